#!/usr/bin/env python3
"""Side-by-side GPU benchmark of ropekv.rope_pool_fused against the serving
engines' own CUDA kernels for the same step, on the same inputs, in one run.

For every model (gpu_bench.MODELS), dtype and token count T it times, per call:

  ropekv            one fused launch (rotated q, k out of place; k_rot and v
                    scattered into the pools)
  ropekv_cache      the same call with cos_sin_cache= the float32 table the
                    table peers read (rows in place of the computed cos/sin)
  vllm              vLLM's rotary_embedding (NeoX, cos/sin table in the model
                    dtype, in place) then reshape_and_cache_flash
                    (kv_cache_dtype "auto", NHD cache, block size 16): 2 launches
  flashinfer        FlashInfer's RoPE with position ids (BatchQKApplyRotaryPosIds,
                    i.e. apply_rope_pos_ids: angles computed in the kernel) then
                    AppendPagedKVCache (page size 1, the slots as page table)
  flashinfer_cache  the same with cos/sin read from a float32 table
                    (apply_rope_with_cos_sin_cache's kernel)
  sglang            SGLang's fused RoPE + KV-buffer store (the JIT kernel behind
                    apply_rope_with_cos_sin_cache_inplace with
                    fused_set_kv_buffer_arg; float32 table, in place, PDL on
                    sm_90+ as SGLang launches it): 1 launch
  copy              a device-to-device copy of the same number of bytes

The peers are not committed: their sources are copied into .peers/ (git-
ignored) and built there by .peers/tools/build.sh into .peers/build/<peer>/
(see .peers/SOURCES.txt for commits and versions). A peer whose module is
missing, or that does not support a shape (FlashInfer and SGLang have no
head_dim 96 path: PEER_HEAD_DIMS), is skipped and shown as "—".

Method: gpu_bench.Timer (CUDA graphs of 50 calls for T <= 512, fewer above,
CUDA-event timing). Every implementation's graphs are captured first, then
--passes passes each time every implementation once, in an order rotated
every pass, and the median pass is reported: slow drifts of the GPU's
clocks fall on every implementation alike. Inputs rotating
over slices larger than twice the L2 cache, slots a random permutation of a
2^20-row pool, positions random in [0, 2^17); the same arrays for every
implementation. Each peer is checked against ropekv on slice 0 (rotated q and
k, pool rows of k and v) with a loose tolerance (their cos/sin are rounded
differently); mismatches are reported, not fatal.

Writes gpu_peers.json and gpu_peers.md to --out and prints the table
(microseconds per call and each one's ratio to ropekv's time).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import os
import sys
import time
import traceback

import torch

import ropekv

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_bench import DTYPES, MODELS, POOL_ROWS, TOKENS, Timer, peak_copy_gbps, spec_bytes  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = ["vllm", "flashinfer", "flashinfer_cache", "sglang"]
# Checked against "ropekv" like the peers (its own table path).
CHECKED = ["ropekv_cache"] + PEERS
IMPLS = ["ropekv", "ropekv_cache"] + PEERS + ["copy"]
LABELS = {"ropekv": "ropekv", "ropekv_cache": "ropekv (cos/sin table)", "vllm": "vLLM", "flashinfer": "FlashInfer",
          "flashinfer_cache": "FlashInfer (cos/sin table)", "sglang": "SGLang", "copy": "copy"}
MAX_POS = 1 << 17
# The head dims each peer's kernels are built for here (FlashInfer dispatches
# 64/128/256/512, SGLang's fused store is instantiated for 64/128/256); other
# shapes are not called (head_dim 96 crashed a peer's launch).
PEER_HEAD_DIMS = {"flashinfer": (64, 128, 256, 512), "sglang": (64, 128, 256)}
VLLM_BLOCK = 16
# Loose: the peers round cos/sin (vLLM: to the model dtype) and some compute
# the angles with fast intrinsics; ropekv rounds once from accurate fp32.
TOL = {"bf16": 0.125, "f16": 0.03}


def load_peers(build_dir, log):
    """Imports .peers/build/<peer>/ropekv_peer_<peer>.so; returns {name: module}."""
    mods, status = {}, {}
    for name in ["vllm", "flashinfer", "sglang"]:
        path = os.path.join(build_dir, name, f"ropekv_peer_{name}.so")
        if not os.path.exists(path):
            status[name] = f"not built ({path} missing)"
            continue
        try:
            spec = importlib.util.spec_from_file_location(f"ropekv_peer_{name}", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            mods[name] = mod
            status[name] = "loaded"
        except Exception as e:  # noqa: BLE001  (report, benchmark the others)
            status[name] = f"import failed: {type(e).__name__}: {str(e)[:300]}"
    for name, s in status.items():
        log(f"peer {name}: {s}")
    return mods, status


def cos_sin_tables(D, base, dt):
    """[MAX_POS, D] tables, cos of the D/2 angles then their sines, from
    ropekv's angles (fp32 inv_freq rounded once from double, fp32 angle
    pos * inv_freq), cos and sin in double: float32 and the model dtype."""
    inv = (base ** (-torch.arange(0, D, 2, dtype=torch.float64, device="cuda") / D)).float()
    theta = torch.arange(MAX_POS, device="cuda", dtype=torch.float32)[:, None] * inv[None, :]
    t64 = theta.double()
    f32 = torch.cat([t64.cos(), t64.sin()], dim=1).float().contiguous()
    return f32, f32.to(dt)


class Config:
    """The arrays of one (model, dtype, T): inputs rotating over slices,
    outputs, indices in every peer's form."""

    def __init__(self, model, dt, T, pools, args):
        name, Hq, Hk, D, base = model
        self.T, self.Hq, self.Hk, self.D, self.base = T, Hq, Hk, D, base
        esize = torch.tensor([], dtype=dt).element_size()
        self.nbytes = spec_bytes(T, Hq, Hk, D, esize, T, index_bytes=8)
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 60 * 2**20
        self.calls_per_graph = 50 if T <= 512 else (10 if T <= 2048 else 4)
        n_graphs = 1 if args.warm else max(1, min(
            args.max_graphs, math.ceil(2 * l2 / (self.nbytes * self.calls_per_graph))))
        self.n_calls = self.calls_per_graph * n_graphs
        # --warm: every call on the same arrays (in L2 after the first).
        self.slices = S = 1 if args.warm else max(1, min(self.n_calls,
                                                         math.ceil(2 * l2 / self.nbytes)))
        g = torch.Generator(device="cuda").manual_seed(T)
        self.q = torch.randn(S, T, Hq, D, device="cuda", dtype=dt, generator=g)
        self.k = torch.randn(S, T, Hk, D, device="cuda", dtype=dt, generator=g)
        self.v = torch.randn(S, T, Hk, D, device="cuda", dtype=dt, generator=g)
        self.q_out, self.k_out = torch.empty_like(self.q), torch.empty_like(self.k)
        self.pos32 = torch.randint(0, MAX_POS, (S, T), device="cuda", dtype=torch.int32,
                                   generator=g)
        self.pos64 = self.pos32.long()
        perm = torch.randperm(POOL_ROWS, device="cuda", generator=g)
        idx = (torch.arange(S * T, device="cuda") % POOL_ROWS).view(S, T)
        self.slots64 = perm[idx].contiguous()
        self.slots32 = self.slots64.to(torch.int32)
        self.k_pool, self.v_pool = pools
        # FlashInfer: one request of T tokens, page size 1, the slots as its
        # page table (token i -> page slots[i], entry 0).
        self.fi_batch = torch.zeros(T, device="cuda", dtype=torch.int32)
        self.fi_pos = torch.arange(T, device="cuda", dtype=torch.int32)
        self.fi_indptr = torch.tensor([0, T], device="cuda", dtype=torch.int32)
        self.fi_last = torch.ones(1, device="cuda", dtype=torch.int32)
        self.scale = torch.ones(1, device="cuda", dtype=torch.float32)
        half_elems = self.nbytes // 2 // 2
        self.src = torch.empty(S, half_elems, device="cuda", dtype=torch.bfloat16).uniform_()
        self.dst = torch.empty_like(self.src)


def make_fns(c, mods, tables, use_pdl):
    """name -> (fn(i) timing call i on slice i % slices, check() -> (q_rot,
    k_rot) on fresh copies of slice 0). In-place peers rotate q_out / k_out
    (filled from q, k once) in the timed calls: the same bytes move."""
    T, Hq, Hk, D, base, S = c.T, c.Hq, c.Hk, c.D, c.base, c.slices
    f32, tdt = tables
    kp, vp = c.k_pool, c.v_pool
    fns = {}

    def ropekv_call(q, k, v, pos, slots, qo, ko, table):
        ropekv.rope_pool_fused(q, k, v, pos, slots, kp, vp, head_dim=D, num_qo_heads=Hq,
                               num_kv_heads=Hk, rope_base=base, q_out=qo, k_out=ko,
                               cos_sin_cache=table)

    for name, table in (("ropekv", None), ("ropekv_cache", f32)):
        def f_ropekv(i, table=table):
            j = i % S
            ropekv_call(c.q[j], c.k[j], c.v[j], c.pos32[j], c.slots32[j], c.q_out[j],
                        c.k_out[j], table)

        def chk_ropekv(table=table):
            qo, ko = torch.empty_like(c.q[0]), torch.empty_like(c.k[0])
            ropekv_call(c.q[0], c.k[0], c.v[0], c.pos32[0], c.slots32[0], qo, ko, table)
            return qo, ko

        fns[name] = (f_ropekv, chk_ropekv)

    if "vllm" in mods:
        mv = mods["vllm"]
        kc = kp.view(POOL_ROWS // VLLM_BLOCK, VLLM_BLOCK, Hk, D)
        vc = vp.view(POOL_ROWS // VLLM_BLOCK, VLLM_BLOCK, Hk, D)

        def vllm_call(q, k, v, pos, slots):
            mv.rotary_embedding(pos, q, k, D, tdt, True)
            mv.reshape_and_cache_flash(k, v, kc, vc, slots, "auto", c.scale, c.scale)

        def f_vllm(i):
            j = i % S
            vllm_call(c.q_out[j], c.k_out[j], c.v[j], c.pos64[j], c.slots64[j])

        def chk_vllm():
            q, k = c.q[0].clone(), c.k[0].clone()
            vllm_call(q, k, c.v[0], c.pos64[0], c.slots64[0])
            return q, k

        fns["vllm"] = (f_vllm, chk_vllm)

    if "flashinfer" in mods and D in PEER_HEAD_DIMS["flashinfer"]:
        mf = mods["flashinfer"]
        fkc, fvc = kp.view(POOL_ROWS, 1, Hk, D), vp.view(POOL_ROWS, 1, Hk, D)

        def fi_call(q, k, v, pos, slots, qo, ko, table):
            if table is None:
                mf.rope_pos_ids(q, k, qo, ko, pos, base, False)
            else:
                mf.rope_cos_sin_cache(q, k, qo, ko, table, pos, False)
            mf.append_paged_kv_cache(ko, v, c.fi_batch, c.fi_pos, fkc, fvc, slots, c.fi_indptr,
                                     c.fi_last)

        for name, table in (("flashinfer", None), ("flashinfer_cache", f32)):
            def f_fi(i, table=table):
                j = i % S
                fi_call(c.q[j], c.k[j], c.v[j], c.pos32[j], c.slots32[j], c.q_out[j],
                        c.k_out[j], table)

            def chk_fi(table=table):
                qo, ko = torch.empty_like(c.q[0]), torch.empty_like(c.k[0])
                fi_call(c.q[0], c.k[0], c.v[0], c.pos32[0], c.slots32[0], qo, ko, table)
                return qo, ko

            fns[name] = (f_fi, chk_fi)

    if "sglang" in mods and D in PEER_HEAD_DIMS["sglang"]:
        ms = mods["sglang"]
        skc, svc = kp.view(POOL_ROWS, Hk * D), vp.view(POOL_ROWS, Hk * D)

        def sg_call(q, k, v, pos, slots):
            ms.apply_rope_inplace_with_kvcache(q, k, v, skc, svc, f32, pos, slots, use_pdl)

        def f_sg(i):
            j = i % S
            sg_call(c.q_out[j], c.k_out[j], c.v[j], c.pos64[j], c.slots64[j])

        def chk_sg():
            q, k = c.q[0].clone(), c.k[0].clone()
            sg_call(q, k, c.v[0], c.pos64[0], c.slots64[0])
            return q, k

        fns["sglang"] = (f_sg, chk_sg)

    def f_copy(i):
        j = i % S
        c.dst[j].copy_(c.src[j])

    fns["copy"] = (f_copy, None)
    return fns


def check(c, fns, dtype_name):
    """Runs ropekv then each peer once on slice 0 (pool rows zeroed before
    each) and compares. Returns {name: None (ok) or a message}, and the
    max errors."""
    rows = c.slots64[0]
    res, errs = {}, {}

    def run(name):
        c.k_pool[rows] = 0
        c.v_pool[rows] = 0
        qo, ko = fns[name][1]()
        return qo.float(), ko.float(), c.k_pool[rows].float(), c.v_pool[rows].float()

    q_ref, k_ref, kp_ref, vp_ref = run("ropekv")
    v0 = c.v[0].float()
    bad = max((kp_ref - k_ref).abs().max().item(), (vp_ref - v0).abs().max().item())
    if bad != 0:
        res["ropekv"] = f"ropekv's own pool rows differ from its k_rot / v by {bad}"
    for name in CHECKED:
        if name not in fns:
            continue
        try:
            qo, ko, kpo, vpo = run(name)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            res[name] = f"not run: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            continue
        e = {"q": (qo - q_ref).abs().max().item(), "k": (ko - k_ref).abs().max().item(),
             "k_pool": (kpo - k_ref).abs().max().item(), "v_pool": (vpo - v0).abs().max().item()}
        errs[name] = e
        worst = max(e.values())
        if not worst <= TOL[dtype_name]:  # NaN counts as a mismatch
            res[name] = ("MISMATCH: max |peer - ropekv| " +
                         ", ".join(f"{k} {x:.3g}" for k, x in e.items()) +
                         f" (tolerance {TOL[dtype_name]})")
        else:
            res[name] = None
    return res, errs


def bench_one(model, dtype_name, T, pools, tables, mods, timer, args, log):
    dt = DTYPES[dtype_name]
    c = Config(model, dt, T, pools, args)
    fns = make_fns(c, mods, tables, args.use_pdl)
    c.q_out.copy_(c.q)
    c.k_out.copy_(c.k)
    notes, errs = check(c, fns, dtype_name)
    r = {"model": model[0], "dtype": dtype_name, "T": T, "bytes": c.nbytes, "calls": c.n_calls,
         "slices": c.slices, "check": {}, "max_err": errs}
    timed = []
    for name in IMPLS:
        r[name] = None
        if name not in fns:
            continue
        note = notes.get(name)
        if note is not None and note.startswith("not run"):
            r["check"][name] = note
            continue
        if note is not None:
            r["check"][name] = note
        timed.append(name)
    # Every implementation's graphs are captured first; then each pass times
    # every implementation once, in an order rotated every pass, so that
    # drifts of the machine (clocks, temperature) fall on all of them alike.
    # The row keeps each one's median pass (and every pass under "samples").
    r["samples"] = {name: [] for name in timed}
    failed, timers = set(), {}
    for name in timed:
        try:
            timers[name] = timer.prepare(fns[name][0], c.n_calls, c.calls_per_graph)
        except Exception as e:  # noqa: BLE001  (report, keep benchmarking)
            torch.cuda.synchronize()
            failed.add(name)
            r["check"][name] = f"timing failed: {type(e).__name__}: {str(e)[:200]}"
    live = [name for name in timed if name not in failed]
    for k in range(args.passes if live else 0):
        for name in live[k % len(live):] + live[:k % len(live)]:
            if name in failed:
                continue
            try:
                r["samples"][name].append(timers[name]())
            except Exception as e:  # noqa: BLE001  (report, keep benchmarking)
                torch.cuda.synchronize()
                failed.add(name)
                r["check"][name] = f"timing failed: {type(e).__name__}: {str(e)[:200]}"
    live = [name for name in live if name not in failed]
    for name in live:
        r[name] = statistics.median(r["samples"][name])
    # Each pass's time over ropekv's in the same pass (adjacent in time): the
    # median ratio, and in how many passes ropekv was the faster.
    r["paired"] = {}
    if "ropekv" in live:
        base = r["samples"]["ropekv"]
        for name in live:
            if name == "ropekv":
                continue
            ratios = [x / b for x, b in zip(r["samples"][name], base)]
            r["paired"][name] = {"median_ratio": statistics.median(ratios),
                                 "ropekv_faster": sum(x > 1.0 for x in ratios),
                                 "passes": len(ratios)}
    del timers
    del c, fns
    return r


def fmt_row(r):
    base = r["ropekv"]
    cells = []
    for name in IMPLS:
        u = r.get(name)
        if u is None:
            cells.append("—")
        elif name == "ropekv":
            cells.append(f"{u:.2f}")
        else:
            mark = " ⚠" if name in r["check"] else ""
            cells.append(f"{u:.2f} ({u / base:.2f}x){mark}" if base else f"{u:.2f}")
    return cells


def summarize(rows):
    """Per dtype and implementation: geometric mean of time / ropekv's time
    over the rows where both ran, and the number of such rows."""
    out = []
    for dtype_name in dict.fromkeys(r["dtype"] for r in rows):
        for name in IMPLS[1:]:
            ratios = [r[name] / r["ropekv"] for r in rows
                      if r["dtype"] == dtype_name and r.get(name) and r.get("ropekv")]
            if ratios:
                gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
                out.append((dtype_name, name, gm, len(ratios), min(ratios), max(ratios)))
    return out


def write_outputs(rows, meta, status, args):
    os.makedirs(args.out, exist_ok=True)
    summary = summarize(rows)
    with open(os.path.join(args.out, "gpu_peers.json"), "w") as f:
        json.dump({"meta": meta, "peers": status, "rows": rows,
                   "summary": [dict(zip(["dtype", "impl", "geomean_ratio_to_ropekv", "rows",
                                         "min_ratio", "max_ratio"], s)) for s in summary]},
                  f, indent=1)
    lines = [
        f"GPU: {meta['gpu']}; torch {meta['torch']}; CUDA {meta['cuda']}; {meta['date']}",
        "peers: " + ("; ".join(f"{k}: {v}" for k, v in meta.get("sources", {}).items())
                     or "(no .peers/SOURCES.txt)"),
        "peer modules: " + "; ".join(f"{k} {v}" for k, v in status.items()),
        f"SGLang launched with PDL: {meta.get('sglang_pdl')}",
        "",
        f"Microseconds per call (CUDA graphs, {'warm' if args.warm else 'cold'} L2, median of "
        f"{args.passes} interleaved passes) and, in parentheses, the time "
        "relative to ropekv's (above 1: ropekv is faster). ⚠: see the checks below. "
        "—: not built, not supported for the shape, or failed.",
        "",
        "| model | dtype | T | " + " | ".join(LABELS[n] + (" µs" if n == "ropekv" else "")
                                          for n in IMPLS) + " |",
        "|---|---|---:|" + "---:|" * len(IMPLS),
    ]
    for r in rows:
        lines.append(f"| {r['model']} | {r['dtype']} | {r['T']} | " + " | ".join(fmt_row(r)) +
                     " |")
    if summary:
        lines += ["", "Time relative to ropekv, geometric mean over the rows where both ran "
                  "(min, max):", ""]
        for dtype_name, name, gm, n, lo, hi in summary:
            lines.append(f"- {dtype_name} {LABELS[name]}: {gm:.2f}x over {n} rows "
                         f"({lo:.2f} .. {hi:.2f})")
    close = [(r, n, p) for r in rows for n, p in r.get("paired", {}).items()
             if n != "copy" and p["median_ratio"] < 1.1]
    if close:
        lines += ["", "Within 10 % of ropekv or faster, pass by pass (each pass's time over "
                  "ropekv's in the same pass: median, and the passes in which ropekv was "
                  "faster):", ""]
        for r, n, p in close:
            lines.append(f"- {r['model']} {r['dtype']} T={r['T']} {LABELS[n]}: "
                         f"{p['median_ratio']:.3f}x, ropekv faster in {p['ropekv_faster']} "
                         f"of {p['passes']}")
    # One line per message, with the token counts it applies to.
    grouped = {}
    for r in rows:
        for n, msg in r["check"].items():
            grouped.setdefault((r["model"], r["dtype"], n, msg), []).append(str(r["T"]))
    lines += ["", "Checks against ropekv on slice 0 (rotated q, k; pool rows of k, v): "
              f"tolerance bf16 {TOL['bf16']}, f16 {TOL['f16']} (max abs difference).", ""]
    if grouped:
        for (model, dtype_name, n, msg), ts in grouped.items():
            lines.append(f"- {model} {dtype_name} {LABELS[n]} (T={','.join(ts)}): {msg}")
    else:
        lines.append("- every peer result agrees with ropekv within the tolerance")
    if meta.get("skipped_for_time"):
        lines += ["", "Not run (time budget): " + ", ".join(meta["skipped_for_time"])]
    with open(os.path.join(args.out, "gpu_peers.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def read_sources():
    path = os.path.join(ROOT, ".peers", "SOURCES.txt")
    out = {}
    if os.path.exists(path):
        for line in open(path):
            if line.startswith("#") or "|" not in line:
                continue
            parts = [p.strip() for p in line.split("|")]
            out[parts[0]] = f"{parts[1]} {parts[2]}"
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--peers-build", default=os.environ.get(
        "PEERS_BUILD", os.path.join(ROOT, ".peers", "build")))
    ap.add_argument("--models", default=",".join(m[0] for m in MODELS))
    ap.add_argument("--dtypes", default="bf16,f16",
                    help="in this order; a later dtype is skipped once the budget is spent")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="start no new (model, dtype, T) after this many seconds")
    ap.add_argument("--max-graphs", type=int, default=64)
    ap.add_argument("--passes", type=int, default=15,
                    help="times every implementation once per pass, in an order rotated "
                         "every pass, this many passes per shape; reports the median")
    ap.add_argument("--warm", action="store_true",
                    help="every call of a shape on the same arrays, which stay in L2 (the "
                         "default rotates over inputs larger than twice the L2: cold)")
    ap.add_argument("--no-pdl", dest="use_pdl", action="store_false",
                    help="launch SGLang's kernel without programmatic dependent launch "
                         "(default: on for sm_90+, as SGLang does)")
    args = ap.parse_args()
    t0 = time.time()
    log = lambda s: print(s, flush=True)  # noqa: E731
    ropekv.set_checked(False)
    props = torch.cuda.get_device_properties(0)
    args.use_pdl = args.use_pdl and props.major >= 9
    mods, status = load_peers(args.peers_build, log)
    meta = {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "warm": args.warm, "command": " ".join(sys.argv), "sglang_pdl": args.use_pdl,
            "sources": read_sources()}
    timer = Timer()
    warm = torch.empty(1 << 28, device="cuda", dtype=torch.bfloat16)
    warm2 = torch.empty_like(warm)
    t_warm = time.time()
    while time.time() - t_warm < 1.0:  # clocks up before the first number
        warm2.copy_(warm)
        torch.cuda.synchronize()
    del warm, warm2
    meta["copy_1GiB_GBps"] = peak_copy_gbps(timer)
    log(f"{props.name}: {props.multi_processor_count} SMs, peak copy "
        f"{meta['copy_1GiB_GBps']:.0f} GB/s; SGLang PDL {'on' if args.use_pdl else 'off'}")
    rows, skipped = [], []
    tokens = [int(t) for t in args.tokens.split(",")]
    models = [m for m in MODELS if m[0] in args.models.split(",")]
    for dtype_name in args.dtypes.split(","):
        dt = DTYPES[dtype_name]
        for model in models:
            name, Hq, Hk, D, base = model
            if time.time() - t0 > args.budget_s:
                skipped.append(f"{name} {dtype_name}")
                continue
            pools = (torch.empty(POOL_ROWS, Hk, D, device="cuda", dtype=dt),
                     torch.empty(POOL_ROWS, Hk, D, device="cuda", dtype=dt))
            tables = cos_sin_tables(D, base, dt)
            for T in tokens:
                if time.time() - t0 > args.budget_s:
                    skipped.append(f"{name} {dtype_name} T={T}")
                    continue
                try:
                    r = bench_one(model, dtype_name, T, pools, tables, mods, timer, args, log)
                except Exception:  # noqa: BLE001  (a failure in one shape: report, go on)
                    log(f"{name} {dtype_name} T={T}: FAILED\n{traceback.format_exc()}")
                    torch.cuda.empty_cache()
                    continue
                rows.append(r)
                cells = " ".join(f"{n} {r[n]:.2f}" if r[n] is not None else f"{n} -"
                                 for n in IMPLS)
                log(f"{name:13s} {dtype_name} T={T:6d}: {cells} us  [{time.time() - t0:.0f} s]")
                for n, msg in r["check"].items():
                    log(f"    {n}: {msg}")
                write_outputs(rows, meta, status, args)  # partial results survive a timeout
            del pools, tables
            torch.cuda.empty_cache()
    meta["skipped_for_time"] = skipped
    if skipped:
        log(f"skipped (time budget {args.budget_s:.0f} s): {', '.join(skipped)}")
    lines = write_outputs(rows, meta, status, args)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
