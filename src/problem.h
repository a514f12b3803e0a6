// The normalised form of one call, made by validate.cc and trusted by every
// backend: element strides (never NULL), sizes as int64, one dtype code.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/fp8.h"
#include "common/inv_freq.h"
#include "ropekv/ropekv.h"

namespace ropekv {

enum class FloatType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };
enum class IndexType : int { kI32 = 0, kI64 = 1 };

/// Storage of the pools: q's dtype unless kv_cache_dtype says otherwise.
enum class PoolType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kFp8E4M3 = 3, kFp8E5M2 = 4 };

inline PoolType pool_type_of(FloatType t) { return static_cast<PoolType>(static_cast<int>(t)); }
inline bool is_fp8(PoolType t) { return t == PoolType::kFp8E4M3 || t == PoolType::kFp8E5M2; }
inline Fp8Kind fp8_kind(PoolType t) {
  return t == PoolType::kFp8E4M3 ? Fp8Kind::kE4M3 : Fp8Kind::kE5M2;
}

/// Element size in bytes of a FloatType.
inline int64_t element_size(FloatType t) { return t == FloatType::kF32 ? 4 : 2; }
inline int64_t element_size(IndexType t) { return t == IndexType::kI32 ? 4 : 8; }
inline int64_t element_size(PoolType t) {
  return t == PoolType::kF32 ? 4 : (is_fp8(t) ? 1 : 2);
}

/// A [rows, heads, head_dim] array: base pointer (byte offset applied) and
/// element strides.
struct View3 {
  void* data = nullptr;
  int64_t stride[3] = {0, 0, 0};
};

/// A [T] index array, or a [D] norm weight.
struct View1 {
  const void* data = nullptr;
  int64_t stride = 0;
};

/// An optional [n] float vector (QK-norm weights): data == nullptr = absent.
struct Weight {
  const void* data = nullptr;
  int64_t stride = 0;
  FloatType dtype = FloatType::kF32;
};

/// The optional [rows, R] cos/sin table: data == nullptr = absent.
struct CosSinCache {
  const void* data = nullptr;
  int64_t rows = 0;
  int64_t stride[2] = {0, 0};
  FloatType dtype = FloatType::kF32;
};

struct Problem {
  int64_t num_tokens = 0;  // T
  int64_t num_qo_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;    // D
  int64_t rotary_dim = 0;  // R, even, <= D
  int64_t pool_size = 0;   // P
  double rope_base = 0.0;
  FreqSpec freq;                 // what the inv_freq table is made from
  float attention_factor = 1.0f; // yarn's m, multiplies cos and sin (1 = off)
  bool is_neox = true;
  FloatType dtype = FloatType::kF32;
  PoolType pool_type = PoolType::kF32;  // == dtype unless kv_cache_dtype is set
  float k_scale = 1.0f, v_scale = 1.0f; // fp8 pools: stored = encode(x / scale)
  CosSinCache cos_sin_cache;
  Weight q_norm, k_norm;
  float norm_eps = 0.0f;
  IndexType pos_type = IndexType::kI32;
  IndexType slot_type = IndexType::kI32;
  DLDevice device{kDLCPU, 0};
  View3 q, k, v, q_rot, k_rot, k_pool, v_pool;
  View1 positions, slots;
};

/// Reads element t of an index array as int64.
inline int64_t load_index(const View1& a, IndexType t, int64_t i) {
  return t == IndexType::kI32 ? static_cast<const int32_t*>(a.data)[i * a.stride]
                              : static_cast<const int64_t*>(a.data)[i * a.stride];
}

/// Whether the call has a QK-norm (of q, of k or of both).
inline bool has_qk_norm(const Problem& p) {
  return p.q_norm.data != nullptr || p.k_norm.data != nullptr;
}

/// Whether the call takes the backends' fast paths: the original op, its
/// frequencies scaled or not (any rope_scaling: yarn's attention factor
/// scales the per-token cos/sin these paths make anyway).
inline bool is_plain(const Problem& p) {
  return p.is_neox && p.pool_type == pool_type_of(p.dtype) &&
         p.cos_sin_cache.data == nullptr && !has_qk_norm(p);
}

/// Checks every rule of the contract and builds the Problem. Throws Error.
/// With `check_index_values`, also reads slots (and, with a cos_sin_cache,
/// positions) on the host (CPU arrays) and rejects any slot >= pool_size
/// and any position outside the table.
/// With `check_duplicates` (checked mode, host-readable slots), also
/// rejects two tokens naming the same non-negative slot.
Problem make_problem(const RopePoolTensors& t, const RopeConfig& config,
                     bool check_index_values, bool check_duplicates = false);

/// Checks how the call is asked to run (num_threads >= 0). Throws Error.
void check_exec_options(const ExecOptions& options);

/// Checks the fields the frequencies depend on (head_dim, rotary_dim,
/// rope_base, rope_scaling) with the op's messages; returns R.
int64_t check_frequency_config(const RopeConfig& config);

/// The message for a position outside the cos_sin_cache table.
std::string position_error(int64_t token, int64_t position, int64_t rows);

/// Throws Error if two tokens name the same non-negative slot (`slots` read
/// on the host, one per token).
void check_unique_slots(const std::vector<int64_t>& slots);

}  // namespace ropekv
