#!/usr/bin/env bash
# Builds tests/gpu/sanitize_driver.cu on this machine (nvcc, no GPU needed)
# against the library of another source tree, for A/B timing on a GPU
# machine (scripts/gpu-check.sh ab): the driver uses only the public API, so
# one driver source serves both libraries.
#
#   scripts/driver-build.sh SRC OUT [ARCH]
#
# SRC: a ropekv source tree (e.g. a `git worktree` of an older commit); OUT:
# a folder (build tree in OUT/build, the driver in OUT/driver); ARCH: CUDA
# architecture, default 90. The library is built with the AVX2 CPU baseline
# (scripts/cpu-baseline.sh); the driver links libhwy and OpenMP dynamically
# (gpu-check.sh unpacks .gpudeps/ for libhwy where the GPU machine lacks it).
# CUDA_FLAGS, if set, is the library's CMAKE_CUDA_FLAGS (a compile-time
# choice to time, e.g. CUDA_FLAGS=-DROPEKV_X=0).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SRC=$(cd "$1" && pwd)
OUT=$2
ARCH=${3:-90}
mkdir -p "$OUT"
cmake -S "$SRC" -B "$OUT/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DCMAKE_CUDA_FLAGS="${CUDA_FLAGS:-}" \
  -DCMAKE_CXX_FLAGS="$("$ROOT"/scripts/cpu-baseline.sh)" \
  -DROPEKV_BUILD_TESTS=OFF -DROPEKV_BUILD_TOOLS=OFF -DROPEKV_BUILD_BENCH=OFF \
  -DROPEKV_BUILD_PYTHON=OFF >/dev/null
cmake --build "$OUT/build" --target ropekv -j"$(nproc)"
nvcc -O2 -std=c++17 -arch=sm_"$ARCH" -I"$SRC/include" "$ROOT/tests/gpu/sanitize_driver.cu" \
  "$OUT/build/libropekv.a" -lhwy -Xcompiler -fopenmp -o "$OUT/driver"
echo "$OUT/driver ($(git -C "$SRC" log --oneline -1 2>/dev/null || echo "$SRC"))"
