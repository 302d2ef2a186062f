"""tensorwire.rpc with CUDA tensors: a host sends CUDA tensors to a Python
worker and gets CUDA tensors back. Skipped without a CUDA device (the Rust half is tested
on simcuda: ``simcuda/run.sh cargo test -p tensorwire-python cuda``).

On a GPU: values, dtype and strided views arrive as sent; the worker writes through the
host's memory (zero-copy); a GPU op queued just before the call, with no synchronize, is
what the worker reads (the worker's stream waits for the host's), and likewise for a
result queued behind a GPU sleep; the host's memory stays allocated while the worker holds
the tensor and is freed after it drops it; a connection without native tensors refuses a
CUDA tensor with ``CudaUnavailable`` before sending anything."""
from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import pytest
import torch

import tensorwire
import tensorwire.rpc as rpc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, HERE)
ENV = {"PYTHONPATH": HERE}
DEV = "cuda:0"
# Generous: the worker imports torch and initialises CUDA on its first tensor.
CALL_TIMEOUT = 120.0


@pytest.fixture(scope="module")
def gpu_worker():
    with rpc.spawn("rpc_cuda_targets:Gpu", env=ENV, timeout=CALL_TIMEOUT, output="capture") as w:
        assert w.call("ping") is True
        yield w


def wait_for(what: str, cond, within: float = 60.0, poke=None) -> None:
    by = time.monotonic() + within
    while not cond():
        assert time.monotonic() < by, f"timed out after {within} s waiting for {what}"
        if poke is not None:
            poke()
        time.sleep(0.05)


def test_values_dtype_and_strided_view_arrive_as_sent(gpu_worker):
    base = torch.arange(4 * 6 * 5, dtype=torch.float32, device=DEV).reshape(4, 6, 5)
    view = base[1:, ::2, 1:4].transpose(0, 1)  # strided, offset, not contiguous
    got = gpu_worker.call("describe", view)
    assert got["device"] == DEV, got
    assert got["dtype"] == "torch.float32", got
    assert got["shape"] == list(view.shape), (got["shape"], list(view.shape))
    assert got["stride"] == list(view.stride()), (got["stride"], list(view.stride()))
    assert got["offset"] == view.storage_offset(), (got["offset"], view.storage_offset())
    assert got["storage_nbytes"] == base.untyped_storage().nbytes(), "the whole storage is shared, not a copy of the view"
    assert got["values"] == view.cpu().tolist(), "values differ"
    for dtype in (torch.int64, torch.bfloat16, torch.uint8, torch.bool):
        t = (torch.arange(10, device=DEV) % 3).to(dtype)
        got = gpu_worker.call("describe", t)
        assert got["dtype"] == str(dtype) and got["values"] == t.cpu().tolist(), (dtype, got)


def test_zero_copy_the_worker_writes_the_hosts_memory(gpu_worker):
    t = torch.zeros(1000, device=DEV)
    gpu_worker.call("add_one_in_place", t[10:20])
    torch.cuda.synchronize()
    assert t[10:20].eq(1).all().item(), "the worker's write did not reach the host's tensor: not zero-copy"
    assert t[:10].eq(0).all().item() and t[20:].eq(0).all().item(), "the worker wrote outside the view it was sent"


def test_an_op_queued_before_the_call_is_what_the_worker_reads(gpu_worker):
    # The worker's CUDA start-up and kernel loads first: they take long enough to hide a
    # missing wait.
    assert gpu_worker.call("all_equal", torch.ones(4, device=DEV), 1.0) is True
    x = torch.zeros(1 << 24, device=DEV)  # 64 MiB
    # Load the kernels first: a lazy module load can synchronize the device, which would
    # let the fill land before the call goes out.
    x.fill_(1.0)
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # the fill below lands ~0.5 s after the call went out
    x.fill_(3.0)
    # No synchronize: the worker's stream must wait for this stream's fill.
    assert gpu_worker.call("all_equal", x, 3.0) is True, "the worker read the tensor before the host's queued fill"


def test_a_result_queued_behind_gpu_work_is_ordered_for_the_host(gpu_worker):
    x = torch.full((1 << 22,), 5.0, device=DEV)
    y = gpu_worker.call("doubled_late", x)
    assert isinstance(y, torch.Tensor) and y.device == torch.device(DEV), type(y)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.all(y == 10.0).item(), "the host read the result before the worker's queued work"


def test_a_received_tensor_sent_back_arrives_whole(gpu_worker):
    x = torch.arange(100, dtype=torch.int32, device=DEV)
    y = gpu_worker.call("echo", x[::3])
    assert y.device == torch.device(DEV) and y.dtype == torch.int32
    assert y.cpu().tolist() == x[::3].cpu().tolist(), "echo changed the values"


def test_the_lease_holds_the_memory_until_the_worker_drops_it(gpu_worker):
    nbytes = 64 << 20
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(0)
    t = torch.ones(nbytes // 4, device=DEV)
    assert gpu_worker.call("keep", t) >= 1
    del t
    gc.collect()
    # Half the tensor as the margin: other tests' small blocks may be freed meanwhile.
    held = before + nbytes // 2
    assert torch.cuda.memory_allocated(0) >= held, "freed while the worker still holds it"
    assert gpu_worker.call("drop_kept") is True
    # The lease ends after the worker's stream work; the storage reference it held is
    # dropped off the GIL and let go the next time this process enters the binding (the
    # ping does).
    wait_for("the host's memory to be freed after the worker dropped its tensor",
             lambda: torch.cuda.memory_allocated(0) < held,
             poke=lambda: gpu_worker.call("ping"))


def test_in_process_pair_and_no_native_tensors():
    class Sum:
        def total(self, t):
            return float(t.double().sum().item())

    a, b = rpc.pair(serve_b={"s": Sum()})
    try:
        x = torch.arange(1000, dtype=torch.float32, device=DEV)
        assert a.call("s", "total", x, timeout=CALL_TIMEOUT) == float(sum(range(1000)))
    finally:
        a.close()
        b.close()
    c, d = rpc.pair(serve_b={"s": Sum()}, native=False)
    try:
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(0)
        x = torch.ones(1 << 20, device=DEV)
        with pytest.raises(tensorwire.errors.CudaUnavailable, match="native"):
            c.call("s", "total", x, timeout=CALL_TIMEOUT)
        del x
        gc.collect()
        wait_for("a refused tensor's memory to be freed", lambda: torch.cuda.memory_allocated(0) < before + (1 << 19),
                 within=10.0, poke=lambda: tensorwire._native.cuda_available())
    finally:
        c.close()
        d.close()


def test_a_sandboxed_gpu_worker_receives_computes_and_returns():
    """A worker in its own pid namespace (landlock, seccomp) with ``Sandbox(gpu=True)``: it
    receives a CUDA tensor (cudaMalloc memory: it travels as a device copy, since legacy
    IPC handles do not cross a pid namespace), computes on the GPU, and returns a CUDA
    tensor the host reads."""
    with rpc.spawn("rpc_cuda_targets:Gpu", path=[HERE], sandbox=rpc.Sandbox(gpu=True), timeout=CALL_TIMEOUT,
                   output="capture") as w:
        assert w.call("ping") is True
        x = torch.arange(1 << 20, dtype=torch.float32, device=DEV)
        y = w.call("doubled_late", x[1::2])
        assert y.device == torch.device(DEV), y.device
        assert torch.equal(y.cpu(), (x[1::2] * 2).cpu()), "the sandboxed worker's result differs"
        got = w.call("describe", x[:10])
        assert got["values"] == x[:10].cpu().tolist(), got
