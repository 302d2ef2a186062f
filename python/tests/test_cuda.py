"""CUDA entry points of the extension. Without a CUDA device (this is what runs in CI here)
they must say why, with tensorwire's CudaUnavailable message; the GPU round trip is
skipped loudly. scripts/gpu_test.sh runs the full GPU suite (tests/gpu) on a GPU machine."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tensorwire
from support import connected_pair

PEER = str(Path(__file__).with_name("peer.py"))
HAVE_GPU = torch.cuda.is_available()
GPU_SKIP = "GPU tests SKIPPED: no CUDA device (run scripts/gpu_test.sh on a GPU machine)"


def test_ops_are_registered_for_every_cuda_entry_point():
    for op in ("cuda_built", "cuda_available", "cuda_device_count", "cuda_ipc_cache_stats",
               "cuda_ipc_cache_keep_warm", "cuda_ring_recv"):
        assert hasattr(tensorwire.ops, op), op
    # A CUDA tensor reaching `send` always has a kernel: the real one (built with CUDA) or
    # the one that explains the build has no CUDA (`ring_send` takes any device).
    assert "CUDA: registered at" in torch._C._dispatch_dump("tensorwire::send")


@pytest.mark.skipif(HAVE_GPU, reason="a CUDA device is present: see test_cuda_available_with_a_gpu")
def test_cuda_unavailable_without_a_driver():
    assert tensorwire.cuda_available() is False
    with pytest.raises(RuntimeError,
                       match=r"tensorwire \(TW_ERR_CUDA_UNAVAILABLE\): tw_cuda_device_count: CUDA unavailable: "
                             r"no NVIDIA driver"):
        tensorwire.cuda_device_count()
    # Nothing was ever opened; the knob is accepted (and checked) all the same.
    assert tensorwire.cuda_ipc_cache_stats() == {"opens": 0, "open_handles": 0}
    tensorwire.cuda_ipc_cache_keep_warm(16)
    with pytest.raises(RuntimeError, match="n must be >= 0, got -1"):
        tensorwire.cuda_ipc_cache_keep_warm(-1)


def test_ring_refuses_tensors_of_other_devices():
    # The device check comes before anything else (the connection handle is not looked at).
    with pytest.raises(RuntimeError, match=r"tensor is on meta; the rings carry CPU tensors \(CPU ring\) and CUDA "
                                           r"tensors \(GPU ring\)"):
        tensorwire.ops.ring_send(1, torch.empty(3, device="meta"))


@pytest.mark.skipif(HAVE_GPU, reason="a CUDA device is present")
def test_gpu_ring_without_a_driver_or_without_a_ring():
    # Asking for a GPU ring needs a driver on this side: the connection is refused at once.
    a, b = tensorwire.socketpair(inheritable_child=False)
    with pytest.raises(RuntimeError, match=r"TW_ERR_CUDA_UNAVAILABLE.*no NVIDIA driver"):
        tensorwire.from_fd(a, cuda_ring_device=0)
    os.close(b)
    with pytest.raises(RuntimeError, match="cuda_ring_device must be -1 .* got -2"):
        tensorwire.ops.from_fd(99, cuda_ring_device=-2)
    # A connection without GPU rings: receiving from one says the peer offered none.
    conn, other = connected_pair()
    with conn, other:
        with pytest.raises(RuntimeError, match=r"TW_ERR_INVALID_ARGUMENT.*offered no GPU ring"):
            conn.cuda_ring_recv(timeout=0.1)


def test_cuda_available_with_a_gpu():
    if not HAVE_GPU:
        pytest.skip(GPU_SKIP)
    assert tensorwire.cuda_built(), "a GPU is present but libtensorwire_torch was built without CUDA"
    assert tensorwire.cuda_available() is True
    assert tensorwire.cuda_device_count() == torch.cuda.device_count()


def test_gpu_round_trip_two_processes():
    if not HAVE_GPU:
        pytest.skip(GPU_SKIP)
    parent_fd, child_fd = tensorwire.socketpair()
    proc = subprocess.Popen([sys.executable, PEER, "cuda_echo", str(child_fd)], pass_fds=[child_fd])
    os.close(child_fd)
    conn = tensorwire.from_fd(parent_fd)
    try:
        t = torch.arange(24, dtype=torch.float32, device="cuda").view(4, 6)[1:, ::2]
        orig = t.cpu()
        assert conn.send(t, 5) is True
        back, tag = conn.recv_tagged(timeout=60)
        assert tag == 5 and back.device.type == "cpu"
        assert torch.equal(back, orig + 1)  # the child saw our values (and its add_)
        assert torch.equal(t.cpu(), orig + 1)  # its add_ landed in our memory: zero-copy
        conn.send(tensorwire.zeros(1), 999_999)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        conn.close()
