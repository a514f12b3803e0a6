"""The options beyond the original call (issue "variants"), on the CPU, against
the float64 reference: interleaved pairs, rope_scaling, cos_sin_cache,
inplace, float32 and fp8 pools, QK-norm, and their errors. Every check draws
fresh random inputs, poisons the outputs and checks that pool rows no token
names are untouched. tests/gpu/test_cuda.py runs the same options on CUDA."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import ropekv
from reference import (BF16, DTYPES, FP8, LINEAR, LLAMA3, LLAMA4_SCOUT, LLAMA32, PROPORTIONAL,
                       YARN_MSCALE, YARN_QWEN, assert_close, bits, fp8_encode,
                       hf_attention_factor, hf_inv_freq, poison, rope, rotary_dim_of)

RNG = np.random.default_rng()


def randn(shape, dtype):
    return RNG.standard_normal(shape).astype(np.float32).astype(dtype)


def call_and_check(T, Hq, Hk, D, dtype, *, base=10000.0, rotary_dim=None, is_neox=True,
                   rope_scaling=None, table_dtype=None, kv_cache_dtype="auto", k_scale=1.0,
                   v_scale=1.0, q_norm=None, k_norm=None, norm_eps=1e-6, inplace=False,
                   num_threads=0, strided=False, idx=np.int64):
    """One call with every named option, poisoned outputs, then every output
    checked: q_rot/k_rot against the float64 reference, pool rows exactly
    encode(k_rot) / encode(v), other pool rows bit-identical."""
    R = rotary_dim_of(D, rotary_dim, rope_scaling)
    if strided:  # q, k, v as views of one fused projection, last dim strided by 2
        qkv = randn((T, Hq + 2 * Hk, 2 * D), dtype)
        q, k, v = qkv[:, :Hq, ::2], qkv[:, Hq:Hq + Hk, ::2], qkv[:, Hq + Hk:, ::2]
    else:
        q, k, v = randn((T, Hq, D), dtype), randn((T, Hk, D), dtype), randn((T, Hk, D), dtype)
    q0, k0 = q.copy(), k.copy()
    P = 2 * T + 5
    cache = None
    if table_dtype is not None:
        max_pos = 4096
        positions = RNG.integers(0, max_pos, T).astype(idx)
        inv = hf_inv_freq(base, R)
        ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]
        cache = np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)
        cache = cache.astype(table_dtype)
    else:
        positions = RNG.integers(0, 1 << 20, T).astype(idx)
        positions[: min(T, 2)] = [0, (1 << 24) - 1][: min(T, 2)]
    slots = RNG.permutation(P)[:T].astype(idx)
    slots[RNG.random(T) < 0.2] = -1

    fp8 = kv_cache_dtype in FP8
    pool_dtype = {"auto": dtype, "float32": np.dtype(np.float32)}.get(kv_cache_dtype, np.uint8)
    if fp8:
        k_pool = RNG.integers(0, 256, (P, Hk, D), dtype=np.uint8)
        v_pool = RNG.integers(0, 256, (P, Hk, D), dtype=np.uint8)
    else:
        k_pool, v_pool = randn((P, Hk, D), pool_dtype), randn((P, Hk, D), pool_dtype)
    k_pool0, v_pool0 = k_pool.copy(), v_pool.copy()
    qw = None if q_norm is None else (1.0 + 0.3 * RNG.standard_normal(D)).astype(q_norm)
    kw = None if k_norm is None else (1.0 + 0.3 * RNG.standard_normal(D)).astype(k_norm)

    outs = {}
    if not inplace:
        outs = {"q_out": poison((T, Hq, D), dtype), "k_out": poison((T, Hk, D), dtype)}
    res = ropekv.rope_pool_fused(
        q, k, v, positions, slots, k_pool, v_pool, head_dim=D, num_qo_heads=Hq,
        num_kv_heads=Hk, rope_base=base, rotary_dim=rotary_dim, is_neox=is_neox,
        rope_scaling=rope_scaling, cos_sin_cache=cache, inplace=inplace,
        kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale, q_norm_weight=qw,
        k_norm_weight=kw, norm_eps=norm_eps, num_threads=num_threads, **outs)
    q_rot, k_rot = res[0], res[1]
    if inplace:
        assert q_rot is q and k_rot is k
    assert res[2] is k_pool and res[3] is v_pool

    ref_args = dict(is_neox=is_neox, cos_sin_cache=cache, norm_eps=norm_eps,
                    inv_freq=None if cache is not None else hf_inv_freq(base, R, rope_scaling),
                    attention_factor=hf_attention_factor(rope_scaling))
    rel_q = 4.0 + (0 if qw is None else D / 2 + 6) + (1 if ref_args["attention_factor"] != 1 else 0)
    rel_k = 4.0 + (0 if kw is None else D / 2 + 6) + (1 if ref_args["attention_factor"] != 1 else 0)
    q_ref, q_mag = rope(q0, positions, base, R, norm_weight=qw, **ref_args)
    k_ref, k_mag = rope(k0, positions, base, R, norm_weight=kw, **ref_args)
    assert_close(q_rot, q_ref, q_mag, "q_rot", rel_q)
    assert_close(k_rot, k_ref, k_mag, "k_rot", rel_k)

    def encode(x, scale):
        if fp8:
            return fp8_encode(np.asarray(x).astype(np.float32), kv_cache_dtype, scale)
        return np.asarray(x).astype(pool_dtype)

    named = set()
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        named.add(s)
        assert bits(k_pool[s]) == bits(encode(k_rot[t], k_scale)), f"k_pool[{s}] != encode(k_rot[{t}])"
        assert bits(v_pool[s]) == bits(encode(v[t], v_scale)), f"v_pool[{s}] != encode(v[{t}])"
    for s in range(P):
        if s not in named:
            assert bits(k_pool[s]) == bits(k_pool0[s]), f"k_pool row {s} was touched"
            assert bits(v_pool[s]) == bits(v_pool0[s]), f"v_pool row {s} was touched"
    return q_rot, k_rot, k_pool, v_pool


DT = list(DTYPES)


# --- is_neox=False (GPT-J / GLM interleaved pairs) ---------------------------------------

@pytest.mark.parametrize("dtype", DT)
@pytest.mark.parametrize("D,R", [(64, 64), (128, 128), (256, 64), (80, 32), (34, 34), (6, 4)])
def test_interleaved(D, R, dtype):
    for T in (1, 7, 150):
        call_and_check(T, 4, 2, D, DTYPES[dtype], rotary_dim=R, is_neox=False)


def test_interleaved_gptj_shape_threads_and_strides():
    for threads in (1, 2):
        call_and_check(33, 16, 16, 256, BF16, rotary_dim=64, is_neox=False, num_threads=threads)
    call_and_check(9, 4, 2, 64, np.dtype(np.float32), is_neox=False, strided=True)


def test_interleaved_matches_mlx_traditional():
    mx = pytest.importorskip("mlx.core")
    T, H, D = 5, 3, 64
    x = randn((T, H, D), np.float32)
    # Small positions: MLX derives its angles in fp32 its own way, so at large
    # positions the two differ by the angle's rounding; the pairing is the point.
    pos = RNG.integers(0, 64, T).astype(np.int32)
    got = ropekv.rope_pool_fused(x, x[:, :1], x[:, :1], pos, -np.ones(T, np.int32),
                                 np.zeros((1, 1, D), np.float32), np.zeros((1, 1, D), np.float32),
                                 head_dim=D, num_qo_heads=H, num_kv_heads=1, rope_base=10000.0,
                                 is_neox=False)[0]
    for t in range(T):  # MLX rotates positions offset + arange(L): one token per call
        want = mx.fast.rope(mx.array(x[t][None, :, None, :]), D, traditional=True, base=10000.0,
                            scale=1.0, offset=int(pos[t]))
        np.testing.assert_allclose(got[t], np.array(want)[0, :, 0, :], rtol=2e-5, atol=2e-5)


# --- rope_scaling -----------------------------------------------------------------------

@pytest.mark.parametrize("scaling", [
    LINEAR, LLAMA3, LLAMA32, LLAMA4_SCOUT, YARN_QWEN, YARN_MSCALE,
    # transformers' reading of yarn's optional keys: beta 0 is the default (get(k) or 32 / 1),
    # a null truncate does not truncate (get("truncate", True) is None, falsy)
    {**YARN_QWEN, "beta_fast": 0, "beta_slow": 0.0}, {**YARN_QWEN, "truncate": None},
    {**YARN_QWEN, "truncate": False},
    # a config read by numpy has numpy's bools
    {**YARN_QWEN, "truncate": np.False_}, {**YARN_QWEN, "truncate": np.True_},
    # proportional: the count of rotating pairs floored (0.3: 19 of 64, 9 of 32, 14 of 48),
    # with and without a factor, and every pair
    PROPORTIONAL, {"rope_type": "proportional", "partial_rotary_factor": 0.3, "factor": 4.0},
    {"rope_type": "proportional"}],
    ids=["linear", "llama3.1", "llama3.2", "llama4-scout", "yarn", "yarn-mscale", "yarn-beta-0",
         "yarn-truncate-null", "yarn-truncate-false", "yarn-truncate-np-false",
         "yarn-truncate-np-true", "proportional", "proportional-0.3-factor",
         "proportional-whole"])
def test_inv_freq_matches_reference_formulas(scaling):
    for base, D in ((500000.0, 128), (1e6, 128), (10000.0, 64), (10000.0, 96)):
        got, m = ropekv.rope_inv_freq(D, base, rope_scaling=scaling)
        want = hf_inv_freq(base, D, scaling).astype(np.float32)
        np.testing.assert_array_equal(got, want)  # both double, rounded once
        assert m == pytest.approx(hf_attention_factor(scaling), rel=1e-15)


def test_llama3_equal_factors_at_the_band_wavelength():
    """Equal low and high factors leave one wavelength, old_context /
    low_freq_factor, between the scaled and the unscaled bands. Made to be
    pair 0's (2 pi, exactly), it gets the scaled frequency (vLLM's smooth 0;
    transformers' 0/0 gives NaN there), the other pairs their band's."""
    lo = 8192.0 / (2 * math.pi)
    assert 8192.0 / lo == 2 * math.pi
    scaling = dict(LLAMA3, factor=16.0, low_freq_factor=lo, high_freq_factor=lo)
    got, _ = ropekv.rope_inv_freq(128, 500000.0, rope_scaling=scaling)
    assert got[0] == np.float32(1.0 / 16.0)
    np.testing.assert_array_equal(got, hf_inv_freq(500000.0, 128, scaling).astype(np.float32))


@pytest.mark.parametrize("name,theta,D,scaling,config", [
    ("llama-3.1-8b", 500000.0, 128, LLAMA3, "LlamaConfig"),
    ("llama-3.2-1b", 500000.0, 64, LLAMA32, "LlamaConfig"),
    ("llama-4-scout", 500000.0, 128, LLAMA4_SCOUT, "LlamaConfig"),
    ("qwen2.5-7b-yarn", 1e6, 128, YARN_QWEN, "Qwen2Config"),
    ("linear", 10000.0, 128, LINEAR, "LlamaConfig"),
    # yarn's attention factor from mscale and mscale_all_dim (DeepSeek's
    # form), from either alone, and given outright
    ("yarn-mscale", 10000.0, 128, YARN_MSCALE, "Qwen2Config"),
    ("yarn-mscale-only", 10000.0, 128, dict(YARN_QWEN, mscale=0.8), "Qwen2Config"),
    ("yarn-mscale_all_dim-only", 10000.0, 128, dict(YARN_QWEN, mscale_all_dim=0.707),
     "Qwen2Config"),
    ("yarn-attention_factor", 1e6, 128, dict(YARN_QWEN, attention_factor=1.25), "Qwen2Config"),
    # proportional away from Gemma-4's config: a pair count that floors where
    # rounding would not (0.3 of 32 pairs: 9, not 10), a factor, heads of 96,
    # the whole head
    ("proportional-0.3-factor", 1e6, 64,
     {"rope_type": "proportional", "partial_rotary_factor": 0.3, "factor": 4.0}, "Qwen2Config"),
    ("proportional-0.5-d96", 10000.0, 96, {"rope_type": "proportional",
                                           "partial_rotary_factor": 0.5}, "LlamaConfig"),
    ("proportional-whole", 500000.0, 256, {"rope_type": "proportional"}, "LlamaConfig"),
])
def test_inv_freq_matches_transformers(name, theta, D, scaling, config):
    """Against transformers' own rope initialisation (which runs in fp32:
    agreement to a few fp32 ulp)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    kind = scaling.get("rope_type", scaling.get("type"))
    params = {k: v for k, v in scaling.items() if k != "type"}
    params.update(rope_type=kind, rope_theta=theta)
    cfg = getattr(transformers, config)(hidden_size=D * 32, num_attention_heads=32, head_dim=D,
                                        max_position_embeddings=131072, rope_parameters=params)
    inv, factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    got, m = ropekv.rope_inv_freq(D, theta, rope_scaling=scaling)
    np.testing.assert_allclose(got, inv.numpy(), rtol=4 * 2.0**-23, atol=0)
    assert m == pytest.approx(factor, rel=1e-12)


@pytest.mark.parametrize("dtype", DT)
@pytest.mark.parametrize("scaling", [LINEAR, LLAMA3, LLAMA4_SCOUT, YARN_QWEN, YARN_MSCALE,
                                     PROPORTIONAL],
                         ids=["linear", "llama3", "llama4-scout", "yarn", "yarn-mscale",
                              "proportional"])
def test_scaled_rope(scaling, dtype):
    for T in (1, 40):
        call_and_check(T, 8, 2, 128, DTYPES[dtype], base=500000.0, rope_scaling=scaling)


def test_proportional_inv_freq_matches_gemma4():
    """Against transformers' Gemma-4 rotary embedding, each layer type's
    inverse frequencies as the model's module holds them (full layers:
    proportional over 512 dims, sliding: default over 256), from the config's
    own rope_parameters entry (fp32 in transformers: a few fp32 ulp; the
    pairs that do not rotate exactly 0)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma4TextConfig"):
        pytest.skip("transformers without Gemma-4")
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding
    cfg = transformers.Gemma4TextConfig()
    module = Gemma4TextRotaryEmbedding(cfg)
    kinds = set()
    for layer_type, params in cfg.rope_parameters.items():
        D = cfg.per_layer_config[layer_type].head_dim
        want = getattr(module, f"{layer_type}_inv_freq").numpy()
        got, m = ropekv.rope_inv_freq(D, params["rope_theta"], rope_scaling=params)
        assert got.shape == want.shape == (D // 2,)
        np.testing.assert_allclose(got, want, rtol=4 * 2.0**-23, atol=0)
        assert m == getattr(module, f"{layer_type}_attention_scaling") == 1.0
        kinds.add(params["rope_type"])
    assert "proportional" in kinds


def test_proportional_pairs_past_the_fraction_are_copied():
    """The pairs proportional leaves at angle 0 come out bit-identical (cos 1,
    sin 0 exactly), the others rotate; its partial_rotary_factor does not set
    rotary_dim, so a rotary_dim given with it is the R the fraction is of."""
    D, T = 64, 9
    got, _ = ropekv.rope_inv_freq(D, 1e4, rope_scaling=PROPORTIONAL)
    assert got.shape == (32,) and np.count_nonzero(got) == 8
    got, _ = ropekv.rope_inv_freq(D, 1e4, 32, rope_scaling=PROPORTIONAL)
    assert got.shape == (16,) and np.count_nonzero(got) == 4
    for is_neox in (True, False):
        q = randn((T, 4, D), np.float32)
        k = randn((T, 2, D), np.float32)
        v = randn((T, 2, D), np.float32)
        pos = RNG.integers(1, 1 << 20, T).astype(np.int64)
        pools = [np.zeros((T, 2, D), np.float32) for _ in range(2)]
        q_rot, k_rot = ropekv.rope_pool_fused(q, k, v, pos, np.arange(T), *pools, head_dim=D,
                                              num_qo_heads=4, num_kv_heads=2, rope_base=1e4,
                                              is_neox=is_neox, rope_scaling=PROPORTIONAL)[:2]
        for x, out in ((q, q_rot), (k, k_rot)):
            first = np.r_[0:8, 32:40] if is_neox else np.arange(16)
            rest = np.setdiff1d(np.arange(D), first)
            assert bits(out[..., rest]) == bits(x[..., rest])
            assert np.all(out[..., first] != x[..., first])


@pytest.mark.parametrize("p", [0, 0.0])
def test_proportional_fraction_zero_rotates_nothing(p):
    """A partial_rotary_factor of 0, which transformers takes (int(0 * D // 2)
    pairs rotate), rotates no pair: every inv_freq 0, q_rot and k_rot
    bit-identical to q and k (finite, nonzero values), the pool rows to k and v."""
    D, T = 32, 5
    scaling = {"rope_type": "proportional", "partial_rotary_factor": p}
    got, m = ropekv.rope_inv_freq(D, 1e4, rope_scaling=scaling)
    assert got.shape == (D // 2,) and not np.any(got) and m == 1.0
    q, k, v = (randn((T, H, D), np.float32) for H in (4, 2, 2))
    pos = RNG.integers(1, 1 << 20, T).astype(np.int64)
    pools = [np.full((T, 2, D), np.nan, np.float32) for _ in range(2)]
    q_rot, k_rot, k_pool, v_pool = ropekv.rope_pool_fused(
        q, k, v, pos, np.arange(T), *pools, head_dim=D, num_qo_heads=4, num_kv_heads=2,
        rope_base=1e4, rope_scaling=scaling)
    assert bits(q_rot) == bits(q) and bits(k_rot) == bits(k)
    assert bits(k_pool) == bits(k) and bits(v_pool) == bits(v)


def test_scaling_numpy_scalars():
    """Values of numpy's scalar types (a config read through numpy) are
    numbers: the same frequencies and factor as the Python numbers."""
    want = ropekv.rope_inv_freq(128, 1e6, None, YARN_QWEN)
    numpy_values = {key: (np.float32(v) if isinstance(v, float) else np.int64(v))
                    if isinstance(v, (int, float)) and not isinstance(v, bool) else v
                    for key, v in YARN_QWEN.items()}
    assert any(isinstance(v, np.float32) for v in numpy_values.values())
    got = ropekv.rope_inv_freq(128, 1e6, None, numpy_values)
    assert bits(got[0]) == bits(want[0]) and got[1] == want[1]
    assert_rejected("must be a number", rope_scaling={"rope_type": "linear",
                                                      "factor": np.str_("2")})


def test_scaling_default_type_is_plain():
    a = call_and_check(3, 2, 1, 64, np.dtype(np.float32), rope_scaling={"rope_type": "default"})
    assert a is not None


@pytest.mark.parametrize("scaling,match", [
    ({"rope_type": "dynamic", "factor": 2.0}, "type 'dynamic' is not supported"),
    ({"rope_type": "longrope"}, "not supported"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
      "original_max_position_embeddings": 8192}, "needs 'high_freq_factor'"),
    ({"type": "yarn", "factor": 4.0}, "needs 'original_max_position_embeddings'"),
    ({"rope_type": "linear"}, "needs 'factor'"),
    ({"rope_type": "linear", "factor": -1.0}, "factor must be finite and > 0"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 8192}, "high_freq_factor must be >= low_freq_factor"),
    ({"rope_type": "linear", "factor": "2"}, "must be a number"),
    # the kernels apply yarn's factor in fp32: finite as a double is not enough
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
      "attention_factor": 1e39}, "attention_factor must be finite and > 0 as a float32"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
      "mscale": 1e40, "mscale_all_dim": 1.0}, "attention_factor must be finite and > 0 as a float32"),
    # given, attention_factor is the factor: 0 and negative ones (which would zero or mirror
    # the rotation) are errors
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
      "attention_factor": 0.0}, "attention_factor must be finite and > 0 as a float32"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
      "attention_factor": 0}, "attention_factor must be finite and > 0 as a float32"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
      "attention_factor": -1.5}, "attention_factor must be finite and > 0 as a float32"),
    ([("rope_type", "linear")], "must be a dict"),
    ({"rope_type": "proportional", "factor": 0.0}, "factor must be finite and > 0 "
     r"\(proportional\)"),
    ({"rope_type": "proportional", "partial_rotary_factor": -0.25},
     r"^rope_scaling partial_rotary_factor must be in \[0, 1\] \(proportional: the fraction of "
     r"the rotary pairs that rotate\), got -0.25$"),
    ({"rope_type": "proportional", "partial_rotary_factor": 1.5},
     r"^rope_scaling partial_rotary_factor must be in \[0, 1\] \(proportional: the fraction of "
     r"the rotary pairs that rotate\), got 1.5$"),
    ({"rope_type": "proportional", "partial_rotary_factor": float("nan")},
     r"must be in \[0, 1\] \(proportional: .*, got nan$"),
])
def test_scaling_errors(scaling, match):
    assert_rejected(match, rope_scaling=scaling)


# --- transformers 5's rope_parameters ---------------------------------------------------
# There a config's rope_scaling is its rope_parameters, holding rope_theta and (Phi, GLM)
# partial_rotary_factor besides the scaling fields.

PHI2 = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.4}


@pytest.mark.parametrize("dtype", DT)
@pytest.mark.parametrize("scaling,base,D,R", [
    ({"rope_type": "default", "rope_theta": 1e6}, 1e6, 128, None),
    ({**LLAMA3, "rope_theta": 500000}, 500000.0, 128, None),
    (PHI2, 10000.0, 80, None),  # rotary_dim from the factor: int(80 * 0.4) = 32
    (PHI2, 10000.0, 80, 32),  # given, and agreeing
    ({**YARN_QWEN, "rope_theta": 1e6, "partial_rotary_factor": 0.5}, 1e6, 128, None),
], ids=["qwen3", "llama3.1", "phi-2", "phi-2-rotary-dim", "yarn-partial"])
def test_rope_parameters(scaling, base, D, R, dtype):
    for T in (1, 23):
        call_and_check(T, 4, 2, D, DTYPES[dtype], base=base, rotary_dim=R, rope_scaling=scaling)


@pytest.mark.parametrize("config", ["PhiConfig", "Qwen3Config", "GPTNeoXConfig",
                                    "Gemma3TextConfig", "Gemma4TextConfig"])
def test_rope_parameters_of_a_transformers_config(config):
    """A transformers 5 config's own rope_scaling, with its rope_theta as
    rope_base (Gemma-3 and -4: those of each layer type, with that type's
    head_dim; the whole dict is an error)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, config):
        pytest.skip(f"transformers without {config}")
    cfg = getattr(transformers, config)()
    params = getattr(cfg, "rope_parameters", None)
    if not isinstance(params, dict) or ("rope_theta" not in params
                                        and config not in ("Gemma3TextConfig", "Gemma4TextConfig")):
        pytest.skip("transformers < 5 keeps rope_theta out of rope_scaling")
    per_layer_type = "rope_type" not in cfg.rope_scaling
    for layer_type, scaling in (cfg.rope_scaling.items() if per_layer_type
                                else [(None, cfg.rope_scaling)]):
        # (each layer type's own config: Gemma-4's full layers have heads of 512)
        layers = getattr(cfg, "per_layer_config", None)
        c = layers[layer_type] if layer_type and layers else cfg
        D = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        call_and_check(5, 4, 2, D, np.dtype(np.float32), base=scaling["rope_theta"],
                       rope_scaling=scaling)
    if per_layer_type:
        first = next(iter(cfg.rope_scaling))
        assert_rejected(rf"^rope_scaling holds RoPE parameters per layer type \('{first}', .*\), "
                        rf".*: pass those of the layer's type, e.g. "
                        rf"rope_scaling=config.rope_scaling\['{first}'\]$",
                        rope_scaling=cfg.rope_scaling)


def test_rope_parameters_inv_freq():
    got, m = ropekv.rope_inv_freq(80, 1e4, rope_scaling=PHI2)
    want, m_want = ropekv.rope_inv_freq(80, 1e4, 32)
    assert bits(got) == bits(want) and got.shape == (16,) and m == m_want == 1.0
    import json
    got, _ = ropekv.rope_inv_freq(80, 1e4, rope_scaling=json.dumps(PHI2))
    assert bits(got) == bits(want)


@pytest.mark.parametrize("rotary_dim", [0, 15, 18])
def test_rope_inv_freq_takes_rotary_dim_as_the_call_does(rotary_dim):
    """A rotary_dim the call rejects, 0 among them (not the core's "head_dim"
    there), is the call's error in rope_inv_freq too; None is head_dim."""
    D = 16
    r = int(RNG.integers(1, D // 2 + 1)) * 2
    got, _ = ropekv.rope_inv_freq(D, 1e4, r)
    assert got.shape == (r // 2,)
    assert bits(ropekv.rope_inv_freq(D, 1e4)[0]) == bits(ropekv.rope_inv_freq(D, 1e4, D)[0])
    match = rf"^rotary_dim must be even and in \[2, head_dim\], got {rotary_dim} for head_dim {D}$"
    with pytest.raises(ValueError, match=match):
        ropekv.rope_inv_freq(D, 1e4, rotary_dim)
    assert_rejected(match, rotary_dim=rotary_dim)


@pytest.mark.parametrize("options,match", [
    (dict(rope_scaling={"rope_type": "default", "rope_theta": 1e6}),
     r"^rope_scaling has rope_theta 1000000.0 but rope_base is 10000.0: ropekv takes the base "
     r"from rope_base, so pass rope_base=1000000.0$"),
    (dict(rope_scaling={**LINEAR, "rope_theta": 5e5}), "rope_theta 500000.0 but rope_base is"),
    (dict(rope_scaling={"rope_type": "default", "partial_rotary_factor": 0.5}, rotary_dim=16),
     r"^rope_scaling has partial_rotary_factor 0.5, which makes rotary_dim int\(16 \* 0.5\) = 8, "
     r"but rotary_dim is 16: pass rotary_dim=8$"),
    (dict(rope_scaling={"rope_type": "default", "partial_rotary_factor": 0.1}),
     r"int\(16 \* 0.1\) = 1: rotary_dim must be even and in \[2, head_dim\]"),
    (dict(rope_scaling={"rope_type": "default", "partial_rotary_factor": 0.01}), r"= 0: rotary_dim"),
    (dict(rope_scaling={"rope_type": "default", "partial_rotary_factor": 1.5}),
     r"^rope_scaling partial_rotary_factor must be in \(0, 1\] \(the fraction of head_dim "
     r"that rotates\), got 1.5$"),
    (dict(rope_scaling={"rope_type": "default", "partial_rotary_factor": 0.0}),
     r"partial_rotary_factor must be in \(0, 1\] \(the fraction of head_dim that rotates\)"),
    (dict(rope_scaling={"rope_type": "default", "rope_theta": "1e4"}),
     "'rope_theta' must be a number"),
    (dict(rope_scaling={"rope_type": "default", "rope_theta": float("inf")}),
     "'rope_theta' must be finite and > 0"),
    (dict(rope_scaling={"rope_type": "default", "rope_theta": True}),
     "'rope_theta' must be a number"),
])
def test_rope_parameters_errors(options, match):
    assert_rejected(match, **options)


def test_mrope_section_is_an_error():
    """Multimodal RoPE (Qwen2-VL) needs three positions per token: not done."""
    assert_rejected(r"^rope_scaling has mrope_section \(multimodal RoPE, as Qwen2-VL's\): .*pass "
                    r"the dict without mrope_section$",
                    rope_scaling={"rope_type": "default", "rope_theta": 1e4,
                                  "mrope_section": [2, 3, 3]})


@pytest.mark.parametrize("scaling,unread", [
    ({**YARN_QWEN, "beta_fasst": 16}, "'beta_fasst'"),
    ({"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}, "'factor'"),
    ({**LINEAR, "low_freq_factor": 1.0, "foo": None}, "'low_freq_factor', 'foo'"),
])
def test_unread_rope_scaling_keys_warn(scaling, unread, monkeypatch):
    """A key ropekv does not read (a misspelt optional one would leave its
    default) is a warning naming it, at the caller's line; the call runs.
    Every call warns, under the caller's filters: the fast path does not
    remember such a dict (pytest.warns or -W error would miss a typo after
    the first call otherwise)."""
    import warnings
    monkeypatch.setattr(ropekv, "_SCALING_SEEN", {})
    with pytest.warns(UserWarning, match=rf"^rope_scaling of type '\w+': ropekv ignores "
                                         rf"{re.escape(unread)} \(it reads rope_type, ") as rec:
        call_and_check(3, 2, 1, 16, np.dtype(np.float32), rope_scaling=scaling)
    assert rec[0].filename == __file__
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(2):
            call_and_check(3, 2, 1, 16, np.dtype(np.float32), rope_scaling=scaling)
    assert [w.filename for w in rec if "ropekv ignores" in str(w.message)] == [__file__] * 2
    assert not ropekv._SCALING_SEEN
    with pytest.warns(UserWarning, match="ropekv ignores") as rec:
        ropekv.rope_inv_freq(16, 1e4, None, scaling)
    assert rec[0].filename == __file__


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_unread_key_under_an_error_filter_raises_before_any_write(framework, monkeypatch):
    """With warnings made errors (python -W error, pytest -W error), an unread
    key raises its UserWarning on the fast path (numpy, PyTorch CPU) as on the
    general one, and the call writes nothing: the fast path's parse once took
    the raised warning for a dict it could not read and left the call to the
    general path, which parses without warning (it ran with the default)."""
    import warnings
    monkeypatch.setattr(ropekv, "_SCALING_SEEN", {})
    T, H, D = 3, 2, 16
    arrays = [randn((T, H, D), np.float32) for _ in range(3)] + [randn((8, H, D), np.float32)
                                                                 for _ in range(2)]
    before = [bits(a) for a in arrays]
    if framework == "torch":
        torch = pytest.importorskip("torch")
        arrays = [torch.from_numpy(a) for a in arrays]  # (the same memory)
    q, k, v, kp, vp = arrays
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="ropekv ignores 'fator'"):
            ropekv.rope_pool_fused(q, k, v, np.arange(T), np.arange(T), kp, vp, head_dim=D,
                                   num_qo_heads=H, num_kv_heads=H, rope_base=1e4,
                                   rope_scaling={**LINEAR, "fator": 2.0})
    assert [bits(np.asarray(a)) for a in arrays] == before


def test_unread_key_warns_once_when_the_call_fails(monkeypatch):
    """A dict with an unread key that lacks a required one: one warning, even
    with every warning shown (the fast path parses it, fails and leaves the
    call to the general path, which parses it again), then the ValueError."""
    import warnings
    monkeypatch.setattr(ropekv, "_SCALING_SEEN", {})
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert_rejected(r"^rope_scaling of type 'linear' needs 'factor'",
                        rope_scaling={"rope_type": "linear", "fator": 2.0})
    assert [str(w.message).count("ignores 'fator'") for w in rec] == [1]


def test_read_rope_scaling_keys_do_not_warn():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for scaling in (LINEAR, LLAMA3, YARN_QWEN, YARN_MSCALE, PHI2,
                        {**YARN_QWEN, "attention_factor": 1.1, "truncate": False}):
            ropekv.rope_inv_freq(80, 1e4, None, scaling)


# --- cos_sin_cache ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DT)
@pytest.mark.parametrize("table", ["float32", "same"])
def test_cos_sin_cache(dtype, table):
    dt = DTYPES[dtype]
    tdt = np.dtype(np.float32) if table == "float32" else dt
    for T, D, R, neox in ((1, 128, 128, True), (37, 80, 32, True), (12, 256, 64, False)):
        call_and_check(T, 4, 2, D, dt, rotary_dim=R, is_neox=neox, table_dtype=tdt)


def test_cos_sin_cache_infers_rotary_dim():
    D, R, T = 96, 24, 4
    call_and_check(T, 2, 2, D, np.dtype(np.float32), rotary_dim=R, table_dtype=np.float32)
    # rotary_dim omitted: the table's width
    q = randn((T, 2, D), np.float32)
    cache = randn((64, R), np.float32)
    pos = RNG.integers(0, 64, T)
    kp = np.zeros((8, 2, D), np.float32)
    a = ropekv.rope_pool_fused(q, q, q, pos, -np.ones(T, np.int64), kp, kp.copy(), head_dim=D,
                               num_qo_heads=2, num_kv_heads=2, rope_base=1.0,
                               cos_sin_cache=cache)[0]
    b = ropekv.rope_pool_fused(q, q, q, pos, -np.ones(T, np.int64), kp, kp.copy(), head_dim=D,
                               num_qo_heads=2, num_kv_heads=2, rope_base=1.0, rotary_dim=R,
                               cos_sin_cache=cache)[0]
    assert bits(a) == bits(b)


@pytest.mark.parametrize("width,match", [
    (15, r"^rotary_dim must be even and in \[2, head_dim\], got 15 for head_dim 16 "
         r"\(the width of cos_sin_cache, shape \(8, 15\)\)$"),
    (18, r"^rotary_dim must be even and in \[2, head_dim\], got 18 for head_dim 16 "
         r"\(the width of cos_sin_cache, shape \(8, 18\)\)$"),
    # (a width of 0 would be the core's "head_dim": the table's shape error)
    (0, r"^cos_sin_cache shape must be \[max_position, rotary_dim\] = \[>= 1, 16\], "
        r"got \(8, 0\)$"),
])
def test_cos_sin_cache_width_that_cannot_be_rotary_dim(width, match):
    """rotary_dim omitted and a table too wide or odd: the error names the
    table, whose width the call took as rotary_dim."""
    assert_rejected(match, cos_sin_cache=randn((8, width), np.float32))


@pytest.mark.parametrize("dtype", DT)
def test_llama4_qk_l2_norm_after_rope_as_unit_weights(dtype):
    """Llama-4 normalises q and k after the rotation (an RMSNorm without
    weights, its "L2 norm"). A rotation of the whole head keeps each head's
    norm, so that is ropekv's QK-norm (before the rotation) with weights of
    ones: checked against the float64 rotation followed by the norm, with
    Llama-4 Scout's interleaved pairs and rope_scaling."""
    T, Hq, Hk, D, eps, base = 9, 5, 1, 128, 1e-5, 500000.0
    q, k, v = randn((T, Hq, D), DTYPES[dtype]), randn((T, Hk, D), DTYPES[dtype]), \
        randn((T, Hk, D), DTYPES[dtype])
    positions = RNG.integers(0, 1 << 20, T)
    k_pool, v_pool = randn((T, Hk, D), DTYPES[dtype]), randn((T, Hk, D), DTYPES[dtype])
    ones = np.ones(D, np.float32)
    q_rot, k_rot, _, _ = ropekv.rope_pool_fused(
        q, k, v, positions, np.arange(T), k_pool, v_pool, head_dim=D, num_qo_heads=Hq,
        num_kv_heads=Hk, rope_base=base, is_neox=False, rope_scaling=LLAMA4_SCOUT,
        q_norm_weight=ones, k_norm_weight=ones, norm_eps=eps,
        q_out=poison((T, Hq, D), DTYPES[dtype]), k_out=poison((T, Hk, D), DTYPES[dtype]))
    for got, x, name in ((q_rot, q, "q_rot"), (k_rot, k, "k_rot")):
        out, mag = rope(x, positions, base, D, is_neox=False,
                        inv_freq=hf_inv_freq(base, D, LLAMA4_SCOUT))
        r = 1.0 / np.sqrt(np.mean(out * out, axis=-1, keepdims=True) + eps)
        assert_close(got, out * r, mag * r, name, 4.0 + D / 2 + 6)
    np.testing.assert_array_equal(bits(k_pool), bits(k_rot))


# --- inplace and preallocated outputs ---------------------------------------------------

@pytest.mark.parametrize("dtype", DT)
def test_inplace(dtype):
    call_and_check(21, 8, 4, 128, DTYPES[dtype], inplace=True)
    call_and_check(5, 4, 2, 64, DTYPES[dtype], inplace=True, is_neox=False, q_norm="float32",
                   k_norm="float32")


def test_numpy_bools_mean_what_python_bools_do():
    """is_neox and inplace as numpy bools (a config read through numpy, say):
    the same bits as True / False, and inplace=np.True_ writes q and k
    themselves."""
    T, H, D = 4, 2, 16
    q, k, v = (randn((T, H, D), np.float32) for _ in range(3))
    idx = np.arange(T, dtype=np.int32)

    def run(qq, kk, **kw):
        pools = [poison((T, H, D), np.float32) for _ in range(2)]
        out = ropekv.rope_pool_fused(qq, kk, v, idx, idx, *pools, head_dim=D, num_qo_heads=H,
                                     num_kv_heads=H, rope_base=1e4, **kw)
        return out[:2], pools

    for flag in (True, False):
        (want_q, want_k), want_pools = run(q, k, is_neox=flag)
        (got_q, got_k), got_pools = run(q, k, is_neox=np.bool_(flag))
        assert bits(got_q) == bits(want_q) and bits(got_k) == bits(want_k), flag
        assert [bits(x) for x in got_pools] == [bits(x) for x in want_pools], flag
    (want_q, want_k), _ = run(q, k)
    qi, ki = q.copy(), k.copy()
    got_q, got_k = run(qi, ki, inplace=np.True_)[0]
    assert got_q is qi and got_k is ki
    assert bits(qi) == bits(want_q) and bits(ki) == bits(want_k)
    q2 = q.copy()
    got_q, got_k = run(q2, k.copy(), inplace=np.False_)[0]
    assert got_q is not q2 and bits(q2) == bits(q) and bits(got_q) == bits(want_q)


def test_inplace_conflicts_with_outputs():
    q = randn((1, 1, 8), np.float32)
    with pytest.raises(ValueError, match="inplace=True writes q and k themselves"):
        ropekv.rope_pool_fused(q, q, q, np.zeros(1, np.int32), np.zeros(1, np.int32),
                               np.zeros((1, 1, 8), np.float32), np.zeros((1, 1, 8), np.float32),
                               head_dim=8, num_qo_heads=1, num_kv_heads=1, rope_base=1e4,
                               inplace=True, q_out=q.copy())


def _read_only(shape):
    x = randn(shape, np.float32)
    x.flags.writeable = False
    return x


@pytest.mark.parametrize("arrays, options, want", [
    # outputs the caller passed: named q_out / k_out
    ({}, dict(q_out=[0.0]), "q_out must be an array"),
    ({}, dict(k_out=np.empty((3, 1, 18), np.float32)), "k_out shape must match k shape"),
    ({}, dict(q_out=_read_only((3, 2, 16))), "q_out is read-only, but ropekv writes into it"),
    ({}, dict(k_out=_read_only((3, 1, 16)), is_neox=False), "k_out is read-only"),
    ({}, dict(q_out=np.empty((3, 2, 16), np.float16), k_out=np.empty((3, 1, 16), np.float16)),
     "q_out/k_out dtype must match q/k/v dtype, got q_out float16, k_out float16 for float32"),
    ({}, dict(q_out=np.empty((3, 2, 16), np.float32), k_out=np.empty((3, 1, 16), np.float16)),
     "k_out dtype must match q/k/v dtype, got k_out float16 for float32"),
    ({}, dict(q_out=np.empty((3, 2, 16), np.float16)),
     "q_out dtype must match q/k/v dtype, got q_out float16 for float32"),
    ({}, dict(k_out=np.empty((3, 1, 16), np.float16)),
     "k_out dtype must match q/k/v dtype, got k_out float16 for float32"),
    # in place: q and k themselves
    (dict(q=_read_only((3, 2, 16))), dict(inplace=True), "q is read-only, but ropekv writes"),
    (dict(k=_read_only((3, 1, 16))),
     dict(inplace=True, rope_scaling={"rope_type": "linear", "factor": 2.0}), "k is read-only"),
])
def test_errors_name_the_outputs_as_the_caller_passed_them(arrays, options, want):
    """A message about an output names what the caller passed (q_out, k_out,
    or q and k with inplace=True), not the returned values' names, on the
    fast path and (with an option) the general one; nothing is written."""
    T, D = 3, 16
    a = dict(q=randn((T, 2, D), np.float32), k=randn((T, 1, D), np.float32),
             v=randn((T, 1, D), np.float32), positions=np.arange(T), slots=np.arange(T),
             k_pool=randn((8, 1, D), np.float32), v_pool=randn((8, 1, D), np.float32))
    a.update(arrays)
    before = [bits(x) for x in a.values()]
    with pytest.raises(ValueError) as info:
        ropekv.rope_pool_fused(*a.values(), head_dim=D, num_qo_heads=2, num_kv_heads=1,
                               rope_base=1e4, **options)
    assert str(info.value).startswith(want), str(info.value)
    assert [bits(x) for x in a.values()] == before


def test_overlap_error_spells_the_in_place_call_as_python_does():
    q = randn((3, 2, 16), np.float32)
    with pytest.raises(ValueError, match=re.escape(
            "q_out overlaps q in memory: an array the call writes may not share memory with "
            "another of its arrays (the one exception is the in-place call: inplace=True, or "
            "q_out=q and k_out=k exactly); pass separate arrays")):
        ropekv.rope_pool_fused(q, randn((3, 1, 16), np.float32), randn((3, 1, 16), np.float32),
                               np.arange(3), np.arange(3), randn((8, 1, 16), np.float32),
                               randn((8, 1, 16), np.float32), head_dim=16, num_qo_heads=2,
                               num_kv_heads=1, rope_base=1e4, q_out=q[::-1])


# --- pools in other formats ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", DT)
@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_pools(kind, dtype):
    for T, D in ((1, 128), (50, 128), (9, 80), (4, 34)):
        scale_k, scale_v = float(RNG.uniform(0.01, 2.0)), float(RNG.uniform(0.01, 2.0))
        call_and_check(T, 8, 4, D, DTYPES[dtype], kv_cache_dtype=kind, k_scale=scale_k,
                       v_scale=scale_v)


def test_fp8_saturates_and_keeps_nan():
    """Values beyond the format's range saturate; NaN stays NaN; exact bits."""
    T, D = 2, 16
    k = (randn((T, 1, D), np.float32) * 1e4).astype(np.float32)
    v = (randn((T, 1, D), np.float32) * 1e6).astype(np.float32)
    v[0, 0, 3] = np.nan
    v[1, 0, 4] = np.inf
    kp, vp = np.zeros((T, 1, D), np.uint8), np.zeros((T, 1, D), np.uint8)
    q_rot, k_rot, _, _ = ropekv.rope_pool_fused(
        k, k, v, np.arange(T), np.arange(T), kp, vp, head_dim=D, num_qo_heads=1,
        num_kv_heads=1, rope_base=1e4, kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=3.0)
    assert bits(kp) == bits(fp8_encode(k_rot, "fp8_e4m3", 0.5))
    assert bits(vp) == bits(fp8_encode(v, "fp8_e4m3", 3.0))
    assert vp[0, 0, 3] & 0x7F == 0x7F and vp[1, 0, 4] == 0x7E  # NaN; +inf -> 448


def test_fp8_typed_pools():
    """ml_dtypes fp8 arrays are taken as their bits, and their type must
    agree with kv_cache_dtype."""
    T, D = 3, 32
    q = randn((T, 2, D), np.float32)
    kp = np.zeros((4, 2, D), FP8["fp8_e5m2"])
    vp = np.zeros((4, 2, D), FP8["fp8_e5m2"])
    _, k_rot, _, _ = ropekv.rope_pool_fused(q, q, q, np.arange(T), np.arange(T), kp, vp,
                                            head_dim=D, num_qo_heads=2, num_kv_heads=2,
                                            rope_base=1e4, kv_cache_dtype="fp8_e5m2")
    assert bits(kp[:T]) == bits(fp8_encode(k_rot, "fp8_e5m2", 1.0))
    before = [bits(kp), bits(vp)]
    with pytest.raises(ValueError, match="^" + re.escape(
            'pool dtypes must be uint8 (fp8 bits) or float8_e4m3fn for kv_cache_dtype="fp8_e4m3", '
            'got k_pool float8_e5m2, v_pool float8_e5m2; pass kv_cache_dtype="fp8_e5m2"') + "$"):
        ropekv.rope_pool_fused(q, q, q, np.arange(T), np.arange(T), kp, vp, head_dim=D,
                               num_qo_heads=2, num_kv_heads=2, rope_base=1e4,
                               kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="^" + re.escape(
            "pool dtypes must match q/k/v dtype, got k_pool float8_e5m2, v_pool float8_e5m2 for "
            'q/k/v float32; an fp8 pool: pass kv_cache_dtype="fp8_e5m2" with k_scale and '
            "v_scale") + "$"):
        ropekv.rope_pool_fused(q, q, q, np.arange(T), np.arange(T), kp, vp, head_dim=D,
                               num_qo_heads=2, num_kv_heads=2, rope_base=1e4)
    assert [bits(kp), bits(vp)] == before
    # Pools of two formats: no one option fits them, and the error says so.
    ve = np.zeros((4, 2, D), FP8["fp8_e4m3"])
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        typed = "float8_e4m3fn" if kv == "fp8_e4m3" else "float8_e5m2"
        with pytest.raises(ValueError, match="^" + re.escape(
                f'pool dtypes must be uint8 (fp8 bits) or {typed} for kv_cache_dtype="{kv}", got '
                "k_pool float8_e5m2, v_pool float8_e4m3fn; k_pool and v_pool hold two fp8 formats "
                "(float8_e5m2, float8_e4m3fn), which no one kv_cache_dtype covers") + "$"):
            ropekv.rope_pool_fused(q, q, q, np.arange(T), np.arange(T), kp, ve, head_dim=D,
                                   num_qo_heads=2, num_kv_heads=2, rope_base=1e4, kv_cache_dtype=kv)
    assert [bits(kp), bits(vp)] == before and not ve.view(np.uint8).any()
    # A typed pool and a pool of bytes in one call: the same encoding.
    kp2, vp2 = np.zeros((4, 2, D), FP8["fp8_e5m2"]), np.zeros((4, 2, D), np.uint8)
    ropekv.rope_pool_fused(q, q, q, np.arange(T), np.arange(T), kp2, vp2, head_dim=D,
                           num_qo_heads=2, num_kv_heads=2, rope_base=1e4, kv_cache_dtype="fp8_e5m2")
    assert bits(kp2) == bits(kp) and bits(vp2.view(FP8["fp8_e5m2"])) == bits(vp)


@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
def test_fp8_typed_inputs_are_named_in_dtype_errors(kv_cache_dtype):
    """An fp8-typed q/k/v (with fp8 pools, which then match it) or QK-norm
    weight is an unsupported dtype, named as its own fp8 dtype, not as the
    uint8 bits the core sees; nothing is written."""
    T, D, f8 = 3, 16, FP8["fp8_e4m3"]
    q, kp = randn((T, 2, D), np.float32).astype(f8), np.zeros((4, 2, D), f8)
    vp = kp.copy()
    before = [bits(a) for a in (q, kp, vp)]
    opts = {} if kv_cache_dtype is None else {"kv_cache_dtype": kv_cache_dtype}
    with pytest.raises(ValueError, match=re.escape(
            "q/k/v dtype must be float16, bfloat16 or float32, got float8_e4m3fn")):
        ropekv.rope_pool_fused(q, q, q, np.arange(T), np.arange(T), kp, vp, head_dim=D,
                               num_qo_heads=2, num_kv_heads=2, rope_base=1e4, **opts)
    assert [bits(a) for a in (q, kp, vp)] == before
    assert_rejected(re.escape("q_norm_weight dtype must be float32 or q's dtype (float32), got "
                              "float8_e4m3fn"), q_norm_weight=np.ones(16, f8))
    # An fp8 output too: its own dtype, not its bits'.
    q32 = randn((T, 2, D), np.float32)
    q_out = np.full((T, 2, D), 0x7F, np.uint8).view(f8)
    kp32, vp32 = randn((4, 2, D), np.float32), randn((4, 2, D), np.float32)
    before = [bits(a) for a in (q_out, kp32, vp32)]
    with pytest.raises(ValueError, match="^" + re.escape(
            "q_out dtype must match q/k/v dtype, got q_out float8_e4m3fn for float32") + "$"):
        ropekv.rope_pool_fused(q32, q32, q32, np.arange(T), np.arange(T), kp32, vp32, head_dim=D,
                               num_qo_heads=2, num_kv_heads=2, rope_base=1e4, q_out=q_out,
                               k_out=np.empty((T, 2, D), np.float32))
    assert [bits(a) for a in (q_out, kp32, vp32)] == before


@pytest.mark.parametrize("dtype", DT)
def test_float32_pools(dtype):
    for T in (1, 30):
        call_and_check(T, 8, 2, 128, DTYPES[dtype], kv_cache_dtype="float32")
    call_and_check(6, 4, 2, 64, DTYPES[dtype], kv_cache_dtype="float32", strided=True)


# --- QK-norm ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DT)
@pytest.mark.parametrize("weights", ["float32", "same"])
def test_qk_norm(dtype, weights):
    dt = DTYPES[dtype]
    wdt = "float32" if weights == "float32" else dt
    for T, D, R in ((1, 128, 128), (23, 128, 128), (5, 80, 32), (3, 34, 34)):
        call_and_check(T, 8, 2, D, dt, rotary_dim=R, q_norm=wdt, k_norm=wdt, norm_eps=1e-6)


def test_qk_norm_one_side_and_eps():
    f32 = np.dtype(np.float32)
    call_and_check(7, 4, 2, 64, f32, q_norm="float32")
    call_and_check(7, 4, 2, 64, f32, k_norm="float32", norm_eps=0.5)


def test_qwen3_like_all_together():
    """Qwen3-8B: QK-norm, fp8 pools, yarn scaling, two threads, strided q/k/v."""
    for threads in (1, 2):
        call_and_check(64, 32, 8, 128, BF16, base=1e6, rope_scaling=YARN_QWEN, q_norm=BF16,
                       k_norm=BF16, kv_cache_dtype="fp8_e4m3", k_scale=0.25, v_scale=0.5,
                       num_threads=threads)
    call_and_check(5, 32, 8, 128, BF16, q_norm="float32", k_norm="float32",
                   kv_cache_dtype="fp8_e4m3", strided=True)


def test_options_results_do_not_depend_on_threads():
    outs = []
    state = RNG.bit_generator.state
    for threads in (1, 2):
        RNG.bit_generator.state = state
        outs.append(call_and_check(300, 8, 2, 128, BF16, is_neox=False, q_norm="float32",
                                   kv_cache_dtype="fp8_e5m2", num_threads=threads))
    for a, b in zip(*outs):
        assert bits(a) == bits(b)


# --- errors: every bad option raises before anything is written -------------------------

def assert_rejected(match, **options):
    """The call raises ValueError(match) and changes no array."""
    T, H, D = 3, 2, 16
    q, k, v = randn((T, H, D), np.float32), randn((T, H, D), np.float32), randn((T, H, D), np.float32)
    pools = {"auto": np.float32, "float32": np.float32}.get(options.get("kv_cache_dtype", "auto"),
                                                           np.uint8)
    kp = options.pop("k_pool", None)
    kp = randn((8, H, D), np.float32).astype(pools) if kp is None else kp
    vp = kp.copy()
    q_out = poison((T, H, D), np.float32)
    before = [bits(a) for a in (q, k, v, kp, vp, q_out)]
    with pytest.raises(ValueError, match=match):
        ropekv.rope_pool_fused(q, k, v, options.pop("positions", np.arange(T)), np.arange(T), kp,
                               vp, head_dim=D, num_qo_heads=H, num_kv_heads=H, rope_base=1e4,
                               q_out=q_out, **options)
    assert [bits(a) for a in (q, k, v, kp, vp, q_out)] == before


def test_option_errors():
    f32 = np.float32
    assert_rejected("kv_cache_dtype must be one of", kv_cache_dtype="int8")
    assert_rejected(r"pool dtypes must be uint8 \(fp8 bits\) or float8_e4m3fn for "
                    r"kv_cache_dtype=\"fp8_e4m3\", got k_pool float32, v_pool float32$",
                    kv_cache_dtype="fp8_e4m3", k_pool=np.zeros((8, 2, 16), np.float32))
    assert_rejected("pool dtypes must be float32 for kv_cache_dtype=\"float32\"",
                    kv_cache_dtype="float32", k_pool=np.zeros((8, 2, 16), np.float16))
    assert_rejected("k_scale must be finite and > 0", kv_cache_dtype="fp8_e4m3", k_scale=0.0)
    assert_rejected("v_scale must be finite and > 0", kv_cache_dtype="fp8_e5m2",
                    v_scale=float("nan"))
    assert_rejected("k_scale/v_scale apply to fp8 pools only", k_scale=2.0)
    # the kernels divide in fp32: a scale that rounds to 0 or Inf there
    assert_rejected("k_scale must be finite and > 0 as a float32, got 1e-50",
                    kv_cache_dtype="fp8_e4m3", k_scale=1e-50)
    assert_rejected(r"v_scale must be finite and > 0 as a float32, got 1e\+39",
                    kv_cache_dtype="fp8_e5m2", v_scale=1e39)
    assert_rejected("norm_eps must be finite and >= 0", q_norm_weight=np.ones(16, f32),
                    norm_eps=-1.0)
    assert_rejected(r"norm_eps must be finite and >= 0 as a float32, got 1e\+39",
                    q_norm_weight=np.ones(16, f32), norm_eps=1e39)
    assert_rejected(r"q_norm_weight shape must be \[head_dim\] = \(16,\)",
                    q_norm_weight=np.ones(8, f32))
    # longer than a head (a weight of another layer or model): not cut to head_dim
    assert_rejected(r"q_norm_weight shape must be \[head_dim\] = \(16,\), got \(32,\)",
                    q_norm_weight=np.ones(32, f32))
    assert_rejected(r"k_norm_weight shape must be \[head_dim\] = \(16,\), got \(17,\)",
                    k_norm_weight=np.ones(17, f32))
    assert_rejected(r"k_norm_weight shape must be \[head_dim\] = \(16,\), got \(2, 16\)",
                    k_norm_weight=np.ones((2, 16), f32))
    assert_rejected("k_norm_weight dtype must be float32 or q's dtype",
                    k_norm_weight=np.ones(16, np.float64))
    assert_rejected(r"cos_sin_cache shape must be \[max_position, rotary_dim\]",
                    cos_sin_cache=np.ones((10, 8), f32), rotary_dim=16)
    assert_rejected("cos_sin_cache dtype must be float32 or q's dtype",
                    cos_sin_cache=np.ones((10, 16), np.float16))
    assert_rejected("cos_sin_cache and rope_scaling exclude each other",
                    cos_sin_cache=np.ones((10, 16), f32), rope_scaling=LINEAR)
    assert_rejected(r"positions\[1\] = 10 is outside cos_sin_cache, which has 10 rows",
                    cos_sin_cache=np.ones((10, 16), f32), positions=np.array([0, 10, 2]))
    assert_rejected(r"positions\[0\] = -1 is outside cos_sin_cache",
                    cos_sin_cache=np.ones((10, 16), f32), positions=np.array([-1, 1, 2]))


def test_float32_pool_without_opt_in_names_the_option():
    """The original call's dtype error stays the default, with the way out."""
    q = randn((2, 1, 8), BF16)
    with pytest.raises(ValueError, match="pool dtypes must match q/k/v dtype.*"
                                         "kv_cache_dtype=\"float32\""):
        ropekv.rope_pool_fused(q, q, q, np.arange(2), np.arange(2), np.zeros((2, 1, 8), np.float32),
                               np.zeros((2, 1, 8), np.float32), head_dim=8, num_qo_heads=1,
                               num_kv_heads=1, rope_base=1e4)


def test_options_do_not_change_the_plain_call():
    """Explicit defaults take the option path and give the same bits."""
    T, D = 9, 64
    q, k, v = randn((T, 4, D), BF16), randn((T, 2, D), BF16), randn((T, 2, D), BF16)
    pos, slots = RNG.integers(0, 1 << 16, T), RNG.permutation(T)
    outs = []
    for extra in ({}, {"kv_cache_dtype": "auto", "is_neox": True, "rope_scaling": {"rope_type": "default"}}):
        kp, vp = np.zeros((T, 2, D), BF16), np.zeros((T, 2, D), BF16)
        outs.append(ropekv.rope_pool_fused(q, k, v, pos, slots, kp, vp, head_dim=D,
                                           num_qo_heads=4, num_kv_heads=2, rope_base=1e4,
                                           **extra))
    for a, b in zip(*outs):
        assert bits(a) == bits(b)
