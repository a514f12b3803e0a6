"""The float64 reference reproduces the golden vectors, and ropekv matches both."""

from __future__ import annotations

import numpy as np
import pytest

import ropekv
from reference import DTYPES, assert_close, load_golden, poison, rope, tolerance, ulp

CASES = load_golden()


def test_golden_has_the_cases_the_spec_names():
    assert len(CASES) == 55
    assert {c["head_dim"] for c in CASES} >= {8, 128, 256}
    assert max(c["position"] for c in CASES) == 2**24 - 1


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"D{c['head_dim']}-p{c['position']}")
def test_reference_reproduces_golden(case):
    x = np.array(case["x"], np.float64)[None, None, :]
    ref, _ = rope(x, np.array([case["position"]]), case["rope_base"])
    np.testing.assert_allclose(ref[0, 0], case["expected"], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_ropekv_on_golden(dtype):
    """Every golden vector through the op, as a q head and as a k head."""
    dt = DTYPES[dtype]
    for c in CASES:
        D = c["head_dim"]
        x = np.array(c["x"], np.float32).astype(dt).reshape(1, 1, D)
        pos = np.array([c["position"]], np.int64)
        kp = poison((2, 1, D), dt)
        q_rot, k_rot, _, _ = ropekv.rope_pool_fused(
            x, x, x, pos, np.array([1]), kp, kp.copy(), head_dim=D, num_qo_heads=1,
            num_kv_heads=1, rope_base=c["rope_base"], q_out=poison((1, 1, D), dt),
            k_out=poison((1, 1, D), dt))
        # x was rounded to dt first: the reference of the rounded input.
        ref, mag = rope(x, pos, c["rope_base"])
        if dt == np.float32:
            np.testing.assert_allclose(ref[0, 0], c["expected"], rtol=0, atol=1e-12)
        assert_close(q_rot, ref, mag, f"golden D={D} pos={c['position']}")
        assert_close(kp[1:], ref, mag, "pool row")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_assert_close_fails_what_it_must(dtype):
    """The checker itself: a poisoned (unwritten) element, a NaN, an Inf and
    an error just over the tolerance fail; an error within it passes."""
    dt = DTYPES[dtype]
    rng = np.random.default_rng()
    ref = rng.standard_normal(64).astype(np.float32).astype(dt).astype(np.float64)
    mag = np.abs(ref) + 1.0
    good = ref.astype(dt)
    assert_close(good, ref, mag, "exact")
    tol = tolerance(np.dtype(dt), ref, mag)
    for bad, what in ((poison(64, dt), "poison"), (np.where(np.arange(64) == 7, np.nan, good),
                                                    "one NaN"),
                      (np.where(np.arange(64) == 9, np.inf, good), "one Inf")):
        with pytest.raises(AssertionError):
            assert_close(np.asarray(bad).astype(dt), ref, mag, what)
    # One ulp of the dtype off passes (the rounding the tolerance allows);
    # the first value of the dtype past the tolerance fails.
    u = ulp(np.dtype(dt), ref)
    within = ref.copy()
    within[5] += u[5]
    assert_close(within.astype(dt), ref, mag, "one ulp")
    over = ref.copy()
    k = 1.0
    while abs(float(np.asarray(ref[5] + k * tol[5]).astype(dt)) - ref[5]) <= tol[5]:
        k += 0.25
    over[5] += k * tol[5]
    with pytest.raises(AssertionError):
        assert_close(over.astype(dt), ref, mag, "over")
