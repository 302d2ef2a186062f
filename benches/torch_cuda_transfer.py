#!/usr/bin/env python3
"""Per-message cost of sharing a CUDA tensor between two Python processes, same run (GPU
machine only; scripts/gpu_test.sh runs it):

  tw cached        tensorwire send (IPC export + event on the current stream), recv in
                   the child (handle from the process's cache, kept warm with
                   keep_warm(16); the default is 0), stream wait; the child drops it,
                   synchronizes its stream and runs a reap pass (stats()), so the lease is
                   released before it acks
  tw open/msg      the same with the child's handle cache at keep_warm(0): every message
                   opens (cuIpcOpenMemHandle) and its release closes its handle
  torch.mp         torch.multiprocessing Queue of the same CUDA tensor, ack over a Queue
  GPU ring         tensorwire ring_send of the tensor through the connection's GPU bounce
                   ring (DtoD copy into the arena + IPC event), cuda_ring_recv in the child
                   (stream wait + DtoD copy out into a fresh tensor), the child synchronizes
                   its stream (the copy is complete) and acks

Each number is a full round trip (tensor to the child, ack back), median and p90 in
microseconds, at 4 KiB and 32 MiB. Targets (docs/DESIGN.md), each printed as PASS or FAIL:
GPU ring 32 MiB / 4 KiB <= 3; per-message-open / GPU ring >= 20 at 4 KiB and at 32 MiB
(also reported: per-message-open / cached). The last line says
"BENCH TARGETS: PASS" or "BENCH TARGETS: FAIL (<which>)"; either way the exit status is 0
(a missed target is a measurement). The exit status is 1 if the measurement itself is
invalid: the child's cuIpcOpenMemHandle count per row (printed) must show the open/msg
row opening a handle for every message and the cached row at most a few, and every
lease must be released after each row. Usage:

  PYTHONPATH=python python3 benches/torch_cuda_transfer.py [--iters N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

import torch  # noqa: E402
import torch.multiprocessing as tmp  # noqa: E402

import tensorwire  # noqa: E402

SIZES = [4 << 10, 32 << 20]
STOP = 1 << 40
KEEP_WARM = (1 << 40) + 1
RING = (1 << 40) + 2    # payload n: the next n messages come through the GPU ring
REPORT = (1 << 40) + 3  # reply with the child's IPC cache stats [opens, open_handles]
WARMUP = 5
WARM_KEEP = 16          # keep_warm of the "tw cached" row (the library's default is 0)
WARM_MAX_OPENS = 2      # opens a cached row may need per size (one per allocation)
RING_TARGET = 3.0       # GPU ring 32 MiB / 4 KiB <= this
OPEN_TARGET = 20.0      # per-message open / GPU ring >= this, at each size


def human(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def tw_child(fd):
    conn = tensorwire.from_fd(fd, handshake_timeout_ms=120_000)
    ack = tensorwire.zeros(1)
    while True:
        t, tag = conn.recv_tagged()
        if tag == KEEP_WARM:
            tensorwire.cuda_ipc_cache_keep_warm(int(t.item()))
        if tag == REPORT:
            del t
            s = tensorwire.cuda_ipc_cache_stats()
            conn.send(tensorwire.to_shared(torch.tensor([s["opens"], s["open_handles"]])), tag)
            continue
        if tag == RING:
            for _ in range(int(t.item())):
                u, utag = conn.cuda_ring_recv_tagged()
                torch.cuda.current_stream().synchronize()  # the copy out has completed
                del u
                conn.send(ack, utag)
            continue
        cuda = t.is_cuda
        del t  # CUDA: the deleter records an event; the lease is released once it completes
        if tag == STOP:
            break
        if cuda:
            # Release now, before the ack: the event completes with the synchronize, and
            # stats() runs a reap pass that releases the lease and, at keep_warm(0), closes
            # the handle, so the next message really opens it again.
            torch.cuda.current_stream().synchronize()
            conn.stats()
        conn.send(ack, tag)
    s = tensorwire.cuda_ipc_cache_stats()
    conn.close()
    print(f"  (child: {s['opens']} cuIpcOpenMemHandle calls in all)", flush=True)


def mp_child(q, acks):
    torch.cuda.init()
    while True:
        t = q.get()
        if t is None:
            break
        del t
        acks.put(1)


def timed(n, fn):
    out = []
    for i in range(WARMUP + n):
        t0 = time.perf_counter()
        fn(i)
        dt = time.perf_counter() - t0
        if i >= WARMUP:
            out.append(dt)
    return out


def bench_tensorwire(iters):
    parent_fd, child_fd = tensorwire.socketpair()
    child = subprocess.Popen([sys.executable, __file__, "--child-tw", str(child_fd)], pass_fds=[child_fd])
    os.close(child_fd)
    conn = tensorwire.from_fd(parent_fd, handshake_timeout_ms=120_000, cuda_ring_device=0)

    def round_trip(t):
        def go(i):
            conn.send(t, i)
            conn.recv()
        return go

    def child_opens():
        conn.send(tensorwire.to_shared(torch.tensor([0])), REPORT)
        return conn.recv().tolist()[0]

    out, opens, problems = {}, {}, []
    for mode, keep in (("tw cached", WARM_KEEP), ("tw open/msg", 0)):
        conn.send(tensorwire.to_shared(torch.tensor([keep])), KEEP_WARM)
        conn.recv()
        for size in SIZES:
            t = torch.ones(size, dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()
            before = child_opens()
            out[(mode, size)] = timed(iters, round_trip(t))
            opens[(mode, size)] = child_opens() - before
            # The child released every lease before its ack; the release reaches this side
            # at its next reap pass (stats() runs one): poll, bounded.
            deadline = time.monotonic() + 5.0
            while (s := conn.stats())["live_leases"] != 0 and time.monotonic() < deadline:
                time.sleep(0.001)
            if s["live_leases"] != 0:
                problems.append(f"{mode} {human(size)}: {s['live_leases']} lease(s) still live 5 s after "
                                f"the last ack: {s}")
            del t
            torch.cuda.synchronize()
    for size in SIZES:
        t = torch.ones(size, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        # Before RING: from then on the child reads the GPU ring, not the socket, until it
        # has received all WARMUP + iters messages (a REPORT sent later would wait forever).
        before = child_opens()
        conn.send(tensorwire.to_shared(torch.tensor([WARMUP + iters])), RING)

        def ring_go(i, t=t):
            conn.ring_send(t, i)
            conn.recv()

        out[("GPU ring", size)] = timed(iters, ring_go)
        opens[("GPU ring", size)] = child_opens() - before
    conn.send(tensorwire.zeros(1), STOP)
    rc = child.wait(120)
    conn.close()
    if rc != 0:
        problems.append(f"the tensorwire child exited with {rc}")
    return out, opens, problems


def bench_torch_mp(iters):
    ctx = tmp.get_context("spawn")
    q, acks = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=mp_child, args=(q, acks))
    p.start()
    out = {}
    for size in SIZES:
        t = torch.ones(size, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()

        def go(i):
            q.put(t)
            acks.get()

        out[("torch.mp", size)] = timed(iters, go)
    q.put(None)
    p.join(120)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--child-tw", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_tw is not None:
        return tw_child(args.child_tw)
    if not torch.cuda.is_available():
        print("GPU bench SKIPPED: no CUDA device")
        return 2

    res, opens, problems = bench_tensorwire(args.iters)
    res.update(bench_torch_mp(args.iters))
    p50 = {k: statistics.median(v) * 1e6 for k, v in res.items()}
    p90 = {k: statistics.quantiles(v, n=10)[8] * 1e6 for k, v in res.items()}

    print(f"\nCUDA tensor round trip per message (to the child, ack back), microseconds; torch {torch.__version__}, "
          f"{torch.cuda.get_device_name(0)}, {args.iters} iterations")
    hdr = f"{'path':<14} | " + " | ".join(f"{human(s) + ' p50':>12} {'p90':>9}" for s in SIZES) + \
        f" | {human(SIZES[-1])}/{human(SIZES[0])}"
    print(hdr)
    print("-" * len(hdr))
    for mode in ("GPU ring", "tw cached", "tw open/msg", "torch.mp"):
        cells = " | ".join(f"{p50[(mode, s)]:12.1f} {p90[(mode, s)]:9.1f}" for s in SIZES)
        print(f"{mode:<14} | {cells} | {p50[(mode, SIZES[-1])] / p50[(mode, SIZES[0])]:8.2f}")

    # The measurement is valid only if each row did what it names (the child's counts).
    n = WARMUP + args.iters
    print(f"\nchild's cuIpcOpenMemHandle calls per row ({n} messages each, warm-up included):")
    for mode in ("GPU ring", "tw cached", "tw open/msg"):
        print(f"  {mode:<14} " + ", ".join(f"{human(s)}: {opens[(mode, s)]}" for s in SIZES))
    for s in SIZES:
        if opens[("tw open/msg", s)] < n:
            problems.append(f"tw open/msg {human(s)}: {opens[('tw open/msg', s)]} opens for {n} messages, "
                            f"expected >= {n} (a handle opened per message)")
        if opens[("tw cached", s)] > WARM_MAX_OPENS:
            problems.append(f"tw cached {human(s)}: {opens[('tw cached', s)]} opens for {n} messages at "
                            f"keep_warm({WARM_KEEP}), expected <= {WARM_MAX_OPENS}")
        if opens[("GPU ring", s)] != 0:
            problems.append(f"GPU ring {human(s)}: {opens[('GPU ring', s)]} opens, expected 0 (arena opened at setup)")

    # The CUDA targets: a verdict per target, and one line to grep.
    print()
    missed = []

    def verdict(name, value, ok, target):
        print(f"{'PASS' if ok else 'FAIL'} target {name}: {value:.2f} (target {target})")
        if not ok:
            missed.append(f"{name} = {value:.2f}, target {target}")

    r = p50[("GPU ring", SIZES[-1])] / p50[("GPU ring", SIZES[0])]
    verdict(f"GPU ring {human(SIZES[-1])} / {human(SIZES[0])}", r, r <= RING_TARGET, f"<= {RING_TARGET:g}")
    for s in SIZES:
        r = p50[("tw open/msg", s)] / p50[("GPU ring", s)]
        verdict(f"per-message open / GPU ring at {human(s)}", r, r >= OPEN_TARGET, f">= {OPEN_TARGET:g}")
    print()
    for s in SIZES:
        r = p50[("tw open/msg", s)] / p50[("tw cached", s)]
        print(f"per-message open / cached at {human(s)}: {r:.1f}x")
    for s in SIZES:
        r = p50[("torch.mp", s)] / p50[("tw cached", s)]
        print(f"torch.multiprocessing / tensorwire cached at {human(s)}: {r:.1f}x")
    print()
    if problems:
        for p in problems:
            print(f"BENCH CHECK FAILED: {p}")
        print("BENCH TARGETS: INVALID (the measurement failed its checks; see BENCH CHECK FAILED above)")
        return 1
    print("BENCH TARGETS: PASS" if not missed else f"BENCH TARGETS: FAIL ({'; '.join(missed)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
