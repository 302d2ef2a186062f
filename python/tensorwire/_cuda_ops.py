"""The torch side of CUDA over ``tensorwire._native`` (``python/native/src/cuda.rs``): what
``cpp/src/cuda.cpp`` does in C++, for the Python ops that replace ``torch.ops.tensorwire``.

Every call passes torch's *current stream* of the tensor's device as a ``cudaStream_t``
int (``torch.cuda.current_stream(d).cuda_stream``): an export is ordered after the work
queued there; a received tensor is ordered on it (the connection's ``cuda_wait``), and
its lease is released once the work queued on that same stream — the one current at
``recv`` — has completed when torch's last view of it dies (the C++ op does the same).
Work on other streams that reads a received tensor must be ordered before that stream's
later work by the caller.

Dtype names are torch's (``str(dtype).removeprefix("torch.")``), as on the CPU path.
"""
from __future__ import annotations

import threading
from typing import Any, List, Tuple

import torch

from . import _native


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise RuntimeError(f"tensorwire: the peer sent dtype {name}, which this torch does not have")
    return dt


def _check_cuda(tensor: torch.Tensor, op: str, verb: str) -> None:
    if not (isinstance(tensor, torch.Tensor) and tensor.is_cuda):
        raise RuntimeError(f"tensorwire.{op}: expected a CUDA tensor")
    if tensor.layout != torch.strided:
        raise RuntimeError(f"tensorwire.{op}: {tensor.layout} tensors cannot be {verb}; only strided (dense) ones")


def _check_visible(device: int, what: str) -> None:
    visible = torch.cuda.device_count()
    if not 0 <= device < visible:
        raise RuntimeError(f"tensorwire.{what} CUDA device {device}; this process sees {visible} CUDA device(s) "
                           "(check CUDA_VISIBLE_DEVICES on both sides)")


def export_parts(tensor: torch.Tensor) -> Tuple[Any, int, int, int, int, str, List[int], List[int], int, bool]:
    """What a CUDA export of ``tensor`` needs, read under the tensor's device: ``(storage,
    storage_ptr, storage_nbytes, device, stream, dtype_name, sizes, strides,
    storage_offset, zero_copy)``. ``storage`` (the allocation's ``UntypedStorage``) is
    what the lease holds; ``stream`` is the device's current stream, the export ordered
    after its queued work. A conjugate/negative view is resolved first and an empty
    storage replaced (copies, ``zero_copy`` false). Shared by :func:`send` and
    ``tensorwire.rpc``'s values (``python/native/src/rpc/values.rs``)."""
    with torch.cuda.device(tensor.device):
        zero_copy = not tensor.is_conj() and not tensor.is_neg()
        src = tensor if zero_copy else tensor.resolve_conj().resolve_neg()
        if src.untyped_storage().nbytes() == 0:
            # One element the (empty) view never touches: the consumer still gets the
            # right device and shape.
            holder = torch.empty(1, dtype=src.dtype, device=src.device)
            src = holder.as_strided(src.size(), src.stride(), 0)
            zero_copy = False
        storage = src.untyped_storage()
        stream = torch.cuda.current_stream(src.device).cuda_stream
        return (storage, storage.data_ptr(), storage.nbytes(), src.device.index, stream, _dtype_name(src.dtype),
                list(src.size()), list(src.stride()), int(src.storage_offset()), zero_copy)


def send(native_conn: Any, tensor: torch.Tensor, tag: int = 0, window_ms: int = 0) -> bool:
    """Export the CUDA ``tensor``'s storage after the work queued on the current stream;
    true if zero-copy (the consumer sees this memory). A received CUDA tensor (any view of
    it) is sent on as the same memory. A conjugate/negative view is resolved first (a
    copy, as is an empty storage, which has no allocation to share)."""
    _check_cuda(tensor, "send", "shared")
    # A negative tag or window_ms: refused by _native.cuda_send, with the extension's message.
    storage, ptr, nbytes, device, stream, dtype_name, sizes, strides, offset, zero_copy = export_parts(tensor)
    # The lease holds `storage` (a reference to the allocation) until it ends.
    _native.cuda_send(native_conn, storage, ptr, nbytes, device, stream, dtype_name, sizes, strides, offset,
                      tag, window_ms)
    return zero_copy


def import_stream(device: int) -> int:
    """The current stream of ``device`` as an int, for ``tensorwire.rpc`` to order a
    received CUDA tensor on (``python/native/src/rpc/values.rs``). A device this process
    does not see is ``tensorwire.errors.CudaUnavailable``."""
    visible = torch.cuda.device_count()
    if not 0 <= device < visible:
        # The library's class, code and message prefix for the kind (its table).
        raise _native.library_error("CudaUnavailable", f"tensorwire.rpc: the peer sent a tensor of CUDA device "
                                    f"{device}; this process sees {visible} CUDA device(s) (check "
                                    "CUDA_VISIBLE_DEVICES on both sides)")
    return torch.cuda.current_stream(device).cuda_stream


def tensor_of_capsule(capsule: Any, dtype_name: str, sizes: List[int], strides: List[int],
                      storage_offset: int) -> torch.Tensor:
    """The producer's view over a kDLCUDA capsule of a whole imported storage (1-D uint8;
    its owner ends the lease when torch's last view dies)."""
    dtype = _dtype(dtype_name)
    raw = torch.from_dlpack(capsule)  # 1-D uint8, the whole storage
    itemsize = torch.empty(0, dtype=dtype).element_size()
    tail = raw.numel() % itemsize  # a storage made for a smaller dtype: never viewed
    if tail:
        raw = raw[: raw.numel() - tail]
    return raw.view(dtype).as_strided(sizes, strides, storage_offset)


def finish_recv(pending: Any, dtype_name: str, sizes: List[int], strides: List[int],
                storage_offset: int) -> torch.Tensor:
    """The tensor of a received CUDA import (``_native.CudaPending``): the current stream of
    its device waits for the producer, then torch gets its storage by DLPack."""
    device = pending.device
    _check_visible(device, "recv: the peer sent a tensor of")
    _dtype(dtype_name)
    stream = torch.cuda.current_stream(device).cuda_stream
    return tensor_of_capsule(pending.capsule(stream), dtype_name, sizes, strides, storage_offset)


def ring_send(native_conn: Any, tensor: torch.Tensor, tag: int = 0, timeout_ms: int = -1) -> None:
    """Copy the CUDA ``tensor`` through the connection's GPU ring: packed on the current
    stream (a no-op if contiguous), copied in there; nothing synchronizes. The packed
    source is used by work on the current stream only, so the caching allocator keeps it
    valid until the copies ran."""
    _check_cuda(tensor, "ring_send", "sent")
    # A negative tag: refused by _native.cuda_ring_send, with the extension's message.
    with torch.cuda.device(tensor.device):
        src = tensor.resolve_conj().resolve_neg().contiguous()
        stream = torch.cuda.current_stream(src.device).cuda_stream
        _native.cuda_ring_send(native_conn, src.data_ptr(), src.device.index, stream, _dtype_name(src.dtype),
                               list(src.size()), list(src.stride()), tag, timeout_ms)


# One receiver at a time per connection between cuda_ring_recv and its finish (as the C++
# op's mutex): a second thread would be described the same message. Keyed by id(); an
# entry outlives its connection (a few bytes; a reused id shares an idle lock).
_ring_locks: dict = {}
_ring_locks_guard = threading.Lock()


def _ring_lock(native_conn: Any) -> threading.Lock:
    with _ring_locks_guard:
        return _ring_locks.setdefault(id(native_conn), threading.Lock())


def ring_recv(native_conn: Any, timeout_ms: int = -1) -> Tuple[torch.Tensor, int]:
    """The next tensor of the peer's GPU ring, as a fresh contiguous tensor on the ring's
    device, copied out on the current stream after the producer's copy in; and its tag."""
    with _ring_lock(native_conn):
        tag, dtype_name, sizes, device, nbytes = _native.cuda_ring_recv(native_conn, timeout_ms)
        try:
            _check_visible(device, "cuda_ring_recv: the peer's GPU ring is on")
            dtype = _dtype(dtype_name)
            with torch.cuda.device(device):
                out = torch.empty(sizes, dtype=dtype, device=torch.device("cuda", device))
                if out.numel() * out.element_size() != nbytes:
                    raise RuntimeError(f"tensorwire.cuda_ring_recv: {nbytes} bytes do not make a {list(sizes)} "
                                       f"tensor of {dtype}")
                stream = torch.cuda.current_stream(device).cuda_stream
                _native.cuda_ring_recv_finish(native_conn, out.data_ptr(), nbytes, stream, timeout_ms)
            return out, tag
        except BaseException:
            # Free the message's slots (a no-op if finish consumed or broke it) so the
            # producer is not left waiting for them.
            try:
                _native.cuda_ring_discard(native_conn, timeout_ms)
            except Exception:
                pass
            raise


def cuda_built() -> bool:
    """True: the binding has CUDA (it loads the driver at run time)."""
    return bool(_native.cuda_built())


def cuda_available() -> bool:
    """True if a CUDA driver is present and initialised."""
    return bool(_native.cuda_available())


def cuda_device_count() -> int:
    """Number of CUDA devices; ``CudaUnavailable`` with the reason without a driver."""
    return int(_native.cuda_device_count())


def cuda_ipc_cache_stats() -> List[int]:
    """``[cuIpcOpenMemHandle calls so far, handles open now]`` of this process."""
    return [int(x) for x in _native.cuda_ipc_cache_stats()]


def cuda_ipc_cache_keep_warm(n: int) -> None:
    """How many unused opened IPC handles stay open (default 0)."""
    _native.cuda_ipc_cache_keep_warm(n)
