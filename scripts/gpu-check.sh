#!/usr/bin/env bash
# The GPU check, on a machine with an NVIDIA GPU, nvcc, PyTorch with CUDA,
# CuPy, nanobind and scikit-build-core (no network needed):
#
#   build     the Python package with the CUDA backend (pip, no build isolation),
#             and the sanitizer's driver; BUILD_DIR (default build/gpu-python)
#             names CMake's folder: /tmp/ab-build-B reuses abflags' build B
#   test      tests/gpu (pytest, CUDA; TEST_ARGS adds pytest arguments, quoted as
#             in a shell: TEST_ARGS='-k "small_kernel or options"')
#   sanitize  compute-sanitizer memcheck, racecheck, initcheck and synccheck on
#             small cases of every kernel variant (tests/gpu/sanitize_driver.cu),
#             then memcheck and racecheck with the one-wave builds forced
#   sansuite  compute-sanitizer memcheck over the GPU pytest suite, racecheck and
#             initcheck over its core tests (about 100 s on an H200)
#   ncu       Nsight Compute on Llama-3.1-8B bf16 calls of T = 1, 64 and 8192
#   latency   per-call time of small calls in CUDA graphs, next to an empty kernel
#   cold      per-call time of plain calls of four model shapes, T = 1..8192, cold L2,
#             at the library's and at each forced number of steps per team (a forced
#             one keeps small plain calls on the plain kernel; not a default step)
#   coldopt   the same at the library's steps with a float32 cos_sin_cache (four
#             shapes), then with QK-norm and fp8 pools (Llama) (not a default step)
#   poolfloor each pool format (bf16, float32, fp8_e4m3) and the QK-norm at T =
#             512..32768, Llama bf16, cold: the library's call next to a kernel of
#             the same loads and stores without its arithmetic and a copy of the
#             same bytes (not a default step)
#   freshpools bench/gpu_fresh_pools.py: a call into freshly allocated pools against
#             one into pools made once and kept (not a default step)
#   split     small calls split over several blocks per token (the library's rule)
#             against one block (ROPEKV_CUDA_SPLIT_GRID=0) and, with a cos_sin_cache,
#             against the table kernel (ROPEKV_CUDA_UNROLL=2): --cold, --cold-table,
#             --cold-options and --latency, two alternations (not a default step)
#   small     the small kernel (calls up to 512 tokens) against the kernels it replaced
#             (ROPEKV_CUDA_SMALL_TOKENS=0) and at 128 and 256 threads per block
#             (ROPEKV_CUDA_SMALL_THREADS): --cold, --cold-table and --cold-interleaved,
#             two alternations (not a default step; SMALL_MODES and SMALL_SETTINGS
#             pick other driver modes and settings, "rule" for the library's own)
#   probe     bench/cuda_decode_probe.cu: decode-sized calls of kernel variants that
#             each drop one part of the critical path (not a default step; PROBE_ARGS
#             picks a mode: onestep, headpar, normfloor)
#   normvar   bench/cuda_norm_variants.sh: the decode probe's normfloor rows for
#             timing-only variants of the kernel header that each drop one part of
#             the QK-norm (not a default step; $OUT/gpu_norm_variants.txt)
#   cputest   the CPU Python suite tests/python
#   cpuscale  the CPU benchmark's options family (Llama-3.1-8B bf16, cold, T = 8192)
#             on this machine's cores at CPUSCALE_THREADS (default 16 8 4 2 1), each
#             count a process of its own (CPUSCALE_LIMIT seconds, default 90): does
#             an option cost its bytes once enough cores fill the memory? Runs a
#             bench binary built elsewhere and carried in .cpubench/ with its shared
#             libraries (cmake --build build --target ropekv_cpu_bench; copy it,
#             libbenchmark and libhwy there; not a default step). CPUSCALE_BINS
#             (names in .cpubench/, default ropekv_cpu_bench) and CPUSCALE_ROUNDS
#             (default 1): builds of two commits timed in alternating processes
#   pyover    bench/py_overhead.py --cuda, twice: host time per call from Python
#             with CUDA tensors (fast path, its attribute reader, general path,
#             torch.ops; not a default step)
#   bench     bench/gpu_bench.py (ropekv vs PyTorch eager, torch.compile, copy)
#   options   bench/gpu_bench.py --options (each option's cost vs the plain call;
#             OPTIONS_ARGS adds its arguments, quoted as in a shell:
#             OPTIONS_ARGS='--option-models "Gemma-4 full" --option-tokens 1,512')
#   ncuopt    Nsight Compute on each option's kernel next to the plain one
#             (bench/gpu_options_calls.py; not a default step; NCUOPT_ARGS adds
#             its arguments, quoted as in a shell: '--model "Gemma-4 full"')
#   ncusrc    Nsight Compute's warp-stall samples per SASS instruction of the
#             calls of bench/gpu_options_calls.py (NCUSRC_ARGS, quoted as in a
#             shell), once per dtype in NCUSRC_DTYPES (default "bf16 f16"):
#             $OUT/ncusrc_<dtype>.csv and the lines with the most samples
#             (bench/ncu_source_stalls.py; not a default step)
#   ab        alternating runs of two carried drivers built elsewhere against two
#             versions of the library (scripts/driver-build.sh): AB_DRIVERS (paths,
#             default build/ab/base/driver build/ab/new/driver), AB_RUNS
#             alternations (2), AB_CASES (driver arguments, "ENV=VALUE+...:mode"
#             items; not a default step); then each cell's least time per
#             driver and setting of the library's variables, side by side
#             (bench/ab_summary.py). One driver with cases that differ only in
#             such a variable times a run-time choice of one build
#   abflags   two builds of this tree that differ only in CMAKE_CUDA_FLAGS
#             (AB_FLAGS_A, AB_FLAGS_B, e.g. -DROPEKV_X=0), each installed in a
#             folder of its own (/tmp/ab-A, /tmp/ab-B), then bench/gpu_bench.py
#             --options (OPTIONS_ARGS) from each in turn, AB_RUNS alternations
#             (2): for a compile-time choice (not a default step)
#   envs      bench/gpu_bench.py --options (OPTIONS_ARGS) from the build step's
#             install, once under each setting of ENV_SETS (';'-separated, each
#             a space-separated list of VAR=value, '-' for none:
#             ENV_SETS='-;ROPEKV_CUDA_NORM64_TOKENS=192'), in turn, ENV_RUNS
#             alternations (2): for a run-time switch (not a default step)
#   peers     .peers/tools/build.sh, then bench/gpu_peers.py: ropekv next to vLLM,
#             FlashInfer and SGLang kernels built from .peers/ (git-ignored, carried;
#             not a default step; about 8 minutes, PEERS_BUDGET seconds)
#
# Usage: scripts/gpu-check.sh [STEP ...]   (default: every step, in that order)
# Logs go to $OUT (default ./gpu-out): log.txt (everything), ncu.txt and the
# benchmark's gpu_bench.{md,csv,json} and cuda_bandwidth.png. A short table of
# the steps and the headline numbers is printed last.
#
# Highway and DLPack: used from the system if installed, else from the Debian
# packages in .gpudeps/ (libhwy1, libhwy-dev, libdlpack-dev; fetch them with
# `apt-get download` into that ignored folder and carry it to the machine).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
LOG=$OUT/log.txt
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(build test sanitize sansuite ncu latency cputest bench options)
BUILD_DIR=${BUILD_DIR:-$ROOT/build/gpu-python}
DRIVER=$ROOT/build/gpu-driver
declare -A RESULT
ORDER=()

log() { echo "$@" | tee -a "$LOG"; }

# ARGS as the words of $1, split as the shell splits them, quotes kept
# (TEST_ARGS='-k "small_kernel or options"').
split_args() { eval "ARGS=(${1:-})"; }

# Runs a step (each command in it has its own time limit), its output
# appended to log.txt.
step() {
  local name=$1
  shift
  log ""
  log "=== $name ($(date +%T))"
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  RESULT[$name]="$([ "$rc" -eq 0 ] && echo ok || echo "FAIL (rc $rc)") $((SECONDS - t0)) s"
  ORDER+=("$name")
  return "$rc"
}

# ---------------------------------------------------------------- environment
if [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
  export CUDACXX=${CUDACXX:-/usr/local/cuda/bin/nvcc}
fi
CMAKE_DEFS=()
if { [ ! -f /usr/include/hwy/highway.h ] || [ -n "${ROPEKV_USE_GPUDEPS:-}" ]; } && ls .gpudeps/*.deb >/dev/null 2>&1; then
  DEPS=/tmp/ropekv-deps
  for f in .gpudeps/*.deb; do dpkg -x "$f" "$DEPS"; done
  LIBDIR=$DEPS/usr/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH=$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  CMAKE_DEFS+=(-C "cmake.define.hwy_DIR=$LIBDIR/cmake/hwy"
               -C "cmake.define.DLPACK_INCLUDE_DIR=$DEPS/usr/include")
  HWY_LINK=(-L"$LIBDIR" -lhwy)
  INC_DEPS=(-I"$DEPS/usr/include")
else
  HWY_LINK=(-lhwy)
  INC_DEPS=()
fi
ARCH=$($PY -c "import torch; p = torch.cuda.get_device_capability(); print(f'{p[0]}{p[1]}')" \
       2>/dev/null || echo 90)

{
  echo "gpu-check $(date -u +%FT%TZ) steps: ${STEPS[*]}"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem \
    --format=csv 2>&1 || true
  nvcc --version 2>&1 | tail -1
  $PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__,
           'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" 2>&1
  git log --oneline -1 2>/dev/null
  # (A copied tree, as the device tool makes, keeps a stale .git: say so.)
  changed=$(git status --porcelain 2>/dev/null | wc -l)
  [ "$changed" -gt 0 ] && echo "(this tree differs from that commit in $changed files: the code run is the tree's)"
} | tee -a "$LOG"

# CPU_ARGS: pip's -C for the CPU backend's baseline flags (none where the
# script gives none).
cpu_args() {
  local flags
  flags=$(scripts/cpu-baseline.sh)
  CPU_ARGS=()
  [ -n "$flags" ] && CPU_ARGS=(-C "cmake.define.CMAKE_CXX_FLAGS=$flags")
  return 0
}

do_build() {
  # With AVX2 as the CPU baseline (scripts/cpu-baseline.sh) Highway compiles
  # only its AVX2 and AVX-512 kernels (the CPU backend's two Highway files are
  # most of this build).
  cpu_args
  timeout 420 $PY -m pip install --no-build-isolation --no-deps --force-reinstall -v . \
    -C build-dir="$BUILD_DIR" -C cmake.define.CMAKE_CUDA_ARCHITECTURES="$ARCH" \
    "${CMAKE_DEFS[@]}" "${CPU_ARGS[@]}" || return 1
  (cd /tmp && $PY -c "import ropekv; assert ropekv.has_cuda(), 'built without CUDA'; \
                      print('ropekv', ropekv.__version__, 'CUDA', ropekv.has_cuda())") || return 1
  local lib
  lib=$(ls "$BUILD_DIR"/libropekv.a) || return 1
  mkdir -p "$(dirname "$DRIVER")"
  timeout 120 nvcc -O2 -std=c++17 -arch=sm_"$ARCH" -Iinclude "${INC_DEPS[@]}" tests/gpu/sanitize_driver.cu \
    "$lib" "${HWY_LINK[@]}" -Xcompiler -fopenmp -o "$DRIVER"
}

do_test() {
  # TEST_ARGS is split as the shell splits words, quotes kept:
  # TEST_ARGS='-k "small_kernel or options"'. The 12 slowest tests are listed.
  # The whole suite took ~100 s on 2026-11-30 and 302 s on 2026-12-04 (the
  # small kernel's shape tests 14-18 s each, its wide QK-norm tests 9-10 s);
  # a run of the same day passed every test and was cut at 480 s in its
  # summary: run this step in a call of its own. One line a test (-v), so
  # that a run cut by the call's limit names the test it was in.
  split_args "${TEST_ARGS:-}"
  (cd /tmp && timeout 570 $PY -m pytest -v -p no:cacheprovider -rs --durations=12 "${ARGS[@]}" "$ROOT/tests/gpu")
}

do_sanitize() {
  local rc=0 tool
  for tool in memcheck racecheck initcheck synccheck; do
    echo "--- compute-sanitizer --tool $tool"
    timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 9 "$DRIVER" || rc=1
  done
  # The wide lanes' one-wave builds, which the rule gives few of the cases.
  for tool in memcheck racecheck; do
    echo "--- compute-sanitizer --tool $tool, ROPEKV_CUDA_ONE_WAVE=1"
    ROPEKV_CUDA_ONE_WAVE=1 timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      "$DRIVER" || rc=1
  done
  return $rc
}

do_sansuite() {
  # compute-sanitizer over the GPU pytest suite itself (every test that runs
  # the kernel; the 4.5 GB pool and torch.compile tests are left out for
  # time): memcheck, then racecheck and initcheck on the core math tests.
  local rc=0 sel="not 2_31 and not compile and not second_device"
  (cd /tmp && timeout 420 compute-sanitizer --tool memcheck --target-processes all \
     --error-exitcode 9 $PY -m pytest -q -p no:cacheprovider -x -k "$sel" "$ROOT/tests/gpu") || rc=1
  for tool in racecheck initcheck; do
    (cd /tmp && timeout 300 compute-sanitizer --tool "$tool" --target-processes all \
       --error-exitcode 9 $PY -m pytest -q -p no:cacheprovider -x \
       -k "models_match_reference or fused_qkv or misaligned or out_of_range" "$ROOT/tests/gpu") || rc=1
  done
  return $rc
}

do_ncu() {
  # Llama-3.1-8B bf16, T = 1, 64, 8192 (two calls each): duration, DRAM, occupancy.
  timeout 150 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section Occupancy --section LaunchStats --section SchedulerStats \
    -k regex:rope_pool -c 6 "$DRIVER" --profile > "$OUT/ncu.txt" 2>&1
  local rc=$?
  grep -E "rope_pool_kernel|DRAM Throughput|Duration|Achieved Occupancy|Registers Per|Theoretical Occ|No Eligible|Block Limit Reg|Grid Size|Block Size" \
    "$OUT/ncu.txt" | sed -E 's/\(ropekv::cuda::detail::Params\).*//' | head -80
  return $rc
}

# The driver's --latency or --cold timing at the library's steps per team
# ("auto") and at each forced one; Llama-3.1-8B bf16 for --latency.
each_unroll() {
  local u rc=0
  for u in auto 1 2 4 8; do
    if [ "$u" = auto ]; then
      timeout 60 "$DRIVER" "$1" || rc=1
    else
      ROPEKV_CUDA_UNROLL=$u timeout 60 "$DRIVER" "$1" || rc=1
    fi
  done
  return $rc
}

do_cold_options() {
  timeout 60 "$DRIVER" --cold-table && timeout 60 "$DRIVER" --cold-options
}

do_split() {
  local i rc=0
  for i in 1 2; do
    for grid in rule 0; do
      echo "== split $grid run $i"
      for mode in --cold --cold-table --cold-options --latency; do
        if [ $grid = rule ]; then
          timeout 60 "$DRIVER" $mode || rc=1
        else
          ROPEKV_CUDA_SPLIT_GRID=0 timeout 60 "$DRIVER" $mode || rc=1
        fi
      done
    done
    echo "== table kernel run $i"
    ROPEKV_CUDA_UNROLL=2 timeout 60 "$DRIVER" --cold-table || rc=1
  done
  return $rc
}

do_small() {
  local i setting mode rc=0
  for i in 1 2; do
    for setting in ${SMALL_SETTINGS:-rule ROPEKV_CUDA_SMALL_TOKENS=0 ROPEKV_CUDA_SMALL_THREADS=128 \
                   ROPEKV_CUDA_SMALL_THREADS=256}; do
      echo "== small $setting run $i"
      [ "$setting" = rule ] && setting=
      for mode in ${SMALL_MODES:---cold --cold-table --cold-interleaved}; do
        env $setting timeout 60 "$DRIVER" $mode || rc=1
      done
    done
  done
  return $rc
}

do_probe() {
  mkdir -p "$ROOT/build" && timeout 120 nvcc -O3 -std=c++17 -arch=sm_"$ARCH" -Isrc bench/cuda_decode_probe.cu \
    -o "$ROOT/build/decode-probe" && timeout 120 "$ROOT/build/decode-probe" ${PROBE_ARGS:-}
}

do_normvar() {
  timeout 300 env ARCH="$ARCH" bash bench/cuda_norm_variants.sh 2 | tee "$OUT/gpu_norm_variants.txt"
}

do_pyover() {
  local i
  for i in 1 2; do timeout 240 $PY bench/py_overhead.py --cuda || return 1; done
}

do_cpuscale() {
  local th rc=0
  local bin round
  for bin in ${CPUSCALE_BINS:-ropekv_cpu_bench}; do
    [ -x ".cpubench/$bin" ] || { echo "no .cpubench/$bin (carry it)"; return 1; }
  done
  nproc
  grep -m1 'model name' /proc/cpuinfo
  for round in $(seq "${CPUSCALE_ROUNDS:-1}"); do
    for th in ${CPUSCALE_THREADS:-16 8 4 2 1}; do
      for bin in ${CPUSCALE_BINS:-ropekv_cpu_bench}; do
        echo "== round $round, $th threads, $bin"
        LD_LIBRARY_PATH=$ROOT/.cpubench${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} ROPEKV_BENCH_THREADS=$th \
          timeout "${CPUSCALE_LIMIT:-90}" ".cpubench/$bin" \
          --benchmark_filter="${CPUSCALE_FILTER:-options/(plain|qk_norm|fp8_pools|qknorm.fp8.yarn)/threads:[0-9]+/T:8192/}" \
          --benchmark_min_time=0.3 --benchmark_repetitions=1 || rc=1
      done
    done
  done
  return $rc
}

do_cputest() {
  (cd /tmp && timeout 180 $PY -m pytest -q -p no:cacheprovider --continue-on-collection-errors \
     "$ROOT/tests/python")
  local rc=$?
  if [ $rc -ge 128 ]; then  # a crash: versions and a native backtrace of the first test
    $PY -c "import nanobind, numpy; print('nanobind', nanobind.__version__, 'numpy', numpy.__version__)"
    (cd /tmp && timeout 120 cuda-gdb -batch -ex run -ex bt --args "$PY" -m pytest -x -q \
       -p no:cacheprovider "$ROOT/tests/python/test_contract.py" 2>&1 | grep -vE "^\[New Thread|^\[Thread" | tail -40)
  fi
  return $rc
}

do_ncuopt() {
  # Each option's kernel next to the plain one (by default Llama-3.1-8B bf16,
  # T = 1 and 8192; two launches per case, in the order the script prints):
  # time, DRAM, occupancy, stalls.
  local rc=0
  split_args "${NCUOPT_ARGS:-}"
  (cd /tmp && timeout 300 ncu --clock-control none -k regex:rope_pool \
     --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
     $PY "$ROOT/bench/gpu_options_calls.py" "${ARGS[@]}" > "$OUT/ncu_options.txt" 2>&1) || rc=1
  grep -E "rope_pool.*Context|^cases:|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Stall|Warp Cycles Per Issued" \
    "$OUT/ncu_options.txt" | sed -E 's/\(ropekv::cuda::detail::(Opt)?Params\).*//' | head -400
  return $rc
}

do_ncusrc() {
  local dt rc=0
  split_args "${NCUSRC_ARGS:-}"
  ncu --version | tail -1
  for dt in ${NCUSRC_DTYPES:-bf16 f16}; do
    echo "== $dt"
    (cd /tmp && timeout 200 ncu --clock-control none -k regex:rope_pool -f -o "/tmp/ncusrc_$dt" \
       --section SourceCounters --section WarpStateStats --warp-sampling-interval 0 \
       $PY "$ROOT/bench/gpu_options_calls.py" --dtype "$dt" "${ARGS[@]}" > "/tmp/ncusrc_$dt.txt" 2>&1) ||
      { tail -5 "/tmp/ncusrc_$dt.txt"; rc=1; continue; }
    grep -E "^cases:" "/tmp/ncusrc_$dt.txt"
    ncu -i "/tmp/ncusrc_$dt.ncu-rep" --page details | grep -E "Warp Cycles Per Issued" | head -20
    ncu -i "/tmp/ncusrc_$dt.ncu-rep" --page source --print-source sass --csv \
      > "$OUT/ncusrc_$dt.csv" 2> "/tmp/ncusrc_${dt}_err.txt" || { cat "/tmp/ncusrc_${dt}_err.txt"; rc=1; }
    $PY "$ROOT/bench/ncu_source_stalls.py" "$OUT/ncusrc_$dt.csv" || rc=1
  done
  return $rc
}

do_options() {
  split_args "${OPTIONS_ARGS:-}"
  (cd /tmp && timeout "${BENCH_TIMEOUT:-560}" $PY "$ROOT/bench/gpu_bench.py" --options --out "$OUT" \
     "${ARGS[@]}")
}

do_bench() {
  (cd /tmp && timeout "${BENCH_TIMEOUT:-560}" $PY "$ROOT/bench/gpu_bench.py" --out "$OUT" ${BENCH_ARGS:-})
}

ab_runs() {
  local i d case envs mode rc=0
  for i in $(seq "${AB_RUNS:-2}"); do
    for case in ${AB_CASES:---cold}; do
      envs=; mode=$case
      if [[ $case == *:* ]]; then envs=${case%%:*}; mode=${case#*:}; fi
      for d in ${AB_DRIVERS:-build/ab/base/driver build/ab/new/driver}; do
        echo "== $d run $i ${envs:+$envs }$mode"
        env ${envs//+/ } timeout 60 "$d" $mode || rc=1
      done
    done
  done
  return $rc
}

do_ab() {  # (the runs, then their cells side by side: bench/ab_summary.py)
  ab_runs | tee "$OUT/ab_runs.txt"
  local rc=${PIPESTATUS[0]}
  $PY "$ROOT/bench/ab_summary.py" "$OUT/ab_runs.txt" || rc=1
  return $rc
}

do_abflags() {
  local v i f pids=() rc=0
  cpu_args
  for v in A B; do  # (both at once: the CUDA file is one translation unit each)
    f=AB_FLAGS_$v
    timeout 420 $PY -m pip install -q --no-build-isolation --no-deps --target "/tmp/ab-$v" . \
      -C build-dir="/tmp/ab-build-$v" -C cmake.define.CMAKE_CUDA_ARCHITECTURES="$ARCH" \
      -C "cmake.define.CMAKE_CUDA_FLAGS=${!f:-}" "${CMAKE_DEFS[@]}" "${CPU_ARGS[@]}" \
      > "/tmp/ab-build-$v.log" 2>&1 &
    pids+=($!)
  done
  for i in 0 1; do
    wait "${pids[$i]}" || { tail -20 "/tmp/ab-build-$([ $i = 0 ] && echo A || echo B).log"; rc=1; }
  done
  [ $rc -eq 0 ] || return 1
  split_args "${OPTIONS_ARGS:-}"
  for i in $(seq "${AB_RUNS:-2}"); do
    for v in A B; do
      f=AB_FLAGS_$v
      echo "== build $v (CMAKE_CUDA_FLAGS '${!f:-}') run $i"
      (cd /tmp && PYTHONPATH=/tmp/ab-$v timeout 300 $PY "$ROOT/bench/gpu_bench.py" --options \
         --out "/tmp/ab-out-$v-$i" "${ARGS[@]}" > /dev/null) || rc=1
      grep "^| " "/tmp/ab-out-$v-$i/gpu_options.md" | cut -d'|' -f2-6
    done
  done
  return $rc
}

do_envs() {
  local i set rc=0 sets kv d
  IFS=';' read -r -a sets <<< "${ENV_SETS:--}"
  split_args "${OPTIONS_ARGS:-}"
  for i in $(seq "${ENV_RUNS:-2}"); do
    for set in "${sets[@]}"; do
      read -r -a kv <<< "$set"  # (its VAR=value items, no globbing; '-': none)
      [ "${kv[*]}" = - ] && kv=()
      d="/tmp/envs-out-$i-${set//[^A-Za-z0-9_=-]/_}"
      rm -rf "$d"
      echo "== settings '${kv[*]:-none}' run $i"
      (cd /tmp && env "${kv[@]}" timeout 300 $PY "$ROOT/bench/gpu_bench.py" --options --out "$d" \
         "${ARGS[@]}" > /dev/null) || rc=1
      [ -f "$d/gpu_options.md" ] && grep "^| " "$d/gpu_options.md" | cut -d'|' -f2-6
    done
  done
  return $rc
}

do_peers() {
  # The serving engines' own kernels next to ropekv, on the same inputs: built
  # from .peers/ (filled by .peers/tools/fetch_sources.sh on a machine with
  # network, carried here); a peer that does not build is reported and skipped.
  local t0=$SECONDS budget=${PEERS_BUDGET:-480} build=${PEERS_BUILD:-$ROOT/.peers/build}
  if [ -f .peers/tools/build.sh ]; then
    PYTHON=$PY PEERS_BUILD=$build PEER_BUILD_TIMEOUT=$((budget / 2 - 15)) \
      timeout $((budget / 2)) bash .peers/tools/build.sh "$ARCH" ||
      echo "(not every peer built: the benchmark skips those)"
  else
    echo "no .peers/tools/build.sh (carry .peers): ropekv and the copy only"
  fi
  local left=$((budget - (SECONDS - t0)))
  (cd /tmp && timeout "$left" $PY "$ROOT/bench/gpu_peers.py" --out "$OUT" --peers-build "$build" \
     --budget-s $((left - 60)) ${PEERS_ARGS:-}) || return 1
  # The plot (matplotlib, where it installs; docs/ has the committed one).
  $PY bench/plot_gpu_peers.py "$OUT/gpu_peers.json" --out "$OUT/cuda_peers_bandwidth.png" ||
    echo "(no plot)"
}

for s in "${STEPS[@]}"; do
  case $s in
    build) step build do_build ;;
    test) step test do_test ;;
    sanitize) step sanitize do_sanitize ;;
    sansuite) step sansuite do_sansuite ;;
    ncu) step ncu do_ncu ;;
    latency) step latency each_unroll --latency ;;
    cold) step cold each_unroll --cold ;;
    coldopt) step coldopt do_cold_options ;;
    poolfloor) step poolfloor timeout 300 "$DRIVER" --pool-floor ;;
    freshpools) step freshpools bash -c "cd /tmp && timeout 120 $PY $ROOT/bench/gpu_fresh_pools.py" ;;
    split) step split do_split ;;
    small) step small do_small ;;
    probe) step probe do_probe ;;
    normvar) step normvar do_normvar ;;
    cputest) step cputest do_cputest ;;
    cpuscale) step cpuscale do_cpuscale ;;
    pyover) step pyover do_pyover ;;
    bench) step bench do_bench ;;
    options) step options do_options ;;
    ncuopt) step ncuopt do_ncuopt ;;
    ncusrc) step ncusrc do_ncusrc ;;
    ab) step ab do_ab ;;
    abflags) step abflags do_abflags ;;
    envs) step envs do_envs ;;
    peers) step peers do_peers ;;
    *) log "unknown step $s"; exit 2 ;;
  esac
done

# ---------------------------------------------------------------- summary
{
  echo ""
  echo "=== summary"
  printf "%-10s %s\n" step result
  for s in "${ORDER[@]}"; do printf "%-10s %s\n" "$s" "${RESULT[$s]}"; done
  grep -E "^(=+ )?[0-9]+ (passed|failed)|passed|failed" "$LOG" | grep -E " in [0-9.]+s" | tail -4
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^PASS|^FAIL" "$LOG" | tail -8
  if [ -f "$OUT/gpu_bench.csv" ]; then
    $PY - "$OUT/gpu_bench.csv" <<'EOF'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
print("\nheadline (bf16): T, ropekv us, GB/s, ratio to copy, eager us, compile us")
for r in rows:
    if r["dtype"] == "bf16" and int(r["T"]) in (1, 32, 64, 2048, 8192, 32768):
        print(f"  {r['model']:13s} T={int(r['T']):6d} {float(r['ropekv_us']):9.2f} us "
              f"{float(r['ropekv_GBps']):6.0f} GB/s  {float(r['ropekv_vs_copy']):.2f}x copy  "
              f"eager {float(r['torch_eager_us']):9.2f}  compile {r['torch_compile_us'] or '-'}")
EOF
  fi
} | tee -a "$LOG"
for s in "${ORDER[@]}"; do
  case ${RESULT[$s]} in ok*) ;; *) exit 1 ;; esac
done
exit 0
