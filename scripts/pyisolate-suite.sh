#!/usr/bin/env bash
# pyisolate 0.10.2's own test suite, run as it is and then with tensorwire's adapter in
# every host it creates (python/tests/pyisolate_suite_plugin.py wraps its child launch;
# nothing of pyisolate is edited), compared test by test. Not part of scripts/test.sh:
# it needs pyisolate's source tree (its tests are not in the wheel) and takes minutes.
#
#   scripts/pyisolate-suite.sh PYISOLATE_SRC OUTDIR [DELAY_S]
#
# PYISOLATE_SRC: a checkout of github.com/Comfy-Org/pyisolate at v0.10.2; OUTDIR gets
# plain.xml/adapter.xml (JUnit) and the logs. With DELAY_S, every child pyisolate starts
# sleeps that long after receiving its bootstrap (python/tests/pyisolate_delay), in both
# runs. $TW_PYTHON (default .venv/bin/python) needs torch, pyisolate 0.10.2, pytest and
# what pyisolate's tests import (pytest-asyncio, pyyaml, psutil, tabulate; on PYTHONPATH
# will do). tensorwire is taken from python/ (build the binding into it first).
# $TW_SUITE_MODES (default "plain adapter") picks the runs; the comparison reads both
# XML files in OUTDIR, whichever run made them. Exits 1 if any test's outcome differs.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
src=$(cd "$1" && pwd)
out=$(mkdir -p "$2" && cd "$2" && pwd)
delay=${3:-}
py=${TW_PYTHON:-$root/.venv/bin/python}
path="$root/python:$root/python/tests${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "$delay" ]; then
  path="$root/python/tests/pyisolate_delay:$path"
  export TW_PYISOLATE_CHILD_DELAY_S=$delay
fi
for mode in ${TW_SUITE_MODES:-plain adapter}; do
  flag=0
  [ "$mode" = adapter ] && flag=1
  echo "== pyisolate suite, $mode${delay:+, children delayed ${delay} s}"
  (cd "$src" && PYTHONPATH="$path" TW_PYISOLATE_SUITE_ADAPTER=$flag "$py" -m pytest -o addopts= -m "not network" \
     -q -rfE -p no:cacheprovider -p pyisolate_suite_plugin --junitxml="$out/$mode.xml" tests \
     > "$out/$mode.log" 2>&1) || true
  tail -n 3 "$out/$mode.log"
done
"$py" - "$out/plain.xml" "$out/adapter.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

def outcomes(path):
    got = {}
    for case in ET.parse(path).iter("testcase"):
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        got[f"{case.get('classname')}::{case.get('name')}"] = kind
    return got

plain, adapter = outcomes(sys.argv[1]), outcomes(sys.argv[2])
for name, got in (("plain", plain), ("adapter", adapter)):
    counts = {}
    for kind in got.values():
        counts[kind] = counts.get(kind, 0) + 1
    print(f"{name}: {len(got)} tests: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
diff = sorted(t for t in plain.keys() | adapter.keys() if plain.get(t) != adapter.get(t))
for t in diff:
    print(f"DIFFERS {t}: plain {plain.get(t)}, adapter {adapter.get(t)}")
print("same outcome for every test" if not diff else f"{len(diff)} tests differ")
sys.exit(1 if diff else 0)
PY
