// Tensors under leases: `send` exports a CPU tensor (zero-copy from a sealed segment, or a
// received tensor forwarded as the producer's memory; else copied once into a segment),
// `recv` returns the peer's tensor aliasing its memory, `stats` counts what the leases did.
#include <memory>
#include <mutex>

#include "common.h"

namespace tensorwire_torch {
namespace {

bool is_zero_copy(const at::Tensor& t) {
  // A conjugate/negative view would lose its lazy bit on the other side: copy it.
  if (t.is_conj() || t.is_neg()) return false;
  // A received tensor is forwarded as the producer's memory (tw_peer_export_imported).
  if (import_of(t.storage()) != nullptr) return true;
  const SegmentCtx* s = segment_of(t.storage());
  return s != nullptr && s->sealed;
}

bool is_shared(const at::Tensor& self) {
  check_exportable(self, "is_shared");
  return is_zero_copy(self);
}

bool send(int64_t conn, const at::Tensor& tensor, int64_t tag, int64_t window_ms) {
  check_exportable(tensor, "send");
  TORCH_CHECK(tag >= 0, "tensorwire.send: tag must be >= 0, got ", tag);
  TORCH_CHECK(window_ms >= 0, "tensorwire.send: window_ms must be >= 0, got ", window_ms);
  auto live = connection(conn, "send");
  bool zero_copy = is_zero_copy(tensor);
  if (zero_copy) {
    if (tw_imported_t* imp = import_of(tensor.storage())) {
      forward_import(live->peer, imp, tensor, tag, window_ms);
      return true;
    }
  }
  at::Tensor src = zero_copy ? tensor : to_shared(tensor);
  const c10::Storage& storage = src.storage();
  const SegmentCtx* seg = segment_of(storage);
  TORCH_INTERNAL_ASSERT(seg != nullptr);
  auto base = static_cast<const char*>(tw_segment_data(seg->seg));
  auto data = static_cast<const char*>(storage.data_ptr().get());
  TORCH_INTERNAL_ASSERT(data >= base);
  size_t offset = static_cast<size_t>(data - base);
  tw_layout_t l = make_layout(src.scalar_type(), src.sizes(), src.strides(), src.storage_offset(), "send");
  // The lease owns a reference to the storage; tw_peer_export calls release_storage
  // exactly once (also when it fails, before returning).
  auto* owner = new c10::Storage(storage);
  TW_CHECK(tw_peer_export(live->peer, seg->seg, offset, storage.nbytes(), &l, static_cast<uint64_t>(tag),
                          static_cast<uint64_t>(window_ms), &release_storage, owner, nullptr));
  return zero_copy;
}

std::tuple<at::Tensor, int64_t> recv(int64_t conn, int64_t timeout_ms) {
  auto live = connection(conn, "recv");
  std::lock_guard<std::mutex> one_receiver(live->recv_mu);
  tw_imported_t* imp = nullptr;
  tw_message_t* msg = nullptr;
  TW_CHECK(tw_peer_recv(live->peer, timeout_ms, &imp, &msg));
  if (msg != nullptr) {
    size_t len = 0;
    tw_message_data(msg, &len);
    tw_message_free(msg);
    TORCH_CHECK(false, "tensorwire.recv: expected a tensor, the peer sent a user message of ", len,
                " bytes (dropped)");
  }
  std::unique_ptr<tw_imported_t, decltype(&tw_imported_free)> guard(imp, &tw_imported_free);
  tw_layout_t l{};
  TW_CHECK(tw_imported_layout(imp, &l));
  auto dtype = imported_dtype(l, "recv");
  int64_t tag = static_cast<int64_t>(tw_imported_tag(imp));
  int32_t device = tw_imported_device(imp);
  if (device >= 0) {
#ifdef TENSORWIRE_WITH_CUDA
    return {wrap_cuda_import(guard.release(), l, dtype), tag};
#else
    // Only reachable where a driver is present (tensorwire opened the handle).
    TORCH_CHECK(false, "tensorwire.recv: the peer sent a tensor in the memory of CUDA device ", device,
                ", but this libtensorwire_torch was built without CUDA (no CUDA toolkit was found at build time); "
                "rebuild cpp/ where nvcc is installed. The tensor was dropped (its lease released).");
#endif
  }
  size_t nbytes = tw_imported_storage_len(imp);
  void* storage_ptr = tw_imported_storage(imp);
  // The deleter releases the lease when the last tensor/view over this storage dies.
  c10::DataPtr dp(storage_ptr, guard.release(), &import_deleter, at::Device(at::kCPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(dp), nullptr, false);
  at::Tensor t = over_storage(std::move(storage), dtype, at::IntArrayRef(l.sizes, l.ndim),
                              at::IntArrayRef(l.strides, l.ndim), l.storage_offset);
  return {t, tag};
}

std::vector<int64_t> stats(int64_t conn) {
  auto live = connection(conn, "stats");
  tw_lease_stats_t s{};
  TW_CHECK(tw_peer_reap(live->peer, &s));
  return {static_cast<int64_t>(s.live_leases), static_cast<int64_t>(s.live_bytes), static_cast<int64_t>(s.granted),
          static_cast<int64_t>(s.released),    static_cast<int64_t>(s.expired),    static_cast<int64_t>(s.reclaimed)};
}

}  // namespace

void forward_import(tw_peer_t* peer, tw_imported_t* imp, const at::Tensor& t, int64_t tag, int64_t window_ms,
                    std::optional<size_t> cuda_stream) {
  const c10::Storage& storage = t.storage();
  // recv's storage starts at the import's storage: the view's offset is relative to it.
  TORCH_INTERNAL_ASSERT(storage.data_ptr().get() == tw_imported_storage(imp));
  tw_layout_t l = make_layout(t.scalar_type(), t.sizes(), t.strides(), t.storage_offset(), "send");
  // tw_peer_export_imported(_cuda) calls release_storage exactly once (also when it fails,
  // before returning).
  auto* owner = new c10::Storage(storage);
  auto utag = static_cast<uint64_t>(tag), window = static_cast<uint64_t>(window_ms);
  TW_CHECK(cuda_stream ? tw_peer_export_imported_cuda(peer, imp, &l, *cuda_stream, utag, window, &release_storage, owner,
                                                      nullptr)
                       : tw_peer_export_imported(peer, imp, &l, utag, window, &release_storage, owner, nullptr));
}

TORCH_LIBRARY_IMPL(tensorwire, CPU, m) {
  m.impl("is_shared", &is_shared);
  m.impl("send", &send);
}

// No tensor arguments: these run on the CompositeExplicitAutograd kernel.
TORCH_LIBRARY_IMPL(tensorwire, CompositeExplicitAutograd, m) {
  m.impl("recv", &recv);
  m.impl("stats", &stats);
}

}  // namespace tensorwire_torch
