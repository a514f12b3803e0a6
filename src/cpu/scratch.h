// Per-thread scratch memory of the CPU backend (shared by all SIMD targets).
#pragma once

namespace ropekv {
namespace cpu {

struct Scratch {
  float* cos;     // [half padded to a whole vector]
  float* sin;     // [half padded]
  float* theta;   // [half padded]
  void* row_in;   // [head_dim padded] elements of the storage type
  void* row_out;  // [head_dim padded]
};

}  // namespace cpu
}  // namespace ropekv
