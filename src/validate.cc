// The contract, once: every rule a call must meet, checked in the order the
// contract gives, before any backend runs. Backends trust the Problem.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
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
  if (t.ndim < 0 || t.ndim > 8 || (t.ndim > 0 && t.shape == nullptr))
    return "(a " + std::to_string(t.ndim) + "-D shape)";
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
    default: {
      // Codes of later DLPack versions than this header's (1.1: bool, then
      // the narrow floats PyTorch and JAX export), by number.
      static const char* const kLater[] = {
          "bool",          "float8_e3m4",   "float8_e4m3",    "float8_e4m3b11fnuz",
          "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
          "float8_e8m0fnu", "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn"};
      const int i = static_cast<int>(d.code) - 6;
      if (i >= 0 && i < static_cast<int>(sizeof(kLater) / sizeof(kLater[0]))) return kLater[i];
      return "dtype code " + std::to_string(d.code);
    }
  }
  return std::string(base) + std::to_string(d.bits);
}

std::string device_str(DLDevice d) {
  switch (d.device_type) {
    case kDLCPU: return d.device_id == 0 ? "cpu" : "cpu:" + std::to_string(d.device_id);
    case kDLCUDA: return "cuda:" + std::to_string(d.device_id);
    case kDLCUDAHost: return "cuda_host";
    case kDLCUDAManaged: return "cuda_managed:" + std::to_string(d.device_id);
    default: return "device type " + std::to_string(d.device_type) + ":" +
                    std::to_string(d.device_id);
  }
}

// "fp8_e4m3" / "fp8_e5m2" for a dtype typed as that fp8 format, else null.
const char* fp8_typed(DLDataType d) {
  if (d.bits != 8 || d.lanes != 1) return nullptr;
  if (d.code == kDLCodeFloat8E4M3fn) return "fp8_e4m3";
  if (d.code == kDLCodeFloat8E5M2) return "fp8_e5m2";
  return nullptr;
}

// The end of a pool dtype error for pools that are both fp8 (each its bytes
// as uint8 or typed as its format): the kv_cache_dtype their typed ones name
// (with_scales: and the scales that come with it), both formats when they
// name two (no one option fits them), any fp8 option for bytes alone; ""
// when a pool is not fp8.
std::string fp8_pools_hint(DLDataType k, DLDataType v, bool with_scales) {
  auto bytes = [](DLDataType d) { return d.code == kDLUInt && d.bits == 8 && d.lanes == 1; };
  const char *fk = fp8_typed(k), *fv = fp8_typed(v);
  if (!(fk || bytes(k)) || !(fv || bytes(v))) return "";
  const std::string scales = with_scales ? " with k_scale and v_scale" : "";
  if (fk && fv && std::string(fk) != fv)
    return "; k_pool and v_pool hold two fp8 formats (" + dtype_str(k) + ", " + dtype_str(v) +
           "), which no one kv_cache_dtype covers";
  const std::string pass =
      with_scales ? "; an fp8 pool: pass kv_cache_dtype=\"" : "; pass kv_cache_dtype=\"";
  if (!fk && !fv) return pass + "fp8_e4m3\" or \"fp8_e5m2\"" + scales;
  return pass + (fk ? fk : fv) + "\"" + scales;
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

// The bytes an array's elements span, [lo, hi); lo == hi: no elements.
// (Addresses as unsigned: a span checked_span accepted ends at most at the
// top of the address space, which a signed end could pass and wrap.)
struct Span {
  uintptr_t lo, hi;
  bool empty() const { return lo == hi; }
};

// An array's layout: the address of element 0, element size and the axes
// it extends along (extent > 1), with their element strides. (For arrays
// whose span checked_span has checked.)
struct Layout {
  intptr_t base = 0;
  int64_t esize = 1;
  int n = 0;
  int64_t extent[3] = {}, stride[3] = {};
  int axis[3] = {};  // the array's axis of each
};

int64_t element_size(const DLTensor& t) {
  return std::max<int64_t>(1, (t.dtype.bits * t.dtype.lanes + 7) / 8);
}

Layout layout_of(const DLTensor& t) {
  Layout l;
  l.base = reinterpret_cast<intptr_t>(base_pointer(t));
  l.esize = element_size(t);
  int64_t s[3];
  strides_of(t, s);
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] <= 1) continue;
    l.extent[l.n] = t.shape[i];
    l.stride[l.n] = s[i];
    l.axis[l.n++] = i;
  }
  return l;
}

// An array we will write must not have two elements at one address, else two
// tokens' writes race and the result depends on the schedule. Accepted:
// layouts whose axes, ordered by |stride|, each step past the whole span of
// the smaller ones (every strided view, permuted or not, of one buffer).
void check_no_self_overlap(const DLTensor& t, const char* name) {
  if (t.strides == nullptr || numel(t) == 0) return;  // compact row-major (DLPack's NULL)
  const Layout l = layout_of(t);
  std::pair<int64_t, int64_t> axes[3];  // (|stride|, extent), by |stride|
  for (int i = 0; i < l.n; ++i) {
    if (l.stride[i] == 0)
      fail(std::string(name) + " has stride 0 along axis " + std::to_string(l.axis[i]) +
           ": its elements overlap, so writes to it would collide; pass an array "
           "that owns its memory (e.g. a contiguous copy)");
    axes[i] = {std::abs(l.stride[i]), l.extent[i]};
    for (int j = i; j > 0 && axes[j].first < axes[j - 1].first; --j) std::swap(axes[j], axes[j - 1]);
  }
  int64_t span = 0;  // in elements
  for (int i = 0; i < l.n; ++i) {
    if (axes[i].first <= span) {
      int64_t s[3];
      strides_of(t, s);
      std::string strides = "(";
      for (int d = 0; d < t.ndim; ++d) strides += (d ? ", " : "") + std::to_string(s[d]);
      fail(std::string(name) + " has strides " + strides + ") (in elements) for shape " +
           shape_str(t) + ": its elements overlap or interleave, so writes to it may "
           "collide; pass an array whose strides do not overlap (e.g. a contiguous copy)");
    }
    span += (axes[i].second - 1) * axes[i].first;
  }
}

// 128-bit sums: two arrays' byte spans each fit in 64 bits, their sums may not.
using Wide = __int128;

Wide floor_div(Wide a, Wide b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }

// Up to three axes of each of two arrays.
constexpr int kMaxDigits = 6;

// Whether some X = sum c_k * stride_k with c_k in [lo_k, hi_k] (axes k >= i
// of n, ordered by decreasing stride, every stride > 0) lies in [x0, x1].
// Digit by digit, each axis taking the digits that leave a reachable rest:
// for views of one buffer's layout (strides that each exceed the span below
// them) a few digits per axis. `budget` bounds the search; when spent, the
// answer is yes.
bool reachable(const Wide* stride, const Wide* lo, const Wide* hi, int i, int n, Wide x0,
               Wide x1, int& budget) {
  if (--budget < 0) return true;
  if (i >= n) return x0 <= 0 && 0 <= x1;
  Wide rest_lo = 0, rest_hi = 0;  // what axes i + 1.. reach
  for (int k = i + 1; k < n; ++k) {
    rest_lo += lo[k] * stride[k];
    rest_hi += hi[k] * stride[k];
  }
  // c * s in [x0 - rest_hi, x1 - rest_lo].
  const Wide s = stride[i];
  const Wide c0 = std::max(lo[i], -floor_div(-(x0 - rest_hi), s));
  const Wide c1 = std::min(hi[i], floor_div(x1 - rest_lo, s));
  for (Wide c = c0; c <= c1; ++c)
    if (reachable(stride, lo, hi, i + 1, n, x0 - c * s, x1 - c * s, budget)) return true;
  return false;
}

enum class Sharing { kNone, kShared, kUnproven };

// Whether arrays a and b share a byte: kShared where some byte is proven
// shared, kNone where none is, kUnproven where the search's budget ran out.
// An array's set of element addresses does not change when an axis is
// reversed (its origin moved to that axis's other end) or the axes are
// reordered, so each is taken with positive strides, and an axis of a is
// paired with one of b of the same byte stride (the views of one layout: the
// q and k heads of one fused QKV buffer, the k and v pools of one cache,
// either of them reversed or permuted), the difference of their indices one
// digit; the other axes are digits of their own. A byte is shared when
// A - B lies in [-(ea - 1), eb - 1] for element addresses A of a and B of b
// (element sizes ea, eb), i.e. X = (A - A0) - (B - B0) in [B0 - A0 - (ea -
// 1), B0 - A0 + eb - 1]. (Called for arrays whose byte spans meet.)
Sharing may_share(const DLTensor& ta, const DLTensor& tb) {
  // Each array's axes as (byte stride > 0, extent), its origin the lowest
  // element's address. (An axis of stride 0 adds no address.)
  struct Axes {
    Wide origin;
    int n = 0;
    Wide stride[3], extent[3];
  } side[2];
  for (int k = 0; k < 2; ++k) {
    const Layout l = layout_of(k == 0 ? ta : tb);
    side[k].origin = l.base;
    for (int i = 0; i < l.n; ++i) {
      const Wide st = Wide{l.stride[i]} * l.esize;
      if (st == 0) continue;
      if (st < 0) side[k].origin += st * (l.extent[i] - 1);
      side[k].stride[side[k].n] = st < 0 ? -st : st;
      side[k].extent[side[k].n++] = l.extent[i];
    }
  }
  const Axes &a = side[0], &b = side[1];
  Wide stride[kMaxDigits], lo[kMaxDigits], hi[kMaxDigits];
  int n = 0;
  bool paired[3] = {false, false, false};  // b's axes taken by one of a's
  for (int i = 0; i < a.n; ++i, ++n) {
    int j = 0;
    while (j < b.n && (paired[j] || b.stride[j] != a.stride[i])) ++j;
    stride[n] = a.stride[i];
    lo[n] = j < b.n ? -(b.extent[j] - 1) : 0;
    hi[n] = a.extent[i] - 1;
    if (j < b.n) paired[j] = true;
  }
  for (int j = 0; j < b.n; ++j) {
    if (paired[j]) continue;
    stride[n] = b.stride[j];
    lo[n] = -(b.extent[j] - 1);
    hi[n++] = 0;
  }
  for (int i = 0; i < n; ++i)  // decreasing stride
    for (int j = i + 1; j < n; ++j)
      if (stride[j] > stride[i]) {
        std::swap(stride[i], stride[j]);
        std::swap(lo[i], lo[j]);
        std::swap(hi[i], hi[j]);
      }
  const Wide d = b.origin - a.origin;
  const Wide ea = element_size(ta), eb = element_size(tb);
  int budget = 4096;
  if (!reachable(stride, lo, hi, 0, n, d - (ea - 1), d + eb - 1, budget)) return Sharing::kNone;
  return budget < 0 ? Sharing::kUnproven : Sharing::kShared;
}

// The arrays a call writes share no memory with each other or with any
// array it reads, but for the in-place call's exact aliases (q_rot = q,
// k_rot = k: each element is read before it is written, by the same
// thread). Otherwise a write lands in memory another part of the call reads
// or writes, and the result depends on the schedule.
void check_no_overlap(const std::vector<std::pair<const char*, const DLTensor*>>& all,
                      const Span* spans, const RopePoolTensors& t) {
  auto exact_alias = [](const DLTensor& x, const DLTensor& y) {
    if (base_pointer(x) != base_pointer(y) || !same_dtype(x.dtype, y.dtype) || !same_shape(x, y))
      return false;
    int64_t sx[3], sy[3];
    strides_of(x, sx);
    strides_of(y, sy);
    for (int i = 0; i < x.ndim; ++i)
      if (x.shape[i] > 1 && sx[i] != sy[i]) return false;
    return true;
  };
  // all[5..8] are k_pool, v_pool, q_rot, k_rot (make_problem's order): each
  // against every other array, each pair of them once.
  for (size_t i = 5; i < 9; ++i) {
    for (size_t j = 0; j < all.size(); ++j) {
      if (j == i || (j >= 5 && j < i)) continue;
      const Span &a = spans[i], &b = spans[j];
      if (a.empty() || b.empty() || a.hi <= b.lo || b.hi <= a.lo) continue;  // (the common case)
      const DLTensor &w = *all[i].second, &x = *all[j].second;
      if (((&w == &t.q_rot && &x == &t.q) || (&w == &t.k_rot && &x == &t.k)) && exact_alias(w, x))
        continue;
      const Sharing sharing = may_share(w, x);
      if (sharing == Sharing::kNone) continue;
      fail(std::string(all[i].first) +
           (sharing == Sharing::kShared
                ? " overlaps " + std::string(all[j].first) + " in memory: "
                : " may overlap " + std::string(all[j].first) +
                      " in memory (their byte ranges meet, and ropekv could not prove within "
                      "its search's bound that they share no byte): ") +
           "an array the call writes may not share memory with another of its arrays (the "
           "one exception is the in-place call, q_rot = q and k_rot = k exactly); pass "
           "separate arrays");
    }
  }
}

// The byte span of t, checked: every extent >= 0, and the element count
// and the bytes the elements span fit in 64 bits (a product that wraps
// would hide a null pointer or send an offset anywhere).
Span checked_span(const DLTensor& t, const char* name) {
  int64_t n = 1;
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] < 0)
      fail(std::string(name) + " has a negative extent: shape " + shape_str(t));
    if (__builtin_mul_overflow(n, t.shape[i], &n))
      fail(std::string(name) + " has shape " + shape_str(t) +
           ", more elements than 64 bits count: memory ropekv cannot address");
  }
  // data + byte_offset past the top of the address space would wrap, to null
  // or anywhere (a pool row at null reads as "no slot": a lost write).
  if (t.data != nullptr &&
      UINTPTR_MAX - reinterpret_cast<uintptr_t>(t.data) < static_cast<uintptr_t>(t.byte_offset))
    fail(std::string(name) + "'s byte_offset " + std::to_string(t.byte_offset) +
         " runs past the top of the address space: memory ropekv cannot address");
  const uintptr_t base = reinterpret_cast<uintptr_t>(base_pointer(t));
  if (n == 0) return {base, base};
  const int64_t esize = element_size(t);
  int64_t s[3];
  strides_of(t, s);
  int64_t below = 0, above = esize;  // bytes before and after element 0
  for (int i = 0; i < t.ndim; ++i) {
    int64_t reach;
    if (s[i] == std::numeric_limits<int64_t>::min() ||
        __builtin_mul_overflow(t.shape[i] - 1, std::abs(s[i]), &reach) ||
        __builtin_mul_overflow(reach, esize, &reach) ||
        __builtin_add_overflow(s[i] < 0 ? below : above, reach, s[i] < 0 ? &below : &above))
      fail(std::string(name) + " has shape " + shape_str(t) +
           " and strides whose byte span does not fit in 64 bits: memory ropekv cannot "
           "address");
  }
  if (t.data != nullptr && (base < static_cast<uintptr_t>(below) ||
                            UINTPTR_MAX - base < static_cast<uintptr_t>(above)))
    fail(std::string(name) + "'s elements would wrap around the address space "
         "(its strides run past address 0 or the top): memory ropekv cannot address");
  // (A null array's span is not used: it fails its null check first.)
  return {base - static_cast<uintptr_t>(below), base + static_cast<uintptr_t>(above)};
}

// The fp32 inverse frequencies the kernels compute from rope_base and
// rope_scaling must be finite (a tiny rope_base or linear factor overflows
// them; yarn with rope_base 1 divides by log(1) = 0). The table is made
// once per spec: the last spec checked is remembered, per thread.
void check_frequencies(const FreqSpec& spec) {
  thread_local FreqSpec last;
  thread_local bool have = false;
  if (have && last == spec) return;
  std::vector<float> f(static_cast<size_t>(spec.rotary_dim / 2));
  fill_inv_freq(spec, f.data());
  for (size_t i = 0; i < f.size(); ++i)
    if (!std::isfinite(f[i]))
      fail("rope_base " + num_str(spec.rope_base) +
           (spec.scaling.type == RopeScalingType::kNone ? std::string()
                                                        : std::string(" with its rope_scaling")) +
           " gives inv_freq[" + std::to_string(i) + "] = " + num_str(f[i]) +
           ", not finite in float32: no angle can be computed from it");
  last = spec;
  have = true;
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
  // Of any type but proportional, transformers reads a partial_rotary_factor
  // as the rotary dimension, which only RopeConfig::rotary_dim sets here:
  // ignored, it would rotate the whole head of a partial-rotary model.
  if (s.type != RopeScalingType::kProportional && s.partial_rotary_factor != 1.0)
    fail("rope_scaling partial_rotary_factor is read by the proportional type only, got " +
         num_str(s.partial_rotary_factor) + ": for another type set rotary_dim to " +
         "int(head_dim * partial_rotary_factor), as transformers does");
  switch (s.type) {
    case RopeScalingType::kNone: {
      // A field set without a type would be dropped, and a dropped factor
      // changes every angle: an error, as a typeless dict is in Python.
      // (partial_rotary_factor: checked above, with its own message.)
      std::string set;
      for_each_scaling_field(s, RopeScaling{}, [&set](const char* name, const auto& v,
                                                      const auto& dflt) {
        if (!(v == dflt)) set += (set.empty() ? "" : ", ") + std::string(name);  // (NaN differs)
      });
      if (!set.empty())
        fail("rope_scaling type is kNone, so its fields " + set + " would mean nothing: set " +
             "rope_scaling.type (linear, llama3, yarn, proportional) or leave them at their " +
             "defaults");
      return;
    }
    case RopeScalingType::kLinear:
      check_positive(s.factor, "rope_scaling factor", " (linear)");
      return;
    case RopeScalingType::kLlama3:
      check_positive(s.factor, "rope_scaling factor", " (llama3)");
      check_positive(s.low_freq_factor, "rope_scaling low_freq_factor", " (llama3)");
      check_positive(s.high_freq_factor, "rope_scaling high_freq_factor", " (llama3)");
      check_positive(s.original_max_position_embeddings,
                     "rope_scaling original_max_position_embeddings", " (llama3)");
      // (Equal factors, as Llama-4 Scout ships, leave no band to smooth.)
      if (!(s.high_freq_factor >= s.low_freq_factor))
        fail("rope_scaling high_freq_factor must be >= low_freq_factor (llama3), got " +
             num_str(s.high_freq_factor) + " and " + num_str(s.low_freq_factor));
      return;
    case RopeScalingType::kYarn:
      check_positive(s.factor, "rope_scaling factor", " (yarn)");
      check_positive(s.original_max_position_embeddings,
                     "rope_scaling original_max_position_embeddings", " (yarn)");
      check_positive(s.beta_fast, "rope_scaling beta_fast", " (yarn)");
      check_positive(s.beta_slow, "rope_scaling beta_slow", " (yarn)");
      if (!std::isfinite(s.mscale) || !std::isfinite(s.mscale_all_dim))
        fail("rope_scaling mscale and mscale_all_dim must be finite");
      // The kernels multiply cos and sin by the factor in fp32: one beyond
      // float32's range would store Inf and NaN, one that rounds to 0 there
      // (or a negative one made from mscale) zeros or mirrors the rotation.
      if (const double m = attention_factor(s);
          !std::isfinite(static_cast<float>(m)) || !(static_cast<float>(m) > 0.0f))
        fail("rope_scaling attention_factor must be finite and > 0 as a float32 (the factor of "
             "cos and sin, given or from mscale and mscale_all_dim), got " + num_str(m));
      return;
    case RopeScalingType::kProportional:
      check_positive(s.factor, "rope_scaling factor", " (proportional)");
      // (0: no pair rotates, as transformers computes it: int(0 * D // 2) pairs.)
      if (!(s.partial_rotary_factor >= 0.0 && s.partial_rotary_factor <= 1.0))
        fail("rope_scaling partial_rotary_factor must be in [0, 1] (proportional: the fraction "
             "of the rotary pairs that rotate), got " + num_str(s.partial_rotary_factor));
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
  // (The QK-norm adds it in fp32: beyond float32's range it would be Inf.)
  if (!std::isfinite(static_cast<float>(cfg.norm_eps)))
    fail("norm_eps must be finite and >= 0 as a float32, got " + num_str(cfg.norm_eps));

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
  // A view whose shape cannot even be read (DLPack's own rules).
  for (const auto& [name, a] :
       {std::pair{"q", &t.q}, std::pair{"k", &t.k}, std::pair{"v", &t.v},
        std::pair{"positions", &t.positions}, std::pair{"slots", &t.slots},
        std::pair{"k_pool", &t.k_pool}, std::pair{"v_pool", &t.v_pool},
        std::pair{"q_rot", &t.q_rot}, std::pair{"k_rot", &t.k_rot},
        std::pair{"cos_sin_cache", &t.cos_sin_cache},
        std::pair{"q_norm_weight", &t.q_norm_weight},
        std::pair{"k_norm_weight", &t.k_norm_weight}}) {
    if (a->ndim < 0 || (a->ndim > 0 && a->shape == nullptr))
      fail(std::string(name) + " is not a valid tensor view: ndim " + std::to_string(a->ndim) +
           (a->ndim > 0 ? " with no shape array" : ""));
  }
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
    // (No hint for a q that ropekv does not take: that is refused below.)
    FloatType q_type;
    std::string hint;
    if (float_dtype(t.q.dtype, &q_type)) {
      if (pd.code == kDLFloat && pd.bits == 32 && pd.lanes == 1)
        hint = "; a float32 pool for " + dtype_str(t.q.dtype) +
               " inputs: pass kv_cache_dtype=\"float32\" (or convert it once with "
               "k_pool.to(q.dtype))";
      else
        hint = fp8_pools_hint(t.k_pool.dtype, t.v_pool.dtype, /*with_scales=*/true);
    }
    fail("pool dtypes must match q/k/v dtype, got k_pool " + dtype_str(t.k_pool.dtype) +
         ", v_pool " + dtype_str(t.v_pool.dtype) + " for q/k/v " + dtype_str(t.q.dtype) +
         hint);
  }
  switch (cfg.kv_cache_dtype) {  // (a C++ caller can pass any value; before the pools' rule)
    case KvCacheDtype::kAuto: case KvCacheDtype::kFloat32: case KvCacheDtype::kFp8E4M3:
    case KvCacheDtype::kFp8E5M2: break;
    default:
      fail("kv_cache_dtype is unknown (value " +
           std::to_string(static_cast<int>(cfg.kv_cache_dtype)) + ")");
  }
  if (cfg.kv_cache_dtype == KvCacheDtype::kFloat32) {
    const DLDataType want{kDLFloat, 32, 1};
    if (!same_dtype(t.k_pool.dtype, want) || !same_dtype(t.v_pool.dtype, want))
      fail("pool dtypes must be float32 for kv_cache_dtype=\"float32\", got k_pool " +
           dtype_str(t.k_pool.dtype) + ", v_pool " + dtype_str(t.v_pool.dtype));
  } else if (cfg.kv_cache_dtype != KvCacheDtype::kAuto) {
    // fp8: the format's bytes as uint8, or typed as the format (DLPack 1.1).
    const char* name = kv_cache_dtype_name(cfg.kv_cache_dtype);
    const DLDataType typed{cfg.kv_cache_dtype == KvCacheDtype::kFp8E4M3 ? kDLCodeFloat8E4M3fn
                                                                         : kDLCodeFloat8E5M2,
                           8, 1};
    auto ok = [&](DLDataType d) {
      return same_dtype(d, DLDataType{kDLUInt, 8, 1}) || same_dtype(d, typed);
    };
    if (!ok(t.k_pool.dtype) || !ok(t.v_pool.dtype))
      fail(std::string("pool dtypes must be uint8 (fp8 bits) or ") + dtype_str(typed) +
           " for kv_cache_dtype=\"" + name + "\", got k_pool " + dtype_str(t.k_pool.dtype) +
           ", v_pool " + dtype_str(t.v_pool.dtype) +
           fp8_pools_hint(t.k_pool.dtype, t.v_pool.dtype, /*with_scales=*/false));
  }

  // --- The outputs (allocated by the caller or by the Python layer). ---
  if (!same_shape(t.q_rot, t.q))
    fail("q_rot shape must match q shape, got " + shape_str(t.q_rot) + " vs " +
         shape_str(t.q));
  if (!same_shape(t.k_rot, t.k))
    fail("k_rot shape must match k shape, got " + shape_str(t.k_rot) + " vs " +
         shape_str(t.k));
  // (Names only the outputs whose dtype is wrong: the other may be one the
  // Python layer made, of the right dtype.)
  const bool q_bad = !same_dtype(t.q_rot.dtype, t.q.dtype);
  const bool k_bad = !same_dtype(t.k_rot.dtype, t.q.dtype);
  if (q_bad || k_bad) {
    const std::string q_got = "q_rot " + dtype_str(t.q_rot.dtype);
    const std::string k_got = "k_rot " + dtype_str(t.k_rot.dtype);
    fail(std::string(q_bad && k_bad ? "q_rot/k_rot" : q_bad ? "q_rot" : "k_rot") +
         " dtype must match q/k/v dtype, got " +
         (q_bad && k_bad ? q_got + ", " + k_got : q_bad ? q_got : k_got) + " for " +
         dtype_str(t.q.dtype));
  }

  // --- What the original leaves to luck. ---
  Problem p;
  check_index_dtype(t.positions, "positions", &p.pos_type);
  check_index_dtype(t.slots, "slots", &p.slot_type);
  if (!float_dtype(t.q.dtype, &p.dtype))
    fail("q/k/v dtype must be float16, bfloat16 or float32, got " + dtype_str(t.q.dtype));
  if (D < 2 || D % 2 != 0)
    fail("head_dim must be even and >= 2, got " + std::to_string(D));
  const int64_t R = cfg.rotary_dim == 0 ? D : cfg.rotary_dim;
  if (R < 2 || R % 2 != 0 || R > D) {
    // The Python call takes rotary_dim from a table's width when not given.
    const DLTensor& c = t.cos_sin_cache;
    const bool table = present(c) && c.ndim == 2 && c.shape[1] == R;
    fail("rotary_dim must be even and in [2, head_dim], got " + std::to_string(R) +
         " for head_dim " + std::to_string(D) +
         (table ? " (the width of cos_sin_cache, shape " + shape_str(c) + ")" : ""));
  }
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
  Span spans[12];  // of each array in `all`
  for (size_t i = 0; i < all.size(); ++i) spans[i] = checked_span(*all[i].second, all[i].first);
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
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i].second->data == nullptr && !spans[i].empty())
      fail(std::string(all[i].first) + " has no data pointer (a null array with " +
           std::to_string(numel(*all[i].second)) + " elements)");
  }
  // Elements at addresses that are not multiples of their size: the kernels
  // read and write them as typed values (undefined behaviour on the CPU, a
  // misaligned-address fault that ends the CUDA context on a GPU). Strides
  // count whole elements, so the first element's address decides.
  for (size_t i = 0; i < all.size(); ++i) {
    const DLTensor& a = *all[i].second;
    const int64_t esize = element_size(a);
    const uintptr_t at = reinterpret_cast<uintptr_t>(base_pointer(a));
    if (!spans[i].empty() && at % static_cast<uintptr_t>(esize) != 0)
      fail(std::string(all[i].first) + " starts at an address that is not a multiple of its " +
           std::to_string(esize) + "-byte elements (data + byte_offset = " +
           std::to_string(at % static_cast<uintptr_t>(esize)) + " mod " + std::to_string(esize) +
           "): memory ropekv cannot address as " + dtype_str(a.dtype) +
           " (copy it to an aligned array)");
  }
  for (size_t i = 5; i < 9; ++i) check_no_self_overlap(*all[i].second, all[i].first);
  check_no_overlap(all, spans, t);
  if (dev.device_type == kDLCUDA) cuda::check_addressable(t);

  p.num_tokens = T;
  p.num_qo_heads = Hq;
  p.num_kv_heads = Hk;
  p.head_dim = D;
  p.rotary_dim = R;
  p.pool_size = t.k_pool.shape[0];
  p.rope_base = cfg.rope_base;
  p.freq = FreqSpec{cfg.rope_base, R, cfg.rope_scaling};
  if (!present(t.cos_sin_cache)) check_frequencies(p.freq);  // (a table replaces them)
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
  check_frequencies(FreqSpec{cfg.rope_base, R, cfg.rope_scaling});
  return R;
}

void check_exec_options(const ExecOptions& options) {
  if (options.num_threads < 0)
    fail("num_threads must be >= 0 (0: OpenMP's default), got " +
         std::to_string(options.num_threads));
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
