// The CUDA backend of a build without nvcc: reports itself absent. The front
// end rejects CUDA arrays before these could be reached.
#include "backends.h"

namespace ropekv {
namespace cuda {
bool available() { return false; }
void check_addressable(const RopePoolTensors&) {
  throw Error("this build of ropekv has no CUDA backend (rebuild with nvcc on PATH)");
}
void check_errors(int, void*) {}
std::vector<int64_t> read_slots(const Problem&, void*) { return {}; }
void run(const Problem&, const ExecOptions&) {
  throw Error("this build of ropekv has no CUDA backend (rebuild with nvcc on PATH)");
}
}  // namespace cuda
}  // namespace ropekv
