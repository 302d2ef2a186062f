"""The import-time torch check (python/tensorwire/_torch_check.py): the range the wheel
was built for against the torch found — refused when older, a warning when newer, both
messages naming the two and what to do — and that ``import tensorwire`` runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import pytest

import tensorwire
from tensorwire import _torch_check

INFO = {"version": "0.1.0", "torch_min": "2.11", "torch_below": "2.16", "torch_tested": ["2.11.0", "2.15.0"]}


@pytest.mark.parametrize("found", ["2.11.0", "2.11.0+cu130", "2.15.0+cu132", "2.15.9", "2.13.0a0+git1234"])
def test_in_range_passes(found):
    assert _torch_check.problem(found, INFO) is None


@pytest.mark.parametrize("found", ["2.10.0", "2.10.9+cpu", "1.13.1", "2.0.0"])
def test_older_is_refused_naming_both_and_what_to_do(found, monkeypatch):
    monkeypatch.delenv("TENSORWIRE_SKIP_TORCH_CHECK", raising=False)
    with pytest.raises(ImportError) as e:
        _torch_check.check(found, INFO)
    msg = str(e.value)
    assert f"this process has torch {found}" in msg
    assert "built for torch >= 2.11, < 2.16" in msg and "tested with 2.11.0, 2.15.0" in msg
    assert "pip install 'torch>=2.11,<2.16'" in msg


@pytest.mark.parametrize("found", ["2.16.0", "2.16.0.dev20261101+cu132", "3.0.0"])
def test_newer_warns_and_goes_ahead(found, monkeypatch):
    monkeypatch.delenv("TENSORWIRE_SKIP_TORCH_CHECK", raising=False)
    with pytest.warns(RuntimeWarning, match=re.escape(f"this process has torch {found}, newer than the range")):
        _torch_check.check(found, INFO)


def test_the_skip_variable_skips(monkeypatch):
    monkeypatch.setenv("TENSORWIRE_SKIP_TORCH_CHECK", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _torch_check.check("2.0.0", INFO)
        _torch_check.check("9.0.0", INFO)


def test_import_tensorwire_runs_the_check_against_the_binding_range():
    # A torch that claims 2.10.0 before tensorwire is imported: the import must fail with the
    # check's message, naming the range the installed binding reports.
    code = ("import torch; torch.__version__ = '2.10.0'\n"
            "try:\n    import tensorwire\nexcept ImportError as e:\n    print('REFUSED', e)\n"
            "else:\n    print('IMPORTED')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TENSORWIRE_SKIP_TORCH_CHECK", "TENSORWIRE_TORCH_LIB")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    info = tensorwire.build_info()
    assert r.stdout.startswith("REFUSED "), r.stdout + r.stderr
    assert f"built for torch >= {info['torch_min']}, < {info['torch_below']}" in r.stdout
    assert "this process has torch 2.10.0" in r.stdout
