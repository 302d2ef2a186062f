"""Registers ``torch.ops.tensorwire``: by default as Python ops over ``tensorwire._native``
(``_ops.py``, no libtorch); with ``$TENSORWIRE_TORCH_LIB`` set, by loading that C++
extension (libtensorwire_torch.so) instead, the route its own tests take."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch


def build_info() -> Optional[ModuleType]:
    """The installed build's facts (module ``tensorwire._build_info``: ``TORCH_VERSION``,
    ``TENSORWIRE_VERSION``, ``CUDA_BUILT``, ``LIBRARY``), or None when this package runs
    from a checkout without an install (a library built by cpp/build.sh). The binding's own
    facts are ``tensorwire._native.build_info()``."""
    try:
        from . import _build_info as info
    except ImportError:
        return None
    return info


def library_path() -> str:
    """Path of the C++ extension libtensorwire_torch.so (loaded only when
    ``$TENSORWIRE_TORCH_LIB`` is set): ``$TENSORWIRE_TORCH_LIB`` if set, else the one
    installed with this package (pip), else a checkout's
    ``build/torch-ext/libtensorwire_torch.so``."""
    env = os.environ.get("TENSORWIRE_TORCH_LIB")
    if env:
        return env
    info = build_info()
    if info is not None:
        # _build_info.py is installed beside the library; in an editable install it is
        # the site-packages copy (the .py sources are the checkout's), so ask it.
        return str(Path(info.__file__).with_name(info.LIBRARY))
    return str(Path(__file__).resolve().parents[2] / "build" / "torch-ext" / "libtensorwire_torch.so")


#: Which implementation ``torch.ops.tensorwire`` runs on: ``"native"`` (Python ops over
#: ``tensorwire._native``, the default) or ``"torch-lib"`` (the C++ extension named by
#: ``$TENSORWIRE_TORCH_LIB``).
BACKEND = "torch-lib" if os.environ.get("TENSORWIRE_TORCH_LIB") else "native"


def load() -> None:
    """Register the ops once: the C++ extension at ``$TENSORWIRE_TORCH_LIB`` if set
    (torch.ops.load_library is idempotent per path), else the Python ops of ``_ops``."""
    if BACKEND == "native":
        from . import _ops

        _ops.register()
        return
    path = library_path()
    if not os.path.exists(path):
        raise ImportError(f"tensorwire: TENSORWIRE_TORCH_LIB={path} does not exist; build the C++ extension with "
                          "cpp/build.sh and point TENSORWIRE_TORCH_LIB at its libtensorwire_torch.so, or unset it "
                          "to use the ops over tensorwire._native")
    torch.ops.load_library(path)


load()
ops = torch.ops.tensorwire
