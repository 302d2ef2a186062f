"""tensorwire._native, the PyO3 binding (python/native), on its own: shared storages made
by Rust reach torch by DLPack, are recognised again by address, and are unmapped when
torch's last view dies; the binding's errors are tensorwire.errors classes; build_info.

The module comes from ``$TENSORWIRE_NATIVE`` (a built ``_native*.so``; scripts/test.sh
sets it to the one in the wheel it built) or, without it, from the installed package.
"""
from __future__ import annotations

import gc
import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch

import tensorwire.errors as errors


def _load():
    path = os.environ.get("TENSORWIRE_NATIVE")
    if not path:
        return pytest.importorskip("tensorwire._native")
    spec = importlib.util.spec_from_file_location("tensorwire._native", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


native = _load()


def _segment_tensor(nbytes: int) -> torch.Tensor:
    return torch.from_dlpack(native.segment_storage(nbytes))


def test_segment_storage_is_zeroed_shared_and_writable():
    t = _segment_tensor(4096)
    assert t.dtype == torch.uint8 and t.shape == (4096,) and t.device.type == "cpu"
    assert int(t.sum()) == 0
    t.fill_(7)
    f = t.view(torch.float32).view(32, 32)  # the views the package makes from a byte storage
    assert f.data_ptr() == t.data_ptr()
    assert native.is_segment(t.data_ptr(), 4096)
    assert native.is_segment(t.data_ptr() + 100, 8)
    assert not native.is_segment(t.data_ptr() + 4000, 200)  # runs past the storage's end


def test_private_tensor_is_not_a_segment():
    t = torch.zeros(1024, dtype=torch.uint8)
    assert not native.is_segment(t.data_ptr(), 1024)


def test_last_view_frees_the_segment():
    gc.collect()
    before = native.live_segments()
    t = _segment_tensor(1 << 20)
    v = t[10:20]
    ptr = t.data_ptr()
    del t
    assert native.live_segments() == before + 1  # a view still holds the storage
    assert native.is_segment(ptr, 1 << 20)
    del v
    gc.collect()
    assert native.live_segments() == before
    assert not native.is_segment(ptr, 1)


def test_unconsumed_capsule_frees_the_segment():
    gc.collect()
    before = native.live_segments()
    cap = native.segment_storage(4096)
    assert native.live_segments() == before + 1
    del cap
    gc.collect()
    assert native.live_segments() == before


def test_capsule_is_consumed_once():
    cap = native.segment_storage(64)
    t = torch.from_dlpack(cap)
    with pytest.raises(Exception):
        torch.from_dlpack(cap)
    t.fill_(1)
    assert int(t.sum()) == 64


def test_errors_are_tensorwire_classes():
    with pytest.raises(errors.Error) as e:
        native.segment_storage(1 << 62)  # no memfd that large
    assert isinstance(e.value, RuntimeError)
    assert e.value.code is not None and e.value.code.startswith("TW_ERR_")
    assert str(e.value).startswith(f"tensorwire ({e.value.code}): ")


def test_build_info_and_pyproject_agree():
    info = native.build_info()
    assert info["cuda_built"] is True
    cargo = (Path(__file__).resolve().parents[2] / "python/native/Cargo.toml").read_text()
    assert info["version"] == re.search(r'(?m)^version = "([^"]+)"', cargo).group(1)
    def ver(s: str) -> tuple[int, ...]:
        return tuple(int(x) for x in s.split("."))
    assert ver(info["torch_min"]) < ver(info["torch_below"])
    for v in info["torch_tested"]:
        assert ver(info["torch_min"]) <= ver(v)[:2] < ver(info["torch_below"])
