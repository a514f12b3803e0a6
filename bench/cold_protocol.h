// The cold-cache protocol shared by the CPU benchmarks (bench/cpu_bench.cc,
// ropekv's call; bench/ggml/ggml_peer.cc, ggml doing the same step): the
// model shapes, the buffers, SPEC section 7's byte count, the sizes of the
// pools and of the rotating input/output sets, the slots and positions of
// each set, and the same-process copy that the ratios are taken against.
#pragma once

#include <benchmark/benchmark.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace bench {

struct Model {
  const char* name;
  int64_t hq, hk, d;
  double base;
};

inline constexpr Model kModels[] = {
    {"Llama-3.1-8B", 32, 8, 128, 500000.0},
    {"Qwen2.5-7B", 28, 4, 128, 1000000.0},
    {"Gemma-2-9B", 16, 8, 256, 10000.0},
};

// Size of the last-level cache, from sysfs (sysconf's value is wrong in some
// VMs); 32 MiB when unknown.
inline int64_t llc_bytes() {
  int64_t best = 0;
  for (int i = 0; i < 8; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i);
    std::ifstream f(dir + "/size");
    std::string v;
    if (!(f >> v) || v.empty()) continue;
    int64_t n = std::atoll(v.c_str());
    if (v.back() == 'K') n <<= 10;
    if (v.back() == 'M') n <<= 20;
    best = std::max(best, n);
  }
  return best > 0 ? best : int64_t{32} << 20;
}

// ROPEKV_BENCH_HUGE_PAGES=all (or 1), pools or io: the benchmark's buffers of
// 2 MiB and more (all of them, the two pools, or the input/output sets) are
// 2 MiB aligned and asked for transparent huge pages (madvise) before their
// first touch, to measure what the TLB costs the cold calls: by default, where
// THP is "madvise", none of them is on huge pages.
enum class Role { kPool, kIo };
inline bool huge_pages(Role role) {
  static const std::string mode = [] {
    const char* e = std::getenv("ROPEKV_BENCH_HUGE_PAGES");
    return std::string(e == nullptr ? "" : e);
  }();
  return mode == "all" || mode == "1" || (mode == "pools" && role == Role::kPool) ||
         (mode == "io" && role == Role::kIo);
}

// 64-byte aligned, zero-initialised (pages touched) buffer.
struct Buffer {
  std::unique_ptr<uint8_t, decltype(&std::free)> p{nullptr, &std::free};
  size_t n = 0;
  explicit Buffer(size_t bytes = 0, Role role = Role::kIo) {
    n = std::max<size_t>(bytes, 64);
    constexpr size_t kHuge = size_t{2} << 20;
    if (huge_pages(role) && n >= kHuge) {
      const size_t padded = (n + kHuge - 1) / kHuge * kHuge;
      p.reset(static_cast<uint8_t*>(std::aligned_alloc(kHuge, padded)));
      // (A refusal would leave 4 KiB pages under a huge-page label: say so.)
      if (madvise(p.get(), padded, MADV_HUGEPAGE) != 0) std::perror("madvise(MADV_HUGEPAGE)");
    } else {
      p.reset(static_cast<uint8_t*>(std::aligned_alloc(64, (n + 63) / 64 * 64)));
    }
    std::memset(p.get(), 0, n);
  }
  uint8_t* get() const { return p.get(); }
};

// SPEC section 7: E * (2*T*Hq*D + 3*T*Hk*D) + EP * 2*W*Hk*D + T * (4 + 4),
// EP the pools' element size, plus what an option reads per token.
inline int64_t spec_bytes(const Model& m, int64_t T, int64_t E, int64_t EP = 0, int64_t extra = 0) {
  if (EP == 0) EP = E;
  return E * (2 * T * m.hq * m.d + 3 * T * m.hk * m.d) + EP * 2 * T * m.hk * m.d + T * 8 +
         T * extra;
}

// Copies n bytes (n a multiple of 16) in 16-byte vectors: with `stream`
// non-temporal stores (no read-for-ownership of the destination, which must
// be 16-byte aligned; store_fence() orders them), else ordinary ones.
inline void copy16(uint8_t* d, const uint8_t* s, size_t n, bool stream) {
#if defined(__SSE2__)
  for (size_t i = 0; i + 16 <= n; i += 16) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    if (stream) _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), x);
    else _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), x);
  }
#else
  (void)stream;
  std::memcpy(d, s, n);
#endif
}

inline void store_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// A non-temporal-store copy of n bytes (both 16-byte aligned, n a multiple
// of 16), fenced.
inline void stream_copy(uint8_t* d, const uint8_t* s, size_t n) {
  copy16(d, s, n, true);
  store_fence();
}

// Timed copy of `n` bytes per call (glibc's memcpy, or with `stream` a
// non-temporal-store copy), rotating over `sets` buffer pairs, on `threads`
// threads (each piece at least 64 KiB, as ropekv's own rule).
inline double memcpy_seconds_per_call(size_t n, int threads, int64_t sets, double min_seconds,
                               bool stream = false) {
  if (stream) n = n / 64 * 64;
  auto cp = [stream](uint8_t* d, const uint8_t* s, size_t k) {
    if (stream) stream_copy(d, s, k);
    else std::memcpy(d, s, k);
  };
  // Kept for the process and grown as needed: every timed row takes two
  // copy references, and first-touching 2x the last-level cache anew for
  // each takes longer than timing them on a large host.
  static Buffer src, dst;
  if (src.n < n * sets) {
    src = Buffer();  // free before allocating the larger pair
    dst = Buffer();
    src = Buffer(n * sets);
    dst = Buffer(n * sets);
    std::memset(src.get(), 1, n * sets);
  }
  const int64_t by_size = std::max<int64_t>(1, static_cast<int64_t>(n) / (64 * 1024));
  const int nt = static_cast<int>(std::min<int64_t>(threads, by_size));
  auto copy = [&](int64_t s) {
    uint8_t* d = dst.get() + s * n;
    const uint8_t* sp = src.get() + s * n;
    if (nt <= 1) {
      cp(d, sp, n);
      return;
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
    {
      const int i = omp_get_thread_num(), k = omp_get_num_threads();
      const size_t chunk = (n / k + 63) / 64 * 64;
      const size_t b = std::min(n, chunk * i), e = std::min(n, b + chunk);
      if (e > b) cp(d + b, sp + b, e - b);
    }
#else
#error "the copy reference needs OpenMP for its threads"
#endif
  };
  for (int64_t s = 0; s < sets; ++s) copy(s);  // warm-up (page faults)
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    int64_t iters = 0, s = 0;
    const auto t0 = std::chrono::steady_clock::now();
    double el = 0;
    do {
      copy(s);
      s = (s + 1) % sets;
      ++iters;
      if ((iters & 7) == 0 || n > (1 << 20))
        el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } while (el < min_seconds / 5);
    el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, el / iters);
  }
  return best;
}

// The sizes of one shape's cold protocol: pools of P rows (each at least 2x
// the last-level cache, and at least 2T rows); in_sets input/output sets (q,
// k, v, positions, q_rot, k_rot) and slot_sets slot sets, each family of sets
// together at least 2x the last-level cache, so that a call never finds its
// inputs or its pool rows in a cache an earlier call warmed. warm: one
// input/output set (decode: in cache right after the QKV projection); hot:
// one slot set too (everything in cache).
struct ColdLayout {
  int64_t P = 0, in_sets = 1, slot_sets = 1;
  int64_t sets() const { return std::max(in_sets, slot_sets); }
};

inline ColdLayout cold_layout(int64_t T, int64_t row_bytes, int64_t set_bytes, bool warm,
                              bool hot) {
  const int64_t llc = llc_bytes();
  ColdLayout c;
  c.P = std::max<int64_t>(2 * T, (2 * llc + row_bytes - 1) / row_bytes);
  c.in_sets = warm ? 1 : std::clamp<int64_t>((2 * llc + set_bytes - 1) / set_bytes, 1, 8192);
  c.slot_sets =
      hot ? 1
          : std::clamp<int64_t>((2 * llc + 2 * T * row_bytes - 1) / (2 * T * row_bytes), 1, 8192);
  return c;
}

// Slots: consecutive chunks of random permutations of the P pool rows (each
// call's slots distinct), slot_sets sets of T; then positions: T consecutive
// positions from a random start below 128k, in_sets sets of T.
inline void fill_slots_and_positions(const ColdLayout& c, int64_t T, int32_t* slots,
                                     int32_t* positions, std::mt19937_64& rng) {
  std::vector<int32_t> perm(c.P);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  int64_t next = 0;
  for (int64_t s = 0; s < c.slot_sets; ++s) {
    if (next + T > c.P) {
      std::shuffle(perm.begin(), perm.end(), rng);
      next = 0;
    }
    for (int64_t t = 0; t < T; ++t) slots[s * T + t] = perm[next++];
  }
  std::uniform_int_distribution<int32_t> pos_dist(0, 131071);
  for (int64_t s = 0; s < c.in_sets; ++s) {
    const int32_t p0 = pos_dist(rng);
    for (int64_t t = 0; t < T; ++t) positions[s * T + t] = p0 + static_cast<int32_t>(t);
  }
}

// The counters of one timed row (el seconds over state.iterations() calls
// moving `bytes`, SPEC section 7) and its same-process copy references:
// glibc's memcpy and a non-temporal-store copy of the same traffic (bytes/2
// read, bytes/2 written) on the same threads, cold (rotating buffers, 2x the
// last-level cache) or, for warm rows, one hot buffer pair.
//   us_per_call, us_per_token, GB/s, memcpy_GB/s, vs_memcpy, ntcopy_GB/s
inline void set_counters(benchmark::State& state, int64_t bytes, int64_t T, int threads,
                         bool warm, double el) {
  const double per_call = el / static_cast<double>(state.iterations());
  const int64_t llc = llc_bytes();
  const int64_t sets = warm ? 1 : std::clamp<int64_t>((2 * llc + bytes - 1) / bytes, 1, 8192);
  const double min_s = std::clamp(el, 0.05, 0.5);
  const double mc = memcpy_seconds_per_call(static_cast<size_t>(bytes / 2), threads, sets, min_s);
  const double nt =
      memcpy_seconds_per_call(static_cast<size_t>(bytes / 2), threads, sets, min_s, true);
  state.counters["us_per_call"] = per_call * 1e6;
  state.counters["us_per_token"] = per_call * 1e6 / static_cast<double>(T);
  state.counters["GB/s"] = static_cast<double>(bytes) / per_call * 1e-9;
  state.counters["memcpy_GB/s"] = static_cast<double>(2 * (bytes / 2)) / mc * 1e-9;
  state.counters["vs_memcpy"] = mc / per_call;
  state.counters["ntcopy_GB/s"] = static_cast<double>(2 * (bytes / 2 / 64 * 64)) / nt * 1e-9;
}

}  // namespace bench
