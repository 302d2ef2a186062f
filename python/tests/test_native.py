"""tensorwire._native, the PyO3 binding (python/native), on its own: shared storages made
by Rust reach torch by DLPack, are recognised again by address, and are unmapped when
torch's last view dies; the binding's errors are tensorwire.errors classes; build_info.

The module is the package's own: the wheel carries it as ``tensorwire/_native.abi3.so``
beside the Python modules, and ``import tensorwire`` needs it (the ops run on it, and the
torch check reads its range), so a package without it fails this suite at the import.
"""
from __future__ import annotations

import gc
import re
import time
from pathlib import Path

import pytest
import torch

import tensorwire
import tensorwire.errors as errors

import tensorwire._native as native


def test_the_module_is_the_installed_packages_own():
    # Beside the package's Python modules, and what build_info() / library_path() name
    # when the ops run on it (no TENSORWIRE_TORCH_LIB).
    path = Path(native.__file__).resolve()
    assert native.__name__ == "tensorwire._native"
    assert path.name == "_native.abi3.so"
    assert path.parent == Path(tensorwire.__file__).resolve().parent
    info = tensorwire.build_info()
    if info["backend"] == "native":
        assert Path(tensorwire.library_path()) == path == Path(info["library"])


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


def _shared(shape, dtype=torch.float32) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    return _segment_tensor(nbytes).view(dtype).view(*shape)


def _send(peer, t: torch.Tensor, tag: int = 0) -> int:
    s = t.untyped_storage()
    return peer.send(s.data_ptr(), s.nbytes(), str(t.dtype).removeprefix("torch."),
                     list(t.shape), list(t.stride()), t.storage_offset(), tag)


def _recv(peer, timeout: float = 10.0) -> tuple[torch.Tensor, int]:
    cap, dtype, sizes, strides, offset, tag = peer.recv(timeout)
    storage = torch.from_dlpack(cap)
    return storage.view(getattr(torch, dtype)).as_strided(sizes, strides, offset), tag


def test_send_recv_a_view_zero_copy_and_the_lease_ends_with_the_last_view():
    a, b = native.Peer.pair()
    t = _shared((8, 16))
    t.copy_(torch.arange(128, dtype=torch.float32).view(8, 16))
    view = t.t()[2:6]  # strided, offset
    _send(a, view, tag=42)
    u, tag = _recv(b)
    assert tag == 42 and torch.equal(u, view) and u.stride() == view.stride()
    t[3, 3] = -1.0  # the receiver aliases the sender's memory
    assert u[1, 3] == -1.0
    assert a.stats()["live_leases"] == 1
    w = u[0]
    del u
    gc.collect()
    time.sleep(0.05)
    assert a.stats()["live_leases"] == 1  # a view still holds the import
    del w
    gc.collect()
    deadline = time.monotonic() + 10
    while a.stats()["live_leases"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert a.stats()["live_leases"] == 0 and a.stats()["released"] == 1


def test_send_of_a_private_tensor_is_refused():
    a, _b = native.Peer.pair()
    with pytest.raises(errors.Refused, match="not a live tensorwire segment"):
        _send(a, torch.zeros(4))


def test_recv_times_out_and_a_closed_peer_is_gone():
    a, b = native.Peer.pair()
    with pytest.raises(errors.Timeout):
        b.recv(0.05)
    del a
    gc.collect()
    with pytest.raises(errors.PeerGone):
        b.recv(5.0)
