#!/usr/bin/env bash
# The C++ suite under sanitizers, and the fuzz target for a bounded time:
#   1. AddressSanitizer + UndefinedBehaviorSanitizer (LeakSanitizer included):
#      every ctest (GoogleTest, ropekv-replay runs, the example consumer).
#   2. libFuzzer over rope_pool_fused's arguments, from the same ASan + UBSan
#      build: first the saved regression inputs, then FUZZ_SECONDS (default 60).
#   3. ThreadSanitizer over the threaded CPU path (LLVM OpenMP with its Archer
#      tool so that OpenMP's own synchronisation is understood).
# Called by scripts/test.sh; needs what scripts/setup.sh installed (clang, its
# runtime libraries and LLVM OpenMP included).
#
# Sanitizer builds are clang at -O1 and, on a CPU with AVX2, with AVX2 as the
# baseline (scripts/cpu-baseline.sh) and Highway's static target alone
# (HWY_COMPILE_ONLY_STATIC): its AVX2 kernels where the CPU has AVX2, else
# those of the compiler's default baseline. The regular build compiles every
# target and its tests run each one the CPU has; here one target keeps the
# two builds and their tests within a few minutes each on two cores (the
# kernel files are most of the build, and the AVX-512 ones could not run on
# an AVX2-only CPU anyway).
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZ_SECONDS=${FUZZ_SECONDS:-60}
jobs=$(nproc)

flags="-gline-tables-only -DHWY_COMPILE_ONLY_STATIC=1 $(scripts/cpu-baseline.sh)"
common=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS=$flags"
        "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -DNDEBUG"
        -DROPEKV_CUDA=OFF -DROPEKV_BUILD_BENCH=OFF)
export CC=clang CXX=clang++

echo "== ASan + UBSan"
cmake -S . -B build-asan "${common[@]}" -DROPEKV_BUILD_FUZZ=ON \
  -DROPEKV_SANITIZE=address,undefined >/dev/null
cmake --build build-asan -j"$jobs"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# replay.default (the main job) is left to the regular ctest: it runs alone
# (RUN_SERIAL) and took over two minutes under ASan; the replay.trace.* and
# replay.numerics runs still take the tool through ASan.
ctest --test-dir build-asan --output-on-failure -j"$jobs" -LE long -E '^replay\.default$'

echo "== libFuzzer (${FUZZ_SECONDS} s)"
fuzz=build-asan/tests/fuzz/fuzz_rope_pool
corpus=$(mktemp -d)
cp tests/fuzz/regressions/* "$corpus"/ 2>/dev/null || true
"$fuzz" -runs=0 tests/fuzz/regressions
"$fuzz" -max_total_time="$FUZZ_SECONDS" -max_len=4096 -print_final_stats=1 "$corpus" 2>&1 | tail -n 12
rm -rf "$corpus"
unset ASAN_OPTIONS UBSAN_OPTIONS

echo "== TSan (threaded CPU path)"
archer=$(ls /usr/lib/llvm-*/lib/libarcher.so 2>/dev/null | head -1)
cmake -S . -B build-tsan "${common[@]}" -DROPEKV_BUILD_TOOLS=OFF -DROPEKV_SANITIZE=thread >/dev/null
cmake --build build-tsan -j"$jobs"
# libomp's own internals are not instrumented: tests/tsan.supp silences
# reports whose stack lies in libomp only; races in ropekv's code still fail.
OMP_TOOL_LIBRARIES="$archer" OMP_NUM_THREADS=4 \
  TSAN_OPTIONS="halt_on_error=1 suppressions=$PWD/tests/tsan.supp" \
  ctest --test-dir build-tsan --output-on-failure -j"$jobs"
echo "sanitizers and fuzzing: clean"
