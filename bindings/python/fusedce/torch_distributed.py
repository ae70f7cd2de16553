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
``return_predicted_tokens`` (global class indices), ``return_lse``, ``check_targets``.

These functions are plain torch.autograd.Functions calling the C library and torch.distributed:
eager mode; torch.compile does not trace into them (they run under ``torch.compiler.disable``:
a graph break).
"""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import _alloc, _lib
from . import _torch_calls as _tc
from . import _torch_args as _ta  # argument handling, the return convention
from . import _torch_ops as _to  # the autograd helpers, the option tuple
from .vocab_parallel import VP_STATS, shard_range

__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_linear_cross_entropy",
           "shard_range", "VP_STATS"]


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


_GATHER_FALLBACK = set()  # backends whose all_gather_into_tensor raised: all_gather into views


def _gather_into(out: Tensor, src: Tensor, group, size: int) -> None:
    """out [size * k, ...] = the group's src [k, ...], rank-major (group None: one rank, a
    copy)."""
    if group is None:
        out.copy_(src)
        return
    backend = str(dist.get_backend(group))
    if backend not in _GATHER_FALLBACK and hasattr(dist, "all_gather_into_tensor"):
        try:
            # the concatenated [P * rows, 8] form: gloo takes it (not the stacked [P, rows, 8])
            dist.all_gather_into_tensor(out, src, group=group)
            return
        except (RuntimeError, NotImplementedError):
            if backend == "nccl":
                raise
            _GATHER_FALLBACK.add(backend)  # e.g. an older gloo: every rank falls back alike
    dist.all_gather(list(out.chunk(size)), src, group=group)  # views: written in place


def _all_gather(stats: Tensor, group, size: int) -> Tensor:
    """[size * rows, VP_STATS]: the group's statistics, rank-major (what fce_vp_loss reads as
    [ranks, rows, VP_STATS])."""
    if group is None:  # no torch.distributed: one rank
        return stats
    out = stats.new_empty((size * stats.shape[0], VP_STATS))
    _gather_into(out, stats, group, size)
    return out


def _all_reduce_sum(t: Tensor, group, size: int) -> None:
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)


# ================================================================ the C calls ====
def _check(status: int, fn: str) -> None:
    if status:
        _lib.check(status, fn)


def _query(skey, fn, *args, pair=False):
    """A cached workspace-size query (fce_vp_*_workspace_size), made for the call it sizes
    (fn without "_workspace_size"), as whose failure its own is raised."""
    sizes = _tc._SIZES.get(skey)
    if sizes is None:
        lo, hi = ctypes.c_size_t(), ctypes.c_size_t()
        extra = (ctypes.byref(lo), ctypes.byref(hi)) if pair else (ctypes.byref(lo),)
        _alloc.query_for(fn[:-len("_workspace_size")], fn, *args, *extra)
        sizes = _tc._SIZES[skey] = (lo.value, hi.value)
    return sizes


def _opts_struct(t: Tensor, dtype, targets: Tensor, opts: tuple, class_weights,
                 grad_weight_fp32: bool = False):
    key, o = _tc.options(_tc._backend(t), _tc._CODE[dtype], _tc._CODE[targets.dtype], *opts,
                         grad_weight_fp32=grad_weight_fp32)
    o.class_weights = _tc._ptr(class_weights)
    o.row_stride = o.grad_row_stride = o.hidden_row_stride = 0
    return key, o


def _vp_loss(o, key, size: int, n: int, vt: int, targets: Tensor, gathered: Tensor,
             reduction: int, extras: int, want_lse: bool, check: bool, stream):
    """fce_vp_loss: (loss, lse, z_loss, accuracy, argmax, flags)."""
    dev = gathered.device
    z_loss, accuracy, argmax = _tc._extras(extras, n, reduction, dev)
    skey = ("vp_loss", key, size, n, vt, argmax is not None, accuracy is not None)
    ws_bytes = _query(skey, "fce_vp_loss_workspace_size", ctypes.byref(o), size, n, vt)[0]
    loss = torch.empty((n,) if reduction == _lib.FCE_REDUCTION_NONE else (),
                       dtype=torch.float32, device=dev)
    lse = torch.empty((n,), dtype=torch.float32, device=dev) if want_lse else None
    flags = torch.zeros((1,), dtype=torch.int32, device=dev) if check else None
    ws = _tc._workspace(ws_bytes, gathered)
    shard = _lib.shard(size, vt, 0, vt)
    out = _lib.outputs(loss=loss.data_ptr(), lse=_tc._ptr(lse), z_loss=_tc._ptr(z_loss),
                       argmax=_tc._ptr(argmax), accuracy=_tc._ptr(accuracy),
                       error_flags=_tc._ptr(flags))
    status = _lib.load().fce_vp_loss(
        ctypes.byref(o), ctypes.byref(shard), n, targets.data_ptr(), gathered.data_ptr(),
        ctypes.byref(out), _tc._ptr(ws), ws_bytes, stream)
    _check(status, "fce_vp_loss")
    return loss, lse, z_loss, accuracy, argmax, flags


def _check_flags(flags: Optional[Tensor], targets: Tensor, vt: int, opts: tuple) -> None:
    """check_targets: read the flags (a host sync) and raise as torch does for an out-of-range
    target (IndexError), RuntimeError for shards that do not tile the vocabulary."""
    if flags is None:
        return
    value = int(flags.item()) & 0xFFFFFFFF
    if value & _lib.FCE_FLAG_TARGET_OUT_OF_RANGE:
        _tc.check_flags(flags, targets, vt, opts)
    if value & _lib.FCE_FLAG_SHARDS_INCONSISTENT:
        raise RuntimeError(
            "fusedce: the vocabulary shards gathered over the group do not tile "
            f"[0, vocab_total={vt}) (their sizes do not sum to it, or a target is held by no "
            "shard or by two): pass each rank's vocab_start and the same vocab_total on every "
            "rank (the rows concerned have a NaN loss)")
    if value:
        raise RuntimeError(f"fusedce reported error flags {value:#x}")


# ======================================================= cross-entropy on logits ====
def _ce_forward(logits, targets, cw, layout, opts, extras, check, want_lse, stream):
    group, size, vs, vt = layout
    n, vl = logits.shape
    key, o = _opts_struct(logits, logits.dtype, targets, opts, cw)
    o.row_stride = logits.stride(0) if n > 1 else vl
    stats = torch.empty((n, VP_STATS), dtype=torch.float32, device=logits.device)
    shard = _lib.shard(size, vt, vs, vl)
    _check(_lib.load().fce_vp_stats(ctypes.byref(o), ctypes.byref(shard), n, logits.data_ptr(),
                                    targets.data_ptr(), stats.data_ptr(), stream), "fce_vp_stats")
    gathered = _all_gather(stats, group, size)
    out = _vp_loss(o, key, size, n, vt, targets, gathered, opts[0], extras, want_lse, check,
                   stream)
    _check_flags(out[5], targets, vt, opts)
    return out[:5], gathered


class _VocabParallelCE(torch.autograd.Function):
    """Returns (loss, lse, z_loss, accuracy, argmax), None for what was not asked for."""

    @staticmethod
    def forward(ctx, logits, targets, cw, layout, opts, extras, check, want_lse, inplace):
        stream = _tc._stream(logits)
        (loss, lse, zl, acc, am), gathered = _ce_forward(logits, targets, cw, layout, opts,
                                                         extras, check, want_lse, stream)
        ctx.save_for_backward(logits, targets, cw, gathered)
        ctx.layout, ctx.opts, ctx.inplace = layout, opts, inplace
        ctx.set_materialize_grads(False)
        _to._non_differentiable(ctx, lse, zl, acc, am, gathered)
        return loss, lse, zl, acc, am, gathered

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        nones = (None,) * 8
        if grad_loss is None or not ctx.needs_input_grad[0]:
            return (None,) + nones
        logits, targets, cw, gathered = ctx.saved_tensors
        _, size, vs, vt = ctx.layout
        n, vl = logits.shape
        up = grad_loss.to(torch.float32).contiguous()
        key, o = _opts_struct(logits, logits.dtype, targets, ctx.opts, cw)
        o.row_stride = logits.stride(0) if n > 1 else vl
        if ctx.inplace:
            _to._hand_out_once(ctx)
            grad = logits
            o.grad_row_stride = o.row_stride
        else:
            grad = torch.empty((n, vl), dtype=logits.dtype, device=logits.device)
            o.grad_row_stride = vl
        ws_bytes = _query(("vp_bwd", key, size, n, vt, vl), "fce_vp_backward_workspace_size",
                          ctypes.byref(o), size, n, vt, vl)[0]
        ws = _tc._workspace(ws_bytes, logits)
        shard = _lib.shard(size, vt, vs, vl)
        grads = _lib.gradients(grad_output=up.data_ptr(), grad_logits=grad.data_ptr())
        _check(_lib.load().fce_vp_backward(
            ctypes.byref(o), ctypes.byref(shard), n, logits.data_ptr(), targets.data_ptr(),
            gathered.data_ptr(), None, ctypes.byref(grads), _tc._ptr(ws), ws_bytes,
            _tc._stream(logits)), "fce_vp_backward")
        return (grad,) + nones


# ============================================================= public helpers ====


def _smoothing(label_smoothing: float, formula: str, vt: int) -> float:
    eps = float(label_smoothing)
    if formula == "torch":
        return eps
    if formula == "megatron":
        return eps * vt / (vt - 1) if eps and vt > 1 else eps
    raise ValueError(f"label_smoothing_formula must be 'torch' or 'megatron', got {formula!r}")


def _class_weights(weight: Optional[Tensor], vt: int, device) -> Optional[Tensor]:
    if weight is None:
        return None
    if weight.dim() != 1 or weight.shape[0] != vt:
        raise ValueError(f"weight (class weights) must have shape ({vt},): the whole "
                         f"vocabulary's, on every rank; got {tuple(weight.shape)}")
    return weight.to(device=device, dtype=torch.float32).contiguous()


def _targets(target: Tensor, n: int, what: str, device) -> Tensor:
    tgt = _ta._targets(target).contiguous()
    if tgt.shape[0] != n:
        raise ValueError(f"target has {tgt.shape[0]} elements for {n} rows of {what}")
    if tgt.device != device:
        raise ValueError(f"target is on {tgt.device} but {what} is on {device}")
    return tgt


def _z_rows_from_stats(lse: Tensor, tgt: Tensor, vt: int, opts: tuple, gathered: Tensor,
                       size: int):
    """Per-row z-loss for reduction 'none' (_torch_args._z_loss_rows), with token scaling's p_y
    from the target logit the gathered statistics already hold: each rank's t_r (docs/semantics.md
    rule 16; scaled and capped; 0 where the shard does not hold the target) summed over the ranks
    — exact, one term is not 0 — so no logit is recomputed and no collective is made."""
    n = lse.shape[0]
    a_y = gathered.view(size, n, VP_STATS)[:, :, 2].sum(0)
    # a_y is already a = c·tanh(s·z/c): the transform of _z_loss_rows must be the identity
    plain = opts[:4] + (0.0, 1.0) + opts[6:]
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
                                 check_targets: bool = False, inplace_backward: bool = False):
    """Cross-entropy of logits whose vocabulary is sharded over ``group``: a drop-in for
    ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy(vocab_parallel_logits, target,
    label_smoothing, tp_group)`` (see the module docstring for the differences).

    vocab_parallel_logits  [..., V_local] (Megatron: [s, b, V/P]), float32/float16/bfloat16:
                  this rank's classes [vocab_start, vocab_start + V_local).
    target        [...] (the leading dimensions): global class indices, the same on every rank.
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
    tgt = _targets(target, n, "vocab_parallel_logits", logits.device)
    vs, vt = _layout(vl, rank, size, vocab_start, vocab_total)
    cw = _class_weights(weight, vt, logits.device)
    t, k = _ta._resolve_shift(shift, shift_seq_len, tuple(target.shape), n)
    opts = _to._opts(ignore_index, red, _smoothing(label_smoothing, label_smoothing_formula, vt),
                     z_loss, softcap, logit_scale, t, k, use_token_scaling)
    mask = _ta._output_mask(return_z_loss, return_token_accuracy, return_predicted_tokens,
                            return_lse)
    extras = _ta._c_extras(mask, red)
    want_lse = bool(mask & 8) or (bool(mask & 1) and red == _lib.FCE_REDUCTION_NONE)
    layout = (group, size, vs, vt)
    if torch.is_grad_enabled() and logits.requires_grad:
        loss, lse, zl, acc, am, gathered = _VocabParallelCE.apply(
            logits, tgt, cw, layout, opts, extras, bool(check_targets), want_lse,
            bool(inplace_backward))
    else:
        (loss, lse, zl, acc, am), gathered = _ce_forward(logits, tgt, cw, layout, opts, extras,
                                                         bool(check_targets), want_lse,
                                                         _tc._stream(logits))
    return _ta._finish(mask, red, tuple(target.shape), loss, lse, zl, acc, am,
                       lambda: _z_rows_from_stats(lse, tgt, vt, opts, gathered, size))


# ===================================================== fused linear + CE, sharded ====
def _cast_inputs(hidden, weight, bias, cdt):
    h = hidden.to(cdt)
    if h.stride(-1) != 1:
        h = h.contiguous()
    w = weight.to(cdt).contiguous()
    b = bias.to(cdt).contiguous() if bias is not None else None
    return h, w, b


def _linear_forward(hidden, weight, bias, targets, cw, layout, opts, cdt, budget, extras,
                    check, want_lse, stream):
    group, size, vs, vt = layout
    h, w, b = _cast_inputs(hidden, weight, bias, cdt)
    n, d = h.shape
    vl = w.shape[0]
    key, o = _opts_struct(h, cdt, targets, opts, cw)
    o.hidden_row_stride = h.stride(0) if n > 1 else d
    lo, hi = _query(("vp_lin_stats", key, n, d, vl), "fce_vp_linear_stats_workspace_size",
                    ctypes.byref(o), n, d, vl, pair=True)
    ws_bytes = max(lo, min(hi, max(0, budget)))
    ws = _tc._workspace(ws_bytes, h)
    stats = torch.empty((n, VP_STATS), dtype=torch.float32, device=h.device)
    shard = _lib.shard(size, vt, vs, vl)
    _check(_lib.load().fce_vp_linear_stats(
        ctypes.byref(o), ctypes.byref(shard), n, d, h.data_ptr(), w.data_ptr(), _tc._ptr(b),
        targets.data_ptr(), stats.data_ptr(), _tc._ptr(ws), ws_bytes, stream),
        "fce_vp_linear_stats")
    del ws
    gathered = _all_gather(stats, group, size)
    out = _vp_loss(o, key, size, n, vt, targets, gathered, opts[0], extras, want_lse, check,
                   stream)
    _check_flags(out[5], targets, vt, opts)
    return out[:5], gathered


class _VocabParallelLinearCE(torch.autograd.Function):
    """Returns (loss, lse, z_loss, accuracy, argmax), None for what was not asked for."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, cw, layout, opts, cdt, budget, extras,
                check, want_lse, reduce_grad_hidden):
        stream = _tc._stream(hidden)
        (loss, lse, zl, acc, am), gathered = _linear_forward(
            hidden, weight, bias, targets, cw, layout, opts, cdt, budget, extras, check,
            want_lse, stream)
        # the inputs (alive anyway: parameters and the [N, D] activations) and the statistics
        ctx.save_for_backward(hidden, weight, bias, targets, cw, gathered)
        ctx.layout, ctx.opts, ctx.cdt, ctx.budget = layout, opts, cdt, budget
        ctx.reduce_grad_hidden = reduce_grad_hidden
        ctx.set_materialize_grads(False)
        _to._non_differentiable(ctx, lse, zl, acc, am, gathered)
        return loss, lse, zl, acc, am, gathered

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        nones = (None,) * 10
        if grad_loss is None:
            return (None,) * 3 + nones
        hidden, weight, bias, targets, cw, gathered = ctx.saved_tensors
        group, size, vs, vt = ctx.layout
        need_h = bool(ctx.needs_input_grad[0])
        need_w = bool(ctx.needs_input_grad[1])
        need_b = bias is not None and bool(ctx.needs_input_grad[2])
        if not (need_h or need_w or need_b):
            return (None,) * 3 + nones
        cdt = ctx.cdt
        h, w, b = _cast_inputs(hidden, weight, bias, cdt)
        n, d = h.shape
        vl = w.shape[0]
        # a float32 weight computed in a 16-bit dtype (autocast) gets its gradient in float32
        fp32_grads = weight.dtype == torch.float32 and cdt != torch.float32
        key, o = _opts_struct(h, cdt, targets, ctx.opts, cw, grad_weight_fp32=fp32_grads)
        o.hidden_row_stride = h.stride(0) if n > 1 else d
        dev = h.device
        gw_dtype = torch.float32 if fp32_grads else cdt
        gh = torch.empty((n, d), dtype=torch.float32, device=dev) if need_h else None
        gw = torch.empty((vl, d), dtype=gw_dtype, device=dev) if need_w else None
        gb = torch.empty((vl,), dtype=gw_dtype, device=dev) if need_b else None
        up = grad_loss.to(torch.float32).contiguous()
        lo, hi = _query(("vp_lin_bwd", key, size, n, d, vt, vl),
                        "fce_vp_linear_backward_workspace_size", ctypes.byref(o), size, n, d, vt,
                        vl, _lib.FCE_FLOAT32, pair=True)
        ws_bytes = max(lo, min(hi, max(0, ctx.budget)))
        ws = _tc._workspace(ws_bytes, h)
        shard = _lib.shard(size, vt, vs, vl)
        grads = _lib.gradients(grad_output=up.data_ptr(), grad_hidden=_tc._ptr(gh),
                               grad_weight=_tc._ptr(gw), grad_bias=_tc._ptr(gb))
        _check(_lib.load().fce_vp_linear_backward(
            ctypes.byref(o), ctypes.byref(shard), n, d, h.data_ptr(), w.data_ptr(),
            _tc._ptr(b), targets.data_ptr(), gathered.data_ptr(), None, ctypes.byref(grads),
            _tc._ptr(ws), ws_bytes, _tc._stream(h)), "fce_vp_linear_backward")
        del ws
        if gh is not None:
            if ctx.reduce_grad_hidden:
                _all_reduce_sum(gh, group, size)  # float32: the sum exact to float32
            gh = gh.to(hidden.dtype)
        if gw is not None:
            gw = gw.to(weight.dtype)
        if gb is not None:
            gb = gb.to(bias.dtype)
        return (gh, gw, gb) + nones


# ---- the fused step (fce_vp_linear_ce, 0.5): the logits made once, the gradients in the forward
class _AllGather:
    """The fce_vp_all_gather_fn of one fce_vp_linear_ce call. The library hands it send [count]
    and recv [ranks, count] float32 inside the call's workspace ``ws`` (a float32 tensor); they
    are gathered by _gather_into, a torch.distributed collective on views of ``ws``. An
    exception is kept (ctypes must not see it: it would print it and return 0, success) and a
    failing status returned, which stops the call; the caller re-raises it."""

    def __init__(self, ws: Optional[Tensor], group, size: int, stream):
        self.ws, self.group, self.size, self.stream = ws, group, size, stream
        self.error: Optional[BaseException] = None
        self.fn = _lib.VP_ALL_GATHER_FN(self._call)  # alive as long as this object

    def _view(self, ptr, count: int, what: str) -> Tensor:
        ws = self.ws
        off = -1 if (ptr is None or ws is None) else int(ptr) - ws.data_ptr()
        if off < 0 or off % 4 or off // 4 + count > ws.numel():
            raise RuntimeError(
                f"fusedce: fce_vp_linear_ce's all-gather got a {what} buffer ({ptr}, {count} "
                "float32) outside the workspace it was given")
        return ws.narrow(0, off // 4, count)

    def _call(self, _context, send, recv, count, stream):
        try:
            n = int(count)
            src = self._view(send, n, "send")
            out = self._view(recv, self.size * n, "recv")
            # the library passes the caller's stream (NULL, None here, for the default one)
            if src.is_cuda and (stream or 0) != (self.stream or 0):
                with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=src.device)):
                    _gather_into(out, src, self.group, self.size)
            else:
                _gather_into(out, src, self.group, self.size)
            return _lib.FCE_SUCCESS
        except BaseException as e:  # noqa: B902 - re-raised by the caller after the C call
            self.error = e
            return _lib.FCE_ERROR_INVALID_ARGUMENT


def _fused_workspace(o, key, size: int, n: int, d: int, vt: int, vl: int, budget: int,
                     cuda: bool, outputs: tuple) -> int:
    """fce_vp_linear_ce's workspace: the full-speed size if it is within budget, else the budget,
    never below the minimum; the same on every rank (the plan, hence the collectives, depends on
    it): queried for shards ⌈vt / size⌉ wide, the widest of equal shards or of shard_range's
    split. A shard wider than that (another uneven split) may need more on its own rank: it gets
    it where that cannot change the plan (the CPU backend's is always gather-once; on CUDA at the
    full-speed size every rank runs the token chunks), else raises."""
    width = -(-vt // size)
    lo, hi = _query(("vp_lin_ce", key, size, n, d, vt, width) + outputs,
                    "fce_vp_linear_ce_workspace_size", ctypes.byref(o), size, n, d, vt, width, 1,
                    _lib.FCE_FLOAT32, pair=True)
    ws_bytes = max(lo, min(hi, budget))
    if vl <= width:
        return ws_bytes
    lo1, hi1 = _query(("vp_lin_ce", key, size, n, d, vt, vl) + outputs,
                      "fce_vp_linear_ce_workspace_size", ctypes.byref(o), size, n, d, vt, vl, 1,
                      _lib.FCE_FLOAT32, pair=True)
    if not cuda:
        return max(ws_bytes, lo1)
    if ws_bytes >= hi:
        return max(ws_bytes, hi1)
    raise ValueError(
        f"fusedce: this rank's shard ({vl} classes) is wider than vocab_total / ranks rounded up "
        f"({width}), and the workspace budget ({budget} bytes) is below the full-speed size "
        f"({hi} bytes) the other ranks plan with: pass workspace_bytes >= {hi} on every rank, "
        "or split the vocabulary as fusedce.torch.distributed.shard_range does")


def _linear_fused(hidden, weight, bias, targets, cw, layout, opts, cdt, budget, extras, check,
                  want_lse, need, reduce_grad_hidden, grad_output, stream):
    """fce_vp_linear_ce with the gradients of ``need`` (hidden, weight, bias) for the upstream
    grad_output (None: 1): (loss, lse, z_loss, accuracy, argmax, (∂hidden, ∂weight, ∂bias)), None
    for what was not asked for; ∂hidden all-reduced (sum, float32) over the group when
    reduce_grad_hidden, then in hidden's dtype; ∂weight and ∂bias in theirs. The workspace is
    freed before the all-reduce and the casts."""
    group, size, vs, vt = layout
    h, w, b = _cast_inputs(hidden, weight, bias, cdt)
    n, d = h.shape
    vl = w.shape[0]
    # a float32 weight computed in a 16-bit dtype (autocast) gets its gradient in float32
    fp32_grads = weight.dtype == torch.float32 and cdt != torch.float32
    key, o = _opts_struct(h, cdt, targets, opts, cw, grad_weight_fp32=fp32_grads)
    o.hidden_row_stride = h.stride(0) if n > 1 else d
    dev = h.device
    reduction = opts[0]
    z_loss, accuracy, argmax = _tc._extras(extras, n, reduction, dev)
    ws_bytes = _fused_workspace(o, key, size, n, d, vt, vl, max(0, budget), h.is_cuda,
                                (cw is not None, argmax is not None, accuracy is not None))
    loss = torch.empty((n,) if reduction == _lib.FCE_REDUCTION_NONE else (),
                       dtype=torch.float32, device=dev)
    lse = torch.empty((n,), dtype=torch.float32, device=dev) if want_lse else None
    flags = torch.zeros((1,), dtype=torch.int32, device=dev) if check else None
    gw_dtype = torch.float32 if fp32_grads else cdt
    # ∂hidden: this rank's partial in float32 (its all-reduce exact to float32), even when it
    # is not all-reduced: a 16-bit grad_hidden_dtype asks for more workspace than it saves
    gh = torch.empty((n, d), dtype=torch.float32, device=dev) if need[0] else None
    gw = torch.empty((vl, d), dtype=gw_dtype, device=dev) if need[1] else None
    gb = torch.empty((vl,), dtype=gw_dtype, device=dev) if need[2] and b is not None else None
    # float32 elements, so that the all-gathers' buffers are views of it
    ws = torch.empty(((ws_bytes + 3) // 4,), dtype=torch.float32, device=dev) if ws_bytes else None
    gather = _AllGather(ws, group, size, stream)
    shard = _lib.shard(size, vt, vs, vl, all_gather=gather.fn)
    out = _lib.outputs(loss=loss.data_ptr(), lse=_tc._ptr(lse), z_loss=_tc._ptr(z_loss),
                       argmax=_tc._ptr(argmax), accuracy=_tc._ptr(accuracy),
                       error_flags=_tc._ptr(flags))
    grads = _lib.gradients(grad_output=_tc._ptr(grad_output), grad_hidden=_tc._ptr(gh),
                           grad_weight=_tc._ptr(gw), grad_bias=_tc._ptr(gb))
    status = _lib.load().fce_vp_linear_ce(
        ctypes.byref(o), ctypes.byref(shard), n, d, h.data_ptr(), w.data_ptr(), _tc._ptr(b),
        targets.data_ptr(), ctypes.byref(out), ctypes.byref(grads), _tc._ptr(ws), ws_bytes,
        stream)
    gather.ws = ws = None  # the workspace goes before the gradients' reduction and casts
    del h, w, b  # (copies under autocast)
    if gather.error is not None:
        error, gather.error = gather.error, None
        raise error  # the all-gather's own exception (the library's status only follows it)
    _check(status, "fce_vp_linear_ce")
    _check_flags(flags, targets, vt, opts)
    if gh is not None:
        if reduce_grad_hidden:
            _all_reduce_sum(gh, group, size)  # float32: the sum exact to float32
        gh = gh.to(hidden.dtype)  # (the float32 partial is dropped here when they differ)
    if gw is not None:
        gw = gw.to(weight.dtype)
    if gb is not None:
        gb = gb.to(bias.dtype)
    return loss, lse, z_loss, accuracy, argmax, (gh, gw, gb)


class _VocabParallelLinearCEFused(torch.autograd.Function):
    """Reductions mean and sum with a gradient: ONE fce_vp_linear_ce in the forward makes the
    loss and the gradients for an upstream 1 (∂hidden all-reduced there); the backward scales
    them by the scalar upstream gradient in place (fce_scale_gradient: nothing is touched when it
    is exactly 1) and hands them out. A second backward through the graph (retain_graph) makes
    them again with the real upstream gradient (the collectives again, on every rank).
    Returns (loss, lse, z_loss, accuracy, argmax), None for what was not asked for."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, cw, layout, opts, cdt, budget, extras,
                check, want_lse, reduce_grad_hidden):
        need = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]),
                bias is not None and bool(ctx.needs_input_grad[2]))
        loss, lse, zl, acc, am, grads = _linear_fused(
            hidden, weight, bias, targets, cw, layout, opts, cdt, budget, extras, check,
            want_lse, need, reduce_grad_hidden, None, _tc._stream(hidden))
        # the gradients, not version-tracked (scaled in place, handed out once); the inputs
        # (alive anyway) for a second backward only
        ctx.grads, ctx.computed = grads, need
        ctx.save_for_backward(hidden, weight, bias, targets, cw)
        ctx.args = (layout, opts, cdt, budget, reduce_grad_hidden)
        ctx.set_materialize_grads(False)
        _to._non_differentiable(ctx, lse, zl, acc, am)
        return loss, lse, zl, acc, am

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        nones = (None,) * 10
        if grad_loss is None:
            ctx.grads = None
            return (None,) * 3 + nones
        need = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]),
                ctx.computed[2] and bool(ctx.needs_input_grad[2]))
        grads = ctx.grads
        if grads is not None and all(c or not w for c, w in zip(ctx.computed, need)):
            ctx.grads = None  # handed out: a later backward makes them again
            out = tuple(g if w else None for g, w in zip(grads, need))
            for g in out:
                if g is not None:
                    _tc.scale_(g, grad_loss)  # a no-op launch for an upstream exactly 1
        else:
            hidden, weight, bias, targets, cw = ctx.saved_tensors
            layout, opts, cdt, budget, reduce_grad_hidden = ctx.args
            out = _linear_fused(hidden, weight, bias, targets, cw, layout, opts, cdt, budget, 0,
                                False, False, need, reduce_grad_hidden, _to._f32(grad_loss),
                                _tc._stream(hidden))[5]
        return out + nones


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
                                        workspace_bytes: Optional[int] = None):
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
    target        [...] (hidden's leading dimensions): global class indices.
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
    tgt = _targets(target, n, "hidden", hidden.device)
    vs, vt = _layout(vl, rank, size, vocab_start, vocab_total)
    cw = _class_weights(weight, vt, hidden.device)
    t, k = _ta._resolve_shift(shift, shift_seq_len, tuple(target.shape), n)
    cdt = _ta._linear_dtype("fusedce.torch.distributed.vocab_parallel_linear_cross_entropy",
                            (("hidden", hidden), ("weight_shard", weight_shard), ("bias", bias)))
    budget = _tc.default_workspace_bytes() if workspace_bytes is None else int(workspace_bytes)
    if budget < 0:
        raise ValueError(f"workspace_bytes must be >= 0, got {workspace_bytes}")
    opts = _to._opts(ignore_index, red, _smoothing(label_smoothing, label_smoothing_formula, vt),
                     z_loss, softcap, logit_scale, t, k, use_token_scaling)
    mask = _ta._output_mask(return_z_loss, return_token_accuracy, return_predicted_tokens,
                            return_lse)
    extras = _ta._c_extras(mask, red)
    want_lse = bool(mask & 8) or (bool(mask & 1) and red == _lib.FCE_REDUCTION_NONE)
    layout = (group, size, vs, vt)
    grad_on = torch.is_grad_enabled() and (
        h2.requires_grad or weight_shard.requires_grad
        or (bias is not None and bias.requires_grad))
    gathered = None  # (the statistics: reduction 'none''s per-row z-loss reads them)
    if grad_on and red != _lib.FCE_REDUCTION_NONE and _lib.has_vp_linear_ce():
        loss, lse, zl, acc, am = _VocabParallelLinearCEFused.apply(
            h2, weight_shard, bias, tgt, cw, layout, opts, cdt, budget, extras,
            bool(check_targets), want_lse, bool(reduce_grad_hidden))
    elif grad_on:
        loss, lse, zl, acc, am, gathered = _VocabParallelLinearCE.apply(
            h2, weight_shard, bias, tgt, cw, layout, opts, cdt, budget, extras,
            bool(check_targets), want_lse, bool(reduce_grad_hidden))
    else:
        (loss, lse, zl, acc, am), gathered = _linear_forward(
            h2, weight_shard, bias, tgt, cw, layout, opts, cdt, budget, extras,
            bool(check_targets), want_lse, _tc._stream(h2))
    return _ta._finish(mask, red, tuple(target.shape), loss, lse, zl, acc, am,
                       lambda: _z_rows_from_stats(lse, tgt, vt, opts, gathered, size))
