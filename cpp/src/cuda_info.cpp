// CUDA ops that need no CUDA headers (the C ABI answers them): whether this build has
// CUDA, whether a driver works, the device count, the IPC handle cache. In a build without
// CUDA (no toolkit found), also the answers for CUDA tensors: the reason, not the
// dispatcher's "could not run with arguments from the CUDA backend".
#include <cstdlib>
#include <mutex>
#include <string>

#include "common.h"

namespace tensorwire_torch {
namespace {

bool cuda_built() {
#ifdef TENSORWIRE_WITH_CUDA
  return true;
#else
  return false;
#endif
}

bool cuda_available() { return cuda_built() && tw_cuda_available(); }

int64_t cuda_device_count() {
  int32_t n = 0;
  TW_CHECK(tw_cuda_device_count(&n));  // TW_ERR_CUDA_UNAVAILABLE (with the reason) without a driver
  return n;
}

std::vector<int64_t> cuda_ipc_cache_stats() {
  uint64_t opens = 0, open_handles = 0;
  tw_cuda_ipc_cache_stats(&opens, &open_handles);
  return {static_cast<int64_t>(opens), static_cast<int64_t>(open_handles)};
}

void cuda_ipc_cache_keep_warm(int64_t n) {
  TORCH_CHECK(n >= 0, "tensorwire.cuda_ipc_cache_keep_warm: n must be >= 0, got ", n);
  tw_cuda_ipc_cache_keep_warm(static_cast<size_t>(n));
}

#ifndef TENSORWIRE_WITH_CUDA
// A CUDA tensor reached `op` in a build without CUDA: say so, with the library's own
// reason too where there is no driver either.
[[noreturn]] void cuda_unbuilt(const char* op, const at::Tensor& tensor) {
  int32_t n = 0;
  tw_result_e r = tw_cuda_device_count(&n);
  TORCH_CHECK(false, "tensorwire.", op, ": tensor is on ", tensor.device(),
              ", but this libtensorwire_torch was built without CUDA (no CUDA toolkit was found at build time); "
              "rebuild cpp/ where nvcc is installed",
              r == TW_OK ? std::string() : std::string("; tensorwire (") + tw_result_name(r) + "): " +
                                               tw_last_error_message());
  std::abort();  // unreachable: TORCH_CHECK(false) throws
}

bool send_cuda_unbuilt(int64_t, const at::Tensor& tensor, int64_t, int64_t) { cuda_unbuilt("send", tensor); }
#endif

}  // namespace

#ifndef TENSORWIRE_WITH_CUDA
void ring_send_cuda(int64_t, const at::Tensor& tensor, int64_t, int64_t) { cuda_unbuilt("ring_send", tensor); }

std::tuple<at::Tensor, int64_t> cuda_ring_recv(int64_t conn, int64_t timeout_ms) {
  auto live = connection(conn, "cuda_ring_recv");
  std::lock_guard<std::mutex> one_receiver(live->cuda_ring_recv_mu);
  uint64_t tag = 0;
  tw_layout_t l{};
  // The library's reason (no GPU ring offered, no driver here) comes first.
  TW_CHECK(tw_peer_cuda_ring_recv(live->peer, timeout_ms, &tag, &l, nullptr, nullptr));
  (void)tw_peer_cuda_ring_discard(live->peer, timeout_ms);
  TORCH_CHECK(false, "tensorwire.cuda_ring_recv: this libtensorwire_torch was built without CUDA (no CUDA toolkit "
              "was found at build time); the message (tag ", tag, ") was dropped");
}

TORCH_LIBRARY_IMPL(tensorwire, CUDA, m) {
  m.impl("send", &send_cuda_unbuilt);
}
#endif

// No tensor arguments: these run on the CompositeExplicitAutograd kernel.
TORCH_LIBRARY_IMPL(tensorwire, CompositeExplicitAutograd, m) {
  m.impl("cuda_ring_recv", &cuda_ring_recv);  // cuda.cpp's, or the one above
  m.impl("cuda_built", &cuda_built);
  m.impl("cuda_available", &cuda_available);
  m.impl("cuda_device_count", &cuda_device_count);
  m.impl("cuda_ipc_cache_stats", &cuda_ipc_cache_stats);
  m.impl("cuda_ipc_cache_keep_warm", &cuda_ipc_cache_keep_warm);
}

}  // namespace tensorwire_torch
