"""GPU smoke of tensorwire._native's CUDA (src/cuda.rs) and tensorwire/_cuda_ops.py on their
own, before the package's ops run over them: no libtorch extension, no package __init__.

Usage on a GPU machine (python3 with torch; no Rust needed there):

    PKG=$(mktemp -d); mkdir $PKG/tensorwire; touch $PKG/tensorwire/__init__.py
    cp python/tensorwire/{errors,_cuda_ops}.py $PKG/tensorwire/
    cp <built lib_native.so> $PKG/tensorwire/_native.abi3.so   # cargo build --release
        # -p tensorwire-python --features extension-module; strip it to carry it
    python3 python/native/tests/gpu_smoke.py $PKG

Prints one line per check and exits non-zero on the first failure.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

PKG = sys.argv[2] if len(sys.argv) > 2 and sys.argv[1] == "--child" else sys.argv[1]
sys.path.insert(0, PKG)
# The Python tests' shared helpers (python/tests/support.py), from this checkout; its
# `import tensorwire` finds $PKG's, which is first on the path.
sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "tests"))

import torch  # noqa: E402
from support import sleep_cycles_for  # noqa: E402

from tensorwire import _cuda_ops as c  # noqa: E402
from tensorwire import _native, errors  # noqa: E402


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")
    print("ok:", what, flush=True)


def until(what, f, timeout=15.0):
    end = time.monotonic() + timeout
    while not f():
        if time.monotonic() > end:
            raise SystemExit(f"FAILED (timed out): {what}")
        time.sleep(0.01)
    print("ok:", what, flush=True)


def recv(conn, timeout_ms=60_000):
    p = _native.cuda_recv(conn, timeout_ms)
    dtype, sizes, strides, offset = p.view
    return c.finish_recv(p, dtype, sizes, strides, offset), p.tag


def child(fd):
    """The consumer: reads the view on its current stream (no synchronize before), adds 1
    in place, reports, drops it and waits for its lease and IPC handle to go."""
    conn = _native.Peer.from_fd(fd)
    opens0 = c.cuda_ipc_cache_stats()[0]
    u, tag = recv(conn)
    lo, hi = u.min().item(), u.max().item()  # on the current stream, after the producer
    print(f"child: tag {tag} shape {tuple(u.shape)} stride {u.stride()} min {lo} max {hi} dev {u.device}", flush=True)
    u.add_(1)
    torch.cuda.current_stream().synchronize()
    opens1, open_now = c.cuda_ipc_cache_stats()
    print(f"child: opens {opens1 - opens0} open {open_now}", flush=True)
    del u
    torch.cuda.current_stream().synchronize()
    until("child: the IPC handle closed after the release (keep_warm 0)", lambda: c.cuda_ipc_cache_stats()[1] == 0)
    sys.stdin.readline()  # the parent checked its lease; exit


def two_processes():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fa, fb = a.detach(), b.detach()
    os.set_inheritable(fb, True)
    proc = subprocess.Popen([sys.executable, __file__, "--child", PKG, str(fb)], pass_fds=[fb],
                            stdin=subprocess.PIPE, text=True)
    os.close(fb)
    conn = _native.Peer.from_fd(fa)
    try:
        cycles = sleep_cycles_for(200)
        values = torch.arange(64 * 1024, dtype=torch.float32, device="cuda").reshape(64, 1024)
        t = torch.zeros(64, 1024, device="cuda")
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)  # busy ~200 ms ...
        t.copy_(values)            # ... then the values, queued before the send
        check(c.send(conn, t[1:, ::2], 5, 0) is True, "send of a CUDA view is zero-copy")
        check(not torch.cuda.current_stream().query(), "send returned while the stream was busy (no synchronize)")
        until("the consumer's lease came back", lambda: conn.stats()["live_leases"] == 0, timeout=60)
        torch.cuda.synchronize()
        want = values.clone()
        want[1:, ::2] += 1
        check(torch.equal(t, want), "the consumer read the values and its add_ landed in our memory")
        proc.stdin.write("\n")
        proc.stdin.flush()
        check(proc.wait(timeout=60) == 0, "child exited 0")
    finally:
        if proc.poll() is None:
            proc.kill()


def one_process():
    a, b = _native.Peer.pair()
    x, y = _native.Peer.pair()
    t = torch.arange(12, dtype=torch.float64, device="cuda").reshape(3, 4)
    check(c.send(a, t.t(), 1, 0) is True, "send (same process)")
    u, tag = recv(b)
    check(tag == 1 and u.shape == (4, 3) and u.stride() == (1, 4), f"view arrived: {tuple(u.shape)} {u.stride()}")
    check(u.data_ptr() == t.data_ptr() and torch.equal(u, t.t()), "same process: the exporter's own memory")
    opens = c.cuda_ipc_cache_stats()[0]
    check(c.send(x, u[1:], 2, 0) is True, "forward of a received tensor")
    v, _ = recv(y)
    check(torch.equal(v, t.t()[1:]) and c.cuda_ipc_cache_stats()[0] == opens, "forwarded as the same memory")
    del u
    time.sleep(0.05)
    check(a.stats()["live_leases"] == 1, "the forward holds the upstream lease")
    del v
    until("all leases back", lambda: a.stats()["live_leases"] == 0 and x.stats()["live_leases"] == 0)
    # A conjugate view is resolved (a copy); an empty tensor goes as a 1-element holder.
    z = torch.tensor([1 + 2j, 3 - 4j], device="cuda").conj()
    check(c.send(a, z, 3, 0) is False, "a conjugate view is sent as a resolved copy")
    w, _ = recv(b)
    check(torch.equal(w, z.resolve_conj()), "its values")
    e = torch.empty(0, 5, device="cuda")
    check(c.send(a, e, 4, 0) is False, "an empty tensor is sent (not zero-copy)")
    f, _ = recv(b)
    check(f.shape == (0, 5) and f.is_cuda, "it arrives empty, on CUDA")
    del w, f
    until("their leases back", lambda: a.stats()["live_leases"] == 0)
    try:
        c.send(a, torch.zeros(2, device="cuda"), -1, 0)
        check(False, "negative tag refused")
    except RuntimeError as err:
        check("tag must be >= 0" in str(err), f"negative tag refused: {err}")


def info():
    check(c.cuda_built() is True and c.cuda_available() is True, "cuda_built, cuda_available")
    check(c.cuda_device_count() == torch.cuda.device_count(), "cuda_device_count matches torch")
    c.cuda_ipc_cache_keep_warm(0)
    try:
        c.cuda_ipc_cache_keep_warm(-1)
        check(False, "keep_warm(-1) refused")
    except errors.Refused as err:
        check("n must be >= 0, got -1" in str(err), "keep_warm(-1) refused")


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(int(sys.argv[3]))
    else:
        info()
        one_process()
        two_processes()
        print("ALL OK")
