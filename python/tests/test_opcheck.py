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


CONNECTION_OPTIONS = [("max_leases", 0), ("max_lease_bytes", 0), ("window_ms", 0), ("handshake_timeout_ms", 0),
                      ("ring_bytes", 0), ("cuda_ring_device", -1), ("cuda_ring_slot_bytes", 0), ("cuda_ring_slots", 0),
                      ("cuda_wait", 0), ("cuda_wait_timeout_ms", 0)]


@pytest.mark.parametrize("op,first,own", [("from_fd", "fd", []), ("connect", "path", []),
                                          ("accept", "listener", [("timeout_ms", -1)])])
def test_connection_options_schema(op, first, own):
    # The three opening ops end with the same keyword-only options (TW_CONNECTION_OPTIONS),
    # which connection.py documents and passes through as **limits.
    args = getattr(ops, op).default._schema.arguments
    assert [a.name for a in args if not a.kwarg_only] == [first]
    assert [(a.name, a.default_value) for a in args if a.kwarg_only] == own + CONNECTION_OPTIONS


@pytest.mark.parametrize("name,bad", [("max_leases", -1), ("max_lease_bytes", -1), ("window_ms", -1),
                                      ("handshake_timeout_ms", -2), ("ring_bytes", -1), ("cuda_ring_device", -2),
                                      ("cuda_ring_slot_bytes", -1), ("cuda_ring_slots", -1), ("cuda_wait", 3),
                                      ("cuda_wait_timeout_ms", -2)])
@pytest.mark.parametrize("op,first", [("from_fd", -1), ("connect", "/nonexistent/tw.sock"), ("accept", -1)])
def test_connection_options_reach_their_field(op, first, name, bad):
    # Each option lands in its own field of the parsed config (checked before anything is
    # opened): a bad value is refused under its own name.
    with pytest.raises(RuntimeError, match=f"tensorwire: {name}"):
        getattr(ops, op)(first, **{name: bad})


def test_cuda_wait_is_passed_by_name_and_its_timeout_in_seconds():
    from tensorwire.connection import _options

    hs = {"handshake_timeout_ms": 60_000}  # Python's default, always passed
    assert _options({"cuda_wait": "host", "cuda_wait_timeout": 0.5}) == {"cuda_wait": 1, "cuda_wait_timeout_ms": 500, **hs}
    assert _options({"cuda_wait": "event", "cuda_wait_timeout": None}) == {"cuda_wait": 2, "cuda_wait_timeout_ms": -1, **hs}
    assert _options({"cuda_wait": "stream", "max_leases": 3}) == {"cuda_wait": 0, "max_leases": 3, **hs}
    with pytest.raises(ValueError, match="cuda_wait must be one of"):
        _options({"cuda_wait": "gpu"})
    with pytest.raises(ValueError, match="cuda_wait_timeout must be a positive number of seconds"):
        _options({"cuda_wait_timeout": 0})
