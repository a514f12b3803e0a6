"""A CUDA array in a process where CUDA cannot be used (no GPU, no driver, as
on CI, which builds with nvcc but has no GPU) must raise ValueError, never
crash. Runs anywhere: on a machine with a GPU the fake array's pointer is not
device memory, which must raise the same way."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import ropekv

kDLCUDA = 2


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))),
]

_keep = []  # keeps every fake array's memory alive for the whole session

_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class FakeCudaArray:
    """Host memory that claims, through DLPack, to live on cuda:0."""

    def __init__(self, shape, dtype):
        self.host = np.ones(shape, dtype=dtype)
        self.shape = tuple(shape)
        self.ndim = len(shape)
        code = {"f": 2, "i": 0}[self.host.dtype.kind]
        self._shape = (ctypes.c_int64 * max(1, self.ndim))(*shape)
        m = DLManagedTensor()
        m.dl_tensor.data = self.host.ctypes.data
        m.dl_tensor.device = DLDevice(kDLCUDA, 0)
        m.dl_tensor.ndim = self.ndim
        m.dl_tensor.dtype = DLDataType(code, self.host.dtype.itemsize * 8, 1)
        m.dl_tensor.shape = self._shape
        m.dl_tensor.strides = None
        m.dl_tensor.byte_offset = 0
        m.deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))(lambda p: None)
        self._m = m
        _keep.append(self)

    def __dlpack_device__(self):
        return (kDLCUDA, 0)

    def __dlpack__(self, stream=None, **kwargs):
        return _PyCapsule_New(ctypes.addressof(self._m), b"dltensor", None)


def test_cuda_array_without_usable_cuda_raises_value_error():
    T, H, D, P = 2, 2, 8, 4
    q = FakeCudaArray((T, H, D), np.float32)
    k = FakeCudaArray((T, H, D), np.float32)
    v = FakeCudaArray((T, H, D), np.float32)
    pos = FakeCudaArray((T,), np.int32)
    slots = FakeCudaArray((T,), np.int32)
    kp = FakeCudaArray((P, H, D), np.float32)
    vp = FakeCudaArray((P, H, D), np.float32)
    qo = FakeCudaArray((T, H, D), np.float32)
    ko = FakeCudaArray((T, H, D), np.float32)
    with pytest.raises(ValueError) as info:
        ropekv.rope_pool_fused(q, k, v, pos, slots, kp, vp, head_dim=D, num_qo_heads=H,
                               num_kv_heads=H, rope_base=1e4, q_out=qo, k_out=ko)
    msg = str(info.value)
    assert msg.startswith("q ") or "CUDA backend" in msg, msg
    assert np.all(kp.host == 1) and np.all(qo.host == 1)


@pytest.mark.parametrize("device", [0, -1, 2**31, 2**40])
def test_check_device_errors_of_no_call_is_a_no_op(device):
    """No CUDA call has run in this process (or the device does not exist):
    nothing to report, whatever the id; a non-integer id is the ValueError
    of every integer argument."""
    assert ropekv.check_device_errors(device) is None
    with pytest.raises(ValueError, match="device"):
        ropekv.check_device_errors(float(device) + 0.5)
