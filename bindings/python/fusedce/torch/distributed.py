"""fusedce.torch.distributed: cross-entropy over a vocabulary sharded across a torch.distributed
group (Megatron's tensor parallelism), with autograd.

    import fusedce.torch
    from fusedce.torch.distributed import vocab_parallel_cross_entropy

    # logits [s, b, V/P]: this rank's columns; target [s, b]: global class indices
    loss = vocab_parallel_cross_entropy(logits, target, label_smoothing, group=tp_group)  # [s, b]

    # the fused output layer: weight_shard [V/P, D] (this rank's rows), the logits never formed
    loss = vocab_parallel_linear_cross_entropy(hidden, weight_shard, target, group=tp_group)

One step: each rank writes 8 float32 per token of statistics of its shard (``fce_vp_stats`` /
``fce_vp_linear_stats``), ONE ``all_gather_into_tensor`` over the group exchanges them (32·P
bytes per token: never the logits), and every rank combines them into the loss of the whole
vocabulary (``fce_vp_loss``), identical on every rank. The backward reads the saved statistics
(no collective) for the gradient of the rank's own shard (``fce_vp_backward`` /
``fce_vp_linear_backward``); the linear version all-reduces (sum) the float32 partial ∂hidden
over the group, then casts it to hidden's dtype. Megatron's own implementation makes three
all-reduces (max, target logit, sum of exponentials) and keeps a float32 softmax [s, b, V/P] for
the backward; this one keeps only the statistics [P, s·b, 8] and a reference to the logits.

The linear version with a gradient and reduction 'mean' or 'sum' (libfusedce >= 0.5) runs the
whole step in the forward instead, in ONE library call (``fce_vp_linear_ce``) that, on CUDA
when the workspace budget reaches its full-speed size (about 1 GiB at large vocabularies),
makes each rank's logits once (6·N·D·V/P FLOPs per rank, against 8·N·D·V/P for the two phases,
which make them again in the backward; below that size the call itself gathers once and makes
them twice): the library issues the statistics' all-gather itself, through a callback that runs
``all_gather_into_tensor`` on the group, once per token chunk (once in all when it gathers
once, and on the CPU backend), and writes the gradients for an upstream 1; ∂hidden is all-reduced
in the forward too, and the backward only scales the gradients by the upstream scalar. Reduction
'none' (a per-token upstream gradient) and calls without a gradient keep the two phases.

Collectives are ``torch.distributed`` calls on ``group``, so they run over NCCL for CUDA tensors
(the library on ``torch.cuda.current_stream()``, ordered with NCCL as every torch collective is)
and over gloo for CPU tensors (the library's CPU backend). Every rank of the group must make the
same call: the same options, rows, targets and ``vocab_total``, and ask for the same gradients.

Shards. By default the shards are equal and in rank order, as Megatron's VocabUtility: the rank
of group rank r holds classes [r·V/P, (r+1)·V/P) with V/P its logits' last dimension (all ranks
equal), and vocab_total = P·V/P. Uneven or permuted shards: pass ``vocab_start`` (this rank's
first class) AND ``vocab_total`` (the whole vocabulary, the same on every rank) on every rank.
``vocab_total`` is required then, not all-reduced from the local sizes: that would be one more
collective and a host synchronisation per call (not CUDA-graph capturable) for a number the
caller knows; :func:`shard_range` gives the usual uneven split. Shards that do not tile
[0, vocab_total) exactly are never a silent wrong answer: the library gives the rows concerned a
NaN loss and gradient and sets FCE_FLAG_SHARDS_INCONSISTENT (``check_targets=True`` raises).

Group. ``group=None`` takes Megatron's tensor-parallel group when Megatron is loaded and its
model parallelism is initialised (``megatron.core.parallel_state``), else the default group.
Without an initialised torch.distributed (and no group) the call runs as one rank.

Megatron compatibility (megatron.core.tensor_parallel.vocab_parallel_cross_entropy(
vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None)):

* the same positional arguments (``group`` is also accepted as ``tp_group=``), shapes and
  per-token float32 loss (reduction 'none' is the default here); the gradient has the logits'
  dtype and shape; without label smoothing the loss and gradient equal Megatron's to float32
  rounding (Megatron computes in float32 too);
* label smoothing: ours is torch's (F.cross_entropy's, docs/semantics.md rule 8) over the WHOLE
  vocabulary: (1−ε)·(−log p_y) + ε/V·Σ_j(−log p_j), the same on every rank and equal to the
  unsharded F.cross_entropy(label_smoothing=ε). Megatron's uses the NeMo form with
  ε' = ε·V/(V−1) (mass ε/(V−1) on each non-target class) — which is torch's formula with ε' — but
  takes V and the mean of log p_j over the rank's LOCAL shard only, so for tensor-parallel size
  > 1 its loss differs from rank to rank and its gradient is not that of any one loss
  (Megatron-LM#737, Megatron-LM#7464). ``label_smoothing_formula="megatron"`` applies the
  NeMo/Megatron coefficient ε·V/(V−1) with the global V: Megatron's result exactly at
  tensor-parallel size 1, and what its formula intends for larger sizes;
* Megatron has no ignore_index (it masks the per-token loss afterwards with a loss mask); here
  ``ignore_index`` (default -100, as torch) gives those rows loss 0 and a zero gradient. A target
  outside [0, V) that is not ignore_index gives NaN here (Megatron silently scores it as
  log-sum-exp, the target logit taken as 0); ``check_targets=True`` raises IndexError instead;
* Megatron modifies the logits in place when they are float32 (the softmax is written over
  them); this implementation never writes the logits (except with ``inplace_backward=True``,
  and only in the backward).

Everything else that :func:`fusedce.torch.cross_entropy` takes works here with the same meaning,
over the whole vocabulary: ``weight`` (class weights [vocab_total], the whole vocabulary's, on
every rank), ``reduction``, ``z_loss``, ``softcap``, ``logit_scale``, ``shift_seq_len``/``shift``
(rows b·T+t: batch-major; Megatron's [s, b] layout is sequence-major, whose labels are shifted
already), ``use_token_scaling``, ``return_z_loss``, ``return_token_accuracy``,
``return_predicted_tokens`` (global class indices), ``return_lse``, ``return_entropy``,
``check_targets``. The returned lse and entropy are differentiable (docs/semantics.md rule 18:
their upstream gradients join the loss's in the one backward call); the entropy makes every
rank's statistics carry one more sum (``options->vp_entropy``). The fused linear step, whose
forward makes the gradients for an upstream 1, makes them again in the backward when lse or the
entropy gets a gradient (one more fce_vp_linear_ce, collectives included).

Class-probability targets (docs/semantics.md rule 19, torch's ``F.cross_entropy(input,
probabilities)`` over the whole vocabulary): a floating ``target`` is THIS RANK'S SHARD of the
probabilities, [..., V_local] (its columns of q [..., vocab_total]), of the logits' dtype (the
matmul's for the linear call). What :func:`fusedce.torch.cross_entropy` refuses with them is
refused here too (use_token_scaling, the shift, return_token_accuracy, check_targets, a
non-negative ignore_index). A target that requires a gradient gets its own, -g (1 - eps) w_j
log p_j on this rank's columns (log p_j = a_j - lse, lse the whole row's), as torch's; with
``sequence_parallel`` that is refused.

Distillation (:func:`vocab_parallel_distill`, docs/semantics.md rule 22): the student's and the
teacher's logits sharded the same way, :func:`fusedce.torch.distill`'s divergence over the whole
vocabulary; one all-gather of 8 float32 per token (two for the JSD with 0 < beta < 1). From
hidden states (:func:`vocab_parallel_linear_distill`): each rank holds its rows of the student's
and the teacher's output weights, :func:`fusedce.torch.linear_distill` over the whole vocabulary
without either model's logits ever whole; the same all-gathers in the forward, and in the
backward the ∂hidden all-reduce of the linear cross-entropy.

These functions are plain torch.autograd.Functions calling the C library and torch.distributed:
eager mode; torch.compile does not trace into them (they run under ``torch.compiler.disable``:
a graph break).
"""

from __future__ import annotations

import functools
import sys
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _alloc, _lib
from .._options import CEOptions, Want
from ..vocab_parallel import VP_STATS, shard_range
from . import _args as _ta  # argument handling, the return convention
from . import _soft
from ._distributed_autograd import (_VocabParallelCE, _VocabParallelLinearCE,
                                    _VocabParallelLinearCEFused)
from ._calls import _stream
from ._distill import linear_args
from ._vp_distill import VocabParallelDistill, distill_forward
from ._vp_linear_distill import (VocabParallelLinearDistill, _cast,
                                 linear_distill_forward)
from ._distributed_calls import SCATTER, Layout, _ce_forward, _gather_tokens, _linear_forward

__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_linear_cross_entropy",
           "megatron_linear_cross_entropy", "use_in_megatron", "shard_range", "VP_STATS",
           "vocab_parallel_distill", "vocab_parallel_linear_distill"]


def _eager_only(fn):
    """torch.compiler.disable(fn), without importing torch._dynamo (0.8 s) before it is loaded:
    when it is not, nothing is being compiled."""
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        disabled = getattr(fn, "_fusedce_disabled", None)
        if disabled is None:
            disabled = fn._fusedce_disabled = torch._dynamo.disable(fn, recursive=True)
        return disabled(*args, **kwargs)
    return inner


# ====================================================================== the group ====
# ====================================================================== the group ====
def _megatron_tp_group():
    """Megatron's tensor-parallel group when Megatron is loaded and initialised, else None.
    Megatron is never imported here: only a module already loaded is looked at."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None:
        return None
    try:
        if ps.model_parallel_is_initialized():
            return ps.get_tensor_model_parallel_group()
    except Exception:  # an older or partial Megatron: fall back to the default group
        return None
    return None


def _resolve_group(group):
    """(group, rank in it, its size); (None, 0, 1) without torch.distributed (no collective is
    made then; with it, even a group of one rank gets its collectives)."""
    if group is None:
        group = _megatron_tp_group()
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not "
                               "initialised")
        return None, 0, 1
    if group is None:
        group = dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise RuntimeError("this process is not a member of the given process group")
    return group, int(rank), int(dist.get_world_size(group))


def _layout(vocab_local: int, rank: int, size: int, vocab_start, vocab_total) -> Tuple[int, int]:
    """(vocab_start, vocab_total) of this rank (see the module docstring: equal shards in rank
    order by default; both given for uneven ones)."""
    if vocab_start is None:
        vt = size * vocab_local
        if vocab_total is not None and int(vocab_total) != vt:
            raise ValueError(
                f"vocab_total={vocab_total} but equal shards of {vocab_local} classes over "
                f"{size} ranks make {vt}: for uneven shards pass each rank's vocab_start too "
                "(fusedce.torch.distributed.shard_range gives a split)")
        return rank * vocab_local, vt
    if vocab_total is None:
        raise ValueError(
            "vocab_start was given without vocab_total: with uneven shards pass vocab_total (the "
            "whole vocabulary's size, the same on every rank) as well; it is not all-reduced "
            "from the local sizes (one more collective and a host sync per call)")
    # [vs, vs + vocab_local) inside [0, vt): the library checks it (fce_vp_stats,
    # fce_vp_linear_stats), naming vocab_start and vocab_total
    return int(vocab_start), int(vocab_total)


# ================================================================ public helpers ====
def _smoothing(label_smoothing: float, formula: str, vt: int) -> float:
    eps = float(label_smoothing)
    if formula == "torch":
        return eps
    if formula == "megatron":
        return eps * vt / (vt - 1) if eps and vt > 1 else eps
    raise ValueError(f"label_smoothing_formula must be 'torch' or 'megatron', got {formula!r}")


def _options(red: int, vt: int, t: int, k: int, ignore_index: int, label_smoothing: float,
             z_loss: float, softcap: float, logit_scale: float, token_scaling: bool,
             returns) -> Tuple[CEOptions, Want, Want]:
    """(opts, want, lib_want) of a call: its CEOptions (the causal shift (T, k) resolved, the
    smoothing in torch's form), the outputs the return_* flags in ``returns`` ask for, and what
    the C calls write for them (lse included)."""
    opts = CEOptions(reduction=red, ignore_index=ignore_index, label_smoothing=label_smoothing,
                     z_loss=z_loss, softcap=softcap, logit_scale=logit_scale, shift_seq_len=t,
                     shift=k, token_scaling=token_scaling)
    want = _ta.want(*returns)
    return opts, want, want.from_library(red)


def _class_weights(weight: Optional[Tensor], vt: int, device) -> Optional[Tensor]:
    if weight is None:
        return None
    if weight.dim() != 1 or weight.shape[0] != vt:
        raise ValueError(f"weight (class weights) must have shape ({vt},): the whole "
                         f"vocabulary's, on every rank; got {tuple(weight.shape)}")
    return weight.to(device=device, dtype=torch.float32).contiguous()


def _columns(class_weights: Optional[Tensor], vs: int, vl: int) -> Optional[Tensor]:
    """This rank's entries of the whole vocabulary's class weights (or None)."""
    return None if class_weights is None else class_weights[vs:vs + vl]


def _grad_mode(reduce_grad_hidden):
    return SCATTER if reduce_grad_hidden == SCATTER else bool(reduce_grad_hidden)


def _targets(target: Tensor, n: int, what: str, device) -> Tensor:
    tgt = _ta._targets(target).contiguous()
    if tgt.shape[0] != n:
        raise ValueError(f"target has {tgt.shape[0]} elements for {n} rows of {what}")
    if tgt.device != device:
        raise ValueError(f"target is on {tgt.device} but {what} is on {device}")
    return tgt


def _probabilities(target: Tensor, n: int, vl: int, dtype, what: str, device, fn: str,
                   autocast: bool = False) -> Tuple[Tensor, Tensor]:
    """A floating target: this rank's shard of the class probabilities, [..., V_local] with n
    rows, of ``dtype`` (cast to it under autocast): (q [n, V_local], which carries the target's
    gradient, and what the library takes, q detached and dense)."""
    if target.dim() < 1 or target.shape[-1] != vl:
        raise ValueError(f"{fn}: target of class probabilities must be this rank's shard "
                         f"[..., {vl}] (its columns of the probabilities), got "
                         f"{tuple(target.shape)}")
    q = _soft.target(target, tuple(target.shape), dtype, fn, autocast=autocast).reshape(-1, vl)
    if q.shape[0] != n:
        raise ValueError(f"{fn}: target has {q.shape[0]} rows of class probabilities for {n} "
                         f"rows of {what}")
    if q.device != device:
        raise ValueError(f"target is on {q.device} but {what} is on {device}")
    return q, q.detach().contiguous()


def _z_rows_from_stats(lse: Tensor, tgt: Tensor, vt: int, opts: CEOptions, gathered: Tensor,
                       size: int):
    """Per-row z-loss for reduction 'none' (_args._z_loss_rows), with token scaling's p_y
    from the target logit the gathered statistics already hold: each rank's t_r (docs/semantics.md
    rule 16; scaled and capped; 0 where the shard does not hold the target) summed over the ranks
    — exact, one term is not 0 — so no logit is recomputed and no collective is made."""
    n = lse.shape[0]
    a_y = gathered.view(size, n, -1)[:, :, 2].sum(0)  # (slot 2 in both layouts)
    # a_y is already a = c·tanh(s·z/c): the transform of _z_loss_rows must be the identity
    plain = opts.replace(softcap=0.0, logit_scale=1.0)
    return _ta._z_loss_rows(lse, tgt, vt, plain, lambda y: a_y)


@_eager_only
def vocab_parallel_cross_entropy(vocab_parallel_logits: Tensor, target: Tensor,
                                 label_smoothing: float = 0.0, group=None, *, tp_group=None,
                                 vocab_start: Optional[int] = None,
                                 vocab_total: Optional[int] = None, reduction: str = "none",
                                 ignore_index: int = -100, weight: Optional[Tensor] = None,
                                 label_smoothing_formula: str = "torch", z_loss: float = 0.0,
                                 softcap: float = 0.0, logit_scale: float = 1.0,
                                 shift_seq_len: int = 0, shift: int = 0,
                                 use_token_scaling: bool = False, return_z_loss: bool = False,
                                 return_token_accuracy: bool = False,
                                 return_predicted_tokens: bool = False, return_lse: bool = False,
                                 check_targets: bool = False, inplace_backward: bool = False,
                                 return_entropy: bool = False, batch_invariant: bool = False):
    """Cross-entropy of logits whose vocabulary is sharded over ``group``: a drop-in for
    ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy(vocab_parallel_logits, target,
    label_smoothing, tp_group)`` (see the module docstring for the differences).

    vocab_parallel_logits  [..., V_local] (Megatron: [s, b, V/P]), float32/float16/bfloat16:
                  this rank's classes [vocab_start, vocab_start + V_local).
    target        [...] (the leading dimensions): global class indices, the same on every rank;
                  or, floating, this rank's shard of class probabilities [..., V_local].
    label_smoothing  ε, torch's formula over the whole vocabulary (``label_smoothing_formula=
                  "megatron"``: Megatron/NeMo's coefficient ε·V/(V−1)).
    group / tp_group  the process group the vocabulary is sharded over (None: Megatron's
                  tensor-parallel group when initialised, else the default group).
    vocab_start, vocab_total  uneven or permuted shards: this rank's first class and the whole
                  vocabulary's size (both, on every rank). Default: equal shards in rank order.
    reduction     'none' (default, Megatron's: the float32 loss of each token, target's shape),
                  'mean' (over non-ignored tokens, class-weighted as torch) or 'sum': the same
                  value on every rank.
    inplace_backward  the backward writes the gradient over the logits (saves one [N, V_local]
                  buffer, as Megatron's float32 path; the logits' values are destroyed by the
                  backward; a second backward through the graph raises).
    batch_invariant  each token's loss ('none'), lse, entropy, predicted token and gradient row
                  are the same bits whatever the batch and the number of ranks the vocabulary is
                  sharded over (docs/semantics.md rule 21: exact statistics, all-gathered at
                  44 float32 per token instead of 8); every rank must pass it.
    Other keywords: as :func:`fusedce.torch.cross_entropy`, over the whole vocabulary.

    Returns the loss, or with a return_* flag the ``CrossEntropyOutput`` named tuple of
    :func:`fusedce.torch.cross_entropy` (``predicted_tokens``: global class indices)."""
    _lib.require_vp("fusedce.torch.distributed.vocab_parallel_cross_entropy")
    if group is not None and tp_group is not None and group is not tp_group:
        raise ValueError("pass the process group once (group= or tp_group=)")
    group, rank, size = _resolve_group(group if group is not None else tp_group)
    red = _ta._reduction(reduction)
    x = _ta._float_input(vocab_parallel_logits,
                         "fusedce.torch.distributed.vocab_parallel_cross_entropy",
                         "vocab_parallel_logits")
    if x.dim() < 1:
        raise ValueError("vocab_parallel_logits must be [..., V_local]")
    vl = x.shape[-1]
    logits = x.reshape(-1, vl)
    if logits.stride(-1) != 1 and vl > 1:
        logits = logits.contiguous()
    n = logits.shape[0]  # (rows >= 0, vocab_local >= 1: the library checks them)
    fn = "fusedce.torch.distributed.vocab_parallel_cross_entropy"
    soft = target.is_floating_point()  # this rank's shard of class probabilities
    if soft:
        q, tgt = _probabilities(target, n, vl, x.dtype, "vocab_parallel_logits", logits.device,
                                fn)
        out_shape = tuple(target.shape[:-1])
    else:
        tgt = _targets(target, n, "vocab_parallel_logits", logits.device)
        out_shape = tuple(target.shape)
    vs, vt = _layout(vl, rank, size, vocab_start, vocab_total)
    cw = _class_weights(weight, vt, logits.device)
    t, k = _ta._resolve_shift(shift, shift_seq_len, out_shape, n)
    opts, want, lib_want = _options(
        red, vt, t, k, ignore_index, _smoothing(label_smoothing, label_smoothing_formula, vt),
        z_loss, softcap, logit_scale, use_token_scaling,
        (return_z_loss, return_token_accuracy, return_predicted_tokens, return_lse,
         return_entropy))
    if batch_invariant:
        opts = opts.replace(batch_invariant=True)
    q_grad = soft and torch.is_grad_enabled() and q.requires_grad
    if soft:
        _soft.check_options(opts, ignore_index, want, check_targets, fn)
        if q_grad:  # its gradient needs the whole row's lse
            lib_want = lib_want.replace(lse=True)
    layout = Layout(group, size, vs, vt)
    if torch.is_grad_enabled() and logits.requires_grad:
        loss, lse, zl, acc, am, ent, gathered = _VocabParallelCE.apply(
            logits, tgt, cw, layout, opts, lib_want, bool(check_targets),
            bool(inplace_backward))
    else:
        (loss, lse, zl, acc, am, ent), gathered = _ce_forward(logits, tgt, cw, layout, opts,
                                                              lib_want, bool(check_targets),
                                                              _stream(logits))
    if q_grad:
        loss = _soft.with_target_grad(loss, q, logits, None, None, _columns(cw, vs, vl), opts,
                                      lse)
    return _ta._finish(want, red, out_shape, loss, lse, zl, acc, am,
                       (lambda: _soft.z_loss_rows(lse, opts)) if soft else
                       (lambda: _z_rows_from_stats(lse, tgt, vt, opts, gathered, size)), ent)


def _distill_kw(divergence, beta, temperature, reduction, ignore_index, softcap,
                logit_scale) -> dict:
    """The distillation's options as the calls of fusedce.vocab_parallel take them."""
    return dict(divergence=divergence, beta=beta, temperature=temperature, reduction=reduction,
                ignore_index=ignore_index, softcap=softcap, logit_scale=logit_scale)


def _distill_result(loss: Tensor, lse, reduction: str, out_shape: tuple, return_lse: bool):
    """A distillation's return: the loss ('none': the leading dimensions' shape), with
    ``return_lse`` (loss, lse of that shape)."""
    if reduction == "none":
        loss = loss.reshape(out_shape)
    if not return_lse:
        return loss
    return loss, lse.reshape(out_shape)


@_eager_only
def vocab_parallel_distill(student_logits: Tensor, teacher_logits: Tensor,
                           target: Optional[Tensor] = None, *, group=None,
                           vocab_start: Optional[int] = None, vocab_total: Optional[int] = None,
                           divergence: str = "forward_kl", beta: float = 0.5,
                           temperature: float = 1.0, reduction: str = "mean",
                           ignore_index: int = -100, softcap: float = 0.0,
                           logit_scale: float = 1.0, return_lse: bool = False):
    """:func:`fusedce.torch.distill` over a vocabulary sharded across ``group``: each rank passes
    its columns [vocab_start, vocab_start + V_local) of the student's logits [..., V_local] and
    of the teacher's (the same shape and dtype; the teacher gets no gradient). ``target``
    ([...], optional, the same on every rank): rows whose target is ``ignore_index`` are not
    counted. The loss ('mean' over the rows counted, 'sum', or 'none': [...]) is the unsharded
    call's to float32 rounding, the same on every rank; its gradient flows to this rank's
    student columns. ``group``, ``vocab_start``, ``vocab_total``: as
    :func:`vocab_parallel_cross_entropy`'s. ``return_lse``: (loss, the student's log-sum-exp of
    a / T over the whole row, [...], not differentiable)."""
    fn = "fusedce.torch.distributed.vocab_parallel_distill"
    _lib.require_vp(fn)
    group, rank, size = _resolve_group(group)
    x = _ta._float_input(student_logits, fn, "student_logits")
    if x.dim() < 1:
        raise ValueError("student_logits must be [..., V_local]")
    if tuple(teacher_logits.shape) != tuple(x.shape) or teacher_logits.dtype != x.dtype:
        raise ValueError(f"teacher_logits must have student_logits' shape {tuple(x.shape)} and "
                         f"dtype {x.dtype}, got {tuple(teacher_logits.shape)} "
                         f"{teacher_logits.dtype}")
    vl = x.shape[-1]
    out_shape = tuple(x.shape[:-1])
    student = x.reshape(-1, vl)
    teacher = teacher_logits.detach().reshape(-1, vl)
    if vl > 1:
        student = student if student.stride(-1) == 1 else student.contiguous()
        teacher = teacher if teacher.stride(-1) == 1 else teacher.contiguous()
    n = student.shape[0]
    tgt = None if target is None else _targets(target, n, "student_logits", student.device)
    layout = Layout(group, size, *_layout(vl, rank, size, vocab_start, vocab_total))
    kw = _distill_kw(divergence, beta, temperature, reduction, ignore_index, softcap,
                     logit_scale)
    if torch.is_grad_enabled() and student.requires_grad:
        loss, lse = VocabParallelDistill.apply(student, teacher, tgt, layout, kw,
                                               bool(return_lse))
    else:
        loss, lse, _ = distill_forward(student, teacher, tgt, layout, kw, bool(return_lse))
    return _distill_result(loss, lse, reduction, out_shape, return_lse)


@_eager_only
def vocab_parallel_linear_distill(hidden: Tensor, weight_shard: Tensor, teacher_hidden: Tensor,
                                  teacher_weight_shard: Tensor, target: Optional[Tensor] = None,
                                  *, group=None, vocab_start: Optional[int] = None,
                                  vocab_total: Optional[int] = None,
                                  divergence: str = "forward_kl", beta: float = 0.5,
                                  temperature: float = 1.0, reduction: str = "mean",
                                  ignore_index: int = -100, softcap: float = 0.0,
                                  logit_scale: float = 1.0, return_lse: bool = False,
                                  reduce_grad_hidden: bool = True,
                                  workspace_bytes: Optional[int] = None):
    """:func:`fusedce.torch.linear_distill` over a vocabulary sharded across ``group``, from
    hidden states: neither the student's logits nor the teacher's are ever whole (each rank
    makes its shard of both piece by piece inside a workspace).

    hidden        [..., D], the same on every rank of the group (leading dimensions flattened).
    weight_shard  [V_local, D]: this rank's rows of the student's output weight (classes
                  [vocab_start, vocab_start + V_local)), no bias.
    teacher_hidden  [..., D'] (hidden's leading dimensions), the same on every rank;
                  ``teacher_weight_shard`` [V_local, D']: this rank's rows of the teacher's
                  output weight, the same classes. The teacher gets no gradient; its tensors are
                  cast to the student's compute dtype, as :func:`fusedce.torch.linear_distill`'s.
    target        [...] (optional, the same on every rank): rows whose target is
                  ``ignore_index`` are not counted.
    group, vocab_start, vocab_total  as :func:`vocab_parallel_cross_entropy`'s.
    divergence, beta, temperature, reduction, softcap, logit_scale  as
                  :func:`fusedce.torch.linear_distill`'s (default reduction 'mean').
    reduce_grad_hidden, workspace_bytes  as :func:`vocab_parallel_linear_cross_entropy`'s
                  (``workspace_bytes``: the budget of each library call, which may differ from
                  rank to rank here: the collectives do not depend on it).

    The forward runs the rounds of statistics (``fce_vp_linear_distill_stats``, one all-gather
    of 8 float32 per token each over the group, two for the JSD with 0 < beta < 1) and the loss
    (``fce_vp_distill_loss``); the backward makes this rank's partial ∂hidden and the gradient of
    its weight shard from the saved last round (``fce_vp_linear_distill_backward``: both logits
    made again), then all-reduces ∂hidden (sum, float32) over the group, so that every rank gets
    the full gradient in hidden's dtype. Every rank must ask for the same gradients. Under
    autocast the matmuls run in the autocast dtype (a float32 weight_shard then gets a float32
    gradient directly); outside it hidden and weight_shard must have one dtype. Returns the
    float32 loss ('mean' over the rows counted, 'sum', or 'none': [...]), the unsharded call's
    to float32 rounding (to the GEMMs' rounding for 16-bit inputs) and the same on every rank;
    ``return_lse``: (loss, the student's log-sum-exp of a / T over the whole row, [...], not
    differentiable)."""
    fn = "fusedce.torch.distributed.vocab_parallel_linear_distill"
    _lib.require_vp(fn)
    group, rank, size = _resolve_group(group)
    out_shape, d, td, cdt, budget = linear_args(
        fn, hidden, weight_shard, teacher_hidden, teacher_weight_shard, workspace_bytes,
        ("weight_shard", "teacher_weight_shard", "V_local"))
    vl = weight_shard.shape[0]
    h2 = hidden.reshape(-1, d)
    th2 = teacher_hidden.detach().reshape(-1, td)
    tw = teacher_weight_shard.detach()
    n = h2.shape[0]
    tgt = None if target is None else _targets(target, n, "hidden", hidden.device)
    layout = Layout(group, size, *_layout(vl, rank, size, vocab_start, vocab_total))
    kw = _distill_kw(divergence, beta, temperature, reduction, ignore_index, softcap,
                     logit_scale)
    if torch.is_grad_enabled() and (h2.requires_grad or weight_shard.requires_grad):
        loss, lse = VocabParallelLinearDistill.apply(h2, weight_shard, th2, tw, tgt, layout, kw,
                                                     cdt, budget, bool(return_lse),
                                                     bool(reduce_grad_hidden))
    else:
        loss, lse, _ = linear_distill_forward(*_cast(h2, weight_shard, th2, tw, cdt), tgt,
                                              layout, kw, budget, bool(return_lse))
    return _distill_result(loss, lse, reduction, out_shape, return_lse)


@_eager_only
def vocab_parallel_linear_cross_entropy(hidden: Tensor, weight_shard: Tensor, target: Tensor, *,
                                        group=None, bias: Optional[Tensor] = None,
                                        vocab_start: Optional[int] = None,
                                        vocab_total: Optional[int] = None,
                                        reduction: str = "mean", ignore_index: int = -100,
                                        weight: Optional[Tensor] = None,
                                        label_smoothing: float = 0.0,
                                        label_smoothing_formula: str = "torch",
                                        z_loss: float = 0.0, softcap: float = 0.0,
                                        logit_scale: float = 1.0, shift_seq_len: int = 0,
                                        shift: int = 0, use_token_scaling: bool = False,
                                        return_z_loss: bool = False,
                                        return_token_accuracy: bool = False,
                                        return_predicted_tokens: bool = False,
                                        return_lse: bool = False, check_targets: bool = False,
                                        reduce_grad_hidden: bool = True,
                                        workspace_bytes: Optional[int] = None,
                                        sequence_parallel: bool = False,
                                        return_entropy: bool = False):
    """The output layer and its cross-entropy with the vocabulary sharded over ``group``
    (Megatron's ColumnParallelLinear output layer with parallel_output=True, followed by
    vocab_parallel_cross_entropy), without ever forming the logits: each rank makes its
    shard's logits piece by piece inside a workspace, and an all-gather of 8 float32 per token
    gives every rank the loss.

    With a gradient and reduction 'mean' or 'sum' (libfusedce >= 0.5): ONE fused library call
    in the forward (``fce_vp_linear_ce``) makes the logits once (6·N·D·V/P FLOPs per rank) when
    the budget reaches its full-speed size on CUDA (else it gathers once and makes them twice,
    as the two phases do), runs the all-gathers from inside (one per token chunk on CUDA, one
    when it gathers once and on the CPU backend, through
    ``all_gather_into_tensor`` on ``group``) and writes the gradients for an upstream 1; ∂hidden
    is all-reduced in the forward, and the backward scales the gradients by the upstream scalar
    (no collective, nothing touched when it is exactly 1). Reduction 'none', calls without a
    gradient (evaluation) and older libraries take the two phases: ``fce_vp_linear_stats``, one
    all-gather and ``fce_vp_loss`` in the forward, ``fce_vp_linear_backward`` (the logits made
    again: 8·N·D·V/P FLOPs in all) and the ∂hidden all-reduce in the backward.

    hidden        [..., D], the same on every rank of the group (leading dimensions flattened).
    weight_shard  [V_local, D]: this rank's rows of the output layer's weight (classes
                  [vocab_start, vocab_start + V_local)); ``bias`` its [V_local] entries or None.
    target        [...] (hidden's leading dimensions): global class indices; or, floating,
                  this rank's shard of class probabilities [..., V_local].
    group, vocab_start, vocab_total, label_smoothing(_formula), ignore_index and the other
                  options: as :func:`vocab_parallel_cross_entropy` (default reduction 'mean';
                  ``weight``: class weights [vocab_total], not the output layer's weight).
    reduce_grad_hidden  True (default): ∂hidden is all-reduced (sum, in float32) over the group,
                  so every rank gets the full gradient (Megatron's copy_to_tensor_model_parallel_
                  region backward). False: each rank gets its own partial ∂hidden, for callers
                  that reduce it themselves (e.g. sequence parallelism: hidden all-gathered by
                  an op whose backward is a reduce-scatter).
    workspace_bytes  scratch budget of each library call (None: FUSEDCE_WORKSPACE_BYTES, else
                  1 GiB), never below the library's minimum. Pass the same value on every rank
                  (the fused call's token chunks, each an all-gather, depend on it).
    sequence_parallel  hidden's rows are sharded over the group (Megatron's sequence
                  parallelism): rank r holds rows [r·n, (r+1)·n) of the N = P·n rows that
                  ``target`` (global, the same on every rank) scores; hidden [n, D] or [n, b, D]
                  (Megatron's [s/P, b, h]: its rows are sequence-major, so the flattened
                  rows of the ranks follow one another). One ``all_gather_into_tensor`` of
                  hidden on the group and the current stream before the library call, one
                  ``reduce_scatter_tensor`` (sum, float32) of ∂hidden after it (in the forward
                  for the fused call, in the backward for the two phases): each rank gets the
                  gradient of its own rows. ``reduce_grad_hidden`` is ignored then.

    Gradients: hidden (its dtype), weight_shard and bias (theirs) when they require grad; every
    rank must ask for the same ones (the ∂hidden all-reduce is collective, and so is a second
    backward through the graph with retain_graph=True). Under autocast the
    matmul runs in the autocast dtype (inputs cast inside), a float32 weight_shard then gets a
    float32 gradient directly. Returns the loss (float32: () for mean/sum, target's shape for
    none), or the CrossEntropyOutput named tuple with return_* flags."""
    _lib.require_vp("fusedce.torch.distributed.vocab_parallel_linear_cross_entropy")
    group, rank, size = _resolve_group(group)
    red = _ta._reduction(reduction)
    if hidden.dim() < 1:
        raise ValueError("hidden must be [..., D]")
    d = hidden.shape[-1]
    if weight_shard.dim() != 2 or weight_shard.shape[1] != d:
        raise ValueError(f"weight_shard must be [V_local, {d}], got {tuple(weight_shard.shape)}")
    vl = weight_shard.shape[0]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != vl):
        raise ValueError(f"bias must be [{vl}] (this rank's entries), got {tuple(bias.shape)}")
    h2 = hidden.reshape(-1, d)
    n = h2.shape[0]  # (rows >= 0, vocab_local and hidden >= 1: the library checks them)
    if sequence_parallel:
        n *= size  # this rank's rows, gathered with the others' before the library call
        reduce_grad_hidden = SCATTER
    fn = "fusedce.torch.distributed.vocab_parallel_linear_cross_entropy"
    cdt = _ta._linear_dtype(fn, (("hidden", hidden), ("weight_shard", weight_shard),
                                 ("bias", bias)))
    what = "hidden" + (" on the group's ranks (sequence_parallel)" if sequence_parallel else "")
    soft = target.is_floating_point()  # this rank's shard of class probabilities
    if soft:
        q, tgt = _probabilities(target, n, vl, cdt, what, hidden.device, fn,
                                autocast=cdt != hidden.dtype)
        out_shape = tuple(target.shape[:-1])
    else:
        tgt = _targets(target, n, what, hidden.device)
        out_shape = tuple(target.shape)
    vs, vt = _layout(vl, rank, size, vocab_start, vocab_total)
    cw = _class_weights(weight, vt, hidden.device)
    t, k = _ta._resolve_shift(shift, shift_seq_len, out_shape, n)
    budget = (_alloc.default_workspace_bytes() if workspace_bytes is None
              else int(workspace_bytes))
    if budget < 0:
        raise ValueError(f"workspace_bytes must be >= 0, got {workspace_bytes}")
    opts, want, lib_want = _options(
        red, vt, t, k, ignore_index, _smoothing(label_smoothing, label_smoothing_formula, vt),
        z_loss, softcap, logit_scale, use_token_scaling,
        (return_z_loss, return_token_accuracy, return_predicted_tokens, return_lse,
         return_entropy))
    q_grad = soft and torch.is_grad_enabled() and q.requires_grad
    if soft:
        _soft.check_options(opts, ignore_index, want, check_targets, fn)
        if q_grad and sequence_parallel:
            raise ValueError(f"{fn}: a target of class probabilities that requires a gradient is "
                             "not supported with sequence_parallel (detach it)")
        if q_grad:  # its gradient needs the whole row's lse
            lib_want = lib_want.replace(lse=True)
    layout = Layout(group, size, vs, vt)
    grad_on = torch.is_grad_enabled() and (
        h2.requires_grad or weight_shard.requires_grad
        or (bias is not None and bias.requires_grad))
    gathered = None  # (the statistics: reduction 'none''s per-row z-loss reads them)
    if grad_on and red != _lib.FCE_REDUCTION_NONE and _lib.has_vp_linear_ce():
        loss, lse, zl, acc, am, ent = _VocabParallelLinearCEFused.apply(
            h2, weight_shard, bias, tgt, cw, layout, opts, cdt, budget, lib_want,
            bool(check_targets), _grad_mode(reduce_grad_hidden))
    elif grad_on:
        loss, lse, zl, acc, am, ent, gathered = _VocabParallelLinearCE.apply(
            h2, weight_shard, bias, tgt, cw, layout, opts, cdt, budget, lib_want,
            bool(check_targets), _grad_mode(reduce_grad_hidden))
    else:
        if sequence_parallel:
            h2 = _gather_tokens(h2, group, size)
        (loss, lse, zl, acc, am, ent), gathered = _linear_forward(
            h2, weight_shard, bias, tgt, cw, layout, opts, cdt, budget, lib_want,
            bool(check_targets), _stream(h2))
    if q_grad:
        loss = _soft.with_target_grad(loss, q, h2.to(cdt), weight_shard.to(cdt),
                                      bias.to(cdt) if bias is not None else None,
                                      _columns(cw, vs, vl), opts, lse)
    return _ta._finish(want, red, out_shape, loss, lse, zl, acc, am,
                       (lambda: _soft.z_loss_rows(lse, opts)) if soft else
                       (lambda: _z_rows_from_stats(lse, tgt, vt, opts, gathered, size)), ent)


# ============================================== Megatron-Core's fused linear CE ====
_REDUCTIONS = ("none", "sum", "mean")


def megatron_linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor,
                                  tp_group=None, reduction: str = "mean",
                                  ignore_index: int = -100,
                                  sequence_parallel: bool = False) -> Tensor:
    """A drop-in for Megatron-Core's ``megatron.core.fusions.fused_linear_cross_entropy.
    linear_cross_entropy(hidden, weight, labels, tp_group=None, reduction="mean",
    ignore_index=-100, sequence_parallel=False)``, the same arguments and results, on any GPU
    and on the CPU (:func:`use_in_megatron` plugs it in).

    hidden   [num_tokens, D] or [s, b, D] (its rows flattened); with ``sequence_parallel`` this
             rank's equal share of the rows ([num_tokens / P, D], [s / P, b, D]).
    weight   [V / P, D]: this rank's equal share of the output layer's rows (rank r: classes
             [r·V/P, (r+1)·V/P)); the whole [V, D] when ``tp_group`` is None.
    labels   [num_tokens] or [s, b]: every token's label, the same on every rank.
    tp_group None: the plain call (:func:`fusedce.torch.linear_cross_entropy`, each rank its own
             tokens, as data parallelism); else the group the vocabulary is sharded over.
    Returns the float32 loss: [num_tokens] for 'none' (0 for ignored tokens), a 0-d tensor for
    'sum' and 'mean' (the mean over tokens whose label is not ignore_index; 0 when there is
    none), the same on every rank. Gradients: ∂weight of this rank's shard; ∂hidden the same
    on every rank (all-reduced) without sequence parallelism, this rank's rows (reduce-scattered)
    with it; the upstream gradient must be the same on every rank, as Megatron requires."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if hidden.dim() < 2:
        raise ValueError(f"hidden must be [num_tokens, dim] or [s, b, dim], got "
                         f"{tuple(hidden.shape)}")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    if tp_group is None:  # Megatron: no tensor parallelism, sequence_parallel has no effect
        from . import linear_cross_entropy
        return linear_cross_entropy(h, weight, y, reduction=reduction,
                                    ignore_index=int(ignore_index))
    return vocab_parallel_linear_cross_entropy(h, weight, y, group=tp_group, reduction=reduction,
                                               ignore_index=int(ignore_index),
                                               sequence_parallel=bool(sequence_parallel))


_MEGATRON_LCE = "megatron.core.fusions.fused_linear_cross_entropy"


def use_in_megatron() -> list:
    """Make Megatron-Core's fused linear cross-entropy (``--cross-entropy-loss-fusion
    --cross-entropy-fusion-impl linear``: ``config.cross_entropy_loss_fusion=True``,
    ``config.cross_entropy_fusion_impl="linear"``) run :func:`megatron_linear_cross_entropy`:
    ``linear_cross_entropy`` is rebound in ``megatron.core.fusions.fused_linear_cross_entropy``
    and in every loaded ``megatron.*`` module that imported it by name (e.g.
    ``megatron.core.transformer.linear_cross_entropy``, whose ``LinearCrossEntropyModule`` is
    GPTModel's output layer then); modules imported later take the rebound name. Call it once
    per process, before the first forward. Returns the modules rebound."""
    import importlib
    source = importlib.import_module(_MEGATRON_LCE)
    original = getattr(source, "linear_cross_entropy")
    if original is megatron_linear_cross_entropy:
        original = getattr(source, "_fusedce_original", original)
    source._fusedce_original = original
    rebound = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "megatron" or name.startswith("megatron.")):
            continue
        if getattr(module, "linear_cross_entropy", None) in (original,
                                                              megatron_linear_cross_entropy):
            module.linear_cross_entropy = megatron_linear_cross_entropy
            rebound.append(name)
    return sorted(rebound)
