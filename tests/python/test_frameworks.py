"""Arrays of every framework that installs here: PyTorch CPU tensors and MLX
arrays in and out (the caller's array type back, pools written in place,
never through a conversion copy), and calls from several threads at once."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import ropekv
from reference import BF16, assert_close, bits, poison, rope

RNG = np.random.default_rng()
TORCH_DTYPES = {"float32": (torch.float32, np.float32), "float16": (torch.float16, np.float16),
                "bfloat16": (torch.bfloat16, BF16)}


def as_numpy(t):
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_torch_cpu_tensors(dtype):
    tdt, _ = TORCH_DTYPES[dtype]
    T, Hq, Hk, D, P = 13, 8, 2, 64, 40
    qkv = torch.randn(T, (Hq + 2 * Hk) * D).to(tdt)  # fused projection output
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
    v = qkv[:, (Hq + Hk) * D :].view(T, Hk, D)
    pos = torch.randint(0, 1 << 24, (T,))  # int64, PyTorch's default
    slots = torch.randperm(P)[:T]
    k_pool, v_pool = torch.randn(P, Hk, D).to(tdt), torch.randn(P, Hk, D).to(tdt)
    k0, v0 = k_pool.clone(), v_pool.clone()
    q_rot, k_rot, kp, vp = ropekv.rope_pool_fused(
        q, k, v, pos, slots, k_pool, v_pool, head_dim=D, num_qo_heads=Hq, num_kv_heads=Hk,
        rope_base=500000.0)
    assert isinstance(q_rot, torch.Tensor) and q_rot.dtype == tdt and q_rot.shape == q.shape
    assert kp is k_pool and vp is v_pool
    ref, mag = rope(as_numpy(q), pos.numpy(), 500000.0)
    assert_close(as_numpy(q_rot), ref, mag, "q_rot")
    assert torch.equal(k_pool[slots], k_rot) and torch.equal(v_pool[slots], v)
    rest = torch.ones(P, dtype=torch.bool)
    rest[slots] = False
    assert torch.equal(k_pool[rest], k0[rest]) and torch.equal(v_pool[rest], v0[rest])


def test_torch_float32_pool_with_bf16_inputs_is_an_error_not_a_copy():
    T, H, D = 3, 2, 16
    q = torch.randn(T, H, D, dtype=torch.bfloat16)
    pool = torch.zeros(4, H, D)
    with pytest.raises(ValueError, match=r"^pool dtypes must match q/k/v dtype.*\.to\(q\.dtype\)"):
        ropekv.rope_pool_fused(q, q, q, torch.arange(T), torch.arange(T), pool, pool.clone(),
                               head_dim=D, num_qo_heads=H, num_kv_heads=H, rope_base=1e4)
    assert torch.count_nonzero(pool) == 0


def test_torch_meta_tensor_is_named_as_such():
    """A tensor on PyTorch's meta device has a shape and no memory: the error
    says so (not "no data pointer"), and nothing is written."""
    T, H, D = 3, 2, 16
    q = torch.randn(T, H, D)
    k_pool = torch.randn(4, H, D)
    k0 = k_pool.clone()
    with pytest.raises(ValueError, match=r"^v_pool is on PyTorch's meta device"):
        ropekv.rope_pool_fused(q, q, q, torch.arange(T), torch.arange(T), k_pool,
                               torch.empty(4, H, D, device="meta"), head_dim=D, num_qo_heads=H,
                               num_kv_heads=H, rope_base=1e4)
    assert bits(k_pool.numpy()) == bits(k0.numpy())


@pytest.mark.parametrize("stream", [None, 0])  # the binding's fast path, and the general path
@pytest.mark.parametrize("offset", [0, 3])  # rows before the view in its storage
@pytest.mark.parametrize("which", ["k_pool", "v_pool", "q_out"])
def test_torch_tensor_without_memory_is_an_error_not_a_lost_write(which, offset, stream):
    """A tensor whose storage was freed (resized to 0 bytes, as FSDP does)
    still reports its shape; a numpy view of it would be a fresh array of
    numpy's own, and the writes would land there. Its data_ptr() is null, or
    null plus the view's offset (a small address, not memory). It must raise
    instead, with nothing written to the other arrays."""
    T, H, D = 3, 2, 16
    g = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 62)))
    q = torch.randn(T, H, D, generator=g)
    arrays = {"k_pool": torch.randn(offset + 4, H, D, generator=g)[offset:],
              "v_pool": torch.randn(offset + 4, H, D, generator=g)[offset:],
              "q_out": torch.full((offset + T, H, D), float("nan"))[offset:]}
    arrays[which].untyped_storage().resize_(0)
    assert arrays[which].data_ptr() == offset * H * D * 4
    before = {n: a.clone() for n, a in arrays.items() if n != which}
    with pytest.raises(ValueError, match=rf"^{which} has no data pointer"):
        ropekv.rope_pool_fused(q, q, q, torch.arange(T), torch.arange(T), arrays["k_pool"],
                               arrays["v_pool"], head_dim=D, num_qo_heads=H, num_kv_heads=H,
                               rope_base=1e4, q_out=arrays["q_out"], stream=stream)
    for n, a in before.items():
        assert bits(arrays[n].numpy()) == bits(a.numpy()), n


@pytest.mark.parametrize("stream", [None, 0])  # the binding's fast path, and the general path
@pytest.mark.parametrize("which", ["q", "positions", "k_pool", "k_out", "cos_sin_cache"])
def test_torch_sparse_tensor_is_a_value_error(which, stream):
    """A sparse tensor has no strided memory: a ValueError naming it (not
    PyTorch's TypeError or RuntimeError), nothing written."""
    T, H, D = 3, 2, 16
    g = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 62)))
    a = {"q": torch.randn(T, H, D, generator=g), "positions": torch.arange(T),
         "k_pool": torch.randn(4, H, D, generator=g), "v_pool": torch.randn(4, H, D, generator=g),
         "k_out": torch.full((T, H, D), float("nan")),
         "cos_sin_cache": torch.randn(8, D, generator=g)}
    a[which] = a[which].to_sparse()
    before = {n: a[n].clone() for n in ("k_pool", "v_pool", "k_out") if n != which}
    with pytest.raises(ValueError, match=rf"^{which} is a PyTorch tensor of layout torch.sparse_coo"
                                         rf": ropekv reads strided \(dense\) memory; pass "
                                         rf"{which}.to_dense\(\)$"):
        ropekv.rope_pool_fused(a["q"], a["q"], a["q"], a["positions"], torch.arange(T),
                               a["k_pool"], a["v_pool"], head_dim=D, num_qo_heads=H,
                               num_kv_heads=H, rope_base=1e4, k_out=a["k_out"],
                               cos_sin_cache=a["cos_sin_cache"], stream=stream)
    for n, x in before.items():
        assert bits(a[n].numpy()) == bits(x.numpy()), n


def test_torch_int32_indices_and_preallocated_outputs():
    T, H, D = 5, 4, 32
    q = torch.randn(T, H, D)
    q_out = torch.full_like(q, float("nan"))
    k_out = torch.full_like(q, float("nan"))
    pool = torch.zeros(8, H, D)
    pos = torch.tensor([0, 1, 2, 3, 100000], dtype=torch.int32)
    res = ropekv.rope_pool_fused(q, q, q, pos, torch.arange(T, dtype=torch.int32), pool,
                                 pool.clone(), head_dim=D, num_qo_heads=H, num_kv_heads=H,
                                 rope_base=1e4, q_out=q_out, k_out=k_out)
    assert res[0] is q_out and res[1] is k_out
    ref, mag = rope(q.numpy(), pos.numpy(), 1e4)
    assert_close(q_out.numpy(), ref, mag, "q_out")
    assert torch.equal(q_out, k_out)


def test_mlx_arrays():
    mx = pytest.importorskip("mlx.core")  # (CI installs MLX: scripts/test.sh checks)
    T, Hq, Hk, D, P = 7, 4, 2, 64, 10
    rng = np.random.default_rng()
    qn = rng.standard_normal((T, Hq, D)).astype(np.float32)
    kn = rng.standard_normal((T, Hk, D)).astype(np.float32)
    pos = rng.integers(0, 10000, T).astype(np.int32)
    slots = rng.permutation(P)[:T].astype(np.int32)
    k_pool, v_pool = mx.zeros((P, Hk, D)), mx.zeros((P, Hk, D))
    q_rot, k_rot, kp, vp = ropekv.rope_pool_fused(
        mx.array(qn), mx.array(kn), mx.array(kn), mx.array(pos), mx.array(slots), k_pool, v_pool,
        head_dim=D, num_qo_heads=Hq, num_kv_heads=Hk, rope_base=1e4)
    assert isinstance(q_rot, mx.array) and kp is k_pool
    ref, mag = rope(qn, pos, 1e4)
    assert_close(np.array(q_rot), ref, mag, "q_rot")
    assert bits(np.array(k_pool)[slots]) == bits(np.array(k_rot))
    assert bits(np.array(v_pool)[slots]) == bits(kn)


def test_mlx_layer_stacked_pool():
    """A 4-D (layer-stacked) MLX pool: the error's usual fix, k_pool[layer],
    would write a copy (an MLX array indexed by an integer is not a view, as
    the README says), so
    for MLX the message asks for one MLX array per layer; nothing is written."""
    mx = pytest.importorskip("mlx.core")
    T, H, D, P = 2, 2, 16, 5
    rng = np.random.default_rng()
    q = mx.array(rng.standard_normal((T, H, D)).astype(np.float32))
    pos, slots = mx.array(np.arange(T, dtype=np.int32)), mx.array(np.arange(T, dtype=np.int32))
    cache = mx.array(rng.standard_normal((3, P, H, D)).astype(np.float32))
    before = np.array(cache)
    with pytest.raises(ValueError, match=r"^rope_pool_fused expects pool tensors to be 3-D, got "
                       r"k_pool \(3, 5, 2, 16\); a 4-D pool is usually a layer-stacked cache: "
                       r"pass k_pool\[layer\], an MLX array of its own \(an MLX array indexed as "
                       r"cache\[layer\] is a copy"):
        ropekv.rope_pool_fused(q, q, q, pos, slots, cache, cache[0], head_dim=D, num_qo_heads=H,
                               num_kv_heads=H, rope_base=1e4)
    assert bits(np.array(cache)) == bits(before)
    # (what the message and the README say of MLX: cache[1] written in place
    # leaves the stacked array as it was)
    layer = cache[1]
    ropekv.rope_pool_fused(q, q, q, pos, slots, layer, mx.zeros((P, H, D)), head_dim=D,
                           num_qo_heads=H, num_kv_heads=H, rope_base=1e4)
    assert bits(np.array(layer)[:T]) != bits(before[1, :T])
    assert bits(np.array(cache)) == bits(before)


def test_jax_arrays():
    """JAX arrays (CPU) as inputs, bf16 included; they are immutable, so the
    pools are numpy arrays and the rotated q and k come back as JAX arrays."""
    jax = pytest.importorskip("jax")
    # On the CPU device even where JAX also has a GPU (its default there):
    # the pools are numpy arrays, on the CPU.
    cpu = jax.devices("cpu")[0]

    def put(a):
        return jax.device_put(a, cpu)

    T, Hq, Hk, D, P = 6, 4, 2, 64, 9
    rng = np.random.default_rng()
    qn = rng.standard_normal((T, Hq, D)).astype(np.float32).astype(BF16)
    kn = rng.standard_normal((T, Hk, D)).astype(np.float32).astype(BF16)
    vn = rng.standard_normal((T, Hk, D)).astype(np.float32).astype(BF16)
    pos = rng.integers(0, 1 << 20, T).astype(np.int32)
    slots = rng.permutation(P)[:T].astype(np.int32)
    k_pool, v_pool = np.zeros((P, Hk, D), BF16), np.zeros((P, Hk, D), BF16)
    w = (1 + rng.random(D)).astype(np.float32)
    q_rot, k_rot, kp, vp = ropekv.rope_pool_fused(
        put(qn), put(kn), put(vn), put(pos), put(slots),
        k_pool, v_pool, head_dim=D, num_qo_heads=Hq, num_kv_heads=Hk, rope_base=1e4,
        q_norm_weight=put(w))
    assert isinstance(q_rot, jax.Array) and isinstance(k_rot, jax.Array) and kp is k_pool
    ref, mag = rope(qn, pos, 1e4, norm_weight=w)
    assert_close(np.asarray(q_rot), ref, mag, "q_rot", rel=4 + D / 2 + 6)
    ref, mag = rope(kn, pos, 1e4)
    assert_close(np.asarray(k_rot), ref, mag, "k_rot")
    assert bits(k_pool[slots]) == bits(np.asarray(k_rot)) and bits(v_pool[slots]) == bits(vn)
    with pytest.raises(ValueError, match="k_pool is a JAX array, which is immutable, but "
                                         r"ropekv writes the pools in place; pass writable pools "
                                         r"\(numpy, PyTorch, CuPy or MLX arrays\)"):
        ropekv.rope_pool_fused(put(qn), put(kn), put(vn),
                               put(pos), put(slots), put(k_pool), v_pool,
                               head_dim=D, num_qo_heads=Hq, num_kv_heads=Hk, rope_base=1e4)
    # Written JAX q/k (in place) or outputs: a copy would be immutable too, so
    # the message says what to do instead; nothing written.
    before = bits(k_pool), bits(v_pool)
    for kw, fix in ((dict(inplace=True), r"q is a JAX array, which is immutable, but ropekv "
                                         r"writes into it; drop inplace=True"),
                    (dict(q_out=put(qn)), r"q_out is a JAX array, which is immutable, but ropekv "
                                          r"writes into it; leave q_out out"),
                    (dict(k_out=put(kn)), r"k_out is a JAX array, which is immutable, but ropekv "
                                          r"writes into it; leave k_out out")):
        with pytest.raises(ValueError, match=fix):
            ropekv.rope_pool_fused(put(qn), put(kn), put(vn), put(pos), put(slots),
                                   k_pool, v_pool, head_dim=D, num_qo_heads=Hq,
                                   num_kv_heads=Hk, rope_base=1e4, **kw)
        assert (bits(k_pool), bits(v_pool)) == before


def test_jax_outputs_follow_their_inputs_and_given_ones_come_back():
    """q_rot comes back in q's framework and k_rot in k's (JAX, numpy, MLX
    mixed in one call); a q_out/k_out the caller passed is returned as
    passed (not a JAX copy of it), written."""
    jax = pytest.importorskip("jax")
    cpu = jax.devices("cpu")[0]
    T, H, D, P = 3, 2, 16, 5
    rng = np.random.default_rng()
    qn = rng.standard_normal((T, H, D)).astype(np.float32)
    kn = rng.standard_normal((T, H, D)).astype(np.float32)
    pos, slots = np.arange(T, dtype=np.int32), np.arange(T, dtype=np.int32)
    kw = dict(head_dim=D, num_qo_heads=H, num_kv_heads=H, rope_base=1e4)

    def call(q, k, **more):
        pools = np.zeros((P, H, D), np.float32), np.zeros((P, H, D), np.float32)
        return ropekv.rope_pool_fused(q, k, kn, pos, slots, *pools, **kw, **more)

    jq, jk = jax.device_put(qn, cpu), jax.device_put(kn, cpu)
    q_rot, k_rot, _, _ = call(qn, jk)
    assert type(q_rot) is np.ndarray and isinstance(k_rot, jax.Array)
    q_rot, k_rot, _, _ = call(jq, kn)
    assert isinstance(q_rot, jax.Array) and type(k_rot) is np.ndarray
    ref_q, mag_q = rope(qn, pos, 1e4)
    ref_k, mag_k = rope(kn, pos, 1e4)
    q_out, k_out = poison((T, H, D), np.float32), poison((T, H, D), np.float32)
    q_rot, k_rot, _, _ = call(jq, jk, q_out=q_out, k_out=k_out)
    assert q_rot is q_out and k_rot is k_out
    assert_close(q_out, ref_q, mag_q, "q_out")
    assert_close(k_out, ref_k, mag_k, "k_out")
    mx = pytest.importorskip("mlx.core")
    q_rot, k_rot, _, _ = call(qn, mx.array(kn))
    assert type(q_rot) is np.ndarray and isinstance(k_rot, mx.array)
    assert_close(np.array(k_rot), ref_k, mag_k, "k_rot")


def test_jax_values_without_one_buffer_are_named():
    """A JAX tracer (a call inside jax.jit) and a deleted array: a ValueError
    naming the argument and the reason, nothing written."""
    jax = pytest.importorskip("jax")
    T, H, D, P = 2, 1, 8, 4
    rng = np.random.default_rng()
    qn = rng.standard_normal((T, H, D)).astype(np.float32)
    pos, slots = np.arange(T, dtype=np.int32), np.arange(T, dtype=np.int32)
    kp, vp = rng.standard_normal((P, H, D)).astype(np.float32), np.zeros((P, H, D), np.float32)
    before = bits(kp), bits(vp)

    def call(q):
        return ropekv.rope_pool_fused(q, qn, qn, pos, slots, kp, vp, head_dim=D, num_qo_heads=H,
                                      num_kv_heads=H, rope_base=1e4)[0]

    with pytest.raises(ValueError, match=r"^q is a JAX tracer \(the call is inside jax.jit"):
        jax.jit(call)(jax.device_put(qn, jax.devices("cpu")[0]))
    gone = jax.device_put(qn, jax.devices("cpu")[0])
    gone.delete()
    with pytest.raises(ValueError, match=r"^q is a deleted JAX array"):
        call(gone)
    assert (bits(kp), bits(vp)) == before


def test_jax_sharded_array_is_named():
    """A JAX array sharded over two (CPU) devices: a ValueError naming it,
    nothing written. In a process of its own: JAX's device count is fixed
    when it starts."""
    pytest.importorskip("jax")
    import os
    import subprocess
    import sys
    script = """
import jax, numpy as np, ropekv
from jax.sharding import Mesh, NamedSharding, PartitionSpec
mesh = Mesh(np.array(jax.devices("cpu")), ("x",))
x = np.random.default_rng().standard_normal((2, 1, 8)).astype(np.float32)
q = jax.device_put(x, NamedSharding(mesh, PartitionSpec("x")))
kp, vp = np.zeros((4, 1, 8), np.float32), np.zeros((4, 1, 8), np.float32)
try:
    ropekv.rope_pool_fused(q, x, x, np.arange(2), np.arange(2), kp, vp, head_dim=8,
                           num_qo_heads=1, num_kv_heads=1, rope_base=1e4)
except ValueError as e:
    print(e)
print("written" if kp.any() or vp.any() else "untouched")
"""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=120, check=True)
    assert run.stdout.splitlines() == [
        "q is a JAX array sharded over 2 devices: pass one device's array "
        "(jax.device_put(q, device))", "untouched"], run.stdout + run.stderr


def test_mlx_bool_is_not_a_number():
    """A 0-d MLX bool is refused where a number goes, as Python's, numpy's,
    JAX's and PyTorch's bools are (its dtype prints mlx.core.bool)."""
    mx = pytest.importorskip("mlx.core")
    T, H, D, P = 2, 1, 8, 4
    rng = np.random.default_rng()
    qn = rng.standard_normal((T, H, D)).astype(np.float32)
    kp, vp = np.zeros((P, H, D), np.float32), np.zeros((P, H, D), np.float32)
    for name in ("rope_base", "norm_eps"):
        kw = {"rope_base": 1e4, name: mx.array(True)}
        with pytest.raises(ValueError, match=rf"^{name} must be a number, got array\(True"):
            ropekv.rope_pool_fused(qn, qn, qn, np.arange(T), np.arange(T), kp, vp, head_dim=D,
                                   num_qo_heads=H, num_kv_heads=H, **kw)
    assert not kp.any() and not vp.any()


def test_threads_call_at_once_on_separate_pools():
    """The GIL is released while the kernel runs: 4 Python threads, each with
    its own pool, many calls each; every result exact."""
    T, Hq, Hk, D, P = 64, 8, 2, 128, 256
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            kp = np.zeros((P, Hk, D), np.float32)
            vp = np.zeros((P, Hk, D), np.float32)
            for _ in range(20):
                q = rng.standard_normal((T, Hq, D)).astype(np.float32)
                k = rng.standard_normal((T, Hk, D)).astype(np.float32)
                pos = rng.integers(0, 1 << 20, T).astype(np.int32)
                slots = rng.permutation(P)[:T].astype(np.int32)
                q_rot, k_rot, _, _ = ropekv.rope_pool_fused(
                    q, k, k, pos, slots, kp, vp, head_dim=D, num_qo_heads=Hq,
                    num_kv_heads=Hk, rope_base=5e5, num_threads=1)
                ref, mag = rope(q, pos, 5e5)
                assert_close(q_rot, ref, mag, "q_rot")
                assert bits(kp[slots]) == bits(k_rot) and bits(vp[slots]) == bits(k)
        except Exception as e:  # noqa: BLE001  (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


class _NumpySub(np.ndarray):
    """An ndarray subclass of a library other than numpy."""


class _TorchSub(torch.Tensor):
    """A torch.Tensor subclass of a library other than torch."""


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_subclasses_defined_elsewhere_follow_their_base(kind):
    """An ndarray or Tensor subclass of another library's is its base's array:
    bf16 passed as its bits, q_rot made by the base library, a pool written in
    place (not refused, nor a TypeError from making q_rot)."""
    T, Hq, Hk, D, P = 5, 4, 2, 32, 16
    q, k, v = (RNG.standard_normal((T, h, D)).astype(BF16) for h in (Hq, Hk, Hk))
    pos = RNG.integers(0, 1 << 20, T)
    slots = RNG.permutation(P)[:T]
    k_pool = RNG.standard_normal((P, Hk, D)).astype(BF16)
    v_pool = RNG.standard_normal((P, Hk, D)).astype(BF16)
    k0, v0 = k_pool.copy(), v_pool.copy()
    if kind == "numpy":
        wrap = lambda a: a.view(_NumpySub)  # noqa: E731
        back = np.asarray
    else:
        wrap = lambda a: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).as_subclass(_TorchSub)  # noqa: E731
        back = lambda t: as_numpy(t.as_subclass(torch.Tensor))  # noqa: E731
    kp, vp = wrap(k_pool), wrap(v_pool)
    q_rot, k_rot, kp_out, vp_out = ropekv.rope_pool_fused(
        wrap(q), wrap(k), wrap(v), pos, slots, kp, vp, head_dim=D, num_qo_heads=Hq,
        num_kv_heads=Hk, rope_base=1e4)
    assert kp_out is kp and vp_out is vp
    assert isinstance(q_rot, np.ndarray if kind == "numpy" else torch.Tensor)
    for x, got in ((q, q_rot), (k, k_rot)):
        ref, mag = rope(x, pos, 1e4)
        assert_close(back(got), ref, mag, f"{kind} subclass")
    k_after, v_after = back(kp), back(vp)  # (the caller's pools, written in place)
    assert bits(k_after[slots]) == bits(back(k_rot)) and bits(v_after[slots]) == bits(v)
    rest = np.setdiff1d(np.arange(P), slots)
    assert bits(k_after[rest]) == bits(k0[rest]) and bits(v_after[rest]) == bits(v0[rest])
