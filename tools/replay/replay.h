// The replay engine: continuous batching over a KV pool, one call of
// ropekv::rope_pool_fused per layer per step, and the verification of
// everything the calls wrote.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "model_config.h"
#include "numerics.h"
#include "workload.h"

namespace replay {

/// A result that differs from the reference. The message names the check and
/// the first bad (request, token, layer, head); the tool exits with status 1.
class VerifyError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct ReplayOptions {
  Dtype dtype = Dtype::kBF16;
  KvDtype kv_dtype = KvDtype::kAuto;  ///< pool format (RopeConfig::kv_cache_dtype)
  double k_scale = 1.0, v_scale = 1.0;  ///< fp8 pools: stored = encode(x / scale)
  int threads = 0;                 ///< ExecOptions::num_threads (0 = OpenMP default)
  int64_t layers = 0;              ///< layers replayed (<= config's; 0 = all)
  int64_t pool_size = 0;           ///< KV slots per layer (0 = auto)
  int64_t max_batch_tokens = 512;  ///< token budget of one step (chunked prefill)
  int64_t max_running = 64;        ///< requests decoding/prefilling at once
  uint64_t seed = 1;
  bool fused_qkv = true;    ///< q/k/v are views of one [T, (Hq+2Hk)*D] buffer
  bool pad_decode = false;  ///< pad decode-only steps to CUDA-graph sizes with slot -1
  int spot_checks = 4;      ///< (layer, token, head) samples of q_rot and of k_rot per step
  bool check_all = false;   ///< check every q_rot/k_rot element of every call
  bool progress = false;    ///< progress bar on stderr
  std::string inject_fault;  ///< hidden: "", pool-k, pool-v, k-rot, q-rot, stray, rope-type
  int64_t inject_at = 100;   ///< hidden: first call index eligible for the fault
};

struct ReplayResult {
  int64_t pool_size = 0;
  int64_t layers = 0;
  int64_t requests = 0, prompt_tokens = 0, output_tokens = 0;
  int64_t steps = 0, decode_only_steps = 0;
  int64_t calls = 0, decode_only_calls = 0;
  int64_t tokens = 0;        ///< sum of T over calls (padding included)
  int64_t rows_written = 0;  ///< sum of W over calls
  int64_t max_call_tokens = 0;
  int64_t slot_reuses = 0;   ///< allocations of a slot that an earlier request had used
  double bytes = 0;          ///< SPEC section 7, summed over calls
  double decode_only_bytes = 0;
  double op_seconds = 0;     ///< sum of the timed calls
  double decode_only_op_seconds = 0;
  double wall_seconds = 0;   ///< the replay loop and its verification
  std::vector<double> call_us;  ///< every call's time, microseconds
  int64_t spot_checked_heads = 0, pool_rows_checked = 0, untouched_rows_checked = 0;
  bool fault_injected = false;
  /// Resident memory (MB) after the first tenth of the steps (warm-up) and
  /// at the end of the run: flat across calls when nothing leaks or grows.
  double rss_warm_mb = 0, rss_end_mb = 0;
};

/// Runs the workload through the op. Throws VerifyError on the first mismatch
/// and InputError when the workload does not fit the pool.
ReplayResult run_replay(const ModelConfig& model, const Workload& workload, const ReplayOptions& opt);

/// This process's resident memory in MB (Linux), or -1.
double resident_mb();

/// Bytes moved by one call (SPEC section 7, with the pool rows at the pool's
/// element size), int32 positions and slots.
double call_bytes(const ModelConfig& m, Dtype t, KvDtype kv, int64_t tokens, int64_t written);

}  // namespace replay
