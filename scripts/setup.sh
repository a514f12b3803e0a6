#!/usr/bin/env bash
# Installs everything ropekv needs on a fresh Debian 12 machine and builds it:
# Debian packages for the C++ side, a virtual environment (.venv) for Python.
# Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

apt_pkgs=(build-essential cmake ninja-build pkg-config python3-venv
          libhwy-dev libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev
          nlohmann-json3-dev libdlpack-dev
          clang libclang-rt-14-dev libomp-dev)  # the last three: scripts/sanitize.sh
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

PY=${PYTHON:-python3}
# PyPI's PyTorch wheel for Linux brings its CUDA libraries: the environment
# takes about 6.5 GB, and pip briefly holds the downloaded wheels (about
# 4 GB) besides. Its cache would keep a third copy that a fresh machine
# never reuses, so it is off; a short disk is named before pip starts.
export PIP_NO_CACHE_DIR=1
free_kb=$(df -Pk . | awk 'NR == 2 { print $4 }')
if [ ! -x .venv/bin/python ] && [ "${free_kb:-0}" -lt $((12 * 1024 * 1024)) ]; then
  echo "setup.sh: $((free_kb / 1024)) MiB free here; the Python environment needs about 12 GiB while it installs" >&2
fi
if [ ! -x .venv/bin/python ]; then
  $PY -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements-dev.txt

# The C++ library, tests, tools and benchmarks (build/), then the Python
# package (its own CMake tree under build/python-*), both incremental. The
# C++ build compiles the CUDA backend whenever nvcc is found and Highway's
# kernels for every x86 target (ctest runs each); the package is built for
# this machine: with the CUDA backend only where a GPU can run it
# (nvidia-smi lists one), and with AVX2 as the baseline where the CPU has it
# (scripts/cpu-baseline.sh: Highway then compiles its AVX2 and AVX-512
# kernels only), which saves most of its four minutes on two cores. scripts/gpu-check.sh builds
# the package with CUDA.
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$(nproc)"
py_opts=(-C cmake.define.ROPEKV_CUDA=OFF)
nvidia-smi -L >/dev/null 2>&1 && py_opts=(-C cmake.define.ROPEKV_CUDA=ON)
cpu=$(scripts/cpu-baseline.sh)
[ -n "$cpu" ] && py_opts+=(-C "cmake.define.CMAKE_CXX_FLAGS=$cpu")
.venv/bin/python -m pip install -q --no-build-isolation "${py_opts[@]}" .
