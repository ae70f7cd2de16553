"""Class-probability targets in :func:`fusedce.torch.cross_entropy` and
``linear_cross_entropy`` (torch's ``F.cross_entropy(input, probabilities)``, docs/semantics.md
rule 19): the checks of a floating target, its per-row z-loss, and the gradient of the target
itself when it requires one.

The loss and the gradient of the logits (hidden states, weight) take the class-index paths
unchanged: the library reads the dtype of the targets tensor (the logits' float dtype) as
class probabilities [N, V]. The target's own gradient, -g (1 - eps) w_j log p_j per element (g
the row's upstream gradient, / N for 'mean'), is made with torch ops from the [N, V] logits
(those of ``linear_cross_entropy`` computed whole for it): the uncommon case, at torch's cost.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._lib import FCE_REDUCTION_MEAN
from .._options import N_OP_ARGS, CEOptions
from ._args import _transform


def check_options(opts: CEOptions, ignore_index: int, want, check_targets: bool, fn: str):
    """Refuse, naming the argument, what has no meaning without a target class (the library
    refuses the same; here the message names the keyword of ``fn``)."""
    refused = (("use_token_scaling", opts.token_scaling),
               ("shift_seq_len / shift", opts.shift_seq_len != 0 or opts.shift != 0),
               ("return_token_accuracy", want.accuracy),
               ("check_targets", check_targets))
    for name, on in refused:
        if on:
            raise ValueError(f"{fn}: {name} is not supported with class-probability targets "
                             "(there is no target class)")
    if ignore_index >= 0:  # torch's rule: a non-negative ignore_index is refused
        raise ValueError(f"{fn}: ignore_index ({ignore_index}) is not supported with "
                         "class-probability targets (every row is scored)")


def target(target: Tensor, logits_shape: tuple, dtype: torch.dtype, fn: str,
           autocast: bool = False) -> Tensor:
    """A floating target as the library takes it: the shape of the logits (given as
    ``logits_shape`` before any flattening), dense, of ``dtype`` (the logits'; under autocast
    the target is cast to it, as F.linear's inputs)."""
    if tuple(target.shape) != tuple(logits_shape):
        raise ValueError(f"{fn}: target of class probabilities must have the shape of the "
                         f"logits {tuple(logits_shape)}, got {tuple(target.shape)}")
    if target.dtype != dtype:
        if not autocast:
            raise TypeError(f"{fn}: target (class probabilities) has dtype {target.dtype} but "
                            f"the logits have {dtype}: they must match")
        target = target.to(dtype)
    return target


def z_loss_rows(lse: Tensor, opts: CEOptions) -> Tensor:
    """The per-row z-loss of reduction 'none': lambda lse^2 on every row (none is ignored)."""
    lse = lse.detach()
    return opts.z_loss * lse.square() if opts.z_loss else torch.zeros_like(lse)


class _TargetGrad(torch.autograd.Function):
    """Zero (the loss's shape) in the forward; in the backward the gradient of the loss with
    respect to the probabilities q [N, V]: -g (1 - eps) w_j log p_j, p the softmax of the
    scaled, capped logits: ``source`` itself, or ``source`` · weightᵀ + bias (the hidden
    states of linear_cross_entropy), made in the backward only. With ``lse`` [N] (a vocabulary
    shard's columns, fusedce.torch.distributed): log p_j = a_j - lse, the whole row's lse. The
    options travel as the scalars of CEOptions.as_op_args (what torch.compile traces through)."""

    @staticmethod
    def forward(ctx, q, source, weight, bias, class_weights, lse, *op_args):
        opts = CEOptions.from_op_args(*op_args)
        ctx.opts = opts
        ctx.save_for_backward(source, weight, bias, class_weights, lse)
        return q.new_zeros((q.shape[0],) if opts.per_row else (), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        source, weight, bias, w, lse = ctx.saved_tensors
        opts = ctx.opts
        z = source if weight is None else torch.nn.functional.linear(source, weight, bias)
        a = _transform(z, opts.logit_scale, opts.softcap)
        log_p = torch.log_softmax(a, dim=-1) if lse is None else a - lse.float().unsqueeze(1)
        g = grad.to(log_p.dtype)
        if opts.per_row:
            g = g.unsqueeze(1)
        elif opts.reduction == FCE_REDUCTION_MEAN:
            g = g / log_p.shape[0]
        dq = -(1.0 - opts.label_smoothing) * g * log_p
        if w is not None:
            dq = dq * w.to(log_p.dtype)
        return (dq,) + (None,) * (5 + N_OP_ARGS)


def with_target_grad(loss: Tensor, q: Tensor, source: Tensor, weight: Optional[Tensor],
                     bias: Optional[Tensor], class_weights: Optional[Tensor],
                     opts: CEOptions, lse: Optional[Tensor] = None) -> Tensor:
    """``loss`` plus a zero carrying the gradient of q when q requires one (else ``loss``):
    the logits are ``source`` [N, V], or ``source`` · weightᵀ + bias (all taken detached);
    ``lse`` [N]: they are a vocabulary shard's columns and lse the whole rows'."""
    if not (torch.is_grad_enabled() and q.requires_grad):
        return loss
    detached = [t.detach() if t is not None else None for t in (source, weight, bias, lse)]
    return loss + _TargetGrad.apply(q, *detached[:3], class_weights, detached[3],
                                    *opts.as_op_args())
