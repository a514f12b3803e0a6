// The replay engine. One step = one forward pass of the engine: a batch of
// decode tokens (one per decoding request) and prefill chunks (up to the
// step's token budget), then one rope_pool_fused call per layer with fresh
// inputs. What each call wrote is checked after it, each request's cache is
// checked when it finishes (before its slots are freed and reused), and the
// whole pool is checked at the end.
#include <unistd.h>
#include "replay.h"

#include <ropekv/reference.h>
#include <ropekv/ropekv.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <initializer_list>
#include <limits>
#include <memory>
#include <sstream>
#include <utility>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace replay {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

/// The product of `factors` (each >= 0), the size of one of the run's
/// buffers (`what`); an InputError where it does not fit in 63 bits (a
/// config of 2^39 layers made the pool's size wrap to 0 and the call fail).
int64_t buffer_size(const char* what, std::initializer_list<int64_t> factors) {
  int64_t n = 1;
  for (const int64_t f : factors)
    if (__builtin_mul_overflow(n, f, &n))
      throw InputError(std::string("the ") + what + " would need more than 2^63 bytes: use fewer " +
                       "--layers, a smaller --pool-size or --max-batch-tokens, or a smaller config");
  return n;
}

/// An InputError where the run's largest buffers (`bytes` in all: the pools
/// and the step's q/k/v) pass this machine's physical memory: allocated
/// lazily under Linux's overcommit, they would be granted and the process
/// killed by the OOM killer once touched, with no message.
void check_fits_in_memory(int64_t bytes) {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) return;  // (unknown: the allocation decides)
  const double have = static_cast<double>(pages) * static_cast<double>(page);
  if (static_cast<double>(bytes) <= have) return;
  char msg[256];
  std::snprintf(msg, sizeof msg, "the KV pools and the step's buffers would need %.1f GiB, more "
                "than this machine's %.1f GiB of memory: ", static_cast<double>(bytes) / (1 << 30),
                have / (1 << 30));
  throw InputError(std::string(msg) + "use fewer --layers, a smaller --pool-size or "
                   "--max-batch-tokens, or a smaller config");
}

/// 64-byte aligned, uninitialised bytes; grows, never shrinks.
class Buffer {
 public:
  void reserve(size_t bytes) {
    if (bytes <= size_) return;
    const size_t n = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, n);
    if (!p) throw std::bad_alloc();
    ptr_.reset(static_cast<uint8_t*>(p));
    size_ = n;
  }
  uint8_t* data() const { return ptr_.get(); }
  size_t size() const { return size_; }

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> ptr_;
  size_t size_ = 0;
};

uint64_t hash_bytes(const void* p, size_t n) {
  // Four independent multiply-xor lanes over 8-byte words, then the tail.
  const uint8_t* b = static_cast<const uint8_t*>(p);
  uint64_t h[4] = {0x243F6A8885A308D3ull, 0x13198A2E03707344ull, 0xA4093822299F31D0ull,
                   0x082EFA98EC4E6C89ull};
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int j = 0; j < 4; ++j) {
      uint64_t w;
      std::memcpy(&w, b + i + 8 * j, 8);
      h[j] = (h[j] ^ w) * 0x9E3779B97F4A7C15ull;
      h[j] ^= h[j] >> 31;
    }
  }
  uint64_t r = h[0] ^ (h[1] * 3) ^ (h[2] * 5) ^ (h[3] * 7) ^ n;
  for (; i < n; i += 4) {  // (an fp8 head of D = 4k + 2 ends in 2 bytes: no read past them)
    uint32_t w = 0;
    std::memcpy(&w, b + i, std::min<size_t>(4, n - i));
    r = (r ^ w) * 0x100000001B3ull;
    r ^= r >> 29;
  }
  uint64_t s = r;
  return splitmix64(s);
}

/// An element's bits (`bytes` wide) and value.
std::string fmt_elem(int bytes, uint32_t bits, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, bytes == 4 ? "0x%08x (%.9g)" : bytes == 2 ? "0x%04x (%.6g)" : "0x%02x (%.6g)",
                bits, v);
  return buf;
}

struct Token {
  int64_t req = -1;  ///< request index, -1 for a padding token
  int64_t pos = 0;   ///< position (= token index in its request)
  int64_t slot = -1;
};

struct ReqState {
  int64_t prefilled = 0;  ///< prompt tokens processed
  int64_t decoded = 0;    ///< decode steps done
  bool admitted = false, finished = false;
  std::vector<int32_t> slots;  ///< slot of each KV token, by position
};

/// Where a check failed: the first bad element of a row.
struct Bad {
  bool bad = false;
  int64_t head = 0, dim = 0;
  uint32_t got_bits = 0, want_bits = 0;
  double got = 0, want = 0, tol = 0;
  bool pool = false;  ///< `got` is a pool element (pool format), else of q's dtype
};

class Engine {
 public:
  Engine(const ModelConfig& m, const Workload& w, const ReplayOptions& o)
      : m_(m), w_(w), o_(o), dt_(o.dtype), E_(elem_size(o.dtype)), kv_(o.kv_dtype),
        PE_(pool_elem_size(o.kv_dtype, o.dtype)), fp8_(is_fp8(o.kv_dtype) ? o.kv_dtype : KvDtype::kFp8E4M3),
        kscale_(static_cast<float>(o.k_scale)), vscale_(static_cast<float>(o.v_scale)),
        rel_(kRopeRel + (m.qk_norm != QkNorm::kNone ? qk_norm_rel(m.head_dim) : 0.0)) {}

  ReplayResult run();

 private:
  // ---- shapes
  int64_t Hq() const { return m_.num_qo_heads; }
  int64_t Hk() const { return m_.num_kv_heads; }
  int64_t D() const { return m_.head_dim; }
  int64_t R() const { return m_.rotary_dim; }
  int64_t qrow() const { return Hq() * D(); }
  int64_t krow() const { return Hk() * D(); }
  int64_t in_row() const { return o_.fused_qkv ? qrow() + 2 * krow() : 0; }
  size_t krow_bytes() const { return static_cast<size_t>(krow()) * E_; }
  size_t pool_row_bytes() const { return static_cast<size_t>(krow()) * PE_; }
  /// Pair i's two dims: NeoX (i, i + R/2), interleaved (2i, 2i + 1).
  int64_t pair_a(int64_t i) const { return m_.is_neox ? i : 2 * i; }
  int64_t pair_b(int64_t i) const { return m_.is_neox ? i + R() / 2 : 2 * i + 1; }

  // ---- buffers of the step
  uint8_t* q_in(int64_t t) const {
    return o_.fused_qkv ? in_.data() + (t * in_row()) * E_ : q_.data() + t * qrow() * E_;
  }
  uint8_t* k_in(int64_t t) const {
    return o_.fused_qkv ? in_.data() + (t * in_row() + qrow()) * E_ : k_.data() + t * krow() * E_;
  }
  uint8_t* v_in(int64_t t) const {
    return o_.fused_qkv ? in_.data() + (t * in_row() + qrow() + krow()) * E_
                        : v_.data() + t * krow() * E_;
  }
  uint8_t* q_rot(int64_t t) const { return qrot_.data() + t * qrow() * E_; }
  uint8_t* k_rot(int64_t t) const { return krot_.data() + t * krow() * E_; }
  uint8_t* k_pool(int64_t layer, int64_t slot) const {
    return pool_.data() + ((2 * layer) * P_ + slot) * pool_row_bytes();
  }
  uint8_t* v_pool(int64_t layer, int64_t slot) const {
    return pool_.data() + ((2 * layer + 1) * P_ + slot) * pool_row_bytes();
  }

  // ---- data
  uint64_t key(int64_t req, int64_t pos, int64_t layer, int tensor) const {
    return mix_key(o_.seed, static_cast<uint64_t>(req), static_cast<uint64_t>(pos),
                   static_cast<uint64_t>(layer), static_cast<uint64_t>(tensor));
  }
  void gen_row(uint64_t k, int64_t n, uint8_t* dst) const;
  void make_table();
  void generate_inputs(int64_t layer);
  /// Layer `layer`'s c and s at position `pos` (its type's RoPE parameters).
  const double* cos_sin(int64_t layer, int64_t pos) const {
    return &tables_[m_.rope_index(layer)][static_cast<size_t>(pos) * R()];
  }
  void make_cos_sin(int64_t max_pos);
  // QK-norm weights of each layer, [D] in q's dtype, q's then k's.
  bool qk_norm() const { return m_.qk_norm != QkNorm::kNone; }
  uint8_t* norm_weight(int64_t layer, bool is_q) const {
    return norm_w_.data() + (2 * layer + (is_q ? 0 : 1)) * D() * E_;
  }
  void make_norm_weights();
  void norm_ref(double* x, int64_t heads, int64_t layer, bool is_q) const;
  void rotate_ref(const double* x, int64_t layer, int64_t pos, double* out) const;
  Bad compare_rotated(const uint8_t* got, bool pool, const double* x, int64_t layer, int64_t pos,
                      int64_t heads, double ulps = -1.0) const;  // -1: rounding_ulps of q's dtype
  Bad compare_pool_bits(const uint8_t* got, const uint8_t* want, int64_t n, float scale) const;
  // ---- pool format
  void encode_row(const uint8_t* src, int64_t n, float scale, uint8_t* dst) const;
  void load_pool_row(const uint8_t* src, int64_t n, float scale, double* out) const;
  uint32_t pool_bits(const uint8_t* p, int64_t e) const;
  double pool_value(const uint8_t* p, int64_t e, float scale) const;
  const char* pool_name() const { return kv_ == KvDtype::kAuto ? dtype_name(dt_) : kv_dtype_name(kv_); }

  // ---- steps
  void admit_and_build();
  void call(int64_t layer, bool timed = true);
  void check_call(int64_t layer);
  void spot_check(int64_t layer);
  void check_all(int64_t layer);
  void check_cached(int64_t req, int64_t pos, int64_t layer, const char* when) const;
  void finish_step();
  void verify_pool_end();
  // Rows of slot s that no call names (free): the fill pattern in every
  // layer (check_unnamed throws a VerifyError naming `when` otherwise).
  void fill_unnamed(int32_t s);
  bool unnamed_intact(int64_t layer, int32_t s) const;
  void check_unnamed(int32_t s, const char* when) const;
  void maybe_inject_before_checks(int64_t layer);
  void maybe_inject_after_checks(int64_t layer);
  [[noreturn]] void report(const std::string& check, int64_t req, int64_t pos, int64_t slot,
                           int64_t layer, const Bad& b, const char* got_name,
                           const char* want_name) const;
  int nthreads() const;
  void progress(bool final);

  const ModelConfig& m_;
  const Workload& w_;
  const ReplayOptions& o_;
  const Dtype dt_;
  const int E_;
  const KvDtype kv_;
  const int PE_;            // bytes of a pool element
  const Fp8Codec fp8_;      // the tool's own codec (used for fp8 pools only)
  const float kscale_, vscale_;  // fp32 scales, as the op divides by them
  const double rel_;             // fp32 units of the magnitude in a rotated element's tolerance
  int64_t L_ = 0, P_ = 0;

  Buffer pool_, in_, q_, k_, v_, qrot_, krot_, norm_w_;
  // Per layer type (ModelConfig::ropes), per position: c[0..R/2), s[0..R/2)
  // (make_cos_sin).
  std::vector<std::vector<double>> tables_;
  std::vector<uint64_t> khash_;  // per (layer, slot, head): hash of the k_rot head the call wrote
  size_t hash_index(int64_t layer, int64_t slot, int64_t head) const {
    return static_cast<size_t>((layer * P_ + slot) * Hk() + head);
  }
  std::vector<int64_t> owner_req_, owner_pos_;  // last writer of each slot
  std::vector<char> ever_used_;
  std::deque<int32_t> free_;
  std::vector<ReqState> st_;
  std::deque<int64_t> waiting_;
  std::vector<int64_t> running_;  // admission order
  int64_t reserved_ = 0;

  std::vector<Token> toks_;
  std::vector<int32_t> positions_, slots_;
  std::vector<std::pair<int64_t, int64_t>> chunks_;  // (request, tokens) prefill of this step
  std::vector<int64_t> decoders_;                      // requests decoding this step
  int64_t written_ = 0;                                // W of this step
  bool decode_only_ = false;

  ReplayResult res_;
  int64_t kv_total_ = 0, kv_done_ = 0, finished_ = 0;
  Clock::time_point last_progress_{};
  struct Sample {
    int64_t layer, token, head;
  };
  std::vector<Sample> spot_q_, spot_k_;  // spot checks of this step
  static constexpr int64_t kTableElems = int64_t{1} << 20;
  Buffer table_data_;  // random values in the dtype; inputs are windows of it
};

int Engine::nthreads() const {
#ifdef _OPENMP
  return o_.threads > 0 ? o_.threads : omp_get_max_threads();
#else
  return 1;
#endif
}

void Engine::gen_row(uint64_t k, int64_t n, uint8_t* dst) const {
  // A window of the random table at a random offset, with the sign of each
  // element flipped by a random 64-bit pattern: fresh data for every
  // (request, token, layer, tensor), made at memcpy speed, and made again
  // bit for bit from the same key when the cache is checked.
  Rng r(k);
  const uint64_t off = r.below(kTableElems);
  const uint64_t mask = r.next();
  if (E_ == 4) {
    uint32_t pat[64];
    for (int i = 0; i < 64; ++i) pat[i] = static_cast<uint32_t>((mask >> i) & 1u) << 31;
    const uint32_t* src = reinterpret_cast<const uint32_t*>(table_data_.data()) + off;
    uint32_t* d = reinterpret_cast<uint32_t*>(dst);
    for (int64_t b = 0; b < n; b += 64) {
      const int64_t m = std::min<int64_t>(64, n - b);
      for (int64_t j = 0; j < m; ++j) d[b + j] = src[b + j] ^ pat[j];
    }
  } else {
    uint16_t pat[64];
    for (int i = 0; i < 64; ++i) pat[i] = static_cast<uint16_t>(((mask >> i) & 1u) << 15);
    const uint16_t* src = reinterpret_cast<const uint16_t*>(table_data_.data()) + off;
    uint16_t* d = reinterpret_cast<uint16_t*>(dst);
    for (int64_t b = 0; b < n; b += 64) {
      const int64_t m = std::min<int64_t>(64, n - b);
      for (int64_t j = 0; j < m; ++j) d[b + j] = static_cast<uint16_t>(src[b + j] ^ pat[j]);
    }
  }
}

void Engine::make_table() {
  // Values uniform in [-2, 2) on a 2^-22 grid (exact in fp32), rounded once
  // to the dtype; long enough for a window of the longest row at any offset.
  const int64_t n = kTableElems + qrow();
  table_data_.reserve(static_cast<size_t>(n) * E_);
  Rng r(mix_key(o_.seed, 0x7AB1E, 0, 0, 0));
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(static_cast<int32_t>(r.next() & 0xFFFFFF) - 0x800000) * 0x1p-22f;
    store_elem(dt_, table_data_.data(), i, v);
  }
}

void Engine::generate_inputs(int64_t layer) {
  const int64_t T = static_cast<int64_t>(toks_.size());
#pragma omp parallel for num_threads(nthreads()) schedule(static) if (T >= 32)
  for (int64_t t = 0; t < T; ++t) {
    const Token& tk = toks_[t];
    if (tk.req < 0) {  // padding: zeros, as an engine's padded graph batch
      std::memset(q_in(t), 0, qrow() * E_);
      std::memset(k_in(t), 0, krow() * E_);
      std::memset(v_in(t), 0, krow() * E_);
      continue;
    }
    gen_row(key(tk.req, tk.pos, layer, 0), qrow(), q_in(t));
    gen_row(key(tk.req, tk.pos, layer, 1), krow(), k_in(t));
    gen_row(key(tk.req, tk.pos, layer, 2), krow(), v_in(t));
  }
}

void Engine::make_norm_weights() {
  // The learned weights are not in a config: uniform in [0.5, 1.5) on a
  // 2^-10 grid (exact in every dtype), fresh per layer and per q/k; ones for
  // a weightless norm (Llama-4).
  if (!qk_norm()) return;
  norm_w_.reserve(static_cast<size_t>(buffer_size("QK-norm weights", {L_, 2, D(), E_})));
  for (int64_t l = 0; l < L_; ++l)
    for (int q = 0; q < 2; ++q) {
      Rng r(mix_key(o_.seed, 0x404D, static_cast<uint64_t>(l), static_cast<uint64_t>(q), 0));
      for (int64_t d = 0; d < D(); ++d) {
        const float w = m_.qk_norm == QkNorm::kUnit
                            ? 1.0f
                            : 0.5f + static_cast<float>(r.next() & 0x3FF) * 0x1p-10f;
        store_elem(dt_, norm_weight(l, q == 0), d, w);
      }
    }
}

void Engine::norm_ref(double* x, int64_t heads, int64_t layer, bool is_q) const {
  // The QK-norm in float64: each head x * w / sqrt(mean(x^2) + eps).
  if (!qk_norm()) return;
  const uint8_t* w = norm_weight(layer, is_q);
  for (int64_t hd = 0; hd < heads; ++hd) {
    double* xh = x + hd * D();
    double ss = 0;
    for (int64_t d = 0; d < D(); ++d) ss += xh[d] * xh[d];
    const double r = 1.0 / std::sqrt(ss / static_cast<double>(D()) + m_.norm_eps);
    for (int64_t d = 0; d < D(); ++d) xh[d] *= r * load_elem(dt_, w, d);
  }
}

void Engine::make_cos_sin(int64_t max_pos) {
  // c and s of every position in float64, from the library's public inverse
  // frequencies (ropekv::rope_inv_freq: the scaling formulas are the
  // library's; the angle and the rotation are the tool's): theta =
  // fp32(fp32(pos) * inv_freq[i]) (the product of two fp32 numbers is exact
  // in double, then rounded once), times yarn's attention factor m in fp32;
  // one table per layer type that a replayed layer has.
  const int64_t h = R() / 2;
  tables_.assign(m_.ropes.size(), {});
  for (size_t kind = 0; kind < m_.ropes.size(); ++kind) {
    if (m_.layers_of(kind, L_).empty()) continue;
    const LayerRope& lr = m_.ropes[kind];
    const std::vector<float> inv = ropekv::rope_inv_freq(rope_config(m_, lr));
    if (static_cast<int64_t>(inv.size()) != h)
      throw VerifyError("MISMATCH (ropekv::rope_inv_freq returned " + std::to_string(inv.size()) +
                        " frequencies for rotary_dim " + std::to_string(R()) + ")");
    const double m = static_cast<float>(ropekv::rope_attention_factor(lr.rope_scaling));
    std::vector<double>& table = tables_[kind];
    table.assign(static_cast<size_t>((max_pos + 1) * R()), 0.0);
#pragma omp parallel for num_threads(nthreads()) schedule(static)
    for (int64_t p = 0; p <= max_pos; ++p) {
      double* row = &table[static_cast<size_t>(p * R())];
      for (int64_t i = 0; i < h; ++i) {
        const double theta =
            static_cast<float>(static_cast<double>(static_cast<float>(p)) * static_cast<double>(inv[i]));
        row[i] = std::cos(theta) * m;
        row[h + i] = std::sin(theta) * m;
      }
    }
    // Without scaling the frequencies are theta^(-2i/R) for both pair layouts:
    // then the table must be exactly ropekv::reference's c and s (rope_head of
    // x = (1,..,1, 0,..,0) gives out[i] = c_i, out[i + R/2] = s_i exactly).
    if (lr.rope_scaling.type != ropekv::RopeScalingType::kNone) continue;
    std::vector<double> unit(static_cast<size_t>(D()), 0.0), out(static_cast<size_t>(D()));
    for (int64_t i = 0; i < h; ++i) unit[i] = 1.0;
    for (int64_t p = 0; p <= max_pos; ++p) {
      ropekv::reference::rope_head(unit.data(), out.data(), D(), R(), p, lr.rope_theta);
      for (int64_t i = 0; i < R(); ++i) {
        if (out[i] != table[static_cast<size_t>(p * R() + i)]) {
          std::ostringstream o;
          o << "MISMATCH (cos/sin from ropekv::rope_inv_freq differ from ropekv::reference): position " << p
            << ", " << (i < h ? "cos" : "sin") << " of pair " << i % h << ": " << table[p * R() + i]
            << " vs reference " << out[i];
          throw VerifyError(o.str());
        }
      }
    }
  }
}

void Engine::rotate_ref(const double* x, int64_t layer, int64_t pos, double* out) const {
  // Float64 RoPE with the table's c and s, in the model's pair layout.
  const int64_t h = R() / 2;
  const double* cs = cos_sin(layer, pos);
  for (int64_t i = 0; i < h; ++i) {
    const int64_t a = pair_a(i), b = pair_b(i);
    out[a] = x[a] * cs[i] - x[b] * cs[h + i];
    out[b] = x[b] * cs[i] + x[a] * cs[h + i];
  }
  for (int64_t d = R(); d < D(); ++d) out[d] = x[d];
}

/// Compares `heads` rotated heads `got` with the float64 rotation of `x` (the
/// dtype values, through norm_ref with a QK-norm) at `pos` in `layer`: within
/// rope_tolerance (q's dtype); for a pool row (`pool`) in an fp8 format, plus
/// one fp8 ulp of ref / k_scale (times k_scale) with ref clamped to the
/// saturation bound. Copied dims must be exact without a QK-norm (the value
/// itself, or its fp8 encoding); with one they are within the tolerance.
Bad Engine::compare_rotated(const uint8_t* got, bool pool, const double* x, int64_t layer, int64_t pos,
                            int64_t heads, double ulps) const {
  Bad b;
  const int64_t Dd = D(), R2 = R(), h = R2 / 2;
  const double* cs = cos_sin(layer, pos);
  const UlpFn ulp(dt_);
  if (ulps < 0) ulps = rounding_ulps(dt_);
  const double K = rel_ * 0x1p-24;
  const bool fp8 = pool && is_fp8(kv_);
  const double ks = kscale_, kmax = fp8_.max_finite() * ks;
  thread_local std::vector<double> g;
  g.resize(static_cast<size_t>(heads * Dd));
  if (pool) load_pool_row(got, heads * Dd, kscale_, g.data());
  else load_row(dt_, got, heads * Dd, g.data());
  // The tolerance of an element whose float64 value is r and fp32 term t;
  // moves r to the saturation bound of an fp8 pool.
  auto tol_of = [&](double& r, double t) {
    double tol = ulps * ulp(r) + t;
    if (fp8) {
      tol += fp8_.ulp(r / ks) * ks + std::fabs(r) * 0x1p-22;  // the fp8 rounding, the fp32 division
      r = std::clamp(r, -kmax, kmax);
    }
    return tol;
  };
  auto copied = [&](double v) {  // what a copied dim must hold
    return fp8 ? fp8_.decode(fp8_.encode(static_cast<float>(v) / kscale_)) * ks : v;
  };
  for (int64_t hd = 0; hd < heads; ++hd) {
    const double* xh = x + hd * Dd;
    const double* gh = g.data() + hd * Dd;
    bool bad = false;
    for (int64_t i = 0; i < h; ++i) {
      const int64_t ia = pair_a(i), ib = pair_b(i);
      const double x1 = xh[ia], x2 = xh[ib], c = cs[i], s = cs[h + i];
      double r1 = x1 * c - x2 * s, r2 = x2 * c + x1 * s;
      const double t1 = tol_of(r1, K * (std::fabs(x1 * c) + std::fabs(x2 * s)));
      const double t2 = tol_of(r2, K * (std::fabs(x2 * c) + std::fabs(x1 * s)));
      bad |= !(std::fabs(gh[ia] - r1) <= t1);
      bad |= !(std::fabs(gh[ib] - r2) <= t2);
    }
    for (int64_t d = R2; d < Dd; ++d) {
      if (qk_norm()) {
        double r = xh[d];
        const double t = tol_of(r, K * std::fabs(xh[d]));
        bad |= !(std::fabs(gh[d] - r) <= t);
      } else {
        bad |= !(gh[d] == copied(xh[d]));
      }
    }
    if (!bad) continue;
    // Slow path: the first bad element in dim order, with its tolerance.
    std::vector<double> ref(static_cast<size_t>(Dd));
    rotate_ref(xh, layer, pos, ref.data());
    for (int64_t d = 0; d < Dd; ++d) {
      double tol = 0, want = ref[d];
      if (d < R2) {
        const int64_t i = m_.is_neox ? (d < h ? d : d - h) : d / 2;
        const int64_t partner = m_.is_neox ? (d < h ? d + h : d - h) : (d ^ 1);
        tol = tol_of(want, K * (std::fabs(xh[d] * cs[i]) + std::fabs(xh[partner] * cs[h + i])));
      } else if (qk_norm()) {
        tol = tol_of(want, K * std::fabs(xh[d]));
      } else {
        want = copied(xh[d]);
      }
      if (!(std::fabs(gh[d] - want) <= tol)) {
        const int64_t e = hd * Dd + d;
        b = {true, hd, d, pool ? pool_bits(got, e) : elem_bits(dt_, got, e), 0, gh[d], want, tol, pool};
        return b;
      }
    }
  }
  return b;
}

/// Two rows in the pool format, bit for bit (values shown times `scale`).
Bad Engine::compare_pool_bits(const uint8_t* got, const uint8_t* want, int64_t n, float scale) const {
  Bad b;
  if (std::memcmp(got, want, static_cast<size_t>(n) * PE_) == 0) return b;
  for (int64_t e = 0; e < n; ++e) {
    if (std::memcmp(got + e * PE_, want + e * PE_, PE_) != 0) {
      b = {true, e / D(), e % D(), pool_bits(got, e), pool_bits(want, e), pool_value(got, e, scale),
           pool_value(want, e, scale), 0, true};
      return b;
    }
  }
  return b;
}

// ------------------------------------------------------------ pool format

/// The pool row the op must store for `n` values of q's dtype at `src`:
/// the same bits (auto), their exact widening (float32), or the tool's fp8
/// encoding of fp32(x / scale) (an fp32 division, as the contract says).
void Engine::encode_row(const uint8_t* src, int64_t n, float scale, uint8_t* dst) const {
  if (kv_ == KvDtype::kAuto) {
    std::memcpy(dst, src, static_cast<size_t>(n) * E_);
    return;
  }
  thread_local std::vector<double> x;
  x.resize(static_cast<size_t>(n));
  load_row(dt_, src, n, x.data());
  if (kv_ == KvDtype::kFloat32) {
    float* d = reinterpret_cast<float*>(dst);
    for (int64_t e = 0; e < n; ++e) d[e] = static_cast<float>(x[e]);  // exact: a dtype value
    return;
  }
  for (int64_t e = 0; e < n; ++e) dst[e] = fp8_.encode(static_cast<float>(x[e]) / scale);
}

/// Pool elements as values in the units of k and v (fp8: decoded times scale).
void Engine::load_pool_row(const uint8_t* src, int64_t n, float scale, double* out) const {
  if (kv_ == KvDtype::kAuto) {
    load_row(dt_, src, n, out);
  } else if (kv_ == KvDtype::kFloat32) {
    load_row(Dtype::kF32, src, n, out);
  } else {
    for (int64_t e = 0; e < n; ++e) out[e] = fp8_.decode(src[e]) * static_cast<double>(scale);
  }
}

uint32_t Engine::pool_bits(const uint8_t* p, int64_t e) const {
  if (PE_ == 4) return reinterpret_cast<const uint32_t*>(p)[e];
  if (PE_ == 2) return reinterpret_cast<const uint16_t*>(p)[e];
  return p[e];
}

double Engine::pool_value(const uint8_t* p, int64_t e, float scale) const {
  double v;
  load_pool_row(p + e * PE_, 1, scale, &v);
  return v;
}

void Engine::report(const std::string& check, int64_t req, int64_t pos, int64_t slot, int64_t layer,
                    const Bad& b, const char* got_name, const char* want_name) const {
  std::ostringstream o;
  const int bytes = b.pool ? PE_ : E_;
  o << "MISMATCH (" << check << "): request " << req << ", token " << pos << ", layer " << layer
    << ", head " << b.head << "\n  at dim " << b.dim << " (position " << pos << ", slot " << slot
    << ", " << (b.pool ? pool_name() : dtype_name(dt_)) << "): " << got_name << " "
    << fmt_elem(bytes, b.got_bits, b.got) << ", " << want_name << " ";
  if (b.tol > 0 || std::strstr(want_name, "reference"))
    o << b.want << " (|diff| " << std::fabs(b.got - b.want) << " > tolerance " << b.tol << ")";
  else
    o << fmt_elem(bytes, b.want_bits, b.want);
  throw VerifyError(o.str());
}

// ------------------------------------------------------------ scheduling

void Engine::admit_and_build() {
  toks_.clear();
  chunks_.clear();
  decoders_.clear();
  int64_t budget = o_.max_batch_tokens;
  // 1. one decode token per request in its decode phase
  for (int64_t r : running_) {
    const Request& q = w_.requests[r];
    if (st_[r].prefilled == q.prompt_tokens) decoders_.push_back(r);
  }
  budget -= static_cast<int64_t>(decoders_.size());
  // 2. prefill chunks of admitted requests, in admission order
  for (int64_t r : running_) {
    const Request& q = w_.requests[r];
    if (budget <= 0) break;
    if (st_[r].prefilled < q.prompt_tokens) {
      const int64_t n = std::min(budget, q.prompt_tokens - st_[r].prefilled);
      chunks_.push_back({r, n});
      budget -= n;
    }
  }
  // 3. admit waiting requests (first come, first served) while the budget,
  //    the running limit and the pool (each request reserves its whole KV) allow
  while (budget > 0 && !waiting_.empty() &&
         static_cast<int64_t>(running_.size()) < o_.max_running) {
    const int64_t r = waiting_.front();
    const Request& q = w_.requests[r];
    if (reserved_ + q.kv_tokens() > P_) break;
    waiting_.pop_front();
    reserved_ += q.kv_tokens();
    st_[r].admitted = true;
    st_[r].slots.assign(static_cast<size_t>(q.kv_tokens()), -1);
    running_.push_back(r);
    const int64_t n = std::min(budget, q.prompt_tokens);
    chunks_.push_back({r, n});
    budget -= n;
  }
  // Tokens: decodes first (as engines order a mixed batch), then chunks.
  auto alloc = [&](int64_t r, int64_t pos) {
    if (free_.empty()) throw std::logic_error("ropekv-replay: free list empty (reservation bug)");
    const int32_t s = free_.front();
    free_.pop_front();
    // Free since its last owner finished (or since the start): untouched.
    check_unnamed(s, "before its reuse");
    if (ever_used_[s]) ++res_.slot_reuses;
    ever_used_[s] = 1;
    st_[r].slots[static_cast<size_t>(pos)] = s;
    owner_req_[s] = r;
    owner_pos_[s] = pos;
    toks_.push_back({r, pos, s});
  };
  for (int64_t r : decoders_) {
    const Request& q = w_.requests[r];
    const int64_t pos = q.prompt_tokens + st_[r].decoded;
    alloc(r, pos);
  }
  for (auto [r, n] : chunks_)
    for (int64_t i = 0; i < n; ++i) alloc(r, st_[r].prefilled + i);
  written_ = static_cast<int64_t>(toks_.size());
  decode_only_ = chunks_.empty() && !decoders_.empty();
  if (o_.pad_decode && decode_only_) {
    // CUDA-graph batch sizes as vLLM captures them: 1, 2, 4, then multiples of 8.
    const int64_t n = written_;
    const int64_t padded = n <= 1 ? 1 : n <= 2 ? 2 : n <= 4 ? 4 : (n + 7) / 8 * 8;
    for (int64_t i = n; i < padded; ++i) toks_.push_back({-1, 0, -1});
  }
  const size_t T = toks_.size();
  positions_.resize(T);
  slots_.resize(T);
  for (size_t t = 0; t < T; ++t) {
    positions_[t] = static_cast<int32_t>(toks_[t].pos);
    slots_[t] = static_cast<int32_t>(toks_[t].slot);
  }
}

void Engine::finish_step() {
  for (int64_t r : decoders_) {
    ++st_[r].decoded;
    ++kv_done_;
  }
  for (auto [r, n] : chunks_) {
    st_[r].prefilled += n;
    kv_done_ += n;
  }
  std::vector<int64_t> still;
  for (int64_t r : running_) {
    const Request& q = w_.requests[r];
    const int64_t decodes = q.output_tokens > 1 ? q.output_tokens - 1 : 0;
    if (st_[r].prefilled == q.prompt_tokens && st_[r].decoded == decodes) {
      // Finished: its cache must still be exactly what the calls wrote.
      const int64_t n = q.kv_tokens();
      const int64_t items = n * L_;
      std::atomic<int64_t> first_bad{items};
#pragma omp parallel for num_threads(nthreads()) schedule(static) if (items >= 256)
      for (int64_t i = 0; i < items; ++i) {
        if (i > first_bad.load(std::memory_order_relaxed)) continue;
        try {
          check_cached(r, i % n, i / n, "at finish");
        } catch (const VerifyError&) {
          int64_t cur = first_bad.load();
          while (i < cur && !first_bad.compare_exchange_weak(cur, i)) {}
        }
      }
      if (first_bad.load() < items) {
        const int64_t i = first_bad.load();
        check_cached(r, i % n, i / n, "at finish");  // throws with the message
      }
      res_.pool_rows_checked += items;
      for (int32_t s : st_[r].slots) {
        // Checked above: the rows become unnamed again, so that a stray
        // write into them shows when the slot is next taken (or at the end).
        fill_unnamed(s);
        owner_req_[s] = owner_pos_[s] = -1;
        free_.push_back(s);
      }
      reserved_ -= n;
      st_[r].finished = true;
      ++finished_;
    } else {
      still.push_back(r);
    }
  }
  running_.swap(still);
}

// ------------------------------------------------------------ one call

void Engine::call(int64_t layer, bool timed) {
  const int64_t T = static_cast<int64_t>(toks_.size());
  const DLDataType dl = dl_dtype(dt_);
  const DLDevice cpu{kDLCPU, 0};
  int64_t q_shape[3] = {T, Hq(), D()}, kv_shape[3] = {T, Hk(), D()}, idx_shape[1] = {T};
  int64_t pool_shape[3] = {P_, Hk(), D()}, w_shape[1] = {D()};
  const int64_t in_stride = o_.fused_qkv ? in_row() : 0;
  int64_t q_strides[3] = {o_.fused_qkv ? in_stride : qrow(), D(), 1};
  int64_t kv_strides[3] = {o_.fused_qkv ? in_stride : krow(), D(), 1};
  auto tensor = [&](void* data, int ndim, int64_t* shape, int64_t* strides, DLDataType type) {
    DLTensor x{};
    x.data = data;
    x.device = cpu;
    x.ndim = ndim;
    x.dtype = type;
    x.shape = shape;
    x.strides = strides;
    x.byte_offset = 0;
    return x;
  };
  const DLDataType i32{kDLInt, 32, 1};
  ropekv::RopePoolTensors t{};
  t.q = tensor(q_in(0), 3, q_shape, q_strides, dl);
  t.k = tensor(k_in(0), 3, kv_shape, kv_strides, dl);
  t.v = tensor(v_in(0), 3, kv_shape, kv_strides, dl);
  t.positions = tensor(positions_.data(), 1, idx_shape, nullptr, i32);
  t.slots = tensor(slots_.data(), 1, idx_shape, nullptr, i32);
  const DLDataType pool_dl = kv_ == KvDtype::kAuto      ? dl
                            : kv_ == KvDtype::kFloat32 ? DLDataType{kDLFloat, 32, 1}
                                                       : DLDataType{kDLUInt, 8, 1};
  t.k_pool = tensor(k_pool(layer, 0), 3, pool_shape, nullptr, pool_dl);
  t.v_pool = tensor(v_pool(layer, 0), 3, pool_shape, nullptr, pool_dl);
  t.q_rot = tensor(q_rot(0), 3, q_shape, nullptr, dl);
  t.k_rot = tensor(k_rot(0), 3, kv_shape, nullptr, dl);
  // The "rope-type" fault: this one call gets the next layer type's RoPE
  // parameters (a Gemma-3 sliding layer called with the full layers', or the
  // reverse), which the checks against the layer's own parameters must catch.
  size_t rope = m_.rope_index(layer);
  if (timed && o_.inject_fault == "rope-type" && !res_.fault_injected &&
      res_.calls >= o_.inject_at && written_ > 0) {
    const size_t wrong = (rope + 1) % m_.ropes.size();
    std::fprintf(stderr,
                 "ropekv-replay: injected fault rope-type at call %lld (layer %lld): the RoPE "
                 "parameters of layer type %zu instead of %zu\n",
                 static_cast<long long>(res_.calls), static_cast<long long>(layer), wrong, rope);
    rope = wrong;
    res_.fault_injected = true;
  }
  ropekv::RopeConfig cfg = rope_config(m_, m_.ropes[rope]);
  cfg.kv_cache_dtype = kv_ == KvDtype::kAuto      ? ropekv::KvCacheDtype::kAuto
                       : kv_ == KvDtype::kFloat32 ? ropekv::KvCacheDtype::kFloat32
                       : kv_ == KvDtype::kFp8E4M3 ? ropekv::KvCacheDtype::kFp8E4M3
                                                  : ropekv::KvCacheDtype::kFp8E5M2;
  cfg.k_scale = o_.k_scale;
  cfg.v_scale = o_.v_scale;
  if (qk_norm()) {
    cfg.norm_eps = m_.norm_eps;
    t.q_norm_weight = tensor(norm_weight(layer, true), 1, w_shape, nullptr, dl);
    t.k_norm_weight = tensor(norm_weight(layer, false), 1, w_shape, nullptr, dl);
    // The "qk-norm" fault: this one call normalises k with weights of ones
    // (q's weights stay), which the checks against the layer's weights must
    // catch.
    if (timed && o_.inject_fault == "qk-norm" && !res_.fault_injected && res_.calls >= o_.inject_at &&
        written_ > 0) {
      std::fprintf(stderr,
                   "ropekv-replay: injected fault qk-norm at call %lld (layer %lld): k normalised with "
                   "weights of ones\n",
                   static_cast<long long>(res_.calls), static_cast<long long>(layer));
      thread_local std::vector<uint8_t> ones;
      ones.resize(static_cast<size_t>(D()) * E_);
      for (int64_t d = 0; d < D(); ++d) store_elem(dt_, ones.data(), d, 1.0f);
      t.k_norm_weight.data = ones.data();
      res_.fault_injected = true;
    }
  }
  ropekv::ExecOptions ex;
  ex.num_threads = o_.threads;

  const auto t0 = Clock::now();
  try {
    ropekv::rope_pool_fused(t, cfg, ex);
  } catch (const ropekv::Error& e) {
    throw VerifyError(std::string("ropekv rejected a valid call (layer ") + std::to_string(layer) +
                      ", T " + std::to_string(T) + "): " + e.what());
  }
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (!timed) return;

  const double bytes = call_bytes(m_, dt_, kv_, T, written_);
  res_.op_seconds += s;
  res_.bytes += bytes;
  res_.call_us.push_back(s * 1e6);
  ++res_.calls;
  res_.tokens += T;
  res_.rows_written += written_;
  res_.max_call_tokens = std::max(res_.max_call_tokens, T);
  if (decode_only_) {
    ++res_.decode_only_calls;
    res_.decode_only_op_seconds += s;
    res_.decode_only_bytes += bytes;
  }
}

void Engine::check_call(int64_t layer) {
  // Every named pool row is bit for bit the encoding of the k_rot the call
  // returned and of the v it was given (the same bits for auto pools); record
  // the k row's hash for the checks after this step.
  const int64_t T = static_cast<int64_t>(toks_.size());
  std::atomic<int64_t> first_bad{T};
#pragma omp parallel for num_threads(nthreads()) schedule(static) if (T >= 64)
  for (int64_t t = 0; t < T; ++t) {
    const Token& tk = toks_[t];
    if (tk.slot < 0) continue;
    bool ok;
    if (kv_ == KvDtype::kAuto) {
      ok = std::memcmp(k_pool(layer, tk.slot), k_rot(t), krow_bytes()) == 0 &&
           std::memcmp(v_pool(layer, tk.slot), v_in(t), krow_bytes()) == 0;
    } else {
      thread_local std::vector<uint8_t> want;
      want.resize(pool_row_bytes());
      encode_row(k_rot(t), krow(), kscale_, want.data());
      ok = std::memcmp(k_pool(layer, tk.slot), want.data(), pool_row_bytes()) == 0;
      encode_row(v_in(t), krow(), vscale_, want.data());
      ok = ok && std::memcmp(v_pool(layer, tk.slot), want.data(), pool_row_bytes()) == 0;
    }
    if (!ok) {
      int64_t cur = first_bad.load();
      while (t < cur && !first_bad.compare_exchange_weak(cur, t)) {}
      continue;
    }
    for (int64_t hd = 0; hd < Hk(); ++hd)
      khash_[hash_index(layer, tk.slot, hd)] =
          hash_bytes(k_pool(layer, tk.slot) + hd * D() * PE_, static_cast<size_t>(D()) * PE_);
  }
  if (first_bad.load() < T) {
    const int64_t t = first_bad.load();
    const Token& tk = toks_[t];
    std::vector<uint8_t> want(pool_row_bytes());
    encode_row(k_rot(t), krow(), kscale_, want.data());
    Bad b = compare_pool_bits(k_pool(layer, tk.slot), want.data(), krow(), kscale_);
    const bool enc = kv_ != KvDtype::kAuto;
    if (b.bad)
      report(enc ? "k pool row vs the encoding of the k_rot the call returned"
                 : "k pool row vs the k_rot the call returned",
             tk.req, tk.pos, tk.slot, layer, b, "k_pool", enc ? "encode(k_rot)" : "k_rot");
    encode_row(v_in(t), krow(), vscale_, want.data());
    b = compare_pool_bits(v_pool(layer, tk.slot), want.data(), krow(), vscale_);
    report(enc ? "v pool row vs the encoding of the v given to the call" : "v pool row vs the v given to the call",
           tk.req, tk.pos, tk.slot, layer, b, "v_pool", enc ? "encode(v)" : "v");
  }
}

void Engine::spot_check(int64_t layer) {
  // The samples of this step that fall on this layer, each against
  // ropekv::reference::rope_head itself when the frequencies are unscaled
  // (interleaved pairs through a permutation: they are NeoX pairs of the
  // de-interleaved head), else against the tool's float64 rotation.
  const int64_t Dd = D(), h = R() / 2;
  const LayerRope& lr = m_.rope(layer);
  const bool use_reference = lr.rope_scaling.type == ropekv::RopeScalingType::kNone;
  std::vector<double> x(Dd), y(Dd), z(Dd), ref(Dd);
  auto one = [&](bool is_q, int64_t t, int64_t hd) {
    const Token& tk = toks_[t];
    const uint8_t* in = (is_q ? q_in(t) : k_in(t)) + hd * Dd * E_;
    const uint8_t* out = (is_q ? q_rot(t) : k_rot(t)) + hd * Dd * E_;
    load_row(dt_, in, Dd, x.data());
    norm_ref(x.data(), 1, layer, is_q);
    if (!use_reference) {
      rotate_ref(x.data(), layer, tk.pos, ref.data());
    } else if (m_.is_neox) {
      ropekv::reference::rope_head(x.data(), ref.data(), Dd, R(), tk.pos, lr.rope_theta);
    } else {
      y = x;
      for (int64_t i = 0; i < h; ++i) y[i] = x[2 * i], y[i + h] = x[2 * i + 1];
      ropekv::reference::rope_head(y.data(), z.data(), Dd, R(), tk.pos, lr.rope_theta);
      ref = z;
      for (int64_t i = 0; i < h; ++i) ref[2 * i] = z[i], ref[2 * i + 1] = z[i + h];
    }
    const double* cs = cos_sin(layer, tk.pos);
    for (int64_t d = 0; d < Dd; ++d) {
      const double g = load_elem(dt_, out, d);
      double tol = qk_norm() ? rope_tolerance(dt_, ref[d], x[d], 0.0, -1.0, rel_) : 0.0;
      if (d < R()) {
        const int64_t i = m_.is_neox ? (d < h ? d : d - h) : d / 2;
        const int64_t partner = m_.is_neox ? (d < h ? d + h : d - h) : (d ^ 1);
        tol = rope_tolerance(dt_, ref[d], x[d] * cs[i], x[partner] * cs[h + i], -1.0, rel_);
      }
      if (!(std::fabs(g - ref[d]) <= tol)) {
        Bad b{true, hd, d, elem_bits(dt_, out, d), 0, g, ref[d], tol};
        const std::string what = use_reference ? " spot check vs ropekv::reference"
                                                : " spot check vs the float64 rotation with scaled frequencies";
        report((is_q ? "q_rot" : "k_rot") + what, tk.req, tk.pos, tk.slot, layer, b, is_q ? "q_rot" : "k_rot",
               "reference");
      }
    }
    ++res_.spot_checked_heads;
  };
  for (const Sample& p : spot_q_)
    if (p.layer == layer) one(true, p.token, p.head);
  for (const Sample& p : spot_k_)
    if (p.layer == layer) one(false, p.token, p.head);
}

void Engine::check_all(int64_t layer) {
  const int64_t T = static_cast<int64_t>(toks_.size());
  std::atomic<int64_t> first_bad{T};
#pragma omp parallel for num_threads(nthreads()) schedule(static) if (T >= 8)
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> x(static_cast<size_t>(qrow()));
    const Token& tk = toks_[t];
    load_row(dt_, q_in(t), qrow(), x.data());
    norm_ref(x.data(), Hq(), layer, true);
    bool bad = compare_rotated(q_rot(t), false, x.data(), layer, tk.pos, Hq()).bad;
    if (!bad) {
      load_row(dt_, k_in(t), krow(), x.data());
      norm_ref(x.data(), Hk(), layer, false);
      bad = compare_rotated(k_rot(t), false, x.data(), layer, tk.pos, Hk()).bad;
    }
    if (bad) {
      int64_t cur = first_bad.load();
      while (t < cur && !first_bad.compare_exchange_weak(cur, t)) {}
    }
  }
  if (first_bad.load() < T) {
    const int64_t t = first_bad.load();
    const Token& tk = toks_[t];
    std::vector<double> x(static_cast<size_t>(qrow()));
    for (int64_t e = 0; e < qrow(); ++e) x[e] = load_elem(dt_, q_in(t), e);
    norm_ref(x.data(), Hq(), layer, true);
    Bad b = compare_rotated(q_rot(t), false, x.data(), layer, tk.pos, Hq());
    if (b.bad) report("q_rot vs reference (--check-all)", tk.req, tk.pos, tk.slot, layer, b, "q_rot", "reference");
    for (int64_t e = 0; e < krow(); ++e) x[e] = load_elem(dt_, k_in(t), e);
    norm_ref(x.data(), Hk(), layer, false);
    b = compare_rotated(k_rot(t), false, x.data(), layer, tk.pos, Hk());
    report("k_rot vs reference (--check-all)", tk.req, tk.pos, tk.slot, layer, b, "k_rot", "reference");
  }
}

/// The cached K/V of token `pos` of request `req` at `layer`: v is bit for
/// bit the encoding of the v generated for it, k is the float64 rotation of
/// its k within the tolerance, and bit for bit the row the call wrote (hash).
void Engine::check_cached(int64_t req, int64_t pos, int64_t layer, const char* when) const {
  const int64_t slot = st_[req].slots[static_cast<size_t>(pos)];
  thread_local std::vector<uint8_t> regen, want;
  thread_local std::vector<double> x;
  regen.resize(krow_bytes());
  want.resize(pool_row_bytes());
  x.resize(static_cast<size_t>(krow()));
  gen_row(key(req, pos, layer, 2), krow(), regen.data());
  encode_row(regen.data(), krow(), vscale_, want.data());
  Bad b = compare_pool_bits(v_pool(layer, slot), want.data(), krow(), vscale_);
  if (b.bad)
    report(std::string("v pool row ") + when + " vs the v generated for the token", req, pos, slot, layer,
           b, "v_pool", kv_ == KvDtype::kAuto ? "v" : "encode(v)");
  gen_row(key(req, pos, layer, 1), krow(), regen.data());
  load_row(dt_, regen.data(), krow(), x.data());
  norm_ref(x.data(), Hk(), layer, false);
  b = compare_rotated(k_pool(layer, slot), true, x.data(), layer, pos, Hk());
  if (b.bad)
    report(std::string("k pool row ") + when + " vs float64 reference of k rotated at its position", req,
           pos, slot, layer, b, "k_pool", "reference");
  for (int64_t hd = 0; hd < Hk(); ++hd) {
    const uint8_t* row = k_pool(layer, slot) + hd * D() * PE_;
    if (hash_bytes(row, static_cast<size_t>(D()) * PE_) == khash_[hash_index(layer, slot, hd)]) continue;
    // Changed since the call wrote it, yet within the tolerance (a flipped
    // low bit). Name the first element that is not the nearest rounding of
    // the reference: that is where the row was changed. (An fp8 row is
    // rounded twice, so no element can be named that way.)
    std::ostringstream o;
    o << "MISMATCH (k pool row " << when << " is not the row the call wrote: its hash differs): request "
      << req << ", token " << pos << ", layer " << layer << ", head " << hd << "\n  slot " << slot;
    if (!is_fp8(kv_)) {
      Bad h = compare_rotated(row, true, x.data() + hd * D(), layer, pos, 1, 0.5);
      if (h.bad)
        o << ", dim " << h.dim << ": k_pool " << fmt_elem(PE_, h.got_bits, h.got) << ", reference " << h.want
          << " (more than half an ulp off: not the nearest rounding)";
    }
    throw VerifyError(o.str());
  }
}

void Engine::verify_pool_end() {
  // Every slot a running request holds has that request's rows; every other
  // row (never named, or freed and refilled) still holds the fill pattern.
  std::atomic<int64_t> first_bad{P_};
  std::atomic<int64_t> untouched{0}, checked{0};
#pragma omp parallel for num_threads(nthreads()) schedule(dynamic, 16)
  for (int64_t s = 0; s < P_; ++s) {
    if (s > first_bad.load(std::memory_order_relaxed)) continue;
    bool bad = false;
    if (owner_req_[s] >= 0) {
      try {
        for (int64_t l = 0; l < L_; ++l) check_cached(owner_req_[s], owner_pos_[s], l, "after the run");
      } catch (const VerifyError&) {
        bad = true;
      }
      checked += L_;
    } else {
      for (int64_t l = 0; l < L_ && !bad; ++l) bad = !unnamed_intact(l, static_cast<int32_t>(s));
      untouched += L_;
    }
    if (bad) {
      int64_t cur = first_bad.load();
      while (s < cur && !first_bad.compare_exchange_weak(cur, s)) {}
    }
  }
  res_.pool_rows_checked += checked.load();
  res_.untouched_rows_checked += untouched.load();
  if (first_bad.load() < P_) {
    const int64_t s = first_bad.load();
    if (owner_req_[s] >= 0) {
      for (int64_t l = 0; l < L_; ++l) check_cached(owner_req_[s], owner_pos_[s], l, "after the run");
    }
    check_unnamed(static_cast<int32_t>(s), "after the run");
  }
}

void Engine::fill_unnamed(int32_t s) {
  for (int64_t l = 0; l < L_; ++l) {
    std::memset(k_pool(l, s), 0xFF, pool_row_bytes());
    std::memset(v_pool(l, s), 0xFF, pool_row_bytes());
  }
}

bool Engine::unnamed_intact(int64_t layer, int32_t s) const {
  const size_t kb = pool_row_bytes();
  for (const uint8_t* p : {k_pool(layer, s), v_pool(layer, s)})
    for (size_t i = 0; i < kb; ++i)
      if (p[i] != 0xFF) return false;
  return true;
}

void Engine::check_unnamed(int32_t s, const char* when) const {
  for (int64_t l = 0; l < L_; ++l) {
    if (unnamed_intact(l, s)) continue;
    for (int kv = 0; kv < 2; ++kv) {
      const uint8_t* p = kv ? v_pool(l, s) : k_pool(l, s);
      for (int64_t e = 0; e < krow(); ++e) {
        if (pool_bits(p, e) != (PE_ == 4 ? 0xFFFFFFFFu : PE_ == 2 ? 0xFFFFu : 0xFFu)) {
          std::ostringstream o;
          o << "MISMATCH (" << (kv ? "v" : "k") << " pool row that no call named was written, found "
            << when << "): request -, token -, layer " << l << ", head " << e / D() << "\n  slot " << s
            << ", dim " << e % D() << ": "
            << fmt_elem(PE_, pool_bits(p, e), pool_value(p, e, kv ? vscale_ : kscale_))
            << ", expected the fill pattern (all bits set)";
          throw VerifyError(o.str());
        }
      }
    }
  }
}

// ------------------------------------------------------------ faults

void Engine::maybe_inject_before_checks(int64_t layer) {
  const std::string& f = o_.inject_fault;
  if (f.empty() || res_.fault_injected || res_.calls - 1 < o_.inject_at) return;
  const Sample* sq = nullptr;
  for (const Sample& p : spot_q_)
    if (p.layer == layer) { sq = &p; break; }
  if (f == "q-rot" && sq) {
    const int64_t t = sq->token, h = sq->head;
    uint8_t* p = q_rot(t) + (h * D() + 1) * E_;
    if (dt_ == Dtype::kF32) *reinterpret_cast<uint32_t*>(p) ^= 0x40000000u;
    else *reinterpret_cast<uint16_t*>(p) ^= 0x4000u;
    res_.fault_injected = true;
  } else if (f == "k-rot" && written_ > 0) {
    uint8_t* p = k_rot(0) + ((Hk() - 1) * D() + 1) * E_;
    p[0] ^= 1;
    res_.fault_injected = true;
  }
  if (res_.fault_injected)
    std::fprintf(stderr, "ropekv-replay: injected fault %s after call %lld (layer %lld)\n", f.c_str(),
                 static_cast<long long>(res_.calls - 1), static_cast<long long>(layer));
}

void Engine::maybe_inject_after_checks(int64_t layer) {
  const std::string& f = o_.inject_fault;
  if (f.empty() || res_.fault_injected || res_.calls - 1 < o_.inject_at) return;
  if ((f == "pool-k" || f == "pool-v") && written_ > 0) {
    const Token& tk = toks_[0];
    uint8_t* row = f == "pool-k" ? k_pool(layer, tk.slot) : v_pool(layer, tk.slot);
    row[((Hk() - 1) * D() + 1) * PE_] ^= 1;  // the lowest bit of (head Hk-1, dim 1)
    res_.fault_injected = true;
    std::fprintf(stderr,
                 "ropekv-replay: injected fault %s after call %lld: request %lld, token %lld, layer %lld, "
                 "head %lld, dim 1 (slot %lld)\n",
                 f.c_str(), static_cast<long long>(res_.calls - 1), static_cast<long long>(tk.req),
                 static_cast<long long>(tk.pos), static_cast<long long>(layer),
                 static_cast<long long>(Hk() - 1), static_cast<long long>(tk.slot));
  } else if (f == "stray" && !free_.empty()) {
    // A write to a row no call names: prefer a slot that was never used.
    // (the last one in the free list: the allocator reaches it last).
    int32_t s = free_.back();
    for (auto it = free_.rbegin(); it != free_.rend(); ++it)
      if (!ever_used_[*it]) { s = *it; break; }
    k_pool(layer, s)[0] ^= 1;
    res_.fault_injected = true;
    std::fprintf(stderr, "ropekv-replay: injected fault stray after call %lld: layer %lld, slot %d\n",
                 static_cast<long long>(res_.calls - 1), static_cast<long long>(layer), s);
  }
}

// ------------------------------------------------------------ progress

void Engine::progress(bool final) {
  if (!o_.progress) return;
  const auto now = Clock::now();
  if (!final && now - last_progress_ < std::chrono::milliseconds(100)) return;
  last_progress_ = now;
  const double frac = kv_total_ ? static_cast<double>(kv_done_) / static_cast<double>(kv_total_) : 1.0;
  const int width = 30;
  const int fill = static_cast<int>(frac * width);
  char bar[width + 1];
  for (int i = 0; i < width; ++i) bar[i] = i < fill ? '#' : '.';
  bar[width] = 0;
  std::fprintf(stderr, "\r[%s] %3d%%  step %lld  requests %lld/%lld done, %zu running  calls %lld   ", bar,
               static_cast<int>(frac * 100), static_cast<long long>(res_.steps),
               static_cast<long long>(finished_), static_cast<long long>(w_.requests.size()),
               running_.size(), static_cast<long long>(res_.calls));
  if (final) std::fprintf(stderr, "\n");
  std::fflush(stderr);
}

// ------------------------------------------------------------ run

ReplayResult Engine::run() {
  const auto wall0 = Clock::now();
  L_ = o_.layers > 0 ? std::min(o_.layers, m_.num_layers) : m_.num_layers;
  res_.layers = L_;
  int64_t largest = 1, max_pos = 0;
  for (const Request& r : w_.requests) {
    largest = std::max(largest, r.kv_tokens());
    max_pos = std::max(max_pos, r.kv_tokens() - 1);
    kv_total_ += r.kv_tokens();
    res_.prompt_tokens += r.prompt_tokens;
    res_.output_tokens += r.output_tokens;
  }
  res_.requests = static_cast<int64_t>(w_.requests.size());
  P_ = o_.pool_size > 0 ? o_.pool_size : std::max(largest, std::min<int64_t>(kv_total_, 4096));
  if (largest > P_)
    throw InputError("a request needs " + std::to_string(largest) + " KV slots but the pool has " +
                     std::to_string(P_) + " (--pool-size): it could never be scheduled");
  if (P_ > std::numeric_limits<int32_t>::max())
    throw InputError(o_.pool_size > 0 ? std::string("--pool-size must be < 2^31 (int32 slots)")
                                      : "a request needs " + std::to_string(largest) +
                                            " KV slots; a pool holds at most 2^31 - 1 (int32 slots)");
  res_.pool_size = P_;

  // The pools, filled with all-ones bits: rows no call names must keep them.
  const int64_t pool_bytes = buffer_size("KV pools", {2, L_, P_, krow(), PE_});
  // Buffers for the largest step (decodes + budget, padding to a multiple of 8).
  const int64_t Tmax = o_.max_batch_tokens + o_.max_running + 8;
  const auto step = [&](int64_t row) { return buffer_size("step's q/k/v buffers", {Tmax, row, E_}); };
  std::vector<int64_t> parts = {pool_bytes, step(qrow()), step(krow())};  // (pools, q_rot, k_rot)
  if (o_.fused_qkv)
    parts.push_back(step(in_row()));
  else
    parts.insert(parts.end(), {step(qrow()), step(krow()), step(krow())});
  int64_t total = 0;
  for (const int64_t b : parts)
    if (__builtin_add_overflow(total, b, &total)) total = INT64_MAX;  // (past any memory)
  check_fits_in_memory(total);
  pool_.reserve(static_cast<size_t>(pool_bytes));
  std::memset(pool_.data(), 0xFF, static_cast<size_t>(pool_bytes));
  khash_.assign(static_cast<size_t>(buffer_size("pool row hashes", {L_, P_, Hk(), 8}) / 8), 0);
  owner_req_.assign(static_cast<size_t>(P_), -1);
  owner_pos_.assign(static_cast<size_t>(P_), -1);
  ever_used_.assign(static_cast<size_t>(P_), 0);
  for (int64_t s = 0; s < P_; ++s) free_.push_back(static_cast<int32_t>(s));
  st_.assign(w_.requests.size(), ReqState{});
  for (const Request& r : w_.requests) waiting_.push_back(r.id);

  make_table();
  make_cos_sin(max_pos);
  make_norm_weights();

  if (o_.fused_qkv) {
    in_.reserve(static_cast<size_t>(step(in_row())));
  } else {
    q_.reserve(static_cast<size_t>(step(qrow())));
    k_.reserve(static_cast<size_t>(step(krow())));
    v_.reserve(static_cast<size_t>(step(krow())));
  }
  qrot_.reserve(static_cast<size_t>(step(qrow())));
  krot_.reserve(static_cast<size_t>(step(krow())));
  // Touch them now: first-touch page faults are not the op's cost.
  for (Buffer* b : {&in_, &q_, &k_, &v_, &qrot_, &krot_})
    if (b->size()) std::memset(b->data(), 0, b->size());

  // One untimed call before the run, T = 1 with slot -1 (writes no pool
  // row), so that the OpenMP thread pool's start is not in the first call.
  toks_.assign(1, Token{});
  positions_.assign(1, 0);
  slots_.assign(1, -1);
  written_ = 0;
  generate_inputs(0);
  call(0, /*timed=*/false);

  while (finished_ < res_.requests) {
    admit_and_build();
    if (toks_.empty())
      throw std::logic_error("ropekv-replay: scheduler made no progress (a bug of the tool)");
    ++res_.steps;
    if (decode_only_) ++res_.decode_only_steps;
    const int64_t T = static_cast<int64_t>(toks_.size());
    Rng pick(mix_key(o_.seed, 0x5B07, static_cast<uint64_t>(res_.steps), 0, 0));
    spot_q_.clear();
    spot_k_.clear();
    for (int i = 0; i < o_.spot_checks; ++i) {
      const auto l1 = static_cast<int64_t>(pick.below(L_)), t1 = static_cast<int64_t>(pick.below(T));
      spot_q_.push_back({l1, t1, static_cast<int64_t>(pick.below(Hq()))});
      const auto l2 = static_cast<int64_t>(pick.below(L_)), t2 = static_cast<int64_t>(pick.below(T));
      spot_k_.push_back({l2, t2, static_cast<int64_t>(pick.below(Hk()))});
    }
    for (int64_t layer = 0; layer < L_; ++layer) {
      generate_inputs(layer);
      call(layer);
      maybe_inject_before_checks(layer);
      check_call(layer);
      spot_check(layer);
      if (o_.check_all) check_all(layer);
      maybe_inject_after_checks(layer);
    }
    finish_step();
    progress(false);
    if (res_.rss_warm_mb == 0 && finished_ * 10 >= res_.requests) res_.rss_warm_mb = resident_mb();
  }
  progress(true);
  res_.rss_end_mb = resident_mb();
  verify_pool_end();
  res_.wall_seconds = seconds_since(wall0);
  if (!o_.inject_fault.empty() && !res_.fault_injected)
    throw InputError("--inject-fault " + o_.inject_fault + ": the run ended (" + std::to_string(res_.calls) +
                     " calls) before the fault could be injected at call " + std::to_string(o_.inject_at));
  return res_;
}

}  // namespace

double resident_mb() {
  // Linux: /proc/self/statm, second field = resident pages.
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return -1;
  long long size = 0, resident = 0;
  const int n = std::fscanf(f, "%lld %lld", &size, &resident);
  std::fclose(f);
  if (n != 2) return -1;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / 1e6;
}

double call_bytes(const ModelConfig& m, Dtype t, KvDtype kv, int64_t tokens, int64_t written) {
  const double E = elem_size(t), PE = pool_elem_size(kv, t);
  const double T = static_cast<double>(tokens), W = static_cast<double>(written);
  const double Hq = static_cast<double>(m.num_qo_heads), Hk = static_cast<double>(m.num_kv_heads),
               D = static_cast<double>(m.head_dim);
  return E * (2 * T * Hq * D + 3 * T * Hk * D) + PE * (2 * W * Hk * D) + T * (4 + 4);
}

ReplayResult run_replay(const ModelConfig& model, const Workload& workload, const ReplayOptions& opt) {
  Engine e(model, workload, opt);
  return e.run();
}

}  // namespace replay
