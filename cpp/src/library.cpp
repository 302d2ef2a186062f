// The one TORCH_LIBRARY block of torch.ops.tensorwire (every schema), and the registry of
// connection / listener handles.
// Implementations live in one file per job (see common.h), each registering its own
// kernels; cuda.cpp, compiled only where a CUDA toolkit is found, has the CUDA send and
// import. Fake implementations for the ops with known output shapes are in
// python/tensorwire/_fake.py.
#include "common.h"

#include <atomic>
#include <unordered_map>

namespace tensorwire_torch {
namespace {

template <typename T>
struct Registry {
  std::mutex mu;
  std::unordered_map<int64_t, std::shared_ptr<T>> live;
};
std::atomic<int64_t> next_handle{1};
Registry<Connection>& connections() {
  static auto* r = new Registry<Connection>();  // never destroyed: no teardown-order issues at exit
  return *r;
}
Registry<Listener>& listeners() {
  static auto* r = new Registry<Listener>();
  return *r;
}

template <typename T>
int64_t add(Registry<T>& r, std::shared_ptr<T> obj) {
  int64_t h = next_handle.fetch_add(1);
  std::lock_guard<std::mutex> g(r.mu);
  r.live.emplace(h, std::move(obj));
  return h;
}

template <typename T>
std::shared_ptr<T> get(Registry<T>& r, int64_t h, const char* what, const char* op) {
  std::lock_guard<std::mutex> g(r.mu);
  auto it = r.live.find(h);
  TORCH_CHECK(it != r.live.end(), "tensorwire.", op, ": ", what, " ", h, " is closed or was never opened");
  return it->second;
}

template <typename T>
void remove(Registry<T>& r, int64_t h) {
  std::shared_ptr<T> dropped;  // freed outside the lock (tw_peer_free runs lease owners)
  std::lock_guard<std::mutex> g(r.mu);
  auto it = r.live.find(h);
  if (it != r.live.end()) {
    dropped = std::move(it->second);
    r.live.erase(it);
  }
}

}  // namespace

int64_t register_connection(tw_peer_t* peer) {
  std::unique_ptr<tw_peer_t, decltype(&tw_peer_free)> g(peer, &tw_peer_free);
  auto c = std::make_shared<Connection>(peer);
  g.release();
  return add(connections(), std::move(c));
}

int64_t register_listener(tw_listener_t* l, std::string path) {
  std::unique_ptr<tw_listener_t, decltype(&tw_listener_free)> g(l, &tw_listener_free);
  auto o = std::make_shared<Listener>(l, std::move(path));
  g.release();
  return add(listeners(), std::move(o));
}

std::shared_ptr<Connection> connection(int64_t h, const char* op) { return get(connections(), h, "connection", op); }
std::shared_ptr<Listener> listener(int64_t h, const char* op) { return get(listeners(), h, "listener", op); }
void close_connection(int64_t h) { remove(connections(), h); }
void close_listener(int64_t h) { remove(listeners(), h); }

}  // namespace tensorwire_torch

TORCH_LIBRARY(tensorwire, m) {
  // Tensors that live in a tensorwire segment (sealed memfd): sending them copies nothing.
  // Fresh memfd pages are zero, so `empty` is zero-filled too.
  m.def("empty(int[] size, *, ScalarType? dtype=None) -> Tensor");
  m.def("zeros(int[] size, *, ScalarType? dtype=None) -> Tensor");
  // Copy `self` once into a new segment (contiguous); the result is shareable.
  m.def("to_shared(Tensor self) -> Tensor");
  // Move the storage of `self` into a new segment in place (like Tensor.share_memory_()).
  m.def("share_(Tensor(a!) self) -> Tensor(a!)");
  // True if `self` lives in a sealed tensorwire segment (export is zero-copy).
  m.def("is_shared(Tensor self) -> bool");

  // Connections, named by int handles (`close` forgets one). `from_fd` takes ownership of `fd` (an end of
  // `socketpair`, e.g. inherited by a child process); `accept` waits for a peer at most timeout_ms. The opening
  // ops end with the keyword-only connection options
  // of TW_CONNECTION_OPTIONS (tensorwire.h, generated from the library's table, which checks each).
  // Limits of 0 mean the library's defaults (handshake: 10 s; ring_bytes: the data area of the ring this side
  // sends through, a power of two >= 4096, default 4 MiB). cuda_ring_device >= 0 gives this side a GPU bounce
  // ring on that device for its CUDA ring_sends (slot_bytes default 4 MiB, slots default 8). cuda_wait: how
  // this side waits for the peer's CUDA work — 0 stream (the GPU waits on the peer's signal word; recv
  // returns at once), 1 host (recv waits until the peer's work completed), 2 event (the stream waits on the
  // peer's IPC event: slow without MPS); cuda_wait_timeout_ms bounds that wait (-1: none; default 30 s).
  m.def("socketpair() -> (int, int)");
  m.def("set_inheritable(int fd, bool inheritable) -> ()");
  m.def("from_fd(int fd, *" TW_CONNECTION_OPTIONS_SCHEMA ") -> int");
  m.def("connect(str path, *" TW_CONNECTION_OPTIONS_SCHEMA ") -> int");
  m.def("listen(str path) -> int");
  m.def("accept(int listener, *, int timeout_ms=-1" TW_CONNECTION_OPTIONS_SCHEMA ") -> int");
  m.def("close(int conn) -> ()");
  m.def("close_listener(int listener) -> ()");
  m.def("peer_pid(int conn) -> int");

  // Export `tensor` to the peer under a lease: zero-copy if it lives in a sealed segment
  // (the lease owns a reference to its storage), else copied once into a fresh segment.
  // Returns whether it went zero-copy. `window_ms` > 0 bounds how long the peer may hold it.
  m.def("send(int conn, Tensor tensor, int tag=0, int window_ms=0) -> bool");
  // The next tensor from the peer (and its tag), aliasing the peer's memory; its lease is
  // released when the last tensor using that memory dies. Every timeout_ms here (recv, the
  // rings, accept): < 0 no limit, 0 do not wait (TW_ERR_TIMEOUT at once), n > 0 at most n ms.
  m.def("recv(int conn, int timeout_ms=-1) -> (Tensor, int)");
  // [live_leases, live_bytes, granted, released, expired, reclaimed] of what this side
  // exported to the peer, after processing pending releases and peer death.
  m.def("stats(int conn) -> int[]");

  // The ring (bounce buffer registered once per connection): `ring_send` copies the view
  // (any strides) packed into the ring, in chunks if it is larger than half the ring,
  // waiting at most timeout_ms for space (< 0: no limit). `ring_recv` returns the next ring
  // tensor (contiguous, owning a private copy of the bytes: no further copy) and its tag.
  // A CUDA tensor goes through the GPU ring (connection opened with cuda_ring_device):
  // packed on the current stream, copied into the device arena there (no synchronize,
  // no handle opened), in chunks if larger than a slot; `cuda_ring_recv` returns it as a
  // fresh contiguous tensor on the ring's device, copied out on the current stream once the
  // producer's copy in is done (the ring's signal word, as the connection's cuda_wait says).
  m.def("ring_send(int conn, Tensor tensor, int tag=0, int timeout_ms=-1) -> ()");
  m.def("ring_recv(int conn, int timeout_ms=-1) -> (Tensor, int)");
  m.def("cuda_ring_recv(int conn, int timeout_ms=-1) -> (Tensor, int)");

  // CUDA. `send` of a CUDA tensor exports its storage by IPC handle (or VMM fd) after the work
  // queued on the current stream (a signal word, or an IPC event, orders the consumer); `recv` of
  // one orders the current stream after it (as the connection's cuda_wait says) and returns a
  // tensor on the device, whose lease is released once the work queued on that stream when the
  // last view dies has completed (an event the reaper polls; nothing synchronizes).
  // cuda_built: this extension was compiled with CUDA; cuda_available: and a driver works.
  m.def("cuda_built() -> bool");
  m.def("cuda_available() -> bool");
  // Number of devices; raises with tensorwire's CudaUnavailable reason without a driver.
  m.def("cuda_device_count() -> int");
  // This process's IPC handle cache: [cuIpcOpenMemHandle calls so far, handles open now].
  m.def("cuda_ipc_cache_stats() -> int[]");
  // How many unused opened handles stay open (default 0: a handle is closed once its last
  // import is released; n > 0 keeps the n most recently used open for reuse).
  m.def("cuda_ipc_cache_keep_warm(int n) -> ()");

  // Interop with PyTorch's own CPU sharing (file_descriptor strategy).
  // A dup of the segment fd behind `self` (close-on-exec; the caller owns it), the
  // segment's length, and the byte offset of `self`'s storage in it.
  m.def("segment_fd(Tensor self) -> (int, int, int)");
  // A tensor over an fd a TRUSTED peer shared (e.g. `storage._share_fd_cpu_()`): the fd
  // is duplicated (the caller keeps its own), mapped without requiring seals, and viewed
  // as dtype/size/stride/storage_offset over its first `nbytes` bytes.
  m.def("from_torch_fd(int fd, int nbytes, ScalarType dtype, int[] size, int[] stride, int storage_offset=0) -> Tensor");
}
