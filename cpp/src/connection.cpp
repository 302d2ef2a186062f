// Opening and closing connections: socketpair / from_fd, listen / accept, connect, each
// opening op taking the connection options (TW_CONNECTION_OPTIONS in tensorwire.h) that are
// turned into one tw_peer_config_t here, each set by name through the C ABI.
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

// Set one option through the library, which owns every option's range, default and
// message (tw_peer_config_set_option): a bad value is refused with the library's message,
// as a plain check of this op's argument (no result-code prefix).
void set_option(tw_peer_config_t& c, const char* name, int64_t value) {
  TORCH_CHECK(tw_peer_config_set_option(&c, name, value) == TW_OK, tw_last_error_message());
}

// The library's defaults, with every option set by name in schema order.
tw_peer_config_t peer_config(const ConnectionOptions& o) {
  tw_peer_config_t c;
  TW_CHECK(tw_peer_config_default(&c));
#define TW_SET_OPTION_(name, default_) set_option(c, #name, o.name);
  TW_CONNECTION_OPTIONS(TW_SET_OPTION_)
#undef TW_SET_OPTION_
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
