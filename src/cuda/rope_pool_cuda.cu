// CUDA backend: one kernel launch per call on the caller's stream, no host
// synchronisation, CUDA-graph capturable. The kernel is in
// rope_pool_kernel.cuh.
//
// The launcher picks the widest vector the arrays allow (16 bytes when the
// last dimension is contiguous and every base pointer and row/head stride is
// a multiple of 16 bytes; 8, 4 or 2 bytes otherwise) and a strided kernel
// when any array's last dimension is not contiguous, and shapes the grid as
// one block per token (its teams share the token's cos/sin). Calls with
// options (not is_plain) run the options kernel, in its 16-byte form or else
// its strided form, except a cos_sin_cache alone with 16-byte vectors and
// rows, which runs the plain kernel built for a table (table_kernel). Small
// calls of 16-bit data with full rotary run the small kernel (small_kernel:
// one token's heads per block, 8-byte vectors; one build per QK-norm or not
// and pool format), plain or with interleaved pairs, a cos_sin_cache, a
// QK-norm (heads of up to 256; 512 in wide lanes), float32 or fp8 pools (fp8 alone only with
// power-of-two scales); other small plain calls of 16-bit data (partial
// rotary) run the options kernel's one-step build (faster at decode than the plain kernel's
// two steps per team), a token's teams spread over several blocks while the
// grid is small.
//
// Device memory it owns, made once and kept for the process: a per-device
// error flag (out-of-range slots) and one inv_freq table per (device,
// rope_base, rotary_dim). Both are made on first use, which may be inside a
// graph capture (relaxed capture mode, a private stream for the upload);
// every later call allocates nothing.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "backends.h"
#include "common/inv_freq.h"
#include "cuda/rope_pool_kernel.cuh"
#include "problem.h"

namespace ropekv {
namespace cuda {
namespace {

using detail::ErrorRecord;
using detail::OptParams;
using detail::Params;
using detail::Tensor3;

[[noreturn]] void fail_cuda(const char* what, cudaError_t e) {
  throw std::runtime_error(std::string("ropekv CUDA backend: ") + what + " failed: " +
                           cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail_cuda(what, e);
}

// Makes `device` current for the scope and restores the caller's device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

// Relaxed stream-capture mode for this thread, for the scope: the pointer
// queries and the one-time allocation below are not stream work and must not
// invalidate a graph capture in progress (PyTorch captures in global mode).
class RelaxedCapture {
 public:
  RelaxedCapture() { ok_ = cudaThreadExchangeStreamCaptureMode(&mode_) == cudaSuccess; }
  ~RelaxedCapture() {
    if (ok_) cudaThreadExchangeStreamCaptureMode(&mode_);
  }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  bool ok_ = false;
};

constexpr int kMaxDevices = 64;

// Per-device state, made once: the error record.
struct DeviceState {
  std::atomic<ErrorRecord*> err{nullptr};
  bool pdl = false;  // programmatic dependent launch (sm_90+); set before err
  int sms = 1;       // streaming multiprocessors; set before err
};
std::array<DeviceState, kMaxDevices> g_devices;
std::mutex g_init_mutex;

ErrorRecord initial_record() {
  ErrorRecord r;
  std::memset(&r, 0, sizeof(r));
  r.token = LLONG_MAX;
  r.pos_token = LLONG_MAX;
  return r;
}

// Copies `bytes` from the host to `dst` through a private non-blocking
// stream and waits: legal also while another stream of this thread is being
// captured (the caller holds RelaxedCapture).
void upload_private(void* dst, const void* src, size_t bytes, const char* what) {
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
  check(e, what);
}

// The current device's state, made on first use. If that first use happens
// while this thread captures a CUDA graph, the allocation runs in relaxed
// capture mode (cudaMalloc is not a stream operation, and the initial copy
// uses a stream of its own), so capture is not invalidated.
DeviceState& device_state(int device) {
  if (device < 0 || device >= kMaxDevices)
    throw std::runtime_error("ropekv CUDA backend: device id " + std::to_string(device) +
                             " is out of the supported range");
  DeviceState& st = g_devices[device];
  if (st.err.load(std::memory_order_acquire) != nullptr) return st;
  std::lock_guard<std::mutex> lock(g_init_mutex);
  if (st.err.load(std::memory_order_relaxed) != nullptr) return st;
  RelaxedCapture relaxed;
  ErrorRecord* rec = nullptr;
  check(cudaMalloc(&rec, sizeof(ErrorRecord)), "allocating the device error flag");
  try {
    const ErrorRecord init = initial_record();
    upload_private(rec, &init, sizeof(init), "initialising the error flag");
  } catch (...) {
    cudaFree(rec);
    throw;
  }
  int major = 0;
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
        "reading the compute capability");
  st.pdl = major >= 9;
  check(cudaDeviceGetAttribute(&st.sms, cudaDevAttrMultiProcessorCount, device),
        "reading the multiprocessor count");
  st.err.store(rec, std::memory_order_release);
  return st;
}

// inv_freq[i] = fp32(base ** (-2i/R)) in double, as the CPU backend, in
// device memory: one small table per (device, rope_base, rotary_dim), made on
// first use (like the error flag: capture-safe) and kept for the process.
// The kernel's parameters stay small, and a call only looks the table up.
struct FreqTable {
  int device;
  FreqSpec spec;
  float* data;
};
std::mutex g_table_mutex;
std::vector<FreqTable> g_tables;

const float* device_inv_freq(int device, const FreqSpec& spec) {
  thread_local FreqTable last{-1, {}, nullptr};
  if (last.data && last.device == device && last.spec == spec) return last.data;
  std::lock_guard<std::mutex> lock(g_table_mutex);
  for (const FreqTable& f : g_tables) {
    if (f.device == device && f.spec == spec) {
      last = f;
      return f.data;
    }
  }
  std::vector<float> host(static_cast<size_t>(spec.rotary_dim / 2));
  fill_inv_freq(spec, host.data());
  RelaxedCapture relaxed;
  float* dev = nullptr;
  check(cudaMalloc(&dev, host.size() * sizeof(float)), "allocating the inv_freq table");
  try {
    upload_private(dev, host.data(), host.size() * sizeof(float), "uploading the inv_freq table");
  } catch (...) {
    cudaFree(dev);
    throw;
  }
  g_tables.push_back(FreqTable{device, spec, dev});
  last = g_tables.back();
  return dev;
}

Tensor3 tensor3(const View3& v) {
  return Tensor3{v.data, v.stride[0], v.stride[1], v.stride[2]};
}

// True when `vec`-element vectors tile the head (half and the tail are
// multiples of vec), and for every array the last dimension is contiguous,
// the row/head strides are multiples of vec elements and the base pointer is
// aligned for one vector access (vec elements of the array's own size, at
// most 16 bytes: a float32 pool row of a 16-bit vector takes two stores).
bool vector_ok(const Problem& p, int64_t vec, int64_t esize, int64_t pool_esize) {
  const int64_t half = p.rotary_dim / 2;
  if (half % vec != 0 || (p.head_dim - p.rotary_dim) % vec != 0) return false;
  const auto ok = [vec](const View3& a, int64_t es) {
    const uintptr_t align = static_cast<uintptr_t>(std::min<int64_t>(16, vec * es));
    return a.stride[2] == 1 && reinterpret_cast<uintptr_t>(a.data) % align == 0 &&
           a.stride[0] % vec == 0 && a.stride[1] % vec == 0;
  };
  for (const View3* a : {&p.q, &p.k, &p.v, &p.q_rot, &p.k_rot})
    if (!ok(*a, esize)) return false;
  return ok(p.k_pool, pool_esize) && ok(p.v_pool, pool_esize);
}

struct Launch {
  long long blocks;
  int threads;
  size_t smem;
  bool pdl;  // launch with programmatic stream serialization
  unsigned int blocks_y = 1;  // the small kernel's 2-D grid and block
  unsigned int threads_y = 1;
  bool full_blocks = false;  // the small kernel: every block holds threads_y heads
  int sms = 0;               // the device's SMs (the small kernel)
  int device = 0;            // the call's device (the small kernel)
};

// The launch configuration of `l`. With l.pdl (Hopper and later), the kernel
// may be launched while the previous kernel of the stream still runs: its
// blocks become resident and wait in griddepcontrol.wait (first statement of
// both kernels) until that kernel's memory is visible. This hides the launch
// gap between back-to-back kernels, e.g. the calls of successive layers in a
// CUDA graph; results are the same as with ordinary stream order.
struct LaunchConfig {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  LaunchConfig(const Launch& l, cudaStream_t stream) {
    cfg.gridDim = dim3(static_cast<unsigned int>(l.blocks), l.blocks_y);
    cfg.blockDim = dim3(static_cast<unsigned int>(l.threads), l.threads_y);
    cfg.dynamicSmemBytes = l.smem;
    cfg.stream = stream;
    if (l.pdl) {
      attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[0].val.programmaticStreamSerializationAllowed = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
    }
  }
  LaunchConfig(const LaunchConfig&) = delete;  // cfg.attrs points into this object
};

template <class T, int N, bool kContig, int U, bool kTable = false>
void launch_as(const Params& prm, const Launch& l, cudaStream_t stream) {
  LaunchConfig lc(l, stream);
  check(cudaLaunchKernelEx(&lc.cfg, detail::rope_pool_kernel<T, N, kContig, U, kTable>, prm),
        "launching the rope_pool kernel");
}

int64_t env_count(const char* name, int64_t fallback);

// Blocks of `threads` threads and `smem` bytes of shared memory that an SM of
// `device` (the current one) holds of `kernel` (the occupancy API, once per
// such kernel, block and device).
int resident_blocks(const void* kernel, int threads, size_t smem, int device) {
  static std::mutex mutex;
  static std::vector<std::pair<std::array<long long, 4>, int>> seen;
  const std::array<long long, 4> key{reinterpret_cast<long long>(kernel), threads,
                                     static_cast<long long>(smem), device};
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& [k, n] : seen)
    if (k == key) return n;
  int n = 0;
  RelaxedCapture relaxed;  // (the query may load the kernel: not stream work)
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem),
        "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  seen.emplace_back(key, n);
  return n;
}

// Whether a wide-lane small-kernel call runs its build's one-wave build
// (kOneWave, 40 registers) instead of `build` (48): when its blocks, each
// holding as many heads (a token's last block with fewer heads keeps its
// block slot as long as a full one), need more than 17/16 of a wave of
// `build`'s and fit one wave of the one-wave build's. There the last blocks
// no longer wait for the first to end; elsewhere the spills and the smaller
// register budget cost (H100, cold L2, the builds compiled so for every
// call: heads of 512 (8 + 4), T = 512, 1536 blocks of 4 warps, 10 / 12 an
// SM: float32 pools 10.24 -> 9.40 us, a QK-norm with them 10.99 -> 10.18, a
// QK-norm 9.38 -> 9.02; at 1024 5-12 % slower, Llama-3.1-8B's QK-norm at
// 256-8192 3-10 % slower). Against ROPEKV_CUDA_ONE_WAVE=0 in the windows
// (H100, cold L2): heads of 512 (8 + 4) at T = 496 and 528 (tails of 13 and
// 20 % of a wave) 2-8 % faster with each option, heads of 512 (32 + 8) at
// 148 and 158 5-7 %; but just past a wave, T = 448 for 8 + 4 (a tail of 2 %:
// 2.5-6 % slower) and 544 for Llama-3.1-8B's QK-norm (3 %: 2 % slower), the
// one-wave build lost, hence the 1/16. Llama's blocks of 5 warps fit 9 an SM
// at 40 registers, not 10 (each quarter of an SM's registers holds 12 warps),
// so its window is T = 562-594 at 132 SMs, where the one-wave build was
// 0.5-2 % faster (a QK-norm) and 4-5 % (with fp8 pools) (docs/performance.md,
// *One wave for the wide lanes at 40 registers*, *16-bit tables on heads of
// 512, the table kernel's jump, and Llama's one-wave window*). For tuning
// (read once): ROPEKV_CUDA_ONE_WAVE=0 never, 1 always.
bool one_wave_small(const void* build, const void* one_wave, const Launch& l) {
  static const int64_t forced = env_count("ROPEKV_CUDA_ONE_WAVE", -1);
  if (forced >= 0) return forced != 0;
  if (!l.full_blocks) return false;
  const int threads = l.threads * static_cast<int>(l.threads_y);
  const long long blocks = l.blocks * static_cast<long long>(l.blocks_y);
  if (blocks <= l.sms) return false;  // (within a wave of any build: no occupancy query)
  const long long wave =
      static_cast<long long>(resident_blocks(build, threads, l.smem, l.device)) * l.sms;
  return 16 * blocks > 17 * wave &&
         blocks <= static_cast<long long>(resident_blocks(one_wave, threads, l.smem, l.device)) *
                       l.sms;
}

// The small kernel's build for a QK-norm or not (kNorm) and a pool format
// (kPools); prm: detail::SmallParams<kNorm, kPools>. Wide lanes (vec =
// 2 * kSmallVec) have cos/sin computed, NeoX pairs or plain interleaved ones
// (small_vec).
template <class T, bool kNorm, int kPools>
void launch_small_as(const detail::SmallParams<kNorm, kPools>& prm, bool interleaved,
                     int64_t vec, const Launch& l, cudaStream_t stream) {
  LaunchConfig lc(l, stream);
  using detail::rope_pool_small_kernel;
  constexpr int kWide = 2 * detail::kSmallVec;
  const char* what = "launching the rope_pool small kernel";
  if (vec == kWide) {
    // (No wide build for float32 pools alone of f16 data: wide_lanes_ok keeps
    // them narrow.)
    if constexpr (!kNorm && kPools == detail::kPoolsF32 && std::is_same_v<T, __half>) {
      throw std::logic_error("ropekv: f16 float32 pools reached the small kernel's wide lanes");
    } else if constexpr (!kNorm && kPools == detail::kPoolsSame) {
      const auto kernel =
          interleaved ? rope_pool_small_kernel<T, false, true, false, kPools, kWide>
                      : rope_pool_small_kernel<T, false, false, false, kPools, kWide>;
      return check(cudaLaunchKernelEx(&lc.cfg, kernel, prm), what);
    } else {
      if (interleaved)  // (small_vec keeps interleaved pairs with options narrow)
        throw std::logic_error(
            "ropekv: interleaved options reached the small kernel's wide lanes");
      using P = detail::SmallParams<kNorm, kPools>;
      auto kernel = rope_pool_small_kernel<T, false, false, kNorm, kPools, kWide, P>;
      if constexpr (detail::kHasOneWave<kWide, kNorm, kPools>) {
        const auto one_wave =
            rope_pool_small_kernel<T, false, false, kNorm, kPools, kWide, P, true>;
        if (one_wave_small(reinterpret_cast<const void*>(kernel),
                           reinterpret_cast<const void*>(one_wave), l))
          kernel = one_wave;
      }
      return check(cudaLaunchKernelEx(&lc.cfg, kernel, prm), what);
    }
  }
  const bool table = prm.cos_sin != nullptr;
  const auto kernel =
      table ? (interleaved ? rope_pool_small_kernel<T, true, true, kNorm, kPools>
                           : rope_pool_small_kernel<T, true, false, kNorm, kPools>)
            : (interleaved ? rope_pool_small_kernel<T, false, true, kNorm, kPools>
                           : rope_pool_small_kernel<T, false, false, kNorm, kPools>);
  check(cudaLaunchKernelEx(&lc.cfg, kernel, prm), what);
}
template <class T, int N, bool kContig, int U, int kPools, bool kNorm>
void launch_options_as(const OptParams& prm, const Launch& l, cudaStream_t stream) {
  LaunchConfig lc(l, stream);
  check(cudaLaunchKernelEx(&lc.cfg,
                           detail::rope_pool_options_kernel<T, N, kContig, U, kPools, kNorm>, prm),
        "launching the rope_pool options kernel");
}

// The 16-byte options kernels: one for fp8 pools and one for the others,
// each with or without the QK-norm code, compiled for one step (small calls)
// or for kOptSteps steps of which o.steps are taken; or the strided one (one
// step, every option at run time: rare layouts). The kOptSteps kernel has
// a build for pools of q's dtype alone: without the float32 pools' code a
// call with a QK-norm took 1-2 % less at T = 512-8192 (docs/performance.md,
// *Options*).
template <class T, bool kNorm, int U>
void launch_options_steps(const OptParams& prm, const Launch& l, cudaStream_t stream) {
  constexpr int kVec = static_cast<int>(16 / sizeof(T));
  if (prm.o.pool_mode == detail::kPoolFp8)
    return launch_options_as<T, kVec, true, U, detail::kPoolsFp8, kNorm>(prm, l, stream);
  if constexpr (U != 1) {
    if (prm.o.pool_mode == detail::kPoolSame)
      return launch_options_as<T, kVec, true, U, detail::kPoolsSame, kNorm>(prm, l, stream);
  }
  return launch_options_as<T, kVec, true, U, detail::kPoolsWide, kNorm>(prm, l, stream);
}
template <class T, bool kNorm>
void launch_options_pools(const OptParams& prm, const Launch& l, cudaStream_t stream) {
  if (prm.o.steps == 1) return launch_options_steps<T, kNorm, 1>(prm, l, stream);
  return launch_options_steps<T, kNorm, detail::kOptSteps>(prm, l, stream);
}

// float32 inputs (rarer with options, and lighter on registers) take the
// kernels with the QK-norm code for every call: fewer kernels to compile.
template <class T>
void launch_options_typed(const OptParams& prm, bool contig, const Launch& l,
                          cudaStream_t stream) {
  if (!contig) return launch_options_as<T, 1, false, 1, detail::kPoolsAny, true>(prm, l, stream);
  if constexpr (sizeof(T) == 2) {
    if (prm.o.q_norm == nullptr && prm.o.k_norm == nullptr)
      return launch_options_pools<T, false>(prm, l, stream);
  }
  return launch_options_pools<T, true>(prm, l, stream);
}

// The 16-byte kernels come in U = 1, 2, 4, 8 steps per team; the narrower
// and strided ones (rare layouts) only in U = 4.
template <class T, int N>
void launch_unrolled(const Params& prm, int unroll, const Launch& l, cudaStream_t stream) {
  switch (unroll) {
    case 1: return launch_as<T, N, true, 1>(prm, l, stream);
    case 2: return launch_as<T, N, true, 2>(prm, l, stream);
    case 8: return launch_as<T, N, true, 8>(prm, l, stream);
    default: return launch_as<T, N, true, 4>(prm, l, stream);
  }
}

template <class T>
void launch_typed(const Params& prm, int vec, bool contig, int unroll, const Launch& l,
                  cudaStream_t stream) {
  constexpr int kVec = static_cast<int>(16 / sizeof(T));
  if (prm.cos_sin != nullptr) {  // the table kernel: 16-byte vectors, U = 2 or 4
    if (unroll == 2) return launch_as<T, kVec, true, 2, true>(prm, l, stream);
    return launch_as<T, kVec, true, 4, true>(prm, l, stream);
  }
  if (!contig) return launch_as<T, 1, false, 4>(prm, l, stream);
  if constexpr (sizeof(T) == 4) {
    if (vec == 4) return launch_unrolled<T, 4>(prm, unroll, l, stream);
    return launch_as<T, 2, true, 4>(prm, l, stream);
  } else {
    if (vec == 8) return launch_unrolled<T, 8>(prm, unroll, l, stream);
    if (vec == 4) return launch_as<T, 4, true, 4>(prm, l, stream);
    return launch_as<T, 2, true, 4>(prm, l, stream);
  }
}

// Steps per team. Small calls (up to 6144 team steps, about a wave and a
// half) take U = 2 and larger calls U = 4: of 1, 2, 4 and 8 the fastest on
// an H200 for Llama-3.1-8B bf16 from T = 1 to 32768 (docs/performance.md,
// "latency" and "cold" steps of gpu-check.sh), and within 2 % of it at
// T >= 2048 for Qwen2.5-7B, Gemma-2-9B and Phi-3-mini. At T = 512 the best
// U varies by shape (1 for Qwen, 2 for Llama, 4 for Phi-3, 8 for Gemma-2);
// the rule takes Llama's and Qwen's 2 (9-12 % faster than 4). With
// a QK-norm each step adds its sum of squares and 1 / sqrt to a team's serial
// path: the options kernel then takes 1 step for small calls and 2 up to
// about T = 512 (latency step, H200, Llama shape with QK-norm and fp8 pools:
// T = 1..64 3.7-3.9 us at 1 step, 4.4-4.6 at 2; T = 512 6.2 us at 2, 7.4 at
// 4). ROPEKV_CUDA_UNROLL=1|2|4|8 forces a value for the 16-byte kernels (for
// tuning; read once).
constexpr int64_t kTwoStepWork = 6144;  // team steps up to which plain calls take U = 2

// Calls with options take the options kernel compiled for one step up to
// 2048 team steps: its code is a third of the kOptSteps kernel's, and a
// decode call fetches its instructions cold (Nsight Compute's stall sampling
// of a T = 1 call with QK-norm and fp8 pools: "no instruction" stalls were
// a quarter of the samples).
constexpr int64_t kOptionsOneStep = 2048;  // team steps up to which options take U = 1

// A tuning variable's value: a count (negative read as 0), or fallback
// when it is not set.
int64_t env_count(const char* name, int64_t fallback) {
  const char* e = std::getenv(name);
  return e ? std::max<int64_t>(0, std::atoll(e)) : fallback;
}

// ROPEKV_CUDA_UNROLL, read once: 1, 2, 4 or 8, else 0 (not forced).
int forced_unroll() {
  static const int forced = [] {
    const int64_t v = env_count("ROPEKV_CUDA_UNROLL", 0);
    return (v == 1 || v == 2 || v == 4 || v == 8) ? static_cast<int>(v) : 0;
  }();
  return forced;
}

// Small one-step calls of 16-bit data split a token's teams over as many
// blocks as keep the grid within split_grid_limit blocks (default: half the
// SMs), each of at least split_teams() warps (default 4) where the token has
// that many. For tuning (read once): ROPEKV_CUDA_SPLIT_TEAMS=N (N >= 1) and
// ROPEKV_CUDA_SPLIT_GRID=N (0: never split).
int64_t split_teams() {
  static const int64_t teams = std::max<int64_t>(1, env_count("ROPEKV_CUDA_SPLIT_TEAMS", 4));
  return teams;
}
int64_t split_grid_limit(int sms) {
  static const int64_t forced = env_count("ROPEKV_CUDA_SPLIT_GRID", -1);
  return forced >= 0 ? forced : sms / 2;
}

// Whether QK-norm weights w (if any) allow the small kernel's loads of vec
// of them (weight_words): contiguous, aligned to vec elements or 16 bytes.
bool small_weights_ok(const Weight& w, int64_t vec = detail::kSmallVec) {
  if (w.data == nullptr) return true;
  const int64_t bytes = std::min<int64_t>(16, (w.dtype == FloatType::kF32 ? 4 : 2) * vec);
  return w.stride == 1 && reinterpret_cast<uintptr_t>(w.data) % bytes == 0;
}

// Tokens up to which a call takes the small kernel (small_kernel): in wide
// lanes (small_vec; plain interleaved pairs included) 8192 where a head's
// wide lanes are a power of two (head_dim 128, 256, ...; a QK-norm with fp8
// pools: every call, see below), else 2048; 512 for
// other plain calls (rope scaling included), 256 with a cos_sin_cache, a
// QK-norm or float32 / fp8 pools (alone: 0.4-0.8 us faster than the options
// kernel at T = 256, Llama-3.1-8B). Against the kernels it replaced (H200,
// cold L2, four shapes): faster up to T = 256 for every shape, and at T = 512
// for Qwen2.5-7B, Gemma-2-9B and Phi-3-mini (2-13 %) but 3 % slower for
// Llama-3.1-8B; with a table 13-22 % slower at T = 512 for three shapes;
// with a QK-norm and fp8 pools (Llama) 19 % faster at T = 256 and 27 %
// slower at 512. In wide lanes, against the plain kernel: 0-9 % faster at
// T = 512-2048 for the four shapes (docs/performance.md, *Wide lanes*). Past
// 2048, against the kernels that took those calls (Llama-3.1-8B unless
// named): at T = 4096 a QK-norm 35.5 -> 32.0 us, with fp8 pools 37.3 -> 31.1,
// fp8 pools 28.7 -> 26.7, plain 29.7 -> 28.7 (Qwen2.5-7B 22.9 -> 21.5); at
// 8192 61.3 against 62.5, 59.2 against 66.9, 52.0 against 52.9, plain even;
// at 32768 a QK-norm 4 % slower. Phi-3-mini's heads of 6 wide lanes ran
// 4-7 % slower at 4096-8192, hence the power of two (*Wide lanes past 2048
// tokens*). A QK-norm with fp8 pools has no limit there but the grid's: against the
// options kernel, T = 16384 124.9 -> 108.5 us, 32768 239.4 -> 214.3 (a QK-norm alone
// 117.5 -> 116.9 and 227.6 -> 230.3, so it keeps 8192; *Wide lanes for a
// QK-norm with fp8 pools past 8192 tokens*). Float32 pools alone, NeoX pairs,
// heads of 64 narrow lanes that wide lanes cannot take (long_narrow: head_dim
// 512, Gemma-4's full-attention shape, the one measured; H100; f16 data, and
// arrays not 16-byte aligned; bf16 data takes wide lanes past 256 tokens since):
// 1024, where the small kernel, against the
// options kernel (78 registers, one block of a token's 12 heads), took T = 512
// 12.96 -> 9.99 us and 1024 19.64 -> 18.83, and was slower from 2048 (36.8
// against 35.2; Llama's heads of 16 lanes at 512: 7.16 against 6.66;
// docs/performance.md, *Heads of 512: the QK-norm's head sum by shuffles*).
// A QK-norm on those heads in narrow lanes takes the same 1024, within
// narrow_norm64's own limits. The same heads with a cos_sin_cache (float32
// or q's dtype) as their one option (table512), at most 40 of them (q and
// kv: 12 and 40 were measured), take 640 where, past 256, the table kernel
// (table_kernel) would take them in four steps (more than kTwoStepWork team
// steps: T * (Hq + 2 Hk) > 6144): each warp four heads in turn, too few
// warps to hide the latency. Against the table kernel (H100, cold L2, bf16
// data), a float32 table: 8 + 4 heads T = 416 8.70 -> 7.74 us, 512 9.84 ->
// 8.79, 640 10.86 -> 10.40, but 768 11.50 against 12.03; 32 + 8 heads T =
// 320 15.02 -> 13.98, 448 18.89 -> 18.59, 512-640 within 0.5 %, 768 30.62
// against 31.36; a bf16 table: 8 + 4 heads T = 416 8.83 -> 7.60, 512 9.84
// -> 8.66, 640 10.84 -> 10.26; 32 + 8 heads T = 320 14.83 -> 13.79, 448
// 18.88 -> 18.37, 512-640 within 1.2 %. Where the table kernel takes two
// steps (8 + 4 heads at 320-384) it was 9-13 % the faster (a bf16 table at
// 384: 6.50 against 7.22), and at 385-396 6 % (its time follows its most
// blocks on one SM, ceil(T / SMs), 3 up to 396 at 132 SMs, then 7.57 us at
// 397 against the small kernel's 7.49; docs/performance.md, *Heads of 512
// with a cos_sin_cache*, *The table512 route*, *16-bit tables on heads of
// 512*). For tuning (read once): ROPEKV_CUDA_SMALL_TOKENS=N sets every limit
// (0: never).
int64_t small_tokens(bool plain, bool wide, int64_t wide_lanes, bool norm_fp8, bool long_narrow,
                     bool table512) {
  static const int64_t forced = env_count("ROPEKV_CUDA_SMALL_TOKENS", -1);
  if (forced >= 0) return forced;
  if (wide && (wide_lanes & (wide_lanes - 1)) == 0)
    return norm_fp8 ? INT_MAX : 8192;  // (INT_MAX: the grid's most blocks in x, one per token)
  if (wide) return 2048;
  if (long_narrow) return 1024;
  if (table512) return 640;
  return plain ? 512 : 256;
}

// Elements per lane of a small-kernel call: 2 * kSmallVec (16-byte vectors,
// "wide lanes") for NeoX calls without a table (plain, with a QK-norm whose
// weights are q's dtype, with any pools: float32 pools alone with bf16 data
// only, wide_lanes_ok) and plain interleaved ones of more
// than wide_small_tokens() = 256 tokens (224 with a QK-norm) whose arrays all take them, else
// kSmallVec (8 bytes). Wide lanes hold twice the bytes in flight per
// thread, and a token's heads fill half the blocks (H200, cold L2, 50-call
// graphs; docs/performance.md, *Wide lanes*): at T = 512
// Llama-3.1-8B 5.49 -> 5.00 us, Gemma-2-9B 7.06 -> 6.39; at T = 256 and below
// they were slower for three of the four shapes (Gemma-2 at T = 256 4.18 ->
// 4.47). With options, against the options kernel that took them past 256
// tokens (Llama): a QK-norm 5.29 -> 3.97 us at T = 257, equal at 512 and
// 1024, 20.6 -> 19.3 at 2048; fp8 pools 4.27 -> 3.46 at 257, 15.9 -> 14.5 at
// 2048. The wide QK-norm builds hold 16-bit weights only (48 registers
// against 63-80 with float32 ones allowed): 6.83 -> 6.52 us at T = 512,
// 19.1 -> 17.3 at 2048, 3.96 -> 4.06 at 257; float32 weights take the
// options kernel there. Plain interleaved pairs (two builds more, 40
// registers as the NeoX one): 5.47 -> 4.97 us at T = 512, the plain NeoX
// call's time. A QK-norm takes them from 225 tokens (H100, cold L2, Llama-3.1-8B
// and Qwen3-8B; narrow against wide): T = 224 3.72 against 4.46 us, 240 4.44
// against 4.62 (Qwen3 4.56 against 4.22; with float32 pools or fp8 pools and
// yarn wide ahead by 0.2-0.4), 256 5.04 against 4.31 (docs/performance.md,
// *A QK-norm with float32 pools in wide lanes*). For
// tuning (read once): ROPEKV_CUDA_SMALL_WIDE=N, wide lanes above N tokens.
int64_t wide_small_tokens(bool norm) {
  static const int64_t forced = env_count("ROPEKV_CUDA_SMALL_WIDE", -1);
  return forced >= 0 ? forced : norm ? 224 : 256;
}
// Threads per block the small kernel aims at (whole heads; one head of up to
// 128 lanes where a head has more): 256 for 17 to 64 tokens, else 128. Of
// 64, 128 and 256 (H200, cold L2, four shapes, plain and with a table), 256
// was 0.07-0.17 us faster than 128 at T = 32 and 64 but slower at T = 8 and
// 512; 64 lost at T = 1 and 512 (docs/performance.md, *Small calls*). For
// tuning (read once): ROPEKV_CUDA_SMALL_THREADS=N, 32 to
// detail::kSmallThreads.
int64_t forced_small_threads() {
  static const int64_t forced = env_count("ROPEKV_CUDA_SMALL_THREADS", 0);
  return forced > 0 ? std::clamp<int64_t>(forced, 32, detail::kSmallThreads) : 0;
}
int64_t small_threads(int64_t tokens) {
  if (const int64_t forced = forced_small_threads()) return forced;
  return tokens > 16 && tokens <= 64 ? 256 : 128;
}

// Heads of 64 narrow lanes (head_dim 512, Gemma-4's full-attention shape)
// with a QK-norm: the small kernel in narrow lanes, two warps a head whose
// sums meet in shared memory, instead of wide lanes (one warp a head), up to
// 192 tokens. Narrow lanes put twice the threads on a call (its latency
// shorter at small T). H100, cold L2, 8 / 4 heads, narrow against wide: a
// QK-norm T = 1 1.94 against 2.21 us, 32 2.37 against 2.70, 192 4.62
// against 5.08, but 256 6.93 against 6.02 (six blocks a token of 128
// threads of 56 registers: past about 198 tokens a second wave), 1024 19.0
// against 15.4 (fp8 pools and yarn the same); with float32 pools, against
// the split wide lanes (kSplitLanes), T = 1 2.00 against 2.31, 192 5.10
// against 5.81, 224 6.92 against 6.19, 512 11.4 against 10.8, 896 19.7
// against 16.9 (docs/performance.md, *Heads of 512: a QK-norm in two warps
// a head*, *Split wide lanes past 192 tokens*).
// Every pool format stops where the narrow grid leaves one wave: two warps
// a head, and as many warps an SM as blocks of small_threads(T) threads of
// kNarrowNormRegisters registers fit its 64K registers (36 in blocks of
// 128, 32 in blocks of 256), so 2 * T * (Hq + Hk) <= warps * SMs (198
// tokens for those 12 heads on 132 SMs; 52 for 32 + 8 heads, in blocks of
// 256, where 192 tokens would be 3.3 waves). Measured at 12 heads only: for
// more heads, or fewer SMs, the limit keeps narrow lanes within the one wave
// where they were measured to win. Calls with float32 pools that wide lanes
// cannot take (wide_ok false: float32 weights, say) keep narrow lanes up to
// 896 tokens (NeoX without a table; small_tokens stops interleaved pairs and
// tables at 256), the limit set where narrow lanes were faster than the
// wide lanes of that time (512 11.9 against 12.9 us, 1024 22.0 against
// 21.2), and run the options kernel past it.
// For tuning (read once): ROPEKV_CUDA_NORM64_TOKENS=N, every limit (0: never).
constexpr int64_t kNarrowNormRegisters = 56;  // (ptxas -v, sm_90: the narrow QK-norm builds)
bool narrow_norm64(const Problem& p, int sms, bool wide_ok) {
  static const int64_t forced = env_count("ROPEKV_CUDA_NORM64_TOKENS", -1);
  if (!has_qk_norm(p) || p.rotary_dim / 2 / detail::kSmallVec != 64) return false;
  if (forced >= 0) return p.num_tokens <= forced;
  if (!wide_ok && p.pool_type == PoolType::kF32) return p.num_tokens <= 896;
  const int64_t threads = small_threads(p.num_tokens);
  const int64_t warps = 65536 / (kNarrowNormRegisters * threads) * threads / 32;
  const int64_t one_wave = warps * sms / (2 * (p.num_qo_heads + p.num_kv_heads));
  return p.num_tokens <= std::min<int64_t>(192, one_wave);
}

// Whether a cos_sin_cache's rows allow loads of `values` values at every
// multiple of that many along a row (as table_load makes them: 16-byte loads
// where they hold more): contiguous rows, the base and the row stride
// aligned to the loads.
bool table_rows_ok(const CosSinCache& cs, int64_t values) {
  const int64_t tes = cs.dtype == FloatType::kF32 ? 4 : 2;
  const int64_t bytes = std::min<int64_t>(16, tes * values);
  return cs.stride[1] == 1 && reinterpret_cast<uintptr_t>(cs.data) % bytes == 0 &&
         (cs.stride[0] * tes) % bytes == 0;
}

// QK-norm weights that wide lanes take: q's dtype (the wide builds hold
// 16-bit weights only), as small_weights_ok says for their 16-byte loads.
bool wide_weights_ok(const Weight& w, FloatType dtype) {
  return w.data == nullptr || (w.dtype == dtype && small_weights_ok(w, 2 * detail::kSmallVec));
}
// Whether a call's arrays and options allow the small kernel's wide lanes
// (small_vec), whatever its number of tokens: 16-bit data (esize 2), cos/sin
// computed, NeoX pairs (any options; float32 pools without a QK-norm with
// bf16 data only, below) or plain interleaved ones, heads a whole number of
// wide lanes, every array in 16-byte vectors, QK-norm weights of q's dtype.
// (Float32 pools of bf16 data without a QK-norm, in split wide lanes
// (kSplitLanes) against the options kernel and, on heads of 512, narrow
// lanes (H100, T = 384-8192): Llama-3.1-8B T = 384 6.33 -> 5.67 us, 768
// 11.24 -> 10.30, 1024 13.27 -> 12.83, but 512 6.65 -> 6.86; heads of 512
// 384 8.25 -> 7.74, 1024 18.70 -> 17.52, 512 10.00 -> 10.22; from 2048
// within 1.6 % (docs/performance.md, *Split wide lanes past 192 tokens*).
// With f16 data the split build was the slower (two runs of the options
// benchmark before and after: Llama-3.1-8B T = 512 6.58 -> 7.29 us, 8192
// 90.6 -> 93.4; heads of 512 +3.7 % and +2.2 %; its bf16 cells within 1 %
// of their A/B), so those calls keep the routes they had. With a QK-norm
// the options kernel was the slower for both (Llama-3.1-8B: T = 512 8.29 ->
// 7.08 us, 2048 28.1 -> 24.5, 8192 92.4 -> 89.8; heads of 512 at T = 1 3.94
// -> 2.77, 1024 25.8 -> 21.3; *A QK-norm with float32 pools in wide
// lanes*).)
bool wide_lanes_ok(const Problem& p, int64_t esize) {
  const bool norm = has_qk_norm(p);
  const bool plain_pairs = p.pool_type == pool_type_of(p.dtype) && !norm;
  const bool neox_ok =
      p.pool_type != PoolType::kF32 || norm || p.dtype == FloatType::kBF16;
  const int64_t wide = 2 * detail::kSmallVec;
  return esize == 2 && p.cos_sin_cache.data == nullptr &&
         (p.is_neox ? neox_ok : plain_pairs) &&
         vector_ok(p, wide, esize, element_size(p.pool_type)) &&
         wide_weights_ok(p.q_norm, p.dtype) && wide_weights_ok(p.k_norm, p.dtype);
}
// (small_vec, above; wide_ok: wide_lanes_ok(p, esize).)
int64_t small_vec(const Problem& p, int sms, bool wide_ok) {
  if (narrow_norm64(p, sms, wide_ok)) return detail::kSmallVec;
  // (A QK-norm over heads of more than 32 narrow lanes, head_dim 512, takes
  // wide lanes past narrow_norm64's limits: its head is one warp there.)
  const bool norm = has_qk_norm(p);
  const bool wide_norm = norm && p.rotary_dim / 2 / detail::kSmallVec > 32;
  return wide_ok && (p.num_tokens > wide_small_tokens(norm) || wide_norm)
             ? 2 * detail::kSmallVec
             : detail::kSmallVec;
}

int choose_unroll(int64_t tokens, int64_t steps, int64_t vec_bytes, bool options, bool qk_norm) {
  if (vec_bytes != 16) return 4;  // only the 16-byte kernels have other U
  if (const int forced = forced_unroll()) return forced;
  const int64_t work = tokens * steps;
  if (options && work <= kOptionsOneStep) return 1;
  if (qk_norm) return work <= 8192 ? 2 : 4;
  return work <= kTwoStepWork ? 2 : 4;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Whether a call runs the plain kernel with its cos/sin read from the
// cos_sin_cache (the table kernel): the table is the call's only option, every
// array takes 16-byte vectors, and the table's rows are 16-byte aligned
// with a contiguous last dimension (it is float32 or of q's dtype, so the
// chunk's N values at cN and half + cN are then aligned too).
bool table_kernel(const Problem& p, int64_t esize) {
  const CosSinCache& cs = p.cos_sin_cache;
  if (cs.data == nullptr || !p.is_neox || p.pool_type != pool_type_of(p.dtype) ||
      has_qk_norm(p))
    return false;
  return table_rows_ok(cs, 16 / esize) && vector_ok(p, 16 / esize, esize, esize);
}

// Whether 1 / scale is an exact normal fp32 number (scale a power of two).
bool exact_reciprocal(float scale) {
  int e = 0;
  return std::frexp(scale, &e) == 0.5f && e >= -124 && e <= 126;
}

// The options of a call for the options kernels (steps: o.steps).
detail::Options options_of(const Problem& p, int steps) {
  detail::Options o{};
  o.q_norm = p.q_norm.data;
  o.qn_stride = p.q_norm.stride;
  o.qn_dtype = static_cast<int>(p.q_norm.dtype);
  o.k_norm = p.k_norm.data;
  o.kn_stride = p.k_norm.stride;
  o.kn_dtype = static_cast<int>(p.k_norm.dtype);
  o.pool_mode = p.pool_type == pool_type_of(p.dtype) ? detail::kPoolSame
                : is_fp8(p.pool_type)                 ? detail::kPoolFp8
                                                      : detail::kPoolF32;
  o.fp8_kind = static_cast<int>(is_fp8(p.pool_type) ? fp8_kind(p.pool_type) : Fp8Kind::kE4M3);
  o.interleaved = !p.is_neox;
  o.head_dim = static_cast<int>(p.head_dim);
  o.steps = steps;
  o.norm_eps = p.norm_eps;
  o.k_scale = p.k_scale;
  o.v_scale = p.v_scale;
  // x / scale is x * (1 / scale), the same correctly rounded quotient, when
  // 1 / scale is an exact normal number (a power-of-two scale, 1 included).
  const bool exact = exact_reciprocal(p.k_scale) && exact_reciprocal(p.v_scale);
  o.fp8_div = exact ? 0 : 1;
  o.k_mul = exact ? 1.0f / p.k_scale : 1.0f;
  o.v_mul = exact ? 1.0f / p.v_scale : 1.0f;
  return o;
}

// Whether a call runs the small kernel (detail::rope_pool_small_kernel): at
// most small_tokens() tokens of 16-bit data with full rotary, vectors of
// kSmallVec elements in every array, NeoX or interleaved pairs, a QK-norm
// only for heads of 1 to 32 lanes at the call's vector width (a power of two:
// head_dim a power of two, and the head's sums read as whole float4s; heads
// of 512 in wide lanes, which small_vec gives them at every T) with contiguous weights
// aligned to kSmallVec of them, pools of any format (but fp8 pools
// whose scales divide, i.e. a reciprocal that is not exact, only with a
// QK-norm: alone they ran 0.1-0.3 us faster on the options kernel at
// T <= 128), and a cos_sin_cache, if any, whose rows allow kSmallVec-value
// loads (16-byte aligned for float32, 8 for 16-bit). Returns the elements
// per lane it runs with (small_vec), 0 where it does not take the call.
int64_t small_kernel(const Problem& p, int64_t esize, int sms) {
  const int64_t lanes = p.rotary_dim / 2 / detail::kSmallVec;
  const CosSinCache& cs = p.cos_sin_cache;
  const bool norm = has_qk_norm(p);
  const bool plain = cs.data == nullptr && !norm && p.pool_type == pool_type_of(p.dtype);
  const bool wide_ok = wide_lanes_ok(p, esize);
  const int64_t vec = small_vec(p, sms, wide_ok);
  const bool wide = vec != detail::kSmallVec;
  const int64_t norm_lanes = p.rotary_dim / 2 / vec;  // (a head's lanes at that vector width)
  const bool norm64 = narrow_norm64(p, sms, wide_ok);  // (two warps a head: norm_lanes 64)
  // (The table kernel's steps: one a head, q, k or v, for 64 lanes of kSmallVec.)
  const bool table512 = lanes == 64 && table_kernel(p, esize) &&
                        p.num_qo_heads + p.num_kv_heads <= 40 &&
                        p.num_tokens * (p.num_qo_heads + 2 * p.num_kv_heads) > kTwoStepWork;
  if (esize != 2 || p.rotary_dim != p.head_dim ||
      p.num_tokens > small_tokens(plain, wide, lanes / 2, norm && is_fp8(p.pool_type),
                                  cs.data == nullptr && p.is_neox && lanes == 64 &&
                                      (norm64 || (!norm && p.pool_type == PoolType::kF32)),
                                  table512) ||
      forced_unroll() != 0 || lanes < 1 || lanes > 128 || p.num_qo_heads + p.num_kv_heads > 65535 ||
      (norm && ((norm_lanes > 32 && !norm64) || (norm_lanes & (norm_lanes - 1)) != 0 ||
                !small_weights_ok(p.q_norm) ||
                !small_weights_ok(p.k_norm))) ||
      (!norm && is_fp8(p.pool_type) &&
       !(exact_reciprocal(p.k_scale) && exact_reciprocal(p.v_scale))) ||
      !vector_ok(p, detail::kSmallVec, esize, element_size(p.pool_type)))
    return 0;
  return cs.data == nullptr || table_rows_ok(cs, detail::kSmallVec) ? vec : 0;
}

// The small kernel's build for a call of T data that small_kernel took: its
// QK-norm or not, and its pool format (fp8 scales that divide come only with
// a QK-norm: small_kernel).
template <class T>
void launch_small_build(const Params& prm, const Problem& p, const Launch& l, int64_t vec,
                        cudaStream_t stream) {
  const bool norm = has_qk_norm(p);
  const bool interleaved = !p.is_neox;
  if (!norm && p.pool_type == pool_type_of(p.dtype))
    return launch_small_as<T, false, detail::kPoolsSame>(prm, interleaved, vec, l, stream);
  OptParams op{};
  static_cast<Params&>(op) = prm;
  op.o = options_of(p, 1);
  const auto pools = [&](auto norm_tag) {
    constexpr bool kNorm = decltype(norm_tag)::value;
    if (op.o.pool_mode == detail::kPoolFp8) {
      if (!op.o.fp8_div)
        return launch_small_as<T, kNorm, detail::kPoolsFp8Mul>(op, interleaved, vec, l, stream);
      if constexpr (kNorm)
        return launch_small_as<T, true, detail::kPoolsFp8>(op, interleaved, vec, l, stream);
      // (kPoolsFp8Mul would store x * mul where x / scale is due.)
      throw std::logic_error(
          "ropekv: fp8 scales that divide reached the small kernel without a QK-norm");
    }
    if (op.o.pool_mode == detail::kPoolF32)
      return launch_small_as<T, kNorm, detail::kPoolsF32>(op, interleaved, vec, l, stream);
    if constexpr (kNorm)
      return launch_small_as<T, true, detail::kPoolsSame>(op, interleaved, vec, l, stream);
    throw std::logic_error("ropekv: a plain call reached the small kernel's option builds");
  };
  if (norm) return pools(std::true_type());
  return pools(std::false_type());
}

// Heads per block of a small-kernel call of `heads` heads of `lanes` lanes:
// small_threads(T) / lanes (at least one), except for a QK-norm in wide
// lanes whose heads do not fill such blocks evenly: the fewest blocks of at
// most kSmallThreads threads, each with an equal share of the heads. Those
// builds hold 48 registers, 42 warps per SM, and Llama-3.1-8B's 40 heads in
// blocks of 16 + 16 + 8 left 2 of a token's 12 warps empty; as 20 + 20
// (H200, cold L2): T = 512 6.51 -> 5.24 us, 1024 10.01 -> 9.52, 8192 60.9 ->
// 59.5; with fp8 pools 6.61 -> 5.11 and 58.8 -> 55.7. The plain and fp8
// builds (40 registers) were even or 1 % slower so, and keep their blocks
// (docs/performance.md, *Balanced blocks for the wide QK-norm*).
int64_t small_heads_per_block(int64_t tokens, int64_t heads, int64_t lanes, bool wide_norm) {
  const int64_t per_block = std::min(heads, std::max<int64_t>(1, small_threads(tokens) / lanes));
  if (!wide_norm || heads % per_block == 0 || forced_small_threads() != 0) return per_block;
  return ceil_div(heads, ceil_div(heads * lanes, detail::kSmallThreads));
}

// The small kernel's launch in lanes of vec elements (small_kernel): HB heads
// of L lanes per block (small_heads_per_block), grid (T, ceil((Hq + Hk) / HB)).
void launch_small(Params& prm, const Problem& p, const DeviceState& st, int64_t vec,
                  cudaStream_t stream) {
  const int64_t lanes = p.rotary_dim / 2 / vec;
  const int64_t heads = p.num_qo_heads + p.num_kv_heads;
  const bool norm = has_qk_norm(p);
  const int64_t per_block =
      small_heads_per_block(p.num_tokens, heads, lanes, norm && vec != detail::kSmallVec);
  Launch l;
  l.blocks = p.num_tokens;
  l.blocks_y = static_cast<unsigned int>(ceil_div(heads, per_block));
  l.threads = static_cast<int>(lanes);
  l.threads_y = static_cast<unsigned int>(per_block);
  l.full_blocks = heads % per_block == 0;
  l.sms = st.sms;
  l.device = p.device.device_id;
  // The cos/sin of the token (not with a table), then with a QK-norm each
  // thread's sum of squares.
  l.smem = ((prm.cos_sin != nullptr ? 0 : p.rotary_dim) + (norm ? per_block * lanes : 0)) *
           sizeof(float);
  l.pdl = st.pdl;
  // Every parameter line before the wait (see param_lines): the small
  // kernel was measured so at every size it takes (T <= 8192 in wide lanes).
  prm.early_params = 1;
  if (p.dtype == FloatType::kF16) return launch_small_build<__half>(prm, p, l, vec, stream);
  return launch_small_build<__nv_bfloat16>(prm, p, l, vec, stream);
}

const char* kTensorNames[] = {"q",      "k",      "v",     "positions",     "slots",
                              "k_pool", "v_pool", "q_rot", "k_rot",         "cos_sin_cache",
                              "q_norm_weight",    "k_norm_weight"};

}  // namespace

bool available() { return true; }

void check_addressable(const RopePoolTensors& t) {
  const DLTensor* all[] = {&t.q,      &t.k,      &t.v,      &t.positions,     &t.slots,
                           &t.k_pool, &t.v_pool, &t.q_rot,  &t.k_rot,         &t.cos_sin_cache,
                           &t.q_norm_weight,     &t.k_norm_weight};
  RelaxedCapture relaxed;
  for (int a = 0; a < 12; ++a) {
    const DLTensor& x = *all[a];
    if (a >= 9 && x.data == nullptr && x.ndim == 0) continue;  // an absent optional tensor
    int64_t n = 1;
    for (int d = 0; d < x.ndim; ++d) n *= x.shape[d];
    if (n == 0) continue;
    const void* ptr = static_cast<const char*>(x.data) + x.byte_offset;
    cudaPointerAttributes attr;
    const cudaError_t e = cudaPointerGetAttributes(&attr, ptr);
    if (e != cudaSuccess) {
      cudaGetLastError();  // clear the (non-sticky) error for the caller
      throw Error(std::string(kTensorNames[a]) + " is a CUDA array (cuda:" +
                  std::to_string(x.device.device_id) +
                  ") but its memory cannot be addressed: CUDA reports " +
                  cudaGetErrorName(e) + " (" + cudaGetErrorString(e) +
                  "); is a GPU present and the driver loaded?");
    }
    const bool device_memory =
        attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
    if (!device_memory) {
      const char* kind = attr.type == cudaMemoryTypeHost ? "pinned host memory"
                                                         : "ordinary host memory";
      throw Error(std::string(kTensorNames[a]) + " claims to be on cuda:" +
                  std::to_string(x.device.device_id) + " but its memory is " + kind +
                  ", which the kernel cannot address; expected device or managed memory "
                  "(copy it to the GPU first)");
    }
    if (attr.device != x.device.device_id)
      throw Error(std::string(kTensorNames[a]) + " claims to be on cuda:" +
                  std::to_string(x.device.device_id) + " but its memory belongs to cuda:" +
                  std::to_string(attr.device) + " (move it with .to(q.device))");
  }
}

void run(const Problem& p, const ExecOptions& options) {
  if (p.num_tokens == 0) return;
  const int device = p.device.device_id;
  DeviceGuard guard(device);
  DeviceState& st = device_state(device);
  cudaStream_t stream = static_cast<cudaStream_t>(options.stream);

  Params prm{};  // (every field defined: the kernels fold all parameter lines, see param_lines)
  prm.q = tensor3(p.q);
  prm.k = tensor3(p.k);
  prm.v = tensor3(p.v);
  prm.q_rot = tensor3(p.q_rot);
  prm.k_rot = tensor3(p.k_rot);
  prm.k_pool = tensor3(p.k_pool);
  prm.v_pool = tensor3(p.v_pool);
  prm.positions = p.positions.data;
  prm.slots = p.slots.data;
  prm.inv_freq = device_inv_freq(device, p.freq);
  prm.err = st.err.load(std::memory_order_relaxed);
  prm.pos_stride = p.positions.stride;
  prm.slot_stride = p.slots.stride;
  prm.pool_size = p.pool_size;
  prm.num_qo_heads = static_cast<int>(p.num_qo_heads);
  prm.num_kv_heads = static_cast<int>(p.num_kv_heads);
  prm.half = static_cast<int>(p.rotary_dim / 2);
  prm.rotary_dim = static_cast<int>(p.rotary_dim);
  prm.pos64 = p.pos_type == IndexType::kI64;
  prm.slot64 = p.slot_type == IndexType::kI64;
  prm.cos_sin = p.cos_sin_cache.data;
  prm.cs_rows = p.cos_sin_cache.rows;
  prm.cs_s0 = p.cos_sin_cache.stride[0];
  prm.cs_s1 = p.cos_sin_cache.stride[1];
  prm.cs_dtype = static_cast<int>(p.cos_sin_cache.dtype);

  const int64_t esize = element_size(p.dtype);
  prm.attention_factor = p.attention_factor;
  if (const int64_t lane_vec = small_kernel(p, esize, st.sms))
    return launch_small(prm, p, st, lane_vec, stream);
  const bool table = table_kernel(p, esize);
  const bool plain_call = is_plain(p) || table;
  const bool norm = has_qk_norm(p);  // (not plain)
  bool contig = true;
  int vec = 1;
  if (table) {
    vec = static_cast<int>(16 / esize);
  } else if (plain_call) {
    for (int64_t bytes = 16; bytes >= 2; bytes /= 2) {
      const int64_t v = bytes / esize;
      if (v < 2) break;  // one element: the strided kernel does the same work
      if (vector_ok(p, v, esize, esize)) {
        vec = static_cast<int>(v);
        break;
      }
    }
  } else if (vector_ok(p, 16 / esize, esize, element_size(p.pool_type))) {
    vec = static_cast<int>(16 / esize);  // the options kernel: 16 bytes or strided
    // A QK-norm over more chunks of a head (items, below) than a team has
    // lanes reads the head twice: only the strided kernel does.
    if (norm && (p.head_dim - p.rotary_dim / 2) / vec > detail::kMaxTeam) vec = 1;
  }
  if (vec == 1) contig = false;

  // Items per head: CH pairs of rotated vectors + the unrotated tail; a team
  // is one warp holding HP heads, or up to kMaxTeam lanes for wide heads.
  const int64_t pairs = p.rotary_dim / 2 / vec;
  const int64_t items = pairs + (p.head_dim - p.rotary_dim) / vec;
  int64_t heads_par, lanes;
  if (items <= 32) {
    heads_par = 32 / items;
    lanes = 32;
  } else {
    heads_par = 1;
    lanes = 64;
    while (lanes < items && lanes < detail::kMaxTeam) lanes *= 2;
  }
  const int64_t heads = p.num_qo_heads + 2 * p.num_kv_heads;
  if (heads > INT_MAX / 4 || p.head_dim > INT_MAX / 4)
    throw Error("num_qo_heads + 2*num_kv_heads and head_dim must fit in 29 bits");
  const int64_t steps = ceil_div(heads, heads_par);
  // A one-step call (the options kernel's U = 1 build) spreads each token
  // over several blocks of one-warp teams, on as many SMs, while the grid
  // stays small: their loads and stores go through several SMs' memory
  // pipelines at once (each block makes the token's cos/sin itself). Blocks
  // of at least 4 warps came within 0.03 us of the best of 2, 3, 4, 6 and 8
  // at T <= 8; where they would overfill the grid, fewer and larger blocks
  // won (2 per token at T = 32); a grid of more than half the SMs gained
  // nothing or lost. Llama-3.1-8B bf16, cold L2: T = 1 1.96 -> 1.80 us,
  // T = 32 2.26 -> 2.14 (H200, docs/performance.md, *Blocks per token*).
  // Measured on 16-bit data (float32 calls with options keep one block of up
  // to 16 warps per token); a split must give a token more blocks than the
  // one-step build's own 16-warp blocks do.
  const int64_t split_blocks =
      esize == 2 && lanes == 32 ? std::min(split_grid_limit(st.sms) / p.num_tokens,
                                           ceil_div(steps, split_teams()))
                                : 1;
  const bool split = split_blocks > ceil_div(steps, detail::max_block(1) / 32);
  // Small plain calls of 16-bit data in 16-byte vectors that the small
  // kernel does not take (partial rotary; all of them with
  // ROPEKV_CUDA_SMALL_TOKENS=0) run that one-step build: one step per team,
  // twice the warps of the plain kernel's two steps, measured faster at
  // decode (docs/performance.md, *One step per team*); with a cos_sin_cache
  // only when split (unsplit, the table kernel is faster). Not when
  // ROPEKV_CUDA_UNROLL forces the plain kernel's steps.
  const bool one_step = esize == 2 && vec * esize == 16 &&
                        p.num_tokens * steps <= kOptionsOneStep && forced_unroll() == 0 &&
                        (!table || split);
  const bool plain = plain_call && !one_step;
  int unroll = contig ? choose_unroll(p.num_tokens, steps, vec * esize, !plain, norm) : 4;
  if (table && plain) unroll = unroll <= 2 ? 2 : 4;  // the table kernel's two builds
  // The options kernels: U = 1 compiled, or U = kOptSteps compiled and
  // `unroll` of them taken (2 or 4), or the strided kernel's one.
  const int kernel_u = plain ? unroll : (contig && unroll > 1 ? detail::kOptSteps : 1);
  if (!plain) unroll = !contig ? 1 : std::min(unroll, detail::kOptSteps);
  const int64_t batches = ceil_div(steps, unroll);
  // The teams of one token share a block (and its cos/sin) when they fit.
  int64_t per_block =
      std::max<int64_t>(1, std::min(batches, detail::max_block(kernel_u) / lanes));
  if (!plain && contig && unroll == 1 && split)
    per_block = std::min(per_block, ceil_div(steps, split_blocks));  // (batches = steps)
  const int64_t blocks_per_token = ceil_div(batches, per_block);
  per_block = ceil_div(batches, blocks_per_token);
  size_t smem = static_cast<size_t>(p.rotary_dim) * sizeof(float);  // cos + sin
  if (smem > 48 * 1024)
    throw Error("rotary dimension " + std::to_string(p.rotary_dim) +
                " is too large for the CUDA backend (at most 12288)");
  if (norm) {
    // q and k weights, and a sum of squares per (warp, step) of wide teams.
    smem += static_cast<size_t>(2 * p.head_dim) * sizeof(float) +
            static_cast<size_t>(per_block * lanes / 32 * kernel_u) * sizeof(float);
    if (smem > 48 * 1024)
      throw Error("head_dim " + std::to_string(p.head_dim) + " with rotary_dim " +
                  std::to_string(p.rotary_dim) +
                  " is too large for QK-norm on the CUDA backend (2 * head_dim + rotary_dim "
                  "must stay below about 12000)");
  }
  prm.pair_items = static_cast<int>(pairs);
  prm.items = static_cast<int>(items);
  prm.heads_par = static_cast<int>(heads_par);
  prm.team_lanes = static_cast<int>(lanes);
  prm.teams_per_block = static_cast<int>(per_block);
  prm.blocks_per_token = static_cast<int>(blocks_per_token);
  prm.num_batches = static_cast<int>(batches);
  Launch l;
  l.blocks = p.num_tokens * blocks_per_token;
  l.threads = static_cast<int>(per_block * lanes);
  l.smem = smem;
  l.pdl = st.pdl;
  if (l.blocks > INT_MAX) throw Error("too many tokens for one launch");
  prm.early_params = l.blocks <= st.sms;  // see param_lines

  if (!plain) {
    OptParams op{};
    static_cast<Params&>(op) = prm;
    op.o = options_of(p, unroll);
    switch (p.dtype) {
      case FloatType::kF32: return launch_options_typed<float>(op, contig, l, stream);
      case FloatType::kF16: return launch_options_typed<__half>(op, contig, l, stream);
      case FloatType::kBF16: return launch_options_typed<__nv_bfloat16>(op, contig, l, stream);
    }
  }
  switch (p.dtype) {
    case FloatType::kF32: return launch_typed<float>(prm, vec, contig, unroll, l, stream);
    case FloatType::kF16: return launch_typed<__half>(prm, vec, contig, unroll, l, stream);
    case FloatType::kBF16:
      return launch_typed<__nv_bfloat16>(prm, vec, contig, unroll, l, stream);
  }
}

std::vector<int64_t> read_slots(const Problem& p, void* stream_ptr) {
  DeviceGuard guard(p.device.device_id);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(stream, &capturing), "cudaStreamIsCapturing");
  if (capturing != cudaStreamCaptureStatusNone) return {};  // cannot sync inside a capture
  const int64_t esize = element_size(p.slot_type);
  const int64_t n = p.num_tokens;
  std::vector<char> raw(static_cast<size_t>(n * esize));
  // One strided 2-D copy: n rows of one element, `stride` elements apart.
  check(cudaMemcpy2DAsync(raw.data(), esize, p.slots.data, p.slots.stride * esize, esize, n,
                          cudaMemcpyDeviceToHost, stream),
        "reading slots for the checked mode");
  check(cudaStreamSynchronize(stream), "reading slots for the checked mode");
  std::vector<int64_t> out(static_cast<size_t>(n));
  const View1 host{raw.data(), 1};
  for (int64_t i = 0; i < n; ++i) out[i] = load_index(host, p.slot_type, i);
  return out;
}

void check_errors(int device_id, void* stream_ptr) {
  if (device_id < 0 || device_id >= kMaxDevices) return;
  ErrorRecord* rec = g_devices[device_id].err.load(std::memory_order_acquire);
  if (rec == nullptr) return;  // no call has run on this device
  DeviceGuard guard(device_id);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(stream, &capturing), "cudaStreamIsCapturing");
  if (capturing != cudaStreamCaptureStatusNone) return;  // cannot sync inside a capture
  check(cudaStreamSynchronize(stream), "a ropekv kernel (cudaStreamSynchronize)");
  ErrorRecord h;
  check(cudaMemcpyAsync(&h, rec, sizeof(h), cudaMemcpyDeviceToHost, stream),
        "reading the device error flag");
  check(cudaStreamSynchronize(stream), "reading the device error flag");
  if (h.count == 0 && h.pos_count == 0) return;
  const ErrorRecord init = initial_record();
  check(cudaMemcpyAsync(rec, &init, sizeof(init), cudaMemcpyHostToDevice, stream),
        "clearing the device error flag");
  check(cudaStreamSynchronize(stream), "clearing the device error flag");
  std::string slots;
  if (h.count != 0)
    slots = "slots[" + std::to_string(h.token) + "] = " + std::to_string(h.slot) +
            " is out of range for a pool of " + std::to_string(h.pool_size) +
            " rows (k_pool.shape[0]); the CUDA kernel skipped the pool writes of " +
            std::to_string(h.count) +
            " token(s) with such slots since the last check (their pool rows were not "
            "written; q_rot and k_rot were)";
  if (h.pos_count == 0) throw Error(slots);
  // Positions first, as the CPU's validation checks them first.
  throw Error(position_error(h.pos_token, h.position, h.rows) +
              "; the CUDA kernel skipped " + std::to_string(h.pos_count) +
              " token(s) with such positions since the last check (nothing of them was "
              "written: not q_rot, k_rot nor their pool rows)" +
              (slots.empty() ? std::string() : "; also " + slots));
}

}  // namespace cuda
}  // namespace ropekv
