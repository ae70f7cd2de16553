"""fusedce.torch: fused cross-entropy for torch, with autograd and torch.compile support.

    from fusedce.torch import cross_entropy, linear_cross_entropy
    loss = cross_entropy(logits, targets)                        # like F.cross_entropy
    loss = linear_cross_entropy(hidden, lm_head.weight, targets)  # logits piece by piece, ≤ 1 GiB

CUDA tensors run on the CUDA backend on ``torch.cuda.current_stream()`` of their device; CPU
tensors run on the CPU backend. The losses are float32 whatever the input dtype (torch's
autocast also computes cross-entropy in float32).

How the gradient is computed (the training path):

* :func:`cross_entropy`, reduction 'mean' or 'sum', gradient needed: ONE pass over the logits in
  the forward (``fce_forward`` with a gradient buffer, upstream gradient 1) writes the loss, lse
  and the gradient; the backward hands that buffer to autograd after ``fce_backward_rescale``,
  which reads the upstream scalar on the device: exactly 1 (a plain ``loss.backward()``) costs
  one launch and no pass; 0 or ±2^k (GradScaler, power-of-two accumulation) an exact in-place
  scale; any other value recomputes the gradient from the logits (kept by reference), so it is
  rounded once, as torch's. No host synchronisation, graph-capturable. The gradient buffer is
  the one the backward returns (no memory beyond it). With ``inplace_backward=True`` the
  gradient is written over the logits instead and scaled with ``fce_scale_gradient`` (a 16-bit
  gradient is then rounded twice for an upstream value that is not ±2^k, as Liger's and
  Quack's).
* :func:`cross_entropy`, reduction 'none': the forward saves lse [N]; the backward calls
  ``fce_backward`` with the per-row upstream gradient (one more read of the logits).
* :func:`linear_cross_entropy` cannot save the logits (they exist only piece by piece), so for
  reduction 'mean' and 'sum' the forward (``fce_linear_ce``) computes the gradients of hidden,
  weight and bias in their own dtypes for an upstream gradient of 1, in the same call as the
  loss, and the backward scales them in place (``fce_scale_gradient``: free when the upstream
  gradient is 1, exact for ±2^k; for other values a 16-bit grad_hidden / grad_weight is rounded
  twice). With a bias that needs a gradient the forward computes the loss only and the backward
  computes everything with the real upstream gradient (8·N·D·V; LLM heads have no bias). Its scratch memory is the budget ``workspace_bytes`` (default 1 GiB); nothing of
  size [V, D] or [N, V] is allocated beyond the gradients returned. For reduction 'none' the
  forward computes the loss only and the backward calls ``fce_linear_ce`` again with the
  per-row upstream gradient (one recomputation of the logits, chunk by chunk).
* Gradients are only computed when autograd will need them (grad mode on and an input
  requiring grad): evaluate under ``torch.no_grad()``.

Extra outputs (``return_z_loss``, ``return_token_accuracy``, ``return_predicted_tokens``,
``return_lse``) come from the same library call as the loss (the accuracy and the argmax from
the logits it reads or forms anyway, never a second pass); with any of them set the functions
return a ``CrossEntropyOutput`` named tuple ``(loss, z_loss, token_accuracy, predicted_tokens,
lse)`` holding the loss and the outputs asked for, in that order (:data:`OUTPUT_FIELDS`). Only
the loss is differentiable.

Differences from torch, on purpose:

* a 'mean' over zero non-ignored targets is 0 with zero gradients (torch gives NaN);
* a target outside [0, C) that is not ``ignore_index`` gives a NaN loss (no host sync to raise
  an error; torch raises), unless ``check_targets=True``: then the library's error flag is read
  after the call (a host synchronisation) and torch's IndexError is raised;
* class-probability targets are not supported; float64 inputs are computed in float32;
* no double backward (the gradients are not differentiable again).

Autocast: :func:`cross_entropy` takes logits of any of float32/float16/bfloat16 as they are
(computing in float32 inside, as autocast's own cross-entropy does). :func:`linear_cross_entropy`
runs its matmul in the autocast dtype when autocast is on for the inputs' device: hidden, weight
and bias are cast inside the op, and a float32 weight gets its gradient in float32 directly.

Everything goes through ``torch.library.custom_op`` with ``register_fake`` and
``register_autograd``, so ``torch.compile(fullgraph=True)`` traces these functions without graph
breaks.
"""

from __future__ import annotations

import collections
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _torch_calls as _tc
from ._lib import FCE_BFLOAT16, FCE_FLOAT16, FCE_FLOAT32, FCE_REDUCTION_NONE

if not hasattr(torch, "library") or not hasattr(torch.library, "custom_op"):
    raise ImportError(f"fusedce.torch needs torch >= 2.4 (torch.library.custom_op); this is "
                      f"torch {torch.__version__}")

__all__ = ["cross_entropy", "linear_cross_entropy", "CrossEntropyLoss",
           "LinearCrossEntropyLoss", "DEFAULT_WORKSPACE_BYTES", "OUTPUT_FIELDS"]

DEFAULT_WORKSPACE_BYTES = _tc.DEFAULT_WORKSPACE_BYTES  # linear CE budget without env or kwarg

_REDUCTIONS = {"mean": 0, "sum": 1, "none": FCE_REDUCTION_NONE}
_TORCH_OF_CODE = {FCE_FLOAT32: torch.float32, FCE_FLOAT16: torch.float16,
                  FCE_BFLOAT16: torch.bfloat16}
_CODE_OF_TORCH = {v: k for k, v in _TORCH_OF_CODE.items()}


def _cw(class_weights: Optional[Tensor]) -> Optional[Tensor]:
    if class_weights is None:
        return None
    return class_weights.to(torch.float32).contiguous()


# ============================================================ cross_entropy ops ====
# opts, everywhere below: (reduction, ignore_index, label_smoothing, z_loss, softcap,
# logit_scale, shift_seq_len, shift, token_scaling), the order _torch_calls.options takes them
# in. ``extras`` is a bitmask of the optional forward outputs (_tc.EXTRA_Z_LOSS, EXTRA_ACCURACY,
# EXTRA_ARGMAX); an op returns an empty [0] tensor for an output not asked for.
def _opts(ignore_index, reduction, label_smoothing, z_loss, softcap, logit_scale, shift_seq_len,
          shift, token_scaling):
    return (int(reduction), int(ignore_index), float(label_smoothing), float(z_loss),
            float(softcap), float(logit_scale), int(shift_seq_len), int(shift),
            bool(token_scaling))


_N_OPTS = 9  # the option arguments of every op below, ignore_index ... token_scaling


def _or_empty(t: Optional[Tensor], like: Tensor, dtype=torch.float32) -> Tensor:
    return t if t is not None else like.new_empty((0,), dtype=dtype)


def _fake_extras(like: Tensor, n, reduction: int, extras: int):
    """The (z_loss, accuracy, argmax) outputs of an op, as fake tensors."""
    z = like.new_empty(() if extras & _tc.EXTRA_Z_LOSS else (0,), dtype=torch.float32)
    acc_shape = ((n,) if reduction == FCE_REDUCTION_NONE else ()) if (
        extras & _tc.EXTRA_ACCURACY) else (0,)
    acc = like.new_empty(acc_shape, dtype=torch.float32)
    am = like.new_empty((n,) if extras & _tc.EXTRA_ARGMAX else (0,), dtype=torch.int64)
    return z, acc, am


# ---- the training path for 'mean' / 'sum': loss and gradient in ONE pass over the logits
@torch.library.custom_op("fusedce::ce_forward_grad", mutates_args=())
def _ce_forward_grad(logits: Tensor, targets: Tensor, class_weights: Optional[Tensor],
                     ignore_index: int, reduction: int, label_smoothing: float, z_loss: float,
                     softcap: float, logit_scale: float, shift_seq_len: int, shift: int,
                     token_scaling: bool, extras: int, check_targets: bool
                     ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, lse, dloss/dlogits for an upstream gradient of 1, z_loss, accuracy, argmax): one
    read, one write."""
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    loss, lse, zl, acc, am = _tc.ce_forward(
        logits, targets, _cw(class_weights),
        _opts(ignore_index, reduction, label_smoothing, z_loss, softcap, logit_scale,
              shift_seq_len, shift, token_scaling),
        grad=grad, extras=extras, check_targets=check_targets)
    return (loss, lse, grad, _or_empty(zl, logits), _or_empty(acc, logits),
            _or_empty(am, logits, torch.int64))


@_ce_forward_grad.register_fake
def _ce_forward_grad_fake(logits, targets, class_weights, ignore_index, reduction,
                          label_smoothing, z_loss, softcap, logit_scale, shift_seq_len, shift,
                          token_scaling, extras, check_targets):
    n = logits.shape[0]
    return (logits.new_empty((), dtype=torch.float32),
            logits.new_empty((n,), dtype=torch.float32),
            logits.new_empty(logits.shape)) + _fake_extras(logits, n, reduction, extras)


@torch.library.custom_op("fusedce::ce_rescale_", mutates_args=("grad",))
def _ce_rescale_(grad: Tensor, grad_loss: Tensor, logits: Tensor, targets: Tensor, lse: Tensor,
                 class_weights: Optional[Tensor], ignore_index: int, reduction: int,
                 label_smoothing: float, z_loss: float, softcap: float, logit_scale: float,
                 shift_seq_len: int, shift: int, token_scaling: bool) -> None:
    """fce_backward_rescale: grad (the forward's, for an upstream 1) becomes the gradient for
    grad_loss, rounded once: nothing when it is 1, an exact in-place scale for ±2^k, else
    computed again from the logits; decided on the device."""
    _tc.ce_backward(logits, targets, lse, grad_loss.to(torch.float32).contiguous(),
                    _cw(class_weights),
                    _opts(ignore_index, reduction, label_smoothing, z_loss, softcap, logit_scale,
                          shift_seq_len, shift, token_scaling), rescale=grad)


@_ce_rescale_.register_fake
def _ce_rescale_fake(grad, grad_loss, logits, targets, lse, class_weights, ignore_index,
                     reduction, label_smoothing, z_loss, softcap, logit_scale, shift_seq_len,
                     shift, token_scaling):
    return None


@torch.library.custom_op("fusedce::scale_", mutates_args=("grad",))
def _scale_(grad: Tensor, grad_output: Tensor) -> None:
    """grad *= grad_output (a scalar) in place on the device; a no-op launch when it is 1."""
    _tc.scale_(grad, grad_output)


@_scale_.register_fake
def _scale_fake(grad, grad_output):
    return None


def _hand_out_once(ctx) -> None:
    """A gradient written over the logits (inplace_backward) is scaled in place and handed to
    autograd, which may keep that very buffer: a second backward through the same graph
    (retain_graph=True) cannot use it again, so it raises with what to do instead."""
    if getattr(ctx, "handed_out", False):
        raise RuntimeError(
            "fusedce.torch.cross_entropy(inplace_backward=True): the gradient was written over "
            "the logits in the forward pass and handed to autograd once; a second backward "
            "through the same graph (retain_graph=True, gradcheck) needs inplace_backward=False.")
    ctx.handed_out = True


_CE_FORWARD_GRAD_INPUTS = 3 + _N_OPTS + 2


def _ce_forward_grad_setup(ctx, inputs, output):
    logits, targets, class_weights = inputs[:3]
    _, lse, grad, zl, acc, am = output
    ctx.mark_non_differentiable(lse, grad, zl, acc, am)
    ctx.set_materialize_grads(False)  # else autograd makes a zero [N, V] "gradient" for grad
    # the logits are kept (a reference: they are the caller's input) so that an upstream
    # gradient other than 1 or ±2^k, or a second backward, can recompute exactly
    ctx.save_for_backward(logits, targets, class_weights, lse)
    ctx.grad = grad  # not version-tracked: the first backward rescales it in place
    ctx.options = inputs[3:3 + _N_OPTS]


def _ce_forward_grad_backward(ctx, grad_loss, *_unused):
    nones = (None,) * (_CE_FORWARD_GRAD_INPUTS - 1)
    if grad_loss is None or not ctx.needs_input_grad[0]:  # (undefined: no gradient flows)
        return (None,) + nones
    logits, targets, class_weights, lse = ctx.saved_tensors
    grad = ctx.grad
    if grad is not None:  # the first backward: the forward's gradient, made the right one
        ctx.grad = None
        _ce_rescale_(grad, grad_loss, logits, targets, lse, class_weights, *ctx.options)
    else:  # handed out already (retain_graph): computed again
        grad = _ce_backward(grad_loss, logits, targets, lse, class_weights, *ctx.options)
    return (grad,) + nones


_ce_forward_grad.register_autograd(_ce_forward_grad_backward, setup_context=_ce_forward_grad_setup)


def _non_differentiable(ctx, *tensors) -> None:
    ctx.mark_non_differentiable(*(t for t in tensors if t is not None))


class _CrossEntropyOnePass(torch.autograd.Function):
    """The same one-pass training path as fusedce::ce_forward_grad + ce_rescale_, as a plain
    autograd.Function calling the C library directly: what eager mode runs (the custom ops'
    dispatch costs tens of µs a call; torch.compile traces the custom ops instead).
    Returns (loss, lse, z_loss, accuracy, argmax), None for the extras not asked for."""

    @staticmethod
    def forward(ctx, logits, targets, class_weights, opts, extras, check_targets):
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        cw = _cw(class_weights)
        loss, lse, zl, acc, am = _tc.ce_forward(logits, targets, cw, opts, grad=grad,
                                                extras=extras, check_targets=check_targets)
        ctx.save_for_backward(logits, targets, cw, lse)
        ctx.grad, ctx.opts = grad, opts
        ctx.set_materialize_grads(False)
        _non_differentiable(ctx, lse, zl, acc, am)
        return loss, lse, zl, acc, am

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        if grad_loss is None:
            return (None,) * 6
        logits, targets, cw, lse = ctx.saved_tensors
        up = grad_loss.to(torch.float32).contiguous()
        if ctx.grad is not None:  # the first backward: fce_backward_rescale, in place
            grad, ctx.grad = ctx.grad, None
            _tc.ce_backward(logits, targets, lse, up, cw, ctx.opts, rescale=grad)
        else:  # a second backward through the graph: computed again
            grad = _tc.ce_backward(logits, targets, lse, up, cw, ctx.opts)
        return (grad,) + (None,) * 5


def _compiling() -> bool:
    fn = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(fn()) if fn is not None else False


class _CrossEntropyInPlace(torch.autograd.Function):
    """inplace_backward=True: the one pass writes the gradient over the logits themselves (a
    plain autograd.Function, as Liger's and Quack's: torch.compile breaks the graph here).
    Returns (loss, lse or None, z_loss, accuracy, argmax)."""

    @staticmethod
    def forward(ctx, logits, targets, class_weights, opts, extras, check_targets, want_lse):
        loss, lse, zl, acc, am = _tc.ce_forward(logits, targets, _cw(class_weights), opts,
                                                grad=logits, want_lse=want_lse, extras=extras,
                                                check_targets=check_targets)
        ctx.save_for_backward(logits)
        ctx.set_materialize_grads(False)
        _non_differentiable(ctx, lse, zl, acc, am)
        return loss, lse, zl, acc, am

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        if grad_loss is None:
            return (None,) * 7
        _hand_out_once(ctx)
        (grad,) = ctx.saved_tensors
        _scale_(grad, grad_loss)
        return (grad,) + (None,) * 6


# ---- reduction 'none' (and no gradient needed): the loss, lse saved, fce_backward later
@torch.library.custom_op("fusedce::ce_forward", mutates_args=())
def _ce_forward(logits: Tensor, targets: Tensor, class_weights: Optional[Tensor],
                ignore_index: int, reduction: int, label_smoothing: float, z_loss: float,
                softcap: float, logit_scale: float, shift_seq_len: int, shift: int,
                token_scaling: bool, extras: int, check_targets: bool
                ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, lse, z_loss, accuracy, argmax)."""
    loss, lse, zl, acc, am = _tc.ce_forward(
        logits, targets, _cw(class_weights),
        _opts(ignore_index, reduction, label_smoothing, z_loss, softcap, logit_scale,
              shift_seq_len, shift, token_scaling),
        extras=extras, check_targets=check_targets)
    return (loss, lse, _or_empty(zl, logits), _or_empty(acc, logits),
            _or_empty(am, logits, torch.int64))


@_ce_forward.register_fake
def _ce_forward_fake(logits, targets, class_weights, ignore_index, reduction, label_smoothing,
                     z_loss, softcap, logit_scale, shift_seq_len, shift, token_scaling, extras,
                     check_targets):
    n = logits.shape[0]
    loss = logits.new_empty((n,) if reduction == FCE_REDUCTION_NONE else (), dtype=torch.float32)
    return (loss, logits.new_empty((n,), dtype=torch.float32)) + _fake_extras(
        logits, n, reduction, extras)


@torch.library.custom_op("fusedce::ce_backward", mutates_args=())
def _ce_backward(grad_loss: Tensor, logits: Tensor, targets: Tensor, lse: Tensor,
                 class_weights: Optional[Tensor], ignore_index: int, reduction: int,
                 label_smoothing: float, z_loss: float, softcap: float, logit_scale: float,
                 shift_seq_len: int, shift: int, token_scaling: bool) -> Tensor:
    return _tc.ce_backward(logits, targets, lse, grad_loss.to(torch.float32).contiguous(),
                           _cw(class_weights),
                           _opts(ignore_index, reduction, label_smoothing, z_loss, softcap,
                                 logit_scale, shift_seq_len, shift, token_scaling))


@_ce_backward.register_fake
def _ce_backward_fake(grad_loss, logits, targets, lse, class_weights, ignore_index, reduction,
                      label_smoothing, z_loss, softcap, logit_scale, shift_seq_len, shift,
                      token_scaling):
    return logits.new_empty(logits.shape)  # dense [N, V] whatever the logits' row stride


def _ce_setup_context(ctx, inputs, output):
    logits, targets, class_weights = inputs[:3]
    _, lse, zl, acc, am = output
    ctx.save_for_backward(logits, targets, class_weights, lse)
    ctx.options = inputs[3:3 + _N_OPTS]
    ctx.mark_non_differentiable(lse, zl, acc, am)
    ctx.set_materialize_grads(False)


def _ce_autograd_backward(ctx, grad_loss, *_unused):
    nones = (None,) * (_CE_FORWARD_GRAD_INPUTS - 1)
    if grad_loss is None:
        return (None,) + nones
    logits, targets, class_weights, lse = ctx.saved_tensors
    grad_logits = None
    if ctx.needs_input_grad[0]:
        grad_logits = _ce_backward(grad_loss, logits, targets, lse, class_weights, *ctx.options)
    return (grad_logits,) + nones


_ce_forward.register_autograd(_ce_autograd_backward, setup_context=_ce_setup_context)


# ========================================================= linear_ce op (fused) ====
@torch.library.custom_op("fusedce::linear_ce", mutates_args=())
def _linear_ce(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor,
               class_weights: Optional[Tensor], grad_output: Optional[Tensor],
               ignore_index: int, reduction: int, label_smoothing: float, z_loss: float,
               softcap: float, logit_scale: float, shift_seq_len: int, shift: int,
               token_scaling: bool, compute_dtype: int, workspace_bytes: int, need_hidden: bool,
               need_weight: bool, need_bias: bool, extras: int, check_targets: bool
               ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """loss, lse, the gradients asked for (empty [0] tensors for the others), scaled by
    grad_output (None = 1), and the extras asked for (z_loss, accuracy, argmax; empty [0] for
    the others). Inputs are cast to compute_dtype (an fce_dtype code) inside; the workspace is
    at most workspace_bytes (never below the library's minimum)."""
    cdt = _TORCH_OF_CODE[compute_dtype]
    h = hidden.to(cdt)
    if h.stride(-1) != 1:
        h = h.contiguous()
    w = weight.to(cdt).contiguous()
    b = bias.to(cdt).contiguous() if bias is not None else None
    # A float32 weight computed in a lower precision gets its gradient in float32 directly: the
    # caller's own float32 buffer is then the library's accumulator (no extra memory). A 16-bit
    # weight gets a 16-bit gradient, never a float32 copy of it.
    fp32_grads = weight.dtype == torch.float32 and cdt != torch.float32
    g = grad_output.to(torch.float32).contiguous() if grad_output is not None else None
    loss, lse, gh, gw, gb, zl, acc, am = _tc.linear_ce(
        h, w, b, targets.contiguous(), _cw(class_weights), g,
        _opts(ignore_index, reduction, label_smoothing, z_loss, softcap, logit_scale,
              shift_seq_len, shift, token_scaling),
        grad_weight_fp32=fp32_grads, need=(need_hidden, need_weight, need_bias),
        budget=int(workspace_bytes), extras=extras, check_targets=check_targets)
    empty = hidden.new_empty((0,))
    gh = gh.to(hidden.dtype) if gh is not None else empty
    gw = gw.to(weight.dtype) if gw is not None else weight.new_empty((0,))
    gb = gb.to(weight.dtype) if gb is not None else weight.new_empty((0,))
    return (loss, lse, gh, gw, gb, _or_empty(zl, hidden), _or_empty(acc, hidden),
            _or_empty(am, hidden, torch.int64))


@_linear_ce.register_fake
def _linear_ce_fake(hidden, weight, bias, targets, class_weights, grad_output, ignore_index,
                    reduction, label_smoothing, z_loss, softcap, logit_scale, shift_seq_len,
                    shift, token_scaling, compute_dtype, workspace_bytes, need_hidden,
                    need_weight, need_bias, extras, check_targets):
    n = hidden.shape[0]
    loss = hidden.new_empty((n,) if reduction == FCE_REDUCTION_NONE else (), dtype=torch.float32)
    lse = hidden.new_empty((n,), dtype=torch.float32)
    gh = hidden.new_empty(hidden.shape) if need_hidden else hidden.new_empty((0,))
    gw = weight.new_empty(weight.shape) if need_weight else weight.new_empty((0,))
    gb = (bias.new_empty(bias.shape, dtype=weight.dtype) if (need_bias and bias is not None)
          else weight.new_empty((0,)))
    return (loss, lse, gh, gw, gb) + _fake_extras(hidden, n, reduction, extras)


_LINEAR_CE_INPUTS = 6 + _N_OPTS + 7


def _linear_ce_setup_context(ctx, inputs, output):
    hidden, weight, bias, targets, class_weights, grad_output = inputs[:6]
    rest = inputs[6:]
    reduction = rest[1]
    # rest: the options (_N_OPTS), compute_dtype, workspace_bytes, need_hidden, need_weight,
    # need_bias, extras, check_targets
    need_hidden, need_weight, need_bias = rest[_N_OPTS + 2:_N_OPTS + 5]
    _, lse, gh, gw, gb, zl, acc, am = output
    ctx.mark_non_differentiable(lse, gh, gw, gb, zl, acc, am)
    # no zero "gradients" for the outputs autograd does not differentiate (they would be as
    # large as the gradients themselves)
    ctx.set_materialize_grads(False)
    # Gradients computed in the forward with an upstream gradient of 1 are scaled in place by
    # the scalar upstream gradient later; otherwise (reduction 'none', or the op called with a
    # grad_output) the backward recomputes them with the real upstream gradient.
    ctx.grad_in_forward = (bool(need_hidden or need_weight or need_bias)
                           and reduction != FCE_REDUCTION_NONE and grad_output is None)
    ctx.computed = (bool(need_hidden), bool(need_weight), bool(need_bias and bias is not None))
    ctx.has_bias = bias is not None
    ctx.options = tuple(rest[:_N_OPTS + 2])  # the options, compute_dtype, workspace_bytes
    # The inputs are kept (they are alive anyway: the weight is a parameter, hidden [N, D] is
    # small) so that a second backward through the same graph can recompute the gradients.
    # The gradients are kept as tensors without version tracking (the backward scales them in
    # place and hands them out).
    ctx.grads = (gh, gw, gb)
    ctx.save_for_backward(hidden, weight, bias, targets, class_weights)


def _linear_ce_autograd_backward(ctx, grad_loss, *_unused):
    nones = (None,) * (_LINEAR_CE_INPUTS - 3)
    if grad_loss is None:
        return (None,) * 3 + nones
    need = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]),
            bool(ctx.needs_input_grad[2]) and ctx.has_bias)
    hidden, weight, bias, targets, class_weights = ctx.saved_tensors
    computed = ctx.grads is not None
    if (ctx.grad_in_forward and computed and
            all(c or not n for c, n in zip(ctx.computed, need))):
        # the first backward: scale the forward's gradients in place (free for an upstream 1)
        out = [g if n else None for g, n in zip(ctx.grads, need)]
        for g in out:
            if g is not None:
                _scale_(g, grad_loss)
        ctx.grads = None  # handed out: a later backward recomputes
    else:  # recompute with the real upstream gradient (per row for reduction 'none')
        _, _, gh, gw, gb, _, _, _ = _linear_ce(hidden, weight, bias, targets, class_weights,
                                               grad_loss, *ctx.options, *need, 0, False)
        out = [g if n else None for g, n in zip((gh, gw, gb), need)]
    return tuple(out) + nones


_linear_ce.register_autograd(_linear_ce_autograd_backward, setup_context=_linear_ce_setup_context)


# ================================================================ public API ====
def _reduction(reduction: str) -> int:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    return _REDUCTIONS[reduction]


def _targets(target: Tensor) -> Tensor:
    if target.is_floating_point():
        raise TypeError("fusedce supports class-index targets only (int64/int32), not class "
                        "probabilities")
    if target.dtype not in (torch.int64, torch.int32):
        target = target.to(torch.int64)
    return target.reshape(-1)


def _float_input(x: Tensor, name: str) -> Tensor:
    if x.dtype == torch.float64:
        return x.to(torch.float32)  # computed in float32 (documented)
    if x.dtype not in _CODE_OF_TORCH:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    return x


def _resolve_shift(shift, shift_seq_len: int, target_shape: tuple, rows: int) -> Tuple[int, int]:
    """(T, k) for the C options from the two spellings of the causal shift:

    * ``shift_seq_len=T`` alone (fusedce 0.2): k = 1;
    * ``shift=k`` (CCE's; True = 1) alone: T = the last dimension of target (a 1-D target is
      one sequence), as CCE's targets (..., T);
    * both: k within sequences of T rows.
    k = 1 is passed as 0 (the C default, which means 1), so that a 0.2 library still runs it.
    """
    t = int(shift_seq_len)
    k = int(shift)  # bool: True -> 1 (CCE)
    if t < 0:
        raise ValueError(f"shift_seq_len must be >= 0, got {shift_seq_len}")
    if k < 0:
        raise ValueError(f"shift must be >= 0, got {shift}")
    if k:
        if not t:
            t = int(target_shape[-1]) if len(target_shape) else rows
        if k >= t:
            raise ValueError(f"shift must be in [0, {t}) (the sequence length), got {k}")
    if t and rows % t:
        raise ValueError(f"the {rows} rows are not a whole number of sequences of "
                         f"shift_seq_len={t}")
    return t, (0 if k == 1 else k)


# ------------------------------------------------------------- extra outputs ----
# The optional outputs, in the order they follow the loss in the returned tuple: Liger's
# (loss, z_loss, token_accuracy, predicted_tokens), then CCE's lse.
OUTPUT_FIELDS = ("loss", "z_loss", "token_accuracy", "predicted_tokens", "lse")
_OUTPUT_TYPES = {
    mask: collections.namedtuple(
        "CrossEntropyOutput",
        ("loss",) + tuple(f for i, f in enumerate(OUTPUT_FIELDS[1:]) if mask >> i & 1))
    for mask in range(1, 16)
}


def _output_mask(return_z_loss, return_token_accuracy, return_predicted_tokens, return_lse):
    return ((1 if return_z_loss else 0) | (2 if return_token_accuracy else 0)
            | (4 if return_predicted_tokens else 0) | (8 if return_lse else 0))


def _c_extras(mask: int, red: int) -> int:
    """The _tc.EXTRA_* bits the library computes for an output mask (a 'none' z-loss is made
    per row from lse here, the library giving only the total)."""
    return ((_tc.EXTRA_Z_LOSS if mask & 1 and red != FCE_REDUCTION_NONE else 0)
            | (_tc.EXTRA_ACCURACY if mask & 2 else 0) | (_tc.EXTRA_ARGMAX if mask & 4 else 0))


def _transform(a: Tensor, logit_scale: float, softcap: float) -> Tensor:
    """a = c * tanh(s * z / c), in float32, as the library does before anything else."""
    a = a.float() * logit_scale
    if softcap > 0:
        a = softcap * torch.tanh(a / softcap)
    return a


def _z_loss_rows(lse: Tensor, targets: Tensor, vocab: int, opts: tuple, target_logit) -> Tensor:
    """Per-row z-loss for reduction 'none' (Liger's): lambda * lse^2 for every non-ignored row
    (out-of-range targets included, SEMANTICS.md rule 3), times the detached p_y with token
    scaling (valid rows), 0 for ignored rows. ``target_logit(y)`` gives the raw logit of class
    y[r] in row r (only called with token scaling)."""
    _, ignore_index, _, lam, softcap, logit_scale, t, k, token_scaling = opts
    if lam == 0.0:
        return torch.zeros_like(lse)
    y = _tc.row_targets(targets.to(torch.int64), ignore_index, t, k)
    counted = y != ignore_index
    zl = lam * lse.square()
    if token_scaling:
        valid = counted & (y >= 0) & (y < vocab)
        a_y = _transform(target_logit(y.clamp(0, vocab - 1)), logit_scale, softcap)
        zl = torch.where(valid, zl * torch.exp(a_y - lse), zl)
    return torch.where(counted, zl, torch.zeros_like(zl))


def _finish(mask: int, red: int, out_shape, loss: Tensor, lse, zl, acc, am, z_rows):
    """The return value: the loss alone, or the CrossEntropyOutput named tuple of the loss and
    the outputs asked for. Per-row outputs take out_shape (the shape of a 'none' loss)."""
    def rows(t):
        return t.reshape(out_shape) if out_shape is not None else t

    if red == FCE_REDUCTION_NONE:
        loss = rows(loss)
    if not mask:
        return loss
    values = [loss]
    if mask & 1:
        values.append(rows(z_rows()) if red == FCE_REDUCTION_NONE else zl)
    if mask & 2:
        values.append(rows(acc) if red == FCE_REDUCTION_NONE else acc)
    if mask & 4:
        values.append(rows(am))
    if mask & 8:
        values.append(rows(lse))
    return _OUTPUT_TYPES[mask](*values)


def cross_entropy(input: Tensor, target: Tensor, weight: Optional[Tensor] = None,
                  ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0, *, z_loss: float = 0.0, softcap: float = 0.0,
                  logit_scale: float = 1.0, shift_seq_len: int = 0, shift: int = 0,
                  use_token_scaling: bool = False, return_z_loss: bool = False,
                  return_token_accuracy: bool = False, return_predicted_tokens: bool = False,
                  return_lse: bool = False, check_targets: bool = False,
                  inplace_backward: bool = False):
    """torch.nn.functional.cross_entropy, fused, plus the options below. When autograd will
    need the gradient (grad mode on, input requiring grad) and the reduction is 'mean' or
    'sum', the forward reads the logits once and writes the gradient once, for an upstream
    gradient of 1; the backward turns it into the gradient for the upstream scalar (nothing
    to do when that is exactly 1; an exact scale for ±2^k; a recomputation from the logits
    otherwise, so the gradient is rounded once — decided on the device). Reduction 'none' saves lse and
    computes the gradient in the backward (one more read of the logits). Under
    ``torch.no_grad()``, or when input does not require grad, only the loss is computed.

    z_loss        lambda: adds lambda * lse^2 per row (PaLM; Liger's lse_square_scale). For
                  'mean' the z-loss terms are divided by the number of non-ignored rows (not
                  by the class weights' sum, as Liger).
    softcap       c > 0: logits become c * tanh(logits / c) first (Gemma 2);
    logit_scale   s: logits are multiplied by s before anything else;
    shift_seq_len, shift   causal shift without a copy (SEMANTICS.md rule 1): with sequences of
                  T rows, row b*T+t of the (flattened) logits is scored against target
                  b*T+t+k and the last k positions of each sequence are ignored.
                  ``shift_seq_len=T`` alone: k = 1 (as before 0.3). ``shift=k`` alone (CCE's
                  integer shift; True = 1): T = target.shape[-1] (a 1-D target is one
                  sequence), so ``cross_entropy(z.view(B * T, V), y.view(B, T), shift=1)`` is
                  ``F.cross_entropy(z.view(B, T, V)[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1))``.
                  Both: k within sequences of T. 0 <= k < T. For reduction 'none' the loss keeps
                  every position (the last k of each sequence hold 0): CCE's is ``loss[..., :-k]``.
    use_token_scaling  each row's loss (its z-loss term included) and gradient times its
                  predicted probability of the target, p_y, treated as a constant (Liger's);
    return_z_loss      also return the z-loss part of the loss (for logging; not
                  differentiable): float32 () for 'mean'/'sum' (the library's total), per row
                  (the shape of the 'none' loss) for 'none', as Liger;
    return_token_accuracy  also return the accuracy of the argmax prediction, computed by the
                  library from the logits it reads anyway: float32 () for 'mean'/'sum' (the
                  fraction of non-ignored rows whose argmax is the target; 0 when every row is
                  ignored), 1.0/0.0 per row for 'none' (0 for ignored rows). Unweighted;
    return_predicted_tokens  also return each row's argmax class (int64, the shape of the
                  'none' loss; -1 for ignored rows; ties: the lowest index, as torch.argmax);
    return_lse    also return each row's log-sum-exp of the (scaled, capped) logits (float32,
                  the shape of the 'none' loss; written for ignored rows too; CCE's);
    check_targets after the call, read the library's error flag (a host synchronisation: slow
                  on CUDA, not allowed inside CUDA-graph capture; inside the op, so no graph
                  break under torch.compile) and raise IndexError("Target 123 is out of
                  bounds.") as torch does when a target is outside [0, C) and not
                  ignore_index. Off by default: such a row gets a NaN loss and gradient, no
                  sync;
    inplace_backward  write the gradient OVER the logits (as Liger and Quack do): saves the
                  [N, V] gradient buffer, but the logits' values are destroyed by the forward,
                  so nothing else may read them afterwards (not even another loss). Only for
                  'mean'/'sum' with a gradient; dense logits (others are copied first). The
                  upstream scalar is applied by scaling (16-bit: rounded twice unless it is
                  ±2^k). Runs as a torch.autograd.Function (torch.compile breaks the graph).

    With inplace_backward=True the gradient is handed to autograd once: a second backward
    through the same graph (retain_graph=True) raises. Without it, a second backward recomputes.

    Returns the loss (a tensor) when no return_* flag is set; otherwise a ``CrossEntropyOutput``
    named tuple of the loss followed by the outputs asked for, always in the order
    ``(loss, z_loss, token_accuracy, predicted_tokens, lse)`` (:data:`OUTPUT_FIELDS`): e.g.
    ``loss, lse = cross_entropy(z, y, return_lse=True)`` (CCE's pair), ``loss, z_loss, acc,
    pred = cross_entropy(z, y, return_z_loss=True, return_token_accuracy=True,
    return_predicted_tokens=True)`` (Liger's four), or by name (``out.token_accuracy``). Only
    the loss is differentiable.

    input is (C,), (N, C) or (N, C, d1, ...) as in torch (the last form is copied to put the
    classes last; give [N, C] for speed). A row stride larger than C (e.g. a slice of padded
    logits) is used without a copy. The loss is float32.
    """
    red = _reduction(reduction)
    input = _float_input(input, "input")
    out_shape = None
    if input.dim() == 1:
        logits, tgt = input.unsqueeze(0), _targets(target)
        out_shape = ()
    elif input.dim() == 2:
        logits, tgt = input, _targets(target)
        if target.dim() != 1:  # [B, T] targets of [B*T, C] logits: per-row outputs [B, T]
            out_shape = tuple(target.shape)
    elif input.dim() > 2:
        logits = input.movedim(1, -1).reshape(-1, input.shape[1])
        tgt = _targets(target)
        out_shape = tuple(target.shape)
    else:
        raise ValueError("input must have at least one dimension (the classes)")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if tgt.shape[0] != logits.shape[0]:
        raise ValueError(f"target has {tgt.shape[0]} elements for {logits.shape[0]} rows of "
                         f"logits (input {tuple(input.shape)}, target {tuple(target.shape)})")
    if weight is not None and (weight.dim() != 1 or weight.shape[0] != logits.shape[1]):
        raise ValueError(f"weight must have shape ({logits.shape[1]},), got "
                         f"{tuple(weight.shape)}")
    t, k = _resolve_shift(shift, shift_seq_len, tuple(target.shape), logits.shape[0])
    args = (int(ignore_index), red, float(label_smoothing), float(z_loss), float(softcap),
            float(logit_scale), t, k, bool(use_token_scaling))
    opts = _opts(*args)
    mask = _output_mask(return_z_loss, return_token_accuracy, return_predicted_tokens,
                        return_lse)
    extras = _c_extras(mask, red)
    check = bool(check_targets)
    want_lse = bool(mask & 8) or (bool(mask & 1) and red == FCE_REDUCTION_NONE)
    need_grad = torch.is_grad_enabled() and logits.requires_grad
    if red != FCE_REDUCTION_NONE and need_grad:
        if inplace_backward:
            if logits.stride(0) != logits.shape[1] and logits.shape[0] > 1:
                logits = logits.contiguous()
            loss, lse, zl, acc, am = _CrossEntropyInPlace.apply(logits, tgt, weight, opts,
                                                                extras, check, want_lse)
        elif _compiling():
            loss, lse, _, zl, acc, am = _ce_forward_grad(logits, tgt, weight, *args, extras,
                                                         check)
        else:
            loss, lse, zl, acc, am = _CrossEntropyOnePass.apply(logits, tgt, weight, opts,
                                                                extras, check)
    elif not _compiling() and not need_grad:
        loss, lse, zl, acc, am = _tc.ce_forward(logits, tgt, _cw(weight), opts,
                                                want_lse=want_lse, extras=extras,
                                                check_targets=check)
    else:
        loss, lse, zl, acc, am = _ce_forward(logits, tgt, weight, *args, extras, check)

    v = logits.shape[1]
    return _finish(mask, red, out_shape, loss, lse, zl, acc, am, lambda: _z_loss_rows(
        lse, tgt, v, opts,
        lambda y: logits.detach().gather(1, y.unsqueeze(1)).squeeze(1)))


def linear_cross_entropy(input: Tensor, linear_weight: Tensor, target: Tensor, *,
                         linear_bias: Optional[Tensor] = None, weight: Optional[Tensor] = None,
                         reduction: str = "mean", ignore_index: int = -100,
                         label_smoothing: float = 0.0, z_loss: float = 0.0,
                         softcap: float = 0.0, logit_scale: float = 1.0,
                         shift_seq_len: int = 0, shift: int = 0,
                         use_token_scaling: bool = False, return_z_loss: bool = False,
                         return_token_accuracy: bool = False,
                         return_predicted_tokens: bool = False, return_lse: bool = False,
                         check_targets: bool = False,
                         workspace_bytes: Optional[int] = None):
    """cross_entropy(F.linear(input, linear_weight, linear_bias), target, ...) without ever
    holding the [N, V] logits (fce_linear_ce).

    input [..., D] (leading dimensions flattened), linear_weight [V, D] (an nn.Linear(D, V) or a
    tied embedding's weight), linear_bias [V], target [...] (the leading dimensions of input),
    weight [V] class weights; the other keywords, the return convention (the loss, or a
    ``CrossEntropyOutput`` named tuple ``(loss, z_loss, token_accuracy, predicted_tokens,
    lse)`` restricted to what was asked for) and the causal shift as in :func:`cross_entropy`
    (``shift=k`` alone: T = target.shape[-1], as CCE's ``linear_cross_entropy(e [B, T, D], c,
    targets [B, T], shift=k)``). The accuracy and predicted tokens come from the logits the
    library computes piece by piece. With ``use_token_scaling``, reduction 'none' and
    ``return_z_loss``, the per-row z-loss needs p_y: the target rows of linear_weight are
    gathered ([N, D], the size of input) to get the target logits. Under autocast the matmul
    runs in the autocast dtype. The loss is float32; for reduction 'none' it has the shape of
    target (so have the per-row outputs).

    workspace_bytes  the memory budget of the call beyond the inputs and the gradients it
                  returns (its scratch workspace); None = FUSEDCE_WORKSPACE_BYTES from the
                  environment (e.g. "512M"), else 1 GiB (fusedce.torch.DEFAULT_WORKSPACE_BYTES).
                  The library picks its fastest plan within it (bench/NOTES.md): token chunks of
                  the logits when they fit with few enough chunks, else the vocab-sliced plan
                  (8·N·D·V instead of 6·N·D·V FLOPs; its float32 [N, D] ∂h accumulator counts
                  towards the budget). A budget below the library's minimum (a few MiB) gets
                  the minimum.
    """
    red = _reduction(reduction)
    if input.dim() < 1:
        raise ValueError("input must be [..., D]")
    if linear_weight.dim() != 2 or linear_weight.shape[1] != input.shape[-1]:
        raise ValueError(f"linear_weight must be [V, {input.shape[-1]}], got "
                         f"{tuple(linear_weight.shape)}")
    vocab = linear_weight.shape[0]
    if linear_bias is not None and (linear_bias.dim() != 1 or linear_bias.shape[0] != vocab):
        raise ValueError(f"linear_bias must be [{vocab}], got {tuple(linear_bias.shape)}")
    if weight is not None and (weight.dim() != 1 or weight.shape[0] != vocab):
        raise ValueError(f"weight must have shape ({vocab},), got {tuple(weight.shape)}")
    hidden = input.reshape(-1, input.shape[-1])
    tgt = _targets(target)
    if tgt.shape[0] != hidden.shape[0]:
        raise ValueError(f"target has {tgt.shape[0]} elements for {hidden.shape[0]} rows of "
                         f"input (input {tuple(input.shape)}, target {tuple(target.shape)})")
    t, k = _resolve_shift(shift, shift_seq_len, tuple(target.shape), hidden.shape[0])
    dev = input.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        cdt = torch.get_autocast_dtype(dev)
    else:
        for name, tt in (("linear_weight", linear_weight), ("linear_bias", linear_bias)):
            if tt is not None and tt.dtype != input.dtype:
                raise TypeError(f"{name} has dtype {tt.dtype} but input has {input.dtype} "
                                "(as for F.linear, they must match outside autocast)")
        cdt = input.dtype
    if cdt == torch.float64:
        cdt = torch.float32
    if cdt not in _CODE_OF_TORCH:
        raise TypeError(f"input must be float32, float16 or bfloat16, got {cdt}")
    grad_on = torch.is_grad_enabled()
    need_h = grad_on and input.requires_grad
    need_w = grad_on and linear_weight.requires_grad
    need_b = grad_on and linear_bias is not None and linear_bias.requires_grad
    # gradients in the forward (scaled in the backward), except for 'none' (per-row upstream
    # gradient) and a bias that needs a gradient (its 16-bit sum would be rounded twice)
    in_forward = red != FCE_REDUCTION_NONE and not need_b
    budget = _tc.default_workspace_bytes() if workspace_bytes is None else int(workspace_bytes)
    if budget < 0:
        raise ValueError(f"workspace_bytes must be >= 0, got {workspace_bytes}")
    args = (int(ignore_index), red, float(label_smoothing), float(z_loss), float(softcap),
            float(logit_scale), t, k, bool(use_token_scaling))
    mask = _output_mask(return_z_loss, return_token_accuracy, return_predicted_tokens,
                        return_lse)
    loss, lse, _, _, _, zl, acc, am = _linear_ce(
        hidden, linear_weight, linear_bias, tgt, weight, None, *args, _CODE_OF_TORCH[cdt],
        budget, bool(need_h and in_forward), bool(need_w and in_forward),
        bool(need_b and in_forward), _c_extras(mask, red), bool(check_targets))

    def target_logit(y):
        h = hidden.detach().to(cdt)
        a = (h.float() * linear_weight.detach().to(cdt)[y].float()).sum(-1)
        if linear_bias is not None:
            a = a + linear_bias.detach().to(cdt)[y].float()
        return a

    return _finish(mask, red, tuple(target.shape), loss, lse, zl, acc, am,
                   lambda: _z_loss_rows(lse, tgt, vocab, _opts(*args), target_logit))


class _LossOptions(torch.nn.Module):
    """The options both loss modules hold (torch.nn.CrossEntropyLoss's, plus fusedce's)."""

    def __init__(self, weight: Optional[Tensor] = None, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0, *, z_loss: float = 0.0,
                 softcap: float = 0.0, logit_scale: float = 1.0, shift_seq_len: int = 0,
                 shift: int = 0, use_token_scaling: bool = False, return_z_loss: bool = False,
                 return_token_accuracy: bool = False, return_predicted_tokens: bool = False,
                 return_lse: bool = False, check_targets: bool = False):
        super().__init__()
        _reduction(reduction)
        self.register_buffer("weight", weight)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.logit_scale = logit_scale
        self.shift_seq_len = shift_seq_len
        self.shift = shift
        self.use_token_scaling = use_token_scaling
        self.return_z_loss = return_z_loss
        self.return_token_accuracy = return_token_accuracy
        self.return_predicted_tokens = return_predicted_tokens
        self.return_lse = return_lse
        self.check_targets = check_targets

    def _kwargs(self) -> dict:
        return dict(z_loss=self.z_loss, softcap=self.softcap, logit_scale=self.logit_scale,
                    shift_seq_len=self.shift_seq_len, shift=self.shift,
                    use_token_scaling=self.use_token_scaling, return_z_loss=self.return_z_loss,
                    return_token_accuracy=self.return_token_accuracy,
                    return_predicted_tokens=self.return_predicted_tokens,
                    return_lse=self.return_lse, check_targets=self.check_targets)

    def extra_repr(self) -> str:
        text = (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, "
                f"softcap={self.softcap}, logit_scale={self.logit_scale}, "
                f"shift_seq_len={self.shift_seq_len}")
        for name in ("shift", "use_token_scaling", "return_z_loss", "return_token_accuracy",
                     "return_predicted_tokens", "return_lse", "check_targets"):
            if getattr(self, name):
                text += f", {name}={getattr(self, name)}"
        return text


class CrossEntropyLoss(_LossOptions):
    """torch.nn.CrossEntropyLoss with fusedce's :func:`cross_entropy` (and its extra options,
    inplace_backward and the return_* flags included: with one set, forward returns the
    CrossEntropyOutput named tuple)."""

    def __init__(self, *args, inplace_backward: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.inplace_backward = inplace_backward

    def forward(self, input: Tensor, target: Tensor):
        return cross_entropy(input, target, self.weight, self.ignore_index, self.reduction,
                             self.label_smoothing, inplace_backward=self.inplace_backward,
                             **self._kwargs())


class LinearCrossEntropyLoss(_LossOptions):
    """Loss of a language-model head: forward(input [..., D], linear_weight [V, D], target,
    linear_bias=None) = :func:`linear_cross_entropy`. The head's weight is an argument, so a
    tied embedding or an nn.Linear's weight can be passed as it is. workspace_bytes: the memory
    budget, as for :func:`linear_cross_entropy`."""

    def __init__(self, *args, workspace_bytes: Optional[int] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.workspace_bytes = workspace_bytes

    def forward(self, input: Tensor, linear_weight: Tensor, target: Tensor,
                linear_bias: Optional[Tensor] = None):
        return linear_cross_entropy(
            input, linear_weight, target, linear_bias=linear_bias, weight=self.weight,
            reduction=self.reduction, ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing, workspace_bytes=self.workspace_bytes,
            **self._kwargs())


# fusedce.torch.distributed: the vocabulary-parallel functions (fusedce/torch_distributed.py)
from . import torch_distributed as distributed  # noqa: E402
import sys as _sys  # noqa: E402
_sys.modules.setdefault(__name__ + ".distributed", distributed)  # import fusedce.torch.distributed
