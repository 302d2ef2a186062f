"""The extension class of the pyisolate tests (pyisolate_host.py): runs in the child;
pyisolate imports it there by module and class name."""

from __future__ import annotations

import os

import torch

from pyisolate import ExtensionBase

HELD: list = []


class TensorExtension(ExtensionBase):
    """Runs in the child."""

    async def info(self, t):
        """What arrived: pid, type, shape, strides, sum."""
        return {"pid": os.getpid(), "is_tensor": isinstance(t, torch.Tensor), "shape": list(t.shape),
                "stride": list(t.stride()), "sum": float(t.double().sum())}

    async def flip(self, t):
        """Add 1 to element 0 in place (visible to the host only if zero-copy)."""
        t.view(-1)[0] += 1
        return None

    async def make(self, n):
        """A tensor made in the child, sent back to the host."""
        return torch.arange(n, dtype=torch.float32)

    async def echo(self, t):
        """The same tensor back (a round trip carrying it both ways)."""
        return t

    async def touch(self, t):
        """Receive and drop (a call carrying one tensor one way)."""
        return None

    async def hold(self, t):
        """Keep the tensor (until the process dies)."""
        HELD.append(t)
        return len(HELD)

    async def pid(self):
        return os.getpid()



    async def adapter_info(self):
        """The adapter pyisolate rehydrated here, and the host adapter inside it."""
        from pyisolate._internal.adapter_registry import AdapterRegistry

        adapter = AdapterRegistry.get()
        inner = getattr(adapter, "inner", None)
        return {"type": type(adapter).__name__, "identifier": adapter.identifier if adapter else None,
                "inner": type(inner).__name__ if inner is not None else None}

    async def mock_double(self, data):
        """A host adapter's own type (MockTestData): what arrived (its serializer's form:
        its deserializer is keyed by a ``__type__`` the form does not carry, so pyisolate
        hands the dict on), and one made here, which this child's registry serializes."""
        from pyisolate_reference_adapters import MockTestData

        value = data.value if isinstance(data, MockTestData) else data["value"]
        return [data if isinstance(data, dict) else repr(data), MockTestData(value * 2)]

    async def registry_kind(self):
        """What MockRegistry is here: pyisolate's remote caller (a ``CallWrapper``) when
        the host adapter's RPC services reached this child, else a local instance."""
        from pyisolate_reference_adapters import MockRegistry

        return type(MockRegistry()).__name__
