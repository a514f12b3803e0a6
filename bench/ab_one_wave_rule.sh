#!/usr/bin/env bash
# Round two of bench/ab_one_wave.sh, one device call, drivers carried
# (build/ab/ow: the first rule, f16 fp8 at 42 registers; build/ab/new: the
# rule past 17/16 of a wave and the f16 fp8 build at 40, each from
# scripts/driver-build.sh . OUT 90):
#  1. new against ow where the rules differ (a tail of 2-3 % of a wave) and
#     where they agree, and f16 fp8 pools at T = 256..8192;
#  2. heads of 512 with a cos_sin_cache: the table kernel against the small
#     kernel (ROPEKV_CUDA_SMALL_TOKENS) at T = 256..4096, to place a limit,
#     and against the table kernel's U = 2 build held to four blocks an SM
#     (build/ab/tb: CUDA_FLAGS=-DROPEKV_AB_TABLE_U2_FOUR, a timing-only #ifdef
#     not kept: docs/performance.md, *Heads of 512 with a cos_sin_cache*);
#  3. then (TESTS=1) this tree built and its one-wave and options tests run.
# Output: $OUT/{rule,table}/ab_runs.txt, the summaries printed.
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/abo}
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
G=Gemma-4-full; L=Llama-3.1-8B; W=heads-of-512-32/8
cases=""
for c in "$G:norm,f32:442,448,496" "$G:f32:442,448,496" "$G:norm:448,496" "$L:norm:544,600" \
         "$W:norm:136,148"; do
  IFS=: read -r sh op tk <<< "$c"
  cases="$cases ROPEKV_DRIVER_SHAPES=$sh+ROPEKV_DRIVER_OPTIONS=$op+ROPEKV_DRIVER_TOKENS=$tk:--cold-options"
done
f="ROPEKV_DRIVER_DTYPE=f16+ROPEKV_DRIVER_SHAPES=$L,$G+ROPEKV_DRIVER_TOKENS=256,512,1024,8192"
cases="$cases $f+ROPEKV_DRIVER_OPTIONS=fp8:--cold-options"
OUT=$O/rule AB_DRIVERS="build/ab/ow/driver build/ab/new/driver" AB_RUNS=3 AB_CASES="$cases" \
  scripts/gpu-check.sh ab > /dev/null 2>&1
echo "rule rc=$?"
t="ROPEKV_DRIVER_SHAPES=$G,$W+ROPEKV_DRIVER_TOKENS=256,320,384,416,448,512,640,768,1024,1536,2048,4096"
OUT=$O/table AB_DRIVERS="build/ab/new/driver build/ab/tb/driver" AB_RUNS=2 AB_CASES="$t:--cold $t:--cold-table \
  ROPEKV_CUDA_SMALL_TOKENS=8192+$t:--cold-table" scripts/gpu-check.sh ab > /dev/null 2>&1
echo "table rc=$?"
python3 bench/ab_summary.py $O/rule/ab_runs.txt
python3 bench/ab_summary.py $O/table/ab_runs.txt
[ "${TESTS:-0}" = 1 ] || exit 0
K="one_wave or wide or test_small_kernel_options or test_options_float32_pools or test_options_fp8"
K="$K or test_options_qk_norm or test_options_inplace or test_options_qwen3_like"
K="$K or test_options_gemma4_like or test_options_combined_layouts or test_options_first_use"
K="$K or test_options_results_are"
OUT=$O/suite TEST_ARGS="-k \"$K\"" timeout "${TEST_TIMEOUT:-400}" scripts/gpu-check.sh build test
echo "suite rc=$?"
tail -n 25 $O/suite/log.txt
