#!/usr/bin/env bash
# Proof that the CUDA suite (tests/cuda_sim.rs, tests/cuda_sim_ring.rs on simcuda) can fail: remove, one at a
# time, a wait that orders GPU work across processes, run the suite, expect it to fail,
# and put the file back (also on Ctrl-C or error). Prints which tests failed for each.
#
#   simcuda/mutations.sh             # all mutations
#   SIMCUDA_SEED=3 simcuda/mutations.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

# name | file | the exact line removed (must occur exactly once)
mutations=(
  "producer's event record before send|src/cuda/event.rs|        self.events.record(slot, stream)?;"
  "consumer's stream wait on the producer's event|src/cuda/event.rs|                self.events.wait(self.slot, stream)?;"
  "ring's wait on the consumer's read event before slot reuse|src/cuda/ring/sender.rs|            self.read_events()?.wait(stream, slot)?;"
)

backup=$(mktemp)
current=""
restore() { if [ -n "$current" ]; then cp "$backup" "$current"; current=""; fi; }
trap 'restore; rm -f "$backup"' EXIT INT TERM

survived=0
for m in "${mutations[@]}"; do
  IFS='|' read -r name file line <<<"$m"
  count=$(grep -cxF -- "$line" "$file" || true)
  if [ "$count" != 1 ]; then
    echo "mutation '$name': the line occurs $count times in $file (expected once): update this script" >&2
    exit 2
  fi
  cp "$file" "$backup"
  current=$file
  LINE="$line" python3 - "$file" <<'PY'
import os, sys
p = sys.argv[1]
line = os.environ["LINE"]
src = open(p).read().split("\n")
src = ["        // (mutation: removed) " + l.strip() if l == line else l for l in src]
open(p, "w").write("\n".join(src))
PY
  echo "==> mutation: remove the $name ($file)"
  out=$(bash simcuda/run.sh cargo test --locked -q --no-fail-fast --test cuda_sim --test cuda_sim_ring 2>&1) && rc=0 || rc=$?
  restore
  failed=$(printf '%s\n' "$out" | sed -n 's/^    \([a-z_0-9]*\)$/\1/p' | sort -u | tr '\n' ' ')
  if [ "$rc" = 0 ]; then
    echo "    SURVIVED: the suite passed without the $name"
    survived=$((survived + 1))
  else
    echo "    caught: failing tests: ${failed:-(see output)}"
  fi
done
if [ "$survived" -gt 0 ]; then
  echo "$survived mutation(s) survived" >&2
  exit 1
fi
echo "every mutation was caught"
