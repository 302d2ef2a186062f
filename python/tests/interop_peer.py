"""Child-process halves of the interop tests (run by torch.multiprocessing spawn)."""

import torch
import torch.multiprocessing as mp

import tensorwire


def torch_to_tensorwire(q_in, q_out):
    """Get a tensor PyTorch shared by fd; view it as a tensorwire tensor; write through it."""
    mp.set_sharing_strategy("file_descriptor")
    t = q_in.get(timeout=60)
    u = tensorwire.from_torch_shared(t)
    ok = torch.equal(u, t) and u.data_ptr() != 0 and not tensorwire.is_shared(u)
    u.mul_(-1)  # through tensorwire's mapping
    del u
    q_out.put(bool(ok))


def tensorwire_to_torch(q_in, q_out):
    """Get a tensorwire segment rebuilt by PyTorch's own rebuild_storage_fd; write through it."""
    mp.set_sharing_strategy("file_descriptor")
    t = q_in.get(timeout=60)
    info = (type(t) is torch.Tensor, t.untyped_storage().is_shared(), tuple(t.shape), t.stride(), t.storage_offset(),
            t.sum().item())
    t.add_(1000)  # through PyTorch's mapping
    del t
    q_out.put(info)
