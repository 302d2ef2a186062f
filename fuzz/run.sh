#!/usr/bin/env bash
# The fuzz step of scripts/test.sh: for every cargo-fuzz target of this crate (or those
# named), replay its kept corpus (corpus/<target>/) and every input that once failed
# (regressions/<target>/), then fuzz it briefly from there. Exits non-zero on any crash,
# timeout or out-of-memory the fuzzer reports. Nothing under corpus/ is written: new
# inputs go to a scratch directory (scripts/fuzz-long.sh is what grows the corpus).
#
#   fuzz/run.sh [SECONDS] [TARGET...]      (default: 10 seconds, every target)
#
# Environment:
#   FUZZ_SECONDS     seconds of fuzzing per target when no SECONDS argument is given
#                    (default 10; 0: replay only)
#   FUZZ_SANITIZER   address (default) | none
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
source "$here/common.sh"
mapfile -t targets < <(fuzz_targets "$@")

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

failed=()
for t in "${targets[@]}"; do
    mkdir -p "corpus/$t" "regressions/$t" "$scratch/$t"
    ml=$(max_len_for "$t")
    n=$(find "corpus/$t" "regressions/$t" -type f | wc -l)
    echo "== $t: replaying $n kept inputs (corpus + regressions)" >&2
    # -runs=0: run every given input once, then stop.
    if ! cargo fuzz run -s "$fuzz_sanitizer" "$t" "corpus/$t" "regressions/$t" -- \
        -runs=0 -timeout=10 -rss_limit_mb=2048; then
        failed+=("$t (replay)")
        continue
    fi
    [[ "$secs" -eq 0 ]] && continue
    echo "== $t: fuzzing for ${secs}s (sanitizer: $fuzz_sanitizer)" >&2
    # New inputs go to the first directory (scratch); the kept corpus only seeds the run.
    if ! cargo fuzz run -s "$fuzz_sanitizer" "$t" "$scratch/$t" "corpus/$t" -- \
        -max_total_time="$secs" -max_len="$ml" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1; then
        failed+=("$t")
    fi
done

if [[ ${#failed[@]} -gt 0 ]]; then
    echo "run.sh: FAILED: ${failed[*]} (inputs in $here/artifacts/)" >&2
    exit 1
fi
echo "run.sh: ${#targets[@]} target(s): kept inputs replayed, then ${secs}s of fuzzing each, without a crash" >&2
