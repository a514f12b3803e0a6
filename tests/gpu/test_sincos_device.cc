// Host test of the CUDA kernel's sin/cos (src/cuda/sincos_device.cuh, which
// compiles without nvcc): within one fp32 ulp of a long-double libm over
// random fp32 angles of every magnitude, the Payne-Hanek range (|theta| >
// 4.2e8) included. Built and run by scripts/gpu-check.sh (g++ only).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

#include "cuda/sincos_device.cuh"

using ropekv::cuda::detail::sincos_device;

namespace {
double worst = 0;
float worst_at = 0;

// Error in fp32 ulps of the result, or of 1.0 near zeros of sin/cos.
double err_ulps(float got, long double ref) {
  const float r = static_cast<float>(ref);
  const double u = std::nextafter(std::fabs(r), INFINITY) - std::fabs(r);
  const double e = std::fabs(static_cast<long double>(got) - ref);
  return std::min(e / u, e / 5.9604644775390625e-8);
}

void check(float x) {
  float s, c;
  sincos_device(x, &s, &c);
  const long double xl = x;
  const double e = std::max(err_ulps(s, sinl(xl)), err_ulps(c, cosl(xl)));
  if (e > worst) {
    worst = e;
    worst_at = x;
  }
}
}  // namespace

int main() {
  std::mt19937_64 rng(1);
  long n = 0;
  for (int i = 0; i < 2000000; ++i, ++n) {
    uint32_t u = static_cast<uint32_t>(rng());
    float x;
    std::memcpy(&x, &u, 4);
    if (std::isfinite(x)) check(x);
  }
  for (int i = 0; i < 1000000; ++i, n += 2) {
    const float x = std::ldexp(static_cast<float>(rng() % 16777216), static_cast<int>(rng() % 80));
    check(x);
    check(-x);
  }
  for (int i = 0; i < 1000000; ++i, ++n) check(static_cast<float>(rng() % 4000000000ull));
  float s, c;
  sincos_device(INFINITY, &s, &c);
  const bool inf_nan = std::isnan(s) && std::isnan(c);
  sincos_device(NAN, &s, &c);
  const bool nan_nan = std::isnan(s) && std::isnan(c);
  const bool ok = worst <= 1.0 && inf_nan && nan_nan;
  std::printf("sincos_device: %ld angles, worst %.3f ulp at %.9g; inf->nan %d, nan->nan %d: %s\n",
              n, worst, worst_at, inf_nan, nan_nan, ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
