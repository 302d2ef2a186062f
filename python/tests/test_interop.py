"""Interop with PyTorch's own CPU sharing (file_descriptor strategy), both ways, between
two processes; "same memory" proven by mutation."""

import pytest
import torch
import torch.multiprocessing as mp

import interop_peer
import tensorwire


@pytest.fixture
def ctx():
    mp.set_sharing_strategy("file_descriptor")
    return mp.get_context("spawn")


def run(ctx, fn, payload):
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=fn, args=(q_in, q_out))
    p.start()
    try:
        q_in.put(payload)
        out = q_out.get(timeout=120)
        p.join(60)
        assert p.exitcode == 0
        return out
    finally:
        if p.is_alive():
            p.kill()


def test_pytorch_shared_storage_imported_as_tensorwire_tensor(ctx):
    base = torch.arange(48, dtype=torch.float32).view(6, 8)
    base.share_memory_()
    t = base[1:, 2:].t()  # a strided view of a PyTorch-shared storage
    expected = -t.clone()
    assert run(ctx, interop_peer.torch_to_tensorwire, t) is True
    assert torch.equal(t, expected)  # the child's write through tensorwire's mapping


def test_pytorch_shared_storage_in_process_is_trusted_not_resent_zero_copy():
    t = torch.arange(10, dtype=torch.int64).share_memory_()
    u = tensorwire.from_torch_shared(t)
    u[3] = -7
    assert t[3].item() == -7
    # Unsealed (PyTorch's shm file): a tensorwire send would copy it once, never pass it on.
    assert not tensorwire.is_shared(u)
    del u
    assert t[3].item() == -7


def test_tensorwire_segment_rebuilt_by_pytorch(ctx):
    base = tensorwire.zeros(5, 7, dtype=torch.float64)
    base.copy_(torch.arange(35, dtype=torch.float64).view(5, 7))
    view = base[1:, ::2].t()
    expected_sum = view.sum().item()
    info = run(ctx, interop_peer.tensorwire_to_torch, tensorwire.to_torch_shared(view))
    is_plain, storage_shared, shape, stride, offset, total = info
    assert is_plain and storage_shared
    assert (shape, stride, offset) == (tuple(view.shape), view.stride(), view.storage_offset())
    assert total == expected_sum
    # The child's add_ through PyTorch's own mapping landed in our segment.
    expected = torch.arange(35, dtype=torch.float64).view(5, 7)
    expected[1:, ::2] += 1000
    assert torch.equal(base, expected)
