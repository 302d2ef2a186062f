"""The hostile worker of test_fs_tensors.py (``python -m tensorwire.worker
fs_targets:Liar``): answers pyisolate ``TensorRef`` values naming any file it likes."""
from __future__ import annotations


def tensor_ref(key, strategy="file_system"):
    """A pyisolate CPU ``TensorRef`` naming ``/dev/shm<key>``: four float32."""
    return {"__type__": "TensorRef", "device": "cpu", "strategy": strategy, "manager_path": "",
            "storage_key": key, "storage_size": 16, "dtype": "torch.float32", "tensor_size": [4],
            "tensor_stride": [1], "tensor_offset": 0, "requires_grad": False}


class Liar:
    def give(self, key, strategy="file_system"):
        return tensor_ref(key, strategy)
