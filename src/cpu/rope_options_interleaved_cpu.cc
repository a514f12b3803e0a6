// CPU backend, options path, interleaved pairs (is_neox=False): the same
// kernels as rope_options_cpu.cc (rope_options-inl.h) for the other pair
// layout, in a translation unit of their own so that the two halves of the
// options path's many instantiations compile in parallel.

#include "backends.h"
#include "cpu/host.h"
#include "cpu/scratch.h"
#include "problem.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/rope_options_interleaved_cpu.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "cpu/rope_options-inl.h"
#include "cpu/rope_pool_cpu-inl.h"

HWY_BEFORE_NAMESPACE();
namespace ropekv {
namespace cpu {
namespace HWY_NAMESPACE {

void ProcessOptionsInterleaved(const OptWork& w) { RunOptionsLayout<true>(w); }

}  // namespace HWY_NAMESPACE
}  // namespace cpu
}  // namespace ropekv
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ropekv {
namespace cpu {

HWY_EXPORT(ProcessOptionsInterleaved);

void process_options_interleaved(const OptWork& w) {
  HWY_DYNAMIC_DISPATCH(ProcessOptionsInterleaved)(w);
}

}  // namespace cpu
}  // namespace ropekv
#endif  // HWY_ONCE
