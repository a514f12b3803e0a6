// nanobind binding of ropekv::rope_pool_fused. Thin: arrays arrive through
// DLPack (or the buffer protocol) as they are, never converted, become
// DLTensor views, and go to the C++ front end, which validates everything.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>

#include "ropekv/ropekv.h"

namespace nb = nanobind;

namespace {

// Any dtype, any device, read-only allowed (writability is checked by the
// Python layer and reported after the contract's own checks).
using Array = nb::ndarray<nb::ro>;

constexpr const char* kNames[] = {"q",      "k",      "v",     "positions", "slots",
                                  "k_pool", "v_pool", "q_rot", "k_rot"};

DLTensor to_dl(const Array& a, bool is_bf16) {
  DLTensor t{};
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));
  t.device = DLDevice{static_cast<DLDeviceType>(a.device_type()), a.device_id()};
  t.ndim = static_cast<int32_t>(a.ndim());
  const nb::dlpack::dtype d = a.dtype();
  t.dtype = DLDataType{d.code, d.bits, d.lanes};
  // numpy has no bf16 of its own: the Python layer passes ml_dtypes bf16
  // arrays as uint16 views and marks them here.
  if (is_bf16) t.dtype = DLDataType{kDLBfloat, 16, 1};
  t.shape = const_cast<int64_t*>(a.shape_ptr());
  t.strides = const_cast<int64_t*>(a.stride_ptr());
  t.byte_offset = 0;
  return t;
}

void run(const Array& q, const Array& k, const Array& v, const Array& positions,
         const Array& slots, const Array& k_pool, const Array& v_pool,
         const std::optional<Array>& q_rot, const std::optional<Array>& k_rot,
         int64_t head_dim, int64_t num_qo_heads, int64_t num_kv_heads, double rope_base,
         int64_t rotary_dim, uint32_t bf16_mask, uint32_t readonly_mask, uintptr_t stream, int num_threads,
         bool checked) {
  const Array* arrays[] = {&q, &k, &v, &positions, &slots, &k_pool, &v_pool,
                           q_rot ? &*q_rot : nullptr, k_rot ? &*k_rot : nullptr};
  std::array<DLTensor, 9> dl{};
  for (int i = 0; i < 9; ++i)
    if (arrays[i]) dl[i] = to_dl(*arrays[i], (bf16_mask >> i) & 1u);
  // A missing output (the Python layer passes None only when q or k is not
  // 3-D) stays a 0-D view: validation rejects q/k first.
  ropekv::RopePoolTensors t{dl[0], dl[1], dl[2], dl[3], dl[4], dl[5], dl[6], dl[7], dl[8]};
  ropekv::RopeConfig cfg;
  cfg.head_dim = head_dim;
  cfg.num_qo_heads = num_qo_heads;
  cfg.num_kv_heads = num_kv_heads;
  cfg.rope_base = rope_base;
  cfg.rotary_dim = rotary_dim;
  if (readonly_mask) {
    ropekv::validate(t, cfg);  // the contract's messages come first
    for (int i = 5; i < 9; ++i)
      if ((readonly_mask >> i) & 1u)
        throw ropekv::Error(std::string(kNames[i]) +
                            " is read-only, but ropekv writes into it; pass a writable "
                            "array (e.g. a copy)");
  }
  ropekv::ExecOptions opts;
  opts.num_threads = num_threads;
  opts.stream = reinterpret_cast<void*>(stream);
  opts.checked = checked;
  ropekv::rope_pool_fused(t, cfg, opts);
}

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "ropekv's C++ core (nanobind). Use the ropekv package, not this module.";
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const ropekv::Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
  m.def("run", &run, nb::arg("q").noconvert(), nb::arg("k").noconvert(),
        nb::arg("v").noconvert(), nb::arg("positions").noconvert(),
        nb::arg("slots").noconvert(), nb::arg("k_pool").noconvert(),
        nb::arg("v_pool").noconvert(), nb::arg("q_rot").noconvert().none(),
        nb::arg("k_rot").noconvert().none(), nb::arg("head_dim"), nb::arg("num_qo_heads"),
        nb::arg("num_kv_heads"), nb::arg("rope_base"), nb::arg("rotary_dim"), nb::arg("bf16_mask"),
        nb::arg("readonly_mask"), nb::arg("stream"), nb::arg("num_threads"),
        nb::arg("checked"), nb::call_guard<nb::gil_scoped_release>(),
        "Runs ropekv::rope_pool_fused on DLPack arrays (see ropekv.rope_pool_fused).");
  m.def(
      "check_device_errors",
      [](int device_id, uintptr_t stream) {
        ropekv::check_device_errors(device_id, reinterpret_cast<void*>(stream));
      },
      nb::arg("device_id"), nb::arg("stream"), nb::call_guard<nb::gil_scoped_release>());
  m.def("has_cuda", &ropekv::has_cuda);
  m.def("cpu_target", &ropekv::cpu_target);
  m.attr("__version__") = ropekv::version();
}
