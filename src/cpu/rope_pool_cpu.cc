// CPU backend: one pass over memory, Highway SIMD with runtime dispatch,
// OpenMP threads over (token, head-range) units.
//
// Per unit: the cos/sin of the token's angles are computed once and reused
// by every head of the unit; each q head is rotated into q_rot, each k head
// into k_rot and (when the token has a slot) the same registers into k_pool;
// v is copied into v_pool. Rows whose last dimension is not contiguous are
// gathered into a scratch row first, so one SIMD routine serves every layout.
#include <cmath>
#include <cstring>
#include <algorithm>
#include <vector>

#include "backends.h"
#include "problem.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/rope_pool_cpu.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "cpu/rope_pool_cpu-inl.h"
#include "cpu/scratch.h"

HWY_BEFORE_NAMESPACE();
namespace ropekv {
namespace cpu {
namespace HWY_NAMESPACE {

// Rotates one contiguous head: out[0:R) = rope(x[0:R)), out[R:D) = x[R:D).
// `out2`, when not null, receives the same values (the pool row).
template <class Ops>
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
    const VF o1 = hn::MulSub(x1, cv, hn::Mul(x2, sv));
    const VF o2 = hn::MulAdd(x2, cv, hn::Mul(x1, sv));
    Ops::Store(o1, out + i);
    Ops::Store(o2, out + half + i);
    if (out2) {
      Ops::Store(o1, out2 + i);
      Ops::Store(o2, out2 + half + i);
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

template <class T>
HWY_INLINE T* Row(const View3& a, int64_t r, int64_t h) {
  return static_cast<T*>(a.data) + r * a.stride[0] + h * a.stride[1];
}

template <class T>
void Gather(const T* src, int64_t stride, int64_t n, T* dst) {
  for (int64_t d = 0; d < n; ++d) dst[d] = src[d * stride];
}

template <class T>
void Scatter(const T* src, int64_t n, T* dst, int64_t stride) {
  for (int64_t d = 0; d < n; ++d) dst[d * stride] = src[d];
}

// One head of q or k: rotate x into out (and into pool_row if not null).
template <class Ops>
HWY_INLINE void RotateHead(const View3& in, const View3& out, const View3* pool, int64_t t,
                           int64_t h, int64_t slot, const Problem& p, const Scratch& sc) {
  using T = typename Ops::T;
  const int64_t D = p.head_dim, half = p.rotary_dim / 2;
  const T* x = Row<T>(in, t, h);
  T* o = Row<T>(out, t, h);
  T* o2 = pool ? Row<T>(*pool, slot, h) : nullptr;
  const bool contiguous =
      in.stride[2] == 1 && out.stride[2] == 1 && (!pool || pool->stride[2] == 1);
  if (contiguous) {
    RotateRow<Ops>(x, o, o2, sc.cos, sc.sin, half, p.rotary_dim, D);
    return;
  }
  T* a = static_cast<T*>(sc.row_in);
  T* b = static_cast<T*>(sc.row_out);
  Gather(x, in.stride[2], D, a);
  RotateRow<Ops>(a, b, nullptr, sc.cos, sc.sin, half, p.rotary_dim, D);
  Scatter(b, D, o, out.stride[2]);
  if (o2) Scatter(b, D, o2, pool->stride[2]);
}

template <class Ops>
void ProcessUnitT(const Problem& p, const float* inv_freq, int64_t t, int64_t h_begin,
                  int64_t h_end, const Scratch& sc) {
  using T = typename Ops::T;
  const int64_t half = p.rotary_dim / 2;
  const int64_t n = static_cast<int64_t>(hn::Lanes(DF()));
  const int64_t half_padded = (half + n - 1) / n * n;

  // theta = fp32(fp32(pos) * inv_freq[i]): an fp32 multiply, rounded once.
  const float pos = static_cast<float>(load_index(p.positions, p.pos_type, t));
  const VF pv = hn::Set(DF(), pos);
  for (int64_t i = 0; i < half_padded; i += n)
    hn::StoreU(hn::Mul(pv, hn::LoadU(DF(), inv_freq + i)), DF(), sc.theta + i);
  SinCos(sc.theta, sc.sin, sc.cos, static_cast<size_t>(half_padded));

  const int64_t slot = load_index(p.slots, p.slot_type, t);
  const int64_t Hq = p.num_qo_heads;
  for (int64_t h = h_begin; h < h_end; ++h) {
    if (h < Hq) {
      RotateHead<Ops>(p.q, p.q_rot, nullptr, t, h, 0, p, sc);
      continue;
    }
    const int64_t hk = h - Hq;
    RotateHead<Ops>(p.k, p.k_rot, slot >= 0 ? &p.k_pool : nullptr, t, hk, slot, p, sc);
    if (slot < 0) continue;
    const T* vs = Row<T>(p.v, t, hk);
    T* vd = Row<T>(p.v_pool, slot, hk);
    if (p.v.stride[2] == 1 && p.v_pool.stride[2] == 1) {
      std::memcpy(vd, vs, p.head_dim * sizeof(T));
    } else {
      for (int64_t d = 0; d < p.head_dim; ++d) vd[d * p.v_pool.stride[2]] = vs[d * p.v.stride[2]];
    }
  }
}

void ProcessUnit(const Problem& p, const float* inv_freq, int64_t t, int64_t h_begin,
                 int64_t h_end, const Scratch& sc) {
  switch (p.dtype) {
    case FloatType::kF32: return ProcessUnitT<F32>(p, inv_freq, t, h_begin, h_end, sc);
    case FloatType::kF16: return ProcessUnitT<F16>(p, inv_freq, t, h_begin, h_end, sc);
    case FloatType::kBF16: return ProcessUnitT<BF16>(p, inv_freq, t, h_begin, h_end, sc);
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

HWY_EXPORT(ProcessUnit);
HWY_EXPORT(TargetName);

namespace {

// Below this many bytes per call, a thread team costs more than it saves.
constexpr int64_t kMinBytesPerThread = 64 * 1024;

// Largest vector of any compiled target, in fp32 lanes: scratch is padded to it.
constexpr int64_t kPad = HWY_MAX_BYTES / sizeof(float) > 16 ? HWY_MAX_BYTES / sizeof(float) : 16;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// inv_freq of the last (rope_base, rotary_dim) seen by this thread, padded
// with zeros to a whole vector: pow() per call would cost more than a decode
// step's data movement.
const float* inv_freq_table(double rope_base, int64_t rotary_dim) {
  thread_local std::vector<float> table;
  thread_local double base_seen = -1.0;
  thread_local int64_t dim_seen = -1;
  if (base_seen != rope_base || dim_seen != rotary_dim) {
    const int64_t half = rotary_dim / 2;
    table.assign(round_up(half, kPad), 0.0f);
    for (int64_t i = 0; i < half; ++i)
      table[i] = static_cast<float>(
          std::pow(rope_base, -2.0 * static_cast<double>(i) / static_cast<double>(rotary_dim)));
    base_seen = rope_base;
    dim_seen = rotary_dim;
  }
  return table.data();
}

// Per-thread scratch, grown on demand and reused across calls.
Scratch thread_scratch(const Problem& p) {
  thread_local std::vector<float> buf;
  const int64_t hp = round_up(p.rotary_dim / 2, kPad);
  const int64_t dp = round_up(p.head_dim, kPad);
  const size_t need = static_cast<size_t>(3 * hp + 2 * dp + 64);
  if (buf.size() < need) buf.resize(need);
  float* b = buf.data();
  return Scratch{b, b + hp, b + 2 * hp, b + 3 * hp, b + 3 * hp + dp};
}

int64_t bytes_moved(const Problem& p) {
  const int64_t e = element_size(p.dtype);
  return e * p.num_tokens * p.head_dim * (2 * p.num_qo_heads + 5 * p.num_kv_heads);
}

}  // namespace

void run(const Problem& p, const ExecOptions& options) {
  const float* inv_freq = inv_freq_table(p.rope_base, p.rotary_dim);
  const int64_t heads = p.num_qo_heads + p.num_kv_heads;

  int threads = 1;
#ifdef _OPENMP
  threads = options.num_threads > 0 ? options.num_threads : omp_get_max_threads();
#endif
  const int64_t by_size = std::max<int64_t>(1, bytes_moved(p) / kMinBytesPerThread);
  threads = static_cast<int>(std::min<int64_t>(threads, by_size));

  // Units: whole tokens when there are enough of them, else each token's
  // heads split into groups so that every thread has work.
  const int64_t groups =
      std::min<int64_t>(heads, std::max<int64_t>(1, (2 * threads + p.num_tokens - 1) / p.num_tokens));
  const int64_t heads_per_group = (heads + groups - 1) / groups;
  const int64_t units = p.num_tokens * groups;

  auto body = [&](int64_t u) {
    const int64_t t = u / groups, g = u % groups;
    const int64_t h0 = g * heads_per_group;
    const int64_t h1 = std::min(heads, h0 + heads_per_group);
    if (h0 < h1) HWY_DYNAMIC_DISPATCH(ProcessUnit)(p, inv_freq, t, h0, h1, thread_scratch(p));
  };

  if (threads <= 1) {
    for (int64_t u = 0; u < units; ++u) body(u);
    return;
  }
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t u = 0; u < units; ++u) body(u);
#endif
}

std::string target_name() {
  return HWY_DYNAMIC_DISPATCH(TargetName)();
}

}  // namespace cpu
}  // namespace ropekv
#endif  // HWY_ONCE
