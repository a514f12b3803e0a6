// A small C++ driver of the CUDA backend for compute-sanitizer (memcheck,
// racecheck) and ncu: no Python, no framework, every kernel variant once.
//
//   sanitize_driver            small cases of every variant; exit 0 if all right
//   sanitize_driver --profile  Llama-3.1-8B bf16 calls of T = 1, 64, 8192 (for ncu)
//   sanitize_driver --latency  per-call time of T = 1..512 in CUDA graphs, and
//                              of an empty kernel (the launch floor)
//   sanitize_driver --profile-decode  T = 1, plain and options kernels (for ncu)
//   sanitize_driver --cold     per-call time of four model shapes, cold L2 (T = 1..8192)
//   sanitize_driver --cold-options  the same for Llama with QK-norm and fp8 pools
//                              (ROPEKV_DRIVER_OPTIONS: other options, any --cold*)
//                              (ROPEKV_DRIVER_TOKENS: other T, e.g. 1,8,64)
//                              (ROPEKV_DRIVER_SHAPES: other shapes, e.g. Gemma-4-full;
//                              ROPEKV_DRIVER_DTYPE=f16: f16 data, else bf16)
//   sanitize_driver --cold-inplace  the same in place (q_rot, k_rot = q, k)
//   sanitize_driver --cold-table    the same with a float32 cos_sin_cache (2^17 rows;
//                              ROPEKV_DRIVER_TABLE=bf16: a bf16 one, q's dtype)
//   sanitize_driver --cold-interleaved  the same with interleaved pairs (is_neox=False)
//   sanitize_driver --pool-floor  Llama bf16 calls with each pool format next to a
//                              kernel of the same loads and stores and a copy
//   sanitize_driver --host     host time per T = 1 call (Llama bf16) and of its parts
//
// Built by scripts/gpu-check.sh against the library the Python build made.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "ropekv/ropekv.h"

namespace {

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,                \
                   cudaGetErrorString(e_));                                          \
      std::exit(2);                                                                  \
    }                                                                                \
  } while (0)

int g_failures = 0;

struct Buf {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit Buf(size_t n) : bytes(n) { CK(cudaMalloc(&ptr, n ? n : 1)); }
  ~Buf() { cudaFree(ptr); }
};

DLTensor view(void* data, DLDataType dt, int ndim, int64_t* shape, int64_t* strides) {
  DLTensor t{};
  t.data = data;
  t.device = DLDevice{kDLCUDA, 0};
  t.ndim = ndim;
  t.dtype = dt;
  t.shape = shape;
  t.strides = strides;
  return t;
}

float to_float(uint16_t bits, int code) {
  if (code == kDLBfloat) {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  __half h;
  std::memcpy(&h, &bits, 2);
  return __half2float(h);
}

// One call: T tokens, Hq/Hk/D, dtype, index width, element stride of the
// last dim (1 = contiguous, 2 = every other element), one slot out of range
// when `bad_slot`. Checks k_pool rows against k_rot and untouched rows.
void run_case(const char* name, int T, int Hq, int Hk, int D, DLDataType dt, bool idx64,
              int64_t last_stride, bool bad_slot) {
  const int esize = dt.bits / 8;
  const int64_t P = 4 * T + 3;
  std::mt19937 rng(1234 + T + D);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  auto fill = [&](size_t n) {
    std::vector<uint8_t> h(n * esize);
    for (size_t i = 0; i < n; ++i) {
      const float x = uni(rng);
      if (esize == 4) {
        std::memcpy(&h[i * 4], &x, 4);
      } else if (dt.code == kDLBfloat) {
        __nv_bfloat16 b = __float2bfloat16_rn(x);
        std::memcpy(&h[i * 2], &b, 2);
      } else {
        __half b = __float2half_rn(x);
        std::memcpy(&h[i * 2], &b, 2);
      }
    }
    return h;
  };
  const size_t nq = size_t(T) * Hq * D * last_stride, nk = size_t(T) * Hk * D * last_stride;
  const size_t np = size_t(P) * Hk * D;
  Buf q(nq * esize), k(nk * esize), v(nk * esize), qr(nq * esize), kr(nk * esize);
  Buf kp(np * esize), vp(np * esize);
  auto hq = fill(nq), hk = fill(nk), hv = fill(nk), hkp = fill(np), hvp = fill(np);
  CK(cudaMemcpy(q.ptr, hq.data(), q.bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(k.ptr, hk.data(), k.bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(v.ptr, hv.data(), v.bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(kp.ptr, hkp.data(), kp.bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(vp.ptr, hvp.data(), vp.bytes, cudaMemcpyHostToDevice));
  CK(cudaMemset(qr.ptr, 0xFF, qr.bytes));
  CK(cudaMemset(kr.ptr, 0xFF, kr.bytes));

  std::vector<int64_t> pos(T), slot(T);
  std::vector<int64_t> perm(P);
  for (int64_t i = 0; i < P; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int t = 0; t < T; ++t) {
    pos[t] = static_cast<int64_t>(rng() % (1u << 24));
    slot[t] = (t % 5 == 4) ? -1 : perm[t];
  }
  if (bad_slot) slot[T / 2] = P + 7;
  const int iw = idx64 ? 8 : 4;
  Buf dpos(size_t(T) * iw), dslot(size_t(T) * iw);
  auto upload = [&](Buf& b, const std::vector<int64_t>& x) {
    if (idx64) {
      CK(cudaMemcpy(b.ptr, x.data(), b.bytes, cudaMemcpyHostToDevice));
    } else {
      std::vector<int32_t> y(x.begin(), x.end());
      CK(cudaMemcpy(b.ptr, y.data(), b.bytes, cudaMemcpyHostToDevice));
    }
  };
  upload(dpos, pos);
  upload(dslot, slot);

  int64_t sq[3] = {T, Hq, D}, sk[3] = {T, Hk, D}, sp[3] = {P, Hk, D}, s1[1] = {T};
  int64_t stq[3] = {Hq * D * last_stride, D * last_stride, last_stride};
  int64_t stk[3] = {Hk * D * last_stride, D * last_stride, last_stride};
  DLDataType it{kDLInt, static_cast<uint8_t>(iw * 8), 1};
  ropekv::RopePoolTensors t{view(q.ptr, dt, 3, sq, stq),     view(k.ptr, dt, 3, sk, stk),
                            view(v.ptr, dt, 3, sk, stk),     view(dpos.ptr, it, 1, s1, nullptr),
                            view(dslot.ptr, it, 1, s1, nullptr), view(kp.ptr, dt, 3, sp, nullptr),
                            view(vp.ptr, dt, 3, sp, nullptr), view(qr.ptr, dt, 3, sq, stq),
                            view(kr.ptr, dt, 3, sk, stk)};
  ropekv::RopeConfig cfg;
  cfg.head_dim = D;
  cfg.num_qo_heads = Hq;
  cfg.num_kv_heads = Hk;
  cfg.rope_base = 500000.0;
  ropekv::rope_pool_fused(t, cfg);
  bool raised = false;
  try {
    ropekv::check_device_errors(0, nullptr);
  } catch (const ropekv::Error& e) {
    raised = true;
    std::printf("  [%s] checked: %s\n", name, e.what());
  }
  CK(cudaDeviceSynchronize());

  // Pool rows: slot rows == k_rot / v, other rows untouched.
  std::vector<uint8_t> gkr(kr.bytes), gkp(kp.bytes), gvp(vp.bytes), gqr(qr.bytes);
  CK(cudaMemcpy(gkr.data(), kr.ptr, kr.bytes, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(gqr.data(), qr.ptr, qr.bytes, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(gkp.data(), kp.ptr, kp.bytes, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(gvp.data(), vp.ptr, vp.bytes, cudaMemcpyDeviceToHost));
  std::vector<int64_t> owner(P, -1);
  for (int tt = 0; tt < T; ++tt)
    if (slot[tt] >= 0 && slot[tt] < P) owner[slot[tt]] = tt;
  int bad = 0;
  const size_t row = size_t(Hk) * D * esize;
  for (int64_t r = 0; r < P; ++r) {
    if (owner[r] < 0) {
      bad += std::memcmp(&gkp[r * row], &hkp[r * row], row) != 0;
      bad += std::memcmp(&gvp[r * row], &hvp[r * row], row) != 0;
      continue;
    }
    const int64_t tt = owner[r];
    for (int64_t e = 0; e < int64_t(Hk) * D; ++e) {
      const size_t src = (size_t(tt) * Hk * D + e) * last_stride * esize;
      bad += std::memcmp(&gkp[r * row + e * esize], &gkr[src], esize) != 0;
      bad += std::memcmp(&gvp[r * row + e * esize], &hv[src], esize) != 0;
    }
  }
  // q_rot: spot-check the math of the first head of every token in fp64.
  double worst = 0;
  const int half = D / 2;
  for (int tt = 0; tt < T; ++tt) {
    for (int i = 0; i < half; ++i) {
      const float f = static_cast<float>(std::pow(500000.0, -2.0 * i / D));
      const double th = static_cast<float>(static_cast<float>(pos[tt]) * f);
      auto at = [&](const std::vector<uint8_t>& h, int d) {
        const size_t off = (size_t(tt) * Hq * D + d) * last_stride * esize;
        if (esize == 4) {
          float x;
          std::memcpy(&x, &h[off], 4);
          return double(x);
        }
        uint16_t b;
        std::memcpy(&b, &h[off], 2);
        return double(to_float(b, dt.code));
      };
      const double x1 = at(hq, i), x2 = at(hq, i + half);
      const double r1 = x1 * std::cos(th) - x2 * std::sin(th);
      const double r2 = x2 * std::cos(th) + x1 * std::sin(th);
      worst = std::max({worst, std::fabs(at(gqr, i) - r1), std::fabs(at(gqr, i + half) - r2)});
    }
  }
  const double tol = esize == 4 ? 1e-6 : (dt.code == kDLBfloat ? 1.6e-2 : 2e-3);
  const bool ok = bad == 0 && worst <= tol && raised == bad_slot;
  std::printf("%-34s T=%-4d Hq=%-2d Hk=%-2d D=%-3d %s: pool mismatches %d, q_rot max err %.2e\n",
              name, T, Hq, Hk, D, ok ? "ok  " : "FAIL", bad, worst);
  if (!ok) ++g_failures;
}

// A call with options (the options kernel) for the sanitizers: interleaved
// pairs or not, a cos_sin_cache (f32, or q's dtype with table_in_dtype) with
// token 1 outside it (or, with table = false, none), QK-norm weights (f32, or
// q's dtype with norm_in_dtype), fp8_e4m3 or float32 pools;
// with kAuto pools (q's dtype) the table alone, without weights (the plain
// kernel's table build when the arrays take 16-byte vectors), unless
// norm_same_pools (then with the weights too). Checks that
// the call raises the position error (with a table), leaves token 1's
// outputs and pool row untouched (likewise), writes every element of the
// other tokens' outputs (no NaN from the poison) and no pool row that no
// token names. The math is the pytest suite's job.
void run_options_case(const char* name, int T, int Hq, int Hk, int D, DLDataType dt,
                      int64_t last_stride, bool interleaved, ropekv::KvCacheDtype pool_type,
                      bool table = true, bool norm = true, bool norm_same_pools = false,
                      bool norm_in_dtype = false, bool table_in_dtype = false) {
  const int esize = dt.bits / 8;
  const bool fp8 = pool_type == ropekv::KvCacheDtype::kFp8E4M3;
  const bool table_only = pool_type == ropekv::KvCacheDtype::kAuto;
  const int pesize = fp8 ? 1 : (table_only ? esize : 4);
  const int64_t P = 2 * T + 3, rows = 50;
  std::mt19937 rng(99 + T + D);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  auto fill = [&](size_t n, int es) {
    std::vector<uint8_t> h(n * es);
    for (size_t i = 0; i < n; ++i) {
      const float x = uni(rng);
      if (es == 1) {
        h[i] = static_cast<uint8_t>(rng());
      } else if (es == 4) {
        std::memcpy(&h[i * 4], &x, 4);
      } else if (dt.code == kDLBfloat) {
        __nv_bfloat16 b = __float2bfloat16_rn(x);
        std::memcpy(&h[i * 2], &b, 2);
      } else {
        __half b = __float2half_rn(x);
        std::memcpy(&h[i * 2], &b, 2);
      }
    }
    return h;
  };
  const size_t nq = size_t(T) * Hq * D * last_stride, nk = size_t(T) * Hk * D * last_stride;
  const size_t np = size_t(P) * Hk * D;
  Buf q(nq * esize), k(nk * esize), v(nk * esize), qr(nq * esize), kr(nk * esize);
  Buf kp(np * pesize), vp(np * pesize), cs(size_t(rows) * D * 4), w(size_t(D) * 4);
  auto hq = fill(nq, esize), hk = fill(nk, esize), hv = fill(nk, esize);
  auto hkp = fill(np, pesize), hvp = fill(np, pesize),
       hcs = fill(size_t(rows) * D, table_in_dtype ? esize : 4),
       hw = fill(D, norm_in_dtype ? esize : 4);
  CK(cudaMemcpy(q.ptr, hq.data(), q.bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(k.ptr, hk.data(), k.bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(v.ptr, hv.data(), v.bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(kp.ptr, hkp.data(), kp.bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(vp.ptr, hvp.data(), vp.bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(cs.ptr, hcs.data(), hcs.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(w.ptr, hw.data(), hw.size(), cudaMemcpyHostToDevice));
  CK(cudaMemset(qr.ptr, 0xFF, qr.bytes));  // NaN in every float format
  CK(cudaMemset(kr.ptr, 0xFF, kr.bytes));
  std::vector<int64_t> pos(T), slot(T);
  for (int t = 0; t < T; ++t) {
    pos[t] = static_cast<int64_t>(rng() % rows);
    slot[t] = t;
  }
  pos[1] = rows;  // outside the table: the token is skipped
  Buf dpos(size_t(T) * 8), dslot(size_t(T) * 8);
  CK(cudaMemcpy(dpos.ptr, pos.data(), dpos.bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dslot.ptr, slot.data(), dslot.bytes, cudaMemcpyHostToDevice));

  int64_t sq[3] = {T, Hq, D}, sk[3] = {T, Hk, D}, sp[3] = {P, Hk, D}, s1[1] = {T};
  int64_t scs[2] = {rows, D}, sw[1] = {D};
  int64_t stq[3] = {Hq * D * last_stride, D * last_stride, last_stride};
  int64_t stk[3] = {Hk * D * last_stride, D * last_stride, last_stride};
  const DLDataType it{kDLInt, 64, 1}, f32{kDLFloat, 32, 1};
  const DLDataType pt = fp8 ? DLDataType{kDLUInt, 8, 1} : (table_only ? dt : f32);
  ropekv::RopePoolTensors t{view(q.ptr, dt, 3, sq, stq),     view(k.ptr, dt, 3, sk, stk),
                            view(v.ptr, dt, 3, sk, stk),     view(dpos.ptr, it, 1, s1, nullptr),
                            view(dslot.ptr, it, 1, s1, nullptr), view(kp.ptr, pt, 3, sp, nullptr),
                            view(vp.ptr, pt, 3, sp, nullptr), view(qr.ptr, dt, 3, sq, stq),
                            view(kr.ptr, dt, 3, sk, stk),
                            view(cs.ptr, table_in_dtype ? dt : f32, 2, scs, nullptr),
                            view(w.ptr, norm_in_dtype ? dt : f32, 1, sw, nullptr),
                            view(w.ptr, norm_in_dtype ? dt : f32, 1, sw, nullptr)};
  if ((table_only && !norm_same_pools) || !norm) t.q_norm_weight = t.k_norm_weight = DLTensor{};
  if (!table) t.cos_sin_cache = DLTensor{};  // cos/sin from rope_base: token 1 is written too
  ropekv::RopeConfig cfg;
  cfg.head_dim = D;
  cfg.num_qo_heads = Hq;
  cfg.num_kv_heads = Hk;
  cfg.is_neox = !interleaved;
  cfg.kv_cache_dtype = pool_type;
  if (fp8) cfg.k_scale = 0.5, cfg.v_scale = 2.0;
  ropekv::rope_pool_fused(t, cfg);
  bool raised = !table;
  try {
    ropekv::check_device_errors(0, nullptr);
  } catch (const ropekv::Error& e) {
    raised = table && std::strstr(e.what(), "positions[1] = 50 is outside cos_sin_cache");
  }
  CK(cudaDeviceSynchronize());
  std::vector<uint8_t> gqr(qr.bytes), gkr(kr.bytes), gkp(kp.bytes), gvp(vp.bytes);
  CK(cudaMemcpy(gqr.data(), qr.ptr, qr.bytes, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(gkr.data(), kr.ptr, kr.bytes, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(gkp.data(), kp.ptr, kp.bytes, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(gvp.data(), vp.ptr, vp.bytes, cudaMemcpyDeviceToHost));
  // Poison left: token 1 everywhere, nowhere else (outputs are NaN-free).
  int bad = 0;
  auto poisoned = [&](const std::vector<uint8_t>& h, int H, int tt) {
    int n = 0;
    for (int64_t e = 0; e < int64_t(H) * D; ++e) {
      const size_t off = (size_t(tt) * H * D * last_stride + e * last_stride) * esize;
      bool all = true;
      for (int b = 0; b < esize; ++b) all = all && h[off + b] == 0xFF;
      n += all;
    }
    return n;
  };
  for (int tt = 0; tt < T; ++tt) {
    const int want = tt == 1 && table ? 1 : 0;
    bad += (poisoned(gqr, Hq, tt) == want * Hq * D) ? 0 : 1;
    bad += (poisoned(gkr, Hk, tt) == want * Hk * D) ? 0 : 1;
  }
  const size_t row = size_t(Hk) * D * pesize;
  for (int64_t r = 0; r < P; ++r) {
    if (r < T && (r != 1 || !table)) continue;  // written by token r
    bad += std::memcmp(&gkp[r * row], &hkp[r * row], row) != 0;
    bad += std::memcmp(&gvp[r * row], &hvp[r * row], row) != 0;
  }
  const bool ok = bad == 0 && raised;
  std::printf("%-34s T=%-4d Hq=%-2d Hk=%-2d D=%-4d %s: mismatches %d, raised %d\n", name, T, Hq,
              Hk, D, ok ? "ok  " : "FAIL", bad, raised);
  if (!ok) ++g_failures;
}

// bf16 buffers of one call for T tokens of a model shape (Llama-3.1-8B by
// default; a pool of 2^19 rows, scattered slots). `options` (OptionSet
// bits): Qwen3's QK-norm (bf16 weights), fp8_e4m3 pools (k_scale 0.5, or
// 0.37: a scale whose reciprocal is not exact, which divides) or float32
// pools.
enum OptionSet : int { kOptNorm = 1, kOptFp8 = 2, kOptF32Pools = 4, kOptFp8Div = 8 };
constexpr int kNormFp8 = kOptNorm | kOptFp8;  // --cold-options' default
int pool_esize_of(int options) {
  return options & (kOptFp8 | kOptFp8Div) ? 1 : options & kOptF32Pools ? 4 : 2;
}
struct Shape {
  const char* name;
  int Hq, Hk, D;
};
constexpr Shape kLlama{"Llama-3.1-8B", 32, 8, 128};
constexpr Shape kShapes[] = {kLlama, {"Qwen2.5-7B", 28, 4, 128}, {"Gemma-2-9B", 16, 8, 256},
                             {"Phi-3-mini", 32, 32, 96}};
// Shapes of --cold* only when named in ROPEKV_DRIVER_SHAPES: heads of 512
// (Gemma-4's full-attention layers, 8 + 4; and 32 + 8).
constexpr Shape kExtraShapes[] = {{"Gemma-4-full", 8, 4, 512}, {"heads-of-512-32/8", 32, 8, 512}};

constexpr DLDataType kBf16{kDLBfloat, 16, 1};
// The dtype of --cold*'s data: ROPEKV_DRIVER_DTYPE=f16, else bf16.
DLDataType driver_dtype() {
  const char* e = std::getenv("ROPEKV_DRIVER_DTYPE");
  return e != nullptr && std::strcmp(e, "f16") == 0 ? DLDataType{kDLFloat, 16, 1} : kBf16;
}

struct ModelCall {
  static constexpr int64_t P = 1 << 19;
  int T, Hq, Hk, D, pool_esize;
  Buf q, k, v, qr, kr, kp, vp, dpos, dslot, w;
  int64_t sq[3], sk[3], sp[3], s1[1], sw[1];
  ropekv::RopePoolTensors t;
  ropekv::RopeConfig cfg;
  // pool_rows: P, or fewer for a call whose pools are never used; dt: the
  // 16-bit dtype of q, k, v, q_rot, k_rot, the weights and pools of q's dtype.
  ModelCall(int T_, Shape m, int options = 0, int64_t pool_rows = P, DLDataType dt = kBf16)
      : T(T_), Hq(m.Hq), Hk(m.Hk), D(m.D), pool_esize(pool_esize_of(options)), q(size_t(T_) * Hq * D * 2), k(size_t(T_) * Hk * D * 2),
        v(k.bytes), qr(q.bytes), kr(k.bytes), kp(size_t(pool_rows) * Hk * D * pool_esize),
        vp(kp.bytes), dpos(T_ * 4), dslot(T_ * 4), w(D * 2), sq{T_, Hq, D}, sk{T_, Hk, D},
        sp{P, Hk, D}, s1{T_}, sw{D} {
    CK(cudaMemset(q.ptr, 0x3c, q.bytes));
    CK(cudaMemset(k.ptr, 0x3c, k.bytes));
    CK(cudaMemset(v.ptr, 0x3c, v.bytes));
    std::vector<int32_t> pos(T), slot(T);
    for (int i = 0; i < T; ++i) {
      pos[i] = i + 1000;
      slot[i] = static_cast<int32_t>((static_cast<int64_t>(i) * 7919 + 13) % P);
    }
    CK(cudaMemcpy(dpos.ptr, pos.data(), dpos.bytes, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dslot.ptr, slot.data(), dslot.bytes, cudaMemcpyHostToDevice));
    const DLDataType it{kDLInt, 32, 1};
    t = ropekv::RopePoolTensors{view(q.ptr, dt, 3, sq, nullptr),  view(k.ptr, dt, 3, sk, nullptr),
                                view(v.ptr, dt, 3, sk, nullptr),  view(dpos.ptr, it, 1, s1, nullptr),
                                view(dslot.ptr, it, 1, s1, nullptr), view(kp.ptr, dt, 3, sp, nullptr),
                                view(vp.ptr, dt, 3, sp, nullptr), view(qr.ptr, dt, 3, sq, nullptr),
                                view(kr.ptr, dt, 3, sk, nullptr)};
    cfg.head_dim = D;
    cfg.num_qo_heads = Hq;
    cfg.num_kv_heads = Hk;
    cfg.rope_base = 500000.0;
    if (options & kOptNorm) {
      CK(cudaMemset(w.ptr, 0x3f, w.bytes));
      t.q_norm_weight = view(w.ptr, dt, 1, sw, nullptr);
      t.k_norm_weight = view(w.ptr, dt, 1, sw, nullptr);
    }
    if (options & (kOptFp8 | kOptFp8Div)) {
      const DLDataType u8{kDLUInt, 8, 1};
      t.k_pool.dtype = u8;
      t.v_pool.dtype = u8;
      cfg.kv_cache_dtype = ropekv::KvCacheDtype::kFp8E4M3;
      cfg.k_scale = options & kOptFp8Div ? 0.37 : 0.5;
      cfg.v_scale = options & kOptFp8Div ? 0.37 : 1.0;
    } else if (options & kOptF32Pools) {
      t.k_pool.dtype = DLDataType{kDLFloat, 32, 1};
      t.v_pool.dtype = DLDataType{kDLFloat, 32, 1};
      cfg.kv_cache_dtype = ropekv::KvCacheDtype::kFloat32;
    }
    // The uploads above ran on the legacy stream (a pageable cudaMemcpy may
    // return before its DMA lands): finish them before a non-blocking stream
    // reads the buffers.
    CK(cudaDeviceSynchronize());
  }
  // Bytes a call moves (SPEC 7): q and k read and written, v read, the pool
  // rows of k and v written, positions and slots read.
  double bytes() const {
    return 2.0 * (2.0 * T * Hq * D + 3.0 * T * Hk * D) + pool_esize * 2.0 * T * Hk * D + 8.0 * T;
  }
  void run(cudaStream_t s = nullptr) {
    ropekv::ExecOptions o;
    o.stream = s;
    ropekv::rope_pool_fused(t, cfg, o);
  }
};
struct LlamaCall : ModelCall {
  explicit LlamaCall(int T_, int options = 0) : ModelCall(T_, kLlama, options) {}
};

// For ncu: T = 1, 64 and 8192, two calls each.
void profile() {
  for (int T : {1, 64, 8192}) {
    LlamaCall c(T);
    c.run();
    c.run();
    CK(cudaDeviceSynchronize());
  }
  ropekv::check_device_errors(0, nullptr);
  std::printf("profile cases done\n");
}

// For ncu's stall sampling of decode: T = 1, the plain kernel twice, then
// the options kernel (QK-norm, fp8 pools) twice.
void profile_decode() {
  for (bool options : {false, true}) {
    LlamaCall c(1, options ? kNormFp8 : 0);
    c.run();
    c.run();
    CK(cudaDeviceSynchronize());
  }
  ropekv::check_device_errors(0, nullptr);
  std::printf("profile cases done\n");
}

// A non-blocking stream of the timing modes, and the time in ms of the work
// a callable enqueues on it (between two events, waited for).
struct StreamTimer {
  cudaStream_t s;
  cudaEvent_t e0, e1;
  StreamTimer() {
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
  }
  template <class F>
  float ms(F&& enqueue) {
    CK(cudaEventRecord(e0, s));
    enqueue();
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float t;
    CK(cudaEventElapsedTime(&t, e0, e1));
    return t;
  }
};

__global__ void empty_kernel(int) {}

// Per-call time of small calls, 50 back-to-back in one CUDA graph (inputs
// L2-warm), next to 50 empty kernels (the launch floor of the machine); and
// of large calls, plain launches timed with events. One line; run it with
// ROPEKV_CUDA_UNROLL=1|2|4|8 to compare the kernel's steps per team.
void latency() {
  StreamTimer timer;
  cudaStream_t s = timer.s;
  auto median_us = [&](auto&& launch, int per_rep) {
    std::vector<float> ms;
    for (int r = 0; r < 9; ++r) ms.push_back(timer.ms(launch));
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2] * 1e3 / per_rep;
  };
  auto time_graph = [&](auto&& body) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < 50; ++i) body();
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    for (int i = 0; i < 5; ++i) CK(cudaGraphLaunch(ge, s));
    const double us = median_us(
        [&] {
          for (int i = 0; i < 20; ++i) CK(cudaGraphLaunch(ge, s));
        },
        20 * 50);
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    return us;
  };
  const char* u = std::getenv("ROPEKV_CUDA_UNROLL");
  for (bool options : {false, true}) {
    if (options)
      std::printf("U=%s options (QK-norm, fp8 pools)", u ? u : "auto");
    else
      std::printf("U=%s graph us/call: empty %.2f", u ? u : "auto",
                  time_graph([&] { empty_kernel<<<1, 32, 0, s>>>(0); }));
    for (int T : {1, 8, 64, 512}) {
      LlamaCall c(T, options ? kNormFp8 : 0);
      c.run(s);
      CK(cudaStreamSynchronize(s));
      std::printf(" | T=%d %.2f", T, time_graph([&] { c.run(s); }));
    }
    for (int T : {2048, 8192, 32768}) {
      LlamaCall c(T, options ? kNormFp8 : 0);
      for (int i = 0; i < 3; ++i) c.run(s);
      const double us = median_us(
          [&] {
            for (int i = 0; i < 10; ++i) c.run(s);
          },
          10);
      std::printf(" | T=%d %.1f us %.0f GB/s", T, us, c.bytes() / us / 1e3);
    }
    std::printf("\n");
  }
  ropekv::check_device_errors(0, s);
}

// Per-call time of plain calls with a cold L2, as the peers benchmark
// measures them: 50 calls in one CUDA graph, each on its own q, k, v,
// positions and slots (fewer sets, cycled, where 50 would not fit in about
// 1 GB), random positions and distinct random slots, the L2 flushed before
// each replay. Every shape of kShapes at T = 1..8192 (with `options`: the
// Llama shape with QK-norm and fp8 pools; others: driver_shapes, tokens:
// driver_tokens, f16 data: driver_dtype; with `inplace`: q_rot and k_rot are
// q and k, as with inplace=True); run it with ROPEKV_CUDA_UNROLL=1|2|4|8 to
// compare the kernel's steps per team.
// ROPEKV_DRIVER_OPTIONS picks the options of --cold* calls (with any mode,
// e.g. a table with a QK-norm: --cold-table): a comma list of norm, fp8,
// fp8div (fp8 pools with scales of inexact reciprocal) and f32 (float32
// pools); --cold-options without it: norm,fp8.
// The items of a comma list (an empty one for an empty string).
std::vector<std::string> comma_items(const char* list) {
  std::vector<std::string> out;
  std::string item;
  for (const char* c = list; *c != 0; ++c) {
    if (*c != ',') {
      item += *c;
    } else {
      out.push_back(item);
      item.clear();
    }
  }
  if (*list != 0) out.push_back(item);
  return out;
}

// An unknown name in a ROPEKV_DRIVER_* list: the driver would time
// something else than asked.
[[noreturn]] void unknown_item(const char* variable, const std::string& item) {
  std::fprintf(stderr, "%s: unknown item '%s'\n", variable, item.c_str());
  std::exit(2);
}

int driver_options() {
  const char* e = std::getenv("ROPEKV_DRIVER_OPTIONS");
  if (e == nullptr) return kNormFp8;
  const std::pair<std::string, int> names[] = {
      {"norm", kOptNorm}, {"fp8", kOptFp8}, {"fp8div", kOptFp8Div}, {"f32", kOptF32Pools}};
  int o = 0;
  for (const std::string& item : comma_items(e)) {
    const auto n = std::find_if(std::begin(names), std::end(names),
                                [&](const auto& x) { return x.first == item; });
    if (n == std::end(names)) unknown_item("ROPEKV_DRIVER_OPTIONS", item);
    o |= n->second;
  }
  return o;
}

// The T of --cold*: ROPEKV_DRIVER_TOKENS (a comma list), default 1 to 8192.
std::vector<int> driver_tokens() {
  const char* e = std::getenv("ROPEKV_DRIVER_TOKENS");
  if (e == nullptr) return {1, 8, 16, 32, 64, 128, 256, 512, 2048, 8192};
  std::vector<int> ts;
  for (const std::string& item : comma_items(e)) {
    char* end = nullptr;
    const long t = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != 0 || t <= 0 || t > INT32_MAX)
      unknown_item("ROPEKV_DRIVER_TOKENS", item);
    ts.push_back(static_cast<int>(t));
  }
  return ts;
}

// The shapes of --cold*: ROPEKV_DRIVER_SHAPES (a comma list of names of
// kShapes and kExtraShapes), default kShapes, or Llama alone with options.
std::vector<Shape> driver_shapes(int options) {
  const char* e = std::getenv("ROPEKV_DRIVER_SHAPES");
  if (e == nullptr)
    return options ? std::vector<Shape>{kLlama}
                   : std::vector<Shape>(std::begin(kShapes), std::end(kShapes));
  std::vector<Shape> all(std::begin(kShapes), std::end(kShapes));
  all.insert(all.end(), std::begin(kExtraShapes), std::end(kExtraShapes));
  std::vector<Shape> out;
  for (const std::string& item : comma_items(e)) {
    const auto m =
        std::find_if(all.begin(), all.end(), [&](const Shape& s) { return item == s.name; });
    if (m == all.end()) unknown_item("ROPEKV_DRIVER_SHAPES", item);
    out.push_back(*m);
  }
  return out;
}

const char* options_name(int o) {
  static std::string s;
  s.clear();
  if (o & kOptNorm) s += " QK-norm";
  if (o & kOptFp8) s += " fp8";
  if (o & kOptFp8Div) s += " fp8/0.37";
  if (o & kOptF32Pools) s += " f32-pools";
  return s.c_str();
}

// The input sets of cold calls like c: as many as keep them within about
// 1 GB (at most 50), each with its own q, k, v, q_rot and k_rot (memset
// values), random positions below 2^17 and T distinct slots of the pool:
// one random row of each of T strides, in order, or (random_slots) the
// first T of a random permutation of its rows.
std::vector<std::unique_ptr<ModelCall>> cold_sets(const ModelCall& c, Shape m, std::mt19937& rng,
                                                  bool random_slots = false) {
  const int T = c.T;
  const size_t set_bytes = c.q.bytes * 2 + c.k.bytes * 3 + size_t(T) * 8;
  const int n = static_cast<int>(std::clamp<size_t>((size_t(1) << 30) / set_bytes, 1, 50));
  std::vector<std::unique_ptr<ModelCall>> sets;
  std::vector<int32_t> perm(random_slots ? ModelCall::P : 0);
  for (int i = 0; i < n; ++i) {
    sets.emplace_back(new ModelCall(T, m, 0, /*pool_rows=*/1));
    std::vector<int32_t> pos(T), slot(T);
    for (int j = 0; j < T; ++j) pos[j] = static_cast<int32_t>(rng() % (1 << 17));
    if (random_slots) {
      for (int64_t j = 0; j < ModelCall::P; ++j) perm[j] = static_cast<int32_t>(j);
      std::shuffle(perm.begin(), perm.end(), rng);
      std::copy(perm.begin(), perm.begin() + T, slot.begin());
    } else {
      const int64_t stride = ModelCall::P / T;
      for (int j = 0; j < T; ++j) slot[j] = static_cast<int32_t>(j * stride + rng() % stride);
    }
    CK(cudaMemcpy(sets[i]->dpos.ptr, pos.data(), T * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(sets[i]->dslot.ptr, slot.data(), T * 4, cudaMemcpyHostToDevice));
  }
  CK(cudaDeviceSynchronize());
  return sets;
}

// c's tensors (its pools, weights, dtypes) with the inputs and outputs of
// set x; in place: q_rot and k_rot are x's q and k.
ropekv::RopePoolTensors with_set(const ModelCall& c, const ModelCall& x, bool inplace = false) {
  ropekv::RopePoolTensors t = c.t;
  t.q.data = x.q.ptr;
  t.k.data = x.k.ptr;
  t.v.data = x.v.ptr;
  t.q_rot.data = inplace ? x.q.ptr : x.qr.ptr;
  t.k_rot.data = inplace ? x.k.ptr : x.kr.ptr;
  t.positions.data = x.dpos.ptr;
  t.slots.data = x.dslot.ptr;
  return t;
}

void cold(int options, bool inplace, bool table, bool interleaved) {
  StreamTimer timer;
  cudaStream_t s = timer.s;
  Buf flush(size_t(256) << 20);
  const char* u = std::getenv("ROPEKV_CUDA_UNROLL");
  std::mt19937 rng(11);
  constexpr int64_t kRows = 1 << 17;  // cos_sin_cache rows (positions are below)
  const char* td = std::getenv("ROPEKV_DRIVER_TABLE");
  const bool table16 = table && td != nullptr && std::strcmp(td, "bf16") == 0;
  const DLDataType table_dt = table16 ? kBf16 : DLDataType{kDLFloat, 32, 1};
  for (const Shape& m : driver_shapes(options)) {
    const char* sg = std::getenv("ROPEKV_CUDA_SPLIT_GRID");
    const char* st = std::getenv("ROPEKV_CUDA_SPLIT_TEAMS");
    const char* sm = std::getenv("ROPEKV_CUDA_SMALL_TOKENS");
    const char* sb = std::getenv("ROPEKV_CUDA_SMALL_THREADS");
    std::printf("U=%s S=%s/%s small=%s/%s cold%s %-12s%s%s%s%s", u ? u : "auto",
                sg ? sg : "auto", st ? st : "auto", sm ? sm : "auto", sb ? sb : "auto",
                driver_dtype().code == kDLFloat ? " f16" : "", m.name,
                options_name(options), inplace ? " in place" : "",
                table ? (table16 ? " cos_sin_cache bf16" : " cos_sin_cache f32") : "",
                interleaved ? " interleaved" : "");
    // A [kRows, D] table (values do not matter for the time).
    Buf tab(table ? size_t(kRows) * m.D * (table16 ? 2 : 4) : 4);
    int64_t tab_shape[2] = {kRows, m.D};
    CK(cudaMemset(tab.ptr, 0x3c, tab.bytes));
    for (int T : driver_tokens()) {
      ModelCall c(T, m, options, ModelCall::P, driver_dtype());
      c.cfg.is_neox = !interleaved;
      const auto sets = cold_sets(c, m, rng);  // inputs and outputs of each call
      const int n = static_cast<int>(sets.size());
      auto call = [&](int i) {
        ropekv::RopePoolTensors t = with_set(c, *sets[i % n], inplace);
        if (table) t.cos_sin_cache = view(tab.ptr, table_dt, 2, tab_shape, nullptr);
        ropekv::ExecOptions o;
        o.stream = s;
        ropekv::rope_pool_fused(t, c.cfg, o);
      };
      cudaGraph_t g;
      cudaGraphExec_t ge;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
      for (int i = 0; i < 50; ++i) call(i);
      CK(cudaStreamEndCapture(s, &g));
      CK(cudaGraphInstantiate(&ge, g, 0));
      std::vector<float> ms;
      for (int r = 0; r < 11; ++r) {
        CK(cudaMemsetAsync(flush.ptr, r, flush.bytes, s));
        const float t = timer.ms([&] { CK(cudaGraphLaunch(ge, s)); });
        if (r > 0) ms.push_back(t);
      }
      std::sort(ms.begin(), ms.end());
      const double us = ms[ms.size() / 2] * 1e3 / 50;
      std::printf(" | T=%d %.2f us %.0f GB/s", T, us, c.bytes() / us / 1e3);
      CK(cudaGraphExecDestroy(ge));
      CK(cudaGraphDestroy(g));
    }
    std::printf("\n");
  }
  ropekv::check_device_errors(0, s);
}

// What a pool format's access pattern costs, whatever the arithmetic: one
// thread per 16 bytes (8 bf16 elements) of q, k or v of a token, loading it
// and storing it to q_rot / k_rot and, for k and v, to the token's pool row
// in the pool's element size (kPoolBytes 1: fp8, 2: q's dtype, 4: float32;
// the values are the input's bits, cut or widened, not converted). Every
// store is as wide as the library's kernel makes it, at the same addresses.
// kNorm: q and k heads are first scaled as a QK-norm scales them
// (x * rsqrt(mean(x^2) + eps) * w, w bf16), a head being 16 neighbouring
// threads (head_dim 128) whose sums of squares meet by shuffles: the least
// any QK-norm adds, a reduction across the head before its first store.
template <int kPoolBytes, bool kNorm>
__global__ void pool_floor_kernel(const uint4* q, const uint4* k, const uint4* v, uint4* q_rot,
                                  uint4* k_rot, unsigned char* k_pool, unsigned char* v_pool,
                                  const int32_t* slots, const uint4* w, int T, int q_chunks,
                                  int kv_chunks) {
  const int per_token = q_chunks + 2 * kv_chunks;
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<long long>(T) * per_token) return;  // (whole heads: T * per_token % 16 == 0)
  const int t = static_cast<int>(i / per_token), c = static_cast<int>(i % per_token);
  const bool is_q = c < q_chunks, is_k = !is_q && c < q_chunks + kv_chunks;
  const int j = c - (is_q ? 0 : q_chunks) - (is_q || is_k ? 0 : kv_chunks);
  const long long at = static_cast<long long>(t) * (is_q ? q_chunks : kv_chunks) + j;
  uint4 x = is_q ? q[at] : is_k ? k[at] : v[at];
  if (kNorm && (is_q || is_k)) {
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&x);
    float2 f[4];
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      f[e] = __bfloat1622float2(h[e]);
      ss = fmaf(f[e].x, f[e].x, fmaf(f[e].y, f[e].y, ss));
    }
#pragma unroll
    for (int m = 8; m > 0; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m, 16);
    const float r = rsqrtf(ss / 128.f + 1e-6f);
    uint4 wv = w[threadIdx.x % 16];
    const __nv_bfloat162* wh = reinterpret_cast<const __nv_bfloat162*>(&wv);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 we = __bfloat1622float2(wh[e]);
      h[e] = __floats2bfloat162_rn(f[e].x * r * we.x, f[e].y * r * we.y);
    }
  }
  if (is_q) {
    q_rot[at] = x;
    return;
  }
  if (is_k) k_rot[at] = x;
  unsigned char* row = (is_k ? k_pool : v_pool) +
                       (static_cast<long long>(slots[t]) * kv_chunks + j) * 8 * kPoolBytes;
  if constexpr (kPoolBytes == 1) {
    // The high byte of each element: 8 bytes.
    const auto hi = [](unsigned a, unsigned b) { return __byte_perm(a, b, 0x7531); };
    *reinterpret_cast<uint2*>(row) = make_uint2(hi(x.x, x.y), hi(x.z, x.w));
  } else if constexpr (kPoolBytes == 2) {
    *reinterpret_cast<uint4*>(row) = x;
  } else {
    // bf16 -> float32 is the bits moved up: 32 bytes.
    const auto wide = [](unsigned a) { return make_uint2(a << 16, a & 0xffff0000u); };
    const uint2 a = wide(x.x), b = wide(x.y), cc = wide(x.z), d = wide(x.w);
    reinterpret_cast<uint4*>(row)[0] = make_uint4(a.x, a.y, b.x, b.y);
    reinterpret_cast<uint4*>(row)[1] = make_uint4(cc.x, cc.y, d.x, d.y);
  }
}

// --pool-floor: Llama-3.1-8B bf16 calls of T = 512..32768 with each pool
// format (bf16, float32, fp8_e4m3 with power-of-two scales), and with a
// QK-norm (bf16 weights) with bf16 or fp8 pools, random or ascending slots,
// cold as in cold(), next to pool_floor_kernel on the same buffers and slots
// and to a device copy of the same bytes: does an option cost the library's
// kernel more than its access pattern (and, with a QK-norm, the head's
// reduction) costs any kernel?
void pool_floor() {
  StreamTimer timer;
  cudaStream_t s = timer.s;
  Buf flush(size_t(256) << 20);
  std::mt19937 rng(17);
  const Shape m = kLlama;
  std::printf("slots | options | T | ropekv us | floor us | copy us | ropekv of copy | "
              "floor of copy | ropekv / floor\n");
  // (Ascending slots were within 1 % of random ones for every pool format:
  // the QK-norm rows take random slots only.)
  const std::pair<bool, int> cases[] = {
      {true, 0},  {true, kOptF32Pools},  {true, kOptFp8}, {true, kOptNorm}, {true, kNormFp8},
      {false, 0}, {false, kOptF32Pools}, {false, kOptFp8}};
  for (const auto& [random_slots, options] : cases) {
    const bool norm = options & kOptNorm;
    for (int T : {512, 2048, 8192, 32768}) {
      ModelCall c(T, m, options);
      const auto sets = cold_sets(c, m, rng, random_slots);
      const int n = static_cast<int>(sets.size());
      // The copy: as many bytes read and written as the call moves.
      const size_t half = static_cast<size_t>(c.bytes() / 2);
      Buf src(half * n), dst(half * n);
      CK(cudaMemset(src.ptr, 1, src.bytes));
      CK(cudaDeviceSynchronize());
      const int q_chunks = m.Hq * m.D / 8, kv_chunks = m.Hk * m.D / 8;
      const long long threads = static_cast<long long>(T) * (q_chunks + 2 * kv_chunks);
      const int grid = static_cast<int>((threads + 255) / 256);
      auto floor = [&](auto kernel, const ModelCall& x) {
        kernel<<<grid, 256, 0, s>>>(
            static_cast<const uint4*>(x.q.ptr), static_cast<const uint4*>(x.k.ptr),
            static_cast<const uint4*>(x.v.ptr), static_cast<uint4*>(x.qr.ptr),
            static_cast<uint4*>(x.kr.ptr), static_cast<unsigned char*>(c.kp.ptr),
            static_cast<unsigned char*>(c.vp.ptr), static_cast<const int32_t*>(x.dslot.ptr),
            static_cast<const uint4*>(c.w.ptr), T, q_chunks, kv_chunks);
      };
      auto run = [&](int way, int i) {
        const ModelCall& x = *sets[i % n];
        if (way == 0) {
          ropekv::ExecOptions o;
          o.stream = s;
          ropekv::rope_pool_fused(with_set(c, x), c.cfg, o);
        } else if (way == 1) {
          if (c.pool_esize == 1) {
            norm ? floor(pool_floor_kernel<1, true>, x) : floor(pool_floor_kernel<1, false>, x);
          } else if (c.pool_esize == 2) {
            norm ? floor(pool_floor_kernel<2, true>, x) : floor(pool_floor_kernel<2, false>, x);
          } else {
            norm ? floor(pool_floor_kernel<4, true>, x) : floor(pool_floor_kernel<4, false>, x);
          }
        } else {
          CK(cudaMemcpyAsync(static_cast<char*>(dst.ptr) + (i % n) * half,
                             static_cast<char*>(src.ptr) + (i % n) * half, half,
                             cudaMemcpyDeviceToDevice, s));
        }
      };
      // Per-call time of each way: 8 calls per graph (T = 512: 50), the L2
      // flushed before each replay, median of 9; the three ways alternate
      // replay by replay so that clock drift falls on each alike.
      const int calls = T <= 512 ? 50 : 8;
      cudaGraphExec_t ge[3];
      for (int way = 0; way < 3; ++way) {
        cudaGraph_t g;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        for (int i = 0; i < calls; ++i) run(way, i);
        CK(cudaStreamEndCapture(s, &g));
        CK(cudaGraphInstantiate(&ge[way], g, 0));
        CK(cudaGraphDestroy(g));
      }
      std::vector<float> ms[3];
      for (int r = 0; r < 10; ++r) {
        for (int way = 0; way < 3; ++way) {
          CK(cudaMemsetAsync(flush.ptr, r, flush.bytes, s));
          const float t = timer.ms([&] { CK(cudaGraphLaunch(ge[way], s)); });
          if (r > 0) ms[way].push_back(t);
        }
      }
      double us[3];
      for (int way = 0; way < 3; ++way) {
        std::sort(ms[way].begin(), ms[way].end());
        us[way] = ms[way][ms[way].size() / 2] * 1e3 / calls;
        CK(cudaGraphExecDestroy(ge[way]));
      }
      // The floor replayed last: its pool row of the last call's first token
      // holds that token's k (normalised with kNorm) as the kernel promises,
      // else it timed less work. (The inputs are one repeated value, so a
      // QK-norm gives x / |x| * w, to within rsqrtf's and bf16's rounding.)
      {
        const ModelCall& x = *sets[(calls - 1) % n];
        int32_t slot0;
        CK(cudaMemcpy(&slot0, x.dslot.ptr, 4, cudaMemcpyDeviceToHost));
        const size_t row = size_t(m.Hk) * m.D;
        std::vector<uint16_t> k0(row), w(m.D);
        std::vector<unsigned char> got(row * c.pool_esize);
        CK(cudaMemcpy(k0.data(), x.k.ptr, row * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(w.data(), c.w.ptr, m.D * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(got.data(), static_cast<char*>(c.kp.ptr) + size_t(slot0) * got.size(),
                      got.size(), cudaMemcpyDeviceToHost));
        const int bf = kDLBfloat;
        for (size_t e = 0; e < row; ++e) {
          const float kx = to_float(k0[e], bf);
          const float want = norm ? std::copysign(1.f, kx) * to_float(w[e % m.D], bf) : kx;
          uint32_t bits = 0;
          std::memcpy(&bits, &got[e * c.pool_esize], c.pool_esize);
          // (fp8: the high byte of a bf16, its sign, exponent and one bit.)
          const float have = c.pool_esize == 4   ? to_float(static_cast<uint16_t>(bits >> 16), bf)
                             : c.pool_esize == 2 ? to_float(static_cast<uint16_t>(bits), bf)
                                                 : to_float(static_cast<uint16_t>(bits << 8), bf);
          if (!(std::fabs(have - want) <= (c.pool_esize == 1 ? 0.5f : 0.01f) * std::fabs(want))) {
            std::printf("FAIL: pool floor row element %zu: %g, not %g\n", e, have, want);
            ++g_failures;
            break;
          }
        }
      }
      std::printf("%s | %s | %d | %.2f | %.2f | %.2f | %.3f | %.3f | %.3f\n",
                  random_slots ? "random" : "ascending", options ? options_name(options) + 1 : "bf16",
                  T, us[0], us[1], us[2], us[2] / us[0], us[2] / us[1], us[0] / us[1]);
      std::fflush(stdout);
    }
  }
  ropekv::check_device_errors(0, s);
}

// Host time per call of a stream of asynchronous T = 1 calls (Llama bf16,
// the kernels run behind; synchronised once at the end), next to the parts
// of a call: the contract check alone (ropekv::validate, which also asks
// CUDA about each of the nine arrays' memory), one cudaPointerGetAttributes,
// and an empty kernel's launch. Best of 5 runs of 20000 calls.
void host() {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  LlamaCall c(1);
  c.run(s);
  CK(cudaStreamSynchronize(s));
  auto per_call_us = [&](auto&& body) {
    double best = 1e30;
    for (int r = 0; r < 5; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < 20000; ++i) body();
      CK(cudaStreamSynchronize(s));
      const std::chrono::duration<double, std::micro> dt = std::chrono::steady_clock::now() - t0;
      best = std::min(best, dt.count() / 20000);
    }
    return best;
  };
  cudaPointerAttributes attr;
  std::printf("host us/call (T=1 Llama bf16): rope_pool_fused %.2f | validate %.2f | "
              "cudaPointerGetAttributes %.3f | empty kernel launch %.2f\n",
              per_call_us([&] { c.run(s); }), per_call_us([&] { ropekv::validate(c.t, c.cfg); }),
              per_call_us([&] { CK(cudaPointerGetAttributes(&attr, c.q.ptr)); }),
              per_call_us([&] { empty_kernel<<<1, 32, 0, s>>>(0); }));
  ropekv::check_device_errors(0, s);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--profile") {
    profile();
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "--profile-decode") {
    profile_decode();
    return 0;
  }
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "--cold" || mode == "--cold-options" || mode == "--cold-inplace" ||
      mode == "--cold-table" || mode == "--cold-interleaved") {
    // (ROPEKV_DRIVER_OPTIONS applies to every --cold* mode; --cold-options
    // defaults to a QK-norm with fp8 pools.)
    const bool opts = mode == "--cold-options" || std::getenv("ROPEKV_DRIVER_OPTIONS") != nullptr;
    cold(opts ? driver_options() : 0, mode == "--cold-inplace", mode == "--cold-table",
         mode == "--cold-interleaved");
    return 0;
  }
  if (mode == "--pool-floor") {
    pool_floor();
    return g_failures == 0 ? 0 : 1;
  }
  if (mode == "--host") {
    host();
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "--latency") {
    latency();
    return 0;
  }
  const DLDataType bf16{kDLBfloat, 16, 1}, f16{kDLFloat, 16, 1}, f32{kDLFloat, 32, 1};
  run_case("bf16 16B vectors", 9, 32, 8, 128, bf16, false, 1, false);
  run_case("bf16 16B vectors, one token", 1, 32, 8, 128, bf16, false, 1, false);
  run_case("f16 16B vectors D=96", 5, 32, 32, 96, f16, true, 1, false);
  run_case("f16 D=256", 3, 16, 8, 256, f16, false, 1, false);
  run_case("f32 16B vectors D=80", 4, 4, 2, 80, f32, false, 1, false);
  run_case("f32 8B vectors D=12", 4, 3, 1, 12, f32, true, 1, false);
  run_case("bf16 4B vectors D=36", 6, 5, 3, 36, bf16, false, 1, false);
  run_case("bf16 strided last dim", 6, 4, 2, 64, bf16, false, 2, false);
  run_case("f32 strided last dim D=2", 6, 4, 2, 2, f32, false, 2, false);
  run_case("f32 D=600 (inv_freq past table)", 2, 2, 1, 600, f32, false, 1, false);
  run_case("bf16 out-of-range slot", 8, 8, 2, 128, bf16, false, 1, true);
  run_case("f16 out-of-range slot, int64", 3, 8, 2, 64, f16, true, 1, true);
  // Plain NeoX calls of 257 to 8192 tokens (2048 for heads of 6 lanes):
  // the small kernel in wide lanes (16-byte vectors; D = 96: 6 lanes per head).
  run_case("small kernel wide lanes bf16", 300, 32, 8, 128, bf16, false, 1, false);
  run_case("small kernel wide lanes f16 D=96, bad slot", 600, 8, 8, 96, f16, true, 1, true);
  using KV = ropekv::KvCacheDtype;
  // NeoX calls of 257 to 8192 tokens with a QK-norm (weights in q's dtype)
  // or fp8 pools (cos/sin computed): the small kernel's option builds in
  // wide lanes; with float32 pools or float32 weights (no wide build) the
  // options kernel.
  run_options_case("small kernel wide lanes bf16 norm fp8", 300, 32, 8, 128, bf16, 1, false,
                   KV::kFp8E4M3, false, true, false, true);
  run_options_case("small kernel wide lanes f16 norm, D=256", 500, 16, 8, 256, f16, 1, false,
                   KV::kAuto, false, true, true, true);
  run_options_case("small kernel wide lanes bf16 norm, 5000 tokens", 5000, 32, 8, 128, bf16, 1,
                   false, KV::kAuto, false, true, true, true);
  run_options_case("opt bf16 norm (float32 weights) fp8, 300 tokens", 300, 32, 8, 128, bf16, 1,
                   false, KV::kFp8E4M3, false);
  // Plain interleaved pairs of 257 to 8192 tokens: wide lanes too.
  run_options_case("small kernel wide lanes bf16 interleaved", 700, 32, 8, 128, bf16, 1, true,
                   KV::kAuto, false, false);
  run_options_case("small kernel wide lanes bf16 fp8 pools", 400, 32, 8, 128, bf16, 1, false,
                   KV::kFp8E4M3, false, false);
  run_options_case("opt f16 norm f32 pools, 600 tokens", 600, 16, 8, 256, f16, 1, false,
                   KV::kFloat32, false);
  // The same with weights in q's dtype: the small kernel's wide lanes, whose
  // float32-pool builds split each lane's vector in two runs (kSplitLanes).
  run_options_case("small kernel split wide lanes f16 norm f32 pools, D=256", 600, 16, 8, 256,
                   f16, 1, false, KV::kFloat32, false, true, false, true);
  run_options_case("small kernel split wide lanes bf16 norm f32 pools, D=512", 1100, 8, 4, 512,
                   bf16, 1, false, KV::kFloat32, false, true, false, true);
  // Float32 pools alone: split wide lanes past 256 tokens too.
  run_options_case("small kernel split wide lanes bf16 f32 pools, D=128", 700, 32, 8, 128,
                   bf16, 1, false, KV::kFloat32, false, false);
  // Heads of 512 with a QK-norm: narrow lanes to 192 tokens (two warps a
  // head, their sums meeting in shared memory; with float32 pools and
  // float32 weights, which wide lanes do not take, 896), then wide lanes, a
  // head one warp (its sum by shuffles); their float32 pools alone: split
  // wide lanes past 256 tokens.
  run_options_case("small kernel wide lanes bf16 norm, D=512, 1100 tokens", 1100, 8, 4, 512,
                   bf16, 1, false, KV::kAuto, false, true, true, true);
  run_options_case("small kernel wide lanes f16 norm fp8, D=512, 1100 tokens", 1100, 8, 4, 512,
                   f16, 1, false, KV::kFp8E4M3, false, true, false, true);
  run_options_case("small kernel split wide lanes bf16 f32 pools, D=512, 700 tokens", 700, 8, 4,
                   512, bf16, 1, false, KV::kFloat32, false, false);
  run_options_case("small kernel narrow bf16 norm, D=512", 3, 8, 4, 512, bf16, 1, false,
                   KV::kAuto, false, true, true, true);
  run_options_case("small kernel narrow f16 norm fp8, D=512, 190 tokens", 190, 8, 4, 512, f16,
                   1, false, KV::kFp8E4M3, false, true, false, true);
  run_options_case("small kernel narrow bf16 table norm fp8, D=512", 9, 8, 3, 512, bf16, 1,
                   false, KV::kFp8E4M3, true, true);
  run_options_case("small kernel narrow bf16 norm f32 pools, D=512", 5, 8, 3, 512, bf16, 1,
                   false, KV::kFloat32, false, true);
  run_options_case("small kernel narrow f16 norm (f32 weights) f32 pools, D=512, 600 tokens",
                   600, 8, 4, 512, f16, 1, false, KV::kFloat32, false, true);
  // With a QK-norm (f32 weights) and float32 or fp8 pools: the small kernel's
  // options build (heads of up to 32 lanes), with or without a table.
  run_options_case("small kernel bf16 table norm fp8", 9, 32, 8, 128, bf16, 1, false,
                   KV::kFp8E4M3);
  run_options_case("small kernel f16 norm f32 pools", 7, 16, 8, 256, f16, 1, true, KV::kFloat32,
                   false);
  run_options_case("small kernel bf16 norm fp8, interleaved", 3, 8, 2, 64, bf16, 1, true,
                   KV::kFp8E4M3, false);
  run_options_case("small kernel bf16 norm fp8 (Qwen3 decode)", 2, 32, 8, 128, bf16, 1, false,
                   KV::kFp8E4M3, false);
  // Pool formats alone: the small kernel's fp8 (power-of-two scales) and
  // float32 builds, D = 96 (12 lanes: no QK-norm build has them).
  run_options_case("small kernel bf16 fp8 pools", 5, 32, 8, 128, bf16, 1, false, KV::kFp8E4M3,
                   true, false);
  run_options_case("small kernel f16 f32 pools, interleaved", 4, 8, 4, 96, f16, 1, true,
                   KV::kFloat32, false, false);
  // The table alone: up to 256 tokens of 16-bit data the small kernel (NeoX
  // or interleaved pairs, 128 lanes per head at D = 1024); beyond, or for
  // float32, the plain kernel reading the table, U = 2 and (past 6144 team
  // steps) U = 4.
  run_options_case("small kernel bf16 table", 9, 32, 8, 128, bf16, 1, false, KV::kAuto);
  run_options_case("small kernel bf16 table, interleaved", 9, 32, 8, 128, bf16, 1, true,
                   KV::kAuto);
  run_options_case("small kernel bf16 table D=1024", 3, 32, 4, 1024, bf16, 1, false, KV::kAuto);
  run_options_case("table kernel bf16, 2 steps", 300, 32, 8, 128, bf16, 1, false, KV::kAuto);
  run_options_case("table kernel bf16, 4 steps", 520, 32, 8, 128, bf16, 1, false, KV::kAuto);
  // A table in q's dtype: the 16-bit branch of the table builds' loads.
  run_options_case("table kernel bf16, bf16 table, 4 steps", 520, 32, 8, 128, bf16, 1, false,
                   KV::kAuto, true, true, false, false, true);
  run_options_case("table kernel f16, f16 table, D=64", 300, 8, 2, 64, f16, 1, false,
                   KV::kAuto, true, true, false, false, true);
  run_options_case("small kernel bf16, bf16 table", 9, 32, 8, 128, bf16, 1, false, KV::kAuto,
                   true, true, false, false, true);
  run_options_case("table kernel bf16 D=1024 (two-warp teams)", 300, 8, 2, 1024, bf16, 1, false,
                   KV::kAuto);
  run_options_case("table kernel f32", 6, 8, 2, 64, f32, 1, false, KV::kAuto);
  // Past 2048 team steps (and past the small kernel's 256 tokens) the
  // kOptSteps options kernel: 2 steps with QK-norm.
  run_options_case("opt bf16 norm fp8, 2 of 4 steps", 300, 32, 8, 128, bf16, 1, false,
                   KV::kFp8E4M3);
  // 4 steps, pools of q's dtype (the kPoolsSame build): the steps' r shared
  // by shuffles; heads of one lane (4 rounds of them).
  run_options_case("opt bf16 norm, 4 steps", 800, 32, 8, 128, bf16, 1, false, KV::kAuto, true,
                   true, true);
  run_options_case("opt bf16 norm D=16, 4 steps", 4200, 32, 8, 16, bf16, 1, false, KV::kAuto,
                   true, true, true);
  run_options_case("opt f16 strided table alone", 5, 4, 2, 64, f16, 2, false, KV::kAuto);
  run_options_case("opt f16 interleaved f32 pools", 5, 8, 2, 96, f16, 1, true, KV::kFloat32);
  run_options_case("opt f32 interleaved fp8", 4, 4, 2, 64, f32, 1, true, KV::kFp8E4M3);
  run_options_case("opt bf16 strided", 6, 4, 2, 64, bf16, 2, true, KV::kFp8E4M3);
  run_options_case("opt bf16 D=1024 (two-warp teams)", 3, 32, 4, 1024, bf16, 1, false,
                   KV::kFp8E4M3);
  run_options_case("opt f32 D=600 strided (wide head)", 2, 2, 1, 600, f32, 2, false,
                   KV::kFloat32);
  std::printf("%s: %d failure(s)\n", g_failures ? "FAIL" : "PASS", g_failures);
  return g_failures ? 1 : 0;
}
