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
cp -f "$target/debug/libsimcuda.so" "$lib/libsimcuda.so"
ln -sf libsimcuda.so "$lib/libcuda.so.1"
ln -sf libsimcuda.so "$lib/libcuda.so"
export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# tests/cuda_sim.rs then insists that the driver it loaded is simcuda.
export TW_EXPECT_SIMCUDA=1
exec "$@"
