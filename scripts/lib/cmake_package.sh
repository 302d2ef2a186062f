# The tensorwire CMake package, built by the C ABI crate's CMake project (ffi/, which runs
# cargo, in the shared cargo target dir): the one way every script builds it. Sourced by
# cpp/build.sh (the torch extension links it), ffi/tests/cmake_package.sh (its C tests and a
# find_package consumer) and scripts/gpu_test.sh prepare (the prefix a GPU machine gets).
#
#   cmake_package_build BUILD_DIR LOG [CMAKE_ARGS...]   configure (its output to LOG, shown
#                                                       on failure) and build; progress on stderr
#   cmake_package_install BUILD_DIR PREFIX              install the package into PREFIX

tw_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

cmake_package_build() {
  local build=$1 log=$2
  shift 2
  mkdir -p "$(dirname "$log")"
  cmake -S "$tw_root/ffi" -B "$build" -DTENSORWIRE_CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$tw_root/target}" "$@" >"$log" 2>&1 \
    || { cat "$log" >&2; return 1; }
  cmake --build "$build" -j"$(nproc 2>/dev/null || echo 2)" >&2
}

cmake_package_install() {
  cmake --install "$1" --prefix "$2" >/dev/null
}
