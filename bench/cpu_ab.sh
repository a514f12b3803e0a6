#!/usr/bin/env bash
# A/B runs of the CPU benchmark, alternated: on a shared machine whose speed
# drifts by tens of percent, two settings timed in alternating processes are
# comparable where two separate runs are not.
#
# Usage: bench/cpu_ab.sh FILTER ROUNDS A B [BENCH]
#   FILTER  a --benchmark_filter regex of ropekv_cpu_bench
#   ROUNDS  alternations (A then B, ROUNDS times)
#   A, B    each either an environment assignment (ROPEKV_CPU_STREAM_POOLS=0)
#           or the path of another ropekv_cpu_bench binary (a build of
#           another commit); "-" is the default binary with no change
#   BENCH   the default binary (build/bench/ropekv_cpu_bench)
# Prints one line per benchmark and side: its us per call in each round.
set -euo pipefail
[ $# -ge 4 ] || { sed -n 2,14p "$0"; exit 2; }
filter=$1 rounds=$2 side_a=$3 side_b=$4
bench=${5:-build/bench/ropekv_cpu_bench}
run_side() {  # side label
  local side=$1 bin=$bench env=()
  if [[ $side == *=* ]]; then env=("$side"); elif [ "$side" != - ]; then bin=$side; fi
  # Console rows (name, time in us, ...): the CSV reporter aborts where rows
  # carry different counters (the cold plain rows' pattern_GB/s).
  env "${env[@]}" "$bin" --benchmark_filter="$filter" --benchmark_min_time=0.2 \
      --benchmark_color=false 2>/dev/null |
    awk -v s="$2" '$1 ~ /real_time/ {print s, $1, $2}'
}
for _ in $(seq "$rounds"); do
  run_side "$side_a" A
  run_side "$side_b" B
done | awk '{k = $2 " " $1; v[k] = v[k] " " sprintf("%.2f", $3)} END {for (k in v) print k, v[k]}' |
  sort
echo "# A = $side_a, B = $side_b, $rounds rounds; us per call"
