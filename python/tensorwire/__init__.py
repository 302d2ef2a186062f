"""tensorwire for PyTorch: zero-copy CPU and CUDA tensor sharing between processes.

Registers ``torch.ops.tensorwire`` as Python ops over the binding ``tensorwire._native``
(``$TENSORWIRE_TORCH_LIB`` loads that C++ extension, ``libtensorwire_torch.so``, instead)
and wraps them with a small ``torch.multiprocessing``-like API::

    parent_fd, child_fd = tensorwire.socketpair()      # child_fd is inheritable
    subprocess.Popen([... , str(child_fd)], pass_fds=[child_fd]); os.close(child_fd)
    conn = tensorwire.from_fd(parent_fd)                # child: tensorwire.from_fd(int(argv[1]))
    t = tensorwire.zeros([1024, 1024])                  # lives in shared memory
    conn.send(t.t())                                    # zero-copy, any strided view
    u = conn.recv()                                     # aliases the peer's memory

    conn.ring_send(torch.randn(64, 64).t())              # copied through the ring, packed
    u = conn.ring_recv()                                # a private contiguous tensor

A tensor that does not live in a tensorwire segment is copied once on ``send``. The
receiver's tensor holds a lease on the sender's memory; it is released when the last
tensor/view over it dies (or when the receiver dies). The ring (a bounce buffer set up
once per connection) copies instead: no lease, any CPU tensor, large ones in chunks.

CUDA tensors (where libtensorwire_torch was built with a CUDA toolkit and a driver
works: ``cuda_available()``): ``send`` exports the storage by IPC handle, ordered after
the work queued on the current stream; ``recv`` makes the current stream wait for it and
returns a tensor on the device (released, once the work queued on that stream completed,
when the last view dies). ``ring_send`` of a CUDA tensor copies it through the
connection's GPU bounce ring (open the connection with ``cuda_ring_device=<index>`` on the
sending side): device-to-device copies on the current stream, no handle opened per
message; the peer takes it with ``cuda_ring_recv()``. Errors are :class:`tensorwire.Error`
(a ``RuntimeError``) subclasses carrying tensorwire's own message: ``PeerGone``,
``Timeout``, ``Refused``, ``QuotaExceeded``, ``ResourceExhausted``, ``CudaUnavailable``.

Code in worker processes (:mod:`tensorwire.rpc`): ``tensorwire.spawn("pkg.mod:Plugin")``
starts a supervised worker serving that object — calls with JSON values and tensors, never
pickle; deadlines, crash containment, a warm :class:`WorkerPool`, an optional sandbox.

``python -m tensorwire demo | doctor | bench`` try it out, check the machine, measure.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Optional, TypeVar, Union

import torch

from ._version import __version__
from ._loader import build_info, library_path, ops
from . import _fake  # noqa: F401  (fake implementations for torch.compile / opcheck)
from .connection import Connection, Listener, connect, from_fd, listen, socketpair
from .errors import CudaUnavailable, Error, PeerGone, QuotaExceeded, Refused, RemoteError, ResourceExhausted, Timeout, translate

__all__ = [
    "__version__", "Connection", "Listener", "socketpair", "from_fd", "connect", "listen",
    "Error", "PeerGone", "Timeout", "Refused", "QuotaExceeded", "ResourceExhausted", "CudaUnavailable", "RemoteError",
    "rpc", "spawn", "Worker", "WorkerPool",
    "empty", "zeros", "to_shared", "share_", "is_shared", "send", "recv", "stats",
    "from_torch_shared", "to_torch_shared", "library_path", "build_info", "cuda_available", "cuda_built",
    "cuda_device_count", "cuda_ipc_cache_stats", "cuda_ipc_cache_keep_warm",
]

_F = TypeVar("_F", bound=Callable[..., Any])


def _mapped(fn: _F) -> _F:
    """Re-raise the extension's RuntimeErrors as tensorwire.Error subclasses."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            raise translate(e) from e
    return wrapper  # type: ignore[return-value]


SizeArg = Union[int, list[int], tuple[int, ...], torch.Size]


def _size(size: tuple[SizeArg, ...]) -> list[int]:
    if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
        return list(size[0])
    return list(size)  # type: ignore[arg-type]


@_mapped
def empty(*size: SizeArg, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A tensor in a new sealed shared segment (zero-filled); sending it copies nothing."""
    return ops.empty(_size(size), dtype=dtype)


@_mapped
def zeros(*size: SizeArg, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Same as :func:`empty` (segments start zeroed)."""
    return ops.zeros(_size(size), dtype=dtype)


@_mapped
def to_shared(t: torch.Tensor) -> torch.Tensor:
    """Copy ``t`` once into a new segment (contiguous); sending the result is zero-copy."""
    return ops.to_shared(t)


@_mapped
def share_(t: torch.Tensor) -> torch.Tensor:
    """Move ``t``'s whole storage into a new segment, in place (every view of it follows),
    like ``Tensor.share_memory_()``; returns ``t``. Later sends of any view are zero-copy.
    A no-op if it already lives in a segment. The storage can no longer be resized."""
    return ops.share_(t)


@_mapped
def is_shared(t: torch.Tensor) -> bool:
    """True if ``t``'s storage is a tensorwire segment (sending it copies nothing)."""
    return ops.is_shared(t)


def send(conn: Connection, tensor: torch.Tensor, tag: int = 0, window_ms: Optional[int] = None, *,
         window: Optional[float] = None) -> bool:
    """``conn.send(tensor, tag, window=window)`` (``window_ms``: deprecated, as there)."""
    return conn._send(tensor, tag, window_ms, window, stacklevel=2)


def recv(conn: Connection, timeout: Optional[float] = None) -> torch.Tensor:
    """``conn.recv(timeout)``."""
    return conn.recv(timeout)


def stats(conn: Connection) -> dict[str, int]:
    """``conn.stats()``."""
    return conn.stats()


@_mapped
def cuda_built() -> bool:
    """True if libtensorwire_torch was compiled with CUDA (a toolkit was found)."""
    return ops.cuda_built()


@_mapped
def cuda_available() -> bool:
    """True if CUDA tensors can be sent and received: built with CUDA and a driver works."""
    return ops.cuda_available()


@_mapped
def cuda_device_count() -> int:
    """CUDA devices tensorwire sees; :class:`CudaUnavailable` with the reason (e.g. no
    NVIDIA driver) where CUDA is unavailable."""
    return ops.cuda_device_count()


@_mapped
def cuda_ipc_cache_stats() -> dict[str, int]:
    """This process's IPC handle cache: ``opens`` (cuIpcOpenMemHandle calls so far) and
    ``open_handles`` (open now)."""
    opens, open_handles = ops.cuda_ipc_cache_stats()
    return {"opens": opens, "open_handles": open_handles}


@_mapped
def cuda_ipc_cache_keep_warm(n: int) -> None:
    """How many unused opened handles stay open (default 0: a handle closes as soon as
    its last import is released). An opt-in, for producers that keep exported memory
    allocated (no ``torch.cuda.empty_cache()`` there): CUDA calls freeing exported memory
    while an importer still has its handle open undefined behaviour."""
    ops.cuda_ipc_cache_keep_warm(n)


# --- interop with PyTorch's own CPU sharing (file_descriptor strategy) -------------------

@_mapped
def from_torch_shared(t: torch.Tensor) -> torch.Tensor:
    """A tensorwire tensor aliasing ``t``, whose storage PyTorch shares by fd (e.g. it
    arrived through a torch.multiprocessing Queue). Only for trusted peers: PyTorch's shm
    files are unsealed. Sending the result over tensorwire copies it once (peers accept
    only sealed segments)."""
    fd, nbytes = t.untyped_storage()._share_fd_cpu_()
    return ops.from_torch_fd(fd, nbytes, t.dtype, list(t.shape), list(t.stride()), t.storage_offset())


def _rebuild_from_torch_fd(df: Any, nbytes: int, dtype: torch.dtype, size: tuple[int, ...],
                           stride: tuple[int, ...], offset: int) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_storage_fd

    storage = rebuild_storage_fd(torch.UntypedStorage, df, nbytes)  # PyTorch's own rebuild
    return torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)


class _TorchShared:
    """Pickles as PyTorch's own fd-sharing rebuild (see :func:`to_torch_shared`)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from multiprocessing.reduction import DupFd

        t = self.t
        try:
            fd, seg_len, byte_off = ops.segment_fd(t)
        except RuntimeError as e:
            raise translate(e) from e
        try:
            df = DupFd(fd)  # duplicates fd for the receiving process
        finally:
            os.close(fd)
        if byte_off != 0:
            raise Error("tensorwire: the storage does not start the segment; PyTorch maps whole files")
        if seg_len != t.untyped_storage().nbytes():
            raise Error(f"tensorwire: segment of {seg_len} bytes holds a storage of "
                               f"{t.untyped_storage().nbytes()}; PyTorch maps whole files")
        return (_rebuild_from_torch_fd, (df, seg_len, t.dtype, tuple(t.shape), t.stride(), t.storage_offset()))


def to_torch_shared(t: torch.Tensor) -> _TorchShared:
    """A picklable handle for ``multiprocessing`` (Queue, Pipe, Process args): the
    receiver rebuilds it with PyTorch's own ``rebuild_storage_fd`` into a plain tensor
    over the same memory as ``t`` (which must live in a tensorwire segment)."""
    return _TorchShared(t)


# tensorwire.rpc (and its binding) load on first use: ``import tensorwire`` alone does not
# need them.
_RPC_NAMES = ("spawn", "Worker", "WorkerPool")


def __getattr__(name: str) -> Any:
    if name == "rpc" or name in _RPC_NAMES:
        import importlib
        rpc = importlib.import_module(".rpc", __name__)
        return rpc if name == "rpc" else getattr(rpc, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
