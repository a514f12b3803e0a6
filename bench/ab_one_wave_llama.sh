#!/usr/bin/env bash
# Llama-3.1-8B's QK-norm (alone and with fp8 pools) in and around its one-wave
# window (T = 562-594 at 132 SMs: blocks of 5 warps, 8 an SM of the 48-register
# build, 9 of the 40-register one), the library's rule against
# ROPEKV_CUDA_ONE_WAVE=0, one carried driver (scripts/driver-build.sh . /tmp/X
# 90, copied to build/ab/ow64/driver; carry .gpudeps and build/ab). Then
# (TESTS=1) this tree built and test_small_kernel_one_wave_rule run.
# Output: $OUT/llama/ab_runs.txt, the summary printed.
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/abo}
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
cases=""
for op in norm norm,fp8; do
  base="ROPEKV_DRIVER_SHAPES=Llama-3.1-8B+ROPEKV_DRIVER_OPTIONS=$op+ROPEKV_DRIVER_TOKENS=544,568,580,594,600"
  cases="$cases ROPEKV_CUDA_ONE_WAVE=0+$base:--cold-options $base:--cold-options"
done
OUT=$O/llama AB_DRIVERS=build/ab/ow64/driver AB_RUNS=3 AB_CASES="$cases" \
  scripts/gpu-check.sh ab > /dev/null 2>&1
echo "llama rc=$?"
python3 bench/ab_summary.py $O/llama/ab_runs.txt
[ "${TESTS:-0}" = 1 ] || exit 0
OUT=$O/suite TEST_ARGS='-k one_wave_rule' timeout "${TEST_TIMEOUT:-300}" \
  scripts/gpu-check.sh build test > /dev/null 2>&1
echo "suite rc=$?"
tail -n 6 $O/suite/log.txt
