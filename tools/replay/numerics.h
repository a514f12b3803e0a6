// Small numeric helpers of ropekv-replay: the element types the op takes
// (f32, f16, bf16 as raw bits), round-to-nearest-even converters, the pool
// formats and an fp8 codec, a seeded counter-based random generator, and the
// verification tolerance.
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

/// The ulps of one rounding to dtype t that a rotated element may be off:
/// half an ulp for f16 / bf16 (round to nearest even of the fp32 result: a
/// truncating or double-rounding store fails), one for f32 (the last fp32
/// rounding and the arithmetic overlap). As the library's own tests.
inline double rounding_ulps(Dtype t) { return t == Dtype::kF32 ? 1.0 : 0.5; }

/// fp32 units (2^-24) of |x1 c| + |x2 s| that the fp32 evaluation of a
/// rotation may be off by: cos/sin within a few ulp, two products, one sum.
constexpr double kRopeRel = 4.0;

/// What a QK-norm adds to kRopeRel for heads of head_dim D: the fp32 sum of
/// D squares (its error grows with D; the square root halves it), r's
/// division and square root, and the two products fp32(fp32(x * r) * w).
/// As the library's tests bound it.
inline double qk_norm_rel(int64_t head_dim) { return static_cast<double>(head_dim) / 2 + 6; }

/// Tolerance of one rotated element: rounding_ulps of the output dtype at
/// |ref| (or `ulps` given) plus the fp32 evaluation error
/// rel * 2^-24 * (|x1 c| + |x2 s|).
inline double rope_tolerance(Dtype t, double ref, double x1c, double x2s, double ulps = -1.0,
                             double rel = kRopeRel) {
  if (ulps < 0) ulps = rounding_ulps(t);
  return ulps * ulp_of(t, ref) + rel * std::ldexp(1.0, -24) * (std::fabs(x1c) + std::fabs(x2s));
}

// ---------------------------------------------------------------- pools

/// Format of k_pool and v_pool (--kv-cache-dtype), ropekv::KvCacheDtype's values.
enum class KvDtype { kAuto, kFloat32, kFp8E4M3, kFp8E5M2 };

inline bool is_fp8(KvDtype k) { return k == KvDtype::kFp8E4M3 || k == KvDtype::kFp8E5M2; }

inline const char* kv_dtype_name(KvDtype k) {
  switch (k) {
    case KvDtype::kAuto: return "auto";
    case KvDtype::kFloat32: return "float32";
    case KvDtype::kFp8E4M3: return "fp8_e4m3";
    default: return "fp8_e5m2";
  }
}

/// Bytes of one pool element for inputs of dtype t.
inline int pool_elem_size(KvDtype k, Dtype t) {
  return k == KvDtype::kAuto ? elem_size(t) : k == KvDtype::kFloat32 ? 4 : 1;
}

/// The tool's own OCP fp8 codec (E4M3 "fn": bias 7, no Inf, max 448, NaN
/// 0x7F/0xFF; E5M2: bias 15, IEEE-like, max 57344). Decoding follows the bit
/// fields; encoding is defined as "the finite code of the input's sign whose
/// value is nearest, ties to the even code", which rounds to nearest even and
/// saturates (past the largest finite value the largest is nearest). It is
/// found by a search of the decoded codes, on purpose nothing like the
/// library's bit arithmetic (src/common/fp8.h), so the two check each other:
/// a binary search, memoised per range of fp32 numbers (exponent and top
/// mantissa bits) so that an encode takes a step or two.
class Fp8Codec {
 public:
  explicit Fp8Codec(KvDtype kind) : e4m3_(kind == KvDtype::kFp8E4M3) {
    mant_bits_ = e4m3_ ? 3 : 2;
    const int bias = e4m3_ ? 7 : 15;
    min_exp_ = 1 - bias;
    for (int c = 0; c < 128; ++c) {
      const int e = c >> mant_bits_, m = c & ((1 << mant_bits_) - 1);
      double v;
      if (e == 0) v = std::ldexp(static_cast<double>(m), min_exp_ - mant_bits_);
      else v = std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -mant_bits_), e - bias);
      if (e4m3_ && c == 0x7F) v = NAN;
      if (!e4m3_ && e == 31) v = m == 0 ? INFINITY : NAN;
      value_[c] = v;
    }
    max_code_ = e4m3_ ? 0x7E : 0x7B;
    max_finite_ = value_[max_code_];
    // start_[b]: the largest code <= the smallest fp32 number of range b.
    const int shift = 23 - mant_bits_;
    for (uint32_t b = 0; b < (1u << (8 + mant_bits_)); ++b)
      start_[b] = static_cast<uint8_t>(floor_code(bits_float(b << shift)));
  }

  double max_finite() const { return max_finite_; }

  /// The value of a code (NaN and, for E5M2, Inf included).
  double decode(uint8_t code) const {
    const double v = value_[code & 0x7F];
    return (code & 0x80) ? -v : v;
  }

  /// Nearest finite code to x of x's sign, ties to the even code; NaN -> 0x7F
  /// with x's sign.
  uint8_t encode(float x) const {
    const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
    if (std::isnan(x)) return static_cast<uint8_t>(sign | 0x7F);
    const double a = std::fabs(static_cast<double>(x));
    // The largest code c with value[c] <= a: from the memo of a's range, a
    // step or two up (a range spans at most one fp8 spacing).
    int c = start_[(float_bits(x) & 0x7FFFFFFFu) >> (23 - mant_bits_)];
    while (c < max_code_ && value_[c + 1] <= a) ++c;
    if (c < max_code_) {
      const double below = a - value_[c], above = value_[c + 1] - a;  // exact in double
      if (above < below || (above == below && ((c + 1) & 1) == 0)) c = c + 1;
    }
    return static_cast<uint8_t>(sign | c);
  }

  /// Spacing of the format's numbers at |a| (the subnormal spacing below the
  /// normals, the top binade's past the largest finite value).
  double ulp(double a) const {
    a = std::fabs(a);
    if (a > max_finite_) a = max_finite_;
    uint64_t b;  // through the exponent bits, as UlpFn (no libm: it runs per element)
    std::memcpy(&b, &a, 8);
    int64_t e = static_cast<int64_t>((b >> 52) & 0x7FF) - 1023;
    if (e < min_exp_) e = min_exp_;
    const uint64_t u = static_cast<uint64_t>(e - mant_bits_ + 1023) << 52;
    double r;
    std::memcpy(&r, &u, 8);
    return r;
  }

 private:
  /// Largest code c in [0, max_code] with value[c] <= |x| (values ascend
  /// with c): a binary search.
  int floor_code(float x) const {
    const double a = std::fabs(static_cast<double>(x));
    int lo = 0, hi = max_code_;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (value_[mid] <= a) lo = mid;
      else hi = mid - 1;
    }
    return lo;
  }

  bool e4m3_;
  int mant_bits_ = 0, min_exp_ = 0, max_code_ = 0;
  double max_finite_ = 0;
  double value_[128] = {};
  uint8_t start_[1 << 11] = {};  // per fp32 range (8 exponent + mant_bits_ bits)
};

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
