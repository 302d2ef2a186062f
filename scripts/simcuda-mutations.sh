#!/usr/bin/env bash
# Proof that the CUDA suite (tests/cuda_sim.rs, cuda_sim_ring.rs, cuda_sim_order.rs on simcuda) can fail:
# remove, one at a time, a wait or signal that orders GPU work across processes, run the suite under the
# wait policy (TENSORWIRE_CUDA_WAIT) that uses it, expect it to fail, and put the file back (also on
# Ctrl-C or error). Prints which tests failed for each.
#
#   simcuda/mutations.sh             # all mutations
#   SIMCUDA_SEED=3 simcuda/mutations.sh
#   ONLY=ring simcuda/mutations.sh   # only the mutations whose name contains "ring"
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

# Four entries each: name, policy (then any extra environment, e.g. a simcuda switch that
# takes the fallback path), file, the exact line removed (must occur exactly once).
mutations=(
  "producer's event record before send" event src/cuda/order/event_pool.rs
  "        self.events.record(slot, stream)?;"
  "consumer's stream wait on the producer's event" event src/cuda/order/remote_events.rs
  "            events.wait(stream, slot as usize)?;"
  "ring's stream wait on the consumer's read event before slot reuse" event src/cuda/ring/sender.rs
  "                        read.wait(stream, slot)?;"
  "ring's host wait on the consumer's read event before slot reuse (no words)" "stream SIMCUDA_NO_HOST_REGISTER=1" src/cuda/ring/sender.rs
  "                        host_wait(|| read.query(slot), deadline, gone, READ_WAIT)?;"
  "ring's host wait on the producer's copy-in event (no words)" "stream SIMCUDA_NO_HOST_REGISTER=1" src/cuda/ring/receiver.rs
  "                        host_wait(|| written.query(slot), deadline, gone, WRITTEN_WAIT).map_err(|e| (e, progressed))?;"
  "ring's written word write after a copy in" stream src/cuda/ring/sender.rs
  "                signalled = w.signal(slot, Word::Written, value, stream);"
  "ring's read word write after a copy out" stream src/cuda/ring/receiver.rs
  "                    words.signal(slot, Word::Read, value, stream).map_err(|e| (e, true))?;"
  "ring's stream wait on a peer's word" stream src/cuda/ring/words.rs
  "        words.stream_wait(lane, value, stream)?;"
  "ring's host wait on a peer's word" host src/cuda/ring/words.rs
  "            host_wait(|| words.reached(lane, value), deadline, gone, what)?;"
  "producer's signal word write" stream src/cuda/order/producer.rs
  "        self.words.as_ref().expect(\"present until drop\").stream_write(i as u32, value, stream)?;"
  "consumer's stream wait on the signal word" stream src/cuda/order/consumer.rs
  "        rw.words.stream_wait(self.lane, self.value, stream)?;"
  "consumer's host wait on the signal word" host src/cuda/order/consumer.rs
  "        host_wait(|| rw.words.reached(self.lane, self.value), &mut rw.timeout.deadline(), &|| peer.gone(), WORD_WAIT)?;"
  "watchdog's forced release of a wait the producer never ends" stream src/cuda/order/watchdog.rs
  "            let _ = e.p.words.force(e.p.lane, e.p.value);"
)

backup=$(mktemp)
current=""
restore() { if [ -n "$current" ]; then cp "$backup" "$current"; current=""; fi; }
trap 'restore; rm -f "$backup"' EXIT INT TERM

survived=0
for ((i = 0; i < ${#mutations[@]}; i += 4)); do
  name=${mutations[i]} file=${mutations[i + 2]} line=${mutations[i + 3]}
  read -r policy extra <<<"${mutations[i + 1]}"
  [[ -n "${ONLY:-}" && "$name" != *"$ONLY"* ]] && continue
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
  echo "==> mutation: remove the $name ($file; TENSORWIRE_CUDA_WAIT=$policy${extra:+ $extra})"
  # A removed wait that lets a stream wait for good must fail the suite, not hang it.
  # shellcheck disable=SC2086 # $extra: assignments, split on purpose
  out=$(env TENSORWIRE_CUDA_WAIT=$policy $extra timeout 300 bash simcuda/run.sh cargo test --locked -q --no-fail-fast --test cuda_sim --test cuda_sim_ring --test cuda_sim_order 2>&1) && rc=0 || rc=$?
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
