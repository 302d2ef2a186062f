"""The object the workers of test_rpc_ordinary.py serve: imported in the worker process,
never in the test's."""
from __future__ import annotations

import os

import torch


class Keeper:
    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []

    def echo(self, t):
        return t

    def layout_and_bytes(self, t):
        packed = t.contiguous().reshape(-1).view(torch.uint8)
        return {"dtype": str(t.dtype), "shape": list(t.shape), "stride": list(t.stride()), "bytes": packed.tolist()}

    def keep_and_return(self, t):
        """Keep what arrived and send it back as it is."""
        self.kept.append(t)
        return t

    def keep(self, t):
        self.kept.append(t)
        return len(self.kept)

    def poke(self, value):
        """Write into the first element of the last tensor kept (this process's view of it)."""
        self.kept[-1].reshape(-1)[0] = value
        return float(self.kept[-1].reshape(-1)[0])

    def write_first(self, t, value):
        t.reshape(-1)[0] = value
        return True

    def drop(self):
        self.kept.clear()
        return True

    def make(self, n):
        """An ordinary tensor of this process (not one it received)."""
        return torch.randn(n)

    def pid(self):
        return os.getpid()

    def storage_kind(self, t):
        """How the tensor arrived here: None (private memory: inline), "import" (a
        segment of the sender's, exported), "sealed" (a segment of this process's)."""
        from tensorwire import _native

        s = t.untyped_storage()
        return _native.storage_kind(s.data_ptr(), s.nbytes())
