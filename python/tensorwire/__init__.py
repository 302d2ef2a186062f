"""tensorwire for PyTorch: zero-copy CPU and CUDA tensor sharing between processes.

Loads ``libtensorwire_torch.so`` (``$TENSORWIRE_TORCH_LIB``, else the repo's
``build/torch-ext/``; ``cpp/build.sh`` builds it) and wraps ``torch.ops.tensorwire``
with a small ``torch.multiprocessing``-like API::

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
message; the peer takes it with ``cuda_ring_recv()``. Errors are ``RuntimeError`` with
tensorwire's own message.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = [
    "Connection", "Listener", "socketpair", "from_fd", "connect", "listen",
    "empty", "zeros", "to_shared", "is_shared", "send", "recv", "stats",
    "from_torch_shared", "to_torch_shared", "library_path", "cuda_available", "cuda_built",
    "cuda_device_count", "cuda_ipc_cache_stats", "cuda_ipc_cache_keep_warm",
]


def library_path() -> str:
    env = os.environ.get("TENSORWIRE_TORCH_LIB")
    if env:
        return env
    return str(Path(__file__).resolve().parents[2] / "build" / "torch-ext" / "libtensorwire_torch.so")


def _load():
    path = library_path()
    if not os.path.exists(path):
        raise ImportError(f"tensorwire: {path} does not exist; build it with cpp/build.sh "
                          "or point TENSORWIRE_TORCH_LIB at libtensorwire_torch.so")
    torch.ops.load_library(path)


_load()
ops = torch.ops.tensorwire
from . import _fake  # noqa: E402,F401  (fake implementations for torch.compile / opcheck)

# Bound overloads: calling them skips the overload-packet lookup (~1 us per call).
_send, _recv, _stats = ops.send.default, ops.recv.default, ops.stats.default
_ring_send, _ring_recv = ops.ring_send.default, ops.ring_recv.default
_cuda_ring_recv = ops.cuda_ring_recv.default

_STATS = ("live_leases", "live_bytes", "granted", "released", "expired", "reclaimed")


class Connection:
    """One end of a tensorwire connection. Close it (or use ``with``) to end every lease
    it granted; the peer sees the connection end."""

    def __init__(self, handle):
        self._h = handle

    def send(self, tensor: torch.Tensor, tag: int = 0, window_ms: int = 0) -> bool:
        """Export ``tensor``; returns True if it went zero-copy (it lives in a segment, or
        came from ``recv`` and is forwarded as the same memory)."""
        return _send(self._h, tensor, tag, window_ms)

    def recv(self, timeout: float | None = None, with_tag: bool = False):
        """The next tensor (CPU, or CUDA on the device the peer's memory is on), aliasing
        the peer's memory. ``timeout`` in seconds (None: no limit)."""
        t, tag = _recv(self._h, _ms(timeout))
        if t.is_cuda:
            torch.cuda.init()  # PyTorch's Python-side CUDA state (no-op once initialized)
        return (t, tag) if with_tag else t

    def ring_send(self, tensor: torch.Tensor, tag: int = 0, timeout: float | None = None) -> None:
        """Copy ``tensor`` (any strides) through the ring, packed; waits at most ``timeout``
        seconds for ring space (None: no limit). A CPU tensor takes the CPU ring (the peer's
        ``ring_recv``), a CUDA tensor the GPU ring (the peer's ``cuda_ring_recv``)."""
        _ring_send(self._h, tensor, tag, _ms(timeout))

    def cuda_ring_recv(self, timeout: float | None = None, with_tag: bool = False):
        """The next tensor from the peer's GPU ring: a fresh contiguous CUDA tensor, filled
        on the current stream after it waited for the peer's copy (no synchronize)."""
        t, tag = _cuda_ring_recv(self._h, _ms(timeout))
        if t.is_cuda:
            torch.cuda.init()
        return (t, tag) if with_tag else t

    def ring_recv(self, timeout: float | None = None, with_tag: bool = False):
        """The next ring tensor: contiguous, owning its (private) bytes."""
        t, tag = _ring_recv(self._h, _ms(timeout))
        return (t, tag) if with_tag else t

    def stats(self) -> dict:
        return dict(zip(_STATS, _stats(self._h)))

    @property
    def peer_pid(self) -> int:
        return ops.peer_pid(self._h)

    def close(self) -> None:
        """End the connection (idempotent); later calls raise RuntimeError."""
        ops.close(self._h)  # runs with the GIL released: lease owners drop safely

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Listener:
    def __init__(self, handle):
        self._h = handle

    def accept(self, **limits) -> Connection:
        return Connection(ops.accept(self._h, **limits))

    def close(self) -> None:
        ops.close_listener(self._h)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _ms(timeout):
    return -1 if timeout is None else max(0, int(timeout * 1000))


def socketpair(inheritable_child: bool = True) -> tuple[int, int]:
    """Two connected fds: keep the first, hand the second to the child process."""
    a, b = ops.socketpair()
    if inheritable_child:
        ops.set_inheritable(b, True)
    return a, b


def from_fd(fd: int, **limits) -> Connection:
    """Handshake over an end of ``socketpair`` (takes ownership of ``fd``). Limits:
    ``max_leases``, ``max_lease_bytes``, ``window_ms``, ``handshake_timeout_ms``,
    ``ring_bytes`` (this side's send ring, a power of two >= 4096) (0: library default);
    ``cuda_ring_device`` (>= 0: a GPU bounce ring on that device for this side's CUDA
    ``ring_send``s; needs a driver), ``cuda_ring_slot_bytes``, ``cuda_ring_slots``."""
    return Connection(ops.from_fd(fd, **limits))


def connect(path: str, **limits) -> Connection:
    return Connection(ops.connect(path, **limits))


def listen(path: str) -> Listener:
    return Listener(ops.listen(path))


def empty(*size, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor in a new shared segment (zero-filled); sending it copies nothing."""
    return ops.empty(_size(size), dtype=dtype)


def zeros(*size, dtype: torch.dtype | None = None) -> torch.Tensor:
    return ops.zeros(_size(size), dtype=dtype)


def to_shared(t: torch.Tensor) -> torch.Tensor:
    """Copy ``t`` once into a new segment."""
    return ops.to_shared(t)


def is_shared(t: torch.Tensor) -> bool:
    return ops.is_shared(t)


def send(conn: Connection, tensor: torch.Tensor, tag: int = 0, window_ms: int = 0) -> bool:
    return conn.send(tensor, tag, window_ms)


def recv(conn: Connection, timeout: float | None = None) -> torch.Tensor:
    return conn.recv(timeout)


def stats(conn: Connection) -> dict:
    return conn.stats()


def cuda_built() -> bool:
    """True if libtensorwire_torch was compiled with CUDA (a toolkit was found)."""
    return ops.cuda_built()


def cuda_available() -> bool:
    """True if CUDA tensors can be sent and received: built with CUDA and a driver works."""
    return ops.cuda_available()


def cuda_device_count() -> int:
    """CUDA devices tensorwire sees; RuntimeError with the reason (e.g. no NVIDIA driver)
    where CUDA is unavailable."""
    return ops.cuda_device_count()


def cuda_ipc_cache_stats() -> dict:
    """This process's IPC handle cache: ``opens`` (cuIpcOpenMemHandle calls so far) and
    ``open_handles`` (open now)."""
    opens, open_handles = ops.cuda_ipc_cache_stats()
    return {"opens": opens, "open_handles": open_handles}


def cuda_ipc_cache_keep_warm(n: int) -> None:
    """How many unused opened handles stay open (default 0: a handle closes as soon as
    its last import is released). An opt-in, for producers that keep exported memory
    allocated (no ``torch.cuda.empty_cache()`` there): CUDA calls freeing exported memory
    while an importer still has its handle open undefined behaviour."""
    ops.cuda_ipc_cache_keep_warm(n)


def _size(size):
    if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
        return list(size[0])
    return list(size)


# --- interop with PyTorch's own CPU sharing (file_descriptor strategy) -------------------

def from_torch_shared(t: torch.Tensor) -> torch.Tensor:
    """A tensorwire tensor aliasing ``t``, whose storage PyTorch shares by fd (e.g. it
    arrived through a torch.multiprocessing Queue). Only for trusted peers: PyTorch's shm
    files are unsealed. Sending the result over tensorwire copies it once (peers accept
    only sealed segments)."""
    fd, nbytes = t.untyped_storage()._share_fd_cpu_()
    return ops.from_torch_fd(fd, nbytes, t.dtype, list(t.shape), list(t.stride()), t.storage_offset())


def _rebuild_from_torch_fd(df, nbytes, dtype, size, stride, offset):
    from torch.multiprocessing.reductions import rebuild_storage_fd

    storage = rebuild_storage_fd(torch.UntypedStorage, df, nbytes)  # PyTorch's own rebuild
    return torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)


class _TorchShared:
    def __init__(self, t):
        self.t = t

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        t = self.t
        fd, seg_len, byte_off = ops.segment_fd(t)
        try:
            df = DupFd(fd)  # duplicates fd for the receiving process
        finally:
            os.close(fd)
        if byte_off != 0:
            raise RuntimeError("tensorwire: the storage does not start the segment; PyTorch maps whole files")
        if seg_len != t.untyped_storage().nbytes():
            raise RuntimeError(f"tensorwire: segment of {seg_len} bytes holds a storage of "
                               f"{t.untyped_storage().nbytes()}; PyTorch maps whole files")
        return (_rebuild_from_torch_fd, (df, seg_len, t.dtype, tuple(t.shape), t.stride(), t.storage_offset()))


def to_torch_shared(t: torch.Tensor) -> _TorchShared:
    """A picklable handle for ``multiprocessing`` (Queue, Pipe, Process args): the
    receiver rebuilds it with PyTorch's own ``rebuild_storage_fd`` into a plain tensor
    over the same memory as ``t`` (which must live in a tensorwire segment)."""
    return _TorchShared(t)
