"""Ordinary CPU tensors of up to the attachment limit (16 KiB packed) through
``tensorwire.rpc`` to a worker process: their bytes travel as a binary attachment of the
RPC frame (no base64, no segment, no lease) and arrive as private memory, bit-exact, in
every dtype and view; sent back, they travel the same way."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tensorwire.rpc as rpc
from support import bytes_of, echo_each_privately, every_dtype_with_views
from tensorwire import _native

HERE = str(Path(__file__).resolve().parent)
ENV = {"PYTHONPATH": HERE}


@pytest.fixture(scope="module")
def worker():
    with rpc.spawn("rpc_ordinary_targets:Keeper", env=ENV, timeout=60.0, output="capture") as w:
        yield w


def _tensors(rows: int) -> list[torch.Tensor]:
    """Every dtype this torch has that tensorwire carries, `rows` x 64 of it (fewer rows
    where that passes the attachment limit), and views."""
    return every_dtype_with_views(rows, 64, seed=11, slice_stop=917, max_bytes=_native.pool_stats()["max_owned"])


@pytest.mark.parametrize("rows", [4, 32])
def test_tensors_of_every_dtype_and_view_travel_attached_bit_exact(worker, rows):
    def as_the_worker_saw_it(t):
        if t.numel() <= 2048:
            got = worker.call("layout_and_bytes", t)
            assert (got["dtype"], got["shape"], got["bytes"]) == (str(t.dtype), list(t.shape), bytes_of(t))
    echo_each_privately(worker, _tensors(rows), also=as_the_worker_saw_it)


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
