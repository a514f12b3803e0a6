// Small numeric helpers of ropekv-replay: the element types the op takes
// (f32, f16, bf16 as raw bits), round-to-nearest-even converters, a seeded
// counter-based random generator, and the verification tolerance.
//
// The tool writes its own converters on purpose: it must not share code with
// the library it checks.
#pragma once

#include <dlpack/dlpack.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

namespace replay {

enum class Dtype { kF32, kF16, kBF16 };

inline int elem_size(Dtype t) { return t == Dtype::kF32 ? 4 : 2; }

inline const char* dtype_name(Dtype t) {
  switch (t) {
    case Dtype::kF32: return "f32";
    case Dtype::kF16: return "f16";
    default: return "bf16";
  }
}

inline DLDataType dl_dtype(Dtype t) {
  DLDataType d;
  d.lanes = 1;
  switch (t) {
    case Dtype::kF32: d.code = kDLFloat; d.bits = 32; break;
    case Dtype::kF16: d.code = kDLFloat; d.bits = 16; break;
    default: d.code = kDLBfloat; d.bits = 16; break;
  }
  return d;
}

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// fp32 -> bf16 bits, round to nearest even (NaN stays a quiet NaN).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_f32(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

/// fp32 -> IEEE binary16 bits, round to nearest even, with subnormals,
/// overflow to infinity and NaN kept.
inline uint16_t f32_to_f16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);  // NaN
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520: inf
  const int32_t e = static_cast<int32_t>(a >> 23) - 127;
  if (e >= -14) {  // normal half
    uint32_t m = a & 0x7FFFFFu;
    uint32_t h = (static_cast<uint32_t>(e + 15) << 10) | (m >> 13);
    const uint32_t rest = m & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // carry may bump exponent: fine
    return static_cast<uint16_t>(sign | h);
  }
  if (e < -25) return sign;  // below half of the smallest subnormal: zero
  // Subnormal half: value = m_full * 2^(e-23), unit 2^-24.
  const uint32_t m_full = (a & 0x7FFFFFu) | 0x800000u;
  const int shift = -e - 1;  // 14 .. 24 : m_full >> (shift) gives units of 2^-24
  const uint32_t q = m_full >> shift;
  const uint32_t rest = m_full & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1);
  uint32_t h = q;
  if (rest > halfway || (rest == halfway && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  if (e == 0) {
    const float v = std::ldexp(static_cast<float>(m), -24);
    return sign ? -v : v;
  }
  if (e == 31) return bits_float(sign | 0x7F800000u | (m << 13));
  return bits_float(sign | ((e + 112u) << 23) | (m << 13));
}

/// Rounds a float to the dtype and stores its bits at `dst` (element i).
inline void store_elem(Dtype t, void* dst, int64_t i, float f) {
  switch (t) {
    case Dtype::kF32: static_cast<float*>(dst)[i] = f; break;
    case Dtype::kF16: static_cast<uint16_t*>(dst)[i] = f32_to_f16(f); break;
    default: static_cast<uint16_t*>(dst)[i] = f32_to_bf16(f); break;
  }
}

inline double load_elem(Dtype t, const void* src, int64_t i) {
  switch (t) {
    case Dtype::kF32: return static_cast<const float*>(src)[i];
    case Dtype::kF16: return f16_to_f32(static_cast<const uint16_t*>(src)[i]);
    default: return bf16_to_f32(static_cast<const uint16_t*>(src)[i]);
  }
}

/// The raw bits of element i, widened (for bit-exact comparisons and reports).
inline uint32_t elem_bits(Dtype t, const void* src, int64_t i) {
  if (t == Dtype::kF32) return static_cast<const uint32_t*>(src)[i];
  return static_cast<const uint16_t*>(src)[i];
}

/// One unit in the last place of the dtype at magnitude |a| (the spacing of
/// the dtype's numbers in the binade of a; the smallest subnormal below the
/// normal range).
inline double ulp_of(Dtype t, double a) {
  a = std::fabs(a);
  int mant_bits, min_exp;  // fraction bits; exponent of the smallest normal
  switch (t) {
    case Dtype::kF32: mant_bits = 23; min_exp = -126; break;
    case Dtype::kF16: mant_bits = 10; min_exp = -14; break;
    default: mant_bits = 7; min_exp = -126; break;
  }
  int e = min_exp;
  if (a >= std::ldexp(1.0, min_exp)) {
    int ex;
    std::frexp(a, &ex);  // a = m 2^ex, m in [0.5, 1)
    e = ex - 1;
  }
  return std::ldexp(1.0, e - mant_bits);
}

/// Widens n elements of dtype t to double (loop per dtype, no switch inside).
inline void load_row(Dtype t, const void* src, int64_t n, double* out) {
  if (t == Dtype::kF32) {
    const float* p = static_cast<const float*>(src);
    for (int64_t i = 0; i < n; ++i) out[i] = p[i];
  } else if (t == Dtype::kBF16) {
    const uint16_t* p = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) out[i] = bits_float(static_cast<uint32_t>(p[i]) << 16);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) out[i] = f16_to_f32(p[i]);
  }
}

/// ulp_of through the exponent bits (no libm): the same value for finite a.
struct UlpFn {
  int mant_bits, min_exp;
  explicit UlpFn(Dtype t)
      : mant_bits(t == Dtype::kF32 ? 23 : t == Dtype::kF16 ? 10 : 7),
        min_exp(t == Dtype::kF16 ? -14 : -126) {}
  double operator()(double a) const {
    uint64_t b;
    std::memcpy(&b, &a, 8);
    int64_t e = static_cast<int64_t>((b >> 52) & 0x7FF) - 1023;
    if (e < min_exp) e = min_exp;
    const uint64_t u = static_cast<uint64_t>(e - mant_bits + 1023) << 52;
    double r;
    std::memcpy(&r, &u, 8);
    return r;
  }
};

/// Tolerance of one rotated element: one ulp of the output dtype at |ref|
/// plus the fp32 evaluation error 4 * 2^-24 * (|x1 c| + |x2 s|). `ulps`
/// scales the first term (0.5: "is the nearest rounding").
inline double rope_tolerance(Dtype t, double ref, double x1c, double x2s, double ulps = 1.0) {
  return ulps * ulp_of(t, ref) + 4.0 * std::ldexp(1.0, -24) * (std::fabs(x1c) + std::fabs(x2s));
}

// ---------------------------------------------------------------- random

inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// A well-mixed 64-bit key of a few integers (order matters).
inline uint64_t mix_key(uint64_t seed, uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  uint64_t s = seed;
  uint64_t h = splitmix64(s);
  for (uint64_t x : {a, b, c, d}) {
    s = h ^ (x * 0xD6E8FEB86659FD93ull);
    h = splitmix64(s);
  }
  return h;
}

/// Small seeded generator (splitmix64 stream).
struct Rng {
  uint64_t state;
  explicit Rng(uint64_t seed) : state(seed) {}
  uint64_t next() { return splitmix64(state); }
  /// Uniform double in [0, 1).
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  /// Uniform integer in [0, n).
  uint64_t below(uint64_t n) { return n ? next() % n : 0; }
  /// Standard normal (Box-Muller), identical on every platform.
  double normal() {
    double u1 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
};

}  // namespace replay
