// The float64 reference (ropekv::reference) against the 55 independently
// computed golden vectors of SPEC section 2, plus spot checks of inv_freq and
// the fp32 angle, and self-tests of the suite's own scalar conversions
// (test_util.h), which every other test relies on.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <vector>

#include "ropekv/reference.h"
#include "test_util.h"

namespace ropekv_test {
namespace {

nlohmann::json load_golden() {
  std::ifstream in(ROPEKV_GOLDEN_JSON);
  EXPECT_TRUE(in.good()) << "cannot open " << ROPEKV_GOLDEN_JSON;
  nlohmann::json j;
  in >> j;
  return j;
}

TEST(Reference, GoldenVectors) {
  const nlohmann::json j = load_golden();
  const auto& cases = j.at("cases");
  ASSERT_EQ(cases.size(), 55u);
  std::set<int64_t> dims, positions;
  int64_t checked = 0;
  double worst = 0.0;
  for (size_t n = 0; n < cases.size(); ++n) {
    const auto& c = cases[n];
    const int64_t D = c.at("head_dim").get<int64_t>();
    const double base = c.at("rope_base").get<double>();
    const int64_t pos = c.at("position").get<int64_t>();
    const std::vector<double> x = c.at("x").get<std::vector<double>>();
    const std::vector<double> want = c.at("expected").get<std::vector<double>>();
    ASSERT_EQ(static_cast<int64_t>(x.size()), D);
    ASSERT_EQ(static_cast<int64_t>(want.size()), D);
    dims.insert(D);
    positions.insert(pos);
    std::vector<double> got(D);
    ropekv::reference::rope_head(x.data(), got.data(), D, D, pos, base);
    const int64_t half = D / 2;
    for (int64_t d = 0; d < D; ++d) {
      // Relative to the size of the pair the element is made of (an output
      // near zero comes from cancellation of terms of that size).
      const int64_t i = d % half;
      const double scale = std::fabs(x[i]) + std::fabs(x[i + half]);
      const double err = std::fabs(got[d] - want[d]);
      worst = std::max(worst, err / scale);
      EXPECT_LE(err, 1e-12 * scale) << "case " << n << " (D=" << D << ", base=" << base
                                    << ", pos=" << pos << ") element " << d << ": " << got[d]
                                    << " vs " << want[d];
      ++checked;
    }
    // In place (out == x) gives the same values.
    std::vector<double> inplace = x;
    ropekv::reference::rope_head(inplace.data(), inplace.data(), D, D, pos, base);
    for (int64_t d = 0; d < D; ++d) EXPECT_EQ(inplace[d], got[d]) << "case " << n;
  }
  EXPECT_GE(dims.size(), 4u);
  EXPECT_TRUE(positions.count((1 << 24) - 1));
  std::printf("[ golden ] %lld elements, worst relative error %.3g\n",
              static_cast<long long>(checked), worst);
}

TEST(Reference, GoldenInputsAreFp32) {
  const nlohmann::json j = load_golden();
  for (const auto& c : j.at("cases"))
    for (double v : c.at("x").get<std::vector<double>>())
      EXPECT_EQ(static_cast<double>(static_cast<float>(v)), v);
}

TEST(Reference, InvFreq) {
  using ropekv::reference::inv_freq;
  EXPECT_EQ(inv_freq(0, 128, 10000.0), 1.0);
  EXPECT_EQ(inv_freq(0, 64, 500000.0), 1.0);
  // 10000^(-1/4) = 0.1 and 10000^(-1/2) = 0.01, rounded once to fp32.
  EXPECT_EQ(inv_freq(1, 8, 10000.0), static_cast<double>(0.1f));
  EXPECT_EQ(inv_freq(32, 128, 10000.0), static_cast<double>(0.01f));
  EXPECT_EQ(inv_freq(1, 2, 1000000.0), static_cast<double>(1e-6f));
  // Every entry is an fp32 number equal to the once-rounded double power.
  for (double base : {10000.0, 500000.0, 1000000.0, 1.5})
    for (int64_t R : {2, 8, 64, 96, 128, 256})
      for (int64_t i = 0; i < R / 2; ++i) {
        const double f = inv_freq(i, R, base);
        EXPECT_EQ(static_cast<double>(static_cast<float>(f)), f);
        const double exact = std::exp(-2.0 * i / R * std::log(base));
        EXPECT_LE(std::fabs(f - exact), 0.5 * ulp_of(exact, kSingle) * (1 + 1e-6))
            << base << " " << R << " " << i;
      }
}

TEST(Reference, Angle) {
  using ropekv::reference::angle;
  using ropekv::reference::inv_freq;
  EXPECT_EQ(angle(0, 5, 128, 10000.0), 0.0);
  EXPECT_EQ(angle(1, 0, 128, 10000.0), 1.0);
  EXPECT_EQ(angle(16777215, 0, 128, 10000.0), 16777215.0);
  // Positions are rounded to fp32 first: 2^24 + 1 becomes 2^24.
  EXPECT_EQ(angle(16777217, 0, 128, 10000.0), 16777216.0);
  EXPECT_EQ(angle(-7, 0, 64, 500000.0), -7.0);
  // The product is rounded once to fp32.
  std::mt19937_64 rng(test_seed());
  for (int n = 0; n < 20000; ++n) {
    const int64_t pos = static_cast<int64_t>(rng() % (1 << 25)) - (1 << 23);
    const int64_t R = 2 * (1 + static_cast<int64_t>(rng() % 128));
    const int64_t i = static_cast<int64_t>(rng() % (R / 2));
    const double base = (rng() & 1) ? 10000.0 : 1000000.0;
    const float fp = static_cast<float>(pos);
    const float f = static_cast<float>(inv_freq(i, R, base));
    const double a = angle(pos, i, R, base);
    EXPECT_EQ(a, static_cast<double>(static_cast<float>(static_cast<double>(fp) * f)));
    EXPECT_EQ(static_cast<double>(static_cast<float>(a)), a);
  }
  // 500000 * inv_freq of Llama-3 dimension 1: the angle is not the double product.
  const double exact = 500000.0 * inv_freq(1, 128, 500000.0);
  const double a = angle(500000, 1, 128, 500000.0);
  EXPECT_NE(a, exact);
  EXPECT_LE(std::fabs(a - exact), 0.5 * ulp_of(exact, kSingle));
}

TEST(Reference, PartialRotaryCopiesTail) {
  std::vector<double> x(10), out(10);
  for (int d = 0; d < 10; ++d) x[d] = 0.25 * (d + 1);
  ropekv::reference::rope_head(x.data(), out.data(), 10, 4, 12345, 10000.0);
  for (int d = 4; d < 10; ++d) EXPECT_EQ(out[d], x[d]);
  const double t0 = ropekv::reference::angle(12345, 0, 4, 10000.0);
  EXPECT_DOUBLE_EQ(out[0], x[0] * std::cos(t0) - x[2] * std::sin(t0));
  EXPECT_DOUBLE_EQ(out[2], x[2] * std::cos(t0) + x[0] * std::sin(t0));
}

// ---------------------------------------------------------------- test_util

TEST(TestUtil, HalfKnownValues) {
  EXPECT_EQ(to_f16(1.0), 0x3C00);
  EXPECT_EQ(to_f16(-2.0), 0xC000);
  EXPECT_EQ(to_f16(0.1f), 0x2E66);
  EXPECT_EQ(to_f16(65504.0), 0x7BFF);
  EXPECT_EQ(to_f16(65519.99), 0x7BFF);
  EXPECT_EQ(to_f16(65520.0), 0x7C00);  // the tie rounds to even = overflow
  EXPECT_EQ(to_f16(1e9), 0x7C00);
  EXPECT_EQ(to_f16(-std::numeric_limits<double>::infinity()), 0xFC00);
  EXPECT_EQ(to_f16(std::ldexp(1.0, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(to_f16(std::ldexp(1.0, -25)), 0x0000);  // tie to even: 0
  EXPECT_EQ(to_f16(std::ldexp(1.5, -25)), 0x0001);
  EXPECT_EQ(to_f16(std::ldexp(3.0, -25)), 0x0002);  // 1.5 quanta: tie to even 2
  EXPECT_EQ(to_f16(std::ldexp(1023.0, -24)), 0x03FF);  // largest subnormal
  EXPECT_EQ(to_f16(std::ldexp(1023.5, -24)), 0x0400);  // rounds up to the smallest normal
  EXPECT_EQ(to_f16(-0.0), 0x8000);
  EXPECT_EQ(to_f16(1.0 + std::ldexp(1.0, -11)), 0x3C00);        // tie, even
  EXPECT_EQ(to_f16(1.0 + 3 * std::ldexp(1.0, -11)), 0x3C02);    // tie, even (up)
  EXPECT_EQ(to_f16(1.0 + std::ldexp(1.0, -11) + 1e-12), 0x3C01);
  EXPECT_EQ(to_f16(std::numeric_limits<double>::quiet_NaN()) & 0x7C00, 0x7C00);
  EXPECT_NE(to_f16(std::numeric_limits<double>::quiet_NaN()) & 0x03FF, 0);
  EXPECT_EQ(from_f16(0x7BFF), 65504.0);
  EXPECT_EQ(from_f16(0x0001), std::ldexp(1.0, -24));
  EXPECT_EQ(from_f16(0x8400), -std::ldexp(1.0, -14));
  EXPECT_TRUE(std::isinf(from_f16(0x7C00)));
  EXPECT_TRUE(std::isnan(from_f16(0x7E00)));
}

TEST(TestUtil, BFloat16KnownValues) {
  EXPECT_EQ(to_bf16(1.0), 0x3F80);
  EXPECT_EQ(to_bf16(0.1f), 0x3DCD);
  EXPECT_EQ(to_bf16(-3.0), 0xC040);
  EXPECT_EQ(to_bf16(1.0 + std::ldexp(1.0, -8)), 0x3F80);      // tie, even
  EXPECT_EQ(to_bf16(1.0 + 3 * std::ldexp(1.0, -8)), 0x3F82);  // tie, even (up)
  EXPECT_EQ(to_bf16(std::numeric_limits<float>::max()), 0x7F80);  // overflow
  EXPECT_EQ(to_bf16(std::ldexp(1.0, -133)), 0x0001);  // smallest bf16 subnormal
  EXPECT_EQ(to_bf16(std::ldexp(1.0, -134)), 0x0000);
  EXPECT_EQ(from_bf16(0x0001), std::ldexp(1.0, -133));
  EXPECT_EQ(from_bf16(0x7F7F), std::ldexp(255.0, 120));
}

// Every 16-bit pattern decodes and re-encodes to itself (NaNs stay NaN).
TEST(TestUtil, RoundTripAll16BitPatterns) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const double h = from_f16(static_cast<uint16_t>(b));
    const double bf = from_bf16(static_cast<uint16_t>(b));
    if (std::isnan(h)) {
      EXPECT_TRUE(std::isnan(from_f16(to_f16(h))));
    } else {
      ASSERT_EQ(to_f16(h), b) << h;
    }
    if (std::isnan(bf)) {
      EXPECT_TRUE(std::isnan(from_bf16(to_bf16(bf))));
    } else {
      ASSERT_EQ(to_bf16(bf), b) << bf;
    }
  }
}

// The converters against independent implementations: the compiler's
// _Float16 (IEEE conversion, round to nearest even) where available, the
// classic integer RNE for bf16, and the hardware double -> float cast.
TEST(TestUtil, ConvertersMatchIndependentImplementations) {
  std::mt19937_64 rng(test_seed());
  for (int n = 0; n < 1000000; ++n) {
    uint32_t u = static_cast<uint32_t>(rng());
    if (n % 2) {  // concentrate on the f16 range
      u = (u & 0x807FFFFFu) | ((96u + static_cast<uint32_t>(rng() % 50)) << 23);
    }
    const float f = f32_from_bits(u);
    if (std::isnan(f)) continue;
#ifdef __FLT16_MAX__
    const _Float16 h = static_cast<_Float16>(f);
    uint16_t hb;
    std::memcpy(&hb, &h, 2);
    ASSERT_EQ(to_f16(f), hb) << f;
#endif
    const uint32_t lsb = (u >> 16) & 1u;
    const uint16_t bb = static_cast<uint16_t>((u + 0x7FFFu + lsb) >> 16);
    ASSERT_EQ(to_bf16(f), bb) << f;
    const double d = std::ldexp(static_cast<double>(rng() >> 11), -static_cast<int>(rng() % 200)) *
                     ((rng() & 1) ? 1 : -1);
    ASSERT_EQ(encode(d, kSingle), f32_bits(static_cast<float>(d))) << d;
  }
}

TEST(TestUtil, Ulp) {
  EXPECT_EQ(ulp_of(1.0, kSingle), std::ldexp(1.0, -23));
  EXPECT_EQ(ulp_of(1.5, kHalf), std::ldexp(1.0, -10));
  EXPECT_EQ(ulp_of(0.99, kBFloat16), std::ldexp(1.0, -8));
  EXPECT_EQ(ulp_of(0.0, kHalf), std::ldexp(1.0, -24));
  EXPECT_EQ(ulp_of(1e-6, kHalf), std::ldexp(1.0, -24));
  EXPECT_EQ(ulp_of(1e-45, kSingle), std::ldexp(1.0, -149));
}

TEST(TestUtil, StridedViewsAddressTheRightElements) {
  // q, k, v of a fused [T, (Hq + 2 Hk) * D] buffer.
  auto qkv = packed_views(DType::kF32, 3, {4, 2, 2}, 8, 1, 0, 0, 5);
  EXPECT_EQ(qkv[0].strides(), (std::vector<int64_t>{64, 8, 1}));
  EXPECT_EQ(qkv[1].off(0, 0, 0), 5 + 32);
  EXPECT_EQ(qkv[2].off(2, 1, 7), 5 + 2 * 64 + 48 + 8 + 7);
  EXPECT_EQ(qkv[0].storage(), qkv[2].storage());
  const DLTensor d = qkv[1].dl();
  EXPECT_EQ(d.byte_offset, (5u + 32u) * 4u);
  EXPECT_EQ(d.strides[0], 64);
  auto s2 = packed_views(DType::kBF16, 2, {3}, 4, 2, 1, 0, 0, false);
  EXPECT_EQ(s2[0].strides(), (std::vector<int64_t>{27, 9, 2}));
  EXPECT_EQ(s2[0].dl().byte_offset, 0u);
  Tensor c = Tensor::compact(DType::kF16, {2, 3});
  EXPECT_EQ(c.dl().strides, nullptr);
  c.set_value(c.off(1) + 2, 1.5);
  EXPECT_EQ(c.raw(5), 0x3E00u);
}

}  // namespace
}  // namespace ropekv_test
