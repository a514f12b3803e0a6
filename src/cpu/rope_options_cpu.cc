// CPU backend, options path: every call that is not is_plain(p) (interleaved
// pairs, a cos_sin_cache, QK-norm, float32 and fp8 pools, in place; yarn's
// attention factor alone takes the plain path), on the same thread plan as the plain path
// (rope_pool_cpu.cc). The kernels are in rope_options-inl.h; this file holds
// their NeoX-pair instantiations and the per-call setup, and
// rope_options_interleaved_cpu.cc the interleaved ones: translation units of
// their own, whose many instantiations compile in parallel with each other
// and with the plain path.

#include <algorithm>
#include <cstring>
#include <vector>

#include "backends.h"
#include "cpu/host.h"
#include "cpu/scratch.h"
#include "problem.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/rope_options_cpu.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "cpu/rope_options-inl.h"
#include "cpu/rope_pool_cpu-inl.h"

HWY_BEFORE_NAMESPACE();
namespace ropekv {
namespace cpu {
namespace HWY_NAMESPACE {

// The options path with NeoX pairs: see rope_options-inl.h.
void ProcessOptionsNeox(const OptWork& w) { RunOptionsLayout<false>(w); }

void OptionsCosSinTable(const Problem& p, const OptionData& od, float* table, int64_t stride,
                        const Scratch& sc) {
  CosSinTableOpt(p, od, table, stride, sc);
}

}  // namespace HWY_NAMESPACE
}  // namespace cpu
}  // namespace ropekv
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ropekv {
namespace cpu {

HWY_EXPORT(ProcessOptionsNeox);
HWY_EXPORT(OptionsCosSinTable);

namespace {
using namespace host;

// A unit of the options path, through the pair layout's kernels.
void process(const OptWork& w) {
  if (w.p->is_neox) return HWY_DYNAMIC_DISPATCH(ProcessOptionsNeox)(w);
  process_options_interleaved(w);
}

// Element i of the float array `data` of `dtype`, widened exactly to fp32.
float widen(const void* data, FloatType dtype, int64_t i) {
  if (dtype == FloatType::kF32) return static_cast<const float*>(data)[i];
  const uint16_t h = static_cast<const uint16_t*>(data)[i];
  uint32_t u;
  if (dtype == FloatType::kBF16) {
    u = static_cast<uint32_t>(h) << 16;
  } else {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1F) {
      u = sign | 0x7F800000u | (m << 13);  // Inf, NaN
    } else if (e != 0) {
      u = sign | ((e + 112u) << 23) | (m << 13);
    } else {  // zero or subnormal: m * 2^-24, exact in fp32
      const float f = static_cast<float>(m) * 5.9604644775390625e-8f;
      std::memcpy(&u, &f, 4);
      u |= sign;
    }
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// QK-norm weight w widened to fp32 into out [padded], zeros after D; null
// when absent.
const float* widen_weight(const Weight& w, int64_t D, int64_t padded, float* out) {
  if (w.data == nullptr) return nullptr;
  for (int64_t d = 0; d < padded; ++d) out[d] = d < D ? widen(w.data, w.dtype, d * w.stride) : 0.0f;
  return out;
}

int64_t option_bytes_written(const Problem& p) {
  const int64_t e = element_size(p.dtype), pe = element_size(p.pool_type);
  return p.num_tokens * p.head_dim *
         (e * (p.num_qo_heads + p.num_kv_heads) + pe * 2 * p.num_kv_heads);
}

int64_t option_bytes_moved(const Problem& p) {
  const int64_t e = element_size(p.dtype), pe = element_size(p.pool_type);
  return p.num_tokens * p.head_dim *
         (e * (2 * p.num_qo_heads + 3 * p.num_kv_heads) + pe * 2 * p.num_kv_heads);
}

}  // namespace

// Every call that is not is_plain: the same thread plan as the plain path,
// through the options kernels. Results do not depend on the plan: each
// element is computed from its own head alone.
void run_options(const Problem& p, const ExecOptions& options) {
  OptionData od;
  if (p.cos_sin_cache.data == nullptr) od.inv_freq = inv_freq_table(p.freq);
  // The weights once per call, read by every thread. Padded beyond a vector
  // past D: the kernels' tail vectors read whole vectors.
  thread_local std::vector<float> weights;
  const int64_t wp = round_up(p.head_dim, kPad) + kPad;
  if (weights.size() < static_cast<size_t>(2 * wp)) weights.resize(2 * wp);
  od.q_norm = widen_weight(p.q_norm, p.head_dim, wp, weights.data());
  od.k_norm = widen_weight(p.k_norm, p.head_dim, wp, weights.data() + wp);

  const int64_t T = p.num_tokens;
  const int64_t heads = p.num_qo_heads + p.num_kv_heads;
  const bool stream = option_bytes_written(p) >= kStreamMinBytes;
  // Few large tokens: their cos/sin once, in the caller's table (see
  // run_planned); the threads read it through `tab` (a thread_local named in
  // a lambda they run would be their own).
  thread_local std::vector<float> table;
  float* tab = nullptr;
  const int64_t part = round_up(p.is_neox ? p.rotary_dim / 2 : p.rotary_dim, kPad);
  const int64_t stride = 2 * part;
  const int threads = plan_threads(options, option_bytes_moved(p));
  TeamScratch& team = team_scratch(p, threads);
  run_planned(
      T, heads, threads,
      [&](int64_t t0, int64_t t1) {
        const Scratch sc = team.mine();
        process(OptWork{&p, &od, &sc, t0, t1, false, stream, nullptr, nullptr, 0, 0});
      },
      [&] {
        if (table.size() < static_cast<size_t>(T * stride)) table.resize(T * stride);
        tab = table.data();
        HWY_DYNAMIC_DISPATCH(OptionsCosSinTable)(p, od, tab, stride, team.of(0));
      },
      [&](int64_t t, int64_t h0, int64_t h1) {
        const float* row = tab + t * stride;
        const Scratch sc = team.mine();
        process(OptWork{&p, &od, &sc, t, t + 1, true, stream, row, row + part, h0, h1});
      });
}

}  // namespace cpu
}  // namespace ropekv
#endif  // HWY_ONCE
