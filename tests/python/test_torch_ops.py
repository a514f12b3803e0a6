"""torch.ops.ropekv.rope_pool_fused: the torch.library custom op, its fake
implementation (opcheck), and torch.compile with no graph break."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ropekv
import ropekv.ops  # noqa: F401  (registers torch.ops.ropekv.rope_pool_fused)
from reference import assert_close, rope

CFG = dict(head_dim=64, num_qo_heads=8, num_kv_heads=2, rope_base=500000.0)


def make(T=11, P=32, dtype=torch.float32):
    q = torch.randn(T, 8, 64).to(dtype)
    k = torch.randn(T, 2, 64).to(dtype)
    v = torch.randn(T, 2, 64).to(dtype)
    pos = torch.randint(0, 1 << 20, (T,))
    slots = torch.randperm(P)[:T]
    return q, k, v, pos, slots, torch.randn(P, 2, 64).to(dtype), torch.randn(P, 2, 64).to(dtype)


def test_op_matches_the_python_call_and_mutates_the_pools():
    q, k, v, pos, slots, kp, vp = make()
    kp2, vp2 = kp.clone(), vp.clone()
    q_rot, k_rot = torch.ops.ropekv.rope_pool_fused(q, k, v, pos, slots, kp, vp, **CFG)
    want = ropekv.rope_pool_fused(q, k, v, pos, slots, kp2, vp2, **CFG)
    assert torch.equal(q_rot, want[0]) and torch.equal(k_rot, want[1])
    assert torch.equal(kp, kp2) and torch.equal(vp, vp2)
    assert torch.equal(kp[slots], k_rot)


def test_opcheck():
    """Schema, fake implementation, declared mutations and autograd
    registration are consistent (torch.library.opcheck)."""
    q, k, v, pos, slots, kp, vp = make(T=5, P=8)
    torch.library.opcheck(torch.ops.ropekv.rope_pool_fused.default,
                          (q, k, v, pos, slots, kp, vp), CFG)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_call_on_layer_views_writes_those_layers(dynamic):
    """An engine's layered cache: the pools are views kcache[layer] made
    outside the compiled function (as README advises for dynamic=True),
    and each compiled call writes its own layer's rows, as eager does."""
    torch._dynamo.reset()
    L, P = 3, 32
    q, k, v, pos, slots, _, _ = make(P=P)
    kc_eager, vc_eager = torch.randn(L, P, 2, 64), torch.randn(L, P, 2, 64)
    kc, vc = kc_eager.clone(), vc_eager.clone()

    def step(q, k, v, pos, slots, kp, vp):
        return torch.ops.ropekv.rope_pool_fused(q, k, v, pos, slots, kp, vp, **CFG)

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)
    for layer in (1, 2):
        want = step(q, k, v, pos, slots, kc_eager[layer], vc_eager[layer])
        got = compiled(q, k, v, pos, slots, kc[layer], vc[layer])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(kc, kc_eager) and torch.equal(vc, vc_eager)
    assert torch.equal(kc[1][slots], kc[2][slots]) and not torch.equal(kc[0][slots], kc[1][slots])


def test_errors_are_value_errors():
    q, k, v, pos, slots, kp, vp = make()
    with pytest.raises(ValueError, match="^rope_pool_fused expects q/k/v to be 3-D"):
        torch.ops.ropekv.rope_pool_fused(q[0], k, v, pos, slots, kp, vp, **CFG)


def test_torch_compile_fullgraph():
    """Inside a compiled function with other ops around it: one graph
    (fullgraph=True fails on any break), results exact, pools mutated."""

    def layer(x, w, pos, slots, kp, vp):
        qkv = (x @ w).view(x.shape[0], 12, 64)
        q, k, v = qkv[:, :8], qkv[:, 8:10], qkv[:, 10:]
        q_rot, k_rot = torch.ops.ropekv.rope_pool_fused(q, k, v, pos, slots, kp, vp, **CFG)
        return q_rot * 2.0, k_rot

    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    T, P = 7, 16
    x, w = torch.randn(T, 96), torch.randn(96, 12 * 64)
    pos, slots = torch.randint(0, 4096, (T,)), torch.randperm(P)[:T]
    kp, vp = torch.zeros(P, 2, 64), torch.zeros(P, 2, 64)
    kp_e, vp_e = kp.clone(), vp.clone()
    got = compiled(x, w, pos, slots, kp, vp)
    want = layer(x, w, pos, slots, kp_e, vp_e)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    assert torch.equal(kp, kp_e) and torch.equal(vp, vp_e)
    qkv = (x @ w).view(T, 12, 64)
    ref, mag = rope(qkv[:, :8].numpy(), pos.numpy(), CFG["rope_base"])
    assert_close((got[0] / 2.0).numpy(), ref, mag, "compiled q_rot")
    assert torch.equal(kp[slots], got[1]) and torch.equal(vp[slots], qkv[:, 10:])
    assert np.count_nonzero(np.delete(kp.numpy(), slots.numpy(), 0)) == 0


def test_op_with_options_opcheck_and_compile():
    """The options through the op: fp8 pools (torch.float8_e4m3fn), QK-norm,
    interleaved pairs and llama3 scaling as JSON; opcheck and a compiled
    graph with no break give the eager call's bits."""
    import json

    T, P = 6, 12
    q, k, v, pos, slots, _, _ = make(T=T, P=P, dtype=torch.bfloat16)
    kp = torch.zeros(P, 2, 64, dtype=torch.float8_e4m3fn)
    vp = torch.zeros(P, 2, 64, dtype=torch.float8_e4m3fn)
    opts = dict(CFG, is_neox=False, kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=0.25,
                rope_scaling=json.dumps({"rope_type": "llama3", "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192}),
                q_norm_weight=torch.rand(64) + 0.5, k_norm_weight=torch.rand(64) + 0.5)
    weights = dict(q_norm_weight=opts.pop("q_norm_weight"), k_norm_weight=opts.pop("k_norm_weight"))
    # opcheck compares pools with arithmetic torch lacks for float8: their bits.
    torch.library.opcheck(torch.ops.ropekv.rope_pool_fused.default,
                          (q, k, v, pos, slots, kp.view(torch.uint8), vp.view(torch.uint8), None,
                           weights["q_norm_weight"],
                           weights["k_norm_weight"]), opts)
    opts.update(weights)
    kp_e, vp_e = kp.clone(), vp.clone()
    want = ropekv.rope_pool_fused(q, k, v, pos, slots, kp_e, vp_e, **opts)

    def f(q, k, v, pos, slots, kp, vp):
        return torch.ops.ropekv.rope_pool_fused(q * 1, k, v, pos, slots, kp, vp, **opts)

    got = torch.compile(f, fullgraph=True, dynamic=False)(q, k, v, pos, slots, kp, vp)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(kp.view(torch.uint8), kp_e.view(torch.uint8))
    assert torch.equal(vp.view(torch.uint8), vp_e.view(torch.uint8))
    assert kp.view(torch.uint8)[slots].any()


def test_not_differentiable_pools_version_bumped_and_inference_mode():
    """Autograd falls through the op: q_rot / k_rot never require grad, even
    from inputs that do. The pools' version counters move, as after any
    PyTorch in-place op (autograd's check against stale saved tensors).
    Inference-mode tensors (no version counter) work too."""
    q, k, v, pos, slots, kp, vp = make()
    q.requires_grad_()
    w = torch.randn(kp.shape, requires_grad=True)
    y = (w * kp).sum()  # saves kp for w's gradient
    before = (kp._version, vp._version)
    q_rot, k_rot = torch.ops.ropekv.rope_pool_fused(q, k, v, pos, slots, kp, vp, **CFG)
    assert not q_rot.requires_grad and q_rot.grad_fn is None and not k_rot.requires_grad
    assert kp._version > before[0] and vp._version > before[1]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    with torch.inference_mode():
        q, k, v, pos, slots, kp, vp = make()
        q_rot, _ = torch.ops.ropekv.rope_pool_fused(q, k, v, pos, slots, kp, vp, **CFG)
        assert q_rot.is_inference()
    ref, mag = rope(q.numpy(), pos.numpy(), CFG["rope_base"])
    assert_close(q_rot.numpy(), ref, mag, "q_rot in inference mode")


@pytest.mark.parametrize("which", ["leaf k_pool", "non-leaf v_pool"])
def test_compiled_call_refuses_a_pool_that_requires_grad(which):
    """Under torch.compile the kernel writes functionalized copies of the
    pools, so the eager call's refusal of a pool that requires grad (grad
    mode on) comes from the fake implementation, while the graph is traced:
    Dynamo raises it wrapped in its own error, with ropekv's message, and
    nothing is written. Under torch.no_grad() the same compiled call writes
    the pool, as eager does."""
    torch._dynamo.reset()
    q, k, v, pos, slots, kp, vp = make()
    if which == "leaf k_pool":
        kp.requires_grad_()
        name, pool = "k_pool", kp
    else:
        vp = torch.randn(vp.shape, requires_grad=True) * 1.0
        name, pool = "v_pool", vp
    before = pool.detach().clone()

    def step(q, k, v, pos, slots, kp, vp):
        return torch.ops.ropekv.rope_pool_fused(q, k, v, pos, slots, kp, vp, **CFG)

    with pytest.raises(ValueError, match=rf"^{name} requires grad, and ropekv writes it in "):
        step(q, k, v, pos, slots, kp, vp)
    # (Dynamo's TorchRuntimeError is a RuntimeError.)
    with pytest.raises(RuntimeError, match=rf"{name} requires grad, and ropekv writes it in "):
        torch.compile(step, fullgraph=True)(q, k, v, pos, slots, kp, vp)
    assert torch.equal(pool.detach(), before)
    with torch.no_grad():
        want = step(q, k, v, pos, slots, kp.detach().clone(), vp.detach().clone())
        got = torch.compile(step, fullgraph=True)(q, k, v, pos, slots, kp, vp)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(pool.detach()[slots], want[1] if name == "k_pool" else v)  # (k_rot, v)


def test_compiled_call_refuses_an_inference_pool_outside_inference_mode():
    """A pool made under torch.inference_mode(), passed to a compiled call
    outside it: the eager call's ValueError, nothing written."""
    torch._dynamo.reset()
    q, k, v, pos, slots, _, vp = make()
    with torch.inference_mode():
        kp = torch.randn(vp.shape)
    before = kp.clone()

    def step(q, k, v, pos, slots, kp, vp):
        return torch.ops.ropekv.rope_pool_fused(q, k, v, pos, slots, kp, vp, **CFG)

    with pytest.raises(ValueError, match=r"^k_pool is an inference tensor \(made under "):
        torch.compile(step, fullgraph=True)(q, k, v, pos, slots, kp, vp)
    assert torch.equal(kp, before)
