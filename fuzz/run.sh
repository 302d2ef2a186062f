#!/usr/bin/env bash
# Run every cargo-fuzz target of this crate for a while; exit non-zero on any crash,
# timeout or out-of-memory the fuzzer reports.
#
#   fuzz/run.sh [SECONDS] [TARGET...]      (default: 10 seconds, every target)
#
# Environment:
#   FUZZ_SECONDS     seconds per target when no SECONDS argument is given (default 10)
#   FUZZ_SANITIZER   address (default) | none   (address needs nightly flags; on stable
#                    they are unlocked with RUSTC_BOOTSTRAP=1, as below)
#   CARGO_HOME       where cargo-fuzz is installed if missing (cargo's default otherwise)
#
# Crash inputs land in fuzz/artifacts/<target>/; reproduce one with
#   cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run <target> artifacts/<target>/crash-...
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"

secs="${1:-${FUZZ_SECONDS:-10}}"
[[ $# -gt 0 ]] && shift
case "$secs" in
    '' | *[!0-9]*) echo "run.sh: SECONDS must be a whole number, got '$secs'" >&2; exit 2 ;;
esac
sanitizer="${FUZZ_SANITIZER:-address}"

if [[ -n "${CARGO_HOME:-}" ]]; then
    export PATH="$CARGO_HOME/bin:$PATH"
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "run.sh: installing cargo-fuzz (about a minute)" >&2
    cargo install --locked cargo-fuzz@0.13.2
fi

# Sanitizer flags (-Zsanitizer) are nightly-only; RUSTC_BOOTSTRAP lets stable accept them.
export RUSTC_BOOTSTRAP=1

if [[ $# -gt 0 ]]; then
    targets=("$@")
else
    mapfile -t targets < <(cargo fuzz list)
fi

# Seed corpus: a few valid descriptors, so the raw-bytes path starts from inputs that
# decode. Cheap, optional (needs python3), written only where no corpus exists yet.
seed_desc_decode() {
    local dir="corpus/desc_decode"
    [[ -d "$dir" ]] && [[ -n "$(ls -A "$dir")" ]] && return 0
    command -v python3 >/dev/null || return 0
    mkdir -p "$dir"
    python3 - "$dir" <<'PY'
import struct, sys
out = sys.argv[1]
MAGIC, VERSION, MAX_NDIM = int.from_bytes(b"TWD1", "little"), 1, 16
def desc(name, dtype, size, sizes, strides, offset=0, nbytes=None, kind=1):
    extent = 0
    if all(s > 0 for s in sizes):
        extent = (offset + sum((s - 1) * st for s, st in zip(sizes, strides)) + 1) * size
    nbytes = extent if nbytes is None else nbytes
    head = struct.pack("<IHBBBBBBIq", MAGIC, VERSION, dtype, len(sizes), 0, 0, kind, 0, 0, offset)
    pad = [0] * (MAX_NDIM - len(sizes))
    geo = struct.pack("<16q", *sizes, *pad) + struct.pack("<16q", *strides, *pad)
    storage = struct.pack("<QQQII64sIIQQ", 7, 0, nbytes, 3, 1, bytes(64), 0, 0, 0, 0)
    b = head + geo + storage
    assert len(b) == 400, len(b)
    open(f"{out}/seed-{name}", "wb").write(b)
desc("f32-2x3", 6, 4, [2, 3], [3, 1])
desc("f32-3x2-transposed", 6, 4, [3, 2], [1, 3])
desc("i64-1000x5-expanded", 4, 8, [1000, 5], [0, 1])
desc("u8-sliced", 0, 1, [4, 2], [6, 2], offset=1)
desc("f64-scalar", 7, 8, [], [], offset=5)
desc("bf16-empty", 15, 2, [0, 4], [4, 1])
desc("c128-ring", 10, 16, [8], [1], kind=2, nbytes=4096)
PY
}

failed=()
for t in "${targets[@]}"; do
    [[ "$t" == desc_decode ]] && seed_desc_decode
    mkdir -p "corpus/$t"
    # Inputs that once crashed (tracked in regressions/<target>/) run first, every time.
    extra=()
    [[ -d "regressions/$t" ]] && extra=("regressions/$t")
    echo "== fuzzing $t for ${secs}s (sanitizer: $sanitizer)" >&2
    if ! cargo fuzz run -s "$sanitizer" "$t" "corpus/$t" "${extra[@]}" -- \
        -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1; then
        failed+=("$t")
    fi
done

if [[ ${#failed[@]} -gt 0 ]]; then
    echo "run.sh: FAILED: ${failed[*]} (inputs in $here/artifacts/)" >&2
    exit 1
fi
echo "run.sh: ${#targets[@]} target(s) ran ${secs}s each without a crash" >&2
