#!/usr/bin/env bash
# One carried driver timed under several settings of the library's tuning
# variables, alternating, through scripts/gpu-check.sh's ab step:
#
#   bench/ab_settings.sh NAME MODE CELL SETTING...
#
# NAME: output folder $OUT/NAME (ab_runs.txt; its summary printed, each
# setting's least time per cell and its ratio to the first setting's);
# MODE: a driver mode (--cold, --cold-table, --cold-options); CELL: the
# ROPEKV_DRIVER_* variables that pick the cells, joined by + (e.g.
# ROPEKV_DRIVER_SHAPES=Llama-3.1-8B+ROPEKV_DRIVER_TOKENS=512,600); each
# SETTING: ENV=VALUE items joined by +, or - for the library's own rule.
# AB_DRIVER (default build/ab/cur/driver: scripts/driver-build.sh . /tmp/X 90,
# copied there; carry .gpudeps and build/ab/cur) and AB_RUNS (default 3).
set -u
name=$1 mode=$2 cell=$3
shift 3
cases=""
for s in "$@"; do
  if [ "$s" = - ]; then cases="$cases $cell:$mode"; else cases="$cases $s+$cell:$mode"; fi
done
O=${OUT:-/tmp/abo}
OUT=$O/$name AB_DRIVERS=${AB_DRIVER:-build/ab/cur/driver} AB_RUNS=${AB_RUNS:-3} \
  AB_CASES="$cases" scripts/gpu-check.sh ab > /dev/null 2>&1
echo "$name rc=$?"
python3 bench/ab_summary.py "$O/$name/ab_runs.txt"
