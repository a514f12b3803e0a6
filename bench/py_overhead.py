#!/usr/bin/env python3
"""Per-call time of ropekv.rope_pool_fused at T = 1 through Python, with
PyTorch CPU tensors (Llama-3.1-8B shapes, warm caches): the plain call, the
call with Llama 3.1's rope_scaling, with interleaved pairs, with a QK-norm
(weights in the input dtype, as Qwen3 has them), with a float32
cos_sin_cache, with fp8 pools, with q_out / k_out given and in place, and
the plain call with numpy arrays, each through the binding's fast path (the default) and through the general path
(stream=0, which CPU arrays otherwise ignore). Where PyTorch has the DLPack C
exchange API (2.10 and later), which the fast path reads tensors through,
also the fast path reading them through their attributes instead, as with
an older PyTorch. Best of 5 timeit runs of 5000 calls each.

With --cuda (on a GPU machine): the same calls with CUDA tensors, the host
time per call of a stream of 5000 asynchronous calls (the kernels run
behind; synchronised once at the end), through the fast path, the general
path (stream= the current stream) and torch.ops.ropekv.rope_pool_fused (with
--ops, the latter on the CPU too).
With --profile, cProfile of 5000 plain bf16 calls through each path.

Usage: .venv/bin/python bench/py_overhead.py [--cuda] [--ops] [--profile]
"""

from __future__ import annotations

import cProfile
import importlib
import json
import pstats
import sys
import timeit

import torch

import ropekv

T, HQ, HK, D, P = 1, 32, 8, 128, 4096
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
ROWS = 8192  # cos_sin_cache rows


def calls(dt: torch.dtype) -> dict:
    inv = 500000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(ROWS, dtype=torch.float64)[:, None] * inv
    table = torch.cat([ang.cos(), ang.sin()], 1).float()
    w = torch.randn(D).to(dt)
    return {"plain": {}, "llama3 rope_scaling": {"rope_scaling": LLAMA3},
            "is_neox=False": {"is_neox": False},
            "QK-norm": {"q_norm_weight": w, "k_norm_weight": w},
            "cos_sin_cache f32": {"cos_sin_cache": table},
            "fp8_e4m3 pools": {"kv_cache_dtype": "fp8_e4m3", "k_scale": 0.5, "v_scale": 0.5},
            # outputs an engine preallocates (no allocation per call); not in torch.ops
            "q_out/k_out given": {"q_out": "given", "k_out": "given"},
            "inplace=True": {"inplace": True},
            # the plain call with numpy arrays (CPU; torch imported, so the
            # call looks at whether it writes PyTorch tensors)
            "numpy arrays": {"numpy": True}}


def numpy_of(x: torch.Tensor):
    """A numpy array of a CPU tensor's values (bf16 through ml_dtypes)."""
    if x.dtype is torch.bfloat16:
        import ml_dtypes

        return x.view(torch.int16).numpy().copy().view(ml_dtypes.bfloat16)
    return x.numpy().copy()


def main() -> None:
    cuda = "--cuda" in sys.argv[1:]
    ops = cuda or "--ops" in sys.argv[1:]
    if ops:
        importlib.import_module("ropekv.ops")  # registers torch.ops.ropekv
    dev = "cuda" if cuda else "cpu"
    torch.set_num_threads(1)
    # The paths timed: the default call (the binding's fast path), the general
    # path (an explicit stream: on the CPU stream=0, which CPU arrays ignore)
    # and, with --ops or --cuda, torch.ops.ropekv.
    ropekv._torch_fast()  # registers torch with the fast path
    exchange = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
    paths = ["fast"] + (["fast-attributes"] if exchange else []) + ["general"] + (
        ["ops"] if ops else [])
    heads = {"fast": "fast path us", "fast-attributes": "fast, attributes", "general":
             "general path us", "ops": "torch.ops us"}
    print(f"{'dtype':9s} {'call':20s}" + "".join(f" {heads[p]:>16s}" for p in paths))
    profiled = []
    for dt in (torch.bfloat16, torch.float32):
        q, k, v = (torch.randn(T, h, D).to(dt).to(dev) for h in (HQ, HK, HK))
        pos, slots = torch.tensor([1234], device=dev), torch.tensor([17], device=dev)
        pools = [torch.zeros(P, HK, D, dtype=dt, device=dev) for _ in range(2)]
        for name, kw in calls(dt).items():
            kw = {n: x.to(dev) if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
            if kw.get("q_out") == "given":
                kw.update(q_out=torch.empty_like(q), k_out=torch.empty_like(k))
            fp8 = kw.get("kv_cache_dtype") == "fp8_e4m3"
            k_pool, v_pool = ((torch.zeros(P, HK, D, dtype=torch.float8_e4m3fn, device=dev)
                               for _ in range(2)) if fp8 else pools)
            arrays = (q, k, v, pos, slots, k_pool, v_pool)
            if kw.pop("numpy", False):
                if cuda:
                    continue
                arrays = tuple(numpy_of(x) for x in arrays)
            us = []
            for path in paths:
                if (path == "ops" and ("q_out" in kw or "inplace" in kw)
                        or path in ("ops", "fast-attributes") and arrays[0] is not q):
                    us.append(float("nan"))
                    continue
                if path == "ops":
                    okw = {n: json.dumps(x) if isinstance(x, dict) else x for n, x in kw.items()}

                    def call(kw=okw):
                        torch.ops.ropekv.rope_pool_fused(
                            *arrays, head_dim=D, num_qo_heads=HQ,
                            num_kv_heads=HK, rope_base=500000.0, **kw)
                else:
                    stream = None if path.startswith("fast") else (
                        torch.cuda.current_stream() if cuda else 0)

                    def call(stream=stream, kw=kw):
                        ropekv.rope_pool_fused(*arrays, head_dim=D,
                                               num_qo_heads=HQ, num_kv_heads=HK,
                                               rope_base=500000.0, stream=stream, **kw)

                def batch(call=call):
                    for _ in range(5000):
                        call()
                    if cuda:
                        torch.cuda.synchronize()
                if path == "fast-attributes":
                    ropekv._register_fast_torch(torch, exchange_api=False)
                batch()  # warm up (CUDA: the first calls make the device state)
                us.append(min(timeit.repeat(batch, number=1, repeat=5)) / 5000 * 1e6)
                if path == "fast-attributes":
                    ropekv._register_fast_torch(torch)
                if "--profile" in sys.argv[1:] and name == "plain" and dt is torch.bfloat16:
                    profiled.append((path, batch))
            print(f"{str(dt).split('.')[1]:9s} {name:20s}" + "".join(f" {u:16.2f}" for u in us))
    for path, batch in profiled:
        # Where a plain bf16 call's host time goes, by Python function (cProfile
        # adds its own cost per function call: compare the shares, not the sums).
        print(f"\n--profile: {heads[path]}, plain bf16, 5000 calls")
        prof = cProfile.Profile()
        prof.runcall(batch)
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
