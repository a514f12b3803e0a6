// nanobind binding of ropekv::rope_pool_fused. Thin: arrays arrive through
// DLPack (or the buffer protocol) as they are, never converted, become
// DLTensor views, and go to the C++ front end, which validates everything.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/string.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

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

using Scaling = std::array<double, 11>;

// The binding's rope_scaling: (type, factor, low_freq_factor,
// high_freq_factor, original_max_position_embeddings, beta_fast, beta_slow,
// attention_factor, mscale, mscale_all_dim, truncate), parsed from the dict by
// the Python layer.
ropekv::RopeScaling to_scaling(const std::optional<Scaling>& v) {
  ropekv::RopeScaling s;
  if (!v) return s;
  const Scaling& a = *v;
  s.type = static_cast<ropekv::RopeScalingType>(static_cast<int>(a[0]));
  s.factor = a[1];
  s.low_freq_factor = a[2];
  s.high_freq_factor = a[3];
  s.original_max_position_embeddings = a[4];
  s.beta_fast = a[5];
  s.beta_slow = a[6];
  s.attention_factor = a[7];
  s.mscale = a[8];
  s.mscale_all_dim = a[9];
  s.truncate = a[10] != 0.0;
  return s;
}

void execute(const ropekv::RopePoolTensors& t, const ropekv::RopeConfig& cfg,
             uint32_t readonly_mask, uintptr_t stream, int num_threads, bool checked) {
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

// Arrays 0..11 (q .. k_rot, then cos_sin_cache, q_norm_weight, k_norm_weight)
// as DLTensor views; a missing one stays a zero DLTensor (absent / 0-D).
ropekv::RopePoolTensors tensors(const Array* const (&arrays)[12], uint32_t bf16_mask) {
  std::array<DLTensor, 12> dl{};
  for (int i = 0; i < 12; ++i)
    if (arrays[i]) dl[i] = to_dl(*arrays[i], (bf16_mask >> i) & 1u);
  return ropekv::RopePoolTensors{dl[0], dl[1], dl[2], dl[3], dl[4],  dl[5],
                                 dl[6], dl[7], dl[8], dl[9], dl[10], dl[11]};
}

ropekv::RopeConfig config(int64_t head_dim, int64_t num_qo_heads, int64_t num_kv_heads,
                          double rope_base, int64_t rotary_dim) {
  ropekv::RopeConfig cfg;
  cfg.head_dim = head_dim;
  cfg.num_qo_heads = num_qo_heads;
  cfg.num_kv_heads = num_kv_heads;
  cfg.rope_base = rope_base;
  cfg.rotary_dim = rotary_dim;
  return cfg;
}

// The original call (no options): the shortest path.
void run(const Array& q, const Array& k, const Array& v, const Array& positions,
         const Array& slots, const Array& k_pool, const Array& v_pool,
         const std::optional<Array>& q_rot, const std::optional<Array>& k_rot,
         int64_t head_dim, int64_t num_qo_heads, int64_t num_kv_heads, double rope_base,
         int64_t rotary_dim, uint32_t bf16_mask, uint32_t readonly_mask, uintptr_t stream,
         int num_threads, bool checked) {
  const Array* arrays[12] = {&q, &k, &v, &positions, &slots, &k_pool, &v_pool,
                             q_rot ? &*q_rot : nullptr, k_rot ? &*k_rot : nullptr,
                             nullptr, nullptr, nullptr};
  execute(tensors(arrays, bf16_mask),
          config(head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim), readonly_mask,
          stream, num_threads, checked);
}

// The call with the options of ropekv.rope_pool_fused's later keywords.
void run_options(const Array& q, const Array& k, const Array& v, const Array& positions,
                 const Array& slots, const Array& k_pool, const Array& v_pool,
                 const std::optional<Array>& q_rot, const std::optional<Array>& k_rot,
                 const std::optional<Array>& cos_sin_cache,
                 const std::optional<Array>& q_norm_weight,
                 const std::optional<Array>& k_norm_weight, int64_t head_dim,
                 int64_t num_qo_heads, int64_t num_kv_heads, double rope_base,
                 int64_t rotary_dim, bool is_neox, const std::optional<Scaling>& rope_scaling,
                 int kv_cache_dtype, double k_scale, double v_scale, double norm_eps,
                 uint32_t bf16_mask, uint32_t readonly_mask, uintptr_t stream, int num_threads,
                 bool checked) {
  auto opt = [](const std::optional<Array>& a) { return a ? &*a : nullptr; };
  const Array* arrays[12] = {&q,         &k,         &v,   &positions,
                             &slots,     &k_pool,    &v_pool, opt(q_rot),
                             opt(k_rot), opt(cos_sin_cache), opt(q_norm_weight),
                             opt(k_norm_weight)};
  ropekv::RopeConfig cfg = config(head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim);
  cfg.is_neox = is_neox;
  cfg.rope_scaling = to_scaling(rope_scaling);
  cfg.kv_cache_dtype = static_cast<ropekv::KvCacheDtype>(kv_cache_dtype);
  cfg.k_scale = k_scale;
  cfg.v_scale = v_scale;
  cfg.norm_eps = norm_eps;
  execute(tensors(arrays, bf16_mask), cfg, readonly_mask, stream, num_threads, checked);
}

std::pair<std::vector<float>, double> inv_freq(int64_t head_dim, double rope_base,
                                               int64_t rotary_dim,
                                               const std::optional<Scaling>& rope_scaling) {
  ropekv::RopeConfig cfg = config(head_dim, 1, 1, rope_base, rotary_dim);
  cfg.rope_scaling = to_scaling(rope_scaling);
  return {ropekv::rope_inv_freq(cfg), ropekv::rope_attention_factor(cfg.rope_scaling)};
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
  m.def("run_options", &run_options, nb::arg("q").noconvert(), nb::arg("k").noconvert(),
        nb::arg("v").noconvert(), nb::arg("positions").noconvert(),
        nb::arg("slots").noconvert(), nb::arg("k_pool").noconvert(),
        nb::arg("v_pool").noconvert(), nb::arg("q_rot").noconvert().none(),
        nb::arg("k_rot").noconvert().none(), nb::arg("cos_sin_cache").noconvert().none(),
        nb::arg("q_norm_weight").noconvert().none(), nb::arg("k_norm_weight").noconvert().none(),
        nb::arg("head_dim"), nb::arg("num_qo_heads"), nb::arg("num_kv_heads"),
        nb::arg("rope_base"), nb::arg("rotary_dim"), nb::arg("is_neox"),
        nb::arg("rope_scaling").none(), nb::arg("kv_cache_dtype"), nb::arg("k_scale"),
        nb::arg("v_scale"), nb::arg("norm_eps"), nb::arg("bf16_mask"), nb::arg("readonly_mask"),
        nb::arg("stream"), nb::arg("num_threads"), nb::arg("checked"),
        nb::call_guard<nb::gil_scoped_release>(),
        "Runs ropekv::rope_pool_fused with its options (see ropekv.rope_pool_fused).");
  m.def("inv_freq", &inv_freq, nb::arg("head_dim"), nb::arg("rope_base"), nb::arg("rotary_dim"),
        nb::arg("rope_scaling").none(), "See ropekv.rope_inv_freq.");
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
