"""Per-transfer latency of a shared CPU tensor between two Python processes, same run:

  tensorwire   torch.ops.tensorwire send/recv of a tensor that lives in a segment
               (zero-copy export under a lease; the receiver drops it, releasing the lease)
  tw ring      torch.ops.tensorwire ring_send/ring_recv of a plain tensor: copied into
               the connection's ring and out into the receiver's own tensor; the ack
               comes back through the other ring (4 KiB and 1 MiB only)
  torch.mp     torch.multiprocessing Queue, file_descriptor strategy, pre-shared tensor
  pickle+pipe  the tensor's bytes pickled through a multiprocessing pipe (copied)

Each transfer is a round trip: the tensor goes to the child, the child drops it and
answers with a tiny ack over the same mechanism; the parent times send -> ack. Sizes
4 KiB, 1 MiB, 64 MiB, 1 GiB. Prints a table (median and p90, microseconds) and, where
matplotlib is installed, writes a PNG plot; a progress bar on stderr while it runs. Usage:

  python -m tensorwire bench [--iters N] [--png PATH | --no-plot] [--max-size BYTES]
  (benches/torch_transfer.py in a checkout calls this)
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pickle
import statistics
import subprocess
import sys
import time
from pathlib import Path

from typing import Callable, Optional

import torch
import torch.multiprocessing as tmp

import tensorwire

SIZES = [4 << 10, 1 << 20, 64 << 20, 1 << 30]
RING_SIZES = [4 << 10, 1 << 20]
STOP = 1 << 40
WARMUP = 3


class Progress:
    """A one-line progress bar on stderr (only where stderr is a terminal, else a line
    per bench), counting round trips against the total planned."""

    def __init__(self, total: int, stream=None) -> None:
        self.total, self.done, self.label = max(total, 1), 0, ""
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.last = 0.0

    def start(self, label: str) -> None:
        self.label = label
        if not self.tty:
            print(f"bench: {label} ...", file=self.stream, flush=True)
        self.draw(force=True)

    def step(self, n: int = 1) -> None:
        self.done += n
        self.draw()

    def draw(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.tty or (not force and now - self.last < 0.1 and self.done < self.total):
            return
        self.last = now
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * 30)
        print(f"\r[{bar:<30}] {frac * 100:5.1f}%  {self.label:<28}", end="", file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty:
            print("\r" + " " * 72 + "\r", end="", file=self.stream, flush=True)


_progress: Optional[Progress] = None


def _tick() -> None:
    if _progress is not None:
        _progress.step()


def human(n):
    for unit, s in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= s:
            return f"{n // s} {unit}"
    return f"{n} B"


# --- children ------------------------------------------------------------------------

def tw_child(fd):
    conn = tensorwire.from_fd(fd)
    ack = tensorwire.zeros(1)
    while True:
        t, tag = conn.recv_tagged()
        del t  # releases the lease
        if tag == STOP:
            break
        conn.send(ack, tag)
    conn.close()


def ring_child(fd):
    conn = tensorwire.from_fd(fd)
    ack = torch.zeros(1)
    while True:
        t, tag = conn.ring_recv_tagged()
        del t
        if tag == STOP:
            break
        conn.ring_send(ack, tag)
    conn.close()


def mp_child(q, acks, cuda=False):
    """The torch.multiprocessing consumer (this bench's and, with `cuda`,
    benches/torch_cuda_transfer.py's): drops each tensor it takes from `q` and acks it,
    until None. A CPU child takes tensors by fd as the parent sends them; a CUDA child
    makes its context first, so that the first timed message does not pay for it."""
    if cuda:
        torch.cuda.init()
    else:
        tmp.set_sharing_strategy("file_descriptor")
    while True:
        t = q.get()
        if t is None:
            break
        del t
        acks.put(1)


def pickle_child(r, w):
    while True:
        msg = r.recv_bytes()
        shape, raw = pickle.loads(msg)
        if shape is None:
            break
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(shape)
        del t, raw, msg
        w.send_bytes(b"k")


# --- parent --------------------------------------------------------------------------

def timed(base_iters, round_trip, warmup=WARMUP):
    """Seconds of each of `base_iters` calls of `round_trip(i)`, after `warmup` untimed
    ones (every row times its round trips the same way: one call each; also
    benches/torch_cuda_transfer.py's rows)."""
    times = []
    for i in range(warmup + base_iters):
        t0 = time.perf_counter()
        round_trip(i)
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
            _tick()
    return times


def warm_up(round_trip, seconds=1.0):
    """Run round trips for a while before measuring: two fresh processes often start on
    one core (the scheduler places a wakee next to its waker) until load balancing
    separates them, which would otherwise inflate whichever size is measured first."""
    end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < end:
        round_trip(i)
        i += 1


def iters_for(size, base, copying):
    if not copying:
        return base
    return max(2, min(base, int(base * (1 << 20) / size))) if size > (1 << 20) else base


def start_child(role):
    """This module run again as the child `role` (``--child-tw``, ``--child-ring``), and
    the connection to it."""
    parent_fd, child_fd = tensorwire.socketpair()
    child = subprocess.Popen([sys.executable, "-m", "tensorwire.bench", role, str(child_fd)], pass_fds=[child_fd])
    os.close(child_fd)
    return child, tensorwire.from_fd(parent_fd)


def bench_tensorwire(sizes, base_iters):
    child, conn = start_child("--child-tw")
    small = tensorwire.zeros(1024, dtype=torch.uint8)
    warm_up(lambda i: (conn.send(small, i), conn.recv()))
    del small
    out = {}
    for size in sizes:
        t = tensorwire.empty(size, dtype=torch.uint8)
        t.fill_(1)  # touch every page
        out[size] = timed(base_iters, lambda i: (conn.send(t, i), conn.recv()))
        s = conn.stats()
        assert s["live_leases"] <= 1, s
        del t
    conn.send(tensorwire.zeros(1), STOP)
    conn.close()
    child.wait(60)
    return out


def bench_ring(sizes, base_iters):
    child, conn = start_child("--child-ring")
    small = torch.ones(1024, dtype=torch.uint8)
    warm_up(lambda i: (conn.ring_send(small, i), conn.ring_recv()))
    out = {}
    for size in sizes:
        t = torch.ones(size, dtype=torch.uint8)
        out[size] = timed(base_iters, lambda i: (conn.ring_send(t, i), conn.ring_recv()))
    conn.ring_send(torch.zeros(1), STOP)
    child.wait(60)
    conn.close()
    return out


def bench_torch_mp(sizes, base_iters):
    tmp.set_sharing_strategy("file_descriptor")
    ctx = tmp.get_context("spawn")
    q, acks = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=mp_child, args=(q, acks))
    p.start()
    small = torch.ones(1024, dtype=torch.uint8).share_memory_()
    def round_trip(t: torch.Tensor) -> None:
        q.put(t)
        acks.get()

    warm_up(lambda i: round_trip(small))
    del small
    out = {}
    for size in sizes:
        t = torch.ones(size, dtype=torch.uint8).share_memory_()
        out[size] = timed(base_iters, lambda i: round_trip(t))
        del t
    q.put(None)
    p.join(60)
    return out


def bench_pickle(sizes, base_iters):
    ctx = multiprocessing.get_context("spawn")
    r1, w1 = ctx.Pipe(duplex=False)
    r2, w2 = ctx.Pipe(duplex=False)
    p = ctx.Process(target=pickle_child, args=(r1, w2))
    p.start()
    out = {}
    for size in sizes:
        t = torch.ones(size, dtype=torch.uint8)
        n = iters_for(size, base_iters, copying=True)
        times = []
        for i in range(min(WARMUP, 1 if size > (64 << 20) else WARMUP) + n):
            t0 = time.perf_counter()
            w1.send_bytes(pickle.dumps((tuple(t.shape), t.numpy().tobytes()), protocol=pickle.HIGHEST_PROTOCOL))
            r2.recv_bytes()
            dt = time.perf_counter() - t0
            times.append(dt)
            _tick()
        out[size] = times[-n:]
        del t
    w1.send_bytes(pickle.dumps((None, b"")))
    p.join(60)
    return out


def main(argv: Optional[list[str]] = None, default_png: str = "tensorwire_transfer.png",
         on_results: Optional[Callable[[dict[str, dict[int, float]]], None]] = None) -> int:
    """Run the benchmark (``python -m tensorwire bench``); returns the exit status.
    ``on_results``, if given, is called with the p50 round trips (µs) by method and size
    once the table is printed."""
    global _progress
    ap = argparse.ArgumentParser(prog="python -m tensorwire bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=200, help="round trips per size (pickle: fewer for big sizes)")
    ap.add_argument("--png", default=default_png, help="where to write the plot, if matplotlib is installed "
                    "(default: %(default)s)")
    ap.add_argument("--no-plot", action="store_true", help="print the table only")
    ap.add_argument("--max-size", type=int, default=1 << 30)
    ap.add_argument("--child-tw", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child-ring", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_tw is not None:
        tw_child(args.child_tw)
        return 0
    if args.child_ring is not None:
        ring_child(args.child_ring)
        return 0

    sizes = [s for s in SIZES if s <= args.max_size]
    started = time.perf_counter()
    ring_sizes = [s for s in RING_SIZES if s in sizes]
    total = args.iters * (len(ring_sizes) + 2 * len(sizes)) + sum(iters_for(s, args.iters, True) for s in sizes)
    _progress = Progress(total)
    try:
        _progress.start("tw ring")
        ring = bench_ring(ring_sizes, args.iters)
        results = {}
        for name, fn in (("tensorwire", bench_tensorwire), ("torch.mp", bench_torch_mp), ("pickle+pipe", bench_pickle)):
            _progress.start(name)
            results[name] = fn(sizes, args.iters)
    finally:
        _progress.close()
        _progress = None
    us = lambda xs, q: statistics.quantiles(xs, n=10)[q] * 1e6 if len(xs) >= 2 else xs[0] * 1e6  # noqa: E731
    p50 = {m: {s: statistics.median(r[s]) * 1e6 for s in sizes} for m, r in results.items()}

    print(f"\nround trip per transfer (tensor to the child, ack back), microseconds; torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs")
    hdr = f"{'size':>8} | {'tensorwire p50':>14} {'p90':>8} | {'tw ring p50':>11} {'p90':>8} | " \
          f"{'torch.mp p50':>12} {'p90':>8} | {'pickle+pipe p50':>15} | {'torch.mp/tw':>11} | {'pickle/tw':>10}"
    print(hdr)
    print("-" * len(hdr))
    for s in sizes:
        tw, mp_, pk = (p50[m][s] for m in ("tensorwire", "torch.mp", "pickle+pipe"))
        rg = f"{statistics.median(ring[s]) * 1e6:11.1f} {us(ring[s], 8):8.1f}" if s in ring else f"{'-':>11} {'-':>8}"
        print(f"{human(s):>8} | {tw:14.1f} {us(results['tensorwire'][s], 8):8.1f} | {rg} | {mp_:12.1f} "
              f"{us(results['torch.mp'][s], 8):8.1f} | {pk:15.1f} | {mp_ / tw:10.1f}x | {pk / tw:9.1f}x")
    worst = min(p50["torch.mp"][s] / p50["tensorwire"][s] for s in sizes)
    flat = p50["tensorwire"][sizes[-1]] / p50["tensorwire"][sizes[0]]
    print(f"\ntensorwire vs torch.multiprocessing: >= {worst:.1f}x lower latency at every size")
    print(f"tensorwire {human(sizes[-1])} / {human(sizes[0])} latency ratio: {flat:.2f}")
    print(f"iterations: tensorwire/tw ring/torch.mp {args.iters} per size; pickle+pipe "
          + ", ".join(f"{human(s)}: {len(results['pickle+pipe'][s])}" for s in sizes))
    if on_results is not None:
        on_results(p50)

    if args.no_plot:
        return 0
    try:
        import matplotlib
    except ImportError:
        print("plot: skipped, matplotlib is not installed (pip install matplotlib, or uv pip install matplotlib; "
              "--no-plot says this is intended)")
        return 0
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m, style in (("tensorwire", "o-"), ("torch.mp", "s-"), ("pickle+pipe", "^-")):
        ax.plot(sizes, [p50[m][s] for s in sizes], style, label=m)
    if ring_sizes:
        ax.plot(ring_sizes, [statistics.median(ring[s]) * 1e6 for s in ring_sizes], "d-", label="tw ring (copy)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [human(s) for s in sizes])
    ax.set_xlabel("tensor size")
    ax.set_ylabel("round trip per transfer, p50 (µs)")
    ax.set_title("Shared CPU tensor between two processes")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"plot: {args.png}  ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
