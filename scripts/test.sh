#!/usr/bin/env bash
# Every test of tensorwire, from a fresh machine of this kind: installs what it needs
# (nothing beyond the Rust toolchain for the transport; cargo-fuzz into .tools/), then
# runs unit, integration and cross-process tests, clippy's unsafe lints, the loom
# models, and each fuzz target (its kept corpus and regressions replayed, then a few
# seconds of fuzzing). Exits non-zero on any failure.
#
# The run is a list of named stages, in order; each prints its start, and the run ends
# with each stage's time. Naming stages runs only those (in the list's order), after
# preparing what they need (the venv, the wheel, the C ABI's build) without its tests.
#
#   scripts/test.sh                 # every stage (CI runs exactly this)
#   scripts/test.sh python remote   # only these stages
#   scripts/test.sh --list          # the stages and what each runs
#   FUZZ_SECONDS=30 scripts/test.sh fuzz
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
log=$(mktemp)

STAGES=()
declare -A ABOUT SECS
stage() { STAGES+=("$1"); ABOUT[$1]=$2; }   # a stage's name and what it runs; its body is stage_<name>
step() { printf '\n==> [%4d s] %s: %s\n' "$SECONDS" "$1" "${ABOUT[$1]}"; }   # seconds since the start

# The Python suites run on two pytest-xdist workers, a test file per worker (a file's
# module fixtures, e.g. its worker processes, stay in one process): most of their time is
# child processes importing torch, one CPU each, so two at a time halve the step on a
# 2-CPU machine.
PYTEST_PAR=(-n "${PYTEST_WORKERS:-2}" --dist loadfile)
# No incremental artefacts: a one-shot build does not reuse them (saves ~350 MiB).
export CARGO_INCREMENTAL=0
# Debug builds carry line tables only (file:line in panics and backtraces, no variables for
# a debugger): the run's many debug builds compile and link markedly faster, in half the
# disk. Set it to `true` for full debug info.
export CARGO_PROFILE_DEV_DEBUG=${CARGO_PROFILE_DEV_DEBUG:-line-tables-only}

# The Python suites beyond the full one under torch 2.15.0: what the second torch and the
# libtorch extension must pass (the ops, both transports, errors, the package itself).
PY_SUITE_OTHER_TORCH="test_native.py test_package.py test_torch_check.py test_two_process.py test_ring.py test_errors.py test_opcheck.py test_stats.py test_interop.py"
PY_SUITE_TORCH_EXT="test_two_process.py test_ring.py test_errors.py test_opcheck.py test_stats.py test_ops_backend.py"

# What several stages need, prepared once whichever stage asks first.
need_py() {   # the pinned test venv (.venv)
  [ -n "${py:-}" ] || py=$(bash scripts/setup-venv.sh | tail -1)
}
need_wheel() {   # the package's one wheel (the wheel stage, with its checks)
  [ -n "${wheel:-}" ] || run_stage wheel
}
need_bwrap() {
  # The escape suite (python/tests/test_containment.py) runs the same probe inside
  # bubblewrap, the reference sandbox, and checks that ours lets nothing through that it
  # does not.
  if ! command -v bwrap >/dev/null; then
    echo "installing bubblewrap (apt)"; apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null
  fi
}
need_pip_venv() {   # a fresh pip venv under torch 2.15.0 with the wheel installed as a user installs it
  [ -z "${pip_py:-}" ] || return 0
  need_wheel
  # The venv is made anew each run (the torch pin lives in scripts/setup-venv.sh; uv links
  # from its cache, seconds).
  pip_venv=$root/build/pip-venv
  rm -rf "$pip_venv"
  pip_py=$(bash scripts/setup-venv.sh "$pip_venv" | tail -1)
  # PATH is the venv's bin only: no cc, c++, cargo or cmake reachable. --no-index: nothing is
  # fetched, so the torch already there must satisfy the wheel's range (pip keeps it).
  torch_before=$("$pip_py" -c 'import torch; print(torch.__version__)')
  local t0=$EPOCHREALTIME
  env -i HOME="$HOME" PATH="$pip_venv/bin" PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 \
    "$pip_py" -m pip install -q --no-index "$wheel"
  echo "pip install of the wheel: $(python3 -c "print(round($EPOCHREALTIME - $t0, 2))") s, no compiler on PATH"
  torch_after=$("$pip_py" -c 'import torch; print(torch.__version__)')
  [ "$torch_before" = "$torch_after" ] || { echo "installing the wheel changed torch: $torch_before -> $torch_after"; exit 1; }
}
need_c_abi() {   # the C ABI's CMake build (the c-abi stage, with its tests)
  [ -n "${SECS[c-abi]:-}" ] || run_stage c-abi
}

stage build "build (debug, all targets: libraries, binaries, tests, benches, examples)"
stage_build() {
  # The benches compile here, in the debug profile; no release build of them (minutes) runs.
  cargo build --all-targets --locked -p tensorwire -p tensorwire-ffi 2>&1 | tail -n 3
}

stage graph "module graph: imports go one way (no loop between the modules of any target of any crate of the workspace, scripts/module_graph.py; nor between the modules of python/tensorwire, scripts/python_imports.py)"
stage_graph() {
  python3 scripts/module_graph.py --self-test
  python3 scripts/module_graph.py --workspace
  python3 scripts/python_imports.py --self-test
  python3 scripts/python_imports.py python/tensorwire
}

stage types "type check: mypy over python/tensorwire against the binding's stub (python/tensorwire/_native.pyi; pyproject.toml [tool.mypy])"
stage_types() {
  need_py
  "$py" -m mypy
}

stage clippy "clippy (undocumented unsafe blocks and other denied lints fail the run)"
stage_clippy() {
  cargo clippy --all-targets --locked -q -- -D clippy::undocumented_unsafe_blocks
}

stage docs "docs: cargo doc of the workspace without warnings (public docs link no private item)"
stage_docs() {
  RUSTDOCFLAGS=-Dwarnings cargo doc --no-deps --workspace --locked -q
}

stage publish "crates: cargo publish --dry-run of tensorwire, tensorwire-ffi, tensorwire-remote and tensorwire-rpc (packaged, then built from the packages; ffi, remote and rpc against the packaged tensorwire, rpc also against the packaged tensorwire-remote, its optional dependency)"
stage_publish() {
  # --allow-dirty: what is checked is the packages and their metadata, not the checkout's state.
  # A fresh target dir each run: cargo treats the packaged crates as immutable registry
  # crates (same name and version, so unpacked and built once per registry path), and a
  # rerun in the same place would verify against an earlier run's tensorwire.
  publish_target=$(mktemp -d)
  cargo publish --dry-run --locked --allow-dirty --target-dir "$publish_target" -p tensorwire -p tensorwire-ffi -p tensorwire-remote -p tensorwire-rpc 2>&1 \
    | grep -E "Packaged|Verifying|error|warning: [^a]"
  rm -rf "$publish_target"
}

stage unit "unit, integration, cross-process and doc tests"
stage_unit() {
  cargo test --locked 2>&1 | tee -a "$log"
  # Again with output shown, so a machine without a GPU says loudly that GPU tests were
  # skipped (the GPU tests themselves run with scripts/gpu_test.sh on a GPU machine).
  { cargo test --locked -q --test cuda_unavailable -- --nocapture 2>&1 || true; } | grep -m1 -E "SKIPPED|driver is present" || true
}

stage loom "loom models (--cfg loom)"
stage_loom() {
  # The models are a crate of their own (loom/): this build then compiles tensorwire and
  # loom only, not the root package's dev-dependencies. No debug info: this build is only
  # run, never debugged from the log, and skipping it makes it markedly quicker.
  RUSTFLAGS="--cfg loom" CARGO_PROFILE_RELEASE_DEBUG=0 cargo test --release --locked -p tensorwire-loom --target-dir target-loom 2>&1 | tee -a "$log"
  if [ "${CI:-}" = true ]; then rm -rf target-loom; fi   # only this step uses it (~0.5 GiB); kept for local reruns
}

stage c-abi "C ABI (tensorwire-ffi): clippy, its Rust tests (header current, mirrored tables), CMake build, C tests under valgrind (ctest), install + find_package consumer"
stage_c_abi() {
  if ! command -v cmake >/dev/null; then
    echo "installing cmake (apt)"; apt-get update -qq && apt-get install -y -qq cmake >/dev/null
  fi
  if ! command -v valgrind >/dev/null; then
    echo "installing valgrind (apt)"; apt-get update -qq && apt-get install -y -qq valgrind >/dev/null
  fi
  cargo clippy -p tensorwire-ffi --all-targets --locked -q -- -D clippy::undocumented_unsafe_blocks
  cargo test -p tensorwire-ffi --locked 2>&1 | tee -a "$log"
  bash ffi/tests/cmake_package.sh "$root/build/cmake-package" 2>&1 | tee -a "$log"
}

stage rpc "tensorwire-rpc: clippy, unit, endpoint, hostile-peer and pyisolate 0.10.2 interop tests"
stage_rpc() {
  need_py
  cargo clippy -p tensorwire-rpc --all-targets --locked -q -- -D clippy::undocumented_unsafe_blocks
  TW_PYTHON="$py" cargo test -p tensorwire-rpc --locked 2>&1 | tee -a "$log"
}

stage wheel "Python wheel: one maturin build of the package (python/tensorwire + the PyO3 binding tensorwire._native, abi3): manylinux tag, no libtorch/libpython linked, metadata (torch range, licenses, CUDA classifier)"
stage_wheel() {
  need_py
  cargo clippy -p tensorwire-python --all-targets --locked -q -- -D clippy::undocumented_unsafe_blocks
  wheel_dir=$root/dist   # the README's `maturin build ... -o dist`
  rm -rf "$wheel_dir"
  # PYO3_PYTHON: the venvs' base interpreter (realpath), so every venv made from one Python
  # configures pyo3 identically and cargo does not rebuild pyo3 when venvs change.
  pyo3_python=$("$py" -c 'import os, sys; print(os.path.realpath(sys._base_executable))')
  # --zig --compatibility manylinux_2_28: linked against glibc 2.28's symbols (zig's libc
  # stubs), the floor of torch's own wheels, so it installs wherever torch does; a plain
  # build here would bind this host's glibc 2.36 symbols (manylinux_2_34 at best).
  PATH="$(dirname "$py"):$PATH" "$(dirname "$py")/maturin" build --release --locked --zig --compatibility manylinux_2_28 \
    -i "$pyo3_python" -o "$wheel_dir" 2>&1 | tail -n 1
  wheel=$(ls "$wheel_dir"/*.whl)
  "$py" scripts/check_wheel.py "$wheel"
}

stage python "Python package under torch 2.15.0 (pip venv): the wheel installed with no compiler on PATH and without touching torch, then pytest python/tests from another directory (the installed package, no env vars)"
stage_python() {
  need_pip_venv
  need_bwrap
  local elsewhere
  elsewhere=$(mktemp -d)
  (cd "$elsewhere" && env -u TENSORWIRE_TORCH_LIB -u PYTHONPATH "$pip_py" -m tensorwire doctor)
  (cd "$elsewhere" && env -u TENSORWIRE_TORCH_LIB -u PYTHONPATH PYTHONDONTWRITEBYTECODE=1 \
    "$pip_py" -m pytest -q -p no:cacheprovider --durations=12 "${PYTEST_PAR[@]}" "$root/python/tests" 2>&1) | tee -a "$log"
  rm -rf "$elsewhere"
}

stage torch-2.11 "the same wheel under torch 2.11.0 (uv venv, which has no pip): uv pip install, no compiler on PATH; the package's tests"
stage_torch_2_11() {
  need_pip_venv
  # torch 2.11.0 is what the GPU machines here carry. Its CUDA wheels are overridden to the
  # versions the 2.15.0 venv has (same SONAMEs, newer minors; one download: torch itself).
  uv_venv=$root/build/uv-venv
  rm -rf "$uv_venv"
  uv_bin=$root/.tools/uv/bin/uv
  export UV_CACHE_DIR="${UV_CACHE_DIR:-$root/.tools/uv-cache}"
  "$uv_bin" venv -q --python python3 "$uv_venv"
  test ! -e "$uv_venv/bin/pip"
  overrides=$(mktemp)
  "$uv_bin" pip freeze --python "$pip_py" | grep -v -E '^(torch|tensorwire)==' |
    sed 's/^cuda-toolkit==/cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]==/' >"$overrides"
  VIRTUAL_ENV=$uv_venv "$uv_bin" pip install -q torch==2.11.0 pytest pytest-xdist==3.8.0 numpy pyisolate==0.10.2 --override "$overrides"
  # The wheel with the same overrides: without them uv sees torch 2.11.0's own CUDA pins
  # unmet and "fixes" them by moving to the cached torch 2.15.0.
  local t0=$EPOCHREALTIME
  env -i HOME="$HOME" PATH="$uv_venv/bin" VIRTUAL_ENV="$uv_venv" UV_CACHE_DIR="$UV_CACHE_DIR" UV_OFFLINE=1 \
    "$uv_bin" pip install -q "$wheel" --override "$overrides"
  echo "uv pip install of the wheel: $(python3 -c "print(round($EPOCHREALTIME - $t0, 2))") s, no compiler on PATH"
  rm -f "$overrides"
  uv_torch=$("$uv_venv/bin/python" -c 'import torch; print(torch.__version__)')
  case "$uv_torch" in 2.11.0*) ;; *) echo "the uv venv has torch $uv_torch, not 2.11.0"; exit 1 ;; esac
  elsewhere=$(mktemp -d)
  (cd "$elsewhere" && env -u TENSORWIRE_TORCH_LIB -u PYTHONPATH "$uv_venv/bin/python" -c \
    "import tensorwire, torch; print('torch', torch.__version__, '| tensorwire', tensorwire.__version__, tensorwire.build_info())")
  (cd "$elsewhere" && env -u TENSORWIRE_TORCH_LIB -u PYTHONPATH PYTHONDONTWRITEBYTECODE=1 \
    "$uv_venv/bin/python" -m pytest -q -p no:cacheprovider "${PYTEST_PAR[@]}" $(printf "$root/python/tests/%s " $PY_SUITE_OTHER_TORCH) 2>&1) | tee -a "$log"
  rm -rf "$elsewhere"
}

stage torch-ext "the libtorch extension (cpp/, for C++ users; not in the wheel): cpp/build.sh against torch 2.15.0, then the op-level tests through it (TENSORWIRE_TORCH_LIB)"
stage_torch_ext() {
  need_pip_venv
  torch_ext=$(bash cpp/build.sh "$pip_py" | tail -1)
  elsewhere=$(mktemp -d)
  (cd "$elsewhere" && TENSORWIRE_TORCH_LIB="$torch_ext" PYTHONDONTWRITEBYTECODE=1 \
    "$pip_py" -m pytest -q -p no:cacheprovider "${PYTEST_PAR[@]}" $(printf "$root/python/tests/%s " $PY_SUITE_TORCH_EXT) 2>&1) | tee -a "$log"
  rm -rf "$elsewhere"
}

stage cuda-glue "torch CUDA glue: cpp/src/cuda.cpp compiles against torch's and the CUDA wheels' headers (syntax only; the GPU runs it: scripts/gpu_test.sh)"
stage_cuda_glue() {
  need_py
  sp=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "${CXX:-g++}" -std=c++20 -fsyntax-only -DTENSORWIRE_WITH_CUDA -I ffi/include -I "$sp/torch/include" \
    -I "$sp/torch/include/torch/csrc/api/include" -I "$sp/nvidia/cu13/include" cpp/src/cuda.cpp
  echo "cuda.cpp: compiles"
}

stage limits "hostile-peer tests again under a desktop's fd limit (ulimit -n 1024) and a 16 GiB address-space limit (ulimit -v)"
stage_limits() {
  # What a peer can make this process hold must fit the limits a user's process really has:
  # a terabyte-sized sparse file, thousands of segments or fds must end in named errors or
  # evictions here too, never in ENOMEM/EMFILE for the rest of the process.
  ( ulimit -n 1024 && ulimit -v $((16 << 20)) &&
    cargo test --locked -q --test hostile --test hostile_limits --test ring_hostile &&
    cargo test --locked -q -p tensorwire-rpc --test hostile ) 2>&1 | tee -a "$log"
}

stage simcuda "CUDA code on simcuda, the strict simulated driver (its unit tests, simcuda/run.sh's install under a running run, tests/cuda_sim*.rs + tests/simcuda_driver.rs, two seeds; the ordering suites under each wait policy; simcuda/README.md)"
stage_simcuda() {
  cargo clippy -p simcuda --all-targets --locked -q -- -D clippy::undocumented_unsafe_blocks
  cargo test --locked -q -p simcuda 2>&1 | tee -a "$log"
  bash simcuda/install_test.sh 2>&1 | tee -a "$log"
  # The ordering suites run under each cross-process wait policy (PeerConfig::cuda_wait,
  # here chosen for every connection by TENSORWIRE_CUDA_WAIT): stream (signal words), host,
  # event; the second seed varies the delays of the default policy only (the run's time
  # budget).
  waits_for_seed() { if [ "$1" = 1 ]; then echo "stream host event"; else echo stream; fi; }
  for seed in 1 2; do
    SIMCUDA_SEED=$seed bash simcuda/run.sh cargo test --locked --test cuda_sim_hostile --test cuda_sim_order --test simcuda_driver 2>&1 | tee -a "$log"
    SIMCUDA_SEED=$seed bash simcuda/run.sh cargo test --locked -p tensorwire-ffi --test cuda_sim_ffi 2>&1 | tee -a "$log"
    for wait in $(waits_for_seed $seed); do
      echo "-- seed $seed, cuda_wait=$wait"
      TENSORWIRE_CUDA_WAIT=$wait SIMCUDA_SEED=$seed bash simcuda/run.sh cargo test --locked --test cuda_sim --test cuda_sim_ring --test cuda_sim_forward 2>&1 | tee -a "$log"
    done
  done
  # Where the words cannot be used (no host registration here), producers fall back to IPC
  # events and consumers wait for them on the host.
  echo "-- no host registration: the event fallback"
  SIMCUDA_NO_HOST_REGISTER=1 bash simcuda/run.sh cargo test --locked --test cuda_sim --test cuda_sim_ring --test cuda_sim_forward 2>&1 | tee -a "$log"
  for seed in 1 2; do
    # Forged CUDA tensors against a native-mode RPC server.
    SIMCUDA_SEED=$seed bash simcuda/run.sh cargo test --locked -p tensorwire-rpc --test cuda_sim_hostile 2>&1 | tee -a "$log"
    for wait in $(waits_for_seed $seed); do
      echo "-- tensorwire-rpc: seed $seed, cuda_wait=$wait"
      # CUDA tensors as RPC arguments and results between two processes.
      TENSORWIRE_CUDA_WAIT=$wait SIMCUDA_SEED=$seed bash simcuda/run.sh cargo test --locked -p tensorwire-rpc --test cuda_sim 2>&1 | tee -a "$log"
    done
  done
  # The Python binding's CUDA half (python/native/src/cuda.rs: export, the DLPack capsule and
  # its deleter, forwards, the GPU ring through the binding's functions) under each policy.
  for wait in stream host event; do
    TENSORWIRE_CUDA_WAIT=$wait bash simcuda/run.sh cargo test --locked -p tensorwire-python cuda 2>&1 | tee -a "$log"
  done
}

stage c-cuda "C ABI's CUDA calls on simcuda: ffi/tests/c/cuda.c (a forked child imports device memory made with the driver API), ffi/tests/c/cuda_forward.c (host -> relay -> last, the CUDA import forwarded), plain and under valgrind (ctest)"
stage_c_cuda() {
  need_c_abi
  # The build from the C ABI step above; 20 ms stream delays make a missing stream wait
  # read stale bytes every time.
  (cd "$root/build/cmake-package/build" &&
    SIMCUDA_MAX_DELAY_US=20000 bash "$root/simcuda/run.sh" ctest -R '^c_cuda' --output-on-failure) 2>&1 | tee -a "$log"
}

stage remote "remote peers with UCX (feature ucx; UCX 1.22 built once from ucx-rs's bundled source): tensorwire-remote's clippy, docs, two-process two-sided transfer/release/SIGKILL tests, hostile requests (forged, replayed and other connections' ids, one-sided gets at the exporter, a stalled exporter), and exporter and importer in two network namespaces over a shaped veth pair (tests/two_hosts.rs, as root; skipped with the reason elsewhere); tensorwire-rpc's remote tensors over loopback TCP between processes (UCX_TLS=tcp): bytes, releases, inline fallback, hostile values and importers, byte budgets, a stalled exporter, SIGKILL mid-transfer; the same through the Python package (tensorwire.rpc.connect/Listener, _native built with the feature)"
stage_remote() {
  need_py
  cargo clippy -p tensorwire-remote -p tensorwire-rpc --features ucx --all-targets --locked -q -- -D clippy::undocumented_unsafe_blocks
  RUSTDOCFLAGS=-Dwarnings cargo doc --no-deps -p tensorwire-remote -p tensorwire-rpc --features ucx --locked -q
  cargo test -p tensorwire-remote --features ucx --locked 2>&1 | tee -a "$log"
  # The rest of tensorwire-rpc's tests run (without the feature) in their own step above;
  # here its unit tests (the remote value's checks) and the remote-tensor binary.
  UCX_TLS=tcp cargo test -p tensorwire-rpc --features ucx --locked --lib --test remote_ucx --test remote_pool 2>&1 | tee -a "$log"
  # The package's remote tensors (python/tests/test_rpc_remote.py): the binding with the
  # feature, in the debug profile so the UCX build above is reused, run from a temporary copy
  # of the package put first on PYTHONPATH. The checkout's own _native.abi3.so is never
  # written (a process may have it mapped); the copy is moved into place under a new name.
  cargo build -p tensorwire-python --features ucx,extension-module --locked -q
  py_ucx=$(mktemp -d)
  cp -r python/tensorwire "$py_ucx/"
  rm -f "$py_ucx/tensorwire/_native.abi3.so"
  cp "${CARGO_TARGET_DIR:-$root/target}/debug/lib_native.so" "$py_ucx/tensorwire/_native.tmp"
  mv "$py_ucx/tensorwire/_native.tmp" "$py_ucx/tensorwire/_native.abi3.so"
  # The file skips without the feature: here that would be a build gone wrong, so say so.
  PYTHONPATH="$py_ucx" "$py" -c "import tensorwire, sys; sys.exit(0 if tensorwire.build_info().get('ucx_built') else 'the binding built with feature ucx says ucx_built is false')"
  (env -u TENSORWIRE_TORCH_LIB UCX_TLS=tcp PYTHONPATH="$py_ucx" PYTHONDONTWRITEBYTECODE=1 \
    "$py" -m pytest -q -p no:cacheprovider python/tests/test_rpc_remote.py 2>&1) | tee -a "$log"
  rm -rf "$py_ucx"
}

stage fuzz "fuzz targets: replay each one's kept corpus and regressions, then fuzz ${FUZZ_SECONDS:-2} s each"
stage_fuzz() {
  # Two seconds each: the replay is the regression check; the fuzzing here is a smoke run
  # (tens of thousands of inputs per target), and longer campaigns use FUZZ_SECONDS.
  FUZZ_SECONDS=${FUZZ_SECONDS:-2} bash fuzz/run.sh
}

stage demo "demo (main job) runs clean"
stage_demo() {
  cargo run --release --locked -q -- demo --max-size 1048576 | tail -n 1
}

run_stage() {   # a stage's time excludes the stages it ran first for what it needs
  # Prefixed names: bash scopes dynamically, and a stage's own assignments must not
  # reach these.
  local _rs_name=$1 _rs_start=$SECONDS _rs_outer=$current _rs_inner_before=$inner
  current=$_rs_name stage_start[$_rs_name]=$SECONDS inner=0
  step "$_rs_name"
  "stage_${_rs_name//[-.]/_}"
  SECS[$_rs_name]=$((SECONDS - _rs_start - inner))
  ran+=("$_rs_name")
  current=$_rs_outer inner=$((_rs_inner_before + SECONDS - _rs_start))
}

report() {   # each stage's time, and where the run stopped if it did not finish
  local status=$? name
  printf '\nstage times:\n'
  for name in "${ran[@]}"; do printf '  %-11s %5d s\n' "$name" "${SECS[$name]}"; done
  [ -z "${current:-}" ] || printf '  %-11s %5d s  (stopped here: exit %d)\n' "$current" "$((SECONDS - stage_start[$current]))" "$status"
  printf '  %-11s %5d s\n' total "$SECONDS"
  rm -f "$log"
  exit "$status"
}

if [ "${1:-}" = --list ]; then
  for name in "${STAGES[@]}"; do printf '%-11s %s\n' "$name" "${ABOUT[$name]}"; done
  exit 0
fi
wanted=("$@")
for name in "${wanted[@]}"; do
  [ -n "${ABOUT[$name]:-}" ] || { echo "no stage '$name'; the stages: ${STAGES[*]}" >&2; exit 2; }
done

# Disk: the whole run needs about 10 GiB here (PyTorch's CUDA wheels are ~5.5 GiB of it).
# Say so up front: a full disk otherwise shows up as a confusing failure half-way through.
free_kib=$(df -Pk . | awk 'NR == 2 { print $4 }')
echo "disk: $((free_kib / 1048576)) GiB free under $root"
if [ "${free_kib:-0}" -lt $((10 * 1048576)) ]; then
  echo "WARNING: less than 10 GiB free; the PyTorch install (about 5.5 GiB) may fail with 'No space left on device'" >&2
fi

ran=()
current=
inner=0
declare -A stage_start
trap report EXIT
for name in "${STAGES[@]}"; do
  if [ ${#wanted[@]} -eq 0 ] || [[ " ${wanted[*]} " == *" $name "* ]]; then
    [ -n "${SECS[$name]:-}" ] || run_stage "$name"
  fi
done
# Every stage asked for must have finished: a shell error that ends the loop early
# (bash carries on after some expansion errors) must not pass for a run.
for name in "${STAGES[@]}"; do
  if [ ${#wanted[@]} -eq 0 ] || [[ " ${wanted[*]} " == *" $name "* ]]; then
    [ -n "${SECS[$name]:-}" ] || { echo "stage $name did not finish" >&2; exit 1; }
  fi
done

# One closing line over every cargo test binary, ctest run and pytest run.
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i) ~ /^passed/) p += $(i-1); if ($(i) ~ /^failed/) f += $(i-1); if ($(i) ~ /^ignored/) s += $(i-1) } }
     /tests passed, [0-9]+ tests failed out of/ { for (i = 1; i <= NF; i++) if ($(i) == "out") { t = $(i+2); fl = $(i-3) } ; p += t - fl; f += fl }
     /^[ \t]*[0-9]+ - [^ ]+ \(Skipped\)$/ { p -= 1; s += 1 }   # ctest counts a skipped test among those passed
     !/^test result:/ && /[0-9]+ (passed|failed|errors?)/ && / in [0-9.]+s( \([0-9:]+\))?( =+)?$/ { for (i = 2; i <= NF; i++) { if ($(i) ~ /^passed/) p += $(i-1); if ($(i) ~ /^(failed|errors?)/) f += $(i-1); if ($(i) ~ /^skipped/) s += $(i-1) } }
     END { printf "\ntensorwire: %d passed, %d failed, %d skipped\n", p, f, s; exit (f > 0) }' "$log"
