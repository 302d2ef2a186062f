#!/usr/bin/env bash
# Run a command against simcuda: build the simulated driver, expose it as libcuda.so.1 /
# libcuda.so in target/simcuda-lib/ (only there: cargo puts target/*/deps on the library
# path of every run, so it is never named libcuda there) and run CMD with that directory
# first on LD_LIBRARY_PATH. SIMCUDA_* settings (README.md) pass through.
#
#   simcuda/run.sh cargo test --test cuda_sim
#   SIMCUDA_SEED=7 SIMCUDA_MAX_DELAY_US=500 simcuda/run.sh cargo test --test cuda_sim
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
cargo build --locked -q -p simcuda --manifest-path "$root/Cargo.toml"
lib=$target/simcuda-lib
mkdir -p "$lib"
# Another run of this script may have the installed library loaded right now (two cargo
# tests started together). Never write into that file: a new build goes in beside it under a
# temporary name and is renamed over it (processes that loaded the old one keep its inode),
# and nothing is written when the build did not change. `cp -f` rewrote the mapped file in
# place: SIGSEGV, SIGBUS and failed dlopens in the other run (simcuda/install_test.sh).
if ! cmp -s "$target/debug/libsimcuda.so" "$lib/libsimcuda.so"; then
  tmp=$(mktemp "$lib/.libsimcuda.so.XXXXXX")
  cp "$target/debug/libsimcuda.so" "$tmp"
  chmod 755 "$tmp"
  mv -f "$tmp" "$lib/libsimcuda.so"
fi
# The links, likewise: `ln -sf` unlinks first, and a dlopen in that gap finds no library.
for name in libcuda.so.1 libcuda.so; do
  if [ "$(readlink "$lib/$name" 2>/dev/null)" != libsimcuda.so ]; then
    tmp=$(mktemp -u "$lib/.$name.XXXXXX")
    ln -s libsimcuda.so "$tmp"
    mv -fT "$tmp" "$lib/$name"
  fi
done
export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# tests/cuda_sim.rs then insists that the driver it loaded is simcuda.
export TW_EXPECT_SIMCUDA=1
exec "$@"
