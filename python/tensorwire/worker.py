"""The worker's side of :func:`tensorwire.rpc.spawn`: ``python -m tensorwire.worker
module:attr`` imports ``module``, takes ``attr`` (a class is instantiated once), and serves
it as ``tensorwire.rpc.MAIN`` to the supervisor that started this process, until the
supervisor closes the connection. Started any other way it exits with status 2 and says
why (it needs the connection the supervisor leaves it)."""
from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any


def resolve(target: str) -> Any:
    """The object ``"module:attr.sub"`` names; a class is instantiated (no arguments)."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"target {target!r} must be 'module:attribute'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj() if inspect.isclass(obj) else obj


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m tensorwire.worker module:attr (started by tensorwire.rpc.spawn)", file=sys.stderr)
        return 2
    from . import _native
    from .rpc import MAIN

    try:
        obj = resolve(argv[1])
    except Exception as e:  # noqa: BLE001 - said to the supervisor through stderr and the exit status
        print(f"tensorwire.worker: cannot load {argv[1]!r}: {type(e).__name__}: {e}", file=sys.stderr)
        return 3
    try:
        _native.serve_worker({MAIN: obj})
    except Exception as e:  # noqa: BLE001
        print(f"tensorwire.worker: {type(e).__name__}: {e}", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
