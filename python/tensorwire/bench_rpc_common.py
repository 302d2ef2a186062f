"""What both halves of ``python -m tensorwire bench rpc`` (the calls table in
:mod:`tensorwire.bench_rpc`, the contention table in :mod:`tensorwire.bench_rpc_contention`)
share: the object every worker serves, the baselines' children, the pyisolate host and
the statistics and formatting of a cell. It imports no other module of the bench."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import socket
import statistics
import tempfile
import traceback
from typing import Callable, Iterator, Optional

import torch

# The module a tensorwire.rpc worker imports: this one, which defines Target and imports
# nothing of the bench's drivers.
TARGET = "tensorwire.bench_rpc_common:Target"


# --- what every worker serves ---------------------------------------------------------

class Target:
    """The object each worker serves (the same methods for every system)."""

    def add(self, a, b):
        return a + b

    def tensor(self, t):
        # Proves the tensor arrived (length, last element: one page read) without a pass
        # over its data, which would hide the transport's cost behind a memory scan.
        return [int(t.numel()), float(t.reshape(-1)[-1])]

    def json(self, x):
        return len(x)

    def noop(self):
        return None

    def echo(self, t):
        return t


_target = Target()


def pool_call(method: str, args: tuple):
    """What ProcessPoolExecutor runs in its worker."""
    return getattr(_target, method)(*args)


def pipe_child(conn) -> None:
    """The mp.Pipe worker: answer each (method, args) until None."""
    while True:
        msg = conn.recv()
        if msg is None:
            break
        method, args = msg
        conn.send(getattr(_target, method)(*args))
        del msg, args
    conn.close()


class AsyncTarget:
    """pyisolate's caller wants coroutine methods; the child serves these."""

    async def add(self, a, b):
        return _target.add(a, b)

    async def tensor(self, t):
        return _target.tensor(t)

    async def json(self, x):
        return _target.json(x)

    async def noop(self):
        return _target.noop()

    async def echo(self, t):
        return _target.echo(t)


# --- pyisolate: its host and child ----------------------------------------------------

def pyisolate_share_torch() -> None:
    """What a pyisolate 0.10.2 host (and its child) sets up when ``share_torch`` is on and
    the execution model is host-coupled (pyisolate/_internal/host.py, uds_client.py): the
    tensor serializer in ``shared_memory`` mode and torch's file_system strategy."""
    from pyisolate._internal.serialization_registry import SerializerRegistry
    from pyisolate._internal.tensor_serializer import register_tensor_serializer

    register_tensor_serializer(SerializerRegistry.get_instance(), mode="shared_memory")
    torch.multiprocessing.set_sharing_strategy("file_system")


def pyisolate_child(path: str) -> None:
    from pyisolate._internal.rpc_protocol import AsyncRPC
    from pyisolate._internal.rpc_transports import JSONSocketTransport

    pyisolate_share_torch()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)

    async def serve() -> None:
        rpc = AsyncRPC(transport=JSONSocketTransport(sock, tensor_transport="shared_memory"))
        rpc.register_callee(AsyncTarget(), "target")
        rpc.run()
        await rpc.run_until_stopped()
        rpc.shutdown()

    asyncio.run(serve())


async def pyisolate_connect(ctx, tmp: str, n: int):
    """A fresh pyisolate child serving :class:`AsyncTarget` on a Unix socket in ``tmp``:
    (process, its AsyncRPC, the caller)."""
    from pyisolate._internal.rpc_protocol import AsyncRPC
    from pyisolate._internal.rpc_transports import JSONSocketTransport

    path = os.path.join(tmp, f"pyisolate-{n}.sock")
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path)
    lsock.listen(1)
    lsock.settimeout(300.0)
    proc = ctx.Process(target=pyisolate_child, args=(path,), daemon=True)
    proc.start()
    try:
        conn, _ = lsock.accept()
    finally:
        lsock.close()
        os.unlink(path)
    conn.settimeout(None)
    rpc = AsyncRPC(transport=JSONSocketTransport(conn, tensor_transport="shared_memory"))
    rpc.run()
    return proc, rpc, rpc.create_caller(AsyncTarget, "target")


def pyisolate_stop(proc, rpc) -> None:
    rpc.shutdown()
    proc.join(10.0)
    if proc.is_alive():
        proc.kill()
        proc.join(10.0)


class PyisolateHost:
    """What a pyisolate host sets up for this process while its children run (the tensor
    serializer, torch's file_system strategy), undone on exit so that the baselines after
    it get torch's default; and a directory for the children's sockets. With
    ``all_along=False`` torch's strategy is pyisolate's only inside :meth:`sharing`, so
    that baselines whose calls take turns with pyisolate's still send with the default."""

    def __init__(self, all_along: bool = True) -> None:
        self.all_along = all_along

    def __enter__(self) -> "PyisolateHost":
        self.before = torch.multiprocessing.get_sharing_strategy()
        pyisolate_share_torch()
        if not self.all_along:
            torch.multiprocessing.set_sharing_strategy(self.before)
        self.ctx = multiprocessing.get_context("spawn")
        self.tmp = tempfile.mkdtemp(prefix="tw-bench-rpc-")
        return self

    @contextlib.contextmanager
    def sharing(self) -> Iterator[None]:
        """torch's sharing strategy as a pyisolate host has it, for the duration."""
        torch.multiprocessing.set_sharing_strategy("file_system")
        try:
            yield
        finally:
            torch.multiprocessing.set_sharing_strategy(self.before if not self.all_along else "file_system")

    def __exit__(self, *exc) -> None:
        torch.multiprocessing.set_sharing_strategy(self.before)
        try:
            from pyisolate._internal.tensor_serializer import flush_tensor_keeper
            flush_tensor_keeper()
        except Exception:  # noqa: BLE001
            pass
        os.rmdir(self.tmp)


# --- a cell ---------------------------------------------------------------------------

def error_line(e: BaseException) -> str:
    """What a table says of the error that stopped a cell or a row: its first line (with
    TENSORWIRE_BENCH_DEBUG set, the traceback goes to stderr too)."""
    if os.environ.get("TENSORWIRE_BENCH_DEBUG"):
        traceback.print_exc()
    return f"{type(e).__name__}: {e}".splitlines()[0][:120]


def p50(xs: list[float]) -> float:
    return statistics.median(xs)


def p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[8] if len(xs) >= 2 else xs[0]


def fmt_us(s: float) -> str:
    us = s * 1e6
    return f"{us:.1f}" if us < 100 else f"{us:,.0f}"


def bar_panel(ax, groups: list[str], series: list[str], samples: Callable[[str, str], Optional[list[float]]],
              label: Callable[[str], str], ylabel: str, title: str) -> None:
    """One panel of the plot: for each of ``groups`` along the x axis, a bar per one of
    ``series`` that has samples there (``samples(series, group)``: seconds per call), its
    height the p50 in microseconds on a log scale; ``label(series)`` names it in the legend."""
    width = 0.8 / len(series)
    for k, s in enumerate(series):
        xs, ys = [], []
        for i, g in enumerate(groups):
            times = samples(s, g)
            if times:
                xs.append(i + (k - (len(series) - 1) / 2) * width)
                ys.append(p50(times) * 1e6)
        if xs:
            ax.bar(xs, ys, width, label=label(s))
    ax.set_yscale("log")
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend()
