"""Float64 reference of ropekv's math (SPEC section 2), in plain numpy.

Independent of the C++ code: it shares nothing with the kernels or with the
C++ reference, and the golden vectors check it (test_reference.py).
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "data", "rope_neox_f64.json")

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}
MANTISSA_BITS = {np.dtype(np.float32): 23, np.dtype(np.float16): 10, BF16: 7}
MIN_NORMAL_EXP = {np.dtype(np.float32): -126, np.dtype(np.float16): -14, BF16: -126}

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


def angles(positions: np.ndarray, rotary_dim: int, base: float) -> np.ndarray:
    """theta[t, i] = fp32(fp32(pos[t]) * fp32(base ** (-2i/R))), as float64."""
    i = np.arange(rotary_dim // 2, dtype=np.float64)
    inv_freq = np.power(np.float64(base), -2.0 * i / rotary_dim).astype(np.float32)
    pos = np.asarray(positions).astype(np.float32)
    return (pos[:, None] * inv_freq[None, :]).astype(np.float32).astype(np.float64)


def rope(x: np.ndarray, positions: np.ndarray, base: float, rotary_dim: int | None = None):
    """NeoX RoPE of x [T, H, D] in float64; returns (out, |x1 c| + |x2 s| per element)."""
    x = np.asarray(x).astype(np.float64)
    D = x.shape[-1]
    R = D if rotary_dim is None else rotary_dim
    half = R // 2
    th = angles(positions, R, base)[:, None, :]
    c, s = np.cos(th), np.sin(th)
    x1, x2 = x[..., :half], x[..., half:R]
    out = x.copy()
    out[..., :half] = x1 * c - x2 * s
    out[..., half:R] = x2 * c + x1 * s
    mag = np.zeros_like(x)
    mag[..., :half] = np.abs(x1 * c) + np.abs(x2 * s)
    mag[..., half:R] = np.abs(x2 * c) + np.abs(x1 * s)
    return out, mag


def ulp(dtype: np.dtype, ref: np.ndarray) -> np.ndarray:
    """One ulp of `dtype` at |ref| (the subnormal spacing below the normals)."""
    a = np.abs(ref)
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    e = np.maximum(e, MIN_NORMAL_EXP[dtype])
    return np.ldexp(1.0, (e - MANTISSA_BITS[dtype]).astype(np.int64))


def tolerance(dtype: np.dtype, ref: np.ndarray, mag: np.ndarray) -> np.ndarray:
    """One rounding of the output dtype, plus the bound of the fp32 arithmetic
    before it (cos/sin within a few ulp, two products, one sum)."""
    return ulp(dtype, ref) + 4.0 * 2.0**-24 * mag


def assert_close(got: np.ndarray, ref: np.ndarray, mag: np.ndarray, what: str = "") -> None:
    got64 = np.asarray(got).astype(np.float64)
    err = np.abs(got64 - ref)
    tol = tolerance(np.asarray(got).dtype, ref, mag)
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


def load_golden():
    with open(GOLDEN) as f:
        return json.load(f)["cases"]
