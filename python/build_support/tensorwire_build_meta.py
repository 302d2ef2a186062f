"""scikit-build-core metadata provider (pyproject.toml): the wheel's dependencies pin the
torch it is built against. libtensorwire_torch.so uses torch's C++ API (c10, ATen), whose
ABI changes between torch releases, so a wheel built against torch X must only be
installed with torch X."""

from __future__ import annotations

from typing import Any, Mapping


def dynamic_metadata(field: str, settings: Mapping[str, Any] | None = None) -> list[str]:
    """The ``dependencies`` list: ``torch==<public version of the importable torch>``."""
    if field != "dependencies":
        raise RuntimeError(f"tensorwire_build_meta provides only 'dependencies', not {field!r}")
    if settings:
        raise RuntimeError(f"tensorwire_build_meta takes no settings, got {sorted(settings)}")
    try:
        import torch
    except ImportError as e:  # pragma: no cover - the message is the point
        raise RuntimeError(
            "tensorwire builds against the installed torch: install torch first, then "
            "`pip install --no-build-isolation .`") from e
    # "2.15.0+cu132" -> "2.15.0": `torch==2.15.0` also matches local builds of it (PEP 440).
    public = torch.__version__.split("+", 1)[0]
    return [f"torch=={public}"]
