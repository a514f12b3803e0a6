"""The CUDA backend against the float64 reference and against the CPU backend.

Runs on a machine with an NVIDIA GPU, PyTorch with CUDA, and a ropekv built
with nvcc (scripts/gpu-check.sh does all three); skipped elsewhere. The
reference, its tolerance (one rounding of the output dtype plus the bound of
the fp32 arithmetic) and the model configs are those of the CPU suite,
tests/python/reference.py, which the golden vectors check.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import ropekv  # noqa: E402

# ROPEKV_TEST_DEVICE=cpu runs the device-agnostic tests on the CPU backend:
# a check of the tests themselves on a machine without a GPU.
DEV = os.environ.get("ROPEKV_TEST_DEVICE", "cuda")
if DEV == "cuda" and (not torch.cuda.is_available() or not ropekv.has_cuda()):
    pytest.skip("needs a CUDA GPU and a ropekv built with CUDA", allow_module_level=True)
cuda_only = pytest.mark.skipif(DEV != "cuda", reason="CUDA-specific behaviour")


# ---------------------------------------------------------------- reference

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import reference  # noqa: E402  (tests/python/reference.py)
from torch_readers import torch_reader  # noqa: E402,F401  (a fixture: both ways of reading tensors)

ref_rope = reference.rope
MODELS = reference.MODELS
NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16,
                torch.bfloat16: reference.BF16}


def f64(t) -> np.ndarray:
    return t.detach().float().cpu().numpy().astype(np.float64)


def as_numpy(t) -> np.ndarray:
    """The tensor's values in numpy, in the same dtype (bf16 via ml_dtypes)."""
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(reference.BF16)
    return t.numpy()


def assert_close(got, ref: np.ndarray, mag: np.ndarray, what: str) -> None:
    reference.assert_close(as_numpy(got), ref, mag, what)


def bits(t):
    """The tensor's raw bits (NaN-safe bitwise comparison)."""
    t = t.contiguous()
    return t.view(torch.int32) if t.element_size() == 4 else t.view(torch.int16)


def same_bits(a, b) -> bool:
    return torch.equal(bits(a), bits(b))


# ---------------------------------------------------------------- helpers

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

def make(T, Hq, Hk, D, P, dtype, idx=torch.int32, seed=0, device=DEV, skip_every=5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, Hq, D, generator=g).to(dtype).to(device)
    k = torch.randn(T, Hk, D, generator=g).to(dtype).to(device)
    v = torch.randn(T, Hk, D, generator=g).to(dtype).to(device)
    pos = torch.randint(0, 1 << 24, (T,), generator=g).to(idx).to(device)
    slots = torch.randperm(P, generator=g)[:T]
    if skip_every:
        slots[skip_every - 1 :: skip_every] = -1
    slots = slots.to(idx).to(device)
    k_pool = torch.randn(P, Hk, D, generator=g).to(dtype).to(device)
    v_pool = torch.randn(P, Hk, D, generator=g).to(dtype).to(device)
    return q, k, v, pos, slots, k_pool, v_pool


def call(q, k, v, pos, slots, k_pool, v_pool, base, **kw):
    return ropekv.rope_pool_fused(q, k, v, pos, slots, k_pool, v_pool, head_dim=q.shape[-1],
                                  num_qo_heads=q.shape[1], num_kv_heads=k.shape[1],
                                  rope_base=base, **kw)


def poisoned(x):
    return torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)


def check_pools(slots, k_rot, v, k_pool, v_pool, k0, v0):
    """Named rows == k_rot / v bit for bit; every other row untouched."""
    s = slots.long().cpu()
    P = k_pool.shape[0]
    named = s[(s >= 0) & (s < P)]
    tok = torch.nonzero((s >= 0) & (s < P)).flatten()
    assert same_bits(k_pool[named.to(k_pool.device)], k_rot[tok.to(k_rot.device)])
    assert same_bits(v_pool[named.to(v_pool.device)], v[tok.to(v.device)])
    rest = torch.ones(P, dtype=torch.bool)
    rest[named] = False
    rest = rest.to(k_pool.device)
    assert same_bits(k_pool[rest], k0[rest]), "a pool row no token names was written"
    assert same_bits(v_pool[rest], v0[rest]), "a pool row no token names was written"


def run_and_check(q, k, v, pos, slots, k_pool, v_pool, base):
    k0, v0 = k_pool.clone(), v_pool.clone()
    q_out, k_out = poisoned(q), poisoned(k)
    q_rot, k_rot, kp, vp = call(q, k, v, pos, slots, k_pool, v_pool, base, q_out=q_out,
                                k_out=k_out)
    if DEV == "cuda":
        torch.cuda.synchronize()
    assert q_rot is q_out and k_rot is k_out and kp is k_pool and vp is v_pool
    p = pos.cpu().numpy()
    ref, mag = ref_rope(f64(q), p, base)
    assert_close(q_rot, ref, mag, "q_rot")
    ref, mag = ref_rope(f64(k), p, base)
    assert_close(k_rot, ref, mag, "k_rot")
    check_pools(slots, k_rot, v, k_pool, v_pool, k0, v0)
    return q_rot, k_rot


@pytest.fixture(autouse=True)
def checked():
    ropekv.set_checked(True)
    yield
    ropekv.set_checked(True)


# ---------------------------------------------------------------- math


@pytest.mark.parametrize("T", [1, 19, 130])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("model", MODELS, ids=[m[0] for m in MODELS])
def test_models_match_reference(model, dtype, T):
    _, Hq, Hk, D, base = model
    run_and_check(*make(T, Hq, Hk, D, 3 * T + 5, DTYPES[dtype], seed=T), base)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("D", [2, 8, 12, 34, 80, 512, 600])
def test_head_dims(D, dtype):
    # 34: half = 17, only narrow vectors; 600: past the inv_freq table of 256.
    run_and_check(*make(7, 3, 2, D, 30, DTYPES[dtype], seed=D), 10000.0)


@pytest.mark.parametrize("idx", [torch.int32, torch.int64])
def test_index_types_and_extreme_positions(idx):
    T, Hq, Hk, D = 12, 4, 2, 128
    q, k, v, pos, slots, kp, vp = make(T, Hq, Hk, D, 64, torch.float32, idx=idx)
    big = [0, 1, -1, -(1 << 20), (1 << 24) - 1, 1 << 24, 123456789, (1 << 31) - 1,
           -(1 << 31), 1 << 28, 3 << 29, 987654321]
    if idx == torch.int64:
        big[-3:] = [1 << 40, -(1 << 45), (1 << 62) + 12345]
    pos = torch.tensor(big, dtype=idx, device=DEV)
    run_and_check(q, k, v, pos, slots, kp, vp, 500000.0)
    # rope_base 1: every inv_freq is 1, so theta = fp32(pos), past the
    # Cody-Waite range (the in-kernel Payne-Hanek reduction).
    run_and_check(q, k, v, pos, slots, kp, vp, 1.0)


@cuda_only
@pytest.mark.parametrize("T", [3000, 9001])
@pytest.mark.parametrize("cfg", [("Llama-3.1-8B", 32, 8, 128, torch.bfloat16),
                                 ("Phi-3-mini-4k", 32, 32, 96, torch.float16),
                                 ("Qwen2.5-7B", 28, 4, 128, torch.float32)],
                         ids=lambda c: c[0])
def test_gpu_equals_cpu_large(cfg, T):
    """Many tokens (other group splits than decode sizes): GPU == CPU backend
    within one rounding of the dtype, on the same inputs."""
    _, Hq, Hk, D, dtype = cfg
    P = T + 1000
    args = make(T, Hq, Hk, D, P, dtype, seed=T)
    cpu = [a.cpu() for a in args]
    k0, v0 = args[5].clone(), args[6].clone()
    gq, gk, gkp, gvp = call(*args, 500000.0)
    cq, ck, ckp, cvp = call(*cpu, 500000.0)
    torch.cuda.synchronize()
    for g, c, x, what in ((gq, cq, cpu[0], "q_rot"), (gk, ck, cpu[1], "k_rot")):
        ref = f64(c)
        # |x1 c| + |x2 s| <= |out| + max|x|: the fp32 arithmetic bound.
        mag = np.abs(ref) + np.max(np.abs(f64(x)), axis=-1, keepdims=True)
        assert_close(g, ref, mag, what + " GPU vs CPU")
    check_pools(args[4], gk, args[2], gkp, gvp, k0, v0)


@cuda_only
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_equals_cpu_models(dtype):
    for name, Hq, Hk, D, base in MODELS:
        args = make(33, Hq, Hk, D, 100, DTYPES[dtype], seed=Hq + D)
        cpu = [a.cpu() for a in args]
        k0, v0 = cpu[5].clone(), cpu[6].clone()
        gq, gk, gkp, gvp = call(*args, base)
        cq, ck, ckp, cvp = call(*cpu, base)
        for g, c, x, what in ((gq, cq, cpu[0], "q_rot"), (gk, ck, cpu[1], "k_rot")):
            ref = f64(c)
            mag = np.abs(ref) + np.max(np.abs(f64(x)), axis=-1, keepdims=True)
            assert_close(g, ref, mag, f"{name} {what} GPU vs CPU")
        check_pools(cpu[4], gk.cpu(), cpu[2], gkp.cpu(), gvp.cpu(), k0, v0)
        check_pools(cpu[4], ck, cpu[2], ckp, cvp, k0, v0)


# ---------------------------------------------------------------- layouts


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fused_qkv_views(dtype):
    """q/k/v as views of one [T, (Hq + 2Hk) * D] projection output."""
    T, Hq, Hk, D, P = 37, 32, 8, 128, 200
    dt = DTYPES[dtype]
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, device=DEV).to(dt)
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
    v = qkv[:, (Hq + Hk) * D :].view(T, Hk, D)
    _, _, _, pos, slots, kp, vp = make(T, Hq, Hk, D, P, dt)
    run_and_check(q, k, v, pos, slots, kp, vp, 500000.0)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_misaligned_and_strided(dtype):
    dt = DTYPES[dtype]
    T, Hq, Hk, D, P = 11, 6, 2, 64, 50
    _, _, _, pos, slots, kp, vp = make(T, Hq, Hk, D, P, dt)
    # Misaligned base (one element in): only narrow vectors are legal.
    buf = torch.randn(T * Hq * D + 1, device=DEV).to(dt)
    q = buf[1:].view(T, Hq, D)
    kbuf = torch.randn(T * Hk * D + 1, device=DEV).to(dt)
    k = kbuf[1:].view(T, Hk, D)
    v = torch.randn(T, Hk, D, device=DEV).to(dt)
    run_and_check(q, k, v, pos, slots, kp, vp, 10000.0)
    # Non-contiguous last dimension: the strided kernel.
    q2 = torch.randn(T, Hq, 2 * D, device=DEV).to(dt)[..., ::2]
    k2 = torch.randn(T, Hk, 2 * D, device=DEV).to(dt)[..., ::2]
    v2 = torch.randn(T, Hk, D, 2, device=DEV).to(dt)[..., 0]
    run_and_check(q2, k2, v2, pos, slots, kp, vp, 10000.0)
    # Heads-major input (a transposed view) and a layer-stacked pool.
    q3 = torch.randn(Hq, T, D, device=DEV).to(dt).transpose(0, 1)
    layers = torch.randn(3, P, Hk, D, device=DEV).to(dt)
    vlayers = torch.randn(3, P, Hk, D, device=DEV).to(dt)
    run_and_check(q3, k, v, pos, slots, layers[1], vlayers[2], 10000.0)
    assert not torch.isnan(layers).any()


def test_negative_slots_write_nothing():
    q, k, v, pos, slots, kp, vp = make(16, 8, 2, 128, 40, torch.bfloat16)
    slots.fill_(-1)
    slots[3] = -(1 << 30)
    run_and_check(q, k, v, pos, slots, kp, vp, 10000.0)


def test_zero_tokens():
    q, k, v, pos, slots, kp, vp = make(0, 8, 2, 64, 10, torch.float16)
    k0 = kp.clone()
    q_rot, k_rot, _, _ = call(q, k, v, pos, slots, kp, vp, 1e4)
    assert q_rot.shape == (0, 8, 64) and k_rot.shape == (0, 2, 64)
    assert same_bits(kp, k0)


# ---------------------------------------------------------------- slots out of range


@cuda_only
def test_out_of_range_slot_checked_raises_and_writes_nothing_outside():
    T, Hq, Hk, D, P = 8, 8, 2, 128, 100
    q, k, v, pos, slots, _, _ = make(T, Hq, Hk, D, P, torch.bfloat16, skip_every=0)
    # The pools are views of the first P rows of larger buffers: the rows
    # after them, where slot P + 5 would land, must stay as they were.
    kbuf = torch.randn(P + 20, Hk, D, device=DEV).to(torch.bfloat16)
    vbuf = torch.randn(P + 20, Hk, D, device=DEV).to(torch.bfloat16)
    kb0, vb0 = kbuf.clone(), vbuf.clone()
    kp, vp = kbuf[:P], vbuf[:P]
    slots[3] = P + 5
    k_out = poisoned(k)
    with pytest.raises(ValueError, match=rf"^slots\[3\] = {P + 5} is out of range for a pool "
                                         rf"of {P} rows \(k_pool.shape\[0\]\)"):
        call(q, k, v, pos, slots, kp, vp, 1e4, k_out=k_out)
    assert same_bits(kbuf[P:], kb0[P:]) and same_bits(vbuf[P:], vb0[P:])
    ok = torch.ones(T, dtype=torch.bool)
    ok[3] = False
    s = slots.long().cpu()
    # The other tokens were written (the kernel skips only the bad one).
    assert same_bits(kbuf[s[ok].to(DEV)], k_out[ok.to(DEV)])
    assert same_bits(vbuf[s[ok].to(DEV)], v[ok.to(DEV)])
    untouched = torch.ones(P + 20, dtype=torch.bool)
    untouched[s[ok]] = False
    assert same_bits(kbuf[untouched.to(DEV)], kb0[untouched.to(DEV)])
    assert same_bits(vbuf[untouched.to(DEV)], vb0[untouched.to(DEV)])
    # The flag was cleared by the raise: a good call afterwards passes.
    slots[3] = -1
    run_and_check(q, k, v, pos, slots, kp, vp, 1e4)


@cuda_only
def test_out_of_range_only_token_leaves_pool_unchanged():
    q, k, v, pos, slots, kp, vp = make(1, 32, 8, 128, 10, torch.float16, idx=torch.int64,
                                       skip_every=0)
    k0, v0 = kp.clone(), vp.clone()
    slots[0] = 1 << 40
    with pytest.raises(ValueError, match=r"^slots\[0\] = 1099511627776 is out of range for a "
                                         r"pool of 10 rows"):
        call(q, k, v, pos, slots, kp, vp, 1e4)
    assert same_bits(kp, k0) and same_bits(vp, v0)


@cuda_only
def test_out_of_range_unchecked_is_reported_by_the_next_checked_call():
    ropekv.set_checked(False)
    q, k, v, pos, slots, kp, vp = make(6, 4, 2, 64, 20, torch.float32, skip_every=0)
    k0 = kp.clone()
    slots[4] = 20
    slots[2] = 25
    call(q, k, v, pos, slots, kp, vp, 1e4)  # no raise: no sync in unchecked mode
    torch.cuda.synchronize()
    s = slots.long().cpu()
    good = s[(s >= 0) & (s < 20)]
    rest = torch.ones(20, dtype=torch.bool)
    rest[good] = False
    assert same_bits(kp[rest.to(DEV)], k0[rest.to(DEV)])
    # The device flag holds the skipped tokens until a check reads it: the
    # next checked call (here a valid one) raises them, then it is clear.
    ropekv.set_checked(True)
    q2, k2, v2, pos2, slots2, kp2, vp2 = make(2, 4, 2, 64, 8, torch.float32)
    with pytest.raises(ValueError, match=r"^slots\[2\] = 25 is out of range for a pool of 20 "
                                         r"rows.* 2 token"):
        call(q2, k2, v2, pos2, slots2, kp2, vp2, 1e4)
    call(q2, k2, v2, pos2, slots2, kp2, vp2, 1e4)


# ---------------------------------------------------------------- 64-bit pool


@cuda_only
def test_pool_over_2_31_elements():
    """2.2M slots x 8 heads x 128 bf16 = 4.5 GB per pool (> 2^31 elements)."""
    P, Hk, D, Hq = 2_200_000, 8, 128, 32
    assert P * Hk * D > 2**31
    free, _ = torch.cuda.mem_get_info()
    if free < 12 * 2**30:
        pytest.skip("needs 12 GB of free GPU memory")
    kp = torch.empty(P, Hk, D, dtype=torch.bfloat16, device=DEV)
    vp = torch.empty(P, Hk, D, dtype=torch.bfloat16, device=DEV)
    watch = torch.tensor([P - 1, P - 2, P - 3, P - 4, 2**31 // (Hk * D) + 1,
                          2**31 // (Hk * D), 0, 1], device=DEV)
    kp[watch] = torch.randn(len(watch), Hk, D, device=DEV).to(torch.bfloat16)
    vp[watch] = torch.randn(len(watch), Hk, D, device=DEV).to(torch.bfloat16)
    k0, v0 = kp[watch].clone(), vp[watch].clone()
    T = 4
    q, k, v, pos, _, _, _ = make(T, Hq, Hk, D, 8, torch.bfloat16, skip_every=0)
    slots = torch.tensor([P - 1, P - 3, 2**31 // (Hk * D) + 1, 0], dtype=torch.int64,
                         device=DEV)
    q_rot, k_rot, _, _ = call(q, k, v, pos, slots, kp, vp, 500000.0)
    torch.cuda.synchronize()
    ref, mag = ref_rope(f64(k), pos.cpu().numpy(), 500000.0)
    assert_close(k_rot, ref, mag, "k_rot")
    written = {0: 0, 2: 1, 4: 2, 6: 3}  # index in watch -> token
    for w in range(len(watch)):
        if w in written:
            assert same_bits(kp[watch[w]], k_rot[written[w]])
            assert same_bits(vp[watch[w]], v[written[w]])
        else:
            assert same_bits(kp[watch[w]], k0[w]) and same_bits(vp[watch[w]], v0[w])
    del kp, vp
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- streams and graphs


@cuda_only
def test_graph_capture_and_replay_with_new_positions_and_slots():
    T, Hq, Hk, D, P = 24, 32, 8, 128, 4096
    dt = torch.bfloat16
    q, k, v, pos, slots, kp, vp = make(T, Hq, Hk, D, P, dt, skip_every=0)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    # Warm up on a side stream, then capture (torch.cuda.graph's protocol).
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call(q, k, v, pos, slots, kp, vp, 500000.0, q_out=q_out, k_out=k_out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call(q, k, v, pos, slots, kp, vp, 500000.0, q_out=q_out, k_out=k_out)
    gen = torch.Generator().manual_seed(5)
    for rep in range(3):
        k0, v0 = kp.clone(), vp.clone()
        q.copy_(torch.randn(q.shape, generator=gen).to(dt))
        k.copy_(torch.randn(k.shape, generator=gen).to(dt))
        v.copy_(torch.randn(v.shape, generator=gen).to(dt))
        new_pos = torch.randint(0, 1 << 22, (T,), generator=gen).to(torch.int32)
        new_slots = torch.randperm(P, generator=gen)[:T].to(torch.int32)
        new_slots[rep] = -1
        pos.copy_(new_pos)
        slots.copy_(new_slots)
        g.replay()
        torch.cuda.synchronize()
        ref, mag = ref_rope(f64(q), new_pos.numpy(), 500000.0)
        assert_close(q_out, ref, mag, f"q_rot replay {rep}")
        ref, mag = ref_rope(f64(k), new_pos.numpy(), 500000.0)
        assert_close(k_out, ref, mag, f"k_rot replay {rep}")
        check_pools(slots, k_out, v, kp, vp, k0, v0)


@cuda_only
def test_first_call_of_the_process_inside_a_capture():
    """The per-device error flag is made lazily; if the very first call is
    inside a graph capture, that must not break the capture."""
    code = textwrap.dedent("""
        import torch, ropekv
        ropekv.set_checked(True)
        T, H, D, P = 4, 2, 64, 16
        x = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float16)
        q, k, v = x(T, H, D), x(T, H, D), x(T, H, D)
        kp, vp = x(P, H, D), x(P, H, D)
        pos = torch.arange(T, device="cuda", dtype=torch.int32)
        slots = torch.arange(T, device="cuda", dtype=torch.int32) + 3
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            ropekv.rope_pool_fused(q, k, v, pos, slots, kp, vp, head_dim=D, num_qo_heads=H,
                                   num_kv_heads=H, rope_base=1e4, q_out=qo, k_out=ko)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(kp[3:7], ko) and torch.equal(vp[3:7], v)
        slots[1] = 99
        g.replay()
        try:  # the next checked call outside the capture reports it
            ropekv.rope_pool_fused(q, k, v, pos, torch.full_like(slots, -1), kp, vp,
                                   head_dim=D, num_qo_heads=H, num_kv_heads=H, rope_base=1e4,
                                   q_out=qo, k_out=ko)
        except ValueError as e:
            assert "slots[1] = 99" in str(e), e
        else:
            raise AssertionError("no error raised")
        print("OK")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ))
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


@cuda_only
def test_side_stream_and_explicit_stream():
    q, k, v, pos, slots, kp, vp = make(40, 16, 8, 256, 100, torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        k0, v0 = kp.clone(), vp.clone()
        q_rot, k_rot, _, _ = call(q, k, v, pos, slots, kp, vp, 1e4)
    s.synchronize()
    p = pos.cpu().numpy()
    ref, mag = ref_rope(f64(q), p, 1e4)
    assert_close(q_rot, ref, mag, "q_rot on a side stream")
    check_pools(slots, k_rot, v, kp, vp, k0, v0)
    s2 = torch.cuda.Stream()
    s2.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s2):
        q_out = poisoned(q)
    s2.synchronize()
    q_rot2, _, _, _ = call(q, k, v, pos, slots, kp, vp, 1e4, q_out=q_out, stream=s2)
    s2.synchronize()
    assert same_bits(q_rot2, q_rot)


@cuda_only
def test_cupy_arrays():
    cp = pytest.importorskip("cupy")
    for dt in (np.float16, np.float32):
        T, Hq, Hk, D, P = 9, 8, 4, 128, 40
        rng = np.random.default_rng(3)
        q = cp.asarray(rng.standard_normal((T, Hq, D)).astype(dt))
        k = cp.asarray(rng.standard_normal((T, Hk, D)).astype(dt))
        v = cp.asarray(rng.standard_normal((T, Hk, D)).astype(dt))
        pos = cp.asarray(rng.integers(0, 1 << 24, T).astype(np.int32))
        slots = cp.asarray(rng.permutation(P)[:T].astype(np.int64))
        kp = cp.asarray(rng.standard_normal((P, Hk, D)).astype(dt))
        vp = cp.asarray(rng.standard_normal((P, Hk, D)).astype(dt))
        q_rot, k_rot, kp2, vp2 = ropekv.rope_pool_fused(
            q, k, v, pos, slots, kp, vp, head_dim=D, num_qo_heads=Hq, num_kv_heads=Hk,
            rope_base=1e6)
        assert isinstance(q_rot, cp.ndarray) and kp2 is kp
        cp.cuda.get_current_stream().synchronize()
        ref, mag = ref_rope(cp.asnumpy(q).astype(np.float64), cp.asnumpy(pos), 1e6)
        got = torch.from_numpy(cp.asnumpy(q_rot))
        assert_close(got, ref, mag, f"cupy {np.dtype(dt).name} q_rot")
        assert (cp.asnumpy(kp)[cp.asnumpy(slots)] == cp.asnumpy(k_rot)).all()
        assert (cp.asnumpy(vp)[cp.asnumpy(slots)] == cp.asnumpy(v)).all()


@cuda_only
@pytest.mark.parametrize("name,offset", [("q", 1), ("slots", 4), ("k_pool", 3)])
def test_cupy_unaligned_array_raises_and_writes_nothing(name, offset):
    """A CuPy array whose first element's address is not a multiple of its
    element size (memptr shifted by bytes): refused on the host before the
    launch, which would fault on a misaligned load; the pools are unchanged."""
    cp = pytest.importorskip("cupy")
    T, Hq, Hk, D, P = 5, 4, 2, 64, 16
    rng = np.random.default_rng(11)
    arrays = {
        "q": rng.standard_normal((T, Hq, D)).astype(np.float16),
        "k": rng.standard_normal((T, Hk, D)).astype(np.float16),
        "v": rng.standard_normal((T, Hk, D)).astype(np.float16),
        "positions": rng.integers(0, 4096, T).astype(np.int64),
        "slots": rng.permutation(P)[:T].astype(np.int64),
        "k_pool": rng.standard_normal((P, Hk, D)).astype(np.float16),
        "v_pool": rng.standard_normal((P, Hk, D)).astype(np.float16),
    }
    dev = {n: cp.asarray(a) for n, a in arrays.items()}
    a = arrays[name]
    buf = cp.cuda.alloc(a.nbytes + 16)
    shifted = cp.ndarray(a.shape, a.dtype, memptr=buf + offset)
    shifted.set(a)
    dev[name] = shifted
    with pytest.raises(ValueError, match=re.escape(
            f"{name} starts at an address that is not a multiple of its "
            f"{a.dtype.itemsize}-byte elements")):
        ropekv.rope_pool_fused(*dev.values(), head_dim=D, num_qo_heads=Hq,
                               num_kv_heads=Hk, rope_base=1e4)
    cp.cuda.Device().synchronize()
    assert (dev["k_pool"].get() == arrays["k_pool"]).all()
    assert (dev["v_pool"].get() == arrays["v_pool"]).all()


@cuda_only
def test_mixed_devices_raise_value_error():
    q, k, v, pos, slots, kp, vp = make(4, 4, 2, 64, 10, torch.float16)
    k0 = kp.clone()
    with pytest.raises(ValueError, match=r"^all arrays must be on one device"):
        call(q, k.cpu(), v, pos, slots, kp, vp, 1e4)
    with pytest.raises(ValueError, match=r"^all arrays must be on one device"):
        call(q, k, v, pos.cpu(), slots, kp, vp, 1e4)
    with pytest.raises(ValueError, match=r"^all arrays must be on one device"):
        call(q.cpu(), k.cpu(), v.cpu(), pos.cpu(), slots.cpu(), kp, vp.cpu(), 1e4)
    assert same_bits(kp, k0)
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match=r"^all arrays must be on one device"):
            call(q, k, v, pos, slots, kp.to("cuda:1"), vp, 1e4)


@cuda_only
def test_arrays_sharing_memory_raise_on_the_gpu():
    """The memory rules hold for CUDA arrays (checked on the host, before the
    launch): pools over one another, an output over an input, a shifted
    alias; views of one buffer that share no element run, in place on a
    fused QKV buffer with the pools interleaved in one cache."""
    T, Hq, Hk, D, P = 6, 4, 2, 64, 16
    q, k, v, pos, slots, kp, vp = make(T, Hq, Hk, D, P, torch.bfloat16)
    k0, v0 = kp.clone(), vp.clone()
    with pytest.raises(ValueError, match=r"^k_pool overlaps v_pool in memory"):
        call(q, k, v, pos, slots, kp, kp[:], 1e4)
    with pytest.raises(ValueError, match=r"^k_out overlaps v in memory"):
        call(q, k, v, pos, slots, kp, vp, 1e4, k_out=v)
    buf = torch.randn(T * Hq * D + 1, device=DEV).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"^q_out overlaps q in memory"):
        call(buf[:-1].view(T, Hq, D), k, v, pos, slots, kp, vp, 1e4,
             q_out=buf[1:].view(T, Hq, D))
    assert same_bits(kp, k0) and same_bits(vp, v0)
    want = call(q.clone(), k.clone(), v, pos, slots, kp.clone(), vp.clone(), 1e4)
    qkv = torch.cat([q, k, v], dim=1)
    kv = torch.stack([kp, vp], dim=1)
    got = call(qkv[:, :Hq], qkv[:, Hq:Hq + Hk], qkv[:, Hq + Hk:], pos, slots, kv[:, 0], kv[:, 1],
               1e4, inplace=True)
    torch.cuda.synchronize()
    for w, g in zip(want, got):
        assert same_bits(w, g)


# ---------------------------------------------------------------- the fast path

def fused_views(T, Hq, Hk, D, P, dtype, seed):
    """q/k/v as views of one fused QKV output, int64 positions every other
    element, slots at an offset, pools with a two-row stride: the layouts
    an engine passes, all on the GPU."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, Hq + 2 * Hk, D, generator=g).to(dtype).to(DEV)
    q, k, v = qkv[:, :Hq], qkv[:, Hq:Hq + Hk], qkv[:, Hq + Hk:]
    pos = torch.randint(0, 1 << 24, (2 * T,), generator=g).to(DEV)[::2]
    slots = torch.cat([torch.zeros(3, dtype=torch.int32),
                       torch.randperm(P, generator=g)[:T].int()]).to(DEV)[3:]
    pools = [torch.randn(2 * P, Hk, D, generator=g).to(dtype).to(DEV)[::2] for _ in range(2)]
    return q, k, v, pos, slots, pools[0], pools[1]


FAST_OPTIONS = {
    "plain": {},
    "is_neox=False": {"is_neox": False},
    "llama3": {"rope_scaling": reference.LLAMA3},
    "cos_sin_cache": {"cos_sin_cache": "table"},
    "qk-norm": {"q_norm_weight": "w", "k_norm_weight": "w", "norm_eps": 1e-5},
    # transformers 5's rope_parameters: rotary_dim from partial_rotary_factor
    "rope-parameters-partial": {"rope_scaling": {"rope_type": "default", "rope_theta": 5e5,
                                                 "partial_rotary_factor": 0.25}},
}


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def general_path():
    """The keyword that sends a call down the general path: an explicit
    stream (the current one; CPU arrays ignore it)."""
    return {"stream": torch.cuda.current_stream() if DEV == "cuda" else 0}


@pytest.mark.usefixtures("torch_reader")
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("opts", list(FAST_OPTIONS))
@pytest.mark.parametrize("T", [1, 37])
def test_fast_path_equals_general_path(dtype, opts, T):
    """A call on the current stream takes the binding's fast path (it reads
    the tensors in place); one with an explicit stream= takes the general
    path (DLPack). Both must write the same bits, on the reference."""
    call(*make(2, 2, 1, 8, 4, torch.float32), 1e4)  # the first torch call registers the path
    dt = DTYPES[dtype]
    Hq, Hk, D, P = 8, 2, 128, 64
    seed = int(np.random.default_rng().integers(1 << 62))
    kw = dict(FAST_OPTIONS[opts])
    g = torch.Generator().manual_seed(seed + 1)
    if "cos_sin_cache" in kw:
        kw["cos_sin_cache"] = torch.randn(1 << 12, D, generator=g).to(DEV)
    if "q_norm_weight" in kw:
        w = (torch.rand(D, generator=g) + 0.5).to(dt).to(DEV)
        kw["q_norm_weight"] = kw["k_norm_weight"] = w
    results = []
    for general in (False, True):
        q, k, v, pos, slots, kp, vp = fused_views(T, Hq, Hk, D, P, dt, seed)
        if "cos_sin_cache" in kw:
            pos = pos % (1 << 12)
        k0, v0 = kp.clone(), vp.clone()
        q_out, k_out = poisoned(q), poisoned(k)
        stream = general_path() if general else {}
        out = call(q, k, v, pos, slots, kp, vp, 5e5, q_out=q_out, k_out=k_out, **kw, **stream)
        sync()
        assert out[0] is q_out and out[1] is k_out and out[2] is kp and out[3] is vp
        check_pools(slots, k_out, v, kp, vp, k0, v0)
        results.append(out)
        if not general:
            # the fast path did take it: run_fast returns None where it declines
            scaling, theta, factor = ropekv._rope_parameters(kw.get("rope_scaling"))
            rotary_dim = ropekv._rotary_dim_for(theta, factor, 5e5, None, D)
            assert ropekv._ext.run_fast(
                q, k, v, pos, slots, kp, vp, None, None, D, Hq, Hk, 5e5, rotary_dim,
                kw.get("is_neox", True), scaling, 0, False, kw.get("cos_sin_cache"),
                kw.get("q_norm_weight"), kw.get("k_norm_weight"),
                kw.get("norm_eps", 1e-6)) is not None
    for got, want in zip(results[0], results[1]):
        assert same_bits(got, want), opts
    if opts == "plain":
        q, k, *_ = fused_views(T, Hq, Hk, D, P, dt, seed)
        p = fused_views(T, Hq, Hk, D, P, dt, seed)[3].cpu().numpy()
        for got, x in ((results[0][0], q), (results[0][1], k)):
            ref, mag = ref_rope(f64(x), p, 5e5)
            assert_close(got, ref, mag, f"fast path {dtype} T={T}")


@pytest.mark.usefixtures("torch_reader")
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "fp8_e4m3 as uint8", "float32"])
@pytest.mark.parametrize("T", [1, 37])
def test_fast_path_pool_formats_equal_general_path(fmt, T):
    """fp8 pools (typed, or raw uint8 bytes as vLLM keeps them) and float32
    pools: the fast path writes the general path's bytes and took the call."""
    call(*make(2, 2, 1, 8, 4, torch.float32), 1e4)  # the first torch call registers the path
    kind = fmt.split()[0]
    Hq, Hk, D, P = 8, 2, 128, 64
    seed = int(np.random.default_rng().integers(1 << 62))
    kw = {"kv_cache_dtype": kind}
    if kind != "float32":
        kw.update(k_scale=0.75, v_scale=2.0)
    results = []
    for general in (False, True):
        q, k, v, pos, slots, _, _ = fused_views(T, Hq, Hk, D, P, torch.bfloat16, seed)
        g = torch.Generator().manual_seed(seed + 2)
        if kind == "float32":
            pools = [torch.randn(P, Hk, D, generator=g).to(DEV) for _ in range(2)]
        else:
            pools = [torch.randint(0, 256, (P, Hk, D), generator=g, dtype=torch.uint8).to(DEV)
                     for _ in range(2)]
            if "uint8" not in fmt:
                fp8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kind]
                pools = [p.view(fp8) for p in pools]
        kp, vp = pools
        before = kp.clone()
        out = call(q, k, v, pos, slots, kp, vp, 5e5, **kw, **(general_path() if general else {}))
        sync()
        assert out[2] is kp and out[3] is vp
        results.append([x.view(torch.uint8) if x.element_size() == 1 else x for x in out])
        if not general:
            assert not same_bits(kp.view(torch.uint8) if kind != "float32" else kp,
                                 before.view(torch.uint8) if kind != "float32" else before)
            assert ropekv._ext.run_fast(
                q, k, v, pos, slots, kp, vp, None, None, D, Hq, Hk, 5e5, None, True, None, 0,
                False, kv_cache_dtype={"float32": 1, "fp8_e4m3": 2, "fp8_e5m2": 3}[kind],
                k_scale=kw.get("k_scale", 1.0), v_scale=kw.get("v_scale", 1.0)) is not None
    for got, want in zip(*results):
        assert torch.equal(got, want) if got.dtype == torch.uint8 else same_bits(got, want), fmt


@pytest.mark.usefixtures("torch_reader")
@cuda_only
def test_fast_path_made_outputs_and_side_stream():
    """Outputs made by the fast path are new contiguous CUDA tensors, and the
    call runs on the current (side) stream: the result is there after that
    stream, and only that stream, is synchronised."""
    q, k, v, pos, slots, kp, vp = make(33, 8, 2, 128, 64, torch.bfloat16, skip_every=0)
    call(q, k, v, pos, slots, kp.clone(), vp.clone(), 1e4)  # registers the fast path
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    q_before = q.clone()
    with torch.cuda.stream(s):
        # A long wait, then q doubled, on the side stream: a call launched on
        # any other stream would read q before it is doubled.
        torch.cuda._sleep(100_000_000)
        q.mul_(2.0)
        q_rot, k_rot, _, _ = call(q, k, v, pos, slots, kp, vp, 1e4)
    s.synchronize()
    assert q_rot.is_cuda and q_rot.is_contiguous() and q_rot.shape == q.shape
    assert torch.equal(q, q_before * 2)
    ref, mag = ref_rope(f64(q), pos.cpu().numpy(), 1e4)
    assert_close(q_rot, ref, mag, "q_rot made by the fast path on a side stream")


@pytest.mark.usefixtures("torch_reader")
@pytest.mark.parametrize("bad", ["positions on the other device", "dtype",
                                 "slot >= P checked", "rank", "odd head_dim"])
def test_fast_path_errors_are_the_general_paths(bad):
    msgs = []
    for general in (False, True):
        q, k, v, pos, slots, kp, vp = make(6, 4, 2, 64, 10, torch.float16, skip_every=0)
        kw = general_path() if general else {}
        if bad == "positions on the other device":
            if DEV != "cuda":
                pytest.skip("one device")
            pos = pos.cpu()
        elif bad == "dtype":
            v = v.float()
        elif bad == "slot >= P checked":
            slots[2] = 10
        elif bad == "rank":
            q = q[0]
        k0, v0 = kp.clone(), vp.clone()
        ropekv.set_checked(bad == "slot >= P checked")
        try:
            with pytest.raises(ValueError) as e:
                ropekv.rope_pool_fused(q, k, v, pos, slots, kp, vp, head_dim=63 if
                                       bad == "odd head_dim" else 64, num_qo_heads=4,
                                       num_kv_heads=2, rope_base=1e4, **kw)
        finally:
            ropekv.set_checked(False)
        sync()
        msgs.append(str(e.value))
        if bad != "slot >= P checked":  # (checked: the named rows in range are written)
            assert same_bits(kp, k0) and same_bits(vp, v0)
    assert msgs[0] == msgs[1], msgs


@cuda_only
def test_second_device_if_present():
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU")
    with torch.cuda.device(1):
        args = make(10, 8, 2, 128, 30, torch.bfloat16, device="cuda:1")
    run_and_check(*args, 1e4)  # current device is 0: the backend must switch


@cuda_only
@pytest.mark.parametrize("unroll", [1, 2, 4, 8])
def test_every_steps_per_team_variant(unroll):
    """The 16-byte kernels come in 1, 2, 4 and 8 steps per team (the library
    picks by size; ROPEKV_CUDA_UNROLL forces one), the options kernel takes
    1, 2 or 4 of its 4: each against the CPU."""
    code = textwrap.dedent("""
        import sys, torch, ropekv
        sys.path.insert(0, %r)
        import test_cuda as tc
        ropekv.set_checked(True)
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            for (T, Hq, Hk, D) in ((37, 32, 8, 128), (5, 28, 4, 128), (9, 32, 32, 96)):
                args = tc.make(T, Hq, Hk, D, 3 * T, dtype, seed=T)
                cpu = [a.cpu() for a in args]
                k0, v0 = cpu[5].clone(), cpu[6].clone()
                gq, gk, gkp, gvp = tc.call(*args, 500000.0)
                cq, ck, ckp, cvp = tc.call(*cpu, 500000.0)
                for g, c, x in ((gq, cq, cpu[0]), (gk, ck, cpu[1])):
                    ref = tc.f64(c)
                    mag = abs(ref) + abs(tc.f64(x)).max(axis=-1, keepdims=True)
                    tc.assert_close(g, ref, mag, f"U={%d} {dtype} T={T}")
                tc.check_pools(cpu[4], gk.cpu(), cpu[2], gkp.cpu(), gvp.cpu(), k0, v0)
            # The options kernel (U = 4: 1, 2, 4 and 4 of its steps taken).
            tc.run_options(37, 32, 8, 128, dtype, is_neox=False, q_norm=torch.float32,
                           k_norm=dtype, kv_cache_dtype="fp8_e4m3", k_scale=0.5, what="opt")
            tc.run_options(9, 16, 2, 1024, dtype, table_dtype=torch.float32, q_norm=dtype,
                           kv_cache_dtype="float32" if dtype != torch.float32 else "auto",
                           what="opt wide")
        print("OK")
    """) % (os.path.dirname(os.path.abspath(__file__)), unroll)
    env = dict(os.environ, ROPEKV_CUDA_UNROLL=str(unroll))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


@cuda_only
def test_duplicate_slots_raise_in_checked_mode(checked):
    q, k, v, pos, slots, kp, vp = make(16, 8, 2, 128, 64, torch.bfloat16, skip_every=0)
    slots[9] = slots[3]
    with pytest.raises(ValueError, match=r"^slots\[9\] = \d+ repeats slots\[3\]: two tokens"):
        call(q, k, v, pos, slots, kp, vp, 1e4)


@cuda_only
def test_two_streams_at_once_give_exact_results():
    """Calls on two CUDA streams at once, each with its own pools, many calls
    each, interleaved on the host: every result exact."""
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    cases = [make(257, 32, 8, 128, 4096, torch.bfloat16, seed=s) for s in (1, 2)]
    snapshots = [(c[5].clone(), c[6].clone()) for c in cases]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = [[], []]
    for rep in range(20):
        for i, (s, c) in enumerate(zip(streams, cases)):
            with torch.cuda.stream(s):
                outs[i].append(call(*c, 5e5)[:2])
    torch.cuda.synchronize()
    for i, c in enumerate(cases):
        q, k, v, pos, slots, kp, vp = c
        ref, mag = ref_rope(f64(q), pos.cpu().numpy(), 5e5)
        for q_rot, k_rot in outs[i]:
            assert_close(q_rot, ref, mag, f"q_rot on stream {i}")
            assert same_bits(k_rot, outs[i][0][1])
        check_pools(slots, outs[i][0][1], v, kp, vp, *snapshots[i])


@cuda_only
def test_torch_custom_op_compiled_and_in_a_cuda_graph():
    """torch.ops.ropekv.rope_pool_fused under torch.compile(fullgraph=True) and
    captured in a CUDA graph: same bits as the direct call."""
    import ropekv.ops  # noqa: F401

    ropekv.set_checked(False)  # checked mode syncs, which a capture forbids
    q, k, v, pos, slots, kp, vp = make(33, 32, 8, 128, 512, torch.bfloat16)
    cfg = dict(head_dim=128, num_qo_heads=32, num_kv_heads=8, rope_base=5e5)
    kp_ref, vp_ref = kp.clone(), vp.clone()
    want = call(q, k, v, pos, slots, kp_ref, vp_ref, 5e5)

    def f(q, k, v, pos, slots, kp, vp):
        return torch.ops.ropekv.rope_pool_fused(q, k, v, pos, slots, kp, vp, **cfg)

    got = torch.compile(f, fullgraph=True)(q, k, v, pos, slots, kp, vp)
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])
    assert same_bits(kp, kp_ref) and same_bits(vp, vp_ref)

    kp2, vp2 = kp.clone(), vp.clone()
    f(q, k, v, pos, slots, kp2, vp2)  # warm-up outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = f(q, k, v, pos, slots, kp2, vp2)
    kp2.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert same_bits(out[0], want[0]) and same_bits(kp2[slots[slots >= 0].long()],
                                                     want[1][slots >= 0])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", [(32, 32, 80, 32), (64, 64, 96, 24), (3, 1, 34, 10)],
                         ids=["Phi-2", "GPT-NeoX-20B", "odd-tail"])
def test_partial_rotary(shape, dtype):
    Hq, Hk, D, R = shape
    q, k, v, pos, slots, kp, vp = make(37, Hq, Hk, D, 80, DTYPES[dtype])
    k0, v0 = kp.clone(), vp.clone()
    q_rot, k_rot, _, _ = call(q, k, v, pos, slots, kp, vp, 1e4, rotary_dim=R,
                              q_out=poisoned(q), k_out=poisoned(k))
    p = pos.cpu().numpy()
    ref, mag = ref_rope(f64(q), p, 1e4, rotary_dim=R)
    assert_close(q_rot, ref, mag, "q_rot")
    ref, mag = ref_rope(f64(k), p, 1e4, rotary_dim=R)
    assert_close(k_rot, ref, mag, "k_rot")
    assert same_bits(q_rot[..., R:], q[..., R:])
    check_pools(slots, k_rot, v, kp, vp, k0, v0)



# ---------------------------------------------------------------- options (variants)
#
# Every option of the variants issue, alone and combined, against the float64
# reference and (on CUDA) against the CPU backend on the same inputs: outputs
# poisoned, pool rows exactly encode(k_rot) / encode(v), rows no token names
# bit-identical. On CUDA these calls run the options kernel (its 16-byte or
# strided form); the plain calls above run the original kernels.

LLAMA3, LLAMA4_SCOUT, LINEAR = reference.LLAMA3, reference.LLAMA4_SCOUT, reference.LINEAR
YARN, YARN_MSCALE = reference.YARN_QWEN, reference.YARN_MSCALE
PROPORTIONAL = reference.PROPORTIONAL
FP8_TORCH = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
TOKEN_ARRAYS = ("q", "k", "v", "positions", "slots")
OPTIONAL = ("cos_sin_cache", "q_norm_weight", "k_norm_weight")


def raw(x):
    """A pool as plain bits: 1-byte (fp8) pools as uint8, others as they are."""
    return x.view(torch.uint8) if x.element_size() == 1 else x


def raw_bits(x) -> np.ndarray:
    x = raw(x.detach()).contiguous().cpu()
    return x.numpy() if x.element_size() == 1 else bits(x).numpy()


def encode_pool(x, kv_cache_dtype, pool_dtype, scale) -> np.ndarray:
    """The bits pool rows must hold for values x (q's dtype): the reference
    quantiser's fp8 of fp32(x / scale), else x widened exactly."""
    if kv_cache_dtype in reference.FP8:
        return reference.fp8_encode(as_numpy(x).astype(np.float32), kv_cache_dtype, scale)
    return raw_bits(x.to(pool_dtype))


def snapshot(t):
    return {n: x.detach().cpu().clone() for n, x in t.items()}


def tokens(d, idx):
    """d with its per-token arrays restricted to the tokens idx."""
    return {n: (x[idx.to(x.device)] if n in TOKEN_ARRAYS else x) for n, x in d.items()}


def options_case(T, Hq, Hk, D, dtype, *, seed=0, base=10000.0, rotary_dim=None, is_neox=True,
                 rope_scaling=None, table_dtype=None, table_rows=4096, kv_cache_dtype="auto",
                 k_scale=1.0, v_scale=1.0, q_norm=None, k_norm=None, norm_eps=1e-6,
                 strided=False, misaligned=False, shift=0, fp8_typed=False, idx=torch.int64,
                 norm_strided=False, device=DEV):
    """The tensors (a dict, on `device`) and keyword arguments of one options
    call. q_norm / k_norm: the weight's torch dtype, or None for no QK-norm;
    norm_strided: the weights are every other element of a buffer."""
    g = torch.Generator().manual_seed(seed)
    R = D if rotary_dim is None else rotary_dim

    def rn(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(dt)

    # (The views are made on `device`: .to() of a view copies it to a new,
    # aligned and contiguous, tensor.)
    if strided:  # views of one fused projection, last dimension strided by 2
        qkv = rn(T, Hq + 2 * Hk, 2 * D).to(device)
        q, k, v = qkv[:, :Hq, ::2], qkv[:, Hq:Hq + Hk, ::2], qkv[:, Hq + Hk:, ::2]
    elif misaligned or shift:  # `shift` (default 1) elements in: no 16-byte vectors
        n = shift or 1
        buf = rn(T * (Hq + 2 * Hk) * D + n).to(device)[n:]
        q = buf[: T * Hq * D].view(T, Hq, D)
        k = buf[T * Hq * D: T * (Hq + Hk) * D].view(T, Hk, D)
        v = buf[T * (Hq + Hk) * D:].view(T, Hk, D)
    else:
        q, k, v = rn(T, Hq, D), rn(T, Hk, D), rn(T, Hk, D)
    t = {}
    if table_dtype is not None:
        pos = torch.randint(0, table_rows, (T,), generator=g)
        inv = reference.hf_inv_freq(base, R)
        ang = np.arange(table_rows, dtype=np.float64)[:, None] * inv[None, :]
        table = np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)
        t["cos_sin_cache"] = torch.from_numpy(table).to(table_dtype)
    else:
        pos = torch.randint(0, 1 << 22, (T,), generator=g)
        pos[: min(T, 2)] = torch.tensor([0, (1 << 24) - 1])[: min(T, 2)]
    P = 2 * T + 5
    slots = torch.randperm(P, generator=g)[:T]
    slots[torch.rand(T, generator=g) < 0.2] = -1
    if kv_cache_dtype in reference.FP8:
        k_pool = torch.randint(0, 256, (P, Hk, D), generator=g, dtype=torch.uint8)
        v_pool = torch.randint(0, 256, (P, Hk, D), generator=g, dtype=torch.uint8)
        if fp8_typed:  # torch float8 tensors rather than uint8
            k_pool = k_pool.view(FP8_TORCH[kv_cache_dtype])
            v_pool = v_pool.view(FP8_TORCH[kv_cache_dtype])
    else:
        pdt = torch.float32 if kv_cache_dtype == "float32" else dtype
        k_pool, v_pool = rn(P, Hk, D, dt=pdt), rn(P, Hk, D, dt=pdt)
    t.update(q=q, k=k, v=v, positions=pos.to(idx), slots=slots.to(idx), k_pool=k_pool,
             v_pool=v_pool)
    kw = dict(rope_base=base, rotary_dim=rotary_dim, is_neox=is_neox, rope_scaling=rope_scaling,
              kv_cache_dtype=kv_cache_dtype, norm_eps=norm_eps)
    if kv_cache_dtype in reference.FP8:
        kw.update(k_scale=k_scale, v_scale=v_scale)
    for name, wdt in (("q_norm_weight", q_norm), ("k_norm_weight", k_norm)):
        if wdt is not None:
            n = 2 * D if norm_strided else D
            t[name] = (1.0 + 0.3 * torch.randn(n, generator=g)).to(wdt)
    out = {n: x.to(device) for n, x in t.items()}
    if strided or misaligned or shift:  # (the layout the case asks for reached the call)
        assert all(not out[n].is_contiguous() for n in "qkv") if strided else \
            all(out[n].data_ptr() % 16 != 0 for n in "qkv")
    if norm_strided:  # (the view is made on `device`: .to() would make it contiguous)
        out.update({n: out[n][::2] for n in ("q_norm_weight", "k_norm_weight") if n in out})
    return out, kw


def options_call(t, kw, *, inplace=False, q_out=None, k_out=None):
    """The call; outputs poisoned unless given (or inplace)."""
    q, k = t["q"], t["k"]
    if not inplace:
        q_out = poisoned(q) if q_out is None else q_out
        k_out = poisoned(k) if k_out is None else k_out
    extra = {n: t[n] for n in OPTIONAL if n in t}
    return ropekv.rope_pool_fused(q, k, t["v"], t["positions"], t["slots"], t["k_pool"],
                                  t["v_pool"], head_dim=q.shape[-1], num_qo_heads=q.shape[1],
                                  num_kv_heads=k.shape[1], inplace=inplace, q_out=q_out,
                                  k_out=k_out, **kw, **extra)


def options_reference(t, kw, snap):
    """{"q_rot"/"k_rot": (reference, magnitude, rel)} for the inputs in snap."""
    D = snap["q"].shape[-1]
    R = reference.rotary_dim_of(D, kw["rotary_dim"], kw["rope_scaling"])
    cache = t.get("cos_sin_cache")
    args = dict(is_neox=kw["is_neox"], norm_eps=kw["norm_eps"],
                cos_sin_cache=None if cache is None else f64(cache),
                inv_freq=None if cache is not None else
                reference.hf_inv_freq(kw["rope_base"], R, kw["rope_scaling"]),
                attention_factor=reference.hf_attention_factor(kw["rope_scaling"]))
    extra = 1.0 if args["attention_factor"] != 1 else 0.0
    out = {}
    for x, wname, name in (("q", "q_norm_weight", "q_rot"), ("k", "k_norm_weight", "k_rot")):
        w = t.get(wname)
        ref, mag = ref_rope(f64(snap[x]), snap["positions"].numpy(), kw["rope_base"], R,
                            norm_weight=None if w is None else f64(w), **args)
        out[name] = (ref, mag, 4.0 + extra + (0 if w is None else D / 2 + 6))
    return out


def check_options(t, kw, res, snap, what=""):
    """q_rot / k_rot against the reference; the named pool rows exactly
    encode(k_rot) / encode(v); every other pool row as in snap (the arrays
    before the call, on the CPU)."""
    q_rot, k_rot, kp, vp = res
    refs = options_reference(t, kw, snap)
    for name, out in (("q_rot", q_rot), ("k_rot", k_rot)):
        ref, mag, rel = refs[name]
        reference.assert_close(as_numpy(out), ref, mag, f"{what} {name}", rel)
    s = t["slots"].long().cpu()
    P = kp.shape[0]
    ok = (s >= 0) & (s < P)
    rows, toks = s[ok], torch.nonzero(ok).flatten()
    kvd = kw["kv_cache_dtype"]
    kp, vp = raw(kp).cpu(), raw(vp).cpu()
    want_k = encode_pool(k_rot.cpu()[toks], kvd, kp.dtype, kw.get("k_scale", 1.0))
    want_v = encode_pool(snap["v"][toks], kvd, vp.dtype, kw.get("v_scale", 1.0))
    assert np.array_equal(raw_bits(kp[rows]), want_k), f"{what}: k_pool rows != encode(k_rot)"
    assert np.array_equal(raw_bits(vp[rows]), want_v), f"{what}: v_pool rows != encode(v)"
    rest = torch.ones(P, dtype=torch.bool)
    rest[rows] = False
    assert np.array_equal(raw_bits(kp[rest]), raw_bits(raw(snap["k_pool"])[rest])), \
        f"{what}: a k_pool row no token names was written"
    assert np.array_equal(raw_bits(vp[rest]), raw_bits(raw(snap["v_pool"])[rest])), \
        f"{what}: a v_pool row no token names was written"
    return refs


def run_options(T, Hq, Hk, D, dtype, *, inplace=False, against_cpu=True, what="", **opts):
    """One options call on DEV, checked by check_options; on CUDA also the
    same call on the CPU backend: q_rot / k_rot within one rounding (plus the
    fp32 bound) of each other, v pools bit-identical, k pools bit-identical
    for every token whose k_rot is (fp8: both encode with encode_fp8)."""
    t, kw = options_case(T, Hq, Hk, D, dtype, **opts)
    snap = snapshot(t)
    res = options_call(t, kw, inplace=inplace)
    if DEV == "cuda":
        torch.cuda.synchronize()
    if inplace:
        assert res[0] is t["q"] and res[1] is t["k"]
    assert res[2] is t["k_pool"] and res[3] is t["v_pool"]
    refs = check_options(t, kw, res, snap, what)
    if DEV != "cuda" or not against_cpu:
        return res
    c = {n: x.clone() for n, x in snap.items()}
    cres = options_call(c, kw, inplace=inplace)
    for i, name in ((0, "q_rot"), (1, "k_rot")):
        _, mag, rel = refs[name]
        reference.assert_close(as_numpy(res[i]), f64(cres[i]), mag, f"{what} {name} GPU vs CPU",
                               rel + 4)
    assert np.array_equal(raw_bits(res[3]), raw_bits(cres[3])), f"{what}: v_pool GPU != CPU"
    equal_k = (bits(res[1].cpu()) == bits(cres[1])).flatten(1).all(1)
    s = snap["slots"].long()
    rows = s[equal_k & (s >= 0)]
    assert np.array_equal(raw_bits(raw(res[2]).cpu()[rows]), raw_bits(raw(cres[2])[rows])), \
        f"{what}: k_pool GPU != CPU for tokens with equal k_rot"
    return res


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("D,R", [(64, 64), (128, 128), (256, 64), (80, 32), (34, 34), (6, 4)])
def test_options_interleaved(D, R, dtype):
    # (34, 34) and (6, 4): no 16-byte vectors, the strided options kernel.
    for T in (1, 7, 150):
        run_options(T, 4, 2, D, DTYPES[dtype], seed=T + D, rotary_dim=R, is_neox=False,
                    what=f"interleaved D={D} R={R} T={T}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_options_gptj_interleaved_partial(dtype):
    """GPT-J: 16 heads of 256, 64 rotated dims, interleaved; decode to prefill."""
    for T in (1, 33, 700):
        run_options(T, 16, 16, 256, DTYPES[dtype], seed=T, rotary_dim=64, is_neox=False,
                    what=f"GPT-J T={T}")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("scaling", [LINEAR, LLAMA3, LLAMA4_SCOUT, YARN, YARN_MSCALE,
                                     PROPORTIONAL],
                         ids=["linear", "llama3", "llama4-scout", "yarn", "yarn-mscale",
                              "proportional"])
def test_options_rope_scaling(scaling, dtype):
    # linear, llama3 and proportional change only the frequencies, yarn also
    # multiplies cos and sin: all in the plain kernel (yarn with other options:
    # test_options_qwen3_like, proportional: test_options_gemma4_like).
    for T in (1, 40, 3000):
        run_options(T, 8, 2, 128, DTYPES[dtype], seed=T, base=500000.0, rope_scaling=scaling,
                    what=f"scaling T={T}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_options_llama4_qk_l2_norm_as_unit_weights(dtype):
    """Llama-4's unweighted norm after the rotation is the QK-norm option with
    weights of ones (the whole-head rotation keeps each head's norm): against
    the float64 rotation followed by the norm, Scout's interleaved pairs and
    rope_scaling, on each kernel's sizes."""
    D, eps, base = 128, 1e-5, 500000.0
    inv = reference.hf_inv_freq(base, D, LLAMA4_SCOUT)
    for T in (1, 40, 3000):
        q, k, v, pos, slots, kp, vp = make(T, 5, 1, D, 2 * T + 5, DTYPES[dtype], seed=T)
        k0, v0 = kp.clone(), vp.clone()
        ones = torch.ones(D, device=DEV)
        q_rot, k_rot, _, _ = call(q, k, v, pos, slots, kp, vp, base, is_neox=False,
                                  rope_scaling=LLAMA4_SCOUT, q_norm_weight=ones,
                                  k_norm_weight=ones, norm_eps=eps, q_out=poisoned(q),
                                  k_out=poisoned(k))
        sync()
        for got, x, name in ((q_rot, q, "q_rot"), (k_rot, k, "k_rot")):
            out, mag = ref_rope(as_numpy(x), as_numpy(pos), base, D, is_neox=False, inv_freq=inv)
            r = 1.0 / np.sqrt(np.mean(out * out, axis=-1, keepdims=True) + eps)
            reference.assert_close(as_numpy(got), out * r, mag * r, f"{name} T={T}",
                                   4.0 + D / 2 + 6)
        check_pools(slots, k_rot, v, kp, vp, k0, v0)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_options_rope_parameters(dtype):
    """A transformers 5 rope_parameters dict (Phi-2's: rope_theta and
    partial_rotary_factor inside): rotary_dim int(80 * 0.4) = 32 from it."""
    phi2 = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.4}
    for T in (1, 40, 3000):
        run_options(T, 8, 2, 80, DTYPES[dtype], seed=T, base=1e4, rope_scaling=phi2,
                    what=f"rope_parameters T={T}")


@pytest.mark.parametrize("idx", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("table", ["float32", "same"])
def test_options_cos_sin_cache(dtype, table, idx):
    # (On CUDA the table alone runs the small kernel up to 256 tokens with full
    # rotary, and the plain kernel's table build at T = 2000, which widens a
    # 32-bit position in its own place.)
    dt = DTYPES[dtype]
    tdt = torch.float32 if table == "float32" else dt
    for T, D, R, neox in ((1, 128, 128, True), (37, 80, 32, True), (12, 256, 64, False),
                          (5, 34, 34, True), (2000, 128, 128, True)):
        run_options(T, 4, 2, D, dt, seed=T, rotary_dim=R, is_neox=neox, table_dtype=tdt,
                    idx=idx, what=f"cos_sin_cache T={T} D={D} R={R}")


@cuda_only
@pytest.mark.parametrize("is_neox", [True, False])
def test_options_cos_sin_cache_many_waves(is_neox):
    """A table call of many waves of blocks (40000 tokens, small heads): each
    token's row read from its own position."""
    run_options(40000, 1, 1, 64, torch.bfloat16, seed=3, is_neox=is_neox,
                table_dtype=torch.float32, what="cos_sin_cache, many waves")


def test_options_cos_sin_cache_strided_table():
    """The table as a strided view (every other row of a larger one)."""
    t, kw = options_case(9, 4, 2, 64, torch.bfloat16, table_dtype=torch.float32, table_rows=512)
    big = torch.zeros(1024, 64, dtype=torch.float32, device=DEV)
    big[::2] = t["cos_sin_cache"]
    t["cos_sin_cache"] = big[::2]
    snap = snapshot(t)
    check_options(t, kw, options_call(t, kw), snap, "strided table")


# Out-of-table positions with the table alone and with other options.
TABLE_CASES = {"table alone": {},
               "table alone, int32 indices": dict(idx=torch.int32),
               "with fp8 and QK-norm": dict(kv_cache_dtype="fp8_e4m3", k_scale=0.5,
                                            q_norm=torch.float32)}


def position_case(case):
    """Tokens 2 and 4 lie outside a 100-row table (positions 100 and -3)."""
    t, kw = options_case(7, 8, 2, 128, torch.bfloat16, table_dtype=torch.float32, table_rows=100,
                         **TABLE_CASES[case])
    t["positions"][2] = 100
    t["positions"][4] = -3
    t["slots"].copy_(torch.arange(7, device=DEV))
    return t, kw


def check_skipped(t, kw, snap, q_out, k_out, bad):
    """Tokens `bad` left nothing (outputs still poisoned, their pool rows as
    they were); every other token is right."""
    for tok in bad:
        assert torch.isnan(q_out[tok].float()).all() and torch.isnan(k_out[tok].float()).all()
    good = torch.tensor([i for i in range(t["q"].shape[0]) if i not in bad])
    # The bad tokens' rows are rows no good token names: check_options
    # requires them unchanged.
    check_options(tokens(t, good), kw, (q_out[good.to(DEV)], k_out[good.to(DEV)], t["k_pool"],
                                        t["v_pool"]), tokens(snap, good), "good tokens")


@cuda_only
@pytest.mark.parametrize("case", list(TABLE_CASES))
def test_options_position_outside_cos_sin_cache_is_skipped_and_raised(case):
    t, kw = position_case(case)
    snap = snapshot(t)
    q_out, k_out = poisoned(t["q"]), poisoned(t["k"])
    with pytest.raises(ValueError, match=r"^positions\[2\] = 100 is outside cos_sin_cache, which "
                                         r"has 100 rows \(positions must be in \[0, 100\)\); the "
                                         r"CUDA kernel skipped 2 token"):
        options_call(t, kw, q_out=q_out, k_out=k_out)
    torch.cuda.synchronize()
    check_skipped(t, kw, snap, q_out, k_out, (2, 4))
    # The raise cleared the flag: the call with good positions passes.
    t["positions"][2] = 7
    t["positions"][4] = 9
    options_call(t, kw)


@cuda_only
@pytest.mark.parametrize("case", list(TABLE_CASES))
def test_options_position_and_slot_errors_unchecked_then_check_device_errors(case):
    ropekv.set_checked(False)
    t, kw = position_case(case)
    t["slots"][5] = 10**6
    options_call(t, kw)  # no sync, no raise
    dev = t["q"].device.index
    with pytest.raises(ValueError, match=r"^positions\[2\] = 100 is outside cos_sin_cache.*"
                                         r"skipped 2 token.*; also slots\[5\] = 1000000 is out "
                                         r"of range for a pool of 19 rows"):
        ropekv.check_device_errors(dev)
    ropekv.check_device_errors(dev)  # cleared


@cuda_only
@pytest.mark.parametrize("norm", [True, False])
def test_options_out_of_table_token_with_several_blocks_per_token(norm):
    """Heads of 1024 and a table: with a QK-norm the options kernel (teams of
    two warps, five blocks per token, the norm's sums crossing warps),
    without one the small kernel (one 128-lane head per block, 36 blocks per
    token). Every block of the token skips it."""
    norms = dict(q_norm=torch.bfloat16, k_norm=torch.float32) if norm else {}
    t, kw = options_case(3, 32, 4, 1024, torch.bfloat16, table_dtype=torch.float32,
                         table_rows=64, **norms)
    t["positions"][1] = 64
    t["slots"].copy_(torch.tensor([0, 1, 2], device=DEV))
    snap = snapshot(t)
    q_out, k_out = poisoned(t["q"]), poisoned(t["k"])
    with pytest.raises(ValueError, match=r"^positions\[1\] = 64 is outside cos_sin_cache"):
        options_call(t, kw, q_out=q_out, k_out=k_out)
    check_skipped(t, kw, snap, q_out, k_out, (1,))


# Small calls of the one-step build (here: fp8 pools without a QK-norm, and
# Phi-3's heads of 96 with a QK-norm) spread a token over as many blocks (of
# at least 4 warps) as keep the grid within half the SMs: on an H200 (132
# SMs) the Llama shape runs 3 blocks per token at T = 1, 7 and 16 and 2 at
# T = 32, Qwen 3 (of 3 warps) at T <= 16, Phi-3 5 at T <= 13 and 4 at
# T = 16; T = 40 is not split. Each block makes the token's cos/sin and
# reads its QK-norm weights; a bad index is reported from the token's first
# block only. Plain calls, interleaved ones, those with a cos_sin_cache and
# those with a QK-norm on heads of 128 run the small kernel instead (4 to 7
# blocks per token for these shapes; see test_small_kernel_shapes and
# test_small_kernel_options).
SPLIT_SHAPES = {"llama": (32, 8, 128), "qwen": (28, 4, 128), "phi3": (32, 32, 96)}
SPLIT_OPTIONS = {
    "plain": {},
    "cos_sin_cache f32": dict(table_dtype=torch.float32),
    "cos_sin_cache bf16": dict(table_dtype=torch.bfloat16),
    "qk-norm fp8": dict(kv_cache_dtype="fp8_e4m3", k_scale=0.5, q_norm=torch.float32,
                        k_norm=torch.bfloat16),
    "fp8": dict(kv_cache_dtype="fp8_e4m3", k_scale=0.5),
    "interleaved": dict(is_neox=False),
}


@pytest.mark.parametrize("opt", list(SPLIT_OPTIONS))
@pytest.mark.parametrize("shape", list(SPLIT_SHAPES))
def test_small_calls_split_over_blocks(shape, opt):
    Hq, Hk, D = SPLIT_SHAPES[shape]
    for T in (1, 7, 16, 32, 40):
        run_options(T, Hq, Hk, D, torch.bfloat16, seed=T, what=f"{shape} {opt} T={T}",
                    **SPLIT_OPTIONS[opt])


@cuda_only
@pytest.mark.parametrize("opt", ["cos_sin_cache f32", "qk-norm fp8"])
def test_split_call_reports_each_bad_token_once(opt):
    """A 7-token Llama-shaped call (5 blocks per token of the small kernel
    with the table, 3 of the one-step build with a QK-norm): two positions
    outside the table and one slot outside the pool are each counted once."""
    ropekv.set_checked(False)
    extra = dict(SPLIT_OPTIONS[opt], table_dtype=torch.float32)
    t, kw = options_case(7, 32, 8, 128, torch.bfloat16, table_rows=100, **extra)
    t["positions"][2] = 100
    t["positions"][4] = -3
    t["slots"].copy_(torch.arange(7, device=DEV))
    t["slots"][5] = 10**6
    snap = snapshot(t)
    q_out, k_out = poisoned(t["q"]), poisoned(t["k"])
    options_call(t, kw, q_out=q_out, k_out=k_out)
    with pytest.raises(ValueError, match=r"^positions\[2\] = 100 is outside cos_sin_cache.*"
                                         r"skipped 2 token.*; also slots\[5\] = 1000000 is out "
                                         r"of range for a pool of 19 rows \(k_pool.shape\[0\]\); "
                                         r"the CUDA kernel skipped the pool writes of 1 token\(s\)"):
        ropekv.check_device_errors(t["q"].device.index)
    check_skipped(t, kw, snap, q_out, k_out, (2, 4))


# Calls of 16-bit data with full rotary (NeoX or interleaved pairs), up to
# 512 tokens (256 with a cos_sin_cache), run the small kernel: blocks of 128 threads (256 at
# T = 17..64) holding whole heads of one token, D / 8 lanes per head (from
# one lane at D = 8 to 128 at D = 1024, one head per 128-thread block), the
# last block of a token partly empty when the heads do not fill it. Plain
# calls (NeoX or interleaved) of 257 to 2048 tokens whose half head_dim is a
# multiple of 8 take it in wide lanes (D / 16 lanes per head: 8 bytes more
# per lane, from D = 80), up to 8192 tokens where D / 16 is a power of two;
# 257 and 513 tokens run the kernels beyond the other limits, 2049 beyond
# the wide lanes' of D = 80 and 96 (test_small_kernel_limits_... has 8193).
SMALL_SHAPES = [(3, 1, 8), (5, 3, 24), (28, 4, 128), (7, 2, 80), (32, 32, 96), (16, 8, 256),
                (4, 2, 512), (3, 1, 1024)]


@pytest.mark.parametrize("pairs", ["neox", "interleaved"])
@pytest.mark.parametrize("table", ["none", "float32", "same"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_small_kernel_shapes(dtype, table, pairs):
    dt = DTYPES[dtype]
    tdt = {"none": None, "float32": torch.float32, "same": dt}[table]
    for i, (Hq, Hk, D) in enumerate(SMALL_SHAPES):
        wide = (1500, 2049) if table == "none" else ()
        for T in (1, 3, 40, 257, 513) + wide:
            run_options(T, Hq, Hk, D, dt, seed=T + D, table_dtype=tdt,
                        is_neox=pairs == "neox", idx=torch.int32 if (i + T) % 2 else torch.int64,
                        what=f"small {Hq}/{Hk}/{D} T={T} table {table} {pairs}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("pool", ["auto", "float32", "fp8_e4m3", "fp8_e5m2"])
def test_small_kernel_options(pool, dtype):
    """The small kernel's builds with options: a QK-norm of q, k or both
    (weights float32 or q's dtype, contiguous or strided), or none, with pools
    of any format (fp8 scales of any value, powers of two among them), NeoX or
    interleaved pairs, with or without a table. It takes a QK-norm for heads
    of 8 to 256 (1 to 32 lanes, a power of two) with contiguous weights, and
    fp8 pools without a QK-norm for power-of-two scales only; NeoX calls
    without a table of 257 (with a QK-norm 225) to 8192 tokens in wide lanes
    (D = 128, 256, T = 257 and 1100 here); the others of SMALL_SHAPES (24, 80, 96, 512, 1024),
    strided weights, other calls past 256 tokens and fp8 pools alone whose
    scales divide go to the options kernel; in place for some."""
    dt = DTYPES[dtype]
    g = np.random.default_rng(len(pool) + 7 * len(dtype))
    norms = [(None, None), (torch.float32, None), (None, dt), (dt, torch.float32)]

    def scales():
        if not pool.startswith("fp8"):
            return {}
        if g.integers(2):  # powers of two: x * (1 / scale), the same quotient
            return dict(k_scale=float(2.0 ** g.integers(-4, 4)),
                        v_scale=float(2.0 ** g.integers(-4, 4)))
        return dict(k_scale=float(g.uniform(0.01, 2.0)), v_scale=float(g.uniform(0.01, 2.0)))

    for i, (Hq, Hk, D) in enumerate(SMALL_SHAPES):
        for j, T in enumerate((1, 40, 257, 1100)):
            qn, kn = norms[(i + j) % 4]
            run_options(T, Hq, Hk, D, dt, seed=T + D, kv_cache_dtype=pool, q_norm=qn,
                        k_norm=kn, is_neox=(i + j) % 2 == 0, norm_strided=j == 1,
                        table_dtype=(None, torch.float32, dt)[(i + 2 * j) % 3],
                        inplace=(i + j) % 5 == 0, idx=torch.int32 if i % 2 else torch.int64,
                        what=f"small {pool} {Hq}/{Hk}/{D} T={T} norms {qn} {kn}", **scales())
    # Every build of the QK-norm kernel (table or not, NeoX or interleaved) on
    # heads of 16 to 256 (2 to 32 lanes; blocks ending in part of a warp), with
    # a norm_eps large enough to move r by far more than the tolerance.
    for k, (Hq, Hk, D) in enumerate(((3, 2, 16), (9, 2, 32), (10, 3, 64), (28, 4, 128),
                                     (8, 4, 256))):
        for table in (None, torch.float32):
            for neox in (True, False):
                run_options(k + 2, Hq, Hk, D, dt, seed=D + k, kv_cache_dtype=pool,
                            q_norm=dt, k_norm=torch.float32, is_neox=neox, table_dtype=table,
                            norm_eps=0.5 if neox else 1e-6,
                            what=f"small norm {pool} {Hq}/{Hk}/{D} table {table} neox {neox}",
                            **scales())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("pool", ["auto", "float32", "fp8_e4m3", "fp8_e5m2"])
def test_small_kernel_wide_lanes_qk_norm(pool, dtype):
    """A QK-norm in the small kernel's wide lanes (NeoX, no table, 225 to 8192
    tokens, weights in q's dtype: the wide builds hold 16-bit weights only)
    on heads of 8, 16 and 32 lanes (D = 128, 256, 512; 32 + 8 heads of 8 lanes in
    two blocks of 20 per token, the others in blocks they fill): weights of both heads,
    of k only and of q only (the other heads take pairs of 1.0 in q's
    dtype), a norm_eps large enough to move r by far more than the
    tolerance, pools of q's dtype, float32 and fp8 (scales that divide and
    powers of two); float32 weights of one head send the call to the options
    kernel (test_small_kernel_routing), the same results. Heads of 512 take
    wide lanes past 192 tokens: also at the first T past it, and at 1100."""
    dt = DTYPES[dtype]
    fp8 = pool.startswith("fp8")
    norms = [(dt, dt), (None, dt), (dt, None), (torch.float32, dt)]
    for i, (Hq, Hk, D) in enumerate(((28, 4, 128), (16, 8, 256), (4, 2, 512), (32, 8, 128))):
        for j, T in enumerate((225, 700, 3000)):  # (8192: the limit test's)
            qn, kn = norms[(i + j) % 4]
            scales = (dict(k_scale=0.37, v_scale=1.7) if (i + j) % 2 else
                      dict(k_scale=0.5, v_scale=4.0)) if fp8 else {}
            run_options(T, Hq, Hk, D, dt, seed=T + D, kv_cache_dtype=pool, q_norm=qn,
                        k_norm=kn, norm_eps=0.5 if j == 1 else 1e-6,
                        idx=torch.int32 if (i + j) % 2 else torch.int64,
                        what=f"wide norm {pool} {Hq}/{Hk}/{D} T={T} norms {qn} {kn}", **scales)
    for T in (193, 1100):
        run_options(T, 4, 2, 512, dt, seed=T, kv_cache_dtype=pool, q_norm=dt, k_norm=dt,
                    idx=torch.int32 if T % 2 else torch.int64,
                    **(dict(k_scale=0.37, v_scale=1.7) if fp8 else {}),
                    what=f"wide norm {pool} 4/2/512 T={T}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_small_kernel_float32_pools_heads_of_512(dtype):
    """Float32 pools alone on heads of 512 (NeoX, no table), which the small
    kernel takes with bf16 data in narrow lanes up to 256 tokens and in split
    wide lanes (each lane's 8 elements two runs of 4) past it, up to 8192;
    with f16 data, and arrays that wide lanes cannot take (8-byte aligned,
    shift 4), in narrow lanes up to 1024 tokens (test_small_kernel_routing):
    at and past each limit, in place and with int32 indices for some."""
    dt = DTYPES[dtype]
    for T in (256, 257, 1024, 1025, 8192, 8193):
        run_options(T, 8, 4, 512, dt, seed=T, kv_cache_dtype="float32", inplace=T == 1024,
                    idx=torch.int32 if T % 2 else torch.int64,
                    what=f"float32 pools 8/4/512 T={T}")
    for T in (1024, 1025):
        run_options(T, 8, 4, 512, dt, seed=T, kv_cache_dtype="float32", shift=4,
                    what=f"float32 pools 8/4/512 8-byte aligned T={T}")


@pytest.mark.parametrize("pool", ["same", "float32", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_small_kernel_qk_norm_heads_of_64_narrow_lanes(dtype, pool):
    """A QK-norm over heads of 512, which the small kernel takes in narrow
    lanes (64 a head, two warps whose sums meet in shared memory) up to 192
    tokens, or with float32 pools and weights that wide lanes do not take
    (float32) 896 (256 with a cos_sin_cache or interleaved pairs): every pool
    format, weights float32 or q's dtype, on both heads or one, a norm_eps
    that moves r, several heads per block and blocks with an idle head
    (Hq + Hk odd), int32 and int64 indices, in place for one, up to the
    limits."""
    dt = DTYPES[dtype]
    fp8 = pool.startswith("fp8")
    lim = 192
    norms = [(dt, dt), (torch.float32, dt), (None, torch.float32), (dt, None)]
    cases = ((1, 8, 4, {}), (5, 3, 2, dict(is_neox=False)), (40, 16, 8, {}),
             (lim // 2 + 1, 8, 4, {}), (lim, 5, 2, {}), (7, 4, 2, dict(table_dtype=torch.float32)),
             (256 if pool == "float32" else lim, 2, 1, dict(is_neox=False)))
    for i, (T, Hq, Hk, extra) in enumerate(cases):
        qn, kn = norms[i % 4]
        run_options(T, Hq, Hk, 512, dt, seed=T + i, q_norm=qn, k_norm=kn,
                    norm_eps=0.5 if i == 2 else 1e-6, inplace=i == 3,
                    idx=torch.int32 if i % 2 else torch.int64,
                    **({} if pool == "same" else dict(kv_cache_dtype=pool)),
                    **(dict(k_scale=0.37, v_scale=1.7) if fp8 else {}), **extra,
                    what=f"narrow norm64 {pool} {Hq}/{Hk}/512 T={T} norms {qn} {kn} {extra}")
    if pool == "float32":  # (a float32 weight on q or on k: narrow lanes to 896)
        for T, Hq, Hk, qn, kn in ((600, 5, 2, torch.float32, dt), (896, 8, 4, None, torch.float32)):
            run_options(T, Hq, Hk, 512, dt, seed=T, q_norm=qn, k_norm=kn, kv_cache_dtype=pool,
                        idx=torch.int32, what=f"narrow norm64 float32 {Hq}/{Hk}/512 T={T} norms "
                                              f"{qn} {kn}")


@cuda_only
def test_small_kernel_routing():
    """Which kernel a Llama-shaped decode call runs (names from the PyTorch
    profiler): the small kernel's build of its QK-norm (or not) and pool
    format (template arguments kNorm, kPools: 3 q's dtype, 4 float32, 2 fp8
    whose scales divide, 5 fp8 with power-of-two scales) for a QK-norm with
    any pools, float32 pools, fp8 pools with power-of-two scales and the
    plain call; the options kernel for fp8 pools alone whose scales divide,
    for options past 256 tokens with interleaved pairs or float32 QK-norm
    weights, past 8192 with NeoX pairs (at 4096 tokens its kOptSteps
    build, U = 4, for pools of q's dtype alone, kPools 3, or with float32, 1),
    and for plain interleaved pairs past 8192 tokens. NeoX calls of 257 to
    8192 tokens without a table, and plain interleaved ones: the small kernel
    in wide lanes (template argument kN 8, else 4), with a QK-norm only where
    its weights are q's dtype, and with such a QK-norm and fp8 pools at any
    number of tokens; plain NeoX ones past 8192 the plain kernel.
    Heads of 6 wide lanes (D = 96): the wide lanes up to 2048 tokens only.
    Heads of 512 with a QK-norm (64 narrow lanes, two warps a head): the
    small kernel in narrow lanes up to 192 tokens (896 with float32 pools
    and float32 weights, which wide lanes do not take; fewer where the
    narrow grid would pass one wave: 52 tokens for 32 + 8 heads on 132 SMs),
    then with NeoX pairs and weights of q's dtype in wide lanes up to 8192
    (fp8 pools: any T), else the options kernel. A QK-norm of q's dtype (any pools)
    takes the wide lanes past 224 tokens, the plain call past 256; with float32
    pools, NeoX pairs: wide lanes up to 8192.
    Float32 pools alone with NeoX pairs: with bf16 data wide lanes past 256
    tokens, up to 8192, on heads of 128, 256 and 512; with f16 data the
    options kernel past 256 tokens, on heads of 512 narrow lanes up to 1024
    (as bf16 arrays that wide lanes cannot take, 8-byte aligned).
    A cos_sin_cache (float32 or q's dtype) on heads of 512 (8 + 4): the table
    kernel from 257 tokens while it takes two steps (T * 16 <= 6144), then the
    small kernel up to 640 tokens (32 + 8 heads too); more than 40 heads
    (40 + 8), the table kernel.
    Every other test passes on either kernel."""
    import re
    norm = dict(q_norm=torch.float32, k_norm=torch.bfloat16)
    norm16 = dict(q_norm=torch.bfloat16, k_norm=torch.bfloat16)
    small, options = "rope_pool_small_kernel", "rope_pool_options_kernel"
    # (The narrow QK-norm's one wave for 32 + 8 heads of 512: 32 warps an SM in
    # blocks of 256 threads at 17 to 64 tokens, 2 * 40 a token: 16 * SMs / 40.)
    wave40 = 16 * torch.cuda.get_device_properties(0).multi_processor_count // 40
    cases = [(1, dict(kv_cache_dtype="fp8_e4m3", **norm), small, ("true", "5")),
             (1, dict(kv_cache_dtype="fp8_e4m3", k_scale=0.37, **norm), small, ("true", "2")),
             (1, norm, small, ("true", "3")),
             (1, dict(kv_cache_dtype="float32"), small, ("false", "4")),
             (1, dict(kv_cache_dtype="fp8_e5m2", k_scale=0.25, v_scale=2.0), small,
              ("false", "5")),
             (1, dict(kv_cache_dtype="fp8_e4m3", k_scale=0.37), options, None),
             (1, {}, small, ("false", "3", "4")),
             (257, {}, small, ("false", "3", "8")),
             (2048, {}, small, ("false", "3", "8")),
             (256, dict(is_neox=False), small, ("false", "3", "4")),
             (257, dict(is_neox=False), small, ("false", "3", "8")),
             (2048, dict(is_neox=False), small, ("false", "3", "8")),
             (8192, {}, small, ("false", "3", "8")),
             (8192, dict(is_neox=False), small, ("false", "3", "8")),
             (8193, dict(is_neox=False), options, None),
             (8193, {}, "rope_pool_kernel", None),
             (2048, dict(D=96), small, ("false", "3", "8")),
             (2049, dict(D=96), "rope_pool_kernel", None),
             (257, norm16, small, ("true", "3", "8")),
             (300, dict(k_norm=torch.bfloat16), small, ("true", "3", "8")),
             (8192, dict(kv_cache_dtype="fp8_e4m3", **norm16), small, ("true", "5", "8")),
             (8193, dict(kv_cache_dtype="fp8_e4m3", **norm16), small, ("true", "5", "8")),
             (20000, dict(kv_cache_dtype="fp8_e4m3", **norm16), small, ("true", "5", "8")),
             (8193, norm16, options, None),
             (257, norm, options, None),
             (2048, dict(kv_cache_dtype="fp8_e4m3", **norm), options, None),
             (256, dict(kv_cache_dtype="float32"), small, ("false", "4", "4")),
             (257, dict(kv_cache_dtype="float32"), small, ("false", "4", "8")),
             (8192, dict(kv_cache_dtype="float32"), small, ("false", "4", "8")),
             (8193, dict(kv_cache_dtype="float32"), options, None),
             (300, dict(kv_cache_dtype="fp8_e4m3", k_scale=0.37), options, None),
             (300, dict(is_neox=False, **norm), options, None),
             (2049, norm, options, None),
             (4096, norm, options, ("4", "3", "true")),
             (4096, dict(kv_cache_dtype="float32", **norm), options, ("4", "1", "true")),
             (224, norm16, small, ("true", "3", "4")),
             (225, norm16, small, ("true", "3", "8")),
             (224, dict(kv_cache_dtype="float32", **norm16), small, ("true", "4", "4")),
             (225, dict(kv_cache_dtype="float32", **norm16), small, ("true", "4", "8")),
             (225, dict(kv_cache_dtype="fp8_e4m3", **norm16), small, ("true", "5", "8")),
             (225, {}, small, ("false", "3", "4")),
             (8192, dict(kv_cache_dtype="float32", **norm16), small, ("true", "4", "8")),
             (8193, dict(kv_cache_dtype="float32", **norm16), options, None),
             (300, dict(kv_cache_dtype="float32", is_neox=False, **norm16), options, None),
             (1, dict(D=512, kv_cache_dtype="float32", **norm16), small, ("true", "4", "4")),
             (192, dict(D=512, H=(8, 4), kv_cache_dtype="float32", **norm16), small,
              ("true", "4", "4")),
             (193, dict(D=512, H=(8, 4), kv_cache_dtype="float32", **norm16), small,
              ("true", "4", "8")),
             (896, dict(D=512, kv_cache_dtype="float32", **norm), small, ("true", "4", "4")),
             (897, dict(D=512, kv_cache_dtype="float32", **norm), options, None),
             (897, dict(D=512, kv_cache_dtype="float32", **norm16), small, ("true", "4", "8")),
             (8192, dict(D=512, kv_cache_dtype="float32", **norm16), small, ("true", "4", "8")),
             (1, dict(D=512, **norm16), small, ("true", "3", "4")),
             (192, dict(D=512, H=(8, 4), **norm16), small, ("true", "3", "4")),
             (193, dict(D=512, H=(8, 4), **norm16), small, ("true", "3", "8")),
             (wave40, dict(D=512, **norm16), small, ("true", "3", "4")),
             (wave40 + 1, dict(D=512, **norm16), small, ("true", "3", "8")),
             (4096, dict(D=512, **norm16), small, ("true", "3", "8")),
             (8193, dict(D=512, **norm16), options, None),
             (192, dict(D=512, H=(8, 4), kv_cache_dtype="fp8_e4m3", **norm16), small,
              ("true", "5", "4")),
             (193, dict(D=512, H=(8, 4), kv_cache_dtype="fp8_e4m3", **norm16), small,
              ("true", "5", "8")),
             (1, dict(D=512, **norm), small, ("true", "3", "4")),
             (wave40 + 1, dict(D=512, **norm), options, None),
             (192, dict(D=512, H=(8, 4), is_neox=False, **norm16), small, ("true", "3", "4")),
             (193, dict(D=512, H=(8, 4), is_neox=False, **norm16), options, None),
             (1024, dict(D=512, kv_cache_dtype="float32"), small, ("false", "4", "8")),
             (8193, dict(D=512, H=(8, 4), kv_cache_dtype="float32"), options, None),
             (300, dict(D=512, kv_cache_dtype="float32", is_neox=False), options, None),
             (300, dict(D=256, kv_cache_dtype="float32"), small, ("false", "4", "8")),
             (300, dict(dtype=torch.float16, kv_cache_dtype="float32"), options, None),
             (1024, dict(D=512, H=(8, 4), dtype=torch.float16, kv_cache_dtype="float32"), small,
              ("false", "4", "4")),
             (1025, dict(D=512, H=(8, 4), dtype=torch.float16, kv_cache_dtype="float32"), options,
              None),
             (1024, dict(D=512, H=(8, 4), kv_cache_dtype="float32", shift=4), small,
              ("false", "4", "4")),
             (1025, dict(D=512, H=(8, 4), kv_cache_dtype="float32", shift=4), options, None),
             (257, dict(D=512, H=(8, 4), table_dtype=torch.float32), "rope_pool_kernel", None),
             (384, dict(D=512, H=(8, 4), table_dtype=torch.float32), "rope_pool_kernel", None),
             (385, dict(D=512, H=(8, 4), table_dtype=torch.float32), small, ("false", "3", "4")),
             (640, dict(D=512, H=(8, 4), table_dtype=torch.float32), small, ("false", "3", "4")),
             (641, dict(D=512, H=(8, 4), table_dtype=torch.float32), "rope_pool_kernel", None),
             (384, dict(D=512, H=(8, 4), table_dtype=torch.bfloat16), "rope_pool_kernel", None),
             (385, dict(D=512, H=(8, 4), table_dtype=torch.bfloat16), small, ("false", "3", "4")),
             (640, dict(D=512, H=(8, 4), dtype=torch.float16, table_dtype=torch.float16), small,
              ("false", "3", "4")),
             (641, dict(D=512, H=(8, 4), table_dtype=torch.bfloat16), "rope_pool_kernel", None),
             (320, dict(D=512, table_dtype=torch.bfloat16), small, ("false", "3", "4")),
             (320, dict(D=512, table_dtype=torch.float32), small, ("false", "3", "4")),
             (320, dict(D=512, H=(40, 8), table_dtype=torch.float32), "rope_pool_kernel", None),
             (448, dict(table_dtype=torch.float32), "rope_pool_kernel", None)]
    for T, opts, want, build in cases:
        opts = dict(opts)
        Hq, Hk = opts.pop("H", (32, 8))
        dt = opts.pop("dtype", torch.bfloat16)
        name = ran_kernel(T, Hq, Hk, opts.pop("D", 128), dt, **opts)
        assert want in name, f"T={T} {opts}: ran {name}, want {want}"
        if build is not None and want == small:  # kNorm, kPools (and kN)
            m = re.search(r"rope_pool_small_kernel<[^,]+, \w+, \w+, (\w+), \(?[\w:]*\)?(\d), "
                          r"\(?[\w:]*\)?(\d)", name)
            assert m and m.groups()[:len(build)] == build, \
                f"T={T} {opts}: ran {name}, want {build}"
        elif build is not None:  # U, kPools, kNorm
            m = re.search(r"rope_pool_options_kernel<[^,]+, \d+, \w+, (\d+), \(?[\w:]*\)?(\d), "
                          r"(\w+)>", name)
            assert m and m.groups() == build, f"T={T} {opts}: ran {name}, want {build}"


def test_small_kernel_table_on_heads_of_512():
    """Heads of 512 (8 + 4) with a cos_sin_cache, float32 or q's dtype, around
    the small kernel's window where the table kernel would take four steps
    (385 to 640 tokens; test_small_kernel_routing names the kernels), against
    the float64 reference and the CPU, in place too, and with 32 + 8 heads
    (from 129 tokens)."""
    for T in (384, 385, 640, 641):
        run_options(T, 8, 4, 512, torch.bfloat16, seed=T, table_dtype=torch.float32,
                    inplace=T == 640, what=f"table heads of 512 T={T}")
        dt = torch.bfloat16 if T % 2 else torch.float16
        run_options(T, 8, 4, 512, dt, seed=T + 1, table_dtype=dt, inplace=T == 385,
                    what=f"{dt} table heads of 512 T={T}")
    run_options(320, 32, 8, 512, torch.float16, seed=7, table_dtype=torch.float32,
                what="table 32 + 8 heads of 512 T=320")
    run_options(320, 32, 8, 512, torch.bfloat16, seed=8, table_dtype=torch.bfloat16,
                what="bf16 table 32 + 8 heads of 512 T=320")


@pytest.mark.parametrize("table", ["none", "float32"])
def test_small_kernel_limits_in_place_and_8_byte_alignment(table):
    """The small kernel at its token limits (8192 in wide lanes of D = 128,
    plain; a QK-norm with fp8 pools, which has none there, on both sides of
    it; 512 for plain inputs 8-byte but not 16-byte
    aligned, 4 elements into a buffer, which only its narrow lanes take as
    vectors; 256 with a table), in place, and on such 8-byte aligned inputs."""
    tdt = None if table == "none" else torch.float32
    limits = ((8192, 0), (512, 4)) if tdt is None else ((256, 0),)
    for limit, shift in limits:
        for T in (limit, limit + 1):
            run_options(T, 28, 4, 128, torch.bfloat16, seed=T, table_dtype=tdt, shift=shift,
                        what=f"small limit T={T} shift {shift} table {table}")
    # A QK-norm (weights in q's dtype) with fp8 pools: wide lanes at any T
    # (the options kernel took them past 8192 before; 256 with a table).
    for T in (limits[0][0], limits[0][0] + 1):
        run_options(T, 28, 4, 128, torch.bfloat16, seed=T, table_dtype=tdt,
                    q_norm=torch.bfloat16, k_norm=torch.bfloat16, kv_cache_dtype="fp8_e4m3",
                    k_scale=0.5, v_scale=2.0, what=f"small limit T={T} norm fp8 table {table}")
    for pairs in ("neox", "interleaved"):
        for T in (1, 40):
            run_options(T, 32, 8, 128, torch.float16, seed=T, table_dtype=tdt, inplace=True,
                        is_neox=pairs == "neox", what=f"small in place T={T} {pairs}")
            run_options(T, 8, 2, 64, torch.bfloat16, seed=T, table_dtype=tdt, shift=4,
                        is_neox=pairs == "neox", what=f"small shifted T={T} {pairs}")


@cuda_only
def test_small_kernel_reports_each_bad_slot_once():
    """A 7-token Llama-shaped plain call (5 blocks per token of the small
    kernel): two slots outside the pool are counted once each, their pool
    rows are not written, q_rot and k_rot of every token are."""
    ropekv.set_checked(False)
    t, kw = options_case(7, 32, 8, 128, torch.bfloat16)
    t["slots"].copy_(torch.arange(7, device=DEV))
    t["slots"][2] = 10**6 + 1
    t["slots"][5] = 10**6
    snap = snapshot(t)
    res = options_call(t, kw)
    with pytest.raises(ValueError, match=r"^slots\[2\] = 1000001 is out of range for a pool of "
                                         r"19 rows \(k_pool.shape\[0\]\); the CUDA kernel "
                                         r"skipped the pool writes of 2 token\(s\)"):
        ropekv.check_device_errors(t["q"].device.index)
    check_options(t, kw, res, snap, "bad slots")


@cuda_only
@pytest.mark.parametrize("env", ["ROPEKV_CUDA_SMALL_THREADS=200", "ROPEKV_CUDA_SMALL_THREADS=32",
                                 "ROPEKV_CUDA_SMALL_TOKENS=0", "ROPEKV_CUDA_NORM64_TOKENS=0"])
def test_small_kernel_tuning_variables(env):
    """The small kernel's tuning variables: blocks of a thread count that is
    not a power of two, or below a head's lanes (one head per block), and
    the small kernel off (the kernels it replaced); plain calls and calls
    with a QK-norm and fp8 pools, each against the CPU."""
    code = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, %r)
        import test_cuda as tc
        for (T, Hq, Hk, D) in ((1, 32, 8, 128), (40, 32, 32, 96), (3, 3, 1, 1024)):
            for neox in (True, False):
                for table in (None, torch.float32):
                    tc.run_options(T, Hq, Hk, D, torch.bfloat16, seed=T, is_neox=neox,
                                   table_dtype=table, what=f"%s T={T} D={D}")
        # The options build with a QK-norm: heads of 16, 8 and 1 lanes, blocks
        # ending in part of a warp.
        for (T, Hq, Hk, D) in ((1, 32, 8, 128), (40, 8, 2, 64), (3, 3, 2, 8), (7, 8, 4, 512)):
            tc.run_options(T, Hq, Hk, D, torch.bfloat16, seed=T, q_norm=torch.float32,
                           k_norm=torch.bfloat16, kv_cache_dtype="fp8_e4m3", k_scale=0.5,
                           v_scale=3.0, what=f"%s norm fp8 T={T} D={D}")
            tc.run_options(T, Hq, Hk, D, torch.bfloat16, seed=T + 1, q_norm=torch.bfloat16,
                           k_norm=torch.bfloat16, kv_cache_dtype="float32",
                           what=f"%s norm f32 pools T={T} D={D}")
        print("OK")
    """) % (os.path.dirname(os.path.abspath(__file__)), env, env, env)
    name, value = env.split("=")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, **{name: value}))
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def ran_kernel(T, Hq, Hk, D, dtype, **opts):
    """The name of the one ropekv kernel that an options call runs (torch's
    profiler)."""
    import re
    from torch.profiler import ProfilerActivity, profile
    t, kw = options_case(T, Hq, Hk, D, dtype, **opts)
    options_call(t, kw)  # (the first call makes the library's tables)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        options_call(t, kw)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if re.search(r"rope_pool_\w*kernel", e.name)]
    assert len(names) == 1, f"T={T} {opts}: ropekv kernels seen: {names}"
    return names[0]


def one_wave_build(name):
    """Whether a small-kernel name (ran_kernel) is of a one-wave build (its
    last template argument, kOneWave, after the parameters' type)."""
    import re
    m = re.search(r"Params, (true|false)>", name)
    assert m, f"not a small-kernel name: {name}"
    return m.group(1) == "true"


@cuda_only
def test_small_kernel_one_wave_rule():
    """The wide lanes' one-wave builds (40 registers) where a call's blocks, all
    holding as many heads, fit one wave only so and need more than 17/16 of
    the usual build's: heads of 512 (8 + 4, three blocks of 4 warps a token)
    with float32 pools, a QK-norm or both at 170 * SMs / 48 < T <= 12 * SMs / 3
    (the builds of 48 registers hold 10 such blocks an SM, the one-wave ones
    12), checked against the float64 reference and the CPU; Llama-3.1-8B's
    QK-norm (two blocks of 20 heads, 5 warps: 8 against 9 an SM, since an
    SM's four quarters of 16384 registers each hold 12 warps of 40) at
    68 * SMs / 16 < T <= 9 * SMs / 2; each window's first and last T and the
    T before it. The usual builds below and above those windows (just past a
    wave of them, too), for the plain call (no one-wave
    build) and for Llama-3.1-8B's float32 pools (blocks of 16 + 16 + 8 heads:
    not all full)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("register counts measured for sm_90 (ptxas -v)")
    tuning = [v for v in ("ROPEKV_CUDA_ONE_WAVE", "ROPEKV_CUDA_SMALL_TOKENS",
                          "ROPEKV_CUDA_SMALL_WIDE", "ROPEKV_CUDA_SMALL_THREADS",
                          "ROPEKV_CUDA_NORM64_TOKENS") if v in os.environ]
    if tuning:
        pytest.skip(f"the library's rule is changed by {tuning}")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if 10 * sms // 3 <= 256:
        pytest.skip(f"{sms} SMs: the window is below the wide lanes of float32 pools")
    inside = 11 * sms // 3
    f32 = dict(kv_cache_dtype="float32")
    norm = dict(q_norm=torch.bfloat16, k_norm=torch.bfloat16)
    cases = [(inside, 8, 4, 512, f32, True), (inside, 8, 4, 512, dict(f32, **norm), True),
             (inside, 8, 4, 512, norm, True), (10 * sms // 3, 8, 4, 512, f32, False),
             (10 * sms // 3 + 1, 8, 4, 512, f32, False),
             (12 * sms // 3 + 1, 8, 4, 512, f32, False), (inside, 8, 4, 512, {}, False),
             (9 * sms // 2, 32, 8, 128, norm, True), (4 * sms, 32, 8, 128, norm, False),
             # each window's edges: the last T below it, its first and its last (the
             # first T past each: 12 * sms // 3 + 1 above, 9 * sms // 2 + 1 below)
             (170 * sms // 48, 8, 4, 512, f32, False), (170 * sms // 48 + 1, 8, 4, 512, f32, True),
             (4 * sms, 8, 4, 512, f32, True), (68 * sms // 16, 32, 8, 128, norm, False),
             (68 * sms // 16 + 1, 32, 8, 128, norm, True),
             (9 * sms // 2 + 1, 32, 8, 128, norm, False), (4 * sms + 1, 32, 8, 128, norm, False),
             (5 * sms, 32, 8, 128, norm, False), (9 * sms // 2, 32, 8, 128, f32, False)]
    for T, Hq, Hk, D, opts, want in cases:
        name = ran_kernel(T, Hq, Hk, D, torch.bfloat16, seed=T, **opts)
        assert "rope_pool_small_kernel" in name and one_wave_build(name) == want, \
            f"T={T} ({Hq}, {Hk}, {D}) {opts}: ran {name}, one wave wanted: {want}"
        if want:
            run_options(T, Hq, Hk, D, torch.bfloat16, seed=T + 1, what=f"one wave T={T}", **opts)


@cuda_only
def test_small_kernel_one_wave_builds():
    """Every one-wave build (ROPEKV_CUDA_ONE_WAVE=1: wherever the wide lanes of
    a QK-norm or of float32 pools run, but a QK-norm with fp8 scales that
    divide) against the float64 reference and the CPU: QK-norm with pools of
    q's dtype, float32, fp8_e4m3 and fp8_e5m2, float32 pools alone (bf16),
    heads of 128 and 512."""
    code = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, %r)
        import test_cuda as tc
        norm = dict(q_norm=torch.bfloat16, k_norm=torch.bfloat16)
        for dt in (torch.bfloat16, torch.float16):
            cases = [dict(norm), dict(norm, kv_cache_dtype="float32"),
                     dict(norm, kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=2.0),
                     dict(norm, kv_cache_dtype="fp8_e5m2", k_scale=0.25, v_scale=4.0)]
            if dt == torch.bfloat16:
                cases.append(dict(kv_cache_dtype="float32"))
            for opts in cases:
                if dt == torch.float16:
                    opts = dict(opts, q_norm=dt, k_norm=dt)
                for (T, Hq, Hk, D) in ((300, 32, 8, 128), (257, 8, 4, 512)):
                    name = tc.ran_kernel(T, Hq, Hk, D, dt, seed=T, **opts)
                    assert tc.one_wave_build(name), f"{opts} T={T} D={D}: ran {name}"
                    tc.run_options(T, Hq, Hk, D, dt, seed=T + 1, what=f"one wave {opts} D={D}",
                                   **opts)
        print("OK")
    """) % os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, ROPEKV_CUDA_ONE_WAVE="1"))
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_options_float32_pools(dtype):
    for T in (1, 30, 3000):
        run_options(T, 8, 2, 128, DTYPES[dtype], seed=T, kv_cache_dtype="float32",
                    what=f"float32 pools T={T}")
    run_options(6, 4, 2, 64, DTYPES[dtype], kv_cache_dtype="float32", strided=True,
                what="float32 pools, strided")
    run_options(6, 4, 2, 64, DTYPES[dtype], kv_cache_dtype="float32", misaligned=True,
                what="float32 pools, misaligned")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
def test_options_fp8_pools(kind, dtype):
    g = np.random.default_rng(len(kind) + len(dtype))
    for T, D, typed in ((1, 128, False), (50, 128, True), (9, 80, False), (4, 34, True),
                        (2000, 128, False)):
        ks, vs = float(g.uniform(0.01, 2.0)), float(g.uniform(0.01, 2.0))
        run_options(T, 8, 4, D, DTYPES[dtype], seed=T + D, kv_cache_dtype=kind, k_scale=ks,
                    v_scale=vs, fp8_typed=typed, what=f"{kind} T={T} D={D}")


def test_options_fp8_saturates_and_keeps_nan():
    """Beyond the format's range saturates (infinities too), NaN stays NaN,
    tiny values round to zero: exactly the reference quantiser's bits."""
    T, D = 2, 16
    k = (torch.randn(T, 1, D) * 1e4).to(DEV)
    v = (torch.randn(T, 1, D) * 1e6).to(DEV)
    v[0, 0, 3] = float("nan")
    v[1, 0, 4] = float("inf")
    v[1, 0, 5] = 1e-9
    kp = torch.zeros(T, 1, D, dtype=torch.uint8, device=DEV)
    vp = torch.zeros(T, 1, D, dtype=torch.uint8, device=DEV)
    pos = torch.arange(T, device=DEV)
    _, k_rot, _, _ = ropekv.rope_pool_fused(k, k, v, pos, pos, kp, vp, head_dim=D, num_qo_heads=1,
                                            num_kv_heads=1, rope_base=1e4,
                                            kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=3.0)
    assert np.array_equal(raw_bits(kp), reference.fp8_encode(as_numpy(k_rot), "fp8_e4m3", 0.5))
    assert np.array_equal(raw_bits(vp), reference.fp8_encode(as_numpy(v), "fp8_e4m3", 3.0))
    assert raw_bits(vp)[0, 0, 3] & 0x7F == 0x7F and raw_bits(vp)[1, 0, 4] == 0x7E


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
def test_options_fp8_every_nan_is_0x7f(kind, dtype):
    """NaNs of either sign and any payload, in v and (rotated) in k_rot, are
    0x7F in both fp8 formats: the hardware conversion's bits (sm_89 and
    later), encode_fp8's and the CPU backend's; on CUDA the same bits as the
    CPU's for the whole pools."""
    T, D = 3, 32
    nans = {"float32": [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFBFFFFF],
            "bfloat16": [0x7FC0, 0xFFC0, 0x7F81, 0xFFFF]}[dtype]
    dt = DTYPES[dtype]
    ity = np.uint32 if dt == torch.float32 else np.uint16
    g = torch.Generator().manual_seed(5)
    k = torch.randn(T, 2, D, generator=g).to(dt)
    v = torch.randn(T, 2, D, generator=g).to(dt)
    for i, b in enumerate(nans):
        nan = torch.from_numpy(np.array([b], ity).view(np.int32 if ity == np.uint32 else
                                                         np.int16)).view(dt)
        v.view(-1)[7 * i + 3] = nan[0]
        k.view(-1)[11 * i + 5] = nan[0]
    pos = torch.arange(T)
    res = []
    for dev in ([DEV, "cpu"] if DEV == "cuda" else [DEV]):
        kp = torch.zeros(T, 2, D, dtype=torch.uint8, device=dev)
        vp = torch.zeros(T, 2, D, dtype=torch.uint8, device=dev)
        out = ropekv.rope_pool_fused(k.to(dev), k.to(dev), v.to(dev), pos.to(dev), pos.to(dev),
                                     kp, vp, head_dim=D, num_qo_heads=2, num_kv_heads=2,
                                     rope_base=1e4, kv_cache_dtype=kind, k_scale=0.75,
                                     v_scale=0.3)
        k_rot = as_numpy(out[1]).astype(np.float32)
        assert np.isnan(k_rot).sum() >= 4
        assert np.array_equal(raw_bits(kp), reference.fp8_encode(k_rot, kind, 0.75))
        assert np.array_equal(raw_bits(vp), reference.fp8_encode(as_numpy(v), kind, 0.3))
        assert (raw_bits(kp)[np.isnan(k_rot)] == 0x7F).all()
        assert (raw_bits(vp)[np.isnan(as_numpy(v).astype(np.float32))] == 0x7F).all()
        res.append((raw_bits(kp), raw_bits(vp)))
    for a, b in zip(res[0], res[-1]):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("weights", ["float32", "same"])
def test_options_qk_norm(dtype, weights):
    dt = DTYPES[dtype]
    wdt = torch.float32 if weights == "float32" else dt
    # 96: six lanes per head, five heads per warp; 34: strided; 1024: teams of
    # two warps; 300 tokens: four steps per team.
    for T, D, R in ((1, 128, 128), (23, 128, 128), (5, 80, 32), (3, 34, 34), (7, 96, 96),
                    (4, 1024, 1024), (300, 128, 128)):
        run_options(T, 8, 2, D, dt, seed=T + D, rotary_dim=R, q_norm=wdt, k_norm=wdt,
                    what=f"qk-norm T={T} D={D} R={R}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_options_qk_norm_on_the_many_step_kernel(dtype):
    """QK-norm calls large enough for the options kernel's kOptSteps build (2
    or 4 steps per team), where the lanes of a head share the steps' r by
    shuffles: power-of-two and other head dims, heads of one or two lanes
    (fewer lanes than steps: several rounds), partial rotary, teams of two warps
    (the r of every step in each lane), pools of q's dtype and float32, one
    norm or both, a norm_eps that moves r."""
    dt = DTYPES[dtype]
    f32 = torch.float32
    wide = "float32" if dt != f32 else "auto"
    for T, Hq, Hk, D, R, extra in (
            (2100, 8, 2, 128, 128, {}),  # 2 steps per team
            (3000, 8, 2, 128, 128, dict(kv_cache_dtype=wide)),
            (3000, 8, 2, 96, 96, dict(norm_eps=0.5)),
            (3000, 8, 2, 80, 32, {}),
            (9000, 8, 2, 16, 16, {}),
            (9000, 6, 3, 32, 32, dict(k_norm=None)),
            (800, 8, 4, 1024, 1024, dict(q_norm=None))):
        kw = {"q_norm": dt, "k_norm": f32, **extra}
        run_options(T, Hq, Hk, D, dt, seed=T + D, rotary_dim=R, **kw,
                    what=f"qk-norm many steps T={T} {Hq}/{Hk}/{D} R={R} {extra}")


def test_options_qk_norm_one_side_and_eps():
    f32 = torch.float32
    run_options(7, 4, 2, 64, f32, q_norm=f32, what="q only")
    run_options(7, 4, 2, 64, f32, k_norm=f32, norm_eps=0.5, what="k only, eps 0.5")


def test_options_qk_norm_head_wider_than_a_team():
    """More chunks per head than lanes in a team (300+ items > 256 lanes): the
    sum of squares reads every chunk before any is written."""
    for dtype in (torch.float32, torch.bfloat16):
        run_options(3, 2, 1, 600, dtype, rotary_dim=512, q_norm=torch.float32,
                    k_norm=torch.float32, strided=True, what="600 wide, strided")
    # 600 16-byte chunks: more than a team's 256 lanes, the strided kernel.
    run_options(3, 2, 1, 2400, torch.float32, q_norm=torch.float32, k_norm=torch.float32,
                what="2400 wide, f32")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_options_inplace(dtype):
    dt = DTYPES[dtype]
    run_options(21, 8, 4, 128, dt, inplace=True, is_neox=False, what="inplace interleaved")
    run_options(5, 4, 2, 64, dt, inplace=True, q_norm=torch.float32, k_norm=torch.float32,
                kv_cache_dtype="fp8_e5m2", k_scale=0.3, v_scale=0.7, what="inplace norm fp8")
    run_options(3, 2, 1, 600, dt, inplace=True, q_norm=torch.float32, k_norm=torch.float32,
                rotary_dim=512, strided=True, what="inplace wide head strided")
    run_options(9, 8, 2, 128, dt, inplace=True, table_dtype=torch.float32,
                kv_cache_dtype="float32" if dt != torch.float32 else "auto",
                what="inplace cos_sin_cache")


@pytest.mark.parametrize("T", [1, 64, 3000])
def test_options_qwen3_like(T):
    """Qwen3-8B: QK-norm (bf16 weights), fp8_e4m3 pools, yarn scaling."""
    run_options(T, 32, 8, 128, torch.bfloat16, seed=T, base=1e6, rope_scaling=YARN,
                q_norm=torch.bfloat16, k_norm=torch.bfloat16, kv_cache_dtype="fp8_e4m3",
                k_scale=0.25, v_scale=0.5, what=f"Qwen3 T={T}")


@pytest.mark.parametrize("T", [1, 64, 3000])
def test_options_gemma4_like(T):
    """Gemma-4's full-attention layers: heads of 512, proportional RoPE (a
    quarter of the pairs rotate), QK-norm with bf16 weights; then, in a
    float32 call without the norm, the pairs at angle 0 bit-identical to the
    input."""
    run_options(T, 16, 4, 512, torch.bfloat16, seed=T, base=1e6, rope_scaling=PROPORTIONAL,
                q_norm=torch.bfloat16, k_norm=torch.bfloat16, what=f"Gemma-4 T={T}")
    t, kw = options_case(T, 16, 4, 512, torch.float32, seed=T + 1, base=1e6,
                         rope_scaling=PROPORTIONAL)
    res = options_call(t, kw)
    sync()
    rest = torch.cat([torch.arange(64, 256), torch.arange(320, 512)])
    moving = t["positions"] != 0  # (options_case gives the first token position 0)
    for got, x in ((res[0], t["q"]), (res[1], t["k"])):
        assert torch.equal(bits(got[..., rest]), bits(x[..., rest])), "pairs at angle 0 changed"
        assert not torch.equal(got[moving][..., :64], x[moving][..., :64]) or not moving.any()


def test_options_combined_layouts():
    """Options with strided, misaligned and int32-indexed inputs."""
    run_options(5, 32, 8, 128, torch.bfloat16, q_norm=torch.float32, k_norm=torch.float32,
                kv_cache_dtype="fp8_e4m3", strided=True, what="norm fp8 strided")
    run_options(11, 6, 2, 64, torch.float16, is_neox=False, rope_scaling=YARN_MSCALE,
                misaligned=True, idx=torch.int32, what="interleaved yarn misaligned")
    run_options(13, 4, 4, 256, torch.float32, rotary_dim=64, is_neox=False,
                table_dtype=torch.float32, kv_cache_dtype="fp8_e5m2", k_scale=2.0,
                q_norm=torch.float32, idx=torch.int32, what="everything, f32")


@cuda_only
def test_options_first_use_inside_a_graph_capture_and_replay():
    """A rope_scaling never seen before (its inv_freq table is made inside the
    capture) with QK-norm and fp8 pools, captured once and replayed with new
    positions and slots."""
    ropekv.set_checked(False)  # checked mode syncs, which a capture forbids
    scaling = {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 12345}
    t, kw = options_case(24, 16, 4, 128, torch.bfloat16, rope_scaling=scaling,
                         q_norm=torch.bfloat16, k_norm=torch.bfloat16,
                         kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=0.25)
    q_out, k_out = torch.empty_like(t["q"]), torch.empty_like(t["k"])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        options_call(t, kw, q_out=q_out, k_out=k_out)
    gen = torch.Generator().manual_seed(11)
    for rep in range(2):
        t["positions"].copy_(torch.randint(0, 1 << 20, (24,), generator=gen))
        t["slots"].copy_(torch.randperm(t["k_pool"].shape[0], generator=gen)[:24])
        snap = snapshot(t)
        g.replay()
        torch.cuda.synchronize()
        check_options(t, kw, (q_out, k_out, t["k_pool"], t["v_pool"]), snap, f"replay {rep}")
    ropekv.check_device_errors(t["q"].device.index)


@cuda_only
def test_options_results_are_reproducible():
    """Identical calls give identical bits (the QK-norm sums in a fixed order)."""
    outs = []
    for _ in range(2):
        t, kw = options_case(500, 32, 8, 128, torch.bfloat16, seed=3, q_norm=torch.float32,
                             k_norm=torch.float32, is_neox=False, kv_cache_dtype="fp8_e5m2")
        outs.append([raw_bits(x) for x in options_call(t, kw)])
    for a, b in zip(*outs):
        assert np.array_equal(a, b)
