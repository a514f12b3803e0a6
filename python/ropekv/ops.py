"""ropekv as a PyTorch operator: ``torch.ops.ropekv.rope_pool_fused``.

Importing this module registers a ``torch.library`` custom op with a fake
(meta) implementation, so the call traces under ``torch.compile`` with no
graph break and can be captured in CUDA graphs. It declares that it mutates
``k_pool`` and ``v_pool`` in place (their version counters move, as after
any in-place PyTorch op), and returns the new ``(q_rot, k_rot)`` (a custom op
may not return its mutated inputs; the pools are the ones passed in). It is
not differentiable: q_rot and k_rot never require grad::

    import ropekv.ops  # registers the op
    q_rot, k_rot = torch.ops.ropekv.rope_pool_fused(
        q, k, v, positions, slots, k_pool, v_pool,
        head_dim=128, num_qo_heads=32, num_kv_heads=8, rope_base=500000.0)

Arguments, dtypes, errors and math are those of :func:`ropekv.rope_pool_fused`,
options included, except that ``rope_scaling`` is given as JSON text
(``json.dumps(config.rope_scaling)``: an operator schema has no dict type),
and ``inplace`` / ``q_out`` / ``k_out`` do not exist (a custom op returns new
tensors), nor do ``stream`` and ``num_threads``: CUDA tensors run on the
current stream, the CPU on OpenMP's default threads. PyTorch converts each
argument to its schema type before ropekv sees it, so the function's type
errors do not apply: ``is_neox=2`` arrives as True, ``rope_base=True`` as 1.0.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _torch_fast, _torch_written
from . import rope_pool_fused as _rope_pool_fused

__all__ = ["rope_pool_fused"]


_SCHEMA = (
    "rope_pool_fused(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor slots, "
    "Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor? cos_sin_cache=None, "
    "Tensor? q_norm_weight=None, Tensor? k_norm_weight=None, *, int head_dim, "
    "int num_qo_heads, int num_kv_heads, float rope_base, int? rotary_dim=None, "
    "bool is_neox=True, str? rope_scaling=None, str kv_cache_dtype=\"auto\", "
    "float k_scale=1., float v_scale=1., float norm_eps=1e-06) -> (Tensor, Tensor)")


def rope_pool_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    cos_sin_cache: Optional[torch.Tensor] = None,
    q_norm_weight: Optional[torch.Tensor] = None,
    k_norm_weight: Optional[torch.Tensor] = None,
    *,
    head_dim: int,
    num_qo_heads: int,
    num_kv_heads: int,
    rope_base: float,
    rotary_dim: Optional[int] = None,
    is_neox: bool = True,
    rope_scaling: Optional[str] = None,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    norm_eps: float = 1e-6,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k with RoPE and scatters k_rot and v into the pools.

    Shapes: q ``[T, num_qo_heads, head_dim]``; k, v ``[T, num_kv_heads,
    head_dim]``; positions, slots ``[T]`` int32/int64; k_pool, v_pool ``[P,
    num_kv_heads, head_dim]`` of q's dtype (or of ``kv_cache_dtype``), all
    on one device; the options as in :func:`ropekv.rope_pool_fused`, with
    ``rope_scaling`` as JSON text (the optional tensors cos_sin_cache,
    q_norm_weight and k_norm_weight may also be passed by keyword). Returns
    ``(q_rot, k_rot)``; k_pool and v_pool are updated in place. Raises
    ValueError as :func:`ropekv.rope_pool_fused` does (and PyTorch's
    NotImplementedError for tensors on a device other than the CPU or CUDA).
    """
    return torch.ops.ropekv.rope_pool_fused(
        q, k, v, positions, slots, k_pool, v_pool, cos_sin_cache, q_norm_weight,
        k_norm_weight, head_dim=head_dim, num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads, rope_base=rope_base, rotary_dim=rotary_dim,
        is_neox=is_neox, rope_scaling=rope_scaling, kv_cache_dtype=kv_cache_dtype,
        k_scale=k_scale, v_scale=v_scale, norm_eps=norm_eps)


def _kernel(q, k, v, positions, slots, k_pool, v_pool, cos_sin_cache=None, q_norm_weight=None,
            k_norm_weight=None, **options):
    # The schema's keywords (head_dim ... norm_eps) are ropekv.rope_pool_fused's.
    q_rot, k_rot, _, _ = _rope_pool_fused(
        q, k, v, positions, slots, k_pool, v_pool, cos_sin_cache=cos_sin_cache,
        q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, **options)
    # (The call bumps the pools' version counters, as PyTorch's in-place ops do.)
    return q_rot, k_rot


def _fake(q, k, v, positions, slots, k_pool, v_pool, *args, **options):
    # The pools' autograd rules first: under torch.compile the kernel writes
    # functionalized copies of the pools, whose flags it cannot see, so a pool
    # that requires grad (grad mode on) or an inference tensor is refused here,
    # while the graph is traced, with the eager call's ValueError.
    _torch_written(_torch_fast(), k_pool, v_pool, None, None, False)
    # Fresh contiguous outputs of q's and k's shape, dtype and device.
    return q.new_empty(q.shape), k.new_empty(k.shape)


# Registered on the dispatcher directly (schema, a CPU and a CUDA kernel, a
# fake): torch.library.custom_op wraps each call in Python layers of its own
# (autograd and in-place bookkeeping) that cost more than the op. The schema
# declares the pools mutated (a!, b!), which is what torch.compile's
# functionalization and CUDA graphs go by. The op is not differentiable:
# autograd falls through it, so q_rot and k_rot never require grad.
_lib = torch.library.Library("ropekv", "DEF")
_lib.define(_SCHEMA)
for _key in ("CPU", "CUDA"):
    _lib.impl("rope_pool_fused", _kernel, _key)
_lib.impl("rope_pool_fused", torch.library.fallthrough_kernel, "Autograd")
torch.library.register_fake("ropekv::rope_pool_fused", _fake, lib=_lib)
