"""Registers ``torch.ops.tensorwire``: by default as Python ops over ``tensorwire._native``
(``_ops.py``, no libtorch); with ``$TENSORWIRE_TORCH_LIB`` set, by loading that C++
extension (libtensorwire_torch.so) instead, the route its own tests take."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def build_info() -> dict[str, Any]:
    """What this install is: the binding's facts (``tensorwire._native.build_info()``:
    ``version``, ``cuda_built`` — always True, the driver loads at run time —,
    ``ucx_built`` — whether ``tensorwire.rpc`` has remote tensors (the ``ucx`` cargo
    feature; the wheel has not) —, ``torch_min``, ``torch_below``, ``torch_tested``) plus ``backend`` (``"native"`` or
    ``"torch-lib"``, see ``BACKEND``), ``library`` (``library_path()``) and ``torch`` (the
    torch this process runs). With the C++ extension, ``cuda_built`` is the extension's."""
    if BACKEND == "torch-lib":
        # The C++ extension may run from a checkout that has no binding built.
        try:
            from . import _native

            info: dict[str, Any] = dict(_native.build_info())
        except ImportError:
            from ._version import __version__

            info = {"version": __version__}
        info["cuda_built"] = bool(torch.ops.tensorwire.cuda_built())
    else:
        from . import _native

        info = dict(_native.build_info())
    info.update(backend=BACKEND, library=library_path(), torch=torch.__version__)
    return info


def library_path() -> str:
    """The file ``torch.ops.tensorwire`` runs on: the binding ``tensorwire/_native.abi3.so``
    by default, the C++ extension ``$TENSORWIRE_TORCH_LIB`` when that is set."""
    env = os.environ.get("TENSORWIRE_TORCH_LIB")
    if env:
        return env
    from . import _native

    return str(Path(_native.__file__).resolve())


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
    path = os.environ["TENSORWIRE_TORCH_LIB"]
    if not os.path.exists(path):
        raise ImportError(f"tensorwire: TENSORWIRE_TORCH_LIB={path} does not exist; build the C++ extension with "
                          "cpp/build.sh and point TENSORWIRE_TORCH_LIB at its libtensorwire_torch.so, or unset it "
                          "to use the ops over tensorwire._native")
    torch.ops.load_library(path)


def _check_torch() -> None:
    """The import-time check of this torch against the wheel's range (``_torch_check``).
    Not for the C++ extension: it is built for one torch, and loading it is its check."""
    if BACKEND != "native":
        return
    from . import _native, _torch_check

    _torch_check.check(torch.__version__, _native.build_info())


_check_torch()
load()
ops = torch.ops.tensorwire
