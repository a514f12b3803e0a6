#!/usr/bin/env bash
# Three A/Bs of the GPU check's `ab` step in one device call, with drivers
# built on a machine without a GPU (scripts/driver-build.sh; carry .gpudeps
# and build/ab), so nothing is built on the GPU machine:
#  1. the one-wave rule (this branch) against ROPEKV_CUDA_ONE_WAVE=0, in and
#     around its windows (the edge T values run the same build either way);
#  2. f16 fp8 pools: this branch's driver against the same tree built with
#     -DROPEKV_AB_F16_FP8_SIX (the #ifdef of branch ab/f16-fp8-40-registers);
#  3. Gemma-4's cos_sin_cache dip at T = 512 (1.26x the plain call): the table
#     kernel's steps and the small kernel's narrow lanes around it.
# Drivers: build/ab/ow/driver (scripts/driver-build.sh . /tmp/ab-ow 90) and
# build/ab/six/driver (CUDA_FLAGS=-DROPEKV_AB_F16_FP8_SIX scripts/driver-build.sh
# <tree with the #ifdef> /tmp/ab-six 90). Output: $OUT/{onewave,f16six,table}.
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/abo}
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
G=Gemma-4-full; L=Llama-3.1-8B; W=heads-of-512-32/8
TG=416,448,496,528,560; TL=512,544,600,656,672; TW=128,136,148,158,166
cases=""
for c in "$L:norm:$TL" "$G:norm,f32:$TG" "$G:f32:$TG" "$G:norm:$TG" "$W:norm:$TW" "$G:norm,fp8:$TG" "$L:norm,fp8:$TL"; do
  IFS=: read -r sh op tk <<< "$c"
  base="ROPEKV_DRIVER_SHAPES=$sh+ROPEKV_DRIVER_OPTIONS=$op+ROPEKV_DRIVER_TOKENS=$tk"
  cases="$cases ROPEKV_CUDA_ONE_WAVE=0+$base:--cold-options $base:--cold-options"
done
OUT=$O/onewave AB_DRIVERS=build/ab/ow/driver AB_RUNS=3 AB_CASES="$cases" scripts/gpu-check.sh ab > /dev/null 2>&1
echo "one-wave rc=$?"
f="ROPEKV_DRIVER_DTYPE=f16+ROPEKV_DRIVER_SHAPES=$L,$G+ROPEKV_DRIVER_TOKENS=256,512,1024,8192"
OUT=$O/f16six AB_DRIVERS="build/ab/ow/driver build/ab/six/driver" AB_RUNS=3 \
  AB_CASES="$f+ROPEKV_DRIVER_OPTIONS=fp8:--cold-options $f:--cold" scripts/gpu-check.sh ab > /dev/null 2>&1
echo "f16six rc=$?"
t="ROPEKV_DRIVER_SHAPES=$G+ROPEKV_DRIVER_TOKENS=384,448,480,512,544,576,640"
OUT=$O/table AB_DRIVERS=build/ab/ow/driver AB_RUNS=2 AB_CASES="$t:--cold $t:--cold-table \
  ROPEKV_CUDA_UNROLL=1+$t:--cold-table ROPEKV_CUDA_UNROLL=2+$t:--cold-table \
  ROPEKV_CUDA_SMALL_TOKENS=1024+$t:--cold-table" scripts/gpu-check.sh ab > /dev/null 2>&1
echo "table rc=$?"
python3 bench/ab_summary.py $O/onewave/ab_runs.txt
python3 bench/ab_summary.py $O/f16six/ab_runs.txt
python3 bench/ab_summary.py $O/table/ab_runs.txt
