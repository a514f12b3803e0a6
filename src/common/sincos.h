// sin and cos of an fp32 angle, accurate to a few fp32 ulp for every angle
// the op can produce (|theta| up to 2^31 and beyond), on the host and on CUDA.
//
// Why not sinf/__sinf: fast approximations are accurate only near zero (at
// position 500000 they are off by percents), and CUDA's accurate sincosf
// takes a slow local-memory path above |x| ~ 1e5. Here the argument is
// reduced by pi/2 in double (three-part Cody-Waite: k * PIO2_HI and
// k * PIO2_MID are exact for |k| < 2^28, so the remainder is good to ~1e-16
// absolute), then short minimax polynomials on [-pi/4, pi/4] (Cephes sinf /
// cosf, ~1 ulp) are evaluated in fp32.
#pragma once

#if defined(__CUDACC__)
#define ROPEKV_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ROPEKV_HOST_DEVICE inline
#endif

#include <cmath>

namespace ropekv {
namespace sincos_consts {
// pi/2 split so that its first two parts have 25 significant bits.
constexpr double kPio2Hi = 1.5707963109016418;      // 0x1.921fb5p+0
constexpr double kPio2Mid = 1.5893254712295857e-08;  // 0x1.110b46p-26
constexpr double kPio2Lo = 6.123233995736766e-17;
constexpr double kTwoOverPi = 0.6366197723675814;
// Above this |k| the exact-product argument no longer holds.
constexpr double kMaxQuadrant = 268435456.0;  // 2^28
// sin(r) ~ r + r^3 * (S1 + r^2 * (S2 + r^2 * S3)), |r| <= pi/4
constexpr float kS1 = -1.6666654611e-1f;
constexpr float kS2 = 8.3321608736e-3f;
constexpr float kS3 = -1.9515295891e-4f;
// cos(r) ~ 1 - r^2/2 + r^4 * (C1 + r^2 * (C2 + r^2 * C3))
constexpr float kC1 = 4.166664568298827e-2f;
constexpr float kC2 = -1.388731625493765e-3f;
constexpr float kC3 = 2.443315711809948e-5f;
}  // namespace sincos_consts

/// sin and cos of the fp32 angle `theta` (radians), each within a few fp32
/// ulp of the exact values.
ROPEKV_HOST_DEVICE void sincos_fp32(float theta, float* sin_out, float* cos_out) {
  using namespace sincos_consts;
  const double x = theta;
  const double kd = rint(x * kTwoOverPi);
  if (!(fabs(kd) < kMaxQuadrant)) {  // huge, Inf or NaN: plain double math
    *sin_out = static_cast<float>(sin(x));
    *cos_out = static_cast<float>(cos(x));
    return;
  }
  const double rd = ((x - kd * kPio2Hi) - kd * kPio2Mid) - kd * kPio2Lo;
  const float r = static_cast<float>(rd);
  const float z = r * r;
  const float sp = r + r * z * (kS1 + z * (kS2 + z * kS3));
  const float cp = 1.0f - 0.5f * z + z * z * (kC1 + z * (kC2 + z * kC3));
  const long long q = static_cast<long long>(kd) & 3;
  const float s = (q & 1) ? cp : sp;
  const float c = (q & 1) ? sp : cp;
  *sin_out = (q & 2) ? -s : s;
  *cos_out = ((q + 1) & 2) ? -c : c;
}

}  // namespace ropekv
