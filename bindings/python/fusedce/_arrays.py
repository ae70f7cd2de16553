"""Array description: what the C ABI sees of any supported array (a pointer, a shape, strides
in elements, a dtype name, a device), read from NumPy arrays, torch tensors (without importing
torch), ``__cuda_array_interface__`` objects and DLPack producers; and the dtype mapping (names,
fce_dtype codes, the dtype keywords).

Nothing here checks what the library checks: pointers are read as they are (their alignment is
the library's to check, naming the argument).
"""

from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np

from ._lib import FCE_BFLOAT16, FCE_FLOAT16, FCE_FLOAT32, FCE_INT32, FCE_INT64

try:  # optional: a real bfloat16 NumPy dtype
    import ml_dtypes as _ml_dtypes

    _NP_BF16 = np.dtype(_ml_dtypes.bfloat16)
except Exception:  # pragma: no cover - depends on the environment
    _ml_dtypes = None
    _NP_BF16 = None

_FLOAT_CODES = {"float32": FCE_FLOAT32, "float16": FCE_FLOAT16, "bfloat16": FCE_BFLOAT16}
_CODE_NAMES = {v: k for k, v in _FLOAT_CODES.items()}
_TARGET_CODES = {"int32": FCE_INT32, "int64": FCE_INT64}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8, "uint32": 4,
             "uint16": 2, "uint8": 1, "int8": 1, "int16": 2, "float64": 8, "bool": 1,
             "bits16": 2}


class _Arr:
    """One array as the C ABI sees it: a pointer, shape, strides in elements, a dtype name."""

    __slots__ = ("name", "obj", "ptr", "shape", "strides", "dtype", "device", "framework",
                 "readonly", "stream", "keep")

    def __init__(self, name, obj, ptr, shape, strides, dtype, device, framework,
                 readonly=False, stream=None, keep=None):
        self.name = name
        self.obj = obj
        self.ptr = int(ptr or 0)
        self.shape = tuple(int(s) for s in shape)
        self.strides = tuple(int(s) for s in strides)
        self.dtype = dtype            # "float32", ..., "bits16" (unknown 16-bit), "other:<x>"
        self.device = device          # ("cpu", 0) or ("cuda", index or None when unknown)
        self.framework = framework    # "numpy", "torch", "cupy", "cai", "dlpack"
        self.readonly = readonly
        self.stream = stream          # __cuda_array_interface__ stream, when it gave one
        self.keep = keep              # whatever must stay alive during the call (DLPack capsule)

    @property
    def is_cuda(self):
        return self.device[0] == "cuda"

    @property
    def itemsize(self):
        return _ITEMSIZE.get(self.dtype, 1)

    @property
    def size(self):
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    def where(self):
        return "cpu" if not self.is_cuda else (
            "cuda:%s" % self.device[1] if self.device[1] is not None else "cuda")


def _c_contiguous_strides(shape):
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(strides))


def _np_dtype_name(dt: np.dtype) -> str:
    if _NP_BF16 is not None and dt == _NP_BF16:
        return "bfloat16"
    if dt.name in _ITEMSIZE:
        return dt.name
    return "other:" + str(dt)


def _typestr_name(typestr: str) -> str:
    if typestr[:1] == ">" and typestr[1:] not in ("u1", "i1", "b1"):
        return "other:" + typestr  # big-endian
    kind_size = typestr[1:]
    return {"f4": "float32", "f2": "float16", "f8": "float64", "i4": "int32", "i8": "int64",
            "u4": "uint32", "u2": "uint16", "u1": "uint8", "i1": "int8", "i2": "int16",
            "b1": "bool", "V2": "bits16"}.get(kind_size, "other:" + typestr)


# DLPack (dlpack.h v0.8 layout, the unversioned DLManagedTensor a plain __dlpack__() returns).
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_kDLCPU, _kDLCUDA, _kDLCUDAHost, _kDLCUDAManaged = 1, 2, 3, 13
_capsule_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get_pointer.restype = ctypes.c_void_p
_capsule_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _dlpack_dtype_name(code, bits, lanes):
    if lanes != 1:
        return "other:vector"
    return {(0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64",
            (1, 8): "uint8", (1, 16): "uint16", (1, 32): "uint32",
            (2, 16): "float16", (2, 32): "float32", (2, 64): "float64",
            (4, 16): "bfloat16", (6, 8): "bool"}.get((code, bits),
                                                     "other:dlpack(%d,%d)" % (code, bits))


def _is_torch(x):
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "data_ptr")


def _describe(x, name: str, dlpack_stream=None) -> _Arr:
    """Read pointer, shape, strides, dtype and device of any supported array."""
    if isinstance(x, np.ndarray):
        itemsize = x.dtype.itemsize
        for s in x.strides:
            if s % itemsize:
                raise ValueError(f"{name}: strides {x.strides} (bytes) are not a multiple of "
                                 f"the element size {itemsize}")
        return _Arr(name, x, x.ctypes.data if x.size else 0, x.shape,
                    tuple(s // itemsize for s in x.strides), _np_dtype_name(x.dtype),
                    ("cpu", 0), "numpy", readonly=not x.flags.writeable)
    if _is_torch(x):
        dev = x.device
        if dev.type == "cpu":
            device = ("cpu", 0)
        elif dev.type == "cuda":
            device = ("cuda", dev.index if dev.index is not None else _torch_current_device())
        else:
            raise ValueError(f"{name}: torch tensors on device '{dev}' are not supported "
                             "(cpu or cuda)")
        layout = str(getattr(x, "layout", "torch.strided"))
        if getattr(x, "is_sparse", False) or layout != "torch.strided":
            raise TypeError(f"{name}: only strided (dense) torch tensors are supported")
        dt = str(x.dtype).replace("torch.", "")
        return _Arr(name, x, x.data_ptr(), tuple(x.shape), tuple(x.stride()),
                    dt if dt in _ITEMSIZE else "other:" + dt, device, "torch")
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        if cai.get("mask") is not None:
            raise ValueError(f"{name}: masked __cuda_array_interface__ arrays are not supported")
        ptr, readonly = cai["data"]
        shape = tuple(cai["shape"])
        dtype = _typestr_name(cai["typestr"])
        itemsize = _ITEMSIZE.get(dtype, 1)
        if cai.get("strides") is None:
            strides = _c_contiguous_strides(shape)
        else:
            bstrides = tuple(cai["strides"])
            if any(s % itemsize for s in bstrides):
                raise ValueError(f"{name}: strides {bstrides} (bytes) are not a multiple of the "
                                 f"element size {itemsize}")
            strides = tuple(s // itemsize for s in bstrides)
        framework = "cupy" if type(x).__module__.split(".")[0] == "cupy" else "cai"
        index = None
        dev = getattr(x, "device", None)
        if framework == "cupy" and dev is not None:
            index = int(dev.id)
        return _Arr(name, x, ptr, shape, strides, dtype, ("cuda", index), framework,
                    readonly=bool(readonly), stream=cai.get("stream"))
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        dev_type, dev_id = x.__dlpack_device__()
        dev_type, dev_id = int(dev_type), int(dev_id)
        if dev_type in (_kDLCPU, _kDLCUDAHost):
            capsule = x.__dlpack__()
            device = ("cpu", 0)
        elif dev_type in (_kDLCUDA, _kDLCUDAManaged):
            # DLPack: None = legacy default stream, 1 = legacy default, 2 = per thread, else a
            # handle (0 is not allowed). Our 0 (NULL) is the legacy default stream.
            s = None if dlpack_stream in (None, 0) else int(dlpack_stream)
            try:
                capsule = x.__dlpack__(stream=s)
            except TypeError:
                capsule = x.__dlpack__()
            device = ("cuda", dev_id)
        else:
            raise ValueError(f"{name}: DLPack device type {dev_type} is not supported (CPU or "
                             "CUDA)")
        if not _capsule_is_valid(capsule, b"dltensor"):
            raise TypeError(f"{name}: __dlpack__() did not return a 'dltensor' capsule")
        t = _DLTensor.from_address(_capsule_get_pointer(capsule, b"dltensor"))
        shape = tuple(t.shape[i] for i in range(t.ndim))
        strides = (tuple(t.strides[i] for i in range(t.ndim)) if t.strides
                   else _c_contiguous_strides(shape))
        dtype = _dlpack_dtype_name(t.dtype.code, t.dtype.bits, t.dtype.lanes)
        ptr = (t.data or 0) + t.byte_offset
        # The capsule's own destructor calls the producer's deleter once we drop it (we never
        # rename it to used_dltensor), so keeping it alive for the call is all that is needed.
        return _Arr(name, x, ptr, shape, strides, dtype, device, "dlpack", keep=capsule)
    raise TypeError(f"{name}: expected a NumPy array, a torch tensor, or an object with "
                    f"__cuda_array_interface__ or __dlpack__, got {type(x).__name__}")


def _torch_current_device():
    import torch
    return torch.cuda.current_device()


# ====================================================================== dtypes ====
def _dtype_name(dtype) -> Optional[str]:
    """Normalise a dtype keyword (str, NumPy dtype, ml_dtypes type, torch dtype, fce code)."""
    if dtype is None:
        return None
    if isinstance(dtype, (int, np.integer)) and not isinstance(dtype, bool):
        if int(dtype) in _CODE_NAMES:
            return _CODE_NAMES[int(dtype)]
        if int(dtype) == FCE_INT32:
            return "int32"
        if int(dtype) == FCE_INT64:
            return "int64"
        raise ValueError(f"unknown fce_dtype code {dtype}")
    text = str(dtype).replace("torch.", "").lower()
    aliases = {"fp32": "float32", "f32": "float32", "float": "float32", "fp16": "float16",
               "f16": "float16", "half": "float16", "bf16": "bfloat16", "int": "int64",
               "long": "int64"}
    try:
        if _NP_BF16 is not None and np.dtype(dtype) == _NP_BF16:
            return "bfloat16"
        text = np.dtype(dtype).name if not isinstance(dtype, str) else text
    except TypeError:
        pass
    text = aliases.get(text, text)
    if text in ("float32", "float16", "bfloat16", "int32", "int64"):
        return text
    raise ValueError(f"unsupported dtype {dtype!r}: float32, float16 or bfloat16 (int32 or int64 "
                     "for targets)")


def _dtype_unsupported(where: str, dtype: str, cast: str) -> TypeError:
    """The one message for an input whose dtype the library has no kernels for (float64, ...),
    on the array path and in the framework layers alike: ``where`` is "<call>: <argument>", and
    nothing is cast behind the caller's back (the computation would not be in that dtype)."""
    return TypeError(f"{where} dtype {dtype} is not supported; supported: float32, float16, "
                     f"bfloat16 (cast with {cast})")


def _float_code(a: _Arr, dtype_kw: Optional[str], what: str = "dtype",
                fn: Optional[str] = None) -> int:
    """The fce_dtype of a floating-point input, checked against the dtype= keyword; ``fn``: the
    public call, named in the message of a dtype the library does not take."""
    if a.dtype in _FLOAT_CODES:
        if dtype_kw is not None and dtype_kw != a.dtype:
            if what == "dtype":
                raise TypeError(f"{a.name} has dtype {a.dtype} but dtype={dtype_kw!r} was given")
            raise TypeError(f"{a.name} has dtype {a.dtype}, expected {dtype_kw} ({what})")
        return _FLOAT_CODES[a.dtype]
    if a.dtype in ("uint16", "bits16", "int16"):
        if dtype_kw in ("bfloat16", "float16"):
            return _FLOAT_CODES[dtype_kw]
        raise TypeError(f"{a.name} holds raw 16-bit values ({a.dtype}); pass dtype='bfloat16' "
                        "(or 'float16') to say what they are" +
                        ("" if _NP_BF16 is not None else ", or install ml_dtypes"))
    cast = ".float()" if a.framework == "torch" else ".astype(numpy.float32)"
    raise _dtype_unsupported(f"{fn}: {a.name}" if fn else a.name, a.dtype.replace("other:", ""),
                             cast)



def _need_dtype(a: _Arr, dtype: str):
    if a.dtype != dtype:
        raise TypeError(f"{a.name} must be {dtype}, got {a.dtype.replace('other:', '')}")

