"""A shared CPU tensor handed to torch two ways, same run, same machine: the libtorch
extension's op (``torch.ops.tensorwire.zeros``: a segment made in Rust, wrapped by
``at::from_blob`` in C++) and the PyO3 binding (``tensorwire._native.segment_storage``:
the same segment, a DLPack capsule, ``torch.from_dlpack`` and a dtype/shape view), each
followed by dropping the tensor (the segment unmapped). Also the export-side check:
``torch.ops.tensorwire.is_shared`` vs ``_native.is_segment`` on the storage address.
And a send/recv round trip of a 4 KiB shared tensor over an in-process connected pair
(export under a lease, import, tensor made, dropped, lease released): the package's
``Connection`` over ``torch.ops`` vs ``_native.Peer`` + ``torch.from_dlpack``.

    TENSORWIRE_TORCH_LIB=build/torch-ext/libtensorwire_torch.so \\
    TENSORWIRE_NATIVE=build/native-wheel/x/_native/_native.abi3.so \\
    PYTHONPATH=python .venv/bin/python benches/dlpack_vs_ops.py

Prints the median over 7 runs of the mean µs per call (2000 calls each).
"""
import importlib.util
import os
import statistics
import threading
import time

import torch

import tensorwire

spec = importlib.util.spec_from_file_location("tensorwire._native", os.environ["TENSORWIRE_NATIVE"])
native = importlib.util.module_from_spec(spec)
spec.loader.exec_module(native)
ops = torch.ops.tensorwire


def per_call(fn, n=2000):
    runs = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)


def via_dlpack():
    return torch.from_dlpack(native.segment_storage(4096)).view(torch.float32).view(32, 32)


def via_ops():
    return ops.zeros([32, 32], dtype=torch.float32)


a, b = via_ops(), via_dlpack()
assert a.shape == b.shape and a.dtype == b.dtype

ta, tb = tensorwire.socketpair(inheritable_child=False)
other = {}
th = threading.Thread(target=lambda: other.setdefault("b", tensorwire.from_fd(tb)))  # both ends handshake
th.start()
ca = tensorwire.from_fd(ta)
th.join()
cb = other["b"]
pa, pb = native.Peer.pair()


def rt_ops():
    ca.send(a)
    cb.recv(timeout=10.0)


def rt_native():
    s = b.untyped_storage()
    pa.send(s.data_ptr(), s.nbytes(), "float32", [32, 32], [32, 1], 0)
    cap, dtype, sizes, strides, off, _tag = pb.recv(10.0)
    torch.from_dlpack(cap).view(getattr(torch, dtype)).as_strided(sizes, strides, off)


print(f"send + recv + drop, 4 KiB:         torch.ops {per_call(rt_ops, 500):.1f} us, DLPack {per_call(rt_native, 500):.1f} us")
print(f"make + drop a 4 KiB shared tensor: torch.ops {per_call(via_ops):.1f} us, DLPack {per_call(via_dlpack):.1f} us")
print(f"is it ours (export check):         torch.ops {per_call(lambda: ops.is_shared(a)):.2f} us, "
      f"_native {per_call(lambda: native.is_segment(b.data_ptr(), b.untyped_storage().nbytes())):.2f} us")
