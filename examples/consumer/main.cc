// The smallest real use of ropekv: one call on a small f32 problem (3 new
// tokens, 2 query heads, 1 KV head, head_dim 8, a pool of 4 rows), checked
// against the float64 reference that ships with the library.
#include <ropekv/reference.h>
#include <ropekv/ropekv.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

// A compact CPU DLTensor over `data` (strides == NULL means row-major).
template <class T>
DLTensor view(std::vector<T>& data, std::vector<int64_t>& shape, DLDataType dtype) {
  DLTensor t{};
  t.data = data.data();
  t.device = {kDLCPU, 0};
  t.ndim = static_cast<int32_t>(shape.size());
  t.dtype = dtype;
  t.shape = shape.data();
  t.strides = nullptr;
  t.byte_offset = 0;
  return t;
}

}  // namespace

int main() {
  const int64_t T = 3, Hq = 2, Hk = 1, D = 8, P = 4;
  const double base = 500000.0;
  const DLDataType f32{kDLFloat, 32, 1}, i32{kDLInt, 32, 1};

  std::vector<float> q(T * Hq * D), k(T * Hk * D), v(T * Hk * D);
  for (size_t i = 0; i < q.size(); ++i) q[i] = 0.25f * static_cast<float>(i % 7) - 0.6f;
  for (size_t i = 0; i < k.size(); ++i) k[i] = 0.5f - 0.125f * static_cast<float>(i % 5);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i);
  std::vector<int32_t> positions = {0, 17, 500000};
  std::vector<int32_t> slots = {2, -1, 0};  // token 1 is not cached
  std::vector<float> k_pool(P * Hk * D, -1.0f), v_pool(P * Hk * D, -1.0f);
  std::vector<float> q_rot(q.size()), k_rot(k.size());

  std::vector<int64_t> sq = {T, Hq, D}, sk = {T, Hk, D}, st = {T}, sp = {P, Hk, D};
  ropekv::RopePoolTensors t{};
  t.q = view(q, sq, f32);
  t.k = view(k, sk, f32);
  t.v = view(v, sk, f32);
  t.positions = view(positions, st, i32);
  t.slots = view(slots, st, i32);
  t.k_pool = view(k_pool, sp, f32);
  t.v_pool = view(v_pool, sp, f32);
  t.q_rot = view(q_rot, sq, f32);
  t.k_rot = view(k_rot, sk, f32);

  ropekv::RopeConfig config;
  config.head_dim = D;
  config.num_qo_heads = Hq;
  config.num_kv_heads = Hk;
  config.rope_base = base;

  try {
    ropekv::rope_pool_fused(t, config);
  } catch (const ropekv::Error& e) {
    std::fprintf(stderr, "ropekv rejected the call: %s\n", e.what());
    return 1;
  }

  // q_rot of token 2, head 1 against the float64 reference.
  std::vector<double> x(D), want(D);
  const float* qh = q.data() + (2 * Hq + 1) * D;
  for (int64_t d = 0; d < D; ++d) x[d] = qh[d];
  ropekv::reference::rope_head(x.data(), want.data(), D, D, positions[2], base);
  int bad = 0;
  for (int64_t d = 0; d < D; ++d) {
    const double got = q_rot[(2 * Hq + 1) * D + d];
    if (std::fabs(got - want[d]) > 1e-6 * (1.0 + std::fabs(want[d]))) {
      std::fprintf(stderr, "q_rot[2, 1, %lld] = %.9g, reference %.9g\n", static_cast<long long>(d),
                   got, want[d]);
      ++bad;
    }
  }
  // Token 0 went to pool row 2, token 2 to row 0; rows 1 and 3 untouched.
  for (int64_t d = 0; d < D; ++d) {
    if (k_pool[2 * D + d] != k_rot[0 * D + d] || v_pool[2 * D + d] != v[0 * D + d]) ++bad;
    if (k_pool[0 * D + d] != k_rot[2 * D + d] || v_pool[0 * D + d] != v[2 * D + d]) ++bad;
    if (k_pool[1 * D + d] != -1.0f || v_pool[3 * D + d] != -1.0f) ++bad;
  }
  std::printf("ropekv %s (CPU target %s, CUDA %s): q_rot[2, 1, 0] = %.7f, reference %.7f: %s\n",
              ropekv::version(), ropekv::cpu_target().c_str(), ropekv::has_cuda() ? "yes" : "no",
              q_rot[(2 * Hq + 1) * D], want[0], bad ? "MISMATCH" : "ok");
  return bad ? 1 : 0;
}
