// libFuzzer target over ropekv::rope_pool_fused's arguments: ranks, shapes,
// strides (negative, zero, padded), dtypes, devices, config values, slot and
// position values, thread counts and checked mode, and every option (pool
// formats incl. fp8, interleaved pairs, partial rotary, rope_scaling,
// cos_sin_cache, QK-norm weights).
//
// Every array is allocated to cover exactly the elements its shape and
// strides reach, so AddressSanitizer reports any access outside them. The
// properties checked: no crash or sanitizer report; a call that throws
// ropekv::Error leaves every byte of every array as it was; a call that
// succeeds wrote no pool row that no token names.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "ropekv/ropekv.h"

namespace {

struct Array {
  std::vector<int64_t> shape, strides;
  std::vector<uint8_t> bytes;
  int64_t min_offset = 0;  // in elements, <= 0
  DLTensor t{};

  void build(FuzzedDataProvider& in, int ndim, const int64_t* want, DLDataType dtype) {
    shape.assign(want, want + ndim);
    strides.resize(ndim);
    int64_t contiguous = 1;
    for (int i = ndim - 1; i >= 0; --i) {
      switch (in.ConsumeIntegralInRange<int>(0, 5)) {
        case 0: strides[i] = 0; break;
        case 1: strides[i] = -contiguous; break;
        case 2: strides[i] = contiguous * in.ConsumeIntegralInRange<int64_t>(2, 3); break;
        default: strides[i] = contiguous; break;
      }
      contiguous *= shape[i] > 0 ? shape[i] : 1;
    }
    int64_t lo = 0, hi = 0, count = 1;
    for (int i = 0; i < ndim; ++i) {
      count *= shape[i];
      if (shape[i] == 0) continue;
      const int64_t reach = strides[i] * (shape[i] - 1);
      (reach < 0 ? lo : hi) += reach;
    }
    const int64_t elem = (dtype.bits + 7) / 8;
    const int64_t n = count == 0 ? 0 : hi - lo + 1;
    bytes.resize(static_cast<size_t>(n * elem));
    for (auto& b : bytes) b = in.ConsumeIntegral<uint8_t>();
    min_offset = lo;
    t.data = n == 0 ? nullptr : bytes.data() - lo * elem;
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = ndim;
    t.dtype = dtype;
    t.shape = shape.data();
    t.strides = in.ConsumeBool() && strides_are_compact() ? nullptr : strides.data();
    t.byte_offset = 0;
  }

  bool strides_are_compact() const {
    int64_t c = 1;
    for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
      if (strides[i] != c) return false;
      c *= shape[i];
    }
    return true;
  }
};

DLDataType pick_float(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<int>(0, 9)) {
    case 0: return {kDLFloat, 64, 1};
    case 1: return {kDLInt, 32, 1};
    case 2: return {kDLFloat, 16, 1};
    case 3: return {kDLBfloat, 16, 1};
    default: return {kDLFloat, 32, 1};
  }
}

DLDataType pick_index(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<int>(0, 7)) {
    case 0: return {kDLFloat, 32, 1};
    case 1: return {kDLUInt, 8, 1};
    case 2: return {kDLInt, 64, 1};
    default: return {kDLInt, 32, 1};
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const int64_t T = in.ConsumeIntegralInRange<int64_t>(0, 9);
  const int64_t Hq = in.ConsumeIntegralInRange<int64_t>(0, 4);
  const int64_t Hk = in.ConsumeIntegralInRange<int64_t>(0, 3);
  const int64_t D = in.ConsumeIntegralInRange<int64_t>(0, 20);
  const int64_t P = in.ConsumeIntegralInRange<int64_t>(0, 12);

  ropekv::RopeConfig cfg;
  cfg.head_dim = in.ConsumeBool() ? D : in.ConsumeIntegralInRange<int64_t>(-2, 24);
  cfg.num_qo_heads = in.ConsumeBool() ? Hq : in.ConsumeIntegralInRange<int64_t>(-1, 5);
  cfg.num_kv_heads = in.ConsumeBool() ? Hk : in.ConsumeIntegralInRange<int64_t>(-1, 5);
  switch (in.ConsumeIntegralInRange<int>(0, 5)) {
    case 0: cfg.rope_base = std::numeric_limits<double>::quiet_NaN(); break;
    case 1: cfg.rope_base = -in.ConsumeFloatingPoint<double>(); break;
    case 2: cfg.rope_base = in.ConsumeFloatingPoint<double>(); break;
    default: cfg.rope_base = 10000.0; break;
  }

  // The options: each off most of the time, sometimes on, sometimes invalid.
  cfg.is_neox = in.ConsumeIntegralInRange<int>(0, 3) != 0;
  if (in.ConsumeIntegralInRange<int>(0, 3) == 0) cfg.rotary_dim = in.ConsumeIntegralInRange<int64_t>(-2, 22);
  const int64_t R = cfg.rotary_dim == 0 ? D : cfg.rotary_dim;
  if (in.ConsumeIntegralInRange<int>(0, 4) == 0) {
    auto& sc = cfg.rope_scaling;
    sc.type = static_cast<ropekv::RopeScalingType>(in.ConsumeIntegralInRange<int>(0, 4));
    auto num = [&](double good) {
      switch (in.ConsumeIntegralInRange<int>(0, 7)) {
        case 0: return std::numeric_limits<double>::quiet_NaN();
        case 1: return -good;
        case 2: return 0.0;
        case 3: return in.ConsumeFloatingPoint<double>();
        default: return good;
      }
    };
    sc.factor = num(8.0);
    sc.low_freq_factor = num(1.0);
    sc.high_freq_factor = num(4.0);
    sc.original_max_position_embeddings = num(8192.0);
    sc.beta_fast = num(32.0);
    sc.beta_slow = num(1.0);
    sc.attention_factor = in.ConsumeBool() ? 0.0 : num(1.2);
    sc.truncate = in.ConsumeBool();
    sc.partial_rotary_factor = num(0.25);
  }
  DLDataType pool_t{};  // set below: q's dtype unless kv_cache_dtype says otherwise
  switch (in.ConsumeIntegralInRange<int>(0, 7)) {
    case 0: cfg.kv_cache_dtype = ropekv::KvCacheDtype::kFloat32; break;
    case 1: cfg.kv_cache_dtype = ropekv::KvCacheDtype::kFp8E4M3; break;
    case 2: cfg.kv_cache_dtype = ropekv::KvCacheDtype::kFp8E5M2; break;
    default: break;
  }
  if (in.ConsumeIntegralInRange<int>(0, 3) == 0) {
    cfg.k_scale = in.ConsumeBool() ? 0.5 : in.ConsumeFloatingPoint<double>();
    cfg.v_scale = in.ConsumeBool() ? 2.0 : in.ConsumeFloatingPoint<double>();
  }
  if (in.ConsumeIntegralInRange<int>(0, 5) == 0) cfg.norm_eps = in.ConsumeFloatingPoint<double>();

  // Mostly well-formed ranks and shapes, sometimes not.
  auto rank = [&](int good) { return in.ConsumeIntegralInRange<int>(0, 7) ? good : in.ConsumeIntegralInRange<int>(0, 4); };
  const DLDataType ft = pick_float(in);
  const DLDataType ft2 = in.ConsumeIntegralInRange<int>(0, 9) ? ft : pick_float(in);
  Array arrays[9];
  const int64_t qs[4] = {T, Hq, D, 2}, ks[4] = {T, Hk, D, 2}, ps[4] = {P, Hk, D, 2};
  const int64_t ts[4] = {T, 2, 2, 2};
  arrays[0].build(in, rank(3), qs, ft);
  arrays[1].build(in, rank(3), ks, ft);
  arrays[2].build(in, rank(3), ks, ft2);
  arrays[3].build(in, rank(1), ts, pick_index(in));
  arrays[4].build(in, rank(1), ts, pick_index(in));
  switch (cfg.kv_cache_dtype) {
    case ropekv::KvCacheDtype::kFloat32: pool_t = {kDLFloat, 32, 1}; break;
    case ropekv::KvCacheDtype::kFp8E4M3:
    case ropekv::KvCacheDtype::kFp8E5M2: pool_t = {kDLUInt, 8, 1}; break;
    default: pool_t = ft; break;
  }
  if (in.ConsumeIntegralInRange<int>(0, 9) == 0) pool_t = pick_float(in);
  arrays[5].build(in, rank(3), ps, pool_t);
  arrays[6].build(in, rank(3), ps, in.ConsumeIntegralInRange<int>(0, 9) ? pool_t : ft2);
  arrays[7].build(in, rank(3), qs, ft);
  arrays[8].build(in, rank(3), ks, ft);
  // Optional arrays: cos_sin_cache [rows, R], q/k norm weights [D].
  Array optional[3];
  const int64_t rows = in.ConsumeIntegralInRange<int64_t>(0, 6);
  // (4 entries each: a wrong rank reads up to 4.)
  const int64_t cs[4] = {rows, in.ConsumeIntegralInRange<int>(0, 5) ? R : R + 2, 2, 2};
  const int64_t ws[4] = {in.ConsumeIntegralInRange<int>(0, 5) ? D : D + 1, 2, 2, 2};
  if (in.ConsumeIntegralInRange<int>(0, 3) == 0)
    optional[0].build(in, rank(2), cs, in.ConsumeBool() ? DLDataType{kDLFloat, 32, 1} : pick_float(in));
  if (in.ConsumeIntegralInRange<int>(0, 3) == 0)
    optional[1].build(in, rank(1), ws, in.ConsumeBool() ? DLDataType{kDLFloat, 32, 1} : pick_float(in));
  if (in.ConsumeIntegralInRange<int>(0, 3) == 0)
    optional[2].build(in, rank(1), ws, in.ConsumeBool() ? ft : pick_float(in));
  // Positions: with a table, mostly inside it.
  Array& positions = arrays[3];
  if (optional[0].t.ndim != 0 && positions.t.ndim == 1 && positions.t.dtype.code == kDLInt &&
      positions.t.data) {
    for (int64_t i = 0; i < positions.shape[0]; ++i) {
      const int64_t v = in.ConsumeIntegralInRange<int64_t>(-1, rows);
      const int64_t off = i * positions.strides[0];
      if (positions.t.dtype.bits == 32)
        static_cast<int32_t*>(positions.t.data)[off] = static_cast<int32_t>(v);
      else
        static_cast<int64_t*>(positions.t.data)[off] = v;
    }
  }

  // Slot values: mostly in range, sometimes negative, repeated or too large.
  Array& slots = arrays[4];
  if (slots.t.ndim == 1 && slots.t.dtype.code == kDLInt && slots.t.data) {
    for (int64_t i = 0; i < slots.shape[0]; ++i) {
      const int64_t s = in.ConsumeIntegralInRange<int64_t>(-3, P + 2);
      const int64_t off = i * slots.strides[0];
      if (slots.t.dtype.bits == 32)
        static_cast<int32_t*>(slots.t.data)[off] = static_cast<int32_t>(s);
      else
        static_cast<int64_t*>(slots.t.data)[off] = s;
    }
  }

  std::vector<std::vector<uint8_t>> before;
  for (const Array& a : arrays) before.push_back(a.bytes);
  std::vector<std::vector<uint8_t>> optional_before;
  for (const Array& a : optional) optional_before.push_back(a.bytes);

  ropekv::RopePoolTensors t{arrays[0].t, arrays[1].t, arrays[2].t, arrays[3].t, arrays[4].t,
                            arrays[5].t, arrays[6].t, arrays[7].t, arrays[8].t,
                            optional[0].t, optional[1].t, optional[2].t};
  ropekv::ExecOptions opts;
  opts.num_threads = in.ConsumeIntegralInRange<int>(0, 3);
  opts.checked = in.ConsumeBool();
  bool threw = false;
  try {
    ropekv::rope_pool_fused(t, cfg, opts);
  } catch (const ropekv::Error&) {
    threw = true;
  }
  if (threw) {
    for (int i = 0; i < 9; ++i)
      if (arrays[i].bytes != before[i]) __builtin_trap();  // a failed call wrote
    for (int i = 0; i < 3; ++i)
      if (optional[i].bytes != optional_before[i]) __builtin_trap();
    return 0;
  }
  // Success: the inputs q, k, v, positions, slots are unchanged, unless an
  // output aliases them (it cannot here: every array has its own buffer).
  for (int i = 0; i < 5; ++i)
    if (arrays[i].bytes != before[i]) __builtin_trap();
  for (int i = 0; i < 3; ++i)  // the optional arrays are read only
    if (optional[i].bytes != optional_before[i]) __builtin_trap();
  return 0;
}
