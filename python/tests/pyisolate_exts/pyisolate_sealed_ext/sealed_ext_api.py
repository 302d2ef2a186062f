"""The sealed worker's extension class (pyisolate_host.py, scenario ``sealed``). A
sealed worker runs in this directory (pyisolate's ``cwd``), which is how it imports
this module by name."""

import os

from pyisolate import ExtensionBase


class SealedExtension(ExtensionBase):
    """Runs in the sealed child."""

    async def shape(self, t):
        """The shape of what arrived: pyisolate's JSON tensor (a TensorValue, or what
        the child's deserializer made of it)."""
        if isinstance(t, dict):
            return list(t["tensor_size"])
        return list(t.shape)

    async def pid(self):
        return os.getpid()
