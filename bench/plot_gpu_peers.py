#!/usr/bin/env python3
"""Plots bench/gpu_peers.py's results into docs/cuda_peers_bandwidth.png.

One panel per model, for one dtype: effective bandwidth (SPEC section 7
bytes of the call / its time, the same bytes for every implementation)
against the token count T, one line per implementation; the device-to-device
copy of the same bytes, measured in the same run, is the dotted ceiling.

Usage (no GPU needed: it reads the JSON the GPU run wrote):
  .venv/bin/python bench/plot_gpu_peers.py docs/data/gpu_peers_2026-11-30_table_loads.json \
      --dtype bf16 --out docs/cuda_peers_bandwidth.png
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# name in gpu_peers.json -> (label, line style)
IMPLS = {
    "ropekv": ("ropekv", dict(color="tab:blue", marker="o", lw=2)),
    "ropekv_cache": ("ropekv, cos/sin table", dict(color="tab:blue", marker=".", ls="--", lw=1)),
    "sglang": ("SGLang (fused, table, PDL)", dict(color="tab:green", marker="^")),
    "flashinfer": ("FlashInfer (2 launches)", dict(color="tab:orange", marker="s")),
    "flashinfer_cache": ("FlashInfer, cos/sin table", dict(color="tab:orange", marker=".",
                                                           ls="--", lw=1)),
    "vllm": ("vLLM (2 launches)", dict(color="tab:red", marker="D")),
    "copy": ("copy of the same bytes", dict(color="black", ls=":", lw=1.5)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", help="gpu_peers.json of a bench/gpu_peers.py run")
    ap.add_argument("--dtype", help="default: the first dtype in the JSON")
    ap.add_argument("--out", default="docs/cuda_peers_bandwidth.png")
    args = ap.parse_args()
    with open(args.json) as f:
        data = json.load(f)
    dtype = args.dtype or data["rows"][0]["dtype"]
    rows = [r for r in data["rows"] if r["dtype"] == dtype]
    if not rows:
        raise SystemExit(f"no {dtype} rows in {args.json}")
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 4), sharey=True,
                             squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = sorted((r for r in rows if r["model"] == model), key=lambda r: r["T"])
        for name, (label, style) in IMPLS.items():
            pts = [(r["T"], r["bytes"] / (r[name] * 1e3)) for r in mine if r.get(name)]
            if pts:
                ax.plot(*zip(*pts), label=label, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{model}, {dtype}")
        ax.set_xlabel("tokens per call (T)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("effective GB/s (SPEC §7 bytes / time)")
    axes[0][0].legend(fontsize=7, loc="upper left")  # the first model has every peer
    meta = data.get("meta", {})
    fig.suptitle(f"{meta.get('gpu', '')}, {meta.get('date', '')}: CUDA graphs, cold L2 "
                 "(bench/gpu_peers.py)", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
