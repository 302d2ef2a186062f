// Storages backed by tensorwire: tensors over segments (ours, sealed; or a trusted peer's
// fd) and over imports, the dtype and layout checks every op shares, and the ops that make
// segment tensors (empty, zeros, to_shared, share_) or hand their fd to PyTorch's own
// sharing (segment_fd, from_torch_fd).
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

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

void import_deleter(void* ctx) { tw_imported_free(static_cast<tw_imported_t*>(ctx)); }

tw_imported_t* import_of(const c10::Storage& storage) {
  if (!storage) return nullptr;
  const c10::DataPtr& dp = storage.data_ptr();
  if (dp.get_deleter() != &import_deleter) return nullptr;
  return static_cast<tw_imported_t*>(dp.get_context());
}

void check_dtype(at::ScalarType dtype, const char* what) {
  size_t tw = tw_dtype_size(static_cast<uint8_t>(dtype));
  TORCH_CHECK(tw != 0, "tensorwire.", what, ": dtype ", dtype,
              " is not supported by tensorwire (bool, integer, floating, complex and float8 types are)");
  TORCH_CHECK(tw == c10::elementSize(dtype), "tensorwire.", what, ": dtype ", dtype, " has ",
              c10::elementSize(dtype), "-byte elements in torch but ", tw, " in tensorwire");
}

void check_strided_dtype(const at::Tensor& t, const char* what, const char* verb) {
  TORCH_CHECK(t.layout() == at::kStrided, "tensorwire.", what, ": ", t.layout(), " tensors cannot be ", verb,
              "; only strided (dense) ones");
  check_dtype(t.scalar_type(), what);
}

void check_exportable(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.defined(), "tensorwire.", what, ": undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), "tensorwire.", what, ": tensor is on ", t.device(),
              "; only CPU tensors can be shared here");
  check_strided_dtype(t, what, "shared");
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

uint64_t extent_bytes(const tw_layout_t& l) {
  uint64_t n = 0;
  TW_CHECK(tw_layout_extent_bytes(&l, &n));
  return n;
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

at::Tensor to_shared(const at::Tensor& self) {
  check_exportable(self, "to_shared");
  at::Tensor out = new_segment_tensor(self.sizes(), self.scalar_type());
  out.copy_(self);  // resolves conjugate / negative bits too
  return out;
}

namespace {

at::Tensor empty(at::IntArrayRef size, std::optional<at::ScalarType> dtype) {
  return new_segment_tensor(size, c10::dtype_or_default(dtype));
}

at::Tensor zeros(at::IntArrayRef size, std::optional<at::ScalarType> dtype) {
  // New memfd pages read as zero: nothing to fill.
  return new_segment_tensor(size, c10::dtype_or_default(dtype));
}

// Move the whole storage of `self` into a new sealed segment, in place (every view of the
// storage follows), as Tensor.share_memory_() does with PyTorch's own shared memory: later
// sends of any view of it are zero-copy. A no-op for a storage already in a sealed segment.
at::Tensor& share_(at::Tensor& self) {
  check_exportable(self, "share_");
  c10::Storage storage = self.storage();
  const SegmentCtx* current = segment_of(storage);
  if (current != nullptr && current->sealed) return self;
  TORCH_CHECK(import_of(storage) == nullptr,
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

// Interop with PyTorch's own CPU sharing (file_descriptor strategy).

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

TORCH_LIBRARY_IMPL(tensorwire, CPU, m) {
  m.impl("to_shared", &to_shared);
  m.impl("share_", &share_);
  m.impl("segment_fd", &segment_fd);
}

// No tensor arguments: these run on the CompositeExplicitAutograd kernel.
TORCH_LIBRARY_IMPL(tensorwire, CompositeExplicitAutograd, m) {
  m.impl("empty", &empty);
  m.impl("zeros", &zeros);
  m.impl("from_torch_fd", &from_torch_fd);
}

}  // namespace tensorwire_torch
