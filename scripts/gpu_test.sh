#!/usr/bin/env bash
# GPU tests of tensorwire's CUDA path on real hardware: the Rust CUDA suite (the same
# tests that run on the simulated driver, simcuda, in every test run) against the real
# driver, and everything that needs torch's CUDA runtime (the libtorch extension's CUDA
# ops, the CUDA benchmark), which no simulated driver can stand in for.
#
# A GPU machine may have no cargo and no network, so what needs cargo is built on a
# machine that has it and copied over; the extension is built on the GPU machine against
# its own torch (the C++ ABI must match that torch) with the CUDA backend (cpp/src/cuda.cpp).
#
#   1. where cargo is:  bash scripts/gpu_test.sh prepare
#                       -> build/gpu-prefix (lib/libtensorwire.a, include/, lib/cmake/tensorwire,
#                          rust-tests/: the Rust CUDA test binaries, the RPC crate's as rpc-*;
#                          c-tests/: the C ABI's CUDA tests)
#   2. copy the repository with build/gpu-prefix in it to the GPU machine and run, from its
#      root:            bash scripts/gpu_test.sh
#      or one stage at a time (each a few minutes):
#                       bash scripts/gpu_test.sh build  (then)  rust  (then)  tests  (then)  wheel  (then)  bench  (then)  mps
#      (TENSORWIRE_PREFIX=<dir> names another prefix; GPU_TEST_ITERS sets the bench's
#      iterations, default 200; the tests' and the bench's full output go to
#      GPU_TEST_LOG_DIR, default build/gpu-test-logs.)
#
# Usage: bash scripts/gpu_test.sh [build|rust|tests|wheel|bench|mps|all]   (default all: every stage, mps last)
#        bash scripts/gpu_test.sh prepare [OUT_DIR]          (here, where cargo is)
# Every stage first checks that python3 sees a CUDA device. `tests` and `bench` reuse the
# extension that an earlier `build` left in build/torch-ext on this machine (its stamp, a
# hash of the prefix, cpp/, the op schemas and the torch version, must match) and rebuild
# it otherwise.
# PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF are set to expandable_segments:False (a
# machine may enable them globally; the vmm test turns them on for its own producer).
#
# What the stages do, each part printed as PASS / FAIL / SKIPPED, with a summary at the
# end; exit status non-zero if any part failed (or no GPU is visible):
#   rust       the Rust CUDA suite (tests/cuda_sim*.rs, ffi/tests/cuda_sim_ffi.rs, the RPC
#              crate's CUDA tests) built by `prepare`, run against the real driver: IPC of every dtype and view,
#              zero-copy, handle cache, stream order (the ordering suites again under
#              TENSORWIRE_CUDA_WAIT=host and =event), the wait policies' signal words and a
#              producer that never signals or dies, VMM, GPU ring, SIGKILL cases, the C
#              ABI's CUDA calls (c-tests/), forwarding a CUDA import host -> relay -> last;
#              and simcuda's conformance tests (tests/simcuda_driver.rs), which calibrate
#              the simulated driver against this one: documented rules must hold here too,
#              and the answers simcuda chooses strictly are recorded as CALIBRATION lines in
#              GPU_TEST_LOG_DIR/simcuda-calibration.log (simcuda-only tests say SKIPPED)
#   build      cpp/build.sh with TENSORWIRE_PREFIX (no cargo) against python3's torch; the
#              configure log must say "CUDA toolkit: ON"; tensorwire.cuda_available()
#   pytest     (tests) python/tests (CPU suite + the CUDA smoke tests) if pytest is installed
#   gpu tests  (tests) tests/gpu/gpu_tests.py: every dtype and non-contiguous views of CUDA
#              tensors round trip; zero-copy (the consumer's in-place write is seen by the
#              producer); ordering (GPU sleep + fill_ right before send, no synchronize:
#              the consumer reads the fill); lease reclaim after SIGKILL of the importer;
#              the IPC handle cache (opened once at keep_warm(16), once per message and
#              none left open at keep_warm(0), reused while an import lives); the GPU
#              bounce ring (every dtype, views, a tensor of many slots, ordering, no handle
#              opened per message); VMM export (a producer with expandable segments; no
#              IPC handle opened). A test that reports SKIPPED is noted on this row.
#   wheel      the package's wheel from `prepare` (build/gpu-prefix/wheel) installed into a venv
#              over this machine's torch (--system-site-packages; pip --no-index --no-deps:
#              nothing built, torch untouched), then python/tests and tests/gpu/gpu_tests.py
#              from another directory through it (the wheel's torch-free binding
#              tensorwire._native, CUDA by DLPack; no TENSORWIRE_TORCH_LIB)
#   bench      (bench) benches/torch_cuda_transfer.py: round trip per message at 4 KiB and
#              32 MiB: its same-run floors (pipe, + host event wait, + a child op of its own, + event stream wait),
#              tw cached and GPU ring per wait policy, a handle opened per message,
#              torch.multiprocessing; whether MPS is active. FAIL if it crashed or its
#              measurement was invalid (its per-row open counts or lease checks failed);
#              the floors are printed in the summary.
#   mps        the bench again under MPS (nvidia-cuda-mps-control -d with private pipe and
#              log directories, stopped afterwards); SKIPPED where MPS is not installed.
#   targets    (bench) the CUDA target ratios (docs/DESIGN.md), from the bench's "BENCH TARGETS:" line:
#              MET or NOT MET (a missed performance target does not fail the run).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# The allocator's configuration for every process below (the vmm test overrides both for
# its producer): legacy cudaMalloc memory, shared by IPC handle.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False
export PYTORCH_ALLOC_CONF=expandable_segments:False

if [[ "${1:-}" == "prepare" ]]; then
  # Here: build the Rust static library (release, via the root CMake project and cargo)
  # and install the CMake package into build/gpu-prefix, small enough to copy.
  set -e
  out=${2:-$root/build/gpu-prefix}
  mkdir -p "$root/build"
  # shellcheck source=lib/cmake_package.sh
  source "$root/scripts/lib/cmake_package.sh"
  cmake_package_build "$root/build/tensorwire-cmake" "$root/build/tensorwire-configure.log" -DCMAKE_BUILD_TYPE=Release -DTENSORWIRE_BUILD_TESTS=OFF
  rm -rf "$out"
  cmake_package_install "$root/build/tensorwire-cmake" "$out"
  rm -f "$out"/lib/libtensorwire.so                 # the extension links the static library
  strip --strip-debug "$out/lib/libtensorwire.a"    # debug info is most of its size
  # The Rust CUDA suite: the same test binaries that run on simcuda in every test run, and
  # simcuda's own rules (simcuda_driver: its conformance tests run against the real driver).
  mkdir -p "$out/rust-tests"
  # Each test binary under its target's name (the RPC crate's prefixed rpc-).
  copy_tests() {  # $1: name prefix; then cargo's arguments
    local pre=$1
    shift
    cargo test --release --locked --no-run --message-format=json "$@" 2>/dev/null |
      "${PYTHON:-python3}" -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["executable"], m["target"]["name"])' | while read -r exe name; do
        cp "$exe" "$out/rust-tests/$pre$name"
        strip --strip-debug "$out/rust-tests/$pre$name"
      done
  }
  copy_tests "" --test cuda_sim --test cuda_sim_ring --test cuda_sim_hostile --test cuda_sim_forward \
    --test cuda_sim_order --test simcuda_driver
  copy_tests "" -p tensorwire-ffi --test cuda_sim_ffi
  copy_tests rpc- -p tensorwire-rpc --test cuda_sim --test cuda_sim_hostile
  ls "$out/rust-tests"
  # The C ABI's CUDA tests (ffi/tests/c/cuda*.c), linked against the static library as the
  # CMake package links it; they open the driver with dlopen.
  mkdir -p "$out/c-tests"
  for t in cuda cuda_forward; do
    "${CC:-cc}" -std=c11 -Wall -Wextra -Werror -I "$out/include" "ffi/tests/c/$t.c" "$out/lib/libtensorwire.a" \
      -lgcc_s -lutil -lrt -lpthread -lm -ldl -o "$out/c-tests/tw_c_$t"
  done
  ls "$out/c-tests"
  # The package's one wheel (pyproject.toml: Python modules + tensorwire._native, torch-free,
  # manylinux_2_28), built exactly as the test command builds it; the wheel stage installs
  # it on the GPU machine with no compiler and runs the Python suites through it.
  vpy=$(bash "$root/scripts/setup-venv.sh" | tail -1)
  PATH="$(dirname "$vpy"):$PATH" "$(dirname "$vpy")/maturin" build --release --locked --zig --compatibility manylinux_2_28 \
    -i "$("$vpy" -c 'import os, sys; print(os.path.realpath(sys._base_executable))')" -o "$out/wheel" 2>&1 | tail -n 1
  "$vpy" "$root/scripts/check_wheel.py" "$out"/wheel/*.whl
  du -sh "$out"
  echo "prepared $out; copy it to the GPU machine (same path in the repository) and run: bash scripts/gpu_test.sh"
  exit 0
fi

stage=${1:-all}
case "$stage" in
  build | rust | tests | wheel | bench | mps | all) ;;
  *) echo "usage: bash scripts/gpu_test.sh [build|rust|tests|wheel|bench|mps|all]   (or: prepare [OUT_DIR])" >&2; exit 2 ;;
esac

py=${PYTHON:-python3}
prefix=${TENSORWIRE_PREFIX:-$root/build/gpu-prefix}
iters=${GPU_TEST_ITERS:-200}
logs=${GPU_TEST_LOG_DIR:-$root/build/gpu-test-logs}
mkdir -p "$logs"
lib=$root/build/torch-ext/libtensorwire_torch.so
stampfile=$root/build/torch-ext/gpu_test.stamp
declare -a results=()
failed=0
record() {  # record NAME STATUS [NOTE]
  results+=("$(printf '%-10s %s%s' "$1" "$2" "${3:+  ($3)}")")
  echo "==> $1: $2${3:+ ($3)}"
  [[ "$2" == FAIL ]] && failed=1
  return 0
}
finish() {
  echo
  echo "=== scripts/gpu_test.sh $stage summary (logs: $logs) ==="
  printf '%s\n' "${results[@]}"
  if ((failed)); then echo "RESULT: FAIL"; exit 1; fi
  echo "RESULT: PASS"
  exit 0
}

echo "=== environment (stage: $stage)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
command -v nvcc >/dev/null && nvcc --version | tail -n 2
if ! command -v make >/dev/null && command -v ninja >/dev/null; then
  export CMAKE_GENERATOR=Ninja
fi
echo "PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF=$PYTORCH_ALLOC_CONF"
if ! torch_id=$("$py" -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda); sys.exit(0 if torch.cuda.is_available() else 1)"); then
  echo "$torch_id"
  record environment FAIL "$py has no usable CUDA device: this script runs only on a GPU machine"
  finish
fi
echo "$torch_id"

# What the extension is built from: the carried prefix, cpp/, the op schemas
# (python/tensorwire/ops.schemas) and this machine's torch.
build_stamp() {
  local hasher=sha256sum
  command -v sha256sum >/dev/null || hasher=cksum
  {
    echo "$torch_id"
    cat "$prefix/lib/libtensorwire.a"
    find "$prefix/include" "$root/cpp" "$root/python/tensorwire/ops.schemas" -type f -print0 2>/dev/null | LC_ALL=C sort -z | xargs -0 cat
  } | $hasher | cut -d' ' -f1
}

build_ext() {  # $1: why
  echo "=== build ($1): cpp/build.sh with TENSORWIRE_PREFIX=$prefix (no cargo), torch of $py"
  if [[ ! -f "$prefix/lib/libtensorwire.a" ]]; then
    record build FAIL "no $prefix/lib/libtensorwire.a: run 'bash scripts/gpu_test.sh prepare' where cargo is, and copy build/gpu-prefix here"
    finish
  fi
  rm -f "$stampfile"
  local built
  if ! built=$(TENSORWIRE_PREFIX="$prefix" bash cpp/build.sh "$py" | tail -n 1) || [[ ! -f "$built" ]]; then
    record build FAIL "cpp/build.sh failed (logs: build/torch-ext-configure.log)"
    finish
  fi
  cp -f build/torch-ext-configure.log "$logs/" 2>/dev/null
  if ! grep -q "CUDA toolkit: ON" build/torch-ext-configure.log; then
    grep "tensorwire_torch:" build/torch-ext-configure.log
    record build FAIL "the extension was configured without a CUDA toolkit (is nvcc on PATH?)"
    finish
  fi
  lib=$built
  build_stamp >"$stampfile"
  build_note="built $lib"
}

# The package: the wheel `prepare` built, installed into a venv over this machine's torch
# (--system-site-packages; pip --no-index --no-deps: nothing is built and torch is kept).
# Every stage's Python runs from it: the wheel stage on its own binding, the others with
# the C++ extension selected by TENSORWIRE_TORCH_LIB.
# A --target dir, not a venv: this machine's python3 may itself be a venv, whose packages
# (torch) a nested venv would not see.
wsite=$root/build/gpu-wheel/site-packages
whl=$(ls "$prefix"/wheel/tensorwire-*.whl 2>/dev/null | head -n 1)
if [[ -z "$whl" ]]; then
  record wheel FAIL "no wheel in $prefix/wheel: run 'bash scripts/gpu_test.sh prepare' where cargo is"
  finish
fi
rm -rf "$wsite"
if ! "$py" -m pip install -q --no-index --no-deps --target "$wsite" "$whl" >"$logs/wheel-install.log" 2>&1 &&
   ! "$py" -m pip install -q --no-index --no-deps --break-system-packages --target "$wsite" "$whl" >>"$logs/wheel-install.log" 2>&1; then
  record wheel FAIL "pip install of $(basename "$whl") failed; log: $logs/wheel-install.log"
  finish
fi
export PYTHONPATH=$wsite
wpy=$py
echo "=== installed $(basename "$whl") into $wsite (PYTHONPATH)"
# GPU_TEST_PYTESTS: test files of python/tests to run (default: all of them).
pytests=()
for f in ${GPU_TEST_PYTESTS:-}; do pytests+=("$root/python/tests/$f"); done
((${#pytests[@]})) || pytests=("$root/python/tests")
export PYTHONDONTWRITEBYTECODE=1

build_note=
if [[ "$stage" == wheel ]]; then
  :  # the wheel needs no build here
elif [[ "$stage" == build || "$stage" == all ]]; then
  build_ext "stage $stage"
elif [[ ! -f "$lib" || ! -f "$stampfile" ]]; then
  build_ext "no earlier build in build/torch-ext"
elif [[ ! -f "$prefix/lib/libtensorwire.a" ]]; then
  echo "=== build: reusing $lib (no $prefix/lib/libtensorwire.a here to compare it with)"
  build_note="reused $lib, not compared: no prefix here"
elif [[ "$(cat "$stampfile")" != "$(build_stamp)" ]]; then
  build_ext "the prefix, cpp/ or torch changed since the earlier build"
else
  echo "=== build: reusing $lib (stamp $(cut -c1-12 "$stampfile"))"
  build_note="reused $lib"
fi
if [[ "$stage" != wheel ]]; then
  export TENSORWIRE_TORCH_LIB=$lib
  if ! "$wpy" -c "import tensorwire as tw; print('tensorwire', tw.build_info()['backend'], 'cuda_built', tw.cuda_built(), 'cuda_available', tw.cuda_available(), 'devices', tw.cuda_device_count()); assert tw.cuda_available()"; then
    record build FAIL "the extension loads but tensorwire.cuda_available() is False ($build_note)"
    finish
  fi
  record build PASS "$build_note"
fi

if [[ "$stage" == rust || "$stage" == all ]]; then
  echo "=== Rust CUDA suite against the real driver ($prefix/rust-tests)"
  if compgen -G "$prefix/rust-tests/*" >/dev/null; then
    rust_failed=0
    : >"$logs/rust-tests.log"
    for t in "$prefix"/rust-tests/*; do
      # simcuda_driver prints what this driver answers where simcuda answers its own strict
      # choice (CALIBRATION lines): shown, not captured.
      extra=()
      [[ "$(basename "$t")" == simcuda_driver ]] && extra=(--nocapture)
      "$t" --test-threads=1 ${extra[@]+"${extra[@]}"} 2>&1 | tee -a "$logs/rust-tests.log" || rust_failed=1
    done
    # The ordering suites under the two other wait policies (the default, stream, ran above).
    for wait in host event; do
      for t in cuda_sim cuda_sim_ring cuda_sim_forward rpc-cuda_sim; do
        [[ -x "$prefix/rust-tests/$t" ]] || continue
        echo "--- $t with TENSORWIRE_CUDA_WAIT=$wait" | tee -a "$logs/rust-tests.log"
        TENSORWIRE_CUDA_WAIT=$wait "$prefix/rust-tests/$t" --test-threads=1 2>&1 | tee -a "$logs/rust-tests.log" || rust_failed=1
      done
    done
    # The C ABI's CUDA calls (exit 77: skipped, no driver).
    for t in "$prefix"/c-tests/*; do
      [[ -x "$t" ]] || continue
      echo "--- $(basename "$t")" | tee -a "$logs/rust-tests.log"
      "$t" 2>&1 | tee -a "$logs/rust-tests.log"
      rc=${PIPESTATUS[0]}
      if ((rc != 0)); then echo "$(basename "$t") exited $rc" | tee -a "$logs/rust-tests.log"; rust_failed=1; fi
    done
    grep -o 'CALIBRATION .*' "$logs/rust-tests.log" >"$logs/simcuda-calibration.log" || true
    # simcuda-only tests skip themselves on a real driver by design: not worth a note.
    if grep "SKIPPED" "$logs/rust-tests.log" | grep -qv "simcuda-only"; then rust_note="some tests SKIPPED: see log"; else rust_note=""; fi
    rust_note="${rust_note:+$rust_note; }$(wc -l <"$logs/simcuda-calibration.log") simcuda calibration lines: $logs/simcuda-calibration.log"
    if ((rust_failed == 0)); then record "rust cuda suite" PASS "$rust_note"; else record "rust cuda suite" FAIL "log: $logs/rust-tests.log"; fi
  else
    record "rust cuda suite" FAIL "no test binaries in $prefix/rust-tests: run 'bash scripts/gpu_test.sh prepare' where cargo is"
  fi
fi

if [[ "$stage" == tests || "$stage" == all ]]; then
  echo "=== pytest python/tests"
  if "$wpy" -c "import pytest" 2>/dev/null; then
    if (cd "$(mktemp -d)" && "$wpy" -m pytest -q -p no:cacheprovider "${pytests[@]}") 2>&1 | tee "$logs/pytest.log"; then
      record pytest PASS
    else
      record pytest FAIL "log: $logs/pytest.log"
    fi
  else
    record pytest SKIPPED "pytest is not installed for $py"
  fi

  echo "=== tests/gpu/gpu_tests.py"
  "$wpy" tests/gpu/gpu_tests.py 2>&1 | tee "$logs/gpu-tests.log"
  rc=${PIPESTATUS[0]}
  # Tests that could not run on this machine say so on a line of their own: "SKIPPED <name>: why".
  skipped=$(grep -E '^SKIPPED' "$logs/gpu-tests.log" | paste -sd ';' -)
  if ((rc == 0)); then
    record "gpu tests" PASS "$skipped"
  else
    record "gpu tests" FAIL "exit $rc; log: $logs/gpu-tests.log${skipped:+; $skipped}"
  fi
fi

if [[ "$stage" == wheel || "$stage" == all ]]; then
  echo "=== the wheel's own binding (no TENSORWIRE_TORCH_LIB): python/tests and tests/gpu/gpu_tests.py"
  wlog=$logs/wheel.log
  : >"$wlog"
  elsewhere=$(mktemp -d)
  wheel_failed=0
  (cd "$elsewhere" && env -u TENSORWIRE_TORCH_LIB "$wpy" -c \
    "import tensorwire as tw, torch; print('wheel:', tw.__file__, 'torch', torch.__version__, tw.build_info()); print('cuda_available', tw.cuda_available(), 'devices', tw.cuda_device_count()); assert tw.cuda_available() and tw.build_info()['backend'] == 'native'") 2>&1 | tee -a "$wlog"
  ((PIPESTATUS[0] == 0)) || wheel_failed=1
  (cd "$elsewhere" && env -u TENSORWIRE_TORCH_LIB "$wpy" -m pytest -q -p no:cacheprovider "${pytests[@]}") 2>&1 | tee -a "$wlog"
  ((PIPESTATUS[0] == 0)) || wheel_failed=1
  (cd "$elsewhere" && env -u TENSORWIRE_TORCH_LIB "$wpy" "$root/tests/gpu/gpu_tests.py") 2>&1 | tee -a "$wlog"
  ((PIPESTATUS[0] == 0)) || wheel_failed=1
  rm -rf "$elsewhere"
  skipped=$(grep -E '^SKIPPED' "$wlog" | paste -sd ';' -)
  if ((wheel_failed == 0)); then record wheel PASS "$(basename "$whl")${skipped:+; $skipped}"; else record wheel FAIL "log: $wlog"; fi
fi

if [[ "$stage" == bench || "$stage" == all ]]; then
  echo "=== benches/torch_cuda_transfer.py --iters $iters"
  "$wpy" benches/torch_cuda_transfer.py --iters "$iters" 2>&1 | tee "$logs/bench.log"
  rc=${PIPESTATUS[0]}
  if ((rc == 0)); then record bench PASS "numbers above"; else record bench FAIL "exit $rc; log: $logs/bench.log"; fi
  # The targets are a measurement: NOT MET is reported, it does not fail the run.
  verdict=$(grep -E '^BENCH TARGETS: ' "$logs/bench.log" | tail -n 1)
  case "$verdict" in
    "BENCH TARGETS: PASS") record targets MET ;;
    "BENCH TARGETS: FAIL"*)
      missed=${verdict#"BENCH TARGETS: FAIL"}; missed=${missed# }; missed=${missed#"("}; missed=${missed%")"}
      record targets "NOT MET" "$missed" ;;
    "BENCH TARGETS: INVALID"*) record targets "NOT MEASURED" "the bench's measurement failed its checks" ;;
    *) record targets "NOT MEASURED" "no 'BENCH TARGETS:' line in the bench's output" ;;
  esac
  floors=$(grep -E '^floor: ' "$logs/bench.log" | awk -F'|' '{gsub(/ +/, " "); print $1 $2}' | paste -sd ';' -)
  [[ -n "$floors" ]] && record floors "p50 µs" "$floors"
fi

if [[ "$stage" == mps || "$stage" == all ]]; then
  # The bench again under MPS (where the machine has it): the event policy's GPU-side wait
  # costs ~28 µs there instead of ~300. The daemon gets private pipe and log directories
  # and is stopped again; MPS clients share faults, so it is never left running.
  mps_ctl=$(command -v nvidia-cuda-mps-control || ls /usr/local/nvidia/bin/nvidia-cuda-mps-control 2>/dev/null || true)
  if [[ -z "$mps_ctl" ]]; then
    record mps SKIPPED "no nvidia-cuda-mps-control on this machine"
  else
    mps_dir=$(mktemp -d)
    export CUDA_MPS_PIPE_DIRECTORY=$mps_dir/pipe CUDA_MPS_LOG_DIRECTORY=$mps_dir/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if "$mps_ctl" -d; then
      echo "=== benches/torch_cuda_transfer.py --iters $iters under MPS ($mps_dir)"
      "$wpy" benches/torch_cuda_transfer.py --iters "$iters" 2>&1 | tee "$logs/bench-mps.log"
      rc=${PIPESTATUS[0]}
      echo quit | "$mps_ctl"
      mps_state=$(grep -oE 'MPS: [a-z ]+' "$logs/bench-mps.log" | head -n 1)
      if ((rc == 0)); then record mps PASS "${mps_state:-MPS state not printed}; log: $logs/bench-mps.log"; else record mps FAIL "exit $rc; log: $logs/bench-mps.log"; fi
    else
      record mps FAIL "nvidia-cuda-mps-control -d failed (as root?)"
    fi
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    rm -rf "$mps_dir"
  fi
fi

finish
