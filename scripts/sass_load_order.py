#!/usr/bin/env python3
"""Whether each small-kernel build issues its q/k/v loads before it waits for
a 32-bit index (positions, slots).

The small kernel (src/cuda/rope_pool_kernel.cuh) loads a token's data first
and its position and slot after, so that both memory round trips overlap.
ptxas may still hoist the index loads and place the 32-bit index's widening
to 64 bits (an SHF on the loaded register) ahead of some data loads: that
instruction then waits for the index, and the data loads behind it go out one
round trip late (docs/performance.md, *f16 pool builds wait for the index*).
This reads nvdisasm's listing of the library's cubin and prints, per build
without a cos_sin_cache (a table build loads its row after the position by
design), how many vector loads (64 or 128 bits: q, k, v, QK-norm weights)
come after the first instruction that reads a 32-bit index register.

  nvcc -cubin -O3 -DNDEBUG -arch=sm_90 --expt-relaxed-constexpr -std=c++17 \\
       -Iinclude -Isrc -DROPEKV_VERSION='"0"' src/cuda/rope_pool_cuda.cu -o /tmp/k.cubin
  nvdisasm -c /tmp/k.cubin > /tmp/k.sass
  scripts/sass_load_order.py /tmp/k.sass

Exit status 1 when any build has a late vector load, but a one-wave build
(kOneWave, 40 registers: ptxas holds some loads back for the registers, and
these builds were timed so, docs/performance.md, *One wave for the wide lanes
at 40 registers*), whose late loads are printed and not counted. nvdisasm
comes with the CUDA toolkit (or pip's nvidia-cuda-nvdisasm).
"""

import re
import sys

LOAD = re.compile(r"(@!?P\d\s+)?LDG\.E(\.64|\.128)?\.CONSTANT\s+(R\d+),\s*"
                  r"desc\[\w+\]\[(R\d+)\.64(\+0x4)?\]")


def functions(path):
    """{mangled name: [instruction text, ...]} of nvdisasm -c output."""
    out, cur = {}, None
    with open(path) as f:
        for line in f:
            m = re.match(r"\s*\.text\.(\S+):", line)
            if m:
                cur = m.group(1)
                out[cur] = []
                continue
            m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
            if cur and m:
                out[cur].append(m.group(1))
    return out


def late_loads(ins):
    """(vector loads after the first read of a 32-bit index, vector loads)."""
    loads = []
    for i, t in enumerate(ins):
        if t.startswith("BAR") or "STG" in t:
            break
        m = LOAD.match(t)
        if m:
            loads.append((i, m.group(1), m.group(2), m.group(3), m.group(4) + (m.group(5) or "")))
    # An index load, in either of two forms: a predicated 32-bit load whose
    # address a 64-bit load under the opposite predicate also reads (int32
    # or int64 indices), or a 32-bit load of the low word next to a 32-bit
    # load of the word after it (an int64's high word).
    # (Within four instructions: a register that held an address is reused.)
    def opposite(p):
        p = p.strip()
        return p.replace("@!", "@") if p.startswith("@!") else p.replace("@", "@!")

    idx_regs, idx_at = set(), set()
    for i, p, w, dst, a in loads:
        near = [(j, p2, w2, a2) for j, p2, w2, _, a2 in loads if 0 < abs(j - i) <= 4]
        pair = [j for j, p2, w2, a2 in near
                if a2 == a and w2 == ".64" and p and p2 and p2.strip() == opposite(p)]
        high = [j for j, _, w2, a2 in near if a2 == a + "+0x4" and w2 is None]
        if (p and w is None and pair) or (w is None and high):
            idx_regs.add(dst)
            idx_at.update([i] + pair + high)
    vec = [i for i, _, w, _, _ in loads if w and i not in idx_at]
    if not idx_at:
        return 0, len(vec)
    first_use = None
    for i in range(min(idx_at) + 1, len(ins)):
        if i in idx_at:
            continue
        srcs = ins[i].split(",", 1)[1] if "," in ins[i] else ""
        if any(re.search(r"\b%s\b" % r, srcs) for r in idx_regs):
            first_use = i
            break
    return sum(1 for i in vec if first_use is not None and i > first_use), len(vec)


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    bad = 0
    for name, ins in sorted(functions(sys.argv[1]).items()):
        m = re.search(r"rope_pool_small_kernelI(\w+?)Lb([01])ELb([01])ELb([01])ELi(\d)ELi(\d)", name)
        if not m or m.group(2) == "1":
            continue
        late, n = late_loads(ins)
        one_wave = "ParamsELb1E" in name
        bad += late > 0 and not one_wave
        dtype = {"6__half": "f16", "13__nv_bfloat16": "bf16", "f": "f32"}.get(m.group(1), m.group(1))
        print(f"{'LATE' if late else 'ok  '} {late}/{n}  {dtype:4} interleaved={m.group(3)} "
              f"norm={m.group(4)} pools={m.group(5)} N={m.group(6)}"
              f"{' one-wave (not counted)' if one_wave else ''}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
