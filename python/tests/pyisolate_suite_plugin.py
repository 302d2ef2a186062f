"""pytest plugin for running pyisolate 0.10.2's own test suite with tensorwire's adapter
in every host it creates (scripts/pyisolate-suite.sh; nothing of pyisolate is edited).

Loaded with ``-p pyisolate_suite_plugin`` and ``TW_PYISOLATE_SUITE_ADAPTER=1``, it wraps
pyisolate's child launch (``Extension._launch_with_uds``): for that launch the adapter
registered with pyisolate is ``tensorwire.pyisolate.compose()`` of the test's own adapter
(``TensorwireAdapter()`` where the test registered none), and the test's adapter is
registered again afterwards, so a test looking at pyisolate's registry sees its own. An
adapter pyisolate could not rehydrate in a child either (its class defined in a function)
is left alone. With ``$TW_PYISOLATE_CHILD_DELAY_S`` (in both runs) it also binds
pyisolate_delay into sandboxed children, which see only what bubblewrap binds. At the end
it prints how many launches were wrapped, how many children paired and how many tensors
went through tensorwire (exports sent, references taken) in the host."""

from __future__ import annotations

import os
from typing import Any

_counts = {"launches": 0, "composed": 0, "left_alone": 0, "paired": 0, "exports": 0, "takes": 0}


def _delay_sandboxed_children() -> None:
    """With ``$TW_PYISOLATE_CHILD_DELAY_S``, children in bubblewrap must see
    pyisolate_delay (on their PYTHONPATH, but bubblewrap shows them only what it binds):
    bind it read-only, in both runs."""
    from pyisolate._internal import host as host_internal

    delay_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pyisolate_delay")
    build = host_internal.build_bwrap_command

    def build_with_delay(*args: Any, **kwargs: Any) -> list[str]:
        cmd = build(*args, **kwargs)
        at = len(cmd) - 3  # before [python, "-m", "pyisolate._internal.uds_client"]
        return cmd[:at] + ["--ro-bind", delay_dir, delay_dir] + cmd[at:]

    host_internal.build_bwrap_command = build_with_delay


def pytest_configure(config: Any) -> None:
    if os.environ.get("TW_PYISOLATE_CHILD_DELAY_S"):
        _delay_sandboxed_children()
    if os.environ.get("TW_PYISOLATE_SUITE_ADAPTER") != "1":
        return
    from pyisolate._internal import host as host_internal
    from pyisolate._internal.adapter_registry import AdapterRegistry

    import tensorwire.pyisolate as twp

    launch = host_internal.Extension._launch_with_uds

    def launch_with_tensorwire(self: Any) -> Any:
        registered = AdapterRegistry.get()
        _counts["launches"] += 1
        if isinstance(registered, twp.TensorwireAdapter):
            return launch(self)
        try:
            wrapped = twp.TensorwireAdapter() if registered is None else twp.compose(registered)
        except ValueError:
            _counts["left_alone"] += 1
            return launch(self)
        _counts["composed"] += registered is not None
        AdapterRegistry.unregister()
        AdapterRegistry.register(wrapped)
        try:
            return launch(self)
        finally:
            AdapterRegistry.unregister()
            if registered is not None:
                AdapterRegistry.register(registered)

    host_internal.Extension._launch_with_uds = launch_with_tensorwire

    pair, export, take = twp._Host.pair, twp._Link.export, twp._Link.take

    def counted_pair(self: Any, transport: Any) -> None:
        pair(self, transport)
        _counts["paired"] += twp._pairing(transport).link is not None

    def counted_export(self: Any, tensor: Any) -> Any:
        _counts["exports"] += 1
        return export(self, tensor)

    def counted_take(self: Any, tag: int) -> Any:
        _counts["takes"] += 1
        return take(self, tag)

    twp._Host.pair, twp._Link.export, twp._Link.take = counted_pair, counted_export, counted_take


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if os.environ.get("TW_PYISOLATE_SUITE_ADAPTER") == "1":
        terminalreporter.write_line("tensorwire adapter: " + " ".join(f"{k}={v}" for k, v in _counts.items()))
