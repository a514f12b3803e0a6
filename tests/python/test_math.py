"""The math against the float64 reference (reference.py), through Python:
every real model config, every dtype, positions up to 2^24, poisoned outputs,
untouched pool rows, odd sizes and layouts."""

from __future__ import annotations

import numpy as np
import pytest

import ropekv
from reference import DTYPES, MODELS, assert_close, bits, poison, rope

RNG = np.random.default_rng()


def randn(shape, dtype):
    return RNG.standard_normal(shape).astype(np.float32).astype(dtype)


def random_positions(T, idx=np.int32):
    """Ordinary and extreme positions: 0 .. 2^24 - 1 and a few negatives."""
    pos = RNG.integers(0, 1 << 24, T)
    pos[: min(T, 3)] = [0, (1 << 24) - 1, -17][: min(T, 3)]
    if T > 5:
        pos[3:6] = RNG.integers(0, 4096, 3)
    return pos.astype(idx)


def run_and_check(T, Hq, Hk, D, base, dtype, idx=np.int32, pool_size=None, slots=None,
                  positions=None, num_threads=0, q=None, k=None, v=None):
    """One call with poisoned outputs; checks q_rot, k_rot, the named pool
    rows and that every other pool row is bit-identical."""
    P = pool_size or 2 * T + 3
    q = randn((T, Hq, D), dtype) if q is None else q
    k = randn((T, Hk, D), dtype) if k is None else k
    v = randn((T, Hk, D), dtype) if v is None else v
    positions = random_positions(T, idx) if positions is None else positions
    if slots is None:
        slots = RNG.permutation(P)[:T].astype(idx)
        slots[RNG.random(T) < 0.2] = -1
    k_pool, v_pool = randn((P, Hk, D), dtype), randn((P, Hk, D), dtype)
    k_pool0, v_pool0 = k_pool.copy(), v_pool.copy()
    q_out, k_out = poison((T, Hq, D), dtype), poison((T, Hk, D), dtype)

    res = ropekv.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, head_dim=D,
                                 num_qo_heads=Hq, num_kv_heads=Hk, rope_base=base,
                                 q_out=q_out, k_out=k_out, num_threads=num_threads)
    assert res[0] is q_out and res[1] is k_out
    assert res[2] is k_pool and res[3] is v_pool

    q_ref, q_mag = rope(q, positions, base)
    k_ref, k_mag = rope(k, positions, base)
    assert_close(q_out, q_ref, q_mag, "q_rot")
    assert_close(k_out, k_ref, k_mag, "k_rot")
    named = set()
    for t, s in enumerate(np.asarray(slots).tolist()):
        if s < 0:
            continue
        named.add(s)
        assert bits(k_pool[s]) == bits(k_out[t]), f"k_pool[{s}] != k_rot[{t}]"
        assert bits(v_pool[s]) == bits(v[t]), f"v_pool[{s}] != v[{t}]"
    for s in range(P):
        if s not in named:
            assert bits(k_pool[s]) == bits(k_pool0[s]), f"k_pool row {s} was touched"
            assert bits(v_pool[s]) == bits(v_pool0[s]), f"v_pool row {s} was touched"
    return q_out, k_out, k_pool, v_pool


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("model", MODELS, ids=[m[0] for m in MODELS])
def test_models(model, dtype):
    _, Hq, Hk, D, base = model
    for T in (1, 19):
        run_and_check(T, Hq, Hk, D, base, DTYPES[dtype])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("D", [2, 4, 8, 10, 34, 80, 96, 130, 512])
def test_odd_head_dims(D, dtype):
    """Head sizes that are not a multiple of any vector width."""
    run_and_check(99, 3, 1, D, 10000.0, DTYPES[dtype])


@pytest.mark.parametrize("idx", [np.int32, np.int64])
def test_index_types(idx):
    run_and_check(33, 8, 2, 64, 500000.0, DTYPES["bfloat16"], idx=idx)


def test_mixed_index_types():
    T = 7
    run_and_check(T, 4, 2, 32, 1e6, np.float32, positions=random_positions(T, np.int64),
                  slots=np.arange(T, dtype=np.int32))


def test_t_zero():
    res = run_and_check(0, 4, 2, 16, 10000.0, np.float32, pool_size=5)
    assert res[0].shape == (0, 4, 16)


def test_t_zero_allocates_empty_outputs():
    q = np.zeros((0, 4, 16), np.float32)
    k = np.zeros((0, 2, 16), np.float32)
    kp = randn((5, 2, 16), np.float32)
    vp = kp.copy()
    q_rot, k_rot, kp2, vp2 = ropekv.rope_pool_fused(
        q, k, k, np.zeros(0, np.int32), np.zeros(0, np.int32), kp, vp,
        head_dim=16, num_qo_heads=4, num_kv_heads=2, rope_base=1e4)
    assert q_rot.shape == (0, 4, 16) and k_rot.shape == (0, 2, 16)
    assert kp2 is kp and bits(kp) == bits(vp)


def test_t_one_decode():
    run_and_check(1, 32, 8, 128, 500000.0, DTYPES["bfloat16"], pool_size=1000)


def test_all_slots_negative():
    T = 12
    run_and_check(T, 4, 2, 64, 1e4, np.float16, slots=np.full(T, -1, np.int32))


def test_slots_with_gaps():
    T = 10
    slots = np.array([0, -1, 5, -3, 9, 2, -1, 30, 31, 17], np.int64)
    run_and_check(T, 4, 2, 64, 1e4, np.float32, slots=slots, pool_size=40)


def test_fused_qkv_views():
    """q, k, v as strided views of one fused QKV projection output
    [T, (Hq + 2 Hk) * D]: the token stride is larger than H * D."""
    T, Hq, Hk, D = 21, 8, 2, 128
    for dtype in DTYPES.values():
        qkv = randn((T, (Hq + 2 * Hk) * D), dtype)
        q = qkv[:, : Hq * D].reshape(T, Hq, D)
        k = qkv[:, Hq * D : (Hq + Hk) * D].reshape(T, Hk, D)
        v = qkv[:, (Hq + Hk) * D :].reshape(T, Hk, D)
        assert not q.flags.c_contiguous and np.shares_memory(q, qkv)
        before = bits(qkv)
        run_and_check(T, Hq, Hk, D, 500000.0, dtype, q=q, k=k, v=v)
        assert bits(qkv) == before, "inputs must not be written"


def test_non_contiguous_last_dim():
    T, Hq, Hk, D = 9, 4, 2, 32
    big = randn((T, Hq, 2 * D), np.float32)
    q = big[..., ::2]
    assert q.strides[-1] == 8
    run_and_check(T, Hq, Hk, D, 1e4, np.float32, q=q)


def test_strided_pool_and_outputs():
    """Pools that are views with a larger row stride; outputs with a gap."""
    T, Hq, Hk, D, P = 11, 4, 2, 64, 30
    dtype = DTYPES["bfloat16"]
    q, k, v = randn((T, Hq, D), dtype), randn((T, Hk, D), dtype), randn((T, Hk, D), dtype)
    big_k, big_v = randn((P, Hk + 1, D), dtype), randn((P, Hk + 1, D), dtype)
    k_pool, v_pool = big_k[:, :Hk], big_v[:, :Hk]
    before_k, before_v = big_k.copy(), big_v.copy()
    q_buf = poison((T, Hq + 3, D), dtype)
    q_out = q_buf[:, 1 : Hq + 1]
    slots = RNG.permutation(P)[:T].astype(np.int32)
    pos = random_positions(T)
    ropekv.rope_pool_fused(q, k, v, pos, slots, k_pool, v_pool, head_dim=D,
                           num_qo_heads=Hq, num_kv_heads=Hk, rope_base=1e6, q_out=q_out)
    q_ref, q_mag = rope(q, pos, 1e6)
    assert_close(q_out, q_ref, q_mag, "q_rot")
    assert np.isnan(q_buf[:, 0].astype(np.float32)).all(), "wrote outside q_out"
    k_ref, k_mag = rope(k, pos, 1e6)
    assert_close(k_pool[slots], k_ref, k_mag, "k_pool")
    assert bits(v_pool[slots]) == bits(v)
    # The extra head of every pool row, and the rows no token names, are untouched.
    assert bits(big_k[:, Hk]) == bits(before_k[:, Hk])
    rest = np.setdiff1d(np.arange(P), slots)
    assert bits(big_v[rest]) == bits(before_v[rest])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_results_identical_for_every_thread_count(dtype):
    T, Hq, Hk, D = 300, 8, 2, 128
    dt = DTYPES[dtype]
    q, k, v = randn((T, Hq, D), dt), randn((T, Hk, D), dt), randn((T, Hk, D), dt)
    pos, slots = random_positions(T), RNG.permutation(T).astype(np.int32)
    outs = []
    for n in (1, 2, 3, 7):
        kp, vp = np.zeros((T, Hk, D), dt), np.zeros((T, Hk, D), dt)
        r = ropekv.rope_pool_fused(q, k, v, pos, slots, kp, vp, head_dim=D, num_qo_heads=Hq,
                                   num_kv_heads=Hk, rope_base=1e4, num_threads=n)
        outs.append(b"".join(bits(x) for x in r))
    assert all(o == outs[0] for o in outs)


def test_in_place_outputs_alias_inputs():
    """q_out=q rotates q in its own buffer (the same values as a fresh out)."""
    T, Hq, Hk, D = 5, 4, 2, 32
    q, k, v = randn((T, Hq, D), np.float32), randn((T, Hk, D), np.float32), randn((T, Hk, D), np.float32)
    pos, slots = random_positions(T), np.arange(T, dtype=np.int32)
    kp, vp = np.zeros((T, Hk, D), np.float32), np.zeros((T, Hk, D), np.float32)
    fresh = ropekv.rope_pool_fused(q, k, v, pos, slots, kp, vp, head_dim=D, num_qo_heads=Hq,
                                   num_kv_heads=Hk, rope_base=1e4)
    q2, k2 = q.copy(), k.copy()
    ropekv.rope_pool_fused(q2, k2, v, pos, slots, kp, vp, head_dim=D, num_qo_heads=Hq,
                           num_kv_heads=Hk, rope_base=1e4, q_out=q2, k_out=k2)
    assert bits(q2) == bits(fresh[0]) and bits(k2) == bits(fresh[1])


def test_nan_and_inf_stay_in_their_token():
    T, Hq, Hk, D = 6, 2, 1, 16
    q, k, v = randn((T, Hq, D), np.float32), randn((T, Hk, D), np.float32), randn((T, Hk, D), np.float32)
    q[2, 1, 3] = np.nan
    k[4, 0, 0] = np.inf
    pos, slots = random_positions(T), np.arange(T, dtype=np.int32)
    kp, vp = np.zeros((T, Hk, D), np.float32), np.zeros((T, Hk, D), np.float32)
    q_rot, k_rot, _, _ = ropekv.rope_pool_fused(q, k, v, pos, slots, kp, vp, head_dim=D,
                                                num_qo_heads=Hq, num_kv_heads=Hk, rope_base=1e4)
    bad_q = ~np.isfinite(q_rot)
    assert bad_q[2, 1].any() and not np.delete(bad_q.reshape(T * Hq, D), 2 * Hq + 1, 0).any()
    bad_k = ~np.isfinite(kp)
    assert bad_k[4, 0].any() and bad_k.sum() == (~np.isfinite(k_rot)).sum()
    assert np.isfinite(np.delete(kp, 4, 0)).all()


def test_f16_near_max_does_not_overflow():
    """|x| near 65504: the rotation's fp32 intermediates cannot overflow."""
    T, Hq, Hk, D = 4, 2, 1, 8
    q = np.full((T, Hq, D), 60000.0, np.float16)
    q[..., D // 2 :] = -60000.0
    k = q[:, :1].copy()
    pos = np.array([1, 2, 3, 4], np.int32)
    kp = np.zeros((T, Hk, D), np.float16)
    q_rot, _, _, _ = ropekv.rope_pool_fused(q, k, k, pos, np.arange(T, dtype=np.int32), kp,
                                            kp.copy(), head_dim=D, num_qo_heads=Hq,
                                            num_kv_heads=Hk, rope_base=1e4)
    ref, mag = rope(q, pos, 1e4)
    finite = np.abs(ref) <= 65504  # beyond that f16 rounds to inf, as it must
    assert_close(q_rot[finite], ref[finite], mag[finite], "q_rot near f16 max")


def test_default_outputs_are_new_arrays():
    T, Hq, Hk, D = 3, 2, 1, 8
    q, k = randn((T, Hq, D), np.float32), randn((T, Hk, D), np.float32)
    kp = np.zeros((4, Hk, D), np.float32)
    q_rot, k_rot, _, _ = ropekv.rope_pool_fused(q, k, k, np.arange(T), np.arange(T), kp,
                                                kp.copy(), head_dim=D, num_qo_heads=Hq,
                                                num_kv_heads=Hk, rope_base=1e4)
    assert isinstance(q_rot, np.ndarray) and q_rot.dtype == q.dtype
    assert not np.shares_memory(q_rot, q) and not np.shares_memory(k_rot, k)


PARTIAL = [  # SPEC section 6: (name, Hq, Hk, D, rotary_dim, base)
    ("Phi-2", 32, 32, 80, 32, 10000.0),
    ("GPT-NeoX-20B", 64, 64, 96, 24, 10000.0),
    ("odd-tail", 3, 1, 34, 10, 500000.0),
]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("model", PARTIAL, ids=[m[0] for m in PARTIAL])
def test_partial_rotary(model, dtype):
    """The first R dims rotate with base ** (-2i / R); R..D-1 are copied."""
    _, Hq, Hk, D, R, base = model
    dt = DTYPES[dtype]
    T, P = 19, 40
    q, k, v = randn((T, Hq, D), dt), randn((T, Hk, D), dt), randn((T, Hk, D), dt)
    pos, slots = random_positions(T), RNG.permutation(P)[:T].astype(np.int32)
    kp, vp = randn((P, Hk, D), dt), randn((P, Hk, D), dt)
    q_out, k_out = poison(q.shape, dt), poison(k.shape, dt)
    ropekv.rope_pool_fused(q, k, v, pos, slots, kp, vp, head_dim=D, num_qo_heads=Hq,
                           num_kv_heads=Hk, rope_base=base, rotary_dim=R, q_out=q_out,
                           k_out=k_out)
    q_ref, q_mag = rope(q, pos, base, rotary_dim=R)
    k_ref, k_mag = rope(k, pos, base, rotary_dim=R)
    assert_close(q_out, q_ref, q_mag, "q_rot")
    assert_close(k_out, k_ref, k_mag, "k_rot")
    assert bits(q_out[..., R:]) == bits(q[..., R:]), "the tail must be copied bit for bit"
    assert bits(kp[slots]) == bits(k_out) and bits(vp[slots]) == bits(v)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_positions_past_2_to_the_24(dtype):
    """SPEC section 2 takes fp32(pos): past 2^24 a position rounds to a
    multiple of 2 (4 past 2^25, ...) before it multiplies. The reference's
    angles, and, without the reference, the bits of the position it rounds to."""
    dt = DTYPES[dtype]
    big = np.array([(1 << 24) + 1, (1 << 25) + 3, -((1 << 24) + 1), (1 << 31) - 1,
                    (1 << 40) + 7], np.int64)
    rounded = big.astype(np.float32).astype(np.int64)
    assert (rounded != big).all()
    T, Hq, Hk, D = len(big), 4, 2, 64
    q, k, v = randn((T, Hq, D), dt), randn((T, Hk, D), dt), randn((T, Hk, D), dt)
    got = run_and_check(T, Hq, Hk, D, 500000.0, dt, idx=np.int64, positions=big, q=q, k=k, v=v)
    same = run_and_check(T, Hq, Hk, D, 500000.0, dt, idx=np.int64, positions=rounded, q=q, k=k,
                         v=v)
    assert bits(got[0]) == bits(same[0]) and bits(got[1]) == bits(same[1])


def test_rotary_dim_equal_to_head_dim_is_the_default():
    T, H, D = 5, 4, 64
    q = randn((T, H, D), np.float32)
    pos = random_positions(T)
    kp = np.zeros((T, H, D), np.float32)
    a = ropekv.rope_pool_fused(q, q, q, pos, np.arange(T), kp, kp.copy(), head_dim=D,
                               num_qo_heads=H, num_kv_heads=H, rope_base=1e4)
    b = ropekv.rope_pool_fused(q, q, q, pos, np.arange(T), kp, kp.copy(), head_dim=D,
                               num_qo_heads=H, num_kv_heads=H, rope_base=1e4, rotary_dim=D)
    assert bits(a[0]) == bits(b[0])
