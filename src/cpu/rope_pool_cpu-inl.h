// Per-target SIMD helpers of the CPU backend (Highway): loads and stores of
// f32 / f16 / bf16 rows as fp32 vectors with round-to-nearest-even stores,
// and a vector sincos accurate for every fp32 angle.
//
// Included once per target by rope_pool_cpu.cc through foreach_target.h.
#if defined(ROPEKV_CPU_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ROPEKV_CPU_INL_H_
#undef ROPEKV_CPU_INL_H_
#else
#define ROPEKV_CPU_INL_H_
#endif

#include <cstring>

#include <hwy/highway.h>

#include "common/fp8.h"
#include "common/sincos.h"
#include "cpu/host.h"
#include "problem.h"

HWY_BEFORE_NAMESPACE();
namespace ropekv {
namespace cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Storage types: the fp32 vector of N lanes and N 16-bit elements.
using DF = hn::ScalableTag<float>;
using DU16 = hn::Rebind<uint16_t, DF>;
using DF16 = hn::Rebind<hwy::float16_t, DF>;
using DU32 = hn::RebindToUnsigned<DF>;
using DI32 = hn::RebindToSigned<DF>;
using VF = hn::Vec<DF>;

using VU16 = hn::Vec<DU16>;

// Row (t, h) of a [rows, heads, D] view.
template <class T>
HWY_INLINE T* Row(const View3& a, int64_t r, int64_t h) {
  return static_cast<T*>(a.data) + r * a.stride[0] + h * a.stride[1];
}

// Whether the rows of `a` are contiguous and each starts on a multiple of
// `align` bytes.
HWY_INLINE bool RowsAligned(const View3& a, int64_t elem_bytes, int64_t align) {
  if (a.stride[2] != 1 || reinterpret_cast<uintptr_t>(a.data) % align != 0) return false;
  for (int i = 0; i < 2; ++i)
    if ((a.stride[i] * elem_bytes) % align != 0) return false;
  return true;
}

// Whether the pools are large enough (kStreamMinBytes each, by k_pool's row
// stride) to be taken as not in cache: their rows are then stored
// non-temporally at any T (unless ROPEKV_CPU_STREAM_POOLS=0). A smaller
// pool may be in cache (a test, a toy model); its rows are stored there.
HWY_INLINE bool LargePool(const Problem& p, int64_t pool_elem_bytes) {
  // (P whole rows may pass 2^63 bytes where the pool's span, P - 1 rows and
  // one element, which validation bounds, does not: that counts as large.
  // A negative row stride never does.)
  int64_t bytes = 0;
  const int64_t stride = p.k_pool.stride[0];
  return stride > 0 &&
         (__builtin_mul_overflow(p.pool_size, stride, &bytes) ||
          __builtin_mul_overflow(bytes, pool_elem_bytes, &bytes) || bytes >= host::kStreamMinBytes) &&
         host::stream_pools_enabled();
}

template <class T>
void Gather(const T* src, int64_t stride, int64_t n, T* dst) {
  for (int64_t d = 0; d < n; ++d) dst[d] = src[d * stride];
}

template <class T>
void Scatter(const T* src, int64_t n, T* dst, int64_t stride) {
  for (int64_t d = 0; d < n; ++d) dst[d * stride] = src[d];
}

// Each storage type: Load (to fp32), Pack (fp32 to the storage vector,
// rounded), Put (store a packed vector; kStream = non-temporal, the address
// aligned to the vector), Store = Put(Pack(v)).
struct F32 {
  using T = float;
  using V = VF;
  static HWY_INLINE VF Load(const T* p) { return hn::LoadU(DF(), p); }
  static HWY_INLINE VF Pack(VF v) { return v; }
  template <bool kStream>
  static HWY_INLINE void Put(VF v, T* p) {
    if (kStream) {
      hn::Stream(v, DF(), p);
    } else {
      hn::StoreU(v, DF(), p);
    }
  }
  static HWY_INLINE void Store(VF v, T* p) { Put<false>(v, p); }
};

// Store of a packed 16-bit vector.
template <bool kStream>
HWY_INLINE void Put16(VU16 v, uint16_t* p) {
  if (kStream) {
    hn::Stream(v, DU16(), p);
  } else {
    hn::StoreU(v, DU16(), p);
  }
}

struct BF16 {
  using T = uint16_t;  // bf16 bits
  static HWY_INLINE VF Load(const T* p) {
    const auto bits = hn::PromoteTo(DU32(), hn::LoadU(DU16(), p));
    return hn::BitCast(DF(), hn::ShiftLeft<16>(bits));
  }
  // Round to nearest even, explicitly: Highway's DemoteTo to bf16 truncates
  // on some targets. NaN stays a (quiet) NaN.
  static HWY_INLINE VU16 Pack(VF v) {
    const DU32 du32;
    const auto u = hn::BitCast(du32, v);
    const auto lsb = hn::And(hn::ShiftRight<16>(u), hn::Set(du32, 1u));
    const auto rounded = hn::ShiftRight<16>(hn::Add(u, hn::Add(lsb, hn::Set(du32, 0x7FFFu))));
    const auto nan = hn::Or(hn::ShiftRight<16>(u), hn::Set(du32, 0x40u));
    const auto is_nan = hn::RebindMask(du32, hn::Ne(v, v));
    const auto r = hn::IfThenElse(is_nan, nan, rounded);
    return hn::DemoteTo(DU16(), hn::BitCast(DI32(), r));
  }
  using V = VU16;
  template <bool kStream>
  static HWY_INLINE void Put(VU16 v, T* p) { Put16<kStream>(v, p); }
  static HWY_INLINE void Store(VF v, T* p) { Put16<false>(Pack(v), p); }
};

#undef ROPEKV_HAVE_BF16_NATIVE  // set per target
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
#define ROPEKV_HAVE_BF16_NATIVE 1
// bf16 through AVX512_BF16's VCVTNEPS2BF16 (Zen 4, Cooper Lake, Sapphire
// Rapids), which Highway 1.0.3 does not use: one instruction instead of the
// nine above. It rounds to nearest even and quiets NaNs exactly as BF16::Pack
// does, but flushes denormal inputs to zero; a vector holding a denormal
// takes BF16::Pack instead. Emitted as inline asm (no target attribute
// needed); only called where the CPU reports AVX512_BF16.
struct BF16Native : BF16 {
  static HWY_INLINE VU16 Pack(VF v) {
    const auto denormal = hn::Mask512<float>{_mm512_fpclass_ps_mask(v.raw, 0x20)};
    if (HWY_UNLIKELY(!hn::AllFalse(DF(), denormal))) return BF16::Pack(v);
    __m256i r;
    asm("vcvtneps2bf16 %1, %0" : "=v"(r) : "v"(v.raw));
    return VU16{r};
  }
  static HWY_INLINE void Store(VF v, T* p) { Put16<false>(Pack(v), p); }
};
#endif

struct F16 {
  using T = uint16_t;  // IEEE binary16 bits
  static HWY_INLINE VF Load(const T* p) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
    // F16C: the hardware conversion, exact for every pattern.
    return hn::PromoteTo(DF(), hn::LoadU(DF16(), reinterpret_cast<const hwy::float16_t*>(p)));
#else
    // Highway's emulated f16 -> f32 PromoteTo (SSSE3, SSE4, EMU128, SCALAR
    // in Highway 1.0.3) turns Inf and NaN into finite numbers (exponent 31 is
    // rebiased like a normal one: Inf -> 65536). Convert exactly here instead
    // (F. Giesen's half_to_float): normals rebiased, Inf/NaN to exponent 255,
    // subnormals renormalised by an exact fp32 subtraction.
    const DU32 du;
    const DF df;
    const auto h = hn::PromoteTo(du, hn::LoadU(DU16(), p));
    const auto shifted_exp = hn::Set(du, 0x7C00u << 13);
    auto o = hn::ShiftLeft<13>(hn::And(h, hn::Set(du, 0x7FFFu)));  // exponent and mantissa
    const auto e = hn::And(o, shifted_exp);
    o = hn::Add(o, hn::Set(du, (127u - 15u) << 23));
    o = hn::IfThenElse(hn::Eq(e, shifted_exp), hn::Add(o, hn::Set(du, (128u - 16u) << 23)), o);
    const auto sub = hn::BitCast(du, hn::Sub(hn::BitCast(df, hn::Add(o, hn::Set(du, 1u << 23))),
                                             hn::BitCast(df, hn::Set(du, 113u << 23))));
    o = hn::IfThenElse(hn::Eq(e, hn::Zero(du)), sub, o);
    o = hn::Or(o, hn::ShiftLeft<16>(hn::And(h, hn::Set(du, 0x8000u))));
    return hn::BitCast(df, o);
#endif
  }
  // Round to nearest even on every target, subnormals and overflow to Inf
  // included. F16C's conversion does it in one instruction (Highway passes
  // the immediate nearest-even mode, whatever MXCSR says); elsewhere the
  // rounding trick of F. Giesen's float_to_half_fast3_rtne: integer rounding
  // for normals, an fp32 add for subnormals. The two differ only in which
  // NaN they give (F16C keeps the payload's top bits, the trick 0x7E00).
  static HWY_INLINE VU16 Pack(VF v) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
    return hn::BitCast(DU16(), hn::DemoteTo(DF16(), v));
#else
    const DI32 di;
    const DF df;
    const auto u = hn::BitCast(di, v);
    const auto sign = hn::And(u, hn::Set(di, static_cast<int32_t>(0x80000000u)));
    const auto a = hn::Xor(u, sign);  // |v| bits, a non-negative int32
    const auto inf_or_nan = hn::IfThenElse(hn::Gt(a, hn::Set(di, 0x7F800000)),
                                           hn::Set(di, 0x7E00), hn::Set(di, 0x7C00));
    const auto magic = hn::Set(di, 126 << 23);  // 0.5f: aligns subnormal f16 ulp
    const auto sub = hn::Sub(hn::BitCast(di, hn::Add(hn::BitCast(df, a), hn::BitCast(df, magic))),
                             magic);
    const auto odd = hn::And(hn::ShiftRight<13>(a), hn::Set(di, 1));
    const auto norm = hn::ShiftRight<13>(
        hn::Add(hn::Add(a, hn::Set(di, static_cast<int32_t>(0xC8000FFFu))), odd));
    auto r = hn::IfThenElse(hn::Lt(a, hn::Set(di, 113 << 23)), sub, norm);
    r = hn::IfThenElse(hn::Lt(a, hn::Set(di, 143 << 23)), r, inf_or_nan);
    r = hn::Or(r, hn::BitCast(di, hn::ShiftRight<16>(hn::BitCast(DU32(), sign))));
    return hn::DemoteTo(DU16(), hn::And(r, hn::Set(di, 0xFFFF)));
#endif
  }
  using V = VU16;
  template <bool kStream>
  static HWY_INLINE void Put(VU16 v, T* p) { Put16<kStream>(v, p); }
  static HWY_INLINE void Store(VF v, T* p) { Put16<false>(Pack(v), p); }
};

// fp8 (OCP E4M3 "fn" / E5M2) of fp32 lanes, bit for bit common/fp8.h's
// encode_fp8: round to nearest even, saturate to the largest finite value
// (Inf included), every NaN -> 0x7F (no sign: the CUDA hardware's bits). One
// byte per lane.
using DU8 = hn::Rebind<uint8_t, DF>;

template <Fp8Kind kKind>
struct Fp8Consts;
template <>
struct Fp8Consts<Fp8Kind::kE4M3> {
  static constexpr int kMantissa = 3, kBias = 7;
  static constexpr float kMax = 448.0f;
  static constexpr uint32_t kMaxCode = 0x7E;
};
template <>
struct Fp8Consts<Fp8Kind::kE5M2> {
  static constexpr int kMantissa = 2, kBias = 15;
  static constexpr float kMax = 57344.0f;
  static constexpr uint32_t kMaxCode = 0x7B;
};

template <Fp8Kind kKind>
HWY_INLINE hn::Vec<DU8> EncodeFp8(VF x) {
  using C = Fp8Consts<kKind>;
  constexpr int kShift = 23 - C::kMantissa;
  // Below the smallest normal the code counts quanta of 2^(1 - bias - M):
  // adding kMagic, whose ulp is that quantum, rounds to a whole number of
  // them (nearest even) and leaves the count in the low mantissa bits.
  constexpr float kMagic = static_cast<float>(1u << (24 - C::kBias - C::kMantissa));
  // Normal: the mantissa rounded to M bits in integers (nearest even), the
  // exponent rebiased by the same addition: (a + half - 1 + odd - rebias)
  // >> shift, in wrapping uint32 arithmetic.
  constexpr uint32_t kRound =
      ((1u << (kShift - 1)) - 1u) - (static_cast<uint32_t>(127 - C::kBias) << 23);
  const DU32 du;
  const DI32 di;
  const DF df;
  const auto u = hn::BitCast(du, x);
  const auto sign = hn::And(hn::ShiftRight<24>(u), hn::Set(du, 0x80u));
  const auto ai = hn::BitCast(di, hn::And(u, hn::Set(du, 0x7FFFFFFFu)));  // |x| bits, < 2^31
  // Saturation: above the largest finite value (Inf too) its bits, which
  // round to its code. NaN is set apart below.
  uint32_t max_bits;
  const float kMax = C::kMax;
  std::memcpy(&max_bits, &kMax, 4);
  const auto a = hn::BitCast(du, hn::Min(ai, hn::Set(di, static_cast<int32_t>(max_bits))));
  const auto magic = hn::Set(df, kMagic);
  const auto sub = hn::Sub(hn::BitCast(du, hn::Add(hn::BitCast(df, a), magic)),
                           hn::BitCast(du, magic));
  const auto odd = hn::And(hn::ShiftRight<kShift>(a), hn::Set(du, 1u));
  const auto norm = hn::ShiftRight<kShift>(hn::Add(hn::Add(a, hn::Set(du, kRound)), odd));
  auto code = hn::IfThenElse(
      hn::RebindMask(du, hn::Lt(hn::BitCast(di, a), hn::Set(di, (128 - C::kBias) << 23))), sub,
      norm);
  code = hn::IfThenElse(hn::RebindMask(du, hn::Gt(ai, hn::Set(di, 0x7F800000))),
                        hn::Set(du, 0x7Fu), hn::Or(code, sign));
  return hn::U8FromU32(code);
}

// sin/cos of `count` fp32 angles (count a multiple of Lanes(DF)), the vector
// form of common/sincos.h: reduction by pi/2 in f64 lanes, polynomials in f64
// (more than fp32 needs), rounded once to fp32.
HWY_INLINE void SinCos(const float* theta, float* sin_out, float* cos_out, size_t count) {
#if HWY_HAVE_FLOAT64
  using namespace sincos_consts;
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> dfh;  // half-width fp32, one per f64 lane
  const size_t n = hn::Lanes(dd);
  for (size_t i = 0; i < count; i += n) {
    const auto x = hn::PromoteTo(dd, hn::LoadU(dfh, theta + i));
    const auto k = hn::Round(hn::Mul(x, hn::Set(dd, kTwoOverPi)));
    if (!hn::AllTrue(dd, hn::Lt(hn::Abs(k), hn::Set(dd, kMaxQuadrant)))) {
      for (size_t j = i; j < i + n; ++j) sincos_fp32(theta[j], &sin_out[j], &cos_out[j]);
      continue;
    }
    auto r = hn::NegMulAdd(k, hn::Set(dd, kPio2Hi), x);
    r = hn::NegMulAdd(k, hn::Set(dd, kPio2Mid), r);
    r = hn::NegMulAdd(k, hn::Set(dd, kPio2Lo), r);
    const auto z = hn::Mul(r, r);
    const auto sp = hn::MulAdd(hn::Mul(r, z),
                               hn::MulAdd(z, hn::MulAdd(z, hn::Set(dd, kS3), hn::Set(dd, kS2)),
                                          hn::Set(dd, kS1)),
                               r);
    const auto cpoly =
        hn::MulAdd(z, hn::MulAdd(z, hn::Set(dd, kC3), hn::Set(dd, kC2)), hn::Set(dd, kC1));
    const auto cp = hn::MulAdd(hn::Mul(z, z), cpoly,
                               hn::NegMulAdd(hn::Set(dd, 0.5), z, hn::Set(dd, 1.0)));
    // Quadrant q = k mod 4 in {0, 1, 2, 3}, computed in f64 (k is an integer).
    const auto q = hn::Sub(k, hn::Mul(hn::Set(dd, 4.0), hn::Floor(hn::Mul(k, hn::Set(dd, 0.25)))));
    const auto one = hn::Set(dd, 1.0), two = hn::Set(dd, 2.0), three = hn::Set(dd, 3.0);
    const auto odd = hn::Or(hn::Eq(q, one), hn::Eq(q, three));
    const auto s = hn::IfThenElse(odd, cp, sp);
    const auto c = hn::IfThenElse(odd, sp, cp);
    const auto neg_s = hn::Ge(q, two);
    const auto neg_c = hn::Or(hn::Eq(q, one), hn::Eq(q, two));
    hn::StoreU(hn::DemoteTo(dfh, hn::IfThenElse(neg_s, hn::Neg(s), s)), dfh, sin_out + i);
    hn::StoreU(hn::DemoteTo(dfh, hn::IfThenElse(neg_c, hn::Neg(c), c)), dfh, cos_out + i);
  }
#else
  for (size_t j = 0; j < count; ++j) sincos_fp32(theta[j], &sin_out[j], &cos_out[j]);
#endif
}

}  // namespace HWY_NAMESPACE
}  // namespace cpu
}  // namespace ropekv
HWY_AFTER_NAMESPACE();

#endif  // ROPEKV_CPU_INL_H_
