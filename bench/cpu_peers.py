#!/usr/bin/env python3
"""Python-level CPU benchmark: ropekv against its peers, same shapes, same run.

For each model shape (Llama-3.1-8B, Qwen2.5-7B, Gemma-2-9B), dtype (f32,
bf16), token count T and thread count, times one call of:

  ropekv     ropekv.rope_pool_fused on PyTorch CPU tensors (the drop-in call:
             it allocates q_rot/k_rot, validates, releases the GIL); also
             with q_out/k_out given (preallocated outputs, no allocation:
             a fresh output of 100+ MB costs its page faults on every call);
  torch      PyTorch eager, the same math as Hugging Face's
             apply_rotary_pos_emb: cos/sin from positions x inv_freq (fp32, cast
             to the dtype), q*cos + rotate_half(q)*sin in the dtype, then
             k_pool.index_copy_(0, slots, k_rot) and v_pool.index_copy_(0,
             slots, v); torch.set_num_threads(threads);
  mlx        the original's fallback on MLX's CPU build: mx.fast.rope on q and
             on k (each token its own offset: shape [T, H, 1, D], offset =
             positions), then k_pool[slots] = k_rot, v_pool[slots] = v, and
             mx.eval. MLX has no thread-count setting: run once per shape and
             listed under every thread count;
  memcpy     numpy copy of the same traffic (bytes/2 read + bytes/2 written,
             one thread), the machine's copy bandwidth in this run.

Bytes per call are SPEC section 7's: E*(2*T*Hq*D + 3*T*Hk*D + 2*W*Hk*D) +
T*(4 + 4), W = T. Caches are cold as in bench/cpu_bench.cc: pools of at least
2x the last-level cache, slots a random permutation of their rows, and every
call uses the next of enough input sets to cover 2x the last-level cache.
The time of a call is the median over batches of calls.

Also prints the per-call time of ropekv.rope_pool_fused at T = 1 with warm
inputs (the Python-level overhead over the C++ call), and the C++ call's time
measured through the same arrays (q_out/k_out given: no allocation).

Results go to a table on stdout and to a CSV (--csv). A ggml CSV made by the
separate ggml harness (see docs/performance.md) can be merged with --ggml-csv;
its rows are printed in the table.

Usage:
  .venv/bin/python bench/cpu_peers.py --csv build-bench/cpu_peers.csv
  .venv/bin/python bench/cpu_peers.py --models Llama-3.1-8B --tokens 1 1024 --threads 1
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

import ropekv

MODELS = {
    "Llama-3.1-8B": (32, 8, 128, 500000.0),
    "Qwen2.5-7B": (28, 4, 128, 1000000.0),
    "Gemma-2-9B": (16, 8, 256, 10000.0),
}
TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def llc_bytes() -> int:
    best = 0
    for i in range(8):
        path = f"/sys/devices/system/cpu/cpu0/cache/index{i}/size"
        try:
            with open(path) as f:
                v = f.read().strip()
        except OSError:
            continue
        n = int(v.rstrip("KMG"))
        n <<= {"K": 10, "M": 20, "G": 30}.get(v[-1], 0)
        best = max(best, n)
    return best or 32 << 20


def spec_bytes(hq: int, hk: int, d: int, T: int, e: int) -> int:
    return e * (2 * T * hq * d + 3 * T * hk * d + 2 * T * hk * d) + T * 8


def time_calls(fn, n_sets: int, min_time: float, batches: int = 7) -> float:
    """Median seconds per call of fn(i), i cycling over n_sets."""
    # Warm-up: at least 3 calls (or every set, when fewer) and a batch's
    # length of time, so that a process's first calls (one-time set-up, clock
    # ramp) are not timed (with one set and 3 calls, the first T = 1 row once
    # read 15.5 us per call against 10-12 us since).
    i, t_end = 0, time.perf_counter() + min_time / batches
    while i < min(n_sets, 3) or time.perf_counter() < t_end:
        fn(i % n_sets)
        i += 1
    # calls per batch so that a batch lasts about min_time / batches
    t0 = time.perf_counter()
    fn(i % n_sets)
    i += 1
    one = max(time.perf_counter() - t0, 1e-7)
    per_batch = max(1, int(min_time / batches / one))
    results = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(per_batch):
            fn(i % n_sets)
            i += 1
        results.append((time.perf_counter() - t0) / per_batch)
    return statistics.median(results)


class Case:
    """Input sets, pools and slots of one (model, dtype, T), in torch."""

    def __init__(self, model: str, dtype: str, T: int, warm: bool = False, seed: int = 0):
        hq, hk, d, base = MODELS[model]
        self.hq, self.hk, self.d, self.base, self.T = hq, hk, d, base, T
        self.dtype = TORCH_DTYPES[dtype]
        e = 4 if dtype == "f32" else 2
        self.e = e
        llc = llc_bytes()
        row = hk * d * e
        P = max(2 * T, -(-2 * llc // row))
        set_bytes = e * (2 * T * hq * d + 3 * T * hk * d) + 8 * T
        self.n_sets = 1 if warm else max(1, min(4096, -(-2 * llc // set_bytes)))
        self.n_slot_sets = max(1, min(4096, -(-2 * llc // (2 * T * row))))
        g = torch.Generator().manual_seed(seed)
        self.k_pool = torch.zeros(P, hk, d, dtype=self.dtype)
        self.v_pool = torch.zeros(P, hk, d, dtype=self.dtype)
        self.sets = []
        for _ in range(self.n_sets):
            q = (torch.rand(T, hq, d, generator=g) * 2 - 1).to(self.dtype)
            k = (torch.rand(T, hk, d, generator=g) * 2 - 1).to(self.dtype)
            v = (torch.rand(T, hk, d, generator=g) * 2 - 1).to(self.dtype)
            p0 = int(torch.randint(0, 131072, (1,), generator=g))
            pos = torch.arange(p0, p0 + T, dtype=torch.int32)
            self.sets.append((q, k, v, pos, torch.empty_like(q), torch.empty_like(k)))
        perm = torch.randperm(P, generator=g)
        self.slots, nxt = [], 0
        for _ in range(self.n_slot_sets):
            if nxt + T > P:
                perm = torch.randperm(P, generator=g)
                nxt = 0
            self.slots.append(perm[nxt : nxt + T].to(torch.int32))
            nxt += T
        self.slots64 = [s.to(torch.int64) for s in self.slots]
        self.n_calls = max(self.n_sets, self.n_slot_sets)
        self.inv_freq = (1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))).float()
        self.bytes = spec_bytes(hq, hk, d, T, e)


def bench_ropekv(c: Case, threads: int, min_time: float, out_given: bool = False) -> float:
    kw = dict(head_dim=c.d, num_qo_heads=c.hq, num_kv_heads=c.hk, rope_base=c.base, num_threads=threads)

    def call(i):
        q, k, v, pos, qo, ko = c.sets[i % c.n_sets]
        if out_given:
            ropekv.rope_pool_fused(q, k, v, pos, c.slots[i % c.n_slot_sets], c.k_pool, c.v_pool,
                                   q_out=qo, k_out=ko, **kw)
        else:
            ropekv.rope_pool_fused(q, k, v, pos, c.slots[i % c.n_slot_sets], c.k_pool, c.v_pool, **kw)

    return time_calls(call, c.n_calls, min_time)


def bench_torch(c: Case, threads: int, min_time: float) -> float:
    torch.set_num_threads(threads)
    half = c.d // 2

    def rotate_half(x):
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def call(i):
        q, k, v, pos, _, _ = c.sets[i % c.n_sets]
        slots = c.slots64[i % c.n_slot_sets]
        freqs = pos.float()[:, None] * c.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos().to(c.dtype), emb.sin().to(c.dtype)
        q_rot = q * cos + rotate_half(q) * sin
        k_rot = k * cos + rotate_half(k) * sin
        c.k_pool.index_copy_(0, slots, k_rot)
        c.v_pool.index_copy_(0, slots, v)
        return q_rot

    return time_calls(call, c.n_calls, min_time)


def bench_mlx(c: Case, min_time: float) -> float | None:
    try:
        import mlx.core as mx
    except ImportError:
        return None
    mx.set_default_device(mx.cpu)
    mdt = {torch.float32: mx.float32, torch.bfloat16: mx.bfloat16}[c.dtype]

    def to_mx(t):
        return mx.array(t.float().numpy()).astype(mdt)

    sets = [(to_mx(q), to_mx(k), to_mx(v), mx.array(pos.numpy())) for q, k, v, pos, _, _ in c.sets]
    slots = [mx.array(s.numpy()) for s in c.slots]
    pools = [to_mx(c.k_pool), to_mx(c.v_pool)]
    mx.eval(*[a for s in sets for a in s], *slots, *pools)
    T, hq, hk, d = c.T, c.hq, c.hk, c.d

    def call(i):
        q, k, v, pos = sets[i % c.n_sets]
        sl = slots[i % c.n_slot_sets]
        q_rot = mx.fast.rope(q.reshape(T, hq, 1, d), d, traditional=False, base=c.base, scale=1.0,
                             offset=pos).reshape(T, hq, d)
        k_rot = mx.fast.rope(k.reshape(T, hk, 1, d), d, traditional=False, base=c.base, scale=1.0,
                             offset=pos).reshape(T, hk, d)
        kp, vp = pools
        kp[sl] = k_rot
        vp[sl] = v
        pools[0], pools[1] = kp, vp
        mx.eval(q_rot, k_rot, kp, vp)

    return time_calls(call, c.n_calls, min_time)


def bench_memcpy(n_bytes: int, min_time: float) -> float:
    """Seconds per numpy copy of n_bytes // 2 bytes, rotating over 2x LLC."""
    half = max(64, n_bytes // 2)
    n = max(1, min(4096, -(-2 * llc_bytes() // half)))
    src = [np.ones(half, dtype=np.uint8) for _ in range(n)]
    dst = [np.zeros(half, dtype=np.uint8) for _ in range(n)]
    return time_calls(lambda i: np.copyto(dst[i], src[i]), n, min_time)


def python_overhead(min_time: float) -> list[dict]:
    """ropekv.rope_pool_fused at T = 1, warm inputs, Llama-3.1-8B shapes, and
    where the time goes: the binding alone (ropekv._ext.run, the nanobind
    call that imports the 9 arrays and runs the C++ op) with PyTorch tensors
    and with numpy arrays of the same data."""
    from ropekv import _ext

    rows = []
    for dtype in ("bf16", "f32"):
        c = Case("Llama-3.1-8B", dtype, 1, warm=True)
        t_alloc = bench_ropekv(c, 1, min_time)
        t_out = bench_ropekv(c, 1, min_time, out_given=True)
        q, k, v, pos, qo, ko = c.sets[0]
        args_t = (q, k, v, pos, c.slots[0], c.k_pool, c.v_pool, qo, ko)
        bf16 = dtype == "bf16"

        def np_view(t):
            return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()

        args_n = tuple(np_view(t) for t in args_t)
        # The float arrays, passed as int16 views: the binding's dtype_views
        # has 2 bits per array (argument order q, k, v, positions, slots,
        # k_pool, v_pool, q_out, k_out).
        mask = sum(ropekv._VIEW_BF16 << (2 * i) for i in (0, 1, 2, 5, 6, 7, 8)) if bf16 else 0
        tail = (c.d, c.hq, c.hk, c.base)
        if "rotary_dim" in (_ext.run.__doc__ or ""):  # newer binding: 0 = the whole head
            tail += (0,)
        t_ext_torch = time_calls(lambda i: _ext.run(*args_t, *tail, 0, 0, 0, 1, False), 1, min_time)
        t_ext_np = time_calls(lambda i: _ext.run(*args_n, *tail, mask, 0, 0, 1, False), 1, min_time)
        # The drop-in call with numpy arrays (bf16 as ml_dtypes.bfloat16).
        t_np = float("nan")
        try:
            if bf16:
                import ml_dtypes

                np_in = [a.view(ml_dtypes.bfloat16) if a.dtype == np.int16 else a for a in args_n[:7]]
            else:
                np_in = list(args_n[:7])
            kw = dict(head_dim=c.d, num_qo_heads=c.hq, num_kv_heads=c.hk, rope_base=c.base, num_threads=1)
            t_np = time_calls(lambda i: ropekv.rope_pool_fused(*np_in, **kw), 1, min_time)
        except ImportError:
            pass
        rows.append(dict(dtype=dtype, us_default=t_alloc * 1e6, us_out_given=t_out * 1e6,
                         us_ext_torch=t_ext_torch * 1e6, us_ext_numpy=t_ext_np * 1e6,
                         us_numpy=t_np * 1e6))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--dtypes", nargs="+", default=["f32", "bf16"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 128, 1024, 8192])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--impls", nargs="+", default=["ropekv", "torch", "mlx", "memcpy"])
    ap.add_argument("--min-time", type=float, default=0.4, help="seconds per measurement")
    ap.add_argument("--csv", default=None, help="write the results here")
    ap.add_argument("--ggml-csv", default=None,
                    help="merge ggml harness rows (impl,model,dtype,T,threads,us_per_call,GB/s)")
    args = ap.parse_args()

    print(f"# {datetime.datetime.now().isoformat(timespec='seconds')}  {platform.node()}  "
          f"ropekv {ropekv.__version__} cpu_target={ropekv.cpu_target()}  torch {torch.__version__}  "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"# command: {' '.join(sys.argv)}")

    rows = []
    over = python_overhead(args.min_time)
    for r in over:
        print(f"ropekv.rope_pool_fused T=1 Llama-3.1-8B {r['dtype']} (torch tensors, warm): "
              f"{r['us_default']:.2f} us/call; q_out/k_out given: {r['us_out_given']:.2f} us; "
              f"binding alone (_ext.run): {r['us_ext_torch']:.2f} us with torch tensors, "
              f"{r['us_ext_numpy']:.2f} us with numpy arrays; the drop-in call with numpy arrays: "
              f"{r['us_numpy']:.2f} us")
        for key, name in (("us_ext_torch", "ropekv-ext-run-torch-T1-warm"),
                          ("us_ext_numpy", "ropekv-ext-run-numpy-T1-warm"),
                          ("us_numpy", "ropekv-python-numpy-T1-warm")):
            rows.append(dict(impl=name, model="Llama-3.1-8B", dtype=r["dtype"], T=1, threads=1,
                             us_per_call=r[key], gbps=""))
        rows.append(dict(impl="ropekv-python-T1-warm", model="Llama-3.1-8B", dtype=r["dtype"], T=1,
                         threads=1, us_per_call=r["us_default"], gbps=""))
        rows.append(dict(impl="ropekv-python-T1-warm-out-given", model="Llama-3.1-8B", dtype=r["dtype"],
                         T=1, threads=1, us_per_call=r["us_out_given"], gbps=""))

    ggml = {}
    if args.ggml_csv and os.path.exists(args.ggml_csv):
        with open(args.ggml_csv) as f:
            for line in f:
                parts = line.strip().split(",")
                if len(parts) != 7 or parts[0] != "ggml":
                    continue
                _, model, dt, T, th, us, gbps = parts
                dt = "bf16" if dt == "f16" else dt  # ggml has no bf16 rope: f16, same bytes
                ggml[(model, dt, int(T), int(th))] = (float(us), float(gbps))

    hdr = (f"{'model':<13} {'dtype':<5} {'T':>5} {'thr':>3} | {'ropekv us':>10} {'GB/s':>6} "
           f"{'out-given':>10} | "
           f"{'torch us':>10} {'x':>6} | {'mlx us':>10} {'x':>6} | {'ggml us':>10} {'x':>6} | "
           f"{'memcpy GB/s':>11} {'ropekv/memcpy':>13}")
    print(hdr)
    print("-" * len(hdr))
    for model in args.models:
        for dtype in args.dtypes:
            for T in args.tokens:
                c = Case(model, dtype, T)
                mc = bench_memcpy(c.bytes, args.min_time) if "memcpy" in args.impls else None
                mlx_t = bench_mlx(c, args.min_time) if "mlx" in args.impls else None
                if mc is not None:
                    rows.append(dict(impl="memcpy-numpy", model=model, dtype=dtype, T=T, threads=1,
                                     us_per_call=mc * 1e6, gbps=2 * (c.bytes // 2) / mc * 1e-9))
                if mlx_t is not None:
                    rows.append(dict(impl="mlx", model=model, dtype=dtype, T=T, threads=0,
                                     us_per_call=mlx_t * 1e6, gbps=c.bytes / mlx_t * 1e-9))
                for th in args.threads:
                    r_t = bench_ropekv(c, th, args.min_time) if "ropekv" in args.impls else None
                    r_o = (bench_ropekv(c, th, args.min_time, out_given=True)
                           if "ropekv" in args.impls else None)
                    t_t = bench_torch(c, th, args.min_time) if "torch" in args.impls else None
                    for name, t in (("ropekv", r_t), ("ropekv-out-given", r_o), ("torch", t_t)):
                        if t is not None:
                            rows.append(dict(impl=name, model=model, dtype=dtype, T=T, threads=th,
                                             us_per_call=t * 1e6, gbps=c.bytes / t * 1e-9))
                    g = ggml.get((model, dtype, T, th))
                    if g is not None:
                        rows.append(dict(impl="ggml", model=model, dtype=dtype, T=T, threads=th,
                                         us_per_call=g[0], gbps=g[1]))

                    def cell(t):
                        if t is None or r_t is None:
                            return f"{'-':>10} {'-':>6}"
                        return f"{t * 1e6:>10.2f} {t / r_t:>6.1f}"

                    print(f"{model:<13} {dtype:<5} {T:>5} {th:>3} | "
                          f"{(r_t or 0) * 1e6:>10.2f} {c.bytes / r_t * 1e-9 if r_t else 0:>6.1f} "
                          f"{(r_o or 0) * 1e6:>10.2f} | "
                          f"{cell(t_t)} | {cell(mlx_t)} | "
                          f"{cell(g[0] * 1e-6 if g else None)} | "
                          + (f"{2 * (c.bytes // 2) / mc * 1e-9:>11.1f} " if mc else f"{'-':>11} ")
                          + (f"{mc / r_t:>13.2f}" if mc and r_t else f"{'-':>13}"), flush=True)
                del c
    print("(x = time of the peer / time of ropekv; mlx: MLX's own threading, same row for every "
          "thread count; ggml: f16 for the bf16 rows, its rope has no bf16)")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["impl", "model", "dtype", "T", "threads", "us_per_call", "gbps"])
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
