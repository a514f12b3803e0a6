#!/usr/bin/env python3
"""One call of each option of bench/gpu_bench.py's options table (--dtype bf16 or
f16, default bf16; one of its shapes: --model, default Llama-3.1-8B), at each
token count given: the launches Nsight Compute profiles in
scripts/gpu-check.sh's `ncuopt` step, to compare each option's kernel with
the plain one (duration, DRAM throughput, occupancy, stall reasons).

Usage: gpu_options_calls.py [--model "Gemma-4 full"] [--dtype f16] [--tokens 1 8192]
                            [--options plain "QK-norm" ...]
Each case runs twice (the first call makes the library's tables), in the
order the script prints; read the second launch of each.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ropekv  # noqa: E402
from gpu_bench import OPTION_MODELS, POOL_ROWS, option_cases  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8192])
    ap.add_argument("--options", nargs="+",
                    default=["plain", "is_neox=False", "yarn scaling", "cos_sin_cache f32",
                             "QK-norm", "fp8_e4m3 pools"])
    ap.add_argument("--model", default="Llama-3.1-8B",
                    choices=[m[0] for m in OPTION_MODELS])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f16"])
    args = ap.parse_args()
    _, Hq, Hk, D, base = next(m for m in OPTION_MODELS if m[0] == args.model)
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    cases = option_cases(D, dt)
    g = torch.Generator(device="cuda").manual_seed(0)
    pools = {pe: (torch.zeros(POOL_ROWS // 4, Hk, D, device="cuda", dtype=pdt),
                  torch.zeros(POOL_ROWS // 4, Hk, D, device="cuda", dtype=pdt))
             for pe, pdt in ((1, torch.uint8), (2, dt), (4, torch.float32))}
    print("cases:", [f"{args.dtype} T={T} {n}" for T in args.tokens for n in args.options],
          flush=True)
    for T in args.tokens:
        q = torch.randn(T, Hq, D, device="cuda", dtype=dt, generator=g)
        k = torch.randn(T, Hk, D, device="cuda", dtype=dt, generator=g)
        v = torch.randn(T, Hk, D, device="cuda", dtype=dt, generator=g)
        pos = torch.randint(0, 1 << 17, (T,), device="cuda", dtype=torch.int32, generator=g)
        slots = torch.randperm(POOL_ROWS // 4, device="cuda", generator=g)[:T].to(torch.int32)
        for name in args.options:
            kw, _, pe = cases[name]
            kp, vp = pools[pe or 2]
            for _ in range(2):  # warm-up, then the profiled launch
                ropekv.rope_pool_fused(q, k, v, pos, slots, kp, vp, head_dim=D, num_qo_heads=Hq,
                                       num_kv_heads=Hk, rope_base=base, **kw)
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
