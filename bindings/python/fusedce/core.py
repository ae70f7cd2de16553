"""fusedce.core: the three compute calls of libfusedce on arrays, with validation and allocation.

Arrays accepted:
  * NumPy arrays (CPU backend): float32, float16, bfloat16 (``ml_dtypes.bfloat16`` when
    installed, otherwise raw ``uint16`` bits with ``dtype="bfloat16"``), int32/int64 targets;
  * torch tensors (CPU tensors use the CPU backend, CUDA tensors the CUDA backend), read
    directly (no torch import is needed to recognise them);
  * any object with ``__cuda_array_interface__`` (CuPy, Numba, JAX, ...) and any object with
    ``__dlpack__`` (JAX, TensorFlow, ...), on the CPU or a CUDA device.

Streams (CUDA backend): ``stream=`` an int (a ``cudaStream_t``; 0 is the legacy default stream,
1 and 2 the legacy and per-thread handles as in the CUDA array interface), a torch stream or a
CuPy stream. Without it: torch's current stream for torch tensors, the ``stream`` entry of
``__cuda_array_interface__`` (CuPy's current stream), else the legacy default stream. DLPack
producers are asked (``__dlpack__(stream=...)``) to order their work before that stream. The
call is asynchronous on that stream, as in C.

Outputs and the workspace are allocated when not given: with NumPy for the CPU backend (torch for
torch CPU tensors), with torch or CuPy for CUDA when the inputs come from them; for other CUDA
producers pass every output (``loss=``, ``lse=``, ...) and ``workspace=`` yourself. Allocations
are made on the current device of the inputs' framework; with an explicit ``stream=`` that is not
torch's current stream, the allocations are recorded on it (``record_stream``) so that the
caching allocator does not reuse them early.

The CUDA backend runs on the calling thread's current device: torch and CuPy inputs have it set
for the call; for other producers make the inputs' device current yourself.

Every option of ``fce_options`` is a keyword with its C name (``class_weights``,
``ignore_index``, ``row_stride``, ``grad_row_stride``, ``shift_seq_len``, ``hidden_row_stride``,
``backend``, ``dtype``, ``target_dtype``, ``reduction``, ``label_smoothing``, ``z_loss_scale``,
``softcap``, ``logit_scale``, ``deterministic``, ``accumulate``, ``grad_weight_fp32``, and since
0.3 ``shift``, ``token_scaling``). The stride, dtype and backend options are read from the
arrays; given explicitly they must agree. The two 0.3 output pointers of ``fce_options``
(``argmax``, ``accuracy``) are outputs like the others: ``return_argmax=True`` /
``return_accuracy=True`` allocate them, ``argmax=`` / ``accuracy=`` pass your own buffers.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any, NamedTuple, Optional

import numpy as np

from . import _lib
from ._lib import (FCE_BACKEND_CPU, FCE_BACKEND_CUDA, FCE_BFLOAT16, FCE_FLOAT16, FCE_FLOAT32,
                   FCE_INT32, FCE_INT64, FCE_REDUCTION_MEAN, FCE_REDUCTION_NONE,
                   FCE_REDUCTION_SUM, FCE_FLAG_TARGET_OUT_OF_RANGE)

try:  # optional: a real bfloat16 NumPy dtype
    import ml_dtypes as _ml_dtypes

    _NP_BF16 = np.dtype(_ml_dtypes.bfloat16)
except Exception:  # pragma: no cover - depends on the environment
    _ml_dtypes = None
    _NP_BF16 = None

__all__ = [
    "ForwardResult", "LinearCEResult", "forward", "backward", "linear_ce",
    "forward_workspace_size", "backward_workspace_size", "linear_ce_workspace_size",
    "check_error_flags", "float_to_bfloat16_bits", "bfloat16_bits_to_float", "REDUCTIONS",
]

REDUCTIONS = {"mean": FCE_REDUCTION_MEAN, "sum": FCE_REDUCTION_SUM, "none": FCE_REDUCTION_NONE}
_FLOAT_CODES = {"float32": FCE_FLOAT32, "float16": FCE_FLOAT16, "bfloat16": FCE_BFLOAT16}
_CODE_NAMES = {v: k for k, v in _FLOAT_CODES.items()}
_TARGET_CODES = {"int32": FCE_INT32, "int64": FCE_INT64}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8, "uint32": 4,
             "uint16": 2, "uint8": 1, "int8": 1, "int16": 2, "float64": 8, "bool": 1,
             "bits16": 2}


class ForwardResult(NamedTuple):
    """What :func:`forward` returns; entries not asked for are None."""

    loss: Any          # float32: shape () for mean/sum, [rows] for none
    lse: Any           # float32 [rows]
    z_loss: Any        # float32 (): the z-loss part of the loss, for logging
    grad_logits: Any   # [rows, vocab] of the logits' dtype
    error_flags: Any   # uint32 [1] (int32 for torch): FCE_FLAG_* bits ORed by the call
    argmax: Any = None    # int64 [rows]: each row's predicted class, -1 for ignored rows
    accuracy: Any = None  # float32: () for mean/sum (fraction of non-ignored rows whose
    #                       argmax is the target), [rows] of 1/0 for none


class LinearCEResult(NamedTuple):
    """What :func:`linear_ce` returns; entries not asked for are None."""

    loss: Any
    lse: Any
    z_loss: Any
    grad_hidden: Any
    grad_weight: Any
    grad_bias: Any
    error_flags: Any
    argmax: Any = None
    accuracy: Any = None


# ============================================================= array descriptions ====
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


# ================================================================== option values ====
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


def _float_code(a: _Arr, dtype_kw: Optional[str], what: str = "dtype") -> int:
    """The fce_dtype of a floating-point input, checked against the dtype= keyword."""
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
    raise TypeError(f"{a.name} has dtype {a.dtype.replace('other:', '')}; fusedce takes float32, "
                    "float16 or bfloat16")


def _reduction_code(reduction) -> int:
    if isinstance(reduction, str):
        if reduction.lower() in REDUCTIONS:
            return REDUCTIONS[reduction.lower()]
    elif isinstance(reduction, (int, np.integer)) and int(reduction) in REDUCTIONS.values():
        return int(reduction)
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def _backend_code(backend) -> Optional[int]:
    if backend is None:
        return None
    if isinstance(backend, str):
        b = backend.lower()
        if b == "cpu":
            return FCE_BACKEND_CPU
        if b == "cuda":
            return FCE_BACKEND_CUDA
    elif isinstance(backend, (int, np.integer)) and int(backend) in (FCE_BACKEND_CPU,
                                                                      FCE_BACKEND_CUDA):
        return int(backend)
    raise ValueError(f"backend must be 'cpu' or 'cuda', got {backend!r}")


def _int_option(value, name, minimum=None):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if not -(2 ** 63) <= value < 2 ** 63:
        raise ValueError(f"{name} ({value}) does not fit in int64")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _float_option(value, name):
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {value!r}") from None


def _build_options(*, backend, dtype, target_dtype, reduction, ignore_index, class_weights_ptr,
                   label_smoothing, z_loss_scale, softcap, logit_scale, shift_seq_len,
                   deterministic, row_stride=0, grad_row_stride=0, hidden_row_stride=0,
                   accumulate=False, grad_weight_fp32=False, shift=0, token_scaling=False,
                   argmax_ptr=0, accuracy_ptr=0) -> _lib.Options:
    o = _lib.default_options()  # struct_size: _lib.options_size()
    shift = _int_option(shift, "shift", 0)
    for on, what in ((shift, "shift"), (token_scaling, "token_scaling"),
                     (argmax_ptr, "argmax"), (accuracy_ptr, "accuracy")):
        if on:
            _lib.require_options_v0_3(what)
    if o.struct_size >= _lib.FCE_OPTIONS_SIZE_V0_3:
        o.shift = shift
        o.argmax = argmax_ptr or None
        o.accuracy = accuracy_ptr or None
        o.token_scaling = 1 if token_scaling else 0
        o.reserved1 = 0
    o.class_weights = class_weights_ptr or None
    o.ignore_index = _int_option(ignore_index, "ignore_index")
    o.row_stride = row_stride
    o.grad_row_stride = grad_row_stride
    o.shift_seq_len = _int_option(shift_seq_len, "shift_seq_len", 0)
    o.hidden_row_stride = hidden_row_stride
    o.backend = backend
    o.dtype = dtype
    o.target_dtype = target_dtype
    o.reduction = reduction
    # Values out of their domain (epsilon outside [0, 1), negative softcap, ...) are the
    # library's to reject: it names the argument in InvalidArgumentError.
    o.label_smoothing = _float_option(label_smoothing, "label_smoothing")
    o.z_loss_scale = _float_option(z_loss_scale, "z_loss_scale")
    o.softcap = _float_option(softcap, "softcap")
    o.logit_scale = _float_option(logit_scale, "logit_scale")
    o.deterministic = 1 if deterministic else 0
    o.accumulate = 1 if accumulate else 0
    o.grad_weight_fp32 = 1 if grad_weight_fp32 else 0
    o.reserved0 = 0
    return o


# ======================================================================= checks ====
def _check_same_device(ref: _Arr, *others: Optional[_Arr]):
    for a in others:
        if a is None:
            continue
        if a.device[0] != ref.device[0] or (
                a.is_cuda and None not in (a.device[1], ref.device[1])
                and a.device[1] != ref.device[1]):
            raise ValueError(f"{a.name} is on {a.where()} but {ref.name} is on {ref.where()}: "
                             "every array of a call must be on the same device")


def _check_backend_kw(ref: _Arr, backend) -> int:
    code = FCE_BACKEND_CUDA if ref.is_cuda else FCE_BACKEND_CPU
    kw = _backend_code(backend)
    if kw is not None and kw != code:
        raise ValueError(f"backend={backend!r} but {ref.name} is on {ref.where()}")
    return code


def _check_aligned(a: _Arr):
    if a.ptr % a.itemsize:
        raise ValueError(f"{a.name}: address {a.ptr:#x} is not aligned to its element size "
                         f"({a.itemsize} bytes)")


def _matrix(a: _Arr, rows: Optional[int] = None, cols: Optional[int] = None,
            dense: bool = False, what: str = "[rows, vocab]") -> int:
    """Check a 2-D [rows, cols] array with a contiguous last dimension; return its row stride."""
    if len(a.shape) != 2:
        raise ValueError(f"{a.name} must be 2-D {what}, got shape {a.shape}")
    r, c = a.shape
    if rows is not None and r != rows:
        raise ValueError(f"{a.name} has {r} rows, expected {rows} (shape {a.shape})")
    if cols is not None and c != cols:
        raise ValueError(f"{a.name} has {c} columns, expected {cols} (shape {a.shape})")
    if r < 1 or c < 1:
        raise ValueError(f"{a.name} is empty (shape {a.shape})")
    if c > 1 and a.strides[1] != 1:
        raise ValueError(f"{a.name}: the last dimension must be contiguous (stride 1 element), "
                         f"got strides {a.strides} (elements); make it contiguous first")
    row_stride = a.strides[0] if r > 1 else c
    if row_stride < c:
        raise ValueError(f"{a.name}: row stride {row_stride} elements is less than the row "
                         f"length {c} (rows overlap or are reversed)")
    if dense and row_stride != c:
        raise ValueError(f"{a.name} must be dense (row stride {c}), got row stride {row_stride}")
    _check_aligned(a)
    return row_stride


def _vector(a: _Arr, n: int, what: str, allow_scalar: bool = False):
    if allow_scalar and n == 1 and a.shape in ((), (1,)):
        _check_aligned(a)
        return
    if len(a.shape) != 1 or a.shape[0] != n:
        raise ValueError(f"{a.name} must have shape ({n},) {what}, got {a.shape}")
    if n > 1 and a.strides[0] != 1:
        raise ValueError(f"{a.name} must be contiguous, got stride {a.strides[0]} elements")
    _check_aligned(a)


def _need_dtype(a: _Arr, dtype: str):
    if a.dtype != dtype:
        raise TypeError(f"{a.name} must be {dtype}, got {a.dtype.replace('other:', '')}")


def _writable(a: _Arr):
    if a.readonly:
        raise ValueError(f"{a.name} is read-only")


def _targets_code(y: _Arr, rows: int, target_dtype) -> int:
    if y.dtype not in _TARGET_CODES:
        raise TypeError(f"targets must be int32 or int64, got {y.dtype.replace('other:', '')}")
    kw = _dtype_name(target_dtype)
    if kw is not None and kw != y.dtype:
        raise TypeError(f"targets have dtype {y.dtype} but target_dtype={target_dtype!r}")
    _vector(y, rows, "[rows]")
    return _TARGET_CODES[y.dtype]


def _check_stride_kw(value, actual, name):
    if value is None or value == 0:
        return
    if int(value) != actual:
        raise ValueError(f"{name}={value} disagrees with the array's row stride {actual}")


def _check_shift(rows, shift_seq_len, shift=0):
    t = _int_option(shift_seq_len, "shift_seq_len", 0)
    k = _int_option(shift, "shift", 0)
    if t > 0 and rows % t:
        raise ValueError(f"shift_seq_len ({t}) must divide the number of rows ({rows})")
    if k and not t:
        raise ValueError(f"shift={k} needs shift_seq_len > 0 (the sequence length T; shift "
                         "is the distance k of the causal shift within each sequence)")


# =================================================================== allocation ====
class _Alloc:
    """Allocates outputs in the framework of a reference array, on its device."""

    def __init__(self, ref: _Arr, stream: int):
        self.ref = ref
        self.stream = stream
        self.made = []

    def can(self):
        return (not self.ref.is_cuda) or self.ref.framework in ("torch", "cupy")

    def _fail(self, what):
        raise TypeError(
            f"{what} must be passed: fusedce allocates CUDA memory only through torch or CuPy, "
            f"and {self.ref.name} comes from {type(self.ref.obj).__module__}."
            f"{type(self.ref.obj).__name__}")

    def empty(self, shape, dtype: str, what: str, zero=False, like=None):
        """A new array; dtype "like" takes the exact dtype object of the array `like`."""
        ref = self.ref
        if not self.can():
            self._fail(what)
        if ref.framework == "torch":
            import torch
            tdt = like.obj.dtype if like is not None else getattr(torch, dtype)
            dev = ref.obj.device
            out = (torch.zeros if zero else torch.empty)(shape, dtype=tdt, device=dev)
            current = torch.cuda.current_stream(dev).cuda_stream if ref.is_cuda else None
            if ref.is_cuda and self.stream not in (None, current):
                out.record_stream(torch.cuda.ExternalStream(self.stream, device=dev))
            self.made.append(out)
            return out
        if ref.is_cuda:  # CuPy
            import cupy
            if like is not None and like.framework == "cupy":
                cdt = like.obj.dtype
            else:
                cdt = np.uint16 if dtype == "bfloat16" else np.dtype(dtype)
            with cupy.cuda.Device(ref.device[1] or 0), self._cupy_stream(cupy):
                out = (cupy.zeros if zero else cupy.empty)(shape, dtype=cdt)
            self.made.append(out)
            return out
        if like is not None and like.framework == "numpy":
            ndt = like.obj.dtype
        elif dtype == "bfloat16":
            ndt = _NP_BF16 if _NP_BF16 is not None else np.uint16
        else:
            ndt = np.dtype(dtype)
        out = (np.zeros if zero else np.empty)(shape, dtype=ndt)
        self.made.append(out)
        return out

    def _cupy_stream(self, cupy):
        current = cupy.cuda.get_current_stream().ptr
        if self.stream in (None, current) or (self.stream in (0, 1) and current == 0):
            return contextlib.nullcontext()
        return cupy.cuda.ExternalStream(self.stream)

    def workspace(self, nbytes: int):
        """(pointer, bytes, keep-alive) of a 16-byte aligned scratch buffer."""
        if nbytes == 0:
            return 0, 0, None
        if not self.ref.is_cuda and self.ref.framework != "torch":
            buf = np.empty(nbytes + 16, dtype=np.uint8)
            off = (-buf.ctypes.data) % 16
            return buf.ctypes.data + off, nbytes, buf
        buf = self.empty((nbytes + 16,), "uint8", "workspace")
        a = _describe(buf, "workspace")
        off = (-a.ptr) % 16
        return a.ptr + off, nbytes, buf

    def scalar_array(self, value: float, n: int, what: str):
        """A float32 [n] (or () when n is None) array holding value."""
        shape = () if n is None else (n,)
        if not self.ref.is_cuda and self.ref.framework != "torch":
            return np.full(shape, value, dtype=np.float32)
        if not self.can():
            self._fail(what)
        out = self.empty(shape, "float32", what)
        out.fill(value) if self.ref.framework == "cupy" else out.fill_(value)
        return out


def _user_workspace(ws, ref: _Arr, needed: int):
    a = _describe(ws, "workspace")
    _check_same_device(ref, a)
    nbytes = a.size * a.itemsize
    if len(a.shape) != 1 or (a.size > 1 and a.strides[0] != 1):
        raise ValueError(f"workspace must be a contiguous 1-D array, got shape {a.shape}")
    if a.ptr % 16:
        raise ValueError(f"workspace address {a.ptr:#x} is not 16-byte aligned")
    if nbytes < needed:
        raise ValueError(f"workspace has {nbytes} bytes, the call needs {needed}")
    return a.ptr, nbytes, a


# ====================================================================== streams ====
def _stream_int(stream) -> Optional[int]:
    if stream is None:
        return None
    if isinstance(stream, (int, np.integer)) and not isinstance(stream, bool):
        return int(stream)
    for attr in ("cuda_stream", "ptr", "handle"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise TypeError(f"stream must be an int (cudaStream_t), a torch or a CuPy stream, got "
                    f"{type(stream).__name__}")


def _call_stream(explicit: Optional[int], arrays) -> int:
    """The cudaStream_t (as an int) a CUDA call is enqueued on."""
    if explicit is not None:
        return explicit
    for a in arrays:
        if a is not None and a.framework == "torch" and a.is_cuda:
            import torch
            return torch.cuda.current_stream(a.obj.device).cuda_stream
    for a in arrays:
        if a is not None and a.stream is not None:
            return int(a.stream)  # 1 / 2: the legacy / per-thread handles, usable as they are
    return 0


@contextlib.contextmanager
def _device_of(ref: _Arr):
    """Make ref's CUDA device current for the call (torch and CuPy inputs)."""
    if ref.is_cuda and ref.framework == "torch":
        import torch
        with torch.cuda.device(ref.obj.device):
            yield
    elif ref.is_cuda and ref.framework == "cupy" and ref.device[1] is not None:
        import cupy
        with cupy.cuda.Device(ref.device[1]):
            yield
    else:
        yield


def _out(x, name, ref, dtype=None):
    """Describe a caller-given output and check it is writable and on ref's device."""
    a = _describe(x, name)
    _check_same_device(ref, a)
    _writable(a)
    if dtype is not None:
        _need_dtype(a, dtype)
    return a


def _grad_output(grad_output, alloc: _Alloc, ref: _Arr, n_values: int, none_reduction: bool):
    """(pointer, keep) of the float32 upstream gradient; (0, None) means g = 1."""
    if grad_output is None:
        return 0, None
    if isinstance(grad_output, (int, float, np.floating, np.integer)) and not isinstance(
            grad_output, bool):
        g = float(grad_output)
        if g == 1.0:
            return 0, None
        arr = alloc.scalar_array(g, n_values if none_reduction else None, "grad_output")
        a = _describe(arr, "grad_output")
        return a.ptr, (arr, a)
    a = _describe(grad_output, "grad_output")
    _check_same_device(ref, a)
    _need_dtype(a, "float32")
    if none_reduction:
        _vector(a, n_values, "[rows] (reduction='none')")
    else:
        _vector(a, 1, "() or (1,) (reduction mean/sum)", allow_scalar=True)
    return a.ptr, a


def _class_weights(class_weights, ref: _Arr, vocab: int):
    if class_weights is None:
        return None
    w = _describe(class_weights, "class_weights")
    _check_same_device(ref, w)
    _need_dtype(w, "float32")
    _vector(w, vocab, "[vocab]")
    return w


def _error_flags(error_flags, alloc: _Alloc, ref: _Arr):
    """(array, pointer): None allocates one zeroed word when possible, False asks for none."""
    if error_flags is False:
        return None, 0
    if error_flags is None:
        if not alloc.can():
            return None, 0
        # torch has only partial uint32 support: its flags word is an int32 (the same 32 bits)
        dtype = "int32" if ref.framework == "torch" else "uint32"
        arr = alloc.empty((1,), dtype, "error_flags", zero=True)
        return arr, _describe(arr, "error_flags").ptr
    a = _out(error_flags, "error_flags", ref)
    if a.dtype not in ("uint32", "int32"):
        raise TypeError(f"error_flags must be uint32 (or int32), got "
                        f"{a.dtype.replace('other:', '')}")
    _vector(a, 1, "(uint32)", allow_scalar=True)
    return error_flags, a.ptr


def check_error_flags(error_flags) -> None:
    """Read an error_flags word (a host sync for CUDA) and raise ValueError if a bit is set."""
    if error_flags is None:
        return
    if _is_torch(error_flags):
        value = int(error_flags.reshape(-1)[0].item())
    elif isinstance(error_flags, np.ndarray):
        value = int(error_flags.reshape(-1)[0])
    elif hasattr(error_flags, "get"):  # CuPy
        value = int(error_flags.get().reshape(-1)[0])
    else:
        value = int(np.asarray(error_flags).reshape(-1)[0])
    value &= 0xFFFFFFFF
    if value & FCE_FLAG_TARGET_OUT_OF_RANGE:
        raise ValueError("a target is outside [0, vocab) and is not ignore_index "
                         "(its row's loss is NaN)")
    if value & _lib.FCE_FLAG_SHARDS_INCONSISTENT:
        raise ValueError("the gathered vocabulary shards do not tile [0, vocab_total) (their "
                         "sizes do not sum to vocab_total, or a target is held by no shard or "
                         "by two: check vocab_start / vocab_total on every rank); the rows "
                         "concerned have a NaN loss")
    if value:
        raise ValueError(f"fusedce reported error flags {value:#x}")


def _argmax_accuracy(argmax, return_argmax, accuracy, return_accuracy, alloc: _Alloc, ref: _Arr,
                     rows: int, red: int):
    """(argmax, its _Arr, accuracy, its _Arr): the optional 0.3 outputs, allocated when asked
    for, checked when given (argmax int64 [rows]; accuracy float32 () or [1] for mean/sum,
    [rows] for none)."""
    am_a = acc_a = None
    if argmax is None and return_argmax:
        argmax = alloc.empty((rows,), "int64", "argmax")
    if argmax is not None:
        am_a = _out(argmax, "argmax", ref, "int64")
        _vector(am_a, rows, "[rows]")
    none = red == FCE_REDUCTION_NONE
    if accuracy is None and return_accuracy:
        accuracy = alloc.empty((rows,) if none else (), "float32", "accuracy")
    if accuracy is not None:
        acc_a = _out(accuracy, "accuracy", ref, "float32")
        _vector(acc_a, rows if none else 1, "[rows] (reduction='none')" if none else "()",
                allow_scalar=not none)
    return argmax, am_a, accuracy, acc_a


def _ptr(a: Optional[_Arr]):
    return a.ptr if a is not None else 0


# ================================================================ workspace sizes ====
def _query_options(rows, vocab, backend, dtype, target_dtype, reduction, ignore_index,
                   class_weights, label_smoothing, z_loss_scale, softcap, logit_scale,
                   shift_seq_len, deterministic, accumulate=False, grad_weight_fp32=False,
                   shift=0, token_scaling=False):
    b = _backend_code(backend)
    w_ptr = 0
    if class_weights is not None:
        w_ptr = _describe(class_weights, "class_weights").ptr
    return _build_options(
        backend=b, dtype=_FLOAT_CODES[_dtype_name(dtype) or "float32"],
        target_dtype=_TARGET_CODES[_dtype_name(target_dtype) or "int64"],
        reduction=_reduction_code(reduction), ignore_index=ignore_index,
        class_weights_ptr=w_ptr, label_smoothing=label_smoothing, z_loss_scale=z_loss_scale,
        softcap=softcap, logit_scale=logit_scale, shift_seq_len=shift_seq_len,
        deterministic=deterministic, accumulate=accumulate, grad_weight_fp32=grad_weight_fp32,
        shift=shift, token_scaling=token_scaling)


def _ce_workspace_size(function, rows, vocab, backend, dtype, target_dtype, reduction,
                       ignore_index, class_weights, label_smoothing, z_loss_scale, softcap,
                       logit_scale, shift_seq_len, deterministic, shift=0,
                       token_scaling=False) -> int:
    o = _query_options(rows, vocab, backend, dtype, target_dtype, reduction, ignore_index,
                       class_weights, label_smoothing, z_loss_scale, softcap, logit_scale,
                       shift_seq_len, deterministic, shift=shift, token_scaling=token_scaling)
    out = ctypes.c_size_t(0)
    _lib.call(function, ctypes.byref(o), int(rows), int(vocab), ctypes.byref(out))
    return int(out.value)


def forward_workspace_size(rows: int, vocab: int, *, backend="cpu", dtype="float32",
                           target_dtype="int64", reduction="mean", ignore_index=-100,
                           class_weights=None, label_smoothing=0.0, z_loss_scale=0.0,
                           softcap=0.0, logit_scale=1.0, shift_seq_len=0,
                           deterministic=False, shift=0, token_scaling=False) -> int:
    """fce_forward_workspace_size: scratch bytes fce_forward needs for these options."""
    return _ce_workspace_size("fce_forward_workspace_size", rows, vocab, backend, dtype,
                              target_dtype, reduction, ignore_index, class_weights,
                              label_smoothing, z_loss_scale, softcap, logit_scale,
                              shift_seq_len, deterministic, shift, token_scaling)


def backward_workspace_size(rows: int, vocab: int, *, backend="cpu", dtype="float32",
                            target_dtype="int64", reduction="mean", ignore_index=-100,
                            class_weights=None, label_smoothing=0.0, z_loss_scale=0.0,
                            softcap=0.0, logit_scale=1.0, shift_seq_len=0,
                            deterministic=False, shift=0, token_scaling=False) -> int:
    """fce_backward_workspace_size: scratch bytes fce_backward needs for these options."""
    return _ce_workspace_size("fce_backward_workspace_size", rows, vocab, backend, dtype,
                              target_dtype, reduction, ignore_index, class_weights,
                              label_smoothing, z_loss_scale, softcap, logit_scale,
                              shift_seq_len, deterministic, shift, token_scaling)


def linear_ce_workspace_size(rows: int, hidden: int, vocab: int, *, with_grad: bool = True,
                             backend="cpu", dtype="float32", target_dtype="int64",
                             reduction="mean", ignore_index=-100, class_weights=None,
                             label_smoothing=0.0, z_loss_scale=0.0, softcap=0.0,
                             logit_scale=1.0, shift_seq_len=0, deterministic=False,
                             accumulate=False, grad_weight_fp32=False, shift=0,
                             token_scaling=False):
    """fce_linear_ce_workspace_size: (min_bytes, optimal_bytes)."""
    o = _query_options(rows, vocab, backend, dtype, target_dtype, reduction, ignore_index,
                       class_weights, label_smoothing, z_loss_scale, softcap, logit_scale,
                       shift_seq_len, deterministic, accumulate, grad_weight_fp32, shift,
                       token_scaling)
    lo, hi = ctypes.c_size_t(0), ctypes.c_size_t(0)
    _lib.call("fce_linear_ce_workspace_size", ctypes.byref(o), int(rows), int(hidden),
              int(vocab), 1 if with_grad else 0, ctypes.byref(lo), ctypes.byref(hi))
    return int(lo.value), int(hi.value)


# ====================================================================== forward ====
def forward(logits, targets, *, reduction="mean", ignore_index: int = -100, class_weights=None,
            label_smoothing: float = 0.0, z_loss_scale: float = 0.0, softcap: float = 0.0,
            logit_scale: float = 1.0, shift_seq_len: int = 0, deterministic: bool = False,
            dtype=None, target_dtype=None, backend=None, row_stride=None, grad_row_stride=None,
            return_lse: bool = False, return_z_loss: bool = False, return_grad: bool = False,
            in_place: bool = False, grad_output=None, loss=None, lse=None, z_loss=None,
            grad_logits=None, error_flags=None, workspace=None, stream=None,
            check_targets: bool = False, shift: int = 0, token_scaling: bool = False,
            return_argmax: bool = False, return_accuracy: bool = False, argmax=None,
            accuracy=None) -> ForwardResult:
    """Cross-entropy of logits [rows, vocab] against targets [rows] (fce_forward).

    The loss is float32: shape () for reduction 'mean'/'sum', [rows] for 'none'.
    ``return_lse`` / ``return_z_loss`` also return lse [rows] and the z-loss total.
    ``return_argmax`` / ``return_accuracy`` (or ``argmax=`` int64 [rows] / ``accuracy=``
    float32 () or [rows] buffers) also return each row's predicted class (-1 for ignored rows)
    and the token accuracy: for mean/sum the fraction of non-ignored rows predicted right, for
    none 1/0 per row (library 0.3).
    ``shift_seq_len=T`` with ``shift=k`` (0 meaning 1): row b*T+t is scored against target
    b*T+t+k, rows with t >= T-k are ignored. ``token_scaling``: each row's loss and gradient
    times its detached p_y (Liger's use_token_scaling).
    ``return_grad`` (or a ``grad_logits=`` buffer, or ``in_place=True`` to write it over the
    logits) also writes d(loss)/d(logits) scaled by ``grad_output`` (a float, or a float32 array
    of shape () for mean/sum or [rows] for none; default 1) in the same pass.
    ``error_flags``: a uint32 [1] array the call ORs FCE_FLAG_* bits into; by default one is
    allocated (zeroed) and returned, ``False`` passes none. ``check_targets`` reads the flags
    after the call (a host sync on CUDA) and raises ValueError when a target was out of range;
    otherwise such a row's loss is NaN.
    """
    s_explicit = _stream_int(stream)
    z = _describe(logits, "logits", s_explicit)
    y = _describe(targets, "targets", s_explicit)
    _check_same_device(z, y)
    backend_code = _check_backend_kw(z, backend)
    if len(z.shape) != 2:
        raise ValueError(f"logits must be 2-D [rows, vocab], got shape {z.shape}")
    rows, vocab = z.shape
    dtype_code = _float_code(z, _dtype_name(dtype))
    rs = _matrix(z)
    _check_stride_kw(row_stride, rs, "row_stride")
    tcode = _targets_code(y, rows, target_dtype)
    red = _reduction_code(reduction)
    _check_shift(rows, shift_seq_len, shift)
    w = _class_weights(class_weights, z, vocab)
    if in_place and grad_logits is not None:
        raise ValueError("pass either in_place=True or grad_logits=, not both")
    if in_place:
        _writable(z)

    call_stream = _call_stream(s_explicit, [z, y, w]) if z.is_cuda else 0
    alloc = _Alloc(z, call_stream)

    with _device_of(z):
        # outputs
        if loss is None:
            loss = alloc.empty((rows,) if red == FCE_REDUCTION_NONE else (), "float32", "loss")
        la = _out(loss, "loss", z, "float32")
        _vector(la, rows if red == FCE_REDUCTION_NONE else 1, "(the loss)",
                allow_scalar=red != FCE_REDUCTION_NONE)
        lse_a = None
        if lse is None and return_lse:
            lse = alloc.empty((rows,), "float32", "lse")
        if lse is not None:
            lse_a = _out(lse, "lse", z, "float32")
            _vector(lse_a, rows, "[rows]")
        zl_a = None
        if z_loss is None and return_z_loss:
            z_loss = alloc.empty((), "float32", "z_loss")
        if z_loss is not None:
            zl_a = _out(z_loss, "z_loss", z, "float32")
            _vector(zl_a, 1, "()", allow_scalar=True)
        argmax, am_a, accuracy, acc_a = _argmax_accuracy(argmax, return_argmax, accuracy,
                                                         return_accuracy, alloc, z, rows, red)
        g_a, grs = None, 0
        if in_place:
            grad_logits, g_a, grs = logits, z, rs
        else:
            if grad_logits is None and return_grad:
                grad_logits = alloc.empty((rows, vocab), _CODE_NAMES[dtype_code], "grad_logits",
                                          like=z)
            if grad_logits is not None:
                g_a = _out(grad_logits, "grad_logits", z)
                _float_code(g_a, _CODE_NAMES[dtype_code], "the logits' dtype")
                grs = _matrix(g_a, rows, vocab)
        if g_a is not None:
            _check_stride_kw(grad_row_stride, grs, "grad_row_stride")
        go_ptr, go_keep = (_grad_output(grad_output, alloc, z, rows, red == FCE_REDUCTION_NONE)
                           if g_a is not None else (0, None))
        flags, flags_ptr = _error_flags(error_flags, alloc, z)

        opts = _build_options(
            backend=backend_code, dtype=dtype_code, target_dtype=tcode, reduction=red,
            ignore_index=ignore_index, class_weights_ptr=_ptr(w),
            label_smoothing=label_smoothing, z_loss_scale=z_loss_scale, softcap=softcap,
            logit_scale=logit_scale, shift_seq_len=shift_seq_len, deterministic=deterministic,
            row_stride=rs, grad_row_stride=grs if g_a is not None else 0, shift=shift,
            token_scaling=token_scaling, argmax_ptr=_ptr(am_a), accuracy_ptr=_ptr(acc_a))
        need = ctypes.c_size_t(0)
        _lib.call("fce_forward_workspace_size", ctypes.byref(opts), rows, vocab,
                  ctypes.byref(need))
        if workspace is None:
            ws_ptr, ws_bytes, ws_keep = alloc.workspace(int(need.value))
        else:
            ws_ptr, ws_bytes, ws_keep = _user_workspace(workspace, z, int(need.value))
        _lib.call("fce_forward", ctypes.byref(opts), rows, vocab, z.ptr, y.ptr, la.ptr,
                  _ptr(lse_a), _ptr(zl_a), _ptr(g_a), go_ptr, flags_ptr, ws_ptr, ws_bytes,
                  call_stream)
        del ws_keep, go_keep
    if check_targets:
        check_error_flags(flags)
    return ForwardResult(loss, lse, z_loss, grad_logits, flags, argmax, accuracy)


# ===================================================================== backward ====
def backward(logits, targets, lse, grad_output=None, *, reduction="mean",
             ignore_index: int = -100, class_weights=None, label_smoothing: float = 0.0,
             z_loss_scale: float = 0.0, softcap: float = 0.0, logit_scale: float = 1.0,
             shift_seq_len: int = 0, deterministic: bool = False, dtype=None, target_dtype=None,
             backend=None, row_stride=None, grad_row_stride=None, grad_logits=None,
             in_place: bool = False, error_flags=None, workspace=None, stream=None,
             shift: int = 0, token_scaling: bool = False):
    """d(loss)/d(logits) from the logits, targets and the lse saved by :func:`forward`
    (fce_backward), scaled by grad_output (float, or float32 () / [rows] for 'none').

    Pass the same options as to forward (``shift``, ``token_scaling`` included; the argmax and
    accuracy outputs are the forward's only). The gradient's p_j come from the float32 lse, so
    they equal the forward's to the rounding of lse, not bit for bit. Returns grad_logits
    (allocated unless given; ``in_place=True`` writes it over the logits and returns them)."""
    s_explicit = _stream_int(stream)
    z = _describe(logits, "logits", s_explicit)
    y = _describe(targets, "targets", s_explicit)
    l = _describe(lse, "lse", s_explicit)
    _check_same_device(z, y, l)
    backend_code = _check_backend_kw(z, backend)
    if len(z.shape) != 2:
        raise ValueError(f"logits must be 2-D [rows, vocab], got shape {z.shape}")
    rows, vocab = z.shape
    dtype_code = _float_code(z, _dtype_name(dtype))
    rs = _matrix(z)
    _check_stride_kw(row_stride, rs, "row_stride")
    tcode = _targets_code(y, rows, target_dtype)
    _need_dtype(l, "float32")
    _vector(l, rows, "[rows]")
    red = _reduction_code(reduction)
    _check_shift(rows, shift_seq_len, shift)
    w = _class_weights(class_weights, z, vocab)
    if in_place and grad_logits is not None:
        raise ValueError("pass either in_place=True or grad_logits=, not both")

    call_stream = _call_stream(s_explicit, [z, y, l, w]) if z.is_cuda else 0
    alloc = _Alloc(z, call_stream)
    with _device_of(z):
        if in_place:
            _writable(z)
            grad_logits, g_a, grs = logits, z, rs
        else:
            if grad_logits is None:
                grad_logits = alloc.empty((rows, vocab), _CODE_NAMES[dtype_code], "grad_logits",
                                          like=z)
            g_a = _out(grad_logits, "grad_logits", z)
            _float_code(g_a, _CODE_NAMES[dtype_code], "the logits' dtype")
            grs = _matrix(g_a, rows, vocab)
        _check_stride_kw(grad_row_stride, grs, "grad_row_stride")
        go_ptr, go_keep = _grad_output(grad_output, alloc, z, rows, red == FCE_REDUCTION_NONE)
        flags_ptr = 0
        if error_flags is not None and error_flags is not False:
            _, flags_ptr = _error_flags(error_flags, alloc, z)
        opts = _build_options(
            backend=backend_code, dtype=dtype_code, target_dtype=tcode, reduction=red,
            ignore_index=ignore_index, class_weights_ptr=_ptr(w),
            label_smoothing=label_smoothing, z_loss_scale=z_loss_scale, softcap=softcap,
            logit_scale=logit_scale, shift_seq_len=shift_seq_len, deterministic=deterministic,
            row_stride=rs, grad_row_stride=grs, shift=shift, token_scaling=token_scaling)
        need = ctypes.c_size_t(0)
        _lib.call("fce_backward_workspace_size", ctypes.byref(opts), rows, vocab,
                  ctypes.byref(need))
        if workspace is None:
            ws_ptr, ws_bytes, ws_keep = alloc.workspace(int(need.value))
        else:
            ws_ptr, ws_bytes, ws_keep = _user_workspace(workspace, z, int(need.value))
        _lib.call("fce_backward", ctypes.byref(opts), rows, vocab, z.ptr, y.ptr, l.ptr, go_ptr,
                  g_a.ptr, flags_ptr, ws_ptr, ws_bytes, call_stream)
        del ws_keep, go_keep
    return grad_logits


# ==================================================================== linear_ce ====
def _grad_set(return_grad, has_bias):
    if return_grad is True:
        return {"hidden", "weight"} | ({"bias"} if has_bias else set())
    if not return_grad:
        return set()
    if isinstance(return_grad, str):
        return_grad = [return_grad]
    names = set(return_grad)
    unknown = names - {"hidden", "weight", "bias"}
    if unknown:
        raise ValueError(f"return_grad names unknown inputs {sorted(unknown)}: use True, False "
                         "or a subset of ('hidden', 'weight', 'bias')")
    if "bias" in names and not has_bias:
        raise ValueError("return_grad asks for the bias gradient but no bias was given")
    return names


def linear_ce(hidden, weight, targets, bias=None, *, reduction="mean", ignore_index: int = -100,
              class_weights=None, label_smoothing: float = 0.0, z_loss_scale: float = 0.0,
              softcap: float = 0.0, logit_scale: float = 1.0, shift_seq_len: int = 0,
              deterministic: bool = False, dtype=None, target_dtype=None, backend=None,
              hidden_row_stride=None, accumulate: bool = False, grad_weight_fp32: bool = False,
              return_lse: bool = False, return_z_loss: bool = False, return_grad=False,
              grad_output=None, loss=None, lse=None, z_loss=None, grad_hidden=None,
              grad_weight=None, grad_bias=None, error_flags=None, workspace=None,
              workspace_size="optimal", stream=None,
              check_targets: bool = False, shift: int = 0, token_scaling: bool = False,
              return_argmax: bool = False, return_accuracy: bool = False, argmax=None,
              accuracy=None) -> LinearCEResult:
    """Cross-entropy of hidden [rows, D] · weightᵀ [D, V] + bias [V] (fce_linear_ce): the logits
    are held only piece by piece, within the workspace.

    ``return_grad`` (True, or a subset of ('hidden', 'weight', 'bias')) or gradient buffers
    (``grad_hidden=``, ``grad_weight=``, ``grad_bias=``) ask for the gradients in the same call,
    scaled by ``grad_output`` (default 1). ``accumulate=True`` adds into grad_weight / grad_bias
    (allocated as zeros when not given); ``grad_weight_fp32=True`` makes them float32.
    ``workspace_size`` picks the scratch size when the workspace is allocated here: 'optimal',
    'min', or a byte count (at least the minimum). ``shift``, ``token_scaling``,
    ``return_argmax``, ``return_accuracy``, ``argmax=``, ``accuracy=``: as for :func:`forward`
    (the predicted classes come from the logits the call computes, never stored whole)."""
    s_explicit = _stream_int(stream)
    h = _describe(hidden, "hidden", s_explicit)
    W = _describe(weight, "weight", s_explicit)
    y = _describe(targets, "targets", s_explicit)
    b = _describe(bias, "bias", s_explicit) if bias is not None else None
    _check_same_device(h, W, y, b)
    backend_code = _check_backend_kw(h, backend)
    if len(h.shape) != 2:
        raise ValueError(f"hidden must be 2-D [rows, hidden], got shape {h.shape}")
    rows, dim = h.shape
    if len(W.shape) != 2:
        raise ValueError(f"weight must be 2-D [vocab, hidden], got shape {W.shape}")
    vocab = W.shape[0]
    dkw = _dtype_name(dtype)
    dtype_code = _float_code(h, dkw)
    dname = _CODE_NAMES[dtype_code]
    _float_code(W, dname, "the hidden states' dtype")
    hrs = _matrix(h, what="[rows, hidden]")
    _check_stride_kw(hidden_row_stride, hrs, "hidden_row_stride")
    _matrix(W, cols=dim, dense=True, what="[vocab, hidden]")
    if b is not None:
        _float_code(b, dname, "the hidden states' dtype")
        _vector(b, vocab, "[vocab]")
    tcode = _targets_code(y, rows, target_dtype)
    red = _reduction_code(reduction)
    _check_shift(rows, shift_seq_len, shift)
    w = _class_weights(class_weights, h, vocab)
    grads = _grad_set(return_grad, b is not None)
    gdtype = "float32" if grad_weight_fp32 else dname

    call_stream = _call_stream(s_explicit, [h, W, y, b, w]) if h.is_cuda else 0
    alloc = _Alloc(h, call_stream)
    with _device_of(h):
        if loss is None:
            loss = alloc.empty((rows,) if red == FCE_REDUCTION_NONE else (), "float32", "loss")
        la = _out(loss, "loss", h, "float32")
        _vector(la, rows if red == FCE_REDUCTION_NONE else 1, "(the loss)",
                allow_scalar=red != FCE_REDUCTION_NONE)
        lse_a = zl_a = None
        if lse is None and return_lse:
            lse = alloc.empty((rows,), "float32", "lse")
        if lse is not None:
            lse_a = _out(lse, "lse", h, "float32")
            _vector(lse_a, rows, "[rows]")
        if z_loss is None and return_z_loss:
            z_loss = alloc.empty((), "float32", "z_loss")
        if z_loss is not None:
            zl_a = _out(z_loss, "z_loss", h, "float32")
            _vector(zl_a, 1, "()", allow_scalar=True)
        argmax, am_a, accuracy, acc_a = _argmax_accuracy(argmax, return_argmax, accuracy,
                                                         return_accuracy, alloc, h, rows, red)

        gh_a = gw_a = gb_a = None
        if grad_hidden is None and "hidden" in grads:
            grad_hidden = alloc.empty((rows, dim), dname, "grad_hidden", like=h)
        if grad_hidden is not None:
            gh_a = _out(grad_hidden, "grad_hidden", h)
            _float_code(gh_a, dname, "the hidden states' dtype")
            _matrix(gh_a, rows, dim, dense=True, what="[rows, hidden]")
        if grad_weight is None and "weight" in grads:
            grad_weight = alloc.empty((vocab, dim), gdtype, "grad_weight", zero=accumulate,
                                      like=None if grad_weight_fp32 else W)
        if grad_weight is not None:
            gw_a = _out(grad_weight, "grad_weight", h)
            _float_code(gw_a, gdtype, "float32 (grad_weight_fp32)" if grad_weight_fp32
                        else "the weight's dtype")
            _matrix(gw_a, vocab, dim, dense=True, what="[vocab, hidden]")
        if grad_bias is None and "bias" in grads:
            grad_bias = alloc.empty((vocab,), gdtype, "grad_bias", zero=accumulate,
                                    like=None if grad_weight_fp32 else b)
        if grad_bias is not None:
            if b is None:
                raise ValueError("grad_bias was given but there is no bias")
            gb_a = _out(grad_bias, "grad_bias", h)
            _float_code(gb_a, gdtype, "float32 (grad_weight_fp32)" if grad_weight_fp32
                        else "the bias' dtype")
            _vector(gb_a, vocab, "[vocab]")
        with_grad = any(a is not None for a in (gh_a, gw_a, gb_a))
        go_ptr, go_keep = (_grad_output(grad_output, alloc, h, rows, red == FCE_REDUCTION_NONE)
                           if with_grad else (0, None))
        flags, flags_ptr = _error_flags(error_flags, alloc, h)
        opts = _build_options(
            backend=backend_code, dtype=dtype_code, target_dtype=tcode, reduction=red,
            ignore_index=ignore_index, class_weights_ptr=_ptr(w),
            label_smoothing=label_smoothing, z_loss_scale=z_loss_scale, softcap=softcap,
            logit_scale=logit_scale, shift_seq_len=shift_seq_len, deterministic=deterministic,
            hidden_row_stride=hrs, accumulate=accumulate, grad_weight_fp32=grad_weight_fp32,
            shift=shift, token_scaling=token_scaling, argmax_ptr=_ptr(am_a),
            accuracy_ptr=_ptr(acc_a))
        lo, hi = ctypes.c_size_t(0), ctypes.c_size_t(0)
        _lib.call("fce_linear_ce_workspace_size", ctypes.byref(opts), rows, dim, vocab,
                  1 if with_grad else 0, ctypes.byref(lo), ctypes.byref(hi))
        if workspace is None:
            if workspace_size == "optimal":
                nbytes = int(hi.value)
            elif workspace_size == "min":
                nbytes = int(lo.value)
            else:
                nbytes = int(workspace_size)
                if nbytes < lo.value:
                    raise ValueError(f"workspace_size={nbytes} is below the minimum "
                                     f"{lo.value} bytes")
            ws_ptr, ws_bytes, ws_keep = alloc.workspace(max(nbytes, int(lo.value)))
        else:
            ws_ptr, ws_bytes, ws_keep = _user_workspace(workspace, h, int(lo.value))
        _lib.call("fce_linear_ce", ctypes.byref(opts), rows, dim, vocab, h.ptr, W.ptr, _ptr(b),
                  y.ptr, la.ptr, _ptr(lse_a), _ptr(zl_a), _ptr(gh_a), _ptr(gw_a), _ptr(gb_a),
                  go_ptr, flags_ptr, ws_ptr, ws_bytes, call_stream)
        del ws_keep, go_keep
    if check_targets:
        check_error_flags(flags)
    return LinearCEResult(loss, lse, z_loss, grad_hidden, grad_weight, grad_bias, flags, argmax,
                          accuracy)


# ============================================================ bfloat16 helpers ====
def float_to_bfloat16_bits(x) -> np.ndarray:
    """Round float32 values to bfloat16 (nearest, ties to even) and return the raw uint16 bits:
    what fusedce takes with dtype='bfloat16' when ml_dtypes is not installed."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)  # keep NaN a (quiet) NaN
    return rounded


def bfloat16_bits_to_float(bits) -> np.ndarray:
    """Raw bfloat16 bits (uint16) to float32."""
    b = np.ascontiguousarray(bits, dtype=np.uint16)
    return (b.astype(np.uint32) << 16).view(np.float32)

