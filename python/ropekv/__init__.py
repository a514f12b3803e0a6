"""ropekv: fused RoPE + KV-cache scatter for LLM inference.

One call per attention layer per forward pass rotates the new queries and
keys with rotary position embeddings and writes the new keys and values into
the KV-cache pool, in one pass over memory. The call is a drop-in for
SGLang's ``sgl_kernel.metal.rope_pool_fused`` and runs on the CPU (Highway
SIMD, OpenMP) and on NVIDIA GPUs (one CUDA launch).

The math is NeoX / rotate-half RoPE (Su et al. 2021, "RoFormer"; as in
GPT-NeoX, Hugging Face transformers and vLLM), with the angle an fp32 number::

    inv_freq[i] = fp32(rope_base ** (-2 i / D))      (double, rounded once)
    theta       = fp32(fp32(position) * inv_freq[i])
    out[i]        = x[i] * cos(theta) - x[i + D/2] * sin(theta)
    out[i + D/2]  = x[i + D/2] * cos(theta) + x[i] * sin(theta)

computed in fp32 and rounded once to the output dtype.
"""

from __future__ import annotations

import operator
import os
from typing import Any, Optional, Tuple

import numpy as _np

from . import _ext

__all__ = [
    "rope_pool_fused",
    "set_checked",
    "is_checked",
    "check_device_errors",
    "has_cuda",
    "cpu_target",
    "__version__",
]

__version__: str = _ext.__version__

_NAMES = ("q", "k", "v", "positions", "slots", "k_pool", "v_pool", "q_rot", "k_rot")
_checked = os.environ.get("ROPEKV_CHECKED", "0") not in ("", "0", "false", "False")


def set_checked(enabled: bool) -> None:
    """Turns checked mode on or off for every later call.

    Checked mode adds the checks that cost time: two tokens naming the same
    non-negative slot (they would race for one pool row) raise ValueError,
    on the CPU before anything is written. On a GPU the kernel never writes
    outside the pool: a token whose slot is ``>= pool_size`` is skipped and
    recorded in a device-side flag, since reading slots on the host would
    cost a device-to-host sync; in checked mode every CUDA call synchronises
    its stream after the launch and raises the CPU's ``ValueError`` for it.
    Off by default; ``ROPEKV_CHECKED=1`` in the environment turns it on at
    import. Out-of-range slots on the CPU always raise.
    """
    global _checked
    _checked = bool(enabled)


def is_checked() -> bool:
    """Whether calls run in checked mode (see :func:`set_checked`)."""
    return _checked


def check_device_errors(device: int = 0, stream: Optional[Any] = None) -> None:
    """Raises for out-of-range slots that CUDA calls on ``device`` skipped.

    For unchecked CUDA calls (see :func:`set_checked`): synchronises
    ``stream`` (a ``torch.cuda.Stream``, ``cupy.cuda.Stream`` or raw
    ``cudaStream_t``; default the legacy default stream), reads and clears
    the device's error flag, and raises the CPU's ``ValueError``
    (``slots[i] = s is out of range for a pool of P rows ...``) if a call
    since the last check skipped a token. A no-op in a build without CUDA.
    """
    _ext.check_device_errors(_int_arg(device, "device"), _stream_handle(stream))


def has_cuda() -> bool:
    """Whether this build of ropekv has the CUDA backend."""
    return _ext.has_cuda()


def cpu_target() -> str:
    """The SIMD instruction set the CPU backend uses here, e.g. ``"AVX3"``."""
    return _ext.cpu_target()


def _framework(x: Any) -> str:
    return type(x).__module__.split(".", 1)[0]


def _as_array(x: Any, name: str) -> Tuple[Any, bool, bool]:
    """Returns (what the binding takes, is_bf16_view, is_read_only)."""
    if not (hasattr(x, "__dlpack__") or hasattr(x, "__array_interface__")):
        try:
            memoryview(x)
        except TypeError:
            raise ValueError(
                f"{name} must be an array (numpy, PyTorch, CuPy, MLX or anything "
                f"with __dlpack__), got {type(x).__name__}"
            ) from None
    if _framework(x) == "numpy":
        read_only = not x.flags.writeable
        # ml_dtypes bf16 (kind "V"): no DLPack/buffer code of its own. The kind
        # test first: dtype.name is a slow Python-level property.
        if x.dtype.kind == "V" and x.dtype.name == "bfloat16":
            return x.view(_np.uint16), True, read_only
        return x, False, read_only
    if _framework(x) == "mlx":
        import mlx.core as mx

        mx.eval(x)  # MLX is lazy: materialise the buffer before exposing it
    return x, False, False


def _empty_like(x: Any) -> Any:
    """A new array of x's shape, dtype, device and framework."""
    fw = _framework(x)
    if fw == "torch":
        import torch

        return torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device)
    if fw == "cupy":
        import cupy

        with cupy.cuda.Device(x.device.id):
            return cupy.empty(x.shape, dtype=x.dtype)
    if fw == "mlx":
        import mlx.core as mx

        out = mx.zeros(x.shape, dtype=x.dtype)
        mx.eval(out)
        return out
    return _np.empty(x.shape, dtype=x.dtype)


def _default_stream(x: Any) -> int:
    """The caller's current CUDA stream for x's framework (0 on the CPU)."""
    fw = _framework(x)
    if fw == "torch" and x.is_cuda:
        import torch

        return torch.cuda.current_stream(x.device).cuda_stream
    if fw == "cupy":
        import cupy

        return cupy.cuda.get_current_stream().ptr
    return 0


def _stream_handle(stream: Any) -> int:
    if stream is None:
        return 0
    for attr in ("cuda_stream", "ptr"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    return int(stream)


def _int_arg(value: Any, name: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None


def rope_pool_fused(
    q: Any,
    k: Any,
    v: Any,
    positions: Any,
    slots: Any,
    k_pool: Any,
    v_pool: Any,
    *,
    head_dim: int,
    num_qo_heads: int,
    num_kv_heads: int,
    rope_base: float,
    rotary_dim: Optional[int] = None,
    q_out: Optional[Any] = None,
    k_out: Optional[Any] = None,
    stream: Optional[Any] = None,
    num_threads: int = 0,
) -> Tuple[Any, Any, Any, Any]:
    """Rotates q and k with RoPE and scatters k_rot and v into the KV pool.

    Drop-in for SGLang's ``rope_pool_fused`` (NeoX RoPE on q/k plus the K/V
    scatter into one layer's pool). For every token ``t`` with
    ``slots[t] >= 0``: ``k_pool[slots[t]] = k_rot[t]`` and
    ``v_pool[slots[t]] = v[t]``; pool rows no token names are never touched.

    Args:
        q: ``[T, num_qo_heads, head_dim]`` float16, bfloat16 or float32: the
            queries of the T new tokens. Any strides (views of one fused QKV
            projection output are fine).
        k: ``[T, num_kv_heads, head_dim]``, q's dtype: the new keys.
        v: ``[T, num_kv_heads, head_dim]``, q's dtype: the new values.
        positions: ``[T]`` int32 or int64: absolute position of each token
            (any value; negative positions are valid RoPE).
        slots: ``[T]`` int32 or int64: pool row receiving each token; a
            negative slot means "do not write this token".
        k_pool: ``[P, num_kv_heads, head_dim]``, q's dtype: one layer's key
            cache, updated in place.
        v_pool: ``[P, num_kv_heads, head_dim]``, q's dtype: one layer's
            value cache, updated in place.
        head_dim: D, elements per head (even, >= 2).
        num_qo_heads: number of query heads.
        num_kv_heads: number of key/value heads.
        rope_base: RoPE theta (10000, 500000, 1e6, ...), finite and > 0.
        rotary_dim: R, the leading dimensions of each head that rotate
            (partial rotary: Phi-2 32 of 80, GPT-NeoX 24 of 96); dimensions
            R..head_dim-1 are copied. Even, 2 <= R <= head_dim; default
            head_dim. The angles use base ** (-2i / R).
        q_out: optional preallocated ``[T, num_qo_heads, head_dim]`` output
            for the rotated queries (else a new array is made).
        k_out: optional preallocated output for the rotated keys.
        stream: CUDA stream for GPU arrays (a ``torch.cuda.Stream``,
            ``cupy.cuda.Stream`` or a raw ``cudaStream_t`` as int); default
            the framework's current stream (PyTorch, CuPy).
        num_threads: CPU threads; 0 follows OMP_NUM_THREADS (else all cores).
            Results are identical for every thread count.

    Arrays are numpy (bf16 through ml_dtypes), PyTorch (CPU or CUDA), CuPy,
    MLX, or anything with ``__dlpack__``, all on one device. The GIL is
    released while the kernel runs.

    Returns:
        ``(q_rot, k_rot, k_pool, v_pool)``: new arrays of the caller's array
        type (or q_out/k_out) for the rotated q and k, and the two pools that
        were passed in, updated in place.

    Raises:
        ValueError: for any input that breaks the contract, with the message
            of SPEC section 3 (wrong rank or shape, mismatched dtypes, a
            dtype other than f16/bf16/f32, non-integer positions/slots, odd
            head_dim or rotary_dim, bad rope_base, mixed devices, read-only pools, a slot
            ``>= P``). Everything is checked before the first write: a call
            that raises leaves every array as it was. On a GPU, an
            out-of-range slot is skipped and raised only in checked mode
            (:func:`set_checked`).
    """
    arrays = [q, k, v, positions, slots, k_pool, v_pool]
    converted, bf16_mask, readonly_mask = [], 0, 0
    for i, (x, name) in enumerate(zip(arrays, _NAMES)):
        a, is_bf16, read_only = _as_array(x, name)
        converted.append(a)
        bf16_mask |= int(is_bf16) << i
        readonly_mask |= int(read_only) << i

    # Outputs: made here (in the caller's framework) once q and k are 3-D;
    # otherwise passed as None and the core reports the rank error.
    outs = []
    for i, (given, src) in enumerate(((q_out, q), (k_out, k)), start=7):
        if given is None and getattr(src, "ndim", None) == 3:
            given = _empty_like(src)
        outs.append(given)
        if given is not None:
            a, is_bf16, read_only = _as_array(given, _NAMES[i])
            converted.append(a)
            bf16_mask |= int(is_bf16) << i
            readonly_mask |= int(read_only) << i
        else:
            converted.append(None)

    handle = _stream_handle(stream) if stream is not None else _default_stream(q)
    _ext.run(
        *converted,
        _int_arg(head_dim, "head_dim"),
        _int_arg(num_qo_heads, "num_qo_heads"),
        _int_arg(num_kv_heads, "num_kv_heads"),
        float(rope_base),
        0 if rotary_dim is None else _int_arg(rotary_dim, "rotary_dim"),
        bf16_mask,
        readonly_mask,
        handle,
        _int_arg(num_threads, "num_threads"),
        _checked,
    )
    return outs[0], outs[1], k_pool, v_pool
