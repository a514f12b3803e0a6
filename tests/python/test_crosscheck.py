"""ropekv against other implementations of the same RoPE, at ordinary
positions, to bf16 tolerance: MLX's mx.fast.rope (traditional=False, the
original's own primitive) and the Hugging Face rotate-half formula."""

from __future__ import annotations

import numpy as np
import pytest

import ropekv
from reference import MODELS

RNG = np.random.default_rng()
BF16_EPS = 2.0**-8  # half an ulp of bf16 relative


def ours(q, positions, base):
    T, H, D = q.shape
    kp = np.zeros((1, H, D), np.float32)
    q_rot, _, _, _ = ropekv.rope_pool_fused(
        q, q, q, positions, np.full(T, -1, np.int32), kp, kp.copy(), head_dim=D,
        num_qo_heads=H, num_kv_heads=H, rope_base=base)
    return q_rot


def hf_rotate_half(q, positions, base):
    """Hugging Face transformers' apply_rotary_pos_emb, in float32 numpy:
    q * cos + rotate_half(q) * sin with cos/sin of cat(freqs, freqs)."""
    D = q.shape[-1]
    inv_freq = 1.0 / (base ** (np.arange(0, D, 2, dtype=np.int64).astype(np.float32) / D))
    freqs = positions.astype(np.float32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]
    rot = np.concatenate([-q[..., D // 2 :], q[..., : D // 2]], axis=-1)
    return (q * cos + rot * sin).astype(np.float32)


def mlx_rope(q, positions, base):
    """mx.fast.rope per token (offset = the token's position)."""
    mx = pytest.importorskip("mlx.core")  # (CI installs MLX: scripts/test.sh checks)
    T, H, D = q.shape
    out = np.empty_like(q)
    for t in range(T):
        x = mx.array(q[t][:, None, :])  # [H, L=1, D]
        y = mx.fast.rope(x, D, traditional=False, base=base, scale=1.0, offset=int(positions[t]))
        out[t] = np.array(y)[:, 0, :]
    return out


def check(got, want, q):
    D = q.shape[-1]
    scale = np.abs(q[..., : D // 2]) + np.abs(q[..., D // 2 :])
    scale = np.concatenate([scale, scale], axis=-1)
    err = np.abs(got - want)
    assert (err <= BF16_EPS * scale + 1e-6).all(), f"max err {err.max()}"


@pytest.mark.parametrize("model", MODELS, ids=[m[0] for m in MODELS])
def test_against_hf_formula(model):
    _, Hq, _, D, base = model
    T = 37
    q = RNG.standard_normal((T, Hq, D)).astype(np.float32)
    pos = RNG.integers(0, 4096, T).astype(np.int32)
    check(ours(q, pos, base), hf_rotate_half(q, pos, base), q)


@pytest.mark.parametrize("model", MODELS, ids=[m[0] for m in MODELS])
def test_against_mlx_fast_rope(model):
    _, Hq, _, D, base = model
    T = 9
    q = RNG.standard_normal((T, Hq, D)).astype(np.float32)
    pos = RNG.integers(0, 4096, T).astype(np.int32)
    check(ours(q, pos, base), mlx_rope(q, pos, base), q)


def test_crosscheck_can_fail():
    """The comparison is sharp: a rotation by the wrong position fails it."""
    q = RNG.standard_normal((4, 8, 128)).astype(np.float32)
    pos = np.array([10, 20, 30, 40], np.int32)
    with pytest.raises(AssertionError):
        check(ours(q, pos + 1, 1e4), hf_rotate_half(q, pos, 1e4), q)
