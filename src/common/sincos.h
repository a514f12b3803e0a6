// sin and cos of an fp32 angle, accurate to about one fp32 ulp for every
// angle (|theta| up to FLT_MAX), on the host and on CUDA: the one scalar
// routine of ropekv (the CPU backend's vector form in cpu/rope_pool_cpu-inl.h
// uses the same reduction and polynomials).
//
// Why not sinf/__sinf: fast approximations are accurate only near zero (at
// position 500000 they are off by percents), CUDA's accurate sincosf takes a
// slow local-memory path above |x| ~ 1e5, and a libm double sin/cos call
// would put a stack frame in the kernel. Here the argument is reduced by pi/2
// in double (three-part Cody-Waite: k * PIO2_HI and k * PIO2_MID are exact
// for |k| < 2^28, so the remainder is good to ~1e-16 absolute); beyond that
// (|theta| > 4.2e8) exactly with 224 bits of 2/pi (Payne-Hanek on the 24-bit
// mantissa, in registers). Then the Cephes sinf/cosf minimax polynomials on
// [-pi/4, pi/4], evaluated in double, rounded once to fp32.
#pragma once

#include <cmath>
#include <cstring>
#include <limits>

// Under nvcc the routine is device code only (its table lives in constant
// memory); host code, compiled by the C++ compiler, gets the same source.
#if defined(__CUDACC__)
#define ROPEKV_SINCOS_FN __device__ __forceinline__
#define ROPEKV_SINCOS_COLD __device__ __noinline__
#define ROPEKV_SINCOS_TABLE __constant__
#else
#define ROPEKV_SINCOS_FN inline
#define ROPEKV_SINCOS_COLD inline
#define ROPEKV_SINCOS_TABLE static
#endif

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

namespace sincos_detail {
ROPEKV_SINCOS_FN unsigned int float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  unsigned int u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

ROPEKV_SINCOS_FN float nan_f32() {
#if defined(__CUDA_ARCH__)
  return __int_as_float(0x7FFFFFFF);
#else
  return std::numeric_limits<float>::quiet_NaN();
#endif
}

// 2/pi, 224 bits, most significant word first (bit j has weight 2^-(j+1)).
ROPEKV_SINCOS_TABLE const unsigned int kTwoOverPiBits[7] = {
    0xA2F9836Eu, 0x4E441529u, 0xFC2757D1u, 0xF534DDC0u,
    0xDB629599u, 0x3C439041u, 0xFE5163ABu};

struct Reduced {
  double r;  // theta - q * pi/2, |r| <= pi/4 (NaN for Inf or NaN)
  int q;     // the quadrant, mod 4
};

// theta reduced exactly with 224 bits of 2/pi (Payne-Hanek on the 24-bit
// mantissa), for |theta| beyond the three-part reduction's range. Out of
// line on CUDA: rare, and a kernel's instructions are fetched cold on every
// launch, so the common path stays short.
ROPEKV_SINCOS_COLD Reduced reduce_large(float theta) {
  const unsigned int u = float_bits(theta) & 0x7FFFFFFFu;
  if (u >= 0x7F800000u) return {static_cast<double>(nan_f32()), 0};  // Inf or NaN
  // |theta| = mant * 2^e with e >= 5 here. Bits j <= e-3 of 2/pi contribute
  // multiples of 4 (whole turns): start at word w0 = (e-2)/32 and take four
  // words W; |theta| * 2/pi = mant * W * 2^(sh - 128), sh = e - 32*w0.
  const unsigned int mant = (u & 0x7FFFFFu) | 0x800000u;
  const int e = static_cast<int>(u >> 23) - 150;
  const int w0 = (e - 2) >> 5;
  const int sh = e - 32 * w0;  // in [2, 33]
  unsigned long long acc = static_cast<unsigned long long>(mant) * kTwoOverPiBits[w0 + 3];
  const unsigned int l0 = static_cast<unsigned int>(acc);
  acc = static_cast<unsigned long long>(mant) * kTwoOverPiBits[w0 + 2] + (acc >> 32);
  const unsigned int l1 = static_cast<unsigned int>(acc);
  acc = static_cast<unsigned long long>(mant) * kTwoOverPiBits[w0 + 1] + (acc >> 32);
  const unsigned int l2 = static_cast<unsigned int>(acc);
  acc = static_cast<unsigned long long>(mant) * kTwoOverPiBits[w0] + (acc >> 32);
  const unsigned int l3 = static_cast<unsigned int>(acc);
  // P = l4:l3:l2:l1:l0 (160 bits); integer part = P >> (128 - sh).
  const unsigned long long mid = (static_cast<unsigned long long>(l3) << 32) | l2;
  const unsigned long long low = (static_cast<unsigned long long>(l1) << 32) | l0;
  const int s = 64 - sh;  // in [31, 62]
  const unsigned long long frac = (mid << (64 - s)) | (low >> s);
  int q = static_cast<int>((mid >> s) & 3u) + static_cast<int>(frac >> 63);
  // frac as a signed fraction of a quadrant, in [-1/2, 1/2).
  double r = static_cast<double>(static_cast<long long>(frac)) * 5.421010862427522e-20 *
             1.5707963267948966;  // 2^-64 * pi/2
  if (theta < 0.0f) {
    r = -r;
    q = -q;
  }
  return {r, q};
}
}  // namespace sincos_detail

/// sin and cos of the fp32 angle `theta` (radians), each within about one
/// fp32 ulp of the exact values; NaN for Inf or NaN.
ROPEKV_SINCOS_FN void sincos_fp32(float theta, float* s_out, float* c_out) {
  using namespace sincos_consts;
  using namespace sincos_detail;
  const double x = theta;
  const double kd = rint(x * kTwoOverPi);
  double r;
  int q;
  if (fabs(kd) < kMaxQuadrant) {
    r = fma(-kd, kPio2Lo, fma(-kd, kPio2Mid, fma(-kd, kPio2Hi, x)));
    q = static_cast<int>(kd);  // |kd| < 2^28
  } else {
    const Reduced red = reduce_large(theta);
    r = red.r;
    q = red.q;
  }
  const double z = r * r;
  const double sp = fma(r * z, fma(z, fma(z, double(kS3), double(kS2)), double(kS1)), r);
  const double cp = fma(z * z, fma(z, fma(z, double(kC3), double(kC2)), double(kC1)),
                        fma(-0.5, z, 1.0));
  const int qq = static_cast<int>(q & 3);
  const double sv = (qq & 1) ? cp : sp;
  const double cv = (qq & 1) ? sp : cp;
  *s_out = static_cast<float>((qq & 2) ? -sv : sv);
  *c_out = static_cast<float>(((qq + 1) & 2) ? -cv : cv);
}

}  // namespace ropekv
