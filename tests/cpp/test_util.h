// Shared helpers of the ropekv GoogleTest suite:
//
//  * scalar f16 / bf16 / f32 conversions written from the IEEE definitions
//    (round to nearest even, subnormals, overflow to Inf, NaN), independent
//    of the kernel's SIMD conversions;
//  * an owning Tensor that describes a DLTensor (shape, element strides,
//    dtype, device) over a byte buffer, and views with any strides over a
//    shared buffer (fused QKV, stride-2 last dimension, padded heads, ...);
//  * a Case: one complete call (inputs drawn at random, outputs poisoned
//    with NaN bit patterns, pools filled with random bits), the float64
//    expectation built with ropekv::reference::rope_head, and a checker
//    that compares every output element, the pool rows the call names
//    (bit-exact), and every other byte of every buffer (bit-identical).
#pragma once

#include <dlpack/dlpack.h>
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "ropekv/reference.h"
#include "ropekv/ropekv.h"

namespace ropekv_test {

// ============================================================ scalar formats

/// A binary floating-point format: `exp_bits` exponent bits, `man_bits`
/// stored mantissa bits, IEEE 754 semantics (bias 2^(e-1)-1, subnormals).
struct Format {
  int exp_bits;
  int man_bits;
};
constexpr Format kHalf{5, 10};
constexpr Format kBFloat16{8, 7};
constexpr Format kSingle{8, 23};

inline int bias_of(Format f) { return (1 << (f.exp_bits - 1)) - 1; }

/// 2^k, exactly, built from its bits where it is a normal double (what
/// std::ldexp(1.0, k) returns; the checks below call it per element, and
/// libm's ldexp and frexp were a quarter of the large tests' time).
inline double pow2(int k) {
  if (k < -1022 || k > 1023) return std::ldexp(1.0, k);
  const uint64_t bits = static_cast<uint64_t>(k + 1023) << 52;
  double v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

/// The exponent e of a = m * 2^e with m in [0.5, 1), for a finite a > 0 (what
/// std::frexp returns), from the bits where a is a normal double.
inline int frexp_exponent(double a) {
  uint64_t bits;
  std::memcpy(&bits, &a, sizeof(bits));
  const int field = static_cast<int>((bits >> 52) & 0x7FF);
  if (field == 0) {  // a subnormal double
    int e = 0;
    std::frexp(a, &e);
    return e;
  }
  return field - 1022;
}

/// Rounds the double `x` once, to nearest even, into format `f` and returns
/// the bit pattern. Subnormals are produced exactly, overflow gives Inf, NaN
/// gives a quiet NaN with the sign of x.
inline uint32_t encode(double x, Format f) {
  const uint32_t sign = std::signbit(x) ? (1u << (f.exp_bits + f.man_bits)) : 0u;
  const uint32_t exp_all = (1u << f.exp_bits) - 1;
  if (std::isnan(x)) return sign | (exp_all << f.man_bits) | (1u << (f.man_bits - 1));
  const double a = std::fabs(x);
  if (std::isinf(a)) return sign | (exp_all << f.man_bits);
  if (a == 0.0) return sign;
  const int e = frexp_exponent(a);  // a = m * 2^e, m in [0.5, 1): the binade's exponent is e - 1
  const int emin = 1 - bias_of(f);
  const int ex = std::max(e - 1, emin);  // subnormals share emin's quantum
  // a in units of the format's quantum 2^(ex - man_bits): a power-of-two
  // scaling of a double, so exact; its fraction is then exact as well.
  const double q = a * pow2(f.man_bits - ex);
  double n = std::floor(q);
  const double frac = q - n;
  if (frac > 0.5 || (frac == 0.5 && std::fmod(n, 2.0) != 0.0)) n += 1.0;
  uint64_t m = static_cast<uint64_t>(n);
  int biased = ex + bias_of(f);
  if (m >= (2ull << f.man_bits)) {  // rounded up into the next binade
    m >>= 1;
    biased += 1;
  }
  if (m < (1ull << f.man_bits)) return sign | static_cast<uint32_t>(m);  // subnormal or 0
  if (biased >= static_cast<int>(exp_all)) return sign | (exp_all << f.man_bits);
  return sign | (static_cast<uint32_t>(biased) << f.man_bits) |
         static_cast<uint32_t>(m - (1ull << f.man_bits));
}

/// The exact value of the bit pattern `bits` of format `f`.
inline double decode(uint32_t bits, Format f) {
  const uint32_t exp_all = (1u << f.exp_bits) - 1;
  const bool negative = (bits >> (f.exp_bits + f.man_bits)) & 1u;
  const uint32_t ex = (bits >> f.man_bits) & exp_all;
  const uint32_t man = bits & ((1u << f.man_bits) - 1);
  double v;
  if (ex == exp_all)
    v = man ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (ex == 0)  // (an integer below 2^24 times a power of two: exact)
    v = static_cast<double>(man) * pow2(1 - bias_of(f) - f.man_bits);
  else
    v = static_cast<double>(man + (1u << f.man_bits)) *
        pow2(static_cast<int>(ex) - bias_of(f) - f.man_bits);
  return negative ? -v : v;
}

/// One unit in the last place of format `f` at magnitude |a| (the spacing of
/// the binade of |a|; the subnormal spacing below the smallest normal).
inline double ulp_of(double a, Format f) {
  a = std::fabs(a);
  const int emin = 1 - bias_of(f);
  int e = 0;
  if (a == 0.0 || !std::isfinite(a)) {
    e = emin + 1;
  } else {
    e = frexp_exponent(a);
  }
  return pow2(std::max(e - 1, emin) - f.man_bits);
}

inline uint16_t to_f16(double x) { return static_cast<uint16_t>(encode(x, kHalf)); }
inline uint16_t to_bf16(double x) { return static_cast<uint16_t>(encode(x, kBFloat16)); }
inline double from_f16(uint16_t b) { return decode(b, kHalf); }
inline double from_bf16(uint16_t b) { return decode(b, kBFloat16); }
inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ============================================================ dtypes

enum class DType { kF32, kF16, kBF16, kF64, kI32, kI64, kI16, kU32 };

inline int64_t dtype_size(DType d) {
  switch (d) {
    case DType::kF16: case DType::kBF16: case DType::kI16: return 2;
    case DType::kF32: case DType::kI32: case DType::kU32: return 4;
    case DType::kF64: case DType::kI64: return 8;
  }
  return 0;
}

inline DLDataType dl_dtype(DType d) {
  switch (d) {
    case DType::kF32: return {kDLFloat, 32, 1};
    case DType::kF16: return {kDLFloat, 16, 1};
    case DType::kBF16: return {kDLBfloat, 16, 1};
    case DType::kF64: return {kDLFloat, 64, 1};
    case DType::kI32: return {kDLInt, 32, 1};
    case DType::kI64: return {kDLInt, 64, 1};
    case DType::kI16: return {kDLInt, 16, 1};
    case DType::kU32: return {kDLUInt, 32, 1};
  }
  return {kDLFloat, 32, 1};
}

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
    case DType::kF64: return "f64";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    case DType::kI16: return "i16";
    case DType::kU32: return "u32";
  }
  return "?";
}

/// The storage format of a floating dtype of the op.
inline Format format_of(DType d) {
  return d == DType::kF16 ? kHalf : d == DType::kBF16 ? kBFloat16 : kSingle;
}

/// A quiet NaN with a payload no arithmetic produces: an element still
/// holding it after a call was never written.
inline uint64_t poison_bits(DType d) {
  switch (d) {
    case DType::kF32: return 0x7FBADBADu;  // signalling-NaN payload
    case DType::kF16: return 0x7D5Au;
    case DType::kBF16: return 0x7FDAu;
    case DType::kF64: return 0x7FF4BADBADBADBADull;
    default: return 0x5A5A5A5A5A5A5A5Aull;
  }
}

// ============================================================ storage, tensors

/// Bytes that views point into: a std::vector, or an external mapping.
struct Storage {
  std::vector<uint8_t> vec;
  uint8_t* base = nullptr;
  size_t size = 0;
  std::function<void()> release;
  Storage() = default;
  explicit Storage(size_t n) : vec(n), base(vec.data()), size(n) {}
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  ~Storage() {
    if (release) release();
  }
  std::vector<uint8_t> snapshot() const { return std::vector<uint8_t>(base, base + size); }
  void restore(const std::vector<uint8_t>& s) { std::memcpy(base, s.data(), size); }
};
using StoragePtr = std::shared_ptr<Storage>;

/// A DLTensor description over a Storage: dtype, shape, element strides and
/// the element offset of element [0, ..., 0] from the storage's start.
class Tensor {
 public:
  Tensor() = default;

  /// A fresh compact row-major tensor that owns its storage. With
  /// `null_strides`, the DLTensor says so with strides == NULL.
  static Tensor compact(DType dt, std::vector<int64_t> shape, bool null_strides = true) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    std::vector<int64_t> strides(shape.size());
    int64_t running = 1;
    for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
      strides[i] = running;
      running *= shape[i];
    }
    auto st = std::make_shared<Storage>(static_cast<size_t>(std::max<int64_t>(n, 1) * dtype_size(dt)));
    Tensor t = view(st, dt, std::move(shape), std::move(strides), 0);
    t.null_strides_ = null_strides;
    return t;
  }

  /// A view of `st`: shape, element strides (any sign), element offset of
  /// element [0, ..., 0]. With `use_byte_offset` the offset goes into
  /// DLTensor::byte_offset, else into the data pointer.
  static Tensor view(StoragePtr st, DType dt, std::vector<int64_t> shape,
                     std::vector<int64_t> strides, int64_t offset, bool use_byte_offset = true) {
    Tensor t;
    t.storage_ = std::move(st);
    t.dtype_ = dt;
    t.shape_ = std::move(shape);
    t.strides_ = std::move(strides);
    t.offset_ = offset;
    t.use_byte_offset_ = use_byte_offset;
    return t;
  }

  /// The DLTensor of this view (points into this object: keep it alive).
  DLTensor dl() const {
    DLTensor d{};
    d.data = storage_ ? storage_->base : nullptr;
    d.device = device_;
    d.ndim = static_cast<int32_t>(shape_.size());
    d.dtype = dtype_override_set_ ? dtype_override_ : dl_dtype(dtype_);
    d.shape = const_cast<int64_t*>(shape_.data());
    d.strides = null_strides_ ? nullptr : const_cast<int64_t*>(strides_.data());
    const uint64_t bytes = static_cast<uint64_t>(offset_ * dtype_size(dtype_));
    if (use_byte_offset_) {
      d.byte_offset = bytes;
    } else {
      d.data = static_cast<uint8_t*>(d.data) + bytes;
      d.byte_offset = 0;
    }
    if (null_data_) d.data = nullptr;
    return d;
  }

  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<int64_t>& strides() const { return strides_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  const StoragePtr& storage() const { return storage_; }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape_) n *= s;
    return n;
  }
  void set_device(DLDevice d) { device_ = d; }
  void set_null_data(bool v) { null_data_ = v; }
  /// Makes the DLTensor claim another dtype (same element size or not): for
  /// calls that must be rejected before any element is touched.
  void override_dtype(DLDataType d) {
    dtype_override_ = d;
    dtype_override_set_ = true;
  }

  // Element offsets (in elements, from the storage's start).
  int64_t off(int64_t i) const { return offset_ + i * strides_[0]; }
  int64_t off(int64_t i, int64_t j, int64_t k) const {
    return offset_ + i * strides_[0] + j * strides_[1] + k * strides_[2];
  }

  uint64_t raw(int64_t elem) const {
    const uint8_t* p = storage_->base + elem * dtype_size(dtype_);
    switch (dtype_size(dtype_)) {
      case 2: { uint16_t v; std::memcpy(&v, p, 2); return v; }
      case 4: { uint32_t v; std::memcpy(&v, p, 4); return v; }
      default: { uint64_t v; std::memcpy(&v, p, 8); return v; }
    }
  }
  void set_raw(int64_t elem, uint64_t bits) {
    uint8_t* p = storage_->base + elem * dtype_size(dtype_);
    switch (dtype_size(dtype_)) {
      case 2: { const uint16_t v = static_cast<uint16_t>(bits); std::memcpy(p, &v, 2); break; }
      case 4: { const uint32_t v = static_cast<uint32_t>(bits); std::memcpy(p, &v, 4); break; }
      default: std::memcpy(p, &bits, 8);
    }
  }

  /// The exact value stored at element offset `elem`.
  double value(int64_t elem) const {
    const uint64_t b = raw(elem);
    switch (dtype_) {
      case DType::kF32: return f32_from_bits(static_cast<uint32_t>(b));
      case DType::kF16: return from_f16(static_cast<uint16_t>(b));
      case DType::kBF16: return from_bf16(static_cast<uint16_t>(b));
      case DType::kF64: { double d; std::memcpy(&d, &b, 8); return d; }
      case DType::kI32: return static_cast<int32_t>(static_cast<uint32_t>(b));
      case DType::kI64: return static_cast<double>(static_cast<int64_t>(b));
      case DType::kI16: return static_cast<int16_t>(static_cast<uint16_t>(b));
      case DType::kU32: return static_cast<uint32_t>(b);
    }
    return 0;
  }
  /// Stores `x` at element offset `elem`, rounded once to the dtype.
  void set_value(int64_t elem, double x) {
    switch (dtype_) {
      case DType::kF32: set_raw(elem, encode(x, kSingle)); break;
      case DType::kF16: set_raw(elem, to_f16(x)); break;
      case DType::kBF16: set_raw(elem, to_bf16(x)); break;
      case DType::kF64: { uint64_t b; std::memcpy(&b, &x, 8); set_raw(elem, b); break; }
      case DType::kI32: set_raw(elem, static_cast<uint32_t>(static_cast<int32_t>(x))); break;
      case DType::kI64: set_raw(elem, static_cast<uint64_t>(static_cast<int64_t>(x))); break;
      case DType::kI16: set_raw(elem, static_cast<uint16_t>(static_cast<int64_t>(x))); break;  // wraps
      case DType::kU32: set_raw(elem, static_cast<uint32_t>(x)); break;
    }
  }
  int64_t index(int64_t i) const {  // 1-D integer arrays
    const uint64_t b = raw(off(i));
    return dtype_ == DType::kI32 ? static_cast<int32_t>(static_cast<uint32_t>(b))
                                 : static_cast<int64_t>(b);
  }
  void set_index(int64_t i, int64_t v) {
    set_raw(off(i), dtype_ == DType::kI32 ? static_cast<uint32_t>(static_cast<int32_t>(v))
                                          : static_cast<uint64_t>(v));
  }

  /// Calls f(element offset) for every element of the view.
  void for_each_offset(const std::function<void(int64_t)>& f) const {
    if (numel() == 0) return;
    std::vector<int64_t> idx(shape_.size(), 0);
    while (true) {
      int64_t o = offset_;
      for (size_t d = 0; d < idx.size(); ++d) o += idx[d] * strides_[d];
      f(o);
      int d = static_cast<int>(idx.size()) - 1;
      for (; d >= 0; --d) {
        if (++idx[d] < shape_[d]) break;
        idx[d] = 0;
      }
      if (d < 0) return;
    }
  }

 private:
  StoragePtr storage_;
  DType dtype_ = DType::kF32;
  std::vector<int64_t> shape_, strides_;
  int64_t offset_ = 0;
  bool use_byte_offset_ = true;
  bool null_strides_ = false;
  bool null_data_ = false;
  DLDevice device_{kDLCPU, 0};
  DLDataType dtype_override_{};
  bool dtype_override_set_ = false;
};

/// [rows, heads[i], D] views packed side by side in the rows of one new
/// storage: element d of head h of block b sits at
///   lead + r * row_stride + (first head of b + h) * head_stride + d * last_stride
/// with head_stride = D * last_stride + head_pad and row_stride = (sum of
/// heads) * head_stride + row_pad. One block = a plain (maybe padded or
/// strided) array; several blocks = a fused projection output such as QKV.
inline std::vector<Tensor> packed_views(DType dt, int64_t rows, const std::vector<int64_t>& heads,
                                        int64_t D, int64_t last_stride = 1, int64_t head_pad = 0,
                                        int64_t row_pad = 0, int64_t lead = 0,
                                        bool use_byte_offset = true) {
  int64_t total_heads = 0;
  for (int64_t h : heads) total_heads += h;
  const int64_t head_stride = D * last_stride + head_pad;
  const int64_t row_stride = total_heads * head_stride + row_pad;
  const int64_t elems = lead + rows * row_stride + 8;  // a guard tail after the last row
  auto st = std::make_shared<Storage>(static_cast<size_t>(elems * dtype_size(dt)));
  std::vector<Tensor> out;
  int64_t first = 0;
  for (int64_t h : heads) {
    out.push_back(Tensor::view(st, dt, {rows, h, D}, {row_stride, head_stride, last_stride},
                               lead + first * head_stride, use_byte_offset));
    first += h;
  }
  return out;
}

// ============================================================ random data

/// A nonzero value in [-4, 4] with varied magnitudes (2^-4 .. 4), rounded
/// to `dt` (never rounds to zero: the smallest is far above every format's
/// subnormal range).
inline double random_value(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> mant(0.5, 1.0);
  std::uniform_int_distribution<int> ex(-3, 3);
  const double v = std::ldexp(mant(rng), ex(rng));
  return (rng() & 1) ? -v : v;
}

inline void fill_random(Tensor& t, std::mt19937_64& rng) {
  t.for_each_offset([&](int64_t o) { t.set_value(o, random_value(rng)); });
}

/// Fills every byte of the tensor's whole storage with the poison NaN of its dtype.
inline void poison_storage(const Tensor& t) {
  Storage& s = *t.storage();
  const int64_t es = dtype_size(t.dtype());
  const uint64_t b = poison_bits(t.dtype());
  for (size_t i = 0; i + es <= s.size; i += es) std::memcpy(s.base + i, &b, es);
}

/// Fills a whole storage with random bytes (a pool's previous contents).
inline void random_bytes(Storage& s, std::mt19937_64& rng) {
  for (size_t i = 0; i < s.size; ++i) s.base[i] = static_cast<uint8_t>(rng() >> 56);
}

/// A seed that differs for every test (name-based) and every `salt`.
inline uint64_t test_seed(uint64_t salt = 0) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "none";
  uint64_t h = 1469598103934665603ull;
  for (char c : name) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return h ^ (salt * 0x9E3779B97F4A7C15ull);
}

// ============================================================ model configs

struct ModelConfig {
  const char* name;
  int64_t hq, hk, d;
  double base;
};

/// SPEC section 6, the models whose rotary dim equals head_dim.
inline std::vector<ModelConfig> full_rotary_models() {
  return {
      {"Llama31_8B", 32, 8, 128, 500000.0}, {"Llama32_1B", 32, 8, 64, 500000.0},
      {"Llama2_7B", 32, 32, 128, 10000.0},  {"Mistral7B", 32, 8, 128, 1000000.0},
      {"Qwen25_7B", 28, 4, 128, 1000000.0}, {"Qwen3_8B", 32, 8, 128, 1000000.0},
      {"Gemma2_9B", 16, 8, 256, 10000.0},   {"Phi3_mini", 32, 32, 96, 10000.0},
  };
}

// ============================================================ one call

/// How the arrays of a Case are laid out.
struct Layout {
  bool fused_qkv = false;     // q, k, v views of one [T, (Hq + 2 Hk) * D] buffer
  bool fused_out = false;     // q_rot, k_rot views of one [T, (Hq + Hk) * D] buffer
  int64_t in_last_stride = 1;   // element stride of the last dim of q, k, v
  int64_t out_last_stride = 1;  // of q_rot, k_rot
  int64_t pool_last_stride = 1; // of k_pool, v_pool
  int64_t in_head_pad = 0, out_head_pad = 0, pool_head_pad = 0;
  int64_t in_row_pad = 0, pool_row_pad = 0;
  int64_t lead = 0;             // elements before element [0,0,0] of every buffer
  bool byte_offset = true;      // lead via DLTensor::byte_offset (else data pointer)
  bool compact_null_strides = false;  // plain compact arrays with strides == NULL
  int64_t index_stride = 1;     // element stride of positions and slots (a column of a wider array)
};

struct CaseSpec {
  int64_t T = 1, Hq = 1, Hk = 1, D = 2, P = 1;
  double base = 10000.0;
  DType dtype = DType::kF32;
  DType pos_type = DType::kI32;
  DType slot_type = DType::kI32;
  Layout layout;
};

inline std::string describe(const CaseSpec& s) {
  std::ostringstream o;
  o << "T=" << s.T << " Hq=" << s.Hq << " Hk=" << s.Hk << " D=" << s.D << " P=" << s.P
    << " base=" << s.base << " " << dtype_name(s.dtype) << " pos=" << dtype_name(s.pos_type)
    << " slots=" << dtype_name(s.slot_type);
  return o.str();
}

struct Case {
  CaseSpec spec;
  Tensor q, k, v, positions, slots, k_pool, v_pool, q_rot, k_rot;
  std::vector<uint8_t> k_pool_init, v_pool_init;  // the pools' contents before any call

  ropekv::RopePoolTensors tensors() const {
    ropekv::RopePoolTensors t{};
    t.q = q.dl();
    t.k = k.dl();
    t.v = v.dl();
    t.positions = positions.dl();
    t.slots = slots.dl();
    t.k_pool = k_pool.dl();
    t.v_pool = v_pool.dl();
    t.q_rot = q_rot.dl();
    t.k_rot = k_rot.dl();
    return t;
  }
  ropekv::RopeConfig config() const {
    ropekv::RopeConfig c;
    c.head_dim = spec.D;
    c.num_qo_heads = spec.Hq;
    c.num_kv_heads = spec.Hk;
    c.rope_base = spec.base;
    return c;
  }
  std::vector<const Tensor*> all() const {
    return {&q, &k, &v, &positions, &slots, &k_pool, &v_pool, &q_rot, &k_rot};
  }
  /// Every distinct storage of the call.
  std::vector<Storage*> storages() const {
    std::vector<Storage*> out;
    for (const Tensor* t : all())
      if (std::find(out.begin(), out.end(), t->storage().get()) == out.end())
        out.push_back(t->storage().get());
    return out;
  }
  /// Poisons the outputs and puts the pools back to their initial contents.
  void reset() {
    poison_storage(q_rot);
    poison_storage(k_rot);
    k_pool.storage()->restore(k_pool_init);
    v_pool.storage()->restore(v_pool_init);
  }
};

/// Random positions: mostly uniform in [0, 2^24], some small, the largest
/// exactly-representable ones (2^24 - 1, 2^24) and some negative.
inline int64_t random_position(std::mt19937_64& rng) {
  const uint64_t r = rng() % 16;
  if (r == 0) return (1 << 24) - 1;
  if (r == 1) return 1 << 24;
  if (r == 2) return -static_cast<int64_t>(rng() % (1 << 24)) - 1;
  if (r < 6) return static_cast<int64_t>(rng() % 4096);
  return static_cast<int64_t>(rng() % ((1 << 24) + 1));
}

/// Builds a Case: inputs random, positions random (positions[0] = 2^24 - 1
/// when T > 1), slots a random injection into [0, P) with about one token
/// in five not written (slot < 0), pools random bytes, outputs poisoned.
inline Case make_case(const CaseSpec& s, std::mt19937_64& rng) {
  Case c;
  c.spec = s;
  const Layout& L = s.layout;
  if (L.compact_null_strides) {
    c.q = Tensor::compact(s.dtype, {s.T, s.Hq, s.D});
    c.k = Tensor::compact(s.dtype, {s.T, s.Hk, s.D});
    c.v = Tensor::compact(s.dtype, {s.T, s.Hk, s.D});
    c.q_rot = Tensor::compact(s.dtype, {s.T, s.Hq, s.D});
    c.k_rot = Tensor::compact(s.dtype, {s.T, s.Hk, s.D});
    c.k_pool = Tensor::compact(s.dtype, {s.P, s.Hk, s.D});
    c.v_pool = Tensor::compact(s.dtype, {s.P, s.Hk, s.D});
  } else {
    if (L.fused_qkv) {
      auto qkv = packed_views(s.dtype, s.T, {s.Hq, s.Hk, s.Hk}, s.D, L.in_last_stride,
                              L.in_head_pad, L.in_row_pad, L.lead, L.byte_offset);
      c.q = qkv[0];
      c.k = qkv[1];
      c.v = qkv[2];
    } else {
      c.q = packed_views(s.dtype, s.T, {s.Hq}, s.D, L.in_last_stride, L.in_head_pad, L.in_row_pad,
                         L.lead, L.byte_offset)[0];
      c.k = packed_views(s.dtype, s.T, {s.Hk}, s.D, L.in_last_stride, L.in_head_pad, L.in_row_pad,
                         L.lead, L.byte_offset)[0];
      c.v = packed_views(s.dtype, s.T, {s.Hk}, s.D, L.in_last_stride, L.in_head_pad, L.in_row_pad,
                         L.lead, L.byte_offset)[0];
    }
    if (L.fused_out) {
      auto out = packed_views(s.dtype, s.T, {s.Hq, s.Hk}, s.D, L.out_last_stride, L.out_head_pad, 0,
                              L.lead, L.byte_offset);
      c.q_rot = out[0];
      c.k_rot = out[1];
    } else {
      c.q_rot = packed_views(s.dtype, s.T, {s.Hq}, s.D, L.out_last_stride, L.out_head_pad, 0,
                             L.lead, L.byte_offset)[0];
      c.k_rot = packed_views(s.dtype, s.T, {s.Hk}, s.D, L.out_last_stride, L.out_head_pad, 0,
                             L.lead, L.byte_offset)[0];
    }
    c.k_pool = packed_views(s.dtype, s.P, {s.Hk}, s.D, L.pool_last_stride, L.pool_head_pad,
                            L.pool_row_pad, L.lead, L.byte_offset)[0];
    c.v_pool = packed_views(s.dtype, s.P, {s.Hk}, s.D, L.pool_last_stride, L.pool_head_pad,
                            L.pool_row_pad, L.lead, L.byte_offset)[0];
  }
  // Input storages first get random bytes everywhere (gaps included), then
  // random values at the elements.
  for (Tensor* t : {&c.q, &c.k, &c.v}) random_bytes(*t->storage(), rng);
  for (Tensor* t : {&c.q, &c.k, &c.v}) fill_random(*t, rng);
  random_bytes(*c.k_pool.storage(), rng);
  random_bytes(*c.v_pool.storage(), rng);
  c.k_pool_init = c.k_pool.storage()->snapshot();
  c.v_pool_init = c.v_pool.storage()->snapshot();

  if (L.index_stride == 1) {
    c.positions = Tensor::compact(s.pos_type, {s.T}, /*null_strides=*/false);
    c.slots = Tensor::compact(s.slot_type, {s.T}, /*null_strides=*/false);
  } else {  // columns 1 of [T, index_stride] arrays
    const int64_t n = s.T * L.index_stride + 1;
    c.positions = Tensor::view(std::make_shared<Storage>(n * dtype_size(s.pos_type)), s.pos_type,
                               {s.T}, {L.index_stride}, 1, L.byte_offset);
    c.slots = Tensor::view(std::make_shared<Storage>(n * dtype_size(s.slot_type)), s.slot_type,
                           {s.T}, {L.index_stride}, 1, L.byte_offset);
    random_bytes(*c.positions.storage(), rng);
    random_bytes(*c.slots.storage(), rng);
  }
  for (int64_t t = 0; t < s.T; ++t) c.positions.set_index(t, random_position(rng));
  if (s.T > 1) c.positions.set_index(0, (1 << 24) - 1);
  std::vector<int64_t> rows(s.P);
  for (int64_t i = 0; i < s.P; ++i) rows[i] = i;
  std::shuffle(rows.begin(), rows.end(), rng);
  for (int64_t t = 0; t < s.T; ++t) {
    const bool skip = t >= s.P || rng() % 5 == 0;
    c.slots.set_index(t, skip ? -1 - static_cast<int64_t>(rng() % 3) : rows[t]);
  }
  c.reset();
  return c;
}

// ============================================================ the expectation

/// The float64 result of the op for one Case, and a bound per element.
struct Expected {
  std::vector<double> q, k;          // [T, H, D] reference values
  std::vector<double> q_tol, k_tol;  // [T, H, D] allowed |got - ref|
};

/// The allowed error of one output element whose exact value is `ref`:
///
///   fp32 arithmetic: 4 * 2^-24 * (|x_a * c| + |x_b * s|)  (c, s good to a
///     couple of fp32 ulp, two products and a sum rounded in fp32);
///   plus one rounding to the output dtype: a whole ulp of the dtype at |ref|
///     for f32 (the final fp32 rounding and the arithmetic overlap), half an
///     ulp for f16/bf16 (round to nearest even of an fp32 value: a
///     truncating or double-rounding store fails this).
inline double element_tolerance(DType dt, double ref, double term_a, double term_b) {
  const double arith = 4.0 * std::ldexp(1.0, -24) * (std::fabs(term_a) + std::fabs(term_b));
  const double ulp = ulp_of(ref, format_of(dt));
  return (dt == DType::kF32 ? ulp : 0.5 * ulp) + arith;
}

/// Rotates every head of x ([T, H, D]) with ropekv::reference::rope_head.
inline void expect_heads(const Tensor& x, const Tensor& positions, int64_t D, double base,
                         DType dt, std::vector<double>* ref, std::vector<double>* tol) {
  const int64_t T = x.shape()[0], H = x.shape()[1], half = D / 2;
  ref->assign(T * H * D, 0.0);
  tol->assign(T * H * D, 0.0);
  std::vector<double> in(D), out(D), c(half), s(half);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t pos = positions.index(t);
    for (int64_t i = 0; i < half; ++i) {
      const double theta = ropekv::reference::angle(pos, i, D, base);
      c[i] = std::cos(theta);
      s[i] = std::sin(theta);
    }
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t d = 0; d < D; ++d) in[d] = x.value(x.off(t, h, d));
      ropekv::reference::rope_head(in.data(), out.data(), D, D, pos, base);
      double* r = ref->data() + (t * H + h) * D;
      double* e = tol->data() + (t * H + h) * D;
      for (int64_t i = 0; i < half; ++i) {
        r[i] = out[i];
        r[i + half] = out[i + half];
        e[i] = element_tolerance(dt, out[i], in[i] * c[i], in[i + half] * s[i]);
        e[i + half] = element_tolerance(dt, out[i + half], in[i + half] * c[i], in[i] * s[i]);
      }
    }
  }
}

inline Expected expect(const Case& c) {
  Expected e;
  expect_heads(c.q, c.positions, c.spec.D, c.spec.base, c.spec.dtype, &e.q, &e.q_tol);
  expect_heads(c.k, c.positions, c.spec.D, c.spec.base, c.spec.dtype, &e.k, &e.k_tol);
  return e;
}

// ============================================================ the checks

/// Snapshots of every storage of a call's case (a Case, or anything with
/// storages(), as the option tests' OptCase), taken just before a call.
struct Snapshot {
  std::map<const Storage*, std::vector<uint8_t>> bytes;
  template <class C>
  explicit Snapshot(const C& c) {
    for (Storage* s : c.storages()) bytes[s] = s->snapshot();
  }
};

/// The bytes a call may write, per storage: every other byte must still hold
/// its snapshot. Callers take a storage's mask once (`of`) and mark bytes in
/// it: the checks mark every element of every output, and a map lookup per
/// element was a large part of the large option tests' time.
class WriteMask {
 public:
  /// The mask of st's bytes (1 = may change), all clear at first; the
  /// reference stays valid while this object lives.
  std::vector<uint8_t>& of(const Storage* st) {
    auto& m = masks_[st];
    if (m.empty()) m.assign(st->size, 0);
    return m;
  }
  /// Marks n bytes from `byte` in a mask from `of`.
  static void set(std::vector<uint8_t>& m, int64_t byte, int64_t n) {
    std::memset(m.data() + byte, 1, static_cast<size_t>(n));
  }
  /// The bytes of st outside its mask that differ from snap; *first the
  /// first of them (-1 if none).
  int64_t changed_outside(const Storage* st, const std::vector<uint8_t>& snap, int64_t* first) const {
    const auto it = masks_.find(st);
    const uint8_t* mask = it == masks_.end() ? nullptr : it->second.data();
    int64_t changed = 0;
    *first = -1;
    for (size_t b = 0; b < st->size; ++b) {
      if ((mask && mask[b]) || st->base[b] == snap[b]) continue;
      if (*first < 0) *first = static_cast<int64_t>(b);
      ++changed;
    }
    return changed;
  }

 private:
  std::map<const Storage*, std::vector<uint8_t>> masks_;
};

/// The smallest magnitude that rounds to Inf in format f (max + half an ulp).
inline double overflow_threshold(Format f) {
  const double max = decode((((1u << f.exp_bits) - 2) << f.man_bits) | ((1u << f.man_bits) - 1), f);
  return max + 0.5 * ulp_of(max, f);
}

/// One output element against its exact value: within `tol`, or, where the
/// exact value overflows the format by more than `tol`, the Inf of its sign
/// (both accepted inside the band of width tol around the threshold).
inline bool element_ok(double got, double ref, double tol, Format f) {
  const double thr = overflow_threshold(f);
  const bool inf_ok = std::isinf(got) && std::signbit(got) == std::signbit(ref);
  if (std::fabs(ref) - tol >= thr) return inf_ok;
  if (std::fabs(ref) + tol >= thr && inf_ok) return true;
  return std::fabs(got - ref) <= tol;  // false for NaN (unwritten poison)
}

/// Compares one output tensor with its expectation; returns the failures.
inline int64_t check_rotated(const Tensor& got, const std::vector<double>& ref,
                             const std::vector<double>& tol, const char* name, int64_t max_report,
                             const std::set<int64_t>& skip_tokens = {}) {
  const int64_t T = got.shape()[0], H = got.shape()[1], D = got.shape()[2];
  int64_t bad = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (skip_tokens.count(t)) continue;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) {
        const int64_t i = (t * H + h) * D + d;
        const double g = got.value(got.off(t, h, d));
        if (!element_ok(g, ref[i], tol[i], format_of(got.dtype()))) {
          if (bad < max_report)
            ADD_FAILURE() << name << "[" << t << ", " << h << ", " << d << "] = " << g
                          << " (bits 0x" << std::hex << got.raw(got.off(t, h, d)) << std::dec
                          << "), reference " << ref[i] << ", |diff| " << std::fabs(g - ref[i])
                          << " > tolerance " << tol[i];
          ++bad;
        }
      }
  }
  return bad;
}

/// Everything about one finished call: q_rot and k_rot against `e` (tokens
/// in `skip_tokens` are left to the caller), the pool rows named by slots
/// equal to k_rot / v bit for bit, and every other byte of every storage
/// (inputs, gaps, untouched pool rows) identical to `before`.
inline void check_call(const Case& c, const Expected& e, const Snapshot& before,
                       const std::set<int64_t>& skip_tokens = {}) {
  const int64_t T = c.spec.T, Hq = c.spec.Hq, Hk = c.spec.Hk, D = c.spec.D;
  int64_t bad = check_rotated(c.q_rot, e.q, e.q_tol, "q_rot", 8, skip_tokens);
  bad += check_rotated(c.k_rot, e.k, e.k_tol, "k_rot", 8, skip_tokens);

  WriteMask may_change;
  auto& mq = may_change.of(c.q_rot.storage().get());
  auto& mk = may_change.of(c.k_rot.storage().get());
  auto& mkp = may_change.of(c.k_pool.storage().get());
  auto& mvp = may_change.of(c.v_pool.storage().get());
  const int64_t es = dtype_size(c.q_rot.dtype()), pe = dtype_size(c.k_pool.dtype());
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t d = 0; d < D; ++d) WriteMask::set(mq, c.q_rot.off(t, h, d) * es, es);
    for (int64_t h = 0; h < Hk; ++h)
      for (int64_t d = 0; d < D; ++d) WriteMask::set(mk, c.k_rot.off(t, h, d) * es, es);
    const int64_t slot = c.slots.index(t);
    if (slot < 0) continue;
    for (int64_t h = 0; h < Hk; ++h)
      for (int64_t d = 0; d < D; ++d) {
        const uint64_t kp = c.k_pool.raw(c.k_pool.off(slot, h, d));
        const uint64_t kr = c.k_rot.raw(c.k_rot.off(t, h, d));
        const uint64_t vp = c.v_pool.raw(c.v_pool.off(slot, h, d));
        const uint64_t vv = c.v.raw(c.v.off(t, h, d));
        if (kp != kr || vp != vv) {
          if (bad < 16)
            ADD_FAILURE() << "token " << t << " slot " << slot << " head " << h << " dim " << d
                          << ": k_pool 0x" << std::hex << kp << " vs k_rot 0x" << kr
                          << ", v_pool 0x" << vp << " vs v 0x" << vv << std::dec;
          ++bad;
        }
        WriteMask::set(mkp, c.k_pool.off(slot, h, d) * pe, pe);
        WriteMask::set(mvp, c.v_pool.off(slot, h, d) * pe, pe);
      }
  }
  for (const auto& [storage, snap] : before.bytes) {
    int64_t first = -1;
    const int64_t changed = may_change.changed_outside(storage, snap, &first);
    if (changed) {
      const char* which = "?";
      for (const auto& [n, t] : std::vector<std::pair<const char*, const Tensor*>>{
               {"q", &c.q}, {"k", &c.k}, {"v", &c.v}, {"positions", &c.positions},
               {"slots", &c.slots}, {"k_pool", &c.k_pool}, {"v_pool", &c.v_pool},
               {"q_rot", &c.q_rot}, {"k_rot", &c.k_rot}})
        if (t->storage().get() == storage) which = n;
      ADD_FAILURE() << changed << " byte(s) of the buffer of " << which
                    << " that the call must not touch changed (first at byte " << first << ")";
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << describe(c.spec);
}

/// Poisons outputs, restores pools, calls the op, checks everything.
inline void run_and_check(Case& c, const Expected& e, const ropekv::ExecOptions& opt = {}) {
  c.reset();
  const Snapshot before(c);
  ropekv::rope_pool_fused(c.tensors(), c.config(), opt);
  check_call(c, e, before);
}

/// The bytes of the outputs and pools after a call (for bit-identity across
/// runs).
inline std::vector<uint8_t> result_bytes(const Case& c) {
  std::vector<uint8_t> out;
  for (const Tensor* t : {&c.q_rot, &c.k_rot, &c.k_pool, &c.v_pool}) {
    const auto s = t->storage()->snapshot();
    out.insert(out.end(), s.begin(), s.end());
  }
  return out;
}

// ============================================================ Highway targets

/// Runs f(target) once for every Highway target compiled into this binary
/// (and the library) that this CPU supports, with dispatch forced to it;
/// checks the library reports that target; resets dispatch afterwards.
template <class F>
void for_each_target(F&& f) {
  struct Reset {
    ~Reset() { hwy::SetSupportedTargetsForTest(0); }
  } reset;
  hwy::SetSupportedTargetsForTest(0);
  const std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  ASSERT_FALSE(targets.empty());
  static bool printed = false;
  if (!printed) {
    printed = true;
    std::string names;
    for (int64_t t : targets) names += std::string(names.empty() ? "" : " ") + hwy::TargetName(t);
    std::printf("[ targets ] every check runs on: %s\n", names.c_str());
  }
  for (int64_t target : targets) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(std::string("Highway target ") + hwy::TargetName(target));
    ASSERT_EQ(ropekv::cpu_target(), std::string(hwy::TargetName(target)));
    f(target);
  }
}

inline std::string target_names() {
  hwy::SetSupportedTargetsForTest(0);
  std::string s;
  for (int64_t t : hwy::SupportedAndGeneratedTargets()) {
    if (!s.empty()) s += " ";
    s += hwy::TargetName(t);
  }
  return s;
}

}  // namespace ropekv_test
