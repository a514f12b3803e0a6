// ropekv — fused RoPE + KV-cache scatter for LLM inference.
//
// One call, once per attention layer per forward pass:
//
//   for every token t in [0, T):
//     q_rot[t, h] = rope(q[t, h], positions[t])          h in [0, Hq)
//     k_rot[t, h] = rope(k[t, h], positions[t])          h in [0, Hk)
//     if slots[t] >= 0:
//       k_pool[slots[t], h] = k_rot[t, h]
//       v_pool[slots[t], h] = v[t, h]
//
//   q, q_rot       [T, Hq, D]     k, v, k_rot    [T, Hk, D]
//   positions      [T] int32|int64 (absolute token positions)
//   slots          [T] int32|int64 (pool row per token; < 0 = do not write)
//   k_pool, v_pool [P, Hk, D]     (one layer's cache, updated in place)
//
// The math (NeoX / rotate-half RoPE, Su et al. 2021, "RoFormer", as in
// GPT-NeoX, Hugging Face transformers and vLLM). R = rotary_dim (default
// head_dim), half = R/2,
// for i in [0, half):
//
//   inv_freq[i] = fp32(rope_base ** (-2i / R))       evaluated in double
//   theta       = fp32(fp32(pos) * inv_freq[i])       the angle is an fp32 number
//   c, s        = cos(theta), sin(theta)              accurate for every angle
//   out[i]      = x[i] * c - x[i + half] * s          in fp32, rounded once
//   out[i+half] = x[i + half] * c + x[i] * s            (round to nearest even)
//
// Dimensions R..D-1 are copied unchanged. Every element of q_rot, k_rot and
// of the named pool rows is written; nothing else is.
//
// Arrays are DLPack DLTensor views (any strides, in elements; strides == NULL
// means compact row-major). Every check of the contract runs before the first
// write: a call that throws ropekv::Error has changed nothing.
#pragma once

#include <dlpack/dlpack.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace ropekv {

/// Thrown for every input that breaks the contract (bad shape, dtype, device,
/// argument value or slot). The message starts with the exact text of the
/// contract's error table. Nothing has been written when it is thrown.
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// What the op computes. Defaults are the original call's: NeoX pairs over
/// the whole head.
struct RopeConfig {
  int64_t head_dim = 0;      ///< D, elements per head; even, >= 2
  int64_t num_qo_heads = 0;  ///< Hq, query heads per token; >= 1
  int64_t num_kv_heads = 0;  ///< Hk, key/value heads per token; >= 1
  double rope_base = 10000.0;  ///< RoPE theta; finite, > 0
  /// R, the leading dimensions of each head that rotate (partial rotary:
  /// Phi-2 rotates 32 of 80, GPT-NeoX 24 of 96); the rest are copied. Even,
  /// 2 <= R <= head_dim; 0 means head_dim.
  int64_t rotary_dim = 0;
};

/// How the op runs. Does not change the results.
struct ExecOptions {
  /// CPU threads; 0 = OpenMP's default (OMP_NUM_THREADS, else all cores).
  /// Results are bit-identical for every thread count.
  int num_threads = 0;
  /// CUDA stream (a cudaStream_t) the kernel is launched on; nullptr = the
  /// legacy default stream. Ignored on the CPU.
  void* stream = nullptr;
  /// Checked mode: also reject duplicate non-negative slots (two tokens
  /// racing for one pool row; on the CPU before anything is written), and on
  /// CUDA synchronise after the launch and raise for the out-of-range slots
  /// the kernel skipped (see check_device_errors). Costs a sort of the slots
  /// and, on CUDA, a host synchronisation per call.
  bool checked = false;
};

/// The arrays of one call. q_rot and k_rot are written; k_pool and v_pool are
/// written at the rows `slots` names; the rest are read.
struct RopePoolTensors {
  DLTensor q;          ///< [T, Hq, D] f16 | bf16 | f32
  DLTensor k;          ///< [T, Hk, D] same dtype as q
  DLTensor v;          ///< [T, Hk, D] same dtype as q
  DLTensor positions;  ///< [T] int32 | int64, absolute positions
  DLTensor slots;      ///< [T] int32 | int64, pool row or < 0 for none
  DLTensor k_pool;     ///< [P, Hk, D] same dtype as q, written in place
  DLTensor v_pool;     ///< [P, Hk, D] same dtype as q, written in place
  DLTensor q_rot;      ///< [T, Hq, D] same dtype as q, output
  DLTensor k_rot;      ///< [T, Hk, D] same dtype as q, output
};

/// Rotates q and k with RoPE and scatters k_rot and v into the pools.
///
/// All arrays live on one device: the CPU (kDLCPU) or one CUDA GPU (kDLCUDA).
/// On the CPU it runs Highway SIMD code for the best instruction set of the
/// machine, on OpenMP threads; on CUDA, one kernel launch on
/// `options.stream`, with no host synchronisation and no allocation.
///
/// Throws ropekv::Error (a std::invalid_argument) with the contract's message
/// for the first broken rule, before anything is written: shapes, dtypes,
/// config values, devices, and on the CPU any slot >= P. On a GPU an
/// out-of-range slot is skipped and reported by the checked mode instead.
void rope_pool_fused(const RopePoolTensors& tensors, const RopeConfig& config,
                     const ExecOptions& options = {});

/// Runs every check rope_pool_fused runs, and nothing else. Throws the same
/// ropekv::Error; returns normally for a call that would succeed.
void validate(const RopePoolTensors& tensors, const RopeConfig& config);

/// Checked mode of the CUDA backend. A kernel never writes outside the pool:
/// it skips a token whose slot is >= pool_size and records it in a
/// device-side error flag of its device. This synchronises `stream` (a
/// cudaStream_t; nullptr = legacy default), reads and clears the flag of
/// CUDA device `device_id`, and throws the same Error the CPU raises if a
/// call since the last check skipped a token. A no-op without CUDA.
void check_device_errors(int device_id, void* stream);

/// True when this build of ropekv has the CUDA backend.
bool has_cuda();

/// The CPU instruction set the CPU backend dispatches to, e.g. "AVX3" or "AVX2".
std::string cpu_target();

/// ropekv's version, "MAJOR.MINOR.PATCH".
const char* version();

}  // namespace ropekv
