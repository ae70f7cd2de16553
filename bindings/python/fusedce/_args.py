"""Arguments: keyword values to fce_options fields, and the checks the C library cannot make.

The library checks every value it is given and names the argument in its message (option
ranges, the causal shift, sizes, row strides, alignment, workspace size, in-place aliasing,
...): those checks are not repeated here, the library's message is raised as it is
(:func:`fusedce._lib.check`). What is checked here is what the C ABI cannot see: Python types
(a value that ctypes would silently truncate), the shapes of arrays that give the sizes passed to
C, their dtypes and devices, contiguity (the C ABI takes a pointer and a row stride), and the
keywords of the Python API itself.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from . import _lib
from ._arrays import _CODE_NAMES, _FLOAT_CODES, _TARGET_CODES, _Arr, _dtype_name, _float_code
from ._lib import (FCE_BACKEND_CPU, FCE_BACKEND_CUDA, FCE_REDUCTION_MEAN, FCE_REDUCTION_NONE,
                   FCE_REDUCTION_SUM)
from ._options import CEOptions, DistillOptions

REDUCTIONS = {"mean": FCE_REDUCTION_MEAN, "sum": FCE_REDUCTION_SUM, "none": FCE_REDUCTION_NONE}


# ================================================================== option values ====
def _int32_code(value, name) -> int:
    """An enum code given as an int (the library checks its value): it must fit int32."""
    value = int(value)
    if not -(2 ** 31) <= value < 2 ** 31:
        raise ValueError(f"{name} ({value}) does not fit in int32")
    return value


def _reduction_code(reduction) -> int:
    if isinstance(reduction, str):
        if reduction.lower() in REDUCTIONS:
            return REDUCTIONS[reduction.lower()]
    elif isinstance(reduction, (int, np.integer)):
        return _int32_code(reduction, "reduction")  # an fce_reduction: the library checks it
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
    elif isinstance(backend, (int, np.integer)):
        return _int32_code(backend, "backend")  # an fce_backend: the library checks it
    raise ValueError(f"backend must be 'cpu' or 'cuda', got {backend!r}")


def _build_options(opts: CEOptions, *, backend, dtype, target_dtype, class_weights_ptr=0,
                   deterministic=False, row_stride=0, grad_row_stride=0, hidden_row_stride=0,
                   accumulate=False, grad_weight_fp32=False) -> _lib.Options:
    """The fce_options of a call: the caller's options (one :class:`CEOptions`, checked where it
    was built) and this call's values (backend, dtypes, class weights, strides, ...). Values out
    of their domain (a negative shift or shift_seq_len, epsilon outside [0, 1), a negative
    softcap, rows that are no whole number of sequences, ...) are the library's to reject: it
    names the argument in InvalidArgumentError. The outputs (argmax, accuracy, ...) are not
    options: they travel in _lib.outputs()."""
    o = _lib.default_options()  # struct_size: _lib.options_size()
    o.backend, o.dtype, o.target_dtype = backend, dtype, target_dtype
    o.reduction, o.ignore_index = opts.reduction, opts.ignore_index
    o.label_smoothing, o.z_loss_scale = opts.label_smoothing, opts.z_loss
    o.softcap, o.logit_scale = opts.softcap, opts.logit_scale
    o.shift_seq_len, o.shift = opts.shift_seq_len, opts.shift
    o.token_scaling = 1 if opts.token_scaling else 0
    o.batch_invariant = 1 if opts.batch_invariant else 0
    o.class_weights = class_weights_ptr or None
    o.row_stride = row_stride
    o.grad_row_stride = grad_row_stride
    o.hidden_row_stride = hidden_row_stride
    o.deterministic = 1 if deterministic else 0
    o.accumulate = 1 if accumulate else 0
    o.grad_weight_fp32 = 1 if grad_weight_fp32 else 0
    o.vp_entropy = 0
    return o


def _build_teacher(opts: DistillOptions, *, logits=0, row_stride=0, hidden_states=0, weight=0,
                   hidden=0, hidden_row_stride=0) -> _lib.Teacher:
    """The fce_teacher of a distillation call: the caller's divergence, beta and temperature
    (one :class:`DistillOptions`) and this call's teacher tensors (addresses, 0 for NULL) and
    sizes. The fce_options of the same call: ``_build_options(opts.ce(), ...)``."""
    return _lib.teacher(divergence=opts.divergence, beta=opts.beta,
                        temperature=opts.temperature, logits=logits, row_stride=row_stride,
                        hidden_states=hidden_states, weight=weight, hidden=hidden,
                        hidden_row_stride=hidden_row_stride)


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


def _matrix(a: _Arr, rows: Optional[int] = None, cols: Optional[int] = None,
            dense: bool = False, what: str = "[rows, vocab]") -> int:
    """Check a 2-D [rows, cols] array with a contiguous last dimension (the C ABI takes a pointer
    and a row stride: it cannot see either); return its row stride (checked by the library
    against the row length, where the call takes one; ``dense``: the call takes none)."""
    if len(a.shape) != 2:
        raise ValueError(f"{a.name} must be 2-D {what}, got shape {a.shape}")
    r, c = a.shape
    if rows is not None and r != rows:
        raise ValueError(f"{a.name} has {r} rows, expected {rows} (shape {a.shape})")
    if cols is not None and c != cols:
        raise ValueError(f"{a.name} has {c} columns, expected {cols} (shape {a.shape})")
    if r == 0:  # no element (an empty batch): its strides mean nothing (NumPy's are 0), dense
        return c
    if c > 1 and a.strides[1] != 1:
        raise ValueError(f"{a.name}: the last dimension must be contiguous (stride 1 element), "
                         f"got strides {a.strides} (elements); make it contiguous first")
    row_stride = a.strides[0] if r > 1 else c
    if row_stride == 0 and r > 1 and c > 0:
        # the C ABI reads a row stride of 0 as "dense": say it here
        raise ValueError(f"{a.name}: row stride 0 (every row the same memory) cannot be passed; "
                         "make it contiguous first")
    if dense and row_stride != c:
        raise ValueError(f"{a.name} must be dense (row stride {c}), got row stride {row_stride}")
    return row_stride


def _hidden_weight(h: _Arr, W: _Arr, vocab_name: str = "vocab") -> Tuple[int, int, int]:
    """(rows, hidden, vocab) of a linear head's hidden states [rows, hidden] and weight
    [vocab, hidden] (both 2-D; the columns and strides are checked with _matrix)."""
    if len(h.shape) != 2:
        raise ValueError(f"{h.name} must be 2-D [rows, hidden], got shape {h.shape}")
    if len(W.shape) != 2:
        raise ValueError(f"{W.name} must be 2-D [{vocab_name}, hidden], got shape {W.shape}")
    return h.shape[0], h.shape[1], W.shape[0]


def _vector(a: _Arr, n: int, what: str, allow_scalar: bool = False):
    """Check a contiguous [n] array (or () / (1,) for n == 1 with ``allow_scalar``)."""
    if allow_scalar and n == 1 and a.shape in ((), (1,)):
        return
    if len(a.shape) != 1 or a.shape[0] != n:
        raise ValueError(f"{a.name} must have shape ({n},) {what}, got {a.shape}")
    if n > 1 and a.strides[0] != 1:
        raise ValueError(f"{a.name} must be contiguous, got stride {a.strides[0]} elements")


def _writable(a: _Arr):
    if a.readonly:
        raise ValueError(f"{a.name} is read-only")


def _targets_code(y: _Arr, rows: int, target_dtype, vocab: Optional[int] = None,
                  dtype_code: Optional[int] = None) -> int:
    """The fce_dtype of targets: class indices y [rows] (int32 / int64), or, where the call takes
    them (``vocab`` and the logits' ``dtype_code`` given: fce_forward, fce_backward,
    fce_linear_ce), class probabilities q [rows, vocab], dense, of the logits' dtype
    (docs/semantics.md rule 19)."""
    if y.dtype not in _TARGET_CODES:
        if vocab is not None and len(y.shape) == 2:
            dname = _CODE_NAMES[dtype_code]
            code = _float_code(y, dname, "the logits' dtype (class probabilities)")
            kw = _dtype_name(target_dtype)
            if kw is not None and kw != dname:
                raise TypeError(f"targets have dtype {y.dtype} but target_dtype={target_dtype!r}")
            _matrix(y, rows, vocab, dense=True, what="[rows, vocab] (class probabilities)")
            return code
        more = (" indices [rows], or class probabilities [rows, vocab] of the logits' dtype"
                if vocab is not None else " (class indices: this call takes no probabilities)")
        raise TypeError(f"targets must be int32 or int64{more}, got "
                        f"{y.dtype.replace('other:', '')} of shape {y.shape}")
    kw = _dtype_name(target_dtype)
    if kw is not None and kw != y.dtype:
        raise TypeError(f"targets have dtype {y.dtype} but target_dtype={target_dtype!r}")
    _vector(y, rows, "[rows]")
    return _TARGET_CODES[y.dtype]


def _target_dtype_code(target_dtype) -> int:
    """The fce_dtype of a target_dtype keyword of a workspace query: int32 / int64 (class
    indices, int64 by default) or a float dtype (class probabilities)."""
    name = _dtype_name(target_dtype) or "int64"
    return _TARGET_CODES.get(name, _FLOAT_CODES.get(name))


def _check_stride_kw(value, actual, name):
    if value is None or value == 0:
        return
    if int(value) != actual:
        raise ValueError(f"{name}={value} disagrees with the array's row stride {actual}")


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


# ======================================================= the framework layers' ====
def _resolve_shift(shift, shift_seq_len, target_shape: tuple, rows: int) -> Tuple[int, int]:
    """(T, k) for the C options from the two spellings of the causal shift (fusedce.torch,
    fusedce.jax, fusedce.torch.distributed):

    * ``shift_seq_len=T`` alone (fusedce 0.2): k = 1;
    * ``shift=k`` (CCE's; True = 1) alone: T = the last dimension of target (a 1-D target is
      one sequence), as CCE's targets (..., T);
    * both: k within sequences of T rows; k < T (the library would ignore every row).
    k = 1 is passed as 0 (the C default, which means 1), so that a 0.2 library still runs it.
    Negative values and rows that are no whole number of sequences are the library's to reject.
    """
    t = int(shift_seq_len)
    k = int(shift)  # bool: True -> 1 (CCE)
    if k > 0:
        if not t:
            t = int(target_shape[-1]) if len(target_shape) else rows
        if t > 0 and k >= t:
            raise ValueError(f"shift must be in [0, {t}) (the sequence length), got {k}")
    return t, (0 if k == 1 else k)

