"""What the Python tests share (python/tests, tests/gpu/gpu_tests.py and
python/native/tests/gpu_smoke.py): the views every round trip sends, a connected pair in
one process, ordinary tensors of every dtype and their private echo, bounded waits (on a condition, on a connection's lease counters), whether a
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


def bytes_of(t) -> list:
    """A tensor's bytes, element order, as a list of ints: equal lists mean bit-exact."""
    import torch
    return t.contiguous().reshape(-1).view(torch.uint8).tolist()


def every_dtype_with_views(rows: int, cols: int, seed: int, slice_stop: int, max_bytes=None) -> list:
    """A seeded `rows` x `cols` tensor in every dtype tensorwire carries, each with its
    views: transposed, stepped, 0-d, empty and the flat slice [5:`slice_stop`]. With `max_bytes`, a dtype
    whose tensor is larger keeps a quarter of its rows."""
    import torch
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, cols, generator=g)
    out = []
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
                  torch.complex128, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
                  torch.bool, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn):
        if dtype.is_complex:
            t = torch.complex(base, -base).to(dtype)
        elif dtype == torch.bool:
            t = base > 0
        elif dtype.is_floating_point:
            t = (base * 100).to(dtype)
        else:
            t = (base * 100).to(torch.int64).to(dtype)
        if max_bytes is not None and t.numel() * t.element_size() > max_bytes:
            t = t[: max(1, t.shape[0] // 4)]
        out += [t, t.t(), t[1::2, ::3], t[2, 3], t[:0], t.reshape(-1)[5:slice_stop]]
    return out


def echo_each_privately(worker, tensors, also=None) -> None:
    """Echo each of `tensors` through `worker` (an RPC worker serving `echo` and
    `storage_kind`): each comes back with its dtype, shape and bytes, as private memory on
    both sides (neither a segment of ours nor an import), and none took a segment of the
    pool. `also(t)` runs more checks per tensor; without it, the binding also counted each
    tensor's two private copies (sent and received) as owned."""
    from tensorwire import _native
    worker.call("echo", tensors[0])
    before = _native.pool_stats()
    for t in tensors:
        back = worker.call("echo", t)
        assert back.dtype == t.dtype and back.shape == t.shape, (t.dtype, t.shape)
        assert bytes_of(back) == bytes_of(t), (t.dtype, t.shape, t.stride())
        s = back.untyped_storage()
        assert _native.storage_kind(s.data_ptr(), s.nbytes()) is None, (t.dtype, t.shape)
        assert worker.call("storage_kind", t) is None, (t.dtype, t.shape)
        if also is not None:
            also(t)
    after = _native.pool_stats()
    assert {k: after[k] - before[k] for k in ("created", "reused", "unpooled", "copies")} == \
        {"created": 0, "reused": 0, "unpooled": 0, "copies": 0}, "a small tensor went into a segment"
    if also is None:
        assert after["owned"] - before["owned"] == 2 * len(tensors)


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
