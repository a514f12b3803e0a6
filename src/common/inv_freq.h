// RoPE's inverse frequencies, as both backends compute them (the float64
// reference in src/reference.cc computes its own, on purpose).
#pragma once

#include <cmath>
#include <cstdint>

namespace ropekv {

/// out[i] = fp32(rope_base ** (-2 i / rotary_dim)) for i < rotary_dim / 2:
/// evaluated in double and rounded once to fp32, as the contract says.
inline void fill_inv_freq(double rope_base, int64_t rotary_dim, float* out) {
  for (int64_t i = 0; i < rotary_dim / 2; ++i)
    out[i] = static_cast<float>(
        std::pow(rope_base, -2.0 * static_cast<double>(i) / static_cast<double>(rotary_dim)));
}

}  // namespace ropekv
