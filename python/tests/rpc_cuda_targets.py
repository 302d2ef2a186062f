"""What the worker of test_rpc_cuda.py serves (``python -m tensorwire.worker
rpc_cuda_targets:Gpu``): imported in the worker process only. Every answer about a
received CUDA tensor is computed on the worker's current stream, which tensorwire has
ordered after the host's writes (no synchronize on either side unless stated)."""
from __future__ import annotations

import gc

import torch

# Tensors the host asked the worker to keep (the lease test).
_kept = []

# About 0.5 s of GPU time: queued before an answer's work, it makes that work land
# long after the call returned unless the receiver is ordered after it.
SLEEP_CYCLES = 1_000_000_000


class Gpu:
    def ping(self):
        return True

    def describe(self, t):
        """What arrived: device, dtype, view, storage size, and the values (read on the
        current stream: `.cpu()` is ordered after the wait tensorwire queued)."""
        return {
            "device": str(t.device),
            "dtype": str(t.dtype),
            "shape": list(t.shape),
            "stride": list(t.stride()),
            "offset": t.storage_offset(),
            "storage_nbytes": t.untyped_storage().nbytes(),
            "values": t.cpu().tolist(),
        }

    def all_equal(self, t, value):
        """True if every element is `value` (read on the current stream)."""
        return bool(torch.all(t == value).item())

    def add_one_in_place(self, t):
        """Write through the received tensor (the host's memory if zero-copy), and make
        the write visible before answering."""
        t.add_(1)
        torch.cuda.synchronize(t.device)
        return None

    def doubled_late(self, t):
        """`t * 2`, queued behind a long GPU sleep, returned without a synchronize: the host
        sees the right values only if it is ordered after this stream."""
        # Load both kernels first: a lazy module load can synchronize the device, which
        # would hide a missing wait on the host's side.
        _ = t * 2
        torch.cuda._sleep(1)
        torch.cuda._sleep(SLEEP_CYCLES)
        return t * 2

    def echo(self, t):
        """The received tensor itself (sent on: tensorwire.rpc clones a received CUDA
        tensor it is asked to send back)."""
        return t

    def keep(self, t):
        _kept.append(t)
        return len(_kept)

    def drop_kept(self):
        _kept.clear()
        gc.collect()
        return True
