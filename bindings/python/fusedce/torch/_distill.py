"""fusedce.torch.distill and linear_distill: knowledge distillation losses (fce_distill,
fce_linear_distill) with autograd and torch.compile support; re-exported by fusedce.torch.

Per row, with the student's logits a and the teacher's t both put through ``logit_scale`` and
``softcap`` and divided by the temperature T (docs/semantics.md rule 20):
p = softmax(a / T), q = softmax(t / T);

* ``divergence="forward_kl"``: KL(q || p) = Σ q (log q − log p) (Hinton's, without T²);
* ``"reverse_kl"``: KL(p || q) = Σ p (log p − log q);
* ``"jsd"``: Liger's generalised JSD(β), m = β q + (1 − β) p:
  β KL(q || m) + (1 − β) KL(p || m) for 0 < β < 1, KL(q || p) at β = 0, KL(p || q) at β = 1.

No T² factor (as Liger): multiply the loss by T² for Hinton's scaling. Rows whose ``target``
equals ``ignore_index`` are not counted (loss 0, zero gradient); without ``target`` every row
counts. 'mean' divides the sum over the counted rows by their number (0 with a zero gradient
when none counts), 'sum' sums, 'none' gives one value per row (0 for rows not counted).

The gradient is the student's (logits; hidden states and weight); the teacher is a constant:
its tensors are detached, and cast to the student's dtype (to the autocast dtype under autocast
in :func:`linear_distill`). The losses are float32; float64 inputs are refused (TypeError),
as everywhere in fusedce.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import _alloc
from .._lib import FCE_REDUCTION_NONE
from .._options import DistillOptions, divergence_code
from . import _calls as _tc
from ._args import _float_input, _linear_dtype, _reduction
from ._distill_ops import _distill, _linear_distill


def _options(reduction, divergence, beta, temperature, ignore_index, softcap,
             logit_scale) -> DistillOptions:
    return DistillOptions.from_keywords(
        reduction=_reduction(reduction), divergence=divergence_code(divergence), beta=beta,
        temperature=temperature, ignore_index=ignore_index, softcap=softcap,
        logit_scale=logit_scale)


def _rows_target(target: Optional[Tensor], lead: tuple, fn: str) -> Optional[Tensor]:
    """The target as [N] class indices (only ignore_index is read), or None."""
    if target is None:
        return None
    if target.is_floating_point() or target.is_complex():
        raise TypeError(f"{fn}: target must hold integers (int64/int32: rows equal to "
                        f"ignore_index are not counted), got {target.dtype}")
    if tuple(target.shape) != lead:
        raise ValueError(f"{fn}: target must have the shape {lead} (the student's leading "
                         f"dimensions), got {tuple(target.shape)}")
    if target.dtype not in (torch.int64, torch.int32):
        target = target.to(torch.int64)
    return target.reshape(-1).contiguous()


def linear_args(fn: str, hidden: Tensor, weight: Tensor, teacher_hidden: Tensor,
                teacher_weight: Tensor, workspace_bytes: Optional[int],
                names: Tuple[str, str, str] = ("weight", "teacher_weight", "V")) -> tuple:
    """The checks of a linear distillation's tensors, ``names`` those of the two weights and of
    their rows in the messages: (hidden's leading dimensions, D, D', the compute dtype, the
    workspace budget in bytes)."""
    w_name, tw_name, rows = names
    if hidden.dim() < 1:
        raise ValueError(f"{fn}: hidden must be [..., D], got a scalar")
    d = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != d:
        raise ValueError(f"{fn}: {w_name} must be [{rows}, {d}], got {tuple(weight.shape)}")
    v = weight.shape[0]
    lead = tuple(hidden.shape[:-1])
    if teacher_hidden.dim() < 1 or tuple(teacher_hidden.shape[:-1]) != lead:
        raise ValueError(f"{fn}: teacher_hidden must be [{', '.join(map(str, lead))}, D'] (the "
                         f"leading dimensions of hidden), got {tuple(teacher_hidden.shape)}")
    td = teacher_hidden.shape[-1]
    if teacher_weight.dim() != 2 or tuple(teacher_weight.shape) != (v, td):
        raise ValueError(f"{fn}: {tw_name} must be [{v}, {td}] (the student's classes, the "
                         f"teacher's hidden size), got {tuple(teacher_weight.shape)}")
    cdt = _linear_dtype(fn, (("hidden", hidden), (w_name, weight)))
    _float_input(teacher_hidden, fn, "teacher_hidden")
    _float_input(teacher_weight, fn, tw_name)
    budget = (_alloc.default_workspace_bytes() if workspace_bytes is None
              else int(workspace_bytes))
    if budget < 0:
        raise ValueError(f"{fn}: workspace_bytes must be >= 0, got {workspace_bytes}")
    return lead, d, td, cdt, budget


def _finish(loss: Tensor, opts: DistillOptions, lead: tuple) -> Tensor:
    return loss.reshape(lead) if opts.reduction == FCE_REDUCTION_NONE else loss


def distill(student_logits: Tensor, teacher_logits: Tensor, *, divergence: str = "forward_kl",
            beta: float = 0.5, temperature: float = 1.0, target: Optional[Tensor] = None,
            ignore_index: int = -100, reduction: str = "mean", softcap: float = 0.0,
            logit_scale: float = 1.0) -> Tensor:
    """The divergence between the student's and the teacher's softmax per row (the module's
    docstring says which), differentiable with respect to ``student_logits`` only.

    student_logits [..., V] (leading dimensions flattened into rows; a row stride larger than V
    is used without a copy), teacher_logits of the same shape (cast to the student's dtype),
    target [...] (the leading dimensions) or None. ``beta`` (JSD, in [0, 1]) and
    ``temperature`` (> 0) are checked by the library. Returns a float32 loss: () for 'mean'
    and 'sum', the leading dimensions for 'none'. When autograd needs the gradient, 'mean' and
    'sum' write it in the forward's one call (the backward scales it by the upstream scalar);
    'none' computes it in the backward."""
    fn = "fusedce.torch.distill"
    _float_input(student_logits, fn, "student_logits")
    _float_input(teacher_logits, fn, "teacher_logits")
    if student_logits.dim() < 1:
        raise ValueError(f"{fn}: student_logits must be [..., V], got a scalar")
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(f"{fn}: teacher_logits must have the shape of student_logits "
                         f"{tuple(student_logits.shape)}, got {tuple(teacher_logits.shape)}")
    lead, v = tuple(student_logits.shape[:-1]), student_logits.shape[-1]
    opts = _options(reduction, divergence, beta, temperature, ignore_index, softcap,
                    logit_scale)
    logits = student_logits.reshape(-1, v)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    teacher = teacher_logits.detach().to(logits.dtype).reshape(-1, v)
    if teacher.stride(-1) != 1:
        teacher = teacher.contiguous()
    tgt = _rows_target(target, lead, fn)
    need_grad = torch.is_grad_enabled() and logits.requires_grad
    loss, _ = _distill(logits, teacher, tgt, None, *opts.as_op_args(),
                       bool(need_grad and not opts.per_row))
    return _finish(loss, opts, lead)


def linear_distill(hidden: Tensor, weight: Tensor, teacher_hidden: Tensor,
                   teacher_weight: Tensor, *, divergence: str = "forward_kl", beta: float = 0.5,
                   temperature: float = 1.0, target: Optional[Tensor] = None,
                   ignore_index: int = -100, reduction: str = "mean", softcap: float = 0.0,
                   logit_scale: float = 1.0, workspace_bytes: Optional[int] = None) -> Tensor:
    """:func:`distill` of ``hidden @ weight.T`` (the student's head) against
    ``teacher_hidden @ teacher_weight.T`` (the teacher's) without either [N, V] logits ever
    held whole (fce_linear_distill: token chunks, both GEMMs and the student's gradients per
    chunk); differentiable with respect to hidden and weight.

    hidden [..., D], weight [V, D] (an nn.Linear(D, V)'s or a tied embedding's weight, no
    bias), teacher_hidden [..., D'] (the same leading dimensions), teacher_weight [V, D'] (the
    same vocabulary), target [...] or None, the other options as for :func:`distill`. Under
    autocast the matmuls run in the autocast dtype (a float32 weight then gets its gradient in
    float32 directly); outside it hidden and weight must have one dtype, the teacher's tensors
    are cast to it. ``workspace_bytes``: the memory budget beyond the inputs and the gradients
    (None: FUSEDCE_WORKSPACE_BYTES, else 1 GiB), never below the library's minimum. 'mean' and
    'sum' compute the gradients in the forward's call (scaled in the backward); 'none' in the
    backward (the logits made again, chunk by chunk)."""
    fn = "fusedce.torch.linear_distill"
    lead, d, td, cdt, budget = linear_args(fn, hidden, weight, teacher_hidden, teacher_weight,
                                           workspace_bytes)
    opts = _options(reduction, divergence, beta, temperature, ignore_index, softcap,
                    logit_scale)
    tgt = _rows_target(target, lead, fn)
    grad_on = torch.is_grad_enabled() and not opts.per_row
    loss, _, _ = _linear_distill(
        hidden.reshape(-1, d), weight, teacher_hidden.detach().reshape(-1, td),
        teacher_weight.detach(), tgt, None, *opts.as_op_args(), _tc.CODE_OF_TORCH[cdt], budget,
        bool(grad_on and hidden.requires_grad), bool(grad_on and weight.requires_grad))
    return _finish(loss, opts, lead)
