// Shared pieces of the tensorwire libtorch extension: error reporting, the segment- and
// import-backed storages, the connection options, and the Connection / Listener classes.
//
// Files: library.cpp (the one TORCH_LIBRARY block: every schema; the handle registry),
// storage.cpp (segment- and import-backed storages, dtype and layout checks, the ops that
// make segment tensors), transfer.cpp (send / recv under leases, stats, the forward of a
// received tensor, CPU or CUDA), connection.cpp (opening and closing connections),
// ring.cpp (the CPU ring), cuda_info.cpp (CUDA ops that need no CUDA headers, and the
// answers of a build without CUDA), cuda.cpp (the CUDA backend, where a toolkit is
// found). Each file registers the ops it implements.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "tensorwire.h"

namespace tensorwire_torch {

// TORCH_CHECK on a tw_result_e, carrying the library's own message (which names the
// failing tw_ function):  "tensorwire (TW_ERR_IO): tw_peer_connect: connect ... failed"
#define TW_CHECK(call)                                                                  \
  do {                                                                                  \
    tw_result_e tw_r_ = (call);                                                         \
    TORCH_CHECK(tw_r_ == TW_OK, "tensorwire (", tw_result_name(tw_r_), "): ",           \
                tw_last_error_message());                                               \
  } while (0)

// What the DataPtr of a tensorwire-backed CPU storage holds as its context.
struct SegmentCtx {
  tw_segment_t* seg;
  // Sealed memfd of our own making: can be exported to untrusted peers as is. An fd
  // from a trusted peer (PyTorch's file_descriptor storages) is unsealed, and peers
  // refuse unsealed fds, so such storages are copied when exported.
  bool sealed;
};

// The deleter of every segment-backed storage: frees the segment handle (the mapping
// itself lives on while exports or imports still use it).
void segment_deleter(void* ctx);

// The segment behind `storage`, or nullptr if it is not a tensorwire segment storage.
const SegmentCtx* segment_of(const c10::Storage& storage);

// The deleter of a received CPU tensor's storage (its context is the tw_imported_t): frees
// the import, which releases its lease.
void import_deleter(void* ctx);

// The import a received CPU tensor's storage is (recv's deleter), else nullptr.
tw_imported_t* import_of(const c10::Storage& storage);

// Bytes the view needs, as tensorwire computes it (overflow, negative values checked).
uint64_t extent_bytes(const tw_layout_t& l);

// Check that `t` is strided (dense; else "<layout> tensors cannot be <verb>", e.g.
// "shared", "sent") and of a dtype tensorwire carries.
void check_strided_dtype(const at::Tensor& t, const char* what, const char* verb);

// Check that `t` is a defined, strided CPU tensor of a dtype tensorwire carries.
void check_exportable(const at::Tensor& t, const char* what);

// A copy of `self` in a new sealed segment (contiguous): shareable without another copy.
at::Tensor to_shared(const at::Tensor& self);

// A CPU tensor over the whole of `seg` (ownership of `seg` passes to the tensor, also on
// failure), viewed with the given sizes/strides/offset (checked to fit).
at::Tensor tensor_over_segment(tw_segment_t* seg, bool sealed, size_t nbytes, at::ScalarType dtype,
                               at::IntArrayRef sizes, at::IntArrayRef strides, int64_t storage_offset);

// A fresh, zeroed, contiguous tensor in a new sealed segment.
at::Tensor new_segment_tensor(at::IntArrayRef sizes, at::ScalarType dtype);

// Check that torch and tensorwire agree on `dtype` (same number, same element size).
void check_dtype(at::ScalarType dtype, const char* what);

// The tw_layout_t of a view (ndim and sizes/strides agreement checked, `what` names the op).
tw_layout_t make_layout(at::ScalarType dtype, at::IntArrayRef sizes, at::IntArrayRef strides, int64_t storage_offset,
                        const char* what);

// A tensor of `dtype` viewing `storage` (whose DataPtr names its device) with the given
// sizes/strides/offset; `key` is the backend's dispatch key (CPU or CUDA).
at::Tensor over_storage(c10::Storage storage, at::ScalarType dtype, at::IntArrayRef sizes, at::IntArrayRef strides,
                        int64_t storage_offset, c10::DispatchKey key = c10::DispatchKey::CPU);

// The release callback of every export: `ctx` is a heap c10::Storage (the lease's owner).
void release_storage(void* ctx);

// The layout and dtype of an import, checked against this torch.
at::ScalarType imported_dtype(const tw_layout_t& l, const char* what);

// `send` of `t`, a view of a tensor `recv` returned (its storage is `imp`'s): forwarded as
// the producer's memory, never a copy — a CPU import with tw_peer_export_imported, a CUDA
// one with tw_peer_export_imported_cuda on `cuda_stream` (it first waits there for the
// producer, then orders the consumer after our work queued there). The lease holds the
// storage (and so the import) until the peer is done with it.
void forward_import(tw_peer_t* peer, tw_imported_t* imp, const at::Tensor& t, int64_t tag, int64_t window_ms,
                    std::optional<size_t> cuda_stream = std::nullopt);

// The GPU ring's receive: cuda.cpp with CUDA; without, cuda_info.cpp answers with the
// library's error (no ring, no driver) or says the extension lacks CUDA.
std::tuple<at::Tensor, int64_t> cuda_ring_recv(int64_t conn, int64_t timeout_ms);
// `ring_send` of a (strided) CUDA tensor: through the GPU ring, or the build's reason.
void ring_send_cuda(int64_t conn, const at::Tensor& tensor, int64_t tag, int64_t timeout_ms);

#ifdef TENSORWIRE_WITH_CUDA
// cuda.cpp: a CUDA tensor over a CUDA import (ownership of `imp` passes to the tensor, also
// on failure): the current stream of its device waits for the producer's last write first.
at::Tensor wrap_cuda_import(tw_imported_t* imp, const tw_layout_t& l, at::ScalarType dtype);
#endif

// The options of every op that opens a connection (from_fd, connect, accept) are
// TW_CONNECTION_OPTIONS(X) of tensorwire.h, X(name, default) for each, generated from the
// library's table: keyword-only ints in the schema, each checked and set by name by the
// library (tw_peer_config_set_option, connection.cpp).
// Schema text of the options, what `, CONNECTION_OPTIONS` in python/tensorwire/ops.schemas
// stands for (library.cpp): ", int max_leases=0, ..., int cuda_ring_slots=0".
#define TW_OPTION_SCHEMA_(name, default_) ", int " #name "=" #default_
#define TW_CONNECTION_OPTIONS_SCHEMA TW_CONNECTION_OPTIONS(TW_OPTION_SCHEMA_)

// Connections and listeners are named by int64 handles in a process-wide registry (a
// custom-class argument costs ~12 us per call from Python; an int costs nothing). An op
// holds a shared_ptr while it runs, so `close` never frees a handle under a running op:
// the tw_peer_t is freed when the last user lets go.
struct Connection {
  explicit Connection(tw_peer_t* p) : peer(p) {}
  ~Connection() { tw_peer_free(peer); }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;
  tw_peer_t* const peer;
  std::mutex recv_mu;       // one receiver at a time, as the C ABI requires
  std::mutex ring_recv_mu;  // one ring receiver at a time
  std::mutex cuda_ring_recv_mu;  // one GPU ring receiver at a time (recv + finish are one step)
};

struct Listener {
  Listener(tw_listener_t* l, std::string p) : listener(l), path(std::move(p)) {}
  ~Listener() { tw_listener_free(listener); }
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;
  tw_listener_t* const listener;
  const std::string path;
};

// Take ownership of `peer` (freed on failure too) and return its handle.
int64_t register_connection(tw_peer_t* peer);
int64_t register_listener(tw_listener_t* listener, std::string path);
// The live object behind a handle; TORCH_CHECK-fails with `op` in the message if the
// handle is unknown or closed.
std::shared_ptr<Connection> connection(int64_t handle, const char* op);
std::shared_ptr<Listener> listener(int64_t handle, const char* op);
// Forget the handle (idempotent); the object is freed once no op uses it.
void close_connection(int64_t handle);
void close_listener(int64_t handle);

}  // namespace tensorwire_torch
