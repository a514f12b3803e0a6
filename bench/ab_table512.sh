#!/usr/bin/env bash
# Heads of 512 with a float32 cos_sin_cache (small_tokens' table512), one
# device call, drivers carried: build/ab/new (the table kernel from 257
# tokens) and build/ab/t5 (the small kernel where the table kernel would
# take four steps, up to 640), each from scripts/driver-build.sh . OUT 90.
# Then (TESTS=1) this tree built and its routing and table tests run.
# Output: $OUT/table512/ab_runs.txt, the summary printed.
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/abo}
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
t="ROPEKV_DRIVER_SHAPES=Gemma-4-full,heads-of-512-32/8+ROPEKV_DRIVER_TOKENS=128,256,320,384,385,416,448,512,640,641,768"
OUT=$O/table512 AB_DRIVERS="build/ab/new/driver build/ab/t5/driver" AB_RUNS=3 \
  AB_CASES="$t:--cold-table $t:--cold" scripts/gpu-check.sh ab > /dev/null 2>&1
echo "table512 rc=$?"
python3 bench/ab_summary.py $O/table512/ab_runs.txt
[ "${TESTS:-0}" = 1 ] || exit 0
OUT=$O/suite TEST_ARGS='-k "routing or table or cos_sin_cache or one_wave_rule or small_kernel_limits"' \
  timeout "${TEST_TIMEOUT:-400}" scripts/gpu-check.sh build test
echo "suite rc=$?"
tail -n 25 $O/suite/log.txt
