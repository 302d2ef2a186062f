// The CPU ring (a bounce buffer registered once per connection): `ring_send` packs any
// strided view into it, `ring_recv` returns the next tensor as a private copy the tensor
// owns. A CUDA tensor given to `ring_send` goes to the GPU ring (cuda.cpp).
#include <cstring>
#include <memory>
#include <mutex>

#include "common.h"

namespace tensorwire_torch {
namespace {

void ring_message_deleter(void* ctx) { tw_ring_message_free(static_cast<tw_ring_message_t*>(ctx)); }

void ring_send(int64_t conn, const at::Tensor& tensor, int64_t tag, int64_t timeout_ms) {
  TORCH_CHECK(tensor.defined(), "tensorwire.ring_send: undefined tensor");
  if (tensor.is_cuda() && tensor.layout() == at::kStrided) return ring_send_cuda(conn, tensor, tag, timeout_ms);
  TORCH_CHECK(tensor.device().is_cpu() || tensor.is_cuda(), "tensorwire.ring_send: tensor is on ", tensor.device(),
              "; the rings carry CPU tensors (CPU ring) and CUDA tensors (GPU ring)");
  check_strided_dtype(tensor, "ring_send", "sent");
  TORCH_CHECK(tag >= 0, "tensorwire.ring_send: tag must be >= 0, got ", tag);
  auto live = connection(conn, "ring_send");
  // The ring carries bytes: a lazy conjugate/negative bit is applied first.
  at::Tensor src = tensor.is_conj() || tensor.is_neg() ? tensor.resolve_conj().resolve_neg() : tensor;
  const c10::Storage& storage = src.storage();
  tw_layout_t l = make_layout(src.scalar_type(), src.sizes(), src.strides(), src.storage_offset(), "ring_send");
  // tensorwire packs the view (any strides) straight from the storage into the ring.
  TW_CHECK(tw_peer_ring_send_view(live->peer, static_cast<uint64_t>(tag), storage.data(), storage.nbytes(), &l,
                                  timeout_ms));
}

std::tuple<at::Tensor, int64_t> ring_recv(int64_t conn, int64_t timeout_ms) {
  auto live = connection(conn, "ring_recv");
  std::lock_guard<std::mutex> one_receiver(live->ring_recv_mu);
  tw_ring_message_t* msg = nullptr;
  // Not borrowed: the bytes are this process's private copy (the peer cannot scribble
  // them), so the tensor can own them without another copy.
  TW_CHECK(tw_peer_ring_recv(live->peer, timeout_ms, /*borrow=*/false, &msg));
  std::unique_ptr<tw_ring_message_t, decltype(&tw_ring_message_free)> guard(msg, &tw_ring_message_free);
  size_t len = 0;
  const void* data = tw_ring_message_data(msg, &len);
  const tw_desc_t* desc = tw_ring_message_desc(msg);
  TORCH_CHECK(desc != nullptr, "tensorwire.ring_recv: expected a tensor, the peer sent ", len,
              " bytes through the ring (dropped)");
  TORCH_INTERNAL_ASSERT(!tw_ring_message_is_borrowed(msg));
  tw_layout_t l{};
  TW_CHECK(tw_desc_layout(desc, &l));
  auto dtype = imported_dtype(l, "ring_recv");
  int64_t tag = static_cast<int64_t>(tw_ring_message_tag(msg));
  at::IntArrayRef sizes(l.sizes, l.ndim), strides(l.strides, l.ndim);
  // tensorwire checked that the descriptor is the packed contiguous layout of the bytes.
  uint64_t need = extent_bytes(l);
  TORCH_CHECK(need <= len && l.storage_offset == 0, "tensorwire.ring_recv: the descriptor needs ", need,
              " bytes at offset ", l.storage_offset, ", the message has ", len);
  auto addr = reinterpret_cast<uintptr_t>(data);
  if (len == 0 || addr % c10::elementSize(dtype) != 0) {
    // Nothing to own (an empty tensor), or bytes not aligned for the dtype: a fresh tensor.
    at::Tensor t = at::empty_strided(sizes, strides, at::TensorOptions().dtype(dtype));
    if (len) std::memcpy(t.data_ptr(), data, need);
    return {t, tag};
  }
  // The tensor owns the message: its deleter frees it when the last view dies.
  c10::DataPtr dp(const_cast<void*>(data), guard.release(), &ring_message_deleter, at::Device(at::kCPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), len, std::move(dp), nullptr, false);
  return {over_storage(std::move(storage), dtype, sizes, strides, 0), tag};
}

}  // namespace

// No tensor arguments (or any device): these run on the CompositeExplicitAutograd kernel.
TORCH_LIBRARY_IMPL(tensorwire, CompositeExplicitAutograd, m) {
  m.impl("ring_send", &ring_send);  // any device: CUDA tensors go to the GPU ring
  m.impl("ring_recv", &ring_recv);
}

}  // namespace tensorwire_torch
