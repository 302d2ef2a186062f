"""The CUDA half of the ops over ``tensorwire._native`` (``_ops.py`` calls these for CUDA
tensors and the ``cuda_*`` ops).

PLACEHOLDER: this package's ``_native`` has no CUDA module yet, so this file answers as
the C++ extension does without a driver (``cuda_built``/``cuda_available`` False,
``cuda_device_count`` raises :class:`CudaUnavailable`, the cache is empty) and refuses
CUDA tensors. The CUDA module's own ``_cuda_ops.py`` replaces it."""

from __future__ import annotations

from typing import Any

import torch

from .errors import CudaUnavailable, Error, Refused

_REFUSED = "tensorwire: CUDA tensors need the CUDA module of tensorwire._native"


def _refused() -> Refused:
    return Refused(_REFUSED, "TW_ERR_INVALID_ARGUMENT")


def send(native_conn: Any, tensor: torch.Tensor, tag: int, window_ms: int) -> bool:
    """Export a CUDA tensor (here: refused)."""
    raise _refused()


def finish_recv(pending: Any, dtype_name: str, sizes: list[int], strides: list[int], storage_offset: int) -> torch.Tensor:
    """The tensor of a received CUDA import, ordered on the current stream (here: refused)."""
    raise _refused()


def ring_send(native_conn: Any, tensor: torch.Tensor, tag: int, timeout_ms: int) -> None:
    """A CUDA tensor through the GPU ring (here: refused)."""
    raise _refused()


def ring_recv(native_conn: Any, timeout_ms: int) -> tuple[torch.Tensor, int]:
    """The next GPU ring tensor and its tag (here: refused)."""
    raise _refused()


def cuda_built() -> bool:
    """Whether this ``_native`` has its CUDA module (here: no)."""
    return False


def cuda_available() -> bool:
    """Whether CUDA tensors can travel (here: no)."""
    return False


def cuda_device_count() -> int:
    """Devices tensorwire sees; without the CUDA module, :class:`CudaUnavailable`."""
    raise CudaUnavailable("tensorwire (TW_ERR_CUDA_UNAVAILABLE): tw_cuda_device_count: CUDA unavailable: "
                          "no NVIDIA driver support in this build (the CUDA module of tensorwire._native is missing)",
                          "TW_ERR_CUDA_UNAVAILABLE")


def cuda_ipc_cache_stats() -> list[int]:
    """``[opens, open_handles]`` of the IPC handle cache (nothing was ever opened)."""
    return [0, 0]


def cuda_ipc_cache_keep_warm(n: int) -> None:
    """How many unused opened handles stay open; checked, nothing to keep here."""
    if n < 0:
        raise Error(f"tensorwire.cuda_ipc_cache_keep_warm: n must be >= 0, got {n}")
