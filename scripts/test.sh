#!/usr/bin/env bash
# Every test of tensorwire, from a fresh machine of this kind: installs what it needs
# (nothing beyond the Rust toolchain for the transport; cargo-fuzz into .tools/), then
# runs unit, integration and cross-process tests, clippy's unsafe lints, the loom
# models, and each fuzz target for a few seconds. Exits non-zero on any failure.
#
#   scripts/test.sh            # everything
#   FUZZ_SECONDS=30 scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
log=$(mktemp)
trap 'rm -f "$log"' EXIT

step() { printf '\n==> %s\n' "$*"; }

step "build (debug, all targets)"
cargo build --all-targets --locked 2>&1 | tail -n 3

step "clippy (undocumented unsafe blocks and other denied lints fail the run)"
cargo clippy --all-targets --locked -q -- -D clippy::undocumented_unsafe_blocks

step "unit, integration, cross-process and doc tests"
cargo test --locked 2>&1 | tee -a "$log"

step "loom models (--cfg loom)"
RUSTFLAGS="--cfg loom" cargo test --release --locked --test loom --target-dir target-loom 2>&1 | tee -a "$log"

step "benches compile"
cargo bench --locked --no-run 2>&1 | tail -n 2

step "fuzz targets (${FUZZ_SECONDS:-5} s each)"
FUZZ_SECONDS=${FUZZ_SECONDS:-5} bash fuzz/run.sh

step "demo (main job) runs clean"
cargo run --release --locked -q -- demo --max-size 1048576 | tail -n 1

# One closing line over every cargo test binary that ran.
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i) ~ /^passed/) p += $(i-1); if ($(i) ~ /^failed/) f += $(i-1); if ($(i) ~ /^ignored/) s += $(i-1) } }
     END { printf "\ntensorwire tests: %d passed, %d failed, %d skipped\n", p, f, s; exit (f > 0) }' "$log"
