// The CUDA kernel of ropekv: one launch rotates q into q_rot, k into k_rot
// and the pool row, and copies v into v_pool.
//
// Work decomposition. The heads of one token are laid end to end as
// "virtual heads" vh in [0, Hq + 2*Hk): q heads, then k heads, then v heads.
// A *team* of TL lanes (32, or 64/128 for very wide heads) owns one token t
// and one contiguous range of virtual heads (a *group*). Inside a team, lane
// l owns the vector chunk c = l % items of a head and the head offset
// hp = l / items; the team walks its head range HP heads at a time.
//
//   chunk c < CH (= half / VEC): the pair of VEC-element vectors at
//            x[c*VEC ...] and x[half + c*VEC ...] (rotated together);
//   chunk c >= CH:               one vector of the unrotated tail [R, D).
//
// So a lane always touches the same frequencies i = c*VEC .. c*VEC+VEC-1: it
// computes their cos/sin once, in registers, and reuses them for every head
// of its group (q and k alike). No shared memory, no barriers. Each lane
// issues the loads of U heads before it waits on any of them, and the first
// batch of loads is in flight while the cos/sin are computed.
//
// Out-of-range slots (>= pool_size) are never written: the token's pool
// writes are skipped and one lane per token records it in the per-device
// ErrorRecord that check_errors reads.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/sincos_device.cuh"

namespace ropekv {
namespace cuda {
namespace detail {

constexpr int kBlock = 128;     // threads per block
constexpr int kMaxTable = 256;  // inv_freq entries passed as kernel parameters
constexpr int kUnroll = 4;      // heads per lane whose loads are in flight together

struct Tensor3 {
  void* data;
  long long s0, s1, s2;  // element strides
};

/// The device-side error flag of one device: tokens whose slot was >= the
/// pool size since the last check, and the smallest such token's details.
struct ErrorRecord {
  unsigned int count;
  int lock;
  long long token;  // LLONG_MAX when no error is recorded
  long long slot;
  long long pool_size;
};

struct Params {
  Tensor3 q, k, v, q_rot, k_rot, k_pool, v_pool;
  const void* positions;
  const void* slots;
  long long pos_stride, slot_stride;
  long long num_tokens;
  long long pool_size;
  long long num_teams;  // num_tokens * groups
  ErrorRecord* err;
  double rope_base;
  int num_qo_heads, num_kv_heads;
  int half, rotary_dim;
  int pos64, slot64;
  int groups;       // teams per token
  int group_heads;  // virtual heads per group (a multiple of heads_par)
  int pair_items;   // CH
  int items;        // CH + tail vectors
  int heads_par;    // HP
  int team_lanes;   // TL, a power of two <= kBlock
  float inv_freq[kMaxTable];
};

// ------------------------------------------------------------------ vectors

// N elements of T held in 32-bit words (N * sizeof(T) >= 4): 16-bit values
// stay packed two to a register and are converted pairwise, so a 16-byte
// vector costs 4 registers, not 8.
template <class T, int N, bool kWords = (N * sizeof(T) >= 4)>
struct Vec {
  static constexpr int kNumWords = static_cast<int>(N * sizeof(T) / 4);
  unsigned int w[kNumWords];
};
// One 16-bit element (the strided kernel).
template <class T>
struct Vec<T, 1, false> {
  T v;
};

template <int kBytes> struct RawOf;
template <> struct RawOf<16> { using type = uint4; };
template <> struct RawOf<8> { using type = uint2; };
template <> struct RawOf<4> { using type = unsigned int; };

__device__ __forceinline__ void to_words(uint4 r, unsigned int* w) {
  w[0] = r.x; w[1] = r.y; w[2] = r.z; w[3] = r.w;
}
__device__ __forceinline__ void to_words(uint2 r, unsigned int* w) { w[0] = r.x; w[1] = r.y; }
__device__ __forceinline__ void to_words(unsigned int r, unsigned int* w) { w[0] = r; }
__device__ __forceinline__ void from_words(const unsigned int* w, uint4* r) {
  *r = make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ void from_words(const unsigned int* w, uint2* r) {
  *r = make_uint2(w[0], w[1]);
}
__device__ __forceinline__ void from_words(const unsigned int* w, unsigned int* r) { *r = w[0]; }

// Loads the vector at x (contiguous: one 16/8/4-byte load through the
// read-only path) or the element x[0] (strided kernel, N = 1).
template <class T, int N, bool kContig>
__device__ __forceinline__ Vec<T, N> load_vec(const T* x) {
  Vec<T, N> out;
  if constexpr (kContig) {
    using Raw = typename RawOf<sizeof(T) * N>::type;
    to_words(__ldg(reinterpret_cast<const Raw*>(x)), out.w);
  } else if constexpr (sizeof(T) == 4) {
    out.w[0] = __float_as_uint(*x);
  } else {
    out.v = *x;
  }
  return out;
}

template <class T, int N, bool kContig>
__device__ __forceinline__ void store_vec(T* y, const Vec<T, N>& v) {
  if constexpr (kContig) {
    using Raw = typename RawOf<sizeof(T) * N>::type;
    Raw r;
    from_words(v.w, &r);
    *reinterpret_cast<Raw*>(y) = r;
  } else if constexpr (sizeof(T) == 4) {
    *y = __uint_as_float(v.w[0]);
  } else {
    *y = v.v;
  }
}

// Two 16-bit values of a word as floats (exact) and back (round to nearest
// even, both halves at once).
__device__ __forceinline__ float2 unpack2(unsigned int w, __nv_bfloat16) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
}
__device__ __forceinline__ float2 unpack2(unsigned int w, __half) {
  __half2 h;
  memcpy(&h, &w, 4);
  return __half22float2(h);
}
__device__ __forceinline__ unsigned int pack2(float2 f, __nv_bfloat16) {
  const __nv_bfloat162 h = __float22bfloat162_rn(f);
  unsigned int w;
  memcpy(&w, &h, 4);
  return w;
}
__device__ __forceinline__ unsigned int pack2(float2 f, __half) {
  const __half2 h = __float22half2_rn(f);
  unsigned int w;
  memcpy(&w, &h, 4);
  return w;
}

__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ __half from_f32(float x, __half) { return __float2half_rn(x); }
__device__ __forceinline__ __nv_bfloat16 from_f32(float x, __nv_bfloat16) {
  return __float2bfloat16_rn(x);
}

// out1 = x1*c - x2*s and out2 = x2*c + x1*s in fp32 (explicit FMA, no
// contraction freedom), rounded once to T (round to nearest even).
__device__ __forceinline__ float rot1(float x1, float x2, float c, float s) {
  return __fmaf_rn(x1, c, -__fmul_rn(x2, s));
}
__device__ __forceinline__ float rot2(float x1, float x2, float c, float s) {
  return __fmaf_rn(x2, c, __fmul_rn(x1, s));
}

template <class T, int N>
__device__ __forceinline__ void rotate(Vec<T, N>& a, Vec<T, N>& b, const float (&c)[N],
                                       const float (&s)[N]) {
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float x1 = __uint_as_float(a.w[j]), x2 = __uint_as_float(b.w[j]);
      a.w[j] = __float_as_uint(rot1(x1, x2, c[j], s[j]));
      b.w[j] = __float_as_uint(rot2(x1, x2, c[j], s[j]));
    }
  } else if constexpr (N == 1) {
    const float x1 = to_f32(a.v), x2 = to_f32(b.v);
    a.v = from_f32(rot1(x1, x2, c[0], s[0]), T());
    b.v = from_f32(rot2(x1, x2, c[0], s[0]), T());
  } else {
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      const float2 x1 = unpack2(a.w[j], T()), x2 = unpack2(b.w[j], T());
      const float c0 = c[2 * j], c1 = c[2 * j + 1], s0 = s[2 * j], s1 = s[2 * j + 1];
      a.w[j] = pack2(make_float2(rot1(x1.x, x2.x, c0, s0), rot1(x1.y, x2.y, c1, s1)), T());
      b.w[j] = pack2(make_float2(rot2(x1.x, x2.x, c0, s0), rot2(x1.y, x2.y, c1, s1)), T());
    }
  }
}

// ------------------------------------------------------------------ kernel

__device__ __forceinline__ long long load_index(const void* base, long long stride, int is64,
                                                long long i) {
  return is64 ? __ldg(static_cast<const long long*>(base) + i * stride)
              : static_cast<long long>(__ldg(static_cast<const int*>(base) + i * stride));
}

__device__ __noinline__ void report_bad_slot(ErrorRecord* e, long long t, long long slot,
                                             long long pool_size) {
  atomicAdd(&e->count, 1u);
  while (atomicCAS(&e->lock, 0, 1) != 0) __nanosleep(64);
  __threadfence();
  volatile ErrorRecord* ve = e;
  if (t < ve->token) {
    ve->token = t;
    ve->slot = slot;
    ve->pool_size = pool_size;
  }
  __threadfence();
  atomicExch(&e->lock, 0);
}

// inv_freq[i] for i >= kMaxTable (head_dim > 512), computed on the device.
__device__ __noinline__ float inv_freq_slow(const Params& p, int i) {
  return static_cast<float>(pow(p.rope_base, -2.0 * i / p.rotary_dim));
}

// cos/sin of the N frequencies i = c*N .. c*N+N-1 of one lane, at `pos`.
template <int N>
__device__ __forceinline__ void compute_cs(const Params& p, int c, float pos, float (&cs_c)[N],
                                           float (&cs_s)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int i = c * N + j;
    const float f = i < kMaxTable ? p.inv_freq[i] : inv_freq_slow(p, i);
    sincos_device(__fmul_rn(pos, f), &cs_s[j], &cs_c[j]);  // theta = fp32(pos * inv_freq)
  }
}

// One kind of head over [h_begin, h_end) (indices within that kind):
// kKind 0 = q (rotate into q_rot), 1 = k (rotate into k_rot and, with
// `pool_row`, into the pool), 2 = v (copy into the pool row).
template <class T, int N, bool kContig, bool kLazy, int kKind>
__device__ __forceinline__ void process_heads(
    const Tensor3& src, const Tensor3& dst, const Tensor3& pool, long long t,
    long long pool_row, int h_begin, int h_end, int hp, int HP, bool pair, int off1, int off2,
    float (&cs_c)[N], float (&cs_s)[N], bool& cs_ready, float pos, int c, const Params& p) {
  const T* __restrict__ s_base = static_cast<const T*>(src.data) + t * src.s0;
  T* d_base;
  long long d_s1, d_s2;
  if constexpr (kKind == 2) {
    d_base = static_cast<T*>(pool.data) + pool_row * pool.s0;
    d_s1 = pool.s1;
    d_s2 = pool.s2;
  } else {
    d_base = static_cast<T*>(dst.data) + t * dst.s0;
    d_s1 = dst.s1;
    d_s2 = dst.s2;
  }
  const bool to_pool = kKind == 1 && pool_row >= 0;
  T* p_base = static_cast<T*>(pool.data) + (to_pool ? pool_row * pool.s0 : 0);
  const long long ss2 = kContig ? 1 : src.s2;
  const long long ds2 = kContig ? 1 : d_s2;
  const long long ps2 = kContig ? 1 : pool.s2;

  for (int h = h_begin + hp; h < h_end; h += kUnroll * HP) {
    Vec<T, N> a[kUnroll], b[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int hh = h + u * HP;
      if (hh < h_end) {
        const T* x = s_base + hh * src.s1;
        a[u] = load_vec<T, N, kContig>(x + off1 * ss2);
        if (pair) b[u] = load_vec<T, N, kContig>(x + off2 * ss2);
      }
    }
    if (kLazy && kKind != 2 && pair && !cs_ready) {
      compute_cs<N>(p, c, pos, cs_c, cs_s);
      cs_ready = true;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int hh = h + u * HP;
      if (hh < h_end) {
        if (kKind != 2 && pair) rotate<T, N>(a[u], b[u], cs_c, cs_s);
        T* y = d_base + hh * d_s1;
        store_vec<T, N, kContig>(y + off1 * ds2, a[u]);
        if (pair) store_vec<T, N, kContig>(y + off2 * ds2, b[u]);
        if (to_pool) {
          T* z = p_base + hh * pool.s1;
          store_vec<T, N, kContig>(z + off1 * ps2, a[u]);
          if (pair) store_vec<T, N, kContig>(z + off2 * ps2, b[u]);
        }
      }
    }
  }
}

// T: float, __half or __nv_bfloat16. N: elements per vector (N = 1 when
// !kContig: any element strides).
template <class T, int N, bool kContig, bool kLazy>
__global__ void __launch_bounds__(kBlock) rope_pool_kernel(const __grid_constant__ Params p) {
  const int TL = p.team_lanes;
  const int lane = threadIdx.x & (TL - 1);
  const long long team =
      static_cast<long long>(blockIdx.x) * (kBlock / TL) + threadIdx.x / TL;
  if (team >= p.num_teams) return;
  long long t;
  int g;
  if (p.num_teams < 0x7FFFFFFFLL) {
    const unsigned int tm = static_cast<unsigned int>(team);
    t = tm / static_cast<unsigned int>(p.groups);
    g = static_cast<int>(tm - static_cast<unsigned int>(t) * p.groups);
  } else {
    t = team / p.groups;
    g = static_cast<int>(team - t * p.groups);
  }

  const int items = p.items, HP = p.heads_par;
  const int hp = HP > 1 ? lane / items : 0;
  if (hp >= HP) return;  // idle lanes of a team whose heads do not fill it
  const int c0 = HP > 1 ? lane - hp * items : lane;

  // Index loads first: their latency overlaps the first data loads.
  const long long slot = load_index(p.slots, p.slot_stride, p.slot64, t);
  const long long position = load_index(p.positions, p.pos_stride, p.pos64, t);
  const float pos = static_cast<float>(position);
  const bool slot_ok = slot >= 0 && slot < p.pool_size;
  if (slot >= p.pool_size && g == 0 && lane == 0) report_bad_slot(p.err, t, slot, p.pool_size);
  const long long row = slot_ok ? slot : -1;

  const int Hq = p.num_qo_heads, Hk = p.num_kv_heads;
  const int vh0 = g * p.group_heads;
  const int vh1 = min(vh0 + p.group_heads, Hq + 2 * Hk);
  const int q0 = min(vh0, Hq), q1 = min(vh1, Hq);
  const int k0 = min(max(vh0 - Hq, 0), Hk), k1 = min(max(vh1 - Hq, 0), Hk);
  const int v0 = min(max(vh0 - Hq - Hk, 0), Hk), v1 = min(max(vh1 - Hq - Hk, 0), Hk);

  for (int c = c0; c < items; c += TL) {
    const bool pair = c < p.pair_items;
    const int off1 = pair ? c * N : p.rotary_dim + (c - p.pair_items) * N;
    const int off2 = p.half + c * N;
    float cs_c[N], cs_s[N];
    bool cs_ready = false;
    if (!kLazy && pair && (q0 < q1 || k0 < k1)) compute_cs<N>(p, c, pos, cs_c, cs_s);
    if (q0 < q1)
      process_heads<T, N, kContig, kLazy, 0>(p.q, p.q_rot, p.k_pool, t, -1, q0, q1, hp, HP, pair,
                                      off1, off2, cs_c, cs_s, cs_ready, pos, c, p);
    if (k0 < k1)
      process_heads<T, N, kContig, kLazy, 1>(p.k, p.k_rot, p.k_pool, t, row, k0, k1, hp, HP, pair,
                                      off1, off2, cs_c, cs_s, cs_ready, pos, c, p);
    if (v0 < v1 && row >= 0)
      process_heads<T, N, kContig, kLazy, 2>(p.v, p.v_pool, p.v_pool, t, row, v0, v1, hp, HP, pair,
                                      off1, off2, cs_c, cs_s, cs_ready, pos, c, p);
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace ropekv
