// CPU implementations of torch.ops.tensorwire.* (and of the ops that take no tensor,
// registered as CompositeExplicitAutograd so they run without a dispatch key).
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>

#include "common.h"

namespace tensorwire_torch {

void segment_deleter(void* ctx) {
  auto* c = static_cast<SegmentCtx*>(ctx);
  tw_segment_free(c->seg);
  delete c;
}

const SegmentCtx* segment_of(const c10::Storage& storage) {
  if (!storage) return nullptr;
  const c10::DataPtr& dp = storage.data_ptr();
  if (dp.get_deleter() != &segment_deleter) return nullptr;
  return static_cast<const SegmentCtx*>(dp.get_context());
}

void check_dtype(at::ScalarType dtype, const char* what) {
  size_t tw = tw_dtype_size(static_cast<uint8_t>(dtype));
  TORCH_CHECK(tw != 0, "tensorwire.", what, ": dtype ", dtype,
              " is not supported by tensorwire (bool, integer, floating, complex and float8 types are)");
  TORCH_CHECK(tw == c10::elementSize(dtype), "tensorwire.", what, ": dtype ", dtype, " has ",
              c10::elementSize(dtype), "-byte elements in torch but ", tw, " in tensorwire");
}

tw_layout_t make_layout(at::ScalarType dtype, at::IntArrayRef sizes, at::IntArrayRef strides, int64_t storage_offset,
                        const char* what) {
  TORCH_CHECK(sizes.size() <= TW_MAX_NDIM, "tensorwire.", what, ": ", sizes.size(),
              " dimensions; tensorwire carries at most ", TW_MAX_NDIM);
  TORCH_CHECK(sizes.size() == strides.size(), "tensorwire.", what, ": ", sizes.size(), " sizes but ", strides.size(),
              " strides");
  tw_layout_t l{};
  l.dtype = static_cast<uint8_t>(dtype);
  l.ndim = static_cast<uint8_t>(sizes.size());
  l.storage_offset = storage_offset;
  for (size_t i = 0; i < sizes.size(); i++) {
    l.sizes[i] = sizes[i];
    l.strides[i] = strides[i];
  }
  return l;
}

void release_storage(void* ctx) {
  // Runs exactly once, on whichever thread ends the lease (often tensorwire's reaper).
  // Dropping a c10::Storage never calls into Python for segment storages (their
  // deleter is segment_deleter) nor for CUDA ones (the caching allocator), and it does
  // not throw.
  delete static_cast<c10::Storage*>(ctx);
}

at::Tensor over_storage(c10::Storage storage, at::ScalarType dtype, at::IntArrayRef sizes, at::IntArrayRef strides,
                        int64_t storage_offset, c10::DispatchKey key) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(key),
                                                    caffe2::TypeMeta::fromScalarType(dtype));
  t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, storage_offset);
  return t;
}

at::ScalarType imported_dtype(const tw_layout_t& l, const char* what) {
  // The descriptor was validated by tensorwire (known dtype, extent inside the storage).
  TORCH_CHECK(l.dtype < static_cast<int>(at::ScalarType::NumOptions), "tensorwire.", what, ": dtype number ",
              int(l.dtype), " is unknown to this torch");
  auto dtype = static_cast<at::ScalarType>(l.dtype);
  check_dtype(dtype, what);
  return dtype;
}

namespace {

// Bytes the view needs, as tensorwire computes it (overflow, negative values checked).
uint64_t extent_bytes(const tw_layout_t& l) {
  uint64_t n = 0;
  TW_CHECK(tw_layout_extent_bytes(&l, &n));
  return n;
}

void import_deleter(void* ctx) { tw_imported_free(static_cast<tw_imported_t*>(ctx)); }

void ring_message_deleter(void* ctx) { tw_ring_message_free(static_cast<tw_ring_message_t*>(ctx)); }

tw_peer_config_t config(int64_t max_leases, int64_t max_lease_bytes, int64_t window_ms, int64_t handshake_timeout_ms,
                        int64_t ring_bytes, int64_t cuda_ring_device, int64_t cuda_ring_slot_bytes,
                        int64_t cuda_ring_slots) {
  TORCH_CHECK(max_leases >= 0 && max_leases <= UINT32_MAX, "tensorwire: max_leases must be in [0, 2^32), got ",
              max_leases);
  TORCH_CHECK(max_lease_bytes >= 0, "tensorwire: max_lease_bytes must be >= 0, got ", max_lease_bytes);
  TORCH_CHECK(window_ms >= 0, "tensorwire: window_ms must be >= 0, got ", window_ms);
  TORCH_CHECK(handshake_timeout_ms >= 0, "tensorwire: handshake_timeout_ms must be >= 0, got ", handshake_timeout_ms);
  TORCH_CHECK(ring_bytes >= 0, "tensorwire: ring_bytes must be >= 0 (0: the default), got ", ring_bytes);
  tw_peer_config_t c;
  TW_CHECK(tw_peer_config_default(&c));
  if (max_leases) c.max_leases = static_cast<uint32_t>(max_leases);
  if (max_lease_bytes) c.max_lease_bytes = static_cast<uint64_t>(max_lease_bytes);
  if (window_ms) c.default_window_ms = static_cast<uint64_t>(window_ms);
  if (handshake_timeout_ms) c.handshake_timeout_ms = handshake_timeout_ms;
  if (ring_bytes) c.ring_bytes = static_cast<uint64_t>(ring_bytes);  // checked by tensorwire
  TORCH_CHECK(cuda_ring_device >= -1 && cuda_ring_device <= 255,
              "tensorwire: cuda_ring_device must be -1 (no GPU ring) or a device index, got ", cuda_ring_device);
  TORCH_CHECK(cuda_ring_slot_bytes >= 0 && cuda_ring_slots >= 0 && cuda_ring_slots <= UINT32_MAX,
              "tensorwire: cuda_ring_slot_bytes and cuda_ring_slots must be >= 0 (0: the default), got ",
              cuda_ring_slot_bytes, " and ", cuda_ring_slots);
  c.cuda_ring_device = static_cast<int32_t>(cuda_ring_device);
  if (cuda_ring_slot_bytes) c.cuda_ring_slot_bytes = static_cast<uint64_t>(cuda_ring_slot_bytes);  // checked
  if (cuda_ring_slots) c.cuda_ring_slots = static_cast<uint32_t>(cuda_ring_slots);
  return c;
}


}  // namespace

at::Tensor tensor_over_segment(tw_segment_t* seg, bool sealed, size_t nbytes, at::ScalarType dtype,
                               at::IntArrayRef sizes, at::IntArrayRef strides, int64_t storage_offset) {
  std::unique_ptr<tw_segment_t, decltype(&tw_segment_free)> seg_guard(seg, &tw_segment_free);
  TORCH_CHECK(nbytes <= tw_segment_len(seg), "tensorwire: storage of ", nbytes, " bytes does not fit a segment of ",
              tw_segment_len(seg));
  tw_layout_t l = make_layout(dtype, sizes, strides, storage_offset, "tensor_over_segment");
  uint64_t need = extent_bytes(l);
  TORCH_CHECK(need <= nbytes, "tensorwire: the view needs ", need, " bytes of storage, the segment provides ", nbytes);
  auto ctx = std::make_unique<SegmentCtx>(SegmentCtx{seg, sealed});
  seg_guard.release();  // owned by ctx from here
  c10::DataPtr dp(tw_segment_data(seg), ctx.release(), &segment_deleter, at::Device(at::kCPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(dp), /*allocator=*/nullptr,
                       /*resizable=*/false);
  return over_storage(std::move(storage), dtype, sizes, strides, storage_offset);
}

at::Tensor new_segment_tensor(at::IntArrayRef sizes, at::ScalarType dtype) {
  check_dtype(dtype, "empty");
  TORCH_CHECK(sizes.size() <= TW_MAX_NDIM, "tensorwire.empty: ", sizes.size(),
              " dimensions; tensorwire carries at most ", TW_MAX_NDIM);
  for (auto s : sizes) TORCH_CHECK(s >= 0, "tensorwire.empty: negative dimension ", s, " in size ", sizes);
  tw_layout_t l{};
  TW_CHECK(tw_layout_contiguous(static_cast<uint8_t>(dtype), sizes.data(), sizes.size(), &l));
  uint64_t nbytes = extent_bytes(l);
  tw_segment_t* seg = nullptr;
  // A segment cannot be empty; an empty tensor gets one byte it never uses.
  TW_CHECK(tw_segment_new(nbytes ? nbytes : 1, &seg));
  return tensor_over_segment(seg, /*sealed=*/true, nbytes, dtype, sizes,
                             at::IntArrayRef(l.strides, l.ndim), 0);
}

namespace {

at::Tensor empty(at::IntArrayRef size, std::optional<at::ScalarType> dtype) {
  return new_segment_tensor(size, c10::dtype_or_default(dtype));
}

at::Tensor zeros(at::IntArrayRef size, std::optional<at::ScalarType> dtype) {
  // New memfd pages read as zero: nothing to fill.
  return new_segment_tensor(size, c10::dtype_or_default(dtype));
}

void check_exportable(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.defined(), "tensorwire.", what, ": undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), "tensorwire.", what, ": tensor is on ", t.device(),
              "; only CPU tensors can be shared here");
  TORCH_CHECK(t.layout() == at::kStrided, "tensorwire.", what, ": ", t.layout(),
              " tensors cannot be shared; only strided (dense) ones");
  check_dtype(t.scalar_type(), what);
}

at::Tensor to_shared(const at::Tensor& self) {
  check_exportable(self, "to_shared");
  at::Tensor out = new_segment_tensor(self.sizes(), self.scalar_type());
  out.copy_(self);  // resolves conjugate / negative bits too
  return out;
}

// Move the whole storage of `self` into a new sealed segment, in place (every view of the
// storage follows), as Tensor.share_memory_() does with PyTorch's own shared memory: later
// sends of any view of it are zero-copy. A no-op for a storage already in a sealed segment.
at::Tensor& share_(at::Tensor& self) {
  check_exportable(self, "share_");
  c10::Storage storage = self.storage();
  const SegmentCtx* current = segment_of(storage);
  if (current != nullptr && current->sealed) return self;
  TORCH_CHECK(storage.data_ptr().get_deleter() != &import_deleter,
              "tensorwire.share_: this storage is the peer's memory (a received tensor); send it as it is "
              "(it is forwarded as the same memory) or copy it with tensorwire.to_shared");
  size_t nbytes = storage.nbytes();
  tw_segment_t* raw = nullptr;
  TW_CHECK(tw_segment_new(nbytes ? nbytes : 1, &raw));  // a segment cannot be empty
  std::unique_ptr<tw_segment_t, decltype(&tw_segment_free)> seg(raw, &tw_segment_free);
  if (nbytes) std::memcpy(tw_segment_data(seg.get()), storage.data(), nbytes);
  auto ctx = std::make_unique<SegmentCtx>(SegmentCtx{seg.release(), /*sealed=*/true});
  void* data = tw_segment_data(ctx->seg);
  storage.set_data_ptr_noswap(c10::DataPtr(data, ctx.release(), &segment_deleter, at::Device(at::kCPU)));
  // The segment's size is sealed: resizing must fail, not reallocate behind the peer's back.
  storage.unsafeGetStorageImpl()->set_allocator(nullptr);
  storage.unsafeGetStorageImpl()->set_resizable(false);
  return self;
}

// The import a received CPU tensor's storage is (recv's deleter), else NULL.
tw_imported_t* import_of(const c10::Storage& storage) {
  if (!storage) return nullptr;
  const c10::DataPtr& dp = storage.data_ptr();
  if (dp.get_deleter() != &import_deleter) return nullptr;
  return static_cast<tw_imported_t*>(dp.get_context());
}

bool is_zero_copy(const at::Tensor& t) {
  // A conjugate/negative view would lose its lazy bit on the other side: copy it.
  if (t.is_conj() || t.is_neg()) return false;
  // A received tensor is forwarded as the producer's memory (tw_peer_export_imported).
  if (import_of(t.storage()) != nullptr) return true;
  const SegmentCtx* s = segment_of(t.storage());
  return s != nullptr && s->sealed;
}

// Forward a view of a received CPU tensor without a copy: the producer's fd travels on;
// the lease holds the storage (and so the import) until the peer is done with it.
void forward_import(tw_peer_t* peer, tw_imported_t* imp, const at::Tensor& t, int64_t tag, int64_t window_ms) {
  const c10::Storage& storage = t.storage();
  // recv's storage starts at the import's storage: the view's offset is relative to it.
  TORCH_INTERNAL_ASSERT(storage.data_ptr().get() == tw_imported_storage(imp));
  tw_layout_t l = make_layout(t.scalar_type(), t.sizes(), t.strides(), t.storage_offset(), "send");
  auto* owner = new c10::Storage(storage);
  TW_CHECK(tw_peer_export_imported(peer, imp, &l, static_cast<uint64_t>(tag), static_cast<uint64_t>(window_ms),
                                   &release_storage, owner, nullptr));
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

// --- the ring (bounce buffer): copies through a region registered once per connection ---

void ring_send(int64_t conn, const at::Tensor& tensor, int64_t tag, int64_t timeout_ms) {
  TORCH_CHECK(tensor.defined(), "tensorwire.ring_send: undefined tensor");
  if (tensor.is_cuda() && tensor.layout() == at::kStrided) return ring_send_cuda(conn, tensor, tag, timeout_ms);
  TORCH_CHECK(tensor.device().is_cpu() || tensor.is_cuda(), "tensorwire.ring_send: tensor is on ", tensor.device(),
              "; the rings carry CPU tensors (CPU ring) and CUDA tensors (GPU ring)");
  TORCH_CHECK(tensor.layout() == at::kStrided, "tensorwire.ring_send: ", tensor.layout(),
              " tensors cannot be sent; only strided (dense) ones");
  check_dtype(tensor.scalar_type(), "ring_send");
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

// --- CUDA entry points that need no CUDA headers (the C ABI answers them) ---

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
// Built without a CUDA toolkit: a CUDA tensor reaching `send` gets the reason, not the
// dispatcher's "could not run with arguments from the CUDA backend".
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

std::vector<int64_t> stats(int64_t conn) {
  auto live = connection(conn, "stats");
  tw_lease_stats_t s{};
  TW_CHECK(tw_peer_reap(live->peer, &s));
  return {static_cast<int64_t>(s.live_leases), static_cast<int64_t>(s.live_bytes), static_cast<int64_t>(s.granted),
          static_cast<int64_t>(s.released),    static_cast<int64_t>(s.expired),    static_cast<int64_t>(s.reclaimed)};
}

std::tuple<int64_t, int64_t> socketpair() {
  int a = -1, b = -1;
  TW_CHECK(tw_socketpair(&a, &b));
  return {a, b};
}

void set_inheritable(int64_t fd, bool inheritable) {
  TORCH_CHECK(fd >= 0 && fd <= INT32_MAX, "tensorwire.set_inheritable: fd ", fd, " is not a valid descriptor");
  TW_CHECK(tw_fd_set_inheritable(static_cast<int>(fd), inheritable));
}

int64_t from_fd(int64_t fd, int64_t max_leases, int64_t max_lease_bytes, int64_t window_ms, int64_t handshake_timeout_ms,
                int64_t ring_bytes, int64_t cuda_ring_device, int64_t cuda_ring_slot_bytes, int64_t cuda_ring_slots) {
  TORCH_CHECK(fd >= 0 && fd <= INT32_MAX, "tensorwire.from_fd: fd ", fd, " is not a valid descriptor");
  tw_peer_config_t c = config(max_leases, max_lease_bytes, window_ms, handshake_timeout_ms, ring_bytes,
                              cuda_ring_device, cuda_ring_slot_bytes, cuda_ring_slots);
  tw_peer_t* p = nullptr;
  TW_CHECK(tw_peer_from_fd(static_cast<int>(fd), &c, &p));
  return register_connection(p);
}

int64_t connect(c10::string_view path, int64_t max_leases, int64_t max_lease_bytes, int64_t window_ms,
                int64_t handshake_timeout_ms, int64_t ring_bytes, int64_t cuda_ring_device, int64_t cuda_ring_slot_bytes,
                int64_t cuda_ring_slots) {
  tw_peer_config_t c = config(max_leases, max_lease_bytes, window_ms, handshake_timeout_ms, ring_bytes,
                              cuda_ring_device, cuda_ring_slot_bytes, cuda_ring_slots);
  std::string p(path);
  tw_peer_t* peer = nullptr;
  TW_CHECK(tw_peer_connect(p.c_str(), &c, &peer));
  return register_connection(peer);
}

int64_t listen(c10::string_view path) {
  std::string p(path);
  tw_listener_t* l = nullptr;
  TW_CHECK(tw_listener_bind(p.c_str(), &l));
  return register_listener(l, p);
}

int64_t accept(int64_t listener_handle, int64_t timeout_ms, int64_t max_leases, int64_t max_lease_bytes, int64_t window_ms,
               int64_t handshake_timeout_ms, int64_t ring_bytes, int64_t cuda_ring_device, int64_t cuda_ring_slot_bytes,
               int64_t cuda_ring_slots) {
  tw_peer_config_t c = config(max_leases, max_lease_bytes, window_ms, handshake_timeout_ms, ring_bytes,
                              cuda_ring_device, cuda_ring_slot_bytes, cuda_ring_slots);
  auto l = listener(listener_handle, "accept");
  tw_peer_t* p = nullptr;
  TW_CHECK(tw_listener_accept(l->listener, timeout_ms, &c, &p));
  return register_connection(p);
}

void close(int64_t conn) { close_connection(conn); }
void close_listener_op(int64_t l) { close_listener(l); }
int64_t peer_pid(int64_t conn) { return tw_peer_pid(connection(conn, "peer_pid")->peer); }

std::tuple<int64_t, int64_t, int64_t> segment_fd(const at::Tensor& self) {
  TORCH_CHECK(self.defined() && self.device().is_cpu(), "tensorwire.segment_fd: expected a defined CPU tensor");
  const SegmentCtx* seg = segment_of(self.storage());
  TORCH_CHECK(seg != nullptr,
              "tensorwire.segment_fd: the tensor does not live in a tensorwire segment; create it with "
              "tensorwire.empty/zeros or copy it with tensorwire.to_shared");
  int fd = fcntl(tw_segment_fd(seg->seg), F_DUPFD_CLOEXEC, 0);
  TORCH_CHECK(fd >= 0, "tensorwire.segment_fd: dup failed: ", std::strerror(errno));
  auto base = static_cast<const char*>(tw_segment_data(seg->seg));
  auto data = static_cast<const char*>(self.storage().data_ptr().get());
  return {fd, static_cast<int64_t>(tw_segment_len(seg->seg)), static_cast<int64_t>(data - base)};
}

at::Tensor from_torch_fd(int64_t fd, int64_t nbytes, at::ScalarType dtype, at::IntArrayRef size,
                         at::IntArrayRef stride, int64_t storage_offset) {
  TORCH_CHECK(fd >= 0 && fd <= INT32_MAX, "tensorwire.from_torch_fd: fd ", fd, " is not a valid descriptor");
  TORCH_CHECK(nbytes > 0, "tensorwire.from_torch_fd: nbytes must be > 0, got ", nbytes);
  TORCH_CHECK(storage_offset >= 0, "tensorwire.from_torch_fd: negative storage_offset ", storage_offset);
  check_dtype(dtype, "from_torch_fd");
  int dup = fcntl(static_cast<int>(fd), F_DUPFD_CLOEXEC, 0);
  TORCH_CHECK(dup >= 0, "tensorwire.from_torch_fd: cannot duplicate fd ", fd, ": ", std::strerror(errno));
  tw_segment_t* seg = nullptr;
  TW_CHECK(tw_segment_from_trusted_fd(dup, static_cast<size_t>(nbytes), &seg));  // owns `dup`, failure too
  return tensor_over_segment(seg, /*sealed=*/false, static_cast<size_t>(nbytes), dtype, size, stride,
                             storage_offset);
}

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
#endif

TORCH_LIBRARY_IMPL(tensorwire, CPU, m) {
  m.impl("to_shared", &to_shared);
  m.impl("share_", &share_);
  m.impl("is_shared", &is_shared);
  m.impl("send", &send);
  m.impl("segment_fd", &segment_fd);
}

#ifndef TENSORWIRE_WITH_CUDA
TORCH_LIBRARY_IMPL(tensorwire, CUDA, m) {
  m.impl("send", &send_cuda_unbuilt);
}
#endif

// No tensor arguments: these run on the CompositeExplicitAutograd kernel.
TORCH_LIBRARY_IMPL(tensorwire, CompositeExplicitAutograd, m) {
  m.impl("empty", &empty);
  m.impl("zeros", &zeros);
  m.impl("recv", &recv);
  m.impl("from_torch_fd", &from_torch_fd);
  m.impl("socketpair", &socketpair);
  m.impl("set_inheritable", &set_inheritable);
  m.impl("from_fd", &from_fd);
  m.impl("connect", &connect);
  m.impl("listen", &listen);
  m.impl("accept", &accept);
  m.impl("close", &close);
  m.impl("close_listener", &close_listener_op);
  m.impl("peer_pid", &peer_pid);
  m.impl("stats", &stats);
  m.impl("ring_send", &ring_send);  // any device: CUDA tensors go to the GPU ring
  m.impl("ring_recv", &ring_recv);
  m.impl("cuda_ring_recv", &cuda_ring_recv);
  m.impl("cuda_built", &cuda_built);
  m.impl("cuda_available", &cuda_available);
  m.impl("cuda_device_count", &cuda_device_count);
  m.impl("cuda_ipc_cache_stats", &cuda_ipc_cache_stats);
  m.impl("cuda_ipc_cache_keep_warm", &cuda_ipc_cache_keep_warm);
}

}  // namespace tensorwire_torch
