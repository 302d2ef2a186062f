"""Ordinary CPU tensors of up to the attachment limit (16 KiB packed) through
``tensorwire.rpc`` to a worker process: their bytes travel as a binary attachment of the
RPC frame (no base64, no segment, no lease) and arrive as private memory, bit-exact, in
every dtype and view; sent back, they travel the same way."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tensorwire.rpc as rpc
from tensorwire import _native

HERE = str(Path(__file__).resolve().parent)
ENV = {"PYTHONPATH": HERE}


@pytest.fixture(scope="module")
def worker():
    with rpc.spawn("rpc_ordinary_targets:Keeper", env=ENV, timeout=60.0, output="capture") as w:
        yield w


def _bytes_of(t: torch.Tensor) -> list[int]:
    return t.contiguous().reshape(-1).view(torch.uint8).tolist()


def _tensors(rows: int) -> list[torch.Tensor]:
    """Every dtype this torch has that tensorwire carries, `rows` x 64 of it, and views:
    transposed, stepped, 0-d, empty, an offset slice."""
    g = torch.Generator().manual_seed(11)
    base = torch.randn(rows, 64, generator=g)
    out = []
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
                  torch.complex128, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
                  torch.bool, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn):
        if dtype.is_complex:
            t = torch.complex(base, -base).to(dtype)
        elif dtype == torch.bool:
            t = base > 0
        elif dtype.is_floating_point:
            t = (base * 100).to(dtype)
        else:
            t = (base * 100).to(torch.int64).to(dtype)
        if t.numel() * t.element_size() > _native.pool_stats()["max_owned"]:
            t = t[: max(1, t.shape[0] // 4)]
        out += [t, t.t(), t[1::2, ::3], t[2, 3], t[:0], t.reshape(-1)[5:917]]
    return out


@pytest.mark.parametrize("rows", [4, 32])
def test_tensors_of_every_dtype_and_view_travel_attached_bit_exact(worker, rows):
    tensors = _tensors(rows)
    worker.call("echo", tensors[0])
    before = _native.pool_stats()
    for t in tensors:
        back = worker.call("echo", t)
        assert back.dtype == t.dtype and back.shape == t.shape, (t.dtype, t.shape)
        assert _bytes_of(back) == _bytes_of(t), (t.dtype, t.shape, t.stride())
        # Private memory on both sides: neither a segment of ours nor an import.
        s = back.untyped_storage()
        assert _native.storage_kind(s.data_ptr(), s.nbytes()) is None
        assert worker.call("storage_kind", t) is None, (t.dtype, t.shape)
        # What the worker saw: the same dtype, shape and bytes.
        if t.numel() <= 2048:
            got = worker.call("layout_and_bytes", t)
            assert (got["dtype"], got["shape"], got["bytes"]) == (str(t.dtype), list(t.shape), _bytes_of(t))
    after = _native.pool_stats()
    assert {k: after[k] - before[k] for k in ("created", "reused", "unpooled", "copies")} == \
        {"created": 0, "reused": 0, "unpooled": 0, "copies": 0}, "a small tensor went into a segment"


def test_the_attachment_limit_and_one_past_it(worker):
    limit = _native.pool_stats()["max_owned"]
    assert limit == 16 << 10
    at, over = torch.randn(limit // 4), torch.randn(limit // 4 + 1)
    assert worker.call("storage_kind", at) is None
    assert worker.call("storage_kind", over) == "import"
    assert torch.equal(worker.call("echo", at), at)
    assert torch.equal(worker.call("echo", over), over)


def test_a_tensor_sent_back_and_forth_stays_private_and_exact(worker):
    x = torch.randn(1024)  # 4 KiB
    y = worker.call("keep_and_return", x)
    assert torch.equal(y, x)
    assert worker.call("poke", 12.5) == 12.5
    assert float(y[0]) == float(x[0]), "an attached tensor came back as shared memory"
    worker.call("drop")
    before = _native.pool_stats()
    for _ in range(50):
        y = worker.call("echo", y)
    assert torch.equal(y, x)
    after = _native.pool_stats()
    assert after["copies"] == before["copies"] and after["owned"] - before["owned"] == 50
    # Several in one call, in order, each its own attachment.
    many = [torch.randn(n) for n in (1, 256, 1024, 3000)]
    for got, want in zip(worker.call("echo", many), many):
        assert torch.equal(got, want)
