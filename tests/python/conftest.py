"""pytest setup for the Python package: use the installed `tensorwire` (pip install
--no-build-isolation .) when there is one; otherwise run from the checkout's python/,
building libtensorwire_torch.so with cpp/build.sh first if it is missing."""

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
    if not os.environ.get("TENSORWIRE_TORCH_LIB") and not (ROOT / "build/torch-ext/libtensorwire_torch.so").exists():
        subprocess.run(["bash", str(ROOT / "cpp/build.sh"), sys.executable], check=True)


def pytest_configure(config):
    # Show skip reasons in the summary (the GPU tests say loudly that they were skipped).
    if "s" not in config.option.reportchars and "a" not in config.option.reportchars.lower():
        config.option.reportchars += "s"
