"""The binding's fast path (ropekv._ext.run_fast): numpy arrays and PyTorch
CPU tensors read in place, with any option. It must give the
general path's results (and the float64 reference's) for any strides,
offsets and dtypes, raise the contract's messages, and decline every
argument it does not take exactly (another dtype or type, a tensor that
has the negative bit, a byte-swapped, unaligned or read-only numpy array, a bool
head_dim...) before anything is written, so that the general path decides
those calls as before.

A call with ``stream=0`` takes the general path (CPU arrays ignore the
stream): the tests use it as the second oracle.
"""

from __future__ import annotations

import os
import re
import numpy as np
import pytest
import torch

import ropekv
from ropekv import _ext
from reference import BF16, assert_close, bits, poison, rope
from torch_readers import torch_reader  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("torch_reader")

RNG = np.random.default_rng()
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NUMPY_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
                "bfloat16": BF16}
T, HQ, HK, D, P = 7, 4, 2, 32, 20
KW = dict(head_dim=D, num_qo_heads=HQ, num_kv_heads=HK, rope_base=500000.0)


def np_of(t):
    """A numpy view (bf16 through ml_dtypes) of a CPU tensor, or the array."""
    if isinstance(t, np.ndarray):
        return t
    t = t.detach().resolve_neg()  # (a copy where the negative bit is set)
    if t.is_sparse:
        t = t.to_dense()
    if t._is_zerotensor():  # (no memory: its values are zeros)
        t = torch.zeros(t.shape, dtype=t.dtype)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8).numpy()  # (their bytes: numpy has no fp8)
    return t.numpy()


def snapshot(arrays):
    return [None if a is None or getattr(a, "is_meta", False) else bits(np_of(a))
            for a in arrays]


def args_of(c):
    return (c["q"], c["k"], c["v"], c["positions"], c["slots"], c["k_pool"], c["v_pool"])


def check_result(c, q_rot, k_rot, pools_before):
    """q_rot / k_rot against the float64 reference; the pool rows the slots
    name hold k_rot and v; every other pool row as it was."""
    pos = np_of(c["positions"]).astype(np.int64)
    slots = np_of(c["slots"]).astype(np.int64)
    ref_q, mag_q = rope(np_of(c["q"]), pos, KW["rope_base"])
    ref_k, mag_k = rope(np_of(c["k"]), pos, KW["rope_base"])
    assert_close(np_of(q_rot), ref_q, mag_q, "q_rot")
    assert_close(np_of(k_rot), ref_k, mag_k, "k_rot")
    kp, vp = np_of(c["k_pool"]), np_of(c["v_pool"])
    kp0, vp0 = pools_before
    assert bits(kp[slots]) == bits(np_of(k_rot)) and bits(vp[slots]) == bits(np_of(c["v"]))
    rest = np.setdiff1d(np.arange(P), slots)
    assert bits(kp[rest]) == bits(kp0[rest]) and bits(vp[rest]) == bits(vp0[rest])


def new_seed():
    return int(RNG.integers(1 << 62))


def torch_call(dtype, seed=None):
    """Tensors with odd strides and storage offsets: q/k/v views of one fused
    QKV output, positions every other int64, slots at an offset, pools with
    a row stride of two rows; outputs given, poisoned, with gaps. The same
    seed gives the same call."""
    g = torch.Generator().manual_seed(new_seed() if seed is None else seed)
    tdt = TORCH_DTYPES[dtype]
    qkv = torch.randn(T, (HQ + 2 * HK) * D, generator=g).to(tdt)
    pos = torch.randint(0, 1 << 20, (2 * T,), generator=g)
    slots = torch.zeros(T + 3, dtype=torch.int32)
    slots[3:] = torch.randperm(P, generator=g)[:T].to(torch.int32)
    k_big = torch.randn(P, 2, HK, D, generator=g).to(tdt)
    v_big = torch.randn(P, 2, HK, D, generator=g).to(tdt)
    nan = float("nan")
    return dict(q=qkv[:, : HQ * D].view(T, HQ, D),
                k=qkv[:, HQ * D : (HQ + HK) * D].view(T, HK, D),
                v=qkv[:, (HQ + HK) * D :].view(T, HK, D),
                positions=pos[::2], slots=slots[3:],
                k_pool=k_big[:, 1], v_pool=v_big[:, 0],
                q_out=torch.full((T, HQ, 2 * D), nan, dtype=tdt)[:, :, D:],
                k_out=torch.full((T + 1, HK, D), nan, dtype=tdt)[1:])


def numpy_call(dtype, seed=None):
    """numpy arrays with negative and gapped strides, poisoned outputs."""
    rng = np.random.default_rng(new_seed() if seed is None else seed)
    ndt = NUMPY_DTYPES[dtype]
    a = lambda *s: rng.standard_normal(s).astype(np.float32).astype(ndt)  # noqa: E731
    return dict(q=a(T, HQ, D)[::-1], k=a(T, HK, 2 * D)[:, :, ::2], v=a(T, HK, D),
                positions=rng.integers(-(1 << 20), 1 << 20, 2 * T)[::-2],
                slots=rng.permutation(P)[:T].astype(np.int32),
                k_pool=a(P, HK, D), v_pool=a(2 * P, HK, D)[1::2],
                q_out=poison((T, HQ, D), ndt), k_out=poison((T, HK, 3 * D), ndt)[:, :, D : 2 * D])


MAKE = {"torch": torch_call, "numpy": numpy_call}


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("make", [torch_call, numpy_call], ids=["torch", "numpy"])
@pytest.mark.parametrize("outputs_given", [True, False], ids=["out-given", "out-new"])
def test_odd_strides_match_reference_and_general_path(make, dtype, outputs_given):
    seed = new_seed()
    c, general = make(dtype, seed), make(dtype, seed)
    before = (np_of(c["k_pool"]).copy(), np_of(c["v_pool"]).copy())
    out = dict(q_out=c["q_out"], k_out=c["k_out"]) if outputs_given else {}
    q_rot, k_rot, kp, vp = ropekv.rope_pool_fused(*args_of(c), **out, **KW)
    assert kp is c["k_pool"] and vp is c["v_pool"]
    if outputs_given:
        assert q_rot is c["q_out"] and k_rot is c["k_out"]
    else:
        assert type(q_rot) is type(c["q"]) and tuple(q_rot.shape) == tuple(c["q"].shape)
        assert np_of(q_rot).flags.c_contiguous and np_of(k_rot).flags.c_contiguous
    check_result(c, q_rot, k_rot, before)
    # The general path, on the same inputs, writes the same bits.
    g_out = dict(q_out=general["q_out"], k_out=general["k_out"]) if outputs_given else {}
    g = ropekv.rope_pool_fused(*args_of(general), **g_out, stream=0, **KW)
    for got, want in zip((q_rot, k_rot, kp, vp), g):
        assert bits(np_of(got)) == bits(np_of(want))
    # And the fast path did take the call (it returns None where it declines).
    again = make(dtype, seed)
    assert _ext.run_fast(*args_of(again), again["q_out"], again["k_out"], D, HQ, HK,
                         KW["rope_base"], None, True, None, 0, True) is not None


def test_mixed_numpy_and_torch_arrays():
    c = numpy_call("float32")
    c["k_pool"], c["v_pool"] = torch.from_numpy(c["k_pool"]), torch.from_numpy(c["v_pool"][::1])
    c["q"] = torch.from_numpy(np.ascontiguousarray(c["q"]))
    before = (np_of(c["k_pool"]).copy(), np_of(c["v_pool"]).copy())
    q_rot, k_rot, _, _ = ropekv.rope_pool_fused(*args_of(c), **KW)
    assert isinstance(q_rot, torch.Tensor) and isinstance(k_rot, np.ndarray)
    check_result(c, q_rot, k_rot, before)


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_no_tokens(framework):
    c = MAKE[framework]("bfloat16")
    for n in ("q", "k", "v", "positions", "slots"):
        c[n] = c[n][:0]
    before = snapshot((c["k_pool"], c["v_pool"]))
    q_rot, k_rot, _, _ = ropekv.rope_pool_fused(*args_of(c), **KW)
    assert tuple(q_rot.shape) == (0, HQ, D) and tuple(k_rot.shape) == (0, HK, D)
    assert snapshot((c["k_pool"], c["v_pool"])) == before


def test_tensors_that_require_grad_are_read_and_written_in_place():
    """As the general path does (through torch.utils.dlpack.to_dlpack): an
    input that requires grad is read in place (the outputs do not require
    grad: ropekv is not differentiable), and under torch.no_grad() so is a
    written array that requires grad."""
    seed = new_seed()
    c, general = torch_call("float32", seed), torch_call("float32", seed)
    for x in (c, general):
        x["q"] = x["q"].clone().requires_grad_()
        x["k_pool"] = x["k_pool"].clone().requires_grad_()
    with torch.no_grad():
        assert _ext.run_fast(*args_of(c), None, None, D, HQ, HK, KW["rope_base"], None, True,
                             None, 0, True) is not None
        c = torch_call("float32", seed)
        c["q"] = c["q"].clone().requires_grad_()
        c["k_pool"] = c["k_pool"].clone().requires_grad_()
        assert outcome(c, None) == outcome(general, 0)
    c = torch_call("float32", seed)
    c["q"] = c["q"].clone().requires_grad_()
    assert not any(x.requires_grad for x in ropekv.rope_pool_fused(*args_of(c), **KW)[:2])


@pytest.mark.parametrize("written", ["k_pool", "v_pool", "q_out", "k_out", "q", "k"])
@pytest.mark.parametrize("stream", [None, 0])
def test_writing_a_tensor_that_requires_grad_is_an_error_under_grad_mode(written, stream):
    """As PyTorch refuses an in-place op on a leaf that requires grad: ropekv
    cannot record its write for autograd. Nothing is written; under
    torch.no_grad() the same call runs."""
    seed = new_seed()
    c = torch_call("float32", seed)
    inplace = written in ("q", "k")
    c[written] = c[written].clone().requires_grad_()
    outs = {} if inplace else {"q_out": c["q_out"], "k_out": c["k_out"]}
    before = snapshot(args_of(c) + (c["q_out"], c["k_out"]))
    with pytest.raises(ValueError, match=rf"^{written} requires grad, and ropekv writes it in "
                                         rf"place, which autograd cannot record"):
        ropekv.rope_pool_fused(*args_of(c), **outs, inplace=inplace, stream=stream, **KW)
    assert snapshot(args_of(c) + (c["q_out"], c["k_out"])) == before
    with torch.no_grad():
        ropekv.rope_pool_fused(*args_of(c), **outs, inplace=inplace, stream=stream, **KW)
    assert snapshot(args_of(c) + (c["q_out"], c["k_out"])) != before


@pytest.mark.parametrize("written", ["k_pool", "v_pool", "q_out", "k_out", "q", "k"])
@pytest.mark.parametrize("grad", [False, True])
def test_writing_an_inference_tensor_outside_inference_mode_is_an_error(written, grad):
    """As PyTorch refuses an in-place op on an inference tensor outside
    torch.inference_mode() (with grad mode on or under torch.no_grad()): an
    engine that made its cache in inference mode calls there. Nothing is
    written; inside inference mode the same call runs, on both paths (a
    stream sends it down the general one)."""
    seed = new_seed()
    c = torch_call("float32", seed)
    inplace = written in ("q", "k")
    with torch.inference_mode():
        c[written] = c[written].clone()
    assert c[written].is_inference()
    outs = {} if inplace else {"q_out": c["q_out"], "k_out": c["k_out"]}
    before = snapshot(args_of(c) + (c["q_out"], c["k_out"]))
    for stream in (None, 0):
        with torch.set_grad_enabled(grad):
            with pytest.raises(ValueError, match=rf"^{written} is an inference tensor \(made under "
                                                 rf"torch.inference_mode\(\)\), which PyTorch"):
                ropekv.rope_pool_fused(*args_of(c), **outs, inplace=inplace, stream=stream, **KW)
        assert snapshot(args_of(c) + (c["q_out"], c["k_out"])) == before
    with pytest.raises(RuntimeError, match="inference tensor outside InferenceMode"):
        c[written].add_(1.0)  # (PyTorch's own rule, which the error follows)
    with torch.inference_mode(), torch.set_grad_enabled(grad):
        ropekv.rope_pool_fused(*args_of(c), **outs, inplace=inplace, **KW)
    assert snapshot(args_of(c) + (c["q_out"], c["k_out"])) != before


@pytest.mark.parametrize("stream", [None, 0])
def test_inference_mode_with_grad_mode_on_writes_what_pytorch_writes(stream):
    """Grad mode switched on inside torch.inference_mode(): PyTorch's in-place
    ops still update an inference tensor and a leaf that requires grad there
    (recording nothing), and so does the call."""
    for kind in ("inference", "requires_grad"):
        c = torch_call("float32", new_seed())
        if kind == "requires_grad":
            c["k_pool"] = c["k_pool"].clone().requires_grad_()
        with torch.inference_mode():
            if kind == "inference":
                c["k_pool"] = c["k_pool"].clone()
            before = c["k_pool"].detach().clone()
            with torch.enable_grad():
                ropekv.rope_pool_fused(*args_of(c), stream=stream, **KW)
                c["k_pool"].add_(0.0)  # (PyTorch's own in-place op, in the same modes)
            assert not torch.equal(c["k_pool"].detach(), before), kind


@pytest.mark.parametrize("stream", [None, 0])
@pytest.mark.parametrize("inplace", [False, True])
def test_written_tensors_have_their_version_bumped(stream, inplace):
    """What PyTorch's own in-place ops do: a backward pass through a tensor
    the call changed raises instead of using the new values; inference-mode
    tensors (no version counter) are written as well."""
    seed = new_seed()
    c = torch_call("float32", seed)
    a = c["q"].clone().requires_grad_()
    q = a * 1.0  # not a leaf; saved by the product below
    loss = (q * q).sum()
    c["q"] = q
    outs = {} if inplace else {"q_out": c["q_out"], "k_out": c["k_out"]}
    written = ([q, c["k"]] if inplace else [c["q_out"], c["k_out"]]) + [c["k_pool"], c["v_pool"]]
    before = [x._version for x in written]
    with torch.no_grad():  # (q requires grad: written in place only without grad mode)
        ropekv.rope_pool_fused(*args_of(c), **outs, inplace=inplace, stream=stream, **KW)
    assert all(x._version > b for x, b in zip(written, before))
    if inplace:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    plain = torch_call("float32", seed)
    with torch.inference_mode():
        d = torch_call("float32", seed)
        ropekv.rope_pool_fused(*args_of(d), stream=stream, **KW)
        assert d["k_pool"].is_inference()
    ropekv.rope_pool_fused(*args_of(plain), stream=stream, **KW)
    assert snapshot(args_of(d)) == snapshot(args_of(plain))
    # Normal tensors written inside inference mode: PyTorch's in-place ops
    # bump their versions there too.
    e = torch_call("float32", seed)
    written = [e["q_out"], e["k_out"], e["k_pool"], e["v_pool"]]
    before = [x._version for x in written]
    with torch.inference_mode():
        ropekv.rope_pool_fused(*args_of(e), q_out=e["q_out"], k_out=e["k_out"], stream=stream,
                               **KW)
    assert all(x._version > b for x, b in zip(written, before))


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_inplace(framework):
    seed = new_seed()
    c, general = MAKE[framework]("bfloat16", seed), MAKE[framework]("bfloat16", seed)
    q0, k0 = np_of(c["q"]).copy(), np_of(c["k"]).copy()
    res = ropekv.rope_pool_fused(*args_of(c), inplace=True, **KW)
    assert res[0] is c["q"] and res[1] is c["k"]
    ref_q, mag_q = rope(q0, np_of(c["positions"]).astype(np.int64), KW["rope_base"])
    assert_close(np_of(c["q"]), ref_q, mag_q, "q in place")
    g = ropekv.rope_pool_fused(*args_of(general), inplace=True, stream=0, **KW)
    for got, want in zip(res, g):
        assert bits(np_of(got)) == bits(np_of(want))
    assert bits(np_of(c["k"])) != bits(k0)


def test_int_rope_base_is_the_float():
    c = torch_call("float32")
    a = ropekv.rope_pool_fused(*args_of(c), **dict(KW, rope_base=500000))
    b = ropekv.rope_pool_fused(*args_of(c), **KW)
    assert bits(np_of(a[0])) == bits(np_of(b[0])) and bits(np_of(a[1])) == bits(np_of(b[1]))


# Errors the core raises through the fast path: the general path's messages,
# nothing written.
def e_pool_dtype(c):
    c["k_pool"] = c["k_pool"].to(torch.float16) if isinstance(c["k_pool"], torch.Tensor) \
        else c["k_pool"].astype(np.float16)


def e_qkv_dtype(c):
    c["v"] = c["v"].to(torch.bfloat16) if isinstance(c["v"], torch.Tensor) \
        else c["v"].astype(BF16)


def e_rank(c):
    c["q"] = c["q"][0]


def e_index_len(c):
    c["slots"] = c["slots"][:-1]


def e_slot_range(c):
    c["slots"][1] = P


def e_overlapping_output(c):
    c["q_out"] = c["q_out"][:1].expand(T, HQ, D) if isinstance(c["q_out"], torch.Tensor) \
        else np.broadcast_to(c["q_out"][:1], (T, HQ, D))


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("mutate", [e_pool_dtype, e_qkv_dtype, e_rank, e_index_len, e_slot_range,
                                    e_overlapping_output], ids=lambda f: f.__name__)
def test_errors_through_the_fast_path(framework, mutate):
    c = MAKE[framework]("float32")
    mutate(c)
    expect_same_error(c, KW)


def expect_same_error(c, kw):
    """The call raises the same ValueError on the fast path and on the
    general path (stream=0), with nothing written either time."""
    arrays = args_of(c)
    out = dict(q_out=c["q_out"], k_out=c["k_out"])
    before = snapshot(arrays + (c["q_out"], c["k_out"]))
    messages = []
    for stream in (None, 0):
        with pytest.raises(ValueError) as info:
            ropekv.rope_pool_fused(*arrays, **out, stream=stream, **kw)
        messages.append(str(info.value))
        assert snapshot(arrays + (c["q_out"], c["k_out"])) == before
    assert messages[0] == messages[1]


# Arguments the fast path declines (run_fast returns None, nothing written);
# ropekv.rope_pool_fused then behaves as the general path does.
def d_negative_bit(c):
    # z.conj().imag is a float32 view whose memory holds the values negated
    z = torch.complex(torch.zeros_like(c["q"]), c["q"].contiguous())
    c["q"] = z.conj().imag
    assert c["q"].is_neg()


def d_none_pool(c):
    c["v_pool"] = None


def d_none_head_dim(c):
    c["kw"] = dict(KW, head_dim=None)


def d_meta_pool(c):
    c["k_pool"] = torch.empty(tuple(c["k_pool"].shape), dtype=c["k_pool"].dtype, device="meta")


def d_zero_tensor_view(c):
    # A ZeroTensor has no storage: a view's data_ptr() is null plus its
    # offset, an address that must be neither read nor written.
    z = torch._efficientzerotensor((T + 1, HK, D), dtype=c["k"].dtype)[1:]
    assert z._is_zerotensor() and z.data_ptr() != 0
    c["k"] = z


def d_empty_zero_tensor(c):
    # No tokens and k an empty ZeroTensor: with no elements there is no
    # address to compare with the offset, so the tensor's flag decides.
    for n in ("q", "v", "positions", "slots", "q_out", "k_out"):
        c[n] = c[n][:0]
    c["k"] = torch._efficientzerotensor((0, HK, D), dtype=c["k"].dtype)


def d_zero_tensor_pool(c):
    c["v_pool"] = torch._efficientzerotensor((P + 1, HK, D), dtype=c["v_pool"].dtype)[1:]


def d_float64(c):
    c["q"], c["k"], c["v"] = (c[n].to(torch.float64) for n in "qkv")


def d_int16_slots(c):
    c["slots"] = c["slots"].to(torch.int16)


def d_parameter(c):
    c["k_pool"] = torch.nn.Parameter(c["k_pool"], requires_grad=False)


def d_sparse_positions(c):
    c["positions"] = c["positions"].to_sparse()


def d_four_dims(c):
    c["v"] = c["v"][None]


def d_byte_swapped(c):
    c["q"] = c["q"].astype(c["q"].dtype.newbyteorder())


def d_unaligned(c):
    raw = np.zeros(c["q"].nbytes + 1, np.uint8)[1:]
    q = raw.view(c["q"].dtype).reshape(c["q"].shape)
    q[...] = c["q"]
    c["q"] = q


def d_read_only_pool(c):
    c["v_pool"].flags.writeable = False


def d_read_only_output(c):
    c["k_out"].flags.writeable = False


def d_numpy_subclass(c):
    c["k"] = c["k"].view(np.recarray)


def d_strides_not_whole_elements(c):
    row = HK * D * 4 + 2  # bytes: a token's row starts 2 bytes past a float boundary
    c["v"] = np.ndarray((T, HK, D), np.float32, np.zeros(T * row, np.uint8), 0, (row, D * 4, 4))


def d_bool_head_dim(c):
    c["kw"] = dict(KW, head_dim=True)


def d_numpy_int_head_dim(c):
    c["kw"] = dict(KW, head_dim=np.int64(D))


def d_huge_head_dim(c):
    c["kw"] = dict(KW, head_dim=1 << 70)


def d_float_head_dim(c):
    c["kw"] = dict(KW, head_dim=float(D))


TORCH_DECLINED = [d_negative_bit, d_zero_tensor_view, d_zero_tensor_pool, d_empty_zero_tensor,
                  d_meta_pool, d_none_pool, d_none_head_dim, d_float64,
                  d_int16_slots, d_parameter, d_sparse_positions, d_four_dims, d_bool_head_dim,
                  d_numpy_int_head_dim, d_huge_head_dim, d_float_head_dim]
NUMPY_DECLINED = [d_byte_swapped, d_unaligned, d_read_only_pool, d_read_only_output,
                  d_numpy_subclass, d_strides_not_whole_elements, d_four_dims]


def outcome(c, stream):
    """(q_rot, k_rot, k_pool, v_pool) bits, or the error's type and message."""
    try:
        r = ropekv.rope_pool_fused(*args_of(c), q_out=c["q_out"], k_out=c["k_out"],
                                   stream=stream, **c.get("kw", KW))
    except Exception as e:  # noqa: BLE001 - the general path's error, whatever it is
        return type(e), str(e)
    return tuple(bits(np_of(x)) for x in r)


@pytest.mark.parametrize("framework,mutate",
                         [("torch", f) for f in TORCH_DECLINED]
                         + [("numpy", f) for f in NUMPY_DECLINED],
                         ids=lambda x: x if isinstance(x, str) else x.__name__)
def test_declined_arguments_take_the_general_path(framework, mutate):
    seed = new_seed()
    c, general = MAKE[framework]("float32", seed), MAKE[framework]("float32", seed)
    mutate(c)
    mutate(general)
    arrays = args_of(c) + (c["q_out"], c["k_out"])
    before = snapshot(arrays)
    kw = c.get("kw", KW)
    assert _ext.run_fast(*arrays, kw["head_dim"], HQ, HK, kw["rope_base"], None, True, None, 0,
                         True) is None
    assert snapshot(arrays) == before
    # The default call ends as the general path does on the same inputs.
    assert outcome(c, None) == outcome(general, 0)


# is_neox and rope_scaling (the options of most model configs) also take the
# fast path; the general path (tested against the float64 reference in
# test_options.py) is the oracle, bit for bit.
FREQ_OPTIONS = {
    "interleaved": dict(is_neox=False),
    "llama3": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192}),
    "yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 32768}),
    "linear-json-interleaved": dict(is_neox=False,
                                    rope_scaling='{"type": "linear", "factor": 2.0}'),
    # transformers 5's rope_parameters: rotary_dim from partial_rotary_factor
    "rope-parameters-partial": dict(rope_scaling={"rope_type": "default", "rope_theta": 500000.0,
                                                  "partial_rotary_factor": 0.5}),
}


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("make", [torch_call, numpy_call], ids=["torch", "numpy"])
@pytest.mark.parametrize("opts", list(FREQ_OPTIONS))
def test_is_neox_and_rope_scaling_match_general_path(make, dtype, opts):
    seed = new_seed()
    kw = dict(KW, **FREQ_OPTIONS[opts])
    c, general = make(dtype, seed), make(dtype, seed)
    got = ropekv.rope_pool_fused(*args_of(c), q_out=c["q_out"], k_out=c["k_out"], **kw)
    want = ropekv.rope_pool_fused(*args_of(general), q_out=general["q_out"],
                                  k_out=general["k_out"], stream=0, **kw)
    for g, w in zip(got, want):
        assert bits(np_of(g)) == bits(np_of(w))
    assert not np.isnan(np_of(got[0]).astype(np.float32)).any()  # every element written
    again = make(dtype, seed)
    scaling, theta, factor = ropekv._rope_parameters(kw.get("rope_scaling"))
    rotary_dim = ropekv._rotary_dim_for(theta, factor, KW["rope_base"], None, D)
    assert _ext.run_fast(*args_of(again), again["q_out"], again["k_out"], D, HQ, HK,
                         KW["rope_base"], rotary_dim, kw.get("is_neox", True), scaling, 0,
                         True) is not None


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("bad", [{"rope_type": "dynamic", "factor": 2.0},
                                 {"rope_type": "llama3", "factor": 8.0},
                                 {"rope_type": "linear", "factor": -1.0},
                                 "{not json", 3.0],
                         ids=["unknown-type", "missing-field", "bad-factor", "bad-json",
                              "not-a-dict"])
def test_bad_rope_scaling_raises_the_general_paths_error(framework, bad):
    expect_same_error(MAKE[framework]("float32"), dict(KW, rope_scaling=bad))


def test_rope_scaling_text_that_is_not_json_names_the_argument():
    with pytest.raises(ValueError, match=r"^rope_scaling text is not JSON \(Expecting value at "
                                         r"character 0\): pass a dict, its JSON text"):
        ropekv._rope_parameters("{not json"[1:])
    with pytest.raises(ValueError, match=r"^rope_scaling text is not JSON"):
        ropekv.rope_inv_freq(16, 1e4, None, "linear")


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("none", ["default", " default ", "null", '{"rope_type": "default"}'])
def test_rope_scaling_text_for_plain_rope(framework, none):
    """The bare string "default", JSON null and a "default" rope_type mean
    plain RoPE: the same bits as rope_scaling=None."""
    seed = new_seed()
    c, plain = MAKE[framework]("float32", seed), MAKE[framework]("float32", seed)
    got = ropekv.rope_pool_fused(*args_of(c), q_out=c["q_out"], k_out=c["k_out"],
                                 **dict(KW, rope_scaling=none))
    want = ropekv.rope_pool_fused(*args_of(plain), q_out=plain["q_out"], k_out=plain["k_out"],
                                  **KW)
    for g, w in zip(got, want):
        assert bits(np_of(g)) == bits(np_of(w))
    for g, w in zip(ropekv.rope_inv_freq(16, 1e4, None, none), ropekv.rope_inv_freq(16, 1e4)):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_remembered_rope_scaling_is_exact(framework, monkeypatch):
    """The fast path remembers parsed rope_scaling dicts by their items and
    the items' types: a dict equal to one seen before but with True for 1
    still raises; a mutated dict is parsed again; a float zero or NaN, or a
    value of a subclass, is never kept; and the memory is bounded."""
    run = MAKE[framework]
    seed = new_seed()
    c = run("float32", seed)
    ropekv.rope_pool_fused(*args_of(c), **KW)  # (the first PyTorch call sets the fast path up)
    monkeypatch.setattr(ropekv, "_SCALING_SEEN", {})
    good = {"rope_type": "linear", "factor": 1}
    ropekv.rope_pool_fused(*args_of(c), **dict(KW, rope_scaling=good))
    assert len(ropekv._SCALING_SEEN) == 1
    expect_same_error(run("float32"), dict(KW, rope_scaling={"rope_type": "linear",
                                                             "factor": True}))
    # The same dict object, changed: parsed again (to numbers the contract
    # check then rejects, on every call).
    good["factor"] = -2
    expect_same_error(run("float32"), dict(KW, rope_scaling=good))
    assert len(ropekv._SCALING_SEEN) == 2
    # Equal results for an equal dict seen before, bit for bit against the
    # general path.
    again, general = run("float32", seed), run("float32", seed)
    seen = {"rope_type": "linear", "factor": 1}
    got = ropekv.rope_pool_fused(*args_of(again), q_out=again["q_out"], k_out=again["k_out"],
                                 **dict(KW, rope_scaling=seen))
    want = ropekv.rope_pool_fused(*args_of(general), q_out=general["q_out"],
                                  k_out=general["k_out"], stream=0,
                                  **dict(KW, rope_scaling=seen))
    for g, w in zip(got, want):
        assert bits(np_of(g)) == bits(np_of(w))
    # -0.0 prints as such in the error; NaN never matches: neither is kept.
    for factor in (-0.0, 0.0, float("nan")):
        expect_same_error(run("float32"), dict(KW, rope_scaling={"rope_type": "linear",
                                                                 "factor": factor}))
    assert len(ropekv._SCALING_SEEN) == 2
    # A value of a float subclass is never kept: its own equality and hash
    # need not tell different values apart.
    class Same(float):
        def __eq__(self, other):
            return isinstance(other, Same)

        def __hash__(self):
            return 7

    got = [ropekv._rope_parameters_seen({"rope_type": "linear", "factor": Same(f)})[0][1]
           for f in (2.0, 3.0)]
    assert got == [2.0, 3.0] and len(ropekv._SCALING_SEEN) == 2
    # An int zero or False is kept (yarn's truncate=False).
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
            "truncate": False}
    assert ropekv._rope_parameters_seen(yarn) == ropekv._rope_parameters(yarn)
    assert len(ropekv._SCALING_SEEN) == 3
    for i in range(2 * ropekv._SCALING_SEEN_MAX):
        ropekv._rope_parameters_seen({"rope_type": "linear", "factor": 1.0 + i})
    assert len(ropekv._SCALING_SEEN) == ropekv._SCALING_SEEN_MAX


@pytest.mark.parametrize("is_neox", [np.bool_(False), 0, None], ids=repr)
def test_is_neox_not_a_bool_is_declined(is_neox):
    """The general path decides what a non-bool is_neox means."""
    seed = new_seed()
    c = torch_call("float32", seed)
    before = snapshot(args_of(c) + (c["q_out"], c["k_out"]))
    assert _ext.run_fast(*args_of(c), c["q_out"], c["k_out"], D, HQ, HK, KW["rope_base"], None,
                         is_neox, None, 0, True) is None
    assert snapshot(args_of(c) + (c["q_out"], c["k_out"])) == before
    general = torch_call("float32", seed)
    assert outcome(dict(c, kw=dict(KW, is_neox=is_neox)), None) == \
        outcome(dict(general, kw=dict(KW, is_neox=is_neox)), 0)


ROWS = 64  # cos_sin_cache rows: positions of these calls are below it


def table_and_norm_options(framework, dtype, which, rng):
    """Options the fast path reads in place (besides is_neox / rope_scaling),
    as arrays of the call's framework: a cos_sin_cache (float32 or q's dtype,
    full or half width: rotary_dim then comes from its width), QK-norm
    weights (q's dtype or float32) with norm_eps, or a mix."""
    def arr(shape, dt):
        x = rng.standard_normal(shape).astype(np.float32)
        if framework == "torch":
            return torch.from_numpy(x).to(TORCH_DTYPES[dt])
        return x.astype(NUMPY_DTYPES[dt])
    table = lambda width, dt: arr((ROWS, width), dt)  # noqa: E731
    return {
        "table-f32": lambda: dict(cos_sin_cache=table(D, "float32")),
        "table-q-dtype": lambda: dict(cos_sin_cache=table(D, dtype)),
        "table-half-width": lambda: dict(cos_sin_cache=table(D // 2, "float32")),
        "qk-norm": lambda: dict(q_norm_weight=arr((D,), dtype), k_norm_weight=arr((D,), "float32"),
                                norm_eps=1e-5),
        "q-norm-only": lambda: dict(q_norm_weight=arr((D,), dtype)),
        "table-norm-interleaved": lambda: dict(cos_sin_cache=table(D, "float32"),
                                               k_norm_weight=arr((D,), dtype), is_neox=False),
    }[which]()


def positions_below(c, framework, rows, rng):
    """c with positions drawn below `rows` (a cos_sin_cache's rows), every
    other element of an int64 array, the last one rows - 1."""
    pos = rng.integers(0, rows, 2 * T)
    pos[-2] = rows - 1
    c["positions"] = (torch.from_numpy(pos) if framework == "torch" else pos)[::2]
    return c


TABLE_NORM = ["table-f32", "table-q-dtype", "table-half-width", "qk-norm", "q-norm-only",
              "table-norm-interleaved"]


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("which", TABLE_NORM)
def test_cos_sin_cache_and_qk_norm_match_general_path(framework, dtype, which):
    """cos_sin_cache and the QK-norm weights are read in place too: the fast
    path's results are the general path's, bit for bit, and it took the call."""
    seed = new_seed()
    calls = []
    for _ in range(3):  # fast path, general path, run_fast itself
        rng = np.random.default_rng(seed)
        c = positions_below(MAKE[framework](dtype, seed), framework, ROWS, rng)
        calls.append((c, table_and_norm_options(framework, dtype, which, rng)))
    (c, opts), (general, gopts), (again, aopts) = calls
    got = ropekv.rope_pool_fused(*args_of(c), q_out=c["q_out"], k_out=c["k_out"], **KW, **opts)
    want = ropekv.rope_pool_fused(*args_of(general), q_out=general["q_out"],
                                  k_out=general["k_out"], stream=0, **KW, **gopts)
    for g, w in zip(got, want):
        assert bits(np_of(g)) == bits(np_of(w))
    assert not np.isnan(np_of(got[0]).astype(np.float32)).any()  # every element written
    is_neox = aopts.pop("is_neox", True)
    assert _ext.run_fast(*args_of(again), again["q_out"], again["k_out"], D, HQ, HK,
                         KW["rope_base"], None, is_neox, None, 0, True, **aopts) is not None


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("bad", ["position-outside-table", "table-too-wide", "weight-length",
                                 "negative-eps", "table-with-scaling"])
def test_table_and_norm_errors_are_the_general_paths(framework, bad):
    seed = new_seed()
    rng = np.random.default_rng(seed)
    c = MAKE[framework]("float32", seed)
    c = positions_below(c, framework, ROWS, rng)
    opts = table_and_norm_options(framework, "float32", "table-f32", rng)
    if bad == "position-outside-table":  # the last position is ROWS - 1
        opts["cos_sin_cache"] = opts["cos_sin_cache"][: ROWS - 1]
    elif bad == "table-too-wide":
        opts["cos_sin_cache"] = (torch.ones(ROWS, 2 * D) if framework == "torch"
                                 else np.ones((ROWS, 2 * D), np.float32))
    elif bad == "weight-length":
        opts = table_and_norm_options(framework, "float32", "qk-norm", rng)
        opts["k_norm_weight"] = opts["k_norm_weight"][: D - 2]
    elif bad == "negative-eps":
        opts = table_and_norm_options(framework, "float32", "qk-norm", rng)
        opts["norm_eps"] = -1.0
    else:
        opts["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    expect_same_error(c, dict(KW, **opts))


def freed(x, offset=0):
    """A view of x's values at storage offset `offset` (elements), its storage
    then freed (resized to 0 bytes, as FSDP does)."""
    big = torch.empty(offset + x.numel(), dtype=x.dtype)
    view = big[offset:].view(x.shape)
    view.copy_(x)
    big.untyped_storage().resize_(0)
    return view


@pytest.mark.parametrize("which", ["cos_sin_cache", "q_norm_weight", "k_norm_weight", "v",
                                   "slots", "k_pool"])
@pytest.mark.parametrize("shape_error", [False, True], ids=["alone", "with-shape-error"])
def test_freed_storage_raises_the_same_error_first_on_both_paths(which, shape_error):
    """A freed tensor, even 0-d (which an absent option also is) or next to
    another contract error, raises the same error on both paths, nothing
    written."""
    seed = new_seed()
    rng = np.random.default_rng(seed)
    c = positions_below(torch_call("float32", seed), "torch", ROWS, rng)
    opts = {"cos_sin_cache": torch.randn(ROWS, D), "q_norm_weight": torch.randn(D),
            "k_norm_weight": torch.randn(D)}
    if which in opts:
        opts[which] = freed(torch.tensor(1.0) if which != "cos_sin_cache" else opts[which], 3)
    else:
        c[which] = freed(c[which], 5)
    kw = dict(KW, num_qo_heads=HQ + 1) if shape_error else KW
    live = [a for n, a in c.items() if n not in (which, "kw")]  # (freed memory is not read)
    for stream in (None, 0):
        before = snapshot(live)
        with pytest.raises(ValueError, match=rf"^{which} has no data pointer"):
            ropekv.rope_pool_fused(*args_of(c), q_out=c["q_out"], k_out=c["k_out"],
                                   stream=stream, **kw, **opts)
        assert snapshot(live) == before


def test_freed_storage_at_an_offset_of_4_gib_raises():
    """data_ptr() is then 4 GiB: not a small address, still no memory."""
    c = torch_call("float32")
    big = torch.empty((1 << 30) + P * HK * D)  # 4 GiB of address space, never touched
    pool = big[1 << 30:].view(P, HK, D)
    big.untyped_storage().resize_(0)
    assert pool.data_ptr() == 1 << 32
    for stream in (None, 0):
        with pytest.raises(ValueError, match=r"^k_pool has no data pointer"):
            ropekv.rope_pool_fused(c["q"], c["k"], c["v"], c["positions"], c["slots"], pool,
                                   c["v_pool"], stream=stream, **KW)


@pytest.mark.parametrize("which", ["q", "v", "cos_sin_cache", "q_norm_weight"])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_negative_bit_is_an_error_not_a_wrong_result(which, requires_grad):
    """torch._neg_view(x) holds x's memory and reads as -x: its memory must
    not be taken for its values."""
    seed = new_seed()
    rng = np.random.default_rng(seed)
    c = positions_below(torch_call("float32", seed), "torch", ROWS, rng)
    opts = {"cos_sin_cache": torch.randn(ROWS, D), "q_norm_weight": torch.randn(D)}
    x = (opts if which in opts else c)[which]
    x = torch._neg_view(x.detach().clone().requires_grad_(requires_grad))
    (opts if which in opts else c)[which] = x
    assert x.is_neg()
    for stream in (None, 0):
        before = snapshot(args_of(c)[5:] + (c["q_out"], c["k_out"]))
        with pytest.raises(ValueError, match=rf"^{which} has PyTorch's negative bit set"):
            ropekv.rope_pool_fused(*args_of(c), q_out=c["q_out"], k_out=c["k_out"],
                                   stream=stream, **KW, **opts)
        assert snapshot(args_of(c)[5:] + (c["q_out"], c["k_out"])) == before


@pytest.mark.parametrize("eps", [float("nan"), -1.0, float("inf")])
@pytest.mark.parametrize("weights", [False, True])
def test_bad_norm_eps_raises_on_both_paths_with_or_without_weights(eps, weights):
    opts = dict(norm_eps=eps)
    if weights:
        opts["q_norm_weight"] = torch.randn(D)
    expect_same_error(torch_call("float32"), dict(KW, **opts))


@pytest.mark.parametrize("name,value", [("norm_eps", None), ("rope_base", None),
                                        ("rope_base", "base"), ("k_scale", [1.0])])
def test_a_scalar_that_is_not_a_number_is_a_value_error_on_both_paths(name, value):
    kw = dict(KW, **{name: value})
    c = torch_call("float32")
    if name == "norm_eps":
        kw["q_norm_weight"] = torch.randn(D)
    if name == "k_scale":  # (scales apply to fp8 pools)
        kw["kv_cache_dtype"] = "fp8_e4m3"
        c["k_pool"] = torch.zeros(P, HK, D, dtype=torch.uint8)
        c["v_pool"] = torch.zeros(P, HK, D, dtype=torch.uint8)
    expect_same_error(c, kw)
    with pytest.raises(ValueError, match="^" + re.escape(f"{name} must be a number, got {value!r}")):
        ropekv.rope_pool_fused(*args_of(c), q_out=c["q_out"], k_out=c["k_out"], **kw)


@pytest.mark.parametrize("name", ["rope_base", "k_scale", "v_scale"])
def test_an_int_beyond_a_double_is_a_value_error_on_both_paths(name):
    kw = dict(KW, **{name: 10 ** 400})
    c = torch_call("float32")
    if name != "rope_base":
        kw["kv_cache_dtype"] = "fp8_e4m3"
        c["k_pool"] = torch.zeros(P, HK, D, dtype=torch.uint8)
        c["v_pool"] = torch.zeros(P, HK, D, dtype=torch.uint8)
    expect_same_error(c, kw)
    with pytest.raises(ValueError, match=f"^{name} is too large for a float, got 1000"):
        ropekv.rope_pool_fused(*args_of(c), q_out=c["q_out"], k_out=c["k_out"], **kw)


@pytest.mark.parametrize("stream", [None, 0])
@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("error", ["fp8_e5m2", "heads", "none"])
def test_outputs_too_large_to_make_fail_alike_on_both_paths(framework, error, stream):
    """q_rot / k_rot are made before the contract's checks (as documented):
    with inputs of 2^40 tokens (zero-stride views, no memory) whose outputs
    cannot be allocated, the call raises the allocation's error on both
    paths (stream=0: the general one), whether or not it also breaks the
    contract, and writes nothing."""
    n = 1 << 40
    if framework == "torch":
        z = lambda *s: torch.zeros((1,) + s[1:]).expand(*s)  # noqa: E731
        c = dict(positions=torch.zeros(1, dtype=torch.int64).expand(n),
                 slots=torch.zeros(1, dtype=torch.int64).expand(n))
        pool = lambda dt: torch.zeros(P, HK, D, dtype=dt)  # noqa: E731
        f8, f32 = torch.float8_e4m3fn, torch.float32
    else:
        import ml_dtypes
        z = lambda *s: np.broadcast_to(np.zeros((1,) + s[1:], np.float32), s)  # noqa: E731
        c = dict(positions=np.broadcast_to(np.zeros(1, np.int64), (n,)),
                 slots=np.broadcast_to(np.zeros(1, np.int64), (n,)))
        pool = lambda dt: np.zeros((P, HK, D), dt)  # noqa: E731
        f8, f32 = ml_dtypes.float8_e4m3fn, np.float32
    c.update(q=z(n, HQ, D), k=z(n, HK, D), v=z(n, HK, D))
    kw = dict(KW)
    if error == "fp8_e5m2":
        c.update(k_pool=pool(f8), v_pool=pool(f8))
        kw.update(kv_cache_dtype="fp8_e5m2", k_scale=0.5, v_scale=0.5)
    else:
        c.update(k_pool=pool(f32), v_pool=pool(f32))
        if error == "heads":
            kw.update(num_kv_heads=HK + 1)
    before = snapshot((c["k_pool"], c["v_pool"]))
    with pytest.raises((MemoryError, RuntimeError)):
        ropekv.rope_pool_fused(*args_of(c), stream=stream, **kw)
    assert snapshot((c["k_pool"], c["v_pool"])) == before


def byte_swapped(x):
    return x.astype(x.dtype.newbyteorder())


def byte_strided(x):
    """x's values in a field of a packed record: strides of 1 + itemsize bytes."""
    rec = np.zeros(x.shape, dtype=[("pad", "u1"), ("x", x.dtype)])
    rec["x"] = x
    return rec["x"]


@pytest.mark.parametrize("which", ["q", "k_pool", "cos_sin_cache"])
@pytest.mark.parametrize("layout", [byte_swapped, byte_strided], ids=lambda f: f.__name__)
def test_numpy_layouts_dlpack_cannot_describe_raise_value_error(which, layout):
    """A byte-swapped dtype or strides that are not whole elements: the same
    ValueError on both paths (not the binding's TypeError), nothing written."""
    seed = new_seed()
    rng = np.random.default_rng(seed)
    c = positions_below(numpy_call("float32", seed), "numpy", ROWS, rng)
    opts = {"cos_sin_cache": rng.standard_normal((ROWS, D)).astype(np.float32)}
    if which in opts:
        opts[which] = layout(opts[which])
    else:
        c[which] = layout(c[which])
    bad = opts[which] if which in opts else c[which]
    assert not bad.dtype.isnative or any(st % bad.dtype.itemsize for st in bad.strides)
    expect_same_error(c, dict(KW, **opts))
    with pytest.raises(ValueError, match=rf"^{which} has (a byte-swapped dtype|strides)"):
        ropekv.rope_pool_fused(*args_of(c), q_out=c["q_out"], k_out=c["k_out"], **KW, **opts)


# ---------------------------------------------------------------- pool formats

POOL_FORMATS = ["fp8_e4m3", "fp8_e5m2", "fp8_e4m3 as uint8", "float32"]


def raw(x):
    """The bytes of an array (numpy or a CPU tensor, fp8 included)."""
    return np.ascontiguousarray(np_of(x)).tobytes()


def with_pool_format(c, framework, fmt, rng):
    """c with pools of the format (row stride of two rows, random contents:
    fp8 bytes of every pattern), typed as the framework's fp8 dtype, as raw
    uint8 bytes, or float32."""
    kind = fmt.split()[0]
    for name in ("k_pool", "v_pool"):
        if kind == "float32":
            x = rng.standard_normal((P, 2, HK, D)).astype(np.float32)[:, 1]
        else:
            x = rng.integers(0, 256, (P, 2, HK, D), dtype=np.uint8)[:, 1]
            if "uint8" not in fmt:
                x = x.view(getattr(__import__("ml_dtypes"), {"fp8_e4m3": "float8_e4m3fn",
                                                             "fp8_e5m2": "float8_e5m2"}[kind]))
        if framework == "torch":
            t = torch.from_numpy(x.view(np.uint8) if x.dtype.itemsize == 1 else x)
            if kind != "float32" and "uint8" not in fmt:
                t = t.view({"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kind])
            x = t
        c[name] = x
    return dict(KW, kv_cache_dtype=kind, **({} if kind == "float32"
                                             else dict(k_scale=0.75, v_scale=2)))


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("fmt", POOL_FORMATS)
def test_pool_formats_match_general_path(framework, dtype, fmt):
    """fp8 pools (typed, or as raw uint8 bytes as vLLM keeps them) and float32
    pools are read in place too: the fast path writes the general path's
    bytes, leaves every other row as it was, and took the call."""
    seed = new_seed()
    calls = []
    for _ in range(3):  # fast path, general path, run_fast itself
        rng = np.random.default_rng(seed)
        c = MAKE[framework](dtype, seed)
        calls.append((c, with_pool_format(c, framework, fmt, rng)))
    (c, kw), (general, gkw), (again, akw) = calls
    before = raw(c["k_pool"])
    got = ropekv.rope_pool_fused(*args_of(c), q_out=c["q_out"], k_out=c["k_out"], **kw)
    want = ropekv.rope_pool_fused(*args_of(general), q_out=general["q_out"],
                                  k_out=general["k_out"], stream=0, **gkw)
    assert got[2] is c["k_pool"] and got[3] is c["v_pool"]
    for g, w in zip(got, want):
        assert raw(g) == raw(w)
    assert raw(c["k_pool"]) != before
    slots = np_of(c["slots"]).astype(np.int64)
    rest = np.setdiff1d(np.arange(P), slots)
    kp0 = np.frombuffer(before, np.uint8).reshape(P, -1)
    assert (np.frombuffer(raw(c["k_pool"]), np.uint8).reshape(P, -1)[rest] == kp0[rest]).all()
    kv = {"fp8_e4m3": 2, "fp8_e5m2": 3, "float32": 1}[akw["kv_cache_dtype"]]
    assert _ext.run_fast(*args_of(again), again["q_out"], again["k_out"], D, HQ, HK,
                         KW["rope_base"], None, True, None, 0, True,
                         kv_cache_dtype=kv, k_scale=akw.get("k_scale", 1.0),
                         v_scale=akw.get("v_scale", 1.0)) is not None


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("bad", ["typed-pool-other-kind", "typed-pool-auto", "uint8-pool-auto",
                                 "zero-scale", "nan-scale", "scale-without-fp8",
                                 "fp8-typed-q", "float32-pool-fp8-kind", "unknown-kind"])
def test_pool_format_errors_are_the_general_paths(framework, bad):
    seed = new_seed()
    rng = np.random.default_rng(seed)
    c = MAKE[framework]("bfloat16", seed)
    kw = with_pool_format(c, framework, "fp8_e4m3", rng)
    if bad == "typed-pool-other-kind":
        kw["kv_cache_dtype"] = "fp8_e5m2"
    elif bad == "typed-pool-auto":
        kw = KW
    elif bad == "uint8-pool-auto":
        kw = with_pool_format(c, framework, "fp8_e4m3 as uint8", rng)
        kw = KW
    elif bad == "zero-scale":
        kw["k_scale"] = 0.0
    elif bad == "nan-scale":
        kw["v_scale"] = float("nan")
    elif bad == "scale-without-fp8":
        kw = dict(with_pool_format(c, framework, "float32", rng), k_scale=0.5)
    elif bad == "fp8-typed-q":
        c["q"] = (c["q"].to(torch.float8_e4m3fn) if framework == "torch"
                  else c["q"].astype(__import__("ml_dtypes").float8_e4m3fn))
    elif bad == "float32-pool-fp8-kind":
        kw = dict(with_pool_format(c, framework, "float32", rng), kv_cache_dtype="fp8_e4m3")
    else:
        kw["kv_cache_dtype"] = "fp16"
    expect_same_error(c, kw)


def _huge_page_advised(ptr, nbytes):
    """Whether a mapping inside [ptr, ptr + nbytes) carries MADV_HUGEPAGE
    ("hg" in /proc/self/smaps' VmFlags)."""
    vma, flags = None, []
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                vma = (lo, hi) if lo < ptr + nbytes and hi > ptr else None
            elif vma is not None and head == "VmFlags:":
                flags.append("hg" in line.split()[1:])
    return any(flags)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
@pytest.mark.parametrize("general", [False, True], ids=["fast", "general"])
def test_large_cpu_outputs_ask_for_huge_pages(general):
    """q_rot and k_rot of 4 MiB or more that the call makes (PyTorch CPU
    tensors) carry MADV_HUGEPAGE, as numpy's own arrays do, so the call's
    first write faults one 2 MiB page at a time. Results are the float64
    reference's."""
    Tb, Hq, Hk, Db = 2048, 8, 4, 128  # q_rot 8 MiB, k_rot 4 MiB (float32)
    q = torch.from_numpy(RNG.standard_normal((Tb, Hq, Db), dtype=np.float32))
    k = torch.from_numpy(RNG.standard_normal((Tb, Hk, Db), dtype=np.float32))
    v = torch.from_numpy(RNG.standard_normal((Tb, Hk, Db), dtype=np.float32))
    pos = torch.from_numpy(RNG.integers(0, 1 << 20, Tb))
    slots = torch.from_numpy(RNG.permutation(Tb + 5)[:Tb])
    k_pool = torch.from_numpy(RNG.standard_normal((Tb + 5, Hk, Db), dtype=np.float32))
    v_pool = torch.from_numpy(RNG.standard_normal((Tb + 5, Hk, Db), dtype=np.float32))
    extra = dict(stream=0) if general else {}
    q_rot, k_rot, _, _ = ropekv.rope_pool_fused(q, k, v, pos, slots, k_pool, v_pool, head_dim=Db,
                                                num_qo_heads=Hq, num_kv_heads=Hk,
                                                rope_base=10000.0, **extra)
    for out in (q_rot, k_rot):
        assert _huge_page_advised(out.data_ptr(), out.nbytes), "no MADV_HUGEPAGE on the output"
    for got, x, name in ((q_rot, q, "q_rot"), (k_rot, k, "k_rot")):
        want, mag = rope(x.numpy().astype(np.float64), pos.numpy(), 10000.0, Db)
        assert_close(got.numpy(), want, mag, name)
