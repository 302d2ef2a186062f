#!/usr/bin/env bash
# Proof that the CUDA suite (tests/cuda_sim.rs, cuda_sim_ring.rs, cuda_sim_order.rs on simcuda) can fail:
# remove, one at a time, a wait or signal that orders GPU work across processes, run the suite under the
# wait policy (TENSORWIRE_CUDA_WAIT) that uses it, expect it to fail, and put the file back (also on
# Ctrl-C or error). Prints which tests failed for each.
#
#   simcuda/mutations.sh             # all mutations
#   SIMCUDA_SEED=3 simcuda/mutations.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

# Four entries each: name, policy, file, the exact line removed (must occur exactly once).
mutations=(
  "producer's event record before send" event src/cuda/order/event_pool.rs
  "        self.events.record(slot, stream)?;"
  "consumer's stream wait on the producer's event" event src/cuda/order/remote_events.rs
  "            events.wait(stream, slot as usize)?;"
  "ring's stream wait on the consumer's read event before slot reuse" event src/cuda/ring/sender.rs
  "                read.wait(stream, slot)?;"
  "ring's host wait on the consumer's read event before slot reuse" stream src/cuda/ring/sender.rs
  "                host_wait(|| read.query(slot), deadline, gone, \"the consumer's copy out of a GPU ring slot\")?;"
  "ring's host wait on the producer's copy-in" stream src/cuda/ring/receiver.rs
  "                    host_wait(|| self.written.query(slot), deadline, gone, WRITTEN_WAIT).map_err(|e| (e, progressed))?;"
  "producer's signal word write" stream src/cuda/order/producer.rs
  "        self.words.as_ref().expect(\"present until drop\").stream_write(i as u32, value, stream)?;"
  "consumer's stream wait on the signal word" stream src/cuda/order/consumer.rs
  "        rw.words.stream_wait(self.lane, self.value, stream)?;"
  "consumer's host wait on the signal word" host src/cuda/order/consumer.rs
  "        host_wait(|| rw.words.reached(self.lane, self.value), &mut rw.timeout.deadline(), &|| peer.gone(), WORD_WAIT)?;"
  "watchdog's forced release of a wait the producer never ends" stream src/cuda/order/watchdog.rs
  "                let _ = e.p.words.force(e.p.lane, e.p.value);"
)

backup=$(mktemp)
current=""
restore() { if [ -n "$current" ]; then cp "$backup" "$current"; current=""; fi; }
trap 'restore; rm -f "$backup"' EXIT INT TERM

survived=0
for ((i = 0; i < ${#mutations[@]}; i += 4)); do
  name=${mutations[i]} policy=${mutations[i + 1]} file=${mutations[i + 2]} line=${mutations[i + 3]}
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
  echo "==> mutation: remove the $name ($file; TENSORWIRE_CUDA_WAIT=$policy)"
  # A removed wait that lets a stream wait for good must fail the suite, not hang it.
  out=$(TENSORWIRE_CUDA_WAIT=$policy timeout 300 bash simcuda/run.sh cargo test --locked -q --no-fail-fast --test cuda_sim --test cuda_sim_ring --test cuda_sim_order 2>&1) && rc=0 || rc=$?
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
