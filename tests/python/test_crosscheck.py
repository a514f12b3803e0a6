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


# --- transformers' own modules, at long positions ---------------------------------------
# transformers computes inv_freq in fp32 (1 / base ** (arange / dim), its scalings in fp32
# too); ropekv rounds the double value once. Where the two inv_freq differ (by 1-3 ulp),
# the angles differ by position * that, plus each one's fp32 rounding (README, "Against
# transformers and vLLM"). An engine's own
# cos/sin table, passed as cos_sin_cache, gives its angles exactly.

LLAMA31 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
QWEN25_YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
               "original_max_position_embeddings": 32768}


def hf_llama(params, D, positions, q):
    """transformers' LlamaRotaryEmbedding and apply_rotary_pos_emb (fp32), and
    its cos/sin rows [max(positions) + 1, D/2] each."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from transformers.models.llama import modeling_llama

    cfg = transformers.LlamaConfig(hidden_size=D * 8, num_attention_heads=8, head_dim=D,
                                   max_position_embeddings=131072, rope_parameters=dict(params))
    if getattr(cfg, "rope_parameters", None) is None:
        pytest.skip("transformers < 5 has no rope_parameters")
    emb = modeling_llama.LlamaRotaryEmbedding(cfg)
    x = torch.from_numpy(q).transpose(0, 1)[None]  # [1, H, T, D]
    cos, sin = emb(x, torch.from_numpy(positions.astype(np.int64))[None])
    out, _ = modeling_llama.apply_rotary_pos_emb(x, x, cos, sin)
    table_pos = torch.arange(int(positions.max()) + 1)[None]
    tcos, tsin = emb(x, table_pos)
    table = torch.cat([tcos[0, :, : D // 2], tsin[0, :, : D // 2]], dim=-1).numpy()
    return out[0].transpose(0, 1).numpy(), emb.inv_freq.numpy(), table


def pair_scale(q):
    D = q.shape[-1]
    s = np.abs(q[..., : D // 2]) + np.abs(q[..., D // 2 :])
    return np.concatenate([s, s], axis=-1)


@pytest.mark.parametrize("params", [LLAMA31, QWEN25_YARN], ids=["llama-3.1", "qwen2.5-yarn"])
def test_transformers_at_long_positions(params):
    """Within what the two inv_freq's difference and the angles' fp32
    rounding allow of transformers' output at positions up to 131071, through
    rope_scaling as a transformers 5 config holds it; within fp32 rounding
    with its cos/sin as the table."""
    D, H, T = 128, 4, 40
    q = RNG.standard_normal((T, H, D)).astype(np.float32)
    pos = np.concatenate([[131071, 65535, 32767, 8191, 0],
                          RNG.integers(0, 131072, T - 5)]).astype(np.int32)
    want, hf_inv, table = hf_llama(params, D, pos, q)
    kp = np.zeros((1, H, D), np.float32)
    kw = dict(head_dim=D, num_qo_heads=H, num_kv_heads=H, rope_base=params["rope_theta"])
    got = ropekv.rope_pool_fused(q, q, q, pos, np.full(T, -1, np.int32), kp, kp.copy(),
                                 rope_scaling=params, **kw)[0]
    # |d theta| <= position * |d inv_freq| + the two angles' roundings (half an ulp each).
    inv, factor = ropekv.rope_inv_freq(D, params["rope_theta"], None, params)
    p32 = pos[:, None].astype(np.float32)
    ang = np.maximum(p32 * inv, p32 * hf_inv)
    dtheta = (pos[:, None] * np.abs(inv.astype(np.float64) - hf_inv)
              + np.spacing(ang.astype(np.float32)))
    bound = (np.concatenate([dtheta, dtheta], axis=-1)[:, None, :] * factor + 8 * 2.0**-24)
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= bound * pair_scale(q) + 1e-7).all(), f"max err {err.max()}"
    # The engine's own angles: its table as cos_sin_cache (the attention factor is in it).
    got = ropekv.rope_pool_fused(q, q, q, pos, np.full(T, -1, np.int32), kp, kp.copy(),
                                 cos_sin_cache=table, **kw)[0]
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= 4 * 2.0**-24 * pair_scale(q) + 1e-7).all(), f"max err {err.max()}"


@pytest.mark.parametrize("params", [LLAMA31, QWEN25_YARN, {"rope_type": "default", "rope_theta": 1e6}],
                         ids=["llama-3.1", "qwen2.5-yarn", "qwen3"])
def test_angles_against_transformers(params):
    """README's numbers: below position 4096, 32768 and 131072 the fp32
    angles of ropekv and transformers differ by at most 2^-12, 2^-9 and 2^-7
    rad (one ulp of an angle just under the limit), in about 3 of 10 pairs."""
    D = 128
    _, hf_inv, _ = hf_llama(params, D, np.array([0]), np.zeros((1, 1, D), np.float32))
    inv, _ = ropekv.rope_inv_freq(D, params["rope_theta"], None, params)
    p = np.arange(1 << 17, dtype=np.float32)[:, None]
    diff = np.abs((p * inv).astype(np.float64) - p * hf_inv)
    for limit, most in ((4096, 2.0**-12), (32768, 2.0**-9), (131072, 2.0**-7)):
        assert diff[:limit].max() <= most, limit
    assert 0.2 < np.count_nonzero(diff) / diff.size < 0.4
