"""ropekv: fused RoPE + KV-cache scatter for LLM inference.

One call per attention layer per forward pass rotates the new queries and
keys with rotary position embeddings and writes the new keys and values into
the KV-cache pool, in one pass over memory. The call is a drop-in for
SGLang's ``sgl_kernel.metal.rope_pool_fused`` and runs on the CPU (Highway
SIMD, OpenMP) and on NVIDIA GPUs (one CUDA launch).

The math is NeoX / rotate-half RoPE (Su et al. 2021, "RoFormer"; as in
GPT-NeoX, Hugging Face transformers and vLLM), with the angle an fp32 number::

    inv_freq[i] = fp32(rope_base ** (-2 i / R))      (double, rounded once)
    theta       = fp32(fp32(position) * inv_freq[i])
    out[i]        = x[i] * cos(theta) - x[i + R/2] * sin(theta)
    out[i + R/2]  = x[i + R/2] * cos(theta) + x[i] * sin(theta)

for i in [0, R/2), R the rotary_dim (default head_dim; dimensions R.. are
copied), computed in fp32 and rounded once to the output dtype.
"""

from __future__ import annotations

import numbers
import operator
import os
import re as _re
import sys as _sys
from typing import Any, Optional, Tuple

import numpy as _np

from . import _ext

__all__ = [
    "rope_pool_fused",
    "rope_inv_freq",
    "set_checked",
    "is_checked",
    "check_device_errors",
    "has_cuda",
    "cpu_target",
    "__version__",
]

__version__: str = _ext.__version__

_NAMES = ("q", "k", "v", "positions", "slots", "k_pool", "v_pool", "q_rot", "k_rot")
_ALL_NAMES = _NAMES + ("cos_sin_cache", "q_norm_weight", "k_norm_weight")
# The core names the outputs as its C++ struct does (q_rot, k_rot; the in-place
# call is q_rot = q there); _in_callers_names puts the caller's names in.
_CORE_IN_PLACE = "the in-place call, q_rot = q and k_rot = k exactly"
_PY_IN_PLACE = "the in-place call: inplace=True, or q_out=q and k_out=k exactly"
_OUTPUT_NAME = _re.compile(r"\b([qk])_rot\b")


def _checked_from_env(value: str) -> bool:
    """ROPEKV_CHECKED's value as a switch: 1/true/yes/on or 0/false/no/off
    (any case; empty = off); any other value turns checked mode on, with a
    warning (the safe reading of a setting meant to catch errors)."""
    v = value.strip().lower()
    if v in ("", "0", "false", "no", "off"):
        return False
    if v not in ("1", "true", "yes", "on"):
        import warnings

        warnings.warn(f"ROPEKV_CHECKED={value!r} is not 1/true/yes/on or 0/false/no/off: "
                      f"checked mode is on", RuntimeWarning, stacklevel=2)
    return True


_checked = _checked_from_env(os.environ.get("ROPEKV_CHECKED", ""))


def set_checked(enabled: bool) -> None:
    """Turns checked mode on or off for every later call.

    Checked mode adds the checks that cost time: two tokens naming the same
    non-negative slot (they would race for one pool row) raise ValueError,
    on the CPU before anything is written. On a GPU the kernel never writes
    outside the pool: a token whose slot is ``>= pool_size`` is skipped and
    recorded in a device-side flag, since reading slots on the host would
    cost a device-to-host sync; in checked mode every CUDA call synchronises
    its stream after the launch and raises the CPU's ``ValueError`` for it.
    Off by default; ``ROPEKV_CHECKED=1`` in the environment (or true, yes,
    on, in any case) turns it on at import. Out-of-range slots on the CPU
    always raise.

    Args:
        enabled: a bool (numpy's too).

    Raises:
        ValueError: for anything else (a string such as ``"no"`` included).
    """
    global _checked
    if not isinstance(enabled, (bool, _np.bool_)):
        raise ValueError(f"set_checked takes a bool, got {enabled!r}")
    _checked = bool(enabled)


def is_checked() -> bool:
    """Whether calls run in checked mode (see :func:`set_checked`)."""
    return _checked


def check_device_errors(device: int = 0, stream: Optional[Any] = None) -> None:
    """Raises for the tokens that CUDA calls on ``device`` skipped.

    For unchecked CUDA calls (see :func:`set_checked`): synchronises
    ``stream``, reads and clears the device's error flag, and raises if a
    call since the last check skipped a token. A no-op in a build without
    CUDA, for a device no call has run on (or no device: a negative id, or
    one beyond any), and while ``stream`` is being captured into a CUDA
    graph.

    Args:
        device: the CUDA device ordinal (an int).
        stream: a ``torch.cuda.Stream``, ``cupy.cuda.Stream`` or raw
            ``cudaStream_t`` (int); default the legacy default stream.

    Raises:
        ValueError: the CPU's message for a skipped token (``slots[i] = s is
            out of range for a pool of P rows ...``, or ``positions[i] = p is
            outside cos_sin_cache ...``), or a device or stream that is not
            an int or a stream.
        RuntimeError: a CUDA API call failed.
    """
    device = _int_arg(device, "device")
    if not 0 <= device < 2 ** 31:  # (no such device: a no-op, as in C++)
        return
    _ext.check_device_errors(device, _stream_handle(stream))


def has_cuda() -> bool:
    """Whether this build of ropekv has the CUDA backend."""
    return _ext.has_cuda()


def cpu_target() -> str:
    """The SIMD instruction set the CPU backend uses here, e.g. ``"AVX3"``."""
    return _ext.cpu_target()


def _framework(x: Any) -> str:
    """The library x's type comes from (its module's first name); for a
    subclass defined elsewhere of numpy's ndarray or torch's Tensor, "numpy"
    or "torch", whose rules it follows (bf16 and fp8 passed as their bits,
    PyTorch's memory checks, outputs made by its base library)."""
    fw = type(x).__module__.split(".", 1)[0]
    if fw in ("numpy", "torch"):
        return fw
    if isinstance(x, _np.ndarray):
        return "numpy"
    torch = _sys.modules.get("torch")  # (never imported for this check)
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    return fw


# How the binding's dtype_views names an array passed as a view of its bits
# (2 bits per array): numpy has no bf16 or fp8 of its own, so such arrays
# travel as uint16 / uint8 and the core is told their dtype.
_VIEW_BF16, _VIEW_FP8 = 1, {"float8_e4m3fn": 2, "float8_e5m2": 3}
try:  # numpy's bf16 and fp8 come from ml_dtypes (without it, numpy has none)
    import ml_dtypes as _ml_dtypes

    _BF16 = _np.dtype(_ml_dtypes.bfloat16)
    _FP8_DTYPES = (_np.dtype(_ml_dtypes.float8_e4m3fn), _np.dtype(_ml_dtypes.float8_e5m2))
except ImportError:  # pragma: no cover
    _BF16, _FP8_DTYPES = None, ()


def _torch_without_memory(x: Any) -> bool:
    """Whether torch tensor x has elements but no memory: its storage was
    freed or resized to 0 bytes (as FSDP does). Its data_ptr() is then null
    plus the view's offset in bytes, an address no live storage has. (A
    tensor that has no data_ptr() at all, sparse or a wrapper, is left to
    DLPack, which reports it.)"""
    try:
        return x.data_ptr() == x.storage_offset() * x.element_size() and x.numel() > 0
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _check_numpy_layout(x: Any, name: str) -> None:
    """Raises ValueError for a numpy array no DLPack view describes: a
    byte-swapped dtype, or strides that are not whole elements."""
    dt = x.dtype
    if not dt.isnative:
        raise ValueError(f"{name} has a byte-swapped dtype ({dt.str}): pass an array in the "
                         f"machine's byte order")
    if any(st % dt.itemsize for st in x.strides):
        raise ValueError(f"{name} has strides {x.strides} that are not whole elements "
                         f"({dt.itemsize} bytes each): pass a copy (numpy.ascontiguousarray)")


def _dlpack_dtype(dt: Any) -> bool:
    """Whether numpy dtype dt has a DLPack type: bool, integers, float16/32/64,
    complex64/128 (not long double, nor ml_dtypes' other narrow floats and
    ints, which numpy keeps as kind "V" or one-byte "f")."""
    k = dt.kind
    return k in "biu" or (k == "f" and dt.itemsize in (2, 4, 8)) or (k == "c" and
                                                                     dt.itemsize in (8, 16))


def _check_jax_exportable(x: Any, name: str) -> None:
    """Raises ValueError for a JAX value with no one buffer to read: a tracer
    (a call inside jax.jit or another transformation), a deleted array, or
    one sharded over several devices (DLPack exports one device's buffer)."""
    import jax

    if isinstance(x, jax.core.Tracer):
        raise ValueError(f"{name} is a JAX tracer (the call is inside jax.jit or another "
                         f"transformation): ropekv runs eagerly on concrete arrays; call it "
                         f"outside the traced function")
    if getattr(x, "is_deleted", lambda: False)():
        raise ValueError(f"{name} is a deleted JAX array (its buffer was freed or donated)")
    n = len(x.devices()) if hasattr(x, "devices") else 1
    if n > 1:
        raise ValueError(f"{name} is a JAX array sharded over {n} devices: pass one device's "
                         f"array (jax.device_put({name}, device))")


def _as_array(x: Any, name: str, written: bool = False) -> Tuple[Any, int, bool]:
    """Returns (what the binding takes, its dtype view (0, _VIEW_BF16 or a
    _VIEW_FP8 value), is_read_only); whether memory of an unknown kind is
    read-only is asked only where the call writes (`written`)."""
    if not (hasattr(x, "__dlpack__") or hasattr(x, "__array_interface__")):
        try:
            memoryview(x)
        except TypeError:
            raise ValueError(
                f"{name} must be an array (numpy, PyTorch, CuPy, JAX, MLX or anything "
                f"with __dlpack__), got {type(x).__name__}"
            ) from None
    fw = _framework(x)
    if fw == "numpy":
        if isinstance(x, _np.ma.MaskedArray):
            # (its data would be read and written as if no element were masked)
            fix = (f"pass {name}.data (its memory: ropekv writes there, the mask stays)"
                   if written else f"pass {name}.filled(value), or {name}.data for every value")
            raise ValueError(f"{name} is a numpy masked array, whose mask ropekv would "
                             f"ignore; {fix}")
        _check_numpy_layout(x, name)
        read_only = not x.flags.writeable
        # ml_dtypes bf16 and fp8 have no DLPack/buffer code of their own: they
        # travel as their bits (dtype equality: dtype.name is a slow property).
        dt = x.dtype
        if dt == _BF16:
            return x.view(_np.uint16), _VIEW_BF16, read_only
        if dt in _FP8_DTYPES:
            return x.view(_np.uint8), _VIEW_FP8[dt.name], read_only
        if not _dlpack_dtype(dt):
            # (The binding could not even take it: a TypeError naming its
            # signature, not the contract's ValueError.)
            raise ValueError(
                f"{name} has dtype {dt.name}, which ropekv does not take: q, k, v and the "
                f"outputs float16, bfloat16 or float32; pools of those or float8_e4m3fn / "
                f"float8_e5m2 (or their uint8 bits); positions and slots int32 or int64")
        return x, 0, read_only
    if fw == "torch":
        import torch

        if x.device.type == "meta":
            raise ValueError(f"{name} is on PyTorch's meta device, which holds no memory: pass "
                             f"a CPU or CUDA tensor")
        if _torch_without_memory(x):
            # Neither a numpy view (numpy would allocate an array of its own,
            # and a pool write would land there and be lost) nor DLPack (a
            # pointer to nothing): the contract check's error for a null array.
            raise ValueError(f"{name} has no data pointer (a null array with {x.numel()} "
                             f"elements)")
        if x.is_neg():
            # Its memory holds the values negated (torch applies the sign
            # lazily); DLPack would hand over the memory as it is.
            raise ValueError(f"{name} has PyTorch's negative bit set (its memory holds the "
                             f"values negated): pass {name}.resolve_neg()")
        # (str() of a dtype costs microseconds: only for one-byte dtypes)
        fp8 = _VIEW_FP8.get(str(x.dtype)[6:], 0) if x.dtype.itemsize == 1 else 0
        if x.device.type == "cpu" and not x.requires_grad:
            # A numpy view of a CPU tensor (same memory) is imported in a
            # third of the time of its __dlpack__ capsule (~0.7 vs 2.2 us).
            try:
                if x.dtype == torch.bfloat16:
                    return x.view(torch.int16).numpy(), _VIEW_BF16, False
                if fp8:
                    return x.view(torch.uint8).numpy(), fp8, False
                return x.numpy(), 0, False
            except (TypeError, RuntimeError):  # a dtype numpy lacks: DLPack reports it
                pass
        if fp8:
            return x.view(torch.uint8), fp8, False
        return x, 0, False  # (PyTorch tensors are writable)
    if fw in ("jax", "jaxlib"):
        _check_jax_exportable(x, name)
        return x, 0, True  # JAX arrays are immutable: inputs only
    if fw == "mlx":
        import mlx.core as mx

        mx.eval(x)  # MLX is lazy: materialise the buffer before exposing it
        return x, 0, False
    if not hasattr(x, "__dlpack__"):
        # A buffer (memoryview, array.array) or an __array_interface__
        # object: numpy views the same memory and knows if it is read-only.
        return _as_array(_np.asarray(x), name, written)
    # Another DLPack producer (CuPy, ...): its read-only flag (DLPack 1.0).
    return x, 0, written and not _ext.writable(x)


# DLPack type codes (the extension's, from dlpack.h and ropekv.h): the dtypes
# _ext.run_fast reads in place.
_DL_INT, _DL_UINT, _DL_FLOAT, _DL_BFLOAT, _DL_E4M3, _DL_E5M2 = _ext.DL_CODES
_DL_FP8 = {"float8_e4m3fn": _DL_E4M3, "float8_e5m2": _DL_E5M2}
# Types whose calls _ext.run_fast takes: numpy.ndarray now, torch.Tensor
# once a call has seen that torch is imported.
_FAST_TENSOR: Optional[type] = None


def _register_fast_numpy() -> None:
    """Tells _ext.run_fast the numpy dtypes it reads, as exact dtype objects:
    a byte-swapped or otherwise unusual dtype is none of them and takes the
    general path. Equal dtypes can be distinct objects (int64 is 'l' and
    'q'), hence a list of every C name."""
    codes = {"f": _DL_FLOAT, "i": _DL_INT, "u": _DL_UINT}
    table = [(dt, codes[dt.kind], dt.itemsize * 8) for dt in map(_np.dtype, "efilqB")]
    if _BF16 is not None:
        table.append((_BF16, _DL_BFLOAT, 16))
    table += [(dt, _DL_FP8[dt.name], 8) for dt in _FP8_DTYPES]
    _ext.fast_path_types("numpy", _np.ndarray, table, _np.empty, None)


_TORCH_FAST: Optional[Tuple[Any, ...]] = None
_DECLINE = object()  # a rope_scaling the fast path leaves to the general path


def _torch_fast() -> Optional[Tuple[Any, ...]]:
    """(torch.Tensor, torch.bfloat16, torch.int16, the dtypes numpy shares,
    torch.strided, torch.is_grad_enabled, torch._C._increment_version,
    torch.is_inference_mode_enabled)
    once torch is imported (by the caller: ropekv never imports it here),
    else None: the inline path of CPU tensors in rope_pool_fused. The first
    time, also tells _ext.run_fast the tensor type and dtypes it reads."""
    global _TORCH_FAST, _FAST_TENSOR
    if _TORCH_FAST is None:
        torch = _sys.modules.get("torch")
        if torch is None or not hasattr(torch, "Tensor"):
            return None
        _TORCH_FAST = (torch.Tensor, torch.bfloat16, torch.int16,
                       (torch.float32, torch.float16, torch.int32, torch.int64), torch.strided,
                       torch.is_grad_enabled, torch._C._increment_version,
                       torch.is_inference_mode_enabled)
        _register_fast_torch(torch)
        _FAST_TENSOR = torch.Tensor
    return _TORCH_FAST


def _output_names(inplace: Any, q_out: Any, k_out: Any) -> Tuple[str, str]:
    """The names the caller gave the outputs, for messages: q / k with
    inplace=True, q_out / k_out where given, else q_rot / k_rot (made by
    ropekv). Called on the general path and for an error only: a fast-path
    call that succeeds does no work for its messages."""
    if inplace:
        return "q", "k"
    return ("q_rot" if q_out is None else "q_out"), ("k_rot" if k_out is None else "k_out")


def _in_callers_names(error: ValueError, q_name: str, k_name: str) -> ValueError:
    """The core's message of `error` in the Python call's terms: its q_rot and
    k_rot are named as the caller passed them (q_name, k_name: "q_out" or "q"
    with inplace=True; "q_rot" for an output ropekv made), and its in-place
    exception as the Python call spells it."""
    message = str(error).replace(_CORE_IN_PLACE, _PY_IN_PLACE)
    if q_name != "q_rot" or k_name != "k_rot":
        names = {"q": q_name, "k": k_name}
        message = _OUTPUT_NAME.sub(lambda m: names[m.group(1)], message)
    return ValueError(message)


def _torch_written(tf: Tuple[Any, ...], k_pool: Any, v_pool: Any, q_out: Any, k_out: Any,
                   inplace: bool) -> Tuple[Any, ...]:
    """The PyTorch tensors among the arrays a call writes (the pools, given
    outputs, q and k in place), whose version counters the call bumps after
    writing, as PyTorch's own in-place ops do: autograd then refuses a
    backward pass through a value the call changed. Raises ValueError, before
    anything is written, outside inference mode only: for one that requires
    grad while grad mode is on (ropekv is not differentiable, and autograd
    could not record the write), and for an inference tensor (which PyTorch's
    own in-place ops refuse there)."""
    T = tf[0]
    # Plain tensors first, without isinstance (a decode call's host time).
    if type(k_pool) is T and type(v_pool) is T and q_out is None and k_out is None:
        written: Tuple[Any, ...] = (k_pool, v_pool)
    elif type(k_pool) is T and type(v_pool) is T and type(q_out) is T and type(k_out) is T:
        written = (k_pool, v_pool, q_out, k_out)
    else:
        written = tuple([x for x in (k_pool, v_pool, q_out, k_out) if isinstance(x, T)])
    if tf[7]():  # (inference mode, as in serving: no tensor's flag is read)
        return written
    grad = tf[5]()
    for x in written:
        # (Outside inference mode PyTorch's own in-place ops refuse an
        # inference tensor; with grad mode on, one that requires grad. In
        # inference mode, grad mode on or off, they refuse neither.)
        inference = x.is_inference()
        if inference or (grad and x.requires_grad):
            names = ("k_pool", "v_pool", "q" if inplace else "q_out", "k" if inplace else "k_out")
            name = next(n for n, y in zip(names, (k_pool, v_pool, q_out, k_out)) if y is x)
            if inference:
                raise ValueError(
                    f"{name} is an inference tensor (made under torch.inference_mode()), which "
                    f"PyTorch lets only code inside inference mode update in place, and ropekv "
                    f"writes it: make the call inside torch.inference_mode(), as PyTorch's own "
                    f"in-place ops must be")
            raise ValueError(
                f"{name} requires grad, and ropekv writes it in place, which autograd cannot "
                f"record (ropekv is not differentiable): call under torch.no_grad() or "
                f"torch.inference_mode(), or pass {name}.detach() (the same memory)")
    return written


def _bump_versions(written: Tuple[Any, ...]) -> None:
    """Bumps the version counters of _torch_written's tensors after the write
    (a no-op for inference-mode tensors, which have none)."""
    _TORCH_FAST[6](written)  # type: ignore[index]  (set: written is not empty)


def _register_fast_torch(torch: Any, exchange_api: bool = True) -> bool:
    """Tells _ext.run_fast torch.Tensor and the dtypes it reads, and (unless
    exchange_api is False: the tests run both ways) the type's DLPack C
    exchange API where torch has one (2.10 and later). Returns whether the
    fast path reads tensors through that API."""
    fp8 = [(getattr(torch, name), code, 8) for name, code in _DL_FP8.items()
           if hasattr(torch, name)]
    table = [(torch.float32, _DL_FLOAT, 32), (torch.float16, _DL_FLOAT, 16),
             (torch.bfloat16, _DL_BFLOAT, 16), (torch.int32, _DL_INT, 32),
             (torch.int64, _DL_INT, 64), (torch.uint8, _DL_UINT, 8)] + fp8
    # each with an empty tensor of it: the API names dtypes by their DLPack type
    return _ext.fast_path_types("torch", torch.Tensor,
        [entry + (torch.empty(0, dtype=entry[0]),) for entry in table],
        torch.empty_like, torch.contiguous_format, _torch_current_stream(torch),
        getattr(torch.Tensor, "__dlpack_c_exchange_api__", None) if exchange_api else None)


def _torch_current_stream(torch: Any) -> Optional[Any]:
    """torch's C function from a device index to its current raw CUDA stream
    (the one Triton launches on), where torch has CUDA and ropekv too; else
    None, and CUDA tensors take the general path (torch.cuda.current_stream,
    a Python-level object, there)."""
    if not _ext.has_cuda() or getattr(torch.version, "hip", None) or not torch.version.cuda:
        return None
    return getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _empty_like(x: Any) -> Any:
    """A new array of x's shape, dtype, device and framework."""
    fw = _framework(x)
    if fw == "torch":
        import torch

        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        if out.nbytes >= 1 << 22 and out.device.type == "cpu":  # see _ext.advise_huge_pages
            _ext.advise_huge_pages(out.data_ptr(), out.nbytes)
        return out
    if fw == "cupy":
        import cupy

        with cupy.cuda.Device(x.device.id):
            return cupy.empty(x.shape, dtype=x.dtype)
    if fw in ("jax", "jaxlib"):
        return _np.empty(x.shape, dtype=_np.dtype(x.dtype))  # wrapped after the call
    if fw == "mlx":
        import mlx.core as mx

        out = mx.zeros(x.shape, dtype=x.dtype)
        mx.eval(out)
        return out
    return _np.empty(x.shape, dtype=x.dtype)


def _output_for(x: Any) -> Any:
    """The array ropekv makes for q_rot (or k_rot) of input x: _empty_like(x)
    for a 3-D array of a known framework; for memory of another kind (a
    buffer, an __array_interface__ or CPU DLPack object), a numpy array (an
    ml_dtypes bf16 one for a bf16 DLPack object); None for an x that is not
    3-D (the core reports its rank)."""
    if getattr(x, "ndim", None) is None or not hasattr(x, "dtype"):
        view = None
        if not hasattr(x, "__dlpack__"):
            try:
                view = _np.asarray(x)
            except Exception:  # noqa: BLE001 - not an array: _as_array says so
                return None
        else:
            try:
                if x.__dlpack_device__()[0] == 1:  # kDLCPU
                    view = _np.from_dlpack(x)
            except Exception:  # noqa: BLE001 - a dtype numpy lacks, say
                # bf16, which numpy imports through ml_dtypes only: its shape
                # from the core's own import.
                got = _ext.layout(x) if _BF16 is not None else None
                if got is not None and got[1:] == (_DL_BFLOAT, 16):
                    return _np.empty(got[0], _BF16) if len(got[0]) == 3 else None
            if view is None:
                raise ValueError(f"cannot make q_rot/k_rot for a {type(x).__name__}: pass q_out "
                                 f"and k_out (or inplace=True)")
        return _np.empty(view.shape, view.dtype) if view.ndim == 3 else None
    return _empty_like(x) if x.ndim == 3 else None


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
    if not isinstance(stream, (str, bytes)) and not _not_a_scalar(stream):
        try:
            return int(stream)  # (objects with __int__, such as cuda-python's CUstream)
        except (TypeError, ValueError):
            pass
    raise ValueError(f"stream must be a CUDA stream (torch.cuda.Stream, cupy's Stream) or its "
                     f"handle as an int, got {stream!r}")


def _not_a_scalar(value: Any) -> bool:
    """Whether a scalar argument is a bool (Python's, numpy's, a 0-d bool array
    or tensor) or an array of rank > 0: int(), float() and operator.index()
    would make 1 of True and a number of a one-element array."""
    if isinstance(value, (bool, _np.bool_)):
        return True
    dtype = getattr(value, "dtype", None)
    # (numpy's and JAX's bool dtype prints "bool", PyTorch's "torch.bool",
    # MLX's "mlx.core.bool")
    return dtype is not None and (getattr(value, "ndim", 0) != 0
                                  or str(dtype).rpartition(".")[2] == "bool")


def _float_arg(value: Any, name: str) -> float:
    # (float("1e4") would parse a string.)
    if isinstance(value, (str, bytes)) or _not_a_scalar(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:  # an int beyond a double's range
        raise ValueError(f"{name} is too large for a float, got {value!r}") from None
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def _is_number(value: Any, number: float) -> bool:
    """Whether value is that number as a Python int or float (not a bool, a
    numpy scalar or an array)."""
    return type(value) in (int, float) and value == number


def _int_arg(value: Any, name: str, bits64: bool = True) -> int:
    """value as a Python int, a ValueError naming it if it is not one (or,
    with bits64, beyond a 64-bit int)."""
    try:
        if _not_a_scalar(value):
            raise TypeError
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None
    if bits64 and not -2**63 <= v < 2**63:
        raise ValueError(f"{name} is out of range (64-bit), got {v}")
    return v


def _threads_arg(value: Any) -> int:
    """num_threads for the binding (an int; the C++ core caps large counts and
    reports a negative one, after the arrays' checks)."""
    v = _int_arg(value, "num_threads", bits64=False)  # (any large count is capped)
    if v < -2**31:  # (beyond the binding's int: reported here)
        raise ValueError(f"num_threads must be >= 0 (0: OpenMP's default), got {v}")
    return min(v, 2**31 - 1)


_KV_CACHE_DTYPES = {"auto": 0, "float32": 1, "fp8_e4m3": 2, "fp8_e5m2": 3}
_SCALING_TYPES = {"linear": 1, "llama3": 2, "yarn": 3, "proportional": 4}
# Required keys per rope_scaling type, then optional keys with their defaults
# (transformers' defaults).
_SCALING_KEYS = {
    "linear": (("factor",), {}),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"), {}),
    "yarn": (("factor", "original_max_position_embeddings"),
             {"beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 0.0,  # (0: not given)
              "mscale": 0.0, "mscale_all_dim": 0.0, "truncate": True}),
    # (its partial_rotary_factor, a _BASE_KEYS entry, is the fraction of
    # pairs that rotate, not rotary_dim)
    "proportional": ((), {"factor": 1.0}),
}


# Keys of a transformers 5 rope_parameters dict (which a config's
# rope_scaling is there) that are not scaling fields: checked against
# rope_base and rotary_dim by _rotary_dim_for.
_BASE_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
_RopeParameters = Tuple[Optional[Tuple[float, ...]], Optional[float], Optional[float]]


def _rope_parameters(rope_scaling: Any, warn: bool = True) -> _RopeParameters:
    """A Hugging Face rope_scaling dict (or its JSON text) as (the binding's
    13 numbers: (type, factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings, beta_fast, beta_slow, attention_factor,
    mscale, mscale_all_dim, truncate, 1 where attention_factor is given, else
    0: the library's default from mscale, proportional's partial_rotary_factor
    or 1), or None for no scaling; the dict's rope_theta, or None; its
    partial_rotary_factor where it sets rotary_dim (every type but
    proportional), or None). warn=False: no warning for keys it does not read
    (a parse of the same dict in the same call has given it)."""
    if rope_scaling is None:
        return None, None, None
    if isinstance(rope_scaling, str):
        import json

        if rope_scaling.strip() == "default":  # the rope_type of plain RoPE, bare
            return None, None, None
        try:
            rope_scaling = json.loads(rope_scaling)
        except json.JSONDecodeError as e:
            raise ValueError(f"rope_scaling text is not JSON ({e.msg} at character {e.pos}): "
                             f"pass a dict, its JSON text, \"default\" or None") from None
        if rope_scaling is None:  # JSON null
            return None, None, None
    if not isinstance(rope_scaling, dict):
        raise ValueError(f"rope_scaling must be a dict (a Hugging Face config's rope_scaling) "
                         f"or None, got {type(rope_scaling).__name__}")
    if (rope_scaling and "rope_type" not in rope_scaling and "type" not in rope_scaling
            and all(isinstance(val, dict) for val in rope_scaling.values())):
        raise ValueError(f"rope_scaling holds RoPE parameters per layer type "
                         f"({', '.join(map(repr, rope_scaling))}), as a transformers 5 config of "
                         f"a model with sliding and full attention layers does: pass those of "
                         f"the layer's type, e.g. rope_scaling=config.rope_scaling"
                         f"[{next(iter(rope_scaling))!r}]")
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    theta = _rope_base_field(rope_scaling, "rope_theta")
    factor = _rope_base_field(rope_scaling, "partial_rotary_factor",
                              proportional=kind == "proportional")
    if kind is None and any(key not in _BASE_KEYS for key in rope_scaling):
        # (transformers 5 reads it as the default type and warns that the
        # fields are unrecognized: a factor dropped that way changes every
        # angle, so it is an error here, as in the replay tool's reader)
        fields = [key for key in rope_scaling if key not in _BASE_KEYS]
        raise ValueError(f"rope_scaling has no 'rope_type' (or 'type'), so its fields "
                         f"{', '.join(map(repr, fields))} would mean nothing: give the "
                         f"type (linear, llama3, yarn, proportional), or pass None for no scaling")
    if "mrope_section" in rope_scaling:
        raise ValueError("rope_scaling has mrope_section (multimodal RoPE, as Qwen2-VL's): "
                         "ropekv rotates each token by one position; for text tokens, whose "
                         "three positions agree, that is the same rotation: pass the dict "
                         "without mrope_section")
    if kind in (None, "default"):
        if warn:
            _warn_unread(rope_scaling, "default", _BASE_KEYS)
        return None, theta, factor
    if not isinstance(kind, str) or kind not in _SCALING_TYPES:
        raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: linear, "
                         f"llama3, yarn, proportional (any other scheme: pass its table as "
                         f"cos_sin_cache)")
    required, optional = _SCALING_KEYS[kind]
    if warn:
        _warn_unread(rope_scaling, kind, (*_BASE_KEYS, *required, *optional))
    values = {}
    for key in required:
        if rope_scaling.get(key) is None:
            raise ValueError(f"rope_scaling of type {kind!r} needs {key!r} "
                             f"(required: {', '.join(required)})")
        values[key] = rope_scaling[key]
    for key, default in optional.items():
        got = rope_scaling.get(key)
        # As transformers reads them: get(key) or 32 / 1 for the betas (0 is the
        # default), get("truncate", True) for truncate (a null is falsy: no truncation).
        if key in ("beta_fast", "beta_slow") and isinstance(got, numbers.Real) and got == 0:
            got = None
        elif key == "truncate" and key in rope_scaling and got is None:
            got = False
        values[key] = default if got is None else got
    for key, val in values.items():
        # (numbers.Real: numpy's scalars too, as a config read by numpy has them)
        if key == "truncate" and isinstance(val, _np.bool_):
            continue  # (numbers.Real has no numpy bool)
        if isinstance(val, bool) and key != "truncate" or not isinstance(val, numbers.Real):
            raise ValueError(f"rope_scaling {key!r} must be a number, got {val!r}")
        try:
            float(val)
        except OverflowError:  # an int beyond a double's range
            raise ValueError(f"rope_scaling {key!r} is too large for a float, "
                             f"got {val!r}") from None
    g = values.get
    return ((float(_SCALING_TYPES[kind]), float(g("factor", 1.0)),
             float(g("low_freq_factor", 0.0)), float(g("high_freq_factor", 0.0)),
             float(g("original_max_position_embeddings", 0.0)), float(g("beta_fast", 32.0)),
             float(g("beta_slow", 1.0)), float(g("attention_factor", 0.0)),
             float(g("mscale", 0.0)), float(g("mscale_all_dim", 0.0)),
             float(bool(g("truncate", True))),
             float(kind == "yarn" and rope_scaling.get("attention_factor") is not None),
             float(factor if kind == "proportional" and factor is not None else 1.0)),
            theta, None if kind == "proportional" else factor)


def _warn_unread(rope_scaling: dict, kind: str, read: Tuple[str, ...]) -> None:
    """A warning for keys ropekv does not read (a misspelt optional key would
    otherwise leave its default in silence), as transformers warns of them."""
    global _UNREAD_WARNINGS
    unread = [key for key in rope_scaling if key not in read]
    if unread:
        import warnings

        _UNREAD_WARNINGS += 1

        level, frame = 1, _sys._getframe(0)  # (the warning names the caller's line)
        while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("ropekv"):
            frame, level = frame.f_back, level + 1
        warnings.warn(f"rope_scaling of type {kind!r}: ropekv ignores "
                      f"{', '.join(map(repr, unread))} (it reads "
                      f"{', '.join(k for k in read if k != 'type')})", stacklevel=level)


def _rope_base_field(rope_scaling: dict, key: str, proportional: bool = False) -> Optional[float]:
    """rope_theta (finite, > 0) or partial_rotary_factor (in (0, 1], the
    fraction of head_dim that rotates) of a rope_parameters dict as a float;
    None where absent or null. The proportional type's partial_rotary_factor
    (the fraction of the pairs that rotate) is only made a float: the core
    checks its range."""
    val = rope_scaling.get(key)
    if val is None:
        return None
    if isinstance(val, bool) or not isinstance(val, numbers.Real):
        raise ValueError(f"rope_scaling {key!r} must be a number, got {val!r}")
    try:
        x = float(val)
    except OverflowError:
        x = float("inf")
    if key != "partial_rotary_factor":
        if not 0 < x < float("inf"):
            raise ValueError(f"rope_scaling {key!r} must be finite and > 0, got {val!r}")
    elif not proportional and not 0 < x <= 1:
        raise ValueError(f"rope_scaling partial_rotary_factor must be in (0, 1] (the fraction "
                         f"of head_dim that rotates), got {val!r}")
    return x


def _rotary_dim_arg(rotary_dim: Any, head_dim: int) -> int:
    """rotary_dim as the core takes it: None is 0, the core's "head_dim";
    a 0 given is an error (the contract's range is [2, head_dim])."""
    if rotary_dim is None:
        return 0
    r = _int_arg(rotary_dim, "rotary_dim")
    if r == 0:
        raise ValueError(f"rotary_dim must be even and in [2, head_dim], got 0 for head_dim "
                         f"{head_dim}")
    return r


def _rotary_dim_for(theta: Optional[float], factor: Optional[float], rope_base: Any,
                    rotary_dim: Any, head_dim: Any) -> Any:
    """The rotary_dim a call uses, given the rope_theta and
    partial_rotary_factor its rope_scaling holds (either may be None).

    In transformers 5 a config's rope_scaling is its rope_parameters, which
    also holds rope_theta and, for partial rotary models (Phi, GLM),
    partial_rotary_factor; ropekv takes the base from rope_base alone, so a
    rope_theta that is not rope_base is an error rather than silently one of
    the two. A partial_rotary_factor gives the rotary_dim transformers uses,
    int(head_dim * factor), where rotary_dim is not given, and must agree with
    it where it is. Arguments the core rejects themselves are left to it."""
    if theta is not None:
        try:
            base = _float_arg(rope_base, "rope_base")
        except ValueError:
            base = None
        if base is not None and base != theta:
            raise ValueError(f"rope_scaling has rope_theta {theta!r} but rope_base is {base!r}: "
                             f"ropekv takes the base from rope_base, so pass "
                             f"rope_base={theta!r}")
    if factor is None:
        return rotary_dim
    try:
        dim = int(_int_arg(head_dim, "head_dim") * factor)
        given = None if rotary_dim is None else _int_arg(rotary_dim, "rotary_dim")
    except ValueError:
        return rotary_dim
    if given is None:
        if dim < 2 or dim % 2:
            raise ValueError(f"rope_scaling has partial_rotary_factor {factor!r}, which makes "
                             f"rotary_dim int({head_dim} * {factor!r}) = {dim}: rotary_dim "
                             f"must be even and in [2, head_dim]")
        return dim
    if given != dim:
        raise ValueError(f"rope_scaling has partial_rotary_factor {factor!r}, which makes "
                         f"rotary_dim int({head_dim} * {factor!r}) = {dim}, but rotary_dim "
                         f"is {given}: pass rotary_dim={dim}")
    return rotary_dim


# Parsed rope_scaling dicts by their items and the items' types (True and 1
# are equal but not the same argument), for the fast path: parsing costs
# about 1.4 us of a decode call, a lookup about 0.7. Bounded. Only dicts
# whose values are all of the exact types str, int, float, bool are kept
# (their equality and hash decide float(); a subclass's need not), and no
# float zero or NaN (-0.0 == 0.0 but prints differently in an error; NaN
# matches nothing), nor a dict whose parse warned of keys ropekv does not
# read (_UNREAD_WARNINGS counts them): each call with it warns again, under
# the caller's warning filters.
_SCALING_SEEN: dict = {}
_SCALING_SEEN_MAX = 64
_SCALING_PLAIN = (str, int, float, bool)
_UNREAD_WARNINGS = 0


def _rope_parameters_seen(rope_scaling: Any) -> _RopeParameters:
    """_rope_parameters, remembered for a dict whose items and their types
    were parsed before (the same result, the same errors)."""
    if type(rope_scaling) is not dict:
        return _rope_parameters(rope_scaling)
    values = rope_scaling.values()
    try:
        key = (*rope_scaling.items(), *map(type, values))
        return _SCALING_SEEN[key]
    except KeyError:
        pass
    except Exception:  # noqa: BLE001 - a value without a usable hash: no memory
        return _rope_parameters(rope_scaling)
    warned = _UNREAD_WARNINGS
    params = _rope_parameters(rope_scaling)  # a dict it cannot read raises: nothing kept
    if warned == _UNREAD_WARNINGS and len(_SCALING_SEEN) < _SCALING_SEEN_MAX and all(
            type(v) in _SCALING_PLAIN and not (type(v) is float and (v == 0.0 or v != v))
            for v in values):
        _SCALING_SEEN[key] = params
    return params


_register_fast_numpy()


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
    is_neox: bool = True,
    rope_scaling: Optional[Any] = None,
    cos_sin_cache: Optional[Any] = None,
    inplace: bool = False,
    q_out: Optional[Any] = None,
    k_out: Optional[Any] = None,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    q_norm_weight: Optional[Any] = None,
    k_norm_weight: Optional[Any] = None,
    norm_eps: float = 1e-6,
    stream: Optional[Any] = None,
    num_threads: int = 0,
) -> Tuple[Any, Any, Any, Any]:
    """Rotates q and k with RoPE and scatters k_rot and v into the KV pool.

    Drop-in for SGLang's ``rope_pool_fused`` (NeoX RoPE on q/k plus the K/V
    scatter into one layer's pool). For every token ``t`` with
    ``slots[t] >= 0``: ``k_pool[slots[t]] = k_rot[t]`` and
    ``v_pool[slots[t]] = v[t]``; pool rows no token names are never touched.
    Every keyword after ``rope_base`` is optional and off by default; with
    the defaults the call is exactly the original one. See also
    :func:`rope_inv_freq` (the frequencies and yarn attention factor a call
    uses) and :mod:`ropekv.ops` (this call as the PyTorch operator
    ``torch.ops.ropekv.rope_pool_fused``, for ``torch.compile``).

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
        k_pool: ``[P, num_kv_heads, head_dim]``, q's dtype (or see
            ``kv_cache_dtype``): one layer's key cache, updated in place.
        v_pool: ``[P, num_kv_heads, head_dim]``, like k_pool: one layer's
            value cache, updated in place.
        head_dim: D, elements per head (even, >= 2).
        num_qo_heads: number of query heads, >= 1.
        num_kv_heads: number of key/value heads, >= 1.
        rope_base: RoPE theta (10000, 500000, 1e6, ...), finite and > 0.
        rotary_dim: R, the leading dimensions of each head that rotate
            (partial rotary: Phi-2 32 of 80, GPT-NeoX 24 of 96, GPT-J 64 of
            256); dimensions R..head_dim-1 are copied. Even, 2 <= R <=
            head_dim; default head_dim (or cos_sin_cache's width, or
            int(head_dim * rope_scaling's partial_rotary_factor)). The angles
            use base ** (-2i / R).
        is_neox: True (default): rotate-half pairs (i, i + R/2), as GPT-NeoX,
            Llama and the original call. False: interleaved pairs (2i, 2i+1),
            as GPT-J, GLM, DeepSeek-V2/V3 and MLX's ``traditional=True``.
        rope_scaling: a Hugging Face config's ``rope_scaling`` dict (or its
            JSON text): ``{"rope_type": "linear", "factor": f}``,
            ``"llama3"`` (factor, low_freq_factor, high_freq_factor,
            original_max_position_embeddings), ``"yarn"`` (factor,
            original_max_position_embeddings; optional beta_fast=32,
            beta_slow=1, attention_factor, mscale, mscale_all_dim, truncate)
            or ``"proportional"`` (Gemma-4's full-attention layers: optional
            factor=1 and partial_rotary_factor=1 in [0, 1], the fraction of
            the R/2 pairs, floor(p * R / 2), that rotate with
            ``base ** (-2i/R) / factor``; the other pairs at angle 0, which
            gives finite nonzero values back unchanged; here
            partial_rotary_factor does not set rotary_dim); the rope_type
            ``"default"`` (or that bare string), JSON ``null`` or None is
            plain RoPE. Frequencies are transformers'
            rope initialisation formulas in double, rounded once to fp32;
            yarn also multiplies cos and sin by its attention factor. A
            transformers 5 ``rope_parameters`` dict (a config's rope_scaling
            there) may also hold ``rope_theta``, which must equal rope_base,
            and ``partial_rotary_factor``, which (but for proportional) sets
            rotary_dim to ``int(head_dim * factor)`` where rotary_dim is not
            given and must agree with it where it is (a dict of those two keys
            alone, without a type, is the default type). Unknown types,
            missing fields, a dict of scaling fields without a type, text
            that is not JSON, a rope_theta or partial_rotary_factor that disagrees,
            per-layer-type dicts and mrope_section (multimodal RoPE) raise
            ValueError; a key ropekv does not read is a UserWarning.
        cos_sin_cache: ``[max_position, R]`` float32 or q's dtype, vLLM's
            layout: row p is ``cos(p * inv_freq)`` in columns ``[0, R/2)``
            and ``sin`` in ``[R/2, R)``. Used instead of the frequencies
            rope_base gives (so any scaling an engine computes works);
            rope_base is still required and checked. Excludes rope_scaling.
            Every position must be in ``[0, max_position)``: ValueError on
            the CPU; on a GPU the token is skipped and reported like a bad
            slot.
        inplace: a bool: rotate q and k in their own buffers and return
            them (q_out and k_out must then be None).
        q_out: optional preallocated ``[T, num_qo_heads, head_dim]`` output
            of q's dtype for the rotated queries (else a new array is made);
            may be q.
        k_out: optional preallocated ``[T, num_kv_heads, head_dim]`` output
            of q's dtype for the rotated keys; may be k.
        kv_cache_dtype: pool format. ``"auto"`` (default): q's dtype.
            ``"float32"``: float32 pools for any input dtype (the exact value
            k_rot holds, widened). ``"fp8_e4m3"`` / ``"fp8_e5m2"``: 8-bit
            pools (uint8 arrays, torch or ml_dtypes ``float8_e4m3fn`` /
            ``float8_e5m2`` arrays) holding ``fp8(k_rot / k_scale)`` and
            ``fp8(v / v_scale)``, divided in fp32, rounded to nearest even
            and saturated to the format's finite range (±448 E4M3, ±57344
            E5M2), as vLLM stores them; NaN is stored as 0x7F.
        k_scale: per-tensor key scale of fp8 pools (finite, > 0); any other
            kv_cache_dtype takes only 1.0 (ValueError: ``k_scale/v_scale
            apply to fp8 pools only``).
        v_scale: per-tensor value scale of fp8 pools (the same rules).
        q_norm_weight: ``[head_dim]`` float32 or q's dtype: QK-norm (Qwen3,
            Gemma-3): RMSNorm over each query head, in fp32, before the
            rotation: ``x * w / sqrt(mean(x**2) + norm_eps)``. The weight
            multiplies as given (a model whose norm scales by ``1 + w``
            passes ``1 + w``).
        k_norm_weight: the same for each key head (k_rot and k_pool get the
            normed, rotated keys; v is not normed).
        norm_eps: the RMSNorm epsilon (finite, >= 0; checked, and unused
            without a norm weight, so a caller may pass its config's eps on
            every call).
        stream: CUDA stream for GPU arrays (a ``torch.cuda.Stream``,
            ``cupy.cuda.Stream`` or a raw ``cudaStream_t`` as int); default
            the framework's current stream (PyTorch, CuPy).
        num_threads: CPU threads; 0 follows OMP_NUM_THREADS (else all cores).
            Results are identical for every thread count.

    Arrays are numpy (bf16 and fp8 through ml_dtypes), PyTorch (CPU or
    CUDA), CuPy, MLX, JAX (inputs only: JAX arrays are immutable, so pools
    and outputs cannot be JAX arrays; the rotated q and k of JAX inputs come
    back as JAX arrays), or anything with ``__dlpack__``, all on one device.
    The GIL is released while the kernel runs. PyTorch tensors the call
    writes (pools, given outputs, q and k in place) have their version
    counters bumped, as PyTorch's in-place ops do; the call is not
    differentiable (q_rot and k_rot never require grad).

    Returns:
        ``(q_rot, k_rot, k_pool, v_pool)``: new arrays of q's and of k's
        array type (or q_out/k_out, or q/k with inplace, as passed) for the
        rotated q and k, and the two pools that were passed in, updated in
        place.

    Raises:
        ValueError: before the first write (a call that raises leaves every
            array as it was), for

            - the contract, with the messages of SPEC section 3: ranks and
              shapes, dtypes (f16/bf16/f32, matching), integer positions and
              slots, an even head_dim and rotary_dim, rope_base, one device,
              writable pools and outputs that share no memory with another
              array of the call (q_out=q, k_out=k exactly is the in-place
              call), a slot ``>= P``;
            - options: an unknown rope_scaling type or a missing field, a
              cos_sin_cache or norm weight of the wrong shape or dtype, pools
              that do not match kv_cache_dtype, scales that are not finite and
              > 0, a yarn attention factor, scale or norm_eps beyond float32;
            - arguments of the wrong type: head_dim not an int, is_neox or
              inplace not a bool, a kv_cache_dtype that is not one of its
              names, a stream that is neither a stream nor an int, an array
              that is None (its rank rule) or cannot be imported;
            - PyTorch tensors the call writes that require grad while grad
              mode is on (autograd could not record the write), or inference
              tensors outside inference mode (as PyTorch's in-place ops
              refuse them);
            - a negative num_threads (checked last).

            A message names an output as it was passed: q_out / k_out, or
            q / k with inplace=True (q_rot / k_rot for those ropekv makes).
            On a GPU an out-of-range slot (or a position outside
            cos_sin_cache) is skipped, and raised only in checked mode
            (:func:`set_checked`), after the kernel ran.
        RuntimeError: a CUDA API call failed.
        MemoryError: q_rot / k_rot or the CPU backend's scratch could not be
            allocated (PyTorch's out-of-memory error for a CUDA q_rot).
    """
    # Any option at all: the general path then runs the options' binding (which
    # also checks a norm_eps other than the default, as the fast path does).
    # (A scale or eps that is not a Python number is an option too: the options'
    # binding parses and checks it.)
    options = (kv_cache_dtype != "auto" or not _is_number(k_scale, 1.0)
               or not _is_number(v_scale, 1.0) or cos_sin_cache is not None
               or q_norm_weight is not None or k_norm_weight is not None or is_neox is not True
               or rope_scaling is not None or not _is_number(norm_eps, 1e-6))
    if inplace is not False:
        if inplace is not True and not isinstance(inplace, _np.bool_):
            raise ValueError(f"inplace must be a bool, got {inplace!r}")
        if inplace:
            if q_out is not None or k_out is not None:
                raise ValueError("inplace=True writes q and k themselves: pass no q_out/k_out")
            q_out, k_out = q, k
    # The PyTorch tensors the call writes (none where all are numpy: no cost there).
    written: Tuple[Any, ...] = ()
    if not (type(k_pool) is _np.ndarray and type(v_pool) is _np.ndarray
            and (q_out is None or type(q_out) is _np.ndarray)
            and (k_out is None or type(k_out) is _np.ndarray)):
        tf = _torch_fast()
        if tf is not None:
            written = _torch_written(tf, k_pool, v_pool, q_out, k_out, inplace)
    kv_code = _KV_CACHE_DTYPES.get(kv_cache_dtype) if isinstance(kv_cache_dtype, str) else None
    parsed = False  # (whether the fast path parsed rope_scaling: its warnings are given)
    if kv_code is not None and stream is None and (type(q) is _np.ndarray
                                                   or type(q) is _FAST_TENSOR):
        # numpy arrays and PyTorch CPU or CUDA tensors (on the current
        # stream) of the plain dtypes, read in place by the binding; it
        # declines anything else (None), having written nothing, and the
        # general path below takes the call. A rope_scaling it cannot read is
        # left to the general path too, which raises in its own order.
        scaling: Any = None
        fast_rotary_dim = rotary_dim
        if rope_scaling is not None:
            parsed = True
            try:
                scaling, theta, factor = _rope_parameters_seen(rope_scaling)
                if theta is not None or factor is not None:
                    fast_rotary_dim = _rotary_dim_for(theta, factor, rope_base, rotary_dim,
                                                      head_dim)
            except Warning:  # (an unread key's warning under an "error" filter)
                raise
            except Exception:  # noqa: BLE001 - the general path reports it
                scaling = _DECLINE
        if scaling is not _DECLINE:
            try:
                done = _ext.run_fast(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out,
                                     head_dim, num_qo_heads, num_kv_heads, rope_base,
                                     fast_rotary_dim, is_neox, scaling, num_threads, _checked,
                                     cos_sin_cache, q_norm_weight, k_norm_weight, norm_eps,
                                     kv_code, k_scale, v_scale)
            except ValueError as e:
                raise _in_callers_names(e, *_output_names(inplace, q_out, k_out)) from None
            if done is not None:
                if written:
                    _bump_versions(written)
                return done
    q_name, k_name = _output_names(inplace, q_out, k_out)
    tf = _torch_fast()
    if tf is not None:
        # Sparse (or MKL-DNN) tensors have no strided memory to read in place.
        for x, name in zip((q, k, v, positions, slots, k_pool, v_pool, q_out, k_out,
                            cos_sin_cache, q_norm_weight, k_norm_weight),
                           _NAMES[:7] + (q_name, k_name) + _ALL_NAMES[9:]):
            if isinstance(x, tf[0]) and x.layout is not tf[4]:
                raise ValueError(f"{name} is a PyTorch tensor of layout {x.layout}: ropekv reads "
                                 f"strided (dense) memory; pass {name}.to_dense()")
    if options:
        if kv_code is None:
            names = ", ".join(map(repr, _KV_CACHE_DTYPES))
            raise ValueError(f"kv_cache_dtype must be one of {names}, got {kv_cache_dtype!r}")

    # Outputs: made here (in the caller's framework) once q and k are 3-D;
    # otherwise passed as None and the core reports the rank error.
    outs = [given if given is not None
            else (_np.empty(src.shape, src.dtype) if type(src) is _np.ndarray else _output_for(src))
            for given, src in ((q_out, q), (k_out, k))]
    arrays = (q, k, v, positions, slots, k_pool, v_pool, outs[0], outs[1])
    converted, dtype_views, readonly_mask, missing = [], 0, 0, []
    for i, x in enumerate(arrays):
        # The common cases inline (a function call per array costs).
        if type(x) is _np.ndarray:
            dt = x.dtype
            # numpy's own dtypes (ml_dtypes' fp8 types report kind "f" or "V"
            # with one byte), or ml_dtypes bf16 as its bits.
            plain = dt.kind in "iub" or (dt.kind == "f" and dt.itemsize in (2, 4, 8))
            if (plain or dt == _BF16) and dt.isnative and x.flags.aligned:
                converted.append(x if plain else x.view(_np.uint16))
                dtype_views |= int(not plain) << (2 * i)  # (_VIEW_BF16)
                if i >= 5:  # only pools and outputs must be writable
                    readonly_mask |= int(not x.flags.writeable) << i
                continue
        elif (tf is not None and type(x) is tf[0] and x.is_cpu and not x.requires_grad
              and not x.is_neg() and not _torch_without_memory(x)):
            # A numpy view of a CPU tensor (the same memory) imports in a
            # third of the time of its DLPack capsule; bf16 as its bits. (A
            # tensor without memory or with the negative bit goes through
            # _as_array: see there.)
            dt = x.dtype
            if dt is tf[1]:
                converted.append(x.view(tf[2]).numpy())
                dtype_views |= _VIEW_BF16 << (2 * i)
                continue
            if dt in tf[3]:
                converted.append(x.numpy())
                continue
        if x is None:
            if i < 7:
                # A missing input or pool: a 0-D stand-in, so that the core
                # reports the first broken rank rule, as for any array of
                # the wrong rank (and the error says which was None).
                missing.append(_NAMES[i])
                converted.append(_np.zeros((), _np.int32 if i in (3, 4) else _np.float32))
            else:  # an output of a q or k that is not 3-D
                converted.append(None)
            continue
        name = _NAMES[i] if i < 7 else (q_name, k_name)[i - 7]
        a, view, read_only = _as_array(x, name, written=i >= 5)
        if read_only and i >= 5 and _framework(x) in ("jax", "jaxlib"):
            # (a copy of a JAX array is immutable too: the generic read-only
            # hint, "pass a writable array (e.g. a copy)", would not help)
            if i in (5, 6):
                raise ValueError(f"{name} is a JAX array, which is immutable, but ropekv writes "
                                 f"the pools in place; pass writable pools (numpy, PyTorch, CuPy "
                                 f"or MLX arrays)")
            fix = ("drop inplace=True (ropekv then returns new arrays)" if inplace else
                   f"leave {name} out (ropekv then makes it) or pass a numpy, PyTorch, CuPy or "
                   f"MLX array")
            raise ValueError(f"{name} is a JAX array, which is immutable, but ropekv writes "
                             f"into it; {fix}")
        converted.append(a)
        dtype_views |= view << (2 * i)
        readonly_mask |= int(read_only) << i

    handle = (_stream_handle(stream) if stream is not None
              else 0 if type(q) is _np.ndarray else _default_stream(q))
    head_dim = _int_arg(head_dim, "head_dim")
    common = (
        head_dim,
        _int_arg(num_qo_heads, "num_qo_heads"),
        _int_arg(num_kv_heads, "num_kv_heads"),
        _float_arg(rope_base, "rope_base"),
        _rotary_dim_arg(rotary_dim, head_dim),
    )
    if is_neox is not True and is_neox is not False and not isinstance(is_neox, _np.bool_):
        raise ValueError(f"is_neox must be a bool, got {is_neox!r}")
    scaling = None
    if rope_scaling is not None:
        scaling, theta, factor = _rope_parameters(rope_scaling, warn=not parsed)
        dim = _rotary_dim_for(theta, factor, rope_base, rotary_dim, head_dim)
        if dim is not rotary_dim:  # (from the dict's partial_rotary_factor)
            common = common[:4] + (dim,)
    try:
        if not options:
            _ext.run(*converted, *common, dtype_views, readonly_mask, handle,
                     _threads_arg(num_threads), _checked)
        else:
            extra = []
            for i, (x, name) in enumerate(((cos_sin_cache, "cos_sin_cache"),
                                           (q_norm_weight, "q_norm_weight"),
                                           (k_norm_weight, "k_norm_weight")), start=9):
                if x is None:
                    extra.append(None)
                    continue
                a, view, _ = _as_array(x, name)
                extra.append(a)
                dtype_views |= view << (2 * i)
            if (rotary_dim is None and cos_sin_cache is not None
                    and len(getattr(cos_sin_cache, "shape", ())) == 2):
                common = common[:4] + (int(cos_sin_cache.shape[1]),)
            _ext.run_options(*converted, *extra, *common, bool(is_neox),
                             scaling, kv_code,
                             _float_arg(k_scale, "k_scale"), _float_arg(v_scale, "v_scale"),
                             _float_arg(norm_eps, "norm_eps"), dtype_views, readonly_mask, handle,
                             _threads_arg(num_threads), _checked)
    except TypeError as e:
        # The binding's own signature refused an array (nanobind imports it
        # before the call, so nothing was written): a DLPack producer that
        # cannot export it, such as a read-only array behind a pre-1.0
        # __dlpack__, which has no way to say that it is read-only.
        raise ValueError(
            f"an array of the call could not be imported through DLPack or the buffer "
            f"protocol (a read-only array behind a pre-1.0 __dlpack__ cannot be exported): "
            f"pass numpy arrays or a DLPack 1.0 producer; {str(e).splitlines()[0]}") from e
    except ValueError as e:
        e = _in_callers_names(e, q_name, k_name)
        if "layer-stacked cache" in str(e) and "mlx" in (_framework(k_pool), _framework(v_pool)):
            # (the usual fix would lose the write: MLX has no views)
            e = ValueError(f"{e}, an MLX array of its own (an MLX array indexed as cache[layer] is a "
                           f"copy of those rows, which the call would write while the stacked "
                           f"cache keeps its old ones: keep one [P, Hk, D] MLX array per layer)")
        if not missing:
            raise e from None
        raise ValueError(f"{e} ({' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                         f"None: pass an array)") from None
    # q_rot and k_rot made here for JAX inputs are numpy arrays (JAX's are
    # immutable): each is handed back as a JAX array, as its input was; an
    # output the caller passed is returned as passed.
    for i, (given, src) in enumerate(((q_out, q), (k_out, k))):
        if given is None and _framework(src) in ("jax", "jaxlib"):
            import jax.numpy as jnp

            outs[i] = jnp.asarray(outs[i])
    if written:
        _bump_versions(written)
    return outs[0], outs[1], k_pool, v_pool


def rope_inv_freq(head_dim: int, rope_base: float, rotary_dim: Optional[int] = None,
                  rope_scaling: Optional[Any] = None) -> Tuple[Any, float]:
    """The fp32 inverse frequencies and cos/sin factor the kernels use.

    Args:
        head_dim: D (even, >= 2).
        rope_base: RoPE theta, finite and > 0.
        rotary_dim: R (even, 2..head_dim); default head_dim, or
            ``int(head_dim * partial_rotary_factor)`` of a rope_scaling that
            holds one (but proportional), as in :func:`rope_pool_fused`.
        rope_scaling: a Hugging Face rope_scaling dict, as in
            :func:`rope_pool_fused`.

    Returns:
        ``(inv_freq, attention_factor)``: a float32 numpy array of R/2
        values, ``rope_base ** (-2i/R)`` scaled by transformers' formulas for
        the scaling type (computed in double, rounded once; 0 for the pairs
        proportional leaves unrotated), and the factor
        cos and sin are multiplied by (yarn's attention factor, else 1.0).

    Raises:
        ValueError: for the values rope_pool_fused rejects.
    """
    scaling, theta, partial = _rope_parameters(rope_scaling)
    rotary_dim = _rotary_dim_for(theta, partial, rope_base, rotary_dim, head_dim)
    head_dim = _int_arg(head_dim, "head_dim")
    freq, factor = _ext.inv_freq(head_dim, _float_arg(rope_base, "rope_base"),
                                 _rotary_dim_arg(rotary_dim, head_dim), scaling)
    return _np.asarray(freq, dtype=_np.float32), factor
