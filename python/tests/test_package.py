"""The installed package (the wheel, scripts/test.sh): imports from any directory with no
environment variables, its metadata asks for a torch range (never a pin) and says CUDA,
and the `python -m tensorwire` commands work (demo: a two-process round trip both ways;
doctor: every CPU capability)."""

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
installed = not Path(tensorwire.__file__).resolve().is_relative_to(ROOT / "python")
needs_install = pytest.mark.skipif(not installed, reason="tensorwire is not installed here (a checkout on PYTHONPATH): "
                                   "SKIPPED; scripts/test.sh installs the wheel into fresh venvs")


def clean_env():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TENSORWIRE_TORCH_LIB")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def run(*args, timeout=120):
    with tempfile.TemporaryDirectory() as cwd:  # not the checkout: nothing relative to it
        return subprocess.run([sys.executable, *args], cwd=cwd, env=clean_env(), capture_output=True, text=True,
                              timeout=timeout)


@needs_install
def test_import_from_elsewhere_loads_the_installed_binding():
    r = run("-c", "import tensorwire, tensorwire._native as n, torch; print(n.__file__); print(tensorwire.__file__); "
                  "print(torch.ops.tensorwire.is_shared(tensorwire.zeros([4])))")
    assert r.returncode == 0, r.stderr
    native, mod, shared = r.stdout.split()
    assert Path(native).name == "_native.abi3.so" and Path(native).parent == Path(mod).parent
    assert "site-packages" in native, native  # the wheel's, not a checkout's
    assert shared == "True"  # torch.ops.tensorwire is served without the libtorch extension


@needs_install
def test_wheel_metadata_asks_for_a_torch_range_that_holds_this_torch():
    import re

    import tensorwire._native as native

    info = native.build_info()
    requires = [r for r in importlib.metadata.requires("tensorwire") or [] if re.match(r"torch\b", r)]
    assert requires == [f"torch<{info['torch_below']},>={info['torch_min']}"] or \
        requires == [f"torch>={info['torch_min']},<{info['torch_below']}"], requires
    assert "==" not in requires[0]
    have = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    assert tuple(map(int, info["torch_min"].split("."))) <= have < tuple(map(int, info["torch_below"].split(".")))


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
    assert f'tensorwire = {{ path = "..", version = "{cargo}"' in rpc  # a version on the path dependency: publishable
    if installed:
        assert importlib.metadata.version("tensorwire") == cargo


@needs_install
def test_wheel_metadata_licenses_and_classifiers():
    meta = importlib.metadata.metadata("tensorwire")
    assert meta["License-Expression"] == "MIT OR Apache-2.0"
    classifiers = meta.get_all("Classifier") or []
    for c in ("Environment :: GPU :: NVIDIA CUDA", "Operating System :: POSIX :: Linux",
              "Topic :: Scientific/Engineering :: Artificial Intelligence"):
        assert c in classifiers, classifiers
    files = [str(f) for f in importlib.metadata.files("tensorwire") or []]
    assert any(f.endswith("LICENSE-MIT") for f in files) and any(f.endswith("LICENSE-APACHE") for f in files), files
