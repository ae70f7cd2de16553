"""The autograd Function of :func:`fusedce.torch.distributed.vocab_parallel_distill`: the rounds
of statistics (``fce_vp_distill_stats``, each all-gathered over the group), the loss from the last
round (``fce_vp_distill_loss``), and in the backward, from the saved last round and without a
collective, the gradient of this rank's student columns (``fce_vp_distill_backward``). The calls
are :mod:`fusedce.vocab_parallel`'s on torch tensors (the current stream, torch's allocator).
"""

from __future__ import annotations

import torch

from .. import vocab_parallel as vp
from ._distributed_calls import _all_gather


def distill_forward(student, teacher, targets, layout, kw: dict, return_lse: bool):
    """(loss, lse or None, the last round's gathered statistics [size·rows, VP_STATS])."""
    group, size, vs, vt = layout
    n = student.shape[0]
    gathered = None
    for rnd in range(1, vp.vp_distill_rounds(kw["divergence"], kw["beta"]) + 1):
        stats = vp.vp_distill_stats(student, teacher, gathered, vocab_start=vs, vocab_total=vt,
                                    round=rnd, **kw)
        gathered = _all_gather(stats, group, size)
    res = vp.vp_distill_loss(gathered, targets, rows=n, vocab_total=vt, return_lse=return_lse,
                             error_flags=False, **kw)
    return res.loss, res.lse, gathered


def outputs(ctx, loss, lse):
    """A distillation Function's outputs (loss, lse or None): lse not differentiable, and no
    zero gradient made for an output that got none."""
    ctx.set_materialize_grads(False)
    if lse is not None:
        ctx.mark_non_differentiable(lse)
    return loss, lse


class VocabParallelDistill(torch.autograd.Function):
    """Returns (loss, lse or None); lse is not differentiable. The teacher gets no gradient."""

    @staticmethod
    def forward(ctx, student, teacher, targets, layout, kw, return_lse):
        loss, lse, gathered = distill_forward(student, teacher, targets, layout, kw, return_lse)
        ctx.save_for_backward(student, teacher, targets, gathered)
        ctx.layout, ctx.kw = layout, kw
        return outputs(ctx, loss, lse)

    @staticmethod
    def backward(ctx, grad_loss, _grad_lse):
        nones = (None,) * 5
        if grad_loss is None or not ctx.needs_input_grad[0]:
            return (None,) + nones
        student, teacher, targets, gathered = ctx.saved_tensors
        _, _, vs, vt = ctx.layout
        grad = vp.vp_distill_backward(student, teacher, gathered, targets,
                                      grad_loss.to(torch.float32).contiguous(), vocab_start=vs,
                                      vocab_total=vt, **ctx.kw)
        return (grad,) + nones
