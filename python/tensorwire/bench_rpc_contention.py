"""The contention half of ``python -m tensorwire bench rpc``: a call that does nothing
(``noop()``, answered None) to a fresh worker of tensorwire.rpc, a torch.multiprocessing
Pipe loop and pyisolate, first on its own, then beside as many busy processes as this
machine has CPUs; its table and its panel of the plot. :mod:`tensorwire.bench_rpc` runs
it (``--only contention``)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from typing import Any, Callable, Optional

import torch

from .bench_rpc_common import (TARGET, PyisolateHost, bar_panel, error_line, fmt_us, p50, p90, pipe_child,
                               pyisolate_connect, pyisolate_stop)

CONTENTION_SYSTEMS = ["tensorwire.rpc", "torch.mp Pipe", "pyisolate"]
PHASES = ["alone", "busy"]


class Busy:
    """``n`` plain Python processes that never sleep, started on entry (given ``settle_s``
    to be running) and killed on exit."""

    def __init__(self, n: int, settle_s: float) -> None:
        self.n, self.settle_s = n, settle_s
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> "Busy":
        try:
            for _ in range(self.n):
                self.procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                                   stdin=subprocess.DEVNULL))
        except BaseException:
            self.__exit__()
            raise
        time.sleep(self.settle_s)
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []


class Contention:
    """Seconds per noop() call by system and phase (or the error that stopped a system)."""

    def __init__(self, busy: int) -> None:
        self.busy = busy
        self.times: dict[str, dict[str, list[float]]] = {s: {} for s in CONTENTION_SYSTEMS}
        self.errors: dict[str, str] = {}


@contextlib.contextmanager
def _phase(system: str, phase: str, cont: Contention, progress, settle_s: float):
    """One phase of a system's contention cells: its progress label, and for "busy" the
    busy processes, running for the phase and killed at its end (whatever happened)."""
    progress.start(f"{system}: noop {'alone' if phase == 'alone' else f'+ {cont.busy} busy'}")
    if phase == "alone":
        yield
    else:
        with Busy(cont.busy, settle_s):
            yield


def contention_sync(system: str, call: Callable[[], Any], cont: Contention, progress, iters: int, warm_s: float,
                    settle_s: float) -> None:
    for phase in PHASES:
        with _phase(system, phase, cont, progress, settle_s):
            end = time.perf_counter() + warm_s
            while time.perf_counter() < end:
                call()
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
                progress.step()
        cont.times[system][phase] = times


async def contention_async(system: str, call, cont: Contention, progress, iters: int, warm_s: float,
                           settle_s: float) -> None:
    for phase in PHASES:
        with _phase(system, phase, cont, progress, settle_s):
            end = time.perf_counter() + warm_s
            while time.perf_counter() < end:
                await call()
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                await call()
                times.append(time.perf_counter() - t0)
                progress.step()
        cont.times[system][phase] = times


def bench_contention(cont: Contention, progress, iters: int, warm_s: float, settle_s: float,
                     pyisolate_missing: Optional[str]) -> None:
    """noop() alone and beside busy processes, for each system on a fresh worker."""
    import tensorwire.rpc as rpc

    def tensorwire_rpc() -> None:
        with rpc.spawn(TARGET) as w:
            if w.call("noop") is not None:
                raise AssertionError("tensorwire.rpc: noop() answered something")
            contention_sync("tensorwire.rpc", lambda: w.call("noop"), cont, progress, iters, warm_s, settle_s)

    def pipe() -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        here, there = ctx.Pipe()
        proc = ctx.Process(target=pipe_child, args=(there,), daemon=True)
        proc.start()
        there.close()

        def call():
            here.send(("noop", ()))
            return here.recv()

        try:
            if call() is not None:
                raise AssertionError("torch.mp Pipe: noop() answered something")
            contention_sync("torch.mp Pipe", call, cont, progress, iters, warm_s, settle_s)
        finally:
            here.send(None)
            proc.join(10.0)
            if proc.is_alive():
                proc.kill()
                proc.join(10.0)
            here.close()

    def pyisolate() -> None:
        async def run(host: PyisolateHost) -> None:
            proc, prpc, target = await pyisolate_connect(host.ctx, host.tmp, 0)
            try:
                if await target.noop() is not None:
                    raise AssertionError("pyisolate: noop() answered something")
                await contention_async("pyisolate", target.noop, cont, progress, iters, warm_s, settle_s)
            finally:
                pyisolate_stop(proc, prpc)

        with PyisolateHost() as host:
            asyncio.run(run(host))

    for system, run in [("tensorwire.rpc", tensorwire_rpc), ("torch.mp Pipe", pipe), ("pyisolate", pyisolate)]:
        if system == "pyisolate" and pyisolate_missing:
            continue
        try:
            run()
        except Exception as e:  # noqa: BLE001 - a system that fails stops its own row only
            cont.errors[system] = error_line(e)


def report_contention(cont: Contention, iters: int, pyisolate_missing: Optional[str]) -> list[str]:
    lines = [f"noop() to a fresh worker, alone and beside {cont.busy} busy processes (as many as CPUs; "
             f"`while True: pass`): p50 / p90 per call, microseconds; {iters} calls per cell after a warm-up"]
    w0, w = 16, 21
    hdr = f"{'contention':<{w0}}|" + "|".join(f" {h:>{w - 1}}" for h in ["alone", f"{cont.busy} busy processes"])
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for s in CONTENTION_SYSTEMS:
        if s == "pyisolate" and pyisolate_missing:
            lines.append(f"{s:<{w0}}| not run: {pyisolate_missing}")
            continue
        cells = []
        for ph in PHASES:
            xs = cont.times[s].get(ph)
            cells.append(f"{fmt_us(p50(xs))} / {fmt_us(p90(xs))}" if xs else ("error" if s in cont.errors else "-"))
        lines.append(f"{s:<{w0}}|" + "|".join(f" {c:>{w - 1}}" for c in cells))
    for s, err in cont.errors.items():
        lines.append(f"error: {s}, contention: {err}")
    tw, pipe = cont.times["tensorwire.rpc"].get("busy"), cont.times["torch.mp Pipe"].get("busy")
    if tw and pipe:
        lines.append(f"beside busy processes, tensorwire.rpc / torch.mp Pipe: p50 {p50(tw) / p50(pipe):.2f}x, "
                     f"p90 {p90(tw) / p90(pipe):.2f}x (goal <= 1)")
    return lines


def plot_contention(cx, cont: Contention) -> None:
    """The contention panel of the plot: noop() p50 per system, alone and beside busy
    processes, on a log scale."""
    bar_panel(cx, CONTENTION_SYSTEMS, PHASES, lambda ph, s: cont.times[s].get(ph),
              lambda ph: "alone" if ph == "alone" else f"{cont.busy} busy processes", "noop() per call, p50 (µs)",
              "Under CPU contention")
