"""Three Python processes: a tensor received by a relay and sent on (`conn.send(u)` with
`u` from `recv`) goes as the same memory — no copy at either hop — and the first
process's lease lives exactly as long as the last process holds the forward."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tensorwire
from support import wait_stats

PEER = str(Path(__file__).with_name("forward_peer.py"))
STOP = 999_999


class Chain:
    """The test (host) -> relay -> last; the host also talks to the last directly."""

    def __init__(self):
        h_r, r_h = tensorwire.socketpair()
        h_l, l_h = tensorwire.socketpair()
        r_l, l_r = tensorwire.socketpair()
        self.relay = subprocess.Popen([sys.executable, PEER, "relay", str(r_h), str(r_l)], pass_fds=[r_h, r_l])
        self.last = subprocess.Popen([sys.executable, PEER, "last", str(l_h), str(l_r)], pass_fds=[l_h, l_r])
        for fd in (r_h, r_l, l_h, l_r):
            os.close(fd)
        self.to_relay = tensorwire.from_fd(h_r)
        self.to_last = tensorwire.from_fd(h_l)

    def ask_last(self, cmd):
        self.to_last.send(torch.tensor([cmd]))
        return self.to_last.recv(timeout=60).tolist()

    def close(self):
        for p in (self.relay, self.last):
            if p.poll() is None:
                p.kill()
                p.wait()
        self.to_relay.close()
        self.to_last.close()


@pytest.fixture
def chain():
    c = Chain()
    yield c
    c.close()


def forward(chain):
    x = tensorwire.zeros(4, 8, dtype=torch.int32)
    assert chain.to_relay.send(x, 5) is True
    assert chain.to_relay.recv(timeout=60).tolist() == [1, 1], "relay: is_shared(received) and zero-copy forward"
    assert chain.to_last.recv(timeout=60).tolist() == [3, 8, 1], "last: the view without row 0, shared"
    return x


def test_forward_is_zero_copy_and_the_lease_chain_ends_with_the_last(chain):
    x = forward(chain)
    assert x[1, 0].item() == 42, "the last's write is not seen by the first process (copied on a hop)"
    x[1, 1] = 7
    assert chain.ask_last(0) == [7], "the first process's write is not seen by the last"
    time.sleep(0.05)
    assert chain.to_relay.stats()["live_leases"] == 1, "the lease ended while the last holds the forward"
    assert chain.ask_last(1) == [1]
    s = wait_stats(chain.to_relay, lambda s: s["live_leases"] == 0)
    assert (s["live_leases"], s["released"], s["reclaimed"]) == (0, 1, 0)
    chain.to_relay.send(tensorwire.zeros(1), STOP)
    chain.to_last.send(torch.tensor([STOP]))
    assert chain.relay.wait(timeout=60) == 0
    assert chain.last.wait(timeout=60) == 0


def test_last_killed_releases_the_relays_import(chain):
    forward(chain)
    chain.last.kill()
    chain.last.wait()
    s = wait_stats(chain.to_relay, lambda s: s["live_leases"] == 0)
    assert (s["live_leases"], s["released"], s["reclaimed"]) == (0, 1, 0)
    chain.to_relay.send(tensorwire.zeros(1), STOP)
    assert chain.relay.wait(timeout=60) == 0


def test_relay_killed_ends_the_hosts_lease_and_the_last_keeps_its_mapping(chain):
    x = forward(chain)
    chain.relay.kill()
    chain.relay.wait()
    s = wait_stats(chain.to_relay, lambda s: s["live_leases"] == 0)
    assert (s["live_leases"], s["released"], s["reclaimed"]) == (0, 0, 1)
    # The last still maps the same pages (memfd pages live while mapped).
    x[1, 1] = 9
    assert chain.ask_last(0) == [9]
    del x
    assert chain.ask_last(0) == [9]
    chain.to_last.send(torch.tensor([STOP]))
    assert chain.last.wait(timeout=60) == 0
