// CPU benchmark of ropekv::rope_pool_fused (Google Benchmark).
//
// Shapes of real models (SPEC section 6), f32, bf16 and f16, T in
// {1, 16, 128, 1024, 8192}, 1 and 2 threads (ROPEKV_BENCH_THREADS below).
// Each row reports:
//
//   us_per_call  wall time of one call (also the benchmark's own Time column)
//   GB/s         SPEC section 7 bytes / time
//   memcpy_GB/s  a memcpy moving the same traffic (bytes/2 read, bytes/2
//                written), timed in the same benchmark right after the op, on
//                the same number of threads
//   vs_memcpy    GB/s / memcpy_GB/s
//   ntcopy_GB/s  the same copy with non-temporal stores (no read of the
//                destination before it is written): glibc 2.36's memcpy does
//                not stream at these sizes, so this is the machine's higher
//                copy ceiling, which ropekv's own streaming stores approach
//   pattern_GB/s (cold plain rows) the call's own rows copied with its store
//                policy and threads, no arithmetic (pattern_call below)
//   vs_pattern   GB/s / pattern_GB/s
//
// Cold caches, as in a serving engine where the pool is far larger than any
// cache and the previous layer has long evicted this one:
//   - the pools have at least kPoolMinBytes each (larger than the last-level
//     cache) and slots are a random permutation of their rows;
//   - every iteration uses the next of S input/output sets (q, k, v,
//     positions, slots, q_rot, k_rot), S chosen so that all sets together
//     are at least 2x the last-level cache: a small T call never finds its
//     inputs in a cache that a previous iteration warmed;
//   - the memcpy reference rotates over its buffers the same way;
//   - every buffer is on ordinary pages unless ROPEKV_BENCH_HUGE_PAGES asks
//     for transparent huge pages (see huge_pages below).
// The C++ API allocates nothing per call, so the loop times rope_pool_fused
// directly (validation included).
//
// The "warm" family (T = 1 and 16) is the decode case: q, k, v and the
// outputs reused (in cache, as right after the QKV projection), the pool rows
// still cold. The "hot" family (T = 1 and 16) has everything in cache:
// compute and call overhead, and the pool rows written back to memory
// (ropekv stores the rows of a pool this large non-temporally, in cache or
// not). Their memcpy reference copies one hot buffer.
//
// The "options" family times every option of the call (Llama-3.1-8B, bf16,
// cold) next to the plain call, "options-warm" the same at T = 1 warm,
// "options-hot" (bf16) and "options-hot-f16" at T = 16 hot (the options'
// arithmetic alone); their bytes count the pools at their real element size
// and the cos_sin_cache rows read.
//
// ROPEKV_BENCH_THREADS (a comma list, default 1,2) sets the thread counts of
// the cold and options families, e.g. 1,2,4,8,16 on a machine whose memory
// takes more than two cores to fill.
//
// Run:  build-bench/bench/ropekv_cpu_bench --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cold_protocol.h"
#include "common/fp_env.h"  // (the library's internal header: BM_IeeeFpScope)
#include "ropekv/ropekv.h"

namespace {

using bench::Buffer;
using bench::kModels;
using bench::Model;
using bench::Role;

DLTensor view(void* data, DLDataType dt, int ndim, int64_t* shape) {
  DLTensor t{};
  t.data = data;
  t.device = {kDLCPU, 0};
  t.ndim = ndim;
  t.dtype = dt;
  t.shape = shape;
  t.strides = nullptr;
  return t;
}

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// f16 bits of f, |f| < 1 (the inputs drawn below): rounded half up, below
// 2^-14 to a signed zero.
uint16_t to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
  if (a < 0x38800000u) return static_cast<uint16_t>(sign);
  return static_cast<uint16_t>(sign | ((a - 0x38000000u + 0x1000u) >> 13));
}

// The float formats of q, k, v and the outputs.
enum Dtype { kF32, kBF16, kF16 };
constexpr const char* kDtypeNames[] = {"f32", "bf16", "f16"};

// Cache states. kWarm: q, k, v, positions and the outputs are one set
// reused by every iteration (in cache, as right after the QKV projection of
// a decode step); the slots still name fresh random pool rows each call (the
// pool is cold). kHot: the slots too are one set (everything in cache: the
// compute and call overhead alone).
enum Cache { kCold, kWarm, kHot };

// The options of the call, for the "options/" family: each timed against the
// plain call of the same shape.
// fp8_pools has scale 0.5 (a power of two: the writer multiplies by 2);
// fp8_pools_0.37 a scale whose reciprocal is not exact, as calibrated scales
// are.
enum Option { kPlain, kInterleaved, kLlama3, kYarn, kCosSinCache, kQkNorm, kF32Pools, kFp8Pools,
              kQwen3Like, kFp8AnyScale, kProportional, kQkNormF32Pools, kNumOptions };
constexpr const char* kOptionNames[] = {"plain",  "interleaved", "llama3",      "yarn",
                                        "cos_sin_cache", "qk_norm", "f32_pools", "fp8_pools",
                                        "qknorm+fp8+yarn", "fp8_pools_0.37", "proportional",
                                        "qknorm+f32_pools"};
static_assert(std::size(kOptionNames) == kNumOptions);
constexpr int64_t kCacheRows = 131072;  // positions are below 128k

// The access pattern of a plain call without its arithmetic: each token's q
// and k rows copied to q_rot and k_rot, its k and v rows to the pool rows its
// slot names, with ropekv's store policy (src/cpu: the rows of a pool of at
// least 8 MiB non-temporal; q_rot and k_rot too once a call writes 8 MiB,
// else ordinary stores, which read each cold line before writing it), on
// the threads ropekv would take (64 KiB per thread at least; contiguous
// token ranges). What the call could reach if its arithmetic were free: the
// "pattern" counters, a reference for the memory side alone (omp.h and the
// copy come with cold_protocol.h, which requires OpenMP).
void pattern_call(const ropekv::RopePoolTensors& a, int64_t T, int64_t q_row, int64_t k_row,
                  bool stream_out, int threads) {
  auto tokens = [&](int64_t t0, int64_t t1) {
    const int32_t* slots = static_cast<const int32_t*>(a.slots.data);
    const auto* q = static_cast<const uint8_t*>(a.q.data);
    const auto* k = static_cast<const uint8_t*>(a.k.data);
    const auto* v = static_cast<const uint8_t*>(a.v.data);
    auto* q_rot = static_cast<uint8_t*>(a.q_rot.data);
    auto* k_rot = static_cast<uint8_t*>(a.k_rot.data);
    auto* k_pool = static_cast<uint8_t*>(a.k_pool.data);
    auto* v_pool = static_cast<uint8_t*>(a.v_pool.data);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t row = slots[t];
      bench::copy16(q_rot + t * q_row, q + t * q_row, q_row, stream_out);
      bench::copy16(k_rot + t * k_row, k + t * k_row, k_row, stream_out);
      bench::copy16(k_pool + row * k_row, k + t * k_row, k_row, true);
      bench::copy16(v_pool + row * k_row, v + t * k_row, k_row, true);
    }
    bench::store_fence();
  };
  if (threads <= 1) return tokens(0, T);
#pragma omp parallel num_threads(threads)
  {
    const int64_t i = omp_get_thread_num(), n = omp_get_num_threads();
    tokens(T * i / n, T * (i + 1) / n);
  }
}

// Seconds per call of pattern_call over the rotating sets (best of 5 runs
// of min_seconds / 5 each, as the copy references).
double pattern_seconds_per_call(const std::vector<ropekv::RopePoolTensors>& calls, int64_t T,
                                int64_t q_row, int64_t k_row, int64_t bytes, int threads,
                                double min_seconds) {
  const bool stream_out = T * (q_row + 3 * k_row) >= (int64_t{8} << 20);
  const int nt = static_cast<int>(
      std::min<int64_t>({threads, std::max<int64_t>(1, bytes / (64 * 1024)), T}));
  for (const auto& a : calls) pattern_call(a, T, q_row, k_row, stream_out, nt);  // warm-up
  double best = 1e30;
  const int64_t sets = static_cast<int64_t>(calls.size());
  for (int rep = 0; rep < 5; ++rep) {
    int64_t iters = 0, c = 0;
    const auto t0 = std::chrono::steady_clock::now();
    double el = 0;
    do {
      pattern_call(calls[c], T, q_row, k_row, stream_out, nt);
      c = (c + 1) % sets;
      ++iters;
      el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } while (el < min_seconds / 5);
    best = std::min(best, el / static_cast<double>(iters));
  }
  return best;
}

// One benchmark's arrays and calls: pools, the rotating input/output and
// slot sets (bench/cold_protocol.h), the option's tensors and config.
struct Fixture {
  std::string key;  // what it was built for (see fixture() below)
  Buffer k_pool, v_pool, q, k, v, q_rot, k_rot, pos, slot, table, weight;
  int64_t shapes[6][3] = {};  // q, k, pool, positions/slots, cos_sin_cache, norm weight
  std::vector<ropekv::RopePoolTensors> calls;
  ropekv::RopeConfig cfg;
  int64_t bytes = 0;  // SPEC section 7, the pools at their element size
};

// The fixture of (m, dtype, T, cache, option), built on first use and kept
// while the same one is asked for: Google Benchmark calls a benchmark
// function several times while it settles the iteration count, and building
// (first-touching more than twice the last-level cache, filling it with
// random values) takes longer than timing on a large host.
const Fixture& fixture(const Model& m, Dtype dtype, int64_t T, Cache cache, Option option) {
  static std::unique_ptr<Fixture> kept;
  std::string key = std::string(m.name) + "/" + kDtypeNames[dtype] + "/" + std::to_string(T) + "/" +
                    std::to_string(cache) + "/" + std::to_string(option);
  if (kept && kept->key == key) return *kept;
  kept.reset();  // free the previous fixture's memory before allocating this one
  auto f = std::make_unique<Fixture>();
  f->key = std::move(key);
  const bool warm = cache != kCold;
  const int64_t E = dtype == kF32 ? 4 : 2;
  const DLDataType dt = dtype == kF32    ? DLDataType{kDLFloat, 32, 1}
                        : dtype == kBF16 ? DLDataType{kDLBfloat, 16, 1}
                                         : DLDataType{kDLFloat, 16, 1};
  const int64_t EP = option == kF32Pools || option == kQkNormF32Pools                  ? 4
                     : option == kFp8Pools || option == kQwen3Like || option == kFp8AnyScale ? 1
                                                                                         : E;
  const DLDataType pool_dt = EP == E ? dt
                             : EP == 4 ? DLDataType{kDLFloat, 32, 1}
                                       : DLDataType{kDLUInt, 8, 1};

  const int64_t row_bytes = m.hk * m.d * EP;
  const int64_t q_elems = T * m.hq * m.d, k_elems = T * m.hk * m.d;
  const bench::ColdLayout lay =
      bench::cold_layout(T, row_bytes, E * (2 * q_elems + 3 * k_elems) + 8 * T, warm,
                         cache == kHot);
  const int64_t P = lay.P, in_sets = lay.in_sets, slot_sets = lay.slot_sets, sets = lay.sets();
  f->k_pool = Buffer(P * row_bytes, Role::kPool);
  f->v_pool = Buffer(P * row_bytes, Role::kPool);
  f->q = Buffer(in_sets * q_elems * E);
  f->k = Buffer(in_sets * k_elems * E);
  f->v = Buffer(in_sets * k_elems * E);
  f->q_rot = Buffer(in_sets * q_elems * E);
  f->k_rot = Buffer(in_sets * k_elems * E);
  f->pos = Buffer(in_sets * T * 4);
  f->slot = Buffer(slot_sets * T * 4);
  std::mt19937_64 rng(1234);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  // Random values in [-1, 1): the first 2^20 drawn, the rest copies of them
  // (the kernels' time does not depend on the values, and drawing a buffer
  // of twice the last-level cache one value at a time dominates the set-up).
  auto fill = [&](const Buffer& b, int64_t n) {
    const int64_t drawn = std::min<int64_t>(n, int64_t{1} << 20);
    for (int64_t i = 0; i < drawn; ++i) {
      const float x = uni(rng);
      if (dtype == kF32) reinterpret_cast<float*>(b.get())[i] = x;
      else reinterpret_cast<uint16_t*>(b.get())[i] = dtype == kBF16 ? to_bf16(x) : to_f16(x);
    }
    for (int64_t i = drawn; i < n; i += drawn)
      std::memcpy(b.get() + i * E, b.get(), static_cast<size_t>(std::min(drawn, n - i) * E));
  };
  fill(f->q, in_sets * q_elems);
  fill(f->k, in_sets * k_elems);
  fill(f->v, in_sets * k_elems);
  bench::fill_slots_and_positions(lay, T, reinterpret_cast<int32_t*>(f->slot.get()),
                                  reinterpret_cast<int32_t*>(f->pos.get()), rng);

  int64_t* sq = f->shapes[0];
  int64_t* sk = f->shapes[1];
  int64_t* sp = f->shapes[2];
  int64_t* s1 = f->shapes[3];
  int64_t* s_cache = f->shapes[4];
  int64_t* s_w = f->shapes[5];
  sq[0] = sk[0] = s1[0] = T;
  sq[1] = m.hq;
  sk[1] = sp[1] = m.hk;
  sq[2] = sk[2] = sp[2] = s_cache[1] = s_w[0] = m.d;
  sp[0] = P;
  s_cache[0] = kCacheRows;
  const DLDataType i32{kDLInt, 32, 1};
  f->calls.resize(sets);
  for (int64_t c = 0; c < sets; ++c) {
    const int64_t s = c % in_sets, ss = c % slot_sets;
    auto& a = f->calls[c];
    a.q = view(f->q.get() + s * q_elems * E, dt, 3, sq);
    a.k = view(f->k.get() + s * k_elems * E, dt, 3, sk);
    a.v = view(f->v.get() + s * k_elems * E, dt, 3, sk);
    a.positions = view(f->pos.get() + s * T * 4, i32, 1, s1);
    a.slots = view(f->slot.get() + ss * T * 4, i32, 1, s1);
    a.k_pool = view(f->k_pool.get(), pool_dt, 3, sp);
    a.v_pool = view(f->v_pool.get(), pool_dt, 3, sp);
    a.q_rot = view(f->q_rot.get() + s * q_elems * E, dt, 3, sq);
    a.k_rot = view(f->k_rot.get() + s * k_elems * E, dt, 3, sk);
  }
  ropekv::RopeConfig& cfg = f->cfg;
  cfg.head_dim = m.d;
  cfg.num_qo_heads = m.hq;
  cfg.num_kv_heads = m.hk;
  cfg.rope_base = m.base;

  // The option under test: its config fields and optional tensors.
  int64_t extra = 0;  // bytes an option reads per token
  f->weight = Buffer(m.d * 4);
  for (int64_t i = 0; i < m.d; ++i) reinterpret_cast<float*>(f->weight.get())[i] = 1.0f + uni(rng);
  const DLDataType f32{kDLFloat, 32, 1};
  const DLTensor weight = view(f->weight.get(), f32, 1, s_w);
  ropekv::RopeScaling yarn;
  yarn.type = ropekv::RopeScalingType::kYarn;
  yarn.factor = 4.0;
  yarn.original_max_position_embeddings = 32768;
  switch (option) {
    case kPlain: break;
    case kInterleaved: cfg.is_neox = false; break;
    case kLlama3:
      cfg.rope_scaling.type = ropekv::RopeScalingType::kLlama3;
      cfg.rope_scaling.factor = 8.0;
      cfg.rope_scaling.low_freq_factor = 1.0;
      cfg.rope_scaling.high_freq_factor = 4.0;
      cfg.rope_scaling.original_max_position_embeddings = 8192;
      break;
    case kYarn: cfg.rope_scaling = yarn; break;
    case kProportional:  // (Gemma-4's full-attention layers: a quarter of the pairs rotate)
      cfg.rope_scaling.type = ropekv::RopeScalingType::kProportional;
      cfg.rope_scaling.partial_rotary_factor = 0.25;
      break;
    case kCosSinCache: {
      f->table = Buffer(kCacheRows * m.d * 4);
      float* tab = reinterpret_cast<float*>(f->table.get());
      for (int64_t i = 0; i < kCacheRows * m.d; ++i) tab[i] = uni(rng);
      extra = m.d * 4;
      for (auto& a : f->calls) a.cos_sin_cache = view(f->table.get(), f32, 2, s_cache);
      break;
    }
    case kQkNorm:
      for (auto& a : f->calls) a.q_norm_weight = a.k_norm_weight = weight;
      break;
    case kF32Pools: cfg.kv_cache_dtype = ropekv::KvCacheDtype::kFloat32; break;
    case kQkNormF32Pools:
      cfg.kv_cache_dtype = ropekv::KvCacheDtype::kFloat32;
      for (auto& a : f->calls) a.q_norm_weight = a.k_norm_weight = weight;
      break;
    case kFp8Pools:
      cfg.kv_cache_dtype = ropekv::KvCacheDtype::kFp8E4M3;
      cfg.k_scale = cfg.v_scale = 0.5;
      break;
    case kFp8AnyScale:
      cfg.kv_cache_dtype = ropekv::KvCacheDtype::kFp8E4M3;
      cfg.k_scale = cfg.v_scale = 0.37;
      break;
    case kQwen3Like:
      cfg.rope_scaling = yarn;
      cfg.kv_cache_dtype = ropekv::KvCacheDtype::kFp8E4M3;
      cfg.k_scale = cfg.v_scale = 0.5;
      for (auto& a : f->calls) a.q_norm_weight = a.k_norm_weight = weight;
      break;
  }
  f->bytes = bench::spec_bytes(m, T, E, EP, extra);
  kept = std::move(f);
  return *kept;
}

void BM_RopePool(benchmark::State& state, Model m, Dtype dtype, int threads, Cache cache,
                 Option option) {
  const bool warm = cache != kCold;
  const int64_t T = state.range(0);
  const Fixture& f = fixture(m, dtype, T, cache, option);
  const auto& calls = f.calls;
  const int64_t sets = static_cast<int64_t>(calls.size());
  ropekv::ExecOptions opt;
  opt.num_threads = threads;

  for (const auto& a : calls) ropekv::rope_pool_fused(a, f.cfg, opt);  // warm-up

  int64_t c = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    ropekv::rope_pool_fused(calls[c], f.cfg, opt);
    if (++c == sets) c = 0;
  }
  const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  bench::set_counters(state, f.bytes, T, threads, warm, el);
  state.counters["sets"] = static_cast<double>(sets);
  if (cache == kCold && option == kPlain) {
    const double per_call = el / static_cast<double>(state.iterations());
    const int64_t E = dtype == kF32 ? 4 : 2;
    const double ps = pattern_seconds_per_call(calls, T, m.hq * m.d * E, m.hk * m.d * E, f.bytes,
                                               threads, std::clamp(el, 0.05, 0.5));
    state.counters["pattern_GB/s"] = static_cast<double>(f.bytes) / ps * 1e-9;
    state.counters["vs_pattern"] = ps / per_call;
  }
  state.SetLabel(ropekv::cpu_target());
}

// The contract check alone (ropekv::validate) of a Llama-3.1-8B bf16 call
// of T tokens on the CPU: what every call pays before its kernel, slots
// read included.
void BM_Validate(benchmark::State& state) {
  const Model& m = kModels[0];
  const int64_t T = state.range(0), P = 4096;
  const DLDataType bf16{kDLBfloat, 16, 1}, i32{kDLInt, 32, 1};
  int64_t sq[3] = {T, m.hq, m.d}, sk[3] = {T, m.hk, m.d}, sp[3] = {P, m.hk, m.d}, si[1] = {T};
  Buffer q(T * m.hq * m.d * 2), k(T * m.hk * m.d * 2), v(T * m.hk * m.d * 2);
  Buffer q_rot(T * m.hq * m.d * 2), k_rot(T * m.hk * m.d * 2);
  Buffer k_pool(P * m.hk * m.d * 2), v_pool(P * m.hk * m.d * 2), pos(T * 4), slot(T * 4);
  for (int64_t i = 0; i < T; ++i) {
    reinterpret_cast<int32_t*>(pos.get())[i] = static_cast<int32_t>(i);
    reinterpret_cast<int32_t*>(slot.get())[i] = static_cast<int32_t>(i % P);
  }
  auto view = [](const Buffer& b, DLDataType dt, int nd, int64_t* shape) {
    DLTensor t{};
    t.data = b.get();
    t.device = {kDLCPU, 0};
    t.ndim = nd;
    t.dtype = dt;
    t.shape = shape;
    return t;
  };
  ropekv::RopePoolTensors t{};
  t.q = view(q, bf16, 3, sq);
  t.k = view(k, bf16, 3, sk);
  t.v = view(v, bf16, 3, sk);
  t.positions = view(pos, i32, 1, si);
  t.slots = view(slot, i32, 1, si);
  t.k_pool = view(k_pool, bf16, 3, sp);
  t.v_pool = view(v_pool, bf16, 3, sp);
  t.q_rot = view(q_rot, bf16, 3, sq);
  t.k_rot = view(k_rot, bf16, 3, sk);
  ropekv::RopeConfig cfg;
  cfg.head_dim = m.d;
  cfg.num_qo_heads = m.hq;
  cfg.num_kv_heads = m.hk;
  cfg.rope_base = m.base;
  for (auto _ : state) ropekv::validate(t, cfg);
}

// What every call pays for its floating-point environment
// (src/common/fp_env.h: one IeeeFpScope on the calling thread and one per
// thread of a CPU team): caller_ftz 0, the caller already in IEEE's default
// (two control-register reads); 1, a caller with flush-to-zero and
// denormals-are-zero set (PyTorch's set_flush_denormal(True)): two writes more.
void BM_IeeeFpScope(benchmark::State& state) {
#if defined(ROPEKV_FP_ENV_SSE)
  const unsigned int caller = _mm_getcsr();
  if (state.range(0)) _mm_setcsr(caller | 0x8040u);  // FTZ (bit 15), DAZ (bit 6)
  for (auto _ : state) {
    const ropekv::IeeeFpScope scope;
    benchmark::ClobberMemory();
  }
  _mm_setcsr(caller);
#else
  state.SkipWithError("x86 only");
#endif
}

// The thread counts of the cold and options families: ROPEKV_BENCH_THREADS
// (positive counts, comma-separated), else 1 and 2.
std::vector<int> bench_threads() {
  std::vector<int> counts;
  if (const char* e = std::getenv("ROPEKV_BENCH_THREADS")) {
    for (const char* c = e; *c != 0;) {
      char* end = nullptr;
      const long n = std::strtol(c, &end, 10);
      if (end == c) break;
      if (n > 0) counts.push_back(static_cast<int>(n));
      c = *end == ',' ? end + 1 : end;
    }
  }
  if (counts.empty()) counts = {1, 2};
  return counts;
}

void register_all() {
  const std::vector<int> thread_counts = bench_threads();
  benchmark::RegisterBenchmark("validate/Llama-3.1-8B/bf16", BM_Validate)
      ->ArgName("T")->Arg(1)->Arg(128)->UseRealTime()->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("fp_env/IeeeFpScope", BM_IeeeFpScope)
      ->ArgName("caller_ftz")->Arg(0)->Arg(1)->Unit(benchmark::kNanosecond);
  for (const Model& m : kModels) {
    for (Dtype dtype : {kF32, kBF16, kF16}) {
      for (int threads : thread_counts) {
        for (Cache cache : {kCold, kWarm, kHot}) {
          const char* family = cache == kCold ? "cold/" : cache == kWarm ? "warm/" : "hot/";
          const std::string name = std::string(family) + m.name + "/" + kDtypeNames[dtype] +
                                   "/threads:" + std::to_string(threads);
          auto* b = benchmark::RegisterBenchmark(name.c_str(), BM_RopePool, m, dtype, threads,
                                                 cache, kPlain);
          b->ArgName("T")->UseRealTime()->Unit(benchmark::kMicrosecond);
          if (cache == kCold)
            b->Arg(1)->Arg(16)->Arg(128)->Arg(1024)->Arg(8192);
          else if (cache == kWarm)
            b->Arg(1)->Arg(16);
          else
            b->Arg(1)->Arg(16);
        }
      }
    }
  }
  // Each option next to the plain call: Llama-3.1-8B, bf16, cold caches.
  for (int threads : thread_counts) {
    for (int o = kPlain; o < kNumOptions; ++o) {
      const std::string name = std::string("options/") + kOptionNames[o] + "/threads:" +
                               std::to_string(threads);
      auto* b = benchmark::RegisterBenchmark(name.c_str(), BM_RopePool, kModels[0], kBF16,
                                             threads, kCold, static_cast<Option>(o));
      b->ArgName("T")->UseRealTime()->Unit(benchmark::kMicrosecond);
      b->Arg(1)->Arg(128)->Arg(1024)->Arg(8192);
    }
  }
  // Each option's compute alone: Llama-3.1-8B bf16 ("options-hot") and f16
  // ("options-hot-f16": its own conversions, and fp8 codes from f16 bits), one
  // thread, every array in cache (the "hot" family), T = 16 (426 KB a call).
  for (Dtype dtype : {kBF16, kF16}) {
    for (int o = kPlain; o < kNumOptions; ++o) {
      const std::string name = std::string(dtype == kBF16 ? "options-hot/" : "options-hot-f16/") +
                               kOptionNames[o] + "/threads:1";
      auto* b = benchmark::RegisterBenchmark(name.c_str(), BM_RopePool, kModels[0], dtype, 1,
                                             kHot, static_cast<Option>(o));
      b->ArgName("T")->UseRealTime()->Unit(benchmark::kMicrosecond)->Arg(16);
    }
  }
  // The decode case of each option (T = 1, one thread, warm as the "warm"
  // family).
  for (int o = kPlain; o < kNumOptions; ++o) {
    const std::string name = std::string("options-warm/") + kOptionNames[o] + "/threads:1";
    auto* b = benchmark::RegisterBenchmark(name.c_str(), BM_RopePool, kModels[0], kBF16, 1, kWarm,
                                           static_cast<Option>(o));
    b->ArgName("T")->UseRealTime()->Unit(benchmark::kMicrosecond)->Arg(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("ropekv_cpu_target", ropekv::cpu_target());
  benchmark::AddCustomContext("llc_bytes", std::to_string(bench::llc_bytes()));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
