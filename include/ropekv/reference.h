// The float64 reference of ropekv's math: the oracle of the tests and of
// ropekv-replay's verification. Plain scalar code, written for clarity, and
// independent of the kernels (it shares no code with them).
#pragma once

#include <cstdint>

namespace ropekv {
namespace reference {

/// inv_freq[i] = fp32(rope_base ** (-2 i / rotary_dim)), evaluated in double
/// and rounded once to fp32; returned widened to double.
double inv_freq(int64_t i, int64_t rotary_dim, double rope_base);

/// theta = fp32(fp32(position) * inv_freq[i]), the fp32 RoPE angle, widened.
double angle(int64_t position, int64_t i, int64_t rotary_dim, double rope_base);

/// Rotates one head in float64 (NeoX / rotate-half pairs (i, i + R/2)).
///   x, out     [head_dim] float64 (out may equal x)
///   rotary_dim R, even, <= head_dim; dims R..head_dim-1 are copied
///   position   absolute token position (any int64; negative is valid RoPE)
///   rope_base  RoPE theta, > 0
void rope_head(const double* x, double* out, int64_t head_dim, int64_t rotary_dim,
               int64_t position, double rope_base);

}  // namespace reference
}  // namespace ropekv
