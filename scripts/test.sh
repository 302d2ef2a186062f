#!/usr/bin/env bash
# Every test of tensorwire, from a fresh machine of this kind: installs what it needs
# (nothing beyond the Rust toolchain for the transport; cargo-fuzz into .tools/), then
# runs unit, integration and cross-process tests, clippy's unsafe lints, the loom
# models, and each fuzz target (its kept corpus and regressions replayed, then a few
# seconds of fuzzing). Exits non-zero on any failure.
#
#   scripts/test.sh            # everything
#   FUZZ_SECONDS=30 scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
log=$(mktemp)
trap 'rm -f "$log"' EXIT

step() { printf '\n==> [%4d s] %s\n' "$SECONDS" "$*"; }   # seconds since the start: where the run's time goes

# Disk: the whole run needs about 10 GiB here (PyTorch's CUDA wheels are ~5.5 GiB of it).
# Say so up front: a full disk otherwise shows up as a confusing failure half-way through.
free_kib=$(df -Pk . | awk 'NR == 2 { print $4 }')
echo "disk: $((free_kib / 1048576)) GiB free under $root"
if [ "${free_kib:-0}" -lt $((10 * 1048576)) ]; then
  echo "WARNING: less than 10 GiB free; the PyTorch install (about 5.5 GiB) may fail with 'No space left on device'" >&2
fi
# No incremental artefacts: a one-shot build does not reuse them (saves ~350 MiB).
export CARGO_INCREMENTAL=0

step "build (debug, all targets: libraries, binaries, tests, benches, examples)"
# The benches compile here, in the debug profile; no release build of them (minutes) runs.
cargo build --all-targets --locked 2>&1 | tail -n 3

step "module graph: imports go one way (no loop between the modules of src/, rpc/src/, simcuda/src/; scripts/module_graph.py)"
python3 scripts/module_graph.py --self-test
python3 scripts/module_graph.py src rpc/src simcuda/src

step "clippy (undocumented unsafe blocks and other denied lints fail the run)"
cargo clippy --all-targets --locked -q -- -D clippy::undocumented_unsafe_blocks

step "docs: cargo doc of the workspace without warnings (public docs link no private item)"
RUSTDOCFLAGS=-Dwarnings cargo doc --no-deps --workspace --locked -q

step "crates: cargo publish --dry-run of tensorwire, tensorwire-remote and tensorwire-rpc (packaged, then built from the packages; rpc against the packaged tensorwire and tensorwire-remote, its optional dependency)"
# --allow-dirty: what is checked is the packages and their metadata, not the checkout's state.
# A fresh target dir each run: cargo treats the packaged crates as immutable registry
# crates (same name and version, so unpacked and built once per registry path), and a
# rerun in the same place would verify against an earlier run's tensorwire.
publish_target=$(mktemp -d)
cargo publish --dry-run --locked --allow-dirty --target-dir "$publish_target" -p tensorwire -p tensorwire-remote -p tensorwire-rpc 2>&1 \
  | grep -E "Packaged|Verifying|error|warning: [^a]"
rm -rf "$publish_target"

step "unit, integration, cross-process and doc tests"
cargo test --locked 2>&1 | tee -a "$log"
# Again with output shown, so a machine without a GPU says loudly that GPU tests were
# skipped (the GPU tests themselves run with scripts/gpu_test.sh on a GPU machine).
{ cargo test --locked -q --test cuda_unavailable -- --nocapture 2>&1 || true; } | grep -m1 -E "SKIPPED|driver is present" || true

step "loom models (--cfg loom)"
RUSTFLAGS="--cfg loom" cargo test --release --locked --test loom --test loom_ring --target-dir target-loom 2>&1 | tee -a "$log"
if [ "${CI:-}" = true ]; then rm -rf target-loom; fi   # only this step uses it (~0.5 GiB); kept for local reruns

step "C ABI: CMake build, C tests under valgrind (ctest), install + find_package consumer"
if ! command -v cmake >/dev/null; then
  echo "installing cmake (apt)"; apt-get update -qq && apt-get install -y -qq cmake >/dev/null
fi
if ! command -v valgrind >/dev/null; then
  echo "installing valgrind (apt)"; apt-get update -qq && apt-get install -y -qq valgrind >/dev/null
fi
bash tests/cmake_package.sh "$root/build/cmake-package" 2>&1 | tee -a "$log"

step "tensorwire-rpc: clippy, unit, endpoint, hostile-peer and pyisolate 0.10.2 interop tests"
py=$(bash scripts/setup-venv.sh | tail -1)
cargo clippy -p tensorwire-rpc --all-targets --locked -q -- -D clippy::undocumented_unsafe_blocks
TW_PYTHON="$py" cargo test -p tensorwire-rpc --locked 2>&1 | tee -a "$log"

step "Python binding tensorwire._native (python/native, PyO3 abi3): clippy, one maturin wheel (tag checked, no libtorch/libpython linked); its tests run in the next step's suite, on the module the package installs"
cargo clippy -p tensorwire-python --all-targets --locked -q -- -D clippy::undocumented_unsafe_blocks
native_wheels=$root/build/native-wheel
rm -rf "$native_wheels"
# Built as the package build builds it (root CMakeLists.txt, target tensorwire_native: same
# target dir, profile, features, strip flag and PYO3_PYTHON, the venvs' base interpreter),
# so the next step's pip install finds it built and only copies it into the package.
pyo3_python=$("$py" -c 'import os, sys; print(os.path.realpath(sys._base_executable))')
(cd python/native && "$(dirname "$py")/maturin" build --release --strip --locked --features extension-module \
   -i "$pyo3_python" -o "$native_wheels" 2>&1 | tail -n 1)
wheel=$(ls "$native_wheels"/*.whl)
case "$(basename "$wheel")" in
  *-cp310-abi3-manylinux_*_x86_64.whl) echo "wheel: $(basename "$wheel")" ;;
  *) echo "unexpected wheel tag: $wheel"; exit 1 ;;
esac
"$py" -m zipfile -e "$wheel" "$native_wheels/x"
wheel_native=$(ls "$native_wheels"/x/_native/_native*.so)
needed=$(readelf -d "$wheel_native" | grep NEEDED)
echo "$needed"
if echo "$needed" | grep -Eq 'torch|c10|libpython'; then echo "the binding links torch or libpython"; exit 1; fi
native_so=${CARGO_TARGET_DIR:-$root/target}/release/lib_native.so
native_built=$(stat -c '%i %Y' "$native_so")

step "Python package: fresh venv (torch via uv, warm cache), pip install --no-build-isolation . (libtorch extension and tensorwire._native), pytest tests/python from another directory (installed package, no env vars: import, two processes, interop, opcheck, the binding, demo, doctor)"
# The venv is made anew each run (the torch pin lives in scripts/setup-venv.sh; uv links
# from its cache, seconds); the package builds into build/py/<tag> and cargo's target/,
# both persistent, so a rerun rebuilds only what changed.
pip_venv=$root/build/pip-venv
rm -rf "$pip_venv"
pip_py=$(bash scripts/setup-venv.sh "$pip_venv" | tail -1)
env -u TENSORWIRE_TORCH_LIB -u PYTHONPATH PIP_ROOT_USER_ACTION=ignore "$pip_py" -m pip install -q --no-build-isolation "$root"
# The binding the package installed: nothing linked beyond the wheel's module, and whether
# the pip build reused the previous step's cargo build or had to build it again.
pip_native=$("$pip_py" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')/tensorwire/_native.abi3.so
if readelf -d "$pip_native" | grep NEEDED | grep -Eq 'torch|c10|libpython'; then echo "$pip_native links torch or libpython"; exit 1; fi
if [ "$(stat -c '%i %Y' "$native_so")" = "$native_built" ] && cmp -s "$pip_native" "$wheel_native"; then
  echo "tensorwire._native: the pip build reused the maturin step's (cargo: fresh; installed module = the wheel's, byte for byte)"
else
  echo "tensorwire._native: the pip build built it again (cargo saw a difference from the maturin step's build)"
fi
elsewhere=$(mktemp -d)
(cd "$elsewhere" && env -u TENSORWIRE_TORCH_LIB -u PYTHONPATH "$pip_py" -c "import tensorwire; print('import tensorwire:', tensorwire.library_path())")
(cd "$elsewhere" && env -u TENSORWIRE_TORCH_LIB -u PYTHONPATH "$pip_py" -m tensorwire doctor)
(cd "$elsewhere" && env -u TENSORWIRE_TORCH_LIB -u PYTHONPATH PYTHONDONTWRITEBYTECODE=1 \
  "$pip_py" -m pytest -q -p no:cacheprovider "$root/tests/python" 2>&1) | tee -a "$log"
rm -rf "$elsewhere"
# The README's other install route: a uv venv (it has no pip) and `uv pip install`, into
# the same build dir (rebuilds only what differs).
uv_venv=$root/build/uv-venv
rm -rf "$uv_venv"
uv_bin=$root/.tools/uv/bin/uv
UV_CACHE_DIR="${UV_CACHE_DIR:-$root/.tools/uv-cache}" "$uv_bin" venv -q --python python3 "$uv_venv"
test ! -e "$uv_venv/bin/pip"
torch_pin=$("$pip_py" -c 'import torch; print(torch.__version__.split("+")[0])')
skbuild_pin=$("$pip_py" -c 'import importlib.metadata as m; print(m.version("scikit-build-core"))')
( export VIRTUAL_ENV=$uv_venv UV_CACHE_DIR="${UV_CACHE_DIR:-$root/.tools/uv-cache}"
  "$uv_bin" pip install -q "torch==$torch_pin" "scikit-build-core==$skbuild_pin"
  env -u TENSORWIRE_TORCH_LIB -u PYTHONPATH "$uv_bin" pip install -q --no-build-isolation "$root" )
(cd /tmp && env -u TENSORWIRE_TORCH_LIB -u PYTHONPATH "$uv_venv/bin/python" -c \
  "import tensorwire; print('uv venv: import tensorwire', tensorwire.__version__, tensorwire.library_path())")

step "torch CUDA glue: cpp/src/cuda.cpp compiles against torch's and the CUDA wheels' headers (syntax only; the GPU runs it: scripts/gpu_test.sh)"
sp=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"${CXX:-g++}" -std=c++20 -fsyntax-only -DTENSORWIRE_WITH_CUDA -I include -I "$sp/torch/include" \
  -I "$sp/torch/include/torch/csrc/api/include" -I "$sp/nvidia/cu13/include" cpp/src/cuda.cpp
echo "cuda.cpp: compiles"

step "hostile-peer tests again under a desktop's fd limit (ulimit -n 1024) and a 16 GiB address-space limit (ulimit -v)"
# What a peer can make this process hold must fit the limits a user's process really has:
# a terabyte-sized sparse file, thousands of segments or fds must end in named errors or
# evictions here too, never in ENOMEM/EMFILE for the rest of the process.
( ulimit -n 1024 && ulimit -v $((16 << 20)) &&
  cargo test --locked -q --test hostile --test hostile_limits --test ring_hostile &&
  cargo test --locked -q -p tensorwire-rpc --test hostile ) 2>&1 | tee -a "$log"

step "CUDA code on simcuda, the strict simulated driver (its unit tests, simcuda/run.sh's install under a running run, tests/cuda_sim*.rs + tests/simcuda_driver.rs, two seeds; the ordering suites under each wait policy; simcuda/README.md)"
cargo clippy -p simcuda --all-targets --locked -q -- -D clippy::undocumented_unsafe_blocks
cargo test --locked -q -p simcuda 2>&1 | tee -a "$log"
bash simcuda/install_test.sh 2>&1 | tee -a "$log"
for seed in 1 2; do
  SIMCUDA_SEED=$seed bash simcuda/run.sh cargo test --locked --test cuda_sim_hostile --test cuda_sim_ffi --test cuda_sim_order --test simcuda_driver 2>&1 | tee -a "$log"
  # Forged CUDA tensors against a native-mode RPC server.
  SIMCUDA_SEED=$seed bash simcuda/run.sh cargo test --locked -p tensorwire-rpc --test cuda_sim_hostile 2>&1 | tee -a "$log"
  # The ordering suites under each cross-process wait policy (PeerConfig::cuda_wait, here
  # chosen for every connection by TENSORWIRE_CUDA_WAIT): stream (signal words), host, event.
  for wait in stream host event; do
    echo "-- seed $seed, cuda_wait=$wait"
    TENSORWIRE_CUDA_WAIT=$wait SIMCUDA_SEED=$seed bash simcuda/run.sh cargo test --locked --test cuda_sim --test cuda_sim_ring --test cuda_sim_forward 2>&1 | tee -a "$log"
    # tensorwire-rpc: CUDA tensors as RPC arguments and results between two processes.
    TENSORWIRE_CUDA_WAIT=$wait SIMCUDA_SEED=$seed bash simcuda/run.sh cargo test --locked -p tensorwire-rpc --test cuda_sim 2>&1 | tee -a "$log"
  done
done
# Where the words cannot be used (no host registration here), producers fall back to IPC
# events and consumers wait for them on the host.
echo "-- no host registration: the event fallback"
SIMCUDA_NO_HOST_REGISTER=1 bash simcuda/run.sh cargo test --locked --test cuda_sim --test cuda_sim_ring --test cuda_sim_forward 2>&1 | tee -a "$log"

step "C ABI's CUDA calls on simcuda: tests/c/cuda.c (a forked child imports device memory made with the driver API), tests/c/cuda_forward.c (host -> relay -> last, the CUDA import forwarded), plain and under valgrind (ctest)"
# The build from the C ABI step above; 20 ms stream delays make a missing stream wait
# read stale bytes every time.
(cd "$root/build/cmake-package/build" &&
  SIMCUDA_MAX_DELAY_US=20000 bash "$root/simcuda/run.sh" ctest -R '^c_cuda' --output-on-failure) 2>&1 | tee -a "$log"

step "remote peers with UCX (feature ucx; UCX 1.22 built once from ucx-rs's bundled source): tensorwire-remote's clippy, docs, two-process get/release/SIGKILL/hostile-blob tests over UCX_TLS=tcp and UCX_TLS=sm,self (each test sets its transports); tensorwire-rpc's remote tensors over loopback TCP between processes (UCX_TLS=tcp): bytes, releases, inline fallback, hostile values"
cargo clippy -p tensorwire-remote -p tensorwire-rpc --features ucx --all-targets --locked -q -- -D clippy::undocumented_unsafe_blocks
RUSTDOCFLAGS=-Dwarnings cargo doc --no-deps -p tensorwire-remote -p tensorwire-rpc --features ucx --locked -q
cargo test -p tensorwire-remote --features ucx --locked 2>&1 | tee -a "$log"
# The rest of tensorwire-rpc's tests run (without the feature) in their own step above;
# here its unit tests (the remote value's checks) and the remote-tensor binary.
UCX_TLS=tcp cargo test -p tensorwire-rpc --features ucx --locked --lib --test remote_ucx 2>&1 | tee -a "$log"

# --- further test steps go above this line (one block per area) ---

step "fuzz targets: replay each one's kept corpus and regressions, then fuzz ${FUZZ_SECONDS:-5} s each"
FUZZ_SECONDS=${FUZZ_SECONDS:-5} bash fuzz/run.sh

step "demo (main job) runs clean"
cargo run --release --locked -q -- demo --max-size 1048576 | tail -n 1

# One closing line over every cargo test binary, ctest run and pytest run.
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i) ~ /^passed/) p += $(i-1); if ($(i) ~ /^failed/) f += $(i-1); if ($(i) ~ /^ignored/) s += $(i-1) } }
     /tests passed, [0-9]+ tests failed out of/ { for (i = 1; i <= NF; i++) if ($(i) == "out") { t = $(i+2); fl = $(i-3) } ; p += t - fl; f += fl }
     /^[ \t]*[0-9]+ - [^ ]+ \(Skipped\)$/ { p -= 1; s += 1 }   # ctest counts a skipped test among those passed
     !/^test result:/ && /[0-9]+ (passed|failed|errors?)/ && / in [0-9.]+s( \([0-9:]+\))?( =+)?$/ { for (i = 2; i <= NF; i++) { if ($(i) ~ /^passed/) p += $(i-1); if ($(i) ~ /^(failed|errors?)/) f += $(i-1); if ($(i) ~ /^skipped/) s += $(i-1) } }
     END { printf "\ntensorwire: %d passed, %d failed, %d skipped\n", p, f, s; exit (f > 0) }' "$log"
