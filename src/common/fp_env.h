// The floating-point environment ropekv computes in, whatever the caller's
// thread has set: IEEE arithmetic with subnormals and rounding to nearest
// even. A caller may run with flush-to-zero / denormals-are-zero (PyTorch's
// torch.set_flush_denormal(True) sets them on its thread) or another
// rounding mode; the OpenMP threads of a call keep their own settings, so
// without this the bits of a result would depend on the thread count and
// differ from the contract's fp32 arithmetic. Host code only.
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64) || defined(_M_IX86)
#include <xmmintrin.h>
#define ROPEKV_FP_ENV_SSE 1
#endif

namespace ropekv {

/// For its lifetime, the calling thread's SIMD floating-point control is
/// IEEE's default (x86 MXCSR: round to nearest, FTZ and DAZ off, exceptions
/// masked; AArch64 FPCR: round to nearest, FZ and FZ16 off); the caller's
/// setting is restored on destruction. Costs two control-register reads
/// where the setting is already the default.
class IeeeFpScope {
 public:
  IeeeFpScope() {
#if defined(ROPEKV_FP_ENV_SSE)
    saved_ = _mm_getcsr();
    // Bits 0-5 are sticky exception flags, kept; 0x1F80 masks every
    // exception with round to nearest, FTZ (bit 15) and DAZ (bit 6) off.
    const unsigned int want = (saved_ & 0x3Fu) | 0x1F80u;
    if (want != saved_) _mm_setcsr(want);
#elif defined(__aarch64__)
    asm volatile("mrs %0, fpcr" : "=r"(saved_));
    // FZ (24), RMode (23:22), FZ16 (19) cleared: IEEE with subnormals, nearest.
    const uint64_t want = saved_ & ~((uint64_t{1} << 24) | (uint64_t{3} << 22) | (uint64_t{1} << 19));
    if (want != saved_) asm volatile("msr fpcr, %0" : : "r"(want));
#endif
  }
  ~IeeeFpScope() {
#if defined(ROPEKV_FP_ENV_SSE)
    // (Keeps flags raised inside, as the caller's own arithmetic would.)
    const unsigned int now = _mm_getcsr();
    const unsigned int back = (saved_ & ~0x3Fu) | (now & 0x3Fu);
    if (back != now) _mm_setcsr(back);
#elif defined(__aarch64__)
    uint64_t now;
    asm volatile("mrs %0, fpcr" : "=r"(now));
    if (now != saved_) asm volatile("msr fpcr, %0" : : "r"(saved_));
#endif
  }
  IeeeFpScope(const IeeeFpScope&) = delete;
  IeeeFpScope& operator=(const IeeeFpScope&) = delete;

 private:
#if defined(ROPEKV_FP_ENV_SSE)
  unsigned int saved_ = 0;
#elif defined(__aarch64__)
  uint64_t saved_ = 0;
#endif
};

}  // namespace ropekv
