#!/usr/bin/env bash
# GPU tests of tensorwire's CUDA path through the libtorch extension (issue 6).
#
# The GPU machine has one GPU, a CUDA 13 toolkit (nvcc), CMake, ninja and PyTorch (cu130)
# as `python3`, but no cargo and no network. So the Rust library is built HERE and
# carried there as a CMake install prefix; the extension is built THERE against its own
# torch (the C++ ABI must match that torch) with the CUDA backend (cpp/src/cuda.cpp).
#
#   1. here (cargo):   bash scripts/gpu_test.sh prepare
#                      -> build/gpu-prefix (lib/libtensorwire.a, include/, lib/cmake/tensorwire)
#   2. there (device tool), from the repository root, carrying that folder:
#                      run(command="bash scripts/gpu_test.sh", carry=["build/gpu-prefix"])
#      (TENSORWIRE_PREFIX=<dir> names another prefix; GPU_TEST_ITERS sets the bench's
#      iterations, default 200.)
#
# What step 2 does, each part printed as PASS / FAIL / SKIPPED, exit status non-zero if any
# part failed (or no GPU is visible):
#   build      cpp/build.sh with TENSORWIRE_PREFIX (no cargo) against python3's torch; the
#              configure log must say "CUDA toolkit: ON"; tensorwire.cuda_available()
#   pytest     tests/python (CPU suite + the CUDA smoke tests) if pytest is installed
#   gpu tests  tests/gpu/gpu_tests.py: every dtype and non-contiguous views of CUDA tensors
#              round trip; zero-copy (the consumer's in-place write is seen by the
#              producer); ordering (GPU sleep + fill_ right before send, no synchronize:
#              the consumer reads the fill); lease reclaim after SIGKILL of the importer;
#              the IPC handle cache opening a handle once (and once per message at
#              keep_warm(0)); the GPU bounce ring (every dtype, views, a tensor of many
#              slots, ordering); VMM export (a producer with expandable segments)
#   bench      benches/torch_cuda_transfer.py: round trip per message at 4 KiB and 32 MiB,
#              GPU ring vs handle cache warm vs a handle opened per message vs
#              torch.multiprocessing, with the issue's target ratios
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

if [[ "${1:-}" == "prepare" ]]; then
  # Here: build the Rust static library (release, via the root CMake project and cargo)
  # and install the CMake package into build/gpu-prefix, small enough to carry.
  set -e
  out=${2:-$root/build/gpu-prefix}
  mkdir -p "$root/build"
  cmake -S "$root" -B "$root/build/tensorwire-cmake" -DCMAKE_BUILD_TYPE=Release -DTENSORWIRE_BUILD_TESTS=OFF \
        -DTENSORWIRE_CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}" >/dev/null
  cmake --build "$root/build/tensorwire-cmake" -j"$(nproc 2>/dev/null || echo 2)"
  rm -rf "$out"
  cmake --install "$root/build/tensorwire-cmake" --prefix "$out" >/dev/null
  rm -f "$out"/lib/libtensorwire.so                 # the extension links the static library
  strip --strip-debug "$out/lib/libtensorwire.a"    # debug info is most of its size
  du -sh "$out"
  echo "prepared $out; on the GPU machine: bash scripts/gpu_test.sh   (carry: ${out#"$root"/})"
  exit 0
fi

py=${PYTHON:-python3}
prefix=${TENSORWIRE_PREFIX:-$root/build/gpu-prefix}
iters=${GPU_TEST_ITERS:-200}
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
  echo "=== scripts/gpu_test.sh summary ==="
  printf '%s\n' "${results[@]}"
  if ((failed)); then echo "RESULT: FAIL"; exit 1; fi
  echo "RESULT: PASS"
  exit 0
}

echo "=== environment"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
command -v nvcc >/dev/null && nvcc --version | tail -n 2
if ! command -v make >/dev/null && command -v ninja >/dev/null; then
  export CMAKE_GENERATOR=Ninja
fi
if ! "$py" -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda); sys.exit(0 if torch.cuda.is_available() else 1)"; then
  record environment FAIL "$py has no usable CUDA device: this script runs only on a GPU machine"
  finish
fi

echo "=== build: cpp/build.sh with TENSORWIRE_PREFIX=$prefix (no cargo), torch of $py"
if [[ ! -f "$prefix/lib/libtensorwire.a" ]]; then
  record build FAIL "no $prefix/lib/libtensorwire.a: run 'bash scripts/gpu_test.sh prepare' where cargo is, and carry build/gpu-prefix"
  finish
fi
if ! lib=$(TENSORWIRE_PREFIX="$prefix" bash cpp/build.sh "$py" | tail -n 1) || [[ ! -f "$lib" ]]; then
  record build FAIL "cpp/build.sh failed (logs: build/torch-ext-configure.log)"
  finish
fi
if ! grep -q "CUDA toolkit: ON" build/torch-ext-configure.log; then
  grep "tensorwire_torch:" build/torch-ext-configure.log
  record build FAIL "the extension was configured without a CUDA toolkit (is nvcc on PATH?)"
  finish
fi
export TENSORWIRE_TORCH_LIB=$lib
export PYTHONPATH=$root/python${PYTHONPATH:+:$PYTHONPATH}
export PYTHONDONTWRITEBYTECODE=1
if ! "$py" -c "import tensorwire as tw; print('tensorwire cuda_built', tw.cuda_built(), 'cuda_available', tw.cuda_available(), 'devices', tw.cuda_device_count()); assert tw.cuda_available()"; then
  record build FAIL "the extension loads but tensorwire.cuda_available() is False"
  finish
fi
record build PASS "$lib"

echo "=== pytest tests/python"
if "$py" -c "import pytest" 2>/dev/null; then
  if "$py" -m pytest -q -p no:cacheprovider tests/python; then record pytest PASS; else record pytest FAIL; fi
else
  record pytest SKIPPED "pytest is not installed for $py"
fi

echo "=== tests/gpu/gpu_tests.py"
if "$py" tests/gpu/gpu_tests.py; then record "gpu tests" PASS; else record "gpu tests" FAIL; fi

echo "=== benches/torch_cuda_transfer.py --iters $iters"
if "$py" benches/torch_cuda_transfer.py --iters "$iters"; then record bench PASS "numbers above"; else record bench FAIL; fi

finish
