// Exhaustive check of the CPU fp8 pool writer's quotient (CorrectedQuotient
// in src/cpu/rope_options-inl.h): for every fp32 x (2^32 patterns) and each
// scale, q = x * r with
// r = fp32(1 / scale), corrected twice by its fused-multiply-add residual,
// against the IEEE quotient fp32(x / scale): the fp32 bits wherever the
// quotient is at least 2^-20 and the product x * r is below 2^64 (where the
// writer takes the correction), and both fp8 codes (E4M3, E5M2) always.
// About two minutes per scale on one core; not part of ctest.
//
// Usage: ropekv_fp8_quotient_check [SEED [RANDOM_SCALES [SCALE ...]]]
//   the given scales (default: eight fixed ones, from 2^-32 to 2^31, edge
//   mantissas included), then RANDOM_SCALES (default 6) random scales in
//   [2^-32, 2^32] drawn from SEED (default 1). Exit status 1 on a mismatch.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "common/fp8.h"

namespace {

float bits_f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint32_t f_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// The writer's arithmetic, one lane (std::fma: one rounding, as the vector
// multiply-adds).
float corrected_quotient(float x, float scale, float r) {
  const float q0 = x * r;
  const float q1 = std::fma(std::fma(-q0, scale, x), r, q0);
  const float q2 = std::fma(std::fma(-q1, scale, x), r, q1);
  return std::fabs(q0) < 0x1p64f ? std::copysign(q2, q0) : q0;
}

}  // namespace

int main(int argc, char** argv) {
  std::mt19937_64 rng(argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1);
  const int random_scales = argc > 2 ? std::atoi(argv[2]) : 6;
  std::vector<float> scales;
  for (int i = 3; i < argc; ++i) scales.push_back(std::strtof(argv[i], nullptr));
  if (argc <= 3)
    scales = {1.0f - 0x1p-24f, 1.5f,   bits_f(0x3FFFFFFF), 0x1p-32f * 1.9999999f,
              0.37f,           0.0213f, 1e-3f,             0x1p31f * 1.3f};
  for (int i = 0; i < random_scales; ++i) {
    const uint32_t e = 127 - 32 + static_cast<uint32_t>(rng() % 64), m = rng() & 0x7FFFFF;
    scales.push_back(bits_f((e << 23) | m));
  }
  long total = 0;
  for (const float s : scales) {
    const float r = 1.0f / s;
    long b32 = 0, b8 = 0;
    for (uint64_t u = 0; u < (uint64_t{1} << 32); ++u) {
      const float x = bits_f(static_cast<uint32_t>(u));
      const float want = x / s, got = corrected_quotient(x, s, r);
      if (std::isnan(want)) {
        b8 += !std::isnan(got);
        continue;
      }
      if (std::fabs(want) >= 0x1p-20f && std::fabs(x * r) < 0x1p64f && f_bits(want) != f_bits(got))
        ++b32;
      for (ropekv::Fp8Kind k : {ropekv::Fp8Kind::kE4M3, ropekv::Fp8Kind::kE5M2})
        b8 += ropekv::encode_fp8(want, k) != ropekv::encode_fp8(got, k);
    }
    std::printf("scale %a (%g): fp32 mismatches %ld, fp8 mismatches %ld\n", s, s, b32, b8);
    std::fflush(stdout);
    total += b32 + b8;
  }
  std::printf("%zu scales, %ld mismatches\n", scales.size(), total);
  return total != 0;
}
