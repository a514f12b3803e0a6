// ggml (llama.cpp's tensor library, CPU backend) doing ropekv's step, the
// peer column "ggml" of bench/cpu_peers.py: one graph per shape of
//
//   q_rot = ggml_rope_ext(q, positions, NeoX)       [D, Hq, T]
//   k_rot = ggml_rope_ext(k, positions, NeoX)       [D, Hk, T]
//   ggml_set_rows(k_cache, reshape(k_rot), slots)   cache [Hk * D, P]
//   ggml_set_rows(v_cache, reshape(v), slots)
//
// as llama.cpp's graph builds it, with I32 positions and slots, under the
// cold protocol of bench/cpu_bench.cc (bench/cold_protocol.h): pools of at
// least 2x the last-level cache, slots fresh random rows, and input/output
// sets rotated so that no call finds its inputs in cache. Before each
// ggml_graph_compute the graph's leaves (and the views over them) are pointed
// at the next set; the plan is made once, with n_threads = 1 or 2 (ggml built
// with OpenMP: its thread team is reused across calls). ggml's rope has no
// bf16 kernel, so the rows that stand for bf16 run f16 (the same bytes).
//
// Each row first checks the call against a float64 reference of SPEC
// section 2 on its first set (q_rot and k_rot of the first and last 32
// tokens, the pool rows of the first and last token) and reports the largest difference as
// max_err: ggml builds the angle by repeated multiplication of the frequency
// ratio, so at positions near 1.3e5 its fp32 angles differ from
// fp32(pos) * inv_freq by a few ulps of the angle; a difference over 0.05
// stops the row (a wrong graph, not rounding).
//
// Built and run by bench/ggml/run.sh (ggml from its source, pinned); the
// counters are those of bench/cpu_bench.cc.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cold_protocol.h"
#include "ggml-cpu.h"
#include "ggml.h"

namespace {

using bench::Buffer;
using bench::Model;
using bench::Role;

double element(const uint8_t* p, int64_t i, bool f16) {
  if (!f16) return reinterpret_cast<const float*>(p)[i];
  return ggml_fp16_to_fp32(reinterpret_cast<const ggml_fp16_t*>(p)[i]);
}

// The largest difference between the row-major [H, D] heads at `got` and the
// float64 NeoX rotation of `x` at `position` (SPEC section 2).
double max_rope_err(const uint8_t* x, const uint8_t* got, int64_t H, int64_t D, double base,
                    int64_t position, bool f16) {
  double err = 0;
  const int64_t half = D / 2;
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t i = 0; i < half; ++i) {
      const double inv_freq = std::pow(base, -2.0 * static_cast<double>(i) / D);
      const double a = static_cast<double>(position) * inv_freq;
      const double x1 = element(x, h * D + i, f16), x2 = element(x, h * D + half + i, f16);
      const double r1 = x1 * std::cos(a) - x2 * std::sin(a);
      const double r2 = x2 * std::cos(a) + x1 * std::sin(a);
      err = std::max({err, std::abs(element(got, h * D + i, f16) - r1),
                      std::abs(element(got, h * D + half + i, f16) - r2)});
    }
  }
  return err;
}

void BM_Ggml(benchmark::State& state, Model m, bool f16, int threads) {
  const int64_t T = state.range(0);
  const int64_t E = f16 ? 2 : 4;
  const ggml_type type = f16 ? GGML_TYPE_F16 : GGML_TYPE_F32;
  const int64_t q_elems = T * m.hq * m.d, k_elems = T * m.hk * m.d;
  const int64_t row_bytes = m.hk * m.d * E;
  const bench::ColdLayout lay =
      bench::cold_layout(T, row_bytes, E * (2 * q_elems + 3 * k_elems) + 8 * T, false, false);
  const int64_t P = lay.P, sets = lay.sets();
  Buffer k_cache(P * row_bytes, Role::kPool), v_cache(P * row_bytes, Role::kPool);
  Buffer q(lay.in_sets * q_elems * E), k(lay.in_sets * k_elems * E), v(lay.in_sets * k_elems * E);
  Buffer q_rot(lay.in_sets * q_elems * E), k_rot(lay.in_sets * k_elems * E);
  Buffer pos(lay.in_sets * T * 4), slot(lay.slot_sets * T * 4);
  std::mt19937_64 rng(1234);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  for (const Buffer* b : {&q, &k, &v}) {
    const int64_t n = static_cast<int64_t>(b->n) / E;
    for (int64_t i = 0; i < n; ++i) {
      const float f = uni(rng);
      if (f16) reinterpret_cast<ggml_fp16_t*>(b->get())[i] = ggml_fp32_to_fp16(f);
      else reinterpret_cast<float*>(b->get())[i] = f;
    }
  }
  auto* slots = reinterpret_cast<int32_t*>(slot.get());
  auto* positions = reinterpret_cast<int32_t*>(pos.get());
  bench::fill_slots_and_positions(lay, T, slots, positions, rng);

  // The graph: tensors without storage of their own, pointed at our buffers.
  ggml_init_params ip{};
  ip.mem_size = 64 * ggml_tensor_overhead() + ggml_graph_overhead();
  ip.no_alloc = true;
  ggml_context* ctx = ggml_init(ip);
  ggml_tensor* tq = ggml_new_tensor_3d(ctx, type, m.d, m.hq, T);
  ggml_tensor* tk = ggml_new_tensor_3d(ctx, type, m.d, m.hk, T);
  ggml_tensor* tv = ggml_new_tensor_3d(ctx, type, m.d, m.hk, T);
  ggml_tensor* tpos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, T);
  ggml_tensor* tslot = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, T);
  ggml_tensor* kc = ggml_new_tensor_2d(ctx, type, m.hk * m.d, P);
  ggml_tensor* vc = ggml_new_tensor_2d(ctx, type, m.hk * m.d, P);
  kc->data = k_cache.get();
  vc->data = v_cache.get();
  const float base = static_cast<float>(m.base);
  // (n_ctx_orig 0, freq_scale 1, ext_factor 0: plain RoPE, no YaRN ramp.)
  ggml_tensor* qr = ggml_rope_ext(ctx, tq, tpos, nullptr, static_cast<int>(m.d),
                                  GGML_ROPE_TYPE_NEOX, 0, base, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f);
  ggml_tensor* kr = ggml_rope_ext(ctx, tk, tpos, nullptr, static_cast<int>(m.d),
                                  GGML_ROPE_TYPE_NEOX, 0, base, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f);
  ggml_tensor* kr2 = ggml_reshape_2d(ctx, kr, m.hk * m.d, T);
  ggml_tensor* v2 = ggml_reshape_2d(ctx, tv, m.hk * m.d, T);
  ggml_tensor* sk = ggml_set_rows(ctx, kc, kr2, tslot);
  ggml_tensor* sv = ggml_set_rows(ctx, vc, v2, tslot);
  ggml_cgraph* gf = ggml_new_graph(ctx);
  ggml_build_forward_expand(gf, qr);
  ggml_build_forward_expand(gf, sk);
  ggml_build_forward_expand(gf, sv);
  ggml_cplan plan = ggml_graph_plan(gf, threads, nullptr);
  std::vector<uint8_t> work(plan.work_size + 1);
  plan.work_data = work.data();

  auto point = [&](int64_t c) {
    const int64_t s = c % lay.in_sets, ss = c % lay.slot_sets;
    tq->data = q.get() + s * q_elems * E;
    tk->data = k.get() + s * k_elems * E;
    tv->data = v2->data = v.get() + s * k_elems * E;
    qr->data = q_rot.get() + s * q_elems * E;
    kr->data = kr2->data = k_rot.get() + s * k_elems * E;
    tpos->data = positions + s * T;
    tslot->data = slots + ss * T;
  };

  // The check, on set 0.
  point(0);
  if (ggml_graph_compute(gf, &plan) != GGML_STATUS_SUCCESS) {
    state.SkipWithError("ggml_graph_compute failed");
    ggml_free(ctx);
    return;
  }
  double err = 0;
  for (int64_t t = 0; t < T; t = t == 31 && T > 64 ? T - 32 : t + 1) {  // first and last 32
    err = std::max(err, max_rope_err(q.get() + t * m.hq * m.d * E,
                                     q_rot.get() + t * m.hq * m.d * E, m.hq, m.d, m.base,
                                     positions[t], f16));
    err = std::max(err, max_rope_err(k.get() + t * m.hk * m.d * E,
                                     k_rot.get() + t * m.hk * m.d * E, m.hk, m.d, m.base,
                                     positions[t], f16));
  }
  for (const int64_t t : {int64_t{0}, T - 1}) {
    const uint8_t* kp = k_cache.get() + slots[t] * row_bytes;
    const uint8_t* vp = v_cache.get() + slots[t] * row_bytes;
    err = std::max(err, max_rope_err(k.get() + t * m.hk * m.d * E, kp, m.hk, m.d, m.base,
                                     positions[t], f16));
    if (std::memcmp(vp, v.get() + t * row_bytes, row_bytes) != 0) err = 1e9;
  }
  if (!(err <= 0.05)) {
    state.SkipWithError(("ggml's result differs from the reference by " + std::to_string(err))
                            .c_str());
    ggml_free(ctx);
    return;
  }

  for (int64_t c = 0; c < sets; ++c) {  // warm-up (page faults of the rotating sets)
    point(c);
    ggml_graph_compute(gf, &plan);
  }
  int64_t c = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    point(c);
    ggml_graph_compute(gf, &plan);
    if (++c == sets) c = 0;
  }
  const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  bench::set_counters(state, bench::spec_bytes(m, T, E), T, threads, false, el);
  state.counters["max_err"] = err;
  state.counters["sets"] = static_cast<double>(sets);
  ggml_free(ctx);
}

}  // namespace

int main(int argc, char** argv) {
  ggml_cpu_init();
  for (const Model& m : bench::kModels) {
    for (const bool f16 : {false, true}) {
      for (const int threads : {1, 2}) {
        const std::string name = std::string("ggml/") + m.name + (f16 ? "/f16" : "/f32") +
                                 "/threads:" + std::to_string(threads);
        benchmark::RegisterBenchmark(name.c_str(), BM_Ggml, m, f16, threads)
            ->ArgName("T")
            ->Arg(1)
            ->Arg(16)
            ->Arg(128)
            ->Arg(1024)
            ->Arg(8192)
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
      }
    }
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
