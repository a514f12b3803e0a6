// Front end: validate, then hand the Problem to the backend of its device.
#include "backends.h"
#include "common/fp_env.h"
#include "problem.h"

namespace ropekv {

void rope_pool_fused(const RopePoolTensors& tensors, const RopeConfig& config,
                     const ExecOptions& options) {
  const IeeeFpScope ieee;  // (the CPU backend's threads take it too: run_planned)
  const bool on_cpu = tensors.q.device.device_type == kDLCPU;
  // On the CPU the slots are read here, so an out-of-range slot raises before
  // any write; on a GPU that read would cost a sync, so the kernel guards.
  const Problem p = make_problem(tensors, config, /*check_index_values=*/on_cpu,
                                 /*check_duplicates=*/on_cpu && options.checked);
  check_exec_options(options);  // (last, as the contract lists it)
  if (p.num_tokens == 0) return;
  if (on_cpu) {
    cpu::run(p, options);
    return;
  }
  cuda::run(p, options);
  if (options.checked) {
    // A GPU reports after the launch (reading slots first would cost the same
    // sync before every call): skipped out-of-range slots, then duplicates.
    cuda::check_errors(p.device.device_id, options.stream);
    check_unique_slots(cuda::read_slots(p, options.stream));
  }
}

void check_device_errors(int device_id, void* stream) {
  cuda::check_errors(device_id, stream);
}

std::vector<float> rope_inv_freq(const RopeConfig& config) {
  const IeeeFpScope ieee;
  const int64_t R = check_frequency_config(config);
  std::vector<float> out(static_cast<size_t>(R / 2));
  fill_inv_freq(FreqSpec{config.rope_base, R, config.rope_scaling}, out.data());
  return out;
}

double rope_attention_factor(const RopeScaling& scaling) { return attention_factor(scaling); }

bool has_cuda() { return cuda::available(); }

std::string cpu_target() { return cpu::target_name(); }

const char* version() { return ROPEKV_VERSION; }

}  // namespace ropekv
