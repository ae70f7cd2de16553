"""The autograd Function of :func:`fusedce.torch.distributed.vocab_parallel_linear_distill`: the
rounds of statistics from hidden states (``fce_vp_linear_distill_stats``, each all-gathered over
the group), the loss from the last round (``fce_vp_distill_loss``), and in the backward, from the
saved last round, this rank's partial ∂hidden and the gradient of its weight shard
(``fce_vp_linear_distill_backward``); ∂hidden is all-reduced (sum, float32) over the group as
the linear cross-entropy's is, then cast to hidden's dtype. The calls are
:mod:`fusedce.vocab_parallel`'s on torch tensors (the current stream, torch's allocator); each
workspace is the call's full-speed size within the budget, never below its minimum.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from .. import vocab_parallel as vp
from ._distributed_calls import _all_gather, _reduce_grad_hidden
from ._vp_distill import outputs

_SIZES: Dict[tuple, Tuple[int, int]] = {}  # the workspace queries' (min, optimal) bytes


def _cast(hidden, weight, teacher_hidden, teacher_weight, cdt):
    """The four inputs in the compute dtype: the hidden states with last stride 1, the weight
    shards dense."""
    def rows(t):
        t = t.to(cdt)
        return t if t.stride(-1) == 1 else t.contiguous()

    return (rows(hidden), weight.to(cdt).contiguous(), rows(teacher_hidden),
            teacher_weight.to(cdt).contiguous())


def _workspace_bytes(query, key: tuple, budget: int, *args, **kw) -> Tuple[int, int]:
    """(the bytes to use, the full-speed size) of a call whose workspace query is ``query``:
    the full-speed size within ``budget``, never below the minimum (queried once per key)."""
    sizes = _SIZES.get(key)
    if sizes is None:
        if len(_SIZES) > 1024:
            _SIZES.clear()
        sizes = _SIZES[key] = query(*args, **kw)
    lo, hi = sizes
    return max(lo, min(hi, max(0, budget))), hi


def _where(h) -> dict:
    return dict(backend="cuda" if h.is_cuda else "cpu", dtype=h.dtype)


def linear_distill_forward(h, w, th, tw, targets, layout, kw: dict, budget: int,
                           return_lse: bool):
    """(loss, lse or None, the last round's gathered statistics [size, rows, VP_STATS]) of the
    inputs already in the compute dtype (:func:`_cast`)."""
    group, size, vs, vt = layout
    n, d = h.shape
    vl, td = tw.shape
    ws, _ = _workspace_bytes(vp.vp_linear_distill_stats_workspace_size,
                             ("stats", h.is_cuda, h.dtype, n, d, vl, td, tuple(sorted(kw.items()))),
                             budget, n, d, vl, td, **_where(h), **kw)
    gathered = None
    for rnd in range(1, vp.vp_distill_rounds(kw["divergence"], kw["beta"]) + 1):
        stats = vp.vp_linear_distill_stats(h, w, th, tw, gathered, vocab_start=vs,
                                           vocab_total=vt, round=rnd, workspace_size=ws, **kw)
        gathered = _all_gather(stats, group, size).view(size, n, vp.VP_STATS)
    res = vp.vp_distill_loss(gathered, targets, rows=n, vocab_total=vt, return_lse=return_lse,
                             error_flags=False, **kw)
    return res.loss, res.lse, gathered


def linear_distill_backward(h, w, th, tw, targets, gathered, layout, kw: dict, budget: int,
                            need, fp32_grads: bool, reduce_grad_hidden: bool, grad_output):
    """(∂hidden float32, ∂weight) of this rank, those of ``need`` (None for the other), for the
    float32 upstream ``grad_output``: ∂hidden reduced over the group by
    ``_reduce_grad_hidden``; ∂weight in the compute dtype, or float32 with ``fp32_grads``."""
    group, size, vs, vt = layout
    n, d = h.shape
    vl, td = tw.shape

    def workspace(fp32):
        return _workspace_bytes(
            vp.vp_linear_distill_backward_workspace_size,
            ("backward", h.is_cuda, h.dtype, size, n, d, vt, vl, td, fp32,
             tuple(sorted(kw.items()))),
            budget, size, n, d, vt, vl, td, grad_weight_fp32=fp32, **_where(h), **kw)

    ws, full = workspace(fp32_grads)
    if need[1] and not fp32_grads and h.dtype != torch.float32 and h.is_cuda and ws < full:
        # CUDA refuses a 16-bit grad_weight below the token-chunk plan's workspace (as
        # fce_linear_distill): accumulate it in float32 and round once at the end
        fp32_grads = True
        ws, _ = workspace(True)
    grads = vp.vp_linear_distill_backward(
        h, w, th, tw, gathered, targets, grad_output, vocab_start=vs, vocab_total=vt,
        return_grad=tuple(name for name, wanted in zip(("hidden", "weight"), need) if wanted),
        grad_hidden_dtype="float32", grad_weight_fp32=fp32_grads, workspace_size=ws, **kw)
    gh = grads.grad_hidden
    if gh is not None:  # float32: the sum exact to float32
        gh = _reduce_grad_hidden(gh, group, size, reduce_grad_hidden)
    return gh, grads.grad_weight


class VocabParallelLinearDistill(torch.autograd.Function):
    """Returns (loss, lse or None); lse is not differentiable. The teacher gets no gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher_hidden, teacher_weight, targets, layout, kw, cdt,
                budget, return_lse, reduce_grad_hidden):
        loss, lse, gathered = linear_distill_forward(
            *_cast(hidden, weight, teacher_hidden, teacher_weight, cdt), targets, layout, kw,
            budget, return_lse)
        # the inputs (alive anyway: parameters and activations) and the last round's statistics
        ctx.save_for_backward(hidden, weight, teacher_hidden, teacher_weight, targets, gathered)
        ctx.layout, ctx.kw, ctx.cdt, ctx.budget = layout, kw, cdt, budget
        ctx.reduce_grad_hidden = reduce_grad_hidden
        return outputs(ctx, loss, lse)

    @staticmethod
    def backward(ctx, grad_loss, _grad_lse):
        nones = (None,) * 9
        need = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]))
        if grad_loss is None or not any(need):
            return (None, None) + nones
        hidden, weight, teacher_hidden, teacher_weight, targets, gathered = ctx.saved_tensors
        cdt = ctx.cdt
        # a float32 weight computed in a 16-bit dtype (autocast) gets its gradient in float32
        fp32_grads = weight.dtype == torch.float32 and cdt != torch.float32
        gh, gw = linear_distill_backward(
            *_cast(hidden, weight, teacher_hidden, teacher_weight, cdt), targets, gathered,
            ctx.layout, ctx.kw, ctx.budget, need, fp32_grads, ctx.reduce_grad_hidden,
            grad_loss.to(torch.float32).contiguous())
        return ((gh.to(hidden.dtype) if gh is not None else None,
                 gw.to(weight.dtype) if gw is not None else None) + nones)
