"""Finds and loads libtensorwire_torch.so (registering ``torch.ops.tensorwire``)."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch


def build_info() -> Optional[ModuleType]:
    """The installed build's facts (module ``tensorwire._build_info``: ``TORCH_VERSION``,
    ``TENSORWIRE_VERSION``, ``CUDA_BUILT``, ``LIBRARY``), or None when this package runs
    from a checkout without an install (a library built by cpp/build.sh)."""
    try:
        from . import _build_info as info
    except ImportError:
        return None
    return info


def library_path() -> str:
    """Path of the libtensorwire_torch.so that ``import tensorwire`` loads:
    ``$TENSORWIRE_TORCH_LIB`` if set (an override, e.g. a library built by cpp/build.sh),
    else the one installed with this package (pip), else a checkout's
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


def load() -> None:
    """Load the extension once (torch.ops.load_library is idempotent per path)."""
    path = library_path()
    if not os.path.exists(path):
        raise ImportError(f"tensorwire: {path} does not exist; install the package with "
                          "`pip install --no-build-isolation .`, or build the library with cpp/build.sh "
                          "and point TENSORWIRE_TORCH_LIB at libtensorwire_torch.so")
    torch.ops.load_library(path)


load()
ops = torch.ops.tensorwire
