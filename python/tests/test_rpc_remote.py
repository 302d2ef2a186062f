"""Remote tensors through the package: two Python processes talk tensorwire.rpc over TCP
(Listener / connect), and a CPU tensor travels by UCX get when both ask for remote tensors
— bytes checked on the receiver, both ways — and inline (JSON) when the peer does not
announce UCX. Needs a binding built with the ``ucx`` feature (not the wheel): skipped with
the reason otherwise; the test command's UCX step builds one and runs this file on it."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tensorwire
from tensorwire import rpc

pytestmark = pytest.mark.skipif(
    not tensorwire.build_info().get("ucx_built", False),
    reason="tensorwire._native built without the `ucx` feature (the wheel has none): "
    "remote tensors cannot be tested here",
)

# The peer: a Listener on a free loopback port, serving `t` (make a tensor, check one),
# remote tensors as argv[1] says; prints its address, serves one connection until the
# caller closes it.
PEER = textwrap.dedent(
    """
    import sys, time, torch
    from tensorwire import rpc

    def pattern(seed, n):
        i = torch.arange(n, dtype=torch.int64)
        return ((i * 2654435761) >> 13).to(torch.uint8) ^ seed

    class T:
        def make(self, seed, n):
            return pattern(seed, n)
        def check(self, t, seed):
            want = pattern(seed, t.numel())
            return bool(t.dtype == torch.uint8 and torch.equal(t, want))

    listener = rpc.Listener("tcp://127.0.0.1:0", {"t": T()}, remote_tensors=sys.argv[1] == "1")
    print(listener.address, flush=True)
    ep = listener.accept()
    while not ep.closed:
        time.sleep(0.05)
    """
)

SIZES = [4 << 10, 1 << 20, 16 << 20]


def pattern(seed: int, n: int) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.int64)
    return ((i * 2654435761) >> 13).to(torch.uint8) ^ seed


@pytest.fixture
def peer():
    procs = []

    def start(remote: bool) -> str:
        p = subprocess.Popen([sys.executable, "-c", PEER, "1" if remote else "0"], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "UCX_TLS": os.environ.get("UCX_TLS", "tcp")})
        procs.append(p)
        line = p.stdout.readline().strip()
        assert line.startswith("tcp://"), f"peer said {line!r}"
        return line

    yield start
    for p in procs:
        p.kill()
        p.wait()


def exchange(ep: rpc.Endpoint) -> None:
    for seed, n in enumerate(SIZES, 1):
        got = ep.call("t", "make", seed, n, timeout=60)
        assert got.dtype == torch.uint8 and got.shape == (n,)
        assert torch.equal(got, pattern(seed, n)), f"{n} bytes from the peer differ"
        assert ep.call("t", "check", pattern(seed + 10, n), seed + 10, timeout=60), f"{n} bytes to the peer differ"


def test_cpu_tensors_travel_by_ucx_when_both_ask(peer):
    ep = rpc.connect(peer(True), remote_tensors=True)
    try:
        assert ep.remote, "both sides asked for remote tensors, the connection did not agree"
        exchange(ep)
    finally:
        ep.close()


def test_inline_when_the_peer_does_not_announce_ucx(peer):
    ep = rpc.connect(peer(False), remote_tensors=True)
    try:
        assert not ep.remote, "the peer's listener has remote tensors off"
        # 16 MiB inline is one JSON value per byte, past the default limits: the sizes
        # that fit, to show the fallback carries the same bytes.
        for seed, n in enumerate(SIZES[:1], 1):
            got = ep.call("t", "make", seed, n, timeout=60)
            assert torch.equal(got, pattern(seed, n))
            assert ep.call("t", "check", pattern(seed + 10, n), seed + 10, timeout=60)
    finally:
        ep.close()


def test_a_large_tensor_needs_the_remote_path(peer):
    # The 16 MiB tensor that travelled by UCX above: inline it is refused at the peer's
    # limits (a frame of one JSON value per byte), so the remote test cannot have passed
    # by falling back to inline.
    ep = rpc.connect(peer(False))
    try:
        assert not ep.remote
        with pytest.raises(tensorwire.Error):
            ep.call("t", "make", 1, SIZES[-1], timeout=60)
    finally:
        ep.close()
