// CPU backend: one pass over memory, Highway SIMD with runtime dispatch,
// OpenMP threads over (token, head-range) units.
//
// Per token: the cos/sin of the token's angles are computed once and reused
// by every head; each q head is rotated into q_rot, each k head
// into k_rot and (when the token has a slot) the same registers into k_pool;
// v is copied into v_pool. Rows whose last dimension is not contiguous are
// gathered into a scratch row first, so one SIMD routine serves every layout.
// Calls with options (not is_plain) take the options path instead
// (rope_options_cpu.cc).

#include <cmath>
#include <cstring>
#include <algorithm>
#include <vector>

#include "backends.h"
#include "common/inv_freq.h"
#include "problem.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/rope_pool_cpu.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include "cpu/rope_pool_cpu-inl.h"
#include "cpu/host.h"
#include "cpu/scratch.h"

HWY_BEFORE_NAMESPACE();
namespace ropekv {
namespace cpu {
namespace HWY_NAMESPACE {

// Rotates one contiguous head: out[0:R) = rope(x[0:R)), out[R:D) = x[R:D).
// `out2`, when not null, receives the same values (the pool row). With
// kStream the stores are non-temporal: the caller has checked that every
// store address is aligned to the vector and that there is no tail.
template <class Ops, bool kStream>
HWY_INLINE void RotateRow(const typename Ops::T* HWY_RESTRICT x, typename Ops::T* out,
                          typename Ops::T* out2, const float* HWY_RESTRICT c,
                          const float* HWY_RESTRICT s, int64_t half, int64_t rotary_dim,
                          int64_t head_dim) {
  using T = typename Ops::T;
  const int64_t n = static_cast<int64_t>(hn::Lanes(DF()));
  int64_t i = 0;
  for (; i + n <= half; i += n) {
    const VF x1 = Ops::Load(x + i), x2 = Ops::Load(x + half + i);
    const VF cv = hn::LoadU(DF(), c + i), sv = hn::LoadU(DF(), s + i);
    const auto o1 = Ops::Pack(hn::MulSub(x1, cv, hn::Mul(x2, sv)));
    const auto o2 = Ops::Pack(hn::MulAdd(x2, cv, hn::Mul(x1, sv)));
    Ops::template Put<kStream>(o1, out + i);
    Ops::template Put<kStream>(o2, out + half + i);
    if (out2) {
      Ops::template Put<kStream>(o1, out2 + i);
      Ops::template Put<kStream>(o2, out2 + half + i);
    }
  }
  if (i < half) {  // tail: one padded vector through a small buffer
    HWY_ALIGN T b1[(HWY_MAX_BYTES / sizeof(float))] = {}, b2[(HWY_MAX_BYTES / sizeof(float))] = {};
    const int64_t m = half - i;
    std::memcpy(b1, x + i, m * sizeof(T));
    std::memcpy(b2, x + half + i, m * sizeof(T));
    const VF x1 = Ops::Load(b1), x2 = Ops::Load(b2);
    const VF cv = hn::LoadU(DF(), c + i), sv = hn::LoadU(DF(), s + i);
    Ops::Store(hn::MulSub(x1, cv, hn::Mul(x2, sv)), b1);
    Ops::Store(hn::MulAdd(x2, cv, hn::Mul(x1, sv)), b2);
    std::memcpy(out + i, b1, m * sizeof(T));
    std::memcpy(out + half + i, b2, m * sizeof(T));
    if (out2) {
      std::memcpy(out2 + i, b1, m * sizeof(T));
      std::memcpy(out2 + half + i, b2, m * sizeof(T));
    }
  }
  if (rotary_dim < head_dim) {
    const size_t bytes = (head_dim - rotary_dim) * sizeof(T);
    std::memcpy(out + rotary_dim, x + rotary_dim, bytes);
    if (out2) std::memcpy(out2 + rotary_dim, x + rotary_dim, bytes);
  }
}

// Copies `bytes` contiguous bytes with non-temporal 16-byte stores (bytes a
// multiple of 16, dst 16-byte aligned): no read of the destination lines
// before they are written. 16-byte vectors on every target, so that a pool
// row needs only 16-byte alignment (numpy's large arrays have no more).
HWY_INLINE void StreamCopy(const void* HWY_RESTRICT src, void* dst, int64_t bytes) {
  const hn::CappedTag<uint8_t, 16> d8;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d8));
  const uint8_t* s = static_cast<const uint8_t*>(src);
  uint8_t* d = static_cast<uint8_t*>(dst);
  for (int64_t i = 0; i < bytes; i += n) hn::Stream(hn::LoadU(d8, s + i), d8, d + i);
}

// One head of q or k whose rows are not all contiguous: gathered into a
// scratch row, rotated, scattered.
template <class Ops>
HWY_NOINLINE void RotateHeadStrided(const View3& in, const View3& out, const View3* pool,
                                    int64_t t, int64_t h, int64_t slot, const Problem& p,
                                    const float* c, const float* s, const Scratch& sc) {
  using T = typename Ops::T;
  const int64_t D = p.head_dim, half = p.rotary_dim / 2;
  T* a = static_cast<T*>(sc.row_in);
  T* b = static_cast<T*>(sc.row_out);
  Gather(Row<T>(in, t, h), in.stride[2], D, a);
  RotateRow<Ops, false>(a, b, nullptr, c, s, half, p.rotary_dim, D);
  Scatter(b, D, Row<T>(out, t, h), out.stride[2]);
  if (pool) Scatter(b, D, Row<T>(*pool, slot, h), pool->stride[2]);
}

// Where a call's stores go. kCached: ordinary stores. kStreamPools: the pool
// rows (k_pool, v_pool) non-temporal, q_rot and k_rot cached: a pool row is
// a random row of a pool far larger than any cache, so an ordinary store
// would first read its lines from memory (a decode step's longest wait),
// while q_rot and k_rot are read by attention next. kStreamAll: every store
// non-temporal (large calls, whose outputs would evict each other anyway).
enum class Stores { kCached, kStreamPools, kStreamAll };

// Heads [h_begin, h_end) of token t (numbered q heads first, then k/v
// heads; done k/v heads first), with the token's cos/sin in c/s.
template <class Ops, Stores kStores>
HWY_INLINE void TokenHeads(const Problem& p, int64_t t, int64_t h_begin, int64_t h_end,
                           const float* HWY_RESTRICT c, const float* HWY_RESTRICT s,
                           bool contiguous, const Scratch& sc) {
  using T = typename Ops::T;
  constexpr bool kAll = kStores == Stores::kStreamAll;
  constexpr bool kPools = kStores != Stores::kCached;
  const int64_t D = p.head_dim, R = p.rotary_dim, half = R / 2;
  const int64_t Hq = p.num_qo_heads;
  const int64_t slot = load_index(p.slots, p.slot_type, t);
  // The kv heads first: their pool rows, stored non-temporally, then drain
  // to memory while the q heads are rotated instead of at the token's end
  // (warm decode 11-21 % faster on a Zen 3 guest; docs/performance.md).
  for (int64_t hk = std::max(h_begin, Hq) - Hq; hk < h_end - Hq; ++hk) {
    T* pool_row = slot >= 0 ? Row<T>(p.k_pool, slot, hk) : nullptr;
    T* k_rot_row = Row<T>(p.k_rot, t, hk);
    if (kStores == Stores::kStreamPools) {
      // The pool row is copied from k_rot, just stored and still in L1.
      RotateRow<Ops, false>(Row<T>(p.k, t, hk), k_rot_row, nullptr, c, s, half, R, D);
      if (pool_row) StreamCopy(k_rot_row, pool_row, D * static_cast<int64_t>(sizeof(T)));
    } else if (contiguous) {
      RotateRow<Ops, kAll>(Row<T>(p.k, t, hk), k_rot_row, pool_row, c, s, half, R, D);
    } else {
      RotateHeadStrided<Ops>(p.k, p.k_rot, slot >= 0 ? &p.k_pool : nullptr, t, hk, slot, p, c, s,
                             sc);
    }
    if (slot < 0) continue;
    const T* vs = Row<T>(p.v, t, hk);
    T* vd = Row<T>(p.v_pool, slot, hk);
    if (kPools) {
      StreamCopy(vs, vd, D * static_cast<int64_t>(sizeof(T)));
    } else if (p.v.stride[2] == 1 && p.v_pool.stride[2] == 1) {
      std::memcpy(vd, vs, D * sizeof(T));
    } else {
      for (int64_t d = 0; d < D; ++d) vd[d * p.v_pool.stride[2]] = vs[d * p.v.stride[2]];
    }
  }
  const int64_t hq_end = std::min(h_end, Hq);
  for (int64_t h = h_begin; h < hq_end; ++h) {
    if (contiguous) {
      RotateRow<Ops, kAll>(Row<T>(p.q, t, h), Row<T>(p.q_rot, t, h), nullptr, c, s, half, R, D);
    } else {
      RotateHeadStrided<Ops>(p.q, p.q_rot, nullptr, t, h, 0, p, c, s, sc);
    }
  }
}

// cos/sin of token t's angles into c/s (each half padded to whole vectors).
// theta = fp32(fp32(pos) * inv_freq[i]): an fp32 multiply, rounded once;
// with yarn's attention factor m, c = fp32(cos * m) and s = fp32(sin * m).
HWY_INLINE void TokenSinCos(const Problem& p, const float* inv_freq, int64_t t, float* c, float* s,
                            float* theta) {
  const int64_t half = p.rotary_dim / 2;
  const int64_t n = static_cast<int64_t>(hn::Lanes(DF()));
  const int64_t half_padded = (half + n - 1) / n * n;
  const float pos = static_cast<float>(load_index(p.positions, p.pos_type, t));
  const VF pv = hn::Set(DF(), pos);
  for (int64_t i = 0; i < half_padded; i += n)
    hn::StoreU(hn::Mul(pv, hn::LoadU(DF(), inv_freq + i)), DF(), theta + i);
  SinCos(theta, s, c, static_cast<size_t>(half_padded));
  if (p.attention_factor != 1.0f) {
    const VF m = hn::Set(DF(), p.attention_factor);
    for (int64_t i = 0; i < half_padded; i += n) {
      hn::StoreU(hn::Mul(hn::LoadU(DF(), c + i), m), DF(), c + i);
      hn::StoreU(hn::Mul(hn::LoadU(DF(), s + i), m), DF(), s + i);
    }
  }
}

bool Contiguous(const Problem& p) {
  return p.q.stride[2] == 1 && p.k.stride[2] == 1 && p.q_rot.stride[2] == 1 &&
         p.k_rot.stride[2] == 1 && p.k_pool.stride[2] == 1;
}

// The stores a call takes (see Stores). kStreamAll: a large call, every
// output row aligned to the vector and made of whole vectors. kStreamPools:
// a large pool, contiguous rows of whole 16-byte blocks (StreamCopy), pool
// rows 16-byte aligned.
template <class Ops>
Stores PickStores(const Problem& p, bool large) {
  using T = typename Ops::T;
  const int64_t e = static_cast<int64_t>(sizeof(T));
  const int64_t vec_bytes = static_cast<int64_t>(hn::Lanes(DF())) * e;
  const bool inputs = p.q.stride[2] == 1 && p.k.stride[2] == 1 && p.v.stride[2] == 1;
  const bool pools = Contiguous(p) && inputs && (p.head_dim * e) % 16 == 0 &&
                     LargePool(p, e) &&
                     RowsAligned(p.k_pool, e, 16) && RowsAligned(p.v_pool, e, 16);
  // A packed vector narrower than 16 bytes (16-bit types on 128-bit targets,
  // SCALAR) cannot be streamed by RotateRow: Highway's Stream writes a whole
  // 16-byte register (and needs 16-byte alignment) whatever the lane count.
  if (large && vec_bytes >= 16 && p.rotary_dim == p.head_dim &&
      (p.rotary_dim / 2 * e) % vec_bytes == 0 && inputs && RowsAligned(p.q_rot, e, vec_bytes) &&
      RowsAligned(p.k_rot, e, vec_bytes) && RowsAligned(p.k_pool, e, vec_bytes) &&
      RowsAligned(p.v_pool, e, vec_bytes))
    return Stores::kStreamAll;
  return pools ? Stores::kStreamPools : Stores::kCached;
}

// Whole tokens [t0, t1): the cos/sin of each token computed once, reused by
// all its heads.
template <class Ops, Stores kStores>
void TokensT(const Problem& p, const float* inv_freq, int64_t t0, int64_t t1, const Scratch& sc) {
  const bool contiguous = Contiguous(p);
  const int64_t heads = p.num_qo_heads + p.num_kv_heads;
  for (int64_t t = t0; t < t1; ++t) {
    TokenSinCos(p, inv_freq, t, sc.cos, sc.sin, sc.theta);
    TokenHeads<Ops, kStores>(p, t, 0, heads, sc.cos, sc.sin, contiguous, sc);
  }
  if (kStores != Stores::kCached) hwy::FlushStream();
}

template <class Ops>
void TokensDtype(const Problem& p, const float* inv_freq, int64_t t0, int64_t t1, bool large,
                 const Scratch& sc) {
  switch (PickStores<Ops>(p, large)) {
    case Stores::kStreamAll: return TokensT<Ops, Stores::kStreamAll>(p, inv_freq, t0, t1, sc);
    case Stores::kStreamPools: return TokensT<Ops, Stores::kStreamPools>(p, inv_freq, t0, t1, sc);
    case Stores::kCached: return TokensT<Ops, Stores::kCached>(p, inv_freq, t0, t1, sc);
  }
}

void ProcessTokens(const Problem& p, const float* inv_freq, int64_t t0, int64_t t1, bool large,
                   const Scratch& sc) {
  switch (p.dtype) {
    case FloatType::kF32: return TokensDtype<F32>(p, inv_freq, t0, t1, large, sc);
    case FloatType::kF16: return TokensDtype<F16>(p, inv_freq, t0, t1, large, sc);
    case FloatType::kBF16:
#if defined(ROPEKV_HAVE_BF16_NATIVE)
      if (host::cpu_has_avx512_bf16()) return TokensDtype<BF16Native>(p, inv_freq, t0, t1, large, sc);
#endif
      return TokensDtype<BF16>(p, inv_freq, t0, t1, large, sc);
  }
}

// cos/sin of tokens [0, T) into `table`: token t's cos at t * stride, its
// sin at t * stride + stride / 2.
void SinCosTable(const Problem& p, const float* inv_freq, float* table, int64_t stride,
                 float* theta) {
  for (int64_t t = 0; t < p.num_tokens; ++t)
    TokenSinCos(p, inv_freq, t, table + t * stride, table + t * stride + stride / 2, theta);
}

template <class Ops>
void HeadsDtype(const Problem& p, const float* c, const float* s, int64_t t, int64_t h0,
                int64_t h1, const Scratch& sc) {
  // Few large tokens: the pools may stream, the rest stays cached.
  if (PickStores<Ops>(p, false) == Stores::kStreamPools) {
    TokenHeads<Ops, Stores::kStreamPools>(p, t, h0, h1, c, s, true, sc);
    hwy::FlushStream();
    return;
  }
  TokenHeads<Ops, Stores::kCached>(p, t, h0, h1, c, s, Contiguous(p), sc);
}

// Heads [h0, h1) of token t, its cos/sin given.
void ProcessHeads(const Problem& p, const float* c, const float* s, int64_t t, int64_t h0,
                  int64_t h1, const Scratch& sc) {
  switch (p.dtype) {
    case FloatType::kF32: return HeadsDtype<F32>(p, c, s, t, h0, h1, sc);
    case FloatType::kF16: return HeadsDtype<F16>(p, c, s, t, h0, h1, sc);
    case FloatType::kBF16:
#if defined(ROPEKV_HAVE_BF16_NATIVE)
      if (host::cpu_has_avx512_bf16()) return HeadsDtype<BF16Native>(p, c, s, t, h0, h1, sc);
#endif
      return HeadsDtype<BF16>(p, c, s, t, h0, h1, sc);
  }
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace cpu
}  // namespace ropekv
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ropekv {
namespace cpu {

HWY_EXPORT(ProcessTokens);
HWY_EXPORT(SinCosTable);
HWY_EXPORT(ProcessHeads);
HWY_EXPORT(TargetName);

namespace {
using namespace host;

int64_t bytes_moved(const Problem& p) {
  const int64_t e = element_size(p.dtype);
  return e * p.num_tokens * p.head_dim * (2 * p.num_qo_heads + 5 * p.num_kv_heads);
}

int64_t bytes_written(const Problem& p) {
  const int64_t e = element_size(p.dtype);
  return e * p.num_tokens * p.head_dim * (p.num_qo_heads + 3 * p.num_kv_heads);
}

}  // namespace

void run(const Problem& p, const ExecOptions& options) {
  if (!is_plain(p)) return run_options(p, options);
  const float* inv_freq = inv_freq_table(p.freq);
  const int64_t T = p.num_tokens;
  const int64_t heads = p.num_qo_heads + p.num_kv_heads;
  const bool large = bytes_written(p) >= kStreamMinBytes;

  // Few large tokens: their cos/sin once, in the caller's table (see
  // run_planned); the threads read it through `tab` (a thread_local named in
  // a lambda they run would be their own).
  thread_local std::vector<float> table;
  float* tab = nullptr;
  const int64_t stride = 2 * round_up(p.rotary_dim / 2, kPad);
  const int threads = plan_threads(options, bytes_moved(p));
  TeamScratch& team = team_scratch(p, threads);
  run_planned(
      T, heads, threads,
      [&](int64_t t0, int64_t t1) {
        HWY_DYNAMIC_DISPATCH(ProcessTokens)(p, inv_freq, t0, t1, large, team.mine());
      },
      [&] {
        if (table.size() < static_cast<size_t>(T * stride)) table.resize(T * stride);
        tab = table.data();
        HWY_DYNAMIC_DISPATCH(SinCosTable)(p, inv_freq, tab, stride, team.of(0).theta);
      },
      [&](int64_t t, int64_t h0, int64_t h1) {
        const float* row = tab + t * stride;
        HWY_DYNAMIC_DISPATCH(ProcessHeads)(p, row, row + stride / 2, t, h0, h1, team.mine());
      });
}

std::string target_name() {
  return HWY_DYNAMIC_DISPATCH(TargetName)();
}

}  // namespace cpu
}  // namespace ropekv
#endif  // HWY_ONCE
