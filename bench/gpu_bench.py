#!/usr/bin/env python3
"""GPU benchmark of ropekv.rope_pool_fused against PyTorch (eager and
torch.compile) and a device-to-device copy of the same bytes, in one run.

For every model (SPEC section 6), dtype and token count T it times, per call:

  ropekv         one fused launch
  torch eager    rotate-half RoPE in the input dtype (Hugging Face style) and
                 index_copy_ of k_rot and v into the pools
  torch.compile  the same function compiled by Inductor (dynamic shapes)
  copy           a device-to-device copy moving the same number of bytes
                 (read + write) as the SPEC section 7 count of the call

Method: every call is captured in CUDA graphs (50 back-to-back calls per
graph for T <= 512, fewer above), replays are timed with CUDA events, and the
median of several measurements is divided by the number of calls. Inputs and
outputs rotate over enough slices that one pass over them is at least twice
the L2 cache, so small T is not served from L2. Slots are a random
permutation of a pool of 2^20 rows. Effective bandwidth = SPEC section 7
bytes / time, for every implementation (the same useful bytes).

Writes gpu_bench.csv, gpu_bench.md, gpu_bench.json and cuda_bandwidth.png to
--out, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

import ropekv

MODELS = [  # name, Hq, Hk, D, rope_theta
    ("Llama-3.1-8B", 32, 8, 128, 500000.0),
    ("Qwen2.5-7B", 28, 4, 128, 1000000.0),
    ("Gemma-2-9B", 16, 8, 256, 10000.0),
    ("Phi-3-mini", 32, 32, 96, 10000.0),
]
TOKENS = [1, 8, 32, 128, 512, 2048, 8192, 32768]
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
POOL_ROWS = 1 << 20
IMPLS = ["ropekv", "torch_eager", "torch_compile", "copy"]


def spec_bytes(T, Hq, Hk, D, esize, written, index_bytes=8):
    """SPEC section 7: read q, k, v; write q_rot, k_rot; write W pool rows."""
    return esize * (2 * T * Hq * D + 3 * T * Hk * D + 2 * written * Hk * D) + T * index_bytes


def torch_rope_pool(q, k, v, positions, slots64, k_pool, v_pool, inv_freq):
    """The PyTorch way: rotate-half RoPE in the input dtype, then index_copy_."""
    half = q.shape[-1] // 2
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(q.dtype)[:, None, :]
    sin = emb.sin().to(q.dtype)[:, None, :]

    def rotate_half(x):
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    q_rot = q * cos + rotate_half(q) * sin
    k_rot = k * cos + rotate_half(k) * sin
    k_pool.index_copy_(0, slots64, k_rot)
    v_pool.index_copy_(0, slots64, v)
    return q_rot, k_rot


class Timer:
    """Captures calls into CUDA graphs and times their replays."""

    def __init__(self, reps=7, target_ms=4.0):
        self.reps = reps
        self.target_ms = target_ms

    def prepare(self, fn, n_calls, calls_per_graph):
        """Warms fn up and captures its n_calls calls into graphs of
        calls_per_graph. Returns time_once(): one timed pass (replayed
        enough times to last about target_ms), in microseconds per call."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(min(3, n_calls)):  # warm-up: compilation, allocator, flag
                fn(i)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        # A slow implementation (say, one that copies the whole pool per call)
        # gets fewer calls, so that the run stays within its time.
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn(0)
        e1.record()
        e1.synchronize()
        est_us = e0.elapsed_time(e1) * 1e3
        if est_us * n_calls > 300_000:
            n_calls = max(1, int(300_000 // est_us))
            calls_per_graph = min(calls_per_graph, n_calls)
        pool = torch.cuda.graph_pool_handle()
        graphs = []
        for g0 in range(0, n_calls, calls_per_graph):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                for i in range(g0, min(n_calls, g0 + calls_per_graph)):
                    fn(i)
            graphs.append(g)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def once(rounds):
            start.record()
            for _ in range(rounds):
                for g in graphs:
                    g.replay()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        once(1)
        one = once(1)
        rounds = max(1, int(math.ceil(self.target_ms / max(one, 1e-3))))
        return lambda: once(rounds) / (rounds * n_calls) * 1e3

    def run(self, fn, n_calls, calls_per_graph):
        """fn(i) launches call i. Returns microseconds per call (median)."""
        time_once = self.prepare(fn, n_calls, calls_per_graph)
        return statistics.median([time_once() for _ in range(self.reps)])


def bench_config(model, dtype_name, T, pool, timer, compiled, args, log):
    name, Hq, Hk, D, base = model
    dt = DTYPES[dtype_name]
    esize = torch.tensor([], dtype=dt).element_size()
    k_pool, v_pool = pool
    nbytes = spec_bytes(T, Hq, Hk, D, esize, T, index_bytes=8)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 60 * 2**20
    calls_per_graph = 50 if T <= 512 else (10 if T <= 2048 else 4)
    n_graphs = max(1, min(args.max_graphs, math.ceil(2 * l2 / (nbytes * calls_per_graph))))
    n_calls = calls_per_graph * n_graphs
    slices = max(1, min(n_calls, math.ceil(2 * l2 / nbytes)))

    g = torch.Generator(device="cuda").manual_seed(T)
    q = torch.randn(slices, T, Hq, D, device="cuda", dtype=dt, generator=g)
    k = torch.randn(slices, T, Hk, D, device="cuda", dtype=dt, generator=g)
    v = torch.randn(slices, T, Hk, D, device="cuda", dtype=dt, generator=g)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    pos = torch.randint(0, 1 << 17, (slices, T), device="cuda", dtype=torch.int32, generator=g)
    perm = torch.randperm(POOL_ROWS, device="cuda", generator=g)
    idx = (torch.arange(slices * T, device="cuda") % POOL_ROWS).view(slices, T)
    slots64 = perm[idx].contiguous()
    slots32 = slots64.to(torch.int32)
    inv_freq = (base ** (-torch.arange(0, D, 2, dtype=torch.float64, device="cuda") / D)).float()

    def f_ropekv(i):
        j = i % slices
        ropekv.rope_pool_fused(q[j], k[j], v[j], pos[j], slots32[j], k_pool, v_pool,
                               head_dim=D, num_qo_heads=Hq, num_kv_heads=Hk, rope_base=base,
                               q_out=q_out[j], k_out=k_out[j])

    def f_eager(i):
        j = i % slices
        torch_rope_pool(q[j], k[j], v[j], pos[j], slots64[j], k_pool, v_pool, inv_freq)

    def f_compiled(i):
        j = i % slices
        compiled(q[j], k[j], v[j], pos[j], slots64[j], k_pool, v_pool, inv_freq)

    half_elems = nbytes // 2 // 2
    c_slices = max(1, min(n_calls, math.ceil(2 * l2 / nbytes)))
    src = torch.empty(c_slices, half_elems, device="cuda", dtype=torch.bfloat16)
    src.uniform_()
    dst = torch.empty_like(src)

    def f_copy(i):
        j = i % c_slices
        dst[j].copy_(src[j])

    # Sanity: ropekv against the eager version on slice 0 (loose: eager rounds twice).
    f_ropekv(0)
    qr, kr = torch_rope_pool(q[0], k[0], v[0], pos[0], slots64[0], k_pool, v_pool, inv_freq)
    err = max((q_out[0].float() - qr.float()).abs().max().item(),
              (k_out[0].float() - kr.float()).abs().max().item())
    if not err < 0.15:
        raise RuntimeError(f"{name} {dtype_name} T={T}: ropekv and eager differ by {err}")

    res = {"model": name, "dtype": dtype_name, "T": T, "bytes": nbytes, "calls": n_calls,
           "slices": slices}
    res["ropekv"] = timer.run(f_ropekv, n_calls, calls_per_graph)
    res["copy"] = timer.run(f_copy, n_calls, calls_per_graph)
    res["torch_eager"] = timer.run(f_eager, n_calls, calls_per_graph)
    res["torch_compile"] = None
    if compiled is not None:
        try:
            res["torch_compile"] = timer.run(f_compiled, n_calls, calls_per_graph)
        except Exception as e:  # noqa: BLE001  (report, keep benchmarking)
            log(f"  torch.compile failed for {name} {dtype_name} T={T}: {type(e).__name__}: "
                f"{str(e)[:300]}")
            args.compile_failed = True
    del q, k, v, q_out, k_out, src, dst
    return res


def peak_copy_gbps(timer):
    n = 1 << 29  # 1 GiB of bf16 each way
    a = torch.empty(n, device="cuda", dtype=torch.bfloat16).uniform_()
    b = torch.empty_like(a)
    us = timer.run(lambda i: b.copy_(a), 4, 4)
    del a, b
    return 2 * n * 2 / (us * 1e-6) / 1e9


def write_outputs(rows, peak, args, meta):
    """peak: the 1 GiB copy; the ceiling drawn and printed is the best copy
    rate of the run (on the H200 here, copies of 600 MB and more ran at only
    ~2.75 TB/s, smaller ones at ~4.25 TB/s)."""
    os.makedirs(args.out, exist_ok=True)
    meta["copy_1GiB_GBps"] = peak
    peak = max([peak] + [r["bytes"] / (r["copy"] * 1e-6) / 1e9 for r in rows])
    with open(os.path.join(args.out, "gpu_bench.json"), "w") as f:
        json.dump({"meta": meta, "peak_copy_GBps": peak, "rows": rows}, f, indent=1)
    hdr = ["model", "dtype", "T", "bytes"]
    with open(os.path.join(args.out, "gpu_bench.csv"), "w") as f:
        f.write(",".join(hdr + [f"{m}_us" for m in IMPLS] + [f"{m}_GBps" for m in IMPLS] +
                         ["ropekv_vs_copy"]) + "\n")
        for r in rows:
            us = [r.get(m) for m in IMPLS]
            gbps = [r["bytes"] / (u * 1e-6) / 1e9 if u else None for u in us]
            ratio = r["copy"] / r["ropekv"]
            f.write(",".join([r["model"], r["dtype"], str(r["T"]), str(r["bytes"])] +
                             ["" if u is None else f"{u:.3f}" for u in us] +
                             ["" if g is None else f"{g:.1f}" for g in gbps] +
                             [f"{ratio:.3f}"]) + "\n")
    lines = [
        f"GPU: {meta['gpu']}; torch {meta['torch']}; CUDA {meta['cuda']}; {meta['date']}",
        f"Best device-to-device copy rate of the run (read + write): {peak:.0f} GB/s "
        f"(1 GiB copy: {meta['copy_1GiB_GBps']:.0f} GB/s)",
        "",
        "| model | dtype | T | ropekv µs | ropekv GB/s | copy GB/s (same bytes) | "
        "ropekv / copy | eager µs | compile µs | speed-up vs eager | vs compile |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        gb = lambda u: r["bytes"] / (u * 1e-6) / 1e9  # noqa: E731
        comp = r.get("torch_compile")
        comp_us = "—" if comp is None else "%.2f" % comp
        comp_x = "—" if comp is None else "%.1fx" % (comp / r["ropekv"])
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['T']} | {r['ropekv']:.2f} | "
            f"{gb(r['ropekv']):.0f} | {gb(r['copy']):.0f} | {r['copy'] / r['ropekv']:.2f} | "
            f"{r['torch_eager']:.2f} | {comp_us} | "
            f"{r['torch_eager'] / r['ropekv']:.1f}x | {comp_x} |")
    with open(os.path.join(args.out, "gpu_bench.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        plot(rows, peak, args, meta)
    except Exception as e:  # noqa: BLE001
        print(f"plot failed: {e}")


def plot(rows, peak, args, meta):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m[0] for m in MODELS]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), sharex=True, sharey=True)
    styles = {"ropekv": ("tab:blue", "o", "ropekv (1 fused launch)"),
              "torch_eager": ("tab:red", "s", "PyTorch eager"),
              "torch_compile": ("tab:orange", "^", "torch.compile"),
              "copy": ("tab:gray", ".", "D2D copy, same bytes")}
    for ax, name in zip(axes.flat, models):
        for impl, (color, marker, label) in styles.items():
            pts = [(r["T"], r["bytes"] / (r[impl] * 1e-6) / 1e9) for r in rows
                   if r["model"] == name and r["dtype"] == "bf16" and r.get(impl)]
            if pts:
                ax.plot(*zip(*pts), color=color, marker=marker, label=label,
                        linestyle="--" if impl == "copy" else "-")
        ax.axhline(peak, color="black", linewidth=0.8, linestyle=":",
                   label=f"copy ceiling {peak:.0f} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{name}, bf16")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("tokens per call (T)")
    for ax in axes[:, 0]:
        ax.set_ylabel("effective GB/s (SPEC §7 bytes / time)")
    axes[0, 0].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"rope_pool_fused on {meta['gpu']} (CUDA graphs, cold L2), {meta['date']}")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "cuda_bandwidth.png"), dpi=110)


# The options of ropekv.rope_pool_fused, each timed against the plain call of
# the same shape: name -> (keyword arguments, extra bytes read per token,
# pool element size or None for q's dtype). Bytes follow SPEC section 7 with
# the pools' real element size and the table / weight reads added.
# (the last: a full-attention layer of transformers' Gemma4TextConfig defaults:
# 8 query and 4 kv heads of 512, which it rotates with proportional RoPE and
# normalises with QK-norm)
OPTION_MODELS = [("Llama-3.1-8B", 32, 8, 128, 500000.0), ("Qwen3-8B", 32, 8, 128, 1000000.0),
                 ("Gemma-4 full", 8, 4, 512, 1000000.0)]
# Shapes timed only when named in --option-models: 32 query and 8 kv heads of
# 512 (more heads of Gemma-4's full-attention size than its defaults: the
# narrow QK-norm's one-wave limit, 16 * SMs / 40 tokens, 52 on 132 SMs).
EXTRA_OPTION_MODELS = [("heads of 512 (32/8)", 32, 8, 512, 1000000.0)]
OPTION_TOKENS = [1, 32, 512, 8192, 32768]


def option_cases(D, dt):
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    proportional = {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    w = torch.rand(D, device="cuda", dtype=dt) + 0.5
    cache = torch.rand(1 << 17, D, device="cuda", dtype=torch.float32)
    return {
        "plain": ({}, 0, None),
        "is_neox=False": ({"is_neox": False}, 0, None),
        "llama3 scaling": ({"rope_scaling": llama3}, 0, None),
        "yarn scaling": ({"rope_scaling": yarn}, 0, None),
        # (Gemma-4's full-attention layers: a quarter of the pairs rotate)
        "proportional scaling": ({"rope_scaling": proportional}, 0, None),
        "cos_sin_cache f32": ({"cos_sin_cache": cache}, 4 * D, None),
        "cos_sin_cache bf16": ({"cos_sin_cache": cache.to(dt)}, 2 * D, None),
        "QK-norm": ({"q_norm_weight": w, "k_norm_weight": w}, 0, None),
        "float32 pools": ({"kv_cache_dtype": "float32"}, 0, 4),
        "fp8_e4m3 pools": ({"kv_cache_dtype": "fp8_e4m3", "k_scale": 0.5, "v_scale": 0.5}, 0, 1),
        "QK-norm + fp8 + yarn": ({"q_norm_weight": w, "k_norm_weight": w, "rope_scaling": yarn,
                                  "kv_cache_dtype": "fp8_e4m3", "k_scale": 0.5, "v_scale": 0.5},
                                 0, 1),
        "QK-norm + float32 pools": ({"q_norm_weight": w, "k_norm_weight": w,
                                     "kv_cache_dtype": "float32"}, 0, 4),
        # (Gemma-4's full-attention layers)
        "QK-norm + proportional": ({"q_norm_weight": w, "k_norm_weight": w,
                                    "rope_scaling": proportional}, 0, None),
    }


def make_pools(pool_esize, Hk, D, dt):
    """k_pool and v_pool, [POOL_ROWS, Hk, D] zeros on the GPU, of pool_esize
    bytes per element: 1 fp8 (as uint8), 2 q's dtype dt, 4 float32."""
    pdt = {1: torch.uint8, 2: dt, 4: torch.float32}[pool_esize]
    return tuple(torch.zeros(POOL_ROWS, Hk, D, device="cuda", dtype=pdt) for _ in range(2))


def bench_options(args, timer, log):
    """Each option's cost next to the plain call and a copy of the same bytes."""
    rows = []
    dt = DTYPES[args.option_dtype]
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 60 * 2**20
    # Every pool format's pools of each (Hk, D), made once and kept, as an
    # engine keeps its KV cache. (Freed and made again between formats, the
    # first format timed after a free ran slower: fp8 pools 1.00x the plain
    # call at T = 8192 where kept pools give 0.92x; gpu_fresh_pools.py.)
    pools = {}
    names = [m[0] for m in OPTION_MODELS + EXTRA_OPTION_MODELS]
    wanted = ([m[0] for m in OPTION_MODELS] if args.option_models is None
              else args.option_models.split(","))
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise SystemExit(f"--option-models: unknown {unknown}; the shapes are {names}")
    models = [m for m in OPTION_MODELS + EXTRA_OPTION_MODELS if m[0] in wanted]
    tokens = (OPTION_TOKENS if args.option_tokens is None
              else [int(t) for t in args.option_tokens.split(",")])
    for model, Hq, Hk, D, base in models:
        # (f16 rows name their dtype; abflags and the docs read bf16 rows as the default)
        name = model if args.option_dtype == "bf16" else f"{model} {args.option_dtype}"
        cases = option_cases(D, dt)
        if args.option_cases is not None:
            cases = {c: cases[c] for c in args.option_cases.split(",")}
        for pe in sorted({c[2] or 2 for c in cases.values()}):
            if (pe, Hk, D) not in pools:
                pools[(pe, Hk, D)] = make_pools(pe, Hk, D, dt)
        for T in tokens:
            g = torch.Generator(device="cuda").manual_seed(T)
            plain_bytes = spec_bytes(T, Hq, Hk, D, 2, T)
            slices = max(1, min(64, math.ceil(2 * l2 / plain_bytes)))
            calls_per_graph = 50 if T <= 512 else 4
            n_calls = calls_per_graph * max(1, min(8, math.ceil(slices / calls_per_graph)))
            q = torch.randn(slices, T, Hq, D, device="cuda", dtype=dt, generator=g)
            k = torch.randn(slices, T, Hk, D, device="cuda", dtype=dt, generator=g)
            v = torch.randn(slices, T, Hk, D, device="cuda", dtype=dt, generator=g)
            q_out, k_out = torch.empty_like(q), torch.empty_like(k)
            pos = torch.randint(0, 1 << 17, (slices, T), device="cuda", dtype=torch.int32,
                                generator=g)
            perm = torch.randperm(POOL_ROWS, device="cuda", generator=g)
            slots = perm[(torch.arange(slices * T, device="cuda") % POOL_ROWS)
                         .view(slices, T)].to(torch.int32)
            for case, (kw, extra, pool_esize) in cases.items():
                pe = pool_esize or 2
                kp, vp = pools[(pe, Hk, D)]
                nbytes = (2 * (2 * T * Hq * D + 3 * T * Hk * D) + pe * 2 * T * Hk * D + 8 * T +
                          extra * T)

                def f(i, kw=kw, kp=kp, vp=vp):
                    j = i % slices
                    ropekv.rope_pool_fused(q[j], k[j], v[j], pos[j], slots[j], kp, vp,
                                           head_dim=D, num_qo_heads=Hq, num_kv_heads=Hk,
                                           rope_base=base, q_out=q_out[j], k_out=k_out[j], **kw)

                us = timer.run(f, n_calls, calls_per_graph)
                half = nbytes // 4
                src = torch.empty(slices, half, device="cuda", dtype=torch.bfloat16)
                dst = torch.empty_like(src)
                copy_us = timer.run(lambda i: dst[i % slices].copy_(src[i % slices]), n_calls,
                                    calls_per_graph)
                del src, dst
                rows.append({"model": name, "T": T, "option": case, "us": us, "bytes": nbytes,
                             "copy_us": copy_us})
                log(f"{name:13s} T={T:6d} {case:22s} {us:9.2f} us {nbytes / us / 1e3:7.0f} GB/s "
                    f"({copy_us / us:.2f} of copy)")
            del q, k, v, q_out, k_out
    pools.clear()
    torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_options.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    lines = ["| model | T | option | µs | vs plain | bytes | GB/s | of copy (same bytes) |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        plain = next((p for p in rows if p["model"] == r["model"] and p["T"] == r["T"]
                      and p["option"] == "plain"), None)
        vs = f"{r['us'] / plain['us']:.2f}" if plain else "-"
        lines.append(f"| {r['model']} | {r['T']} | {r['option']} | {r['us']:.2f} | "
                     f"{vs} | {r['bytes']} | "
                     f"{r['bytes'] / r['us'] / 1e3:.0f} | {r['copy_us'] / r['us']:.2f} |")
    with open(os.path.join(args.out, "gpu_options.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--options", action="store_true",
                    help="time each option of the call against the plain call instead "
                         "(bf16 unless --option-dtype; Llama-3.1-8B, Qwen3-8B and Gemma-4 "
                         "full-attention shapes) -> gpu_options.md")
    ap.add_argument("--option-models", default=None,
                    help="with --options: the shapes to time (names, comma-separated; default all)")
    ap.add_argument("--option-tokens", default=None,
                    help="with --options: the token counts (default %s)"
                         % ",".join(map(str, OPTION_TOKENS)))
    ap.add_argument("--option-dtype", default="bf16", choices=sorted(DTYPES),
                    help="with --options: q, k and v's dtype (default bf16)")
    ap.add_argument("--option-cases", default=None,
                    help="with --options: the cases (names as in the table, comma-separated; "
                         "default all; without plain the vs-plain column reads -)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--models", default=",".join(m[0] for m in MODELS))
    ap.add_argument("--dtypes", default="bf16,f16")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--compile-dtypes", default="bf16",
                    help="dtypes for which torch.compile is timed too")
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="skip torch.compile once the run has taken this long")
    ap.add_argument("--max-graphs", type=int, default=64)
    args = ap.parse_args()
    args.compile_failed = False
    ropekv.set_checked(False)
    t0 = time.time()
    log = lambda s: print(s, flush=True)  # noqa: E731
    props = torch.cuda.get_device_properties(0)
    meta = {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(sys.argv)}
    timer = Timer()
    warm = torch.empty(1 << 28, device="cuda", dtype=torch.bfloat16)
    warm2 = torch.empty_like(warm)
    t_warm = time.time()
    while time.time() - t_warm < 1.0:  # clocks up before the first number
        warm2.copy_(warm)
        torch.cuda.synchronize()
    del warm, warm2
    if args.options:
        bench_options(args, timer, log)
        return
    peak = peak_copy_gbps(timer)
    log(f"{props.name}: {props.multi_processor_count} SMs, "
        f"L2 {getattr(props, 'L2_cache_size', 0) >> 20} MiB, "
        f"peak copy {peak:.0f} GB/s")
    rows = []
    tokens = [int(t) for t in args.tokens.split(",")]
    for model in MODELS:
        if model[0] not in args.models.split(","):
            continue
        for dtype_name in args.dtypes.split(","):
            dt = DTYPES[dtype_name]
            _, Hq, Hk, D, _ = model
            k_pool = torch.empty(POOL_ROWS, Hk, D, device="cuda", dtype=dt)
            v_pool = torch.empty_like(k_pool)
            compiled = None
            if (dtype_name in args.compile_dtypes.split(",") and time.time() - t0 < args.budget_s
                    and not args.compile_failed):
                torch._dynamo.reset()
                compiled = torch.compile(torch_rope_pool, dynamic=True)
            for T in tokens:
                if compiled is not None and (time.time() - t0 > args.budget_s or
                                             args.compile_failed):
                    log("  (time budget spent or a failure: no more torch.compile)")
                    compiled = None
                r = bench_config(model, dtype_name, T, (k_pool, v_pool), timer, compiled, args,
                                 log)
                rows.append(r)
                gb = r["bytes"] / (r["ropekv"] * 1e-6) / 1e9
                comp = r["torch_compile"]
                log(f"{model[0]:13s} {dtype_name} T={T:6d}: ropekv {r['ropekv']:8.2f} us "
                    f"{gb:6.0f} GB/s ({r['copy'] / r['ropekv']:.2f} of copy), eager "
                    f"{r['torch_eager']:8.2f} us, compile "
                    f"{'-' if comp is None else f'{comp:.2f}'} us  [{time.time() - t0:.0f} s]")
            del k_pool, v_pool
            torch.cuda.empty_cache()
    peak = max(peak, peak_copy_gbps(timer))
    write_outputs(rows, peak, args, meta)


if __name__ == "__main__":
    main()
