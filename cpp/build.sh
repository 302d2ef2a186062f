#!/usr/bin/env bash
# Build libtensorwire_torch.so against the venv's torch and the tensorwire CMake package:
#   1. the root CMake project builds tensorwire (cargo, shared target dir) and installs
#      the package into build/tensorwire-prefix;
#   2. cpp/ is configured with CMAKE_PREFIX_PATH="<that prefix>;<torch's cmake prefix>".
# Usage: cpp/build.sh [PYTHON]   (default: the venv from scripts/setup-venv.sh)
# Prints the path of the built library on its last line.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${1:-$(bash "$root/scripts/setup-venv.sh" | tail -1)}
build=$root/build
prefix=$build/tensorwire-prefix
jobs=$(nproc 2>/dev/null || echo 2)

cmake -S "$root" -B "$build/tensorwire-cmake" -DCMAKE_BUILD_TYPE=Release -DTENSORWIRE_BUILD_TESTS=OFF \
      -DTENSORWIRE_CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}" >"$build/tensorwire-configure.log" \
  || { cat "$build/tensorwire-configure.log" >&2; exit 1; }
cmake --build "$build/tensorwire-cmake" -j"$jobs" >&2
cmake --install "$build/tensorwire-cmake" --prefix "$prefix" >/dev/null

torch_prefix=$("$py" -c "import torch; print(torch.utils.cmake_prefix_path)")
cmake -S "$root/cpp" -B "$build/torch-ext" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$prefix;$torch_prefix" >"$build/torch-ext-configure.log" 2>&1 \
  || { cat "$build/torch-ext-configure.log" >&2; exit 1; }
grep "tensorwire_torch:" "$build/torch-ext-configure.log" >&2 || true
cmake --build "$build/torch-ext" -j"$jobs" >&2
echo "$build/torch-ext/libtensorwire_torch.so"
