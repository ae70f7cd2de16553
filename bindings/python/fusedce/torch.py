"""fusedce.torch: fused cross-entropy for torch, with autograd and torch.compile support.

    from fusedce.torch import cross_entropy, linear_cross_entropy
    loss = cross_entropy(logits, targets)                        # like F.cross_entropy
    loss = linear_cross_entropy(hidden, lm_head.weight, targets)  # logits never materialised

CUDA tensors run on the CUDA backend on ``torch.cuda.current_stream()`` of their device; CPU
tensors run on the CPU backend. The losses are float32 whatever the input dtype (torch's
autocast also computes cross-entropy in float32).

How the gradient is computed (the training path):

* :func:`cross_entropy` saves lse [N] (float32) in the forward (``fusedce::ce_forward``) and
  calls ``fce_backward`` (``fusedce::ce_backward``) in the backward, with the upstream gradient
  as a device pointer. The forward reads the logits once, the backward reads them once and
  writes the gradient once; nothing of size [N, V] beyond the logits themselves is kept between
  forward and backward, and no gradient is computed when no backward follows.
* :func:`linear_cross_entropy` cannot save the logits (they never exist whole), so for
  reduction 'mean' and 'sum' the forward (``fusedce::linear_ce``) computes the gradients of
  hidden, weight and bias with an upstream gradient of 1, in the same pass as the loss, and the
  backward multiplies them by the upstream scalar. The weight and bias gradients are kept in
  float32 until then (one rounding to their dtype after scaling); the hidden-state gradient is
  kept in its dtype, so an upstream scalar other than a power of two (1 included) rounds it a
  second time. The gradients are only computed when
  autograd will need them (grad mode on and an input requiring grad), so evaluate under
  ``torch.no_grad()``. For reduction 'none' the per-row upstream gradient is not known in the
  forward: the forward computes the loss only and the backward calls ``fce_linear_ce`` again
  with the upstream gradient (one recomputation of the logits, chunk by chunk).

Differences from torch, on purpose:

* a 'mean' over zero non-ignored targets is 0 with zero gradients (torch gives NaN);
* a target outside [0, C) that is not ``ignore_index`` gives a NaN loss (no host sync to raise
  an error; torch raises);
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

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import core
from ._lib import FCE_BFLOAT16, FCE_FLOAT16, FCE_FLOAT32, FCE_REDUCTION_NONE

if not hasattr(torch, "library") or not hasattr(torch.library, "custom_op"):
    raise ImportError(f"fusedce.torch needs torch >= 2.4 (torch.library.custom_op); this is "
                      f"torch {torch.__version__}")

__all__ = ["cross_entropy", "linear_cross_entropy", "CrossEntropyLoss",
           "LinearCrossEntropyLoss"]

_REDUCTIONS = {"mean": 0, "sum": 1, "none": FCE_REDUCTION_NONE}
_TORCH_OF_CODE = {FCE_FLOAT32: torch.float32, FCE_FLOAT16: torch.float16,
                  FCE_BFLOAT16: torch.bfloat16}
_CODE_OF_TORCH = {v: k for k, v in _TORCH_OF_CODE.items()}


def _stream(t: Tensor) -> Optional[int]:
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else None


def _cw(class_weights: Optional[Tensor]) -> Optional[Tensor]:
    if class_weights is None:
        return None
    return class_weights.to(torch.float32).contiguous()


# ============================================================ cross_entropy ops ====
@torch.library.custom_op("fusedce::ce_forward", mutates_args=())
def _ce_forward(logits: Tensor, targets: Tensor, class_weights: Optional[Tensor],
                ignore_index: int, reduction: int, label_smoothing: float, z_loss: float,
                softcap: float, logit_scale: float, shift_seq_len: int) -> Tuple[Tensor, Tensor]:
    r = core.forward(logits, targets.contiguous(), reduction=reduction,
                     ignore_index=ignore_index, class_weights=_cw(class_weights),
                     label_smoothing=label_smoothing, z_loss_scale=z_loss, softcap=softcap,
                     logit_scale=logit_scale, shift_seq_len=shift_seq_len, return_lse=True,
                     error_flags=False, stream=_stream(logits))
    return r.loss, r.lse


@_ce_forward.register_fake
def _ce_forward_fake(logits, targets, class_weights, ignore_index, reduction, label_smoothing,
                     z_loss, softcap, logit_scale, shift_seq_len):
    n = logits.shape[0]
    loss = logits.new_empty((n,) if reduction == FCE_REDUCTION_NONE else (), dtype=torch.float32)
    return loss, logits.new_empty((n,), dtype=torch.float32)


@torch.library.custom_op("fusedce::ce_backward", mutates_args=())
def _ce_backward(grad_loss: Tensor, logits: Tensor, targets: Tensor, lse: Tensor,
                 class_weights: Optional[Tensor], ignore_index: int, reduction: int,
                 label_smoothing: float, z_loss: float, softcap: float, logit_scale: float,
                 shift_seq_len: int) -> Tensor:
    return core.backward(logits, targets.contiguous(), lse,
                         grad_loss.to(torch.float32).contiguous(), reduction=reduction,
                         ignore_index=ignore_index, class_weights=_cw(class_weights),
                         label_smoothing=label_smoothing, z_loss_scale=z_loss, softcap=softcap,
                         logit_scale=logit_scale, shift_seq_len=shift_seq_len,
                         stream=_stream(logits))


@_ce_backward.register_fake
def _ce_backward_fake(grad_loss, logits, targets, lse, class_weights, ignore_index, reduction,
                      label_smoothing, z_loss, softcap, logit_scale, shift_seq_len):
    return logits.new_empty(logits.shape)  # dense [N, V] whatever the logits' row stride


def _ce_setup_context(ctx, inputs, output):
    logits, targets, class_weights = inputs[:3]
    _, lse = output
    ctx.save_for_backward(logits, targets, class_weights, lse)
    ctx.options = inputs[3:]
    ctx.mark_non_differentiable(lse)


def _ce_autograd_backward(ctx, grad_loss, grad_lse):
    logits, targets, class_weights, lse = ctx.saved_tensors
    grad_logits = None
    if ctx.needs_input_grad[0]:
        grad_logits = _ce_backward(grad_loss, logits, targets, lse, class_weights, *ctx.options)
    return (grad_logits,) + (None,) * 9


_ce_forward.register_autograd(_ce_autograd_backward, setup_context=_ce_setup_context)


# ========================================================= linear_ce op (fused) ====
@torch.library.custom_op("fusedce::linear_ce", mutates_args=())
def _linear_ce(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor,
               class_weights: Optional[Tensor], grad_output: Optional[Tensor],
               ignore_index: int, reduction: int, label_smoothing: float, z_loss: float,
               softcap: float, logit_scale: float, shift_seq_len: int, compute_dtype: int,
               need_hidden: bool, need_weight: bool, need_bias: bool
               ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """loss, lse, and the gradients asked for (empty [0] tensors for the others), scaled by
    grad_output (None = 1). Inputs are cast to compute_dtype (an fce_dtype code) inside."""
    cdt = _TORCH_OF_CODE[compute_dtype]
    h = hidden.to(cdt)
    if h.stride(-1) != 1:
        h = h.contiguous()
    w = weight.to(cdt).contiguous()
    b = bias.to(cdt).contiguous() if bias is not None else None
    need_bias = need_bias and bias is not None
    grads = [n for n, f in (("hidden", need_hidden), ("weight", need_weight),
                            ("bias", need_bias)) if f]
    # A float32 weight computed in a lower precision gets its gradient in float32 directly.
    # Gradients computed here for an upstream gradient of 1 (scaled in the backward) stay in
    # float32 too, so that scaling then casting rounds them once; a float32 grad_weight is also
    # what the library's float32 accumulation over token chunks needs, so it costs no memory.
    in_forward = grad_output is None and reduction != FCE_REDUCTION_NONE
    fp32_grads = (weight.dtype == torch.float32 and cdt != torch.float32) or in_forward
    g = grad_output.to(torch.float32).contiguous() if grad_output is not None else None
    r = core.linear_ce(h, w, targets.contiguous(), b, reduction=reduction,
                       ignore_index=ignore_index, class_weights=_cw(class_weights),
                       label_smoothing=label_smoothing, z_loss_scale=z_loss, softcap=softcap,
                       logit_scale=logit_scale, shift_seq_len=shift_seq_len,
                       grad_weight_fp32=fp32_grads, return_lse=True, return_grad=grads,
                       grad_output=g, error_flags=False, stream=_stream(hidden))
    empty = hidden.new_empty((0,))
    gh = r.grad_hidden.to(hidden.dtype) if need_hidden else empty
    gw_dtype = torch.float32 if in_forward else weight.dtype
    gw = r.grad_weight.to(gw_dtype) if need_weight else weight.new_empty((0,))
    gb = r.grad_bias.to(gw_dtype) if need_bias else weight.new_empty((0,))
    return r.loss, r.lse, gh, gw, gb


@_linear_ce.register_fake
def _linear_ce_fake(hidden, weight, bias, targets, class_weights, grad_output, ignore_index,
                    reduction, label_smoothing, z_loss, softcap, logit_scale, shift_seq_len,
                    compute_dtype, need_hidden, need_weight, need_bias):
    n = hidden.shape[0]
    loss = hidden.new_empty((n,) if reduction == FCE_REDUCTION_NONE else (), dtype=torch.float32)
    lse = hidden.new_empty((n,), dtype=torch.float32)
    gh = hidden.new_empty(hidden.shape) if need_hidden else hidden.new_empty((0,))
    in_forward = grad_output is None and reduction != FCE_REDUCTION_NONE
    gw_dtype = torch.float32 if in_forward else weight.dtype
    gw = weight.new_empty(weight.shape, dtype=gw_dtype) if need_weight else weight.new_empty((0,))
    gb = (bias.new_empty(bias.shape, dtype=gw_dtype) if (need_bias and bias is not None)
          else weight.new_empty((0,)))
    return loss, lse, gh, gw, gb


def _linear_ce_setup_context(ctx, inputs, output):
    (hidden, weight, bias, targets, class_weights, grad_output, ignore_index, reduction,
     *rest) = inputs
    need_hidden, need_weight, need_bias = rest[-3:]
    _, lse, gh, gw, gb = output
    ctx.mark_non_differentiable(lse, gh, gw, gb)
    # Gradients computed in the forward with an upstream gradient of 1 can be scaled by the
    # scalar upstream gradient later; otherwise (reduction 'none', or the op called with a
    # grad_output) the backward recomputes them with the real upstream gradient.
    ctx.grad_in_forward = (bool(need_hidden or need_weight or need_bias)
                           and reduction != FCE_REDUCTION_NONE and grad_output is None)
    ctx.computed = (bool(need_hidden), bool(need_weight), bool(need_bias and bias is not None))
    ctx.has_bias = bias is not None
    ctx.grad_dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
    ctx.options = (ignore_index, reduction, *rest[:-3])  # ... through compute_dtype
    needs = getattr(ctx, "needs_input_grad", (True, True, True))
    need = (bool(needs[0]), bool(needs[1]), bool(needs[2]) and bias is not None)
    if ctx.grad_in_forward and all(c or not n for c, n in zip(ctx.computed, need)):
        # the inputs are not needed again: do not keep them alive
        ctx.save_for_backward(gh, gw, gb, None, None, None, None, None)
    else:
        ctx.save_for_backward(gh, gw, gb, hidden, weight, bias, targets, class_weights)


def _scale(grad: Tensor, g: Tensor) -> Tensor:
    # g: a 0-d float32 upstream gradient; grad keeps its dtype.
    return grad * g if grad.dtype == torch.float32 else grad * g.to(grad.dtype)


def _linear_ce_autograd_backward(ctx, grad_loss, grad_lse, _gh, _gw, _gb):
    need = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]),
            bool(ctx.needs_input_grad[2]) and ctx.has_bias)
    gh, gw, gb, hidden, weight, bias, targets, class_weights = ctx.saved_tensors
    if ctx.grad_in_forward and all(c or not n for c, n in zip(ctx.computed, need)):
        out = [_scale(g, grad_loss).to(dt) if n else None
               for g, n, dt in zip((gh, gw, gb), need, ctx.grad_dtypes)]
    else:  # recompute with the real upstream gradient (per row for reduction 'none')
        _, _, gh, gw, gb = _linear_ce(hidden, weight, bias, targets, class_weights, grad_loss,
                                      *ctx.options, *need)
        out = [g if n else None for g, n in zip((gh, gw, gb), need)]
    return tuple(out) + (None,) * 14


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


def cross_entropy(input: Tensor, target: Tensor, weight: Optional[Tensor] = None,
                  ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0, *, z_loss: float = 0.0, softcap: float = 0.0,
                  logit_scale: float = 1.0, shift_seq_len: int = 0) -> Tensor:
    """torch.nn.functional.cross_entropy, fused (one read of the logits in the forward, one
    read and one write in the backward), plus:

    z_loss        lambda: adds lambda * lse^2 per row (PaLM);
    softcap       c > 0: logits become c * tanh(logits / c) first (Gemma 2);
    logit_scale   s: logits are multiplied by s before anything else;
    shift_seq_len T > 0: causal LM shift without a copy: row b*T+t of the (flattened) logits
                  is scored against target b*T+t+1 and the last position of each sequence is
                  ignored. Give input [B*T, V] (or [B, T, V] flattened) and target [B*T].

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
    loss, _ = _ce_forward(logits, tgt, weight, int(ignore_index), red, float(label_smoothing),
                          float(z_loss), float(softcap), float(logit_scale), int(shift_seq_len))
    if red == FCE_REDUCTION_NONE and out_shape is not None:
        loss = loss.reshape(out_shape)
    return loss


def linear_cross_entropy(input: Tensor, linear_weight: Tensor, target: Tensor, *,
                         linear_bias: Optional[Tensor] = None, weight: Optional[Tensor] = None,
                         reduction: str = "mean", ignore_index: int = -100,
                         label_smoothing: float = 0.0, z_loss: float = 0.0,
                         softcap: float = 0.0, logit_scale: float = 1.0,
                         shift_seq_len: int = 0) -> Tensor:
    """cross_entropy(F.linear(input, linear_weight, linear_bias), target, ...) without ever
    holding the [N, V] logits (fce_linear_ce).

    input [..., D] (leading dimensions flattened), linear_weight [V, D] (an nn.Linear(D, V) or a
    tied embedding's weight), linear_bias [V], target [...] (the leading dimensions of input),
    weight [V] class weights; the other keywords as in :func:`cross_entropy`. Under autocast the
    matmul runs in the autocast dtype. The loss is float32; for reduction 'none' it has the shape
    of target.
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
    dev = input.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        cdt = torch.get_autocast_dtype(dev)
    else:
        for name, t in (("linear_weight", linear_weight), ("linear_bias", linear_bias)):
            if t is not None and t.dtype != input.dtype:
                raise TypeError(f"{name} has dtype {t.dtype} but input has {input.dtype} "
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
    in_forward = red != FCE_REDUCTION_NONE
    loss, _, _, _, _ = _linear_ce(
        hidden, linear_weight, linear_bias, tgt, weight, None, int(ignore_index), red,
        float(label_smoothing), float(z_loss), float(softcap), float(logit_scale),
        int(shift_seq_len), _CODE_OF_TORCH[cdt], bool(need_h and in_forward),
        bool(need_w and in_forward), bool(need_b and in_forward))
    if red == FCE_REDUCTION_NONE:
        loss = loss.reshape(target.shape)
    return loss


class _LossOptions(torch.nn.Module):
    """The options both loss modules hold (torch.nn.CrossEntropyLoss's, plus fusedce's)."""

    def __init__(self, weight: Optional[Tensor] = None, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0, *, z_loss: float = 0.0,
                 softcap: float = 0.0, logit_scale: float = 1.0, shift_seq_len: int = 0):
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

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, "
                f"softcap={self.softcap}, logit_scale={self.logit_scale}, "
                f"shift_seq_len={self.shift_seq_len}")


class CrossEntropyLoss(_LossOptions):
    """torch.nn.CrossEntropyLoss with fusedce's :func:`cross_entropy` (and its extra options)."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return cross_entropy(input, target, self.weight, self.ignore_index, self.reduction,
                             self.label_smoothing, z_loss=self.z_loss, softcap=self.softcap,
                             logit_scale=self.logit_scale, shift_seq_len=self.shift_seq_len)


class LinearCrossEntropyLoss(_LossOptions):
    """Loss of a language-model head: forward(input [..., D], linear_weight [V, D], target,
    linear_bias=None) = :func:`linear_cross_entropy`. The head's weight is an argument, so a
    tied embedding or an nn.Linear's weight can be passed as it is."""

    def forward(self, input: Tensor, linear_weight: Tensor, target: Tensor,
                linear_bias: Optional[Tensor] = None) -> Tensor:
        return linear_cross_entropy(
            input, linear_weight, target, linear_bias=linear_bias, weight=self.weight,
            reduction=self.reduction, ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing, z_loss=self.z_loss, softcap=self.softcap,
            logit_scale=self.logit_scale, shift_seq_len=self.shift_seq_len)

