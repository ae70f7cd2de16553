"""fusedce.core: the three compute calls of libfusedce on arrays, with allocation.

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

Errors: what the library checks (option ranges, the shift, sizes, strides, alignment, the
workspace's size, overlapping buffers) it reports itself, naming the argument: the
:class:`fusedce.FusedCEError` subclass of its status carries that message. Checked here first is
what the C ABI cannot see: Python types, array shapes, dtypes, devices and contiguity.

Class-probability targets: :func:`forward`, :func:`backward` and :func:`linear_ce` take, in
place of class indices, a float array q [rows, vocab] (dense, the logits' dtype) as targets:
torch's ``F.cross_entropy(input, probabilities)``, label smoothing and class weights included;
every row is scored (ignore_index does not apply), 'mean' divides by rows; token_scaling, the
shift and the accuracy are refused by the library (docs/semantics.md rule 19).

Distillation: :func:`distill` (student logits against teacher logits, fce_distill) and
:func:`linear_distill` (student and teacher hidden states and weights, fce_linear_distill), in
_distill.py.

The modules behind this one: _distill.py (the distillation calls), _arrays.py (array
description, DLPack, the CUDA array interface, dtypes), _args.py (keywords to fce_options, the
checks the library cannot make), _alloc.py (outputs and workspaces), _streams.py (streams and
devices), _errors.py and _lib.py (statuses, exceptions, the loaded library).
"""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

import numpy as np

from . import _lib
from ._alloc import (_Alloc, _argmax_accuracy, _class_weights, _error_flags, _grad_logits,  # noqa: F401
                     _grad_output, _linear_grads, _loss_lse, _out, _ptr, _user_workspace,
                     _workspace, query_for)
from ._args import (REDUCTIONS, _backend_code, _build_options, _check_backend_kw,
                    _check_same_device, _check_stride_kw, _grad_set, _hidden_weight, _matrix,
                    _reduction_code, _target_dtype_code, _targets_code, _vector, _writable)
from ._arrays import (_CODE_NAMES, _FLOAT_CODES, _ITEMSIZE, _NP_BF16, _TARGET_CODES,  # noqa: F401
                      _Arr, _describe, _dtype_name, _float_code, _is_torch, _need_dtype)
from ._lib import FCE_FLAG_TARGET_OUT_OF_RANGE
from ._distill import (DistillResult, LinearDistillResult, distill,  # noqa: F401
                       distill_workspace_size, linear_distill, linear_distill_workspace_size)
from ._options import CEOptions
from ._streams import _call_stream, _device_of, _stream_int  # noqa: F401

__all__ = [
    "ForwardResult", "LinearCEResult", "forward", "backward", "linear_ce",
    "forward_workspace_size", "backward_workspace_size", "linear_ce_workspace_size",
    "check_error_flags", "float_to_bfloat16_bits", "bfloat16_bits_to_float", "REDUCTIONS",
    "DistillResult", "LinearDistillResult", "distill", "linear_distill",
    "distill_workspace_size", "linear_distill_workspace_size",
]




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



# ================================================================ error flags ====
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



# ================================================================ workspace sizes ====
def _query_options(opts: CEOptions, backend, dtype, target_dtype, class_weights, deterministic,
                   accumulate=False, grad_weight_fp32=False) -> _lib.Options:
    w_ptr = 0
    if class_weights is not None:
        w_ptr = _describe(class_weights, "class_weights").ptr
    return _build_options(
        opts, backend=_backend_code(backend),
        dtype=_FLOAT_CODES[_dtype_name(dtype) or "float32"],
        target_dtype=_target_dtype_code(target_dtype),
        class_weights_ptr=w_ptr, deterministic=deterministic, accumulate=accumulate,
        grad_weight_fp32=grad_weight_fp32)


def _ce_workspace_size(function, rows, vocab, opts: CEOptions, backend, dtype, target_dtype,
                       class_weights, deterministic) -> int:
    o = _query_options(opts, backend, dtype, target_dtype, class_weights, deterministic)
    out = ctypes.c_size_t(0)
    _lib.call(function, ctypes.byref(o), int(rows), int(vocab), ctypes.byref(out))
    return int(out.value)


def _ce_workspace_size_fn(call: str):
    """The public function of the workspace query ``call`` (fce_forward_workspace_size,
    fce_backward_workspace_size): the options as keywords, the bytes returned."""
    def workspace_size(rows: int, vocab: int, *, backend="cpu", dtype="float32",
                       target_dtype="int64", reduction="mean", ignore_index=-100,
                       class_weights=None, label_smoothing=0.0, z_loss_scale=0.0,
                       softcap=0.0, logit_scale=1.0, shift_seq_len=0,
                       deterministic=False, shift=0, token_scaling=False) -> int:
        opts = CEOptions.from_keywords(
            reduction=_reduction_code(reduction), ignore_index=ignore_index,
            label_smoothing=label_smoothing, z_loss_scale=z_loss_scale, softcap=softcap,
            logit_scale=logit_scale, shift_seq_len=shift_seq_len, shift=shift,
            token_scaling=token_scaling)
        return _ce_workspace_size(call, rows, vocab, opts, backend, dtype, target_dtype,
                                  class_weights, deterministic)

    name = call[len("fce_"):]
    workspace_size.__name__ = workspace_size.__qualname__ = name
    workspace_size.__doc__ = (f"{call}: scratch bytes {call[:-len('_workspace_size')]} needs "
                              "for these options.")
    return workspace_size


forward_workspace_size = _ce_workspace_size_fn("fce_forward_workspace_size")
backward_workspace_size = _ce_workspace_size_fn("fce_backward_workspace_size")


def linear_ce_workspace_size(rows: int, hidden: int, vocab: int, *, with_grad: bool = True,
                             backend="cpu", dtype="float32", target_dtype="int64",
                             reduction="mean", ignore_index=-100, class_weights=None,
                             label_smoothing=0.0, z_loss_scale=0.0, softcap=0.0,
                             logit_scale=1.0, shift_seq_len=0, deterministic=False,
                             accumulate=False, grad_weight_fp32=False, shift=0,
                             token_scaling=False):
    """fce_linear_ce_workspace_size: (min_bytes, optimal_bytes)."""
    opts = CEOptions.from_keywords(
        reduction=_reduction_code(reduction), ignore_index=ignore_index,
        label_smoothing=label_smoothing, z_loss_scale=z_loss_scale, softcap=softcap,
        logit_scale=logit_scale, shift_seq_len=shift_seq_len, shift=shift,
        token_scaling=token_scaling)
    o = _query_options(opts, backend, dtype, target_dtype, class_weights, deterministic,
                       accumulate, grad_weight_fp32)
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
    dtype_code = _float_code(z, _dtype_name(dtype), fn="fusedce.forward")
    rs = _matrix(z)
    _check_stride_kw(row_stride, rs, "row_stride")
    tcode = _targets_code(y, rows, target_dtype, vocab, dtype_code)
    opts = CEOptions.from_keywords(
        reduction=_reduction_code(reduction), ignore_index=ignore_index,
        label_smoothing=label_smoothing, z_loss_scale=z_loss_scale, softcap=softcap,
        logit_scale=logit_scale, shift_seq_len=shift_seq_len, shift=shift,
        token_scaling=token_scaling)
    w = _class_weights(class_weights, z, vocab)

    call_stream = _call_stream(s_explicit, [z, y, w]) if z.is_cuda else 0
    alloc = _Alloc(z, call_stream)

    with _device_of(z):
        # outputs
        loss, la, lse, lse_a = _loss_lse(alloc, z, rows, opts.per_row, loss, lse, return_lse)
        zl_a = None
        if z_loss is None and return_z_loss:
            z_loss = alloc.empty((), "float32", "z_loss")
        if z_loss is not None:
            zl_a = _out(z_loss, "z_loss", z, "float32")
            _vector(zl_a, 1, "()", allow_scalar=True)
        argmax, am_a, accuracy, acc_a = _argmax_accuracy(
            argmax, return_argmax, accuracy, return_accuracy, alloc, z, rows, opts.reduction)
        grad_logits, g_a, grs = _grad_logits(
            alloc, logits, z, rs, _CODE_NAMES[dtype_code], in_place=in_place,
            grad_logits=grad_logits, return_grad=return_grad, grad_row_stride=grad_row_stride)
        go_ptr, go_keep = (_grad_output(grad_output, alloc, z, rows, opts.per_row)
                           if g_a is not None else (0, None))
        flags, flags_ptr = _error_flags(error_flags, alloc, z)

        o = _build_options(
            opts, backend=backend_code, dtype=dtype_code, target_dtype=tcode,
            class_weights_ptr=_ptr(w), deterministic=deterministic, row_stride=rs,
            grad_row_stride=grs if g_a is not None else 0)
        need = ctypes.c_size_t(0)
        query_for("fce_forward", "fce_forward_workspace_size", ctypes.byref(o), rows, vocab,
                  ctypes.byref(need))
        if workspace is None:
            ws_ptr, ws_bytes, ws_keep = alloc.workspace(int(need.value))
        else:
            ws_ptr, ws_bytes, ws_keep = _user_workspace(workspace, z)
        out = _lib.outputs(loss=la.ptr, lse=_ptr(lse_a), z_loss=_ptr(zl_a), argmax=_ptr(am_a),
                           accuracy=_ptr(acc_a), error_flags=flags_ptr)
        grads = _lib.gradients(grad_output=go_ptr, grad_logits=_ptr(g_a))
        _lib.call("fce_forward", ctypes.byref(o), rows, vocab, z.ptr, y.ptr, ctypes.byref(out),
                  ctypes.byref(grads), ws_ptr, ws_bytes, call_stream)
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
    dtype_code = _float_code(z, _dtype_name(dtype), fn="fusedce.backward")
    rs = _matrix(z)
    _check_stride_kw(row_stride, rs, "row_stride")
    tcode = _targets_code(y, rows, target_dtype, vocab, dtype_code)
    _need_dtype(l, "float32")
    _vector(l, rows, "[rows]")
    opts = CEOptions.from_keywords(
        reduction=_reduction_code(reduction), ignore_index=ignore_index,
        label_smoothing=label_smoothing, z_loss_scale=z_loss_scale, softcap=softcap,
        logit_scale=logit_scale, shift_seq_len=shift_seq_len, shift=shift,
        token_scaling=token_scaling)
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
        go_ptr, go_keep = _grad_output(grad_output, alloc, z, rows, opts.per_row)
        flags_ptr = 0
        if error_flags is not None and error_flags is not False:
            _, flags_ptr = _error_flags(error_flags, alloc, z)
        o = _build_options(
            opts, backend=backend_code, dtype=dtype_code, target_dtype=tcode,
            class_weights_ptr=_ptr(w), deterministic=deterministic, row_stride=rs,
            grad_row_stride=grs)
        need = ctypes.c_size_t(0)
        query_for("fce_backward", "fce_backward_workspace_size", ctypes.byref(o), rows, vocab,
                  ctypes.byref(need))
        if workspace is None:
            ws_ptr, ws_bytes, ws_keep = alloc.workspace(int(need.value))
        else:
            ws_ptr, ws_bytes, ws_keep = _user_workspace(workspace, z)
        out = _lib.outputs(error_flags=flags_ptr)
        grads = _lib.gradients(grad_output=go_ptr, grad_logits=g_a.ptr)
        _lib.call("fce_backward", ctypes.byref(o), rows, vocab, z.ptr, y.ptr, l.ptr,
                  ctypes.byref(out), ctypes.byref(grads), ws_ptr, ws_bytes, call_stream)
        del ws_keep, go_keep
    return grad_logits


# ==================================================================== linear_ce ====
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
    rows, dim, vocab = _hidden_weight(h, W)
    dkw = _dtype_name(dtype)
    dtype_code = _float_code(h, dkw, fn="fusedce.linear_ce")
    dname = _CODE_NAMES[dtype_code]
    _float_code(W, dname, "the hidden states' dtype", fn="fusedce.linear_ce")
    hrs = _matrix(h, what="[rows, hidden]")
    _check_stride_kw(hidden_row_stride, hrs, "hidden_row_stride")
    _matrix(W, cols=dim, dense=True, what="[vocab, hidden]")
    if b is not None:
        _float_code(b, dname, "the hidden states' dtype", fn="fusedce.linear_ce")
        _vector(b, vocab, "[vocab]")
    tcode = _targets_code(y, rows, target_dtype, vocab, dtype_code)
    opts = CEOptions.from_keywords(
        reduction=_reduction_code(reduction), ignore_index=ignore_index,
        label_smoothing=label_smoothing, z_loss_scale=z_loss_scale, softcap=softcap,
        logit_scale=logit_scale, shift_seq_len=shift_seq_len, shift=shift,
        token_scaling=token_scaling)
    w = _class_weights(class_weights, h, vocab)
    grads = _grad_set(return_grad, b is not None)
    gdtype = "float32" if grad_weight_fp32 else dname

    call_stream = _call_stream(s_explicit, [h, W, y, b, w]) if h.is_cuda else 0
    alloc = _Alloc(h, call_stream)
    with _device_of(h):
        loss, la, lse, lse_a = _loss_lse(alloc, h, rows, opts.per_row, loss, lse, return_lse)
        zl_a = None
        if z_loss is None and return_z_loss:
            z_loss = alloc.empty((), "float32", "z_loss")
        if z_loss is not None:
            zl_a = _out(z_loss, "z_loss", h, "float32")
            _vector(zl_a, 1, "()", allow_scalar=True)
        argmax, am_a, accuracy, acc_a = _argmax_accuracy(
            argmax, return_argmax, accuracy, return_accuracy, alloc, h, rows, opts.reduction)

        (grad_hidden, grad_weight, grad_bias), (gh_a, gw_a, gb_a) = _linear_grads(
            alloc, h, W, b, grads, grad_hidden, grad_weight, grad_bias, rows=rows, dim=dim,
            vocab=vocab, gh_dtype=dname, gh_like=h, gh_what="the hidden states' dtype",
            grad_weight_fp32=grad_weight_fp32, wdtype=gdtype, accumulate=accumulate,
            vocab_name="vocab")
        with_grad = any(a is not None for a in (gh_a, gw_a, gb_a))
        go_ptr, go_keep = (_grad_output(grad_output, alloc, h, rows, opts.per_row)
                           if with_grad else (0, None))
        flags, flags_ptr = _error_flags(error_flags, alloc, h)
        o = _build_options(
            opts, backend=backend_code, dtype=dtype_code, target_dtype=tcode,
            class_weights_ptr=_ptr(w), deterministic=deterministic, hidden_row_stride=hrs,
            accumulate=accumulate, grad_weight_fp32=grad_weight_fp32)
        lo, hi = ctypes.c_size_t(0), ctypes.c_size_t(0)
        query_for("fce_linear_ce", "fce_linear_ce_workspace_size", ctypes.byref(o), rows, dim,
                  vocab, 1 if with_grad else 0, ctypes.byref(lo), ctypes.byref(hi))
        ws_ptr, ws_bytes, ws_keep = _workspace(workspace, alloc, h, int(lo.value), int(hi.value),
                                               workspace_size)
        out = _lib.outputs(loss=la.ptr, lse=_ptr(lse_a), z_loss=_ptr(zl_a), argmax=_ptr(am_a),
                           accuracy=_ptr(acc_a), error_flags=flags_ptr)
        grads = _lib.gradients(grad_output=go_ptr, grad_hidden=_ptr(gh_a),
                               grad_weight=_ptr(gw_a), grad_bias=_ptr(gb_a))
        _lib.call("fce_linear_ce", ctypes.byref(o), rows, dim, vocab, h.ptr, W.ptr, _ptr(b),
                  y.ptr, ctypes.byref(out), ctypes.byref(grads), ws_ptr, ws_bytes, call_stream)
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

