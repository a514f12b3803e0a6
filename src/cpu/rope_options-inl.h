// Per-target kernels of the CPU backend's options path: every call that is
// not is_plain(p) (interleaved pairs, yarn's attention factor, a
// cos_sin_cache, QK-norm, float32 and fp8 pools, in any combination).
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
// Included once per target by rope_pool_cpu.cc through foreach_target.h.
#if defined(ROPEKV_CPU_OPTIONS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ROPEKV_CPU_OPTIONS_INL_H_
#undef ROPEKV_CPU_OPTIONS_INL_H_
#else
#define ROPEKV_CPU_OPTIONS_INL_H_
#endif

#include <hwy/highway.h>

#include <algorithm>
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

template <Fp8Kind kKind>
struct PoolFp8 {  // encode_fp8(fp32(x / scale)), an IEEE division
  using T = uint8_t;
  static constexpr bool kSame = false;
  static HWY_INLINE void PutWide(VF v, VF scale, T* dst) {
    hn::StoreU(EncodeFp8<kKind>(hn::Div(v, scale)), DU8(), dst);
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

// Stores the first m lanes of o, rounded to q's dtype, at out.
template <class Ops>
HWY_INLINE void StorePartial(VF o, typename Ops::T* out, int64_t m) {
  HWY_ALIGN typename Ops::T b[kMaxLanes];
  Ops::Store(o, b);
  std::memcpy(out, b, static_cast<size_t>(m) * sizeof(typename Ops::T));
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

template <class Ops, class Pool>
HWY_INLINE void PutPoolRowT(const typename Ops::T* src, void* dst, int64_t dst_stride,
                            int64_t count, float scale, const Scratch& sc) {
  using PT = typename Pool::T;
  const VF sv = hn::Set(DF(), scale);
  if (dst_stride == 1) return PutWideRow<Ops, Pool>(src, static_cast<PT*>(dst), count, sv);
  PT* b = static_cast<PT*>(sc.row_pool);
  PutWideRow<Ops, Pool>(src, b, count, sv);
  Scatter(b, count, static_cast<PT*>(dst), dst_stride);
}

// A pool row (k or v of one head) from the contiguous row src of q's dtype:
// the pool format is picked here, once per row.
template <class Ops>
HWY_NOINLINE void PutPoolRow(PoolType type, const typename Ops::T* src, void* dst,
                             int64_t dst_stride, int64_t count, float scale, const Scratch& sc) {
  switch (type) {
    case PoolType::kFp8E4M3:
      return PutPoolRowT<Ops, PoolFp8<Fp8Kind::kE4M3>>(src, dst, dst_stride, count, scale, sc);
    case PoolType::kFp8E5M2:
      return PutPoolRowT<Ops, PoolFp8<Fp8Kind::kE5M2>>(src, dst, dst_stride, count, scale, sc);
    case PoolType::kF32:
      // (f32 inputs: a float32 pool is q's dtype.)
      if constexpr (!std::is_same_v<typename Ops::T, float>) {
        return PutPoolRowT<Ops, PoolF32<Ops>>(src, dst, dst_stride, count, scale, sc);
      } else {
        return PutPoolRowT<Ops, PoolSame<Ops>>(src, dst, dst_stride, count, scale, sc);
      }
    default:
      return PutPoolRowT<Ops, PoolSame<Ops>>(src, dst, dst_stride, count, scale, sc);
  }
}

// QK-norm's r = 1 / sqrt(sum(x^2) / D + eps), all in fp32.
template <class Ops>
HWY_INLINE float RmsFactor(const typename Ops::T* x, int64_t D, float eps) {
  const DF df;
  const int64_t n = static_cast<int64_t>(hn::Lanes(df));
  VF acc = hn::Zero(df);
  int64_t d = 0;
  for (; d + n <= D; d += n) {
    const VF v = Ops::Load(x + d);
    acc = hn::MulAdd(v, v, acc);
  }
  if (d < D) {
    const VF v = LoadPartial<Ops>(x + d, D - d);
    acc = hn::MulAdd(v, v, acc);
  }
  const float ss = hn::GetLane(hn::SumOfLanes(df, acc));
  return 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
}

// The input value the rotation uses: fp32(fp32(x * r) * w) with QK-norm.
template <bool kNorm>
HWY_INLINE VF Prep(VF x, VF r, const float* w) {
  if constexpr (kNorm) {
    return hn::Mul(hn::Mul(x, r), hn::LoadU(DF(), w));
  } else {
    (void)r;
    (void)w;
    return x;
  }
}

// One contiguous head: out[0:R) = rope(x'), out[R:D) = x', x' = x or its
// QK-norm (kNorm, w the fp32 weight, padded), rounded to q's dtype. c/s as
// TokenCosSinOpt makes them. out may be x.
template <class Ops, bool kInterleaved, bool kNorm>
HWY_INLINE void RotateRowOpt(const typename Ops::T* x, typename Ops::T* out, const float* c,
                             const float* s, const float* w, float eps, int64_t R, int64_t D) {
  using T = typename Ops::T;
  const DF df;
  const int64_t n = static_cast<int64_t>(hn::Lanes(df));
  VF r = hn::Set(df, 1.0f);
  if constexpr (kNorm) r = hn::Set(df, RmsFactor<Ops>(x, D, eps));
  if constexpr (!kInterleaved) {
    const int64_t half = R / 2;
    int64_t i = 0;
    for (; i + n <= half; i += n) {
      const VF x1 = Prep<kNorm>(Ops::Load(x + i), r, w + i);
      const VF x2 = Prep<kNorm>(Ops::Load(x + half + i), r, w + half + i);
      const VF cv = hn::LoadU(df, c + i), sv = hn::LoadU(df, s + i);
      Ops::Store(hn::MulSub(x1, cv, hn::Mul(x2, sv)), out + i);
      Ops::Store(hn::MulAdd(x2, cv, hn::Mul(x1, sv)), out + half + i);
    }
    if (i < half) {
      const int64_t m = half - i;
      const VF x1 = Prep<kNorm>(LoadPartial<Ops>(x + i, m), r, w + i);
      const VF x2 = Prep<kNorm>(LoadPartial<Ops>(x + half + i, m), r, w + half + i);
      const VF cv = hn::LoadU(df, c + i), sv = hn::LoadU(df, s + i);
      StorePartial<Ops>(hn::MulSub(x1, cv, hn::Mul(x2, sv)), out + i, m);
      StorePartial<Ops>(hn::MulAdd(x2, cv, hn::Mul(x1, sv)), out + half + i, m);
    }
  } else {
#if HWY_TARGET == HWY_SCALAR
    // One lane: each pair as two vectors, with the NeoX formulas.
    for (int64_t i = 0; i < R; i += 2) {
      const VF x1 = Prep<kNorm>(Ops::Load(x + i), r, w + i);
      const VF x2 = Prep<kNorm>(Ops::Load(x + i + 1), r, w + i + 1);
      const VF cv = hn::LoadU(df, c + i), sv = hn::LoadU(df, s + i + 1);
      Ops::Store(hn::MulSub(x1, cv, hn::Mul(x2, sv)), out + i);
      Ops::Store(hn::MulAdd(x2, cv, hn::Mul(x1, sv)), out + i + 1);
    }
#else
    // Pairs in adjacent lanes: o = x * (c, c) + swap(x) * (-s, s). Lane 2i is
    // fma(x[2i], c, -(x[2i+1] s)), lane 2i+1 fma(x[2i+1], c, x[2i] s): the
    // NeoX formulas' operations exactly (negation is exact).
    int64_t i = 0;
    for (; i + n <= R; i += n) {
      const VF xv = Prep<kNorm>(Ops::Load(x + i), r, w + i);
      const VF sw = hn::Reverse2(df, xv);
      Ops::Store(hn::MulAdd(xv, hn::LoadU(df, c + i), hn::Mul(sw, hn::LoadU(df, s + i))), out + i);
    }
    if (i < R) {  // R and the lane count are even: no pair straddles the tail
      const int64_t m = R - i;
      const VF xv = Prep<kNorm>(LoadPartial<Ops>(x + i, m), r, w + i);
      const VF sw = hn::Reverse2(df, xv);
      StorePartial<Ops>(hn::MulAdd(xv, hn::LoadU(df, c + i), hn::Mul(sw, hn::LoadU(df, s + i))),
                        out + i, m);
    }
#endif
  }
  if (R < D) {
    if constexpr (!kNorm) {  // copied unchanged
      if (out != x) std::memcpy(out + R, x + R, static_cast<size_t>(D - R) * sizeof(T));
    } else {
      int64_t d = R;
      for (; d + n <= D; d += n) Ops::Store(Prep<kNorm>(Ops::Load(x + d), r, w + d), out + d);
      if (d < D)
        StorePartial<Ops>(Prep<kNorm>(LoadPartial<Ops>(x + d, D - d), r, w + d), out + d, D - d);
    }
  }
}

// One head of q or k whose rows are not contiguous: gathered into a scratch
// row, rotated into row_out (left there for the pool), scattered.
template <class Ops, bool kInterleaved, bool kNorm>
HWY_NOINLINE void RotateHeadStridedOpt(const View3& in, const View3& outv, int64_t t, int64_t h,
                                       const Problem& p, const float* c, const float* s,
                                       const float* w, const Scratch& sc) {
  using T = typename Ops::T;
  const int64_t D = p.head_dim;
  T* a = static_cast<T*>(sc.row_in);
  T* b = static_cast<T*>(sc.row_out);
  Gather(Row<T>(in, t, h), in.stride[2], D, a);
  RotateRowOpt<Ops, kInterleaved, kNorm>(a, b, c, s, w, p.norm_eps, p.rotary_dim, D);
  Scatter(b, D, Row<T>(outv, t, h), outv.stride[2]);
}

// ------------------------------------------------------------ heads of a token

template <class Ops, bool kInterleaved, bool kNorm>
HWY_INLINE void QHeadsOpt(const Problem& p, const OptionData& od, int64_t t, int64_t h0, int64_t h1,
                          const float* c, const float* s, bool contiguous, const Scratch& sc) {
  using T = typename Ops::T;
  for (int64_t h = h0; h < h1; ++h) {
    if (contiguous) {
      RotateRowOpt<Ops, kInterleaved, kNorm>(Row<T>(p.q, t, h), Row<T>(p.q_rot, t, h), c, s,
                                             od.q_norm, p.norm_eps, p.rotary_dim, p.head_dim);
    } else {
      RotateHeadStridedOpt<Ops, kInterleaved, kNorm>(p.q, p.q_rot, t, h, p, c, s, od.q_norm, sc);
    }
  }
}

// k heads: k_rot, then the pool rows from k_rot as rounded and from v.
template <class Ops, bool kInterleaved, bool kNorm>
HWY_INLINE void KHeadsOpt(const Problem& p, const OptionData& od, int64_t t, int64_t h0, int64_t h1,
                          const float* c, const float* s, bool contiguous, const Scratch& sc) {
  using T = typename Ops::T;
  const int64_t D = p.head_dim;
  const int64_t slot = load_index(p.slots, p.slot_type, t);
  const int64_t pe = element_size(p.pool_type);
  for (int64_t hk = h0; hk < h1; ++hk) {
    const T* k_rot_row;
    if (contiguous) {
      T* out = Row<T>(p.k_rot, t, hk);
      RotateRowOpt<Ops, kInterleaved, kNorm>(Row<T>(p.k, t, hk), out, c, s, od.k_norm, p.norm_eps,
                                             p.rotary_dim, D);
      k_rot_row = out;
    } else {
      RotateHeadStridedOpt<Ops, kInterleaved, kNorm>(p.k, p.k_rot, t, hk, p, c, s, od.k_norm, sc);
      k_rot_row = static_cast<const T*>(sc.row_out);
    }
    if (slot < 0) continue;
    char* k_dst = static_cast<char*>(p.k_pool.data) +
                  (slot * p.k_pool.stride[0] + hk * p.k_pool.stride[1]) * pe;
    char* v_dst = static_cast<char*>(p.v_pool.data) +
                  (slot * p.v_pool.stride[0] + hk * p.v_pool.stride[1]) * pe;
    PutPoolRow<Ops>(p.pool_type, k_rot_row, k_dst, p.k_pool.stride[2], D, p.k_scale, sc);
    const T* v_row = Row<T>(p.v, t, hk);
    if (p.v.stride[2] != 1) {
      Gather(v_row, p.v.stride[2], D, static_cast<T*>(sc.row_in));
      v_row = static_cast<const T*>(sc.row_in);
    }
    PutPoolRow<Ops>(p.pool_type, v_row, v_dst, p.v_pool.stride[2], D, p.v_scale, sc);
  }
}

// Heads [h_begin, h_end) of token t (q heads first, then k/v heads).
template <class Ops, bool kInterleaved>
HWY_INLINE void TokenHeadsOpt(const Problem& p, const OptionData& od, int64_t t, int64_t h_begin,
                              int64_t h_end, const float* c, const float* s, bool contiguous,
                              const Scratch& sc) {
  const int64_t Hq = p.num_qo_heads;
  const int64_t hq_end = std::min(h_end, Hq);
  if (h_begin < hq_end) {
    if (od.q_norm) {
      QHeadsOpt<Ops, kInterleaved, true>(p, od, t, h_begin, hq_end, c, s, contiguous, sc);
    } else {
      QHeadsOpt<Ops, kInterleaved, false>(p, od, t, h_begin, hq_end, c, s, contiguous, sc);
    }
  }
  const int64_t k0 = std::max(h_begin, Hq) - Hq, k1 = h_end - Hq;
  if (k0 < k1) {
    if (od.k_norm) {
      KHeadsOpt<Ops, kInterleaved, true>(p, od, t, k0, k1, c, s, contiguous, sc);
    } else {
      KHeadsOpt<Ops, kInterleaved, false>(p, od, t, k0, k1, c, s, contiguous, sc);
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
    for (int64_t i = 0; i < half; ++i) {
      c_out[2 * i] = c_out[2 * i + 1] = c[i];
      s_out[2 * i] = -s[i];
      s_out[2 * i + 1] = s[i];
    }
    for (int64_t j = R; j < (R + n - 1) / n * n; ++j) c_out[j] = s_out[j] = 0.0f;
  }
}

// ------------------------------------------------------------ one call's work

template <class Ops, bool kInterleaved>
HWY_NOINLINE void RunOpt(const OptWork& w) {
  const Problem& p = *w.p;
  const Scratch& sc = *w.sc;
  const bool contiguous =
      p.q.stride[2] == 1 && p.k.stride[2] == 1 && p.q_rot.stride[2] == 1 && p.k_rot.stride[2] == 1;
  if (w.heads) {
    TokenHeadsOpt<Ops, kInterleaved>(p, *w.od, w.t0, w.h0, w.h1, w.c, w.s, contiguous, sc);
    return;
  }
  const int64_t heads = p.num_qo_heads + p.num_kv_heads;
  for (int64_t t = w.t0; t < w.t1; ++t) {
    TokenCosSinOpt(p, w.od->inv_freq, t, sc.cos, sc.sin, sc);
    TokenHeadsOpt<Ops, kInterleaved>(p, *w.od, t, 0, heads, sc.cos, sc.sin, contiguous, sc);
  }
}

/// The options path for one storage type (the pair layout picked here, once
/// per call).
template <class Ops>
HWY_INLINE void RunOptions(const OptWork& w) {
  if (w.p->is_neox) return RunOpt<Ops, false>(w);
  RunOpt<Ops, true>(w);
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
