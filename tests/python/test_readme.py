"""The README's Python example, run as written, and the claims its comments
make checked: the pool rows the slots name hold k_rot and v (slot -1 writes
none), every other row keeps its zeros, and q_rot / k_rot match the float64
reference within one rounding of bf16."""

from __future__ import annotations

import pathlib
import re

import numpy as np

from reference import assert_close, bits, check_pool_rows, hf_inv_freq, rope

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_python_example_runs_and_does_what_it_says():
    blocks = python_blocks()
    assert blocks, "README.md has no ```python block"
    ns: dict = {}
    exec(compile(blocks[0], "README.md (python example)", "exec"), ns)  # noqa: S102
    q, k, v = ns["q"], ns["k"], ns["v"]
    positions, slots = ns["positions"], ns["slots"]
    k_pool, v_pool = ns["k_pool"], ns["v_pool"]
    q_rot, k_rot = ns["q_rot"], ns["k_rot"]
    base = 500000.0
    ref_q, mag_q = rope(q, positions, base)
    ref_k, mag_k = rope(k, positions, base)
    assert_close(q_rot, ref_q, mag_q, "README q_rot")
    assert_close(k_rot, ref_k, mag_k, "README k_rot")
    zeros = np.zeros_like(k_pool)
    check_pool_rows(k_pool, v_pool, zeros, zeros, slots, k_rot, v, "README")
    # The comment's own example rows.
    assert bits(k_pool[17]) == bits(k_rot[0]) and bits(v_pool[400]) == bits(v[3])


def test_readme_per_layer_type_example():
    """The second example (Gemma-4's full-attention layers: proportional RoPE
    with QK-norm), run on its own as a reader who copies it would: q_rot /
    k_rot against the float64 reference, the pool rows, and its comment's
    count of the pairs that rotate."""
    blocks = python_blocks()
    assert len(blocks) >= 2, "README.md lost its per-layer-type example"
    ns: dict = {}
    exec(compile(blocks[1], "README.md (per-layer-type example)", "exec"), ns)  # noqa: S102
    full, D = ns["full"], ns["D"]
    inv = hf_inv_freq(full["rope_theta"], D, full)
    assert np.count_nonzero(inv) == 64 and inv.shape == (256,)
    for x, w, got in ((ns["q"], ns["q_norm_weight"], ns["q_rot"]),
                      (ns["k"], ns["k_norm_weight"], ns["k_rot"])):
        ref, mag = rope(x, ns["positions"], full["rope_theta"], inv_freq=inv, norm_weight=w)
        assert_close(got, ref, mag, "README per-layer-type example")
    zeros = np.zeros_like(ns["k_pool"])
    check_pool_rows(ns["k_pool"], ns["v_pool"], zeros, zeros, ns["slots"], ns["k_rot"], ns["v"],
                    "README per-layer-type example")
