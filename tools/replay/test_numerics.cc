// Checks ropekv-replay's own f16/bf16 converters and ulp function against a
// plain double-precision model of round-to-nearest-even, and its fp8 codec
// against a brute-force nearest-code search. Exit 0 = pass.
#include <cfenv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "numerics.h"

using namespace replay;

namespace {

int failures = 0;

void fail(const char* what, float f, uint32_t got, uint32_t want) {
  if (++failures <= 10)
    std::printf("FAIL %s: x = %.9g (0x%08x): got 0x%04x, want 0x%04x\n", what, f, float_bits(f), got, want);
}

/// RNE of f to a binary format with `mant` fraction bits, smallest normal
/// exponent `emin` and largest finite `max`, as a double (inf past max).
double model_round(float f, int mant, int emin, double max_finite) {
  const double x = f;
  if (x == 0) return x;
  int e;
  std::frexp(std::fabs(x), &e);
  e -= 1;
  if (e < emin) e = emin;
  const double unit = std::ldexp(1.0, e - mant);
  const double r = std::nearbyint(x / unit) * unit;  // FE_TONEAREST: ties to even
  if (std::fabs(r) > max_finite) return std::copysign(INFINITY, x);
  return r;
}

void check_one(float f) {
  if (std::isnan(f)) return;
  const double h = model_round(f, 10, -14, 65504.0);
  const float hf = f16_to_f32(f32_to_f16(f));
  if (!(hf == static_cast<float>(h)) || std::signbit(hf) != std::signbit(f))
    fail("f16", f, f32_to_f16(f), f32_to_f16(static_cast<float>(h)));
  const double b = model_round(f, 7, -126, 3.3895313892515355e38);
  const float bf = bf16_to_f32(f32_to_bf16(f));
  if (!(bf == static_cast<float>(b)) || std::signbit(bf) != std::signbit(f))
    fail("bf16", f, f32_to_bf16(f), f32_to_bf16(static_cast<float>(b)));
}

/// The definition the codec implements: over all 256 codes, the finite one
/// of x's sign nearest to x, ties to the even code.
uint8_t fp8_brute(const Fp8Codec& c, float x) {
  const bool neg = std::signbit(x);
  if (std::isnan(x)) return static_cast<uint8_t>((neg ? 0x80 : 0) | 0x7F);
  int best = -1;
  double best_d = 0;
  for (int code = 0; code < 256; ++code) {
    const double v = c.decode(static_cast<uint8_t>(code));
    if (!std::isfinite(v) || ((code & 0x80) != 0) != neg) continue;
    const double d = std::isinf(x) ? (c.max_finite() - std::fabs(v)) : std::fabs(v - static_cast<double>(x));
    if (best < 0 || d < best_d || (d == best_d && (code & 1) == 0)) {
      best = code;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(best);
}

void check_fp8(KvDtype kind, Rng& rng) {
  const Fp8Codec c(kind);
  const char* name = kv_dtype_name(kind);
  auto expect = [&](float x, uint8_t want) {
    const uint8_t got = c.encode(x);
    if (got != want) {
      ++failures;
      if (failures <= 20)
        std::printf("FAIL %s encode(%.9g) = 0x%02x, want 0x%02x\n", name, x, got, want);
    }
  };
  // Every finite code round-trips; the midpoints between neighbours (exact
  // in fp32) and the floats next to them round as the definition says.
  for (int code = 0; code < 256; ++code) {
    const double v = c.decode(static_cast<uint8_t>(code));
    if (std::isnan(v)) continue;
    if (std::isinf(v)) {
      expect(static_cast<float>(v), fp8_brute(c, static_cast<float>(v)));
      continue;
    }
    expect(static_cast<float>(v), static_cast<uint8_t>(code));
    const double next = c.decode(static_cast<uint8_t>(code + 1));
    if ((code & 0x7F) < 0x7F && std::isfinite(next)) {
      const float mid = static_cast<float>((v + next) / 2);
      for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f), std::nextafter(mid, -1e30f)})
        expect(x, fp8_brute(c, x));
    }
  }
  for (int i = 0; i < 200000; ++i) {
    const uint64_t r = rng.next();
    const uint32_t exp = static_cast<uint32_t>(100 + (r >> 40) % 50);  // 2^-27 .. 2^22
    expect(bits_float((static_cast<uint32_t>(r) & 0x807FFFFFu) | (exp << 23)),
           fp8_brute(c, bits_float((static_cast<uint32_t>(r) & 0x807FFFFFu) | (exp << 23))));
  }
  // Known codes (OCP 8-bit floating point specification).
  const bool e4 = kind == KvDtype::kFp8E4M3;
  expect(1.0f, e4 ? 0x38 : 0x3C);
  expect(-2.0f, e4 ? 0xC0 : 0xC0);
  expect(e4 ? 448.0f : 57344.0f, e4 ? 0x7E : 0x7B);
  expect(e4 ? 464.0f : 61440.0f, e4 ? 0x7E : 0x7B);  // the midpoint to the next binade step: saturates
  expect(1e30f, e4 ? 0x7E : 0x7B);
  expect(-INFINITY, e4 ? 0xFE : 0xFB);
  expect(NAN, 0x7F);
  expect(-0.0f, 0x80);
  expect(e4 ? 0x1p-10f : 0x1p-17f, 0x00);  // half the smallest subnormal: tie to 0
  expect(e4 ? 0x3p-10f : 0x3p-17f, 0x02);  // 1.5 subnormals: tie to the even code 2
  expect(e4 ? 0x1.8p-10f : 0x1.8p-17f, 0x01);
  if (c.ulp(1.0) != (e4 ? 0x1p-3 : 0x1p-2) || c.ulp(0.0) != (e4 ? 0x1p-9 : 0x1p-16) ||
      c.ulp(1e9) != (e4 ? 32.0 : 8192.0)) {
    ++failures;
    std::printf("FAIL %s ulp: %g %g %g\n", name, c.ulp(1.0), c.ulp(0.0), c.ulp(1e9));
  }
  if (!std::isinf(c.decode(0x7C)) && !e4) {
    ++failures;
    std::printf("FAIL fp8_e5m2 decode(0x7C) is not Inf\n");
  }
}

}  // namespace

int main() {
  std::fesetround(FE_TONEAREST);
  // Every f16: decode matches the formula, and encodes back to itself.
  for (uint32_t u = 0; u < 65536; ++u) {
    const uint16_t h = static_cast<uint16_t>(u);
    const uint32_t e = (h >> 10) & 31, m = h & 1023;
    const float v = f16_to_f32(h);
    if (e == 31) {
      if (m == 0 ? !std::isinf(v) : !std::isnan(v)) fail("f16 decode special", v, h, 0);
      continue;
    }
    const double want = (e == 0 ? std::ldexp(static_cast<double>(m), -24)
                                : std::ldexp(1.0 + m / 1024.0, static_cast<int>(e) - 15)) *
                        ((h & 0x8000) ? -1 : 1);
    if (v != static_cast<float>(want)) fail("f16 decode", v, h, 0);
    if (f32_to_f16(v) != h) fail("f16 round trip", v, f32_to_f16(v), h);
  }
  // Every bf16 round-trips.
  for (uint32_t u = 0; u < 65536; ++u) {
    const uint16_t b = static_cast<uint16_t>(u);
    const float v = bf16_to_f32(b);
    if (!std::isnan(v) && f32_to_bf16(v) != b) fail("bf16 round trip", v, f32_to_bf16(v), b);
  }
  // Floats around every f16 and bf16 value (ties and their neighbours) and
  // random floats over the interesting exponent range.
  for (uint32_t u = 0; u < 65536; ++u) {
    const float v = f16_to_f32(static_cast<uint16_t>(u));
    if (std::isnan(v) || std::isinf(v)) continue;
    const uint32_t bits = float_bits(v);
    for (int32_t d = -(1 << 13) - 2; d <= (1 << 13) + 2; d += (1 << 12)) {
      for (int32_t k = -1; k <= 1; ++k) check_one(bits_float(bits + static_cast<uint32_t>(d + k)));
    }
    const uint32_t bb = float_bits(bf16_to_f32(static_cast<uint16_t>(u)));
    for (int32_t k = -1; k <= 1; ++k) {
      check_one(bits_float(bb + 0x8000u + static_cast<uint32_t>(k)));
      check_one(bits_float(bb + static_cast<uint32_t>(k)));
    }
  }
  Rng rng(12345);
  for (int i = 0; i < 4000000; ++i) {
    const uint64_t r = rng.next();
    const uint32_t exp = static_cast<uint32_t>(100 + (r >> 40) % 60);  // 2^-27 .. 2^32
    const uint32_t bits = (static_cast<uint32_t>(r) & 0x807FFFFFu) | (exp << 23);
    check_one(bits_float(bits));
    check_one(bits_float(static_cast<uint32_t>(r >> 32)));  // any float
  }
  // fp8: the codec against a brute-force definition and known codes.
  for (KvDtype kind : {KvDtype::kFp8E4M3, KvDtype::kFp8E5M2}) check_fp8(kind, rng);

  // ulp: the spacing of the format at a.
  const struct {
    Dtype t;
    double a, want;
  } ulps[] = {{Dtype::kBF16, 1.0, 0x1p-7}, {Dtype::kBF16, 1.99, 0x1p-7}, {Dtype::kBF16, 0.5, 0x1p-8},
              {Dtype::kF16, 1.0, 0x1p-10}, {Dtype::kF16, 0.0, 0x1p-24}, {Dtype::kF16, 1e-6, 0x1p-24},
              {Dtype::kF32, 3.0, 0x1p-22}, {Dtype::kF32, 0.0, 0x1p-149}, {Dtype::kBF16, 0.0, 0x1p-133}};
  for (const auto& u : ulps) {
    if (ulp_of(u.t, u.a) != u.want || UlpFn(u.t)(u.a) != u.want || UlpFn(u.t)(-u.a) != u.want) {
      ++failures;
      std::printf("FAIL ulp(%s, %g) = %g / %g, want %g\n", dtype_name(u.t), u.a, ulp_of(u.t, u.a),
                  UlpFn(u.t)(u.a), u.want);
    }
  }
  std::printf("%s (%d failures)\n", failures ? "FAILED" : "passed", failures);
  return failures ? 1 : 0;
}
