"""The error contract of SPEC section 3 through Python: exact messages, their
order, the hints, and that a failed call leaves every array as it was."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import ropekv
from reference import BF16, bits

T, HQ, HK, D, P = 5, 4, 2, 16, 12


def make_call(rng, dtype=np.float32, idx=np.int32):
    a = lambda *s: rng.standard_normal(s).astype(np.float32).astype(dtype)  # noqa: E731
    return dict(
        q=a(T, HQ, D),
        k=a(T, HK, D),
        v=a(T, HK, D),
        positions=rng.integers(0, 1 << 20, T).astype(idx),
        slots=rng.permutation(P)[:T].astype(idx),
        k_pool=a(P, HK, D),
        v_pool=a(P, HK, D),
    ), dict(head_dim=D, num_qo_heads=HQ, num_kv_heads=HK, rope_base=10000.0)


def call(arrays, kw):
    return ropekv.rope_pool_fused(
        arrays["q"], arrays["k"], arrays["v"], arrays["positions"], arrays["slots"],
        arrays["k_pool"], arrays["v_pool"], **kw)


def expect_error(arrays, kw, prefix):
    """Calls, expects ValueError starting with `prefix`, and checks that no
    array changed by a single bit."""
    before = {n: bits(a) for n, a in arrays.items() if isinstance(a, np.ndarray)}
    with pytest.raises(ValueError) as info:
        call(arrays, kw)
    msg = str(info.value)
    assert msg.startswith(prefix), f"message {msg!r} does not start with {prefix!r}"
    for n, b in before.items():
        assert bits(arrays[n]) == b, f"{n} changed by a failed call"
    return msg


@pytest.fixture
def rng():
    return np.random.default_rng()


# (name, mutation, exact message prefix) in the contract's order.
def m_qk_rank(a, kw):
    a["q"] = a["q"][0]
    return "rope_pool_fused expects q/k/v to be 3-D"


def m_v_rank(a, kw):
    a["v"] = a["v"][None]
    return "rope_pool_fused expects q/k/v to be 3-D"


def m_index_rank(a, kw):
    a["slots"] = a["slots"][:, None]
    return "rope_pool_fused expects positions/slots to be 1-D"


def m_pool_rank(a, kw):
    a["v_pool"] = a["v_pool"][None]
    return "rope_pool_fused expects pool tensors to be 3-D"


def m_q_shape(a, kw):
    kw["num_qo_heads"] = HQ + 1
    return f"q shape must be [num_tokens, num_qo_heads, head_dim], got ({T}, {HQ}, {D})"


def m_k_shape(a, kw):
    a["k"] = a["k"][:, :1]
    return f"k shape must be [num_tokens, num_kv_heads, head_dim], got ({T}, 1, {D})"


def m_v_shape(a, kw):
    a["v"] = a["v"][:-1]
    return f"v shape must match k shape, got ({T - 1}, {HK}, {D}) vs ({T}, {HK}, {D})"


def m_index_len(a, kw):
    a["positions"] = a["positions"][:-1]
    return "positions/slots must have one entry per token"


def m_k_pool_shape(a, kw):
    a["k_pool"] = np.ascontiguousarray(a["k_pool"][:, :1])
    return f"k_pool has incompatible shape ({P}, 1, {D})"


def m_v_pool_shape(a, kw):
    a["v_pool"] = a["v_pool"][:-1]
    return f"v_pool shape must match k_pool shape, got ({P - 1}, {HK}, {D}) vs ({P}, {HK}, {D})"


def m_qkv_dtype(a, kw):
    a["v"] = a["v"].astype(np.float16)
    return "q/k/v dtypes must match"


def m_pool_dtype(a, kw):
    a["k_pool"] = a["k_pool"].astype(np.float16)
    return "pool dtypes must match q/k/v dtype"


CONTRACT = [m_qk_rank, m_v_rank, m_index_rank, m_pool_rank, m_q_shape, m_k_shape, m_v_shape,
            m_index_len, m_k_pool_shape, m_v_pool_shape, m_qkv_dtype, m_pool_dtype]


@pytest.mark.parametrize("mutate", CONTRACT, ids=lambda f: f.__name__)
def test_each_contract_message(rng, mutate):
    arrays, kw = make_call(rng)
    prefix = mutate(arrays, kw)
    expect_error(arrays, kw, prefix)


@pytest.mark.parametrize("i", range(len(CONTRACT) - 1))
def test_first_broken_rule_wins(rng, i):
    """A call wrong in two ways gets the earlier message, for every pair of
    consecutive rules (and the first against every later one)."""
    for j in range(i + 1, len(CONTRACT)):
        arrays, kw = make_call(rng)
        first = CONTRACT[i](arrays, kw)
        CONTRACT[j](arrays, kw)
        expect_error(arrays, kw, first)


def test_shapes_print_as_python_tuples(rng):
    arrays, kw = make_call(rng)
    arrays["positions"] = arrays["positions"][:-1]
    msg = expect_error(arrays, kw, "positions/slots must have one entry per token")
    assert f"({T - 1},)" in msg


def test_hint_layer_stacked_pool(rng):
    arrays, kw = make_call(rng)
    arrays["k_pool"] = np.stack([arrays["k_pool"]] * 3)
    msg = expect_error(arrays, kw, "rope_pool_fused expects pool tensors to be 3-D")
    assert "pass k_pool[layer]" in msg


def test_hint_flattened_pool(rng):
    arrays, kw = make_call(rng)
    arrays["v_pool"] = arrays["v_pool"].reshape(P, HK * D)
    msg = expect_error(arrays, kw, "rope_pool_fused expects pool tensors to be 3-D")
    assert "reshape to [pool_size, num_kv_heads, head_dim]" in msg


def test_hint_float32_pool_for_bf16(rng):
    arrays, kw = make_call(rng, dtype=BF16)
    arrays["k_pool"] = arrays["k_pool"].astype(np.float32)
    arrays["v_pool"] = arrays["v_pool"].astype(np.float32)
    msg = expect_error(arrays, kw, "pool dtypes must match q/k/v dtype")
    assert "k_pool.to(q.dtype)" in msg


# --- the checks the original leaves to luck ---------------------------------

def test_float_positions(rng):
    arrays, kw = make_call(rng)
    arrays["positions"] = arrays["positions"].astype(np.float32)
    msg = expect_error(arrays, kw, "positions must be an int32 or int64 array")
    assert "float32" in msg


def test_unsigned_slots(rng):
    arrays, kw = make_call(rng)
    arrays["slots"] = arrays["slots"].astype(np.uint32)
    expect_error(arrays, kw, "slots must be an int32 or int64 array, got uint32")


def test_float64_inputs(rng):
    arrays, kw = make_call(rng, dtype=np.float64)
    expect_error(arrays, kw, "q/k/v dtype must be float16, bfloat16 or float32, got float64")


def test_bool_positions_name_their_dtype(rng):
    arrays, kw = make_call(rng)
    arrays["positions"] = arrays["positions"] % 2 == 0
    expect_error(arrays, kw, "positions must be an int32 or int64 array, got bool")


def test_torch_narrow_float_pools_name_their_dtype(rng):
    """PyTorch float8 pools other than e4m3fn / e5m2 reach the contract
    through DLPack (codes of DLPack 1.1, newer than its header here): the
    message names them."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fnuz"):
        pytest.skip("no float8_e4m3fnuz in this PyTorch")
    arrays, kw = make_call(rng)
    t = {n: torch.from_numpy(a) for n, a in arrays.items()}
    t["k_pool"] = t["k_pool"].to(torch.float8_e4m3fnuz)
    t["v_pool"] = t["v_pool"].to(torch.float8_e5m2fnuz)
    before = {n: x.clone() for n, x in t.items()}
    with pytest.raises(ValueError, match=r"^pool dtypes must match q/k/v dtype, got k_pool "
                                         r"float8_e4m3fnuz, v_pool float8_e5m2fnuz for q/k/v "
                                         r"float32"):
        call(t, kw)
    for n, x in t.items():
        assert torch.equal(x.view(torch.uint8) if x.element_size() == 1 else x,
                           before[n].view(torch.uint8) if x.element_size() == 1 else before[n])


NARROW = ["float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz", "float8_e4m3",
          "float8_e3m4", "float8_e8m0fnu", "float6_e2m3fn", "float4_e2m1fn", "int4", "uint4"]


@pytest.mark.parametrize("name", NARROW + ["longdouble"])
@pytest.mark.parametrize("which", ["k_pool", "q"])
def test_dtypes_without_a_dlpack_type_raise_value_error(rng, name, which):
    """numpy arrays of a dtype DLPack has no type for (ml_dtypes' narrow
    floats and ints other than float8_e4m3fn / float8_e5m2, long double): the
    contract's ValueError naming the dtype, not the binding's TypeError, and
    every array as it was; with kv_cache_dtype="fp8_e4m3" too."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    dt = np.longdouble if name == "longdouble" else getattr(ml_dtypes, name, None)
    if dt is None:
        pytest.skip(f"ml_dtypes {ml_dtypes.__version__} has no {name}")
    arrays, kw = make_call(rng)
    with np.errstate(invalid="ignore"):  # (int4 / uint4 of random floats)
        arrays[which] = arrays[which].astype(dt)
        if which == "k_pool":
            arrays["v_pool"] = arrays["v_pool"].astype(dt)
    for extra in ({}, {"kv_cache_dtype": "fp8_e4m3"}):
        msg = expect_error(arrays, dict(kw, **extra), f"{which} has dtype {np.dtype(dt).name}, "
                                                      "which ropekv does not take")
        assert "float8_e4m3fn" in msg


@pytest.mark.parametrize("head_dim", [7, 0])
def test_bad_head_dim(rng, head_dim):
    arrays, kw = make_call(rng)
    for n in ("q", "k", "v", "k_pool", "v_pool"):
        arrays[n] = np.ascontiguousarray(arrays[n][..., :head_dim])
    kw["head_dim"] = head_dim
    expect_error(arrays, kw, f"head_dim must be even and >= 2, got {head_dim}")


@pytest.mark.parametrize("base", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_rope_base(rng, base):
    arrays, kw = make_call(rng)
    kw["rope_base"] = base
    expect_error(arrays, kw, "rope_base must be finite and > 0")


@pytest.mark.parametrize("slot", [P, P + 1000, 2**40])
def test_slot_out_of_range(rng, slot):
    arrays, kw = make_call(rng, idx=np.int64)
    arrays["slots"][T - 1] = slot
    msg = expect_error(arrays, kw, f"slots[{T - 1}] = {slot} is out of range for a pool of {P} rows")
    assert "nothing was written" in msg


def unaligned_copy(a, offset):
    """a's values in a numpy array whose data starts `offset` bytes past an
    aligned buffer (np.frombuffer at an offset: flags.aligned is False)."""
    buf = bytearray(a.nbytes + offset)
    out = np.frombuffer(buf, dtype=a.dtype, count=a.size, offset=offset).reshape(a.shape)
    out[...] = a
    return out


@pytest.mark.parametrize("name", ["q", "slots", "k_pool"])
def test_unaligned_array(rng, name):
    """An array whose first element's address is not a multiple of its element
    size: refused (the kernels read elements as typed values), nothing written."""
    arrays, kw = make_call(rng, idx=np.int64)
    arrays[name] = unaligned_copy(arrays[name], 3)
    assert not arrays[name].flags.aligned
    size = arrays[name].dtype.itemsize
    expect_error(arrays, kw, f"{name} starts at an address that is not a multiple of its "
                             f"{size}-byte elements (data + byte_offset = 3 mod {size})")


def test_unaligned_bf16_at_even_offsets_is_fine(rng):
    arrays, kw = make_call(rng, dtype=BF16)
    want = call({n: a.copy() for n, a in arrays.items()}, kw)
    arrays["q"] = unaligned_copy(arrays["q"], 2 + 8)  # (2-byte elements: aligned for them)
    got = call(arrays, kw)
    assert all(bits(g) == bits(w) for g, w in zip(got, want))


def test_read_only_pool(rng):
    arrays, kw = make_call(rng)
    arrays["k_pool"].flags.writeable = False
    expect_error(arrays, kw, "k_pool is read-only")


def test_read_only_inputs_are_fine(rng):
    arrays, kw = make_call(rng)
    for n in ("q", "k", "v", "positions", "slots"):
        arrays[n].flags.writeable = False
    call(arrays, kw)


def test_not_an_array(rng):
    arrays, kw = make_call(rng)
    arrays["q"] = arrays["q"].tolist()
    expect_error(arrays, kw, "q must be an array")


@pytest.mark.parametrize("name", ["q", "positions", "k_pool", "v_pool"])
def test_masked_array(rng, name):
    """A numpy masked array would be read (or written) as if nothing were
    masked: refused, with the fix for an input or a pool; nothing written."""
    arrays, kw = make_call(rng)
    mask = np.zeros(arrays[name].shape, bool)
    mask.flat[0] = True
    arrays[name] = np.ma.masked_array(arrays[name], mask=mask)
    fix = (f"pass {name}.data (its memory" if name.endswith("pool") else
           f"pass {name}.filled(value), or {name}.data for every value")
    expect_error(arrays, kw, f"{name} is a numpy masked array, whose mask ropekv would ignore; "
                             f"{fix}")


def test_head_dim_not_int(rng):
    arrays, kw = make_call(rng)
    kw["head_dim"] = 16.0
    expect_error(arrays, kw, "head_dim must be an int")


@pytest.mark.parametrize("row_bytes,prefix", [
    (0, "k_pool has stride 0 along axis 0"),
    (4, f"k_pool has strides (1, {D}, 1) (in elements) for shape ({P}, {HK}, {D}): its elements "
        f"overlap"),
])
def test_overlapping_pool(rng, row_bytes, prefix):
    """A pool whose rows share memory (stride 0, or rows one element apart)
    would make writes collide."""
    arrays, kw = make_call(rng)
    kp = arrays["k_pool"]
    arrays["k_pool"] = np.lib.stride_tricks.as_strided(
        kp, shape=kp.shape, strides=(row_bytes,) + kp.strides[1:], writeable=True)
    expect_error(arrays, kw, prefix)


def test_messages_through_mlx():
    """The contract holds for MLX arrays too (DLPack path, not numpy)."""
    mx = pytest.importorskip("mlx.core")  # (CI installs MLX: scripts/test.sh checks)
    rng = np.random.default_rng()
    arrays, kw = make_call(rng)
    m = {n: mx.array(a) for n, a in arrays.items()}
    m["q"] = m["q"][0]
    with pytest.raises(ValueError, match=re.escape("rope_pool_fused expects q/k/v to be 3-D")):
        call(m, kw)


@pytest.mark.parametrize("path", ["fast", "general"])
@pytest.mark.parametrize("option", [None, "q_norm_weight"])
def test_duplicate_slots_raise_in_checked_mode(rng, path, option):
    """On both paths (stream=0 takes the general one for CPU arrays), with and
    without an option (each path hands checked mode to its own core call)."""
    arrays, kw = make_call(rng, idx=np.int64)
    if path == "general":
        kw["stream"] = 0
    if option:
        kw[option] = rng.uniform(0.5, 1.5, D).astype(np.float32)
    arrays["slots"][3] = arrays["slots"][1]
    s = int(arrays["slots"][1])
    expect_error(arrays, kw, f"slots[3] = {s} repeats slots[1]: two tokens would race")


def test_negative_slots_may_repeat(rng):
    arrays, kw = make_call(rng)
    arrays["slots"][:3] = -1
    call(arrays, kw)


def test_duplicate_slots_pass_unchecked(rng):
    """Unchecked, a duplicate is the caller's race: no error, no other row touched."""
    arrays, kw = make_call(rng)
    arrays["slots"][3] = arrays["slots"][1]
    before = arrays["k_pool"].copy()
    ropekv.set_checked(False)
    call(arrays, kw)
    untouched = np.setdiff1d(np.arange(P), arrays["slots"])
    assert bits(arrays["k_pool"][untouched]) == bits(before[untouched])


@pytest.mark.parametrize("rotary_dim", [7, 0 - 2, D + 2])
def test_bad_rotary_dim(rng, rotary_dim):
    arrays, kw = make_call(rng)
    kw["rotary_dim"] = rotary_dim
    expect_error(arrays, kw, f"rotary_dim must be even and in [2, head_dim], got {rotary_dim}")


# ------------------------------------------------- memory the call writes


class DLPackOnly:
    """An array known only by its __dlpack__ (no shape, dtype, buffer)."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


class InterfaceOnly:
    """An array known only by its __array_interface__ (its memory: self.a)."""

    def __init__(self, a):
        self.a = a
        self.__array_interface__ = a.__array_interface__


def test_pools_sharing_memory(rng):
    arrays, kw = make_call(rng)
    arrays["v_pool"] = arrays["k_pool"][:]  # another view of the same rows
    expect_error(arrays, kw, "k_pool overlaps v_pool in memory")


def test_output_over_an_input(rng):
    arrays, kw = make_call(rng)
    kw["k_out"] = arrays["v"]  # k_out would overwrite v before the pool gets it
    expect_error(arrays, kw, "k_out overlaps v in memory")


def test_output_inside_a_pool(rng):
    arrays, kw = make_call(rng)
    flat = arrays["k_pool"].reshape(-1)
    kw["q_out"] = flat[:T * HQ * D].reshape(T, HQ, D)
    expect_error(arrays, kw, "k_pool overlaps q_out in memory")


def test_shifted_alias_is_not_in_place(rng):
    """q_out one element past q: each write would land on an element not yet
    read. Only the exact alias (inplace=True) is allowed."""
    arrays, kw = make_call(rng)
    buf = rng.standard_normal(T * HQ * D + 1).astype(np.float32)
    arrays["q"] = buf[:-1].reshape(T, HQ, D)
    kw["q_out"] = buf[1:].reshape(T, HQ, D)
    expect_error(arrays, kw, "q_out overlaps q in memory")


@pytest.mark.parametrize("writer,option", [
    ("k_pool", "cos_sin_cache"), ("v_pool", "q_norm_weight"), ("k_pool", "k_norm_weight"),
    ("q_out", "q_norm_weight"), ("k_out", "cos_sin_cache"),
])
def test_writer_over_an_option_array(rng, writer, option):
    """A pool or an output over the cos_sin_cache or a QK-norm weight: the
    call would overwrite what it reads for other tokens' heads. Refused like
    the overlaps of the core arrays, nothing written."""
    arrays, kw = make_call(rng)
    rows = 4  # (positions below rows: the table's rows are its only valid ones)
    arrays["positions"] = rng.integers(0, rows, T).astype(np.int32)
    if writer in ("k_pool", "v_pool"):
        flat = arrays[writer].reshape(-1)
    else:  # an output of its own, the option array taken from its memory
        flat = np.full((T, HQ if writer == "q_out" else HK, D), np.nan, np.float32).reshape(-1)
        kw[writer] = flat.reshape(T, -1, D)
    # The option array as a view of the writer's last elements.
    n = rows * D if option == "cos_sin_cache" else D
    view = flat[flat.size - n:]
    view[...] = rng.uniform(0.5, 1.5, n).astype(np.float32)
    kw[option] = view.reshape(rows, D) if option == "cos_sin_cache" else view
    expect_error(arrays, kw, f"{writer} overlaps {option} in memory")


def test_transposed_view_of_q_is_not_in_place(rng):
    """q_out over q's memory, its shape and dtype q's, but tokens and heads
    swapped in its strides: not the exact alias inplace=True makes, and each
    write would land on an element another head has yet to read."""
    arrays, kw = make_call(rng)
    q = arrays["q"]
    kw["q_out"] = np.lib.stride_tricks.as_strided(
        q, shape=q.shape, strides=(D * 4, T * D * 4, 4), writeable=True)
    assert kw["q_out"].shape == q.shape and np.shares_memory(kw["q_out"], q)
    expect_error(arrays, kw, "q_out overlaps q in memory")


def test_views_of_one_buffer_that_do_not_overlap(rng):
    """In place on one fused QKV buffer, k and v pools interleaved in one
    cache: views of shared buffers, no element shared. The same results as
    separate arrays."""
    arrays, kw = make_call(rng)
    qkv = np.concatenate([arrays["q"], arrays["k"], arrays["v"]], axis=1)
    kv = np.stack([arrays["k_pool"], arrays["v_pool"]], axis=1)  # [P, 2, HK, D]
    want = call({n: a.copy() for n, a in arrays.items()}, kw)
    fused = dict(arrays, q=qkv[:, :HQ], k=qkv[:, HQ:HQ + HK], v=qkv[:, HQ + HK:],
                 k_pool=kv[:, 0], v_pool=kv[:, 1])
    got = call(fused, dict(kw, inplace=True))
    for w, g in zip(want, got):
        assert bits(w) == bits(g)
    assert np.shares_memory(got[0], qkv) and np.shares_memory(got[2], kv)


def test_reversed_and_permuted_views_of_one_buffer(rng):
    """Views of one buffer that share no element, one of them reversed or
    with its axes in another order (the same addresses as the plain view):
    the pools as the even rows and the reversed odd rows of one cache, a pool
    reversed along its heads beside the other in one [P, 2, HK, D] cache, and
    q_out as a reversed head slice of a buffer whose other heads are v. The
    same results as separate arrays; a reversed view over the other pool's
    rows is still refused."""
    arrays, kw = make_call(rng)
    want = call({n: a.copy() for n, a in arrays.items()}, kw)
    P = arrays["k_pool"].shape[0]
    cache = np.empty((2 * P,) + arrays["k_pool"].shape[1:], arrays["k_pool"].dtype)
    kp, vp = cache[::2], cache[1::2][::-1]
    kp[...], vp[...] = arrays["k_pool"], arrays["v_pool"]
    got = call(dict(arrays, k_pool=kp, v_pool=vp), kw)
    assert all(bits(w) == bits(g) for w, g in zip(want, got))
    kv = np.stack([arrays["k_pool"], arrays["v_pool"][:, ::-1]], axis=1)  # [P, 2, HK, D]
    got = call(dict(arrays, k_pool=kv[:, 0], v_pool=kv[:, 1, ::-1]), kw)
    assert all(bits(w) == bits(g) for w, g in zip(want, got))
    buf = np.empty((T, HQ + HK, D), arrays["q"].dtype)
    buf[:, HQ:] = arrays["v"]
    got = call(dict(arrays, v=buf[:, HQ:]), dict(kw, q_out=buf[:, :HQ][::-1]))
    assert bits(got[0]) == bits(want[0])
    cache[...] = 0
    expect_error(dict(arrays, k_pool=cache[::2], v_pool=cache[::2][::-1]), kw,
                 "k_pool overlaps v_pool in memory")


def test_pair_the_bounded_search_cannot_clear_may_overlap():
    """A pool inside the span of a read array of other strides, sharing no
    element with it (counted here), in a layout whose search for a shared
    byte runs out of its bound: refused as "may overlap", not "overlaps",
    before anything is written."""
    from numpy.lib.stride_tricks import as_strided
    T, P, H, D = 323, 223, 64, 2
    s_t, s_h, s_p, s_k, off = 384, 4, 536, 8, 30  # (in elements)
    buf = np.zeros(max(T * s_t + H * s_h, off + P * s_p + H * s_k) + D, np.float32)
    q = as_strided(buf, (T, H, D), (4 * s_t, 4 * s_h, 4))
    k_pool = as_strided(buf[off:], (P, H, D), (4 * s_p, 4 * s_k, 4))
    def elements(offset, strides, shape):  # every element's index in buf
        return offset + np.dot(strides, np.indices(shape).reshape(len(shape), -1))

    assert np.intersect1d(elements(0, (s_t, s_h, 1), (T, H, D)),
                          elements(off, (s_p, s_k, 1), (P, H, D))).size == 0
    k = np.ones((T, H, D), np.float32)
    before = buf.copy()
    with pytest.raises(ValueError, match=r"^k_pool may overlap q in memory \(their byte ranges "
                                         r"meet, and ropekv could not prove within its search's "
                                         r"bound that they share no byte\): "):
        ropekv.rope_pool_fused(q, k, k, np.arange(T), np.arange(T), k_pool,
                               np.zeros((P, H, D), np.float32), head_dim=D, num_qo_heads=H,
                               num_kv_heads=H, rope_base=1e4)
    assert (buf == before).all()


def test_read_only_memory_of_any_kind(rng):
    """Read-only memory that is not a numpy array: a memoryview of bytes, a
    memoryview of a read-only array, a read-only array behind __dlpack__
    (DLPack 1.0's flag). Each is refused before anything is written."""

    arrays, kw = make_call(rng)
    immutable = arrays["k_pool"].tobytes()
    ro = arrays["k_pool"].copy()
    ro.setflags(write=False)
    for pool in (memoryview(immutable).cast("B").cast("f", ro.shape), memoryview(ro),
                 DLPackOnly(ro)):
        expect_error(dict(arrays, k_pool=pool), kw, "k_pool is read-only")
        assert bits(ro) == bits(arrays["k_pool"])
        assert immutable == arrays["k_pool"].tobytes()


class LegacyDLPack(DLPackOnly):
    """A producer of DLPack before 1.0: __dlpack__ takes no max_version, and
    its capsule cannot say that memory is read-only."""

    def __dlpack__(self, stream=None):
        return self.a.__dlpack__(stream=stream)


def test_legacy_dlpack_producers(rng):
    """A writable pool behind a pre-1.0 __dlpack__ is written in place; a
    read-only one (which it cannot export) is a ValueError, nothing written."""
    arrays, kw = make_call(rng)
    want = call({n: a.copy() for n, a in arrays.items()}, kw)
    kp = arrays["k_pool"].copy()
    call(dict(arrays, k_pool=LegacyDLPack(kp)), kw)
    assert bits(kp) == bits(want[2])
    ro = arrays["k_pool"].copy()
    ro.flags.writeable = False
    expect_error(dict(arrays, k_pool=LegacyDLPack(ro)), kw, "an array of the call could not be "
                 "imported")
    assert bits(ro) == bits(arrays["k_pool"])


def test_writable_memory_of_any_kind(rng):
    """The same kinds, writable: the pools are written in place, as a numpy
    pool would be."""

    arrays, kw = make_call(rng)
    want = call({n: a.copy() for n, a in arrays.items()}, kw)
    for wrap in (memoryview, DLPackOnly, InterfaceOnly):
        kp, vp = arrays["k_pool"].copy(), arrays["v_pool"].copy()
        got = call(dict(arrays, k_pool=wrap(kp), v_pool=wrap(vp)), kw)
        assert bits(kp) == bits(want[2]) and bits(vp) == bits(want[3]), wrap.__name__
        assert bits(got[0]) == bits(want[0])


@pytest.mark.parametrize("name,value,prefix", [
    ("num_threads", -1, "num_threads must be >= 0 (0: OpenMP's default), got -1"),
    ("num_threads", -2**40, "num_threads must be >= 0"),
    ("num_qo_heads", 2**63, "num_qo_heads is out of range (64-bit)"),
    ("head_dim", -2**64, "head_dim is out of range (64-bit)"),
    ("rope_base", "10000", "rope_base must be a number, got '10000'"),
    # A bool is not a count or a number here, though Python's int and float take it.
    ("head_dim", True, "head_dim must be an int, got True"),
    ("num_kv_heads", np.True_, "num_kv_heads must be an int, got "),
    ("num_threads", False, "num_threads must be an int, got False"),
    ("rotary_dim", True, "rotary_dim must be an int, got True"),
    ("rope_base", True, "rope_base must be a number, got True"),
    ("rope_base", np.True_, "rope_base must be a number, got "),
    # ... nor a 0-d bool array, nor an array of numbers (one element or more),
    # whether or not the value matters to the call (scales without fp8 pools).
    ("rope_base", np.array(True), "rope_base must be a number, got "),
    ("norm_eps", np.array(False), "norm_eps must be a number, got "),
    ("num_threads", np.array(True), "num_threads must be an int, got "),
    ("head_dim", np.array([D]), "head_dim must be an int, got "),
    ("k_scale", True, "k_scale must be a number, got True"),
    ("v_scale", np.True_, "v_scale must be a number, got "),
    ("k_scale", np.array([1.0, 1.0]), "k_scale must be a number, got "),
    ("v_scale", np.array([1.0]), "v_scale must be a number, got "),
    ("rope_scaling", {"rope_type": ["yarn"], "factor": 4.0},
     "rope_scaling type ['yarn'] is not supported"),
    ("rope_base", 1e-300, "rope_base 1e-300 gives inv_freq[2] = inf, not finite"),
    # a dict of fields without its type (transformers 5 reads it as plain
    # RoPE with a warning; ropekv does not drop a factor)
    ("rope_scaling", {"factor": 8.0}, "rope_scaling has no 'rope_type' (or 'type'), so its "
     "fields 'factor' would mean nothing"),
    ("rope_scaling", {"rope_type": None, "factor": 8.0}, "rope_scaling has no 'rope_type' (or "
     "'type'), so its fields 'factor' would mean nothing"),
    # (partial_rotary_factor and rope_theta are read without a type: not named)
    ("rope_scaling", {"factor": 8.0, "partial_rotary_factor": 0.5}, "rope_scaling has no "
     "'rope_type' (or 'type'), so its fields 'factor' would mean nothing"),
    ("inplace", "False", "inplace must be a bool, got 'False'"),
    ("inplace", 1, "inplace must be a bool, got 1"),
    ("inplace", np.array([True, True]), "inplace must be a bool, got "),
    ("stream", "x", "stream must be a CUDA stream (torch.cuda.Stream, cupy's Stream) or its "
     "handle as an int, got 'x'"),
    ("stream", True, "stream must be a CUDA stream"),
    ("stream", object(), "stream must be a CUDA stream"),
    ("rotary_dim", 0, f"rotary_dim must be even and in [2, head_dim], got 0 for head_dim {D}"),
    ("is_neox", None, "is_neox must be a bool, got None"),
    ("is_neox", "no", "is_neox must be a bool, got 'no'"),
    ("rope_scaling", {"type": "linear", "factor": 10**400},
     "rope_scaling 'factor' is too large for a float"),
    ("rope_scaling", {"type": "linear", "factor": 1e-40},
     "rope_base 10000 with its rope_scaling gives inv_freq[0] = inf"),
])
def test_argument_errors_are_value_errors(rng, name, value, prefix):
    arrays, kw = make_call(rng)
    expect_error(arrays, dict(kw, **{name: value}), prefix)


@pytest.mark.parametrize("name,rule", [
    ("q", "rope_pool_fused expects q/k/v to be 3-D"),
    ("v", "rope_pool_fused expects q/k/v to be 3-D"),
    ("slots", "rope_pool_fused expects positions/slots to be 1-D"),
    ("k_pool", "rope_pool_fused expects pool tensors to be 3-D"),
])
@pytest.mark.parametrize("options", [{}, {"is_neox": False}])
def test_none_array_is_a_rank_error(rng, name, rule, options):
    """An array that is None breaks its rank rule: a ValueError that names it,
    nothing written (also with options, which take the other binding)."""
    arrays, kw = make_call(rng)
    arrays[name] = None
    msg = expect_error(arrays, dict(kw, **options), rule)
    assert f"({name} is None: pass an array)" in msg
    # An earlier rule still wins over a later None.
    if not rule.endswith("q/k/v to be 3-D"):
        arrays, kw = make_call(rng)
        arrays["q"] = arrays["q"][0]
        arrays[name] = None
        expect_error(arrays, kw, "rope_pool_fused expects q/k/v to be 3-D")


def test_thread_count_error_comes_last(rng):
    """num_threads < 0 is the contract's last check: any array error first."""
    for mutate in (m_qk_rank, m_pool_dtype, m_index_len):
        arrays, kw = make_call(rng)
        prefix = mutate(arrays, kw)
        expect_error(arrays, dict(kw, num_threads=-1), prefix)
    arrays, kw = make_call(rng)
    arrays["slots"][1] = P  # out of range: read before any write on the CPU
    expect_error(arrays, dict(kw, num_threads=-1), f"slots[1] = {P}")


def test_thread_counts_beyond_the_cap(rng):
    """A million threads asked for (and 2^31, past a C int, and 2^70): the call runs,
    with the same bits as one thread. (The cap itself, max(64, 4 x
    processors) threads, is Cpu.ThreadTeamIsCapped's.)"""
    arrays, kw = make_call(rng)
    big = {n: np.repeat(a, 200, axis=0) if n in ("q", "k", "v") else a for n, a in arrays.items()}
    big["positions"] = rng.integers(0, 1 << 20, 200 * T).astype(np.int32)
    big["slots"] = np.full(200 * T, -1, np.int32)
    one = call({n: a.copy() for n, a in big.items()}, dict(kw, num_threads=1))
    many = call(big, dict(kw, num_threads=10**6))
    for a, b in zip(one, many):
        assert bits(a) == bits(b)
    assert call(big, dict(kw, num_threads=2**31))[0].shape == (200 * T, HQ, D)
    assert call(big, dict(kw, num_threads=2**70))[0].shape == (200 * T, HQ, D)  # past 64 bits


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX")
def test_child_forked_after_threads_runs_its_calls(rng):
    """GNU OpenMP's threads do not survive fork(): in a child forked after a
    call started a thread team, a call that started one again would wait
    forever. There the calls run on one thread, with the same bits."""
    arrays, kw = make_call(rng)
    big = {n: np.repeat(a, 400, axis=0) if n in ("q", "k", "v") else a for n, a in arrays.items()}
    big["positions"] = rng.integers(0, 1 << 20, 400 * T).astype(np.int32)
    big["slots"] = np.full(400 * T, -1, np.int32)
    want = call({n: a.copy() for n, a in big.items()}, dict(kw, num_threads=2))  # a team of 2
    pid = os.fork()
    if pid == 0:  # the child: its own exit code, never pytest's
        code = 1
        try:
            for threads in (0, 2):
                got = call({n: a.copy() for n, a in big.items()}, dict(kw, num_threads=threads))
                if any(bits(a) != bits(b) for a, b in zip(want, got)):
                    break
            else:
                code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's call did not return in 60 s")
        time.sleep(0.02)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child's results differ"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")
def test_out_of_memory_in_a_threaded_call_raises_and_writes_nothing():
    """A call whose scratch memory cannot be had raises MemoryError with every
    array as it was, on a team of threads too (an allocation in a team thread
    cannot raise: it would end the process). Run in a child process with its
    address space capped 128 MiB above its size: a head of 2^23 elements needs
    scratch rows of 2^23 floats, about 200 MiB per thread."""
    script = textwrap.dedent("""
        import resource, numpy as np, ropekv
        D = 1 << 23
        rng = np.random.default_rng()
        q = rng.standard_normal((2, 1, D), dtype=np.float32).astype(np.float16)
        k, v = q + 1, q - 1
        k_pool, v_pool = np.zeros((2, 1, D), np.float16), np.ones((2, 1, D), np.float16)
        q_out, k_out = np.full_like(q, 7), np.full_like(q, 7)
        arrays = [q, k, v, k_pool, v_pool, q_out, k_out]
        before = [a.copy() for a in arrays]
        size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        for threads in (2, 1):
            resource.setrlimit(resource.RLIMIT_AS, (size + (128 << 20), hard))
            try:
                ropekv.rope_pool_fused(q, k, v, np.arange(2, dtype=np.int32),
                                       np.array([1, 0], np.int32), k_pool, v_pool,
                                       q_out=q_out, k_out=k_out, head_dim=D, num_qo_heads=1,
                                       num_kv_heads=1, rope_base=1e4, num_threads=threads)
                raise SystemExit(f"{threads} threads: no MemoryError")
            except MemoryError:
                pass
            finally:
                resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
            for a, b in zip(arrays, before):
                if a.tobytes() != b.tobytes():
                    raise SystemExit(f"{threads} threads: an array changed")
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.returncode, run.stdout,
                                                                 run.stderr[-2000:])


def test_outputs_made_for_inputs_of_any_kind(rng):
    """q and k as a memoryview, an __array_interface__ object or a CPU DLPack
    object without shape or dtype attributes: ropekv makes numpy outputs,
    with the same bits as for numpy inputs."""

    arrays, kw = make_call(rng)
    want = call({n: a.copy() for n, a in arrays.items()}, kw)
    for wrap in (memoryview, DLPackOnly, InterfaceOnly):
        pools = {"k_pool": arrays["k_pool"].copy(), "v_pool": arrays["v_pool"].copy()}
        got = call(dict(arrays, q=wrap(arrays["q"]), k=wrap(arrays["k"]), **pools), kw)
        assert isinstance(got[0], np.ndarray) and isinstance(got[1], np.ndarray), wrap.__name__
        for w, g in zip(want, got[:2] + (pools["k_pool"], pools["v_pool"])):
            assert bits(w) == bits(g), wrap.__name__


def test_outputs_made_for_bf16_dlpack_objects(rng):
    """q and k as CPU DLPack objects of bf16 (which numpy cannot import
    without ml_dtypes' help): ropekv makes ml_dtypes bf16 numpy outputs of
    their shape, with the same bits as for bf16 numpy inputs; a q of the
    wrong rank still gets the core's rank error, nothing written."""
    torch = pytest.importorskip("torch")
    arrays, kw = make_call(rng, dtype=BF16)
    want = call({n: a.copy() for n, a in arrays.items()}, kw)
    as_torch = lambda a: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)  # noqa: E731
    pools = {"k_pool": arrays["k_pool"].copy(), "v_pool": arrays["v_pool"].copy()}
    got = call(dict(arrays, q=DLPackOnly(as_torch(arrays["q"])),
                    k=DLPackOnly(as_torch(arrays["k"])), **pools), kw)
    for w, g in zip(want, got[:2]):
        assert isinstance(g, np.ndarray) and g.dtype == BF16 and g.shape == w.shape
    for w, g in zip(want, got[:2] + (pools["k_pool"], pools["v_pool"])):
        assert bits(w) == bits(g)
    flat = DLPackOnly(as_torch(arrays["q"].reshape(T, HQ * D)))
    expect_error(dict(arrays, q=flat), kw,
                 f"rope_pool_fused expects q/k/v to be 3-D, got q ({T}, {HQ * D})")


@pytest.mark.parametrize("value,on", [
    ("", False), ("0", False), ("false", False), ("False", False), ("FALSE", False),
    ("no", False), ("Off", False), (" 0 ", False),
    ("1", True), ("true", True), ("YES", True), ("on", True)])
def test_checked_env_values(value, on):
    """ROPEKV_CHECKED reads as a switch in any case: no/off are off."""
    assert ropekv._checked_from_env(value) is on


def test_checked_env_unknown_value_warns_and_is_on():
    with pytest.warns(RuntimeWarning, match=r"ROPEKV_CHECKED='maybe' is not 1/true/yes/on"):
        assert ropekv._checked_from_env("maybe") is True


@pytest.mark.parametrize("value", ["no", "False", 1, 0, None, np.array([True])])
def test_set_checked_takes_a_bool(value):
    was = ropekv.is_checked()
    with pytest.raises(ValueError, match=r"^set_checked takes a bool, got "):
        ropekv.set_checked(value)
    assert ropekv.is_checked() == was
    ropekv.set_checked(np.False_)
    assert ropekv.is_checked() is False
    ropekv.set_checked(was)
