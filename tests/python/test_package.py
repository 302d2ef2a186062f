"""The pip-installed package: imports from any directory with no environment variables,
its wheel metadata pins the torch it was built for, and the `python -m tensorwire`
commands work (demo: a two-process round trip both ways; doctor: every CPU capability)."""

import importlib.metadata
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import tensorwire

ROOT = Path(__file__).resolve().parents[2]
installed = tensorwire.build_info() is not None
needs_install = pytest.mark.skipif(not installed, reason="tensorwire is not pip-installed here (checkout build): "
                                   "SKIPPED; scripts/test.sh installs it into a fresh venv")


def clean_env():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TENSORWIRE_TORCH_LIB")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def run(*args, timeout=120):
    with tempfile.TemporaryDirectory() as cwd:  # not the checkout: nothing relative to it
        return subprocess.run([sys.executable, *args], cwd=cwd, env=clean_env(), capture_output=True, text=True,
                              timeout=timeout)


@needs_install
def test_import_from_elsewhere_loads_the_packaged_library():
    r = run("-c", "import tensorwire, torch; print(tensorwire.library_path()); print(tensorwire.__file__)")
    assert r.returncode == 0, r.stderr
    lib, mod = r.stdout.split()
    assert Path(lib).name == "libtensorwire_torch.so" and Path(lib).exists()
    assert "site-packages" in lib, lib  # the package data, not a checkout build


@needs_install
def test_wheel_metadata_pins_the_build_torch():
    requires = importlib.metadata.requires("tensorwire") or []
    public = torch.__version__.split("+")[0]
    assert f"torch=={public}" in requires, requires
    assert tensorwire.build_info().TORCH_VERSION == torch.__version__


@needs_install
def test_demo_round_trip_both_ways():
    r = run("-m", "tensorwire", "demo", "--max-size", str(1 << 20))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "demo: OK" in r.stdout
    assert r.stdout.count(" yes ") == 8  # every parent -> child view: zero-copy


@needs_install
def test_doctor_reports_every_cpu_capability():
    r = run("-m", "tensorwire", "doctor")
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("memfd + seals", "SCM_CREDENTIALS", "pidfd", "futex doorbells", "peer death", "torch version"):
        assert f"✓ {name}" in r.stdout, r.stdout
    assert "CUDA driver + devices" in r.stdout and "expandable segments" in r.stdout


@needs_install
def test_cli_rejects_unknown_commands():
    r = run("-m", "tensorwire", "frobnicate")
    assert r.returncode == 2 and "unknown command 'frobnicate'" in r.stderr


def test_version_is_the_crates():
    # One version for the crate, the wheel (pyproject.toml reads Cargo.toml) and
    # tensorwire.__version__.
    import re

    cargo = re.search(r'(?m)^version = "([^"]+)"', (ROOT / "Cargo.toml").read_text()).group(1)
    assert tensorwire.__version__ == cargo
    rpc = (ROOT / "rpc/Cargo.toml").read_text()
    assert re.search(r'(?m)^version = "([^"]+)"', rpc).group(1) == cargo
    assert f'tensorwire = {{ path = "..", version = "{cargo}" }}' in rpc
    if installed:
        assert importlib.metadata.version("tensorwire") == cargo


@needs_install
def test_wheel_metadata_licenses_and_classifiers():
    meta = importlib.metadata.metadata("tensorwire")
    classifiers = meta.get_all("Classifier") or []
    for c in ("License :: OSI Approved :: MIT License", "License :: OSI Approved :: Apache Software License",
              "Operating System :: POSIX :: Linux", "Topic :: Scientific/Engineering :: Artificial Intelligence"):
        assert c in classifiers, classifiers
    files = [str(f) for f in importlib.metadata.files("tensorwire") or []]
    assert any(f.endswith("LICENSE-MIT") for f in files) and any(f.endswith("LICENSE-APACHE") for f in files), files
