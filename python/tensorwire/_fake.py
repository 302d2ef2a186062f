"""Fake (meta) implementations of the tensorwire ops whose output shape is known, so
FakeTensor tracing (torch.compile, torch.library.opcheck) can run them."""

import torch


def _contiguous_strides(size):
    strides, acc = [], 1
    for s in reversed(size):
        strides.append(acc)
        acc *= max(s, 1)
    return list(reversed(strides))


@torch.library.register_fake("tensorwire::empty")
def _empty(size, *, dtype=None):
    return torch.empty(size, dtype=dtype)


@torch.library.register_fake("tensorwire::zeros")
def _zeros(size, *, dtype=None):
    return torch.empty(size, dtype=dtype)


@torch.library.register_fake("tensorwire::to_shared")
def _to_shared(t):
    return torch.empty_strided(t.shape, _contiguous_strides(t.shape), dtype=t.dtype, device=t.device)


@torch.library.register_fake("tensorwire::from_torch_fd")
def _from_torch_fd(fd, nbytes, dtype, size, stride, storage_offset=0):
    n = nbytes // torch.empty((), dtype=dtype).element_size()
    return torch.empty(n, dtype=dtype).as_strided(size, stride, storage_offset)


@torch.library.register_fake("tensorwire::share_")
def _share_(t):
    return t
