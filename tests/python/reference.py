"""Float64 reference of ropekv's math (SPEC section 2), in plain numpy.

Independent of the C++ code: it shares nothing with the kernels or with the
C++ reference, and the golden vectors check it (test_reference.py).
"""

from __future__ import annotations

import json
import math
import os

import ml_dtypes
import numpy as np

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "data", "rope_neox_f64.json")

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}
MANTISSA_BITS = {np.dtype(np.float32): 23, np.dtype(np.float16): 10, BF16: 7}
MIN_NORMAL_EXP = {np.dtype(np.float32): -126, np.dtype(np.float16): -14, BF16: -126}

# The rope_scaling blocks of the tests (Hugging Face form): Llama 3.1 and 3.2,
# Llama-4 Scout, Qwen2.5's yarn, a DeepSeek-style yarn with mscale, linear,
# Gemma-4's proportional.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
LLAMA32 = dict(LLAMA3, factor=32.0)
# Llama-4 Scout's block: equal low and high factors, so no band is smoothed
LLAMA4_SCOUT = dict(LLAMA3, factor=16.0, high_freq_factor=1.0)
YARN_QWEN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
YARN_MSCALE = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}
LINEAR = {"rope_type": "linear", "factor": 2.5}
# Gemma-4's full-attention layers: a quarter of the pairs rotate, the rest stay
PROPORTIONAL = {"rope_type": "proportional", "partial_rotary_factor": 0.25}

# SPEC section 6 configs whose rotary dim equals head_dim: (name, Hq, Hk, D, base)
MODELS = [
    ("Llama-3.1-8B", 32, 8, 128, 500000.0),
    ("Llama-3.2-1B", 32, 8, 64, 500000.0),
    ("Llama-2-7B", 32, 32, 128, 10000.0),
    ("Mistral-7B-v0.3", 32, 8, 128, 1000000.0),
    ("Qwen2.5-7B", 28, 4, 128, 1000000.0),
    ("Qwen3-8B", 32, 8, 128, 1000000.0),
    ("Gemma-2-9B", 16, 8, 256, 10000.0),
    ("Phi-3-mini-4k", 32, 32, 96, 10000.0),
]


def angles(positions: np.ndarray, rotary_dim: int, base: float, inv_freq=None) -> np.ndarray:
    """theta[t, i] = fp32(fp32(pos[t]) * fp32(inv_freq[i])), as float64; inv_freq
    defaults to base ** (-2i/R)."""
    if inv_freq is None:
        i = np.arange(rotary_dim // 2, dtype=np.float64)
        inv_freq = np.power(np.float64(base), -2.0 * i / rotary_dim)
    inv_freq = np.asarray(inv_freq, dtype=np.float64).astype(np.float32)
    pos = np.asarray(positions).astype(np.float32)
    return (pos[:, None] * inv_freq[None, :]).astype(np.float32).astype(np.float64)


def scaling_type(rope_scaling) -> str | None:
    return None if rope_scaling is None else rope_scaling.get("rope_type", rope_scaling.get("type"))


def rotary_dim_of(head_dim: int, rotary_dim: int | None, rope_scaling=None) -> int:
    """R of a call: rotary_dim, else int(head_dim * partial_rotary_factor) of a
    rope_parameters dict (transformers' rule; proportional's factor is the
    fraction of pairs that rotate instead), else head_dim."""
    if rotary_dim is not None:
        return rotary_dim
    if (isinstance(rope_scaling, dict) and "partial_rotary_factor" in rope_scaling
            and scaling_type(rope_scaling) != "proportional"):
        return int(head_dim * rope_scaling["partial_rotary_factor"])
    return head_dim


def hf_inv_freq(base: float, rotary_dim: int, rope_scaling=None) -> np.ndarray:
    """Inverse frequencies of transformers' rope initialisation functions
    (modeling_rope_utils: default, linear, llama3, yarn, proportional), in
    float64, written from the formulas (Peng et al. 2023 for yarn; Meta's
    Llama 3.1 release for llama3; Gemma-4's for proportional)."""
    R = rotary_dim
    i = np.arange(0, R, 2, dtype=np.float64)
    freq = 1.0 / np.power(float(base), i / R)
    kind = scaling_type(rope_scaling)
    if kind in (None, "default"):
        return freq
    if kind == "proportional":  # the first int(p * R // 2) pairs rotate, the rest do not
        rotating = int(float(rope_scaling.get("partial_rotary_factor", 1.0)) * R // 2)
        return np.where(np.arange(R // 2) < rotating, freq / float(rope_scaling.get("factor", 1.0)),
                        0.0)
    factor = float(rope_scaling["factor"])
    if kind == "linear":
        return freq / factor
    if kind == "llama3":
        lo, hi = float(rope_scaling["low_freq_factor"]), float(rope_scaling["high_freq_factor"])
        old = float(rope_scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / freq
        out = np.where(wavelen > old / lo, freq / factor, freq)
        # (lo == hi: the band is one wavelength, taken as scaled: smooth 0)
        smooth = (old / wavelen - lo) / (hi - lo) if hi > lo else np.zeros_like(freq)
        mid = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        return np.where(mid, (1 - smooth) * out / factor + smooth * out, out)
    if kind == "yarn":
        old = float(rope_scaling["original_max_position_embeddings"])
        fast = float(rope_scaling.get("beta_fast") or 32)
        slow = float(rope_scaling.get("beta_slow") or 1)

        def corr(rot):
            return R * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))

        low, high = corr(fast), corr(slow)
        if rope_scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, R - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(R // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        return freq / factor * (1 - extrapolation) + freq * extrapolation
    raise ValueError(kind)


def hf_attention_factor(rope_scaling=None) -> float:
    """yarn's factor on cos and sin (1 otherwise), as transformers computes it."""
    if not rope_scaling or rope_scaling.get("rope_type", rope_scaling.get("type")) != "yarn":
        return 1.0
    if rope_scaling.get("attention_factor"):
        return float(rope_scaling["attention_factor"])
    factor = float(rope_scaling["factor"])

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if m and m_all:
        return get_mscale(factor, m) / get_mscale(factor, m_all)
    return get_mscale(factor)


def rope(x: np.ndarray, positions: np.ndarray, base: float, rotary_dim: int | None = None, *,
         is_neox: bool = True, inv_freq=None, attention_factor: float = 1.0,
         cos_sin_cache=None, norm_weight=None, norm_eps: float = 1e-6):
    """RoPE of x [T, H, D] in float64; returns (out, bound magnitude per element).

    NeoX pairs (i, i + R/2) or interleaved (2i, 2i + 1); cos/sin from the fp32
    angle, times attention_factor, or read from cos_sin_cache[pos] (vLLM
    layout); with norm_weight, an RMSNorm over each head first. The magnitude
    is what the fp32 arithmetic's error scales with (|x1 c| + |x2 s|, and for
    the copied dims |x|).
    """
    x = np.asarray(x).astype(np.float64)
    D = x.shape[-1]
    R = D if rotary_dim is None else rotary_dim
    half = R // 2
    if norm_weight is not None:
        w = np.asarray(norm_weight).astype(np.float64)
        r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + norm_eps)
        x = x * r * w
    if cos_sin_cache is not None:
        table = np.asarray(cos_sin_cache).astype(np.float64)[np.asarray(positions)]
        c, s = table[:, None, :half], table[:, None, half:R]
    else:
        th = angles(positions, R, base, inv_freq)[:, None, :]
        m = np.float64(np.float32(attention_factor))
        c, s = np.cos(th) * m, np.sin(th) * m
    # Slices, not index arrays: views, several times faster on large T.
    if is_neox:
        i1, i2 = slice(0, half), slice(half, R)
    else:
        i1, i2 = slice(0, R, 2), slice(1, R, 2)
    x1, x2 = x[..., i1], x[..., i2]
    out = x.copy()
    out[..., i1] = x1 * c - x2 * s
    out[..., i2] = x2 * c + x1 * s
    mag = np.abs(x)
    mag[..., i1] = np.abs(x1 * c) + np.abs(x2 * s)
    mag[..., i2] = np.abs(x2 * c) + np.abs(x1 * s)
    return out, mag


FP8 = {"fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn), "fp8_e5m2": np.dtype(ml_dtypes.float8_e5m2)}


def fp8_encode(x, kind: str, scale: float) -> np.ndarray:
    """The reference quantiser: fp32(x / scale), saturated to the format's
    largest finite value, rounded to nearest even (ml_dtypes' cast); uint8 bits.
    Every NaN is 0x7F (a NaN in both formats, sign clear), as the CUDA
    hardware conversion gives it and ropekv stores it."""
    dt = FP8[kind]
    y = (np.asarray(x).astype(np.float32) / np.float32(scale)).astype(np.float32)
    big = np.float32(ml_dtypes.finfo(dt).max)
    nan = np.isnan(y)
    y = np.where(nan, np.float32(0), np.clip(y, -big, big))
    return np.where(nan, np.uint8(0x7F), y.astype(dt).view(np.uint8))


def fp8_decode(bits_u8: np.ndarray, kind: str) -> np.ndarray:
    return np.asarray(bits_u8).view(FP8[kind]).astype(np.float64)


def ulp(dtype: np.dtype, ref: np.ndarray) -> np.ndarray:
    """One ulp of `dtype` at |ref| (the subnormal spacing below the normals)."""
    # frexp: |ref| = m 2^e with m in [0.5, 1), so floor(log2 |ref|) = e - 1,
    # read from the bits (a third of log2's time on large arrays).
    _, e = np.frexp(np.where(ref != 0, ref, 1.0))
    e = np.maximum(e - 1, MIN_NORMAL_EXP[dtype])
    return np.ldexp(1.0, e - MANTISSA_BITS[dtype])


def tolerance(dtype: np.dtype, ref: np.ndarray, mag: np.ndarray, rel: float = 4.0) -> np.ndarray:
    """One rounding of the output dtype, plus the bound of the fp32 arithmetic
    before it: `rel` fp32 units (2^-24) of the magnitude. 4 covers cos/sin
    within a few ulp, two products and one sum; QK-norm adds its fp32 sum of
    squares (callers pass about head_dim / 2 more)."""
    return ulp(dtype, ref) + rel * 2.0**-24 * mag


def assert_close(got: np.ndarray, ref: np.ndarray, mag: np.ndarray, what: str = "",
                 rel: float = 4.0) -> None:
    got64 = np.asarray(got).astype(np.float64)
    err = np.abs(got64 - ref)
    tol = tolerance(np.asarray(got).dtype, ref, mag, rel)
    bad = ~(err <= tol)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements off; first at {idx}: "
            f"got {got64[idx]!r}, want {ref[idx]!r} (tol {tol[idx]:.3g})"
        )


def poison(shape, dtype: np.dtype) -> np.ndarray:
    """An array full of NaN, so an element the kernel never wrote fails."""
    return np.full(shape, np.nan, dtype=np.float32).astype(dtype)


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def check_pool_rows(k_pool, v_pool, k_before, v_before, slots, k_rot, v, what: str = "") -> None:
    """Pools of q's dtype after a call: row slots[t] holds k_rot[t] and v[t]
    bit for bit (the last token naming a row; slot -1 names none), every
    other row is as it was before the call (k_before, v_before)."""
    named = {}
    for t, s in enumerate(np.asarray(slots).tolist()):
        if s >= 0:
            named[s] = t
    for s in range(k_pool.shape[0]):
        want_k, want_v = (k_rot[named[s]], v[named[s]]) if s in named else (k_before[s], v_before[s])
        assert bits(k_pool[s]) == bits(want_k), f"{what} k_pool[{s}]"
        assert bits(v_pool[s]) == bits(want_v), f"{what} v_pool[{s}]"


def load_golden():
    with open(GOLDEN) as f:
        return json.load(f)["cases"]
