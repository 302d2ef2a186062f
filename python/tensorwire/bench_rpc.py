"""Per-call latency of an RPC from a Python host to one Python worker process, same run:

  tensorwire.rpc  rpc.spawn("tensorwire.bench_rpc_common:Target"): the worker the
                  package supervises; tensors made with rpc.empty travel without a copy
  pyisolate       pyisolate 0.10.2's AsyncRPC over its JSONSocketTransport on a Unix
                  socket, with the tensor serializer a share_torch host registers (a CPU
                  tensor's storage goes to /dev/shm once, torch's file_system strategy,
                  and each call sends a reference to it by name)
  ProcessPool     concurrent.futures.ProcessPoolExecutor(1): submit(...).result()
  mp.Pipe         a multiprocessing.Pipe call loop: send (method, args), the child
                  answers; values pickled (tensors through torch's multiprocessing
                  reductions: the storage goes to shared memory once, then its fd)

Every worker is a fresh interpreter started by this process (pyisolate's own host starts
its children with the spawn method too) that imports this module and serves the same
``Target`` object; this process calls it, one call at a time. Payloads: add(1, 2); one
4 KiB tensor; one 64 MiB tensor (tensorwire.rpc: from rpc.empty; the others: a plain
torch tensor); a nested JSON value with 1,000 leaves (100 dicts of 10 keys); one dict of
333 keys, each a 3-element list (999 leaves); a 1 KiB, a
4 KiB and a 64 MiB ``torch.randn`` tensor (ordinary memory for every system) that the
callee returns as it is. Otherwise the callee answers something small (3, the tensor's
length and last element, the list's length). The "Pipe bytes" row times the 1 KiB and
4 KiB randn echoes over the same Pipe with the tensor's bytes pickled each way (no shared
memory).

How a cell is timed: every system's worker is started first (one at a time: each start,
to its first answer, is timed on its own as the first of that system's ``--cold`` cold
starts; the others come after the calls); then every system warms up on every payload
(5 calls, answers checked), and the cells take turns: ``--iters`` calls a cell, made in
turns in which each cell (payload, system) makes at most 30 timed calls in a row, opened
by one untimed call whose answer is checked; the order of the payloads, and of the
systems within a payload, rotates from turn to turn so that none is always first. p50
and p90 in microseconds. Why: the table's goals are ratios between cells of one run
(tensorwire.rpc's JSON calls against the mp.Pipe loop's, its 4 KiB echo against its own
add(1, 2) and against the Pipe bytes row), and a machine's load drifts over the minute a
run takes; measured one cell after another, each cell would see a different load and
the ratios would follow the drift. Taking turns spreads every cell's samples over the
same window of time, and 30 calls in a row keep each system's calls back to back, as a
caller's loop makes them.

Also tensorwire.rpc's warm pool (WorkerPool.get() -> a worker) and its worker start from
a zygote that imported torch (spawn(zygote=True): kill -> the replacement's first
answer), after the calls. Progress on stderr; a table on stdout and, where matplotlib is
installed, a PNG.

Then the same with the CPUs taken: a call that does nothing (``noop()``, answered None) to
a fresh worker of tensorwire.rpc, a torch.multiprocessing Pipe loop and pyisolate, first
on its own, then beside as many busy processes as this machine has CPUs (plain Python
``while True: pass``, started before and killed after), ``--iters`` calls each; p50 and
p90 (one system after another: the busy processes are the load there). A system whose
waits hand the CPU to a busy process (a spin that yields, say) pays a scheduler time
slice there, which the table shows. Usage:

  python -m tensorwire bench rpc [--iters N] [--cold N] [--quick] [--only calls|contention]
                                 [--png PATH | --no-plot]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

import torch

from .bench_rpc_common import (TARGET, PyisolateHost, bar_panel, error_line, fmt_us, p50, p90, pipe_child,
                               pool_call, pyisolate_connect, pyisolate_stop)
from .bench_rpc_contention import CONTENTION_SYSTEMS, PHASES, Contention, bench_contention, plot_contention, \
    report_contention

SYSTEMS = ["tensorwire.rpc", "pyisolate", "ProcessPool", "mp.Pipe", "Pipe bytes"]
PAYLOADS = ["add(1, 2)", "4 KiB tensor", "64 MiB tensor", "JSON 1,000 leaves", "JSON dict 333 keys", "1 KiB randn echo",
            "4 KiB randn echo", "64 MiB randn echo"]
# Payloads the "Pipe bytes" row measures: the tensor's bytes pickled each way (the 64 MiB
# echo takes about a second a call that way: its baseline is mp.Pipe's shared memory).
ECHOES = ["1 KiB randn echo", "4 KiB randn echo"]
WARMUP_CALLS = 5
# Timed calls in a row per cell and turn (fewer where --iters does not divide evenly).
# Each cell's turn opens with one untimed call, so that 1 call in 31 is overhead; 300
# calls a cell are 10 turns, spread over the whole run of the calls; and a turn is long
# enough that a system's calls run back to back, as a caller's loop makes them.
TURN_CALLS = 30


# --- payloads -----------------------------------------------------------------------

def json_payload() -> list:
    """100 dicts of 10 keys: 1,000 leaves (ints, strings, floats)."""
    out = []
    for i in range(100):
        d = {}
        for j in range(10):
            d[f"key{j}"] = (i * 10 + j) if j % 3 == 0 else (f"value {i}.{j}" if j % 3 == 1 else (i + j) / 7)
        out.append(d)
    return out


def dict_payload() -> dict:
    """One dict of 333 keys, each a small list (an int, a float, a string): 999 leaves."""
    return {f"key{i}": [i, i * 0.5, f"s{i}"] for i in range(333)}


# The randn echoes' lengths in float32 elements: 1 KiB, 4 KiB, 64 MiB.
RANDN = {"1 KiB randn echo": 256, "4 KiB randn echo": 1024, "64 MiB randn echo": 16 << 20}


def payload(name: str, make_tensor: Callable[[int], torch.Tensor]) -> tuple[str, tuple, Any]:
    """(method, args, expected answer) of one payload, made for one system: its tensors
    made by ``make_tensor`` (ones, float32), its randn echo an ordinary tensor (memory no
    transport made) that the worker returns as it is."""
    if name in RANDN:
        t = torch.randn(RANDN[name])
        return "echo", (t,), t
    n = {"4 KiB tensor": 1024, "64 MiB tensor": 16 << 20}.get(name)
    if n is not None:
        return "tensor", (make_tensor(n),), [n, 1.0]
    if name == "JSON 1,000 leaves":
        return "json", (json_payload(),), 100
    if name == "JSON dict 333 keys":
        return "json", (dict_payload(),), 333
    assert name == "add(1, 2)", name
    return "add", (1, 2), 3


def plain_tensor(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.float32)


# --- timing ---------------------------------------------------------------------------

class Cells:
    """Seconds per call, by system and payload (or the error that stopped a cell)."""

    def __init__(self, progress) -> None:
        self.times: dict[str, dict[str, list[float]]] = {s: {} for s in SYSTEMS}
        self.errors: dict[str, dict[str, str]] = {s: {} for s in SYSTEMS}
        self.cold: dict[str, list[float]] = {s: [] for s in SYSTEMS}
        self.pool_get: list[float] = []
        self.pool_first: list[float] = []
        self.zygote_start: list[float] = []
        self.zygote_sandboxed_start: list[float] = []
        self.progress = progress

    def fail(self, system: str, what: str, e: BaseException) -> None:
        self.errors[system][what] = error_line(e)


def check(system: str, payload: str, got: Any, want: Any) -> None:
    if isinstance(got, tuple):
        got = list(got)
    if isinstance(want, torch.Tensor):
        if not (isinstance(got, torch.Tensor) and torch.equal(got, want)):
            raise AssertionError(f"{system} {payload}: the worker's answer is not the tensor sent")
        return
    if got != want:
        raise AssertionError(f"{system} {payload}: the worker answered {got!r}, expected {want!r}")


@dataclass
class Worker:
    """A started worker whose calls the table times: ``call(method, *args)`` makes one
    call and returns the answer; ``timed(method, args, n)`` makes ``n`` calls one at a
    time and returns the seconds of each (the answers dropped as they come, as a
    caller's loop drops them)."""

    system: str
    call: Callable[..., Any]
    timed: Callable[[str, tuple, int], list[float]]
    make_tensor: Callable[[int], torch.Tensor]
    payloads: tuple[str, ...] = tuple(PAYLOADS)


def sync_worker(system: str, call: Callable[..., Any], make_tensor: Callable[[int], torch.Tensor],
                payloads: tuple[str, ...] = tuple(PAYLOADS)) -> Worker:
    def timed(method: str, args: tuple, n: int) -> list[float]:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            call(method, *args)
            times.append(time.perf_counter() - t0)
        return times

    return Worker(system, call, timed, make_tensor, payloads)


def rotated(xs: list, k: int) -> list:
    k %= len(xs) or 1
    return xs[k:] + xs[:k]


def measure(workers: list[Worker], cells: Cells, iters: int, warm_s: float) -> None:
    """Every cell, the cells taking turns (see the module's docstring): each worker's
    warm-up on every payload, then turns in which every cell makes at most TURN_CALLS
    timed calls, opened by one untimed call whose answer is checked; the order of the
    payloads, and of the systems within a payload, rotates from turn to turn."""
    for w in workers:
        if "add(1, 2)" not in w.payloads:
            continue  # Pipe bytes: the mp.Pipe worker's, settled as mp.Pipe
        try:
            end = time.perf_counter() + warm_s
            while time.perf_counter() < end:  # lets the scheduler settle the two processes
                w.timed("add", (1, 2), 10)
        except Exception as e:  # noqa: BLE001 - a system that fails stops its own row only
            cells.fail(w.system, "stopped", e)
    cells.progress.start("calls: warm-up")
    ready: dict[tuple[str, str], tuple[Worker, str, tuple, Any]] = {}
    for name in PAYLOADS:
        for w in workers:
            if name not in w.payloads or "stopped" in cells.errors[w.system]:
                continue
            try:
                method, args, want = payload(name, w.make_tensor)
                for _ in range(WARMUP_CALLS):  # the first send of a plain tensor shares it
                    check(w.system, name, w.call(method, *args), want)
                ready[name, w.system] = (w, method, args, want)
            except Exception as e:  # noqa: BLE001 - shown in the table's cell
                cells.fail(w.system, name, e)
    times: dict[tuple[str, str], list[float]] = {cell: [] for cell in ready}
    systems = [w.system for w in workers]
    turns = -(-iters // TURN_CALLS)
    for t in range(turns):
        n = iters // turns + (t < iters % turns)
        cells.progress.start(f"calls: turn {t + 1} of {turns}")
        for name in rotated(PAYLOADS, t):
            for s in rotated(systems, t):
                if (name, s) not in ready:
                    continue
                w, method, args, want = ready[name, s]
                try:
                    check(s, name, w.call(method, *args), want)
                    times[name, s] += w.timed(method, args, n)
                    cells.progress.step(n)
                except Exception as e:  # noqa: BLE001
                    cells.fail(s, name, e)
                    del ready[name, s]
    for name, s in ready:
        cells.times[s][name] = times[name, s]



# --- the systems ----------------------------------------------------------------------

def cold_sample(cells: Cells, system: str, t0: float) -> None:
    """The start of the worker the calls are timed on (start -> first add(1, 2) answered)
    is the first cold start of ``--cold``: the same measurement, one torch import fewer per
    system than a separate start."""
    cells.cold[system].append(time.perf_counter() - t0)
    cells.progress.step()


def start_tensorwire(stack: contextlib.ExitStack, cells: Cells) -> list[Worker]:
    import tensorwire.rpc as rpc

    t0 = time.perf_counter()
    w = stack.enter_context(rpc.spawn(TARGET))
    w.call("add", 1, 2)
    cold_sample(cells, "tensorwire.rpc", t0)
    return [sync_worker("tensorwire.rpc", w.call, lambda n: rpc.empty(n).fill_(1))]


def more_tensorwire(cells: Cells, cold: int, pool_gets: int) -> None:
    """tensorwire.rpc's other starts: cold, from the zygote (sandboxed too where this
    kernel allows it), and the warm pool's hand-out."""
    import tensorwire.rpc as rpc

    cells.progress.start("tensorwire.rpc: cold start")
    for _ in range(cold - 1):
        t0 = time.perf_counter()
        w = rpc.spawn(TARGET)
        w.call("add", 1, 2)
        cells.cold["tensorwire.rpc"].append(time.perf_counter() - t0)
        w.close()
        cells.progress.step()
    cells.progress.start("tensorwire.rpc: start from the zygote")
    with rpc.spawn(TARGET, zygote=True) as w:
        w.call("add", 1, 2)  # the zygote has imported torch from here on
        for _ in range(max(cold, 5)):
            w.kill()
            t0 = time.perf_counter()
            w.call("add", 1, 2)  # a worker forked from the zygote, then its first answer
            cells.zygote_start.append(time.perf_counter() - t0)
            cells.progress.step()
    if rpc._native.containment()["user_namespaces"]:
        cells.progress.start("tensorwire.rpc: a sandboxed worker's start from the zygote")
        with rpc.spawn(TARGET, zygote=True, sandbox=rpc.Sandbox()) as w:
            w.call("add", 1, 2)
            for _ in range(max(cold, 5)):
                w.kill()
                t0 = time.perf_counter()
                w.call("add", 1, 2)  # forked, contained (namespaces, landlock, seccomp), first answer
                cells.zygote_sandboxed_start.append(time.perf_counter() - t0)
                cells.progress.step()
    cells.progress.start("tensorwire.rpc: warm pool")
    with rpc.WorkerPool(TARGET, 2) as pool:
        if not pool.wait_idle(2, 300.0):
            raise RuntimeError("tensorwire.rpc: the pool's workers did not start within 300 s")
        for _ in range(pool_gets):
            t0 = time.perf_counter()
            pw = pool.get()
            t1 = time.perf_counter()
            pw.call("add", 1, 2)
            t2 = time.perf_counter()
            pw.release()
            cells.pool_get.append(t1 - t0)
            cells.pool_first.append(t2 - t0)
            pool.wait_idle(2, 60.0)  # each hand-out finds the pool full again
            cells.progress.step()


class Pyisolate:
    """pyisolate's side of the calls table: a host (torch's file_system strategy only
    while pyisolate's calls run, so that the baselines' turns send with torch's default)
    and the event loop its awaited calls run on, a turn at a time."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self.host = stack.enter_context(PyisolateHost(all_along=False))
        self.loop = asyncio.new_event_loop()
        stack.callback(self.loop.close)

    def run(self, coro: Awaitable[Any]) -> Any:
        with self.host.sharing():
            return self.loop.run_until_complete(coro)

    def connect(self, n: int) -> tuple[Any, Any, Any]:
        return self.run(pyisolate_connect(self.host.ctx, self.host.tmp, n))

    def stop(self, proc, prpc) -> None:
        async def stop() -> None:  # on the loop its AsyncRPC was made on, as pyisolate's host does
            pyisolate_stop(proc, prpc)
        self.run(stop())

    def start(self, stack: contextlib.ExitStack, cells: Cells) -> list[Worker]:
        t0 = time.perf_counter()
        proc, prpc, target = self.connect(0)
        stack.callback(self.stop, proc, prpc)
        self.run(target.add(1, 2))
        cold_sample(cells, "pyisolate", t0)

        async def calls(method: str, args: tuple, n: int) -> list[float]:
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                await getattr(target, method)(*args)
                times.append(time.perf_counter() - t0)
            return times

        return [Worker("pyisolate", lambda m, *a: self.run(getattr(target, m)(*a)),
                       lambda m, a, n: self.run(calls(m, a, n)), plain_tensor)]

    def more(self, cells: Cells, cold: int) -> None:
        cells.progress.start("pyisolate: cold start")
        for i in range(cold - 1):
            t0 = time.perf_counter()
            proc, prpc, target = self.connect(i + 1)
            self.run(target.add(1, 2))
            cells.cold["pyisolate"].append(time.perf_counter() - t0)
            self.stop(proc, prpc)
            cells.progress.step()


def start_process_pool(stack: contextlib.ExitStack, cells: Cells) -> list[Worker]:
    t0 = time.perf_counter()
    ex = stack.enter_context(concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")))
    ex.submit(pool_call, "add", (1, 2)).result()
    cold_sample(cells, "ProcessPool", t0)
    return [sync_worker("ProcessPool", lambda m, *a: ex.submit(pool_call, m, a).result(), plain_tensor)]


def more_process_pool(cells: Cells, cold: int) -> None:
    cells.progress.start("ProcessPool: cold start")
    for _ in range(cold - 1):
        t0 = time.perf_counter()
        ex = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        ex.submit(pool_call, "add", (1, 2)).result()
        cells.cold["ProcessPool"].append(time.perf_counter() - t0)
        ex.shutdown()
        cells.progress.step()


def pipe_start():
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=pipe_child, args=(there,), daemon=True)
    proc.start()
    there.close()
    return proc, here


def pipe_call(conn, method, *args):
    conn.send((method, args))
    return conn.recv()


def pipe_stop(proc, conn) -> None:
    conn.send(None)
    proc.join(10.0)
    if proc.is_alive():
        proc.kill()
        proc.join(10.0)
    conn.close()


def start_pipe(stack: contextlib.ExitStack, cells: Cells) -> list[Worker]:
    """The mp.Pipe loop, and on the same Pipe the "Pipe bytes" row: each randn echo as the
    tensor's bytes, pickled both ways (no shared memory), made a tensor again on return."""
    t0 = time.perf_counter()
    proc, conn = pipe_start()
    stack.callback(pipe_stop, proc, conn)
    pipe_call(conn, "add", 1, 2)
    cold_sample(cells, "mp.Pipe", t0)

    def as_bytes(method: str, t: torch.Tensor) -> torch.Tensor:
        return torch.frombuffer(bytearray(pipe_call(conn, method, t.numpy().tobytes())), dtype=t.dtype)

    return [sync_worker("mp.Pipe", lambda m, *a: pipe_call(conn, m, *a), plain_tensor),
            sync_worker("Pipe bytes", as_bytes, plain_tensor, tuple(ECHOES))]


def more_pipe(cells: Cells, cold: int) -> None:
    cells.progress.start("mp.Pipe: cold start")
    for _ in range(cold - 1):
        t0 = time.perf_counter()
        proc, conn = pipe_start()
        pipe_call(conn, "add", 1, 2)
        cells.cold["mp.Pipe"].append(time.perf_counter() - t0)
        pipe_stop(proc, conn)
        cells.progress.step()


def bench_calls(cells: Cells, systems: list[str], iters: int, warm_s: float, cold: int, pool_gets: int) -> None:
    """Start every system's worker (its cold start, one at a time), time the calls with
    the cells taking turns, stop the workers; then each system's other starts."""
    with contextlib.ExitStack() as lasting:
        pyi: Optional[Pyisolate] = None
        starts: dict[str, Callable[[contextlib.ExitStack, Cells], list[Worker]]] = {
            "tensorwire.rpc": start_tensorwire, "ProcessPool": start_process_pool, "mp.Pipe": start_pipe}
        mores: dict[str, Callable[[], None]] = {
            "tensorwire.rpc": lambda: more_tensorwire(cells, cold, pool_gets),
            "ProcessPool": lambda: more_process_pool(cells, cold), "mp.Pipe": lambda: more_pipe(cells, cold)}
        workers: list[Worker] = []
        with contextlib.ExitStack() as calls:
            for system in systems:
                cells.progress.start(f"{system}: start")
                try:
                    if system == "pyisolate":
                        pyi = Pyisolate(lasting)
                        workers += pyi.start(calls, cells)
                    else:
                        workers += starts[system](calls, cells)
                except Exception as e:  # noqa: BLE001 - a system that fails stops its own row only
                    cells.fail(system, "stopped", e)
            measure(workers, cells, iters, warm_s)
        for system in systems:
            if "stopped" in cells.errors[system]:
                continue
            try:
                if system == "pyisolate":
                    assert pyi is not None
                    pyi.more(cells, cold)
                else:
                    mores[system]()
            except Exception as e:  # noqa: BLE001
                cells.fail(system, "stopped", e)


# --- report ---------------------------------------------------------------------------

def cell(cells: Cells, system: str, payload: str) -> str:
    if payload in cells.errors[system]:
        return "error"
    xs = cells.times[system].get(payload)
    if not xs:
        return "-"
    return f"{fmt_us(p50(xs))} / {fmt_us(p90(xs))}"


def report(cells: Cells, args, pyisolate_missing: Optional[str]) -> list[str]:
    lines = []
    w0, w = 16, 19
    lines.append(f"RPC from this process to one worker process, one call at a time: p50 / p90 per call, microseconds; "
                 f"{args.iters} calls per cell after a warm-up, the cells taking turns of <= {TURN_CALLS} calls; torch {torch.__version__}, {os.cpu_count()} CPUs")
    hdr = f"{'':<{w0}}|" + "|".join(f" {p:>{w - 1}}" for p in PAYLOADS) + f"| {'cold start p50':>15} | {'warm pool get p50':>18}"
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for s in SYSTEMS:
        if s == "pyisolate" and pyisolate_missing:
            lines.append(f"{s:<{w0}}| not run: {pyisolate_missing}")
            continue
        row = f"{s:<{w0}}|" + "|".join(f" {cell(cells, s, p):>{w - 1}}" for p in PAYLOADS)
        c = f"{p50(cells.cold[s]) * 1e3:,.0f} ms" if cells.cold[s] else "-"
        g = f"{fmt_us(p50(cells.pool_get))} µs" if s == "tensorwire.rpc" and cells.pool_get else "-"
        lines.append(row + f"| {c:>15} | {g:>18}")
    for s in SYSTEMS:
        for what, err in cells.errors[s].items():
            lines.append(f"error: {s}, {what}: {err}")

    tw = cells.times["tensorwire.rpc"]
    pi = cells.times["pyisolate"]
    ratios = {p: p50(pi[p]) / p50(tw[p]) for p in PAYLOADS if pi.get(p) and tw.get(p)}
    if ratios:
        lines.append("pyisolate / tensorwire.rpc, p50: " + ", ".join(f"{p} {r:.1f}x" for p, r in ratios.items()))
    facts = []
    pb = cells.times["Pipe bytes"]
    mp_ = cells.times["mp.Pipe"]
    for p in ("1 KiB randn echo", "4 KiB randn echo"):
        if tw.get(p) and tw.get("add(1, 2)"):
            small = p50(tw[p])
            fact = f"{p}: {small / p50(tw['add(1, 2)']):.2f}x add(1, 2) (goal <= 1.5x)"
            if pb.get(p):
                fact += f", {small / p50(pb[p]):.2f}x Pipe bytes (goal <= 1x)"
            facts.append(fact)
    for p in ("JSON 1,000 leaves", "JSON dict 333 keys"):
        if tw.get(p) and mp_.get(p):
            facts.append(f"{p}: {p50(tw[p]) / p50(mp_[p]):.2f}x mp.Pipe (goal <= 1x)")
    if tw.get("64 MiB randn echo") and mp_.get("64 MiB randn echo"):
        facts.append(f"64 MiB randn echo: {p50(tw['64 MiB randn echo']) / p50(mp_['64 MiB randn echo']):.2f}x mp.Pipe "
                     f"(goal <= 1x)")
    if "add(1, 2)" in ratios:
        facts.append(f"add(1, 2): {ratios['add(1, 2)']:.1f}x pyisolate (goal >= 10x), "
                     f"{p50(tw['add(1, 2)']) * 1e6:.1f} µs p50 (goal <= 40 µs)")
    elif tw.get("add(1, 2)"):
        facts.append(f"add(1, 2): {p50(tw['add(1, 2)']) * 1e6:.1f} µs p50 (goal <= 40 µs)")
    if "64 MiB tensor" in ratios:
        facts.append(f"64 MiB tensor: {ratios['64 MiB tensor']:.1f}x pyisolate (goal >= 50x)")
    if cells.pool_get:
        facts.append(f"warm worker handed out in {p50(cells.pool_get) * 1e3:.3f} ms p50 (goal <= 1 ms); "
                     f"hand-out + first add(1, 2) {p50(cells.pool_first) * 1e3:.3f} ms")
    if cells.zygote_start:
        z = p50(cells.zygote_start)
        than = (f", {p50(cells.cold['pyisolate']) / z:,.0f}x faster than pyisolate's cold start"
                if cells.cold["pyisolate"] else "")
        facts.append(f"worker start from the zygote (torch imported): {z * 1e3:.1f} ms p50 (goal <= 50 ms){than}")
    if cells.zygote_sandboxed_start:
        facts.append(f"sandboxed worker start from the zygote: {p50(cells.zygote_sandboxed_start) * 1e3:.1f} ms p50")
    if facts:
        lines.append("goals: " + "; ".join(facts))
    lines.append(f"cold start: start the worker -> first add(1, 2) answered, p50 of {args.cold} (each worker imports "
                 f"torch); warm pool: WorkerPool(size=2).get(), p50 of {len(cells.pool_get)}; start from the zygote: "
                 f"kill the worker, then the next add(1, 2) answered by a worker forked from spawn(zygote=True)'s zygote, "
                 f"p50 of {len(cells.zygote_start)}; a sandboxed worker's start from the zygote: the same, contained as it is "
                 f"forked, and importing the target's module itself (the zygote never imports a sandboxed target)")
    lines.append("randn echoes: every system sends a torch.randn tensor and the worker returns it (tensorwire.rpc: "
                 "1 KiB and 4 KiB attached to the RPC frame as raw bytes, 64 MiB moved into a "
                 "segment in place by its first send; "
                 "Pipe bytes: the tensor's bytes pickled both ways)")
    lines.append("tensors: tensorwire.rpc sends rpc.empty tensors (shared segment, no copy); pyisolate, ProcessPool "
                 "and mp.Pipe send a plain tensor, moved into shared memory by its first send (in the warm-up) and "
                 "passed by reference after that (pyisolate: a /dev/shm name in its JSON; the others: an fd)")
    return lines


def plot(cells: Cells, cont: Contention, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    have_calls = any(cells.times[s] for s in SYSTEMS)
    have_cont = any(cont.times[s] for s in CONTENTION_SYSTEMS)
    fig, axes = plt.subplots(1, have_calls + have_cont, figsize=(8 + 4 * (have_calls and have_cont), 4.5),
                             squeeze=False)
    if have_cont:
        plot_contention(axes[0][-1], cont)
    if have_calls:
        bar_panel(axes[0][0], PAYLOADS, SYSTEMS, lambda s, p: cells.times[s].get(p), str, "per call, p50 (µs)",
                  "RPC to one worker process")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m tensorwire bench rpc``; returns the exit status (1 if a cell failed)."""
    from .bench import Progress

    ap = argparse.ArgumentParser(prog="python -m tensorwire bench rpc", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=None, help="timed calls per cell, made in turns of at most "
                    "30 per cell (default 500; --quick: 20)")
    ap.add_argument("--cold", type=int, default=None, help="cold starts per system (default 3; --quick: 1)")
    ap.add_argument("--quick", action="store_true", help="few calls and starts: checks that it runs, not a measurement")
    ap.add_argument("--png", default="tensorwire_rpc.png", help="where to write the plot, if matplotlib is installed "
                    "(default: %(default)s)")
    ap.add_argument("--no-plot", action="store_true", help="print the table only")
    ap.add_argument("--only", choices=["calls", "contention"], default=None,
                    help="run one part: the calls table, or noop() alone and beside busy processes")
    args = ap.parse_args(argv)
    args.iters = args.iters or (20 if args.quick else 500)
    args.cold = args.cold or (1 if args.quick else 3)
    if args.iters < 1 or args.cold < 1:
        ap.error("--iters and --cold must be at least 1")
    warm_s = 0.2 if args.quick else 1.0
    pool_gets = 3 if args.quick else 20
    settle_s = 0.1 if args.quick else 0.5
    do_calls, do_contention = args.only in (None, "calls"), args.only in (None, "contention")

    try:
        import pyisolate
        version = getattr(pyisolate, "__version__", "?")
        pyisolate_missing = None
    except ImportError as e:
        pyisolate_missing = f"pyisolate is not importable ({e}); pip install pyisolate==0.10.2"
        version = None
    if version and not version.startswith("0.10."):
        print(f"bench rpc: note: pyisolate {version} is installed; this bench was written against 0.10.2",
              file=sys.stderr)

    started = time.perf_counter()
    systems = [s for s in SYSTEMS if not (s == "pyisolate" and pyisolate_missing) and s != "Pipe bytes"]
    contention_systems = [s for s in CONTENTION_SYSTEMS if not (s == "pyisolate" and pyisolate_missing)]
    total = ((len(systems) * (len(PAYLOADS) * args.iters + args.cold) + pool_gets + len(ECHOES) * args.iters
              + max(args.cold, 5)) * do_calls
             + len(contention_systems) * len(PHASES) * args.iters * do_contention)
    progress = Progress(total)
    cells = Cells(progress)
    cont = Contention(os.cpu_count() or 1)
    try:
        if do_calls:
            bench_calls(cells, systems, args.iters, warm_s, args.cold, pool_gets)
        if do_contention:
            bench_contention(cont, progress, args.iters, warm_s, settle_s, pyisolate_missing)
    finally:
        progress.close()
    if pyisolate_missing:
        print(f"bench rpc: pyisolate row SKIPPED: {pyisolate_missing}", file=sys.stderr)

    if do_calls:
        print()
        for line in report(cells, args, pyisolate_missing):
            print(line)
    if do_contention:
        print()
        for line in report_contention(cont, args.iters, pyisolate_missing):
            print(line)
    failed = any(cells.errors[s] for s in SYSTEMS) or bool(cont.errors)

    if not args.no_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("plot: skipped, matplotlib is not installed (--no-plot says this is intended)")
        else:
            plot(cells, cont, args.png)
            print(f"plot: {args.png}  ({time.perf_counter() - started:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
