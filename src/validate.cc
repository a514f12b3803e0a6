// The contract, once: every rule a call must meet, checked in the order the
// contract gives, before any backend runs. Backends trust the Problem.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>
#include <vector>
#include <string>

#include "backends.h"
#include "problem.h"

namespace ropekv {
namespace {

[[noreturn]] void fail(const std::string& message) { throw Error(message); }

// Shapes print as Python tuples: (4, 8, 128), (4,), (). (No iostreams here:
// messages are built from std::to_string only, so no locale is involved.)
std::string shape_str(const DLTensor& t) {
  std::string s = "(";
  for (int i = 0; i < t.ndim; ++i) {
    if (i) s += ", ";
    s += std::to_string(t.shape[i]);
  }
  if (t.ndim == 1) s += ",";
  return s + ")";
}

std::string dtype_str(DLDataType d) {
  if (d.lanes != 1) return "vector dtype";
  const char* base = nullptr;
  switch (d.code) {
    case kDLFloat: base = "float"; break;
    case kDLBfloat: base = "bfloat"; break;
    case kDLInt: base = "int"; break;
    case kDLUInt: base = "uint"; break;
    case kDLComplex: base = "complex"; break;
    default: return "dtype code " + std::to_string(d.code);
  }
  return std::string(base) + std::to_string(d.bits);
}

std::string device_str(DLDevice d) {
  switch (d.device_type) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return "cuda:" + std::to_string(d.device_id);
    case kDLCUDAHost: return "cuda_host";
    case kDLCUDAManaged: return "cuda_managed:" + std::to_string(d.device_id);
    default: return "device type " + std::to_string(d.device_type) + ":" +
                    std::to_string(d.device_id);
  }
}

const char* kv_cache_dtype_name(KvCacheDtype d) {
  switch (d) {
    case KvCacheDtype::kAuto: return "auto";
    case KvCacheDtype::kFloat32: return "float32";
    case KvCacheDtype::kFp8E4M3: return "fp8_e4m3";
    case KvCacheDtype::kFp8E5M2: return "fp8_e5m2";
  }
  return "?";
}

std::string num_str(double x) {
  char value[32];
  std::snprintf(value, sizeof(value), "%g", x);
  return value;
}

bool present(const DLTensor& t) { return t.data != nullptr || t.ndim != 0; }

bool same_dtype(DLDataType a, DLDataType b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

bool shape_is(const DLTensor& t, int64_t a, int64_t b, int64_t c) {
  return t.ndim == 3 && t.shape[0] == a && t.shape[1] == b && t.shape[2] == c;
}

bool same_shape(const DLTensor& a, const DLTensor& b) {
  if (a.ndim != b.ndim) return false;
  for (int i = 0; i < a.ndim; ++i)
    if (a.shape[i] != b.shape[i]) return false;
  return true;
}

int64_t numel(const DLTensor& t) {
  int64_t n = 1;
  for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
  return n;
}

// Element strides; DLPack's NULL strides mean compact row-major.
void strides_of(const DLTensor& t, int64_t* out) {
  int64_t running = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    out[i] = t.strides ? t.strides[i] : running;
    running *= t.shape[i];
  }
}

void* base_pointer(const DLTensor& t) {
  return static_cast<char*>(t.data) + t.byte_offset;
}

View3 view3(const DLTensor& t) {
  View3 v;
  v.data = base_pointer(t);
  strides_of(t, v.stride);
  return v;
}

View1 view1(const DLTensor& t) {
  View1 v;
  v.data = base_pointer(t);
  int64_t s[1];
  strides_of(t, s);
  v.stride = s[0];
  return v;
}

bool float_dtype(DLDataType d, FloatType* out) {
  if (d.lanes != 1) return false;
  if (d.code == kDLFloat && d.bits == 32) { *out = FloatType::kF32; return true; }
  if (d.code == kDLFloat && d.bits == 16) { *out = FloatType::kF16; return true; }
  if (d.code == kDLBfloat && d.bits == 16) { *out = FloatType::kBF16; return true; }
  return false;
}

void check_index_dtype(const DLTensor& t, const char* name, IndexType* out) {
  const DLDataType d = t.dtype;
  if (d.lanes == 1 && d.code == kDLInt && d.bits == 32) { *out = IndexType::kI32; return; }
  if (d.lanes == 1 && d.code == kDLInt && d.bits == 64) { *out = IndexType::kI64; return; }
  fail(std::string(name) + " must be an int32 or int64 array, got " + dtype_str(d) +
       " (convert with .astype(int32) / .to(torch.int32))");
}

// An array we will write must not have two elements at one address, else two
// tokens' writes race and the result depends on the schedule.
void check_no_self_overlap(const DLTensor& t, const char* name) {
  if (numel(t) == 0) return;
  int64_t s[3];
  strides_of(t, s);
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] > 1 && s[i] == 0)
      fail(std::string(name) + " has stride 0 along axis " + std::to_string(i) +
           ": its elements overlap, so writes to it would collide; pass an array "
           "that owns its memory (e.g. a contiguous copy)");
  }
}

Weight weight(const DLTensor& t) {
  Weight w;
  if (!present(t)) return w;
  float_dtype(t.dtype, &w.dtype);
  w.data = base_pointer(t);
  int64_t s[1];
  strides_of(t, s);
  w.stride = s[0];
  return w;
}

void check_positive(double x, const char* name, const char* what) {
  if (!std::isfinite(x) || x <= 0.0)
    fail(std::string(name) + " must be finite and > 0" + what + ", got " + num_str(x));
}

// rope_scaling's fields, the way transformers' config validation reads them.
void check_rope_scaling(const RopeScaling& s) {
  switch (s.type) {
    case RopeScalingType::kNone: return;
    case RopeScalingType::kLinear:
      check_positive(s.factor, "rope_scaling factor", " (linear)");
      return;
    case RopeScalingType::kLlama3:
      check_positive(s.factor, "rope_scaling factor", " (llama3)");
      check_positive(s.low_freq_factor, "rope_scaling low_freq_factor", " (llama3)");
      check_positive(s.high_freq_factor, "rope_scaling high_freq_factor", " (llama3)");
      check_positive(s.original_max_position_embeddings,
                     "rope_scaling original_max_position_embeddings", " (llama3)");
      if (!(s.high_freq_factor > s.low_freq_factor))
        fail("rope_scaling high_freq_factor must be > low_freq_factor (llama3), got " +
             num_str(s.high_freq_factor) + " and " + num_str(s.low_freq_factor));
      return;
    case RopeScalingType::kYarn:
      check_positive(s.factor, "rope_scaling factor", " (yarn)");
      check_positive(s.original_max_position_embeddings,
                     "rope_scaling original_max_position_embeddings", " (yarn)");
      check_positive(s.beta_fast, "rope_scaling beta_fast", " (yarn)");
      check_positive(s.beta_slow, "rope_scaling beta_slow", " (yarn)");
      if (!std::isfinite(s.attention_factor) || s.attention_factor < 0.0)
        fail("rope_scaling attention_factor must be finite and >= 0 (0 = the default), got " +
             num_str(s.attention_factor));
      if (!std::isfinite(s.mscale) || !std::isfinite(s.mscale_all_dim))
        fail("rope_scaling mscale and mscale_all_dim must be finite");
      return;
  }
  fail("rope_scaling type is unknown");
}

// The options beyond the original call (RopeConfig's later fields and the
// optional tensors), after the original's checks.
void check_options(const RopePoolTensors& t, const RopeConfig& cfg, int64_t R, FloatType dtype) {
  const int64_t D = cfg.head_dim;
  check_rope_scaling(cfg.rope_scaling);
  const bool fp8 = cfg.kv_cache_dtype == KvCacheDtype::kFp8E4M3 ||
                   cfg.kv_cache_dtype == KvCacheDtype::kFp8E5M2;
  if (fp8) {
    // The kernels divide by the scale in fp32: one that rounds to 0 or Inf
    // there would store NaN or zeros.
    for (const auto& [scale, name] : {std::pair{cfg.k_scale, "k_scale"},
                                      std::pair{cfg.v_scale, "v_scale"}}) {
      check_positive(scale, name, "");
      const float f = static_cast<float>(scale);
      if (!std::isfinite(f) || f <= 0.0f)
        fail(std::string(name) + " must be finite and > 0 as a float32, got " + num_str(scale));
    }
  } else if (cfg.k_scale != 1.0 || cfg.v_scale != 1.0) {
    fail("k_scale/v_scale apply to fp8 pools only (kv_cache_dtype=\"fp8_e4m3\" or "
         "\"fp8_e5m2\"), got k_scale " + num_str(cfg.k_scale) + ", v_scale " +
         num_str(cfg.v_scale) + " with kv_cache_dtype=\"" +
         kv_cache_dtype_name(cfg.kv_cache_dtype) + "\"");
  }
  if (!std::isfinite(cfg.norm_eps) || cfg.norm_eps < 0.0)
    fail("norm_eps must be finite and >= 0, got " + num_str(cfg.norm_eps));

  // A float array of q's dtype or float32.
  auto check_float = [&](const DLTensor& a, const char* name) {
    FloatType ft;
    if (!float_dtype(a.dtype, &ft) || (ft != dtype && ft != FloatType::kF32))
      fail(std::string(name) + " dtype must be float32 or q's dtype (" +
           dtype_str(t.q.dtype) + "), got " + dtype_str(a.dtype));
  };
  if (present(t.cos_sin_cache)) {
    const DLTensor& c = t.cos_sin_cache;
    if (cfg.rope_scaling.type != RopeScalingType::kNone)
      fail("cos_sin_cache and rope_scaling exclude each other: the table already holds "
           "the scaled cos/sin (pass one of them)");
    if (c.ndim != 2 || c.shape[1] != R || c.shape[0] < 1)
      fail("cos_sin_cache shape must be [max_position, rotary_dim] = [>= 1, " +
           std::to_string(R) + "], got " + shape_str(c));
    check_float(c, "cos_sin_cache");
  }
  const std::pair<const char*, const DLTensor*> norms[] = {
      {"q_norm_weight", &t.q_norm_weight}, {"k_norm_weight", &t.k_norm_weight}};
  for (const auto& [name, w] : norms) {
    if (!present(*w)) continue;
    if (w->ndim != 1 || w->shape[0] != D)
      fail(std::string(name) + " shape must be [head_dim] = (" + std::to_string(D) +
           ",), got " + shape_str(*w));
    check_float(*w, name);
  }
}

}  // namespace

Problem make_problem(const RopePoolTensors& t, const RopeConfig& cfg,
                     bool check_index_values, bool check_duplicates) {
  // --- The original call's checks, in its order (messages exact). ---
  if (t.q.ndim != 3 || t.k.ndim != 3 || t.v.ndim != 3)
    fail("rope_pool_fused expects q/k/v to be 3-D, got q " + shape_str(t.q) + ", k " +
         shape_str(t.k) + ", v " + shape_str(t.v));
  if (t.positions.ndim != 1 || t.slots.ndim != 1)
    fail("rope_pool_fused expects positions/slots to be 1-D, got positions " +
         shape_str(t.positions) + ", slots " + shape_str(t.slots));
  if (t.k_pool.ndim != 3 || t.v_pool.ndim != 3) {
    const DLTensor& bad = t.k_pool.ndim != 3 ? t.k_pool : t.v_pool;
    const char* name = t.k_pool.ndim != 3 ? "k_pool" : "v_pool";
    std::string hint;
    if (bad.ndim == 4)
      hint = "; a 4-D pool is usually a layer-stacked cache: pass " + std::string(name) +
             "[layer]";
    else if (bad.ndim == 2)
      hint = "; a 2-D pool is usually a flattened one: reshape to "
             "[pool_size, num_kv_heads, head_dim]";
    fail("rope_pool_fused expects pool tensors to be 3-D, got " + std::string(name) + " " +
         shape_str(bad) + hint);
  }
  const int64_t T = t.q.shape[0];
  const int64_t Hq = cfg.num_qo_heads, Hk = cfg.num_kv_heads, D = cfg.head_dim;
  if (t.q.shape[1] != Hq || t.q.shape[2] != D)
    fail("q shape must be [num_tokens, num_qo_heads, head_dim], got " + shape_str(t.q) +
         " with num_qo_heads=" + std::to_string(Hq) + ", head_dim=" + std::to_string(D));
  if (!shape_is(t.k, T, Hk, D))
    fail("k shape must be [num_tokens, num_kv_heads, head_dim], got " + shape_str(t.k) +
         " with num_tokens=" + std::to_string(T) + ", num_kv_heads=" + std::to_string(Hk) +
         ", head_dim=" + std::to_string(D));
  if (!same_shape(t.v, t.k))
    fail("v shape must match k shape, got " + shape_str(t.v) + " vs " + shape_str(t.k));
  if (t.positions.shape[0] != T || t.slots.shape[0] != T)
    fail("positions/slots must have one entry per token, got positions " +
         shape_str(t.positions) + ", slots " + shape_str(t.slots) + " for " +
         std::to_string(T) + " tokens");
  if (t.k_pool.shape[1] != Hk || t.k_pool.shape[2] != D)
    fail("k_pool has incompatible shape " + shape_str(t.k_pool) +
         ", expected [pool_size, " + std::to_string(Hk) + ", " + std::to_string(D) + "]");
  if (!same_shape(t.v_pool, t.k_pool))
    fail("v_pool shape must match k_pool shape, got " + shape_str(t.v_pool) + " vs " +
         shape_str(t.k_pool));
  if (!same_dtype(t.k.dtype, t.q.dtype) || !same_dtype(t.v.dtype, t.q.dtype))
    fail("q/k/v dtypes must match, got q " + dtype_str(t.q.dtype) + ", k " +
         dtype_str(t.k.dtype) + ", v " + dtype_str(t.v.dtype));
  if (cfg.kv_cache_dtype == KvCacheDtype::kAuto &&
      (!same_dtype(t.k_pool.dtype, t.q.dtype) || !same_dtype(t.v_pool.dtype, t.q.dtype))) {
    const DLDataType pd =
        same_dtype(t.k_pool.dtype, t.q.dtype) ? t.v_pool.dtype : t.k_pool.dtype;
    std::string hint;
    if (pd.code == kDLFloat && pd.bits == 32)
      hint = "; a float32 pool for " + dtype_str(t.q.dtype) +
             " inputs: pass kv_cache_dtype=\"float32\" (or convert it once with "
             "k_pool.to(q.dtype))";
    else if (pd.code == kDLUInt && pd.bits == 8)
      hint = "; an fp8 pool: pass kv_cache_dtype=\"fp8_e4m3\" or \"fp8_e5m2\" with "
             "k_scale and v_scale";
    fail("pool dtypes must match q/k/v dtype, got k_pool " + dtype_str(t.k_pool.dtype) +
         ", v_pool " + dtype_str(t.v_pool.dtype) + " for q/k/v " + dtype_str(t.q.dtype) +
         hint);
  }
  if (cfg.kv_cache_dtype != KvCacheDtype::kAuto) {
    const bool f32 = cfg.kv_cache_dtype == KvCacheDtype::kFloat32;
    const DLDataType want = f32 ? DLDataType{kDLFloat, 32, 1} : DLDataType{kDLUInt, 8, 1};
    if (!same_dtype(t.k_pool.dtype, want) || !same_dtype(t.v_pool.dtype, want))
      fail(std::string("pool dtypes must be ") + (f32 ? "float32" : "uint8 (fp8 bits)") +
           " for kv_cache_dtype=\"" + kv_cache_dtype_name(cfg.kv_cache_dtype) +
           "\", got k_pool " + dtype_str(t.k_pool.dtype) + ", v_pool " +
           dtype_str(t.v_pool.dtype));
  }

  // --- The outputs (allocated by the caller or by the Python layer). ---
  if (!same_shape(t.q_rot, t.q))
    fail("q_rot shape must match q shape, got " + shape_str(t.q_rot) + " vs " +
         shape_str(t.q));
  if (!same_shape(t.k_rot, t.k))
    fail("k_rot shape must match k shape, got " + shape_str(t.k_rot) + " vs " +
         shape_str(t.k));
  if (!same_dtype(t.q_rot.dtype, t.q.dtype) || !same_dtype(t.k_rot.dtype, t.q.dtype))
    fail("q_rot/k_rot dtype must match q/k/v dtype, got q_rot " + dtype_str(t.q_rot.dtype) +
         ", k_rot " + dtype_str(t.k_rot.dtype) + " for " + dtype_str(t.q.dtype));

  // --- What the original leaves to luck. ---
  Problem p;
  check_index_dtype(t.positions, "positions", &p.pos_type);
  check_index_dtype(t.slots, "slots", &p.slot_type);
  if (!float_dtype(t.q.dtype, &p.dtype))
    fail("q/k/v dtype must be float16, bfloat16 or float32, got " + dtype_str(t.q.dtype));
  if (D < 2 || D % 2 != 0)
    fail("head_dim must be even and >= 2, got " + std::to_string(D));
  const int64_t R = cfg.rotary_dim == 0 ? D : cfg.rotary_dim;
  if (R < 2 || R % 2 != 0 || R > D)
    fail("rotary_dim must be even and in [2, head_dim], got " + std::to_string(R) +
         " for head_dim " + std::to_string(D));
  if (Hq < 1) fail("num_qo_heads must be >= 1, got " + std::to_string(Hq));
  if (Hk < 1) fail("num_kv_heads must be >= 1, got " + std::to_string(Hk));
  if (!std::isfinite(cfg.rope_base) || cfg.rope_base <= 0.0)
    fail("rope_base must be finite and > 0, got " + num_str(cfg.rope_base));
  check_options(t, cfg, R, p.dtype);

  std::vector<std::pair<const char*, const DLTensor*>> all = {
      {"q", &t.q},         {"k", &t.k},         {"v", &t.v},
      {"positions", &t.positions}, {"slots", &t.slots}, {"k_pool", &t.k_pool},
      {"v_pool", &t.v_pool}, {"q_rot", &t.q_rot}, {"k_rot", &t.k_rot}};
  if (present(t.cos_sin_cache)) all.push_back({"cos_sin_cache", &t.cos_sin_cache});
  if (present(t.q_norm_weight)) all.push_back({"q_norm_weight", &t.q_norm_weight});
  if (present(t.k_norm_weight)) all.push_back({"k_norm_weight", &t.k_norm_weight});
  const DLDevice dev = t.q.device;
  for (const auto& [name, a] : all) {
    if (a->device.device_type != dev.device_type || a->device.device_id != dev.device_id)
      fail("all arrays must be on one device, got q on " + device_str(dev) + " and " +
           std::string(name) + " on " + device_str(a->device) +
           " (move them with .to(q.device))");
  }
  if (dev.device_type != kDLCPU && dev.device_type != kDLCUDA)
    fail("q is on " + device_str(dev) +
         ", memory ropekv cannot address: pass CPU or CUDA arrays");
  if (dev.device_type == kDLCUDA && !has_cuda())
    fail("q is on " + device_str(dev) +
         " but this build of ropekv has no CUDA backend (rebuild with nvcc on PATH)");
  for (const auto& [name, a] : all) {
    if (a->data == nullptr && numel(*a) > 0)
      fail(std::string(name) + " has no data pointer (a null array with " +
           std::to_string(numel(*a)) + " elements)");
  }
  check_no_self_overlap(t.k_pool, "k_pool");
  check_no_self_overlap(t.v_pool, "v_pool");
  check_no_self_overlap(t.q_rot, "q_rot");
  check_no_self_overlap(t.k_rot, "k_rot");
  if (dev.device_type == kDLCUDA) cuda::check_addressable(t);

  p.num_tokens = T;
  p.num_qo_heads = Hq;
  p.num_kv_heads = Hk;
  p.head_dim = D;
  p.rotary_dim = R;
  p.pool_size = t.k_pool.shape[0];
  p.rope_base = cfg.rope_base;
  p.freq = FreqSpec{cfg.rope_base, R, cfg.rope_scaling};
  p.attention_factor = static_cast<float>(attention_factor(cfg.rope_scaling));
  p.is_neox = cfg.is_neox;
  switch (cfg.kv_cache_dtype) {
    case KvCacheDtype::kAuto: p.pool_type = pool_type_of(p.dtype); break;
    case KvCacheDtype::kFloat32: p.pool_type = PoolType::kF32; break;
    case KvCacheDtype::kFp8E4M3: p.pool_type = PoolType::kFp8E4M3; break;
    case KvCacheDtype::kFp8E5M2: p.pool_type = PoolType::kFp8E5M2; break;
  }
  p.k_scale = static_cast<float>(cfg.k_scale);
  p.v_scale = static_cast<float>(cfg.v_scale);
  if (present(t.cos_sin_cache)) {
    const DLTensor& c = t.cos_sin_cache;
    float_dtype(c.dtype, &p.cos_sin_cache.dtype);
    p.cos_sin_cache.data = base_pointer(c);
    p.cos_sin_cache.rows = c.shape[0];
    strides_of(c, p.cos_sin_cache.stride);
  }
  p.q_norm = weight(t.q_norm_weight);
  p.k_norm = weight(t.k_norm_weight);
  p.norm_eps = static_cast<float>(cfg.norm_eps);
  p.device = dev;
  p.q = view3(t.q);
  p.k = view3(t.k);
  p.v = view3(t.v);
  p.q_rot = view3(t.q_rot);
  p.k_rot = view3(t.k_rot);
  p.k_pool = view3(t.k_pool);
  p.v_pool = view3(t.v_pool);
  p.positions = view1(t.positions);
  p.slots = view1(t.slots);

  if (check_index_values) {
    if (p.cos_sin_cache.data != nullptr) {
      for (int64_t i = 0; i < T; ++i) {
        const int64_t pos = load_index(p.positions, p.pos_type, i);
        if (pos < 0 || pos >= p.cos_sin_cache.rows)
          fail(position_error(i, pos, p.cos_sin_cache.rows) + "; nothing was written");
      }
    }
    for (int64_t i = 0; i < T; ++i) {
      const int64_t s = load_index(p.slots, p.slot_type, i);
      if (s >= p.pool_size)
        fail("slots[" + std::to_string(i) + "] = " + std::to_string(s) +
             " is out of range for a pool of " + std::to_string(p.pool_size) +
             " rows (k_pool.shape[0]); nothing was written");
    }
    if (check_duplicates) {
      std::vector<int64_t> slots(static_cast<size_t>(T));
      for (int64_t i = 0; i < T; ++i) slots[i] = load_index(p.slots, p.slot_type, i);
      check_unique_slots(slots);
    }
  }
  return p;
}

int64_t check_frequency_config(const RopeConfig& cfg) {
  const int64_t D = cfg.head_dim;
  if (D < 2 || D % 2 != 0) fail("head_dim must be even and >= 2, got " + std::to_string(D));
  const int64_t R = cfg.rotary_dim == 0 ? D : cfg.rotary_dim;
  if (R < 2 || R % 2 != 0 || R > D)
    fail("rotary_dim must be even and in [2, head_dim], got " + std::to_string(R) +
         " for head_dim " + std::to_string(D));
  if (!std::isfinite(cfg.rope_base) || cfg.rope_base <= 0.0)
    fail("rope_base must be finite and > 0, got " + num_str(cfg.rope_base));
  check_rope_scaling(cfg.rope_scaling);
  return R;
}

std::string position_error(int64_t token, int64_t position, int64_t rows) {
  return "positions[" + std::to_string(token) + "] = " + std::to_string(position) +
         " is outside cos_sin_cache, which has " + std::to_string(rows) +
         " rows (positions must be in [0, " + std::to_string(rows) + "))";
}

// Two tokens naming one pool row race (which one lands depends on the
// schedule): an error in checked mode.
void check_unique_slots(const std::vector<int64_t>& slots) {
  std::vector<std::pair<int64_t, int64_t>> named;  // (slot, token)
  named.reserve(slots.size());
  for (size_t i = 0; i < slots.size(); ++i)
    if (slots[i] >= 0) named.emplace_back(slots[i], static_cast<int64_t>(i));
  std::sort(named.begin(), named.end());
  for (size_t j = 1; j < named.size(); ++j)
    if (named[j].first == named[j - 1].first)
      fail("slots[" + std::to_string(named[j].second) + "] = " +
           std::to_string(named[j].first) + " repeats slots[" +
           std::to_string(named[j - 1].second) +
           "]: two tokens would race for one pool row (checked mode)");
}

void validate(const RopePoolTensors& tensors, const RopeConfig& config) {
  make_problem(tensors, config, tensors.q.device.device_type == kDLCPU);
}

}  // namespace ropekv
