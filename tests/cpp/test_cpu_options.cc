// The CPU backend's options against a float64 oracle written here, on every
// Highway target compiled into the library that this CPU supports:
// interleaved pairs (is_neox = false), yarn's attention factor, a
// cos_sin_cache (f32 and q's dtype), QK-norm, float32 and fp8 pools (E4M3,
// E5M2, with scales), in place (q_rot = q, k_rot = k), alone and combined,
// for f32 / f16 / bf16, strided layouts and 1 / 2 threads.
//
// The oracle shares no code with the kernels: cos/sin in double of the fp32
// angle fp32(fp32(pos) * inv_freq[i]) (inv_freq from ropekv::rope_inv_freq,
// the fp32 table the op is defined with), the norm and the rotation in
// double, fp8 by the nearest value of a table of every code (ties to the
// even code, saturation, every NaN -> 0x7F).
//
// Every call: outputs poisoned with NaN bit patterns beforehand (except in
// place), every element within one rounding of the output dtype plus the
// fp32 arithmetic bound (with QK-norm (D/2 + 8) 2^-24 relative on top), the
// named pool rows equal to encode(k_rot) / encode(v) bit for bit, every
// other byte of every buffer untouched.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "common/fp8.h"
#include "test_util.h"

namespace ropekv_test {
namespace {

const DType kFloatTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

// ============================================================ fp8 oracle

enum class PoolKind { kAuto, kF32, kE4M3, kE5M2 };

const char* pool_name(PoolKind k) {
  switch (k) {
    case PoolKind::kAuto:
      return "auto";
    case PoolKind::kF32:
      return "float32";
    case PoolKind::kE4M3:
      return "fp8_e4m3";
    case PoolKind::kE5M2:
      return "fp8_e5m2";
  }
  return "?";
}

bool is_fp8(PoolKind k) { return k == PoolKind::kE4M3 || k == PoolKind::kE5M2; }

// The value of non-negative code c, from the formats' definitions: E4M3
// ("fn") bias 7, exponent 15 normal, 0x7F NaN; E5M2 bias 15, exponent 31
// Inf/NaN.
double fp8_code_value(uint32_t c, bool e4m3) {
  const int man_bits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
  const uint32_t e = c >> man_bits, m = c & ((1u << man_bits) - 1);
  if (e == 0) return std::ldexp(static_cast<double>(m), 1 - bias - man_bits);
  return std::ldexp(static_cast<double>(m + (1u << man_bits)),
                    static_cast<int>(e) - bias - man_bits);
}

// Every finite non-negative value, ascending: index = code.
const std::vector<double>& fp8_values(bool e4m3) {
  static const std::vector<double> tables[2] = {[] {
                                                  std::vector<double> v;
                                                  for (uint32_t c = 0; c <= 0x7B; ++c)
                                                    v.push_back(fp8_code_value(c, false));
                                                  return v;
                                                }(),
                                                [] {
                                                  std::vector<double> v;
                                                  for (uint32_t c = 0; c <= 0x7E; ++c)
                                                    v.push_back(fp8_code_value(c, true));
                                                  return v;
                                                }()};
  return tables[e4m3 ? 1 : 0];
}

// The fp8 code of x: the nearest finite value (ties to the even code), the
// largest one above it (Inf included), the sign of x kept; every NaN -> 0x7F.
uint8_t fp8_ref(float x, bool e4m3) {
  const uint32_t sign = std::signbit(x) ? 0x80u : 0u;
  if (std::isnan(x)) return 0x7Fu;
  const double a = std::fabs(static_cast<double>(x));
  const std::vector<double>& v = fp8_values(e4m3);
  if (a >= v.back()) return static_cast<uint8_t>(sign | (v.size() - 1));
  const size_t hi = static_cast<size_t>(std::lower_bound(v.begin(), v.end(), a) - v.begin());
  if (v[hi] == a || hi == 0) return static_cast<uint8_t>(sign | hi);
  const size_t lo = hi - 1;
  const double dl = a - v[lo], dh = v[hi] - a;
  const size_t c = dl < dh ? lo : dh < dl ? hi : (lo % 2 == 0 ? lo : hi);
  return static_cast<uint8_t>(sign | c);
}

TEST(CpuOptions, Fp8OracleSelfCheck) {
  // The table's extremes and a few hand-checked encodings.
  EXPECT_EQ(fp8_code_value(0x7E, true), 448.0);
  EXPECT_EQ(fp8_code_value(0x7B, false), 57344.0);
  EXPECT_EQ(fp8_code_value(0x01, true), std::ldexp(1.0, -9));
  EXPECT_EQ(fp8_code_value(0x01, false), std::ldexp(1.0, -16));
  EXPECT_EQ(fp8_ref(1.0f, true), 0x38);
  EXPECT_EQ(fp8_ref(-2.0f, false), 0xC0);
  EXPECT_EQ(fp8_ref(1.0625f, true), 0x38);  // tie 1 / 1.125: even code
  EXPECT_EQ(fp8_ref(1.1875f, true), 0x3A);  // tie 1.125 / 1.25: even code
  EXPECT_EQ(fp8_ref(464.0f, true), 0x7E);   // beyond the largest: saturate
  EXPECT_EQ(fp8_ref(-INFINITY, true), 0xFE);
  EXPECT_EQ(fp8_ref(INFINITY, false), 0x7B);
  EXPECT_EQ(fp8_ref(-NAN, true), 0x7F);
  EXPECT_EQ(fp8_ref(-0.0f, false), 0x80);
  EXPECT_EQ(fp8_ref(std::ldexp(1.0f, -11), true), 0x00);  // a quarter quantum
  EXPECT_EQ(fp8_ref(std::ldexp(3.0f, -11), true), 0x01);  // three quarters
}

// ============================================================ pools

// A [P, Hk, D] pool: a float Tensor (auto, float32) or uint8 fp8 bytes.
struct Pool {
  PoolKind kind = PoolKind::kAuto;
  Tensor t;  // float pools
  // fp8 pools: element offsets are byte offsets.
  StoragePtr st;
  std::vector<int64_t> shape, strides;
  int64_t offset = 0;
  bool typed = false;  // fp8: typed as its format (DLPack 1.1), else uint8 bytes

  Storage* storage() const { return is_fp8(kind) ? st.get() : t.storage().get(); }
  int64_t off(int64_t s, int64_t h, int64_t d) const {
    if (!is_fp8(kind)) return t.off(s, h, d);
    return offset + s * strides[0] + h * strides[1] + d * strides[2];
  }
  int64_t elem_size() const { return is_fp8(kind) ? 1 : dtype_size(t.dtype()); }
  uint64_t raw(int64_t s, int64_t h, int64_t d) const {
    if (!is_fp8(kind)) return t.raw(t.off(s, h, d));
    return st->base[off(s, h, d)];
  }
  DLTensor dl() const {
    if (!is_fp8(kind)) return t.dl();
    DLTensor d{};
    d.data = st->base;
    d.device = {kDLCPU, 0};
    d.ndim = 3;
    d.dtype = !typed                    ? DLDataType{kDLUInt, 8, 1}
              : kind == PoolKind::kE4M3 ? DLDataType{ropekv::kDLCodeFloat8E4M3fn, 8, 1}
                                        : DLDataType{ropekv::kDLCodeFloat8E5M2, 8, 1};
    d.shape = const_cast<int64_t*>(shape.data());
    d.strides = const_cast<int64_t*>(strides.data());
    d.byte_offset = static_cast<uint64_t>(offset);
    return d;
  }
};

// A compact [rows, heads, D] array of dt whose first element is 64-byte
// aligned (the non-temporal store path needs aligned rows).
Tensor aligned_compact(DType dt, int64_t rows, int64_t heads, int64_t D) {
  const int64_t es = dtype_size(dt);
  auto st = std::make_shared<Storage>(static_cast<size_t>((rows * heads * D) * es + 64));
  const int64_t off = ((64 - reinterpret_cast<uintptr_t>(st->base) % 64) % 64) / es;
  return Tensor::view(st, dt, {rows, heads, D}, {heads * D, D, 1}, off);
}

Pool make_pool(PoolKind kind, DType dt, int64_t P, int64_t Hk, int64_t D, const Layout& L,
               bool align64 = false) {
  Pool p;
  p.kind = kind;
  if (align64) {
    if (!is_fp8(kind)) {
      p.t = aligned_compact(kind == PoolKind::kF32 ? DType::kF32 : dt, P, Hk, D);
      return p;
    }
    p.st = std::make_shared<Storage>(static_cast<size_t>(P * Hk * D + 64));
    p.shape = {P, Hk, D};
    p.strides = {Hk * D, D, 1};
    p.offset = static_cast<int64_t>((64 - reinterpret_cast<uintptr_t>(p.st->base) % 64) % 64);
    return p;
  }
  if (!is_fp8(kind)) {
    p.t = packed_views(kind == PoolKind::kF32 ? DType::kF32 : dt, P, {Hk}, D, L.pool_last_stride,
                       L.pool_head_pad, L.pool_row_pad, L.lead, L.byte_offset)[0];
    return p;
  }
  const int64_t head_stride = D * L.pool_last_stride + L.pool_head_pad;
  const int64_t row_stride = Hk * head_stride + L.pool_row_pad;
  p.st = std::make_shared<Storage>(static_cast<size_t>(L.lead + P * row_stride + 8));
  p.shape = {P, Hk, D};
  p.strides = {row_stride, head_stride, L.pool_last_stride};
  p.offset = L.lead;
  return p;
}

// ============================================================ one call

enum class CacheKind { kNone, kF32, kQ };

struct OptSpec {
  int64_t T = 1, Hq = 2, Hk = 1, D = 64, R = 0, P = 4;  // R 0 = D
  double base = 10000.0;
  DType dtype = DType::kF32;
  DType pos_type = DType::kI32, slot_type = DType::kI32;
  bool is_neox = true;
  ropekv::RopeScaling scaling;
  CacheKind cache = CacheKind::kNone;
  int64_t cache_rows = 64, cache_col_stride = 1;
  bool q_norm = false, k_norm = false;
  bool norm_f32 = true;  // weights float32, else q's dtype
  int64_t norm_stride = 1;
  double eps = 1e-6;
  PoolKind pool = PoolKind::kAuto;
  double k_scale = 1.0, v_scale = 1.0;
  bool inplace = false;
  bool align64 = false;  // compact arrays whose element [0, 0, 0] is 64-byte aligned
  Layout layout;

  int64_t rotary() const { return R == 0 ? D : R; }
};

std::string describe(const OptSpec& s) {
  std::ostringstream o;
  o << "T=" << s.T << " Hq=" << s.Hq << " Hk=" << s.Hk << " D=" << s.D << " R=" << s.rotary() << " "
    << dtype_name(s.dtype) << (s.is_neox ? " neox" : " interleaved");
  if (s.scaling.type == ropekv::RopeScalingType::kYarn)
    o << " yarn(factor " << s.scaling.factor << ")";
  if (s.scaling.type == ropekv::RopeScalingType::kProportional)
    o << " proportional(" << s.scaling.partial_rotary_factor << ", factor " << s.scaling.factor
      << ")";
  if (s.cache != CacheKind::kNone)
    o << " cache(" << (s.cache == CacheKind::kF32 ? "f32" : "q dtype") << ", rows " << s.cache_rows
      << ", col stride " << s.cache_col_stride << ")";
  if (s.q_norm || s.k_norm)
    o << " norm(" << (s.q_norm ? "q" : "") << (s.k_norm ? "k" : "") << ", "
      << (s.norm_f32 ? "f32" : "q dtype") << ", stride " << s.norm_stride << ")";
  o << " pool " << pool_name(s.pool);
  if (is_fp8(s.pool)) o << " (k_scale " << s.k_scale << ", v_scale " << s.v_scale << ")";
  if (s.inplace) o << " in place";
  const Layout& L = s.layout;
  o << " strides in/out/pool " << L.in_last_stride << "/" << L.out_last_stride << "/"
    << L.pool_last_stride << (L.fused_qkv ? " fused qkv" : "");
  return o.str();
}

struct OptCase {
  OptSpec s;
  Tensor q, k, v, positions, slots, q_rot, k_rot, cache, q_w, k_w;
  Pool k_pool, v_pool;
  std::map<Storage*, std::vector<uint8_t>> init;  // inputs (in place) and pools before any call

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
    if (s.cache != CacheKind::kNone) t.cos_sin_cache = cache.dl();
    if (s.q_norm) t.q_norm_weight = q_w.dl();
    if (s.k_norm) t.k_norm_weight = k_w.dl();
    return t;
  }
  ropekv::RopeConfig config() const {
    ropekv::RopeConfig c;
    c.head_dim = s.D;
    c.num_qo_heads = s.Hq;
    c.num_kv_heads = s.Hk;
    c.rope_base = s.base;
    c.rotary_dim = s.R;
    c.is_neox = s.is_neox;
    c.rope_scaling = s.scaling;
    c.kv_cache_dtype = s.pool == PoolKind::kAuto   ? ropekv::KvCacheDtype::kAuto
                       : s.pool == PoolKind::kF32  ? ropekv::KvCacheDtype::kFloat32
                       : s.pool == PoolKind::kE4M3 ? ropekv::KvCacheDtype::kFp8E4M3
                                                   : ropekv::KvCacheDtype::kFp8E5M2;
    c.k_scale = s.k_scale;
    c.v_scale = s.v_scale;
    c.norm_eps = s.eps;
    return c;
  }
  std::vector<Storage*> storages() const {
    std::vector<Storage*> out;
    auto add = [&](Storage* st) {
      if (st && std::find(out.begin(), out.end(), st) == out.end()) out.push_back(st);
    };
    for (const Tensor* t : {&q, &k, &v, &positions, &slots, &q_rot, &k_rot})
      add(t->storage().get());
    if (s.cache != CacheKind::kNone) add(cache.storage().get());
    if (s.q_norm) add(q_w.storage().get());
    if (s.k_norm) add(k_w.storage().get());
    add(k_pool.storage());
    add(v_pool.storage());
    return out;
  }
  /// Inputs and pools back to their first contents, outputs poisoned.
  void reset() {
    for (auto& [st, bytes] : init) st->restore(bytes);
    if (!s.inplace) {
      poison_storage(q_rot);
      poison_storage(k_rot);
    }
  }
};

// A [n] float vector of dtype dt, `stride` elements apart, random values.
Tensor random_vector(DType dt, int64_t n, int64_t stride, std::mt19937_64& rng) {
  auto st = std::make_shared<Storage>(static_cast<size_t>((n * stride + 4) * dtype_size(dt)));
  random_bytes(*st, rng);
  Tensor t = Tensor::view(st, dt, {n}, {stride}, 1);
  fill_random(t, rng);
  return t;
}

OptCase make_opt_case(const OptSpec& s, std::mt19937_64& rng) {
  OptCase c;
  c.s = s;
  const Layout& L = s.layout;
  const int64_t R = s.rotary();
  if (s.align64) {
    c.q = aligned_compact(s.dtype, s.T, s.Hq, s.D);
    c.k = aligned_compact(s.dtype, s.T, s.Hk, s.D);
    c.v = aligned_compact(s.dtype, s.T, s.Hk, s.D);
  } else if (L.fused_qkv) {
    auto qkv = packed_views(s.dtype, s.T, {s.Hq, s.Hk, s.Hk}, s.D, L.in_last_stride, L.in_head_pad,
                            L.in_row_pad, L.lead, L.byte_offset);
    c.q = qkv[0];
    c.k = qkv[1];
    c.v = qkv[2];
  } else {
    for (auto [t, h] : {std::pair<Tensor*, int64_t>{&c.q, s.Hq}, {&c.k, s.Hk}, {&c.v, s.Hk}})
      *t = packed_views(s.dtype, s.T, {h}, s.D, L.in_last_stride, L.in_head_pad, L.in_row_pad,
                        L.lead, L.byte_offset)[0];
  }
  for (Tensor* t : {&c.q, &c.k, &c.v}) random_bytes(*t->storage(), rng);
  for (Tensor* t : {&c.q, &c.k, &c.v}) fill_random(*t, rng);
  if (s.inplace) {
    c.q_rot = c.q;
    c.k_rot = c.k;
  } else if (s.align64) {
    c.q_rot = aligned_compact(s.dtype, s.T, s.Hq, s.D);
    c.k_rot = aligned_compact(s.dtype, s.T, s.Hk, s.D);
  } else if (L.fused_out) {
    auto out = packed_views(s.dtype, s.T, {s.Hq, s.Hk}, s.D, L.out_last_stride, L.out_head_pad, 0,
                            L.lead, L.byte_offset);
    c.q_rot = out[0];
    c.k_rot = out[1];
  } else {
    c.q_rot = packed_views(s.dtype, s.T, {s.Hq}, s.D, L.out_last_stride, L.out_head_pad, 0, L.lead,
                           L.byte_offset)[0];
    c.k_rot = packed_views(s.dtype, s.T, {s.Hk}, s.D, L.out_last_stride, L.out_head_pad, 0, L.lead,
                           L.byte_offset)[0];
  }
  c.k_pool = make_pool(s.pool, s.dtype, s.P, s.Hk, s.D, L, s.align64);
  c.v_pool = make_pool(s.pool, s.dtype, s.P, s.Hk, s.D, L, s.align64);
  // fp8 pools: each as its bytes or typed as its format (the same call).
  c.k_pool.typed = rng() % 2 == 0;
  c.v_pool.typed = rng() % 2 == 0;
  random_bytes(*c.k_pool.storage(), rng);
  random_bytes(*c.v_pool.storage(), rng);

  if (s.cache != CacheKind::kNone) {
    const DType cdt = s.cache == CacheKind::kF32 ? DType::kF32 : s.dtype;
    const int64_t row = R * s.cache_col_stride + 3;
    auto st =
        std::make_shared<Storage>(static_cast<size_t>((s.cache_rows * row + 2) * dtype_size(cdt)));
    random_bytes(*st, rng);
    c.cache = Tensor::view(st, cdt, {s.cache_rows, R}, {row, s.cache_col_stride}, 2, L.byte_offset);
    fill_random(c.cache, rng);
  }
  const DType wdt = s.norm_f32 ? DType::kF32 : s.dtype;
  if (s.q_norm) c.q_w = random_vector(wdt, s.D, s.norm_stride, rng);
  if (s.k_norm) c.k_w = random_vector(wdt, s.D, s.norm_stride, rng);

  c.positions = Tensor::compact(s.pos_type, {s.T}, /*null_strides=*/false);
  c.slots = Tensor::compact(s.slot_type, {s.T}, /*null_strides=*/false);
  for (int64_t t = 0; t < s.T; ++t) {
    const int64_t pos = s.cache != CacheKind::kNone
                            ? static_cast<int64_t>(rng() % static_cast<uint64_t>(s.cache_rows))
                            : random_position(rng);
    c.positions.set_index(t, pos);
  }
  if (s.cache != CacheKind::kNone && s.T > 1) c.positions.set_index(0, s.cache_rows - 1);
  std::vector<int64_t> rows(s.P);
  for (int64_t i = 0; i < s.P; ++i) rows[i] = i;
  std::shuffle(rows.begin(), rows.end(), rng);
  for (int64_t t = 0; t < s.T; ++t) {
    const bool skip = t >= s.P || rng() % 5 == 0;
    c.slots.set_index(t, skip ? -1 - static_cast<int64_t>(rng() % 3) : rows[t]);
  }
  // Saved: the pools, and the inputs the call overwrites in place.
  for (Storage* st : {c.k_pool.storage(), c.v_pool.storage()}) c.init[st] = st->snapshot();
  if (s.inplace)
    for (const Tensor* t : {&c.q, &c.k}) c.init[t->storage().get()] = t->storage()->snapshot();
  c.reset();
  return c;
}

// ============================================================ the expectation

struct OptExpected {
  std::vector<double> q, k, q_tol, k_tol;  // [T, H, D]
};

double rounding(DType dt, double ref) {
  const double ulp = ulp_of(ref, format_of(dt));
  return dt == DType::kF32 ? ulp : 0.5 * ulp;
}

void expect_heads_opt(const OptCase& c, const Tensor& x, const Tensor* w,
                      const std::vector<double>& cs, std::vector<double>* ref,
                      std::vector<double>* tol) {
  const OptSpec& s = c.s;
  const int64_t T = s.T, H = x.shape()[1], D = s.D, R = s.rotary(), half = R / 2;
  const double m = static_cast<float>(ropekv::rope_attention_factor(s.scaling));
  const double u = std::ldexp(1.0, -24);
  // fp32 arithmetic: c/s within ~2 ulp, two products and a sum rounded; the
  // attention factor one more rounding on c and s; QK-norm's r and two
  // products.
  const double norm_rel = w ? (static_cast<double>(D) / 2 + 8) * u : 0.0;
  const double rot_rel = (m != 1.0 ? 6.0 : 4.0) * u + norm_rel;
  const double eps = static_cast<float>(s.eps);
  ref->assign(T * H * D, 0.0);
  tol->assign(T * H * D, 0.0);
  std::vector<double> xn(D);
  for (int64_t t = 0; t < T; ++t) {
    const double* cv = cs.data() + t * R;  // c[i], then s[i] at half + i
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t d = 0; d < D; ++d) xn[d] = x.value(x.off(t, h, d));
      if (w) {
        double ss = 0.0;
        for (int64_t d = 0; d < D; ++d) ss += xn[d] * xn[d];
        const double r = 1.0 / std::sqrt(ss / static_cast<double>(D) + eps);
        for (int64_t d = 0; d < D; ++d) xn[d] = xn[d] * r * w->value(w->off(d));
      }
      double* o = ref->data() + (t * H + h) * D;
      double* e = tol->data() + (t * H + h) * D;
      for (int64_t i = 0; i < half; ++i) {
        const int64_t a = s.is_neox ? i : 2 * i, b = s.is_neox ? i + half : 2 * i + 1;
        const double co = cv[i], si = cv[half + i];
        o[a] = xn[a] * co - xn[b] * si;
        o[b] = xn[b] * co + xn[a] * si;
        e[a] = rounding(s.dtype, o[a]) + rot_rel * (std::fabs(xn[a] * co) + std::fabs(xn[b] * si));
        e[b] = rounding(s.dtype, o[b]) + rot_rel * (std::fabs(xn[b] * co) + std::fabs(xn[a] * si));
      }
      for (int64_t d = R; d < D; ++d) {
        o[d] = xn[d];
        e[d] = rounding(s.dtype, xn[d]) + norm_rel * std::fabs(xn[d]);
      }
    }
  }
}

OptExpected expect_opt(const OptCase& c) {
  const OptSpec& s = c.s;
  const int64_t R = s.rotary(), half = R / 2;
  // Per token: c[i] at t * R + i, s[i] at t * R + half + i.
  std::vector<double> cs(s.T * R);
  const std::vector<float> inv_freq =
      s.cache == CacheKind::kNone ? ropekv::rope_inv_freq(c.config()) : std::vector<float>();
  const double m = static_cast<float>(ropekv::rope_attention_factor(s.scaling));
  for (int64_t t = 0; t < s.T; ++t) {
    const int64_t pos = c.positions.index(t);
    for (int64_t i = 0; i < half; ++i) {
      if (s.cache != CacheKind::kNone) {
        cs[t * R + i] = c.cache.value(c.cache.off(pos) + i * c.cache.strides()[1]);
        cs[t * R + half + i] = c.cache.value(c.cache.off(pos) + (half + i) * c.cache.strides()[1]);
      } else {
        const float theta = static_cast<float>(pos) * inv_freq[i];
        cs[t * R + i] = std::cos(static_cast<double>(theta)) * m;
        cs[t * R + half + i] = std::sin(static_cast<double>(theta)) * m;
      }
    }
  }
  OptExpected e;
  expect_heads_opt(c, c.q, s.q_norm ? &c.q_w : nullptr, cs, &e.q, &e.q_tol);
  expect_heads_opt(c, c.k, s.k_norm ? &c.k_w : nullptr, cs, &e.k, &e.k_tol);
  return e;
}

// The pool element for the value x (exactly representable in q's dtype,
// `bits` its bits there).
uint64_t pool_ref(const OptSpec& s, uint64_t bits, double x, double scale) {
  switch (s.pool) {
    case PoolKind::kAuto:
      return bits;
    case PoolKind::kF32:
      return f32_bits(static_cast<float>(x));
    case PoolKind::kE4M3:
    case PoolKind::kE5M2:
      return fp8_ref(static_cast<float>(x) / static_cast<float>(scale), s.pool == PoolKind::kE4M3);
  }
  return 0;
}

// ============================================================ the checks

void check_opt(const OptCase& c, const OptExpected& e,
               const std::map<const Storage*, std::vector<uint8_t>>& before) {
  const OptSpec& s = c.s;
  int64_t bad = check_rotated(c.q_rot, e.q, e.q_tol, "q_rot", 8);
  bad += check_rotated(c.k_rot, e.k, e.k_tol, "k_rot", 8);

  WriteMask may_change;
  auto& mq = may_change.of(c.q_rot.storage().get());
  auto& mk = may_change.of(c.k_rot.storage().get());
  auto& mkp = may_change.of(c.k_pool.storage());
  auto& mvp = may_change.of(c.v_pool.storage());
  const int64_t es = dtype_size(s.dtype), pe = c.k_pool.elem_size();
  for (int64_t t = 0; t < s.T; ++t) {
    for (int64_t h = 0; h < s.Hq; ++h)
      for (int64_t d = 0; d < s.D; ++d) WriteMask::set(mq, c.q_rot.off(t, h, d) * es, es);
    for (int64_t h = 0; h < s.Hk; ++h)
      for (int64_t d = 0; d < s.D; ++d) WriteMask::set(mk, c.k_rot.off(t, h, d) * es, es);
    const int64_t slot = c.slots.index(t);
    if (slot < 0) continue;
    for (int64_t h = 0; h < s.Hk; ++h)
      for (int64_t d = 0; d < s.D; ++d) {
        const int64_t kr = c.k_rot.off(t, h, d);
        // v as it was before the call (in place: v is never written).
        const int64_t vo = c.v.off(t, h, d);
        const uint64_t want_k = pool_ref(s, c.k_rot.raw(kr), c.k_rot.value(kr), s.k_scale);
        const uint64_t want_v = pool_ref(s, c.v.raw(vo), c.v.value(vo), s.v_scale);
        const uint64_t got_k = c.k_pool.raw(slot, h, d), got_v = c.v_pool.raw(slot, h, d);
        if (got_k != want_k || got_v != want_v) {
          if (bad < 16)
            ADD_FAILURE() << "token " << t << " slot " << slot << " head " << h << " dim " << d
                          << ": k_pool 0x" << std::hex << got_k << " want 0x" << want_k
                          << " (k_rot 0x" << c.k_rot.raw(kr) << "), v_pool 0x" << got_v
                          << " want 0x" << want_v << " (v 0x" << c.v.raw(vo) << ")" << std::dec;
          ++bad;
        }
        WriteMask::set(mkp, c.k_pool.off(slot, h, d) * pe, pe);
        WriteMask::set(mvp, c.v_pool.off(slot, h, d) * pe, pe);
      }
  }
  for (const auto& [storage, snap] : before) {
    int64_t first = -1;
    const int64_t changed = may_change.changed_outside(storage, snap, &first);
    if (changed) {
      ADD_FAILURE() << changed << " byte(s) the call must not touch changed (first at byte "
                    << first << " of a buffer of " << storage->size << ")";
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << describe(s);
}

// Inputs restored, outputs poisoned, one call, every check.
void run_and_check_opt(OptCase& c, const OptExpected& e, int threads = 1) {
  c.reset();
  const Snapshot before(c);
  ropekv::ExecOptions opt;
  opt.num_threads = threads;
  ropekv::rope_pool_fused(c.tensors(), c.config(), opt);
  check_opt(c, e, before.bytes);
}

// Every output byte of the last call.
std::vector<uint8_t> opt_result_bytes(const OptCase& c) {
  std::vector<uint8_t> out;
  for (Storage* st :
       {c.q_rot.storage().get(), c.k_rot.storage().get(), c.k_pool.storage(), c.v_pool.storage()}) {
    const auto b = st->snapshot();
    out.insert(out.end(), b.begin(), b.end());
  }
  return out;
}

void check_opt_on_all_targets(OptCase& c, const OptExpected& e, int threads = 1) {
  for_each_target([&](int64_t) { run_and_check_opt(c, e, threads); });
}

// ============================================================ option sets

ropekv::RopeScaling yarn(double factor, double original, double mscale = 0.0,
                         double mscale_all_dim = 0.0) {
  ropekv::RopeScaling y;
  y.type = ropekv::RopeScalingType::kYarn;
  y.factor = factor;
  y.original_max_position_embeddings = original;
  y.mscale = mscale;
  y.mscale_all_dim = mscale_all_dim;
  return y;
}

// Gemma-4's full layers: a fraction of the pairs rotate, the rest at angle 0.
ropekv::RopeScaling proportional(double fraction, double factor = 1.0) {
  ropekv::RopeScaling p;
  p.type = ropekv::RopeScalingType::kProportional;
  p.partial_rotary_factor = fraction;
  p.factor = factor;
  return p;
}

// One option on top of a plain spec.
struct Option {
  const char* name;
  void (*apply)(OptSpec*);
};

const Option kOptions[] = {
    {"interleaved", [](OptSpec* s) { s->is_neox = false; }},
    {"yarn", [](OptSpec* s) { s->scaling = yarn(4.0, 8192.0); }},
    {"proportional", [](OptSpec* s) { s->scaling = proportional(0.3, 2.0); }},
    {"cache_f32", [](OptSpec* s) { s->cache = CacheKind::kF32; }},
    {"cache_q_dtype", [](OptSpec* s) { s->cache = CacheKind::kQ; }},
    {"q_norm", [](OptSpec* s) { s->q_norm = true; }},
    {"k_norm",
     [](OptSpec* s) {
       s->k_norm = true;
       s->norm_f32 = false;
     }},
    {"qk_norm",
     [](OptSpec* s) {
       s->q_norm = s->k_norm = true;
       s->eps = 1e-5;
     }},
    {"pool_f32", [](OptSpec* s) { s->pool = PoolKind::kF32; }},
    {"fp8_e4m3",
     [](OptSpec* s) {
       s->pool = PoolKind::kE4M3;
       s->k_scale = 0.75;
       s->v_scale = 0.0625;
     }},
    {"fp8_e5m2",
     [](OptSpec* s) {
       s->pool = PoolKind::kE5M2;
       s->k_scale = 3.0;
       s->v_scale = 1.0;
     }},
    {"in_place", [](OptSpec* s) { s->inplace = true; }},
    {"in_place_interleaved_norm",
     [](OptSpec* s) {
       s->inplace = true;
       s->is_neox = false;
       s->q_norm = s->k_norm = true;
     }},
};

// ============================================================ tests

// Every option alone, f32 / f16 / bf16, head dims 64, 80, 128, 256 and 34,
// T 1, 7 and 300 in turn, every target.
TEST(CpuOptions, EachOptionAloneOnEveryTarget) {
  std::mt19937_64 rng(test_seed());
  const int64_t dims[] = {64, 80, 128, 256, 34};
  const int64_t tokens[] = {1, 7, 300};
  int n = 0;
  for (const Option& op : kOptions)
    for (DType dt : kFloatTypes)
      for (int64_t D : dims) {
        OptSpec s;
        s.T = tokens[n % 3];
        s.Hq = s.T == 300 ? 2 : 4;
        s.Hk = s.T == 300 ? 1 : 2;
        s.D = D;
        s.P = s.T + 3;
        s.base = n % 2 ? 500000.0 : 10000.0;
        s.dtype = dt;
        s.pos_type = n % 4 < 2 ? DType::kI32 : DType::kI64;
        s.slot_type = n % 3 == 0 ? DType::kI64 : DType::kI32;
        ++n;
        op.apply(&s);
        OptCase c = make_opt_case(s, rng);
        const OptExpected e = expect_opt(c);
        SCOPED_TRACE(std::string(op.name) + ": " + describe(s));
        check_opt_on_all_targets(c, e);
      }
}

// Partial rotary with every option: the copied dims get the norm and the
// pool encoding too.
TEST(CpuOptions, PartialRotaryWithEachOption) {
  std::mt19937_64 rng(test_seed());
  int n = 0;
  for (const Option& op : kOptions)
    for (DType dt : kFloatTypes) {
      OptSpec s;
      s.T = 5;
      s.Hq = 3;
      s.Hk = 2;
      s.D = n % 2 ? 80 : 96;
      s.R = n % 2 ? 32 : 24;
      s.P = 9;
      s.dtype = dt;
      ++n;
      op.apply(&s);
      OptCase c = make_opt_case(s, rng);
      const OptExpected e = expect_opt(c);
      SCOPED_TRACE(std::string(op.name) + ": " + describe(s));
      check_opt_on_all_targets(c, e);
    }
}

// Proportional RoPE's pairs past its fraction turn by angle 0: every target
// must give back their input bits (cos 1 and sin 0 exactly), in both pair
// layouts, where the reference's tolerance alone would allow a rounding.
TEST(CpuOptions, ProportionalPairsAtAngleZeroAreExactCopiesOnEveryTarget) {
  std::mt19937_64 rng(test_seed());
  for (DType dt : kFloatTypes)
    for (bool neox : {true, false}) {
      OptSpec s;
      s.T = 37;
      s.Hq = 4;
      s.Hk = 2;
      s.D = 128;
      s.P = 40;
      s.dtype = dt;
      s.is_neox = neox;
      s.scaling = proportional(0.25);  // pairs 0..15 of 64 rotate
      OptCase c = make_opt_case(s, rng);
      const OptExpected e = expect_opt(c);
      SCOPED_TRACE(describe(s));
      for_each_target([&](int64_t) {
        run_and_check_opt(c, e);
        int64_t rotated = 0;
        for (const auto& [x, out] : {std::pair{&c.q, &c.q_rot}, std::pair{&c.k, &c.k_rot}})
          for (int64_t t = 0; t < s.T; ++t)
            for (int64_t h = 0; h < x->shape()[1]; ++h)
              for (int64_t d = 0; d < s.D; ++d) {
                const int64_t pair = neox ? d % 64 : d / 2;
                const double in = x->value(x->off(t, h, d)), got = out->value(out->off(t, h, d));
                if (pair >= 16)
                  ASSERT_EQ(std::memcmp(&in, &got, sizeof in), 0) << t << " " << h << " " << d;
                else
                  rotated += got != in;
              }
        EXPECT_GT(rotated, 0);
      });
    }
}

// Model-like combinations.
struct Combo {
  const char* name;
  int64_t Hq, Hk, D, R;
  double base;
  void (*apply)(OptSpec*);
};

const Combo kCombos[] = {
    // Qwen3: QK-norm (weights of q's dtype) and an fp8 cache.
    {"Qwen3_8B_qk_norm_fp8_e4m3", 32, 8, 128, 0, 1000000.0,
     [](OptSpec* s) {
       s->q_norm = s->k_norm = true;
       s->norm_f32 = false;
       s->pool = PoolKind::kE4M3;
       s->k_scale = 0.5;
       s->v_scale = 0.02;
     }},
    // GPT-J: interleaved pairs over 64 of 256 dims.
    {"GPTJ_6B_interleaved_partial", 16, 16, 256, 64, 10000.0,
     [](OptSpec* s) { s->is_neox = false; }},
    // yarn with DeepSeek's mscale form, a float32 pool.
    {"yarn_mscale_pool_f32", 16, 4, 128, 0, 10000.0,
     [](OptSpec* s) {
       s->scaling = yarn(40.0, 4096.0, 0.707, 0.707);
       s->scaling.mscale = 1.0;
       s->pool = PoolKind::kF32;
     }},
    // Qwen2.5-style yarn, interleaved, fp8 e5m2.
    {"yarn_interleaved_fp8_e5m2", 28, 4, 128, 0, 1000000.0,
     [](OptSpec* s) {
       s->scaling = yarn(4.0, 32768.0);
       s->is_neox = false;
       s->pool = PoolKind::kE5M2;
       s->k_scale = 2.0;
       s->v_scale = 0.125;
     }},
    // Gemma-4's full layers: heads of 512, a quarter of the pairs rotating,
    // QK-norm.
    {"Gemma4_full_proportional_qk_norm", 16, 4, 512, 0, 1000000.0,
     [](OptSpec* s) {
       s->scaling = proportional(0.25);
       s->q_norm = s->k_norm = true;
       s->norm_f32 = false;
     }},
    // vLLM's cos_sin_cache in float32 with QK-norm.
    {"cache_f32_qk_norm", 8, 2, 64, 0, 10000.0,
     [](OptSpec* s) {
       s->cache = CacheKind::kF32;
       s->cache_rows = 4096;
       s->q_norm = s->k_norm = true;
     }},
    // A bf16-style cache (q's dtype), interleaved, partial rotary (GLM).
    {"cache_q_dtype_interleaved_partial", 8, 2, 80, 32, 10000.0,
     [](OptSpec* s) {
       s->cache = CacheKind::kQ;
       s->cache_rows = 300;
       s->is_neox = false;
     }},
    // Everything at once, in place.
    {"everything_in_place", 6, 2, 96, 64, 10000.0,
     [](OptSpec* s) {
       s->is_neox = false;
       s->scaling = yarn(8.0, 2048.0);
       s->q_norm = s->k_norm = true;
       s->pool = PoolKind::kE4M3;
       s->k_scale = 0.3;
       s->v_scale = 7.0;
       s->inplace = true;
     }},
};

TEST(CpuOptions, ModelCombinationsOnEveryTarget) {
  std::mt19937_64 rng(test_seed());
  int n = 0;
  for (const Combo& cb : kCombos)
    for (DType dt : kFloatTypes)
      for (int64_t T : {1, 7, 300}) {
        OptSpec s;
        s.T = T;
        s.Hq = cb.Hq;
        s.Hk = cb.Hk;
        s.D = cb.D;
        s.R = cb.R;
        s.P = T + 5;
        s.base = cb.base;
        s.dtype = dt;
        s.pos_type = n % 2 ? DType::kI64 : DType::kI32;
        ++n;
        cb.apply(&s);
        OptCase c = make_opt_case(s, rng);
        const OptExpected e = expect_opt(c);
        SCOPED_TRACE(std::string(cb.name) + ": " + describe(s));
        if (T == 300) {  // the long calls on the dispatcher's target alone
          run_and_check_opt(c, e);
        } else {
          check_opt_on_all_targets(c, e);
        }
      }
}

// Non-contiguous layouts with every option: strided last dims (gathered and
// scattered), fused QKV, padded heads and pool rows, a strided cache and
// strided norm weights, offsets in the data pointer.
TEST(CpuOptions, StridedLayoutsWithEveryOption) {
  std::mt19937_64 rng(test_seed());
  const struct {
    int64_t in, out, pool;
    bool fused;
  } layouts[] = {{2, 1, 1, false}, {1, 3, 1, false}, {1, 1, 2, false},
                 {2, 2, 3, true},  {1, 1, 1, true},  {3, 1, 2, false}};
  int n = 0;
  for (const Option& op : kOptions)
    for (const auto& ly : layouts) {
      OptSpec s;
      s.T = 5;
      s.Hq = 3;
      s.Hk = 2;
      s.D = n % 2 ? 34 : 96;
      s.R = n % 3 == 0 ? s.D - 10 : 0;
      s.P = 8;
      s.dtype = kFloatTypes[n % 3];
      s.layout.in_last_stride = ly.in;
      s.layout.out_last_stride = ly.out;
      s.layout.pool_last_stride = ly.pool;
      s.layout.fused_qkv = ly.fused;
      s.layout.fused_out = ly.fused;
      s.layout.in_head_pad = n % 2 ? 3 : 0;
      s.layout.out_head_pad = n % 3;
      s.layout.pool_head_pad = n % 2 ? 0 : 5;
      s.layout.pool_row_pad = 7;
      s.layout.in_row_pad = ly.fused ? 11 : 0;
      s.layout.lead = 1 + n % 4;
      s.layout.byte_offset = n % 2 == 0;
      s.cache_col_stride = 1 + n % 2;
      s.norm_stride = 1 + n % 3;
      ++n;
      op.apply(&s);
      OptCase c = make_opt_case(s, rng);
      const OptExpected e = expect_opt(c);
      SCOPED_TRACE(std::string(op.name) + ": " + describe(s));
      check_opt_on_all_targets(c, e);
    }
}

// q_rot = q and k_rot = k: the plain path and each option, contiguous,
// strided and fused.
TEST(CpuOptions, InPlaceWithEveryOption) {
  std::mt19937_64 rng(test_seed());
  int n = 0;
  std::vector<Option> options(std::begin(kOptions), std::end(kOptions));
  options.push_back({"plain", [](OptSpec*) {}});
  for (const Option& op : options)
    for (int layout = 0; layout < 3; ++layout) {
      OptSpec s;
      s.T = 1 + 6 * (n % 2);
      s.Hq = 4;
      s.Hk = 2;
      s.D = layout == 1 ? 34 : 128;
      s.P = 9;
      s.dtype = kFloatTypes[n % 3];
      s.layout.in_last_stride = layout == 1 ? 2 : 1;
      s.layout.fused_qkv = layout == 2;
      ++n;
      op.apply(&s);
      s.inplace = true;
      OptCase c = make_opt_case(s, rng);
      const OptExpected e = expect_opt(c);
      SCOPED_TRACE(std::string(op.name) + ": " + describe(s));
      check_opt_on_all_targets(c, e);
    }
}

// 1, 2 and 3 threads give the same bytes, and are right: token ranges
// (T >= 2 threads) and (token, head-group) units (T < 2 threads), with
// enough heads that the call is split at all.
TEST(CpuOptions, ThreadCountsGiveBitIdenticalResults) {
  std::mt19937_64 rng(test_seed());
  const Combo* combos[] = {&kCombos[0], &kCombos[1], &kCombos[3], &kCombos[4], &kCombos[6]};
  int n = 0;
  for (const Combo* cb : combos)
    for (int64_t T : {1, 2, 7, 300}) {
      OptSpec s;
      s.T = T;
      s.D = cb->D;
      s.R = cb->R;
      s.P = T + 3;
      s.base = cb->base;
      s.dtype = kFloatTypes[n++ % 3];
      // Enough bytes for 3 threads (the backend splits from 64 KiB a thread).
      const int64_t want_hq = 200000 / (T * dtype_size(s.dtype) * s.D * 2) + 1;
      s.Hq = std::max(cb->Hq, want_hq);
      s.Hk = cb->Hk;
      cb->apply(&s);
      OptCase c = make_opt_case(s, rng);
      const OptExpected e = expect_opt(c);
      SCOPED_TRACE(std::string(cb->name) + ": " + describe(s));
      std::vector<uint8_t> first;
      for (int threads : {1, 2, 3}) {
        run_and_check_opt(c, e, threads);
        const std::vector<uint8_t> got = opt_result_bytes(c);
        if (threads == 1)
          first = got;
        else
          EXPECT_TRUE(got == first) << "num_threads " << threads << " differs from 1 thread";
      }
    }
}

// Checks the call on every target, then on 1 and 2 threads, which must give
// the same bytes.
void check_targets_and_two_threads(OptCase& c, const OptExpected& e) {
  check_opt_on_all_targets(c, e);
  run_and_check_opt(c, e, 1);
  const std::vector<uint8_t> one = opt_result_bytes(c);
  run_and_check_opt(c, e, 2);
  EXPECT_TRUE(opt_result_bytes(c) == one) << "2 threads differ from 1";
}

// Calls large enough (8 MiB written) for non-temporal stores, with aligned
// rows, so that they take them: each option, and the plain call; 1 and 2
// threads give the same bytes.
TEST(CpuOptions, LargeAlignedCallsOnEveryTarget) {
  std::mt19937_64 rng(test_seed());
  std::vector<Option> options = {kOptions[0], kOptions[1], kOptions[2], kOptions[6], kOptions[7],
                                 kOptions[8], kOptions[9], kOptions[11]};
  // The plain call (the plain path's streamed stores) in every dtype.
  for (int i = 0; i < 3; ++i) options.push_back({"plain", [](OptSpec*) {}});
  int n = 0;
  for (const Option& op : options) {
    OptSpec s;
    s.T = 400;  // with 64 + 8 heads of 128: > 8 MiB written for every option
    s.Hq = 64;
    s.Hk = 8;
    s.D = 128;
    s.P = s.T + 5;
    s.base = 500000.0;
    s.dtype = kFloatTypes[n % 3];
    s.align64 = true;
    s.cache_rows = 2048;
    ++n;
    op.apply(&s);
    OptCase c = make_opt_case(s, rng);
    const OptExpected e = expect_opt(c);
    SCOPED_TRACE(std::string(op.name) + ": " + describe(s));
    check_targets_and_two_threads(c, e);
  }
}

// Small calls into pools of at least 8 MiB, 64-byte aligned, whose rows the
// options path stores non-temporally (from the registers, in the pool's
// format) while q_rot and k_rot stay in cache: each option, T = 1, 3 and 16
// in turn, every target; 1 and 2 threads give the same bytes (T = 3 takes
// the (token, head-group) plan on two threads, T = 16 splits the tokens).
TEST(CpuOptions, SmallCallsIntoLargePools) {
  std::mt19937_64 rng(test_seed());
  int n = 0;
  for (const Option& op : kOptions) {
    OptSpec s;
    s.T = n % 3 == 0 ? 1 : n % 3 == 1 ? 3 : 16;
    s.Hq = s.T == 3 ? 64 : 32;
    s.Hk = 8;
    s.D = s.T == 3 ? 256 : 128;
    s.base = 500000.0;
    s.dtype = kFloatTypes[(n / 3) % 3];
    s.align64 = true;
    s.cache_rows = 2048;
    ++n;
    op.apply(&s);
    // Every other call partial (where the option leaves R at D): the
    // streamed pool rows take the copied dims too.
    if (s.R == 0 && n % 2 == 0) s.R = s.D / 2;
    const int64_t pool_elem = s.pool == PoolKind::kE4M3 || s.pool == PoolKind::kE5M2 ? 1
                              : s.pool == PoolKind::kF32                          ? 4
                                                                                  : dtype_size(s.dtype);
    s.P = (int64_t{8} << 20) / (s.Hk * s.D * pool_elem) + s.T;
    OptCase c = make_opt_case(s, rng);
    const OptExpected e = expect_opt(c);
    SCOPED_TRACE(std::string(op.name) + ": " + describe(s));
    check_targets_and_two_threads(c, e);
  }
}

// A position outside the cos_sin_cache at the first, a middle or the last
// token: the call is refused before any write, naming that token.
TEST(CpuOptions, TablePositionsCheckedOnEveryTokenBeforeAnyWrite) {
  std::mt19937_64 rng(test_seed());
  OptSpec s;
  s.T = 5;
  s.Hq = 4;
  s.Hk = 2;
  s.D = 32;
  s.P = 8;
  s.cache = CacheKind::kF32;
  s.cache_rows = 64;
  s.q_norm = true;
  for (int64_t token : {0, 2, 4})
    for (int64_t position : {int64_t{-1}, int64_t{64}}) {
      OptCase c = make_opt_case(s, rng);
      c.positions.set_index(token, position);
      const Snapshot before(c);
      const std::string want = "positions[" + std::to_string(token) + "] = " +
                               std::to_string(position) +
                               " is outside cos_sin_cache, which has 64 rows";
      try {
        ropekv::rope_pool_fused(c.tensors(), c.config());
        ADD_FAILURE() << "accepted " << want;
      } catch (const ropekv::Error& e) {
        EXPECT_EQ(std::string(e.what()).rfind(want, 0), 0u) << e.what();
      }
      for (const auto& [st, bytes] : before.bytes)
        EXPECT_TRUE(st->snapshot() == bytes) << "a rejected call wrote memory";
    }
}

// The call of the fp8 code tests: T tokens of one q head and one kv head of
// D elements of `dtype`, a pool of T rows of `kind` with these scales.
OptSpec fp8_code_spec(int64_t T, int64_t D, DType dtype, PoolKind kind, double k_scale,
                      double v_scale) {
  OptSpec s;
  s.T = T;
  s.Hq = 1;
  s.Hk = 1;
  s.D = D;
  s.P = T;
  s.dtype = dtype;
  s.pool = kind;
  s.k_scale = k_scale;
  s.v_scale = v_scale;
  return s;
}

// The vector fp8 encoder against the table oracle, bit for bit, on every
// target: v (v_scale 1, then others) holds every sign and exponent with
// mantissas at and around each rounding boundary, the special values, and
// random bit patterns; f32 inputs, so v reaches the pool unrounded.
// Runs the call of `s` (one kv head; v's element i in token order holding the
// raw bits raw(i), slots reversed) on every target and checks each v_pool
// code bit for bit against the shared scalar encoder (the oracle the other
// backends use too) of fp32(value / v_scale), value = as_float(raw bits).
template <class Raw, class AsFloat>
void check_fp8_codes(OptSpec s, std::mt19937_64& rng, Raw raw, AsFloat as_float) {
  OptCase c = make_opt_case(s, rng);
  const int64_t T = s.T, D = s.D;
  for (int64_t t = 0; t < T; ++t) {
    c.slots.set_index(t, T - 1 - t);
    for (int64_t d = 0; d < D; ++d) c.v.set_raw(c.v.off(t, 0, d), raw(t * D + d));
  }
  const OptExpected e = expect_opt(c);
  SCOPED_TRACE(describe(s));
  const ropekv::Fp8Kind fk =
      s.pool == PoolKind::kE4M3 ? ropekv::Fp8Kind::kE4M3 : ropekv::Fp8Kind::kE5M2;
  for_each_target([&](int64_t) {
    run_and_check_opt(c, e);
    int64_t bad = 0;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < D; ++d) {
        const uint64_t b = c.v.raw(c.v.off(t, 0, d));
        const uint8_t want = ropekv::encode_fp8(as_float(b) / static_cast<float>(s.v_scale), fk);
        const uint64_t got = c.v_pool.raw(T - 1 - t, 0, d);
        if (got != want && bad++ < 8)
          ADD_FAILURE() << "v bits 0x" << std::hex << b << ": v_pool 0x" << got
                        << ", encode_fp8 0x" << int{want} << std::dec;
      }
    EXPECT_EQ(bad, 0);
  });
}

TEST(CpuOptions, Fp8EncoderBitExactOnEveryTarget) {
  std::mt19937_64 rng(test_seed());
  std::vector<uint32_t> bits;
  for (uint32_t se = 0; se < 512; ++se)      // sign and exponent
    for (uint32_t top = 0; top < 32; ++top)  // the mantissa's top 5 bits
      for (uint32_t low : {0u, 1u, 0x1FFFFu, 0x20000u, 0x3FFFFu, 0x10000u, 0xFFFFu,
                           static_cast<uint32_t>(rng() & 0x3FFFFu)})
        bits.push_back((se << 23) | (top << 18) | low);
  for (int i = 0; i < 1 << 18; ++i) bits.push_back(static_cast<uint32_t>(rng()));
  const int64_t D = 256;
  const int64_t T = static_cast<int64_t>((bits.size() + D - 1) / D);
  for (PoolKind kind : {PoolKind::kE4M3, PoolKind::kE5M2})
    for (double v_scale : {1.0, 0.1, 3.0}) {
      check_fp8_codes(
          fp8_code_spec(T, D, DType::kF32, kind, 1.0 / v_scale, v_scale), rng, [&](int64_t i) { return bits[static_cast<size_t>(i) % bits.size()]; },
          [](uint64_t b) { return f32_from_bits(static_cast<uint32_t>(b)); });
    }
}

// Every one of the 65536 bf16 patterns as v through an fp8 pool, bit for bit
// against the shared scalar encoder of fp32(v / scale), on every target, for
// power-of-two scales from 2^-65 to 2^70 (x * (1 / scale); on AVX-512 the
// codes of 2^-64 .. 2^64 come from the bf16 bits, the others from fp32
// lanes) and one that takes the division; and once through a large aligned
// call (non-temporal pool rows).
TEST(CpuOptions, Fp8FromEveryBf16PatternOnEveryTarget) {
  std::mt19937_64 rng(test_seed());
  const int64_t D = 256, T = 65536 / D;
  struct Run {
    double scale;
    bool large;
  };
  const Run runs[] = {{1.0, false},          {0.5, false},         {2.0, false},
                      {std::ldexp(1.0, -20), false}, {std::ldexp(1.0, 20), false},
                      {std::ldexp(1.0, -64), false}, {std::ldexp(1.0, 64), false},
                      {std::ldexp(1.0, -65), false}, {std::ldexp(1.0, 70), false},
                      {0.1, false},          {0.5, true}};
  for (PoolKind kind : {PoolKind::kE4M3, PoolKind::kE5M2})
    for (const Run& run : runs) {
      OptSpec s = fp8_code_spec(T, D, DType::kBF16, kind, 1.0 / run.scale, run.scale);
      s.Hq = run.large ? 64 : 1;  // large: > 8 MiB written
      s.align64 = run.large;
      check_fp8_codes(
          s, rng, [](int64_t i) { return static_cast<uint64_t>(i); },
          [](uint64_t b) { return f32_from_bits(static_cast<uint32_t>(b) << 16); });
    }
}

// Every one of the 65536 f16 patterns as v through an fp8 pool, bit for bit
// against the shared scalar encoder of fp32(v / scale), on every target: the
// power-of-two scales whose codes AVX-512 makes from the f16 bits (E4M3
// 2^-8 to 2^7, E5M2 1; f16 subnormals among them; k_scale the same, so that
// the call takes that writer), the first ones past that range on either side
// (fp32 lanes), and one that takes the division.
TEST(CpuOptions, Fp8FromEveryF16PatternOnEveryTarget) {
  std::mt19937_64 rng(test_seed());
  const int64_t D = 256, T = 65536 / D;
  for (PoolKind kind : {PoolKind::kE4M3, PoolKind::kE5M2}) {
    std::vector<double> scales = {0.1};
    const int lo = kind == PoolKind::kE4M3 ? -9 : -1, hi = kind == PoolKind::kE4M3 ? 8 : 1;
    for (int j = lo; j <= hi; ++j) scales.push_back(std::ldexp(1.0, j));
    for (double scale : scales) {
      check_fp8_codes(
          fp8_code_spec(T, D, DType::kF16, kind, scale, scale), rng, [](int64_t i) { return static_cast<uint64_t>(i); },
          [](uint64_t b) { return from_f16(static_cast<uint16_t>(b)); });
    }
  }
}

// fp32(v / scale) for scales whose reciprocal is not exact (the pool writer
// divides): v chosen so that the quotient lands on and around the rounding
// boundaries of both fp8 formats (fp32 values a few ulps from each midpoint,
// at every exponent an fp8 code distinguishes), with random patterns, bit
// for bit against the IEEE division, on every target; scales from 2^-40 to
// 2^40.
TEST(CpuOptions, Fp8QuotientsAtRoundingBoundariesOnEveryTarget) {
  std::mt19937_64 rng(test_seed());
  std::vector<double> scales = {0.37, 0.0213, 3.0, 1e-3, 7.1, std::ldexp(1.3, 31),
                                std::ldexp(1.7, -32), std::ldexp(1.3, -40), std::ldexp(1.7, 40)};
  for (int i = 0; i < 3; ++i)  // random ones, 2^-32 to 2^32
    scales.push_back(std::ldexp(1.0 + static_cast<double>(rng() % (1u << 23)) / (1u << 23),
                                static_cast<int>(rng() % 64) - 32));
  const int64_t D = 256;
  for (PoolKind kind : {PoolKind::kE4M3, PoolKind::kE5M2})
    for (double scale : scales) {
      const float sf = static_cast<float>(scale);
      std::vector<uint32_t> bits;
      for (uint32_t sign : {0u, 1u})
        for (int e = -22; e <= 17; ++e)
          for (uint32_t top = 0; top < 8; ++top)
            for (uint32_t low : {0x80000u, 0x7FFFFu, 0x100000u, 0xFFFFFu, 0x180000u, 0u}) {
              const uint32_t q_bits =
                  (sign << 31) | (static_cast<uint32_t>(127 + e) << 23) | (top << 20) | low;
              const uint32_t x = f32_bits(f32_from_bits(q_bits) * sf);
              for (int32_t dx = -2; dx <= 2; ++dx) bits.push_back(x + dx);
            }
      for (int i = 0; i < 4096; ++i) bits.push_back(static_cast<uint32_t>(rng()));
      OptSpec s;
      s.T = static_cast<int64_t>((bits.size() + D - 1) / D);
      s.Hq = 1;
      s.Hk = 1;
      s.D = D;
      s.P = s.T;
      s.pool = kind;
      s.v_scale = scale;
      s.k_scale = scale;
      check_fp8_codes(
          s, rng, [&](int64_t i) { return bits[static_cast<size_t>(i) % bits.size()]; },
          [](uint64_t b) { return f32_from_bits(static_cast<uint32_t>(b)); });
    }
}

}  // namespace
}  // namespace ropekv_test
