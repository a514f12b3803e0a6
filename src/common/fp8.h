// fp32 -> fp8 (OCP E4M3 "fn" and E5M2) encoding shared by the host, the CPU
// backend's scalar paths and the CUDA kernel, so every backend stores the
// same bits: round to nearest even, saturate to the largest finite value
// (Inf included), every NaN -> 0x7F (a NaN in both formats, sign clear: the
// bits of the hardware conversion of sm_89 and later, cvt.rn.satfinite).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define ROPEKV_HD __host__ __device__ __forceinline__
#else
#define ROPEKV_HD inline
#endif

namespace ropekv {

enum class Fp8Kind : int { kE4M3 = 0, kE5M2 = 1 };

/// Format constants: mantissa bits, exponent bias, largest finite value and
/// its code (sign bit clear).
struct Fp8Format {
  int mantissa_bits;
  int bias;
  float max_finite;
  uint32_t max_code;
};

ROPEKV_HD Fp8Format fp8_format(Fp8Kind kind) {
  return kind == Fp8Kind::kE4M3 ? Fp8Format{3, 7, 448.0f, 0x7Eu}
                                : Fp8Format{2, 15, 57344.0f, 0x7Bu};
}

ROPEKV_HD uint8_t encode_fp8(float x, Fp8Kind kind) {
  const Fp8Format f = fp8_format(kind);
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7Fu;  // NaN, whatever its sign
  float ax;
  std::memcpy(&ax, &a, 4);
  if (ax > f.max_finite) return static_cast<uint8_t>(sign | f.max_code);  // saturate
  const int e = static_cast<int>(a >> 23) - 127;
  uint32_t code;
  if (e < 1 - f.bias) {
    // Below the smallest normal: count quanta of 2^(1 - bias - M). The scaled
    // value is exact (a power-of-two multiply) and < 2^M + 1, so adding and
    // removing 2^23 rounds it to the nearest integer, ties to even. A result
    // of 2^M is the smallest normal's code, as wanted.
    const float scaled = ax * static_cast<float>(1u << (f.bias + f.mantissa_bits - 1));
#if defined(__CUDA_ARCH__)
    code = __float2uint_rn(scaled);  // round to nearest even, in registers
#else
    volatile float t = scaled + 8388608.0f;  // volatile: keep the rounding step
    code = static_cast<uint32_t>(t - 8388608.0f);
#endif
  } else {
    // Normal: round the fp32 mantissa to M bits (nearest even) in integers,
    // then rebias the exponent.
    const int shift = 23 - f.mantissa_bits;
    const uint32_t r = (a + ((1u << (shift - 1)) - 1u) + ((a >> shift) & 1u)) >> shift;
    code = r - (static_cast<uint32_t>(127 - f.bias) << f.mantissa_bits);
  }
  return static_cast<uint8_t>(sign | code);
}

}  // namespace ropekv
