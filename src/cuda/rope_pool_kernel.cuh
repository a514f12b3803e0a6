// The CUDA kernel of ropekv: one launch rotates q into q_rot, k into k_rot
// and the pool row, and copies v into v_pool.
//
// Work decomposition. The heads of one token are laid end to end as
// "virtual heads" vh in [0, Hq + 2*Hk): q heads, then k heads, then v heads.
// Inside a *team* of TL lanes (one warp, or 2-8 warps for very wide heads),
// lane l owns the vector chunk c = l % items of a head and the head offset
// hp = l / items, so the team covers HP = TL / items heads per step:
//
//   chunk c < CH (= half / N): the pair of N-element vectors at x[c*N ...]
//                              and x[half + c*N ...] (rotated together);
//   chunk c >= CH:             one vector of the unrotated tail [R, D).
//
// A team owns one *batch* of U steps (U * HP virtual heads, of
// any kinds: the kind is chosen per lane), and issues all of its loads at
// once. A block holds the teams of one token (one block per token unless the
// token has more batches than a block has teams). Its threads compute the
// token's cos/sin once, one frequency per thread, into shared memory, while
// the data loads are in flight; after one barrier every lane reads the
// cos/sin of its chunk and rotates every head of its batch with them.
//
// Out-of-range slots (>= pool_size) are never written: the token's pool
// writes are skipped and one thread per token records it in the per-device
// ErrorRecord that check_errors reads.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/sincos.h"

namespace ropekv {
namespace cuda {
namespace detail {

constexpr int kMaxTeam = 256;  // lanes of one team (wide heads), at most

/// Threads per block, at most: 512 for one step per team (small calls: all
/// teams of a token in one block), 256 otherwise (which keeps the register
/// allocation of the U = 4 kernel at 80, 8 blocks of 3 warps per SM).
constexpr int max_block(int U) { return U == 1 ? 512 : 256; }

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
  const float* inv_freq;  // [half], fp32(base ** (-2i/R)), made on the host
  ErrorRecord* err;
  long long pos_stride, slot_stride;
  long long pool_size;
  int num_qo_heads, num_kv_heads;
  int half, rotary_dim;
  int pos64, slot64;
  int pair_items;        // CH
  int items;             // CH + tail vectors
  int heads_par;         // HP
  int team_lanes;        // TL, a power of two
  int teams_per_block;
  int blocks_per_token;
  int num_batches;       // batches per token
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

// Virtual head vh -> kind (0 q, 1 k, 2 v) and the head index within it.
__device__ __forceinline__ int kind_of(int vh, int Hq, int Hk, int* h) {
  if (vh < Hq) {
    *h = vh;
    return 0;
  }
  if (vh < Hq + Hk) {
    *h = vh - Hq;
    return 1;
  }
  *h = vh - Hq - Hk;
  return 2;
}

template <class T>
__device__ __forceinline__ T* at(const Tensor3& a, long long row, int h) {
  return static_cast<T*>(a.data) + row * a.s0 + h * a.s1;
}

// One chunk of one team: the loads of its U steps.
template <class T, int N, bool kContig, int U>
__device__ __forceinline__ void load_batch(const Params& p, long long t, int first_vh, int hp,
                                           int c, Vec<T, N> (&a)[U], Vec<T, N> (&b)[U]) {
  const int Hq = p.num_qo_heads, Hk = p.num_kv_heads, HP = p.heads_par;
  const bool pair = c < p.pair_items;
  const int off1 = pair ? c * N : p.rotary_dim + (c - p.pair_items) * N;
  const int off2 = p.half + c * N;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int vh = first_vh + u * HP + hp;
    if (vh < Hq + 2 * Hk) {
      int h;
      const int kind = kind_of(vh, Hq, Hk, &h);
      const Tensor3& x = kind == 0 ? p.q : (kind == 1 ? p.k : p.v);
      const T* src = at<T>(x, t, h);
      const long long s2 = kContig ? 1 : x.s2;
      a[u] = load_vec<T, N, kContig>(src + off1 * s2);
      if (pair) b[u] = load_vec<T, N, kContig>(src + off2 * s2);
    }
  }
}

// Rotates (q, k) or copies (v) the loaded batch and stores it.
template <class T, int N, bool kContig, int U>
__device__ __forceinline__ void store_batch(const Params& p, long long t, long long row,
                                            int first_vh, int hp, int c, const float* cs_smem,
                                            Vec<T, N> (&a)[U], Vec<T, N> (&b)[U]) {
  const int Hq = p.num_qo_heads, Hk = p.num_kv_heads, HP = p.heads_par;
  const bool pair = c < p.pair_items;
  const int off1 = pair ? c * N : p.rotary_dim + (c - p.pair_items) * N;
  const int off2 = p.half + c * N;
  float cs_c[N], cs_s[N];
  if (pair) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      cs_c[j] = cs_smem[c * N + j];
      cs_s[j] = cs_smem[p.half + c * N + j];
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int vh = first_vh + u * HP + hp;
    if (vh >= Hq + 2 * Hk) continue;
    int h;
    const int kind = kind_of(vh, Hq, Hk, &h);
    if (kind != 2 && pair) rotate<T, N>(a[u], b[u], cs_c, cs_s);
    const Tensor3& y = kind == 0 ? p.q_rot : (kind == 1 ? p.k_rot : p.v_pool);
    if (kind == 2 && row < 0) continue;
    T* dst = at<T>(y, kind == 2 ? row : t, h);
    const long long s2 = kContig ? 1 : y.s2;
    store_vec<T, N, kContig>(dst + off1 * s2, a[u]);
    if (pair) store_vec<T, N, kContig>(dst + off2 * s2, b[u]);
    if (kind == 1 && row >= 0) {
      T* z = at<T>(p.k_pool, row, h);
      const long long z2 = kContig ? 1 : p.k_pool.s2;
      store_vec<T, N, kContig>(z + off1 * z2, a[u]);
      if (pair) store_vec<T, N, kContig>(z + off2 * z2, b[u]);
    }
  }
}

// T: float, __half or __nv_bfloat16. N: elements per vector (N = 1 when
// !kContig: any element strides). Dynamic shared memory: 2 * half floats.
// U: steps per team (1 for small calls: more warps, shorter code; 4 for
// large ones: more bytes in flight per warp).
template <class T, int N, bool kContig, int U>
__global__ void __launch_bounds__(max_block(U)) rope_pool_kernel(const __grid_constant__ Params p) {
  extern __shared__ float cs_smem[];  // cos[half], then sin[half]
  const int tid = threadIdx.x;
  long long t = blockIdx.x;
  int j = 0;
  if (p.blocks_per_token > 1) {
    t = blockIdx.x / p.blocks_per_token;
    j = static_cast<int>(blockIdx.x - t * p.blocks_per_token);
  }
  const int TL = p.team_lanes, items = p.items, HP = p.heads_par;
  const int lane = tid & (TL - 1);
  const int batch = j * p.teams_per_block + tid / TL;
  const int hp = HP > 1 ? lane / items : 0;
  const int c0 = HP > 1 ? lane - hp * items : lane;
  // No early return: every thread reaches the barrier.
  const bool active = hp < HP && batch < p.num_batches && c0 < items;
  const int first_vh = batch * U * HP;

  const long long slot = load_index(p.slots, p.slot_stride, p.slot64, t);
  const long long position = load_index(p.positions, p.pos_stride, p.pos64, t);

  // The first chunk's loads go out before the cos/sin are computed.
  Vec<T, N> a[U], b[U];
  if (active) load_batch<T, N, kContig, U>(p, t, first_vh, hp, c0, a, b);

  // cos/sin of the token, one frequency per thread: theta = fp32(pos * inv_freq).
  const float pos = static_cast<float>(position);
  for (int i = tid; i < p.half; i += blockDim.x) {
    float s, c;
    sincos_fp32(__fmul_rn(pos, __ldg(p.inv_freq + i)), &s, &c);
    cs_smem[i] = c;
    cs_smem[p.half + i] = s;
  }
  if (slot >= p.pool_size && j == 0 && tid == 0) report_bad_slot(p.err, t, slot, p.pool_size);
  __syncthreads();
  if (!active) return;

  const long long row = slot >= 0 && slot < p.pool_size ? slot : -1;
  for (int c = c0;;) {
    store_batch<T, N, kContig, U>(p, t, row, first_vh, hp, c, cs_smem, a, b);
    c += TL;
    if (c >= items) break;
    load_batch<T, N, kContig, U>(p, t, first_vh, hp, c, a, b);
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace ropekv
