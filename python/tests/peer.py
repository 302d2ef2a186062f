"""The other process of the two-process tests: `python peer.py MODE FD`, FD an inherited
end of tensorwire.socketpair()."""

import os
import sys
import time

import torch

import tensorwire

STOP = 999_999


def raw(t):
    """The view's elements packed, as bytes."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def storage_bytes(t):
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def echo(conn):
    """For each tensor: flip bit 0 of its element 0 through the shared memory (the
    sender must see it: zero-copy), then send back its metadata and a copy of its
    elements, having dropped it (its lease is released before the reply is sent)."""
    while True:
        t, tag = conn.recv_tagged(timeout=60)
        if tag == STOP:
            return
        off = t.storage_offset() * t.element_size()
        if t.numel() > 0:
            s = storage_bytes(t)
            s[off] ^= 1
            del s
        meta = torch.tensor([t.dtype.itemsize, t.storage_offset(), t.untyped_storage().nbytes(), *t.shape, *t.stride()],
                            dtype=torch.int64)
        copy = raw(t).clone()
        del t
        conn.send(meta, tag)
        conn.send(copy, tag)


def hold(conn):
    """Receive N tensors (N = first tensor's value), keep them all, ack, wait for SIGKILL."""
    n = int(conn.recv(timeout=60).item())
    held = [conn.recv(timeout=60) for _ in range(n)]
    conn.send(tensorwire.to_shared(torch.tensor([len(held)])))
    while True:
        time.sleep(60)


def views(conn):
    """Keep only a view of the received tensor, then drop it on request."""
    t = conn.recv(timeout=60)
    v = t[1:].t()
    del t
    conn.send(torch.tensor([1]))
    conn.recv(timeout=60)  # "drop it now"
    v.add_(0)  # still usable
    del v
    conn.send(torch.tensor([2]))
    try:
        conn.recv(timeout=60)  # wait for the parent to finish: its last tensor, or its close
    except RuntimeError as e:
        # The parent may close right after sending; closing ends its in-flight leases.
        if "TW_ERR_PEER_GONE" not in str(e):
            raise


def ring_echo(conn):
    """For each ring tensor: reply through the ring with its metadata, then the tensor
    itself. Every tensor received is kept until STOP and checked again then (a later
    message must not reuse an earlier one's bytes)."""
    kept = []
    while True:
        t, tag = conn.ring_recv_tagged(timeout=60)
        if tag == STOP:
            break
        s = t.untyped_storage()
        # Packed: contiguous, offset 0, the storage is exactly the elements (no extra copy
        # of a larger buffer), owned by the tensor.
        meta = torch.tensor([t.element_size(), int(t.is_contiguous()), t.storage_offset(), s.nbytes(),
                             int(s.data_ptr() == t.data_ptr()), *t.shape, *t.stride()], dtype=torch.int64)
        conn.ring_send(meta, tag, timeout=60)
        conn.ring_send(t, tag, timeout=60)
        kept.append((t, raw(t).clone()))
    ok = all(torch.equal(raw(t), copy) for t, copy in kept)
    conn.ring_send(torch.tensor([int(ok), len(kept)]), STOP, timeout=60)


def cuda_echo(conn):
    """For each CUDA tensor: add 1 in place (on the current stream, which waited for the
    sender's writes), synchronize, reply with a CPU copy. STOP ends it."""
    while True:
        t, tag = conn.recv_tagged(timeout=60)
        if tag == STOP:
            return
        assert t.is_cuda, t.device
        t.add_(1)
        torch.cuda.current_stream().synchronize()
        conn.send(t.cpu(), tag)
        del t


def main():
    mode, fd = sys.argv[1], int(sys.argv[2])
    conn = tensorwire.from_fd(fd, ring_bytes=int(os.environ.get("TW_TEST_RING_BYTES", "0")))
    assert conn.peer_pid == os.getppid(), (conn.peer_pid, os.getppid())
    {"echo": echo, "hold": hold, "views": views, "ring_echo": ring_echo, "cuda_echo": cuda_echo}[mode](conn)
    conn.close()


if __name__ == "__main__":
    main()
