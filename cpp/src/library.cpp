// The one TORCH_LIBRARY block of torch.ops.tensorwire, and the registry of connection /
// listener handles. The schemas, with what each op does, are python/tensorwire/ops.schemas:
// the list the Python op layer (_ops.py) registers too, embedded by CMakeLists.txt.
// Implementations live in one file per job (see common.h), each registering its own
// kernels; cuda.cpp, compiled only where a CUDA toolkit is found, has the CUDA send and
// import. Fake implementations for the ops with known output shapes are in
// python/tensorwire/_fake.py.
#include "common.h"

#include "tensorwire_op_schemas.h"  // kOpSchemas: python/tensorwire/ops.schemas, embedded

#include <atomic>
#include <string_view>
#include <unordered_map>
#include <vector>

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

// The schema lines of kOpSchemas (ops.schemas' format: '#' comments and blank lines
// skipped), with `, CONNECTION_OPTIONS` spelled out from tensorwire.h's table.
std::vector<std::string> op_schemas() {
  constexpr std::string_view options = ", CONNECTION_OPTIONS";
  std::vector<std::string> out;
  std::string_view text = kOpSchemas;
  while (!text.empty()) {
    size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    size_t first = line.find_first_not_of(" \t\r");
    if (first == std::string_view::npos || line[first] == '#') continue;
    line = line.substr(first, line.find_last_not_of(" \t\r") + 1 - first);
    std::string schema(line);
    for (size_t at; (at = schema.find(options)) != std::string::npos;) {
      schema.replace(at, options.size(), TW_CONNECTION_OPTIONS_SCHEMA);
    }
    out.push_back(std::move(schema));
  }
  return out;
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
  for (const std::string& schema : tensorwire_torch::op_schemas()) m.def(schema.c_str());
}
