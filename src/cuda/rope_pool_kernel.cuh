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
//
// yarn's attention factor scales the cos/sin in either kernel. A
// cos_sin_cache alone runs the plain kernel built for a table (kTable): each
// lane reads its chunk's cos/sin from the token's row, no shared memory, no
// barrier. Calls with other options (interleaved pairs, a cos_sin_cache with
// others or with rows the 16-byte loads cannot take, QK-norm, float32 or fp8
// pools) run rope_pool_options_kernel:
// the same decomposition and loads, so the plain kernel stays as it is. Its
// 16-byte form is compiled per pool family (fp8, or q's dtype / float32; the
// U = 4 form also for q's dtype alone) and
// with or without the QK-norm code, U = 4 steps of which a call takes 1 to 4
// (2 for small calls, 4 for large ones, as the plain kernel's U); the other
// options are uniform run-time branches. Each chunk's cos/sin and weights are
// read from shared memory as the work goes, in blocks of 4 elements, which
// keeps these kernels at the plain kernel's 80 registers. fp8 uses the
// hardware conversion on sm_89 and later (cvt.rn.satfinite, encode_fp8's
// bits). The strided form (U = 1) branches on every option at run time.
// Interleaved pairs (2i, 2i+1) keep the NeoX memory layout: chunk c's
// vectors at cN and half + cN each hold N / 2 whole pairs, rotated with
// frequencies cN / 2 .. and (half + cN) / 2 .. (the memory accesses of a
// warp are then the plain kernel's). The
// QK-norm's sum of squares is reduced over the lanes of a head with shuffles
// (and, for teams wider than a warp, through shared memory at the cos/sin
// barrier) before any lane writes; a position outside the cos_sin_cache
// skips the whole token (the block's threads agree: one token per block).
//
// Small calls of 16-bit data with full rotary (up to 512 tokens, 256 with a
// table, a QK-norm or another pool format) run rope_pool_small_kernel
// instead (end of this file): plain, interleaved, with a cos_sin_cache, a
// QK-norm on heads of up to 256, float32 or fp8 pools, one build for each
// QK-norm or not and pool format; NeoX calls of 257 to 8192 tokens (2048
// where a head's wide lanes are not a power of two) without a table (plain,
// with a QK-norm, with fp8 pools, with float32 pools of bf16 data) and plain
// interleaved ones run its builds
// in wide lanes (16-byte vectors). Its QK-norm sums a head's squares in
// another order than the options kernel (4- or 8-element lane chunks, then the
// lanes' sums in four strided runs), so a QK-norm result can differ by one
// rounding between calls of different sizes (256 / 257 tokens, 8192 / 8193);
// either is within the contract's bound, and each is reproducible.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/fp8.h"
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
/// pool size since the last check, and the smallest such token's details;
/// then the same for positions outside a cos_sin_cache (options kernel).
struct ErrorRecord {
  unsigned int count;
  int lock;
  long long token;  // LLONG_MAX when no error is recorded
  long long slot;
  long long pool_size;
  unsigned int pos_count;
  int unused;
  long long pos_token;  // LLONG_MAX when no error is recorded
  long long position;
  long long rows;
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
  float attention_factor;  // yarn: multiplies cos and sin (1 = off)
  // cos_sin_cache: [cs_rows, R] table (cos then sin of each row), or nullptr
  // (cos/sin computed from inv_freq).
  const void* cos_sin;
  long long cs_rows, cs_s0, cs_s1;
  int cs_dtype;          // FloatType code: 0 f32, 1 f16, 2 bf16
  int early_params;      // 1: every parameter is read before the wait (param_lines)
};

/// How the options kernel writes a pool element (o.pool_mode).
enum PoolMode : int {
  kPoolSame = 0,  // q's dtype: the bits of k_rot / v
  kPoolF32 = 1,   // float32 pool: exact widening
  kPoolFp8 = 2,   // uint8 pool: encode_fp8(x / scale)
};

/// The pool formats an options kernel is compiled for (its kPools).
enum PoolCode : int {
  kPoolsAny = 0,   // every format, o.pool_mode at run time (the strided kernel)
  kPoolsWide = 1,  // kPoolSame or kPoolF32 (exact: the values as they are)
  kPoolsFp8 = 2,   // kPoolFp8
  kPoolsSame = 3,  // kPoolSame only (the small kernel's builds, the kOptSteps kernel)
  kPoolsF32 = 4,   // kPoolF32 only
  kPoolsFp8Mul = 5,  // kPoolFp8 whose scales' reciprocals are exact (o.fp8_div == 0):
                     // no division code, which made a decode call 0.35 us slower
};

/// Steps per team of the 16-byte options kernels: the most a batch takes;
/// o.steps (1 to kOptSteps) is how many it takes, so one binary serves small
/// calls (2, like the plain kernel's U = 2) and large ones (4).
constexpr int kOptSteps = 4;

/// The options of a call that is not plain (see is_plain in problem.h).
struct Options {
  const void* q_norm;   // [D] QK-norm weights, or nullptr: no norm of q
  const void* k_norm;   // likewise for k
  long long qn_stride, kn_stride;
  int qn_dtype, kn_dtype;  // FloatType codes: 0 f32, 1 f16, 2 bf16
  int pool_mode;                     // PoolMode
  int fp8_kind;                      // Fp8Kind of a kPoolFp8 pool
  int interleaved;                   // pairs (2i, 2i+1) instead of (i, i + half)
  int head_dim;
  int steps;                         // steps per team (the batch); <= the kernel's U
  int fp8_div;  // 1: x / scale (IEEE division); 0: x * k_mul / v_mul, the same
                // quotient (both scales are powers of two, their reciprocals exact)
  float norm_eps;
  float k_scale, v_scale;  // fp8 pools: stored = encode(x / scale)
  float k_mul, v_mul;      // 1 / k_scale, 1 / v_scale when fp8_div == 0
};

struct OptParams : Params {
  Options o;
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

// The 16-bit value u16 of dtype code 1 f16 or 2 bf16 as a float (exact).
__device__ __forceinline__ float widen(unsigned int u16, int dtype) {
  if (dtype == 2) return __uint_as_float(u16 << 16);
  return __half2float(__ushort_as_half(static_cast<unsigned short>(u16)));
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

// Element i of an index array (positions, slots): its address, and the
// value at an address (int64 or int32).
__device__ __forceinline__ const void* index_at(const void* base, long long stride, int is64,
                                                long long i) {
  return static_cast<const char*>(base) + i * stride * (is64 ? 8 : 4);
}
__device__ __forceinline__ long long load_index_at(const void* at, int is64) {
  return is64 ? __ldg(static_cast<const long long*>(at))
              : static_cast<long long>(__ldg(static_cast<const int*>(at)));
}

// Counts token t's bad index (a slot >= the pool size, or with `position` a
// position outside the cos_sin_cache) and, under the record's lock, keeps the
// smallest such token with the index and the limit it broke. Out of line and
// with few arguments: the call sits on a rarely taken branch of a kernel
// whose length a decode call pays for.
__device__ __noinline__ void report_bad_index(ErrorRecord* e, bool position, long long t,
                                              long long value, long long limit) {
  atomicAdd(position ? &e->pos_count : &e->count, 1u);
  while (atomicCAS(&e->lock, 0, 1) != 0) __nanosleep(64);
  __threadfence();
  volatile ErrorRecord* ve = e;
  volatile long long* first = position ? &ve->pos_token : &ve->token;
  if (t < *first) {
    *first = t;
    *(position ? &ve->position : &ve->slot) = value;
    *(position ? &ve->rows : &ve->pool_size) = limit;
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

// Element offsets of chunk c's vectors in a head: the pair (off1, off2) of
// a rotated chunk, or the one tail vector at off1. Vectors (N > 1) keep the
// NeoX layout for interleaved pairs too, so that a warp's loads and stores
// stay one contiguous run each: a vector at an even offset holds N / 2
// whole pairs (half is a multiple of N). The strided kernel (N = 1) takes
// one interleaved pair (x[2c], x[2c+1]) per chunk.
template <int N>
__device__ __forceinline__ void options_offsets(const Params& p, int c, bool interleaved,
                                                int* off1, int* off2) {
  const bool pair = c < p.pair_items;
  const bool one_pair = N == 1 && interleaved;
  *off1 = pair ? (one_pair ? 2 * c : c * N) : p.rotary_dim + (c - p.pair_items) * N;
  *off2 = one_pair ? 2 * c + 1 : p.half + c * N;
}

// Where a team's batch reads: for each step u, token t's head (q, k or v by
// the virtual head) and its element stride, or nullptr past the batch's last
// virtual head (vh_end). Reads kernel parameters only, so the kernels make
// it before griddepcontrol.wait.
template <class T, int U>
struct BatchSrc {
  const T* x[U];
  long long s2[U];
};
template <class T, bool kContig, int U>
__device__ __forceinline__ BatchSrc<T, U> batch_src(const Params& p, long long t, int first_vh,
                                                    int hp, int vh_end) {
  BatchSrc<T, U> src;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int vh = first_vh + u * p.heads_par + hp;
    src.x[u] = nullptr;
    src.s2[u] = 1;
    if (vh < vh_end) {
      int h;
      const int kind = kind_of(vh, p.num_qo_heads, p.num_kv_heads, &h);
      const Tensor3& x = kind == 0 ? p.q : (kind == 1 ? p.k : p.v);
      src.x[u] = at<T>(x, t, h);
      if (!kContig) src.s2[u] = x.s2;
    }
  }
  return src;
}

// One chunk of one team: the loads of its U steps. kOpt: the options
// kernel's (run-time) layout of pairs.
template <class T, int N, bool kContig, int U, bool kOpt = false>
__device__ __forceinline__ void load_batch(const Params& p, const BatchSrc<T, U>& src, int c,
                                           Vec<T, N> (&a)[U], Vec<T, N> (&b)[U],
                                           bool interleaved = false) {
  const bool pair = c < p.pair_items;
  int off1, off2;
  if constexpr (kOpt) {
    options_offsets<N>(p, c, interleaved, &off1, &off2);
  } else {
    off1 = pair ? c * N : p.rotary_dim + (c - p.pair_items) * N;
    off2 = p.half + c * N;
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (src.x[u] != nullptr) {
      const long long s2 = kContig ? 1 : src.s2[u];
      a[u] = load_vec<T, N, kContig>(src.x[u] + off1 * s2);
      if (pair) b[u] = load_vec<T, N, kContig>(src.x[u] + off2 * s2);
    }
  }
}

// Rotates (q, k) or copies (v) the loaded batch and stores it; cs_c / cs_s:
// the cos / sin of chunk c (read only when it is a rotated pair).
template <class T, int N, bool kContig, int U>
__device__ __forceinline__ void store_batch(const Params& p, long long t, long long row,
                                            int first_vh, int hp, int c, const float (&cs_c)[N],
                                            const float (&cs_s)[N], Vec<T, N> (&a)[U],
                                            Vec<T, N> (&b)[U]) {
  const int Hq = p.num_qo_heads, Hk = p.num_kv_heads, HP = p.heads_par;
  const bool pair = c < p.pair_items;
  const int off1 = pair ? c * N : p.rotary_dim + (c - p.pair_items) * N;
  const int off2 = p.half + c * N;
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
// Programmatic dependent launch (sm_90+; the launcher sets the attribute):
// wait until the previous kernel of the stream has finished and its writes
// are visible (q, k, v, positions, slots may be its outputs), then let the
// next kernel of the stream start its launch. A no-op without the attribute
// and on older GPUs.
//
// `ready`: a value the wait must come after (see param_lines). Both
// predicated forms of the wait are there, so exactly one runs whatever the
// value is, but the assembler must compute the value first.
__device__ __forceinline__ void grid_dependency_sync(unsigned long long ready = 0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n\t.reg .pred r;\n\tsetp.ne.b64 r, %0, 0;\n\t@r griddepcontrol.wait;\n\t"
      "@!r griddepcontrol.wait;\n\t}" ::"l"(ready)
      : "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// With p.early_params, one word of every 32 bytes of the kernel parameters,
// combined: grid_dependency_sync(param_lines(p)) then waits until all of
// them are in the constant cache, which overlaps the previous kernel. Else
// each parameter line is first read when the code after the wait needs it
// (the data pointers, the output tensors), and a decode call waits for
// those misses on its critical path: 0.2-0.45 us per call in 50-call
// graphs, e.g. 1.70 / 2.03 -> 1.41 / 1.84 us (warm / cold L2) for a kernel
// that reads its cos/sin from a table (bench/cuda_decode_probe.cu, rows
// table and table/pin). The launcher sets it for grids of at most one block
// per SM: larger grids run most blocks after the previous kernel has ended,
// where reading every line first only delays them (Llama T = 512: 3.99 ->
// 4.36 us).
template <class P>
__device__ __forceinline__ unsigned long long param_lines(const P& p) {
  if (!p.early_params) return 0;
  const unsigned long long* w = reinterpret_cast<const unsigned long long*>(&p);
  constexpr int kWords = sizeof(P) / 8;
  unsigned long long x = w[kWords - 1];
#pragma unroll
  for (int i = 0; i < kWords - 1; i += 4) x ^= w[i];
  return x;
}

// What the first loads of a kernel need, combined for grid_dependency_sync:
// their addresses (the batch's heads, the token's position and slot) made
// before the wait, so that after it the loads go out at once; and with
// p.early_params every parameter line. Made after the wait, the addresses
// (about 50 instructions of parameter reads and index arithmetic) delayed
// the position, whose arrival starts the cos/sin.
template <class P, class T, int U>
__device__ __forceinline__ unsigned long long first_addresses(const P& p,
                                                              const BatchSrc<T, U>& src,
                                                              const void* pos_at,
                                                              const void* slot_at) {
  unsigned long long x = param_lines(p) ^ reinterpret_cast<unsigned long long>(pos_at) ^
                         reinterpret_cast<unsigned long long>(slot_at);
#pragma unroll
  for (int u = 0; u < U; ++u) x ^= reinterpret_cast<unsigned long long>(src.x[u]);
  return x;
}

// Where a thread works: its token t, lane in the team, batch, and head
// offset hp and chunk c0 in the step. Without integer divisions (about 25
// instructions each; a decode call's time is mostly its critical path of
// instructions): TL is a power of two, and (lane + 1/2) / items (lane < 32,
// items <= 16 when HP > 1) is at least 1/32 away from an integer, far
// beyond __fdividef's error.
struct Place {
  long long t;
  int part;  // which of the token's blocks_per_token blocks
  int lane, batch, hp, c0;
};
__device__ __forceinline__ Place place_of(const Params& p) {
  Place pl;
  pl.t = blockIdx.x;
  pl.part = 0;
  if (p.blocks_per_token > 1) {
    pl.t = blockIdx.x / p.blocks_per_token;
    pl.part = static_cast<int>(blockIdx.x - pl.t * p.blocks_per_token);
  }
  const int tid = threadIdx.x;
  pl.lane = tid & (p.team_lanes - 1);
  pl.batch = pl.part * p.teams_per_block + (tid >> (__ffs(p.team_lanes) - 1));
  pl.hp = p.heads_par > 1
              ? __float2int_rz(__fdividef(static_cast<float>(pl.lane) + 0.5f,
                                          static_cast<float>(p.items)))
              : 0;
  pl.c0 = pl.lane - pl.hp * p.items;
  return pl;
}

// The first inverse frequency of thread tid (0 when it has none). Read
// before griddepcontrol.wait: the table is ropekv's own, written once when it
// is made, never by a kernel. Loaded after the position instead, it waited
// for it (the compiler converts the position first): one more memory round
// trip, about 0.3 us of a decode call (bench/cuda_decode_probe.cu).
__device__ __forceinline__ float first_inv_freq(const Params& p, int tid) {
  return tid < p.half ? __ldg(p.inv_freq + tid) : 0.0f;
}

// Where frequency i's cos (and, half further on, its sin) sits in shared
// memory for readers of N values a lane (smem_cos_sin_quads<N>). N a multiple of
// 8: a chunk's N / 4 quads (float4s) lie in N / 4 planes of half / N quads,
// quad g of chunk c at plane g, place c, so that a warp's lanes, one chunk
// each, read each plane's quads one after another: conflict-free 16-byte
// reads. In cos[i] order, a lane's 32-byte chunk put eight lanes on each
// bank (Nsight Compute, the wide lanes' reads: 80 % of their wavefronts
// were conflicts). With smem_cos_sin_quads, against cos[i] order and scalar
// sin reads (H100, cold L2, heads of 512, 8 + 4 heads): plain T = 512 8.49
// -> 7.83 us, 1024 15.65 -> 14.63; a QK-norm T = 256 6.02 -> 5.65, 512 9.91
// -> 9.35; Llama-3.1-8B and Qwen3-8B within 1 % (docs/performance.md, *The
// cos/sin in quads*). N <= 4: cos[i].
template <int N>
__device__ __forceinline__ int cs_index(int i, int half) {
  if constexpr (N % 8 == 0) {
    const unsigned u = static_cast<unsigned>(i);
    return static_cast<int>(((u % N / 4) * (static_cast<unsigned>(half) / N) + u / N) * 4 + u % 4);
  }
  return i;
}

// The token's cos/sin into shared memory (cos[half], then sin[half], each in
// the order of cs_index<N>: N the reading lanes' values, 1 for cos[i]), one
// frequency per thread of the block's `threads`: theta = fp32(pos *
// inv_freq), each times yarn's attention factor when it is not 1. freq0:
// first_inv_freq(p, tid).
template <int N = 1>
__device__ __forceinline__ void make_cos_sin(const Params& p, long long position, int tid,
                                             int threads, float freq0, float* cs_smem) {
  const float pos = static_cast<float>(position);
  const float m = p.attention_factor;
  for (int i = tid; i < p.half; i += threads) {
    float s, c;
    sincos_fp32(__fmul_rn(pos, i == tid ? freq0 : __ldg(p.inv_freq + i)), &s, &c);
    if (m != 1.0f) {
      c = __fmul_rn(c, m);
      s = __fmul_rn(s, m);
    }
    const int at = cs_index<N>(i, p.half);
    cs_smem[at] = c;
    cs_smem[p.half + at] = s;
  }
}

// The chunk's cos and sin (N each) from shared memory (cos[half], then
// sin[half], in cos[i] order).
template <int N>
__device__ __forceinline__ void smem_cos_sin(const float* cs_smem, int half, int c,
                                             float (&cc)[N], float (&ss)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    cc[j] = cs_smem[c * N + j];
    ss[j] = cs_smem[half + c * N + j];
  }
}

// The same from shared memory written by make_cos_sin<N> (N a multiple of
// 4, half a multiple of N, so that sin[] is 16-byte aligned too), in 16-byte
// reads: as scalars the sin reads were 4- and 8-way bank conflicts at N = 4
// and 8. (The small kernel's; in the plain kernel these reads took its
// U = 2 build from 64 to 71 registers.)
template <int N>
__device__ __forceinline__ void smem_cos_sin_quads(const float* cs_smem, int half, int c,
                                                   float (&cc)[N], float (&ss)[N]) {
  static_assert(N % 4 == 0, "whole quads");
  const float4* cq = reinterpret_cast<const float4*>(cs_smem);
  const float4* sq = reinterpret_cast<const float4*>(cs_smem + half);
#pragma unroll
  for (int g = 0; g < N / 4; ++g) {
    const int at = cs_index<N>(c * N + 4 * g, half) / 4;
    const float4 x = cq[at], y = sq[at];
    cc[4 * g] = x.x;
    cc[4 * g + 1] = x.y;
    cc[4 * g + 2] = x.z;
    cc[4 * g + 3] = x.w;
    ss[4 * g] = y.x;
    ss[4 * g + 1] = y.y;
    ss[4 * g + 2] = y.z;
    ss[4 * g + 3] = y.w;
  }
}

// out = lo then hi: the two runs of a split lane (load_lane) as one array.
template <class A, int M>
__device__ __forceinline__ void join_runs(const A (&lo)[M], const A (&hi)[M], A (&out)[2 * M]) {
#pragma unroll
  for (int j = 0; j < M; ++j) {
    out[j] = lo[j];
    out[M + j] = hi[j];
  }
}

// A lane's cos and sin for load_lane's layout: smem_cos_sin_quads<N> (the
// quads of make_cos_sin<N>), or with kSplit its two runs of N / 2 in cos[i]
// order (make_cos_sin<1>), read as quads c and c + half / N, each run's reads
// one contiguous span of the warp: conflict-free too.
template <int N, bool kSplit>
__device__ __forceinline__ void smem_cos_sin_lane(const float* cs_smem, int half, int c,
                                                  float (&cc)[N], float (&ss)[N]) {
  if constexpr (!kSplit) {
    smem_cos_sin_quads<N>(cs_smem, half, c, cc, ss);
  } else {
    static_assert(N == 8, "split lanes: two quads");
    float c0[4], s0[4], c1[4], s1[4];
    smem_cos_sin_quads<4>(cs_smem, half, c, c0, s0);
    smem_cos_sin_quads<4>(cs_smem, half, c + half / N, c1, s1);
    join_runs(c0, c1, cc);
    join_runs(s0, s1, ss);
  }
}

// The N values at element i of a table of dtype code 0 f32 or (16-bit) 1 f16 /
// 2 bf16, as loaded: 16-byte loads where they hold more (8-byte ones for
// N = 2; the launchers check the row stride, the base and half for it), the
// conversion apart (table_floats), so that a row's cos and sin loads both go
// out before either is waited for. Loaded and converted one after the other,
// a 16-bit table cost a decode call a second memory round trip (0.2-0.3 us
// at T = 1; docs/performance.md, *The small kernel's reads*).
template <int N>
struct TableWords {
  unsigned int w[N];  // f32: one value per word; 16-bit: two per word (N / 2 words)
};
template <int N>
__device__ __forceinline__ TableWords<N> table_load(const void* base, long long i, int dtype) {
  TableWords<N> r;
  if (dtype == 0) {
    const unsigned int* f = static_cast<const unsigned int*>(base) + i;
    if constexpr (N == 2) {
      to_words(__ldg(reinterpret_cast<const uint2*>(f)), r.w);
    } else {
#pragma unroll
      for (int j = 0; j < N; j += 4) to_words(__ldg(reinterpret_cast<const uint4*>(f + j)), r.w + j);
    }
  } else {
    using Raw = typename RawOf<2 * N>::type;
    to_words(__ldg(reinterpret_cast<const Raw*>(static_cast<const unsigned short*>(base) + i)), r.w);
  }
  return r;
}
// The values of table_load as floats (exact).
template <int N>
__device__ __forceinline__ void table_floats(const TableWords<N>& r, int dtype, float (&x)[N]) {
  if (dtype == 0) {
#pragma unroll
    for (int j = 0; j < N; ++j) x[j] = __uint_as_float(r.w[j]);
  } else {
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      x[2 * j] = widen(r.w[j] & 0xFFFFu, dtype);
      x[2 * j + 1] = widen(r.w[j] >> 16, dtype);
    }
  }
}

// The cos and sin at elements ic and is of a table: both loads go out before
// either is converted, in one branch per dtype (a load and conversion of the
// generic table_load / table_floats for each took the plain kernel's table
// builds from 80 to 95 registers; one after the other, a 16-bit table's sin
// load waited for its cos).
template <int N>
__device__ __forceinline__ void table_cos_sin(const void* base, long long ic, long long is,
                                              int dtype, float (&cc)[N], float (&ss)[N]) {
  if (dtype == 0) {
    table_floats<N>(table_load<N>(base, ic, 0), 0, cc);
    table_floats<N>(table_load<N>(base, is, 0), 0, ss);
  } else {
    const TableWords<N> wc = table_load<N>(base, ic, dtype);
    const TableWords<N> ws = table_load<N>(base, is, dtype);
    table_floats<N>(wc, dtype, cc);
    table_floats<N>(ws, dtype, ss);
  }
}

// kTable = false: the plain call. kTable = true: the call whose one option
// is a cos_sin_cache with 16-byte aligned rows (16-byte vectors only): each
// lane reads its chunk's cos/sin from the token's table row itself (no
// shared memory, no barrier), and a position outside the table skips the
// token (nothing of it written) and is recorded in the error flag.
template <class T, int N, bool kContig, int U, bool kTable = false>
__global__ void __launch_bounds__(max_block(U)) rope_pool_kernel(const __grid_constant__ Params p) {
  extern __shared__ float cs_smem[];  // cos[half], then sin[half]
  // Before the wait, overlapping the previous kernel: only what reads no
  // memory that kernel may write.
  const int tid = threadIdx.x;
  const Place pl = place_of(p);
  const long long t = pl.t;
  const int TL = p.team_lanes, items = p.items, HP = p.heads_par;
  const int batch = pl.batch, hp = pl.hp, c0 = pl.c0;
  // No early return before the barrier: every thread reaches it.
  const bool active = hp < HP && batch < p.num_batches && c0 < items;
  const int first_vh = batch * U * HP;
  const float freq0 = kTable ? 0.0f : first_inv_freq(p, tid);
  const BatchSrc<T, U> src =
      batch_src<T, kContig, U>(p, t, first_vh, hp, p.num_qo_heads + 2 * p.num_kv_heads);
  const void* pos_at = index_at(p.positions, p.pos_stride, p.pos64, t);
  const void* slot_at = index_at(p.slots, p.slot_stride, p.slot64, t);
  grid_dependency_sync(first_addresses(p, src, pos_at, slot_at));

  // The first chunk's loads go out first, then the position (needed first),
  // then the slot. Issued before the data loads, a 32-bit index (widened to
  // 64 bits as soon as it arrives, before the next branch) held them back by
  // one memory round trip; so did a 32-bit slot issued before the position
  // (bench/cuda_decode_probe.cu). The cos/sin are computed meanwhile. The
  // table kernel asks for the position first: its table row waits for it.
  // (A 32-bit position is widened after the data loads are issued.)
  Vec<T, N> a[U], b[U];
  long long position = 0;
  int position32 = 0;
  if (kTable) {
    if (p.pos64)
      position = __ldg(static_cast<const long long*>(pos_at));
    else
      position32 = __ldg(static_cast<const int*>(pos_at));
  }
  if (active) load_batch<T, N, kContig, U>(p, src, c0, a, b);
  if (kTable && !p.pos64) {
    asm volatile("" : "+r"(position32));  // keeps the widening here
    position = position32;
  }
  if (!kTable) position = load_index_at(pos_at, p.pos64);
  const long long slot = load_index_at(slot_at, p.slot64);
  // The cos/sin of the lane's chunk c, read from the table (kTable) or from
  // shared memory after the barrier.
  float cc[N], ss[N];
  const long long cs_row = kTable ? position * p.cs_s0 : 0;
  auto cos_sin_of = [&](int c) {
    if (c >= p.pair_items) return;
    if constexpr (kTable) {
      table_cos_sin<N>(p.cos_sin, cs_row + c * N, cs_row + p.half + c * N, p.cs_dtype, cc, ss);
    } else {
      smem_cos_sin<N>(cs_smem, p.half, c, cc, ss);
    }
  };
  if constexpr (kTable) {
    // The row goes out as soon as the position is in: nothing else first.
    const bool in_table = position >= 0 && position < p.cs_rows;
    if (in_table && active) cos_sin_of(c0);
    if (!in_table) {
      if (pl.part == 0 && tid == 0) report_bad_index(p.err, true, t, position, p.cs_rows);
      return;
    }
  } else {
    make_cos_sin(p, position, tid, blockDim.x, freq0, cs_smem);
  }
  if (slot >= p.pool_size && pl.part == 0 && tid == 0)
    report_bad_index(p.err, false, t, slot, p.pool_size);
  if constexpr (!kTable) __syncthreads();
  if (!active) return;
  if constexpr (!kTable) cos_sin_of(c0);

  const long long row = slot >= 0 && slot < p.pool_size ? slot : -1;
  for (int c = c0;;) {
    store_batch<T, N, kContig, U>(p, t, row, first_vh, hp, c, cc, ss, a, b);
    c += TL;
    if (c >= items) break;
    // (src made again: held through the loop, it cost the U = 4 kernel 9
    // registers and a block per SM.)
    load_batch<T, N, kContig, U>(
        p, batch_src<T, kContig, U>(p, t, first_vh, hp, p.num_qo_heads + 2 * p.num_kv_heads), c,
        a, b);
    cos_sin_of(c);
  }
}

// ------------------------------------------------------------------ options

// A vector as N floats (exact) and back (each rounded once, nearest even).
template <class T, int N>
__device__ __forceinline__ void to_floats(const Vec<T, N>& v, float (&x)[N]) {
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int j = 0; j < N; ++j) x[j] = __uint_as_float(v.w[j]);
  } else if constexpr (N == 1) {
    x[0] = to_f32(v.v);
  } else {
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      const float2 f = unpack2(v.w[j], T());
      x[2 * j] = f.x;
      x[2 * j + 1] = f.y;
    }
  }
}

template <class T, int N>
__device__ __forceinline__ Vec<T, N> from_floats(const float (&x)[N]) {
  Vec<T, N> v;
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int j = 0; j < N; ++j) v.w[j] = __float_as_uint(x[j]);
  } else if constexpr (N == 1) {
    v.v = from_f32(x[0], T());
  } else {
#pragma unroll
    for (int j = 0; j < N / 2; ++j) v.w[j] = pack2(make_float2(x[2 * j], x[2 * j + 1]), T());
  }
  return v;
}

// Element i of a float vector of dtype code 0 f32, 1 f16, 2 bf16: its bits,
// and the bits as a float (exact). Apart, the conversion can wait where the
// value is used instead of stalling right after the load.
__device__ __forceinline__ unsigned int load_bits(const void* base, long long i, int dtype) {
  if (dtype == 0) return __ldg(static_cast<const unsigned int*>(base) + i);
  return __ldg(static_cast<const unsigned short*>(base) + i);
}
__device__ __forceinline__ float bits_to_float(unsigned int bits, int dtype) {
  return dtype == 0 ? __uint_as_float(bits) : widen(bits, dtype);
}
__device__ __forceinline__ float load_float(const void* base, long long i, int dtype) {
  return bits_to_float(load_bits(base, i, dtype), dtype);
}
// Elements i and j, both loads issued before either is converted: a table
// row's cos and sin. Loaded and converted one after the other, a decode call
// with a cos_sin_cache took 2.60 / 3.23 us (warm / cold table) against
// 2.39 / 2.82 (bench/cuda_decode_probe.cu, row options/table).
__device__ __forceinline__ void load_float2(const void* base, long long i, long long j, int dtype,
                                            float* x, float* y) {
  if (dtype == 0) {
    const float* f = static_cast<const float*>(base);
    *x = __ldg(f + i);
    *y = __ldg(f + j);
  } else {
    const unsigned short* h = static_cast<const unsigned short*>(base);
    const unsigned int a = __ldg(h + i), b = __ldg(h + j);
    *x = widen(a, dtype);
    *y = widen(b, dtype);
  }
}

// B floats from shared memory: float4 / float2 loads in the contiguous
// kernel (p aligned to B floats, at most 16 bytes), else one at a time.
template <int B, bool kContig>
__device__ __forceinline__ void load_floats(const float* p, float (&x)[B]) {
  if constexpr (kContig && B % 4 == 0) {
#pragma unroll
    for (int j = 0; j < B; j += 4) {
      const float4 f = *reinterpret_cast<const float4*>(p + j);
      x[j] = f.x;
      x[j + 1] = f.y;
      x[j + 2] = f.z;
      x[j + 3] = f.w;
    }
  } else if constexpr (kContig && B == 2) {
    const float2 f = *reinterpret_cast<const float2*>(p);
    x[0] = f.x;
    x[1] = f.y;
  } else {
#pragma unroll
    for (int j = 0; j < B; ++j) x[j] = p[j];
  }
}

// Elements [k, k + B) of a vector as floats (exact), and back (each rounded
// once to T); k a multiple of B, B even unless N == 1.
template <class T, int N, int B>
__device__ __forceinline__ void get_floats(const Vec<T, N>& v, int k, float (&x)[B]) {
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int j = 0; j < B; ++j) x[j] = __uint_as_float(v.w[k + j]);
  } else if constexpr (N == 1) {
    x[0] = to_f32(v.v);
  } else {
#pragma unroll
    for (int j = 0; j < B / 2; ++j) {
      const float2 f = unpack2(v.w[k / 2 + j], T());
      x[2 * j] = f.x;
      x[2 * j + 1] = f.y;
    }
  }
}

template <class T, int N, int B>
__device__ __forceinline__ void set_floats(Vec<T, N>& v, int k, const float (&x)[B]) {
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int j = 0; j < B; ++j) v.w[k + j] = __float_as_uint(x[j]);
  } else if constexpr (N == 1) {
    v.v = from_f32(x[0], T());
  } else {
#pragma unroll
    for (int j = 0; j < B / 2; ++j)
      v.w[k / 2 + j] = pack2(make_float2(x[2 * j], x[2 * j + 1]), T());
  }
}

// fp8 codes of two fp32 values, lo in bits 0-7 and hi in bits 8-15. On
// sm_89 and later the hardware conversion: round to nearest even, saturate
// to the largest finite value (Inf included), NaN -> 0x7F, which are
// encode_fp8's bits for every input; before, encode_fp8 itself.
__device__ __forceinline__ unsigned int fp8x2(float lo, float hi, Fp8Kind kind) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short r;
  if (kind == Fp8Kind::kE4M3) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  }
  return r;
#else
  return encode_fp8(lo, kind) | static_cast<unsigned int>(encode_fp8(hi, kind)) << 8;
#endif
}

// Where a lane's N elements of a half-row lie: N contiguous ones at N * lane
// (pass x = row + N * lane), or with kSplit two runs of N / 2, at N / 2 * lane
// and quarter + N / 2 * lane (x = row + N / 2 * lane; quarter = half / 2, the
// wide lanes' N / 2 * L), so that each of a warp's loads and stores covers
// one contiguous run. The wide lanes' float32 pool stores (32 bytes a lane in
// two 16-byte halves) used 20 of each 32-byte sector they wrote (Nsight
// Compute); split, each store of a warp writes 512 contiguous bytes.
template <class T, int N, bool kSplit>
__device__ __forceinline__ Vec<T, N> load_lane(const T* x, int quarter) {
  if constexpr (!kSplit) {
    return load_vec<T, N, true>(x);
  } else {
    const Vec<T, N / 2> lo = load_vec<T, N / 2, true>(x);
    const Vec<T, N / 2> hi = load_vec<T, N / 2, true>(x + quarter);
    Vec<T, N> v;
    join_runs(lo.w, hi.w, v.w);
    return v;
  }
}

// The two runs of a split lane's vector (load_lane).
template <class T, int N>
__device__ __forceinline__ void split_vec(const Vec<T, N>& v, Vec<T, N / 2>& lo,
                                          Vec<T, N / 2>& hi) {
  constexpr int W = Vec<T, N / 2>::kNumWords;
#pragma unroll
  for (int j = 0; j < W; ++j) {
    lo.w[j] = v.w[j];
    hi.w[j] = v.w[W + j];
  }
}

// Stores v in load_lane's layout at y (y = row + N * lane, or N / 2 * lane
// split).
template <class T, int N, bool kSplit>
__device__ __forceinline__ void store_lane(T* y, int quarter, const Vec<T, N>& v) {
  if constexpr (!kSplit) {
    store_vec<T, N, true>(y, v);
  } else {
    Vec<T, N / 2> lo, hi;
    split_vec<T, N>(v, lo, hi);
    store_vec<T, N / 2, true>(y, lo);
    store_vec<T, N / 2, true>(y + quarter, hi);
  }
}

// Writes the N values of v (q's dtype: k_rot as rounded, or v) at element
// `off` of pool row (row, h) in the pool's format (o.pool_mode, one of the
// formats kPools). 16-byte kernel: one vector store of N pool elements (two for a
// float32 pool of 16-bit inputs). fp8: the IEEE quotient x / scale, or the
// same quotient as x * mul when the host found the reciprocal exact.
template <class T, int N, bool kContig, int kPools>
__device__ __forceinline__ void store_pool(const Tensor3& y, const Options& o, long long row,
                                           int h, int off, const Vec<T, N>& v, float scale,
                                           float mul) {
  // (A float32 pool of float32 inputs is kPoolSame.)
  const int mode = kPools == kPoolsFp8 || kPools == kPoolsFp8Mul ? kPoolFp8
                   : kPools == kPoolsAny  ? o.pool_mode
                   : kPools == kPoolsSame || sizeof(T) == 4 ? kPoolSame
                   : kPools == kPoolsF32 || o.pool_mode == kPoolF32 ? kPoolF32
                                                                     : kPoolSame;
  if (mode == kPoolSame) {
    store_vec<T, N, kContig>(at<T>(y, row, h) + (kContig ? off : off * y.s2), v);
    return;
  }
  if (mode == kPoolF32) {
    float x[N];
    to_floats<T, N>(v, x);
    float* dst = at<float>(y, row, h) + (kContig ? off : off * y.s2);
    if constexpr (kContig) {
      static_assert(N % 4 == 0, "the options kernel's vectors hold 16 bytes");
#pragma unroll
      for (int j = 0; j < N; j += 4)
        *reinterpret_cast<float4*>(dst + j) = make_float4(x[j], x[j + 1], x[j + 2], x[j + 3]);
    } else {
      *dst = x[0];
    }
    return;
  }
  // fp8, four elements (one word of codes) at a time.
  const Fp8Kind kind = static_cast<Fp8Kind>(o.fp8_kind);
  constexpr int B = N < 4 ? N : 4;
  unsigned int w[(N + 3) / 4];
#pragma unroll
  for (int k = 0; k < N; k += B) {
    float x[B];
    get_floats<T, N, B>(v, k, x);
    if (kPools != kPoolsFp8Mul && o.fp8_div) {
#pragma unroll
      for (int j = 0; j < B; ++j) x[j] = __fdiv_rn(x[j], scale);
    } else {
#pragma unroll
      for (int j = 0; j < B; ++j) x[j] = __fmul_rn(x[j], mul);
    }
    if constexpr (B == 4) {
      w[k / 4] = fp8x2(x[0], x[1], kind) | fp8x2(x[2], x[3], kind) << 16;
    } else {
      w[0] = fp8x2(x[0], 0.0f, kind);
    }
  }
  unsigned char* dst = at<unsigned char>(y, row, h) + (kContig ? off : off * y.s2);
  if constexpr (!kContig) {
    *dst = static_cast<unsigned char>(w[0]);
  } else if constexpr (N == 8) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  } else {
    *reinterpret_cast<unsigned int*>(dst) = w[0];
  }
}

// store_pool of a lane's vector in load_lane's layout (e: its first element).
template <class T, int N, int kPools, bool kSplit>
__device__ __forceinline__ void store_pool_lane(const Tensor3& y, const Options& o,
                                                long long row, int h, int e, int quarter,
                                                const Vec<T, N>& v, float scale, float mul) {
  if constexpr (!kSplit) {
    store_pool<T, N, true, kPools>(y, o, row, h, e, v, scale, mul);
  } else {
    Vec<T, N / 2> lo, hi;
    split_vec<T, N>(v, lo, hi);
    store_pool<T, N / 2, true, kPools>(y, o, row, h, e, lo, scale, mul);
    store_pool<T, N / 2, true, kPools>(y, o, row, h, e + quarter, hi, scale, mul);
  }
}

// Sum of squares of one chunk's elements (QK-norm), in fp32.
template <class T, int N>
__device__ __forceinline__ float sum_squares(const Vec<T, N>& a, const Vec<T, N>& b, bool pair) {
  float x[N];
  float s = 0.0f;
  to_floats<T, N>(a, x);
#pragma unroll
  for (int j = 0; j < N; ++j) s = __fmaf_rn(x[j], x[j], s);
  if (pair) {
    to_floats<T, N>(b, x);
#pragma unroll
    for (int j = 0; j < N; ++j) s = __fmaf_rn(x[j], x[j], s);
  }
  return s;
}

// Adds to ss[u] the squares of the lane's chunk c of each q/k head of the
// batch (virtual heads below vh_end) that has a QK-norm weight.
template <class T, int N, int U>
__device__ __forceinline__ void add_squares(const OptParams& p, int first_vh, int vh_end, int hp,
                                            int c, const Vec<T, N> (&a)[U],
                                            const Vec<T, N> (&b)[U], float (&ss)[U]) {
  const int Hq = p.num_qo_heads, Hk = p.num_kv_heads, HP = p.heads_par;
  const bool pair = c < p.pair_items;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int vh = first_vh + u * HP + hp;
    if (vh >= vh_end) continue;
    int h;
    const int kind = kind_of(vh, Hq, Hk, &h);
    if (kind == 0 ? p.o.q_norm != nullptr : (kind == 1 && p.o.k_norm != nullptr))
      ss[u] += sum_squares<T, N>(a[u], b[u], pair);
  }
}

// One chunk of a q or k head: the QK-norm when `norm` (x * r, times the
// weights w at off1 / off2), the rotation of a pair chunk (NeoX, or
// interleaved), in fp32, then one rounding to T; without a norm an
// unrotated chunk is left as it is. The work goes in blocks of 4 elements
// of each vector, each with its cos/sin and weights read from shared memory
// then: fewer values live at once than with the chunk's cos/sin held in
// registers for every step (as the plain kernel does), which keeps the
// registers of these kernels at the plain one's. cs: the cos of frequency 0
// (its sin at cs + half); NeoX and the strided kernel's pair use
// frequencies from off1 (cN, or c), interleaved vectors hold the pairs
// off1 / 2 .. and off2 / 2 ...
template <class T, int N, bool kContig, bool kNorm>
__device__ __forceinline__ void transform(Vec<T, N>& a, Vec<T, N>& b, bool pair, bool interleaved,
                                          bool norm, const float* w, int off1, int off2, float r,
                                          const float* cs, int half) {
  const bool normed = kNorm && norm;
  if (!normed && !pair) return;
  constexpr int B = N < 4 ? N : 4;
#pragma unroll
  for (int k = 0; k < N; k += B) {
    float xa[B], xb[B];
    get_floats<T, N, B>(a, k, xa);
    if (pair) get_floats<T, N, B>(b, k, xb);
    if (normed) {
      float wv[B];
      load_floats<B, kContig>(w + off1 + k, wv);
#pragma unroll
      for (int j = 0; j < B; ++j) xa[j] = __fmul_rn(__fmul_rn(xa[j], r), wv[j]);
      if (pair) {
        load_floats<B, kContig>(w + off2 + k, wv);
#pragma unroll
        for (int j = 0; j < B; ++j) xb[j] = __fmul_rn(__fmul_rn(xb[j], r), wv[j]);
      }
    }
    if (pair) {
      if (N > 1 && interleaved) {
        // xa holds pairs (off1 + k) / 2 + i, xb pairs (off2 + k) / 2 + i,
        // each (x[2i], x[2i+1]).
        constexpr int P = B > 1 ? B / 2 : 1;  // (N == 1: not reached)
        float ca[P], sa[P], cb[P], sb[P];
        const float* fa = cs + (off1 + k) / 2;
        const float* fb = cs + (off2 + k) / 2;
        load_floats<P, kContig>(fa, ca);
        load_floats<P, kContig>(fa + half, sa);
        load_floats<P, kContig>(fb, cb);
        load_floats<P, kContig>(fb + half, sb);
#pragma unroll
        for (int i = 0; i < P; ++i) {
          const float a1 = xa[2 * i], a2 = xa[2 * i + 1];
          xa[2 * i] = rot1(a1, a2, ca[i], sa[i]);
          xa[2 * i + 1] = rot2(a1, a2, ca[i], sa[i]);
          const float b1 = xb[2 * i], b2 = xb[2 * i + 1];
          xb[2 * i] = rot1(b1, b2, cb[i], sb[i]);
          xb[2 * i + 1] = rot2(b1, b2, cb[i], sb[i]);
        }
      } else {
        // NeoX (frequencies off1 = cN ..), or one interleaved pair
        // (x[2c], x[2c+1]) in the strided kernel (frequency off1 / 2 = c).
        float c[B], s[B];
        const float* f = cs + (interleaved ? off1 / 2 : off1) + k;
        load_floats<B, kContig>(f, c);
        load_floats<B, kContig>(f + half, s);
#pragma unroll
        for (int j = 0; j < B; ++j) {
          const float x1 = xa[j], x2 = xb[j];
          xa[j] = rot1(x1, x2, c[j], s[j]);
          xb[j] = rot2(x1, x2, c[j], s[j]);
        }
      }
      set_floats<T, N, B>(b, k, xb);
    }
    set_floats<T, N, B>(a, k, xa);
  }
}

// The QK-norm's r = 1 / sqrt(ss / D + eps): ss / D correctly rounded (the
// product by 2^-log2(D) where D is a power of two: the same quotient), then
// the hardware reciprocal square root (rsqrtf, within 2 ulp of fp32; the CPU
// rounds a square root and a division, so the two backends' r can differ
// by those ulp, far inside one rounding of a 16-bit output). It sits on a
// decode call's serial path: against the IEEE square root and division,
// 0.04-0.06 us less at T = 1 to 32 and 0.06-0.11 us at T = 512 (H200, cold L2;
// docs/performance.md, *The QK-norm's reciprocal square root*).
// pow2: a compile-time true where the caller knows D is one.
__device__ __forceinline__ float norm_scale(float ss, int D, float eps, bool pow2) {
  const float q = pow2 ? __fmul_rn(ss, __int_as_float((127 - (__ffs(D) - 1)) << 23))
                       : __fdiv_rn(ss, static_cast<float>(D));
  return rsqrtf(__fadd_rn(q, eps));
}

// A float kernel parameter read into a register by a load of its address (a
// __grid_constant__ parameter's address is a generic one), where this is
// called: the compiler otherwise reads a parameter from the constant bank
// where it is used. The small kernel's QK-norm read norm_eps so after its
// block barrier, on the decode call's critical path, and 0.03-0.11 us of a
// call at T = 1 to 128 (H200, warm and cold L2) went with it; read before the
// wait it is in a register by then (docs/performance.md, *norm_eps in a
// register*). (A volatile load there was slower at T = 128: a system-scope
// read in every thread.)
__device__ __forceinline__ float param_in_register(const float& x) {
  float v;
  asm volatile("ld.f32 %0, [%1];" : "=f"(v) : "l"(&x));
  return v;
}

// The options kernel's r of step u of a batch (ss: the head sums of its
// steps): 1 for a step past `steps`, a v head or a head without weights.
template <int U>
__device__ __forceinline__ float step_norm_scale(const OptParams& p, int first_vh, int hp, int u,
                                                 int steps, const float (&ss)[U]) {
  if (u >= steps) return 1.0f;
  int h;
  const int kind = kind_of(first_vh + u * p.heads_par + hp, p.num_qo_heads, p.num_kv_heads, &h);
  if (kind == 2 || (kind == 0 ? p.o.q_norm : p.o.k_norm) == nullptr) return 1.0f;
  float x = ss[0];
#pragma unroll
  for (int k = 1; k < U; ++k)
    if (k == u) x = ss[k];
  const int D = p.o.head_dim;
  return norm_scale(x, D, p.o.norm_eps, (D & (D - 1)) == 0);
}

// The options kernel's store of one chunk for each step of the batch: q and
// k through `transform` into q_rot / k_rot, then k_rot's values and v's into
// their pool rows in the pool's format; the same order of work as
// store_batch.
template <class T, int N, bool kContig, int U, int kPools, bool kNorm>
__device__ __forceinline__ void store_batch_options(const OptParams& p, long long t,
                                                    long long row, int first_vh, int vh_end,
                                                    int hp, int c, const float* cs_smem,
                                                    bool norm, const float* wq, const float* wk,
                                                    const float (&r)[U], Vec<T, N> (&a)[U],
                                                    Vec<T, N> (&b)[U]) {
  const Options& o = p.o;
  const int Hq = p.num_qo_heads, Hk = p.num_kv_heads, HP = p.heads_par;
  const bool pair = c < p.pair_items;
  const bool interleaved = o.interleaved != 0;
  int off1, off2;
  options_offsets<N>(p, c, interleaved, &off1, &off2);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int vh = first_vh + u * HP + hp;
    if (vh >= vh_end) continue;
    int h;
    const int kind = kind_of(vh, Hq, Hk, &h);
    if (kind != 2) {
      transform<T, N, kContig, kNorm>(a[u], b[u], pair, interleaved, norm, kind == 0 ? wq : wk,
                                      off1, off2, r[u], cs_smem, p.half);
      const Tensor3& y = kind == 0 ? p.q_rot : p.k_rot;
      T* dst = at<T>(y, t, h);
      const long long s2 = kContig ? 1 : y.s2;
      store_vec<T, N, kContig>(dst + off1 * s2, a[u]);
      if (pair) store_vec<T, N, kContig>(dst + off2 * s2, b[u]);
    }
    if (kind != 0 && row >= 0) {
      const Tensor3& y = kind == 1 ? p.k_pool : p.v_pool;
      const float scale = kind == 1 ? o.k_scale : o.v_scale;
      const float mul = kind == 1 ? o.k_mul : o.v_mul;
      store_pool<T, N, kContig, kPools>(y, o, row, h, off1, a[u], scale, mul);
      if (pair) store_pool<T, N, kContig, kPools>(y, o, row, h, off2, b[u], scale, mul);
    }
  }
}

// The kernel of calls with options: rope_pool_kernel's decomposition, with
// the pool formats (kPools: fp8, or not) and the QK-norm code (kNorm) fixed
// at compile time, the other options (interleaved pairs, the attention
// factor, a cos_sin_cache, the fp8 kind and scales) as uniform run-time
// branches. A batch takes o.steps <= U steps. Dynamic shared memory:
// cos[half], sin[half]; with a QK-norm also q and k weights [D] each (fp32)
// and a sum of squares per (warp, step) for teams wider than a warp.
template <class T, int N, bool kContig, int U, int kPools, bool kNorm>
__global__ void __launch_bounds__(max_block(U))
    rope_pool_options_kernel(const __grid_constant__ OptParams p) {
  extern __shared__ float4 smem4[];  // float4: 16-byte aligned weights
  // Before the wait: see rope_pool_kernel.
  float* smem = reinterpret_cast<float*>(smem4);
  const Options& o = p.o;
  const int tid = threadIdx.x;
  const Place pl = place_of(p);
  const long long t = pl.t;
  const int TL = p.team_lanes, items = p.items, HP = p.heads_par;
  const int steps = U == 1 ? 1 : o.steps;
  const int lane = pl.lane, batch = pl.batch, hp = pl.hp, c0 = pl.c0;
  // No early return: every thread reaches the shuffles and the barrier.
  const bool active = hp < HP && batch < p.num_batches && c0 < items;
  const int first_vh = batch * steps * HP;
  // The batch's virtual heads end here: steps u >= `steps` are not its own.
  const int vh_end = min(first_vh + steps * HP, p.num_qo_heads + 2 * p.num_kv_heads);
  const bool interleaved = o.interleaved != 0;
  const float freq0 = p.cos_sin == nullptr ? first_inv_freq(p, tid) : 0.0f;
  const BatchSrc<T, U> src = batch_src<T, kContig, U>(p, t, first_vh, hp, vh_end);
  const void* pos_at = index_at(p.positions, p.pos_stride, p.pos64, t);
  const void* slot_at = index_at(p.slots, p.slot_stride, p.slot64, t);
  grid_dependency_sync(first_addresses(p, src, pos_at, slot_at));

  // Data loads first, then the position and the slot (see rope_pool_kernel).
  Vec<T, N> a[U], b[U];
  if (active) load_batch<T, N, kContig, U, true>(p, src, c0, a, b, interleaved);
  const long long position = load_index_at(pos_at, p.pos64);
  const long long slot = load_index_at(slot_at, p.slot64);

  float* cs_smem = smem;
  const int D = o.head_dim;
  const bool norm = kNorm && (o.q_norm != nullptr || o.k_norm != nullptr);
  float* wq = smem + p.rotary_dim;  // with a QK-norm: the weights of q, k
  float* wk = wq + D;
  float* partial = wk + D;
  // In the one-step kernel (small calls), a thread's first QK-norm weights go
  // out now, with the index loads: issued after the cos/sin (which wait for
  // the position), they cost a decode call a second memory round trip. (In
  // the kOptSteps kernel the two registers they hold cost 2 % at T >= 2048.)
  constexpr bool kEarly = kNorm && U == 1;
  unsigned int wq0 = 0, wk0 = 0;  // bits, converted where stored
  if (kEarly && norm && tid < D) {
    if (o.q_norm) wq0 = load_bits(o.q_norm, tid * o.qn_stride, o.qn_dtype);
    if (o.k_norm) wk0 = load_bits(o.k_norm, tid * o.kn_stride, o.kn_dtype);
  }
  // A position outside the table skips the token: the same for the block.
  bool skip = false;
  if (p.cos_sin != nullptr) {
    skip = position < 0 || position >= p.cs_rows;
    if (!skip) {
      const long long base = position * p.cs_s0;
      for (int i = tid; i < p.half; i += blockDim.x) {
        float c, s;
        load_float2(p.cos_sin, base + i * p.cs_s1, base + (p.half + i) * p.cs_s1, p.cs_dtype,
                    &c, &s);
        cs_smem[i] = c;
        cs_smem[p.half + i] = s;
      }
    } else if (pl.part == 0 && tid == 0) {
      report_bad_index(p.err, true, t, position, p.cs_rows);
    }
  } else {
    make_cos_sin(p, position, tid, blockDim.x, freq0, cs_smem);
  }
  if (norm) {
    if (kEarly && tid < D) {
      wq[tid] = o.q_norm ? bits_to_float(wq0, o.qn_dtype) : 1.0f;
      wk[tid] = o.k_norm ? bits_to_float(wk0, o.kn_dtype) : 1.0f;
    }
    for (int i = kEarly ? tid + blockDim.x : tid; i < D; i += blockDim.x) {
      wq[i] = o.q_norm ? load_float(o.q_norm, i * o.qn_stride, o.qn_dtype) : 1.0f;
      wk[i] = o.k_norm ? load_float(o.k_norm, i * o.kn_stride, o.kn_dtype) : 1.0f;
    }
  }
  if (!skip && slot >= p.pool_size && pl.part == 0 && tid == 0)
    report_bad_index(p.err, false, t, slot, p.pool_size);

  // QK-norm: each lane's sum of squares over its chunks, then over the lanes
  // of the head, in a fixed order (the result does not depend on timing).
  float r[U];
#pragma unroll
  for (int u = 0; u < U; ++u) r[u] = 1.0f;
  if (kNorm) {
    float ss[U];
#pragma unroll
    for (int u = 0; u < U; ++u) ss[u] = 0.0f;
    if (norm) {
      if (active) {
        add_squares<T, N, U>(p, first_vh, vh_end, hp, c0, a, b, ss);
        // A head wider than the team (strided kernel only: the launcher
        // sends such a call there): its other chunks are read here and again
        // below, by this lane only (in place stays safe).
        for (int c = c0 + TL; !kContig && c < items; c += TL) {
#pragma unroll 1
          for (int u = 0; u < steps; ++u) {  // rare: one step at a time, short code
            Vec<T, N> a2[1], b2[1];
            float s[1] = {0.0f};
            load_batch<T, N, kContig, 1, true>(
                p, batch_src<T, kContig, 1>(p, t, first_vh + u * HP, hp, vh_end), c, a2, b2,
                interleaved);
            add_squares<T, N, 1>(p, first_vh + u * HP, vh_end, hp, c, a2, b2, s);
#pragma unroll
            for (int k = 0; k < U; ++k)
              if (k == u) ss[k] += s[0];
          }
        }
      }
      // Within a warp: a tree over the head's lanes (a segment of `items`
      // lanes of a one-warp team, or the whole warp of a wider team), summed
      // into the segment's first lane and broadcast.
      const int wl = tid & 31;
      const int seg = TL == 32 ? items : 32;
      const int off = TL == 32 ? c0 : wl;
#pragma unroll 1
      for (int d = 1; d < seg; d <<= 1) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const float other = __shfl_down_sync(0xFFFFFFFFu, ss[u], d);
          if (off + d < seg) ss[u] += other;
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) ss[u] = __shfl_sync(0xFFFFFFFFu, ss[u], wl - off);
      if (U > 1 && TL == 32) {
        // r of each step: lane `off` of the head's segment makes step off's
        // (and off + seg's ... where a segment has fewer lanes than steps)
        // and the segment's lanes take them by shuffles, instead of each
        // lane making every step's r in turn (a chain of U divisions and
        // square roots: 4-5 % of a call at T = 2048-8192; docs/performance.md,
        // *Options*). One step (U = 1) needs no shuffles.
        const int base = wl - off;
#pragma unroll 1
        for (int u0 = 0; u0 < steps; u0 += seg) {  // one round where seg >= steps
          const float x = step_norm_scale<U>(p, first_vh, hp, u0 + off, steps, ss);
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const float y = __shfl_sync(0xFFFFFFFFu, x, base + min(max(u - u0, 0), seg - 1));
            if (u >= u0 && u < u0 + seg) r[u] = y;
          }
        }
      } else if (TL > 32 && wl == 0) {
#pragma unroll
        for (int u = 0; u < U; ++u) partial[(tid >> 5) * U + u] = ss[u];
      }
    }
    __syncthreads();
    if (!active || skip) return;
    if (norm && (U == 1 || TL > 32)) {
      // One step, or a team wider than a warp (very wide heads; the warps'
      // sums from shared memory): every step's r in this lane.
      if (TL > 32) {
        const int w0 = (tid - lane) >> 5;  // the team's first warp
#pragma unroll
        for (int u = 0; u < U; ++u) {
          float s = 0.0f;
#pragma unroll 1
          for (int w = 0; w < TL / 32; ++w) s += partial[(w0 + w) * U + u];
          ss[u] = s;
        }
      }
#pragma unroll 1
      for (int u = 0; u < steps; ++u) {
        const float x = step_norm_scale<U>(p, first_vh, hp, u, steps, ss);
#pragma unroll
        for (int k = 0; k < U; ++k)
          if (k == u) r[k] = x;
      }
    }
  } else {
    __syncthreads();
    if (!active || skip) return;
  }

  const long long row = slot >= 0 && slot < p.pool_size ? slot : -1;
  for (int c = c0;;) {
    store_batch_options<T, N, kContig, U, kPools, kNorm>(p, t, row, first_vh, vh_end, hp, c,
                                                        cs_smem, norm, wq, wk, r, a, b);
    c += TL;
    if (c >= items) break;
    load_batch<T, N, kContig, U, true>(p, batch_src<T, kContig, U>(p, t, first_vh, hp, vh_end),
                                       c, a, b, interleaved);  // (see rope_pool_kernel)
  }
}

// ------------------------------------------------------------------ small calls

// Pairs per lane of the small kernel: two 8-byte vectors of 16-bit data.
constexpr int kSmallVec = 4;
// The most threads of its blocks (heads of L lanes each); the launcher aims
// at 128 or 256 (small_threads in rope_pool_cuda.cu).
constexpr int kSmallThreads = 256;

// The parameters of a small-kernel build: Params for the plain builds (no
// QK-norm, pools of q's dtype), OptParams for the others.
template <bool kNorm, int kPools>
using SmallParams =
    typename std::conditional<kNorm || kPools != kPoolsSame, OptParams, Params>::type;

// The raw words of N (kSmallVec, or 2 * kSmallVec in wide lanes) QK-norm
// weights at element e of w, in 16- or 8-byte loads: WW = N words of dtype
// code wdt (0 float32, N words; else q's dtype, N / 2 words of two), or
// WW = N / 2 words of q's dtype alone (wide lanes: float32 weights there
// held eight more registers across the block's barrier). The launcher takes
// only contiguous weights aligned to N of them (small_weights_ok and
// small_vec in rope_pool_cuda.cu).
template <int N, int WW>
__device__ __forceinline__ void weight_words(const void* w, int e, int wdt,
                                             unsigned int (&x)[WW]) {
  static_assert(N == kSmallVec || N == 2 * kSmallVec, "one or two 16-byte loads");
  static_assert(WW == N || WW == N / 2, "float32 or 16-bit words");
  if (WW == N && wdt == 0) {
    const uint4* u4 = reinterpret_cast<const uint4*>(static_cast<const float*>(w) + e);
#pragma unroll
    for (int k = 0; k < WW / 4; ++k) {
      const uint4 u = __ldg(u4 + k);
      x[4 * k] = u.x;
      x[4 * k + 1] = u.y;
      x[4 * k + 2] = u.z;
      x[4 * k + 3] = u.w;
    }
  } else if constexpr (N == 8) {
    const uint4 u =
        __ldg(reinterpret_cast<const uint4*>(static_cast<const unsigned short*>(w) + e));
    x[0] = u.x;
    x[1] = u.y;
    x[2] = u.z;
    x[3] = u.w;
  } else {
    const uint2 u =
        __ldg(reinterpret_cast<const uint2*>(static_cast<const unsigned short*>(w) + e));
    x[0] = u.x;
    x[1] = u.y;
  }
}

// The weights of a lane's N elements at e (load_lane's runs with kSplit: two
// loads of N / 2 weights, 16-bit ones in the wide builds).
template <int N, int WW, bool kSplit>
__device__ __forceinline__ void lane_weight_words(const void* w, int e, int quarter, int wdt,
                                                  unsigned int (&x)[WW]) {
  if constexpr (!kSplit) {
    weight_words<N, WW>(w, e, wdt, x);
  } else {
    static_assert(WW == N / 2, "split lanes: 16-bit weights");
    unsigned int lo[WW / 2], hi[WW / 2];
    weight_words<N / 2, WW / 2>(w, e, wdt, lo);
    weight_words<N / 2, WW / 2>(w, e + quarter, wdt, hi);
    join_runs(lo, hi, x);
  }
}

// The weights of weight_words as floats (exact): float32 words as they are,
// 16-bit ones (q's dtype T) converted in pairs, where they are used (a
// conversion right after the load would stall the loads issued after it).
template <class T, int N, int WW>
__device__ __forceinline__ void weight_floats(const unsigned int (&w)[WW], int wdt,
                                              float (&x)[N]) {
  if (WW == N && wdt == 0) {
#pragma unroll
    for (int j = 0; j < N; ++j) x[j] = __uint_as_float(w[j % WW]);  // (WW == N here)
  } else {
#pragma unroll
    for (int k = 0; k < N / 2; ++k) {
      const float2 f = unpack2(w[k], T());
      x[2 * k] = f.x;
      x[2 * k + 1] = f.y;
    }
  }
}

// Interleaved pairs (x[2i], x[2i+1]) of 16-bit vectors: each word of a and
// b is one pair; c and s hold the frequencies of a's pairs, then b's.
template <class T, int N>
__device__ __forceinline__ void rotate_interleaved(Vec<T, N>& a, Vec<T, N>& b,
                                                   const float (&c)[N], const float (&s)[N]) {
  static_assert(sizeof(T) == 2 && N % 2 == 0, "16-bit vectors of whole pairs");
  constexpr int W = N / 2;
#pragma unroll
  for (int j = 0; j < W; ++j) {
    const float2 x = unpack2(a.w[j], T()), y = unpack2(b.w[j], T());
    a.w[j] = pack2(make_float2(rot1(x.x, x.y, c[j], s[j]), rot2(x.x, x.y, c[j], s[j])), T());
    b.w[j] = pack2(make_float2(rot1(y.x, y.y, c[W + j], s[W + j]),
                               rot2(y.x, y.y, c[W + j], s[W + j])),
                   T());
  }
}

// The QK-norm and the rotation of a lane's two vectors in fp32, then one
// rounding to T (the order of transform: x * r, times the weight, then the
// rotation). wa / wb: the weights of a's and b's elements as weight_words
// of dtype code wdt; c, s as for rotate (NeoX) or rotate_interleaved.
template <class T, int N, bool kInterleaved, int WW>
__device__ __forceinline__ void rotate_normed(Vec<T, N>& a, Vec<T, N>& b, const float (&c)[N],
                                              const float (&s)[N], float r,
                                              const unsigned int (&wa)[WW],
                                              const unsigned int (&wb)[WW], int wdt) {
  float xa[N], xb[N], fa[N], fb[N];
  to_floats<T, N>(a, xa);
  to_floats<T, N>(b, xb);
  weight_floats<T, N, WW>(wa, wdt, fa);
  weight_floats<T, N, WW>(wb, wdt, fb);
#pragma unroll
  for (int j = 0; j < N; ++j) {
    xa[j] = __fmul_rn(__fmul_rn(xa[j], r), fa[j]);
    xb[j] = __fmul_rn(__fmul_rn(xb[j], r), fb[j]);
  }
  if constexpr (kInterleaved) {
    constexpr int W = N / 2;
#pragma unroll
    for (int i = 0; i < W; ++i) {
      const float a1 = xa[2 * i], a2 = xa[2 * i + 1], b1 = xb[2 * i], b2 = xb[2 * i + 1];
      xa[2 * i] = rot1(a1, a2, c[i], s[i]);
      xa[2 * i + 1] = rot2(a1, a2, c[i], s[i]);
      xb[2 * i] = rot1(b1, b2, c[W + i], s[W + i]);
      xb[2 * i + 1] = rot2(b1, b2, c[W + i], s[W + i]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float x1 = xa[j], x2 = xb[j];
      xa[j] = rot1(x1, x2, c[j], s[j]);
      xb[j] = rot2(x1, x2, c[j], s[j]);
    }
  }
  a = from_floats<T, N>(xa);
  b = from_floats<T, N>(xb);
}

// The QK-norm's head sum of the small kernel: the L lane sums at hs (shared
// memory, 16-byte aligned), L a power of two <= 32. For L >= 4 in one order:
// four running sums of every fourth value (float4 reads), then (s0 + s1) +
// (s2 + s3); below, in lane order. With L known, every read goes out before
// the first add: in a loop over a run-time L each read waited for the one
// before it (4 shared-memory round trips for L = 16).
template <int L>
__device__ __forceinline__ float head_sum_of(const float* hs) {
  float4 v[L / 4];
#pragma unroll
  for (int i = 0; i < L / 4; ++i) v[i] = reinterpret_cast<const float4*>(hs)[i];
  float4 acc = v[0];
#pragma unroll
  for (int i = 1; i < L / 4; ++i) {
    acc.x += v[i].x;
    acc.y += v[i].y;
    acc.z += v[i].z;
    acc.w += v[i].w;
  }
  return (acc.x + acc.y) + (acc.z + acc.w);
}
__device__ __forceinline__ float head_sum(const float* hs, int L) {
  // (Ranges, not a switch on L: the compiler makes a switch, or tests of
  // equality, a jump table, whose constant-bank load a cold call may wait for.)
  if (L >= 16) return L >= 32 ? head_sum_of<32>(hs) : head_sum_of<16>(hs);
  if (L >= 4) return L >= 8 ? head_sum_of<8>(hs) : head_sum_of<4>(hs);
  return L == 2 ? hs[0] + hs[1] : hs[0];
}
// The same sum, one float4 read at a time: the wide-lane builds' (see the
// small kernel).
__device__ __forceinline__ float head_sum_serial(const float* hs, int L) {
  float sum = 0.0f;
  if (L >= 4) {
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int i = 0; i < 32; i += 4) {
      if (i >= L) break;
      const float4 v = *reinterpret_cast<const float4*>(hs + i);
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
    }
    sum = (acc.x + acc.y) + (acc.z + acc.w);
  } else {
    for (int i = 0; i < L; ++i) sum += hs[i];
  }
  return sum;
}

// Whether a small-kernel build splits its lanes' vectors in two runs
// (load_lane): the wide builds with float32 pools (with a QK-norm or
// without). Against whole 16-byte vectors (H100, cold L2,
// us): heads of 512 (8 + 4) with a QK-norm, T = 1024 21.85 -> 18.33, 8192
// 137.7 -> 132.1 (float32 pools alone 130.8); Llama-3.1-8B and Qwen3-8B
// within 2 % either way (docs/performance.md, *Split wide lanes for float32
// pools*). Those builds are held to five blocks of kSmallThreads an SM
// (__launch_bounds__), which keeps them at the unsplit builds' 48 registers
// (57-64 without: each run has its own addresses); 0 leaves the other builds
// as the compiler makes them (1 would raise their registers).
template <int kN, int kPools>
constexpr bool kSplitLanes = kN != kSmallVec && kPools == kPoolsF32;

// The small kernel's blocks an SM for __launch_bounds__ (0: the compiler's
// choice). Five for the split builds (above) and for the wide f16 QK-norm
// build with fp8 pools of exact reciprocal scales, which has 54 registers
// without it (48 in bf16): four blocks an SM. With five, f16 Llama-3.1-8B
// QK-norm + fp8 + yarn, H100, cold L2: T = 512 6.91 -> 5.96 us, 1024 12.04
// -> 11.75, 256 4.21 -> 4.36 (docs/performance.md, *Five blocks an SM for
// an f16 QK-norm with fp8 pools*). The builds already at 48 are left alone:
// the bound changes their code and costs them up to 1 %. Six for the wide
// f16 build of fp8 pools alone (exact reciprocal scales): 42 registers
// without it (40 warps an SM), 40 with it as in bf16 (48), no spills (ptxas
// -v, sm_90). H100, cold L2, f16, fp8_e4m3 pools: T = 512 Llama-3.1-8B 6.22
// -> 5.99 us, heads of 512 (8 + 4) 8.12 -> 7.37; at 1024 10.37 -> 10.23 and
// 13.40 -> 13.68; 256 and 8192 within 0.3 % (docs/performance.md, *Six
// blocks an SM for f16 fp8 pools*).
template <class T, int kN, bool kNorm, int kPools>
constexpr int kSmallMinBlocks =
    kSplitLanes<kN, kPools> ||
            (std::is_same<T, __half>::value && kN != kSmallVec && kNorm && kPools == kPoolsFp8Mul)
        ? 5
    : std::is_same<T, __half>::value && kN != kSmallVec && !kNorm && kPools == kPoolsFp8Mul
        ? 6
        : 0;

// Blocks of kSmallThreads an SM for the one-wave builds (kOneWave): 1536
// threads, at most 42 registers each, which ptxas makes 40 (sm_90): 48 warps
// an SM in blocks of 4 warps, against 40 for the builds of 48 registers. The
// split float32-pool builds need no spills at 40; the QK-norm builds spill
// 16-24 bytes a thread (ptxas -v).
constexpr int kOneWaveMinBlocks = 6;
// Whether a small-kernel build has a one-wave build (kOneWave): the wide
// lanes of a QK-norm (pools of q's dtype, float32, fp8 of exact reciprocal
// scales) or of float32 pools, the builds of 48 registers. Not the QK-norm
// with dividing fp8 scales (63-64 registers, 32 bytes spilled at 40: not
// measured), nor the plain and fp8 builds (40 registers).
template <int kN, bool kNorm, int kPools>
constexpr bool kHasOneWave =
    kN != kSmallVec && (kNorm ? kPools != kPoolsFp8 : kPools == kPoolsF32);

// The kernel of small calls of 16-bit data (decode), full rotary; kTable:
// cos/sin read from a cos_sin_cache; kInterleaved: GPT-J pairs (2i, 2i+1)
// instead of NeoX (i, i + half); kNorm: a QK-norm (heads of L = 1..32 lanes,
// a power of two: the launcher's rule); kPools: the pool format, one per
// build (kPoolsSame: q's dtype, kPoolsF32, kPoolsFp8 with the scales in
// p.o, kPoolsFp8Mul for scales that do not divide). The plain builds take
// Params, the others OptParams (SmallParams).
// Each build holds only its own code: a decode call fetches its
// instructions cold, and a build with every pool format in it (the QK-norm
// build before) was twice the plain one's length. Block (L, HB): HB heads
// of one token, each q head or kv head (with its v) taken by L = half / kN
// lanes; a lane loads the vectors of kN elements at kN * l and half + kN * l
// (kN = kSmallVec = 4; 8, "wide lanes", in the NeoX builds and the plain
// interleaved build without a table that calls of 257 to 8192 tokens take:
// twice the bytes in flight per thread; the wide float32-pool builds split
// each vector in two runs, kSplitLanes).
// With kN = 4 (NeoX: pairs 4l.. with half + 4l..; interleaved: the pairs 2l,
// 2l + 1 and half / 2 + 2l, half / 2 + 2l + 1 they hold (kN = 8: 4l..4l + 3
// and half / 2 + 4l..), so that loads and stores stay contiguous runs); grid
// (T, ceil((Hq + Hk) / HB)). Each block makes the token's
// cos/sin once into shared memory (one frequency per thread, one barrier),
// and its heads share them; with a table each lane reads its own from the
// token's row (no shared memory, no barrier). With a QK-norm, a head's sum
// of squares is its L lanes' sums, added through shared memory at a block
// barrier (the table build has one for it), the same sum in every lane.
//
// Why this shape: a decode call is a chain of memory round trips and
// instruction fetches, not a stream of bytes, and small blocks of one
// vector per lane spread it over more SMs with short code. Against what
// small calls ran before (the options kernel's one-step build, split over
// several blocks per token; H200, cold L2, 50-call graphs, four shapes):
// T = 1 1.78-1.96 -> 1.60-1.75 us, T = 128 2.81-3.95 -> 2.53-3.25; with a
// float32 table, Llama-3.1-8B T = 1 2.11 -> 1.99, T = 32 2.52 -> 2.15
// (docs/performance.md, *Small calls*; bench/cuda_decode_probe.cu headpar
// has the shapes it was chosen from).
// kOneWave: the same code held to 40 registers (kOneWaveMinBlocks), a
// second build of the wide lanes' QK-norm and float32-pool builds for the
// grids that fit one wave only so (the launcher's one_wave_small).
template <class T, bool kTable, bool kInterleaved, bool kNorm = false, int kPools = kPoolsSame,
          int kN = kSmallVec, class P = SmallParams<kNorm, kPools>, bool kOneWave = false>
__global__ void __launch_bounds__(kSmallThreads, kOneWave ? kOneWaveMinBlocks
                                                          : kSmallMinBlocks<T, kN, kNorm, kPools>)
    rope_pool_small_kernel(
    const __grid_constant__ P p) {
  static_assert(std::is_same<P, SmallParams<kNorm, kPools>>::value, "the build's parameters");
  // cos[half], then sin[half] (not with a table); then with a QK-norm each
  // thread's sum of squares.
  extern __shared__ float cs_smem[];
  static_assert(kPools == kPoolsSame || kPools == kPoolsF32 || kPools == kPoolsFp8 ||
                    kPools == kPoolsFp8Mul,
                "one pool format per build");
  constexpr int N = kN;
  static_assert(N == kSmallVec || (N == 2 * kSmallVec && !kTable &&
                                    (!kInterleaved || (!kNorm && kPools == kPoolsSame))),
                "wide lanes: cos/sin computed; with interleaved pairs the plain build only");
  const int lane = threadIdx.x, threads = blockDim.x * blockDim.y;
  const int tid = threadIdx.y * blockDim.x + lane;
  const long long t = blockIdx.x;
  const int Hq = p.num_qo_heads, hh = blockIdx.y * blockDim.y + threadIdx.y;
  const bool active = hh < Hq + p.num_kv_heads, is_q = hh < Hq;
  // Narrow builds of a QK-norm, and of f16 data with float32 or fp8 pools,
  // load without a branch on `active`: a thread past the last head loads kv
  // head 0 of its token (in bounds, unused). With the branch, ptxas put the
  // widening of a 32-bit index ahead of the f16 pool builds' loads
  // (scripts/sass_load_order.py), one memory round trip late: without it,
  // f16 Llama-3.1-8B float32 pools T = 32 2.26 -> 2.01 us, as bf16; QK-norm
  // calls at T = 1 0.01-0.06 us faster in both dtypes. The plain builds
  // (0.01-0.02 us slower at T = 32 without it), the wide ones (the QK-norm's
  // Llama-3.1-8B T = 512 6.07 -> 6.74, bf16) and bf16's pool builds (in
  // order with it, within 0.03 us without) keep it (docs/performance.md,
  // *The q/k/v loads without a branch*).
  constexpr bool kAllLoad =
      kN == kSmallVec && (kNorm || (kPools != kPoolsSame && std::is_same<T, __half>::value));
  const int h = is_q ? hh : (active || !kAllLoad ? hh - Hq : 0);
  constexpr bool kSplit = kSplitLanes<kN, kPools>;
  constexpr int kRun = kSplit ? N / 2 : N;  // (a lane's first element: kRun * lane)
  const int quarter = p.half / 2;
  // Before the wait (overlapping the previous kernel): addresses only.
  const float freq0 = kTable ? 0.0f : first_inv_freq(p, tid);
  const T* src = at<T>(is_q ? p.q : p.k, t, h) + lane * kRun;
  const T* vsrc = at<T>(p.v, t, is_q ? 0 : h) + lane * kRun;
  const void* pos_at = index_at(p.positions, p.pos_stride, p.pos64, t);
  const void* slot_at = index_at(p.slots, p.slot_stride, p.slot64, t);
  // The QK-norm's eps in a register before the wait (4-element lanes, where
  // it was measured; see param_in_register).
  float norm_eps = 0.0f;
  if constexpr (kNorm) norm_eps = N == kSmallVec ? param_in_register(p.o.norm_eps) : p.o.norm_eps;
  grid_dependency_sync(param_lines(p) ^ reinterpret_cast<unsigned long long>(src) ^
                       reinterpret_cast<unsigned long long>(pos_at) ^
                       reinterpret_cast<unsigned long long>(slot_at));

  // The data loads go out first, then the indices: a 32-bit index issued
  // first (widened to 64 bits as it arrives) held them back by one memory
  // round trip. The table build loads the slot only where it is needed (kv
  // heads, the reporter), the other build in every thread: each order
  // measured 0.15-0.25 us faster than the other for its build (cold T = 1,
  // four shapes; docs/performance.md, *Small calls*).
  Vec<T, N> a, b, va, vb;
  if (kAllLoad || active) {
    a = load_lane<T, N, kSplit>(src, quarter);
    b = load_lane<T, N, kSplit>(src + p.half, quarter);
    if (!is_q) {
      va = load_lane<T, N, kSplit>(vsrc, quarter);
      vb = load_lane<T, N, kSplit>(vsrc + p.half, quarter);
    }
  }
  // The head's QK-norm weights (QK-norm build), as raw words: converted
  // where used, so that the index loads below are not held back. A head
  // without a norm (only one of q_norm_weight, k_norm_weight given) takes
  // weights of 1 and r = 1, whose products are exact: one rotation path.
  const void* w = nullptr;
  int wdt = 0;
  constexpr int WW = N == kSmallVec ? N : N / 2;  // wide lanes: 16-bit weights only
  unsigned int wa[WW], wb[WW];
  if constexpr (kNorm) {
    w = is_q ? p.o.q_norm : p.o.k_norm;
    if (w != nullptr) {
      wdt = is_q ? p.o.qn_dtype : p.o.kn_dtype;
      if (active) {
        lane_weight_words<N, WW, kSplit>(w, lane * kRun, quarter, wdt, wa);
        lane_weight_words<N, WW, kSplit>(w, p.half + lane * kRun, quarter, wdt, wb);
      }
    } else if constexpr (WW == N) {
#pragma unroll
      for (int j = 0; j < WW; ++j) wa[j] = wb[j] = 0x3F800000u;  // 1.0f, dtype code 0
    } else {
      wdt = 1;  // pairs of 1.0 in q's dtype (any nonzero code: 16-bit words)
#pragma unroll
      for (int j = 0; j < WW; ++j)
        wa[j] = wb[j] = std::is_same<T, __half>::value ? 0x3C003C00u : 0x3F803F80u;
    }
  }
  const long long position = load_index_at(pos_at, p.pos64);
  const bool reporter = blockIdx.y == 0 && tid == 0;  // one report per token
  const long long slot =
      !kTable || !is_q || reporter ? load_index_at(slot_at, p.slot64) : -1;
  float cc[N], ss[N];
  if constexpr (kTable) {
    if (position < 0 || position >= p.cs_rows) {  // the token is skipped
      if (reporter) report_bad_index(p.err, true, t, position, p.cs_rows);
      return;
    }
    if (active) {
      const long long row = position * p.cs_s0;
      if constexpr (kInterleaved) {
        TableWords<2> wc[2], ws[2];
#pragma unroll
        for (int k = 0; k < 2; ++k) {  // a's frequencies, then b's
          const long long f = row + (k == 0 ? 0 : p.half / 2) + 2 * lane;
          wc[k] = table_load<2>(p.cos_sin, f, p.cs_dtype);
          ws[k] = table_load<2>(p.cos_sin, f + p.half, p.cs_dtype);
        }
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          float c2[2], s2[2];
          table_floats<2>(wc[k], p.cs_dtype, c2);
          table_floats<2>(ws[k], p.cs_dtype, s2);
          cc[2 * k] = c2[0];
          cc[2 * k + 1] = c2[1];
          ss[2 * k] = s2[0];
          ss[2 * k + 1] = s2[1];
        }
      } else {
        const TableWords<N> wc = table_load<N>(p.cos_sin, row + lane * N, p.cs_dtype);
        const TableWords<N> ws = table_load<N>(p.cos_sin, row + p.half + lane * N, p.cs_dtype);
        table_floats<N>(wc, p.cs_dtype, cc);
        table_floats<N>(ws, p.cs_dtype, ss);
      }
    }
  } else {
    make_cos_sin<kInterleaved || kSplit ? 1 : N>(p, position, tid, threads, freq0, cs_smem);
  }
  if (slot >= p.pool_size && reporter) report_bad_index(p.err, false, t, slot, p.pool_size);
  // QK-norm: each lane's sum of squares goes to shared memory (after the
  // cos/sin) before the block's barrier, and after it every lane of a head
  // adds the head's L sums (L = blockDim.x <= 32, a power of two) in the same
  // order (head_sum), then r = 1 / sqrt(ss / D + eps) by norm_scale, as in the
  // options kernel. (A butterfly of shuffles instead cost 0.2 us at T = 1: four
  // dependent steps on the call's critical path; a barrier of the head's
  // lanes alone (__syncwarp), 0.07 us at T = 1 and 1.6 us at T = 512.) The
  // table build has a barrier for it alone.
  // Wide heads of 32 lanes (D = 512) are one warp each: their sum is a
  // butterfly of shuffles before the barrier, where the cos/sin's sincos
  // hides it, instead of eight shared-memory reads, one after another
  // (head_sum_serial), after it. Each step adds the same two values in
  // every lane, so that every lane holds the same sum.
  // Narrow heads of 64 lanes (D = 512, the launcher's narrow_norm64) are two
  // warps: each warp's sum by the same butterfly, its first lane's copy to
  // shared memory; after the barrier every lane adds the two in one order.
  constexpr bool kWide = N != kSmallVec;
  float* sq_smem = cs_smem + (kTable ? 0 : 2 * p.half);
  float warp_sq = 0.0f;
  if constexpr (kNorm) {
    const float sq = active && w != nullptr ? sum_squares<T, N>(a, b, true) : 0.0f;
    if (blockDim.x == (kWide ? 32 : 64)) {
      warp_sq = sq;
#pragma unroll
      for (int m = 16; m >= 1; m /= 2) warp_sq += __shfl_xor_sync(0xffffffffu, warp_sq, m);
      if (!kWide && (lane & 31) == 0) sq_smem[tid] = warp_sq;
    } else {
      sq_smem[tid] = sq;
    }
  }
  if constexpr (!kTable || kNorm) __syncthreads();
  auto smem_cs = [&] {
    if constexpr (!kTable) {
      if constexpr (kInterleaved) {
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const int f = (j < N / 2 ? 0 : p.half / 2) + N / 2 * lane + j % (N / 2);
          cc[j] = cs_smem[f];
          ss[j] = cs_smem[p.half + f];
        }
      } else {
        smem_cos_sin_lane<N, kSplit>(cs_smem, p.half, lane, cc, ss);
      }
    }
  };
  // In 4-element lanes the cos/sin are read first, so that with a QK-norm
  // their shared-memory reads go out with the head's sums, which head_sum
  // issues at once (0.04-0.11 us less at T <= 32). Wide lanes keep the order
  // and the sum of before: the cos/sin first took them from 48 to 64
  // registers (1.5 us more at T = 512), and head_sum there re-read blockDim.x
  // at each test (0.07 us more; docs/performance.md, *The small kernel's
  // reads*).
  if constexpr (!kWide) smem_cs();
  float r = 1.0f;
  if constexpr (kNorm) {
    // (D = 2 * half is a power of two here: the launcher's rule.)
    if (w != nullptr) {
      const float* hs = sq_smem + threadIdx.y * blockDim.x;
      const int L = blockDim.x;
      const float head_sq = kWide ? (L == 32 ? warp_sq : head_sum_serial(hs, L))
                                  : (L == 64 ? hs[0] + hs[32] : head_sum(hs, L));
      r = norm_scale(head_sq, 2 * p.half, norm_eps, true);
    }
  }
  if constexpr (kWide) smem_cs();
  if (!active) return;
  if constexpr (kNorm)
    rotate_normed<T, N, kInterleaved, WW>(a, b, cc, ss, r, wa, wb, wdt);
  else if constexpr (kInterleaved)
    rotate_interleaved<T, N>(a, b, cc, ss);
  else
    rotate<T, N>(a, b, cc, ss);
  T* dst = at<T>(is_q ? p.q_rot : p.k_rot, t, h) + lane * kRun;
  store_lane<T, N, kSplit>(dst, quarter, a);
  store_lane<T, N, kSplit>(dst + p.half, quarter, b);
  if (is_q || slot < 0 || slot >= p.pool_size) return;
  if constexpr (kPools != kPoolsSame) {
    // (Unrolled: the four stores as one copy in a loop made a call with fp8
    // pools 0.6 us slower at T = 1; docs/performance.md, *Options*.)
    const Options& o = p.o;
    const int e = lane * kRun;
    store_pool_lane<T, N, kPools, kSplit>(p.k_pool, o, slot, h, e, quarter, a, o.k_scale, o.k_mul);
    store_pool_lane<T, N, kPools, kSplit>(p.k_pool, o, slot, h, p.half + e, quarter, b,
                                          o.k_scale, o.k_mul);
    store_pool_lane<T, N, kPools, kSplit>(p.v_pool, o, slot, h, e, quarter, va, o.v_scale,
                                          o.v_mul);
    store_pool_lane<T, N, kPools, kSplit>(p.v_pool, o, slot, h, p.half + e, quarter, vb,
                                          o.v_scale, o.v_mul);
  } else {
    T* kz = at<T>(p.k_pool, slot, h) + lane * N;
    store_vec<T, N, true>(kz, a);
    store_vec<T, N, true>(kz + p.half, b);
    T* vz = at<T>(p.v_pool, slot, h) + lane * N;
    store_vec<T, N, true>(vz, va);
    store_vec<T, N, true>(vz + p.half, vb);
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace ropekv
