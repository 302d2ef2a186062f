"""torch.library.opcheck on the ops whose output shapes are known (their fake
implementations are in python/tensorwire/_fake.py)."""

import pytest
import torch

import tensorwire

ops = torch.ops.tensorwire


@pytest.mark.parametrize("args,kwargs", [(([3, 4],), {"dtype": torch.float64}), (([2, 0, 5],), {}),
                                          (([],), {"dtype": torch.int8})])
@pytest.mark.parametrize("op", ["empty", "zeros"])
def test_factories(op, args, kwargs):
    torch.library.opcheck(getattr(ops, op).default, args, kwargs)


@pytest.mark.parametrize("t", [torch.randn(4, 5).t(), torch.arange(10)[2::3], torch.zeros(0, 2),
                               torch.randn(3, dtype=torch.complex64)])
def test_to_shared(t):
    torch.library.opcheck(ops.to_shared.default, (t,))


def test_from_torch_fd():
    s = torch.arange(24, dtype=torch.float32).share_memory_()
    fd, nbytes = s.untyped_storage()._share_fd_cpu_()
    torch.library.opcheck(ops.from_torch_fd.default, (fd, nbytes, torch.float32, [3, 4], [1, 3], 2))


def test_fake_tensor_mode_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        t = ops.zeros([7, 3], dtype=torch.bfloat16)
        u = ops.to_shared(torch.empty(2, 3).t())
    assert t.shape == (7, 3) and t.dtype == torch.bfloat16
    assert u.shape == (3, 2) and u.stride() == (2, 1)
