// Opening and closing connections: socketpair / from_fd, listen / accept, connect, each
// opening op taking the connection options (TW_CONNECTION_OPTIONS in common.h) that are
// turned into one tw_peer_config_t here.
#include <cstdint>
#include <string>

#include "common.h"

namespace tensorwire_torch {
namespace {

// The options as the op received them (int64 each, in TW_CONNECTION_OPTIONS order).
struct ConnectionOptions {
#define TW_OPTION_FIELD_(name, default_) int64_t name;
  TW_CONNECTION_OPTIONS(TW_OPTION_FIELD_)
#undef TW_OPTION_FIELD_
};

// The library's defaults, overridden by every option that is not 0 (range-checked here;
// values the library checks itself, like the ring size, are passed on as they are).
tw_peer_config_t peer_config(const ConnectionOptions& o) {
  TORCH_CHECK(o.max_leases >= 0 && o.max_leases <= UINT32_MAX, "tensorwire: max_leases must be in [0, 2^32), got ",
              o.max_leases);
  TORCH_CHECK(o.max_lease_bytes >= 0, "tensorwire: max_lease_bytes must be >= 0, got ", o.max_lease_bytes);
  TORCH_CHECK(o.window_ms >= 0, "tensorwire: window_ms must be >= 0, got ", o.window_ms);
  TORCH_CHECK(o.handshake_timeout_ms >= -1,
              "tensorwire: handshake_timeout_ms must be -1 (no limit), 0 (the default) or > 0, got ",
              o.handshake_timeout_ms);
  TORCH_CHECK(o.ring_bytes >= 0, "tensorwire: ring_bytes must be >= 0 (0: the default), got ", o.ring_bytes);
  TORCH_CHECK(o.cuda_ring_device >= -1 && o.cuda_ring_device <= 255,
              "tensorwire: cuda_ring_device must be -1 (no GPU ring) or a device index, got ", o.cuda_ring_device);
  TORCH_CHECK(o.cuda_ring_slot_bytes >= 0, "tensorwire: cuda_ring_slot_bytes must be >= 0 (0: the default), got ",
              o.cuda_ring_slot_bytes);
  TORCH_CHECK(o.cuda_ring_slots >= 0 && o.cuda_ring_slots <= UINT32_MAX,
              "tensorwire: cuda_ring_slots must be in [0, 2^32) (0: the default), got ", o.cuda_ring_slots);
  TORCH_CHECK(o.cuda_wait >= 0 && o.cuda_wait <= 2,
              "tensorwire: cuda_wait must be 0 (stream), 1 (host) or 2 (event), got ", o.cuda_wait);
  TORCH_CHECK(o.cuda_wait_timeout_ms >= -1,
              "tensorwire: cuda_wait_timeout_ms must be -1 (no limit), 0 (the default) or > 0, got ",
              o.cuda_wait_timeout_ms);
  tw_peer_config_t c;
  TW_CHECK(tw_peer_config_default(&c));
  if (o.max_leases) c.max_leases = static_cast<uint32_t>(o.max_leases);
  if (o.max_lease_bytes) c.max_lease_bytes = static_cast<uint64_t>(o.max_lease_bytes);
  if (o.window_ms) c.default_window_ms = static_cast<uint64_t>(o.window_ms);
  if (o.handshake_timeout_ms) c.handshake_timeout_ms = o.handshake_timeout_ms;
  if (o.ring_bytes) c.ring_bytes = static_cast<uint64_t>(o.ring_bytes);
  c.cuda_ring_device = static_cast<int32_t>(o.cuda_ring_device);
  if (o.cuda_ring_slot_bytes) c.cuda_ring_slot_bytes = static_cast<uint64_t>(o.cuda_ring_slot_bytes);
  if (o.cuda_ring_slots) c.cuda_ring_slots = static_cast<uint32_t>(o.cuda_ring_slots);
  c.cuda_wait = static_cast<uint32_t>(o.cuda_wait);
  if (o.cuda_wait_timeout_ms) c.cuda_wait_timeout_ms = o.cuda_wait_timeout_ms;
  return c;
}

// The kernel of an opening op: the op's own arguments (`Lead`, e.g. the listener and
// accept's timeout), then every connection option in schema order (the signature
// TW_CONNECTION_OPTIONS_SCHEMA declares). `Open` gets its own arguments and the parsed
// config, and returns the connection's handle.
#define TW_OPTION_PARAM_(name, default_) , int64_t name
#define TW_OPTION_ARG_(name, default_) name,
template <auto Open, typename... Lead>
int64_t with_options(Lead... lead TW_CONNECTION_OPTIONS(TW_OPTION_PARAM_)) {
  return Open(lead..., peer_config(ConnectionOptions{TW_CONNECTION_OPTIONS(TW_OPTION_ARG_)}));
}
#undef TW_OPTION_PARAM_
#undef TW_OPTION_ARG_

int64_t open_from_fd(int64_t fd, const tw_peer_config_t& c) {
  TORCH_CHECK(fd >= 0 && fd <= INT32_MAX, "tensorwire.from_fd: fd ", fd, " is not a valid descriptor");
  tw_peer_t* p = nullptr;
  TW_CHECK(tw_peer_from_fd(static_cast<int>(fd), &c, &p));
  return register_connection(p);
}

int64_t open_connect(c10::string_view path, const tw_peer_config_t& c) {
  std::string p(path);
  tw_peer_t* peer = nullptr;
  TW_CHECK(tw_peer_connect(p.c_str(), &c, &peer));
  return register_connection(peer);
}

int64_t open_accept(int64_t listener_handle, int64_t timeout_ms, const tw_peer_config_t& c) {
  auto l = listener(listener_handle, "accept");
  tw_peer_t* p = nullptr;
  TW_CHECK(tw_listener_accept(l->listener, timeout_ms, &c, &p));
  return register_connection(p);
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

int64_t listen(c10::string_view path) {
  std::string p(path);
  tw_listener_t* l = nullptr;
  TW_CHECK(tw_listener_bind(p.c_str(), &l));
  return register_listener(l, p);
}

void close(int64_t conn) { close_connection(conn); }
void close_listener_op(int64_t l) { close_listener(l); }
int64_t peer_pid(int64_t conn) { return tw_peer_pid(connection(conn, "peer_pid")->peer); }

}  // namespace

// No tensor arguments: these run on the CompositeExplicitAutograd kernel.
TORCH_LIBRARY_IMPL(tensorwire, CompositeExplicitAutograd, m) {
  m.impl("socketpair", &socketpair);
  m.impl("set_inheritable", &set_inheritable);
  m.impl("from_fd", &with_options<&open_from_fd, int64_t>);
  m.impl("connect", &with_options<&open_connect, c10::string_view>);
  m.impl("listen", &listen);
  m.impl("accept", &with_options<&open_accept, int64_t, int64_t>);
  m.impl("close", &close);
  m.impl("close_listener", &close_listener_op);
  m.impl("peer_pid", &peer_pid);
}

}  // namespace tensorwire_torch
