// Per-thread scratch memory of the CPU backend, and the per-call data of its
// options path (shared by all SIMD targets).
#pragma once

#include <cstdint>

namespace ropekv {
struct Problem;
namespace cpu {

struct Scratch {
  float* cos;     // [rotary_dim padded to a whole vector]
  float* sin;     // [rotary_dim padded]
  float* theta;   // [half padded]
  void* row_in;   // [head_dim padded] elements of the storage type
  void* row_out;  // [head_dim padded]
  // The options path only:
  float* half_cos;  // [half padded] cos/sin before the interleaved layout
  float* half_sin;  // [half padded]
  void* row_pool;   // [head_dim padded] pool elements (up to 4 bytes)
  float* head_r;    // [heads padded] QK-norm factors of one token's q (or k) heads
};

/// What every thread of a non-plain call reads (made once per call).
struct OptionData {
  const float* inv_freq = nullptr;  // padded; null with a cos_sin_cache
  const float* q_norm = nullptr;    // QK-norm weights widened to fp32, padded; null = none
  const float* k_norm = nullptr;
};

/// A unit of work of the options path: whole tokens [t0, t1), or (heads)
/// heads [h0, h1) of token t0 with its cos/sin given in c/s.
struct OptWork {
  const Problem* p;
  const OptionData* od;
  const Scratch* sc;
  int64_t t0, t1;
  bool heads;
  bool stream;  // a large call: non-temporal stores where every row allows them
  const float* c;
  const float* s;
  int64_t h0, h1;
};

}  // namespace cpu
}  // namespace ropekv
