// Per-target kernels of the CPU backend's options path: every call that is
// not is_plain(p) (interleaved pairs, a cos_sin_cache, QK-norm, float32 and
// fp8 pools, in any combination, with or without yarn's attention factor).
//
// The plain path (rope_pool_cpu.cc) is left as it is; here every option that
// changes the inner loops is a template parameter (storage type, pair
// layout, norm, pool format), chosen once per call (norm: once per head
// kind), so no loop tests an option per element. The per-token options
// (cache, attention factor) only change how the token's cos/sin are made.
//
// In place (q_rot == q, k_rot == k): every vector of a head is loaded before
// the elements it covers are stored, by the thread that stores them, and the
// norm reads the whole head first.
//
// Included once per target by rope_options_cpu.cc through foreach_target.h.
#if defined(ROPEKV_CPU_OPTIONS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ROPEKV_CPU_OPTIONS_INL_H_
#undef ROPEKV_CPU_OPTIONS_INL_H_
#else
#define ROPEKV_CPU_OPTIONS_INL_H_
#endif

#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "cpu/rope_pool_cpu-inl.h"
#include "cpu/scratch.h"
#include "problem.h"

HWY_BEFORE_NAMESPACE();
namespace ropekv {
namespace cpu {
namespace HWY_NAMESPACE {

// Lanes of the widest vector of any target: the size of tail buffers.
constexpr int64_t kMaxLanes = HWY_MAX_BYTES / sizeof(float);
static_assert(kMaxLanes <= 16, "scratch rows are padded to 16 fp32 lanes (host.h kPad)");

// ------------------------------------------------------------ pool formats
// PutWide stores an fp32 vector whose values q's dtype holds exactly (k_rot
// as rounded, v) in the pool's format.

template <class Ops>
struct PoolSame {  // q's dtype: the same bits
  using T = typename Ops::T;
  static constexpr bool kSame = true;
  static HWY_INLINE void PutWide(VF v, VF, T* dst) { Ops::Store(v, dst); }
};

template <class Ops>
struct PoolF32 {  // exact widening
  using T = float;
  static constexpr bool kSame = false;
  static HWY_INLINE void PutWide(VF v, VF, T* dst) { hn::StoreU(v, DF(), dst); }
};

// encode_fp8(fp32(x / scale)), an IEEE division. For a power-of-two scale
// (1 included) the product with its exact reciprocal is the same correctly
// rounded quotient, and far cheaper: then kDiv = false and `scale` holds the
// reciprocal.
template <Fp8Kind kKind, bool kDiv>
struct PoolFp8 {
  using T = uint8_t;
  static constexpr bool kSame = false;
  static HWY_INLINE void PutWide(VF v, VF scale, T* dst) {
    const VF q = kDiv ? hn::Div(v, scale) : hn::Mul(v, scale);
    hn::StoreU(EncodeFp8<kKind>(q), DU8(), dst);
  }
};

// log2(scale) where scale is a power of two whose reciprocal is an exact
// normal fp32 number (2^-125 .. 2^125), else INT_MIN. From the bits: the
// pool writers are made for every token.
HWY_INLINE int ExactReciprocalLog2(float scale) {
  uint32_t b;
  std::memcpy(&b, &scale, 4);
  const int biased = static_cast<int>(b >> 23);  // (a negative scale: 256 and up)
  return (b & 0x7FFFFFu) == 0 && biased >= 2 && biased <= 252 ? biased - 127 : INT_MIN;
}

// Whether 1 / scale is an exact normal fp32 number (scale a power of two).
HWY_INLINE bool ExactReciprocal(float scale) { return ExactReciprocalLog2(scale) != INT_MIN; }

// The packed (storage) vector of Ops at p, bits unchanged.
template <class Ops>
HWY_INLINE typename Ops::V LoadPacked(const typename Ops::T* p) {
  if constexpr (std::is_same_v<typename Ops::T, float>) {
    return hn::LoadU(DF(), p);
  } else {
    return hn::LoadU(DU16(), p);
  }
}

// The fp32 value of a packed vector: what Ops::Load of its bits gives.
template <class Ops>
HWY_INLINE VF Widen(typename Ops::V v) {
  if constexpr (std::is_same_v<typename Ops::T, float>) {
    return v;
  } else if constexpr (std::is_base_of_v<BF16, Ops>) {
    return hn::BitCast(DF(), hn::ShiftLeft<16>(hn::PromoteTo(DU32(), v)));
  } else {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
    return hn::PromoteTo(DF(), hn::BitCast(DF16(), v));
#else
    HWY_ALIGN uint16_t b[kMaxLanes];
    hn::Store(v, DU16(), b);
    return Ops::Load(b);
#endif
  }
}

// Pool writers of the register path: Put<kStream>(packed vector of q's
// dtype, dst) stores its lanes in the pool's format (kStream:
// non-temporally, dst aligned; only where kCanStream, a vector of the pool's
// elements being at least the 16 bytes Highway's Stream writes). The values
// are those of PoolSame / PoolF32 / PoolFp8 below, from the same bits. A
// writer with kPairs also has PutPair, two vectors (to two places) at once.
template <class Ops>
struct WriteSame {
  using PT = typename Ops::T;
  static constexpr bool kSame = true;
  static constexpr bool kPairs = false;
  static constexpr bool kCanStream = hn::MaxLanes(DF()) * sizeof(PT) >= 16;
  explicit WriteSame(float) {}
  template <bool kStream>
  HWY_INLINE void Put(typename Ops::V o, PT* dst) const {
    Ops::template Put<kStream && kCanStream>(o, dst);
  }
};

template <class Ops>
struct WriteF32 {
  using PT = float;
  static constexpr bool kSame = false;
  static constexpr bool kPairs = false;
  static constexpr bool kCanStream = hn::MaxLanes(DF()) * sizeof(PT) >= 16;
  explicit WriteF32(float) {}
  template <bool kStream>
  HWY_INLINE void Put(typename Ops::V o, PT* dst) const {
    const VF v = Widen<Ops>(o);
    if constexpr (kStream && kCanStream) {
      hn::Stream(v, DF(), dst);
    } else {
      hn::StoreU(v, DF(), dst);
    }
  }
};

// fp8 codes of 16-bit values (bf16, f16) times 2^k, made from their bits in
// 16-bit lanes: two packed vectors per step, twice the values per vector
// operation of EncodeFp8's fp32 lanes, with no widening and no multiply.
// The codes are encode_fp8(fp32(x * 2^k)) exactly: x * 2^k is exact in fp32
// wherever its code is not 0 or saturated, and the rounding below is that of
// encode_fp8 on the input's mantissa (nearest even). Only where every
// operation is one AVX-512 instruction (16-bit variable shifts among them),
// and only for the k of Fp8From16::Make: bf16 |k| <= 64 (bf16 subnormals
// then code 0); f16 where its subnormals map to fp8 subnormals or 0 and
// 448 (57344) * 2^-k is an f16 normal (E4M3 -7 <= k <= 8, E5M2 k = 0).
// Elsewhere the calls take WriteFp8 (EncodeFp8).
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
template <class Ops, Fp8Kind kKind>
struct Fp8From16 {
  static constexpr bool kAvailable = !std::is_same_v<typename Ops::T, float>;
  static constexpr bool kBf16 = std::is_base_of_v<BF16, Ops>;
  // The input format: exponent and mantissa bits, bias.
  static constexpr int kE = kBf16 ? 8 : 5, kM = kBf16 ? 7 : 10, kB = kBf16 ? 127 : 15;
  using C = Fp8Consts<kKind>;
  static constexpr int kMo = C::kMantissa, kBo = C::kBias;
  static constexpr int kShift = kM - kMo;  // mantissa bits dropped for a normal code
  using DW = hn::Repartition<uint16_t, DF>;  // two packed vectors of q's dtype
  using VW = hn::Vec<DW>;

  bool on = false;
  uint16_t clamp = 0, round_off = 0, sh_base = 0, bias_base = 0, sub_below = 0;

  // For x * 2^k (k = -log2(scale)); `on` false where the call takes EncodeFp8.
  static Fp8From16 Make(float scale) {
    Fp8From16 f;
    const int log2_scale = ExactReciprocalLog2(scale);
    if (!kAvailable || log2_scale == INT_MIN) return f;
    const int k = -log2_scale;
    const int lo = kBf16 ? -64 : (kKind == Fp8Kind::kE4M3 ? -7 : 0);
    const int hi = kBf16 ? 64 : (kKind == Fp8Kind::kE4M3 ? 8 : 0);
    if (k < lo || k > hi) return f;
    const int emax = kKind == Fp8Kind::kE4M3 ? 8 : 15;  // largest finite: 1.75 * 2^emax
    f.on = true;
    // Saturation: |x| above the largest finite value / 2^k (Inf too) is
    // clamped to it, whose code is the largest finite one.
    f.clamp = static_cast<uint16_t>(((emax - k + kB) << kM) | (3u << (kM - 2)));
    // Normal codes: (a + 2^(s-1) - 1 + odd + (rebias << s)) >> s, the
    // rebias k + bo - bi in the exponent field (wrapping 16-bit arithmetic).
    const int rebias = (k + kBo - kB) * (1 << kMo);
    f.round_off = static_cast<uint16_t>(((1 << (kShift - 1)) - 1) + rebias * (1 << kShift));
    // Subnormal codes: the significand rounded to nearest even after a right
    // shift by sh = sh_base - e (e >= 1), i.e. (sig + 2^(sh-1) - 1 + odd) >> sh,
    // 2^(sh-1) - 1 = 0xFFFF >> (17 - sh) = 0xFFFF >> (bias_base + e). Shifts
    // of 16 or more give 0.
    const int sh_base = kM - kMo + 1 + kB - k - kBo;
    f.sh_base = static_cast<uint16_t>(sh_base);
    f.bias_base = static_cast<uint16_t>(17 - sh_base);
    f.sub_below = static_cast<uint16_t>(kB - k - kBo + 1);  // exponent fields below: subnormal code
    return f;
  }

  HWY_INLINE VW Encode(VW b) const {
    const DW d;
    const VW a0 = hn::And(b, hn::Set(d, 0x7FFF));
    const auto nan = hn::Gt(a0, hn::Set(d, static_cast<uint16_t>(((1 << kE) - 1) << kM)));
    const VW a = hn::Min(a0, hn::Set(d, clamp));
    const VW one = hn::Set(d, 1);
    const VW odd = hn::And(hn::ShiftRight<kShift>(a), one);
    const VW normal = hn::ShiftRight<kShift>(hn::Add(hn::Add(a, hn::Set(d, round_off)), odd));
    const VW e = hn::ShiftRight<kM>(a);
    VW sig = hn::And(a, hn::Set(d, (1 << kM) - 1));
    VW es = e;
    if constexpr (kBf16) {
      sig = hn::Or(sig, hn::Set(d, 1 << kM));  // (bf16 subnormals give code 0 for these k)
    } else {  // f16 subnormals: no implicit bit, exponent 1
      sig = hn::Or(sig, hn::ShiftLeft<kM>(hn::Min(e, one)));
      es = hn::Max(e, one);
    }
    const VW sh = hn::Sub(hn::Set(d, sh_base), es);
    const VW half_m1 = hn::Shr(hn::Set(d, 0xFFFF), hn::Add(hn::Set(d, bias_base), es));
    const VW sub = hn::Shr(hn::Add(hn::Add(sig, half_m1), hn::And(hn::Shr(sig, sh), one)), sh);
    VW code = hn::IfThenElse(hn::Lt(e, hn::Set(d, sub_below)), sub, normal);
    code = hn::Or(hn::And(code, hn::Set(d, 0x7F)), hn::And(hn::ShiftRight<8>(b), hn::Set(d, 0x80)));
    return hn::IfThenElse(nan, hn::Set(d, 0x7F), code);
  }

  // The codes of o1 at d1 and of o2 at d2 (kStream: non-temporally).
  template <bool kStream>
  HWY_INLINE void PutPair(typename Ops::V o1, uint8_t* d1, typename Ops::V o2, uint8_t* d2) const {
    const DW d;
    const hn::Rebind<uint8_t, DW> d8;
    const auto codes = hn::TruncateTo(d8, Encode(hn::Combine(d, o2, o1)));
    const hn::Half<decltype(d8)> dh;
    if constexpr (kStream) {
      hn::Stream(hn::LowerHalf(dh, codes), dh, d1);
      hn::Stream(hn::UpperHalf(dh, codes), dh, d2);
    } else {
      hn::StoreU(hn::LowerHalf(dh, codes), dh, d1);
      hn::StoreU(hn::UpperHalf(dh, codes), dh, d2);
    }
  }
};
#else
template <class Ops, Fp8Kind kKind>
struct Fp8From16 {  // (WriteFp8 everywhere on this target)
  static constexpr bool kAvailable = false;
};
#endif

// encode_fp8(fp32(x / scale)); x * (1 / scale) where that is the same
// number (ExactReciprocal), picked once per call.
template <class Ops, Fp8Kind kKind>
struct WriteFp8 {
  using PT = uint8_t;
  static constexpr bool kSame = false;
  static constexpr bool kPairs = false;
  static constexpr bool kCanStream = hn::MaxLanes(DF()) * sizeof(PT) >= 16;
  bool div;
  VF s;
  explicit WriteFp8(float scale)
      : div(!ExactReciprocal(scale)), s(hn::Set(DF(), div ? scale : 1.0f / scale)) {}
  template <bool kStream>
  HWY_INLINE void Put(typename Ops::V o, PT* dst) const {
    const VF v = Widen<Ops>(o);
    const auto code = EncodeFp8<kKind>(div ? hn::Div(v, s) : hn::Mul(v, s));
    if constexpr (kStream && kCanStream) {
      hn::Stream(code, DU8(), dst);
    } else {
      hn::StoreU(code, DU8(), dst);
    }
  }
};

// WriteFp8 for a call whose k_scale and v_scale both take Fp8From16 (its
// own writer type, so that no loop tests which encoder to run): pairs of
// vectors through Fp8From16, single ones through WriteFp8's EncodeFp8, the
// same codes.
template <class Ops, Fp8Kind kKind>
struct WriteFp8From16 : WriteFp8<Ops, kKind> {
  using PT = uint8_t;
  static constexpr bool kPairs = true;
  Fp8From16<Ops, kKind> narrow;
  explicit WriteFp8From16(float scale)
      : WriteFp8<Ops, kKind>(scale), narrow(Fp8From16<Ops, kKind>::Make(scale)) {}
  template <bool kStream>
  HWY_INLINE void PutPair(typename Ops::V o1, PT* d1, typename Ops::V o2, PT* d2) const {
    narrow.template PutPair<kStream && WriteFp8<Ops, kKind>::kCanStream>(o1, d1, o2, d2);
  }
};

// A contiguous row of count elements of q's dtype (v) into a contiguous
// pool row through the writer W; with kStream count is a whole number of
// vectors.
template <class Ops, class W, bool kStream>
HWY_INLINE void PutVRow(const typename Ops::T* src, typename W::PT* dst, int64_t count,
                        const W& w) {
  using T = typename Ops::T;
  using PT = typename W::PT;
  if constexpr (W::kSame && !kStream) {
    std::memcpy(dst, src, static_cast<size_t>(count) * sizeof(T));  // the plain path's copy
  } else {
    const int64_t n = static_cast<int64_t>(hn::Lanes(DF()));
    int64_t d = 0;
    if constexpr (W::kPairs) {
      for (; d + 2 * n <= count; d += 2 * n)
        w.template PutPair<kStream>(LoadPacked<Ops>(src + d), dst + d,
                                    LoadPacked<Ops>(src + d + n), dst + d + n);
    }
    for (; d + n <= count; d += n) w.template Put<kStream>(LoadPacked<Ops>(src + d), dst + d);
    if (d < count) {
      HWY_ALIGN T b[kMaxLanes] = {};
      HWY_ALIGN PT pb[kMaxLanes];
      std::memcpy(b, src + d, static_cast<size_t>(count - d) * sizeof(T));
      w.template Put<false>(LoadPacked<Ops>(b), pb);
      std::memcpy(dst + d, pb, static_cast<size_t>(count - d) * sizeof(PT));
    }
  }
}

// Where RotateRowOpt sends a second copy of its output: nowhere (NoSink),
// a row of q's dtype (RowSink, null = nowhere), or a pool row through a
// writer (PoolSink, never null: a test in the loop kept the writer's
// constants from being hoisted out of it). Put takes a whole packed vector at
// element i, PutPair two of them (at i1 and i2), PutPartial the first m lanes
// of an fp32 vector (rounded to q's dtype first), CopyRaw elements [i, i + m)
// of the input unchanged.
struct NoSink {
  template <class V>
  HWY_INLINE void Put(V, int64_t) const {}
  template <class V>
  HWY_INLINE void PutPair(V, int64_t, V, int64_t) const {}
  HWY_INLINE void PutPartial(VF, int64_t, int64_t) const {}
  template <class T>
  HWY_INLINE void CopyRaw(const T*, int64_t, int64_t) const {}
};

template <class Ops>
struct RowSink {
  using T = typename Ops::T;
  T* dst;
  HWY_INLINE void Put(typename Ops::V o, int64_t i) const {
    if (dst) Ops::template Put<false>(o, dst + i);
  }
  HWY_INLINE void PutPair(typename Ops::V o1, int64_t i1, typename Ops::V o2, int64_t i2) const {
    Put(o1, i1);
    Put(o2, i2);
  }
  HWY_INLINE void PutPartial(VF v, int64_t i, int64_t m) const {
    if (!dst) return;
    HWY_ALIGN T b[kMaxLanes];
    Ops::Store(v, b);
    std::memcpy(dst + i, b, static_cast<size_t>(m) * sizeof(T));
  }
  HWY_INLINE void CopyRaw(const T* x, int64_t i, int64_t m) const {
    if (dst) std::memcpy(dst + i, x + i, static_cast<size_t>(m) * sizeof(T));
  }
};

template <class Ops, class W, bool kStream>
struct PoolSink {
  using T = typename Ops::T;
  using PT = typename W::PT;
  PT* dst;
  const W* w;
  HWY_INLINE void Put(typename Ops::V o, int64_t i) const {
    w->template Put<kStream>(o, dst + i);
  }
  HWY_INLINE void PutPair(typename Ops::V o1, int64_t i1, typename Ops::V o2, int64_t i2) const {
    if constexpr (W::kPairs) {
      w->template PutPair<kStream>(o1, dst + i1, o2, dst + i2);
    } else {
      Put(o1, i1);
      Put(o2, i2);
    }
  }
  HWY_INLINE void PutPartial(VF v, int64_t i, int64_t m) const {  // never with kStream
    HWY_ALIGN T b[kMaxLanes];
    HWY_ALIGN PT pb[kMaxLanes];
    Ops::Store(v, b);
    w->template Put<false>(LoadPacked<Ops>(b), pb);
    std::memcpy(dst + i, pb, static_cast<size_t>(m) * sizeof(PT));
  }
  HWY_INLINE void CopyRaw(const T* x, int64_t i, int64_t m) const {  // never with kStream
    PutVRow<Ops, W, false>(x + i, dst + i, m, *w);
  }
};

// ------------------------------------------------------------ row helpers

// m < Lanes elements at x, zero-padded to a vector.
template <class Ops>
HWY_INLINE VF LoadPartial(const typename Ops::T* x, int64_t m) {
  HWY_ALIGN typename Ops::T b[kMaxLanes] = {};
  std::memcpy(b, x, static_cast<size_t>(m) * sizeof(typename Ops::T));
  return Ops::Load(b);
}

// count elements of src (q's dtype, contiguous) into a contiguous pool row.
template <class Ops, class Pool>
HWY_INLINE void PutWideRow(const typename Ops::T* src, typename Pool::T* dst, int64_t count,
                           VF scale) {
  using PT = typename Pool::T;
  if constexpr (Pool::kSame) {
    std::memcpy(dst, src, static_cast<size_t>(count) * sizeof(PT));
  } else {
    const int64_t n = static_cast<int64_t>(hn::Lanes(DF()));
    int64_t d = 0;
    for (; d + n <= count; d += n) Pool::PutWide(Ops::Load(src + d), scale, dst + d);
    if (d < count) {
      HWY_ALIGN PT pb[kMaxLanes];
      Pool::PutWide(LoadPartial<Ops>(src + d, count - d), scale, pb);
      std::memcpy(dst + d, pb, static_cast<size_t>(count - d) * sizeof(PT));
    }
  }
}

// count elements from src to dst, non-temporally; dst aligned to a whole
// vector, count * sizeof(T) a whole number of vectors (CanStreamOpt). The
// chunks are as wide as the stores that wrote src just before (a packed
// vector of T), so that the loads take the stored data from the store
// buffer; never narrower than 16 bytes, which Highway's Stream writes even
// for a partial vector.
template <class T>
HWY_INLINE void StreamRow(const T* src, T* dst, int64_t count) {
  using DT = hn::Rebind<T, DF>;
  if constexpr (hn::MaxLanes(DT()) * sizeof(T) >= 16) {
    const DT d;
    const int64_t n = static_cast<int64_t>(hn::Lanes(d));
    for (int64_t i = 0; i < count; i += n) hn::Stream(hn::LoadU(d, src + i), d, dst + i);
  } else {
    const hn::ScalableTag<uint8_t> d8;
    const int64_t n = static_cast<int64_t>(hn::Lanes(d8));
    const uint8_t* s = reinterpret_cast<const uint8_t*>(src);
    uint8_t* d = reinterpret_cast<uint8_t*>(dst);
    const int64_t bytes = count * static_cast<int64_t>(sizeof(T));
    for (int64_t i = 0; i < bytes; i += n) hn::Stream(hn::LoadU(d8, s + i), d8, d + i);
  }
}

// Where a row is stored: directly (contiguous), through a scratch row and a
// scatter (strided), or through a scratch row and non-temporal stores.
enum class RowMode { kDirect, kStrided, kStream };

template <class Ops, class Pool>
HWY_INLINE void PutPoolRowT(const typename Ops::T* src, void* dst, int64_t dst_stride,
                            int64_t count, VF scale, RowMode mode, const Scratch& sc) {
  using PT = typename Pool::T;
  if (mode == RowMode::kStream && Pool::kSame)
    return StreamRow(reinterpret_cast<const PT*>(src), static_cast<PT*>(dst), count);
  if (mode != RowMode::kStream && dst_stride == 1)
    return PutWideRow<Ops, Pool>(src, static_cast<PT*>(dst), count, scale);
  PT* b = static_cast<PT*>(sc.row_pool);
  PutWideRow<Ops, Pool>(src, b, count, scale);
  if (mode == RowMode::kStream) return StreamRow(b, static_cast<PT*>(dst), count);
  Scatter(b, count, static_cast<PT*>(dst), dst_stride);
}

template <class Ops, Fp8Kind kKind>
HWY_INLINE void PutFp8RowT(const typename Ops::T* src, void* dst, int64_t dst_stride, int64_t count,
                           float scale, RowMode mode, const Scratch& sc) {
  if (ExactReciprocal(scale))
    return PutPoolRowT<Ops, PoolFp8<kKind, false>>(src, dst, dst_stride, count,
                                                   hn::Set(DF(), 1.0f / scale), mode, sc);
  PutPoolRowT<Ops, PoolFp8<kKind, true>>(src, dst, dst_stride, count, hn::Set(DF(), scale), mode,
                                         sc);
}

// A pool row (k or v of one head) from the contiguous row src of q's dtype:
// the pool format is picked here, once per row.
template <class Ops>
HWY_NOINLINE void PutPoolRow(PoolType type, const typename Ops::T* src, void* dst,
                             int64_t dst_stride, int64_t count, float scale, RowMode mode,
                             const Scratch& sc) {
  const VF one = hn::Set(DF(), 1.0f);
  switch (type) {
    case PoolType::kFp8E4M3:
      return PutFp8RowT<Ops, Fp8Kind::kE4M3>(src, dst, dst_stride, count, scale, mode, sc);
    case PoolType::kFp8E5M2:
      return PutFp8RowT<Ops, Fp8Kind::kE5M2>(src, dst, dst_stride, count, scale, mode, sc);
    case PoolType::kF32:
      // (f32 inputs: a float32 pool is q's dtype.)
      if constexpr (!std::is_same_v<typename Ops::T, float>) {
        return PutPoolRowT<Ops, PoolF32<Ops>>(src, dst, dst_stride, count, one, mode, sc);
      } else {
        return PutPoolRowT<Ops, PoolSame<Ops>>(src, dst, dst_stride, count, one, mode, sc);
      }
    default:
      return PutPoolRowT<Ops, PoolSame<Ops>>(src, dst, dst_stride, count, one, mode, sc);
  }
}

// sum(x^2) over a contiguous head, in fp32.
template <class Ops>
HWY_INLINE float SumSquares(const typename Ops::T* x, int64_t D) {
  const DF df;
  const int64_t n = static_cast<int64_t>(hn::Lanes(df));
  // Four accumulators: the sum's latency, not its throughput, bounds a head.
  VF a0 = hn::Zero(df), a1 = hn::Zero(df), a2 = hn::Zero(df), a3 = hn::Zero(df);
  int64_t d = 0;
#if HWY_TARGET != HWY_SCALAR
  if constexpr (std::is_base_of_v<BF16, Ops>) {
    // bf16 without widening: a 32-bit lane holds two elements, the even one
    // in its low half (its fp32 value is the lane shifted up by 16) and the
    // odd one in its high half (the lane with the low half cleared). One
    // load, a shift and an AND per 2n values instead of two widening loads
    // and two shifts (a QK-norm call of 16 cached tokens on Zen 4: 17.5
    // instead of 18 us; docs/performance.md, *Options*, CPU).
    const hn::Repartition<uint16_t, DF> d16;
    const DU32 du;
    const auto high = hn::Set(du, 0xFFFF0000u);
    for (; d + 4 * n <= D; d += 4 * n) {
      const auto u0 = hn::BitCast(du, hn::LoadU(d16, x + d));
      const auto u1 = hn::BitCast(du, hn::LoadU(d16, x + d + 2 * n));
      const VF e0 = hn::BitCast(df, hn::ShiftLeft<16>(u0)), o0 = hn::BitCast(df, hn::And(u0, high));
      const VF e1 = hn::BitCast(df, hn::ShiftLeft<16>(u1)), o1 = hn::BitCast(df, hn::And(u1, high));
      a0 = hn::MulAdd(e0, e0, a0);
      a1 = hn::MulAdd(o0, o0, a1);
      a2 = hn::MulAdd(e1, e1, a2);
      a3 = hn::MulAdd(o1, o1, a3);
    }
  }
#endif
  for (; d + 4 * n <= D; d += 4 * n) {
    const VF v0 = Ops::Load(x + d), v1 = Ops::Load(x + d + n);
    const VF v2 = Ops::Load(x + d + 2 * n), v3 = Ops::Load(x + d + 3 * n);
    a0 = hn::MulAdd(v0, v0, a0);
    a1 = hn::MulAdd(v1, v1, a1);
    a2 = hn::MulAdd(v2, v2, a2);
    a3 = hn::MulAdd(v3, v3, a3);
  }
  for (; d + n <= D; d += n) {
    const VF v = Ops::Load(x + d);
    a0 = hn::MulAdd(v, v, a0);
  }
  if (d < D) {
    const VF v = LoadPartial<Ops>(x + d, D - d);
    a1 = hn::MulAdd(v, v, a1);
  }
  return hn::GetLane(hn::SumOfLanes(df, hn::Add(hn::Add(a0, a1), hn::Add(a2, a3))));
}

// QK-norm's r = 1 / sqrt(sum(x^2) / D + eps) of heads [h0, h1) of `in` at
// token t into r[0, h1 - h0) (padded to whole vectors), all in fp32: every
// head's sum first, then the divisions and square roots as vectors, so the
// heads' latencies overlap.
template <class Ops>
HWY_INLINE void RmsFactors(const View3& in, int64_t t, int64_t h0, int64_t h1, int64_t D, float eps,
                           float* r, const Scratch& sc) {
  using T = typename Ops::T;
  const DF df;
  const int64_t n = static_cast<int64_t>(hn::Lanes(df));
  for (int64_t h = h0; h < h1; ++h) {
    const T* x = Row<T>(in, t, h);
    if (in.stride[2] != 1) {
      Gather(x, in.stride[2], D, static_cast<T*>(sc.row_in));
      x = static_cast<const T*>(sc.row_in);
    }
    r[h - h0] = SumSquares<Ops>(x, D);
  }
  const VF d = hn::Set(df, static_cast<float>(D)), e = hn::Set(df, eps), one = hn::Set(df, 1.0f);
  for (int64_t i = 0; i < h1 - h0; i += n) {
    const VF ss = hn::LoadU(df, r + i);
    hn::StoreU(hn::Div(one, hn::Sqrt(hn::Add(hn::Div(ss, d), e))), df, r + i);
  }
}

// RmsFactors' r of one head from its sum of squares: the same fp32
// operations, one lane.
HWY_INLINE float RmsFactor(float ss, int64_t D, float eps) {
  return 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
}

// Heads whose sums of squares RmsPipelined makes ahead of their rotation.
constexpr int64_t kRmsAhead = 4;

// r of heads [h0, h1) of a contiguous `in` at token t, each made kRmsAhead
// heads ahead of the rotation that uses it (visit(h, r)): the sums'
// loads stay independent of the rotations for that many heads, so loads of
// later heads are in flight while earlier ones are rotated and stored (with
// the sums of every head first, a pass of loads then a pass of stores:
// QK-norm 1.8x the plain call's time at T = 1024), and a head is rotated
// soon after its sum read it, from L1.
template <class Ops, class Visit>
HWY_INLINE void RmsPipelined(const View3& in, int64_t t, int64_t h0, int64_t h1, int64_t D,
                             float eps, const Visit& visit) {
  using T = typename Ops::T;
  float ss[kRmsAhead];
  const int64_t nh = h1 - h0;
  for (int64_t j = 0; j < std::min(kRmsAhead, nh); ++j)
    ss[j] = SumSquares<Ops>(Row<T>(in, t, h0 + j), D);
  for (int64_t j = 0; j < nh; ++j) {
    const float r = RmsFactor(ss[j % kRmsAhead], D, eps);
    if (j + kRmsAhead < nh) ss[j % kRmsAhead] = SumSquares<Ops>(Row<T>(in, t, h0 + j + kRmsAhead), D);
    visit(h0 + j, r);
  }
}

// The input value the rotation uses: fp32(fp32(x * r) * w[i]) with QK-norm.
// (w is null without: no offset is applied to it then.)
template <bool kNorm>
HWY_INLINE VF Prep(VF x, VF r, const float* w, int64_t i) {
  if constexpr (kNorm) {
    return hn::Mul(hn::Mul(x, r), hn::LoadU(DF(), w + i));
  } else {
    (void)r;
    (void)w;
    (void)i;
    return x;
  }
}

// Stores v, rounded to q's dtype, at out + i (kStream: non-temporally) and
// in the sink.
template <class Ops, bool kStream, class Sink>
HWY_INLINE void Put2(VF v, typename Ops::T* out, const Sink& sink, int64_t i) {
  const auto packed = Ops::Pack(v);
  Ops::template Put<kStream>(packed, out + i);
  sink.Put(packed, i);
}

// The first m lanes only (never streamed).
template <class Ops, class Sink>
HWY_INLINE void Put2Partial(VF v, typename Ops::T* out, const Sink& sink, int64_t i, int64_t m) {
  HWY_ALIGN typename Ops::T b[kMaxLanes];
  Ops::Store(v, b);
  std::memcpy(out + i, b, static_cast<size_t>(m) * sizeof(typename Ops::T));
  sink.PutPartial(v, i, m);
}

// One contiguous head: out[0:R) = rope(x'), out[R:D) = x', x' = x or its
// QK-norm (kNorm: w the fp32 weight, padded; rms its r), rounded to q's
// dtype; the sink gets the same (a pool row: from the registers). c/s as
// TokenCosSinOpt makes them. out may be x.
template <class Ops, bool kInterleaved, bool kNorm, bool kStream = false, class Sink = NoSink>
HWY_INLINE void RotateRowOpt(const typename Ops::T* x, typename Ops::T* out, const Sink& sink,
                             const float* HWY_RESTRICT c, const float* HWY_RESTRICT s,
                             const float* HWY_RESTRICT w, float rms, int64_t R, int64_t D) {
  using T = typename Ops::T;
  const DF df;
  const int64_t n = static_cast<int64_t>(hn::Lanes(df));
  VF r = hn::Set(df, 1.0f);
  if constexpr (kNorm) r = hn::Set(df, rms);
  if constexpr (!kInterleaved) {
    const int64_t half = R / 2;
    int64_t i = 0;
    for (; i + n <= half; i += n) {
      const VF x1 = Prep<kNorm>(Ops::Load(x + i), r, w, i);
      const VF x2 = Prep<kNorm>(Ops::Load(x + half + i), r, w, half + i);
      const VF cv = hn::LoadU(df, c + i), sv = hn::LoadU(df, s + i);
      // Both results before the first store, as the plain path: the stores
      // may alias x (in place), so the compiler keeps their order.
      const auto o1 = Ops::Pack(hn::MulSub(x1, cv, hn::Mul(x2, sv)));
      const auto o2 = Ops::Pack(hn::MulAdd(x2, cv, hn::Mul(x1, sv)));
      Ops::template Put<kStream>(o1, out + i);
      Ops::template Put<kStream>(o2, out + half + i);
      sink.PutPair(o1, i, o2, half + i);
    }
    if (i < half) {
      const int64_t m = half - i;
      const VF x1 = Prep<kNorm>(LoadPartial<Ops>(x + i, m), r, w, i);
      const VF x2 = Prep<kNorm>(LoadPartial<Ops>(x + half + i, m), r, w, half + i);
      const VF cv = hn::LoadU(df, c + i), sv = hn::LoadU(df, s + i);
      Put2Partial<Ops>(hn::MulSub(x1, cv, hn::Mul(x2, sv)), out, sink, i, m);
      Put2Partial<Ops>(hn::MulAdd(x2, cv, hn::Mul(x1, sv)), out, sink, half + i, m);
    }
  } else {
#if HWY_TARGET == HWY_SCALAR
    // One lane: each pair as two vectors, with the NeoX formulas.
    for (int64_t i = 0; i < R; i += 2) {
      const VF x1 = Prep<kNorm>(Ops::Load(x + i), r, w, i);
      const VF x2 = Prep<kNorm>(Ops::Load(x + i + 1), r, w, i + 1);
      const VF cv = hn::LoadU(df, c + i), sv = hn::LoadU(df, s + i + 1);
      const auto o1 = Ops::Pack(hn::MulSub(x1, cv, hn::Mul(x2, sv)));
      const auto o2 = Ops::Pack(hn::MulAdd(x2, cv, hn::Mul(x1, sv)));
      Ops::template Put<kStream>(o1, out + i);
      Ops::template Put<kStream>(o2, out + i + 1);
      sink.Put(o1, i);
      sink.Put(o2, i + 1);
    }
#else
    // Pairs in adjacent lanes: o = x * (c, c) + swap(x) * (-s, s). Lane 2i is
    // fma(x[2i], c, -(x[2i+1] s)), lane 2i+1 fma(x[2i+1], c, x[2i] s): the
    // NeoX formulas' operations exactly (negation is exact).
    int64_t i = 0;
    // Two vectors per step, both loaded before either is stored (as the
    // NeoX loop's two halves): two loads in flight, and in place stays safe.
    for (; i + 2 * n <= R; i += 2 * n) {
      const VF xa = Prep<kNorm>(Ops::Load(x + i), r, w, i);
      const VF xb = Prep<kNorm>(Ops::Load(x + i + n), r, w, i + n);
      const auto oa = Ops::Pack(
          hn::MulAdd(xa, hn::LoadU(df, c + i), hn::Mul(hn::Reverse2(df, xa), hn::LoadU(df, s + i))));
      const auto ob = Ops::Pack(hn::MulAdd(
          xb, hn::LoadU(df, c + i + n), hn::Mul(hn::Reverse2(df, xb), hn::LoadU(df, s + i + n))));
      Ops::template Put<kStream>(oa, out + i);
      Ops::template Put<kStream>(ob, out + i + n);
      sink.PutPair(oa, i, ob, i + n);
    }
    for (; i + n <= R; i += n) {
      const VF xv = Prep<kNorm>(Ops::Load(x + i), r, w, i);
      const VF sw = hn::Reverse2(df, xv);
      Put2<Ops, kStream>(hn::MulAdd(xv, hn::LoadU(df, c + i), hn::Mul(sw, hn::LoadU(df, s + i))),
                         out, sink, i);
    }
    if (i < R) {  // R and the lane count are even: no pair straddles the tail
      const int64_t m = R - i;
      const VF xv = Prep<kNorm>(LoadPartial<Ops>(x + i, m), r, w, i);
      const VF sw = hn::Reverse2(df, xv);
      Put2Partial<Ops>(hn::MulAdd(xv, hn::LoadU(df, c + i), hn::Mul(sw, hn::LoadU(df, s + i))), out,
                       sink, i, m);
    }
#endif
  }
  if (R < D) {
    if constexpr (!kNorm) {  // copied unchanged
      if (out != x) std::memcpy(out + R, x + R, static_cast<size_t>(D - R) * sizeof(T));
      sink.CopyRaw(x, R, D - R);
    } else {
      int64_t d = R;
      for (; d + n <= D; d += n)
        Put2<Ops, kStream>(Prep<kNorm>(Ops::Load(x + d), r, w, d), out, sink, d);
      if (d < D)
        Put2Partial<Ops>(Prep<kNorm>(LoadPartial<Ops>(x + d, D - d), r, w, d), out, sink, d, D - d);
    }
  }
}

// One head of q or k whose rows are strided, rotated into the scratch
// row_out (left there for the pool): gathered, rotated, scattered.
template <class Ops, bool kInterleaved, bool kNorm>
HWY_NOINLINE void RotateHeadViaScratch(const View3& in, const View3& outv, int64_t t, int64_t h,
                                       const Problem& p, const float* c, const float* s,
                                       const float* w, float rms, const Scratch& sc) {
  using T = typename Ops::T;
  const int64_t D = p.head_dim;
  const T* x = Row<T>(in, t, h);
  T* b = static_cast<T*>(sc.row_out);
  if (in.stride[2] != 1) {
    T* a = static_cast<T*>(sc.row_in);
    Gather(x, in.stride[2], D, a);
    x = a;
  }
  RotateRowOpt<Ops, kInterleaved, kNorm>(x, b, NoSink(), c, s, w, rms, p.rotary_dim, D);
  Scatter(b, D, Row<T>(outv, t, h), outv.stride[2]);
}

// ------------------------------------------------------------ heads of a token

// kStream: every row contiguous and aligned (CanStreamOpt); the stores are
// non-temporal, from the registers.
template <class Ops, bool kInterleaved, bool kNorm, bool kStream>
HWY_NOINLINE void QHeadsOpt(const Problem& p, const OptionData& od, int64_t t, int64_t h0,
                            int64_t h1, const float* c, const float* s, RowMode mode,
                            const Scratch& sc) {
  using T = typename Ops::T;
  if (kStream || mode == RowMode::kDirect) {
    auto rotate = [&](int64_t h, float rms) HWY_ATTR __attribute__((always_inline)) {
      RotateRowOpt<Ops, kInterleaved, kNorm, kStream>(Row<T>(p.q, t, h), Row<T>(p.q_rot, t, h),
                                                      NoSink(), c, s, od.q_norm, rms,
                                                      p.rotary_dim, p.head_dim);
    };
    if constexpr (kNorm) {
      RmsPipelined<Ops>(p.q, t, h0, h1, p.head_dim, p.norm_eps, rotate);
    } else {
      for (int64_t h = h0; h < h1; ++h) rotate(h, 1.0f);
    }
    return;
  }
  if (kNorm) RmsFactors<Ops>(p.q, t, h0, h1, p.head_dim, p.norm_eps, sc.head_r, sc);
  for (int64_t h = h0; h < h1; ++h) {
    const float rms = kNorm ? sc.head_r[h - h0] : 1.0f;
    RotateHeadViaScratch<Ops, kInterleaved, kNorm>(p.q, p.q_rot, t, h, p, c, s, od.q_norm, rms,
                                                   sc);
  }
}

// Row of kv head hk at `slot` in a pool of element type PT; null when the
// token writes no pool row (slot < 0).
template <class PT>
HWY_INLINE PT* PoolRow(const View3& pool, int64_t slot, int64_t hk) {
  return slot < 0 ? nullptr
                  : static_cast<PT*>(pool.data) + slot * pool.stride[0] + hk * pool.stride[1];
}

// k heads: k_rot, then the pool rows from k_rot as rounded and from v.
// Where v and the pool rows are contiguous (every large aligned call, and
// every contiguous one), the pool rows are written from the registers
// through the writer W (k: the packed k_rot vectors as they are stored; v:
// its vectors as loaded), non-temporally with kStream or kPoolStream (the
// pool rows alone, CanStreamPoolsOpt). Otherwise through scratch rows
// (PutPoolRow).
template <class Ops, class W, bool kInterleaved, bool kNorm, bool kStream, bool kPoolStream>
HWY_NOINLINE void KHeadsOpt(const Problem& p, const OptionData& od, int64_t t, int64_t h0,
                            int64_t h1, const float* c, const float* s, RowMode mode,
                            const Scratch& sc) {
  using T = typename Ops::T;
  using PT = typename W::PT;
  const int64_t D = p.head_dim;
  const int64_t slot = load_index(p.slots, p.slot_type, t);
  const bool regs = mode != RowMode::kStrided && p.v.stride[2] == 1 &&
                    p.k_pool.stride[2] == 1 && p.v_pool.stride[2] == 1 &&
                    (!kStream || W::kCanStream);
  constexpr bool kPools = (kStream || kPoolStream) && W::kCanStream;
  const W wk(p.k_scale), wv(p.v_scale);
  if (regs) {
    auto head = [&](int64_t hk, float rms) HWY_ATTR __attribute__((always_inline)) {
      const T* const k = Row<T>(p.k, t, hk);
      T* const k_rot = Row<T>(p.k_rot, t, hk);
      if (slot < 0)
        return RotateRowOpt<Ops, kInterleaved, kNorm, kStream>(k, k_rot, NoSink(), c, s, od.k_norm,
                                                               rms, p.rotary_dim, D);
      RotateRowOpt<Ops, kInterleaved, kNorm, kStream>(
          k, k_rot, PoolSink<Ops, W, kPools>{PoolRow<PT>(p.k_pool, slot, hk), &wk}, c, s, od.k_norm,
          rms, p.rotary_dim, D);
      PutVRow<Ops, W, kPools>(Row<T>(p.v, t, hk), PoolRow<PT>(p.v_pool, slot, hk), D, wv);
    };
    if constexpr (kNorm) {
      RmsPipelined<Ops>(p.k, t, h0, h1, D, p.norm_eps, head);
    } else {
      for (int64_t hk = h0; hk < h1; ++hk) head(hk, 1.0f);
    }
    return;
  }
  if (kNorm) RmsFactors<Ops>(p.k, t, h0, h1, D, p.norm_eps, sc.head_r, sc);
  for (int64_t hk = h0; hk < h1; ++hk) {
    const float rms = kNorm ? sc.head_r[hk - h0] : 1.0f;
    PT* const k_dst = PoolRow<PT>(p.k_pool, slot, hk);
    PT* const v_dst = PoolRow<PT>(p.v_pool, slot, hk);
    const T* k_rot_row;
    if (kStream) {  // (a pool vector under 16 bytes: through row_out)
      T* keep = slot >= 0 ? static_cast<T*>(sc.row_out) : nullptr;
      RotateRowOpt<Ops, kInterleaved, kNorm, true>(Row<T>(p.k, t, hk), Row<T>(p.k_rot, t, hk),
                                                   RowSink<Ops>{keep}, c, s, od.k_norm, rms,
                                                   p.rotary_dim, D);
      k_rot_row = keep;
    } else if (mode == RowMode::kDirect) {
      T* out = Row<T>(p.k_rot, t, hk);
      RotateRowOpt<Ops, kInterleaved, kNorm>(Row<T>(p.k, t, hk), out, NoSink(), c, s, od.k_norm,
                                             rms, p.rotary_dim, D);
      k_rot_row = out;
    } else {
      RotateHeadViaScratch<Ops, kInterleaved, kNorm>(p.k, p.k_rot, t, hk, p, c, s, od.k_norm, rms,
                                                     sc);
      k_rot_row = static_cast<const T*>(sc.row_out);
    }
    if (slot < 0) continue;
    PutPoolRow<Ops>(p.pool_type, k_rot_row, k_dst, p.k_pool.stride[2], D, p.k_scale, mode, sc);
    const T* v_row = Row<T>(p.v, t, hk);
    if (p.v.stride[2] != 1) {
      Gather(v_row, p.v.stride[2], D, static_cast<T*>(sc.row_in));
      v_row = static_cast<const T*>(sc.row_in);
    }
    PutPoolRow<Ops>(p.pool_type, v_row, v_dst, p.v_pool.stride[2], D, p.v_scale, mode, sc);
  }
}

// Heads [h_begin, h_end) of token t: the k/v heads first, so that their pool
// rows (non-temporal for a large pool) drain while the q heads are rotated.
template <class Ops, class W, bool kInterleaved, bool kStream, bool kPoolStream>
HWY_INLINE void TokenHeadsOpt(const Problem& p, const OptionData& od, int64_t t, int64_t h_begin,
                              int64_t h_end, const float* c, const float* s, RowMode mode,
                              const Scratch& sc) {
  const int64_t Hq = p.num_qo_heads;
  const int64_t k0 = std::max(h_begin, Hq) - Hq, k1 = h_end - Hq;
  if (k0 < k1) {
    if (od.k_norm) {
      KHeadsOpt<Ops, W, kInterleaved, true, kStream, kPoolStream>(p, od, t, k0, k1, c, s, mode,
                                                                  sc);
    } else {
      KHeadsOpt<Ops, W, kInterleaved, false, kStream, kPoolStream>(p, od, t, k0, k1, c, s, mode,
                                                                   sc);
    }
  }
  const int64_t hq_end = std::min(h_end, Hq);
  if (h_begin < hq_end) {
    if (od.q_norm) {
      QHeadsOpt<Ops, kInterleaved, true, kStream>(p, od, t, h_begin, hq_end, c, s, mode, sc);
    } else {
      QHeadsOpt<Ops, kInterleaved, false, kStream>(p, od, t, h_begin, hq_end, c, s, mode, sc);
    }
  }
}

// ------------------------------------------------------------ a token's cos/sin

// Row `pos` of the cos_sin_cache into c/s [half], widened exactly, zeros up
// to a whole vector.
template <class CacheOps>
HWY_INLINE void CacheRow(const CosSinCache& cc, int64_t pos, int64_t half, float* c, float* s,
                         const Scratch& sc) {
  using CT = typename CacheOps::T;
  const DF df;
  const int64_t n = static_cast<int64_t>(hn::Lanes(df));
  const CT* row = static_cast<const CT*>(cc.data) + pos * cc.stride[0];
  if (cc.stride[1] != 1) {
    CT* g = static_cast<CT*>(sc.row_in);  // free while cos/sin are made
    Gather(row, cc.stride[1], 2 * half, g);
    row = g;
  }
  int64_t i = 0;
  for (; i + n <= half; i += n) {
    hn::StoreU(CacheOps::Load(row + i), df, c + i);
    hn::StoreU(CacheOps::Load(row + half + i), df, s + i);
  }
  if (i < half) {
    hn::StoreU(LoadPartial<CacheOps>(row + i, half - i), df, c + i);
    hn::StoreU(LoadPartial<CacheOps>(row + half + i, half - i), df, s + i);
  }
}

// Token t's cos/sin in the layout RotateRowOpt takes, zero-padded to whole
// vectors: NeoX c[i], s[i] for i < half; interleaved c[2i] = c[2i+1] = c_i,
// s[2i] = -s_i, s[2i+1] = s_i for i < half.
HWY_INLINE void TokenCosSinOpt(const Problem& p, const float* inv_freq, int64_t t, float* c_out,
                               float* s_out, const Scratch& sc) {
  const DF df;
  const int64_t n = static_cast<int64_t>(hn::Lanes(df));
  const int64_t R = p.rotary_dim, half = R / 2;
  const int64_t half_padded = (half + n - 1) / n * n;
  float* c = p.is_neox ? c_out : sc.half_cos;
  float* s = p.is_neox ? s_out : sc.half_sin;
  const int64_t pos = load_index(p.positions, p.pos_type, t);
  if (p.cos_sin_cache.data != nullptr) {
    switch (p.cos_sin_cache.dtype) {
      case FloatType::kF32:
        CacheRow<F32>(p.cos_sin_cache, pos, half, c, s, sc);
        break;
      case FloatType::kF16:
        CacheRow<F16>(p.cos_sin_cache, pos, half, c, s, sc);
        break;
      case FloatType::kBF16:
        CacheRow<BF16>(p.cos_sin_cache, pos, half, c, s, sc);
        break;
    }
  } else {
    // theta = fp32(fp32(pos) * inv_freq[i]), as the plain path.
    const VF pv = hn::Set(df, static_cast<float>(pos));
    for (int64_t i = 0; i < half_padded; i += n)
      hn::StoreU(hn::Mul(pv, hn::LoadU(df, inv_freq + i)), df, sc.theta + i);
    SinCos(sc.theta, s, c, static_cast<size_t>(half_padded));
    if (p.attention_factor != 1.0f) {  // yarn: c = fp32(c * m), s = fp32(s * m)
      const VF m = hn::Set(df, p.attention_factor);
      for (int64_t i = 0; i < half_padded; i += n) {
        hn::StoreU(hn::Mul(hn::LoadU(df, c + i), m), df, c + i);
        hn::StoreU(hn::Mul(hn::LoadU(df, s + i), m), df, s + i);
      }
    }
  }
  if (!p.is_neox) {
    int64_t i = 0;
#if HWY_TARGET != HWY_SCALAR
    for (; i + n <= half; i += n) {
      const VF cv = hn::LoadU(df, c + i), sv = hn::LoadU(df, s + i);
      hn::StoreInterleaved2(cv, cv, df, c_out + 2 * i);
      hn::StoreInterleaved2(hn::Neg(sv), sv, df, s_out + 2 * i);
    }
#endif
    for (; i < half; ++i) {
      c_out[2 * i] = c_out[2 * i + 1] = c[i];
      s_out[2 * i] = -s[i];
      s_out[2 * i + 1] = s[i];
    }
    for (int64_t j = R; j < (R + n - 1) / n * n; ++j) c_out[j] = s_out[j] = 0.0f;
  }
}

// ------------------------------------------------------------ one call's work

// Whether every row the call writes can take whole non-temporal vector
// stores from the registers: inputs and outputs contiguous, outputs aligned
// to the vector and whole vectors of it, no partial vector in a head (R = D,
// half a whole number of packed vectors, those at least 16 bytes: Highway's
// Stream writes a whole 16-byte register).
template <class Ops>
HWY_INLINE bool CanStreamOpt(const Problem& p) {
  using T = typename Ops::T;
  const int64_t vb = static_cast<int64_t>(hn::Lanes(hn::ScalableTag<uint8_t>()));
  const int64_t packed = static_cast<int64_t>(hn::Lanes(DF()) * sizeof(T));
  if (packed < 16 || p.rotary_dim != p.head_dim) return false;
  if ((p.rotary_dim / 2 * static_cast<int64_t>(sizeof(T))) % packed != 0) return false;
  if (p.q.stride[2] != 1 || p.k.stride[2] != 1 || p.v.stride[2] != 1) return false;
  const int64_t e = element_size(p.dtype), pe = element_size(p.pool_type);
  const View3* rows[] = {&p.q_rot, &p.k_rot, &p.k_pool, &p.v_pool};
  for (const View3* a : rows) {
    const int64_t es = (a == &p.k_pool || a == &p.v_pool) ? pe : e;
    if (a->stride[2] != 1 || reinterpret_cast<uintptr_t>(a->data) % vb != 0) return false;
    if ((a->stride[0] * es) % vb != 0 || (a->stride[1] * es) % vb != 0) return false;
    if ((p.head_dim * es) % vb != 0) return false;
  }
  return true;
}

// Whether the pool rows alone can take whole non-temporal vector stores of
// the writer W (KHeadsOpt's register path) in a call that is not large:
// pools of at least kStreamMinBytes (LargePool), contiguous rows aligned to
// W's vector, every store position a whole vector (R = D, half a whole
// number of lanes), and rows of q, k, v, q_rot and k_rot contiguous.
template <class Ops, class W>
HWY_INLINE bool CanStreamPoolsOpt(const Problem& p) {
  if (!W::kCanStream) return false;
  const int64_t n = static_cast<int64_t>(hn::Lanes(DF()));
  const int64_t pe = static_cast<int64_t>(sizeof(typename W::PT));
  if (p.rotary_dim != p.head_dim || (p.rotary_dim / 2) % n != 0) return false;
  if (p.q.stride[2] != 1 || p.k.stride[2] != 1 || p.v.stride[2] != 1 || p.q_rot.stride[2] != 1 ||
      p.k_rot.stride[2] != 1)
    return false;
  return LargePool(p, pe) && RowsAligned(p.k_pool, pe, n * pe) && RowsAligned(p.v_pool, pe, n * pe);
}

template <class Ops, class W, bool kInterleaved, bool kStream, bool kPoolStream = false>
HWY_INLINE void RunOptT(const OptWork& w, RowMode mode) {
  const Problem& p = *w.p;
  const Scratch& sc = *w.sc;
  if (w.heads) {
    TokenHeadsOpt<Ops, W, kInterleaved, kStream, kPoolStream>(p, *w.od, w.t0, w.h0, w.h1, w.c, w.s,
                                                              mode, sc);
  } else {
    // Each token's cos/sin just before its heads (as the plain path): their
    // compute overlaps the memory traffic of the heads around them. (Made
    // for a block of tokens ahead, the block's compute ran with the memory
    // idle: yarn 1.3x the plain call's time at T = 1024.)
    const int64_t heads = p.num_qo_heads + p.num_kv_heads;
    for (int64_t t = w.t0; t < w.t1; ++t) {
      TokenCosSinOpt(p, w.od->inv_freq, t, sc.cos, sc.sin, sc);
      TokenHeadsOpt<Ops, W, kInterleaved, kStream, kPoolStream>(p, *w.od, t, 0, heads, sc.cos,
                                                                sc.sin, mode, sc);
    }
  }
  if (kStream || kPoolStream) hwy::FlushStream();
}

template <class Ops, class W, bool kInterleaved>
HWY_INLINE void RunOptW(const OptWork& w) {
  const Problem& p = *w.p;
  if (w.stream && CanStreamOpt<Ops>(p))
    return RunOptT<Ops, W, kInterleaved, true>(w, RowMode::kStream);
  if (CanStreamPoolsOpt<Ops, W>(p))
    return RunOptT<Ops, W, kInterleaved, false, true>(w, RowMode::kDirect);
  const bool contiguous =
      p.q.stride[2] == 1 && p.k.stride[2] == 1 && p.q_rot.stride[2] == 1 && p.k_rot.stride[2] == 1;
  RunOptT<Ops, W, kInterleaved, false>(w, contiguous ? RowMode::kDirect : RowMode::kStrided);
}

// fp8 pools: Fp8From16's writer where it takes both scales.
template <class Ops, Fp8Kind kKind, bool kInterleaved>
HWY_INLINE void RunOptFp8(const OptWork& w) {
  if constexpr (Fp8From16<Ops, kKind>::kAvailable) {
    using F = Fp8From16<Ops, kKind>;
    if (F::Make(w.p->k_scale).on && F::Make(w.p->v_scale).on)
      return RunOptW<Ops, WriteFp8From16<Ops, kKind>, kInterleaved>(w);
  }
  RunOptW<Ops, WriteFp8<Ops, kKind>, kInterleaved>(w);
}

// The pool format, once per call.
template <class Ops, bool kInterleaved>
HWY_NOINLINE void RunOpt(const OptWork& w) {
  switch (w.p->pool_type) {
    case PoolType::kFp8E4M3:
      return RunOptFp8<Ops, Fp8Kind::kE4M3, kInterleaved>(w);
    case PoolType::kFp8E5M2:
      return RunOptFp8<Ops, Fp8Kind::kE5M2, kInterleaved>(w);
    case PoolType::kF32:
      // (f32 inputs: a float32 pool is q's dtype.)
      if constexpr (!std::is_same_v<typename Ops::T, float>) {
        return RunOptW<Ops, WriteF32<Ops>, kInterleaved>(w);
      } else {
        return RunOptW<Ops, WriteSame<Ops>, kInterleaved>(w);
      }
    default:
      return RunOptW<Ops, WriteSame<Ops>, kInterleaved>(w);
  }
}

/// The options path for one pair layout: the storage type picked here, once
/// per call (rope_options_cpu.cc instantiates the NeoX layout,
/// rope_options_interleaved_cpu.cc the interleaved one).
template <bool kInterleaved>
HWY_INLINE void RunOptionsLayout(const OptWork& w) {
  switch (w.p->dtype) {
    case FloatType::kF32:
      return RunOpt<F32, kInterleaved>(w);
    case FloatType::kF16:
      return RunOpt<F16, kInterleaved>(w);
    case FloatType::kBF16:
#if defined(ROPEKV_HAVE_BF16_NATIVE)
      if (host::cpu_has_avx512_bf16()) return RunOpt<BF16Native, kInterleaved>(w);
#endif
      return RunOpt<BF16, kInterleaved>(w);
  }
}

/// cos/sin of tokens [0, T) into `table` for the (token, head-group) units:
/// token t's c at t * stride, its s at t * stride + stride / 2.
HWY_INLINE void CosSinTableOpt(const Problem& p, const OptionData& od, float* table, int64_t stride,
                               const Scratch& sc) {
  for (int64_t t = 0; t < p.num_tokens; ++t)
    TokenCosSinOpt(p, od.inv_freq, t, table + t * stride, table + t * stride + stride / 2, sc);
}

}  // namespace HWY_NAMESPACE
}  // namespace cpu
}  // namespace ropekv
HWY_AFTER_NAMESPACE();

#endif  // ROPEKV_CPU_OPTIONS_INL_H_
