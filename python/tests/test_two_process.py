"""Two real Python processes sharing tensors through torch.ops.tensorwire."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tensorwire
from support import connected_pair, views_of, wait_stats

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

PEER = str(Path(__file__).with_name("peer.py"))
STOP = 999_999

DTYPES = [
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
    torch.float64, torch.complex32, torch.complex64, torch.complex128, torch.bool, torch.bfloat16,
    torch.float8_e5m2, torch.float8_e4m3fn, torch.float8_e5m2fnuz, torch.float8_e4m3fnuz,
    torch.uint16, torch.uint32, torch.uint64, torch.float8_e8m0fnu,
]


class Child:
    def __init__(self, mode):
        parent_fd, child_fd = tensorwire.socketpair()
        self.proc = subprocess.Popen([sys.executable, PEER, mode, str(child_fd)], pass_fds=[child_fd])
        os.close(child_fd)
        self.conn = tensorwire.from_fd(parent_fd)
        assert self.conn.peer_pid == self.proc.pid

    def finish(self):
        # The child exits once it has taken the last message; close only then, since
        # closing ends the leases of what we sent (a STOP still in flight included).
        rc = self.proc.wait(timeout=60)
        self.conn.close()
        assert rc == 0

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def child(request):
    c = Child(request.param)
    yield c
    c.kill()
    c.conn.close()


def raw(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def random_bytes(shape, dtype):
    t = tensorwire.empty(shape, dtype=dtype)
    u = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    if dtype == torch.bool:
        u.copy_(torch.randint(0, 2, u.shape, dtype=torch.uint8))
    else:
        u.copy_(torch.randint(0, 256, u.shape, dtype=torch.uint8))
    return t


def exchange(c, t, tag):
    """Send `t`, let the echo child flip bit 0 of element 0, get its view of `t` back."""
    storage = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    off = t.storage_offset() * t.element_size()
    before = int(storage[off])
    # What the child will see after its flip (an expanded view sees it several times).
    flipped = storage.clone()
    flipped[off] ^= 1
    expected = raw(torch.empty(0, dtype=t.dtype).set_(flipped.untyped_storage(), t.storage_offset(), t.shape, t.stride()))
    assert c.conn.send(t, tag) is True  # zero-copy: t lives in a segment
    meta, mtag = c.conn.recv_tagged(timeout=60)
    copy, ctag = c.conn.recv_tagged(timeout=60)
    assert mtag == ctag == tag
    return meta.tolist(), copy, expected, before, int(storage[off])


@pytest.mark.parametrize("child", ["echo"], indirect=True)
def test_every_dtype_and_view_zero_copy(child):
    tag = 0
    for dtype in DTYPES:
        base = random_bytes((6, 8), dtype)
        for name, t in views_of(base, empty=False).items():
            tag += 1
            meta, copy, expected, before, after = exchange(child, t, tag)
            what = f"{dtype} {name}"
            itemsize, offset, nbytes, *rest = meta
            assert itemsize == t.element_size(), what
            assert offset == t.storage_offset(), what
            assert nbytes == t.untyped_storage().nbytes(), what
            assert rest == [*t.shape, *t.stride()], what
            assert torch.equal(copy, expected), what   # the child saw our bytes (and its flip)
            assert after == before ^ 1, what           # we see the child's write: same memory
            # The child dropped its tensor before replying: our lease is back.
            s = wait_stats(child.conn, lambda s: s["live_leases"] == 0)
            assert s["live_leases"] == 0 and s["live_bytes"] == 0, (what, s)
    s = child.conn.stats()
    assert s["granted"] == s["released"] == tag
    child.conn.send(tensorwire.zeros(1), STOP)
    child.finish()


@pytest.mark.parametrize("child", ["echo"], indirect=True)
def test_plain_tensors_are_copied_once(child):
    for t in [torch.arange(24, dtype=torch.float32).view(4, 6).t(), torch.randn(3, 4, dtype=torch.complex64).conj(),
              torch.zeros(0, 3), torch.tensor(7.5, dtype=torch.float64)]:
        expected = raw(t.resolve_conj()).clone()
        assert child.conn.send(t, 1) is False
        meta = child.conn.recv(timeout=60).tolist()
        copy = child.conn.recv(timeout=60)
        if t.numel():
            expected[0] ^= 1  # the flip happened in the copy, not in `t`
        assert torch.equal(copy, expected)
        assert meta[3:3 + t.dim()] == list(t.shape)
        if t.numel():  # the child's flip went to the copy, not to `t`
            flipped_back = expected.clone()
            flipped_back[0] ^= 1
            assert torch.equal(raw(t.resolve_conj()), flipped_back)
    # A conjugate view of a shared tensor would lose its conj bit: it is copied too.
    s = tensorwire.zeros(2, dtype=torch.complex64)
    assert tensorwire.is_shared(s) and not tensorwire.is_shared(s.conj())
    assert wait_stats(child.conn, lambda s: s["live_leases"] == 0)["live_leases"] == 0
    child.conn.send(tensorwire.zeros(1), STOP)
    child.finish()


@pytest.mark.parametrize("child", ["views"], indirect=True)
def test_lease_released_when_last_view_dies(child):
    t = tensorwire.zeros(4, 3)
    use = torch._C._storage_Use_Count(t.untyped_storage()._cdata)
    child.conn.send(t)
    assert torch._C._storage_Use_Count(t.untyped_storage()._cdata) == use + 1  # the lease's owner
    child.conn.recv(timeout=60)  # child dropped the base, keeps a view
    assert wait_stats(child.conn, lambda s: False, timeout=0.2)["live_leases"] == 1
    assert torch._C._storage_Use_Count(t.untyped_storage()._cdata) == use + 1
    child.conn.send(tensorwire.zeros(1))  # drop it (a second lease, released at once)
    child.conn.recv(timeout=60)
    s = wait_stats(child.conn, lambda s: s["live_leases"] == 0)
    assert s["live_leases"] == 0 and s["released"] == s["granted"] == 2, s
    assert torch._C._storage_Use_Count(t.untyped_storage()._cdata) == use  # owner dropped
    child.conn.send(tensorwire.zeros(1))
    child.finish()


@pytest.mark.parametrize("child", ["hold"], indirect=True)
def test_sigkill_reclaims_leases(child):
    n = 50
    tensors = [tensorwire.zeros(16, 16) for _ in range(n)]
    uses = [torch._C._storage_Use_Count(t.untyped_storage()._cdata) for t in tensors]
    child.conn.send(tensorwire.to_shared(torch.tensor(n)))
    for i, t in enumerate(tensors):
        assert child.conn.send(t[i % 16:], i)
    assert child.conn.recv(timeout=60).item() == n
    s = child.conn.stats()
    assert s["live_leases"] == n and s["live_bytes"] == n * 16 * 16 * 4, s
    os.kill(child.proc.pid, signal.SIGKILL)
    child.proc.wait()
    s = wait_stats(child.conn, lambda s: s["live_leases"] == 0)
    assert s["live_leases"] == 0 and s["live_bytes"] == 0 and s["reclaimed"] == n, s
    assert [torch._C._storage_Use_Count(t.untyped_storage()._cdata) for t in tensors] == uses
    with pytest.raises(RuntimeError, match="TW_ERR_PEER_GONE"):
        child.conn.send(tensors[0])


def test_share_moves_the_storage_in_place():
    """share_ moves a plain tensor's storage into a segment in place (every view follows,
    like Tensor.share_memory_()); sending it is then zero-copy; resizing is refused."""
    base = torch.arange(12, dtype=torch.float32)
    view = base.view(3, 4).t()
    assert not tensorwire.is_shared(base)
    if tensorwire.build_info()["backend"] == "native" and not hasattr(base.untyped_storage(), "_swap_data_ptr_"):
        # This torch cannot swap a storage's memory from Python: a clear refusal, nothing moved.
        with pytest.raises(tensorwire.Error, match=r"share_: moving a storage in place needs .*to_shared"):
            tensorwire.share_(view)
        assert not tensorwire.is_shared(base) and torch.equal(base, torch.arange(12, dtype=torch.float32))
        return
    assert tensorwire.share_(base) is base
    assert tensorwire.is_shared(base) and tensorwire.is_shared(view)
    assert torch.equal(view, torch.arange(12, dtype=torch.float32).view(3, 4).t())
    ptr = base.data_ptr()
    tensorwire.share_(view)  # already shared: nothing moves
    assert base.data_ptr() == ptr
    with pytest.raises(RuntimeError):
        base.resize_(1000)
    a, b = connected_pair()
    with a, b:
        assert a.send(view) is True  # zero-copy
        got = b.recv(timeout=5)
        with pytest.raises(tensorwire.Error, match="peer's memory"):
            tensorwire.share_(got)
        got[0, 0] = 100.0
        assert base[0] == 100.0  # the same memory
        del got
