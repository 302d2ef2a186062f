"""``torch.ops.tensorwire.*`` as Python ops over ``tensorwire._native`` (no libtorch).

:func:`register` defines library ``tensorwire`` with the schemas of ``ops.schemas`` (the
list the C++ extension's ``TORCH_LIBRARY`` block defines too) and registers the
functions below as their kernels, on the keys the extension uses: ``CPU`` (and ``CUDA``
for ``send``) for the ops that take a tensor, ``CompositeExplicitAutograd`` for the others
(so ops without tensor arguments dispatch too). The fake implementations stay in
``_fake.py``, so opcheck and ``torch.compile`` see the same ops as with the extension.

Connections and listeners are int handles in a process-wide registry (``close`` forgets
one; an op on a forgotten handle raises ``"tensorwire.<op>: connection N is closed or was
never opened"``, as the extension does). Failures raise ``tensorwire.errors`` classes with
the extension's messages and codes: its own checks as the base ``Error`` (no code), the
library's as the class of their code. The checks on what ``_native`` is handed (a view's
dimensions and strides, fds, byte counts, whether a storage is a segment) are
``_native``'s, with the op's message; the ones here are on torch objects it never sees
(a tensor's layout and device, a torch dtype and its element size, a handle).

The package's hot path (``connection.py``) calls :func:`send`, :func:`recv`,
:func:`ring_send`, ... directly, skipping the dispatcher. Tensors come from ``_native`` as
DLPack capsules over byte storages; the dtype and view are applied here, with
``Tensor.set_`` (the storage's owner, an import or a segment, lives as long as the last
tensor over it). CUDA tensors and the ``cuda_*`` ops go to ``_cuda_ops``.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
from typing import Any, Optional

import torch

from . import _cuda_ops, _native
from .errors import Error

__all__ = ["SCHEMAS", "register"]

# ----------------------------------------------------------------------------------------
# Schemas: ops.schemas beside this module (shipped in the wheel), the one list the C++
# extension embeds too (cpp/CMakeLists.txt); `, CONNECTION_OPTIONS` stands for the
# connection options.

# The connection options (name, default), in schema order: the library's table.
OPTIONS = tuple((name, default) for name, _type, _min, _max, default, _doc, _choices in _native.connection_options())
_OPTIONS_SCHEMA = "".join(f", int {name}={default}" for name, default in OPTIONS)


def _read_schemas() -> tuple[str, ...]:
    with open(os.path.join(os.path.dirname(__file__), "ops.schemas"), encoding="utf-8") as f:
        lines = [line.strip() for line in f]
    return tuple(line.replace(", CONNECTION_OPTIONS", _OPTIONS_SCHEMA) for line in lines
                 if line and not line.startswith("#"))


SCHEMAS = _read_schemas()

# ----------------------------------------------------------------------------------------
# Handles.

_next_handle = itertools.count(1)  # one sequence for connections and listeners, as the extension's
_connections: dict[int, Any] = {}
_listeners: dict[int, Any] = {}
_lock = threading.Lock()


def _add(table: dict[int, Any], obj: Any) -> int:
    with _lock:
        h = next(_next_handle)
        table[h] = obj
    return h


def _connection(h: int, op: str) -> Any:
    """The live ``_native.Peer`` of handle ``h``. Callers never keep it in a local: a frame
    that an exception's traceback keeps (``pytest.raises``, a logged error) would keep the
    connection open after ``close`` (the extension's ops let go of it when they throw)."""
    try:
        return _connections[h]  # a dict read is atomic under the GIL
    except KeyError:
        raise Error(f"tensorwire.{op}: connection {h} is closed or was never opened") from None


def _listener(h: int, op: str) -> Any:
    try:
        return _listeners[h]
    except KeyError:
        raise Error(f"tensorwire.{op}: listener {h} is closed or was never opened") from None


def native_connection(h: int, op: str = "connection") -> Any:
    """The ``_native.Peer`` behind handle ``h`` (for ``_cuda_ops`` and tests)."""
    return _connection(h, op)


# ----------------------------------------------------------------------------------------
# dtypes and views (the one place torch dtypes meet tensorwire's names).

_BY_NAME: dict[str, torch.dtype] = {}
_SIZE: dict[torch.dtype, int] = {}   # dtype -> tensorwire's element size
_NAME: dict[torch.dtype, str] = {}
for _n, _s in _native.dtypes():
    _d = getattr(torch, _n, None)
    if isinstance(_d, torch.dtype):
        _BY_NAME[_n], _SIZE[_d], _NAME[_d] = _d, _s, _n
del _n, _s, _d
_CAPSULE = type(torch.empty(0).__dlpack__())


def _check_dtype(dtype: torch.dtype, what: str) -> None:
    size = _SIZE.get(dtype)
    if size is None:
        raise Error(f"tensorwire.{what}: dtype {dtype} is not supported by tensorwire "
                    "(bool, integer, floating, complex and float8 types are)")
    if size != dtype.itemsize:
        raise Error(f"tensorwire.{what}: dtype {dtype} has {dtype.itemsize}-byte elements in torch but {size} in "
                    "tensorwire")


def _check_strided_dtype(t: torch.Tensor, what: str, verb: str) -> None:
    if t.layout != torch.strided:
        raise Error(f"tensorwire.{what}: {t.layout} tensors cannot be {verb}; only strided (dense) ones")
    _check_dtype(t.dtype, what)


def _check_exportable(t: torch.Tensor, what: str) -> None:
    if t.device.type != "cpu":
        raise Error(f"tensorwire.{what}: tensor is on {t.device}; only CPU tensors can be shared here")
    _check_strided_dtype(t, what, "shared")


def _over(storage: torch.UntypedStorage, dtype: torch.dtype, sizes: Any, strides: Any, offset: int) -> torch.Tensor:
    """A tensor of ``dtype`` viewing ``storage`` (not a view of another tensor: no ``_base``)."""
    return torch.empty(0, dtype=dtype).set_(storage, offset, sizes, strides)


def _segment_tensor(size: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A fresh, zeroed, contiguous tensor in a new sealed segment (the extension's
    ``new_segment_tensor``)."""
    _check_dtype(dtype, "empty")
    strides, nbytes = _native.empty_layout(_NAME[dtype], size)  # checks the sizes
    storage = torch.from_dlpack(_native.segment_storage(nbytes)).untyped_storage()
    return _over(storage, dtype, size, strides, 0)


def _storage_kind(t: torch.Tensor) -> Optional[str]:
    s = t.untyped_storage()
    return _native.storage_kind(s.data_ptr(), s.nbytes())


# ----------------------------------------------------------------------------------------
# Storage ops.

def empty(size: list[int], dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    return _segment_tensor(list(size), dtype if dtype is not None else torch.get_default_dtype())


def zeros(size: list[int], dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    # New memfd pages read as zero: nothing to fill.
    return _segment_tensor(list(size), dtype if dtype is not None else torch.get_default_dtype())


def to_shared(self: torch.Tensor) -> torch.Tensor:
    _check_exportable(self, "to_shared")
    out = _segment_tensor(list(self.shape), self.dtype)
    out.copy_(self)  # resolves conjugate / negative bits too
    return out


def is_shared(self: torch.Tensor) -> bool:
    _check_exportable(self, "is_shared")
    return _zero_copy(self)


def _zero_copy(t: torch.Tensor) -> bool:
    # A conjugate/negative view would lose its lazy bit on the other side: copy it.
    if t.is_conj() or t.is_neg():
        return False
    return _storage_kind(t) in ("sealed", "import")


def share_(self: torch.Tensor) -> torch.Tensor:
    """Move the whole storage of ``self`` into a new sealed segment, in place (every view of
    the storage follows): the storage's data pointer is swapped with a segment storage's
    (``UntypedStorage._swap_data_ptr_``), whose old memory then goes with that storage."""
    _check_exportable(self, "share_")
    kind = _storage_kind(self)
    if kind == "sealed":
        return self
    if kind == "import":
        raise Error("tensorwire.share_: this storage is the peer's memory (a received tensor); send it as it is "
                    "(it is forwarded as the same memory) or copy it with tensorwire.to_shared")
    storage = self.untyped_storage()
    if not hasattr(storage, "_swap_data_ptr_"):
        # torch 2.11 has no way to swap a storage's memory in place from Python; refuse
        # before anything is allocated rather than move only some of the views.
        raise Error(f"tensorwire.share_: moving a storage in place needs UntypedStorage._swap_data_ptr_, which "
                    f"torch {torch.__version__} lacks (newer torch has it); use tensorwire.to_shared(t), which "
                    f"copies it once into a new shared tensor, or the C++ extension (TENSORWIRE_TORCH_LIB)")
    _move_into_segment(storage)
    return self


def share_for_send(storage: torch.UntypedStorage) -> bool:
    """``tensorwire.rpc``'s first trip of a large ordinary tensor: move ``storage`` into a
    new sealed segment in place, as :func:`share_` does (every view of it follows, and
    later sends are zero-copy). False, with nothing changed, where it cannot move: a torch
    without ``UntypedStorage._swap_data_ptr_``, or a storage in shared memory already
    (``share_memory_()``, a torch.multiprocessing peer's): moving it would cut that
    sharing. The caller then copies the view."""
    if not hasattr(storage, "_swap_data_ptr_") or storage.is_shared():
        return False
    _move_into_segment(storage)
    return True


def _move_into_segment(storage: torch.UntypedStorage) -> None:
    """Copy ``storage`` into a new sealed segment and swap that memory in under it, so
    every view of the storage follows; then make it not resizable (``_freeze``)."""
    nbytes = storage.nbytes()
    seg = torch.from_dlpack(_native.segment_storage(nbytes)).untyped_storage()
    if nbytes:
        seg.copy_(storage)
    # Both callers checked that this torch has it (2.11 does not).
    getattr(storage, "_swap_data_ptr_")(seg)
    _freeze(storage)


def _freeze(storage: torch.UntypedStorage) -> None:
    """Make ``storage`` not resizable (its size is the segment's, sealed): a resize must
    fail, not reallocate behind the peer's back. Torch has no Python setter for this; see
    ``_resizable_flag``."""
    flag = _resizable_flag()
    if flag is not None:
        flag(storage, False)


_RESIZABLE: Any = ...


def _resizable_flag() -> Any:
    """A setter of ``StorageImpl::resizable_`` through ``ctypes``, or None where it cannot be
    found safely. Torch exposes no setter for the flag the extension sets with
    ``set_resizable(false)``; its offset is found once by comparing a resizable storage
    with a non-resizable one (a DLPack storage) byte by byte, and every write is checked
    through ``UntypedStorage.resizable()`` (restored on a mismatch)."""
    global _RESIZABLE
    if _RESIZABLE is not ...:
        return _RESIZABLE
    _RESIZABLE = None
    try:
        import ctypes

        window = 128
        a = torch.empty(8, dtype=torch.uint8).untyped_storage()
        b = torch.from_dlpack(_native.segment_storage(8)).untyped_storage()
        if not a.resizable() or b.resizable():
            return None
        ra = ctypes.string_at(a._cdata, window)
        rb = ctypes.string_at(b._cdata, window)
        candidates = [i for i in range(window) if ra[i] == 1 and rb[i] == 0]
        for off in candidates:
            cell = ctypes.c_uint8.from_address(a._cdata + off)
            cell.value = 0
            ok = not a.resizable()
            cell.value = 1
            if ok and a.resizable():
                def set_flag(storage: torch.UntypedStorage, value: bool, off: int = off) -> None:
                    c = ctypes.c_uint8.from_address(storage._cdata + off)
                    old = c.value
                    c.value = int(value)
                    if storage.resizable() != value:
                        c.value = old
                _RESIZABLE = set_flag
                break
    except Exception:
        _RESIZABLE = None
    return _RESIZABLE


def segment_fd(self: torch.Tensor) -> tuple[int, int, int]:
    if self.device.type != "cpu":
        raise Error("tensorwire.segment_fd: expected a defined CPU tensor")
    s = self.untyped_storage()
    return _native.segment_fd(s.data_ptr(), s.nbytes())  # refuses a storage in no segment


def from_torch_fd(fd: int, nbytes: int, dtype: torch.dtype, size: list[int], stride: list[int],
                  storage_offset: int = 0) -> torch.Tensor:
    _check_dtype(dtype, "from_torch_fd")  # the torch dtype; the rest is _native's to check
    size, stride = list(size), list(stride)
    # Over a close-on-exec duplicate of fd (fd stays the caller's).
    cap = _native.trusted_fd_storage(fd, nbytes, _NAME[dtype], size, stride, storage_offset)
    return _over(torch.from_dlpack(cap).untyped_storage(), dtype, size, stride, storage_offset)


# ----------------------------------------------------------------------------------------
# Connections.

_OPTION_NAMES = frozenset(name for name, _ in OPTIONS)


def _option_list(kw: dict[str, int]) -> list[int]:
    """The options in schema order (the dispatcher passes every one; a direct call may leave
    some out: their defaults)."""
    if not _OPTION_NAMES.issuperset(kw):
        raise TypeError(f"unexpected connection option(s): {sorted(set(kw) - _OPTION_NAMES)}")
    return [kw.get(name, default) for name, default in OPTIONS]


def socketpair() -> tuple[int, int]:
    # As tw_socketpair: a connected AF_UNIX SOCK_SEQPACKET pair, close-on-exec (Python's
    # sockets are created non-inheritable).
    try:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    except OSError as e:
        raise _native.library_error("Resource", f"tw_socketpair: socketpair(AF_UNIX, SOCK_SEQPACKET): {e}") from None
    return a.detach(), b.detach()


def set_inheritable(fd: int, inheritable: bool) -> None:
    if not 0 <= fd <= 2**31 - 1:
        raise Error(f"tensorwire.set_inheritable: fd {fd} is not a valid descriptor")
    try:
        os.set_inheritable(fd, inheritable)
    except OSError as e:
        raise _native.library_error("Io", f"tw_fd_set_inheritable: {e}") from None


def from_fd(fd: int, **options: int) -> int:
    return _add(_connections, _native.Peer.from_fd(fd, _option_list(options)))


def connect(path: str, **options: int) -> int:
    return _add(_connections, _native.Peer.connect(path, _option_list(options)))


def listen(path: str) -> int:
    return _add(_listeners, _native.Listener.bind(path))


def accept(listener: int, timeout_ms: int = -1, **options: int) -> int:
    opts = _option_list(options)
    lst = _listeners.get(listener)
    if lst is None:
        _native.check_connection_options(opts)  # the options are checked first, as the extension does
        lst = _listener(listener, "accept")
    return _add(_connections, lst.accept(timeout_ms, opts))


def close(conn: int) -> None:
    with _lock:
        peer = _connections.pop(conn, None)
    del peer  # freed here unless an op in flight still holds it


def close_listener(listener: int) -> None:
    with _lock:
        lst = _listeners.pop(listener, None)
    if lst is not None:
        lst.close()


def peer_pid(conn: int) -> int:
    return _connection(conn, "peer_pid").peer_pid()


# The largest packed view a send copies into a recycled segment (the binding's pool);
# larger ones are copied into a fresh segment, as before.
_POOLED_MAX = _native.pool_stats()["max_pooled"]


def send(conn: int, tensor: torch.Tensor, tag: int = 0, window_ms: int = 0) -> bool:
    if tensor.is_cuda:
        return _cuda_ops.send(_connection(conn, "send"), tensor, tag, window_ms)
    _check_exportable(tensor, "send")
    # A negative tag or window_ms: refused by _native's send, with the extension's message.
    _connection(conn, "send")  # checked here, as the extension does; not kept (see _connection)
    s = tensor.untyped_storage()
    kind = None if tensor.is_conj() or tensor.is_neg() else _native.storage_kind(s.data_ptr(), s.nbytes())
    zero_copy = kind in ("sealed", "import")
    if not zero_copy and not (tensor.is_conj() or tensor.is_neg()) \
            and tensor.numel() * tensor.element_size() <= _POOLED_MAX:
        # Small and medium private tensors: packed into a recycled segment of the binding's
        # pool (no fresh memfd per send); the lease holds that segment, not the tensor.
        s = tensor.untyped_storage()
        _connection(conn, "send").send(s.data_ptr(), s.nbytes(), _NAME[tensor.dtype], tensor.shape, tensor.stride(),
                                       tensor.storage_offset(), tag, None, window_ms, None, True)
        return False
    src = tensor if zero_copy else to_shared(tensor)
    s = src.untyped_storage()
    # A segment's lease holds a reference to the torch storage too, as the extension's lease
    # holds a c10::Storage: a fresh alias (a Python storage object is cached per storage, so
    # holding it would not count as a reference). Its decref may wait for the next call into
    # _native (the lease can end on the reaper thread, without the GIL); a forwarded import
    # needs none (the lease holds the import), so nothing upstream waits on a decref.
    owner = None if kind == "import" else src.detach()
    _connection(conn, "send").send(s.data_ptr(), s.nbytes(), _NAME[src.dtype], src.shape, src.stride(),
                                   src.storage_offset(), tag, None, window_ms, owner)
    return zero_copy


def recv(conn: int, timeout_ms: int = -1) -> tuple[torch.Tensor, int]:
    got, name, sizes, strides, offset, tag = _connection(conn, "recv").recv(None, timeout_ms)
    if type(got) is not _CAPSULE:
        return _cuda_ops.finish_recv(got, name, sizes, strides, offset), tag
    dtype = _BY_NAME.get(name)
    if dtype is None:
        raise Error(f"tensorwire.recv: dtype {name} is unknown to this torch")
    return _over(torch.from_dlpack(got).untyped_storage(), dtype, sizes, strides, offset), tag


def stats(conn: int) -> list[int]:
    return _connection(conn, "stats").stats_list()


def ring_send(conn: int, tensor: torch.Tensor, tag: int = 0, timeout_ms: int = -1) -> None:
    if tensor.is_cuda and tensor.layout == torch.strided:
        return _cuda_ops.ring_send(_connection(conn, "ring_send"), tensor, tag, timeout_ms)
    if tensor.device.type not in ("cpu", "cuda"):
        raise Error(f"tensorwire.ring_send: tensor is on {tensor.device}; the rings carry CPU tensors (CPU ring) and "
                    "CUDA tensors (GPU ring)")
    _check_strided_dtype(tensor, "ring_send", "sent")
    # A negative tag: refused by _native.ring_send, with the extension's message.
    _connection(conn, "ring_send")  # checked here, as the extension does; not kept
    # The ring carries bytes: a lazy conjugate/negative bit is applied first.
    src = tensor.resolve_conj().resolve_neg() if tensor.is_conj() or tensor.is_neg() else tensor
    s = src.untyped_storage()
    _native.ring_send(_connection(conn, "ring_send"), s.data_ptr(), s.nbytes(), _NAME[src.dtype], src.shape, src.stride(), src.storage_offset(),
                      tag, timeout_ms)


def ring_recv(conn: int, timeout_ms: int = -1) -> tuple[torch.Tensor, int]:
    cap, name, sizes, strides, tag = _native.ring_recv(_connection(conn, "ring_recv"), timeout_ms)
    dtype = _BY_NAME.get(name)
    if dtype is None:
        raise Error(f"tensorwire.ring_recv: dtype {name} is unknown to this torch")
    if cap is None:  # nothing to own (an empty tensor)
        return torch.empty_strided(sizes, strides, dtype=dtype), tag
    raw = torch.from_dlpack(cap)
    if raw.data_ptr() % dtype.itemsize:
        raw = raw.clone()  # bytes not aligned for the dtype: a fresh (aligned) copy
    return _over(raw.untyped_storage(), dtype, sizes, strides, 0), tag


def cuda_ring_recv(conn: int, timeout_ms: int = -1) -> tuple[torch.Tensor, int]:
    return _cuda_ops.ring_recv(_connection(conn, "cuda_ring_recv"), timeout_ms)


def cuda_built() -> bool:
    return _cuda_ops.cuda_built()


def cuda_available() -> bool:
    return _cuda_ops.cuda_available()


def cuda_device_count() -> int:
    return _cuda_ops.cuda_device_count()


def cuda_ipc_cache_stats() -> list[int]:
    return list(_cuda_ops.cuda_ipc_cache_stats())


def cuda_ipc_cache_keep_warm(n: int) -> None:
    _cuda_ops.cuda_ipc_cache_keep_warm(n)


# ----------------------------------------------------------------------------------------
# Registration.

# Ops that take a tensor, by the keys the extension registers them on (send has a CUDA
# kernel too, as cuda.cpp / cuda_info.cpp give it); every other op is
# CompositeExplicitAutograd (no tensor arguments, or any device, as ring_send).
_KEYS = {"to_shared": ("CPU",), "share_": ("CPU",), "is_shared": ("CPU",), "segment_fd": ("CPU",),
         "send": ("CPU", "CUDA")}

_library: Optional[torch.library.Library] = None


def register() -> None:
    """Define ``torch.ops.tensorwire`` over ``_native`` (once per process)."""
    global _library
    if _library is not None:
        return
    lib = torch.library.Library("tensorwire", "DEF")
    for schema in SCHEMAS:
        name = schema.split("(", 1)[0]
        lib.define(schema)
        fn = globals()[name]
        for key in _KEYS.get(name, ("CompositeExplicitAutograd",)):
            lib.impl(name, fn, key)
    _library = lib
