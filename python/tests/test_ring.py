"""The ring (bounce buffer) through torch.ops.tensorwire.ring_send / ring_recv, between two
real processes: any CPU view arrives packed with its values, large tensors go in chunks,
timeouts are RuntimeErrors with tensorwire's message."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import tensorwire
from support import views_of
from test_two_process import DTYPES, random_bytes, raw

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

PEER = str(Path(__file__).with_name("peer.py"))
STOP = 999_999


class RingChild:
    def __init__(self, ring_bytes=0):
        parent_fd, child_fd = tensorwire.socketpair()
        env = dict(os.environ, TW_TEST_RING_BYTES=str(ring_bytes))
        self.proc = subprocess.Popen([sys.executable, PEER, "ring_echo", str(child_fd)], pass_fds=[child_fd], env=env)
        os.close(child_fd)
        self.conn = tensorwire.from_fd(parent_fd, ring_bytes=ring_bytes)

    def echo(self, t, tag):
        """Send `t` through the ring; get back what the child saw: its metadata and the tensor."""
        self.conn.ring_send(t, tag, timeout=60)
        meta, mtag = self.conn.ring_recv_tagged(timeout=60)
        back, btag = self.conn.ring_recv_tagged(timeout=60)
        assert mtag == btag == tag
        return meta.tolist(), back

    def finish(self):
        """STOP: the child re-checks every tensor it kept, then exits."""
        self.conn.ring_send(torch.zeros(1), STOP, timeout=60)
        ok, n = self.conn.ring_recv(timeout=60).tolist()
        self.conn.close()
        assert self.proc.wait(timeout=60) == 0
        return bool(ok), n

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()


@pytest.fixture
def child(request):
    c = RingChild(getattr(request, "param", 0))
    yield c
    c.kill()


def check_packed(meta, back, t, what):
    itemsize, contiguous, offset, nbytes, owns_start, *rest = meta
    n = t.dim()
    assert itemsize == t.element_size(), what
    assert contiguous == 1 and offset == 0, what
    assert nbytes == t.numel() * t.element_size(), what  # packed: only the view's elements travel
    assert owns_start == 1 or t.numel() == 0, what
    assert rest[:n] == list(t.shape), what
    assert tuple(rest[n:]) == torch.empty(t.shape).stride(), what  # contiguous strides
    assert back.dtype == t.dtype and back.shape == t.shape and back.is_contiguous(), what
    assert torch.equal(raw(back), raw(t)), what  # the values, bit for bit


def test_every_dtype_and_view_arrives_packed(child):
    tag = 0
    for dtype in DTYPES:
        base = random_bytes((6, 8), dtype)
        for name, t in views_of(base).items():
            tag += 1
            meta, back = child.echo(t, tag)
            check_packed(meta, back, t, f"{dtype} {name}")
    assert child.finish() == (True, tag)


def test_plain_tensors_conj_and_neg_views(child):
    z = torch.randn(5, 3, dtype=torch.complex64)
    cases = {
        "plain strided": torch.arange(60, dtype=torch.int32).view(5, 12)[:, 1::3],
        "conj view": z.conj(),  # the lazy bit is applied: values arrive conjugated
        "neg view": torch._neg_view(torch.randn(4, 4)).t(),
        "3-d permuted": torch.randn(3, 4, 5, dtype=torch.float64).permute(2, 0, 1),
        "flipped copy": torch.randn(7).flip(0),
    }
    for i, (name, t) in enumerate(cases.items()):
        meta, back = child.echo(t, i + 1)
        assert torch.equal(back, t), name
        assert not back.is_conj() and not back.is_neg(), name
        check_packed(meta, back, t.resolve_conj().resolve_neg(), name)
    assert child.finish() == (True, len(cases))


@pytest.mark.parametrize("child", [1 << 16], indirect=True)  # 64 KiB rings both ways
def test_larger_than_the_ring_goes_in_chunks(child):
    tensors = [
        torch.randn(700, 600).t(),                                      # 1.6 MiB, transposed
        torch.randint(-2**62, 2**62, (300, 100, 9), dtype=torch.int64)[:, ::2, 1:8],  # strided, 1.7 MiB
        torch.randn(2 << 20, dtype=torch.float16),                      # 4 MiB, contiguous
    ]
    for i, t in enumerate(tensors):
        meta, back = child.echo(t, i + 1)
        check_packed(meta, back, t, f"tensor {i}")
    assert child.finish() == (True, len(tensors))


def pair(**limits):
    a, b = tensorwire.socketpair(inheritable_child=False)
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("b", tensorwire.from_fd(b, **limits)))
    th.start()
    ca = tensorwire.from_fd(a, **limits)
    th.join()
    return ca, out["b"]


def test_timeouts_and_errors():
    a, b = pair(ring_bytes=4096)
    with pytest.raises(RuntimeError, match=r"tensorwire \(TW_ERR_TIMEOUT\): tw_peer_ring_recv: timed out after 50ms"):
        b.ring_recv(timeout=0.05)
    # Larger than the 4 KiB ring and nobody draining it: the sender gives up.
    with pytest.raises(RuntimeError, match=r"TW_ERR_TIMEOUT.*tw_peer_ring_send_view: timed out.*waiting for space"):
        a.ring_send(torch.zeros(64 << 10, dtype=torch.uint8), timeout=0.05)
    with pytest.raises(RuntimeError, match="tag must be >= 0"):
        b.ring_send(torch.zeros(1), tag=-1)
    with pytest.raises(RuntimeError, match="is not supported by tensorwire"):
        b.ring_send(torch.empty(2, dtype=torch.bits8))
    with pytest.raises(RuntimeError, match="17 dimensions; tensorwire carries at most 16"):
        b.ring_send(torch.zeros([1] * 17))
    with pytest.raises(RuntimeError, match="only strided"):
        b.ring_send(torch.zeros(3, 3).to_sparse())
    r, w = os.pipe()
    with pytest.raises(RuntimeError, match="ring_bytes must be >= 0"):
        tensorwire.from_fd(r, ring_bytes=-1)  # refused before tensorwire takes the fd
    os.close(r)
    os.close(w)
    b.close()
    with pytest.raises(RuntimeError, match=r"tensorwire.ring_send: connection \d+ is closed or was never opened"):
        b.ring_send(torch.zeros(1))
    with pytest.raises(RuntimeError, match=r"tensorwire.ring_recv: connection \d+ is closed or was never opened"):
        b.ring_recv(timeout=0)
    with pytest.raises(RuntimeError, match=r"TW_ERR_PEER_GONE"):
        a.ring_recv(timeout=5)
    a.close()


def test_received_tensor_outlives_connection_and_later_messages():
    a, b = pair()
    first = torch.arange(1000, dtype=torch.float64)
    a.ring_send(first, 1)
    got = b.ring_recv(timeout=5)
    for i in range(20):  # later messages must land elsewhere
        a.ring_send(torch.full((1000,), float(-i), dtype=torch.float64), 2)
        assert b.ring_recv(timeout=5)[0].item() == -i
    a.close()
    b.close()
    got.add_(1)  # owned by the tensor: still writable after both ends closed
    assert torch.equal(got, first + 1)
