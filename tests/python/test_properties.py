"""Property-based tests (hypothesis) of the whole contract on the CPU.

Random ranks, shapes, strides, dtypes, head counts and sizes, slots
(negative, duplicate, out of range) and positions. A small model of the
contract written here predicts, for each drawn call, either the first
message it must raise or that it is valid; then every valid call must equal
the float64 reference and every invalid call must raise that message and
leave every array byte-identical."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ropekv
from reference import BF16, assert_close, bits, check_pool_rows, poison, rope

FLOATS = [np.dtype(np.float32), np.dtype(np.float16), BF16]
INDEX = [np.dtype(np.int32), np.dtype(np.int64)]


def strided(rng, shape, dtype, stride_kind):
    """An array of `shape` that is a view into a larger buffer: contiguous,
    every other element of the last dim, or with padding between rows."""
    shape = tuple(shape)
    if stride_kind == 0 or len(shape) == 0:
        base = rng.standard_normal(shape).astype(np.float32).astype(dtype)
        return base
    if stride_kind == 1:
        big = rng.standard_normal(shape[:-1] + (2 * shape[-1],)).astype(np.float32).astype(dtype)
        return big[..., ::2]
    big = rng.standard_normal((shape[0] + 1,) + shape[1:-1] + (shape[-1] + 3,))
    big = big.astype(np.float32).astype(dtype)
    return big[1:, ..., 1 : 1 + shape[-1]]


@st.composite
def calls(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    T = draw(st.integers(0, 24))
    Hq, Hk = draw(st.integers(1, 5)), draw(st.integers(1, 3))
    D = 2 * draw(st.integers(1, 40))
    P = draw(st.integers(1, 40))
    dtype = draw(st.sampled_from(FLOATS))
    pos_t, slot_t = draw(st.sampled_from(INDEX)), draw(st.sampled_from(INDEX))
    kinds = draw(st.lists(st.integers(0, 2), min_size=9, max_size=9))
    base = draw(st.sampled_from([1e4, 5e5, 1e6, 2.5]))
    cfg = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hk, rope_base=base)
    a = dict(
        q=strided(rng, (T, Hq, D), dtype, kinds[0]),
        k=strided(rng, (T, Hk, D), dtype, kinds[1]),
        v=strided(rng, (T, Hk, D), dtype, kinds[2]),
        positions=rng.integers(-1000, 1 << 24, T).astype(pos_t),
        slots=rng.integers(-3, P, T).astype(slot_t),
        k_pool=strided(rng, (P, Hk, D), dtype, kinds[3]),
        v_pool=strided(rng, (P, Hk, D), dtype, kinds[4]),
    )
    # Make most calls valid (unique slots); then maybe break one thing.
    if draw(st.booleans()) and T:
        a["slots"] = np.where(a["slots"] >= 0, -1, a["slots"]).astype(slot_t)
        uniq = rng.permutation(P)[: min(T, P)]
        a["slots"][: len(uniq)] = uniq
    mutation = draw(st.sampled_from(
        ["none"] * 6 + ["rank_q", "rank_idx", "rank_pool", "heads", "k_shape", "v_shape",
                        "len", "pool_shape", "vpool_shape", "dtype_v", "dtype_pool",
                        "float_pos", "f64", "odd_D", "base", "slot_high", "dup"]))
    if mutation == "rank_q":
        a["q"] = a["q"].reshape(a["q"].shape + (1,))
    elif mutation == "rank_idx":
        a["positions"] = a["positions"][:, None]
    elif mutation == "rank_pool":
        a["k_pool"] = a["k_pool"][None]
    elif mutation == "heads":
        cfg["num_qo_heads"] = Hq + 1
    elif mutation == "k_shape":
        a["k"] = a["k"][:, :, : D - 2] if D > 2 else a["k"][:, :0]
    elif mutation == "v_shape":
        a["v"] = np.concatenate([a["v"], a["v"]], axis=1)
    elif mutation == "len":
        a["slots"] = np.concatenate([a["slots"], a["slots"][:1] if T else np.zeros(1, slot_t)])
    elif mutation == "pool_shape":
        a["k_pool"] = np.concatenate([a["k_pool"], a["k_pool"]], axis=1)
    elif mutation == "vpool_shape":
        a["v_pool"] = a["v_pool"][: P - 1] if P > 1 else np.concatenate([a["v_pool"]] * 2)
    elif mutation == "dtype_v":
        a["v"] = a["v"].astype(np.float32 if dtype != np.float32 else np.float16)
    elif mutation == "dtype_pool":
        a["v_pool"] = a["v_pool"].astype(np.float32 if dtype != np.float32 else np.float16)
    elif mutation == "float_pos":
        a["positions"] = a["positions"].astype(np.float32)
    elif mutation == "f64":
        for n in ("q", "k", "v", "k_pool", "v_pool"):
            a[n] = a[n].astype(np.float64)
    elif mutation == "odd_D":
        for n in ("q", "k", "v", "k_pool", "v_pool"):
            a[n] = a[n][..., : D - 1]
        cfg["head_dim"] = D - 1
    elif mutation == "base":
        cfg["rope_base"] = draw(st.sampled_from([0.0, -2.0, float("nan"), float("inf")]))
    elif mutation == "slot_high" and T:
        a["slots"][rng.integers(0, T)] = P + rng.integers(0, 3)
    elif mutation == "dup" and T >= 2 and P >= 1:
        a["slots"][0] = a["slots"][1] = rng.integers(0, P)
    return a, cfg


def expected_error(a, cfg):
    """The contract of SPEC section 3, in order, as a model: the first
    message a call must raise, or None."""
    q, k, v, pos, slots, kp, vp = (a[n] for n in
                                   ("q", "k", "v", "positions", "slots", "k_pool", "v_pool"))
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        return "rope_pool_fused expects q/k/v to be 3-D"
    if pos.ndim != 1 or slots.ndim != 1:
        return "rope_pool_fused expects positions/slots to be 1-D"
    if kp.ndim != 3 or vp.ndim != 3:
        return "rope_pool_fused expects pool tensors to be 3-D"
    T, D, Hq, Hk = q.shape[0], cfg["head_dim"], cfg["num_qo_heads"], cfg["num_kv_heads"]
    if q.shape[1:] != (Hq, D):
        return "q shape must be [num_tokens, num_qo_heads, head_dim]"
    if k.shape != (T, Hk, D):
        return "k shape must be [num_tokens, num_kv_heads, head_dim]"
    if v.shape != k.shape:
        return "v shape must match k shape"
    if pos.shape[0] != T or slots.shape[0] != T:
        return "positions/slots must have one entry per token"
    if kp.shape[1:] != (Hk, D):
        return "k_pool has incompatible shape"
    if vp.shape != kp.shape:
        return "v_pool shape must match k_pool shape"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return "q/k/v dtypes must match"
    if kp.dtype != q.dtype or vp.dtype != q.dtype:
        return "pool dtypes must match q/k/v dtype"
    if pos.dtype not in INDEX:
        return "positions must be an int32 or int64 array"
    if slots.dtype not in INDEX:
        return "slots must be an int32 or int64 array"
    if q.dtype not in FLOATS:
        return "q/k/v dtype must be float16, bfloat16 or float32"
    if D < 2 or D % 2:
        return "head_dim must be even and >= 2"
    base = cfg["rope_base"]
    if not np.isfinite(base) or base <= 0:
        return "rope_base must be finite and > 0"
    P = kp.shape[0]
    for i, s in enumerate(slots.tolist()):
        if s >= P:
            return f"slots[{i}] = {s} is out of range"
    named = [s for s in slots.tolist() if s >= 0]
    if len(set(named)) != len(named):
        return "slots["  # the message names the later of the two tokens
    return None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls())
def test_contract_property(call):
    a, cfg = call
    want = expected_error(a, cfg)
    before = {n: bits(x) for n, x in a.items()}
    args = [a[n] for n in ("q", "k", "v", "positions", "slots", "k_pool", "v_pool")]
    if want is not None:
        try:
            ropekv.rope_pool_fused(*args, **cfg)
        except ValueError as e:
            assert str(e).startswith(want), f"got {str(e)!r}, want {want!r}"
        else:
            raise AssertionError(f"no error, want {want!r}")
        for n, b in before.items():
            assert bits(a[n]) == b, f"{n} changed by a failed call"
        return

    q, k, v, pos, slots, kp, vp = args
    kp0, vp0 = kp.copy(), vp.copy()
    q_out, k_out = poison(q.shape, q.dtype), poison(k.shape, k.dtype)
    ropekv.rope_pool_fused(*args, **cfg, q_out=q_out, k_out=k_out)
    q_ref, q_mag = rope(q, pos, cfg["rope_base"])
    k_ref, k_mag = rope(k, pos, cfg["rope_base"])
    assert_close(q_out, q_ref, q_mag, "q_rot")
    assert_close(k_out, k_ref, k_mag, "k_rot")
    check_pool_rows(kp, vp, kp0, vp0, slots, k_out, v)
    for n in ("q", "k", "v", "positions", "slots"):
        assert bits(a[n]) == before[n], f"input {n} was written"
