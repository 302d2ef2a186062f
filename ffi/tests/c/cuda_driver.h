/* The few CUDA driver entry points the C tests use, resolved from libcuda.so.1 with dlopen
 * (the _v2 ABI names, as cuda.h maps them): no CUDA headers or toolkit needed, and a
 * machine without a driver can still build and run the tests (they then skip). */
#ifndef TW_TEST_CUDA_DRIVER_H
#define TW_TEST_CUDA_DRIVER_H
#include <dlfcn.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUstream;
typedef void *CUcontext;
static struct {
  void *lib;
  CUresult (*Init)(unsigned);
  CUresult (*DeviceGet)(int *, int);
  CUresult (*PrimaryCtxRetain)(CUcontext *, int);
  CUresult (*PrimaryCtxRelease)(int);
  CUresult (*CtxSetCurrent)(CUcontext);
  CUresult (*MemAlloc)(CUdeviceptr *, size_t);
  CUresult (*MemFree)(CUdeviceptr);
  CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
  CUresult (*MemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
  CUresult (*MemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*MemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
  CUresult (*StreamCreate)(CUstream *, unsigned);
  CUresult (*StreamDestroy)(CUstream);
  CUresult (*StreamSynchronize)(CUstream);
} cu;

#define CU(call)                                                                        \
  do {                                                                                  \
    CUresult e_ = (call);                                                               \
    if (e_ != 0) {                                                                      \
      fprintf(stderr, "%s:%d: %s -> CUDA error %d\n", __FILE__, __LINE__, #call, e_);   \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)

static inline void *cu_sym(const char *name) {
  void *p = dlsym(cu.lib, name);
  if (p == NULL) {
    fprintf(stderr, "libcuda.so.1 has no %s\n", name);
    exit(1);
  }
  return p;
}

/* Resolve the driver; false if no libcuda.so.1 can be loaded (the test then skips: exit
 * 77, ctest's SKIP_RETURN_CODE) — unless simcuda/run.sh started the test
 * (TW_EXPECT_SIMCUDA), where a missing driver is a failure: exit 1. */
static inline bool load_driver(void) {
  cu.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (cu.lib == NULL) {
    if (getenv("TW_EXPECT_SIMCUDA") != NULL) {
      fprintf(stderr, "simcuda/run.sh ran this, but libcuda.so.1 did not load: %s\n", dlerror());
      exit(1);
    }
    return false;
  }
  cu.Init = (__typeof__(cu.Init))cu_sym("cuInit");
  cu.DeviceGet = (__typeof__(cu.DeviceGet))cu_sym("cuDeviceGet");
  cu.PrimaryCtxRetain = (__typeof__(cu.PrimaryCtxRetain))cu_sym("cuDevicePrimaryCtxRetain");
  cu.PrimaryCtxRelease = (__typeof__(cu.PrimaryCtxRelease))cu_sym("cuDevicePrimaryCtxRelease_v2");
  cu.CtxSetCurrent = (__typeof__(cu.CtxSetCurrent))cu_sym("cuCtxSetCurrent");
  cu.MemAlloc = (__typeof__(cu.MemAlloc))cu_sym("cuMemAlloc_v2");
  cu.MemFree = (__typeof__(cu.MemFree))cu_sym("cuMemFree_v2");
  cu.MemcpyHtoDAsync = (__typeof__(cu.MemcpyHtoDAsync))cu_sym("cuMemcpyHtoDAsync_v2");
  cu.MemcpyDtoHAsync = (__typeof__(cu.MemcpyDtoHAsync))cu_sym("cuMemcpyDtoHAsync_v2");
  cu.MemcpyDtoDAsync = (__typeof__(cu.MemcpyDtoDAsync))cu_sym("cuMemcpyDtoDAsync_v2");
  cu.MemsetD8Async = (__typeof__(cu.MemsetD8Async))cu_sym("cuMemsetD8Async");
  cu.StreamCreate = (__typeof__(cu.StreamCreate))cu_sym("cuStreamCreate");
  cu.StreamDestroy = (__typeof__(cu.StreamDestroy))cu_sym("cuStreamDestroy_v2");
  cu.StreamSynchronize = (__typeof__(cu.StreamSynchronize))cu_sym("cuStreamSynchronize");
  return true;
}

/* Driver up on device 0 in this process, primary context current; returns a new stream.
 * CUDA state does not survive fork: each process starts the driver itself, after its
 * last fork. */
static inline CUstream start_driver(void) {
  int dev;
  CUcontext ctx;
  CUstream s;
  CU(cu.Init(0));
  CU(cu.DeviceGet(&dev, 0));
  CU(cu.PrimaryCtxRetain(&ctx, dev));
  CU(cu.CtxSetCurrent(ctx));
  CU(cu.StreamCreate(&s, 0));
  return s;
}

/* Undo start_driver and close the library: a process's last CUDA call. */
static inline void stop_driver(CUstream s) {
  CU(cu.StreamDestroy(s));
  CU(cu.CtxSetCurrent(NULL));
  CU(cu.PrimaryCtxRelease(0));
  dlclose(cu.lib);
}

/* `n` bytes of device memory at `p`, copied to a new host buffer (the caller frees it)
 * once the work queued on `s` before has run. */
static inline void *copy_to_host(CUdeviceptr p, size_t n, CUstream s) {
  void *host = malloc(n);
  if (host == NULL) {
    fprintf(stderr, "no memory for %zu bytes\n", n);
    exit(1);
  }
  CU(cu.MemcpyDtoHAsync(host, p, n, s));
  CU(cu.StreamSynchronize(s));
  return host;
}

#endif
