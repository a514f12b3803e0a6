#include "ropekv/reference.h"

#include <cmath>
#include <vector>

namespace ropekv {
namespace reference {

double inv_freq(int64_t i, int64_t rotary_dim, double rope_base) {
  const double exponent = -2.0 * static_cast<double>(i) / static_cast<double>(rotary_dim);
  return static_cast<double>(static_cast<float>(std::pow(rope_base, exponent)));
}

double angle(int64_t position, int64_t i, int64_t rotary_dim, double rope_base) {
  const float pos = static_cast<float>(position);
  const float f = static_cast<float>(inv_freq(i, rotary_dim, rope_base));
  // The product of two fp32 numbers, rounded once to fp32: exact in double,
  // then one rounding, so no dependence on the compiler's FP contraction.
  const double exact = static_cast<double>(pos) * static_cast<double>(f);
  return static_cast<double>(static_cast<float>(exact));
}

void rope_head(const double* x, double* out, int64_t head_dim, int64_t rotary_dim,
               int64_t position, double rope_base) {
  const int64_t half = rotary_dim / 2;
  std::vector<double> in(x, x + head_dim);
  for (int64_t i = 0; i < half; ++i) {
    const double theta = angle(position, i, rotary_dim, rope_base);
    const double c = std::cos(theta), s = std::sin(theta);
    out[i] = in[i] * c - in[i + half] * s;
    out[i + half] = in[i + half] * c + in[i] * s;
  }
  for (int64_t d = rotary_dim; d < head_dim; ++d) out[d] = in[d];
}

}  // namespace reference
}  // namespace ropekv
