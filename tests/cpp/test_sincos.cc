// ropekv::sincos_fp32 (src/common/sincos.h), the scalar sin/cos of an fp32
// angle used by the CPU backend (scalar targets, huge angles) and by CUDA,
// against double-precision std::sin / std::cos of the same fp32 angle.
//
// Bound: 2 fp32 ulp of the exact result, ulp taken at |exact| (the subnormal
// spacing 2^-149 below 2^-126). No absolute floor: the reduction by pi/2 is
// done in double with a three-part pi/2 whose first two products are exact,
// so the reduced argument r carries an absolute error of about 2^-78 plus
// 2^-52 |r|, and the closest an fp32 angle below 2^28 * pi/2 comes to a
// multiple of pi/2 is far above 2^-50; the relative error of sin near its
// zeros therefore stays at the fp32 rounding of r and of the polynomial.
// A result of exactly 0 (theta = 0) is compared exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "common/sincos.h"
#include "test_util.h"

namespace ropekv_test {
namespace {

constexpr double kUlps = 2.0;

struct Worst {
  double ulps = 0.0;
  float theta = 0.0f;
};

// Checks one angle; returns false (and reports) when out of bounds.
bool check_angle(float theta, Worst* worst_s, Worst* worst_c, int* reported) {
  float s = 0.0f, c = 0.0f;
  ropekv::sincos_fp32(theta, &s, &c);
  const double x = static_cast<double>(theta);
  const double es = std::sin(x), ec = std::cos(x);
  const double us = std::fabs(s - es) / ulp_of(es, kSingle);
  const double uc = std::fabs(c - ec) / ulp_of(ec, kSingle);
  if (us > worst_s->ulps) *worst_s = {us, theta};
  if (uc > worst_c->ulps) *worst_c = {uc, theta};
  if (!(us <= kUlps) || !(uc <= kUlps)) {
    if ((*reported)++ < 10)
      ADD_FAILURE() << "theta " << theta << " (bits 0x" << std::hex << f32_bits(theta) << std::dec
                    << "): sin " << s << " vs " << es << " (" << us << " ulp), cos " << c << " vs "
                    << ec << " (" << uc << " ulp)";
    return false;
  }
  return true;
}

TEST(SinCos, EdgeCases) {
  Worst ws, wc;
  int reported = 0;
  std::vector<float> angles = {0.0f,
                               -0.0f,
                               std::numeric_limits<float>::denorm_min(),
                               -std::numeric_limits<float>::denorm_min(),
                               std::numeric_limits<float>::min(),
                               1e-20f,
                               1e-7f,
                               1.0f,
                               -1.0f,
                               16777216.0f,   // 2^24
                               -16777216.0f,
                               16777215.0f,   // 2^24 - 1
                               16777218.0f,
                               500000.0f,
                               1000000.0f,
                               131071.0f,
                               4095.0f,
                               268435456.0f,  // 2^28
                               421657440.0f,  // ~ 2^28 * pi/2: the switch to the double path
                               421657472.0f,
                               -421657440.0f,
                               1073741824.0f,   // 2^30
                               2147483648.0f,   // 2^31
                               -2147483648.0f,
                               4294967296.0f,   // 2^32
                               1e10f,
                               1e20f,
                               -1e30f,
                               std::numeric_limits<float>::max(),
                               -std::numeric_limits<float>::max()};
  // Multiples of pi/4 as fp32 numbers (the zeros and extrema of sin, cos, and
  // the quadrant boundaries of the reduction), and their fp32 neighbours.
  for (int k = -4000; k <= 4000; ++k) {
    const float a = static_cast<float>(k * (M_PI / 4.0));
    angles.push_back(a);
    angles.push_back(std::nextafter(a, std::numeric_limits<float>::infinity()));
    angles.push_back(std::nextafter(a, -std::numeric_limits<float>::infinity()));
  }
  for (int k = -64; k <= 64; ++k) {  // large multiples of pi/2
    const double m = std::ldexp(1.0, 24) + k * 1000003.0;
    angles.push_back(static_cast<float>(m * (M_PI / 2.0)));
    angles.push_back(static_cast<float>(-m * (M_PI / 2.0)));
  }
  for (float a : angles) check_angle(a, &ws, &wc, &reported);
  EXPECT_EQ(reported, 0);
  std::printf("[ edge cases ] %zu angles, worst sin %.3f ulp at %.9g, worst cos %.3f ulp at %.9g\n",
              angles.size(), ws.ulps, ws.theta, wc.ulps, wc.theta);
}

TEST(SinCos, NonFiniteGiveNaN) {
  for (float a : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN()}) {
    float s = 0.0f, c = 0.0f;
    ropekv::sincos_fp32(a, &s, &c);
    EXPECT_TRUE(std::isnan(s)) << a;
    EXPECT_TRUE(std::isnan(c)) << a;
  }
}

// Random fp32 angles, uniform in the exponent from 2^-30 to 2^31 (both
// signs), so every magnitude gets the same number of samples.
TEST(SinCos, RandomAnglesAllMagnitudes) {
  std::mt19937_64 rng(test_seed());
  Worst ws, wc;
  int reported = 0;
  const int n = 2000000;
  std::uniform_int_distribution<int> ex(-30, 31);
  std::uniform_real_distribution<double> mant(1.0, 2.0);
  for (int i = 0; i < n; ++i) {
    double a = std::ldexp(mant(rng), ex(rng) - 1);  // [2^-31, 2^31)
    if (rng() & 1) a = -a;
    check_angle(static_cast<float>(a), &ws, &wc, &reported);
  }
  EXPECT_EQ(reported, 0);
  std::printf("[ random ] %d angles, worst sin %.3f ulp at %.9g, worst cos %.3f ulp at %.9g\n", n,
              ws.ulps, ws.theta, wc.ulps, wc.theta);
}

// The angles the op actually produces: fp32(fp32(pos) * inv_freq[i]) for
// positions up to 2^24 (and negative) and the bases of real models.
TEST(SinCos, RopeAngles) {
  std::mt19937_64 rng(test_seed());
  Worst ws, wc;
  int reported = 0;
  int count = 0;
  const double bases[] = {10000.0, 500000.0, 1000000.0};
  const int64_t dims[] = {64, 96, 128, 256};
  for (int rep = 0; rep < 2000; ++rep) {
    const double base = bases[rng() % 3];
    const int64_t D = dims[rng() % 4];
    int64_t pos = static_cast<int64_t>(rng() % ((1 << 24) + 1));
    if (rep % 7 == 0) pos = -pos;
    if (rep == 0) pos = (1 << 24) - 1;
    for (int64_t i = 0; i < D / 2; ++i) {
      const float theta = static_cast<float>(ropekv::reference::angle(pos, i, D, base));
      check_angle(theta, &ws, &wc, &reported);
      ++count;
    }
  }
  EXPECT_EQ(reported, 0);
  std::printf("[ rope ] %d angles, worst sin %.3f ulp at %.9g, worst cos %.3f ulp at %.9g\n",
              count, ws.ulps, ws.theta, wc.ulps, wc.theta);
}

// Every fp32 angle in [2^24 - 2^16, 2^24 + 2^17] (integers and halves of
// the fp32 grid there), the range where positions end.
TEST(SinCos, DenseNear2To24) {
  Worst ws, wc;
  int reported = 0;
  int count = 0;
  float a = 16777216.0f - 65536.0f;
  while (a <= 16777216.0f + 131072.0f) {
    check_angle(a, &ws, &wc, &reported);
    check_angle(-a, &ws, &wc, &reported);
    a = std::nextafter(a, std::numeric_limits<float>::infinity());
    count += 2;
  }
  EXPECT_EQ(reported, 0);
  std::printf("[ dense ] %d angles, worst sin %.3f ulp, worst cos %.3f ulp\n", count, ws.ulps,
              wc.ulps);
}

}  // namespace
}  // namespace ropekv_test
