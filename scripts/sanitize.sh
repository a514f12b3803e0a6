#!/usr/bin/env bash
# The C++ suite under sanitizers, and the fuzz target for a bounded time:
#   1. AddressSanitizer + UndefinedBehaviorSanitizer (LeakSanitizer included):
#      every ctest (GoogleTest, ropekv-replay runs, the example consumer).
#   2. ThreadSanitizer over the threaded CPU path (clang, LLVM OpenMP with its
#      Archer tool so that OpenMP's own synchronisation is understood).
#   3. libFuzzer over rope_pool_fused's arguments (ASan + UBSan), first on the
#      saved regression inputs, then for FUZZ_SECONDS (default 60).
# Called by scripts/test.sh; needs what scripts/setup.sh installed (clang, its
# runtime libraries and LLVM OpenMP included).
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZ_SECONDS=${FUZZ_SECONDS:-60}
jobs=$(nproc)

common=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DROPEKV_CUDA=OFF -DROPEKV_BUILD_BENCH=OFF)

echo "== ASan + UBSan"
cmake -S . -B build-asan "${common[@]}" -DROPEKV_SANITIZE=address,undefined >/dev/null
cmake --build build-asan -j"$jobs"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j"$jobs" -LE long

echo "== TSan (threaded CPU path)"
archer=$(ls /usr/lib/llvm-*/lib/libarcher.so 2>/dev/null | head -1)
CC=clang CXX=clang++ cmake -S . -B build-tsan "${common[@]}" -DROPEKV_BUILD_TOOLS=OFF \
  -DROPEKV_SANITIZE=thread >/dev/null
cmake --build build-tsan -j"$jobs"
# libomp's own internals are not instrumented: tests/tsan.supp silences
# reports whose stack lies in libomp only; races in ropekv's code still fail.
OMP_TOOL_LIBRARIES="$archer" OMP_NUM_THREADS=4 \
  TSAN_OPTIONS="halt_on_error=1 suppressions=$PWD/tests/tsan.supp" \
  ctest --test-dir build-tsan --output-on-failure -j1

echo "== libFuzzer (${FUZZ_SECONDS} s)"
CC=clang CXX=clang++ cmake -S . -B build-fuzz "${common[@]}" -DROPEKV_BUILD_TESTS=OFF \
  -DROPEKV_BUILD_TOOLS=OFF -DROPEKV_BUILD_FUZZ=ON -DROPEKV_SANITIZE=address,undefined >/dev/null
cmake --build build-fuzz -j"$jobs"
corpus=$(mktemp -d)
cp tests/fuzz/regressions/* "$corpus"/ 2>/dev/null || true
build-fuzz/tests/fuzz/fuzz_rope_pool -runs=0 tests/fuzz/regressions
build-fuzz/tests/fuzz/fuzz_rope_pool -max_total_time="$FUZZ_SECONDS" -max_len=4096 \
  -print_final_stats=1 "$corpus" 2>&1 | tail -n 12
rm -rf "$corpus"
echo "sanitizers and fuzzing: clean"
