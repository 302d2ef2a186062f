"""What the Python tests share (python/tests, tests/gpu/gpu_tests.py and
python/native/tests/gpu_smoke.py): the views every round trip sends, a connected pair in
one process, bounded waits (on a condition, on a connection's lease counters), whether a
process is gone, and how long a GPU sleep keeps a stream busy."""

import os
import threading
import time

import tensorwire


def views_of(base, empty=True):
    """Views of a 2-D `base` (at least 6 x 9): contiguous, transposed, a strided slice with
    a storage offset, a stride-0 expand, a 0-dim element and (unless `empty` is False, for
    tests that write into each view) an empty view."""
    views = {
        "contiguous": base,
        "transposed": base.t(),
        "slice": base[1::2, 3:],
        "expand": base[2:3, :5].expand(4, 5),
        "scalar": base[1, 2],
    }
    if empty:
        views["empty"] = base[:, 8:]
    return views


def wait_for(what: str, cond, within: float = 10.0) -> None:
    """Poll `cond` until it holds; fail naming `what` after `within` seconds."""
    by = time.monotonic() + within
    while not cond():
        assert time.monotonic() < by, f"timed out waiting for {what}"
        time.sleep(0.01)


def gone(pid: int) -> bool:
    """Whether process `pid` has exited (reaped, or a zombie its parent has not reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:
        return ") Z " in f.read()


def wait_stats(conn, pred, timeout=10.0):
    """Poll `conn.stats()` until `pred` holds or `timeout` seconds pass; the last stats."""
    deadline = time.monotonic() + timeout
    while True:
        s = conn.stats()
        if pred(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.005)


def connected_pair(**limits):
    """Two connected ends in this process: the first opened with `limits`, the second
    with the defaults (a thread handshakes it, as a peer process would)."""
    a, b = tensorwire.socketpair(inheritable_child=False)
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("b", tensorwire.from_fd(b)))
    th.start()
    ca = tensorwire.from_fd(a, **limits)
    th.join()
    return ca, out["b"]


def sleep_cycles_for(ms):
    """GPU clock cycles that torch.cuda._sleep needs to keep the stream busy for `ms`."""
    import torch  # only the GPU scripts call this; the rest of this module needs no torch

    torch.cuda._sleep(1000)  # load the kernel first (lazy module loading would inflate the timing)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 10_000_000
    start.record()
    torch.cuda._sleep(n)
    end.record()
    end.synchronize()
    return int(n * ms / max(start.elapsed_time(end), 1e-3))
