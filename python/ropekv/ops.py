"""ropekv as a PyTorch operator: ``torch.ops.ropekv.rope_pool_fused``.

Importing this module registers a ``torch.library`` custom op with a fake
(meta) implementation, so the call traces under ``torch.compile`` with no
graph break and can be captured in CUDA graphs. It declares that it mutates
``k_pool`` and ``v_pool`` in place, and returns the new ``(q_rot, k_rot)``
(a custom op may not return its mutated inputs; the pools are the ones passed
in)::

    import ropekv.ops  # registers the op
    q_rot, k_rot = torch.ops.ropekv.rope_pool_fused(
        q, k, v, positions, slots, k_pool, v_pool,
        head_dim=128, num_qo_heads=32, num_kv_heads=8, rope_base=500000.0)

Arguments, dtypes, errors and math are those of :func:`ropekv.rope_pool_fused`;
CUDA tensors run on the current stream.
"""

from __future__ import annotations

from typing import Tuple

import torch

from . import rope_pool_fused as _rope_pool_fused

__all__ = ["rope_pool_fused"]


@torch.library.custom_op("ropekv::rope_pool_fused", mutates_args=("k_pool", "v_pool"))
def rope_pool_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    *,
    head_dim: int,
    num_qo_heads: int,
    num_kv_heads: int,
    rope_base: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k with RoPE and scatters k_rot and v into the pools.

    Shapes: q ``[T, num_qo_heads, head_dim]``; k, v ``[T, num_kv_heads,
    head_dim]``; positions, slots ``[T]`` int32/int64; k_pool, v_pool ``[P,
    num_kv_heads, head_dim]``, all float16/bfloat16/float32 of q's dtype, on
    one device. Returns ``(q_rot, k_rot)``; k_pool and v_pool are updated in
    place. Raises ValueError as :func:`ropekv.rope_pool_fused` does.
    """
    q_rot, k_rot, _, _ = _rope_pool_fused(
        q, k, v, positions, slots, k_pool, v_pool, head_dim=head_dim,
        num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, rope_base=rope_base)
    return q_rot, k_rot


@rope_pool_fused.register_fake
def _(q, k, v, positions, slots, k_pool, v_pool, *, head_dim, num_qo_heads, num_kv_heads,
      rope_base):
    # Fresh contiguous outputs of q's and k's shape, dtype and device.
    return q.new_empty(q.shape), k.new_empty(k.shape)
