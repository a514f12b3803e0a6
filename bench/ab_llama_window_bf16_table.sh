#!/usr/bin/env bash
# One device call, one carried driver of this tree (run on an H100 on
# 2026-12-07 at 22:10 UTC: docs/performance.md, *16-bit tables on heads of
# 512, the table kernel's jump, and Llama's one-wave window*)
# (scripts/driver-build.sh . /tmp/X 90, copied to build/ab/cur/driver; carry
# .gpudeps and build/ab/cur):
#  1. Llama-3.1-8B's QK-norm, alone and with fp8 pools, in and around its
#     one-wave window (T = 562-594 at 132 SMs: blocks of 5 warps, 8 an SM of
#     the 48-register build, 9 of the 40-register one), the library's rule
#     against ROPEKV_CUDA_ONE_WAVE=0;
#  2. heads of 512 with a bf16 cos_sin_cache (table512 took float32 tables
#     only then): the library's route against the small kernel up to 640 tokens
#     (ROPEKV_CUDA_SMALL_TOKENS=640), and a float32 table as the control;
#  3. the table kernel (8 + 4 heads of 512, float32 table) around whole
#     multiples of the SMs' count of tokens, against the library's route;
#  4. then (TESTS=1) this tree built and the routing and one-wave rule tests run.
# Output: $OUT/{llama-norm,llama-norm-fp8,table-bf16,table-f32,table-jump},
# summaries printed.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
L="ROPEKV_DRIVER_SHAPES=Llama-3.1-8B+ROPEKV_DRIVER_TOKENS=544,568,580,594,600"
bench/ab_settings.sh llama-norm --cold-options "$L+ROPEKV_DRIVER_OPTIONS=norm" - ROPEKV_CUDA_ONE_WAVE=0
bench/ab_settings.sh llama-norm-fp8 --cold-options "$L+ROPEKV_DRIVER_OPTIONS=norm,fp8" - \
  ROPEKV_CUDA_ONE_WAVE=0
H="ROPEKV_DRIVER_SHAPES=Gemma-4-full,heads-of-512-32/8+ROPEKV_DRIVER_TOKENS=320,384,416,448,512,640,641"
bench/ab_settings.sh table-bf16 --cold-table "$H+ROPEKV_DRIVER_TABLE=bf16" - ROPEKV_CUDA_SMALL_TOKENS=640
AB_RUNS=2 bench/ab_settings.sh table-f32 --cold-table "$H" - ROPEKV_CUDA_SMALL_TOKENS=640
# The table kernel's jump between 385 and 416 tokens (8 + 4 heads: one block
# of 4 warps a token, 80 registers, 6 an SM): does its time follow the most
# blocks one SM holds, ceil(T / SMs), 3 up to 396 and 4 from 397 at 132 SMs?
# (ROPEKV_CUDA_SMALL_TOKENS=256: the table kernel past 256 tokens.)
G="ROPEKV_DRIVER_SHAPES=Gemma-4-full+ROPEKV_DRIVER_TOKENS=264,384,392,396,397,400,408,416,528,529"
AB_RUNS=2 bench/ab_settings.sh table-jump --cold-table "$G" ROPEKV_CUDA_SMALL_TOKENS=256 -
[ "${TESTS:-0}" = 1 ] || exit 0
O=${OUT:-/tmp/abo}
OUT=$O/suite TEST_ARGS='-k "routing or one_wave_rule"' timeout "${TEST_TIMEOUT:-300}" \
  scripts/gpu-check.sh build test > /dev/null 2>&1
echo "suite rc=$?"
tail -n 6 "$O/suite/log.txt"
