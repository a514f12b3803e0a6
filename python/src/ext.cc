// nanobind binding of ropekv::rope_pool_fused. Thin: arrays arrive through
// DLPack (or the buffer protocol) as they are, never converted, become
// DLTensor views, and go to the C++ front end, which validates everything.
// run_fast reads numpy arrays and PyTorch CPU and CUDA tensors in place
// instead (see "fast path" below).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/string.h>

#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ropekv/ropekv.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace nb = nanobind;

namespace {

// Any dtype, any device, read-only allowed (writability is checked by the
// Python layer and reported after the contract's own checks).
using Array = nb::ndarray<nb::ro>;

constexpr const char* kNames[] = {"q",      "k",      "v",     "positions", "slots",
                                  "k_pool", "v_pool", "q_rot", "k_rot"};

// What an array the Python layer passes as a view of its bits stands for
// (2 bits per array in the binding's dtype_views): numpy has no bf16 or fp8
// of its own, so ml_dtypes bf16 arrays come as uint16 and fp8 arrays
// (ml_dtypes or PyTorch) as uint8, and the core sees their own dtype.
enum DtypeView : uint32_t { kOwnDtype, kBfloat16View, kFloat8E4M3fnView, kFloat8E5M2View };

DLTensor to_dl(const Array& a, uint32_t view) {
  DLTensor t{};
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));
  t.device = DLDevice{static_cast<DLDeviceType>(a.device_type()), a.device_id()};
  t.ndim = static_cast<int32_t>(a.ndim());
  const nb::dlpack::dtype d = a.dtype();
  t.dtype = DLDataType{d.code, d.bits, d.lanes};
  switch (view) {
    case kBfloat16View: t.dtype = DLDataType{kDLBfloat, 16, 1}; break;
    case kFloat8E4M3fnView: t.dtype = DLDataType{ropekv::kDLCodeFloat8E4M3fn, 8, 1}; break;
    case kFloat8E5M2View: t.dtype = DLDataType{ropekv::kDLCodeFloat8E5M2, 8, 1}; break;
    default: break;
  }
  t.shape = const_cast<int64_t*>(a.shape_ptr());
  t.strides = const_cast<int64_t*>(a.stride_ptr());
  t.byte_offset = 0;
  return t;
}

using Scaling = std::array<double, 13>;

// The binding's rope_scaling: (type, factor, low_freq_factor,
// high_freq_factor, original_max_position_embeddings, beta_fast, beta_slow,
// attention_factor, mscale, mscale_all_dim, truncate, whether attention_factor
// was given, partial_rotary_factor of proportional), parsed from the dict by
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
  if (a[11] != 0.0) s.attention_factor = a[7];
  s.mscale = a[8];
  s.mscale_all_dim = a[9];
  s.truncate = a[10] != 0.0;
  s.partial_rotary_factor = a[12];
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
ropekv::RopePoolTensors tensors(const Array* const (&arrays)[12], uint32_t dtype_views) {
  std::array<DLTensor, 12> dl{};
  for (int i = 0; i < 12; ++i)
    if (arrays[i]) dl[i] = to_dl(*arrays[i], (dtype_views >> (2 * i)) & 3u);
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
         int64_t rotary_dim, uint32_t dtype_views, uint32_t readonly_mask, uintptr_t stream,
         int num_threads, bool checked) {
  const Array* arrays[12] = {&q, &k, &v, &positions, &slots, &k_pool, &v_pool,
                             q_rot ? &*q_rot : nullptr, k_rot ? &*k_rot : nullptr,
                             nullptr, nullptr, nullptr};
  execute(tensors(arrays, dtype_views),
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
                 uint32_t dtype_views, uint32_t readonly_mask, uintptr_t stream, int num_threads,
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
  execute(tensors(arrays, dtype_views), cfg, readonly_mask, stream, num_threads, checked);
}

// ---------------------------------------------------------------- fast path
// The common call (numpy arrays or PyTorch CPU or CUDA tensors, any
// options) reads each array's pointer, shape and strides straight from the
// object: no DLPack capsule or numpy view per array, which cost more than
// the op at T = 1. Anything it does not know exactly (another type, dtype
// or device, a tensor with the negative bit, a big-endian or unaligned
// numpy array, an argument of another type) makes it decline before
// anything is written, and the Python layer takes the general path, so
// errors and conversions stay those of the general path.

constexpr int kFastMaxDims = 3;  // the contract's largest rank; a larger one takes the general path

struct FastDtype {
  PyObject* dtype;  // a numpy dtype or torch.dtype instance, compared by identity
  DLDataType code;
  // torch with the DLPack C exchange API: the type the API gives a tensor of
  // this dtype, which identifies the dtype there (no dtype attribute read).
  DLDataType exported{};
};

// An attribute (or a method called without arguments) of the registered
// type. When the type holds a C getset or method descriptor for it, that
// descriptor is called directly: the attribute lookup per read was about a
// tenth of the fast path's time with PyTorch tensors (run_fast, 9 tensors:
// 4.8-5.2 -> 4.4-4.5 us). A method set on one tensor object is thus
// ignored: the type's method is what describes the tensor's memory.
struct Member {
  PyObject* name = nullptr;
  PyObject* descr = nullptr;  // null: generic attribute lookup
  bool call = false;
  bool getset = false;
  bool present = false;  // the type has it (else every read fails)
};

enum MemberId {
  kDtype, kArrayStruct, kIsCpu, kIsCuda, kGetDevice, kIsNeg, kIsZero, kShape, kStride, kDataPtr,
  kStorageOffset, kMembers
};

// DLPack's C exchange API (DLPack 1.3: the `__dlpack_c_exchange_api__`
// capsule of a tensor type; PyTorch has it since 2.10), the part ropekv
// calls. Declared here because the dlpack.h ropekv builds against may
// predate it; the layout is DLPack's ABI for major version 1.
struct DLPackExchangeApiV1 {
  uint32_t major, minor;  // DLPackVersion
  const void* prev_api;
  const void* managed_tensor_allocator;
  const void* managed_tensor_from_py_object_no_sync;
  const void* managed_tensor_to_py_object_no_sync;
  // Fills a DLTensor that borrows the object's shape and strides until
  // control returns to Python; -1 with a Python error set on failure.
  int (*dltensor_from_py_object_no_sync)(void* py_object, DLTensor* out);
  const void* current_work_stream;
};

struct FastFramework {
  PyTypeObject* type = nullptr;  // numpy.ndarray or torch.Tensor, exactly (no subclass)
  std::vector<FastDtype> dtypes;
  PyObject* empty = nullptr;  // numpy.empty or torch.empty_like: new outputs
  Member members[kMembers];
  // torch: where the type has it, a tensor's dtype, device, shape, strides
  // and address come from one C call instead of six attribute reads (about
  // 0.5 us per tensor on the development machine).
  const DLPackExchangeApiV1* exchange = nullptr;
};

// Registered once per framework by the Python layer (ropekv never imports
// torch itself); the references are kept for the life of the process.
struct FastTypes {
  FastFramework numpy, torch;
  PyObject* contiguous_format = nullptr;  // torch.contiguous_format
  PyObject* kw_memory_format = nullptr;
  // torch's current raw CUDA stream of a device index (a cudaStream_t as an
  // int), or null: CUDA tensors then take the general path.
  PyObject* current_stream = nullptr;
};

FastTypes& fast_types() {
  static FastTypes* f = new FastTypes();  // never destroyed: outlives the interpreter
  return *f;
}

// numpy's __array_struct__ capsule (numpy's documented array interface, C side).
struct PyArrayInterface {
  int two;
  int nd;
  char typekind;
  int itemsize;
  int flags;
  Py_intptr_t* shape;
  Py_intptr_t* strides;
  void* data;
  PyObject* descr;
};
constexpr int kNpyAligned = 0x0100, kNpyNotSwapped = 0x0200, kNpyWriteable = 0x0400;

struct FastView {
  DLTensor t{};
  int64_t shape[kFastMaxDims] = {};
  int64_t strides[kFastMaxDims] = {};
  PyObject* dtype = nullptr;  // the registered dtype object (borrowed)
  bool is_torch = false;
  bool read_only = false;
};

// A new reference to o.name (or o.name() for a method), or nullptr with no
// Python error left set.
PyObject* attr(PyObject* o, const Member& m) {
  PyObject* r;
  if (m.descr && m.getset)
    r = Py_TYPE(m.descr)->tp_descr_get(m.descr, o, reinterpret_cast<PyObject*>(Py_TYPE(o)));
  else if (m.descr)
    r = PyObject_Vectorcall(m.descr, &o, 1, nullptr);
  else
    r = m.call ? PyObject_CallMethodNoArgs(o, m.name) : PyObject_GetAttr(o, m.name);
  if (!r) PyErr_Clear();
  return r;
}

Member member(PyTypeObject* type, const char* name, bool call) {
  Member m;
  m.name = PyUnicode_InternFromString(name);
  m.call = call;
  if (!m.name) throw nb::python_error();
  PyObject* d = PyObject_GetAttr(reinterpret_cast<PyObject*>(type), m.name);
  m.present = d != nullptr;
  if (!d) {
    PyErr_Clear();
  } else if (call ? Py_IS_TYPE(d, &PyMethodDescr_Type) : Py_IS_TYPE(d, &PyGetSetDescr_Type)) {
    m.descr = d;  // kept
    m.getset = !call;
  } else {
    Py_DECREF(d);
  }
  return m;
}

void set_dtype(const FastDtype& d, FastView& v) {
  v.t.dtype = d.code;
  v.dtype = d.dtype;
}

// Looks o.dtype up in the framework's table.
bool dtype_of(PyObject* o, const FastFramework& fw, FastView& v) {
  PyObject* dtype = attr(o, fw.members[kDtype]);
  if (!dtype) return false;
  for (const FastDtype& d : fw.dtypes)
    if (d.dtype == dtype) {
      set_dtype(d, v);
      break;
    }
  Py_DECREF(dtype);
  return v.dtype != nullptr;
}

// Reads a tuple of at most kFastMaxDims Python ints (torch.Size is a tuple)
// of n entries (any number when n < 0; n is then set).
bool int_tuple(PyObject* tup, int64_t* out, int& n) {
  if (!tup || !PyTuple_Check(tup)) return false;
  const Py_ssize_t size = PyTuple_GET_SIZE(tup);
  if (size > kFastMaxDims || (n >= 0 && size != n)) return false;
  for (Py_ssize_t i = 0; i < size; ++i) {
    PyObject* item = PyTuple_GET_ITEM(tup, i);
    if (!PyLong_CheckExact(item)) return false;
    int overflow = 0;
    const long long x = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow || (x == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    out[i] = x;
  }
  n = static_cast<int>(size);
  return true;
}

bool numpy_view(PyObject* o, const FastTypes& f, FastView& v) {
  const FastFramework& fw = f.numpy;
  if (!dtype_of(o, fw, v)) return false;
  PyObject* cap = attr(o, fw.members[kArrayStruct]);
  if (!cap) return false;
  bool ok = false;
  auto* a = static_cast<const PyArrayInterface*>(PyCapsule_GetPointer(cap, nullptr));
  if (!a) {
    PyErr_Clear();
  } else if (a->two == 2 && a->nd <= kFastMaxDims && a->itemsize * 8 == v.t.dtype.bits &&
             (a->flags & (kNpyAligned | kNpyNotSwapped)) == (kNpyAligned | kNpyNotSwapped)) {
    ok = true;
    for (int i = 0; i < a->nd; ++i) {
      // numpy strides are bytes, DLPack's elements (numpy's own DLPack export
      // refuses strides that are not whole elements: the general path reports it)
      if (a->strides[i] % a->itemsize != 0) ok = false;
      v.shape[i] = a->shape[i];
      v.strides[i] = a->strides[i] / a->itemsize;
    }
    v.t.ndim = a->nd;
    v.t.data = a->data;
    v.t.device = DLDevice{kDLCPU, 0};
    v.read_only = !(a->flags & kNpyWriteable);
  }
  Py_DECREF(cap);  // the array itself stays alive: the caller holds it
  return ok;
}

// The device of a PyTorch tensor: CPU, or CUDA where a current-stream
// function is registered; any other device takes the general path.
bool torch_device(const FastTypes& f, DLDevice d, FastView& v) {
  if (d.device_type == kDLCPU) {
    v.t.device = DLDevice{kDLCPU, 0};
    return true;
  }
  if (d.device_type != kDLCUDA || !f.current_stream || d.device_id < 0) return false;
  v.t.device = d;
  return true;
}

// Dtype, device, shape, strides and address through DLPack's exchange API.
bool torch_fields_exchange(PyObject* o, const FastTypes& f, FastView& v, int& n) {
  DLTensor d{};
  if (f.torch.exchange->dltensor_from_py_object_no_sync(o, &d) != 0) {
    PyErr_Clear();  // sparse, MKL-DNN and other tensors DLPack cannot describe
    return false;
  }
  if (!torch_device(f, d.device, v) || d.ndim < 0 || d.ndim > kFastMaxDims) return false;
  for (const FastDtype& t : f.torch.dtypes)
    if (t.exported.code == d.dtype.code && t.exported.bits == d.dtype.bits &&
        t.exported.lanes == d.dtype.lanes) {
      set_dtype(t, v);
      break;
    }
  if (!v.dtype) return false;
  n = d.ndim;
  int64_t row_major = 1;  // (null strides: row-major)
  for (int i = n - 1; i >= 0; --i) {
    v.shape[i] = d.shape[i];
    v.strides[i] = d.strides ? d.strides[i] : row_major;
    row_major *= d.shape[i];
  }
  v.t.data = static_cast<char*>(d.data) + d.byte_offset;
  return true;
}

// The same through the tensor's attributes (a PyTorch without the API).
bool torch_fields_attributes(PyObject* o, const FastTypes& f, FastView& v, int& n) {
  const FastFramework& fw = f.torch;
  PyObject* is_cpu = attr(o, fw.members[kIsCpu]);
  Py_XDECREF(is_cpu);
  if (is_cpu == Py_True) {
    v.t.device = DLDevice{kDLCPU, 0};
  } else {
    if (!f.current_stream || is_cpu != Py_False) return false;
    PyObject* is_cuda = attr(o, fw.members[kIsCuda]);
    Py_XDECREF(is_cuda);
    if (is_cuda != Py_True) return false;
    PyObject* index = attr(o, fw.members[kGetDevice]);
    if (!index) return false;
    const long device = PyLong_AsLong(index);
    Py_DECREF(index);
    if (device < 0 || device > std::numeric_limits<int32_t>::max()) {
      PyErr_Clear();
      return false;
    }
    if (!torch_device(f, DLDevice{kDLCUDA, static_cast<int32_t>(device)}, v)) return false;
  }
  // Sparse, MKL-DNN or wrapper tensors raise on shape/stride()/data_ptr():
  // they take the general path.
  PyObject* shape = attr(o, fw.members[kShape]);
  bool ok = int_tuple(shape, v.shape, n);
  Py_XDECREF(shape);
  if (!ok) return false;
  PyObject* strides = attr(o, fw.members[kStride]);
  ok = int_tuple(strides, v.strides, n);
  Py_XDECREF(strides);
  if (!ok) return false;
  PyObject* ptr = attr(o, fw.members[kDataPtr]);
  if (!ptr) return false;
  v.t.data = PyLong_AsVoidPtr(ptr);  // data_ptr() includes the storage offset
  Py_DECREF(ptr);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

bool torch_view(PyObject* o, const FastTypes& f, FastView& v) {
  const FastFramework& fw = f.torch;
  int n = -1;
  if (!(fw.exchange ? torch_fields_exchange(o, f, v, n)
                    : dtype_of(o, fw, v) && torch_fields_attributes(o, f, v, n)))
    return false;
  // A tensor with the negative bit (e.g. z.conj().imag) holds its values
  // negated: the general path raises for it. (A tensor that requires grad
  // is read and written in place, as the general path does through DLPack.)
  PyObject* is_neg = attr(o, fw.members[kIsNeg]);
  Py_XDECREF(is_neg);
  if (is_neg != Py_False) return false;
  // A tensor whose storage was freed (resized to 0 bytes, as FSDP does), and
  // a ZeroTensor (torch._efficientzerotensor, autograd's zero gradients),
  // have no memory: their address is null plus the view's offset in bytes
  // (of any size), which no live storage has. The general path raises for
  // them, so such calls are left to it. (An empty tensor has no address to
  // compare; a torch without ZeroTensors has no _is_zerotensor.)
  int64_t numel = 1;
  for (int d = 0; d < n; ++d) numel *= v.shape[d];
  if (numel > 0) {
    PyObject* off = attr(o, fw.members[kStorageOffset]);
    if (!off) return false;
    const long long elements = PyLong_AsLongLong(off);
    Py_DECREF(off);
    if (elements == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    if (static_cast<unsigned long long>(elements) * (v.t.dtype.bits / 8) ==
        reinterpret_cast<uintptr_t>(v.t.data))
      return false;
  } else if (fw.members[kIsZero].present) {
    PyObject* is_zero = attr(o, fw.members[kIsZero]);
    Py_XDECREF(is_zero);
    if (is_zero != Py_False) return false;
  }
  v.t.ndim = n;
  v.is_torch = true;
  return true;
}

bool fast_view(PyObject* o, FastView& v) {
  const FastTypes& f = fast_types();
  PyTypeObject* tp = Py_TYPE(o);
  bool ok = false;
  if (tp == f.numpy.type && tp)
    ok = numpy_view(o, f, v);
  else if (tp == f.torch.type && tp)
    ok = torch_view(o, f, v);
  if (!ok) return false;
  v.t.shape = v.shape;
  v.t.strides = v.strides;
  return true;
}

// A new CPU output of 4 MiB or more asks for transparent huge pages over its
// 2 MiB-aligned interior, as numpy does for its own arrays (PyTorch's CPU
// allocator does not, unless THP_MEM_ALLOC_ENABLE is set): its first write,
// which is the call's, then takes one page fault per 2 MiB instead of one
// per 4 KiB (Llama-3.1-8B float32 q_rot at T = 8192, 134 MB: made and first
// filled in 19 ms instead of 56, one thread). Only a hint: where the kernel
// has huge pages off, or on other systems, nothing changes.
void advise_huge_pages(uintptr_t data, uint64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uint64_t kHuge = uint64_t{1} << 21;
  if (bytes < 2 * kHuge) return;
  const uint64_t begin = (data + kHuge - 1) & ~(kHuge - 1);
  const uint64_t end = (data + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

// A new output of src's shape and dtype, row-major, in src's framework, as
// the general path makes it (numpy.empty; torch.empty_like, whose default
// keeps src's strides, so the memory_format keyword, which costs 0.2 us,
// is given only when src is not row-major already).
nb::object new_output(PyObject* src, const FastView& v) {
  const FastTypes& f = fast_types();
  PyObject* out;
  if (v.is_torch) {
    bool row_major = true;
    for (int64_t i = v.t.ndim - 1, expect = 1; i >= 0; expect *= v.shape[i], --i)
      row_major &= v.strides[i] == expect;
    PyObject* args[] = {src, f.contiguous_format};
    out = row_major ? PyObject_Vectorcall(f.torch.empty, args, 1, nullptr)
                    : PyObject_Vectorcall(f.torch.empty, args, 1, f.kw_memory_format);
  } else {
    PyObject* shape = PyTuple_New(v.t.ndim);
    if (!shape) throw nb::python_error();
    for (int i = 0; i < v.t.ndim; ++i) {
      PyObject* d = PyLong_FromLongLong(v.shape[i]);
      if (!d) {
        Py_DECREF(shape);
        throw nb::python_error();
      }
      PyTuple_SET_ITEM(shape, i, d);
    }
    PyObject* args[] = {shape, v.dtype};
    out = PyObject_Vectorcall(f.numpy.empty, args, 2, nullptr);
    Py_DECREF(shape);
  }
  if (!out) throw nb::python_error();
  return nb::steal(out);
}

// An exact Python int in range (bool and other integer types take the
// general path, which reports or converts them).
template <typename Int>
bool fast_int(PyObject* o, Int& out) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow || (x == -1 && PyErr_Occurred()) || x < std::numeric_limits<Int>::min() ||
      x > std::numeric_limits<Int>::max()) {
    PyErr_Clear();
    return false;
  }
  out = static_cast<Int>(x);
  return true;
}

// An exact Python float, or an exact int as float() makes it (other types
// take the general path, which converts or reports them).
bool fast_float(PyObject* o, double& out) {
  if (PyFloat_CheckExact(o)) {
    out = PyFloat_AS_DOUBLE(o);
    return true;
  }
  if (!PyLong_CheckExact(o)) return false;
  out = PyLong_AsDouble(o);
  if (out == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

// Registers numpy.ndarray (with numpy.empty) or torch.Tensor (with
// torch.empty_like, torch.contiguous_format and, where torch has CUDA, its
// current raw stream of a device index) and the dtypes run_fast reads for
// it: (dtype, DLPack type code, bits) each (fp8 dtypes with DLPack 1.1's
// codes), and for torch an empty tensor of the dtype as a fourth; for torch
// also the type's DLPack C exchange API
// capsule, or None. Returns whether torch tensors are read through that API.
bool fast_path_types(const std::string& framework, nb::handle type, nb::list dtypes,
                     nb::handle empty, nb::handle contiguous_format,
                     nb::handle current_stream, nb::handle exchange_api) {
  FastTypes& f = fast_types();
  if (!f.kw_memory_format) f.kw_memory_format = nb::make_tuple("memory_format").release().ptr();
  if (!PyType_Check(type.ptr()) || !PyCallable_Check(empty.ptr()))
    throw nb::type_error("fast_path_types: a type and a callable");
  FastFramework fw;
  std::vector<nb::handle> samples;  // (torch) an empty tensor of each dtype
  for (nb::handle item : dtypes) {
    nb::tuple t = nb::cast<nb::tuple>(item);
    fw.dtypes.push_back(FastDtype{
        t[0].inc_ref().ptr(), DLDataType{nb::cast<uint8_t>(t[1]), nb::cast<uint8_t>(t[2]), 1}});
    samples.push_back(t.size() > 3 ? t[3] : nb::none());
  }
  fw.type = reinterpret_cast<PyTypeObject*>(type.inc_ref().ptr());
  const std::pair<const char*, bool> names[kMembers] = {
      {"dtype", false},  {"__array_struct__", false}, {"is_cpu", false},
      {"is_cuda", false}, {"get_device", true},      {"is_neg", true},
      {"_is_zerotensor", true}, {"shape", false},    {"stride", true},
      {"data_ptr", true}, {"storage_offset", true}};
  for (int i = 0; i < kMembers; ++i)
    fw.members[i] = member(fw.type, names[i].first, names[i].second);
  fw.empty = empty.inc_ref().ptr();
  if (framework == "numpy") {
    f.numpy = std::move(fw);
    return false;
  } else if (framework == "torch") {
    if (contiguous_format.is_none()) throw nb::type_error("fast_path_types: contiguous_format");
    f.contiguous_format = contiguous_format.inc_ref().ptr();
    if (!current_stream.is_none()) {
      if (!PyCallable_Check(current_stream.ptr()))
        throw nb::type_error("fast_path_types: current_stream must be callable");
      f.current_stream = current_stream.inc_ref().ptr();
    }
    // A capsule of another name or major version is not used.
    if (!exchange_api.is_none() && PyCapsule_IsValid(exchange_api.ptr(), "dlpack_exchange_api")) {
      const auto* api = static_cast<const DLPackExchangeApiV1*>(
          PyCapsule_GetPointer(exchange_api.ptr(), "dlpack_exchange_api"));
      if (api && api->major == 1 && api->dltensor_from_py_object_no_sync) {
        exchange_api.inc_ref();  // kept, with the API it points to, for the process
        fw.exchange = api;
      }
    }
    // The type the API gives each dtype, from an empty tensor of it (a dtype
    // whose sample it cannot describe keeps bits 0, which no tensor has).
    if (fw.exchange)
      for (size_t i = 0; i < samples.size(); ++i) {
        DLTensor d{};
        if (samples[i].is_none()) continue;
        if (fw.exchange->dltensor_from_py_object_no_sync(samples[i].ptr(), &d) == 0)
          fw.dtypes[i].exported = d.dtype;
        else
          PyErr_Clear();
      }
    // Two dtypes given one type could not be told apart: the attributes then.
    for (size_t i = 0; fw.exchange && i < fw.dtypes.size(); ++i)
      for (size_t j = 0; j < i; ++j) {
        const DLDataType a = fw.dtypes[i].exported, b = fw.dtypes[j].exported;
        if (a.bits != 0 && a.code == b.code && a.bits == b.bits && a.lanes == b.lanes)
          fw.exchange = nullptr;
      }
    f.torch = std::move(fw);
    return f.torch.exchange != nullptr;
  } else {
    throw nb::value_error("fast_path_types: framework must be 'numpy' or 'torch'");
  }
}

// ropekv.rope_pool_fused on numpy arrays and PyTorch CPU or CUDA tensors
// (CUDA: on torch's current stream), with any of its options (the Python
// layer has turned rope_scaling into its numbers and kv_cache_dtype into
// its code). Returns (q_rot, k_rot, k_pool, v_pool), making q_rot / k_rot
// when None is given, or None, having written nothing, when an argument is
// not one it reads (fast_view, fast_int, fast_float, is_neox not a bool) or
// a pool or output is read-only; raises the contract's ValueError.
nb::object run_fast(nb::handle q, nb::handle k, nb::handle v, nb::handle positions,
                    nb::handle slots, nb::handle k_pool, nb::handle v_pool, nb::handle q_rot,
                    nb::handle k_rot, nb::handle head_dim, nb::handle num_qo_heads,
                    nb::handle num_kv_heads, nb::handle rope_base, nb::handle rotary_dim,
                    nb::handle is_neox, const std::optional<Scaling>& rope_scaling,
                    nb::handle num_threads, bool checked, nb::handle cos_sin_cache,
                    nb::handle q_norm_weight, nb::handle k_norm_weight, nb::handle norm_eps,
                    int kv_cache_dtype, nb::handle k_scale, nb::handle v_scale) {
  ropekv::RopeConfig cfg;
  if (is_neox.ptr() != Py_True && is_neox.ptr() != Py_False) return nb::none();
  cfg.is_neox = is_neox.ptr() == Py_True;
  cfg.rope_scaling = to_scaling(rope_scaling);
  int threads = 0;
  if (!fast_int(head_dim.ptr(), cfg.head_dim) || !fast_int(num_qo_heads.ptr(), cfg.num_qo_heads) ||
      !fast_int(num_kv_heads.ptr(), cfg.num_kv_heads) || !fast_int(num_threads.ptr(), threads))
    return nb::none();
  // (rotary_dim=0 given is an error, which the general path raises; in the
  // C++ config 0 means head_dim.)
  if (!rotary_dim.is_none() && (!fast_int(rotary_dim.ptr(), cfg.rotary_dim) || cfg.rotary_dim == 0))
    return nb::none();
  if (!fast_float(rope_base.ptr(), cfg.rope_base) || !fast_float(k_scale.ptr(), cfg.k_scale) ||
      !fast_float(v_scale.ptr(), cfg.v_scale))
    return nb::none();
  if (!PyFloat_CheckExact(norm_eps.ptr())) return nb::none();
  cfg.norm_eps = PyFloat_AS_DOUBLE(norm_eps.ptr());
  cfg.kv_cache_dtype = static_cast<ropekv::KvCacheDtype>(kv_cache_dtype);

  const nb::handle in[7] = {q, k, v, positions, slots, k_pool, v_pool};
  FastView views[12];
  for (int i = 0; i < 7; ++i)
    if (!fast_view(in[i].ptr(), views[i])) return nb::none();
  // The optional inputs: absent (None) or read in place like the others.
  const nb::handle opt[3] = {cos_sin_cache, q_norm_weight, k_norm_weight};
  for (int i = 0; i < 3; ++i)
    if (!opt[i].is_none() && !fast_view(opt[i].ptr(), views[9 + i])) return nb::none();
  // Without rotary_dim, a 2-D cos_sin_cache's width is R (as the general
  // path has it).
  if (rotary_dim.is_none() && !cos_sin_cache.is_none() && views[9].t.ndim == 2)
    cfg.rotary_dim = views[9].shape[1];
  // Every decline before the outputs are made (the general path makes its
  // own). A pool or output numpy exports as read-only may be a warn-on-write
  // broadcast view that the general path judges by flags.writeable: it
  // decides (and reports) every such call.
  auto declined = [&](int i) { return i >= 5 && i < 9 && views[i].read_only; };
  for (int i : {5, 6})
    if (declined(i)) return nb::none();
  // Outputs: the given ones first, then the others made like q and k (when
  // q / k is 3-D; otherwise None, and the core reports the rank).
  nb::object outs[2] = {nb::borrow(q_rot), nb::borrow(k_rot)};
  for (int j = 0; j < 2; ++j)
    if (!outs[j].is_none() && (!fast_view(outs[j].ptr(), views[7 + j]) || declined(7 + j)))
      return nb::none();
  for (int j = 0; j < 2; ++j)
    if (outs[j].is_none() && views[j].t.ndim == 3) {
      outs[j] = new_output(in[j].ptr(), views[j]);
      FastView& o = views[7 + j];
      if (!fast_view(outs[j].ptr(), o)) return nb::none();
      if (o.is_torch && o.t.device.device_type == kDLCPU)  // (numpy advises its own)
        advise_huge_pages(reinterpret_cast<uintptr_t>(o.t.data),
                          uint64_t(o.shape[0]) * o.strides[0] * (o.t.dtype.bits / 8));
    }

  DLTensor optional[3] = {};
  for (int i = 0; i < 3; ++i)
    if (!opt[i].is_none()) optional[i] = views[9 + i].t;
  // CUDA: the caller's current stream on q's device, as the general path
  // launches (arrays on other devices fail the contract's device check).
  uintptr_t stream = 0;
  if (views[0].t.device.device_type == kDLCUDA) {
    PyObject* index = PyLong_FromLong(views[0].t.device.device_id);
    if (!index) throw nb::python_error();
    PyObject* s = PyObject_Vectorcall(fast_types().current_stream, &index, 1, nullptr);
    Py_DECREF(index);
    if (!s) throw nb::python_error();
    stream = reinterpret_cast<uintptr_t>(PyLong_AsVoidPtr(s));
    Py_DECREF(s);
    if (PyErr_Occurred()) throw nb::python_error();
  }
  const ropekv::RopePoolTensors t{views[0].t, views[1].t,  views[2].t,  views[3].t,
                                  views[4].t, views[5].t,  views[6].t,  views[7].t,
                                  views[8].t, optional[0], optional[1], optional[2]};
  {
    nb::gil_scoped_release release;
    execute(t, cfg, 0, stream, threads, checked);
  }
  return nb::make_tuple(outs[0], outs[1], k_pool, v_pool);
}

std::pair<std::vector<float>, double> inv_freq(int64_t head_dim, double rope_base,
                                               int64_t rotary_dim,
                                               const std::optional<Scaling>& rope_scaling) {
  ropekv::RopeConfig cfg = config(head_dim, 1, 1, rope_base, rotary_dim);
  cfg.rope_scaling = to_scaling(rope_scaling);
  return {ropekv::rope_inv_freq(cfg), ropekv::rope_attention_factor(cfg.rope_scaling)};
}

// Whether x imports as a writable array (nanobind asks a DLPack producer
// for a versioned capsule, whose read-only flag it honours, and a buffer
// for writable access): read-only memory that a framework the package does
// not know exports (a memoryview of bytes, a read-only array behind
// __dlpack__) is caught before it is written.
bool writable(nb::handle x) {
  nb::ndarray<> a;
  return nb::try_cast(x, a, /*convert=*/false);
}

// (shape, DLPack type code, bits) of x as it imports (read-only allowed) on
// the CPU, or None where it does not: how the package learns the shape and
// dtype of a DLPack object that numpy cannot import (bf16), to make its outputs.
nb::object layout(nb::handle x) {
  nb::ndarray<nb::ro> a;
  if (!nb::try_cast(x, a, /*convert=*/false) || a.device_type() != nb::device::cpu::value)
    return nb::none();
  nb::list shape;
  for (size_t i = 0; i < a.ndim(); ++i) shape.append(a.shape(i));
  return nb::make_tuple(nb::tuple(shape), static_cast<int>(a.dtype().code),
                        static_cast<int>(a.dtype().bits));
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
        nb::arg("num_kv_heads"), nb::arg("rope_base"), nb::arg("rotary_dim"), nb::arg("dtype_views"),
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
        nb::arg("v_scale"), nb::arg("norm_eps"), nb::arg("dtype_views"), nb::arg("readonly_mask"),
        nb::arg("stream"), nb::arg("num_threads"), nb::arg("checked"),
        nb::call_guard<nb::gil_scoped_release>(),
        "Runs ropekv::rope_pool_fused with its options (see ropekv.rope_pool_fused).");
  // Every argument may be None (or anything): run_fast declines what it does
  // not take, and the general path reports it.
  m.def("run_fast", &run_fast, nb::arg("q").none(), nb::arg("k").none(), nb::arg("v").none(),
        nb::arg("positions").none(), nb::arg("slots").none(), nb::arg("k_pool").none(),
        nb::arg("v_pool").none(), nb::arg("q_rot").none(), nb::arg("k_rot").none(),
        nb::arg("head_dim").none(), nb::arg("num_qo_heads").none(),
        nb::arg("num_kv_heads").none(), nb::arg("rope_base").none(),
        nb::arg("rotary_dim").none(), nb::arg("is_neox").none(), nb::arg("rope_scaling").none(),
        nb::arg("num_threads").none(), nb::arg("checked"),
        nb::arg("cos_sin_cache").none() = nb::none(), nb::arg("q_norm_weight").none() = nb::none(),
        nb::arg("k_norm_weight").none() = nb::none(), nb::arg("norm_eps").none() = nb::float_(1e-6),
        nb::arg("kv_cache_dtype") = 0, nb::arg("k_scale").none() = nb::float_(1.0),
        nb::arg("v_scale").none() = nb::float_(1.0),
        "ropekv.rope_pool_fused with its options (kv_cache_dtype as its KvCacheDtype code), on "
        "numpy arrays or PyTorch CPU or CUDA tensors read in place (see fast_path_types): "
        "(q_rot, k_rot, k_pool, v_pool), or None, having written nothing, for anything else.");
  m.def("fast_path_types", &fast_path_types, nb::arg("framework"), nb::arg("type"),
        nb::arg("dtypes"), nb::arg("empty"), nb::arg("contiguous_format").none(),
        nb::arg("current_stream").none() = nb::none(), nb::arg("exchange_api").none() = nb::none(),
        "Registers numpy.ndarray or torch.Tensor for run_fast: its (dtype, DLPack code, bits), "
        "the function that makes outputs and (torch) the current CUDA stream's and the type's "
        "DLPack C exchange API capsule, if any.");
  m.def("inv_freq", &inv_freq, nb::arg("head_dim"), nb::arg("rope_base"), nb::arg("rotary_dim"),
        nb::arg("rope_scaling").none(), "See ropekv.rope_inv_freq.");
  m.def(
      "check_device_errors",
      [](int device_id, uintptr_t stream) {
        ropekv::check_device_errors(device_id, reinterpret_cast<void*>(stream));
      },
      nb::arg("device_id"), nb::arg("stream"), nb::call_guard<nb::gil_scoped_release>());
  m.def("advise_huge_pages", &advise_huge_pages, nb::arg("data"), nb::arg("bytes"),
        "Asks for transparent huge pages over a new CPU output of 4 MiB or more (a hint).");
  m.def("writable", &writable, nb::arg("x"),
        "Whether x imports as a writable array (DLPack's read-only flag, a buffer's access).");
  m.def("layout", &layout, nb::arg("x"),
        "(shape, DLPack type code, bits) of x as it imports on the CPU, else None.");
  m.def("has_cuda", &ropekv::has_cuda);
  m.def("cpu_target", &ropekv::cpu_target);
  m.attr("__version__") = ropekv::version();
  // DLPack type codes (dlpack.h; fp8: DLPack 1.1's, from ropekv.h), so that
  // the package names the dtypes run_fast reads without its own copy.
  m.attr("DL_CODES") = nb::make_tuple(
      static_cast<int>(kDLInt), static_cast<int>(kDLUInt), static_cast<int>(kDLFloat),
      static_cast<int>(kDLBfloat), static_cast<int>(ropekv::kDLCodeFloat8E4M3fn),
      static_cast<int>(ropekv::kDLCodeFloat8E5M2));
}
