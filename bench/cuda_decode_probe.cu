// What a decode-sized call of the CUDA kernel spends its time on: variants
// of the plain kernel that each drop or replace one part of its critical
// path, timed as an engine runs them (50 calls captured in one CUDA graph,
// launched with programmatic dependent launch, time per call), with the L2
// warm (the same buffers every call) and cold (50 different buffer sets,
// L2 flushed before each replay).
//
//   library   rope_pool_kernel itself (the header's template)
//   options   rope_pool_options_kernel with no option set (what a decode
//             call of it costs before its options); "/table" with a
//             cos_sin_cache (f32)
//   fp64-sc   the same work in a shorter kernel (no wide-head loop, no
//             bad-slot report, no yarn factor)
//   warp-sc   each warp makes all cos/sin of the token into its own shared
//             memory slice (no block barrier: a warp goes on when its own
//             data is in)
//   shfl-sc   each lane makes two cos/sin (head_dim 128) and the warp hands
//             them out with shuffles (no shared memory)
//   fast-sc   the same with __sincosf (inaccurate; timing only)
//   lane-sc   no shared memory or barrier: each lane computes its own chunk's
//             N cos/sin with sincos_fp32
//   table     no sincos at all: each lane reads its chunk's cos/sin from a
//             [positions, R] f32 table row (a cos_sin_cache)
//   table+bar the same with a block barrier before the rotation
//   fast-lane each lane its own chunk's N cos/sin with __sincosf (inaccurate;
//             timing only): no shared memory, no barrier
//   copy      loads and stores only (no cos/sin, no rotation); "+bar" with a
//             block barrier before the stores
//   empty     an empty kernel (the launch floor)
// each as one block per token (the library's plan) and, with "/split", one
// block per team (6 blocks per token); "/inplace": q_rot and k_rot are q and
// k (the call with inplace=True, and what SGLang's kernel does); "/pin":
// every address of the first loads (and the parameters of the outputs) made
// before griddepcontrol.wait, which is made to wait for them, so that after
// it only the loads remain.
//   library/table  the library's plain kernel built for a cos_sin_cache (f32)
//   onestep/bN     the options kernel's one-step build with no option set (what
//                  small plain calls run) as N = 1, 3, 6 or 12 blocks per token;
//                  "onestep/table/bN" with a cos_sin_cache; "table-u1/bN" the
//                  plain kernel's table build at one step per team
// (`decode-probe onestep`: the library rows and the onestep rows only.)
// `decode-probe headpar` (T = 1, 8, 32, 128): the onestep rows next to
//   small, small/table   the library's small kernel (rope_pool_small_kernel) in
//                        blocks of 8 heads (the library takes 16 at T = 17..64),
//                        int64 and ("/i32") int32 random indices
//   hp/v4/...            SGLang's shape: a block is 8 tokens of one head,
//                        16 lanes of 4 pairs (8-byte vectors), each lane its
//                        own cos/sin: /sc sincos_fp32, /table an f32 table
//                        row, /copy none (no rotation)
//   tokK/v4/...          a block is one token and 8 heads (K heads per lane):
//                        /block 64 threads make the cos/sin into shared
//                        memory, one barrier; /warp each warp makes all 64;
//                        /loop each lane its own in a rolled loop; /fast
//                        __sincosf (timing only); /table the table row
// `decode-probe normfloor` (T = 1, 8, 32, 128): what a QK-norm must cost at
// decode, whatever the kernel: the small kernel plain and with a QK-norm
// (bf16 weights; "-f32w" float32 weights, "-q" / "-k" weights for q or k
// only, "norm-build" the QK-norm build with no weights (r = 1), "-late"
// without early_params) next to kernels of its shape (a token's 8 heads per
// block, 16 lanes of 4 pairs) that do no RoPE at all:
//   floor/copy        loads and stores only (q_rot, k_rot, both pools)
//   floor/copy+bar    the same with a block barrier between them (the plain
//                     small kernel's barrier, for its cos/sin, waits for no
//                     data)
//   floor/norm        each head scaled by its r = rsqrt(mean(x^2) + eps):
//                     the lanes' sums of squares through shared memory at a
//                     block barrier, as the small kernel adds them
//   floor/norm-shfl   the same, the head's 16 sums by a butterfly of shuffles
//   floor/norm-w      floor/norm with the bf16 weights loaded and multiplied
//
// Llama-3.1-8B shape (32 q heads, 8 kv heads, head_dim 128), bf16, random
// slots in a 2^20-row pool, random positions below 2^17.
//
// Build and run (scripts/gpu-check.sh probe):
//   nvcc -O3 -std=c++17 -arch=sm_90 -Isrc bench/cuda_decode_probe.cu -o probe && ./probe
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include "cuda/rope_pool_kernel.cuh"

using namespace ropekv::cuda::detail;
using T = __nv_bfloat16;
constexpr int kN = 8, kU = 2;

#define CK(x)                                                                     \
  do {                                                                            \
    cudaError_t e_ = (x);                                                         \
    if (e_ != cudaSuccess) {                                                      \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,             \
                   cudaGetErrorString(e_));                                       \
      std::exit(2);                                                               \
    }                                                                             \
  } while (0)

enum Mode {
  kFastSc = 1, kLaneSc = 2, kTable = 3, kCopy = 4, kF64Sc = 5, kWarpSc = 6, kShflSc = 7,
  kTableBar = 8, kCopyBar = 9, kFastLane = 10
};

__global__ void empty_kernel() { grid_dependency_sync(); }

// The plain kernel's work decomposition (teams of 32 lanes, HP heads per
// step, U steps) with the cos/sin made as `kMode` says.
// An empty asm that "changes" x: x must be computed before it, and cannot be
// recomputed after it.
#define PIN(x) asm volatile("" : "+l"(x))


template <int kMode, bool kPin = false>
__global__ void __launch_bounds__(256) probe_kernel(const __grid_constant__ Params p,
                                                    const float* table) {
  extern __shared__ float cs_smem[];
  if constexpr (!kPin) grid_dependency_sync();
  const int tid = threadIdx.x;
  const Place pl = place_of(p);
  const long long t = pl.t;
  const int HP = p.heads_par, batch = pl.batch, hp = pl.hp, c = pl.c0;
  const bool active = hp < HP && batch < p.num_batches;
  const int first_vh = batch * kU * HP;
  long long slot, position;
  Vec<T, kN> a[kU], b[kU];
  if constexpr (kPin) {
    // "/pin": every address the call needs, and so every kernel parameter it
    // reads, is made before griddepcontrol.wait (overlapping the previous
    // kernel); after it only the loads remain.
    const T* src[kU];
    const int Hq = p.num_qo_heads, Hk = p.num_kv_heads;
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      int h;
      const int vh = first_vh + u * HP + hp;
      const int kind = kind_of(vh < Hq + 2 * Hk ? vh : 0, Hq, Hk, &h);
      const Tensor3& x = kind == 0 ? p.q : (kind == 1 ? p.k : p.v);
      src[u] = at<T>(x, t, h) + c * kN;
      PIN(src[u]);
    }
    const long long* pos_at = static_cast<const long long*>(p.positions) + t * p.pos_stride;
    const long long* slot_at = static_cast<const long long*>(p.slots) + t * p.slot_stride;
    PIN(pos_at);
    PIN(slot_at);
    // Touch the output tensors' parameters too.
    void* outs[4] = {p.q_rot.data, p.k_rot.data, p.k_pool.data, p.v_pool.data};
    long long ostr[3] = {p.q_rot.s0, p.k_pool.s0, p.v_pool.s0};
#pragma unroll
    for (int i = 0; i < 4; ++i) PIN(outs[i]);
#pragma unroll
    for (int i = 0; i < 3; ++i) PIN(ostr[i]);
    unsigned long long acc = reinterpret_cast<unsigned long long>(pos_at) ^
                             reinterpret_cast<unsigned long long>(slot_at);
#pragma unroll
    for (int u = 0; u < kU; ++u) acc ^= reinterpret_cast<unsigned long long>(src[u]);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc ^= reinterpret_cast<unsigned long long>(outs[i]);
#pragma unroll
    for (int i = 0; i < 3; ++i) acc ^= static_cast<unsigned long long>(ostr[i]);
    grid_dependency_sync(acc);
    if (active) {
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        if (first_vh + u * HP + hp < Hq + 2 * Hk) {
          a[u] = load_vec<T, kN, true>(src[u]);
          b[u] = load_vec<T, kN, true>(src[u] + p.half);
        }
      }
    }
    position = __ldg(pos_at);
    slot = __ldg(slot_at);
    // Keep the touched values alive to here (no code).
#pragma unroll
    for (int i = 0; i < 4; ++i) PIN(outs[i]);
#pragma unroll
    for (int i = 0; i < 3; ++i) PIN(ostr[i]);
  } else {
    slot = load_index_at(index_at(p.slots, p.slot_stride, p.slot64, t), p.slot64);
    position = load_index_at(index_at(p.positions, p.pos_stride, p.pos64, t), p.pos64);
    if (active)
      load_batch<T, kN, true, kU>(
          p, batch_src<T, true, kU>(p, t, first_vh, hp, p.num_qo_heads + 2 * p.num_kv_heads), c,
          a, b);
  }
  const float pos = static_cast<float>(position);
  float cc[kN], ss[kN];
  if constexpr (kMode == kFastSc || kMode == kF64Sc || kMode == kWarpSc) {
    // Shared by the block through one barrier, or (warp-sc) made by each warp
    // into its own slice.
    constexpr bool kWarp = kMode == kWarpSc;
    float* cs = kWarp ? cs_smem + (tid >> 5) * 2 * p.half : cs_smem;
    for (int i = kWarp ? (tid & 31) : tid; i < p.half; i += kWarp ? 32 : blockDim.x) {
      float s, co;
      if constexpr (kMode == kFastSc)
        __sincosf(__fmul_rn(pos, __ldg(p.inv_freq + i)), &s, &co);
      else
        ropekv::sincos_fp32(__fmul_rn(pos, __ldg(p.inv_freq + i)), &s, &co);
      cs[i] = co;
      cs[p.half + i] = s;
    }
    if constexpr (kWarp)
      __syncwarp();
    else
      __syncthreads();
    for (int e = 0; e < kN; ++e) {
      cc[e] = cs[c * kN + e];
      ss[e] = cs[p.half + c * kN + e];
    }
  } else if constexpr (kMode == kShflSc) {
    // half = 64: lane l makes frequencies l and l + 32; shuffles hand them out.
    const int l = tid & 31;
    float s0, c0, s1, c1;
    ropekv::sincos_fp32(__fmul_rn(pos, __ldg(p.inv_freq + l)), &s0, &c0);
    ropekv::sincos_fp32(__fmul_rn(pos, __ldg(p.inv_freq + 32 + l)), &s1, &c1);
#pragma unroll
    for (int e = 0; e < kN; ++e) {
      const int f = c * kN + e;  // < 64
      const float a0 = __shfl_sync(~0u, c0, f & 31), a1 = __shfl_sync(~0u, c1, f & 31);
      const float b0 = __shfl_sync(~0u, s0, f & 31), b1 = __shfl_sync(~0u, s1, f & 31);
      cc[e] = f < 32 ? a0 : a1;
      ss[e] = f < 32 ? b0 : b1;
    }
  } else if constexpr (kMode == kLaneSc) {
#pragma unroll
    for (int e = 0; e < kN; ++e)
      ropekv::sincos_fp32(__fmul_rn(pos, __ldg(p.inv_freq + c * kN + e)), &ss[e], &cc[e]);
  } else if constexpr (kMode == kFastLane) {
#pragma unroll
    for (int e = 0; e < kN; ++e)
      __sincosf(__fmul_rn(pos, __ldg(p.inv_freq + c * kN + e)), &ss[e], &cc[e]);
  } else if constexpr (kMode == kTable || kMode == kTableBar) {
    const float* row = table + position * p.rotary_dim;
    const float4* r4 = reinterpret_cast<const float4*>(row + c * kN);
    const float4* s4 = reinterpret_cast<const float4*>(row + p.half + c * kN);
    const float4 c0 = __ldg(r4), c1 = __ldg(r4 + 1), s0 = __ldg(s4), s1 = __ldg(s4 + 1);
    cc[0] = c0.x; cc[1] = c0.y; cc[2] = c0.z; cc[3] = c0.w;
    cc[4] = c1.x; cc[5] = c1.y; cc[6] = c1.z; cc[7] = c1.w;
    ss[0] = s0.x; ss[1] = s0.y; ss[2] = s0.z; ss[3] = s0.w;
    ss[4] = s1.x; ss[5] = s1.y; ss[6] = s1.z; ss[7] = s1.w;
  }
  if constexpr (kMode == kTableBar || kMode == kCopyBar) __syncthreads();
  if (!active) return;
  const long long row = slot >= 0 && slot < p.pool_size ? slot : -1;
  const int Hq = p.num_qo_heads, Hk = p.num_kv_heads;
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int vh = first_vh + u * HP + hp;
    if (vh >= Hq + 2 * Hk) continue;
    int h;
    const int kind = kind_of(vh, Hq, Hk, &h);
    if constexpr (kMode != kCopy && kMode != kCopyBar) {
      if (kind != 2) rotate<T, kN>(a[u], b[u], cc, ss);
    }
    const Tensor3& y = kind == 0 ? p.q_rot : (kind == 1 ? p.k_rot : p.v_pool);
    if (kind == 2 && row < 0) continue;
    T* dst = at<T>(y, kind == 2 ? row : t, h);
    store_vec<T, kN, true>(dst + c * kN, a[u]);
    store_vec<T, kN, true>(dst + p.half + c * kN, b[u]);
    if (kind == 1 && row >= 0) {
      T* z = at<T>(p.k_pool, row, h);
      store_vec<T, kN, true>(z + c * kN, a[u]);
      store_vec<T, kN, true>(z + p.half + c * kN, b[u]);
    }
  }
}

// "headpar" mode: the shape SGLang's fused kernel takes for small calls.
// Grid (T / kTpb, Hq + Hk): a block is one head (a q head, or a kv head with
// its v) of kTpb tokens; kL = half / kV lanes per head, each lane kV pairs
// (two vectors of kV elements, at i and i + half). No shared memory, no
// barrier: each lane makes its own kV cos/sin (kHpSc: sincos_fp32; kHpTable:
// an f32 [rows, D] table row; kHpCopy: none, no rotation).
// "tok" form (kHpt > 0): a block is one token and 128 / kL heads at a time,
// each lane handling kHpt heads with the cos/sin it made once (the heads
// share them in registers); grid (T, ceil((Hq + Hk) / (128 / kL * kHpt))).
// kHpFast: __sincosf (inaccurate, timing only); kHpLoop: sincos_fp32 in a
// rolled loop through the lane's own shared-memory slots (less code, no
// barrier); kHpBlock (tok form): threads 0..63 make one cos/sin each into
// shared memory, then a block barrier; kHpWarp (tok form): each warp makes
// all 64 (two per lane, rolled) into its own slice, then __syncwarp.
enum HpMode { kHpSc = 0, kHpTable = 1, kHpCopy = 2, kHpFast = 3, kHpLoop = 4, kHpBlock = 5,
              kHpWarp = 6 };
template <int kV, int kMode, int kHpt>
__global__ void __launch_bounds__(128) headpar_kernel(const __grid_constant__ Params p,
                                                      const float* table, int num_tokens) {
  constexpr int kL = 64 / kV, kRows = 128 / kL;  // (half = 64)
  const int tx = threadIdx.x % kL, ty = threadIdx.x / kL;
  const int Hq = p.num_qo_heads, Hqk = Hq + p.num_kv_heads;
  constexpr int kH = kHpt > 0 ? kHpt : 1;
  long long t;
  int hh0, hstep;
  if constexpr (kHpt > 0) {
    t = blockIdx.x;
    hh0 = blockIdx.y * kRows * kHpt + ty;
    hstep = kRows;
  } else {
    t = static_cast<long long>(blockIdx.x) * kRows + ty;
    hh0 = blockIdx.y;
    hstep = 0;
  }
  const bool active = t < num_tokens;
  const T* src[kH];
  unsigned long long acc = param_lines(p);
#pragma unroll
  for (int j = 0; j < kH; ++j) {
    const int hh = min(hh0 + j * hstep, Hqk - 1);
    src[j] = (hh < Hq ? at<T>(p.q, t, hh) : at<T>(p.k, t, hh - Hq)) + tx * kV;
    acc ^= reinterpret_cast<unsigned long long>(src[j]);
  }
  const long long* pos_at = static_cast<const long long*>(p.positions) + t;
  const long long* slot_at = static_cast<const long long*>(p.slots) + t;
  grid_dependency_sync(acc ^ reinterpret_cast<unsigned long long>(pos_at));
  if (!active) return;
  Vec<T, kV> a[kH], b[kH], va[kH], vb[kH];
  bool has_v = false;
#pragma unroll
  for (int j = 0; j < kH; ++j) {
    const int hh = hh0 + j * hstep;
    if (hh >= Hqk) continue;
    a[j] = load_vec<T, kV, true>(src[j]);
    b[j] = load_vec<T, kV, true>(src[j] + p.half);
    if (hh >= Hq) {
      const T* vs = at<T>(p.v, t, hh - Hq) + tx * kV;
      va[j] = load_vec<T, kV, true>(vs);
      vb[j] = load_vec<T, kV, true>(vs + p.half);
      has_v = true;
    }
  }
  const long long position = __ldg(pos_at);
  const long long slot = has_v ? __ldg(slot_at) : -1;
  float cc[kV], ss[kV];
  if constexpr (kMode == kHpSc) {
    const float pos = static_cast<float>(position);
#pragma unroll
    for (int e = 0; e < kV; ++e)
      ropekv::sincos_fp32(__fmul_rn(pos, __ldg(p.inv_freq + tx * kV + e)), &ss[e], &cc[e]);
  } else if constexpr (kMode == kHpFast) {
    const float pos = static_cast<float>(position);
#pragma unroll
    for (int e = 0; e < kV; ++e)
      __sincosf(__fmul_rn(pos, __ldg(p.inv_freq + tx * kV + e)), &ss[e], &cc[e]);
  } else if constexpr (kMode == kHpLoop || kMode == kHpBlock || kMode == kHpWarp) {
    __shared__ float sm[128 * 2 * kV];
    const float pos = static_cast<float>(position);
    float* mine;
    if constexpr (kMode == kHpLoop) {
      mine = sm + threadIdx.x * 2 * kV;
#pragma unroll 1
      for (int e = 0; e < kV; ++e)
        ropekv::sincos_fp32(__fmul_rn(pos, __ldg(p.inv_freq + tx * kV + e)), &mine[kV + e],
                            &mine[e]);
    } else if constexpr (kMode == kHpBlock) {
      if (threadIdx.x < 64)
        ropekv::sincos_fp32(__fmul_rn(pos, __ldg(p.inv_freq + threadIdx.x)), &sm[64 + threadIdx.x],
                            &sm[threadIdx.x]);
      __syncthreads();
    } else {
      float* w = sm + (threadIdx.x >> 5) * 128;
#pragma unroll 1
      for (int i = threadIdx.x & 31; i < 64; i += 32)
        ropekv::sincos_fp32(__fmul_rn(pos, __ldg(p.inv_freq + i)), &w[64 + i], &w[i]);
      __syncwarp();
    }
#pragma unroll
    for (int e = 0; e < kV; ++e) {
      if constexpr (kMode == kHpLoop) {
        cc[e] = mine[e];
        ss[e] = mine[kV + e];
      } else {
        const float* w = kMode == kHpBlock ? sm : sm + (threadIdx.x >> 5) * 128;
        cc[e] = w[tx * kV + e];
        ss[e] = w[64 + tx * kV + e];
      }
    }
  } else if constexpr (kMode == kHpTable) {
    const float* row = table + position * p.rotary_dim + tx * kV;
#pragma unroll
    for (int e = 0; e < kV; e += 4) {
      const float4 c4 = __ldg(reinterpret_cast<const float4*>(row + e));
      const float4 s4 = __ldg(reinterpret_cast<const float4*>(row + p.half + e));
      cc[e] = c4.x; cc[e + 1] = c4.y; cc[e + 2] = c4.z; cc[e + 3] = c4.w;
      ss[e] = s4.x; ss[e + 1] = s4.y; ss[e + 2] = s4.z; ss[e + 3] = s4.w;
    }
  }
  const long long row = slot >= 0 && slot < p.pool_size ? slot : -1;
#pragma unroll
  for (int j = 0; j < kH; ++j) {
    const int hh = hh0 + j * hstep;
    if (hh >= Hqk) continue;
    if constexpr (kMode != kHpCopy) rotate<T, kV>(a[j], b[j], cc, ss);
    const bool isq = hh < Hq;
    const int h = isq ? hh : hh - Hq;
    T* dst = at<T>(isq ? p.q_rot : p.k_rot, t, h) + tx * kV;
    store_vec<T, kV, true>(dst, a[j]);
    store_vec<T, kV, true>(dst + p.half, b[j]);
    if (!isq && row >= 0) {
      T* z = at<T>(p.k_pool, row, h) + tx * kV;
      store_vec<T, kV, true>(z, a[j]);
      store_vec<T, kV, true>(z + p.half, b[j]);
      T* w = at<T>(p.v_pool, row, h) + tx * kV;
      store_vec<T, kV, true>(w, va[j]);
      store_vec<T, kV, true>(w + p.half, vb[j]);
    }
  }
}

// "normfloor" mode: grid (T, ceil((Hq + Hk) / 8)), block (16, 8): each
// (lane, head) row a lane of 4 pairs of one head, as the small kernel.
enum FloorMode { kFloorCopy = 0, kFloorCopyBar = 1, kFloorNorm = 2, kFloorShfl = 3,
                 kFloorNormW = 4 };
template <int kMode>
__global__ void __launch_bounds__(128) floor_kernel(const __grid_constant__ Params p,
                                                    const T* weight) {
  constexpr int N = 4;
  __shared__ float sums[128];
  const int lane = threadIdx.x, tid = threadIdx.y * blockDim.x + lane;
  const long long t = blockIdx.x;
  const int Hq = p.num_qo_heads, hh = blockIdx.y * blockDim.y + threadIdx.y;
  const bool active = hh < Hq + p.num_kv_heads, is_q = hh < Hq;
  const int h = is_q ? hh : hh - Hq;
  const T* src = at<T>(is_q ? p.q : p.k, t, h) + lane * N;
  const T* vsrc = at<T>(p.v, t, is_q ? 0 : h) + lane * N;
  grid_dependency_sync(param_lines(p) ^ reinterpret_cast<unsigned long long>(src));
  Vec<T, N> a, b, va, vb, wa, wb;
  if (active) {
    a = load_vec<T, N, true>(src);
    b = load_vec<T, N, true>(src + p.half);
    if (!is_q) {
      va = load_vec<T, N, true>(vsrc);
      vb = load_vec<T, N, true>(vsrc + p.half);
    }
    if constexpr (kMode == kFloorNormW) {
      wa = load_vec<T, N, true>(weight + lane * N);
      wb = load_vec<T, N, true>(weight + p.half + lane * N);
    }
  }
  const long long slot = load_index_at(index_at(p.slots, p.slot_stride, p.slot64, t), p.slot64);
  if constexpr (kMode == kFloorCopyBar) __syncthreads();
  if constexpr (kMode == kFloorNorm || kMode == kFloorShfl || kMode == kFloorNormW) {
    float ss = active ? sum_squares<T, N>(a, b, true) : 0.0f, total;
    if constexpr (kMode == kFloorShfl) {
#pragma unroll
      for (int m = 8; m >= 1; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m, 16);
      total = ss;
    } else {
      sums[tid] = ss;
      __syncthreads();
      total = head_sum(sums + threadIdx.y * blockDim.x, blockDim.x);
    }
    const float r = norm_scale(total, 2 * p.half, 1e-6f, true);
    float xa[N], xb[N];
    to_floats<T, N>(a, xa);
    to_floats<T, N>(b, xb);
    if constexpr (kMode == kFloorNormW) {
      float fa[N], fb[N];
      to_floats<T, N>(wa, fa);
      to_floats<T, N>(wb, fb);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        xa[j] = __fmul_rn(__fmul_rn(xa[j], r), fa[j]);
        xb[j] = __fmul_rn(__fmul_rn(xb[j], r), fb[j]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < N; ++j) {
        xa[j] = __fmul_rn(xa[j], r);
        xb[j] = __fmul_rn(xb[j], r);
      }
    }
    a = from_floats<T, N>(xa);
    b = from_floats<T, N>(xb);
  }
  if (!active) return;
  T* dst = at<T>(is_q ? p.q_rot : p.k_rot, t, h) + lane * N;
  store_vec<T, N, true>(dst, a);
  store_vec<T, N, true>(dst + p.half, b);
  if (is_q || slot < 0 || slot >= p.pool_size) return;
  T* kz = at<T>(p.k_pool, slot, h) + lane * N;
  store_vec<T, N, true>(kz, a);
  store_vec<T, N, true>(kz + p.half, b);
  T* vz = at<T>(p.v_pool, slot, h) + lane * N;
  store_vec<T, N, true>(vz, va);
  store_vec<T, N, true>(vz + p.half, vb);
}

int main(int argc, char** argv) {
  // "onestep": the library rows and the one-step sweep only.
  const bool only_onestep = argc > 1 && std::strcmp(argv[1], "onestep") == 0;
  // "headpar": the one-step rows next to the head-parallel shapes, T up to 128.
  const bool headpar = argc > 1 && std::strcmp(argv[1], "headpar") == 0;
  // "normfloor": the small kernel with and without a QK-norm next to the
  // floor kernels, T up to 128.
  const bool normfloor = argc > 1 && std::strcmp(argv[1], "normfloor") == 0;
  constexpr int Hq = 32, Hk = 8, D = 128, half = D / 2;
  const long long P = 1 << 20, kRows = 1 << 17;
  const int kCalls = 50;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::mt19937 rng(7);

  // Shared state: pools, inv_freq, error record, cos/sin table.
  T *k_pool, *v_pool;
  CK(cudaMalloc(&k_pool, P * Hk * D * sizeof(T)));
  CK(cudaMalloc(&v_pool, P * Hk * D * sizeof(T)));
  std::vector<float> inv(half);
  for (int i = 0; i < half; ++i) inv[i] = static_cast<float>(std::pow(5e5, -2.0 * i / D));
  float* inv_d;
  CK(cudaMalloc(&inv_d, half * sizeof(float)));
  CK(cudaMemcpy(inv_d, inv.data(), half * sizeof(float), cudaMemcpyHostToDevice));
  ErrorRecord* err;
  CK(cudaMalloc(&err, sizeof(ErrorRecord)));
  CK(cudaMemset(err, 0, sizeof(ErrorRecord)));
  float* table;
  CK(cudaMalloc(&table, kRows * D * sizeof(float)));
  CK(cudaMemset(table, 0, kRows * D * sizeof(float)));
  // QK-norm weights (bf16, near 1) for the small kernel's QK-norm build and
  // floor/norm-w.
  T* weight;
  {
    std::vector<T> w(D);
    for (int i = 0; i < D; ++i) w[i] = __float2bfloat16(0.9f + 0.002f * i);
    CK(cudaMalloc(&weight, D * sizeof(T)));
    CK(cudaMemcpy(weight, w.data(), D * sizeof(T), cudaMemcpyHostToDevice));
  }
  float* weight_f32;
  {
    std::vector<float> w(D);
    for (int i = 0; i < D; ++i) w[i] = 0.9f + 0.002f * i;
    CK(cudaMalloc(&weight_f32, D * sizeof(float)));
    CK(cudaMemcpy(weight_f32, w.data(), D * sizeof(float), cudaMemcpyHostToDevice));
  }
  char* flush;
  const size_t kFlush = 256u << 20;
  CK(cudaMalloc(&flush, kFlush));

  std::printf("decode probe: Llama-3.1-8B bf16, us per call (50 calls per CUDA graph, PDL)\n");
  std::printf("%-16s %5s %9s %9s\n", "variant", "T", "warm", "cold");
  for (int T_ : {1, 8, 32, 128}) {
    if (T_ == 128 && !headpar && !normfloor) break;
    // kCalls buffer sets of q, k, v, q_rot, k_rot, positions, slots.
    std::vector<Params> sets(kCalls);
    std::vector<void*> allocs;
    std::uniform_int_distribution<long long> slot_d(0, P - 1), pos_d(0, kRows - 1);
    // Positions and slots of one set: int64 or int32, random or the latency
    // step's (1000 + t, (7919 t + 13) mod P).
    auto set_indices = [&](Params* p, bool is64, bool random) {
      const size_t es = is64 ? 8 : 4;
      std::vector<char> pos(T_ * es), slot(T_ * es);
      for (int t = 0; t < T_; ++t) {
        const long long ps = random ? pos_d(rng) : 1000 + t;
        const long long sl = random ? slot_d(rng) : (7919LL * t + 13) % P;
        const int ps32 = static_cast<int>(ps), sl32 = static_cast<int>(sl);
        std::memcpy(&pos[t * es], is64 ? static_cast<const void*>(&ps) : &ps32, es);
        std::memcpy(&slot[t * es], is64 ? static_cast<const void*>(&sl) : &sl32, es);
      }
      void *pd, *sd;
      CK(cudaMalloc(&pd, T_ * es));
      CK(cudaMalloc(&sd, T_ * es));
      CK(cudaMemcpy(pd, pos.data(), T_ * es, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(sd, slot.data(), T_ * es, cudaMemcpyHostToDevice));
      allocs.push_back(pd);
      allocs.push_back(sd);
      p->positions = pd;
      p->slots = sd;
      p->pos64 = p->slot64 = is64 ? 1 : 0;
    };
    for (int i = 0; i < kCalls; ++i) {
      Params& p = sets[i];
      p = Params{};
      auto tens = [&](int H) {
        void* d;
        CK(cudaMalloc(&d, size_t(T_) * H * D * sizeof(T)));
        CK(cudaMemset(d, 0x3c, size_t(T_) * H * D * sizeof(T)));
        allocs.push_back(d);
        return Tensor3{d, (long long)H * D, D, 1};
      };
      p.q = tens(Hq);
      p.k = tens(Hk);
      p.v = tens(Hk);
      p.q_rot = tens(Hq);
      p.k_rot = tens(Hk);
      p.k_pool = Tensor3{k_pool, (long long)Hk * D, D, 1};
      p.v_pool = Tensor3{v_pool, (long long)Hk * D, D, 1};
      set_indices(&p, true, true);
      p.pos_stride = p.slot_stride = 1;
      p.inv_freq = inv_d;
      p.err = err;
      p.pool_size = P;
      p.num_qo_heads = Hq;
      p.num_kv_heads = Hk;
      p.half = half;
      p.rotary_dim = D;
      p.pair_items = half / kN;
      p.items = half / kN;
      p.heads_par = 32 / p.items;
      p.team_lanes = 32;
      p.num_batches = (Hq + 2 * Hk) / (p.heads_par * kU);
      p.attention_factor = 1.0f;
      p.early_params = 1;  // as the library sets it for T up to the SM count
    }
    // The same sets with int32 indices, positions 1000 + t and slots
    // (7919 t + 13) mod P (the inputs of the library's own latency step), and
    // each of the two differences alone.
    // In place: q_rot and k_rot are q and k (what SGLang's kernel does).
    std::vector<Params> sets_inplace = sets;
    for (Params& p : sets_inplace) {
      p.q_rot = p.q;
      p.k_rot = p.k;
    }
    std::vector<Params> sets32 = sets, sets64fixed = sets, sets32rand = sets;
    for (int i = 0; i < kCalls; ++i) {
      set_indices(&sets32[i], false, false);
      set_indices(&sets64fixed[i], true, false);
      set_indices(&sets32rand[i], false, true);
    }
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    // One call of `kernel` per set (or the same set), 50 in a graph.
    auto measure = [&](auto launch, int teams_per_block, bool cold,
                       const std::vector<Params>& which) {
      cudaGraph_t g;
      cudaGraphExec_t ge;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
      for (int i = 0; i < kCalls; ++i) {
        Params p = which[cold ? i : 0];
        p.teams_per_block = teams_per_block;
        p.blocks_per_token = (p.num_batches + teams_per_block - 1) / teams_per_block;
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute attr[1];
        cfg.gridDim = dim3(static_cast<unsigned>(T_ * p.blocks_per_token));
        cfg.blockDim = dim3(static_cast<unsigned>(teams_per_block * 32));
        cfg.dynamicSmemBytes = teams_per_block * D * sizeof(float);  // warp-sc: a slice each
        cfg.stream = s;
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        launch(&cfg, p);
      }
      CK(cudaStreamEndCapture(s, &g));
      CK(cudaGraphInstantiate(&ge, g, 0));
      std::vector<float> ms;
      for (int r = 0; r < 21; ++r) {
        if (cold) CK(cudaMemsetAsync(flush, r, kFlush, s));
        CK(cudaEventRecord(e0, s));
        CK(cudaGraphLaunch(ge, s));
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float m;
        CK(cudaEventElapsedTime(&m, e0, e1));
        if (r > 0) ms.push_back(m);
      }
      CK(cudaGraphExecDestroy(ge));
      CK(cudaGraphDestroy(g));
      std::sort(ms.begin(), ms.end());
      return ms[ms.size() / 2] * 1e3 / kCalls;
    };
    auto row = [&](const char* name, auto launch, const std::vector<Params>& which) {
      for (int tpb : {6, 1}) {
        char label[64];
        std::snprintf(label, sizeof label, "%s%s", name, tpb == 6 ? "" : "/split");
        std::printf("%-16s %5d %9.2f %9.2f\n", label, T_,
                    measure(launch, tpb, false, which), measure(launch, tpb, true, which));
      }
    };
    auto library = [](cudaLaunchConfig_t* cfg, const Params& p) {
      CK(cudaLaunchKernelEx(cfg, rope_pool_kernel<T, kN, true, kU>, p));
    };
    if (normfloor) {
      auto frow = [&](const char* name, auto launch) {
        std::printf("%-16s %5d %9.2f %9.2f\n", name, T_, measure(launch, 1, false, sets),
                    measure(launch, 1, true, sets));
      };
      // The small kernel as the library launches it for this shape: blocks
      // of 8 heads of 16 lanes; with a QK-norm its OptParams build (pools of
      // q's dtype), weights of bf16 for q and k.
      // weights: 2 bf16 (both), 0 f32 (both), -1 none (the QK-norm build with
      // r = 1), 3 q's only, 4 k's only; early: Params::early_params.
      auto small = [w = weight, wf = weight_f32, T_](bool norm, int weights = 2, int early = 1) {
        return [=](cudaLaunchConfig_t* cfg, const Params& p0) {
          cfg->blockDim = dim3(16, 8);
          cfg->gridDim = dim3(static_cast<unsigned>(T_),
                              static_cast<unsigned>((p0.num_qo_heads + p0.num_kv_heads + 7) / 8));
          cfg->dynamicSmemBytes = (D + (norm ? 128 : 0)) * sizeof(float);
          if (!norm) {
            CK(cudaLaunchKernelEx(cfg, rope_pool_small_kernel<T, false, false>, p0));
            return;
          }
          OptParams op{};
          static_cast<Params&>(op) = p0;
          op.early_params = early;
          if (weights >= 0) {
            op.o.q_norm = weights == 0 ? static_cast<const void*>(wf) : w;
            op.o.k_norm = weights == 3 ? nullptr : op.o.q_norm;
            if (weights == 4) op.o.q_norm = nullptr;
          }
          op.o.qn_stride = op.o.kn_stride = 1;
          op.o.qn_dtype = op.o.kn_dtype = weights == 0 ? 0 : 2;  // f32 or bf16
          op.o.pool_mode = kPoolSame;
          op.o.head_dim = D;
          op.o.steps = 1;
          op.o.norm_eps = 1e-6f;
          op.o.k_scale = op.o.v_scale = op.o.k_mul = op.o.v_mul = 1.0f;
          CK(cudaLaunchKernelEx(cfg, rope_pool_small_kernel<T, false, false, true, kPoolsSame>,
                                op));
        };
      };
      auto floor_launch = [w = weight, T_](auto kernel) {
        return [=](cudaLaunchConfig_t* cfg, const Params& p) {
          cfg->blockDim = dim3(16, 8);
          cfg->gridDim = dim3(static_cast<unsigned>(T_),
                              static_cast<unsigned>((p.num_qo_heads + p.num_kv_heads + 7) / 8));
          cfg->dynamicSmemBytes = 0;
          CK(cudaLaunchKernelEx(cfg, kernel, p, static_cast<const T*>(w)));
        };
      };
      // Twice in turn: the two passes show the run's own spread.
      for (int pass = 0; pass < 2; ++pass) {
        frow("small", small(false));
        frow("small/qk-norm", small(true));
        frow("small/qk-norm-f32w", small(true, 0));
        frow("small/qk-norm-q", small(true, 3));
        frow("small/qk-norm-k", small(true, 4));
        frow("small/norm-build", small(true, -1));
        frow("small/qk-norm-late", small(true, 2, 0));
        frow("floor/copy", floor_launch(floor_kernel<kFloorCopy>));
        frow("floor/copy+bar", floor_launch(floor_kernel<kFloorCopyBar>));
        frow("floor/norm", floor_launch(floor_kernel<kFloorNorm>));
        frow("floor/norm-shfl", floor_launch(floor_kernel<kFloorShfl>));
        frow("floor/norm-w", floor_launch(floor_kernel<kFloorNormW>));
      }
      CK(cudaStreamSynchronize(s));
      for (void* d : allocs) CK(cudaFree(d));
      continue;
    }
    row("library", library, sets);
    if (!only_onestep && !headpar) {
      row("library/i32", library, sets32);
      row("library/i64-fixed", library, sets64fixed);
      row("library/i32-random", library, sets32rand);
      row("library/inplace", library, sets_inplace);
    }
    // The plain kernel reading its cos/sin from a cos_sin_cache (f32), built
    // for kUk steps per team.
    const float* tab0 = table;
    auto library_table = [tab0](auto compiled) {
      return [tab0](cudaLaunchConfig_t* cfg, const Params& p0) {
        Params p = p0;
        p.cos_sin = tab0;
        p.cs_rows = kRows;
        p.cs_s0 = D;
        p.cs_s1 = 1;
        constexpr int kUk = decltype(compiled)::value;
        CK(cudaLaunchKernelEx(cfg, rope_pool_kernel<T, kN, true, kUk, true>, p));
      };
    };
    row("library/table", library_table(std::integral_constant<int, kU>{}), sets);
    // The options kernel as a decode call runs it (16-byte form, pools of q's
    // dtype, no QK-norm), built for kUk steps of which `steps` are taken:
    // cos/sin made, or read from a cos_sin_cache (an f32 table).
    auto options_kernel = [](auto compiled, int steps, const float* cos_sin, long long rows) {
      Options o{};
      o.pool_mode = kPoolSame;
      o.head_dim = D;
      o.steps = steps;
      o.k_scale = o.v_scale = o.k_mul = o.v_mul = 1.0f;
      return [o, cos_sin, rows](cudaLaunchConfig_t* cfg, const Params& p) {
        OptParams op{};
        static_cast<Params&>(op) = p;
        op.cos_sin = cos_sin;
        op.cs_rows = rows;
        op.cs_s0 = D;
        op.cs_s1 = 1;
        op.o = o;
        constexpr int kUk = decltype(compiled)::value;
        CK(cudaLaunchKernelEx(cfg, rope_pool_options_kernel<T, kN, true, kUk, kPoolsWide, false>,
                              op));
      };
    };
    // 2 of kOptSteps steps (the options kernel's larger build).
    auto options = [&](const float* cos_sin, long long rows) {
      return options_kernel(std::integral_constant<int, kOptSteps>{}, kU, cos_sin, rows);
    };
    // What ships for small plain calls (the options kernel's one-step build, no
    // option set) and the table kernel at one step, as 1, 3, 6 or 12 blocks
    // per token of 12, 4, 2 or 1 teams ("/bN": N blocks per token).
    std::vector<Params> sets1 = sets;
    for (Params& p : sets1) p.num_batches = (Hq + 2 * Hk) / p.heads_par;
    auto row1 = [&](const char* name, auto launch) {
      for (int tpb : {12, 4, 2, 1}) {
        char label[64];
        std::snprintf(label, sizeof label, "%s/b%d", name, 12 / tpb);
        std::printf("%-16s %5d %9.2f %9.2f\n", label, T_, measure(launch, tpb, false, sets1),
                    measure(launch, tpb, true, sets1));
      }
    };
    auto onestep = [&](const float* cos_sin, long long rows) {
      return options_kernel(std::integral_constant<int, 1>{}, 1, cos_sin, rows);
    };
    row1("onestep", onestep(nullptr, 0));
    if (headpar) {
      // kHpt = 0: SGLang's shape, grid (T / rows, Hq + Hk); else one token
      // per block, kHpt heads per lane.
      auto hp = [tab0 = table, T_](auto kernel, int lanes, int hpt) {
        return [=](cudaLaunchConfig_t* cfg, const Params& p) {
          const int rows = 128 / lanes, hqk = p.num_qo_heads + p.num_kv_heads;
          cfg->blockDim = dim3(128);
          cfg->dynamicSmemBytes = 0;
          const int per_block = rows * (hpt == 0 ? 1 : hpt);
          cfg->gridDim = hpt == 0 ? dim3(static_cast<unsigned>((T_ + rows - 1) / rows),
                                         static_cast<unsigned>(hqk))
                                  : dim3(static_cast<unsigned>(T_),
                                         static_cast<unsigned>((hqk + per_block - 1) / per_block));
          CK(cudaLaunchKernelEx(cfg, kernel, p, tab0, T_));
        };
      };
      auto hrow = [&](const char* name, auto launch, const std::vector<Params>& which) {
        std::printf("%-16s %5d %9.2f %9.2f\n", name, T_, measure(launch, 1, false, which),
                    measure(launch, 1, true, which));
      };
      // The library's small kernel (rope_pool_small_kernel), computing its
      // cos/sin or reading them from the table, int64 and int32 indices.
      auto small = [tab0 = table, T_](bool with_table) {
        return [=](cudaLaunchConfig_t* cfg, const Params& p0) {
          Params p = p0;
          cfg->blockDim = dim3(16, 8);
          cfg->gridDim = dim3(static_cast<unsigned>(T_),
                              static_cast<unsigned>((p.num_qo_heads + p.num_kv_heads + 7) / 8));
          cfg->dynamicSmemBytes = with_table ? 0 : D * sizeof(float);
          if (with_table) {
            p.cos_sin = tab0;
            p.cs_rows = kRows;
            p.cs_s0 = D;
            p.cs_s1 = 1;
            p.cs_dtype = 0;
          }
          CK(cudaLaunchKernelEx(cfg, with_table ? rope_pool_small_kernel<T, true, false>
                                                : rope_pool_small_kernel<T, false, false>, p));
        };
      };
      hrow("small", small(false), sets);
      hrow("small/i32", small(false), sets32rand);
      hrow("small/table", small(true), sets);
      hrow("small/table/i32", small(true), sets32rand);
      hrow("hp/v4/sc", hp(headpar_kernel<4, kHpSc, 0>, 16, 0), sets);
      hrow("hp/v4/fast", hp(headpar_kernel<4, kHpFast, 0>, 16, 0), sets);
      hrow("hp/v4/table", hp(headpar_kernel<4, kHpTable, 0>, 16, 0), sets);
      hrow("hp/v4/copy", hp(headpar_kernel<4, kHpCopy, 0>, 16, 0), sets);
      hrow("tok1/v4/block", hp(headpar_kernel<4, kHpBlock, 1>, 16, 1), sets);
      hrow("tok2/v4/block", hp(headpar_kernel<4, kHpBlock, 2>, 16, 2), sets);
      hrow("tok1/v4/warp", hp(headpar_kernel<4, kHpWarp, 1>, 16, 1), sets);
      hrow("tok1/v4/loop", hp(headpar_kernel<4, kHpLoop, 1>, 16, 1), sets);
      hrow("tok1/v4/fast", hp(headpar_kernel<4, kHpFast, 1>, 16, 1), sets);
      hrow("tok1/v4/table", hp(headpar_kernel<4, kHpTable, 1>, 16, 1), sets);
      CK(cudaStreamSynchronize(s));
      for (void* d : allocs) CK(cudaFree(d));
      continue;
    }
    row1("onestep/table", onestep(table, kRows));
    row1("table-u1", library_table(std::integral_constant<int, 1>{}));
    if (only_onestep) {
      CK(cudaStreamSynchronize(s));
      for (void* d : allocs) CK(cudaFree(d));
      continue;
    }
    row("options", options(nullptr, 0), sets);
    row("options/table", options(table, kRows), sets);
    const float* tab = table;
    auto probe = [tab](auto kernel) {
      return [tab, kernel](cudaLaunchConfig_t* cfg, const Params& p) {
        CK(cudaLaunchKernelEx(cfg, kernel, p, tab));
      };
    };
    row("fp64-sc", probe(probe_kernel<kF64Sc>), sets);
    row("fp64-sc/pin", probe(probe_kernel<kF64Sc, true>), sets);
    row("fp64-sc", probe(probe_kernel<kF64Sc>), sets);
    row("fp64-sc/pin", probe(probe_kernel<kF64Sc, true>), sets);
    row("copy/pin", probe(probe_kernel<kCopy, true>), sets);
    row("table/pin", probe(probe_kernel<kTable, true>), sets);
    row("warp-sc", probe(probe_kernel<kWarpSc>), sets);
    row("shfl-sc", probe(probe_kernel<kShflSc>), sets);
    row("fast-sc", probe(probe_kernel<kFastSc>), sets);
    row("lane-sc", probe(probe_kernel<kLaneSc>), sets);
    row("table", probe(probe_kernel<kTable>), sets);
    row("table+bar", probe(probe_kernel<kTableBar>), sets);
    row("fast-lane", probe(probe_kernel<kFastLane>), sets);
    row("copy", probe(probe_kernel<kCopy>), sets);
    row("copy/inplace", probe(probe_kernel<kCopy>), sets_inplace);
    row("table/inplace", probe(probe_kernel<kTable>), sets_inplace);
    row("copy+bar", probe(probe_kernel<kCopyBar>), sets);
    // The empty kernel (one block of 192 threads per token): the launch floor.
    auto empty = [](cudaLaunchConfig_t* cfg, const Params&) {
      CK(cudaLaunchKernelEx(cfg, empty_kernel));
    };
    std::printf("%-16s %5d %9.2f\n", "empty", T_, measure(empty, 6, false, sets));
    CK(cudaStreamSynchronize(s));
    for (void* d : allocs) CK(cudaFree(d));
  }
  return 0;
}
