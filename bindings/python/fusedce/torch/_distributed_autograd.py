"""The autograd Functions of :mod:`fusedce.torch.distributed`, over the C calls and collectives
of :mod:`fusedce.torch._distributed_calls`. Each takes the options as one
:class:`fusedce._options.CEOptions`, the outputs asked of the library as one
:class:`fusedce._options.Want` and the shard as one ``Layout``.
"""

from __future__ import annotations

import torch

from .._options import NOTHING
from . import _calls as _tc
from ._distributed_calls import (SCATTER, _ce_backward, _ce_forward, _gather_tokens,
                                 _linear_backward, _linear_forward, _linear_fused)
from ._ops import _f32, _hand_out_once, _non_differentiable


def _all_rows(hidden, layout, reduce_grad_hidden):
    """hidden's rows of the whole group under sequence parallelism (reduce_grad_hidden ==
    SCATTER: each rank holds its own rows, gathered here), else hidden itself."""
    if reduce_grad_hidden == SCATTER:
        return _gather_tokens(hidden, layout.group, layout.size)
    return hidden


def _loss_differentiable(ctx, outputs, gathered) -> tuple:
    """A two-phase Function's outputs (loss, lse, z_loss, accuracy, argmax, entropy, gathered
    statistics): the loss, lse and the entropy differentiable (docs/semantics.md rule 18), and
    no zero gradients made for what got none."""
    loss, lse, zl, acc, am, ent = outputs
    ctx.set_materialize_grads(False)
    ctx.entropy = ent is not None  # (the statistics carry the entropy's sums)
    _non_differentiable(ctx, zl, acc, am, gathered)
    return loss, lse, zl, acc, am, ent, gathered


class _VocabParallelCE(torch.autograd.Function):
    """Returns (loss, lse, z_loss, accuracy, argmax, entropy, gathered statistics), None for what
    was not asked for."""

    @staticmethod
    def forward(ctx, logits, targets, cw, layout, opts, want, check, inplace):
        stream = _tc._stream(logits)
        outputs, gathered = _ce_forward(logits, targets, cw, layout, opts, want, check, stream)
        ctx.save_for_backward(logits, targets, cw, gathered)
        ctx.layout, ctx.opts, ctx.inplace = layout, opts, inplace
        return _loss_differentiable(ctx, outputs, gathered)

    @staticmethod
    def backward(ctx, grad_loss, grad_lse, _zl, _acc, _am, grad_entropy, _gathered):
        nones = (None,) * 7
        if (grad_loss is None and grad_lse is None and grad_entropy is None) or \
                not ctx.needs_input_grad[0]:
            return (None,) + nones
        logits, targets, cw, gathered = ctx.saved_tensors
        if ctx.inplace:
            _hand_out_once(ctx)
        grad = _ce_backward(logits, targets, cw, gathered, ctx.layout, ctx.opts, grad_loss,
                            ctx.inplace, grad_lse, grad_entropy, ctx.entropy)
        return (grad,) + nones


class _VocabParallelLinearCE(torch.autograd.Function):
    """Returns (loss, lse, z_loss, accuracy, argmax, entropy, gathered statistics), None for what
    was not asked for."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, cw, layout, opts, cdt, budget, want,
                check, reduce_grad_hidden):
        stream = _tc._stream(hidden)
        hidden = _all_rows(hidden, layout, reduce_grad_hidden)
        outputs, gathered = _linear_forward(
            hidden, weight, bias, targets, cw, layout, opts, cdt, budget, want, check, stream)
        # the inputs (alive anyway: parameters and the [N, D] activations; under sequence
        # parallelism the gathered rows, as Megatron keeps them) and the statistics
        ctx.save_for_backward(hidden, weight, bias, targets, cw, gathered)
        ctx.layout, ctx.opts, ctx.cdt, ctx.budget = layout, opts, cdt, budget
        ctx.reduce_grad_hidden = reduce_grad_hidden
        return _loss_differentiable(ctx, outputs, gathered)

    @staticmethod
    def backward(ctx, grad_loss, grad_lse, _zl, _acc, _am, grad_entropy, _gathered):
        nones = (None,) * 9
        if grad_loss is None and grad_lse is None and grad_entropy is None:
            return (None,) * 3 + nones
        hidden, weight, bias, targets, cw, gathered = ctx.saved_tensors
        need = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]),
                bias is not None and bool(ctx.needs_input_grad[2]))
        if not any(need):
            return (None,) * 3 + nones
        return _linear_backward(hidden, weight, bias, targets, cw, gathered, ctx.layout,
                                ctx.opts, ctx.cdt, ctx.budget, need, ctx.reduce_grad_hidden,
                                grad_loss, grad_lse, grad_entropy, ctx.entropy) + nones


class _VocabParallelLinearCEFused(torch.autograd.Function):
    """Reductions mean and sum with a gradient: ONE fce_vp_linear_ce in the forward makes the
    loss and the gradients for an upstream 1 (∂hidden all-reduced there); the backward scales
    them by the scalar upstream gradient in place (fce_scale_gradient: nothing is touched when it
    is exactly 1) and hands them out. A second backward through the graph (retain_graph) makes
    them again with the real upstream gradient (the collectives again, on every rank), as does
    one where lse or the entropy got a gradient (docs/semantics.md rule 18: their terms join
    the loss's in that call). Returns (loss, lse, z_loss, accuracy, argmax, entropy), None for
    what was not asked for."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, cw, layout, opts, cdt, budget, want,
                check, reduce_grad_hidden):
        need = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]),
                bias is not None and bool(ctx.needs_input_grad[2]))
        loss, lse, zl, acc, am, grads, ent = _linear_fused(
            _all_rows(hidden, layout, reduce_grad_hidden), weight, bias, targets, cw, layout,
            opts, cdt, budget, want, check, need, reduce_grad_hidden, None, _tc._stream(hidden))
        # the gradients, not version-tracked (scaled in place, handed out once); the inputs
        # (alive anyway) for a second backward only
        ctx.grads, ctx.computed = grads, need
        ctx.save_for_backward(hidden, weight, bias, targets, cw)
        ctx.args = (layout, opts, cdt, budget, reduce_grad_hidden)
        ctx.entropy = ent is not None
        ctx.set_materialize_grads(False)
        _non_differentiable(ctx, zl, acc, am)
        return loss, lse, zl, acc, am, ent

    @staticmethod
    def backward(ctx, grad_loss, grad_lse, _zl, _acc, _am, grad_entropy):
        nones = (None,) * 9
        if grad_loss is None and grad_lse is None and grad_entropy is None:
            ctx.grads = None
            return (None,) * 3 + nones
        need = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]),
                ctx.computed[2] and bool(ctx.needs_input_grad[2]))
        grads = ctx.grads
        if (grads is not None and grad_loss is not None and grad_lse is None
                and grad_entropy is None and all(c or not w for c, w in zip(ctx.computed, need))):
            ctx.grads = None  # handed out: a later backward makes them again
            out = tuple(g if w else None for g, w in zip(grads, need))
            for g in out:
                if g is not None:
                    _tc.scale_(g, grad_loss)  # a no-op launch for an upstream exactly 1
        else:
            hidden, weight, bias, targets, cw = ctx.saved_tensors
            layout, opts, cdt, budget, reduce_grad_hidden = ctx.args
            up = (_f32(grad_loss) if grad_loss is not None
                  else torch.zeros((), dtype=torch.float32, device=hidden.device))
            out = _linear_fused(_all_rows(hidden, layout, reduce_grad_hidden), weight, bias,
                                targets, cw, layout, opts, cdt, budget, NOTHING, False, need,
                                reduce_grad_hidden, up, _tc._stream(hidden), grad_lse,
                                grad_entropy, ctx.entropy)[5]
        return out + nones
