// Shared pieces of the tensorwire libtorch extension: error reporting, the segment- and
// import-backed storages, and the Connection / Listener classes.
#pragma once

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <shared_mutex>
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

// A CPU tensor over the whole of `seg` (ownership of `seg` passes to the tensor, also on
// failure), viewed with the given sizes/strides/offset (checked to fit).
at::Tensor tensor_over_segment(tw_segment_t* seg, bool sealed, size_t nbytes, at::ScalarType dtype,
                               at::IntArrayRef sizes, at::IntArrayRef strides, int64_t storage_offset);

// A fresh, zeroed, contiguous tensor in a new sealed segment.
at::Tensor new_segment_tensor(at::IntArrayRef sizes, at::ScalarType dtype);

// Check that torch and tensorwire agree on `dtype` (same number, same element size).
void check_dtype(at::ScalarType dtype, const char* what);

// One connection (tw_peer_t). `close()` ends it; every op on a closed one fails.
struct Connection : torch::CustomClassHolder {
  explicit Connection(tw_peer_t* p) : peer(p) {}
  ~Connection() override { tw_peer_free(peer); }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Shared by every op, exclusive for close(); recv additionally takes recv_mu (one
  // receiver at a time, as the C ABI requires).
  std::shared_mutex mu;
  std::mutex recv_mu;
  tw_peer_t* peer;

  void close();
  int64_t pid();
};

struct Listener : torch::CustomClassHolder {
  explicit Listener(tw_listener_t* l, std::string p) : listener(l), path(std::move(p)) {}
  ~Listener() override { tw_listener_free(listener); }
  std::shared_mutex mu;
  tw_listener_t* listener;
  std::string path;
  void close();
};

// Lock a connection for an op, failing clearly if it was closed.
struct LiveConnection {
  explicit LiveConnection(const c10::intrusive_ptr<Connection>& c, const char* op);
  std::shared_lock<std::shared_mutex> lock;
  tw_peer_t* peer;
};

}  // namespace tensorwire_torch
