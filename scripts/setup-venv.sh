#!/usr/bin/env bash
# Create (or reuse) the project's Python venv at .venv with the pinned test stack:
# PyTorch from PyPI (CPU use; the wheel is a CUDA build and runs without a GPU), pytest
# with pytest-xdist (scripts/test.sh runs the Python suites on two workers),
# pyisolate for the RPC interop tests, and the CUDA headers the torch wheel's own CUDA
# wheels lack (nvidia-cuda-crt) so cpp/src/cuda.cpp can be compile-checked without a GPU, and mypy (the
# package's type check, configured in pyproject.toml). Uses uv (installed into .tools/ on first run).
# Also pip, and maturin with ziglang, which build the package's one wheel (pyproject.toml:
# python/tensorwire with the PyO3 binding tensorwire._native, abi3, linked by zig against
# glibc 2.28, the floor torch's own wheels have: manylinux_2_28).
# Usage: scripts/setup-venv.sh [VENV_DIR]   (default .venv; a fresh dir gets a fresh venv)
# Prints the venv's python path on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
TORCH_VERSION=2.15.0
PYISOLATE_VERSION=0.10.2
CUDA_CRT_VERSION=13.2.86
ZIGLANG_VERSION=0.17.1
MATURIN_VERSION=1.16.0
XDIST_VERSION=3.8.0
MYPY_VERSION=2.4.1
venv=${1:-.venv}
stamp="$venv/.tensorwire-stack-torch${TORCH_VERSION}-pyisolate${PYISOLATE_VERSION}-crt${CUDA_CRT_VERSION}-zig${ZIGLANG_VERSION}-maturin${MATURIN_VERSION}-xdist${XDIST_VERSION}-mypy${MYPY_VERSION}"
if [ ! -f "$stamp" ]; then
  if [ ! -x .tools/uv/bin/uv ]; then
    python3 -m pip install -q --target .tools/uv uv >&2
  fi
  uv() { PYTHONPATH="$root/.tools/uv" python3 -m uv "$@"; }
  export UV_CACHE_DIR="${UV_CACHE_DIR:-$root/.tools/uv-cache}"
  [ -x "$venv/bin/python" ] || uv venv -q --python python3 "$venv" >&2
  uv pip install -q --python "$venv/bin/python" "torch==${TORCH_VERSION}" "pyisolate==${PYISOLATE_VERSION}" \
    "nvidia-cuda-crt==${CUDA_CRT_VERSION}" pytest "pytest-xdist==${XDIST_VERSION}" numpy matplotlib \
    pip "maturin==${MATURIN_VERSION}" "ziglang==${ZIGLANG_VERSION}" "mypy==${MYPY_VERSION}" >&2
  touch "$stamp"
fi
echo "$(cd "$venv" && pwd)/bin/python"
