// The backends' entry points. Each takes a validated Problem and trusts it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "problem.h"

namespace ropekv {
namespace cpu {
/// Runs the op on the CPU (Highway SIMD, OpenMP threads).
void run(const Problem& p, const ExecOptions& options);
/// Name of the Highway target the dispatcher picks on this machine.
std::string target_name();
}  // namespace cpu

namespace cuda {
/// True when the CUDA backend is compiled in (src/cuda/), false for the stub.
bool available();
/// Throws Error if any array of a CUDA call is not device memory the kernel
/// can address on the device the arrays name.
void check_addressable(const RopePoolTensors& t);
/// Launches the op on options.stream; no synchronisation, no allocation.
void run(const Problem& p, const ExecOptions& options);
/// See ropekv::check_device_errors.
void check_errors(int device_id, void* stream);
/// Copies the problem's slots to the host (synchronising `stream`), for the
/// checked mode's duplicate check.
std::vector<int64_t> read_slots(const Problem& p, void* stream);
}  // namespace cuda
}  // namespace ropekv
