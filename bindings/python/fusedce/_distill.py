"""fusedce.core's distillation calls on arrays: fce_distill and fce_linear_distill (and their
workspace queries), with allocation, as the cross-entropy calls of fusedce.core (the arrays,
streams and errors of its docstring). Re-exported by fusedce.core; nothing here imports it.

The divergence per row (docs/semantics.md rule 20), with the student's logits a and the
teacher's t both put through logit_scale and softcap, divided by the temperature T:
p = softmax(a / T) (student), q = softmax(t / T) (teacher);
'forward_kl' KL(q || p), 'reverse_kl' KL(p || q), 'jsd' Liger's generalised JSD(beta)
(beta KL(q || m) + (1 - beta) KL(p || m), m = beta q + (1 - beta) p; KL(q || p) at beta 0,
KL(p || q) at beta 1). No T^2 factor. Rows whose target equals ignore_index are not counted
(targets None: every row counts); 'mean' divides by the rows counted. The gradients are the
student's only.
"""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

from . import _lib
from ._alloc import (_Alloc, _grad_logits, _grad_output, _linear_grads, _loss_lse, _ptr,
                     _user_workspace, _workspace, query_for)
from ._args import (_backend_code, _build_options, _build_teacher, _check_backend_kw,
                    _check_same_device, _check_stride_kw, _grad_set, _hidden_weight, _matrix,
                    _reduction_code, _target_dtype_code, _targets_code)
from ._arrays import _CODE_NAMES, _FLOAT_CODES, _describe, _dtype_name, _float_code
from ._options import DistillOptions
from ._streams import _call_stream, _device_of, _stream_int

__all__ = ["DistillResult", "LinearDistillResult", "distill", "linear_distill",
           "distill_workspace_size", "linear_distill_workspace_size"]


class DistillResult(NamedTuple):
    """What :func:`distill` returns; entries not asked for are None."""

    loss: Any         # float32: () for mean/sum, [rows] for none (0 for rows not counted)
    lse: Any          # float32 [rows]: the student's log-sum-exp of a / T, every row
    grad_logits: Any  # [rows, vocab] of the logits' dtype: the student's gradient


class LinearDistillResult(NamedTuple):
    """What :func:`linear_distill` returns; entries not asked for are None."""

    loss: Any
    lse: Any
    grad_hidden: Any  # [rows, hidden] of the hidden states' dtype
    grad_weight: Any  # [vocab, hidden] of the weight's dtype (float32 with grad_weight_fp32)


def _opts(reduction, divergence, beta, temperature, ignore_index, softcap, logit_scale):
    return DistillOptions.from_keywords(
        reduction=_reduction_code(reduction), divergence=divergence, beta=beta,
        temperature=temperature, ignore_index=ignore_index, softcap=softcap,
        logit_scale=logit_scale)


def _query_options(opts: DistillOptions, backend, dtype, target_dtype, **fields):
    return _build_options(opts.ce(), backend=_backend_code(backend),
                          dtype=_FLOAT_CODES[_dtype_name(dtype) or "float32"],
                          target_dtype=_target_dtype_code(target_dtype), **fields)


def _targets(targets, rows: int, target_dtype, s_explicit):
    """(the _Arr of the targets or None, their fce_dtype): class indices [rows] (int32/int64)
    whose ignore_index rows are not counted; None counts every row."""
    if targets is None:
        return None, _target_dtype_code(target_dtype)
    y = _describe(targets, "targets", s_explicit)
    return y, _targets_code(y, rows, target_dtype)


# ============================================================== workspace sizes ====
def distill_workspace_size(rows: int, vocab: int, *, divergence="forward_kl", beta=0.5,
                           temperature=1.0, backend="cpu", dtype="float32",
                           target_dtype="int64", reduction="mean", ignore_index=-100,
                           softcap=0.0, logit_scale=1.0) -> int:
    """fce_distill_workspace_size: scratch bytes :func:`distill` needs for these options."""
    opts = _opts(reduction, divergence, beta, temperature, ignore_index, softcap, logit_scale)
    o = _query_options(opts, backend, dtype, target_dtype)
    t = _build_teacher(opts)
    out = ctypes.c_size_t(0)
    _lib.call("fce_distill_workspace_size", ctypes.byref(o), ctypes.byref(t), int(rows),
              int(vocab), ctypes.byref(out))
    return int(out.value)


def linear_distill_workspace_size(rows: int, hidden: int, vocab: int, teacher_hidden: int, *,
                                  with_grad: bool = True, divergence="forward_kl", beta=0.5,
                                  temperature=1.0, backend="cpu", dtype="float32",
                                  target_dtype="int64", reduction="mean", ignore_index=-100,
                                  softcap=0.0, logit_scale=1.0, accumulate=False,
                                  grad_weight_fp32=False):
    """fce_linear_distill_workspace_size: (min_bytes, optimal_bytes)."""
    opts = _opts(reduction, divergence, beta, temperature, ignore_index, softcap, logit_scale)
    o = _query_options(opts, backend, dtype, target_dtype, accumulate=accumulate,
                       grad_weight_fp32=grad_weight_fp32)
    t = _build_teacher(opts, hidden=int(teacher_hidden))
    lo, hi = ctypes.c_size_t(0), ctypes.c_size_t(0)
    _lib.call("fce_linear_distill_workspace_size", ctypes.byref(o), ctypes.byref(t), int(rows),
              int(hidden), int(vocab), 1 if with_grad else 0, ctypes.byref(lo),
              ctypes.byref(hi))
    return int(lo.value), int(hi.value)


# ====================================================================== distill ====
def distill(logits, teacher_logits, targets=None, *, divergence="forward_kl", beta: float = 0.5,
            temperature: float = 1.0, reduction="mean", ignore_index: int = -100,
            softcap: float = 0.0, logit_scale: float = 1.0, dtype=None, target_dtype=None,
            backend=None, row_stride=None, grad_row_stride=None, return_lse: bool = False,
            return_grad: bool = False, in_place: bool = False, grad_output=None, loss=None,
            lse=None, grad_logits=None, workspace=None, stream=None) -> DistillResult:
    """The divergence between the student's logits [rows, vocab] and the teacher's
    teacher_logits [rows, vocab] (same dtype; any row stride with a contiguous last dimension)
    per row (fce_distill; the module's docstring says which). ``targets`` (int32/int64 [rows],
    optional): rows whose target equals ``ignore_index`` are not counted. ``return_grad`` (or a
    ``grad_logits=`` buffer, or ``in_place=True`` to write it over the logits) also writes the
    student's gradient, scaled by ``grad_output`` (a float, or float32 () / [rows] for 'none';
    default 1). ``return_lse``: the student's log-sum-exp of a / T per row."""
    s_explicit = _stream_int(stream)
    z = _describe(logits, "logits", s_explicit)
    t = _describe(teacher_logits, "teacher_logits", s_explicit)
    if len(z.shape) != 2:
        raise ValueError(f"logits must be 2-D [rows, vocab], got shape {z.shape}")
    rows, vocab = z.shape
    y, tcode = _targets(targets, rows, target_dtype, s_explicit)
    _check_same_device(z, t, y)
    backend_code = _check_backend_kw(z, backend)
    dtype_code = _float_code(z, _dtype_name(dtype), fn="fusedce.distill")
    _float_code(t, _CODE_NAMES[dtype_code], "the logits' dtype", fn="fusedce.distill")
    rs = _matrix(z)
    _check_stride_kw(row_stride, rs, "row_stride")
    trs = _matrix(t, rows, vocab)
    opts = _opts(reduction, divergence, beta, temperature, ignore_index, softcap, logit_scale)

    call_stream = _call_stream(s_explicit, [z, t, y]) if z.is_cuda else 0
    alloc = _Alloc(z, call_stream)
    with _device_of(z):
        loss, la, lse, lse_a = _loss_lse(alloc, z, rows, opts.per_row, loss, lse, return_lse)
        grad_logits, g_a, grs = _grad_logits(
            alloc, logits, z, rs, _CODE_NAMES[dtype_code], in_place=in_place,
            grad_logits=grad_logits, return_grad=return_grad, grad_row_stride=grad_row_stride)
        go_ptr, go_keep = (_grad_output(grad_output, alloc, z, rows, opts.per_row)
                           if g_a is not None else (0, None))
        o = _build_options(opts.ce(), backend=backend_code, dtype=dtype_code, target_dtype=tcode,
                           row_stride=rs, grad_row_stride=grs)
        teacher = _build_teacher(opts, logits=t.ptr, row_stride=trs)
        need = ctypes.c_size_t(0)
        query_for("fce_distill", "fce_distill_workspace_size", ctypes.byref(o),
                  ctypes.byref(teacher), rows, vocab, ctypes.byref(need))
        if workspace is None:
            ws_ptr, ws_bytes, ws_keep = alloc.workspace(int(need.value))
        else:
            ws_ptr, ws_bytes, ws_keep = _user_workspace(workspace, z)
        out = _lib.outputs(loss=la.ptr, lse=_ptr(lse_a))
        grads = _lib.gradients(grad_output=go_ptr, grad_logits=_ptr(g_a))
        _lib.call("fce_distill", ctypes.byref(o), ctypes.byref(teacher), rows, vocab, z.ptr,
                  _ptr(y), ctypes.byref(out), ctypes.byref(grads), ws_ptr, ws_bytes,
                  call_stream)
        del ws_keep, go_keep
    return DistillResult(loss, lse, grad_logits)


# =============================================================== linear_distill ====
def linear_distill(hidden, weight, teacher_hidden, teacher_weight, targets=None, *,
                   divergence="forward_kl", beta: float = 0.5, temperature: float = 1.0,
                   reduction="mean", ignore_index: int = -100, softcap: float = 0.0,
                   logit_scale: float = 1.0, dtype=None, target_dtype=None, backend=None,
                   hidden_row_stride=None, accumulate: bool = False,
                   grad_weight_fp32: bool = False, return_lse: bool = False, return_grad=False,
                   grad_output=None, loss=None, lse=None, grad_hidden=None, grad_weight=None,
                   workspace=None, workspace_size="optimal",
                   stream=None) -> LinearDistillResult:
    """:func:`distill` of the student's hidden [rows, D] · weightᵀ (weight [V, D]) against the
    teacher's teacher_hidden [rows, D'] · teacher_weightᵀ (teacher_weight [V, D']), no bias,
    all of one dtype, without either logits ever held whole (fce_linear_distill).

    ``return_grad`` (True, or a subset of ('hidden', 'weight')) or gradient buffers
    (``grad_hidden=``, ``grad_weight=``) ask for the student's gradients, scaled by
    ``grad_output`` (default 1); the teacher gets none. ``accumulate``, ``grad_weight_fp32``,
    ``workspace_size``: as for :func:`fusedce.core.linear_ce`."""
    s_explicit = _stream_int(stream)
    h = _describe(hidden, "hidden", s_explicit)
    W = _describe(weight, "weight", s_explicit)
    th = _describe(teacher_hidden, "teacher_hidden", s_explicit)
    tW = _describe(teacher_weight, "teacher_weight", s_explicit)
    rows, dim, vocab = _hidden_weight(h, W)
    _, tdim, _ = _hidden_weight(th, tW)
    y, tcode = _targets(targets, rows, target_dtype, s_explicit)
    _check_same_device(h, W, th, tW, y)
    backend_code = _check_backend_kw(h, backend)
    dtype_code = _float_code(h, _dtype_name(dtype), fn="fusedce.linear_distill")
    dname = _CODE_NAMES[dtype_code]
    for a in (W, th, tW):
        _float_code(a, dname, "the hidden states' dtype", fn="fusedce.linear_distill")
    hrs = _matrix(h, what="[rows, hidden]")
    _check_stride_kw(hidden_row_stride, hrs, "hidden_row_stride")
    _matrix(W, cols=dim, dense=True, what="[vocab, hidden]")
    thrs = _matrix(th, rows, what="[rows, teacher hidden]")
    _matrix(tW, vocab, tdim, dense=True, what="[vocab, teacher hidden]")
    opts = _opts(reduction, divergence, beta, temperature, ignore_index, softcap, logit_scale)
    grads = _grad_set(return_grad, False)
    gdtype = "float32" if grad_weight_fp32 else dname

    call_stream = _call_stream(s_explicit, [h, W, th, tW, y]) if h.is_cuda else 0
    alloc = _Alloc(h, call_stream)
    with _device_of(h):
        loss, la, lse, lse_a = _loss_lse(alloc, h, rows, opts.per_row, loss, lse, return_lse)
        (grad_hidden, grad_weight, _), (gh_a, gw_a, _) = _linear_grads(
            alloc, h, W, None, grads, grad_hidden, grad_weight, None, rows=rows, dim=dim,
            vocab=vocab, gh_dtype=dname, gh_like=h, gh_what="the hidden states' dtype",
            grad_weight_fp32=grad_weight_fp32, wdtype=gdtype, accumulate=accumulate,
            vocab_name="vocab")
        with_grad = gh_a is not None or gw_a is not None
        go_ptr, go_keep = (_grad_output(grad_output, alloc, h, rows, opts.per_row)
                           if with_grad else (0, None))
        o = _build_options(opts.ce(), backend=backend_code, dtype=dtype_code, target_dtype=tcode,
                           hidden_row_stride=hrs, accumulate=accumulate,
                           grad_weight_fp32=grad_weight_fp32)
        teacher = _build_teacher(opts, hidden_states=th.ptr, weight=tW.ptr, hidden=tdim,
                                 hidden_row_stride=thrs)
        lo, hi = ctypes.c_size_t(0), ctypes.c_size_t(0)
        query_for("fce_linear_distill", "fce_linear_distill_workspace_size", ctypes.byref(o),
                  ctypes.byref(teacher), rows, dim, vocab, 1 if with_grad else 0,
                  ctypes.byref(lo), ctypes.byref(hi))
        ws_ptr, ws_bytes, ws_keep = _workspace(workspace, alloc, h, int(lo.value), int(hi.value),
                                               workspace_size)
        out = _lib.outputs(loss=la.ptr, lse=_ptr(lse_a))
        grads = _lib.gradients(grad_output=go_ptr, grad_hidden=_ptr(gh_a),
                               grad_weight=_ptr(gw_a))
        _lib.call("fce_linear_distill", ctypes.byref(o), ctypes.byref(teacher), rows, dim,
                  vocab, h.ptr, W.ptr, _ptr(y), ctypes.byref(out), ctypes.byref(grads), ws_ptr,
                  ws_bytes, call_stream)
        del ws_keep, go_keep
    return LinearDistillResult(loss, lse, grad_hidden, grad_weight)
