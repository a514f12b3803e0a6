"""The CUDA backend against the float64 reference and against the CPU backend.

Runs on a machine with an NVIDIA GPU, PyTorch with CUDA, and a ropekv built
with nvcc (scripts/gpu-check.sh does all three); skipped elsewhere. The
reference, its tolerance (one rounding of the output dtype plus the bound of
the fp32 arithmetic) and the model configs are those of the CPU suite,
tests/python/reference.py, which the golden vectors check.
"""

from __future__ import annotations

import os
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
    picks by size; ROPEKV_CUDA_UNROLL forces one): each against the CPU."""
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
