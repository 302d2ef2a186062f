"""Load simcuda as libcuda.so.1 (LD_LIBRARY_PATH from simcuda/run.sh), use it, and, if asked,
keep it loaded until told to go on, then use it again: the holder in simcuda/install_test.sh.

    python3 install_test_holder.py                 # use it once
    python3 install_test_holder.py READY GO        # use it, touch READY, wait for GO, use it again
"""
import ctypes
import os
import sys
import time

lib = ctypes.CDLL("libcuda.so.1")
NAMES = {
    0: b"CUDA_SUCCESS",
    1: b"CUDA_ERROR_INVALID_VALUE",
    201: b"CUDA_ERROR_INVALID_CONTEXT",
    712: b"CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
    801: b"CUDA_ERROR_NOT_SUPPORTED",
}


def ok(r, what):
    if r != 0:
        raise SystemExit(f"holder: {what} returned {r}")


def use(round_):
    """Calls that run code all over the library: errors, devices, a context, a stream worker."""
    ok(lib.cuInit(0), "cuInit")
    n = ctypes.c_int()
    ok(lib.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
    for code, name in NAMES.items():
        p = ctypes.c_char_p()
        ok(lib.cuGetErrorName(code, ctypes.byref(p)), "cuGetErrorName")
        if p.value != name:
            raise SystemExit(f"holder: cuGetErrorName({code}) = {p.value!r}, want {name!r}")
    ctx = ctypes.c_void_p()
    ok(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0), "cuDevicePrimaryCtxRetain")
    ok(lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent_v2")
    d = ctypes.c_uint64()
    ok(lib.cuMemAlloc_v2(ctypes.byref(d), ctypes.c_size_t(4096)), "cuMemAlloc_v2")
    ok(lib.cuMemsetD8_v2(d, ctypes.c_ubyte(round_ % 256), ctypes.c_size_t(4096)), "cuMemsetD8_v2")
    buf = (ctypes.c_ubyte * 4096)()
    ok(lib.cuMemcpyDtoH_v2(buf, d, ctypes.c_size_t(4096)), "cuMemcpyDtoH_v2")
    if any(b != round_ % 256 for b in buf):
        raise SystemExit("holder: device memory read back wrong")
    ok(lib.cuMemFree_v2(d), "cuMemFree_v2")
    ok(lib.cuCtxPopCurrent_v2(ctypes.byref(ctx)), "cuCtxPopCurrent_v2")


for a in ("cuMemAlloc_v2", "cuMemcpyDtoH_v2"):
    getattr(lib, a).restype = ctypes.c_int
lib.cuMemsetD8_v2.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t]
lib.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]

use(1)
if len(sys.argv) == 3:
    ready, go = sys.argv[1:]
    open(ready, "w").close()
    deadline = time.monotonic() + 300
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            raise SystemExit("holder: never told to go on")
        time.sleep(0.01)
    for i in range(50):
        use(i + 2)
print("holder: ok")
