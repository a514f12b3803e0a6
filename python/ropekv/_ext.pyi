"""Type stubs of ropekv's nanobind module (use the ropekv package instead)."""
from typing import Any, List, Optional, Tuple

__version__: str
DL_CODES: Tuple[int, int, int, int, int, int]

def run(q: Any, k: Any, v: Any, positions: Any, slots: Any, k_pool: Any, v_pool: Any,
        q_rot: Optional[Any], k_rot: Optional[Any], head_dim: int, num_qo_heads: int,
        num_kv_heads: int, rope_base: float, rotary_dim: int, dtype_views: int, readonly_mask: int,
        stream: int, num_threads: int, checked: bool) -> None: ...
def run_options(q: Any, k: Any, v: Any, positions: Any, slots: Any, k_pool: Any, v_pool: Any,
                q_rot: Optional[Any], k_rot: Optional[Any], cos_sin_cache: Optional[Any],
                q_norm_weight: Optional[Any], k_norm_weight: Optional[Any], head_dim: int,
                num_qo_heads: int, num_kv_heads: int, rope_base: float, rotary_dim: int,
                is_neox: bool, rope_scaling: Optional[Tuple[float, ...]], kv_cache_dtype: int,
                k_scale: float, v_scale: float, norm_eps: float, dtype_views: int,
                readonly_mask: int, stream: int, num_threads: int, checked: bool) -> None: ...
def run_fast(q: Any, k: Any, v: Any, positions: Any, slots: Any, k_pool: Any, v_pool: Any,
             q_rot: Optional[Any], k_rot: Optional[Any], head_dim: Any, num_qo_heads: Any,
             num_kv_heads: Any, rope_base: Any, rotary_dim: Optional[Any], is_neox: Any,
             rope_scaling: Optional[Tuple[float, ...]], num_threads: Any,
             checked: bool, cos_sin_cache: Any = None, q_norm_weight: Any = None,
             k_norm_weight: Any = None, norm_eps: Any = 1e-6, kv_cache_dtype: int = 0,
             k_scale: Any = 1.0, v_scale: Any = 1.0) -> Optional[Tuple[Any, Any, Any, Any]]: ...
def fast_path_types(framework: str, type: type, dtypes: List[Tuple[Any, ...]],
                    empty: Any, contiguous_format: Optional[Any],
                    current_stream: Optional[Any] = None,
                    exchange_api: Optional[Any] = None) -> bool: ...
def inv_freq(head_dim: int, rope_base: float, rotary_dim: int,
             rope_scaling: Optional[Tuple[float, ...]]) -> Tuple[List[float], float]: ...
def check_device_errors(device_id: int, stream: int) -> None: ...
def advise_huge_pages(data: int, bytes: int) -> None: ...
def writable(x: Any) -> bool: ...
def has_cuda() -> bool: ...
def cpu_target() -> str: ...
