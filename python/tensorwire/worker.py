"""The worker's side of :func:`tensorwire.rpc.spawn`: ``python -m tensorwire.worker
module:attr`` imports ``module``, takes ``attr`` (a class is instantiated once, with the
constructor arguments ``spawn(init_args=..., init_kwargs=...)`` passed as JSON in
``TENSORWIRE_WORKER_INIT``), and serves it as ``tensorwire.rpc.MAIN`` to the supervisor
that started this process, until the supervisor closes the connection: its public methods,
and ``__call__`` when it is callable (a function target). Started any other way it exits
with status 2 and says why (it needs the connection the supervisor leaves it)."""
from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from typing import Any, Optional

#: Where :func:`tensorwire.rpc.spawn` puts a class target's constructor arguments.
INIT_ENV = "TENSORWIRE_WORKER_INIT"


def resolve(target: str, init: Optional[str] = None) -> Any:
    """The object ``"module:attr.sub"`` names; a class is instantiated, with the
    arguments in ``init`` (JSON ``{"args": [...], "kwargs": {...}}``) when given."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"target {target!r} must be 'module:attribute'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if init is not None and not inspect.isclass(obj):
        raise TypeError(f"{target!r} is a {type(obj).__name__}, not a class: init_args / init_kwargs are for a class target")
    if not inspect.isclass(obj):
        return obj
    given = json.loads(init) if init is not None else {}
    return obj(*given.get("args", ()), **given.get("kwargs", {}))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m tensorwire.worker module:attr (started by tensorwire.rpc.spawn)", file=sys.stderr)
        return 2
    from . import _native
    from .rpc import MAIN

    # `python -m` puts the current directory first on the import path (unless -P did
    # not): the import path is what the supervisor named, nothing implicit.
    if not getattr(sys.flags, "safe_path", False) and sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
    try:
        # The sandbox's system-call policy before the target's code runs (its import).
        _native.enter_sandbox()
    except Exception as e:  # noqa: BLE001 - said to the supervisor through stderr and the exit status
        print(f"tensorwire.worker: cannot enter the sandbox: {type(e).__name__}: {e}", file=sys.stderr)
        return 5
    # Read once and kept from whatever the target starts.
    init = os.environ.pop(INIT_ENV, None)
    try:
        obj = resolve(argv[1], init)
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
