"""The relay and the last process of the forwarding tests:
`python forward_peer.py relay|last HOST_FD LINK_FD`, both fds inherited ends of
tensorwire.socketpair(): HOST_FD to the test, LINK_FD between relay and last."""

import sys

import torch

import tensorwire

STOP = 999_999


def relay(host, down):
    """Forward each tensor without its first row; report [is_shared(received), went zero-copy]."""
    while True:
        u, tag = host.recv_tagged(timeout=60)
        if tag == STOP:
            return
        shared = tensorwire.is_shared(u)
        zero_copy = down.send(u[1:], tag)
        del u  # only the forward's lease holds the import now
        host.send(torch.tensor([int(shared), int(zero_copy)]), tag)


def last(host, up):
    """Take the forwarded tensor, write 42 at its element 0, report; then on each command
    tensor from the host: 0 report element (0, 1), 1 drop the tensor, STOP exit."""
    t = up.recv(timeout=60)
    t[0, 0] = 42
    host.send(torch.tensor([*t.shape, int(tensorwire.is_shared(t))]))
    while True:
        cmd = int(host.recv(timeout=60).item())
        if cmd == STOP:
            return
        if cmd == 0:
            host.send(torch.tensor([int(t[0, 1])]))
        else:
            del t
            host.send(torch.tensor([1]))


if __name__ == "__main__":
    role, host_fd, link_fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    host = tensorwire.from_fd(host_fd)
    link = tensorwire.from_fd(link_fd)
    (relay if role == "relay" else last)(host, link)
    link.close()
    host.close()
