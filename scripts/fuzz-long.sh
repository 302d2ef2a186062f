#!/usr/bin/env bash
# A fuzzing campaign: every cargo-fuzz target (or those named) for SECONDS each, one at a
# time, starting from its kept corpus (fuzz/corpus/<target>/) and regressions; the new
# coverage found is merged into the kept corpus, minimized (libFuzzer -merge=1: the
# smallest set of inputs that keeps all coverage), so the corpus in the repository
# grows only by what adds coverage. Fails on any crash, timeout or out-of-memory, with
# the failing input's path printed; the corpus of a target that failed is not touched.
#
#   scripts/fuzz-long.sh [SECONDS] [TARGET...]     (default: 600 seconds, every target)
#
# Environment:
#   FUZZ_SANITIZER          address (default) | none
#   FUZZ_CORPUS_MAX_FILES   most files kept per target (default 500)
#   FUZZ_CORPUS_MAX_KIB     most KiB kept per target (default 1024)
#   FUZZ_JOBS               parallel fuzzing processes per target (default 1: the
#                           machine may be shared)
#
# The last lines are a table: target, executions, corpus files and bytes, result.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root/fuzz"

secs="${1:-600}"
[[ $# -gt 0 ]] && shift
case "$secs" in
    '' | *[!0-9]* | 0) echo "fuzz-long.sh: SECONDS must be a whole number > 0, got '$secs'" >&2; exit 2 ;;
esac
max_files="${FUZZ_CORPUS_MAX_FILES:-500}"
max_kib="${FUZZ_CORPUS_MAX_KIB:-1024}"
jobs="${FUZZ_JOBS:-1}"
source "$root/fuzz/common.sh"
mapfile -t targets < <(fuzz_targets "$@")

# The seed inputs (valid messages of each kind) are part of every corpus.
if command -v python3 >/dev/null; then
    python3 "$root/fuzz/seed-corpus.py" corpus
fi

echo "== building ${#targets[@]} target(s) (sanitizer: $fuzz_sanitizer)" >&2
cargo fuzz build -s "$fuzz_sanitizer" >&2

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

summary=()
failed=()
for t in "${targets[@]}"; do
    ml=$(max_len_for "$t")
    mkdir -p "corpus/$t" "regressions/$t" "$work/$t/new" "$work/$t/min"
    log="$work/$t/log"
    echo "== $t: ${secs}s, -max_len=$ml, starting from $(find "corpus/$t" -type f | wc -l) kept inputs" >&2
    status=ok
    # New inputs go to the first directory; the kept corpus and regressions seed the run.
    if ! cargo fuzz run -s "$fuzz_sanitizer" -j "$jobs" "$t" "$work/$t/new" "corpus/$t" "regressions/$t" -- \
        -max_total_time="$secs" -max_len="$ml" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        2>&1 | tee "$log" >&2; then
        status=FAILED
    fi
    # -j > 1 writes each worker's log to fuzz-N.log; count those too.
    shopt -s nullglob
    worker_logs=(fuzz-*.log)
    shopt -u nullglob
    execs=$(awk -F: '/stat::number_of_executed_units/ { s += $NF } END { print s + 0 }' "$log" "${worker_logs[@]}")
    rm -f "${worker_logs[@]}"
    if [[ $status == FAILED ]]; then
        art=$(grep -oE '(Test unit written to|artifact_prefix=.*; Test unit written to) [^ ]+' "$log" | awk '{ print $NF }' | tail -1)
        echo "fuzz-long.sh: $t FAILED; input: ${art:-see $root/fuzz/artifacts/$t/}" >&2
        echo "  reproduce: cd $root/fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run $t ${art:-artifacts/$t/<crash-file>}" >&2
        failed+=("$t")
        summary+=("$(printf '%-18s %12s %8s %10s  %s' "$t" "$execs" - - "FAILED ${art:-}")")
        continue
    fi
    # Merge: the smallest set of kept + new inputs with all their coverage.
    cargo fuzz run -s "$fuzz_sanitizer" "$t" "$work/$t/min" "corpus/$t" "$work/$t/new" -- \
        -merge=1 -max_len="$ml" -timeout=10 -rss_limit_mb=2048 >"$work/$t/merge.log" 2>&1 ||
        { echo "fuzz-long.sh: merging the corpus of $t failed (log: $work/$t/merge.log)" >&2; cat "$work/$t/merge.log" >&2; exit 1; }
    # Cap: past the limits, keep the smallest files (they carry the most coverage per byte).
    merged=$(find "$work/$t/min" -type f | wc -l)
    n=0 total=0
    while IFS=' ' read -r sz f; do
        if (( n >= max_files || total + sz > max_kib * 1024 )); then
            rm -f "$f"
            continue
        fi
        n=$((n + 1)) total=$((total + sz))
    done < <(find "$work/$t/min" -type f -printf '%s %p\n' | sort -n)
    # Replace the kept corpus; the seeds stay in it whatever the merge kept.
    (( n < merged )) && echo "fuzz-long.sh: $t: the merge kept $merged inputs; the cap keeps the $n smallest" >&2
    find "corpus/$t" -type f -delete
    find "$work/$t/min" -type f -exec cp -t "corpus/$t" {} +
    if command -v python3 >/dev/null; then
        python3 "$root/fuzz/seed-corpus.py" corpus
    fi
    files=$(find "corpus/$t" -type f | wc -l)
    bytes=$(find "corpus/$t" -type f -printf '%s\n' | awk '{ s += $1 } END { print s + 0 }')
    summary+=("$(printf '%-18s %12s %8s %10s  %s' "$t" "$execs" "$files" "$bytes" ok)")
done

echo >&2
printf '%-18s %12s %8s %10s  %s\n' target executions files bytes result
printf '%s\n' "${summary[@]}"
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "fuzz-long.sh: FAILED: ${failed[*]} (inputs in $root/fuzz/artifacts/)" >&2
    exit 1
fi
