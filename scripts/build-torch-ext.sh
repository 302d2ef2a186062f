#!/usr/bin/env bash
# Build libtensorwire_torch.so against the venv's torch and the tensorwire CMake package:
#   1. the root CMake project builds tensorwire (cargo, shared target dir) and installs
#      the package into build/tensorwire-prefix;
#   2. cpp/ is configured with CMAKE_PREFIX_PATH="<that prefix>;<torch's cmake prefix>".
# Usage: cpp/build.sh [PYTHON]   (default: the venv from scripts/setup-venv.sh)
# With TENSORWIRE_PREFIX=<dir> (an install prefix of the tensorwire CMake package, e.g.
# carried to a machine without cargo), step 1 is skipped and that prefix is used.
# Prints the path of the built library on its last line.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${1:-$(bash "$root/scripts/setup-venv.sh" | tail -1)}
build=$root/build
jobs=$(nproc 2>/dev/null || echo 2)
mkdir -p "$build"

if [[ -n "${TENSORWIRE_PREFIX:-}" ]]; then
  prefix=$(cd "$TENSORWIRE_PREFIX" && pwd)
  [[ -f "$prefix/lib/cmake/tensorwire/tensorwireConfig.cmake" && -f "$prefix/lib/libtensorwire.a" ]] \
    || { echo "cpp/build.sh: TENSORWIRE_PREFIX=$prefix has no tensorwire CMake package (lib/cmake/tensorwire, lib/libtensorwire.a)" >&2; exit 1; }
else
  prefix=$build/tensorwire-prefix
  # shellcheck source=lib/cmake_package.sh
  source "$root/scripts/lib/cmake_package.sh"
  cmake_package_build "$build/tensorwire-cmake" "$build/tensorwire-configure.log" -DCMAKE_BUILD_TYPE=Release -DTENSORWIRE_BUILD_TESTS=OFF
  cmake_package_install "$build/tensorwire-cmake" "$prefix"
fi

torch_prefix=$("$py" -c "import torch; print(torch.utils.cmake_prefix_path)")
cmake -S "$root/cpp" -B "$build/torch-ext" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$prefix;$torch_prefix" -Dtensorwire_DIR="$prefix/lib/cmake/tensorwire" >"$build/torch-ext-configure.log" 2>&1 \
  || { cat "$build/torch-ext-configure.log" >&2; exit 1; }
grep "tensorwire_torch:" "$build/torch-ext-configure.log" >&2 || true
cmake --build "$build/torch-ext" -j"$jobs" >&2
echo "$build/torch-ext/libtensorwire_torch.so"
