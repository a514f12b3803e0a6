#!/usr/bin/env bash
# What a decode call's QK-norm costs in the small kernel, part by part:
# timing-only variants of src/cuda/rope_pool_kernel.cuh, each a patched copy
# built into bench/cuda_decode_probe.cu and run in its `normfloor` mode
# (Llama-3.1-8B bf16, T = 1, 8, 32, 128, warm and cold L2, 50-call graphs).
# None of the variants computes the right result; they only show where the
# time goes (docs/performance.md, *What a decode QK-norm must cost*).
#
#   base   the header as it is
#   nosc   no sincos: the cos/sin a cheap function of the position
#   nosum  no data before the barrier: every lane's sum of squares a constant
#   now    no weight loads: weights of 1
#   nohs   no shared-memory head sum: r from the lane's own sum (times L)
#   eps0   norm_eps a compile-time constant (1e-6) instead of the parameter
#          (read into a register before the wait since the change after
#          2730f09; before it, read from the constant bank after the barrier)
#
# Usage (on the GPU machine, from the repository root):
#   bash bench/cuda_norm_variants.sh [ROUNDS] > variants.txt
# Each round runs every variant's probe once, in turn; every probe prints
# every row twice.
set -euo pipefail
ROUNDS=${1:-2}
ARCH=${ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)}
VARIANTS="base nosc nosum now nohs eps0"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

patch_header() {  # variant name -> $WORK/<name>/cuda/rope_pool_kernel.cuh
  mkdir -p "$WORK/$1/cuda"
  python3 - "$1" "$WORK/$1/cuda/rope_pool_kernel.cuh" <<'PY'
import sys
name, out = sys.argv[1], sys.argv[2]
s = open("src/cuda/rope_pool_kernel.cuh").read()

def rep(old, new):
    global s
    if old not in s:
        sys.exit(f"variant {name}: the header no longer has {old!r}")
    s = s.replace(old, new)

NORM = """      r = norm_scale(kWide ? head_sum_serial(hs, L) : head_sum(hs, L), 2 * p.half, norm_eps,
                     true);"""
if name == "nosc":
    rep("    sincos_fp32(__fmul_rn(pos, i == tid ? freq0 : __ldg(p.inv_freq + i)), &s, &c);",
        "    s = __fmul_rn(pos, 1e-30f); c = __fadd_rn(s, freq0);")
elif name == "nosum":
    rep("if constexpr (kNorm) sq_smem[tid] = active && w != nullptr ? sum_squares<T, N>(a, b, true) : 0.0f;",
        "if constexpr (kNorm) sq_smem[tid] = 1.0f;")
elif name == "now":
    rep("""      if (active) {
        weight_words<N, WW>(w, lane * N, wdt, wa);
        weight_words<N, WW>(w, p.half + lane * N, wdt, wb);
      }""", """      wdt = 0;
#pragma unroll
      for (int j = 0; j < WW; ++j) wa[j] = wb[j] = 0x3F800000u;""")
elif name == "nohs":
    rep(NORM, NORM.replace("head_sum(hs, L)", "sq_smem[tid] * L"))
elif name == "eps0":
    rep(NORM, NORM.replace("norm_eps,", "1e-6f,"))
open(out, "w").write(s)
PY
  nvcc -O3 -std=c++17 -arch=sm_"$ARCH" -I"$WORK/$1" -Isrc bench/cuda_decode_probe.cu \
    -o "$WORK/probe_$1"
}

for v in $VARIANTS; do patch_header "$v" & done
wait
for v in $VARIANTS; do [ -x "$WORK/probe_$v" ] || { echo "variant $v did not build" >&2; exit 1; }; done
for r in $(seq "$ROUNDS"); do
  for v in $VARIANTS; do
    echo "## round $r variant $v"
    "$WORK/probe_$v" normfloor | grep -E '^(small|floor)'
  done
done
