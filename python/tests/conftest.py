"""pytest setup for the Python package: use the installed `tensorwire` (the wheel) when
there is one; otherwise run from the checkout's python/, building the binding
(`python/tensorwire/_native.abi3.so`, cargo) first if it is missing — or, with
TENSORWIRE_TORCH_LIB set, on that C++ extension."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INSTALLED = importlib.util.find_spec("tensorwire") is not None

if not INSTALLED:
    sys.path.insert(0, str(ROOT / "python"))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), os.environ.get("PYTHONPATH")]))
    native = ROOT / "python/tensorwire/_native.abi3.so"
    if not native.exists():
        # The modules that need no libtorch (rpc, the storages) use the binding with either
        # backend. Built as the wheel's; moved into place, never copied over a mapped file.
        subprocess.run(["cargo", "build", "--release", "--locked", "-p", "tensorwire-python", "--features",
                        "extension-module"], cwd=ROOT, check=True)
        target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
        tmp = native.with_suffix(".tmp")
        tmp.write_bytes((target / "release/lib_native.so").read_bytes())
        tmp.replace(native)


def pytest_configure(config):
    # Show skip reasons in the summary (the GPU tests say loudly that they were skipped).
    if "s" not in config.option.reportchars and "a" not in config.option.reportchars.lower():
        config.option.reportchars += "s"
