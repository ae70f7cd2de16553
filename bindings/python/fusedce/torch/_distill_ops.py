"""The distillation ops of fusedce.torch: direct C calls of fce_distill and fce_linear_distill on
torch tensors, and the ``torch.library.custom_op`` operators over them (``register_fake`` and
``register_autograd``: eager mode and ``torch.compile`` run the same ops). The public functions
are in _distill.py.

How the gradient is computed: for reduction 'mean' and 'sum' the forward writes the student's
gradients (of the logits; of hidden and weight) in the same call as the loss, for an upstream
gradient of 1, and the backward scales them in place (``fce_scale_gradient``: nothing to do
for 1, exact for ±2^k); for 'none' the forward computes the loss only and the backward calls
the library again with the per-row upstream gradient. The teacher gets no gradient.

The options travel as one :class:`fusedce._options.DistillOptions`, flattened at an op boundary
by ``as_op_args`` (reduction, ignore_index, divergence, beta, temperature, softcap,
logit_scale, in that order) and rebuilt by ``DistillOptions.from_op_args``.
"""

from __future__ import annotations

import ctypes
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .. import _alloc, _args, _lib
from .._options import N_DISTILL_OP_ARGS, DistillOptions
from . import _calls as _tc
from ._ops import _f32, _scale_


# ============================================================== direct C calls ====
def _targets_code(targets: Optional[Tensor]) -> int:
    return _tc._CODE[targets.dtype] if targets is not None else _lib.FCE_INT64


def _loss(n: int, opts: DistillOptions, like: Tensor) -> Tensor:
    return torch.empty((n,) if opts.per_row else (), dtype=torch.float32, device=like.device)


def distill(logits: Tensor, teacher: Tensor, targets: Optional[Tensor],
            grad_output: Optional[Tensor], opts: DistillOptions,
            need_grad: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """fce_distill: (loss, the student's dense [N, V] gradient or None). logits and teacher
    [N, V] of one dtype with last stride 1, targets [N] int32/int64 or None, grad_output
    float32 (None = 1)."""
    n, v = logits.shape
    _, o = _tc.options(_tc._backend(logits), _tc._CODE[logits.dtype], _targets_code(targets),
                       opts.ce())
    o.row_stride = logits.stride(0) if n > 1 else v
    t = _args._build_teacher(opts, logits=teacher.data_ptr(),
                             row_stride=teacher.stride(0) if n > 1 else v)
    lib = _lib.load()
    size = ctypes.c_size_t()
    _alloc.check_query(lib.fce_distill_workspace_size(ctypes.byref(o), ctypes.byref(t), n, v,
                                                      ctypes.byref(size)),
                       "fce_distill_workspace_size", "fce_distill")
    ws = _tc._workspace(size.value, logits)
    loss = _loss(n, opts, logits)
    grad = torch.empty((n, v), dtype=logits.dtype, device=logits.device) if need_grad else None
    out = _lib.outputs(loss=loss.data_ptr())
    grads = _lib.gradients(grad_output=_tc._ptr(grad_output), grad_logits=_tc._ptr(grad))
    _tc._check(lib.fce_distill(ctypes.byref(o), ctypes.byref(t), n, v, logits.data_ptr(),
                               _tc._ptr(targets), ctypes.byref(out), ctypes.byref(grads),
                               _tc._ptr(ws), size.value, _tc._stream(logits)), "fce_distill")
    return loss, grad


_SIZES: Dict[tuple, Tuple[int, int]] = {}


def linear_distill(hidden: Tensor, weight: Tensor, teacher_hidden: Tensor,
                   teacher_weight: Tensor, targets: Optional[Tensor],
                   grad_output: Optional[Tensor], opts: DistillOptions, *,
                   grad_weight_fp32: bool, need: Tuple[bool, bool],
                   workspace_bytes: int) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """fce_linear_distill: (loss, grad_hidden, grad_weight), the gradients asked for in
    ``need`` (None for the others), scaled by grad_output (None = 1). hidden [N, D] and
    teacher_hidden [N, D'] with last stride 1, weight [V, D] and teacher_weight [V, D'] dense,
    all of one dtype. The workspace: the full-speed size within ``workspace_bytes``, never
    below the library's minimum."""
    n, d = hidden.shape
    v, td = weight.shape[0], teacher_hidden.shape[1]
    key, o = _tc.options(_tc._backend(hidden), _tc._CODE[hidden.dtype], _targets_code(targets),
                         opts.ce(), grad_weight_fp32=grad_weight_fp32)
    o.hidden_row_stride = hidden.stride(0) if n > 1 else d
    t = _args._build_teacher(opts, hidden_states=teacher_hidden.data_ptr(),
                             weight=teacher_weight.data_ptr(), hidden=td,
                             hidden_row_stride=teacher_hidden.stride(0) if n > 1 else td)
    with_grad = any(need)
    lib = _lib.load()
    skey = (key, n, d, v, td, with_grad)
    sizes = _SIZES.get(skey)
    if sizes is None:
        lo, hi = ctypes.c_size_t(), ctypes.c_size_t()
        _alloc.check_query(lib.fce_linear_distill_workspace_size(
            ctypes.byref(o), ctypes.byref(t), n, d, v, int(with_grad), ctypes.byref(lo),
            ctypes.byref(hi)), "fce_linear_distill_workspace_size", "fce_linear_distill")
        if len(_SIZES) > 1024:
            _SIZES.clear()
        sizes = _SIZES[skey] = (lo.value, hi.value)
    ws_bytes = max(sizes[0], min(sizes[1], max(0, workspace_bytes - 8 * n - 4096)))
    if (need[1] and not grad_weight_fp32 and hidden.dtype != torch.float32 and hidden.is_cuda
            and ws_bytes < sizes[1]):
        # CUDA refuses a 16-bit grad_weight below the token-chunk plan's workspace: accumulate
        # it in float32 (within the budget) and round once at the end
        loss, gh, gw = linear_distill(hidden, weight, teacher_hidden, teacher_weight, targets,
                                      grad_output, opts, grad_weight_fp32=True, need=need,
                                      workspace_bytes=workspace_bytes)
        return loss, gh, gw.to(hidden.dtype)
    dev = hidden.device
    loss = _loss(n, opts, hidden)
    gh = torch.empty((n, d), dtype=hidden.dtype, device=dev) if need[0] else None
    gw = (torch.empty((v, d), dtype=torch.float32 if grad_weight_fp32 else hidden.dtype,
                      device=dev) if need[1] else None)
    ws = _tc._workspace(ws_bytes, hidden)
    out = _lib.outputs(loss=loss.data_ptr())
    grads = _lib.gradients(grad_output=_tc._ptr(grad_output), grad_hidden=_tc._ptr(gh),
                           grad_weight=_tc._ptr(gw))
    _tc._check(lib.fce_linear_distill(
        ctypes.byref(o), ctypes.byref(t), n, d, v, hidden.data_ptr(), weight.data_ptr(),
        _tc._ptr(targets), ctypes.byref(out), ctypes.byref(grads), _tc._ptr(ws), ws_bytes,
        _tc._stream(hidden)), "fce_linear_distill")
    return loss, gh, gw


def _upstream(grad_loss: Tensor, opts: DistillOptions, n: int, like: Tensor) -> Tensor:
    """The loss's upstream gradient as the C calls take it (float32, dense; zeros where the
    loss got none)."""
    if grad_loss is None:
        return torch.zeros((n,) if opts.per_row else (), dtype=torch.float32, device=like.device)
    return _f32(grad_loss)


# ============================================================= fce_distill op ====
@torch.library.custom_op("fusedce::distill", mutates_args=())
def _distill(logits: Tensor, teacher: Tensor, targets: Optional[Tensor],
             grad_output: Optional[Tensor], reduction: int, ignore_index: int, divergence: int,
             beta: float, temperature: float, softcap: float, logit_scale: float,
             need_grad: bool) -> Tuple[Tensor, Tensor]:
    """(loss, the student's gradient [N, V] for grad_output (None = 1), or an empty [0] tensor
    without need_grad)."""
    loss, grad = distill(
        logits, teacher, targets, grad_output,
        DistillOptions.from_op_args(reduction, ignore_index, divergence, beta, temperature,
                                    softcap, logit_scale), need_grad)
    return loss, grad if grad is not None else logits.new_empty((0,))


@_distill.register_fake
def _distill_fake(logits, teacher, targets, grad_output, reduction, ignore_index, divergence,
                  beta, temperature, softcap, logit_scale, need_grad):
    n = logits.shape[0]
    loss = logits.new_empty((n,) if reduction == _lib.FCE_REDUCTION_NONE else (),
                            dtype=torch.float32)
    return loss, logits.new_empty(logits.shape) if need_grad else logits.new_empty((0,))


_DISTILL_INPUTS = 4 + N_DISTILL_OP_ARGS + 1


def _distill_setup(ctx, inputs, output):
    logits, teacher, targets, grad_output = inputs[:4]
    opts = DistillOptions.from_op_args(*inputs[4:4 + N_DISTILL_OP_ARGS])
    need_grad = inputs[4 + N_DISTILL_OP_ARGS]
    _, grad = output
    ctx.mark_non_differentiable(grad)
    ctx.set_materialize_grads(False)
    # the forward's gradient (upstream 1) is scaled in place by the first backward; else, and
    # for a second backward, computed again from the logits (kept by reference)
    ctx.grad = grad if (need_grad and not opts.per_row and grad_output is None) else None
    ctx.options = opts
    ctx.save_for_backward(logits, teacher, targets)


def _distill_backward(ctx, grad_loss, _grad):
    nones = (None,) * (_DISTILL_INPUTS - 1)
    if grad_loss is None or not ctx.needs_input_grad[0]:
        return (None,) + nones
    logits, teacher, targets = ctx.saved_tensors
    if ctx.grad is not None:
        grad, ctx.grad = ctx.grad, None
        _scale_(grad, grad_loss)
    else:
        grad = _distill(logits, teacher, targets, _upstream(grad_loss, ctx.options,
                                                            logits.shape[0], logits),
                        *ctx.options.as_op_args(), True)[1]
    return (grad,) + nones


_distill.register_autograd(_distill_backward, setup_context=_distill_setup)


# ====================================================== fce_linear_distill op ====
@torch.library.custom_op("fusedce::linear_distill", mutates_args=())
def _linear_distill(hidden: Tensor, weight: Tensor, teacher_hidden: Tensor,
                    teacher_weight: Tensor, targets: Optional[Tensor],
                    grad_output: Optional[Tensor], reduction: int, ignore_index: int,
                    divergence: int, beta: float, temperature: float, softcap: float,
                    logit_scale: float, compute_dtype: int, workspace_bytes: int,
                    need_hidden: bool, need_weight: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(loss, grad_hidden, grad_weight) for grad_output (None = 1), an empty [0] tensor for a
    gradient not asked for. Every input is cast to compute_dtype (an fce_dtype code) inside;
    a float32 weight computed in a lower precision gets its gradient in float32 directly."""
    cdt = _tc.TORCH_OF_CODE[compute_dtype]

    def rows(t):
        t = t.to(cdt)
        return t if t.stride(-1) == 1 else t.contiguous()

    fp32_grads = weight.dtype == torch.float32 and cdt != torch.float32
    loss, gh, gw = linear_distill(
        rows(hidden), weight.to(cdt).contiguous(), rows(teacher_hidden),
        teacher_weight.to(cdt).contiguous(),
        targets.contiguous() if targets is not None else None,
        _f32(grad_output) if grad_output is not None else None,
        DistillOptions.from_op_args(reduction, ignore_index, divergence, beta, temperature,
                                    softcap, logit_scale),
        grad_weight_fp32=fp32_grads, need=(need_hidden, need_weight),
        workspace_bytes=int(workspace_bytes))
    gh = gh.to(hidden.dtype) if gh is not None else hidden.new_empty((0,))
    gw = gw.to(weight.dtype) if gw is not None else weight.new_empty((0,))
    return loss, gh, gw


@_linear_distill.register_fake
def _linear_distill_fake(hidden, weight, teacher_hidden, teacher_weight, targets, grad_output,
                         reduction, ignore_index, divergence, beta, temperature, softcap,
                         logit_scale, compute_dtype, workspace_bytes, need_hidden, need_weight):
    n = hidden.shape[0]
    loss = hidden.new_empty((n,) if reduction == _lib.FCE_REDUCTION_NONE else (),
                            dtype=torch.float32)
    gh = hidden.new_empty(hidden.shape) if need_hidden else hidden.new_empty((0,))
    gw = weight.new_empty(weight.shape) if need_weight else weight.new_empty((0,))
    return loss, gh, gw


_LINEAR_DISTILL_INPUTS = 6 + N_DISTILL_OP_ARGS + 4


def _linear_distill_setup(ctx, inputs, output):
    hidden, weight, teacher_hidden, teacher_weight, targets, grad_output = inputs[:6]
    opts = DistillOptions.from_op_args(*inputs[6:6 + N_DISTILL_OP_ARGS])
    compute_dtype, workspace_bytes, need_hidden, need_weight = inputs[6 + N_DISTILL_OP_ARGS:]
    _, gh, gw = output
    ctx.mark_non_differentiable(gh, gw)
    ctx.set_materialize_grads(False)
    ctx.grad_in_forward = ((need_hidden or need_weight) and not opts.per_row
                           and grad_output is None)
    ctx.computed = (bool(need_hidden), bool(need_weight))
    ctx.grads = (gh, gw)
    ctx.options, ctx.compute_dtype, ctx.workspace_bytes = opts, compute_dtype, workspace_bytes
    ctx.save_for_backward(hidden, weight, teacher_hidden, teacher_weight, targets)


def _linear_distill_backward(ctx, grad_loss, _gh, _gw):
    nones = (None,) * (_LINEAR_DISTILL_INPUTS - 2)
    need = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]))
    if grad_loss is None or not any(need):
        return (None, None) + nones
    if (ctx.grad_in_forward and ctx.grads is not None
            and all(c or not n for c, n in zip(ctx.computed, need))):
        out = [g if n else None for g, n in zip(ctx.grads, need)]
        for g in out:
            if g is not None:
                _scale_(g, grad_loss)
        ctx.grads = None  # handed out: a later backward recomputes
    else:
        hidden, weight, teacher_hidden, teacher_weight, targets = ctx.saved_tensors
        gh, gw = _linear_distill(
            hidden, weight, teacher_hidden, teacher_weight, targets,
            _upstream(grad_loss, ctx.options, hidden.shape[0], hidden),
            *ctx.options.as_op_args(), ctx.compute_dtype, ctx.workspace_bytes, *need)[1:]
        out = [g if n else None for g, n in zip((gh, gw), need)]
    return tuple(out) + nones


_linear_distill.register_autograd(_linear_distill_backward,
                                  setup_context=_linear_distill_setup)
