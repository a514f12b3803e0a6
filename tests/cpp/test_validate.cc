// The contract's checks (SPEC section 3): the 11 messages of the original
// call, exact prefix and order (a call wrong in several ways gets the first
// rule's message), shapes as Python tuples, the hints for common mistakes,
// then the checks the original leaves to luck. After every rejected call,
// every buffer (inputs, outputs, pools) is bit-identical to before.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "test_util.h"

namespace ropekv_test {
namespace {

static_assert(std::is_base_of_v<std::invalid_argument, ropekv::Error>,
              "ropekv::Error is the ValueError of the contract: a std::invalid_argument");

constexpr int64_t kT = 3, kHq = 4, kHk = 2, kD = 8, kP = 6;

struct Arr {
  std::vector<int64_t> shape;
  DType dtype;
  DLDevice device{kDLCPU, 0};
  bool null_data = false;
  std::vector<int64_t> strides;  // empty: compact, strides == NULL
};

struct VSpec {
  Arr q, k, v, positions, slots, k_pool, v_pool, q_rot, k_rot;
  ropekv::RopeConfig cfg;
  std::vector<Arr*> all() {
    return {&q, &k, &v, &positions, &slots, &k_pool, &v_pool, &q_rot, &k_rot};
  }
};

VSpec valid_spec(DType dt = DType::kF32, int64_t T = kT, int64_t Hq = kHq, int64_t Hk = kHk,
                 int64_t D = kD, int64_t P = kP) {
  VSpec s;
  s.q = {{T, Hq, D}, dt};
  s.k = {{T, Hk, D}, dt};
  s.v = {{T, Hk, D}, dt};
  s.positions = {{T}, DType::kI32};
  s.slots = {{T}, DType::kI64};
  s.k_pool = {{P, Hk, D}, dt};
  s.v_pool = {{P, Hk, D}, dt};
  s.q_rot = {{T, Hq, D}, dt};
  s.k_rot = {{T, Hk, D}, dt};
  s.cfg.head_dim = D;
  s.cfg.num_qo_heads = Hq;
  s.cfg.num_kv_heads = Hk;
  s.cfg.rope_base = 500000.0;
  return s;
}

struct Built {
  std::vector<Tensor> t;  // q, k, v, positions, slots, k_pool, v_pool, q_rot, k_rot
  ropekv::RopePoolTensors tensors() const {
    ropekv::RopePoolTensors r{};
    DLTensor* f[] = {&r.q, &r.k, &r.v, &r.positions, &r.slots,
                     &r.k_pool, &r.v_pool, &r.q_rot, &r.k_rot};
    for (size_t i = 0; i < t.size(); ++i) *f[i] = t[i].dl();
    return r;
  }
};

bool is_float(DType d) {
  return d == DType::kF32 || d == DType::kF16 || d == DType::kBF16 || d == DType::kF64;
}

// Allocates every array of the spec: inputs random, slots distinct valid
// rows (of a pool of kP rows), outputs poisoned, pools random bytes.
Built build(VSpec s, std::mt19937_64& rng) {
  Built b;
  int idx = 0;
  for (Arr* a : s.all()) {
    Tensor t;
    if (a->strides.empty()) {
      t = Tensor::compact(a->dtype, a->shape, /*null_strides=*/rng() & 1);
    } else {
      int64_t span = 1;
      for (size_t d = 0; d < a->shape.size(); ++d)
        span += (a->shape[d] - 1) * std::abs(a->strides[d]);
      t = Tensor::view(std::make_shared<Storage>(span * dtype_size(a->dtype)), a->dtype, a->shape,
                       a->strides, 0);
    }
    t.set_device(a->device);
    t.set_null_data(a->null_data);
    random_bytes(*t.storage(), rng);
    if (idx == 3 || idx == 4) {  // positions, slots
      int64_t n = 0;
      t.for_each_offset([&](int64_t o) {
        const int64_t val = idx == 3 ? static_cast<int64_t>(rng() % 100000) : (n++ * 2 + 1) % kP;
        t.set_value(o, static_cast<double>(val));
      });
    } else if (idx < 3 && is_float(a->dtype)) {
      fill_random(t, rng);
    } else if (idx >= 7) {
      poison_storage(t);
    }
    b.t.push_back(t);
    ++idx;
  }
  return b;
}

// Calls validate() and rope_pool_fused() on a freshly built call; both must
// throw ropekv::Error with the same message and leave every byte of every
// buffer as it was. Returns the message.
std::string error_of_built(const Built& b, const ropekv::RopeConfig& cfg);

std::string error_of(const VSpec& s, uint64_t salt = 0) {
  std::mt19937_64 rng(test_seed(salt));
  return error_of_built(build(s, rng), s.cfg);
}

// error_of for arrays already built (views of shared storage, say).
std::string error_of_built(const Built& b, const ropekv::RopeConfig& cfg) {
  std::vector<std::vector<uint8_t>> before;
  for (const Tensor& t : b.t) before.push_back(t.storage()->snapshot());
  std::string messages[2];
  for (int which = 0; which < 2; ++which) {
    // (rope_pool_fused only once validate() has rejected the call: a broken
    // check would otherwise let it write out of bounds and crash the suite.)
    if (which == 1 && messages[0].empty()) break;
    try {
      if (which == 0)
        ropekv::validate(b.tensors(), cfg);
      else
        ropekv::rope_pool_fused(b.tensors(), cfg);
      ADD_FAILURE() << (which ? "rope_pool_fused" : "validate") << " accepted the call";
    } catch (const ropekv::Error& e) {
      messages[which] = e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "threw something other than ropekv::Error: " << e.what();
    }
  }
  EXPECT_EQ(messages[0], messages[1]) << "validate() and rope_pool_fused() disagree";
  for (size_t i = 0; i < b.t.size(); ++i)
    EXPECT_TRUE(b.t[i].storage()->snapshot() == before[i])
        << "array " << i << " changed by a rejected call (" << messages[1] << ")";
  return messages[1];
}

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

#define EXPECT_PREFIX(msg, prefix) \
  EXPECT_TRUE(starts_with(msg, prefix)) << "message: " << (msg) << "\nwanted prefix: " << (prefix)
#define EXPECT_CONTAINS(msg, part) \
  EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg) << "\nwanted: " << (part)

// ------------------------------------------------------------ the 11 rules

struct Rule {
  const char* prefix;  // the contract's text (static part)
  std::string full;    // the full prefix for the single mutation, shapes included
  std::function<void(VSpec&)> mutate;
};

std::vector<Rule> rules() {
  return {
      {"rope_pool_fused expects q/k/v to be 3-D", "rope_pool_fused expects q/k/v to be 3-D",
       [](VSpec& s) { s.k.shape = {kT, kHk * kD}; }},
      {"rope_pool_fused expects positions/slots to be 1-D",
       "rope_pool_fused expects positions/slots to be 1-D",
       [](VSpec& s) { s.slots.shape = {kT, 1}; }},
      {"rope_pool_fused expects pool tensors to be 3-D",
       "rope_pool_fused expects pool tensors to be 3-D",
       [](VSpec& s) { s.v_pool.shape = {1, kP, kHk, kD}; }},
      {"q shape must be [num_tokens, num_qo_heads, head_dim], got ",
       "q shape must be [num_tokens, num_qo_heads, head_dim], got (3, 4, 8)",
       [](VSpec& s) { s.cfg.num_qo_heads = kHq + 1; }},
      {"k shape must be [num_tokens, num_kv_heads, head_dim], got ",
       "k shape must be [num_tokens, num_kv_heads, head_dim], got (3, 2, 8)",
       [](VSpec& s) { s.cfg.num_kv_heads = kHk + 1; }},
      {"v shape must match k shape, got ", "v shape must match k shape, got (4, 2, 8) vs (3, 2, 8)",
       [](VSpec& s) { s.v.shape[0] = kT + 1; }},
      {"positions/slots must have one entry per token",
       "positions/slots must have one entry per token",
       [](VSpec& s) { s.positions.shape = {kT + 1}; }},
      {"k_pool has incompatible shape ", "k_pool has incompatible shape (6, 2, 10)",
       [](VSpec& s) { s.k_pool.shape[2] = kD + 2; }},
      {"v_pool shape must match k_pool shape, got ",
       "v_pool shape must match k_pool shape, got (6, 2, 8) vs (7, 2, 8)",
       [](VSpec& s) { s.k_pool.shape[0] = kP + 1; }},
      {"q/k/v dtypes must match", "q/k/v dtypes must match",
       [](VSpec& s) { s.k.dtype = DType::kF16; }},
      {"pool dtypes must match q/k/v dtype", "pool dtypes must match q/k/v dtype",
       [](VSpec& s) { s.k_pool.dtype = DType::kF16; }},
  };
}

TEST(Validate, ValidCallPasses) {
  std::mt19937_64 rng(test_seed());
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    const VSpec s = valid_spec(dt);
    const Built b = build(s, rng);
    EXPECT_NO_THROW(ropekv::validate(b.tensors(), s.cfg));
    EXPECT_NO_THROW(ropekv::rope_pool_fused(b.tensors(), s.cfg));
  }
  // T = 0 is a valid call, also with null data pointers.
  VSpec s = valid_spec(DType::kF32, 0);
  for (Arr* a : {&s.q, &s.k, &s.v, &s.positions, &s.slots, &s.q_rot, &s.k_rot}) a->null_data = true;
  const Built b = build(s, rng);
  EXPECT_NO_THROW(ropekv::validate(b.tensors(), s.cfg));
  EXPECT_NO_THROW(ropekv::rope_pool_fused(b.tensors(), s.cfg));
}

TEST(Validate, EachRuleAlone) {
  const auto rs = rules();
  for (size_t i = 0; i < rs.size(); ++i) {
    VSpec s = valid_spec();
    rs[i].mutate(s);
    const std::string m = error_of(s, i);
    SCOPED_TRACE("rule " + std::to_string(i + 1));
    EXPECT_PREFIX(m, rs[i].full);
  }
}

// Every pair (i < j) of broken rules: the message of rule i.
TEST(Validate, FirstBrokenRuleWins) {
  const auto rs = rules();
  for (size_t i = 0; i < rs.size(); ++i)
    for (size_t j = i + 1; j < rs.size(); ++j) {
      VSpec s = valid_spec();
      rs[j].mutate(s);
      rs[i].mutate(s);
      const std::string m = error_of(s, i * 16 + j);
      SCOPED_TRACE("rules " + std::to_string(i + 1) + " and " + std::to_string(j + 1));
      EXPECT_PREFIX(m, rs[i].prefix);
    }
  // All of them at once: rule 1.
  VSpec s = valid_spec();
  for (size_t j = rs.size(); j-- > 0;) rs[j].mutate(s);
  EXPECT_PREFIX(error_of(s), rs[0].prefix);
}

// The checks beyond the original's come after all 11 rules.
TEST(Validate, ExtraChecksComeAfterTheRules) {
  const auto rs = rules();
  const std::vector<std::function<void(VSpec&)>> extras = {
      [](VSpec& s) { s.positions.dtype = DType::kF32; },
      [](VSpec& s) { s.cfg.rope_base = -1.0; },
      [](VSpec& s) { s.k_rot.device = {kDLCUDA, 0}; },
  };
  for (size_t i = 0; i < rs.size(); ++i)
    for (size_t e = 0; e < extras.size(); ++e) {
      VSpec s = valid_spec();
      extras[e](s);
      rs[i].mutate(s);
      SCOPED_TRACE("rule " + std::to_string(i + 1) + " with extra " + std::to_string(e));
      EXPECT_PREFIX(error_of(s, i * 8 + e), rs[i].prefix);
    }
}

TEST(Validate, ShapesPrintAsPythonTuples) {
  VSpec s = valid_spec();
  s.k.shape = {kT, kHk * kD};
  std::string m = error_of(s);
  EXPECT_CONTAINS(m, "(3, 16)");
  EXPECT_CONTAINS(m, "(3, 4, 8)");

  s = valid_spec();
  s.slots.shape = {kT, 1};
  m = error_of(s);
  EXPECT_CONTAINS(m, "(3, 1)");
  EXPECT_CONTAINS(m, "(3,)");  // a 1-D shape keeps its comma

  s = valid_spec();
  s.positions.shape = {kT + 1};
  m = error_of(s);
  EXPECT_CONTAINS(m, "(4,)");
  EXPECT_CONTAINS(m, "(3,)");

  s = valid_spec();
  s.slots.shape = {};  // 0-D
  m = error_of(s);
  EXPECT_PREFIX(m, "rope_pool_fused expects positions/slots to be 1-D");
  EXPECT_CONTAINS(m, "()");
}

TEST(Validate, Hints) {
  VSpec s = valid_spec();
  s.k_pool.shape = {4, kP, kHk, kD};  // layer-stacked cache
  std::string m = error_of(s);
  EXPECT_PREFIX(m, "rope_pool_fused expects pool tensors to be 3-D");
  EXPECT_CONTAINS(m, "pass k_pool[layer]");
  EXPECT_CONTAINS(m, "(4, 6, 2, 8)");

  s = valid_spec();
  s.v_pool.shape = {kP, kHk * kD};  // flattened cache
  m = error_of(s);
  EXPECT_PREFIX(m, "rope_pool_fused expects pool tensors to be 3-D");
  EXPECT_CONTAINS(m, "reshape to [pool_size, num_kv_heads, head_dim]");

  s = valid_spec(DType::kBF16);
  s.k_pool.dtype = DType::kF32;
  s.v_pool.dtype = DType::kF32;
  m = error_of(s);
  EXPECT_PREFIX(m, "pool dtypes must match q/k/v dtype");
  EXPECT_CONTAINS(m, ".to(q.dtype)");

  s = valid_spec(DType::kBF16);
  s.v_pool.dtype = DType::kF32;  // only one of them
  m = error_of(s);
  EXPECT_PREFIX(m, "pool dtypes must match q/k/v dtype");
  EXPECT_CONTAINS(m, ".to(q.dtype)");
}

// ------------------------------------------------------------ beyond the original

TEST(Validate, IndexArraysMustBeIntegers) {
  for (DType bad : {DType::kF32, DType::kF64, DType::kI16, DType::kU32, DType::kF16}) {
    VSpec s = valid_spec();
    s.positions.dtype = bad;
    std::string m = error_of(s);
    EXPECT_PREFIX(m, "positions");
    EXPECT_CONTAINS(m, "int32 or int64");
    s = valid_spec();
    s.slots.dtype = bad;
    m = error_of(s);
    EXPECT_PREFIX(m, "slots");
    EXPECT_CONTAINS(m, "int32 or int64");
  }
  VSpec s = valid_spec();
  s.positions.dtype = DType::kF32;
  EXPECT_CONTAINS(error_of(s), "float32");
}

TEST(Validate, UnsupportedFloatDtype) {
  VSpec s = valid_spec(DType::kF64);
  const std::string m = error_of(s);
  EXPECT_CONTAINS(m, "float16, bfloat16 or float32");
  EXPECT_CONTAINS(m, "float64");
}

TEST(Validate, OutputsMustMatch) {
  VSpec s = valid_spec();
  s.q_rot.shape[1] = kHq - 1;
  EXPECT_PREFIX(error_of(s), "q_rot shape must match q shape, got (3, 3, 8) vs (3, 4, 8)");
  s = valid_spec();
  s.k_rot.shape[0] = kT + 1;
  EXPECT_PREFIX(error_of(s), "k_rot shape must match k shape");
  s = valid_spec();
  s.k_rot.dtype = DType::kBF16;
  EXPECT_PREFIX(error_of(s), "k_rot dtype must match q/k/v dtype, got k_rot bfloat16 for float32");
  s.q_rot.dtype = DType::kF16;
  EXPECT_PREFIX(error_of(s), "q_rot/k_rot dtype must match q/k/v dtype, got q_rot float16, "
                             "k_rot bfloat16 for float32");
  s = valid_spec();
  s.q_rot.dtype = DType::kF16;
  EXPECT_PREFIX(error_of(s), "q_rot dtype must match q/k/v dtype, got q_rot float16 for float32");
}

TEST(Validate, HeadDim) {
  for (int64_t D : {7, 1, 0, 3}) {
    VSpec s = valid_spec(DType::kF32, kT, kHq, kHk, D);
    EXPECT_PREFIX(error_of(s, D), "head_dim must be even and >= 2, got " + std::to_string(D));
  }
  VSpec s = valid_spec(DType::kF32, kT, kHq, kHk, -2);
  s.q.shape[2] = s.k.shape[2] = s.v.shape[2] = s.q_rot.shape[2] = s.k_rot.shape[2] = 0;
  s.k_pool.shape[2] = s.v_pool.shape[2] = 0;
  // q's shape (3, 4, 0) no longer matches head_dim = -2: rule 4 fires first.
  EXPECT_PREFIX(error_of(s), "q shape must be");
}

TEST(Validate, HeadCounts) {
  VSpec s = valid_spec(DType::kF32, kT, 0, kHk);
  EXPECT_PREFIX(error_of(s), "num_qo_heads must be >= 1, got 0");
  s = valid_spec(DType::kF32, kT, kHq, 0);
  EXPECT_PREFIX(error_of(s), "num_kv_heads must be >= 1, got 0");
}

TEST(Validate, RopeBase) {
  const double bad[] = {std::numeric_limits<double>::quiet_NaN(),
                        std::numeric_limits<double>::infinity(),
                        -std::numeric_limits<double>::infinity(), 0.0, -0.0, -10000.0};
  for (double b : bad) {
    VSpec s = valid_spec();
    s.cfg.rope_base = b;
    EXPECT_PREFIX(error_of(s), "rope_base must be finite and > 0, got ") << b;
  }
  VSpec s = valid_spec();
  s.cfg.rope_base = 1e-30;  // tiny but valid: base^(-6/8) = 1e22.5 is a float32
  std::mt19937_64 rng(test_seed());
  const Built b = build(s, rng);
  EXPECT_NO_THROW(ropekv::validate(b.tensors(), s.cfg));
  // base^(-2i/8) overflows float32 from i = 1: no angle can be computed.
  s.cfg.rope_base = 1e-300;
  EXPECT_PREFIX(error_of(s), "rope_base 1e-300 gives inv_freq[1] = inf, not finite");
  // yarn with rope_base 1 divides by log(1) = 0 (transformers' formula).
  s = valid_spec();
  s.cfg.rope_base = 1.0;
  s.cfg.rope_scaling.type = ropekv::RopeScalingType::kYarn;
  s.cfg.rope_scaling.factor = 4.0;
  s.cfg.rope_scaling.original_max_position_embeddings = 4096;
  EXPECT_PREFIX(error_of(s), "rope_base 1 with its rope_scaling gives inv_freq[0] = ");
  // A linear factor whose reciprocal overflows float32.
  s = valid_spec();
  s.cfg.rope_scaling.type = ropekv::RopeScalingType::kLinear;
  s.cfg.rope_scaling.factor = 1e-40;
  EXPECT_PREFIX(error_of(s), "rope_base 500000 with its rope_scaling gives inv_freq[0] = inf");
}

// Proportional RoPE's fields: a factor as every type's, a fraction of the
// pairs in [0, 1]; the count of rotating pairs may be 0 (p = 0, or p R / 2 < 1).
TEST(Validate, ProportionalScaling) {
  std::mt19937_64 rng(test_seed());
  VSpec s = valid_spec();
  s.cfg.rope_scaling.type = ropekv::RopeScalingType::kProportional;
  for (double p : {0.25, 1.0, 1e-3, 0.0}) {
    s.cfg.rope_scaling.partial_rotary_factor = p;
    EXPECT_NO_THROW(ropekv::validate(build(s, rng).tensors(), s.cfg)) << p;
  }
  for (double p : {-1e-300, -0.5, 1.0000001, std::nan("")}) {
    s.cfg.rope_scaling.partial_rotary_factor = p;
    EXPECT_PREFIX(error_of(s), "rope_scaling partial_rotary_factor must be in [0, 1] "
                               "(proportional: the fraction of the rotary pairs that rotate), got ");
  }
  s.cfg.rope_scaling.partial_rotary_factor = 0.5;
  for (double f : {0.0, -2.0, HUGE_VAL}) {
    s.cfg.rope_scaling.factor = f;
    EXPECT_PREFIX(error_of(s), "rope_scaling factor must be finite and > 0 (proportional), got ");
  }
}

// partial_rotary_factor of any other type is transformers' rotary_dim, which
// RopeConfig::rotary_dim gives: a value other than 1 there is refused, not
// ignored (it would rotate the whole head of a partial-rotary model).
TEST(Validate, PartialRotaryFactorOfOtherTypes) {
  std::mt19937_64 rng(test_seed());
  using ropekv::RopeScalingType;
  for (RopeScalingType type : {RopeScalingType::kNone, RopeScalingType::kLinear,
                               RopeScalingType::kLlama3, RopeScalingType::kYarn}) {
    VSpec s = valid_spec();
    s.cfg.rope_scaling.type = type;
    if (type != RopeScalingType::kNone) {  // (kNone: every field at its default)
      s.cfg.rope_scaling.factor = 4.0;
      s.cfg.rope_scaling.low_freq_factor = 1.0;
      s.cfg.rope_scaling.high_freq_factor = 4.0;
      s.cfg.rope_scaling.original_max_position_embeddings = 8192;
    }
    EXPECT_NO_THROW(ropekv::validate(build(s, rng).tensors(), s.cfg)) << static_cast<int>(type);
    for (const auto& [p, text] : {std::pair{0.5, "0.5"}, {0.0, "0"}, {1.5, "1.5"}}) {
      s.cfg.rope_scaling.partial_rotary_factor = p;
      EXPECT_PREFIX(error_of(s), std::string("rope_scaling partial_rotary_factor is read by the "
                                             "proportional type only, got ") +
                                     text + ": for another type set rotary_dim to "
                                            "int(head_dim * partial_rotary_factor)");
    }
  }
}

// A field set while the type is kNone would be dropped (a factor so dropped
// changes every angle): an Error naming the fields, as a typeless dict is in
// Python. Each field alone, a NaN factor, and several at once.
TEST(Validate, ScalingFieldsWithoutAType) {
  std::mt19937_64 rng(test_seed());
  VSpec s = valid_spec();
  EXPECT_NO_THROW(ropekv::validate(build(s, rng).tensors(), s.cfg));
  using Field = std::pair<const char*, void (*)(ropekv::RopeScaling&)>;
  const Field fields[] = {
      {"factor", [](ropekv::RopeScaling& r) { r.factor = 8.0; }},
      {"factor", [](ropekv::RopeScaling& r) { r.factor = std::nan(""); }},
      {"low_freq_factor", [](ropekv::RopeScaling& r) { r.low_freq_factor = 1.0; }},
      {"high_freq_factor", [](ropekv::RopeScaling& r) { r.high_freq_factor = 4.0; }},
      {"original_max_position_embeddings",
       [](ropekv::RopeScaling& r) { r.original_max_position_embeddings = 8192; }},
      {"beta_fast", [](ropekv::RopeScaling& r) { r.beta_fast = 0.0; }},
      {"beta_slow", [](ropekv::RopeScaling& r) { r.beta_slow = 2.0; }},
      {"attention_factor", [](ropekv::RopeScaling& r) { r.attention_factor = 1.0; }},
      {"mscale", [](ropekv::RopeScaling& r) { r.mscale = 1.0; }},
      {"mscale_all_dim", [](ropekv::RopeScaling& r) { r.mscale_all_dim = 1.0; }},
      {"truncate", [](ropekv::RopeScaling& r) { r.truncate = false; }},
  };
  for (const auto& [name, set] : fields) {
    s = valid_spec();
    set(s.cfg.rope_scaling);
    EXPECT_PREFIX(error_of(s), std::string("rope_scaling type is kNone, so its fields ") + name +
                                   " would mean nothing: set rope_scaling.type");
  }
  s = valid_spec();
  s.cfg.rope_scaling.factor = 8.0;
  s.cfg.rope_scaling.mscale = 1.0;
  EXPECT_PREFIX(error_of(s), "rope_scaling type is kNone, so its fields factor, mscale would");
}

// Factors the kernels apply in fp32 must be finite there, not only as doubles
// (else Inf and NaN reach the outputs and the pools).
TEST(Validate, FactorsFiniteInFloat32) {
  std::mt19937_64 rng(test_seed());
  VSpec s = valid_spec();
  s.cfg.rope_scaling.type = ropekv::RopeScalingType::kYarn;
  s.cfg.rope_scaling.factor = 4.0;
  s.cfg.rope_scaling.original_max_position_embeddings = 4096;
  s.cfg.rope_scaling.attention_factor = 3e38;  // the largest finite float32 is 3.4e38
  EXPECT_NO_THROW(ropekv::validate(build(s, rng).tensors(), s.cfg));
  s.cfg.rope_scaling.attention_factor = 1e39;
  EXPECT_PREFIX(error_of(s), "rope_scaling attention_factor must be finite and > 0 as a float32");
  // A given factor is the factor: 0 and negative ones zero or mirror the
  // rotation.
  for (double given : {0.0, -1.5, std::nan("")}) {
    s.cfg.rope_scaling.attention_factor = given;
    EXPECT_PREFIX(error_of(s), "rope_scaling attention_factor must be finite and > 0 as a float32");
  }
  // The same factor from mscale / mscale_all_dim (none given).
  s.cfg.rope_scaling.attention_factor.reset();
  s.cfg.rope_scaling.mscale = 1e40;
  s.cfg.rope_scaling.mscale_all_dim = 1.0;
  EXPECT_PREFIX(error_of(s), "rope_scaling attention_factor must be finite and > 0 as a float32");
  s.cfg.rope_scaling.mscale = -100.0;  // 0.1 * -100 * ln 4 + 1 < 0: a mirrored rotation
  EXPECT_PREFIX(error_of(s), "rope_scaling attention_factor must be finite and > 0 as a float32");
  s.cfg.rope_scaling.mscale = 1.0;
  EXPECT_NO_THROW(ropekv::validate(build(s, rng).tensors(), s.cfg));
  s.cfg.rope_scaling.attention_factor = 1e-300;  // 0 as a float32: cos and sin would be 0
  EXPECT_PREFIX(error_of(s), "rope_scaling attention_factor must be finite and > 0 as a float32");

  s = valid_spec();
  s.cfg.norm_eps = 3e38;
  EXPECT_NO_THROW(ropekv::validate(build(s, rng).tensors(), s.cfg));
  s.cfg.norm_eps = 1e39;
  EXPECT_PREFIX(error_of(s), "norm_eps must be finite and >= 0 as a float32, got 1e+39");
}

TEST(Validate, MixedDevices) {
  VSpec s = valid_spec();
  s.k_pool.device = {kDLCUDA, 0};
  std::string m = error_of(s);
  EXPECT_PREFIX(m, "all arrays must be on one device");
  EXPECT_CONTAINS(m, "k_pool");
  EXPECT_CONTAINS(m, "cuda:0");

  s = valid_spec();
  s.k_pool.device = {kDLCPU, 1};  // the ids differ: the message shows them
  m = error_of(s);
  EXPECT_PREFIX(m, "all arrays must be on one device, got q on cpu and k_pool on cpu:1");

  s = valid_spec();
  for (Arr* a : s.all()) a->device = {kDLCUDA, 0};
  s.positions.device = {kDLCUDA, 1};
  m = error_of(s);
  EXPECT_PREFIX(m, "all arrays must be on one device");
  EXPECT_CONTAINS(m, "positions");
  EXPECT_CONTAINS(m, "cuda:1");

  s = valid_spec();
  s.q.device = {kDLCUDA, 0};  // q decides; the first other array is named
  m = error_of(s);
  EXPECT_PREFIX(m, "all arrays must be on one device");
  EXPECT_CONTAINS(m, "cuda:0");
}

TEST(Validate, DevicesItCannotAddress) {
  VSpec s = valid_spec();
  for (Arr* a : s.all()) a->device = {kDLOpenCL, 0};
  EXPECT_CONTAINS(error_of(s), "cannot address");
}

TEST(Validate, CudaArraysWithoutCudaBackend) {
  if (ropekv::has_cuda())
    GTEST_SKIP() << "this build has the CUDA backend (host pointers labelled CUDA are "
                    "rejected by the backend's own addressability check)";
  VSpec s = valid_spec();
  for (Arr* a : s.all()) a->device = {kDLCUDA, 0};
  const std::string m = error_of(s);
  EXPECT_CONTAINS(m, "cuda:0");
  EXPECT_CONTAINS(m, "no CUDA backend");
}

TEST(Validate, SlotOutOfRangeRaisesBeforeAnyWrite) {
  // build() gives the tokens slots 1, 3, 5: with a pool of 5 rows the last
  // one is exactly P.
  for (DType st : {DType::kI32, DType::kI64}) {
    VSpec s = valid_spec();
    s.slots.dtype = st;
    s.k_pool.shape[0] = s.v_pool.shape[0] = 5;
    EXPECT_PREFIX(error_of(s), "slots[2] = 5 is out of range for a pool of 5 rows");
  }
  // Any value >= P, int64 beyond 2^31 included; earlier tokens valid.
  for (int64_t bad : {int64_t{6}, int64_t{7}, int64_t{1} << 31, int64_t{1} << 40}) {
    std::mt19937_64 rng(test_seed(static_cast<uint64_t>(bad)));
    VSpec s = valid_spec();
    Built b = build(s, rng);
    b.t[4].set_index(0, 0);
    b.t[4].set_index(1, bad);
    b.t[4].set_index(2, -1);
    std::vector<std::vector<uint8_t>> before;
    for (const Tensor& t : b.t) before.push_back(t.storage()->snapshot());
    try {
      ropekv::rope_pool_fused(b.tensors(), s.cfg);
      ADD_FAILURE() << "slot " << bad << " accepted";
    } catch (const ropekv::Error& e) {
      EXPECT_PREFIX(std::string(e.what()),
                    "slots[1] = " + std::to_string(bad) + " is out of range for a pool of 6 rows");
    }
    for (size_t i = 0; i < b.t.size(); ++i)
      EXPECT_TRUE(b.t[i].storage()->snapshot() == before[i]) << "array " << i << " changed";
  }
}

TEST(Validate, NullDataPointer) {
  VSpec s = valid_spec();
  s.k.null_data = true;
  const std::string m = error_of(s);
  EXPECT_PREFIX(m, "k has no data pointer");
}

// t's shape and strides in storage of its own with one element more: a
// byte_offset below one element keeps the view inside it (else its span
// could reach the next allocation and be refused as an overlap first).
Tensor with_spare_element(const Tensor& t) {
  auto st = std::make_shared<Storage>(static_cast<size_t>((t.numel() + 1) * dtype_size(t.dtype())));
  return Tensor::view(st, t.dtype(), t.shape(), t.strides(), 0);
}

// An array whose first element is not at a multiple of its element size (a
// byte_offset the size does not divide): refused before anything is
// written, for an input, an index array and a pool; a 16-bit array at an
// even offset is fine.
TEST(Validate, MisalignedArrays) {
  std::mt19937_64 rng(test_seed());
  const char* names[] = {"q", "k", "v", "positions", "slots", "k_pool", "v_pool", "q_rot", "k_rot"};
  for (int which : {0, 4, 5, 8}) {
    for (uint64_t off : {1, 2, 3}) {
      VSpec s = valid_spec();
      Built b = build(s, rng);
      b.t[static_cast<size_t>(which)] = with_spare_element(b.t[static_cast<size_t>(which)]);
      ropekv::RopePoolTensors r = b.tensors();
      DLTensor* f[] = {&r.q,      &r.k,      &r.v,     &r.positions, &r.slots,
                       &r.k_pool, &r.v_pool, &r.q_rot, &r.k_rot};
      f[which]->byte_offset += off;
      std::vector<std::vector<uint8_t>> before;
      for (const Tensor& t : b.t) before.push_back(t.storage()->snapshot());
      // (the call only once validate() has refused: accepted, it would read
      // and write past the shifted array's storage)
      bool refused = false;
      try {
        ropekv::validate(r, s.cfg);
      } catch (const ropekv::Error&) {
        refused = true;
      }
      if (!refused) {
        ADD_FAILURE() << "validate accepted " << names[which] << " at byte offset " << off;
        continue;
      }
      try {
        ropekv::rope_pool_fused(r, s.cfg);
        ADD_FAILURE() << names[which] << " at byte offset " << off << " accepted";
      } catch (const ropekv::Error& e) {
        EXPECT_PREFIX(std::string(e.what()),
                      std::string(names[which]) +
                          " starts at an address that is not a multiple of its " +
                          (which == 4 ? "8" : "4") + "-byte elements (data + byte_offset = " +
                          std::to_string(off) + " mod " + (which == 4 ? "8" : "4") + ")");
      }
      for (size_t i = 0; i < b.t.size(); ++i)
        EXPECT_TRUE(b.t[i].storage()->snapshot() == before[i]) << "array " << i << " changed";
    }
  }
  VSpec s = valid_spec(DType::kBF16);
  Built b = build(s, rng);
  b.t[0] = with_spare_element(b.t[0]);
  ropekv::RopePoolTensors r = b.tensors();
  r.q.byte_offset += 2;  // (validated only)
  EXPECT_NO_THROW(ropekv::validate(r, s.cfg));
  r.q.byte_offset += 1;
  try {
    ropekv::validate(r, s.cfg);
    ADD_FAILURE() << "bf16 q at an odd address accepted";
  } catch (const ropekv::Error& e) {
    EXPECT_PREFIX(std::string(e.what()),
                  "q starts at an address that is not a multiple of its 2-byte elements");
  }
}

TEST(Validate, OverlappingOutputs) {
  VSpec s = valid_spec();
  s.k_pool.strides = {0, kD, 1};  // every row at one address
  EXPECT_PREFIX(error_of(s), "k_pool has stride 0 along axis 0");
  s = valid_spec();
  s.q_rot.strides = {kHq * kD, 0, 1};
  EXPECT_PREFIX(error_of(s), "q_rot has stride 0 along axis 1");
  // Non-zero strides whose elements collide: rows one element apart, heads
  // half a head apart.
  s = valid_spec();
  s.k_pool.strides = {1, kD, 1};
  EXPECT_PREFIX(error_of(s), "k_pool has strides (1, 8, 1) (in elements) for shape (6, 2, 8): "
                             "its elements overlap");
  s = valid_spec();
  s.q_rot.strides = {kHq * kD, kD / 2, 1};
  EXPECT_PREFIX(error_of(s), "q_rot has strides (32, 4, 1)");
  // Permuted and padded layouts are views without overlap.
  std::mt19937_64 rng(test_seed());
  s = valid_spec();
  s.k_pool.strides = {kD, kP * kD, 1};       // heads outermost
  s.q_rot.strides = {kD, kT * kD + 3, 1};    // padded, tokens inner
  const Built b = build(s, rng);
  EXPECT_NO_THROW(ropekv::validate(b.tensors(), s.cfg));
}

// Arrays of one call sharing memory: a pool over another pool, an output
// over a pool or an input, shifted aliases. Views of one buffer that do not
// share elements (q, k, v of a fused QKV output rotated in place; k and v
// pools interleaved in one cache) are accepted.
TEST(Validate, ArraysSharingMemory) {
  std::mt19937_64 rng(test_seed());
  const VSpec s = valid_spec();
  const DType dt = DType::kF32;
  auto call = [&] { return build(s, rng); };
  auto view_of = [&](const Tensor& t, std::vector<int64_t> shape, std::vector<int64_t> strides,
                     int64_t offset) { return Tensor::view(t.storage(), dt, shape, strides, offset); };
  const std::vector<int64_t> pool_shape = {kP, kHk, kD}, pool_strides = {kHk * kD, kD, 1};
  {
    Built b = call();
    b.t[6] = view_of(b.t[5], pool_shape, pool_strides, 0);  // v_pool = k_pool
    EXPECT_PREFIX(error_of_built(b, s.cfg), "k_pool overlaps v_pool in memory");
  }
  {
    Built b = call();  // q_rot inside k_pool's memory
    auto big = Tensor::compact(dt, {kP * kHk * kD + kT * kHq * kD});
    b.t[5] = view_of(big, pool_shape, pool_strides, 0);
    b.t[7] = view_of(big, {kT, kHq, kD}, {kHq * kD, kD, 1}, kD);
    EXPECT_PREFIX(error_of_built(b, s.cfg), "k_pool overlaps q_rot in memory");
  }
  {
    // k_pool over q, declared with a byte span just under 2^63 (a shape its
    // buffer does not have): its end lies past INTPTR_MAX, and the overlap
    // is still seen (a signed end wrapped, and the call wrote into q).
    Built b = call();
    const int64_t rows = std::numeric_limits<int64_t>::max() / (kHk * kD * 4);
    b.t[5] = view_of(b.t[0], {rows, kHk, kD}, pool_strides, 0);
    b.t[6] = Tensor::view(Tensor::compact(dt, {kHk * kD}).storage(), dt, {rows, kHk, kD},
                          pool_strides, 0);
    EXPECT_PREFIX(error_of_built(b, s.cfg), "k_pool overlaps q in memory");
  }
  {
    Built b = call();
    b.t[8] = view_of(b.t[2], {kT, kHk, kD}, {kHk * kD, kD, 1}, 0);  // k_rot = v
    EXPECT_PREFIX(error_of_built(b, s.cfg), "k_rot overlaps v in memory");
  }
  {
    Built b = call();  // q_rot = q shifted by one element: not the in-place call
    auto big = Tensor::compact(dt, {kT * kHq * kD + 1});
    b.t[0] = view_of(big, {kT, kHq, kD}, {kHq * kD, kD, 1}, 0);
    fill_random(b.t[0], rng);
    b.t[7] = view_of(big, {kT, kHq, kD}, {kHq * kD, kD, 1}, 1);
    EXPECT_PREFIX(error_of_built(b, s.cfg), "q_rot overlaps q in memory");
  }
  {
    Built b = call();  // v_pool over the input v's memory
    auto big = Tensor::compact(dt, {kP * kHk * kD});
    b.t[6] = view_of(big, pool_shape, pool_strides, 0);
    b.t[2] = view_of(big, {kT, kHk, kD}, {kHk * kD, kD, 1}, 5 * kD);
    fill_random(b.t[2], rng);
    EXPECT_PREFIX(error_of_built(b, s.cfg), "v_pool overlaps v in memory");
  }
  {
    Built b = call();  // in place on one fused QKV buffer, pools interleaved
    const int64_t row = (kHq + 2 * kHk) * kD;
    auto qkv = Tensor::compact(dt, {kT * row});
    b.t[0] = view_of(qkv, {kT, kHq, kD}, {row, kD, 1}, 0);
    b.t[1] = view_of(qkv, {kT, kHk, kD}, {row, kD, 1}, kHq * kD);
    b.t[2] = view_of(qkv, {kT, kHk, kD}, {row, kD, 1}, (kHq + kHk) * kD);
    for (int i = 0; i < 3; ++i) fill_random(b.t[i], rng);
    b.t[7] = b.t[0];
    b.t[8] = b.t[1];
    auto kv = Tensor::compact(dt, {kP * 2 * kHk * kD});
    b.t[5] = view_of(kv, pool_shape, {2 * kHk * kD, kD, 1}, 0);
    b.t[6] = view_of(kv, pool_shape, {2 * kHk * kD, kD, 1}, kHk * kD);
    EXPECT_NO_THROW(ropekv::validate(b.tensors(), s.cfg));
    // One element more for k, and its last head runs into v's first.
    b.t[1] = view_of(qkv, {kT, kHk, kD}, {row, kD, 1}, kHq * kD + 1);
    b.t[8] = b.t[1];
    EXPECT_PREFIX(error_of_built(b, s.cfg), "k_rot overlaps v in memory");
  }
}

// k_pool and v_pool as random views of one buffer (strides of any sign,
// zero included, random offsets), against a brute-force count of the bytes
// each reaches: a pool whose own elements overlap, or two that share a
// byte, are refused; two of one layout (strides of the same sizes, each
// stepping past the span of the smaller ones; of any signs, in any order of
// the axes) that share none are accepted. (Other pairs whose byte ranges meet
// may be refused too: the rule is conservative there, as the README says.)
TEST(Validate, RandomPoolLayoutsInOneBuffer) {
  std::mt19937_64 rng(test_seed());
  VSpec s = valid_spec();
  const std::vector<int64_t> shape = {kP, kHk, kD};
  const int64_t esize = dtype_size(DType::kF32);
  int shared = 0, exact_disjoint = 0, flipped_disjoint = 0;
  for (int it = 0; it < 20000; ++it) {
    Built b = build(s, rng);
    auto storage = std::make_shared<Storage>(4096 * esize);
    auto stride = [&] { return static_cast<int64_t>(rng() % 41) - 20; };
    std::vector<int64_t> sa = {stride(), stride(), stride()};
    const int64_t oa = 1500 + static_cast<int64_t>(rng() % 400);
    int64_t ob = 1500 + static_cast<int64_t>(rng() % 400);
    if (rng() & 1) {
      // One layout with gaps (axes in a random order, random signs), the
      // second view a few elements away: into the gaps, or over the first.
      int axes[3] = {0, 1, 2};
      std::shuffle(axes, axes + 3, rng);
      int64_t span = 1;
      for (int d : axes) {
        const int64_t st = span + static_cast<int64_t>(rng() % 3);
        sa[d] = rng() & 1 ? st : -st;
        span += (shape[d] - 1) * st;
      }
      ob = oa + static_cast<int64_t>(rng() % 121) - 60;
    }
    std::vector<int64_t> sb = sa;
    const int kind = static_cast<int>(rng() % 4);
    if (kind == 0) {
      sb = {stride(), stride(), stride()};
    } else if (kind == 1) {  // the same layout, axes reversed or swapped
      for (auto& st : sb)
        if (rng() & 1) st = -st;
      std::shuffle(sb.begin(), sb.end(), rng);
    }
    b.t[5] = Tensor::view(storage, DType::kF32, shape, sa, oa);
    b.t[6] = Tensor::view(storage, DType::kF32, shape, sb, ob);
    auto bytes = [&](const std::vector<int64_t>& st, int64_t off, bool& self) {
      std::vector<int64_t> v;
      for (int64_t i = 0; i < kP; ++i)
        for (int64_t h = 0; h < kHk; ++h)
          for (int64_t d = 0; d < kD; ++d)
            for (int64_t e = 0; e < esize; ++e)
              v.push_back((off + i * st[0] + h * st[1] + d * st[2]) * esize + e);
      std::sort(v.begin(), v.end());
      self = std::adjacent_find(v.begin(), v.end()) != v.end();
      return v;
    };
    // The documented rule for a pool's own strides: ordered by size, each
    // steps past the span of the smaller ones (others may be refused).
    auto abs_sorted = [](std::vector<int64_t> st) {
      for (auto& x : st) x = std::abs(x);
      std::sort(st.begin(), st.end());
      return st;
    };
    auto nested = [&](const std::vector<int64_t>& st) {
      std::vector<std::pair<int64_t, int64_t>> ax;  // (|stride|, extent)
      for (int d = 0; d < 3; ++d) ax.push_back({std::abs(st[d]), shape[d]});
      std::sort(ax.begin(), ax.end());
      int64_t span = 1;
      for (const auto& [str, n] : ax) {
        if (str < span) return false;
        span += (n - 1) * str;
      }
      return true;
    };
    bool self_a = false, self_b = false;
    const std::vector<int64_t> a = bytes(sa, oa, self_a), bb = bytes(sb, ob, self_b);
    std::vector<int64_t> common;
    std::set_intersection(a.begin(), a.end(), bb.begin(), bb.end(), std::back_inserter(common));
    std::string msg;
    try {
      ropekv::validate(b.tensors(), s.cfg);
    } catch (const ropekv::Error& e) {
      msg = e.what();
    }
    SCOPED_TRACE("strides (" + std::to_string(sa[0]) + ", " + std::to_string(sa[1]) + ", " +
                 std::to_string(sa[2]) + ") at " + std::to_string(oa) + " and (" +
                 std::to_string(sb[0]) + ", " + std::to_string(sb[1]) + ", " +
                 std::to_string(sb[2]) + ") at " + std::to_string(ob));
    if (self_a || self_b || !common.empty()) {
      shared += !common.empty();
      ASSERT_FALSE(msg.empty()) << "overlapping pools accepted";
    } else if (sa == sb && nested(sa)) {
      ++exact_disjoint;
      ASSERT_TRUE(msg.empty()) << "disjoint views of one layout refused: " << msg;
    } else if (abs_sorted(sa) == abs_sorted(sb) && nested(sa) && nested(sb)) {
      ++flipped_disjoint;
      ASSERT_TRUE(msg.empty()) << "disjoint reversed or permuted views refused: " << msg;
    }
  }
  // (Both kinds must have occurred for the test to mean anything.)
  EXPECT_GT(shared, 500);
  EXPECT_GT(exact_disjoint, 500);
  EXPECT_GT(flipped_disjoint, 200);
}

// Shapes and strides whose products wrap, negative extents, unreadable
// views: errors before anything is read or written.
TEST(Validate, ExtentsAndViews) {
  VSpec s = valid_spec();
  s.k_pool.shape[0] = s.v_pool.shape[0] = -3;
  EXPECT_PREFIX(error_of(s), "k_pool has a negative extent: shape (-3, 2, 8)");
  {
    std::mt19937_64 rng(test_seed());
    s = valid_spec();
    Built b = build(s, rng);
    // A pool of 2^62 rows with no memory: its element count wraps to 0.
    for (int i : {5, 6}) {
      b.t[i] = Tensor::view(b.t[i].storage(), DType::kF32, {int64_t{1} << 62, kHk, kD},
                            {kHk * kD, kD, 1}, 0);
      b.t[i].set_null_data(true);
    }
    EXPECT_PREFIX(error_of_built(b, s.cfg), "k_pool has shape (4611686018427387904, 2, 8), "
                                            "more elements than 64 bits count");
  }
  {
    std::mt19937_64 rng(test_seed());
    s = valid_spec();
    Built b = build(s, rng);
    b.t[0] = Tensor::view(b.t[0].storage(), DType::kF32, {kT, kHq, kD},
                          {int64_t{1} << 62, kD, 1}, 0);  // its byte offsets wrap
    EXPECT_PREFIX(error_of_built(b, s.cfg), "q has shape (3, 4, 8) and strides whose byte span "
                                            "does not fit in 64 bits");
  }
  {
    std::mt19937_64 rng(test_seed());
    s = valid_spec();
    const Built b = build(s, rng);
    ropekv::RopePoolTensors t = b.tensors();
    t.k.shape = nullptr;
    EXPECT_THROW(
        {
          try {
            ropekv::validate(t, s.cfg);
          } catch (const ropekv::Error& e) {
            EXPECT_PREFIX(std::string(e.what()), "k is not a valid tensor view: ndim 3 with no shape");
            throw;
          }
        },
        ropekv::Error);
    // A byte_offset that wraps data + byte_offset around the address space
    // (to null: a pool row there would read as "no slot").
    for (const uint64_t past : {uint64_t{0}, uint64_t{64}}) {
      t = b.tensors();
      t.k_pool.byte_offset = ~reinterpret_cast<uintptr_t>(t.k_pool.data) + 1 + past;
      try {
        ropekv::validate(t, s.cfg);
        ADD_FAILURE() << "accepted a byte_offset that wraps, past " << past;
      } catch (const ropekv::Error& e) {
        EXPECT_PREFIX(std::string(e.what()), "k_pool's byte_offset ");
        EXPECT_CONTAINS(std::string(e.what()), "runs past the top of the address space");
      }
    }
    t = b.tensors();
    t.q.ndim = 1 << 28;  // its shape is not printed past its 3 entries
    try {
      ropekv::validate(t, s.cfg);
      ADD_FAILURE() << "accepted";
    } catch (const ropekv::Error& e) {
      EXPECT_PREFIX(std::string(e.what()), "rope_pool_fused expects q/k/v to be 3-D, got q (a "
                                           "268435456-D shape)");
    }
  }
}

TEST(Validate, UnknownKvCacheDtype) {
  std::mt19937_64 rng(test_seed());
  VSpec s = valid_spec();
  s.cfg.kv_cache_dtype = static_cast<ropekv::KvCacheDtype>(7);
  Built b = build(s, rng);
  // With pools of q's dtype, and of fp8 bytes: the value is the error, not the pools.
  EXPECT_PREFIX(error_of_built(b, s.cfg), "kv_cache_dtype is unknown (value 7)");
  for (int i : {5, 6}) b.t[i].override_dtype(DLDataType{kDLUInt, 8, 1});  // fp8 pools' bytes
  EXPECT_PREFIX(error_of_built(b, s.cfg), "kv_cache_dtype is unknown (value 7)");
}

// fp8 pools are their bytes as uint8 or typed as their format (DLPack 1.1's
// codes), each pool either way; a pool typed as the other format, or fp8
// pools without the opt-in, are named with the option that fits them.
TEST(Validate, Fp8PoolsTypedOrBytes) {
  std::mt19937_64 rng(test_seed());
  VSpec s = valid_spec();
  Built b = build(s, rng);
  const DLDataType bytes{kDLUInt, 8, 1}, e4m3{ropekv::kDLCodeFloat8E4M3fn, 8, 1},
      e5m2{ropekv::kDLCodeFloat8E5M2, 8, 1};
  for (const auto& [kv, own, other] :
       {std::tuple{ropekv::KvCacheDtype::kFp8E4M3, e4m3, e5m2},
        std::tuple{ropekv::KvCacheDtype::kFp8E5M2, e5m2, e4m3}}) {
    s.cfg.kv_cache_dtype = kv;
    const std::string name = kv == ropekv::KvCacheDtype::kFp8E4M3 ? "fp8_e4m3" : "fp8_e5m2";
    const std::string other_name = kv == ropekv::KvCacheDtype::kFp8E4M3 ? "fp8_e5m2" : "fp8_e4m3";
    const std::string own_str = kv == ropekv::KvCacheDtype::kFp8E4M3 ? "float8_e4m3fn" : "float8_e5m2";
    const std::string other_str = kv == ropekv::KvCacheDtype::kFp8E4M3 ? "float8_e5m2" : "float8_e4m3fn";
    for (const auto& [k, v] : {std::pair{bytes, bytes}, std::pair{own, own}, std::pair{bytes, own},
                               std::pair{own, bytes}}) {
      b.t[5].override_dtype(k);
      b.t[6].override_dtype(v);
      EXPECT_NO_THROW(ropekv::validate(b.tensors(), s.cfg)) << name;
    }
    b.t[5].override_dtype(bytes);
    b.t[6].override_dtype(other);
    EXPECT_EQ(error_of_built(b, s.cfg),
              "pool dtypes must be uint8 (fp8 bits) or " + own_str + " for kv_cache_dtype=\"" +
                  name + "\", got k_pool uint8, v_pool " + other_str +
                  "; pass kv_cache_dtype=\"" + other_name + "\"");
    b.t[5].override_dtype(DLDataType{kDLFloat, 32, 1});  // not fp8 at all: no hint
    b.t[6].override_dtype(own);
    EXPECT_EQ(error_of_built(b, s.cfg),
              "pool dtypes must be uint8 (fp8 bits) or " + own_str + " for kv_cache_dtype=\"" +
                  name + "\", got k_pool float32, v_pool " + own_str);
    // Pools of two formats: no one option fits them.
    b.t[5].override_dtype(own);
    b.t[6].override_dtype(other);
    EXPECT_EQ(error_of_built(b, s.cfg),
              "pool dtypes must be uint8 (fp8 bits) or " + own_str + " for kv_cache_dtype=\"" +
                  name + "\", got k_pool " + own_str + ", v_pool " + other_str +
                  "; k_pool and v_pool hold two fp8 formats (" + own_str + ", " + other_str +
                  "), which no one kv_cache_dtype covers");
    // Without the opt-in: the format a typed pool holds is named.
    s.cfg.kv_cache_dtype = ropekv::KvCacheDtype::kAuto;
    b.t[6].override_dtype(own);
    EXPECT_EQ(error_of_built(b, s.cfg),
              "pool dtypes must match q/k/v dtype, got k_pool " + own_str + ", v_pool " + own_str +
                  " for q/k/v float32; an fp8 pool: pass kv_cache_dtype=\"" + name +
                  "\" with k_scale and v_scale");
    b.t[6].override_dtype(bytes);  // (bytes fit either format)
    EXPECT_EQ(error_of_built(b, s.cfg),
              "pool dtypes must match q/k/v dtype, got k_pool " + own_str +
                  ", v_pool uint8 for q/k/v float32; an fp8 pool: pass kv_cache_dtype=\"" + name +
                  "\" with k_scale and v_scale");
    b.t[6].override_dtype(DLDataType{kDLFloat, 32, 1});  // one pool q's dtype: no hint
    EXPECT_EQ(error_of_built(b, s.cfg), "pool dtypes must match q/k/v dtype, got k_pool " +
                                            own_str + ", v_pool float32 for q/k/v float32");
    // A q/k/v dtype ropekv does not take: no hint (following one would only
    // meet the q/k/v dtype error).
    for (int i : {0, 1, 2, 7, 8}) b.t[i].override_dtype(own);
    for (int i : {5, 6}) b.t[i].override_dtype(DLDataType{kDLFloat, 32, 1});
    EXPECT_EQ(error_of_built(b, s.cfg),
              "pool dtypes must match q/k/v dtype, got k_pool float32, v_pool float32 for q/k/v " +
                  own_str);
    for (int i : {0, 1, 2, 7, 8}) b.t[i].override_dtype(DLDataType{kDLFloat, 32, 1});
  }
}

TEST(Validate, NegativeThreadCount) {
  std::mt19937_64 rng(test_seed());
  const VSpec s = valid_spec();
  const Built b = build(s, rng);
  std::vector<std::vector<uint8_t>> before;
  for (const Tensor& t : b.t) before.push_back(t.storage()->snapshot());
  ropekv::ExecOptions o;
  o.num_threads = -1;
  try {
    ropekv::rope_pool_fused(b.tensors(), s.cfg, o);
    ADD_FAILURE() << "accepted num_threads = -1";
  } catch (const ropekv::Error& e) {
    EXPECT_PREFIX(std::string(e.what()), "num_threads must be >= 0 (0: OpenMP's default), got -1");
  }
  for (size_t i = 0; i < b.t.size(); ++i) EXPECT_TRUE(b.t[i].storage()->snapshot() == before[i]);
}

}  // namespace
}  // namespace ropekv_test

namespace ropekv_test {
namespace {

// Checked mode (ExecOptions::checked): two tokens naming one pool row are
// rejected before anything is written; negative slots may repeat.
TEST(Validate, CheckedModeRejectsDuplicateSlots) {
  std::mt19937_64 rng(test_seed());
  for (DType st : {DType::kI32, DType::kI64}) {
    CaseSpec s;
    s.T = 5;
    s.Hq = 4;
    s.Hk = 2;
    s.D = 16;
    s.P = 8;
    s.slot_type = st;
    Case c = make_case(s, rng);
    ropekv::ExecOptions checked;
    checked.checked = true;
    // Slots with one repeat, refused in checked mode with nothing written.
    auto expect_refused = [&](const int64_t (&slots)[5], const std::string& prefix) {
      for (int64_t t = 0; t < 5; ++t) c.slots.set_index(t, slots[t]);
      const Snapshot before(c);
      try {
        ropekv::rope_pool_fused(c.tensors(), c.config(), checked);
        ADD_FAILURE() << "accepted in checked mode: " << prefix;
      } catch (const ropekv::Error& e) {
        EXPECT_PREFIX(std::string(e.what()), prefix);
      }
      for (const auto& [storage, snap] : before.bytes)
        EXPECT_TRUE(storage->snapshot() == snap) << "a rejected call wrote memory";
    };
    // The largest slot repeated (the last pair of the sorted slots), then
    // the smallest one (the first pair), which the calls below keep.
    expect_refused({1, 7, 3, -1, 7}, "slots[4] = 7 repeats slots[1]");
    expect_refused({4, -1, 6, -1, 4}, "slots[4] = 4 repeats slots[0]");
    c.reset();
    // Unchecked, the call goes through (one of the two tokens lands).
    EXPECT_NO_THROW(ropekv::rope_pool_fused(c.tensors(), c.config()));
    // Checked with distinct slots (negative ones repeated): a normal call.
    c.slots.set_index(4, 7);
    c.slots.set_index(3, -5);
    run_and_check(c, expect(c), checked);
  }
}

}  // namespace
}  // namespace ropekv_test
