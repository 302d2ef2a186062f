"""The import-time check of the torch this process has against the range the wheel was
built and tested for (``tensorwire._native.build_info()``: ``torch_min``, ``torch_below``,
``torch_tested``; the wheel's ``Requires-Dist`` says the same range).

Nothing in the wheel links torch's C++ ABI, so a torch outside the range usually still
loads it; what may differ is the Python-level API the package uses (``torch.library``,
``torch.from_dlpack``). Hence: an older torch than ``torch_min`` is refused with an
``ImportError`` saying what was found and what to do; a newer one than the range warns
once (``RuntimeWarning``) and goes ahead. ``TENSORWIRE_SKIP_TORCH_CHECK=1`` skips both.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Iterable, Mapping, Optional, cast


def _release(version: str) -> tuple[int, ...]:
    """``"2.15.0+cu132"`` / ``"2.16.0.dev20261101"`` -> ``(2, 15, 0)`` / ``(2, 16, 0)``."""
    m = re.match(r"(\d+(?:\.\d+)*)", version)
    if not m:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(x) for x in m.group(1).split("."))


def problem(found: str, info: Mapping[str, object]) -> Optional[tuple[str, str]]:
    """``None`` if ``found`` is in the range, else ``("old" | "new", message)``."""
    lo, hi = str(info["torch_min"]), str(info["torch_below"])
    tested = ", ".join(str(v) for v in cast(Iterable[object], info["torch_tested"]))
    built = (f"tensorwire {info['version']} is built for torch >= {lo}, < {hi} "
             f"(tested with {tested}); this process has torch {found}")
    rel = _release(found)
    if rel < _release(lo):
        return "old", (f"{built}. Install a torch in that range (pip install 'torch>={lo},<{hi}'), "
                       f"or a tensorwire release made for torch {found}; "
                       f"TENSORWIRE_SKIP_TORCH_CHECK=1 imports it anyway, unsupported.")
    if rel[:2] >= _release(hi)[:2]:
        return "new", (f"{built}, newer than the range: it is expected to work (the binding does not "
                       f"link torch) but is untested; TENSORWIRE_SKIP_TORCH_CHECK=1 silences this.")
    return None


def check(found: str, info: Mapping[str, object]) -> None:
    """Raise or warn as the module docstring says."""
    if os.environ.get("TENSORWIRE_SKIP_TORCH_CHECK") == "1":
        return
    p = problem(found, info)
    if p is None:
        return
    kind, msg = p
    if kind == "old":
        raise ImportError(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
