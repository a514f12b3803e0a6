#!/usr/bin/env python3
"""What the huge-page advice on new CPU outputs saves a large call.

The default call of ropekv.rope_pool_fused makes q_rot and k_rot; on the CPU
they are fresh PyTorch tensors whose first write is the call's own, so at
large T their page faults are a large part of the call. The binding asks for
transparent huge pages over such outputs (ropekv._ext.advise_huge_pages).
This times, in one process and interleaved, the Llama-3.1-8B call at T = 8192
through the general path (stream=0, where the advice is a Python call and can
be switched off):

  not advised   the default call, the advice replaced by a no-op
  advised       the default call as it ships
  given         q_out / k_out given (no new outputs: the kernel's own time)

Pools of 2^17 rows, slots a random permutation of them, random positions.
Median and best of 25 calls each.

Usage: .venv/bin/python bench/cpu_huge_pages.py [--dtype f32|bf16] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import ropekv
from ropekv import _ext


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    T, Hq, Hk, D, P = args.tokens, 32, 8, 128, 1 << 17
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    rng = np.random.default_rng(0)
    q, k, v = (torch.randn(T, h, D).to(dt) for h in (Hq, Hk, Hk))
    pos = torch.from_numpy(rng.integers(0, 1 << 17, T))
    slots = torch.from_numpy(rng.permutation(P)[:T])
    k_pool, v_pool = torch.zeros(P, Hk, D, dtype=dt), torch.zeros(P, Hk, D, dtype=dt)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hk, rope_base=5e5,
              num_threads=args.threads, stream=0)
    advise = _ext.advise_huge_pages

    def call(mode: str) -> float:
        _ext.advise_huge_pages = advise if mode == "advised" else (lambda *a: None)
        t0 = time.perf_counter()
        if mode == "given":
            ropekv.rope_pool_fused(q, k, v, pos, slots, k_pool, v_pool, q_out=q_out,
                                   k_out=k_out, **kw)
        else:
            out = ropekv.rope_pool_fused(q, k, v, pos, slots, k_pool, v_pool, **kw)
            del out
        return time.perf_counter() - t0

    times = {m: [] for m in ("not advised", "advised", "given")}
    try:
        call("given")  # (first touch of the pools and given outputs)
        for _ in range(5):
            for m in times:
                times[m] += [call(m) for _ in range(5)]
    finally:
        _ext.advise_huge_pages = advise
    for m, ts in times.items():
        ts.sort()
        print(f"{args.dtype} T={T} threads={args.threads} {m:12s} median "
              f"{ts[len(ts) // 2] * 1e3:7.1f} ms  best {ts[0] * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
