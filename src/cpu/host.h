// Host-side helpers of the CPU backend shared by its plain path
// (rope_pool_cpu.cc) and its options path (rope_options_cpu.cc): thresholds,
// the per-thread inv_freq table and scratch.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "common/fp_env.h"
#include "common/inv_freq.h"
#include "cpu/scratch.h"
#include "problem.h"

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#endif

namespace ropekv {
namespace cpu {
namespace host {

// Whether this CPU has AVX512_BF16 (CPUID leaf 7 subleaf 1, EAX bit 5): the
// AVX3 targets' bf16 stores use VCVTNEPS2BF16 then (BF16Native).
inline bool cpu_has_avx512_bf16() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
    return ((a >> 5) & 1) != 0;
  }();
  return has;
#else
  return false;
#endif
}

// Below this many bytes per call, a thread team costs more than it saves.
constexpr int64_t kMinBytesPerThread = 64 * 1024;

// From this many bytes written per call on, outputs are stored non-temporally
// (as glibc's memcpy does above a fraction of the last-level cache): they
// would evict each other before use, and streaming skips reading every
// output line before writing it. The plain path also streams the rows of a
// pool of at least this many bytes at any T: such a pool is taken as not in
// cache.
constexpr int64_t kStreamMinBytes = 8 << 20;

// Whether the rows of a large pool are stored non-temporally at any T (see
// LargePool). For tuning and A/B measurements, read once:
// ROPEKV_CPU_STREAM_POOLS=0 turns it off.
inline bool stream_pools_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("ROPEKV_CPU_STREAM_POOLS");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  return on;
}

// Largest vector of any compiled target, in fp32 lanes (AVX-512): scratch is
// padded to it (checked per target in rope_options-inl.h).
constexpr int64_t kPad = 16;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// inv_freq of the last frequency spec seen by this thread, padded with zeros
// to a whole vector: pow() per call would cost more than a decode step's data
// movement.
inline const float* inv_freq_table(const FreqSpec& spec) {
  thread_local std::vector<float> table;
  thread_local FreqSpec seen{-1.0, -1, {}};
  if (seen != spec) {
    table.assign(round_up(spec.rotary_dim / 2, kPad), 0.0f);
    fill_inv_freq(spec, table.data());
    seen = spec;
  }
  return table.data();
}

// This thread's index in the team of the call it works for (0: the caller),
// set by run_planned: not omp_get_thread_num(), which for a caller that is
// itself a thread of its own program's OpenMP team is its index there.
inline thread_local int team_index = 0;

// The scratch of every thread of a call's team, in one buffer of the calling
// thread, grown on demand and reused by its later calls. Made before the team
// starts: a std::bad_alloc there raises with every array as it was, where in
// a team thread it would end the process (an exception cannot leave an
// OpenMP region).
class TeamScratch {
 public:
  /// Room for `threads` scratches of p's sizes (may throw std::bad_alloc).
  void reserve(const Problem& p, int threads) {
    hp_ = round_up(p.rotary_dim / 2, kPad);
    rp_ = round_up(p.rotary_dim, kPad);
    dp_ = round_up(p.head_dim, kPad);
    const int64_t hr = round_up(std::max(p.num_qo_heads, p.num_kv_heads), kPad);
    each_ = 2 * rp_ + 3 * hp_ + 3 * dp_ + hr + 64;
    const size_t need = static_cast<size_t>(each_ * std::max(threads, 1));
    if (buf_.size() < need) buf_.resize(need);
  }
  /// This thread's scratch (team_index), in a team or on the caller.
  Scratch mine() { return of(team_index); }
  /// The scratch of thread i of the team (0: the caller's).
  Scratch of(int i) {
    float* b = buf_.data() + static_cast<int64_t>(i) * each_;
    Scratch sc;
    sc.cos = b;
    sc.sin = b + rp_;
    sc.theta = b + 2 * rp_;
    sc.row_in = b + 2 * rp_ + hp_;
    sc.row_out = b + 2 * rp_ + hp_ + dp_;
    sc.half_cos = b + 2 * rp_ + hp_ + 2 * dp_;
    sc.half_sin = b + 2 * rp_ + 2 * hp_ + 2 * dp_;
    sc.row_pool = b + 2 * rp_ + 3 * hp_ + 2 * dp_;
    sc.head_r = b + 2 * rp_ + 3 * hp_ + 3 * dp_;
    return sc;
  }

 private:
  std::vector<float> buf_;
  int64_t hp_ = 0, rp_ = 0, dp_ = 0, each_ = 0;
};

// The calling thread's TeamScratch, reserved for `threads` threads of p.
inline TeamScratch& team_scratch(const Problem& p, int threads) {
  thread_local TeamScratch sc;
  sc.reserve(p, threads);
  return sc;
}


// The most threads a call starts: four per processor, at least 64. More
// only cost their creation (the results do not depend on the count), and a
// team of a million threads makes OpenMP abort the process.
inline int64_t max_threads() {
#ifdef _OPENMP
  // (Asked once: omp_get_num_procs is a system call.)
  static const int64_t cap = std::max<int64_t>(64, 4 * static_cast<int64_t>(omp_get_num_procs()));
  return cap;
#else
  return 1;
#endif
}

// GNU OpenMP's threads do not survive fork(): in a child forked after the
// parent started a team, the child's first team waits forever for them.
// team_started: a call of this process started a team (run_planned);
// forked_after_team: this process is such a child, whose calls run on one
// thread (plan_threads).
inline std::atomic<bool> team_started{false};
inline std::atomic<bool> forked_after_team{false};
inline bool in_child_forked_after_team() {
#if defined(__unix__) || defined(__APPLE__)
  // (Registered before the first team: plan_threads runs first.)
  static const bool registered = [] {
    pthread_atfork(nullptr, nullptr, [] {
      if (team_started.load(std::memory_order_relaxed))
        forked_after_team.store(true, std::memory_order_relaxed);
    });
    return true;
  }();
  (void)registered;
#endif
  return forked_after_team.load(std::memory_order_relaxed);
}

// Threads for a call that moves `bytes`: options.num_threads (0: OpenMP's
// default, OMP_NUM_THREADS), at most one per kMinBytesPerThread and
// max_threads() (either way), at least one; one in a child forked after
// this process started a team (in_child_forked_after_team).
inline int plan_threads(const ExecOptions& options, int64_t bytes) {
  if (in_child_forked_after_team()) return 1;
  int64_t threads = 1;
#ifdef _OPENMP
  threads = std::min<int64_t>(
      options.num_threads > 0 ? options.num_threads : omp_get_max_threads(), max_threads());
#else
  (void)options;
#endif
  return static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(1, bytes / kMinBytesPerThread)));
}

// The thread plan of a call over T tokens of `heads` heads each (q and k),
// on `threads` threads (plan_threads). One thread: tokens(0, T), on the
// caller. T >= 2 * threads: each thread takes a contiguous range of whole
// tokens, tokens(t0, t1), so every token's cos/sin is made once. Fewer,
// larger tokens: table() makes every token's cos/sin once, on the caller,
// then (token, head-group) units go to the threads, heads(t, h0, h1), so
// that every thread has work. Each element is computed from its own head
// alone: results do not depend on the plan. Each thread of a team computes
// in IEEE's default floating-point mode (IeeeFpScope), as the caller's
// thread does (rope_pool_fused): a team thread's own mode would otherwise
// decide the bits of its share.
template <class Tokens, class Table, class Heads>
void run_planned(int64_t T, int64_t heads, int threads, const Tokens& tokens, const Table& table,
                 const Heads& head_group) {
  team_index = 0;
  if (threads <= 1) {
    tokens(int64_t{0}, T);
    return;
  }
#ifdef _OPENMP
  team_started.store(true, std::memory_order_relaxed);
  if (T >= 2 * threads) {
#pragma omp parallel num_threads(threads)
    {
      const IeeeFpScope ieee;
      team_index = omp_get_thread_num();
      const int64_t i = team_index, n = omp_get_num_threads();
      const int64_t t0 = T * i / n, t1 = T * (i + 1) / n;
      if (t0 < t1) tokens(t0, t1);
    }
    return;
  }
  table();
  const int64_t groups = std::min<int64_t>(heads, (2 * threads + T - 1) / T);
  const int64_t heads_per_group = (heads + groups - 1) / groups;
  const int64_t units = T * groups;
#pragma omp parallel num_threads(threads)
  {
    const IeeeFpScope ieee;
    team_index = omp_get_thread_num();
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t t = u / groups, g = u % groups;
      const int64_t h0 = g * heads_per_group, h1 = std::min(heads, h0 + heads_per_group);
      if (h0 < h1) head_group(t, h0, h1);
    }
  }
#else
  (void)heads;
  (void)table;
  (void)head_group;
#endif
}

}  // namespace host

/// The options path (rope_options_cpu.cc): every call that is not is_plain.
void run_options(const Problem& p, const ExecOptions& options);

/// One unit of the options path with interleaved pairs
/// (rope_options_interleaved_cpu.cc).
void process_options_interleaved(const OptWork& w);

}  // namespace cpu
}  // namespace ropekv
