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
// of the named pool rows is written; nothing else is. (On CUDA a token whose
// slot is >= P loses its pool writes, one whose position is outside
// cos_sin_cache all its writes; checked mode reports both: ExecOptions.)
//
// Options, all off by default (RopeConfig and the optional tensors):
//   is_neox             true by default; false: pairs (2i, 2i+1) instead of (i, i+half)
//   rope_scaling        inv_freq of Hugging Face's linear / llama3 / yarn /
//                       proportional scaling; yarn multiplies c and s by its
//                       attention factor m: c = fp32(c * m), s = fp32(s * m)
//   cos_sin_cache       c, s read from a [max_position, R] table at row pos
//   q/k_norm_weight     x -> fp32(fp32(x * r) * w), r = 1/sqrt(mean(x^2) + eps)
//                       over the whole head, in fp32, before the rotation
//                       (RMSNorm, Zhang & Sennrich 2019, as transformers'
//                       Qwen3 q_norm / k_norm apply it)
//   kv_cache_dtype      pool rows hold encode(k_rot) and encode(v): exact
//                       widening to float32, or fp8 of fp32(x / scale)
//
// Arrays are DLPack DLTensor views (strides in elements, strides == NULL
// meaning compact row-major; rejected: null data, misaligned bases, written
// arrays that overlap themselves or another array). Every check of the
// contract runs before the first write: a call whose checks throw
// ropekv::Error has changed nothing. CUDA's checked mode and
// check_device_errors throw it after the kernel ran, for what it skipped.
#pragma once

#include <dlpack/dlpack.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace ropekv {

/// Thrown for every input that breaks the contract (bad shape, dtype, device,
/// argument value or slot). The message starts with the exact text of the
/// contract's error table. Nothing has been written when a call's checks
/// throw it; CUDA's checked mode and check_device_errors throw it after the
/// kernel ran, for the tokens it skipped.
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// Hugging Face `rope_scaling` types (transformers' modeling_rope_utils).
enum class RopeScalingType {
  kNone,    ///< plain RoPE
  kLinear,  ///< position interpolation: inv_freq / factor
  kLlama3,  ///< Llama 3.1's wavelength-banded interpolation
  kYarn,    ///< YaRN (Peng et al. 2023), with its attention factor on cos and sin
  /// Gemma-4's full-attention layers: the first pairs rotate at the plain
  /// frequencies (divided by factor), the rest at angle 0 (cos 1, sin 0).
  kProportional,
};

/// A `rope_scaling` entry of a Hugging Face config. The inverse frequencies
/// are those of transformers' `_compute_{linear,llama3,yarn,proportional}_parameters`,
/// evaluated in double and rounded once to fp32. With type kNone every field
/// must keep its default: one set without a type is an Error (a factor so
/// dropped would change every angle). A type ignores the fields it does not
/// read, as transformers does.
struct RopeScaling {
  RopeScalingType type = RopeScalingType::kNone;
  double factor = 1.0;           ///< linear, llama3, yarn, proportional: finite, > 0
  double low_freq_factor = 0.0;  ///< llama3: finite, > 0
  double high_freq_factor = 0.0; ///< llama3: finite, >= low_freq_factor
  /// llama3, yarn: the pre-training context length, > 0.
  double original_max_position_embeddings = 0.0;
  double beta_fast = 32.0;  ///< yarn: rotations of the fast band, > 0
  double beta_slow = 1.0;   ///< yarn: rotations of the slow band, > 0
  /// yarn: multiplies cos and sin. Not given (nullopt), transformers'
  /// default: with mscale and mscale_all_dim both non-zero,
  /// get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim), else
  /// get_mscale(factor), where get_mscale(s, m) = 0.1 m ln(s) + 1 for s > 1,
  /// else 1. Given or made, the factor must be finite and > 0 as a float32
  /// (the kernels apply it in fp32): a given 0 is an error.
  std::optional<double> attention_factor;
  double mscale = 0.0;          ///< yarn (DeepSeek form), finite; 0 = absent
  double mscale_all_dim = 0.0;  ///< yarn (DeepSeek form), finite; 0 = absent
  bool truncate = true;         ///< yarn: floor/ceil the correction range
  /// proportional: the fraction p of the pairs that rotate, in [0, 1]; read
  /// by that type only, and any other type with a p other than 1 is an
  /// error (for those, where a Hugging Face dict holds a
  /// partial_rotary_factor, set RopeConfig::rotary_dim to int(head_dim * p),
  /// as transformers and ropekv's Python layer do). The
  /// first floor(p R / 2) of the R/2 pairs get rope_base ** (-2i / R) /
  /// factor, the rest inv_freq 0, so finite nonzero values come back
  /// unchanged (x * 1 - y * 0, as transformers computes it). R (rotary_dim)
  /// is not changed by it (transformers' proportional RoPE rotates over the
  /// whole head_dim, as ropekv's default rotary_dim does).
  double partial_rotary_factor = 1.0;
};

/// Format of k_pool and v_pool.
enum class KvCacheDtype {
  kAuto,     ///< the dtype of q (the original call's rule)
  kFloat32,  ///< float32 pools for any input dtype
  kFp8E4M3,  ///< 8-bit OCP E4M3 ("fn": max 448, no Inf): pools of uint8 or float8_e4m3fn
  kFp8E5M2,  ///< 8-bit OCP E5M2 (max 57344): pools of uint8 or float8_e5m2
};

/// DLPack 1.1's type codes of the two fp8 formats (kDLFloat8_e4m3fn,
/// kDLFloat8_e5m2; bits 8), for dlpack.h headers that predate them. An fp8
/// pool may be typed so (as PyTorch and ml_dtypes type theirs) or be its
/// bytes as uint8.
inline constexpr uint8_t kDLCodeFloat8E4M3fn = 10;
inline constexpr uint8_t kDLCodeFloat8E5M2 = 12;

/// What the op computes. Defaults are the original call's: NeoX pairs over
/// the whole head, frequencies from rope_base, pools of q's dtype. (The
/// original has no default rope_base: set the model's rope_theta; 10000 is
/// RoFormer's.)
struct RopeConfig {
  int64_t head_dim = 0;      ///< D, elements per head; even, >= 2
  int64_t num_qo_heads = 0;  ///< Hq, query heads per token; >= 1
  int64_t num_kv_heads = 0;  ///< Hk, key/value heads per token; >= 1
  double rope_base = 10000.0;  ///< RoPE theta; finite, > 0 (checked with a cos_sin_cache too)
  /// R, the leading dimensions of each head that rotate (partial rotary:
  /// Phi-2 rotates 32 of 80, GPT-NeoX 24 of 96); the rest are copied. Even,
  /// 2 <= R <= head_dim; 0 means head_dim.
  int64_t rotary_dim = 0;
  /// true: NeoX / rotate-half pairs (i, i + R/2). false: GPT-J / GLM
  /// interleaved pairs (2i, 2i + 1), MLX's `traditional=True`.
  bool is_neox = true;
  /// Frequency scaling (Hugging Face `rope_scaling`); must be kNone when a
  /// cos_sin_cache is given.
  RopeScaling rope_scaling;
  /// Pool format. fp8 pools store encode(x / scale): x the value written to
  /// k_rot (keys) or read from v (values), divided in fp32, rounded to nearest
  /// even and saturated to the format's largest finite value (NaN stays NaN),
  /// as vLLM's reshape_and_cache_flash stores it.
  KvCacheDtype kv_cache_dtype = KvCacheDtype::kAuto;
  /// fp8 pools: per-tensor key scale, finite and > 0, as a float32 too (the
  /// kernels divide in fp32); any other kv_cache_dtype takes only 1.0.
  double k_scale = 1.0;
  double v_scale = 1.0;  ///< fp8 pools: per-tensor value scale, as k_scale
  /// QK-norm (RMSNorm over each head, before the rotation) epsilon, used
  /// when q_norm_weight or k_norm_weight is given; finite (as a float32 too),
  /// >= 0.
  double norm_eps = 1e-6;
};

/// How the op runs. Does not change the results.
struct ExecOptions {
  /// CPU threads; 0 = OpenMP's default (OMP_NUM_THREADS, else all cores);
  /// negative: an Error (the last check, after the arrays'). A call starts at most max(64, 4 x processors) and
  /// at most one per 64 KiB it moves. Results are bit-identical for every
  /// thread count.
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
/// written at the rows `slots` names; the rest are read. The last three are
/// optional: a zero-initialised DLTensor (data == NULL, ndim == 0) is absent.
struct RopePoolTensors {
  DLTensor q;          ///< [T, Hq, D] f16 | bf16 | f32
  DLTensor k;          ///< [T, Hk, D] same dtype as q
  DLTensor v;          ///< [T, Hk, D] same dtype as q
  DLTensor positions;  ///< [T] int32 | int64, absolute positions
  DLTensor slots;      ///< [T] int32 | int64, pool row or < 0 for none
  DLTensor k_pool;     ///< [P, Hk, D] q's dtype (or kv_cache_dtype), written in place
  DLTensor v_pool;     ///< [P, Hk, D] like k_pool, written in place
  DLTensor q_rot;      ///< [T, Hq, D] same dtype as q, output (may be q itself)
  DLTensor k_rot;      ///< [T, Hk, D] same dtype as q, output (may be k itself)
  /// Optional [max_position, R] f32 or q's dtype, vLLM's layout: row p holds
  /// cos(p * inv_freq[i]) in columns [0, R/2) and the sines in [R/2, R).
  /// Replaces the frequencies from rope_base (still checked); every position
  /// must be in [0, max_position).
  /// (The optional members start zeroed, absent, so that `{q, k, ..., k_rot}`
  /// leaves them so without -Wmissing-field-initializers warnings.)
  DLTensor cos_sin_cache{};
  DLTensor q_norm_weight{};  ///< optional [D] f32 or q's dtype: QK-norm of q
  DLTensor k_norm_weight{};  ///< optional [D] f32 or q's dtype: QK-norm of k
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
/// config values, devices, layouts, and on the CPU any slot >= P or position
/// outside cos_sin_cache. On a GPU such a token is skipped and reported by
/// the checked mode (after the launch) instead. A failing CUDA API call
/// throws std::runtime_error, an allocation of the CPU backend's scratch
/// std::bad_alloc.
void rope_pool_fused(const RopePoolTensors& tensors, const RopeConfig& config,
                     const ExecOptions& options = {});

/// Runs every check rope_pool_fused runs on the tensors and the config, and
/// nothing else. Throws the same ropekv::Error; returns normally for a call
/// that would succeed with the default ExecOptions. Not checked here: what
/// ExecOptions add (num_threads >= 0; checked mode's repeated slots), and
/// the CUDA backend's own checks at launch, before any write (the memory
/// behind each pointer on its device; rotary_dim up to 12288, and for a
/// QK-norm 2 * head_dim + rotary_dim below about 12000; heads and head_dim
/// within 29 bits; the blocks of one launch).
void validate(const RopePoolTensors& tensors, const RopeConfig& config);

/// Checked mode of the CUDA backend. A kernel never writes outside the pool:
/// it skips a token whose slot is >= pool_size and records it in a
/// device-side error flag of its device. This synchronises `stream` (a
/// cudaStream_t; nullptr = legacy default), reads and clears the flag of
/// CUDA device `device_id`, and throws the same Error the CPU raises if a
/// call since the last check skipped a token. A no-op in a build without
/// CUDA, for a device id no call has run on (no flag was made yet) or out of
/// range, and while `stream` is being captured into a graph (no sync there).
void check_device_errors(int device_id, void* stream);

/// The fp32 inverse frequencies the kernels rotate with: rotary_dim / 2
/// values (rotary_dim 0 = head_dim), rope_base ** (-2i / R) scaled by
/// config.rope_scaling as transformers' rope initialisation functions do,
/// evaluated in double and rounded once. Throws Error for a head_dim,
/// rotary_dim, rope_base or rope_scaling the op would reject.
std::vector<float> rope_inv_freq(const RopeConfig& config);

/// The factor cos and sin are multiplied by: yarn's attention factor (see
/// RopeScaling::attention_factor), 1 for every other scaling type. Checks
/// nothing: the fields are validated by rope_inv_freq and the call.
double rope_attention_factor(const RopeScaling& scaling);

/// True when this build of ropekv has the CUDA backend.
bool has_cuda();

/// The CPU instruction set the CPU backend dispatches to, e.g. "AVX3" or "AVX2".
std::string cpu_target();

/// ropekv's version, "MAJOR.MINOR.PATCH".
const char* version();

}  // namespace ropekv
