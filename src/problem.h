// The normalised form of one call, made by validate.cc and trusted by every
// backend: element strides (never NULL), sizes as int64, one dtype code.
#pragma once

#include <cstdint>
#include <vector>

#include "ropekv/ropekv.h"

namespace ropekv {

enum class FloatType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };
enum class IndexType : int { kI32 = 0, kI64 = 1 };

/// Element size in bytes of a FloatType.
inline int64_t element_size(FloatType t) { return t == FloatType::kF32 ? 4 : 2; }
inline int64_t element_size(IndexType t) { return t == IndexType::kI32 ? 4 : 8; }

/// A [rows, heads, head_dim] array: base pointer (byte offset applied) and
/// element strides.
struct View3 {
  void* data = nullptr;
  int64_t stride[3] = {0, 0, 0};
};

/// A [T] index array.
struct View1 {
  const void* data = nullptr;
  int64_t stride = 0;
};

struct Problem {
  int64_t num_tokens = 0;  // T
  int64_t num_qo_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;    // D
  int64_t rotary_dim = 0;  // R, even, <= D
  int64_t pool_size = 0;   // P
  double rope_base = 0.0;
  FloatType dtype = FloatType::kF32;
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

/// Checks every rule of the contract and builds the Problem. Throws Error.
/// With `check_index_values`, also reads slots on the host (CPU arrays) and
/// rejects any slot >= pool_size.
/// With `check_duplicates` (checked mode, host-readable slots), also
/// rejects two tokens naming the same non-negative slot.
Problem make_problem(const RopePoolTensors& t, const RopeConfig& config,
                     bool check_index_values, bool check_duplicates = false);

/// Throws Error if two tokens name the same non-negative slot (`slots` read
/// on the host, one per token).
void check_unique_slots(const std::vector<int64_t>& slots);

}  // namespace ropekv
