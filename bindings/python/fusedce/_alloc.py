"""Allocation: the outputs and the workspace of a call, made in the framework of its inputs
(NumPy for the CPU backend, torch for torch tensors, CuPy for CuPy arrays) on their device,
and the caller-given buffers described and checked for what the C ABI cannot see (shape, dtype,
device, writability); the workspace's size and alignment are the library's to check. Also the
memory budget of the linear cross-entropy in the framework layers (FUSEDCE_WORKSPACE_BYTES).
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import numpy as np

from . import _lib
from ._args import _check_same_device, _check_stride_kw, _matrix, _vector, _writable
from ._arrays import _NP_BF16, _Arr, _describe, _float_code, _need_dtype
from ._errors import FusedCEError, as_call
from ._lib import FCE_REDUCTION_NONE


# ------------------------------------------------------------------ workspace queries ----
def check_query(status: int, query: str, call: str) -> None:
    """_lib.check for the status of a workspace query (fce_*_workspace_size) made to size the
    workspace of the compute call ``call``: a failure is raised as that call's (_errors.as_call),
    the name the user's call goes by in C."""
    try:
        _lib.check(status, query)
    except FusedCEError as e:
        raise as_call(e, query, call) from None


def query_for(call: str, query: str, *args) -> None:
    """The workspace query ``query`` with ``args``, made for the compute call ``call``
    (check_query)."""
    check_query(getattr(_lib.load(), query)(*args), query, call)

# ------------------------------------------------------------------ memory budget ----
DEFAULT_WORKSPACE_BYTES = 1 << 30  # linear CE through torch / JAX: <= 1 GiB beyond the gradients


def parse_bytes(text: str) -> int:
    """'1073741824', '512M', '1G', '128MiB' -> bytes."""
    t = text.strip().upper().replace("IB", "").replace("B", "")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMGT" else t
    value = int(float(num) * mult)
    if value < 0:
        raise ValueError(f"a byte count must be >= 0, got {text!r}")
    return value


def default_workspace_bytes() -> int:
    """The linear CE memory budget when a call gives none: FUSEDCE_WORKSPACE_BYTES, else 1 GiB."""
    env = os.environ.get("FUSEDCE_WORKSPACE_BYTES")
    if env:
        try:
            return parse_bytes(env)
        except (ValueError, IndexError):
            raise ValueError(f"FUSEDCE_WORKSPACE_BYTES={env!r} is not a byte count "
                             "(e.g. 1073741824, 512M, 1G)") from None
    return DEFAULT_WORKSPACE_BYTES


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




def _user_workspace(ws, ref: _Arr):
    """(pointer, bytes, keep-alive) of a caller's workspace: a contiguous 1-D array on ref's
    device (its size and 16-byte alignment are the library's to check)."""
    a = _describe(ws, "workspace")
    _check_same_device(ref, a)
    if len(a.shape) != 1 or (a.size > 1 and a.strides[0] != 1):
        raise ValueError(f"workspace must be a contiguous 1-D array, got shape {a.shape}")
    return a.ptr, a.size * a.itemsize, a


def _workspace(workspace, alloc: _Alloc, ref: _Arr, lo: int, hi: int, workspace_size):
    """The workspace of a call whose query gives (min, optimal) bytes: the caller's, or one of
    ``workspace_size`` bytes ('optimal', 'min' or a count: below the minimum, the library
    refuses it with WorkspaceTooSmallError)."""
    if workspace is not None:
        return _user_workspace(workspace, ref)
    if workspace_size == "optimal":
        nbytes = hi
    elif workspace_size == "min":
        nbytes = lo
    else:
        nbytes = int(workspace_size)
        if nbytes < 0:
            raise ValueError(f"workspace_size must be 'optimal', 'min' or a byte count, got "
                             f"{workspace_size!r}")
    return alloc.workspace(nbytes)


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


def _loss_lse(alloc: _Alloc, ref: _Arr, rows: int, per_row: bool, loss, lse, return_lse: bool):
    """(loss, its _Arr, lse, its _Arr or None): the loss (float32 [rows] for reduction 'none',
    else ()) and lse (float32 [rows], when given or ``return_lse``) outputs of a call: the
    caller's, checked, or allocated."""
    if loss is None:
        loss = alloc.empty((rows,) if per_row else (), "float32", "loss")
    la = _out(loss, "loss", ref, "float32")
    _vector(la, rows if per_row else 1, "(the loss)", allow_scalar=not per_row)
    lse_a = None
    if lse is None and return_lse:
        lse = alloc.empty((rows,), "float32", "lse")
    if lse is not None:
        lse_a = _out(lse, "lse", ref, "float32")
        _vector(lse_a, rows, "[rows]")
    return loss, la, lse, lse_a


def _grad_logits(alloc: _Alloc, logits, z: _Arr, row_stride: int, dtype_name: str, *,
                 in_place: bool, grad_logits, return_grad: bool, grad_row_stride):
    """(grad_logits, its _Arr or None, its row stride or 0): the gradient buffer of a call over
    given logits (fce_forward, fce_distill): the logits themselves (``in_place``), the
    caller's (checked), one allocated for ``return_grad``, or none."""
    rows, vocab = z.shape
    if in_place:
        if grad_logits is not None:
            raise ValueError("pass either in_place=True or grad_logits=, not both")
        _writable(z)
        grad_logits, g_a, grs = logits, z, row_stride
    else:
        g_a, grs = None, 0
        if grad_logits is None and return_grad:
            grad_logits = alloc.empty((rows, vocab), dtype_name, "grad_logits", like=z)
        if grad_logits is not None:
            g_a = _out(grad_logits, "grad_logits", z)
            _float_code(g_a, dtype_name, "the logits' dtype")
            grs = _matrix(g_a, rows, vocab)
    if g_a is not None:
        _check_stride_kw(grad_row_stride, grs, "grad_row_stride")
    return grad_logits, g_a, grs


def _ptr(a: Optional[_Arr]):
    return a.ptr if a is not None else 0



def _linear_grads(alloc, h, W, b, grads, grad_hidden, grad_weight, grad_bias, *, rows, dim,
                  vocab, gh_dtype, gh_like, gh_what, grad_weight_fp32, wdtype, accumulate,
                  vocab_name):
    """The gradient outputs of a fused linear + CE call (fce_linear_ce, fce_vp_linear_backward):
    the caller's, checked, or allocated for the names in `grads` ("hidden", "weight", "bias").
    grad_hidden [rows, dim] of gh_dtype; grad_weight [vocab, dim] and grad_bias [vocab] of wdtype
    (zeroed when accumulating); a new grad_hidden is made like gh_like (or None). Returns the three arrays as given or made, and their _Arr
    descriptions (None where absent)."""
    gh_a = gw_a = gb_a = None
    if grad_hidden is None and "hidden" in grads:
        grad_hidden = alloc.empty((rows, dim), gh_dtype, "grad_hidden", like=gh_like)
    if grad_hidden is not None:
        gh_a = _out(grad_hidden, "grad_hidden", h)
        _float_code(gh_a, gh_dtype, gh_what)
        _matrix(gh_a, rows, dim, dense=True, what="[rows, hidden]")
    if grad_weight is None and "weight" in grads:
        grad_weight = alloc.empty((vocab, dim), wdtype, "grad_weight", zero=accumulate,
                                  like=None if grad_weight_fp32 else W)
    if grad_weight is not None:
        gw_a = _out(grad_weight, "grad_weight", h)
        _float_code(gw_a, wdtype, "float32 (grad_weight_fp32)" if grad_weight_fp32
                    else "the weight's dtype")
        _matrix(gw_a, vocab, dim, dense=True, what=f"[{vocab_name}, hidden]")
    if grad_bias is None and "bias" in grads:
        grad_bias = alloc.empty((vocab,), wdtype, "grad_bias", zero=accumulate,
                                like=None if grad_weight_fp32 else b)
    if grad_bias is not None:  # (without a bias: the library refuses it)
        gb_a = _out(grad_bias, "grad_bias", h)
        _float_code(gb_a, wdtype, "float32 (grad_weight_fp32)" if grad_weight_fp32
                    else "the bias' dtype")
        _vector(gb_a, vocab, f"[{vocab_name}]")
    return (grad_hidden, grad_weight, grad_bias), (gh_a, gw_a, gb_a)
