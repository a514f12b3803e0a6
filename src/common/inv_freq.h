// RoPE's inverse frequencies and attention factor, as both backends compute
// them (the float64 references in src/reference.cc and tests/python compute
// their own, on purpose). Host code only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ropekv/ropekv.h"

namespace ropekv {

/// Calls f(name, field of a, field of b) for each field of RopeScaling but
/// its type, in declaration order: the one list of them that FreqSpec's
/// equality and validation's check of a typeless RopeScaling both read.
template <class F>
void for_each_scaling_field(const RopeScaling& a, const RopeScaling& b, F&& f) {
  // (Twelve names, RopeScaling's fields: this stops compiling when one is
  // added or removed, until the list below is brought in line.)
  [[maybe_unused]] const auto& [type, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11] = a;
  f("factor", a.factor, b.factor);
  f("low_freq_factor", a.low_freq_factor, b.low_freq_factor);
  f("high_freq_factor", a.high_freq_factor, b.high_freq_factor);
  f("original_max_position_embeddings", a.original_max_position_embeddings,
    b.original_max_position_embeddings);
  f("beta_fast", a.beta_fast, b.beta_fast);
  f("beta_slow", a.beta_slow, b.beta_slow);
  f("attention_factor", a.attention_factor, b.attention_factor);
  f("mscale", a.mscale, b.mscale);
  f("mscale_all_dim", a.mscale_all_dim, b.mscale_all_dim);
  f("truncate", a.truncate, b.truncate);
  f("partial_rotary_factor", a.partial_rotary_factor, b.partial_rotary_factor);
}

/// Everything the frequency table depends on; equal specs give equal tables
/// (the backends cache tables by it).
struct FreqSpec {
  double rope_base = 10000.0;
  int64_t rotary_dim = 0;
  RopeScaling scaling;

  bool operator==(const FreqSpec& o) const {
    bool same = rope_base == o.rope_base && rotary_dim == o.rotary_dim &&
                scaling.type == o.scaling.type;
    for_each_scaling_field(scaling, o.scaling,
                           [&same](const char*, const auto& a, const auto& b) { same &= a == b; });
    return same;
  }
  bool operator!=(const FreqSpec& o) const { return !(*this == o); }
};

namespace detail {
constexpr double kPi = 3.14159265358979323846;

// transformers' yarn helpers, in double.
inline double yarn_get_mscale(double scale, double m) {
  return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
}
inline double yarn_correction_dim(double rotations, double dim, double base, double max_pos) {
  return dim * std::log(max_pos / (rotations * 2.0 * kPi)) / (2.0 * std::log(base));
}
}  // namespace detail

/// The factor yarn multiplies cos and sin by (1 for every other type).
inline double attention_factor(const RopeScaling& s) {
  if (s.type != RopeScalingType::kYarn) return 1.0;
  if (s.attention_factor) return *s.attention_factor;
  if (s.mscale != 0.0 && s.mscale_all_dim != 0.0)
    return detail::yarn_get_mscale(s.factor, s.mscale) /
           detail::yarn_get_mscale(s.factor, s.mscale_all_dim);
  return detail::yarn_get_mscale(s.factor, 1.0);
}

/// out[i] for i < rotary_dim / 2: base ** (-2 i / R), scaled as transformers'
/// rope initialisation functions do for spec.scaling, evaluated in double and
/// rounded once to fp32.
inline void fill_inv_freq(const FreqSpec& spec, float* out) {
  const int64_t half = spec.rotary_dim / 2;
  const double R = static_cast<double>(spec.rotary_dim);
  const RopeScaling& s = spec.scaling;
  double low = 0.0, high = 0.0;  // yarn's correction range, in pair indices
  if (s.type == RopeScalingType::kYarn) {
    const double omax = s.original_max_position_embeddings;
    low = detail::yarn_correction_dim(s.beta_fast, R, spec.rope_base, omax);
    high = detail::yarn_correction_dim(s.beta_slow, R, spec.rope_base, omax);
    if (s.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, R - 1.0);
    if (low == high) high += 0.001;  // transformers' guard against 0/0
  }
  // proportional: the pairs that rotate (transformers' int(p * D // 2)).
  const double rotating = std::floor(s.partial_rotary_factor * R * 0.5);
  for (int64_t i = 0; i < half; ++i) {
    const double base_freq = std::pow(spec.rope_base, -2.0 * static_cast<double>(i) / R);
    double f = base_freq;
    switch (s.type) {
      case RopeScalingType::kNone: break;
      case RopeScalingType::kLinear: f = base_freq / s.factor; break;
      case RopeScalingType::kLlama3: {
        const double omax = s.original_max_position_embeddings;
        const double wavelen = 2.0 * detail::kPi / base_freq;
        if (wavelen > omax / s.low_freq_factor) {
          f = base_freq / s.factor;
        } else if (wavelen >= omax / s.high_freq_factor) {
          // Equal factors (Llama-4 Scout): the band is the one wavelength
          // omax / low_freq_factor, where transformers' 0/0 gives NaN; it
          // takes the scaled frequency there, as vLLM does (smooth 0).
          const double span = s.high_freq_factor - s.low_freq_factor;
          const double smooth = span > 0.0 ? (omax / wavelen - s.low_freq_factor) / span : 0.0;
          f = (1.0 - smooth) * base_freq / s.factor + smooth * base_freq;
        }
        break;
      }
      case RopeScalingType::kYarn: {
        const double ramp =
            std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
        const double extrapolation = 1.0 - ramp;  // weight of the unscaled frequency
        f = base_freq / s.factor * (1.0 - extrapolation) + base_freq * extrapolation;
        break;
      }
      case RopeScalingType::kProportional:
        // (angle 0: cos 1 and sin 0 exactly, so finite nonzero values come back unchanged)
        f = static_cast<double>(i) < rotating ? base_freq / s.factor : 0.0;
        break;
    }
    out[i] = static_cast<float>(f);
  }
}

}  // namespace ropekv
