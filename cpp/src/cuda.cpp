// CUDA implementations of torch.ops.tensorwire.* — compiled only where CMake finds a CUDA
// toolkit (TENSORWIRE_WITH_CUDA). Without one, cuda_info.cpp answers CUDA tensors with a
// clear error instead.
//
// Export: the storage's base pointer and size go to tw_peer_export_cuda with the view's
// layout and PyTorch's current stream of the tensor's device; tensorwire records an IPC
// event there, so the consumer sees every write queued before `send` without anyone
// synchronizing. The lease owns a reference to the storage (the caching allocator does not
// reuse the block until the consumer released it).
//
// The GPU ring (ring_send of a CUDA tensor, cuda_ring_recv): see the functions below.
//
// Import: the current stream of the device waits for the producer's event (a stream wait,
// never a device synchronize); when the tensor dies, the lease is released once the work
// queued on that stream has completed (tw_imported_release_after: an event, no blocking).
//
// Forward: `send` of a tensor (or any view) whose storage came from `recv` sends the same
// device memory on (tw_peer_export_imported_cuda), never a copy; its lease holds the
// storage, so the upstream lease goes back once both the forward and the local tensors
// are done with it.
#ifndef TENSORWIRE_WITH_CUDA
#error "cuda.cpp is built only with TENSORWIRE_WITH_CUDA (cpp/CMakeLists.txt adds it when a CUDA toolkit is found)"
#endif

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <memory>

#include "common.h"

namespace tensorwire_torch {
namespace {

struct CudaImportCtx {
  tw_imported_t* imp;
  cudaStream_t stream;  // the stream that waited for the producer (current at import time)
  int device;
};

void cuda_import_deleter(void* p) {
  // A deleter must not throw. Non-blocking: tensorwire records an event on the stream
  // that waited for the producer and releases the lease once the work queued there so far
  // has completed (polled by its reaper) — no stream synchronize here. If the event cannot
  // be recorded, the lease is released at once; the handle is consumed either way.
  auto* c = static_cast<CudaImportCtx*>(p);
  (void)tw_imported_release_after(c->imp, reinterpret_cast<uintptr_t>(c->stream));
  delete c;
}

// The import a received CUDA tensor's storage is (wrap_cuda_import's deleter), else NULL.
tw_imported_t* cuda_import_of(const c10::Storage& storage) {
  if (!storage) return nullptr;
  const c10::DataPtr& dp = storage.data_ptr();
  if (dp.get_deleter() != &cuda_import_deleter) return nullptr;
  return static_cast<CudaImportCtx*>(dp.get_context())->imp;
}

bool send_cuda(int64_t conn, const at::Tensor& tensor, int64_t tag, int64_t window_ms) {
  TORCH_CHECK(tensor.defined() && tensor.is_cuda(), "tensorwire.send: expected a CUDA tensor");
  check_strided_dtype(tensor, "send", "shared");
  TORCH_CHECK(tag >= 0, "tensorwire.send: tag must be >= 0, got ", tag);
  TORCH_CHECK(window_ms >= 0, "tensorwire.send: window_ms must be >= 0, got ", window_ms);
  auto live = connection(conn, "send");
  c10::cuda::CUDAGuard device_guard(tensor.device());
  bool zero_copy = !tensor.is_conj() && !tensor.is_neg();
  if (zero_copy) {
    if (tw_imported_t* imp = cuda_import_of(tensor.storage())) {
      // The IPC handle or the producer's VMM fd travels on, ordered on the current stream.
      cudaStream_t stream = c10::cuda::getCurrentCUDAStream(tensor.device().index()).stream();
      forward_import(live->peer, imp, tensor, tag, window_ms, static_cast<size_t>(reinterpret_cast<uintptr_t>(stream)));
      return true;
    }
  }
  // A conjugate/negative view would lose its lazy bit on the other side: resolve it (on the
  // device, on the current stream, ordered before the export's event).
  at::Tensor src = zero_copy ? tensor : tensor.resolve_conj().resolve_neg();
  if (src.storage().nbytes() == 0) {
    // An empty tensor has no allocation to share: export a one-element allocation that the
    // (empty) view never touches, so the consumer still gets the right device and shape.
    at::Tensor holder = at::empty({1}, src.options());
    src = holder.as_strided(src.sizes(), src.strides(), 0);
    zero_copy = false;
  }
  const c10::Storage& storage = src.storage();
  tw_layout_t l = make_layout(src.scalar_type(), src.sizes(), src.strides(), src.storage_offset(), "send");
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(src.device().index()).stream();
  // The lease owns a reference to the storage; tw_peer_export_cuda calls release_storage
  // exactly once (also when it fails, before returning).
  auto* owner = new c10::Storage(storage);
  TW_CHECK(tw_peer_export_cuda(live->peer, static_cast<uint64_t>(reinterpret_cast<uintptr_t>(storage.data())),
                               static_cast<uint64_t>(storage.nbytes()), &l,
                               static_cast<size_t>(reinterpret_cast<uintptr_t>(stream)), static_cast<uint64_t>(tag),
                               static_cast<uint64_t>(window_ms), &release_storage, owner, nullptr));
  return zero_copy;
}

// The GPU ring: `tensor` is packed on the current stream (a no-op if contiguous) and
// copied through the connection's device arena there; nothing synchronizes. The packed
// source is used by work on the current stream only, so the caching allocator's stream
// semantics keep it valid until the copies ran.
}  // namespace

void ring_send_cuda(int64_t conn, const at::Tensor& tensor, int64_t tag, int64_t timeout_ms) {
  TORCH_CHECK(tensor.defined() && tensor.is_cuda(), "tensorwire.ring_send: expected a CUDA tensor");
  check_strided_dtype(tensor, "ring_send", "sent");
  TORCH_CHECK(tag >= 0, "tensorwire.ring_send: tag must be >= 0, got ", tag);
  auto live = connection(conn, "ring_send");
  c10::cuda::CUDAGuard device_guard(tensor.device());
  at::Tensor src = tensor.resolve_conj().resolve_neg().contiguous();
  // Contiguous (size-1 dims may carry any stride, which tensorwire accepts as well).
  tw_layout_t l = make_layout(src.scalar_type(), src.sizes(), src.strides(), 0, "ring_send");
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(src.device().index()).stream();
  TW_CHECK(tw_peer_cuda_ring_send(live->peer, static_cast<uint64_t>(reinterpret_cast<uintptr_t>(src.data_ptr())), &l,
                                  static_cast<size_t>(reinterpret_cast<uintptr_t>(stream)),
                                  static_cast<uint64_t>(tag), timeout_ms));
}

std::tuple<at::Tensor, int64_t> cuda_ring_recv(int64_t conn, int64_t timeout_ms) {
  auto live = connection(conn, "cuda_ring_recv");
  std::lock_guard<std::mutex> one_receiver(live->cuda_ring_recv_mu);
  uint64_t tag = 0, nbytes = 0;
  int32_t device = -1;
  tw_layout_t l{};
  TW_CHECK(tw_peer_cuda_ring_recv(live->peer, timeout_ms, &tag, &l, &device, &nbytes));
  try {
    auto dtype = imported_dtype(l, "cuda_ring_recv");
    int64_t visible = c10::cuda::device_count();
    TORCH_CHECK(device >= 0 && device < visible, "tensorwire.cuda_ring_recv: the peer's GPU ring is on CUDA device ",
                device, "; this process sees ", visible, " CUDA device(s) (check CUDA_VISIBLE_DEVICES on both sides)");
    auto index = static_cast<c10::DeviceIndex>(device);
    c10::cuda::CUDAGuard device_guard(index);
    at::Tensor out = at::empty(at::IntArrayRef(l.sizes, l.ndim), at::TensorOptions().dtype(dtype).device(at::kCUDA, index));
    TORCH_CHECK(static_cast<uint64_t>(out.nbytes()) == nbytes, "tensorwire.cuda_ring_recv: ", nbytes,
                " bytes do not make a ", out.sizes(), " tensor of ", dtype);
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(index).stream();
    TW_CHECK(tw_peer_cuda_ring_recv_finish(live->peer, static_cast<uint64_t>(reinterpret_cast<uintptr_t>(out.data_ptr())),
                                           nbytes, static_cast<size_t>(reinterpret_cast<uintptr_t>(stream)), timeout_ms));
    return {out, static_cast<int64_t>(tag)};
  } catch (...) {
    // Free the message's slots (a no-op if finish consumed or broke it) so the producer
    // is not left waiting for them.
    (void)tw_peer_cuda_ring_discard(live->peer, timeout_ms);
    throw;
  }
}

at::Tensor wrap_cuda_import(tw_imported_t* imp, const tw_layout_t& l, at::ScalarType dtype) {
  std::unique_ptr<tw_imported_t, decltype(&tw_imported_free)> guard(imp, &tw_imported_free);
  int32_t device = tw_imported_device(imp);
  int64_t visible = c10::cuda::device_count();
  TORCH_CHECK(device >= 0 && device < visible, "tensorwire.recv: the peer sent a tensor of CUDA device ", device,
              "; this process sees ", visible, " CUDA device(s) (check CUDA_VISIBLE_DEVICES on both sides)");
  auto index = static_cast<c10::DeviceIndex>(device);
  c10::cuda::CUDAGuard device_guard(index);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(index).stream();
  // Work queued on this stream from now on runs after the producer's writes.
  TW_CHECK(tw_imported_cuda_wait(imp, static_cast<size_t>(reinterpret_cast<uintptr_t>(stream))));
  auto ctx = std::make_unique<CudaImportCtx>(CudaImportCtx{imp, stream, device});
  guard.release();  // owned by ctx from here
  void* storage_ptr = tw_imported_storage(imp);
  size_t nbytes = tw_imported_storage_len(imp);
  c10::DataPtr dp(storage_ptr, ctx.release(), &cuda_import_deleter, at::Device(at::kCUDA, index));
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(dp), /*allocator=*/nullptr,
                       /*resizable=*/false);
  return over_storage(std::move(storage), dtype, at::IntArrayRef(l.sizes, l.ndim), at::IntArrayRef(l.strides, l.ndim),
                      l.storage_offset, c10::DispatchKey::CUDA);
}

TORCH_LIBRARY_IMPL(tensorwire, CUDA, m) { m.impl("send", &send_cuda); }

}  // namespace tensorwire_torch
