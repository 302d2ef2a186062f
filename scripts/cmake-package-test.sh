#!/usr/bin/env bash
# Build tensorwire with CMake from the repo, run its ctest suite (C tests + valgrind),
# install it to a prefix, and build + run ffi/tests/cmake_consumer against both the install
# prefix and the build tree. Usage: ffi/tests/cmake_package.sh [WORKDIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$root/build/cmake-package}
rm -rf "$work"
mkdir -p "$work"
# shellcheck source=lib/cmake_package.sh
source "$root/scripts/lib/cmake_package.sh"
cmake_package_build "$work/build" "$work/configure.log"
(cd "$work/build" && ctest --output-on-failure)
cmake_package_install "$work/build" "$work/prefix"
for f in include/tensorwire.h lib/libtensorwire.a lib/libtensorwire.so lib/cmake/tensorwire/tensorwireConfig.cmake \
         lib/cmake/tensorwire/tensorwireConfigVersion.cmake; do
  [ -f "$work/prefix/$f" ] || { echo "install is missing $f" >&2; exit 1; }
done
for mode in prefix buildtree; do
  if [ $mode = prefix ]; then args=(-DCMAKE_PREFIX_PATH="$work/prefix"); else args=(-Dtensorwire_DIR="$work/build"); fi
  cmake -S "$root/ffi/tests/cmake_consumer" -B "$work/consumer-$mode" "${args[@]}" >"$work/consumer-$mode.log"
  cmake --build "$work/consumer-$mode" -j2 >/dev/null
  "$work/consumer-$mode/consumer_static"
  "$work/consumer-$mode/consumer_shared"
  readelf -d "$work/consumer-$mode/consumer_shared" | grep -q "NEEDED.*libtensorwire.so" || { echo "consumer_shared does not link libtensorwire.so" >&2; exit 1; }
done
echo "cmake package: install prefix and build tree both usable"
