"""Bad input surfaces as RuntimeError carrying tensorwire's message."""

import os
import threading

import pytest
import torch

import tensorwire
from support import connected_pair



def test_connection_errors():
    with pytest.raises(RuntimeError, match=r"TW_ERR_IO.*tw_peer_connect.*No such file or directory"):
        tensorwire.connect("/nonexistent/tensorwire.sock")
    with pytest.raises(RuntimeError, match=r"fd -1 is not a valid descriptor"):
        tensorwire.from_fd(-1)
    r, w = os.pipe()
    os.close(w)
    with pytest.raises(RuntimeError, match=r"tensorwire \(TW_ERR_\w+\): tw_peer_from_fd"):
        tensorwire.from_fd(r)  # not a socket (ownership passed: tensorwire closed it)
    with pytest.raises(RuntimeError, match="max_leases must be in"):
        tensorwire.from_fd(0, max_leases=-1)


def test_recv_timeout_peer_gone_and_closed():
    a, b = connected_pair()
    with pytest.raises(tensorwire.Timeout, match=r"TW_ERR_TIMEOUT.*timed out"):
        b.recv(timeout=0.05)
    a.close()
    with pytest.raises(RuntimeError, match=r"tensorwire.send: connection \d+ is closed or was never opened"):
        a.send(tensorwire.zeros(1))
    with pytest.raises(tensorwire.PeerGone, match=r"TW_ERR_PEER_GONE"):
        b.recv(timeout=5)
    with pytest.raises(RuntimeError, match=r"TW_ERR_PEER_GONE"):
        b.send(tensorwire.zeros(1))
    b.close()


def test_waits_follow_one_convention(tmp_path):
    """timeout: None no limit, 0 do not wait, seconds otherwise (rounded up to whole ms,
    never down to "do not wait"; too long for the clock: no limit); negative is refused."""
    import time

    a, b = connected_pair()
    start = time.monotonic()
    with pytest.raises(tensorwire.Timeout, match=r"timed out at once"):
        b.recv(timeout=0)
    with pytest.raises(tensorwire.Timeout, match=r"timed out at once"):
        b.ring_recv(timeout=0)
    with tensorwire.listen(str(tmp_path / "l.sock")) as listener:
        with pytest.raises(tensorwire.Timeout, match=r"timed out at once.*a connection"):
            listener.accept(timeout=0)
    assert time.monotonic() - start < 2
    with pytest.raises(tensorwire.Timeout, match=r"timed out after 1ms"):
        b.ring_recv(timeout=0.0001)
    with pytest.raises(ValueError, match="non-negative"):
        b.recv(timeout=-1)
    # A huge timeout waits (here for a tensor sent a little later).
    later = threading.Timer(0.05, lambda: a.send(tensorwire.zeros(3)))
    later.start()
    assert b.recv(timeout=1e30).shape == (3,)
    later.join()
    a.close()
    b.close()


def test_quota_exceeded():
    a, b = connected_pair(max_leases=1)  # b may hold at most one of a's leases at once
    t = tensorwire.zeros(4)
    a.send(t)
    with pytest.raises(tensorwire.QuotaExceeded, match=r"TW_ERR_QUOTA_EXCEEDED"):
        a.send(t)
    held = b.recv(timeout=5)
    del held  # lease released: room again
    deadline = 50
    while a.stats()["live_leases"] and deadline:
        deadline -= 1
    assert a.stats()["live_leases"] == 0
    a.send(t)
    a.close()
    b.close()


def test_bad_tensors_and_arguments():
    with pytest.raises(RuntimeError, match="negative dimension -1"):
        tensorwire.empty(2, -1)
    with pytest.raises(RuntimeError, match="at most 16"):
        tensorwire.zeros([1] * 17)
    with pytest.raises(RuntimeError, match="is not supported by tensorwire"):
        tensorwire.empty(4, dtype=torch.quint8)
    with pytest.raises(RuntimeError, match="does not live in a tensorwire segment"):
        tensorwire.ops.segment_fd(torch.zeros(3))
    a, b = connected_pair()
    with pytest.raises(RuntimeError, match="tag must be >= 0"):
        a.send(tensorwire.zeros(1), tag=-1)
    with pytest.raises(RuntimeError, match="17 dimensions; tensorwire carries at most 16"):
        a.send(torch.zeros([1] * 17))
    a.close()
    b.close()


def test_from_torch_fd_errors():
    with pytest.raises(RuntimeError, match="cannot duplicate fd"):
        tensorwire.ops.from_torch_fd(987654, 16, torch.float32, [4], [1])
    s = torch.zeros(4).share_memory_()
    fd, nbytes = s.untyped_storage()._share_fd_cpu_()
    with pytest.raises(RuntimeError, match=r"TW_ERR_INVALID_SEGMENT.*segment too small: 4096 bytes needed, file has 16"):
        tensorwire.ops.from_torch_fd(fd, 4096, torch.float32, [4], [1])
    with pytest.raises(RuntimeError, match="the view needs 32 bytes of storage, the segment provides 16"):
        tensorwire.ops.from_torch_fd(fd, nbytes, torch.float32, [8], [1])


def test_the_view_and_fd_checks_name_the_op():
    """The checks on what the library is handed (a view's dimensions and strides, fds, byte
    counts, a storage's address) give the op's own message whichever layer runs them: the C++ extension's
    TORCH_CHECKs, or `_native` under the Python ops (which do not check again), as the
    base Error without a code."""
    from tensorwire._loader import BACKEND

    ops = tensorwire.ops
    s = torch.zeros(4).share_memory_()
    fd, nbytes = s.untyped_storage()._share_fd_cpu_()
    a, b = connected_pair()
    cases = [
        (lambda: ops.from_torch_fd(-1, 16, torch.float32, [4], [1]),
         "tensorwire.from_torch_fd: fd -1 is not a valid descriptor"),
        (lambda: ops.from_torch_fd(2**31, 16, torch.float32, [4], [1]),
         "tensorwire.from_torch_fd: fd 2147483648 is not a valid descriptor"),
        (lambda: ops.from_torch_fd(fd, 0, torch.float32, [4], [1]),
         "tensorwire.from_torch_fd: nbytes must be > 0, got 0"),
        (lambda: ops.from_torch_fd(fd, nbytes, torch.float32, [4], [1], -1),
         "tensorwire.from_torch_fd: negative storage_offset -1"),
        (lambda: ops.from_torch_fd(fd, nbytes, torch.float32, [2, 2], [1]),
         "tensorwire.tensor_over_segment: 2 sizes but 1 strides"),
        (lambda: ops.from_torch_fd(fd, nbytes, torch.float32, [1] * 17, [1] * 17),
         "tensorwire.tensor_over_segment: 17 dimensions; tensorwire carries at most 16"),
        (lambda: tensorwire.zeros([1] * 17), "tensorwire.empty: 17 dimensions; tensorwire carries at most 16"),
        (lambda: tensorwire.empty(2, -1), r"tensorwire.empty: negative dimension -1 in size \[2, -1\]"),
        # A private tensor: the Python ops pack it (the check is send's), the extension
        # copies it into a new segment first (the check is empty's).
        (lambda: a.send(torch.zeros([1] * 17)), r"tensorwire\.(send|empty): 17 dimensions; tensorwire carries at most 16"),
        (lambda: a.send(tensorwire.zeros(1).view([1] * 17)),
         "tensorwire.send: 17 dimensions; tensorwire carries at most 16"),
        (lambda: a.ring_send(torch.zeros([1] * 17)),
         "tensorwire.ring_send: 17 dimensions; tensorwire carries at most 16"),
        (lambda: ops.segment_fd(torch.zeros(3)), "tensorwire.segment_fd: the tensor does not live in a tensorwire segment"),
    ]
    try:
        for call, want in cases:
            with pytest.raises(RuntimeError, match=want) as e:
                call()
            if BACKEND == "native":
                assert type(e.value) is tensorwire.Error and e.value.code is None, (want, e.value)
        # The caller's fd (here the shared storage's own) stays open: the view maps a
        # duplicate.
        t = ops.from_torch_fd(fd, nbytes, torch.float32, [4], [1])
        del t
        os.fstat(fd)
    finally:
        a.close()
        b.close()


def test_errors_map_to_the_hierarchy():
    """Result codes become the documented classes (all RuntimeErrors); unknown codes and
    failures without a code become the base Error."""
    from tensorwire.errors import translate

    assert issubclass(tensorwire.Error, RuntimeError)
    cases = {
        "TW_ERR_PEER_GONE": tensorwire.PeerGone, "TW_ERR_TIMEOUT": tensorwire.Timeout,
        "TW_ERR_PROTOCOL": tensorwire.Refused, "TW_ERR_INVALID_DESCRIPTOR": tensorwire.Refused,
        "TW_ERR_INVALID_SEGMENT": tensorwire.Refused, "TW_ERR_QUOTA_EXCEEDED": tensorwire.QuotaExceeded,
        "TW_ERR_CUDA_UNAVAILABLE": tensorwire.CudaUnavailable, "TW_ERR_RESOURCE": tensorwire.ResourceExhausted,
        "TW_ERR_IO": tensorwire.Error,
    }
    for code, cls in cases.items():
        e = translate(RuntimeError(f"tensorwire ({code}): tw_x: what went wrong"))
        assert type(e) is cls and e.code == code and "what went wrong" in str(e)
    plain = translate(RuntimeError("tensorwire.send: connection 3 is closed or was never opened"))
    assert type(plain) is tensorwire.Error and plain.code is None


def test_real_failures_raise_the_mapped_classes():
    with pytest.raises(tensorwire.Error) as e:
        tensorwire.connect("/nonexistent/tensorwire.sock")
    assert e.value.code == "TW_ERR_IO"
    a, b = tensorwire.socketpair()
    import os
    os.close(b)
    with pytest.raises(tensorwire.PeerGone):
        tensorwire.from_fd(a, handshake_timeout=2)


_FD_LIMIT_CHILD = r'''
import os, resource, threading
import tensorwire

a, b = tensorwire.socketpair(inheritable_child=False)
out = {}
th = threading.Thread(target=lambda: out.setdefault("b", tensorwire.from_fd(b)))
th.start()
ca = tensorwire.from_fd(a)
th.join()
cb = out["b"]
t = tensorwire.zeros(1024)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
filler = []
try:
    while True:
        filler.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
ca.send(t)
try:
    cb.recv(timeout=5)
    print("NO ERROR")
except tensorwire.ResourceExhausted as e:
    assert isinstance(e, tensorwire.Error) and e.code == "TW_ERR_RESOURCE", e
    for fd in filler:
        os.close(fd)
    ca.send(t)  # the connection goes on once fds are free again
    u = cb.recv(timeout=5)
    print("RESOURCE", str(e).splitlines()[0])
'''


def test_resource_exhausted_at_the_fd_limit():
    # In a child process: the limit must not disturb the test run.
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _FD_LIMIT_CHILD], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("RESOURCE"), r.stdout + r.stderr
    assert "open-file limit" in r.stdout, r.stdout


_WAITING_CHILD = r'''
import os, sys, time
import tensorwire
c = tensorwire.from_fd(int(sys.argv[1]))
print("up", flush=True)
if sys.argv[2] == "exit":
    os._exit(3)
time.sleep(600)
'''


@pytest.mark.parametrize("how", ["kill", "exit"])
def test_a_dead_peer_is_reported_as_killed_or_exited(how):
    import signal
    import subprocess
    import sys

    parent_fd, child_fd = tensorwire.socketpair()
    child = subprocess.Popen([sys.executable, "-c", _WAITING_CHILD, str(child_fd), how], pass_fds=[child_fd],
                             stdout=subprocess.PIPE, text=True)
    os.close(child_fd)
    try:
        with tensorwire.from_fd(parent_fd) as conn:
            assert child.stdout.readline() == "up\n"
            if how == "kill":
                os.kill(child.pid, signal.SIGKILL)
                want = rf"process {child.pid} was killed by SIGKILL \(signal 9\)"
            else:
                want = f"process {child.pid} exited with status 3"
            with pytest.raises(tensorwire.PeerGone, match=want):
                conn.recv(timeout=30)
    finally:
        child.kill()
    # Reading the status left it for its owner to collect.
    assert child.wait(timeout=30) == (-signal.SIGKILL if how == "kill" else 3)


def test_the_tables_come_from_the_library():
    """The exception classes, the ops' options and the binding's option checks read the
    library's tables (``_native.result_codes()``, ``_native.connection_options()``): one
    class per code as the table names it, each option refused past its range with its own
    message as a plain Error."""
    from tensorwire import _native, _ops, errors

    codes = _native.result_codes()
    assert set(errors.CODES) | set(errors.BASE_CODES) == {name for code, name, _k, _c in codes if code}
    for code, name, _kind, cls in codes:
        if code:
            assert errors.CODES.get(name, tensorwire.Error).__name__ == cls, name
    e = _native.library_error("Resource", "tw_x: no fds")
    assert type(e) is tensorwire.ResourceExhausted and e.code == "TW_ERR_RESOURCE"
    assert str(e) == "tensorwire (TW_ERR_RESOURCE): tw_x: no fds"

    opts = _native.connection_options()
    assert _ops.OPTIONS == tuple((o[0], o[4]) for o in opts)
    defaults = [o[4] for o in opts]
    for i, (name, kind, lo, hi, default, doc, _choices) in enumerate(opts):
        assert kind == "int" and lo <= default <= hi and doc, name
        for ok in (lo, hi):
            _native.check_connection_options(defaults[:i] + [ok] + defaults[i + 1:])
        for bad in (lo - 1, hi + 1):
            if not -2**63 <= bad < 2**63:
                continue
            with pytest.raises(tensorwire.Error, match=f"^tensorwire: {name} must .*, got {bad}$") as e:
                _native.check_connection_options(defaults[:i] + [bad] + defaults[i + 1:])
            assert type(e.value) is tensorwire.Error and e.value.code is None
