"""Whether a call into freshly allocated pools runs at its settled speed.

Llama-3.1-8B bf16, T = 8192, random distinct slots in a 2^20-row pool, each
call timed as bench/gpu_bench.py --options times it (its Timer: 4-call CUDA
graphs, median of 7 passes):

1. the plain call, float32 pools, fp8 pools, the QK-norm + fp8 + yarn
   combination and fp8 pools again with one format's pools at a time: the
   previous format's freed, and the caching allocator's memory given back
   to CUDA, before the next format's are made (the options benchmark's
   order before it kept every format's pools);
2. the first four with every format's pools made once and kept, twice over;
3. each format's pools freed (the memory given back), made again and its
   call timed three times at once, then the same after half a second idle.

    python bench/gpu_fresh_pools.py      (needs PyTorch with CUDA and ropekv)
"""
import os
import sys
import time

import torch

import ropekv

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_bench import POOL_ROWS, Timer, make_pools, option_cases  # noqa: E402

T, HQ, HK, D, BASE = 8192, 32, 8, 128, 500000.0


def main():
    timer = Timer()
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(1)
    cases = option_cases(D, dt)
    q, k, v = (torch.randn(T, h, D, device="cuda", dtype=dt, generator=g) for h in (HQ, HK, HK))
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    pos = torch.randint(0, 1 << 17, (T,), device="cuda", dtype=torch.int32, generator=g)
    slots = torch.randperm(POOL_ROWS, device="cuda", generator=g)[:T].to(torch.int32)

    pools = {}

    def time_case(name):
        kw, _, pe = cases[name]
        kp, vp = pools[pe or 2]
        return timer.run(lambda i: ropekv.rope_pool_fused(
            q, k, v, pos, slots, kp, vp, head_dim=D, num_qo_heads=HQ, num_kv_heads=HK,
            rope_base=BASE, q_out=q_out, k_out=k_out, **kw), 4, 4)

    order = ["plain", "float32 pools", "fp8_e4m3 pools", "QK-norm + fp8 + yarn"]
    # As the options benchmark did: one format's pools at a time, the
    # previous format's freed before the next are made.
    line = []
    for name in order + ["fp8_e4m3 pools"]:
        pe = cases[name][2] or 2
        if pe not in pools:
            pools.clear()
            torch.cuda.empty_cache()
            pools[pe] = make_pools(pe, HK, D, dt)
        line.append(f"{name} {time_case(name):.2f} us")
    print("one format's pools at a time: " + " | ".join(line), flush=True)
    pools.clear()
    torch.cuda.empty_cache()
    pools.update({pe: make_pools(pe, HK, D, dt) for pe in (1, 2, 4)})
    for _ in range(2):
        print("pools kept: " + " | ".join(f"{n} {time_case(n):.2f} us" for n in order), flush=True)
    for name, pe in (("fp8_e4m3 pools", 1), ("float32 pools", 4), ("plain", 2)):
        for idle_s in (0.0, 0.5):
            del pools[pe]
            torch.cuda.empty_cache()
            pools[pe] = make_pools(pe, HK, D, dt)
            torch.cuda.synchronize()
            time.sleep(idle_s)
            us = [time_case(name) for _ in range(3)]
            print(f"{name}: fresh pools, {idle_s:.1f} s idle: "
                  + " then ".join(f"{u:.2f}" for u in us) + " us", flush=True)


if __name__ == "__main__":
    main()
