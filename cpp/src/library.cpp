// The one TORCH_LIBRARY block of torch.ops.tensorwire: every schema and the two classes.
// Implementations live per backend (cpu.cpp: CPU and backend-less ops). Fake
// implementations for the ops with known output shapes are in python/tensorwire/_fake.py.
#include "common.h"

namespace tensorwire_torch {

void Connection::close() {
  std::unique_lock<std::shared_mutex> g(mu);
  tw_peer_free(peer);  // ends every lease this side granted; their owners are dropped
  peer = nullptr;
}

int64_t Connection::pid() {
  std::shared_lock<std::shared_mutex> g(mu);
  TORCH_CHECK(peer != nullptr, "tensorwire: the connection is closed");
  return tw_peer_pid(peer);
}

void Listener::close() {
  std::unique_lock<std::shared_mutex> g(mu);
  tw_listener_free(listener);
  listener = nullptr;
}

LiveConnection::LiveConnection(const c10::intrusive_ptr<Connection>& c, const char* op) : lock(c->mu), peer(c->peer) {
  TORCH_CHECK(peer != nullptr, "tensorwire.", op, ": the connection is closed");
}

}  // namespace tensorwire_torch

using tensorwire_torch::Connection;
using tensorwire_torch::Listener;

TORCH_LIBRARY(tensorwire, m) {
  m.class_<Connection>("Connection").def("pid", &Connection::pid);
  m.class_<Listener>("Listener").def("path", [](const c10::intrusive_ptr<Listener>& l) { return l->path; });

  // Tensors that live in a tensorwire segment (sealed memfd): sending them copies nothing.
  // Fresh memfd pages are zero, so `empty` is zero-filled too.
  m.def("empty(int[] size, *, ScalarType? dtype=None) -> Tensor");
  m.def("zeros(int[] size, *, ScalarType? dtype=None) -> Tensor");
  // Copy `self` once into a new segment (contiguous); the result is shareable.
  m.def("to_shared(Tensor self) -> Tensor");
  // True if `self` lives in a sealed tensorwire segment (export is zero-copy).
  m.def("is_shared(Tensor self) -> bool");

  // Connections. `from_fd` takes ownership of `fd` (an end of `socketpair`, e.g. inherited
  // by a child process). Limits of 0 mean the library's defaults (handshake: 10 s).
  m.def("socketpair() -> (int, int)");
  m.def("set_inheritable(int fd, bool inheritable) -> ()");
  m.def("from_fd(int fd, *, int max_leases=0, int max_lease_bytes=0, int window_ms=0, int handshake_timeout_ms=0) -> __torch__.torch.classes.tensorwire.Connection");
  m.def("connect(str path, *, int max_leases=0, int max_lease_bytes=0, int window_ms=0, int handshake_timeout_ms=0) -> __torch__.torch.classes.tensorwire.Connection");
  m.def("listen(str path) -> __torch__.torch.classes.tensorwire.Listener");
  m.def("accept(__torch__.torch.classes.tensorwire.Listener listener, *, int max_leases=0, int max_lease_bytes=0, int window_ms=0, int handshake_timeout_ms=0) -> __torch__.torch.classes.tensorwire.Connection");
  m.def("close(__torch__.torch.classes.tensorwire.Connection conn) -> ()");
  m.def("close_listener(__torch__.torch.classes.tensorwire.Listener listener) -> ()");
  m.def("peer_pid(__torch__.torch.classes.tensorwire.Connection conn) -> int");

  // Export `tensor` to the peer under a lease: zero-copy if it lives in a sealed segment
  // (the lease owns a reference to its storage), else copied once into a fresh segment.
  // Returns whether it went zero-copy. `window_ms` > 0 bounds how long the peer may hold it.
  m.def("send(__torch__.torch.classes.tensorwire.Connection conn, Tensor tensor, int tag=0, int window_ms=0) -> bool");
  // The next tensor from the peer (and its tag), aliasing the peer's memory; its lease is
  // released when the last tensor using that memory dies. timeout_ms < 0: no limit.
  m.def("recv(__torch__.torch.classes.tensorwire.Connection conn, int timeout_ms=-1) -> (Tensor, int)");
  // [live_leases, live_bytes, granted, released, expired, reclaimed] of what this side
  // exported to the peer, after processing pending releases and peer death.
  m.def("stats(__torch__.torch.classes.tensorwire.Connection conn) -> int[]");

  // Interop with PyTorch's own CPU sharing (file_descriptor strategy).
  // A dup of the segment fd behind `self` (close-on-exec; the caller owns it), the
  // segment's length, and the byte offset of `self`'s storage in it.
  m.def("segment_fd(Tensor self) -> (int, int, int)");
  // A tensor over an fd a TRUSTED peer shared (e.g. `storage._share_fd_cpu_()`): the fd
  // is duplicated (the caller keeps its own), mapped without requiring seals, and viewed
  // as dtype/size/stride/storage_offset over its first `nbytes` bytes.
  m.def("from_torch_fd(int fd, int nbytes, ScalarType dtype, int[] size, int[] stride, int storage_offset=0) -> Tensor");
}
