#!/usr/bin/env bash
# simcuda/run.sh must never rewrite a library that a running process has loaded: two runs
# started together (two `cargo test`s, a test and a benchmark) share target/simcuda-lib, and
# a `cp -f` over the installed file truncates and rewrites the very pages the first run has
# mapped (seen: SIGSEGV, SIGBUS, failed dlopen). Checked here:
#   1. run A loads the installed library and keeps it loaded (simcuda/install_test_holder.py);
#   2. run B builds a different library (opt-level 1: other code at the same file offsets),
#      installs it and uses it while A holds the old one;
#   3. A uses its library again; both runs must succeed, and the installed file is B's;
#   4. a run whose build did not change installs nothing (the file keeps its inode).
# It uses a target directory of its own (target/simcuda-install-test) so that the suite's
# library is not touched.
#
#   bash simcuda/install_test.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export CARGO_TARGET_DIR=$root/target/simcuda-install-test
run() { bash "$root/simcuda/run.sh" "$@"; }
holder=$root/simcuda/install_test_holder.py
lib=$CARGO_TARGET_DIR/simcuda-lib/libsimcuda.so
work=$(mktemp -d)
pid=
cleanup() { if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; fi; rm -rf "$work"; }
trap cleanup EXIT

CARGO_PROFILE_DEV_OPT_LEVEL=0 run true
CARGO_PROFILE_DEV_OPT_LEVEL=0 run python3 "$holder" "$work/ready" "$work/go" &
pid=$!
for _ in $(seq 600); do
  [ -e "$work/ready" ] && break
  kill -0 "$pid" 2>/dev/null || { echo "install test: the holder ended before it loaded the library" >&2; exit 1; }
  sleep 0.1
done
[ -e "$work/ready" ] || { echo "install test: the holder never loaded the library" >&2; exit 1; }
CARGO_PROFILE_DEV_OPT_LEVEL=1 run python3 "$holder"
touch "$work/go"
rc=0
wait "$pid" || rc=$?
pid=
if [ "$rc" != 0 ]; then
  echo "install test: FAILED: the run that held the library while another installed a new one exited $rc" >&2
  exit 1
fi
cmp -s "$CARGO_TARGET_DIR/debug/libsimcuda.so" "$lib" || { echo "install test: FAILED: the new build was not installed" >&2; exit 1; }
inode=$(stat -c %i "$lib")
CARGO_PROFILE_DEV_OPT_LEVEL=1 run true
[ "$(stat -c %i "$lib")" = "$inode" ] || { echo "install test: FAILED: an unchanged library was installed again" >&2; exit 1; }
echo "install test: ok (a run kept its library loaded while another installed a different build; an unchanged build installs nothing)"
