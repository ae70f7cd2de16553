"""fusedce.vocab_parallel: libfusedce's vocabulary-parallel calls (``fce_vp_*``, 0.4) on arrays.

The output layer sharded over the vocabulary (Megatron's tensor parallelism): each of P ranks
holds classes ``[vocab_start, vocab_start + vocab_local)`` of ``vocab_total`` — its logits'
columns, or the rows of the weight (and bias). A step is two phases around one collective that
the caller runs with its own communicator (include/fusedce.h, docs/semantics.md rule 16):

    stats = vp_stats(logits_shard, targets, vocab_start=s, vocab_total=V)   # [rows, 8] float32
    gathered = all_gather(stats)                 # [P, rows, 8] (or [P * rows, 8]), any rank order
    r = vp_loss(gathered, targets, vocab_total=V, reduction="mean")         # identical on ranks
    g = vp_backward(logits_shard, targets, gathered, vocab_start=s, vocab_total=V)

and for the fused linear + CE ``vp_linear_stats`` / ``vp_linear_backward``, whose ``grad_hidden``
is this rank's PARTIAL ∂h: sum it over the ranks (all-reduce). Nothing here communicates:
:mod:`fusedce.torch.distributed` does the whole step over a torch.distributed group.

Arrays, devices, streams, allocation and the option keywords are those of :mod:`fusedce.core`
(NumPy / torch / CuPy / DLPack; CPU or CUDA backend from where the arrays live). Options every
call takes (all ranks and both phases must pass the same): ``reduction``, ``ignore_index``,
``class_weights`` (float32 [vocab_total]: the WHOLE vocabulary's weights on every rank),
``label_smoothing``, ``z_loss_scale``, ``softcap``, ``logit_scale``, ``shift_seq_len``,
``shift``, ``token_scaling``, ``deterministic``. Targets are the global class indices, the same
array on every rank, or class probabilities (docs/semantics.md rule 19): each rank passes ITS
SHARD of q, [rows, vocab_local] of the logits' dtype (its columns of q [rows, vocab_total]), and
:func:`vp_loss` does not read them (any rank's shard, or None with ``rows=``). The loss, the gradients and the mean's denominator are those of the
unsharded call (:func:`fusedce.forward` / :func:`fusedce.linear_ce` on the whole vocabulary) to
float32 rounding. Gathered shards that do not tile ``[0, vocab_total)`` give NaN rows and set
``FCE_FLAG_SHARDS_INCONSISTENT`` in ``error_flags`` (``check_targets=True`` raises).

Distillation with both the student's and the teacher's logits sharded the same way
(docs/semantics.md rule 22): :func:`vp_distill_rounds` rounds of :func:`vp_distill_stats`
(round 2, the JSD's, reads round 1's gathered statistics), each all-gathered, then
:func:`vp_distill_loss` and :func:`vp_distill_backward` from the last round's gathered
statistics; equal to :func:`fusedce.distill` on the whole rows to float32 rounding. From
hidden states (each rank holding its rows of the student's and the teacher's weights, neither
model's logits ever whole): :func:`vp_linear_distill_stats` for the rounds, the same
:func:`vp_distill_loss`, then :func:`vp_linear_distill_backward` (its grad_hidden this rank's
PARTIAL ∂h: all-reduce it); equal to :func:`fusedce.linear_distill` to float32 rounding.

Needs libfusedce 0.4 (:func:`fusedce._lib.require_vp` raises UnsupportedError for an older one;
the distillation 1.0).
"""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple, Optional, Tuple

import numpy as np

from . import _lib
from ._lib import FCE_REDUCTION_NONE, FCE_VP_STATS, FCE_VP_STATS_INVARIANT
from ._alloc import (_Alloc, _argmax_accuracy, _class_weights, _error_flags, _grad_logits,
                     _grad_output, _linear_grads, _loss_lse, _out, _ptr, _user_workspace,
                     _workspace, query_for)
from ._args import (_backend_code, _build_options, _build_teacher, _check_backend_kw,
                    _check_same_device, _check_stride_kw, _grad_set, _hidden_weight, _matrix,
                    _reduction_code, _target_dtype_code, _targets_code, _vector, _writable)
from ._arrays import (_CODE_NAMES, _FLOAT_CODES, _Arr, _describe, _dtype_name,
                      _float_code, _need_dtype)
from ._options import CEOptions, DistillOptions
from ._options import int_option as _int_option
from ._streams import _call_stream, _device_of, _stream_int
from .core import check_error_flags

__all__ = [
    "VP_STATS", "VP_STATS_INVARIANT", "VPLossResult", "VPLinearGrads", "shard_range",
    "vp_stats", "vp_loss",
    "vp_backward", "vp_linear_stats", "vp_linear_backward", "vp_loss_workspace_size",
    "vp_backward_workspace_size", "vp_linear_stats_workspace_size",
    "vp_linear_backward_workspace_size", "VPDistillLossResult", "vp_distill_rounds",
    "vp_distill_stats", "vp_distill_loss", "vp_distill_backward", "vp_linear_distill_stats",
    "vp_linear_distill_backward", "vp_linear_distill_stats_workspace_size",
    "vp_linear_distill_backward_workspace_size",
]

VP_STATS = FCE_VP_STATS  # float32 per row of a shard's statistics
# ... with batch_invariant=True (exact sums: the results do not depend on the shards)
VP_STATS_INVARIANT = FCE_VP_STATS_INVARIANT


def _width(batch_invariant: bool) -> int:
    return VP_STATS_INVARIANT if batch_invariant else VP_STATS


class VPLossResult(NamedTuple):
    """What :func:`vp_loss` returns; entries not asked for are None."""

    loss: Any          # float32: () for mean/sum, [rows] for none
    lse: Any           # float32 [rows]: the whole vocabulary's log-sum-exp
    z_loss: Any        # float32 ()
    error_flags: Any   # uint32 [1] (int32 for torch)
    argmax: Any = None    # int64 [rows]: global class index, -1 for ignored rows
    accuracy: Any = None  # float32: () for mean/sum, [rows] for none
    entropy: Any = None   # float32 [rows]: each row's entropy (statistics made with entropy=True)


class VPLinearGrads(NamedTuple):
    """What :func:`vp_linear_backward` returns; entries not asked for are None."""

    grad_hidden: Any   # [rows, hidden]: this rank's PARTIAL ∂h (sum it over the ranks)
    grad_weight: Any   # [vocab_local, hidden]: ∂W of this rank's rows, complete
    grad_bias: Any     # [vocab_local]


def shard_range(vocab_total: int, rank: int, ranks: int, equal: bool = False) -> Tuple[int, int]:
    """(vocab_start, vocab_local) of shard ``rank`` of ``ranks`` over ``vocab_total`` classes.

    ``equal=True``: Megatron's VocabUtility (vocab_total must divide by ranks: rank r holds
    [r·V/P, (r+1)·V/P)). Otherwise the split of ``numpy.array_split`` / ``torch.tensor_split``:
    the first ``vocab_total % ranks`` shards hold one class more."""
    v, r, p = int(vocab_total), int(rank), int(ranks)
    if p < 1 or not 0 <= r < p:
        raise ValueError(f"rank must be in [0, {p}), got {r}")
    if equal:
        if v % p:
            raise ValueError(f"vocab_total ({v}) is not divisible by the {p} ranks")
        return r * (v // p), v // p
    q, m = divmod(v, p)
    return r * q + min(r, m), q + (1 if r < m else 0)


# ================================================================ shared checks ====
def _sizes(vocab_total, vocab_start=None):
    """vocab_total and vocab_start as ints (their ranges are the library's to check)."""
    vt = _int_option(vocab_total, "vocab_total")
    vs = None if vocab_start is None else _int_option(vocab_start, "vocab_start")
    return vt, vs


def _gathered(g: _Arr, rows: int, width: int = VP_STATS) -> int:
    """Check gathered statistics [ranks, rows, width] (or [ranks * rows, width]) float32,
    dense (width: VP_STATS, or VP_STATS_INVARIANT with batch_invariant); return ranks (checked
    by the library, with the 16-byte alignment)."""
    _need_dtype(g, "float32")
    if len(g.shape) == 3 and g.shape[1:] == (rows, width):
        ranks = g.shape[0]
    elif len(g.shape) == 2 and g.shape[1] == width and rows > 0 and g.shape[0] % rows == 0:
        ranks = g.shape[0] // rows
    else:
        raise ValueError(f"gathered_stats must be [ranks, {rows}, {width}] (or "
                         f"[ranks * {rows}, {width}]) float32, got shape {g.shape}")
    expect = []
    acc = 1
    for s in reversed(g.shape):
        expect.append(acc)
        acc *= s
    if tuple(reversed(expect)) != g.strides and g.size > 1:
        raise ValueError(f"gathered_stats must be dense (C-contiguous), got strides {g.strides}")
    return ranks


def _stats_out(stats, alloc: _Alloc, ref: _Arr, rows: int, width: int = VP_STATS):
    if stats is None:
        if not ref.is_cuda and ref.framework != "torch":  # NumPy: 16-byte aligned by hand
            buf = np.empty(rows * width + 4, dtype=np.float32)
            off = ((-buf.ctypes.data) % 16) // 4
            stats = buf[off:off + rows * width].reshape(rows, width)
        else:
            stats = alloc.empty((rows, width), "float32", "stats")
    a = _out(stats, "stats", ref, "float32")
    _matrix(a, rows, width, dense=True, what=f"[rows, {width}]")
    return stats, a  # (its 16-byte alignment: the library's to check)


def _ce_options(red: int, kw: dict) -> CEOptions:
    return CEOptions.from_keywords(
        reduction=red, ignore_index=kw["ignore_index"], label_smoothing=kw["label_smoothing"],
        z_loss_scale=kw["z_loss_scale"], softcap=kw["softcap"], logit_scale=kw["logit_scale"],
        shift_seq_len=kw["shift_seq_len"], shift=kw["shift"], token_scaling=kw["token_scaling"],
        batch_invariant=kw.get("batch_invariant", False))


def _options(ref: _Arr, dtype_code: int, tcode: int, red: int, kw: dict, w: Optional[_Arr],
             **extra):
    return _build_options(
        _ce_options(red, kw), backend=_check_backend_kw(ref, kw.get("backend")),
        dtype=dtype_code, target_dtype=tcode, class_weights_ptr=_ptr(w),
        deterministic=kw["deterministic"], **extra)


def _opt_kw(reduction="mean", ignore_index=-100, class_weights=None, label_smoothing=0.0,
            z_loss_scale=0.0, softcap=0.0, logit_scale=1.0, shift_seq_len=0, shift=0,
            token_scaling=False, deterministic=False, backend=None, batch_invariant=False):
    return dict(reduction=reduction, ignore_index=ignore_index, class_weights=class_weights,
                label_smoothing=label_smoothing, z_loss_scale=z_loss_scale, softcap=softcap,
                logit_scale=logit_scale, shift_seq_len=shift_seq_len, shift=shift,
                token_scaling=token_scaling, deterministic=deterministic, backend=backend,
                batch_invariant=bool(batch_invariant))


# ======================================================================== phase 1 ====
def vp_stats(logits, targets, *, vocab_total: int, vocab_start: int, reduction="mean",
             ignore_index: int = -100, class_weights=None, label_smoothing: float = 0.0,
             z_loss_scale: float = 0.0, softcap: float = 0.0, logit_scale: float = 1.0,
             shift_seq_len: int = 0, shift: int = 0, token_scaling: bool = False,
             deterministic: bool = False, dtype=None, target_dtype=None, backend=None,
             row_stride=None, stats=None, stream=None, entropy: bool = False,
             batch_invariant: bool = False):
    """Phase 1 (fce_vp_stats) over this rank's logits [rows, vocab_local] (columns
    ``[vocab_start, vocab_start + vocab_local)`` of the whole vocabulary; a row stride larger
    than vocab_local is fine): returns ``stats`` float32 [rows, VP_STATS] (allocated, 16-byte
    aligned, unless given). ``targets`` [rows] are global class indices, or this rank's shard of
    class probabilities [rows, vocab_local] of the logits' dtype. ``entropy=True``: the
    statistics also carry the shard's entropy sums, for :func:`vp_loss`'s ``return_entropy``
    (docs/semantics.md rule 18); every call of the step must then pass it.
    ``batch_invariant=True``: statistics of exact sums, [rows, VP_STATS_INVARIANT], so that
    each row's loss, lse, entropy, argmax and gradient are the same bits whatever the batch and
    the number of shards (docs/semantics.md rule 21); every call of the step must pass it."""
    _lib.require_vp()
    s_explicit = _stream_int(stream)
    z = _describe(logits, "logits", s_explicit)
    y = _describe(targets, "targets", s_explicit)
    _check_same_device(z, y)
    if len(z.shape) != 2:
        raise ValueError(f"logits must be 2-D [rows, vocab_local], got shape {z.shape}")
    rows, vl = z.shape
    vt, vs = _sizes(vocab_total, vocab_start)
    dtype_code = _float_code(z, _dtype_name(dtype), fn="fusedce.vocab_parallel.vp_stats")
    rs = _matrix(z, what="[rows, vocab_local]")
    _check_stride_kw(row_stride, rs, "row_stride")
    tcode = _targets_code(y, rows, target_dtype, vl, dtype_code)
    red = _reduction_code(reduction)
    w = _class_weights(class_weights, z, vt)
    kw = _opt_kw(reduction, ignore_index, class_weights, label_smoothing, z_loss_scale, softcap,
                 logit_scale, shift_seq_len, shift, token_scaling, deterministic, backend,
                 batch_invariant)
    call_stream = _call_stream(s_explicit, [z, y, w]) if z.is_cuda else 0
    alloc = _Alloc(z, call_stream)
    with _device_of(z):
        stats, sa = _stats_out(stats, alloc, z, rows, _width(batch_invariant))
        opts = _options(z, dtype_code, tcode, red, kw, w, row_stride=rs)
        opts.vp_entropy = 1 if entropy else 0
        shard = _lib.shard(1, vt, vs, vl)
        _lib.call("fce_vp_stats", ctypes.byref(opts), ctypes.byref(shard), rows, z.ptr, y.ptr,
                  sa.ptr, call_stream)
    return stats


def vp_linear_stats(hidden, weight, targets, bias=None, *, vocab_total: int, vocab_start: int,
                    reduction="mean", ignore_index: int = -100, class_weights=None,
                    label_smoothing: float = 0.0, z_loss_scale: float = 0.0,
                    softcap: float = 0.0, logit_scale: float = 1.0, shift_seq_len: int = 0,
                    shift: int = 0, token_scaling: bool = False, deterministic: bool = False,
                    dtype=None, target_dtype=None, backend=None, hidden_row_stride=None,
                    stats=None, workspace=None, workspace_size="optimal", stream=None,
                    entropy: bool = False):
    """Phase 1 of the fused linear + CE (fce_vp_linear_stats): the statistics of
    z = hidden [rows, D] · weightᵀ + bias over this rank's weight rows [vocab_local, D] (and
    bias [vocab_local]), the logits made piece by piece in the workspace (``workspace_size``:
    'optimal', 'min' or bytes, when it is allocated here). Returns stats [rows, VP_STATS].
    ``entropy``: as :func:`vp_stats`'s."""
    _lib.require_vp()
    s_explicit = _stream_int(stream)
    h = _describe(hidden, "hidden", s_explicit)
    W = _describe(weight, "weight", s_explicit)
    y = _describe(targets, "targets", s_explicit)
    b = _describe(bias, "bias", s_explicit) if bias is not None else None
    _check_same_device(h, W, y, b)
    rows, dim, vl, dname, dtype_code, hrs = _linear_args(
        "fusedce.vocab_parallel.vp_linear_stats", h, W, b, dtype, hidden_row_stride)
    vt, vs = _sizes(vocab_total, vocab_start)
    tcode = _targets_code(y, rows, target_dtype, vl, dtype_code)
    red = _reduction_code(reduction)
    w = _class_weights(class_weights, h, vt)
    kw = _opt_kw(reduction, ignore_index, class_weights, label_smoothing, z_loss_scale, softcap,
                 logit_scale, shift_seq_len, shift, token_scaling, deterministic, backend)
    call_stream = _call_stream(s_explicit, [h, W, y, b, w]) if h.is_cuda else 0
    alloc = _Alloc(h, call_stream)
    with _device_of(h):
        stats, sa = _stats_out(stats, alloc, h, rows)
        opts = _options(h, dtype_code, tcode, red, kw, w, hidden_row_stride=hrs)
        opts.vp_entropy = 1 if entropy else 0
        lo, hi = ctypes.c_size_t(0), ctypes.c_size_t(0)
        query_for("fce_vp_linear_stats", "fce_vp_linear_stats_workspace_size", ctypes.byref(opts),
                  rows, dim, vl, ctypes.byref(lo), ctypes.byref(hi))
        ws_ptr, ws_bytes, ws_keep = _workspace(workspace, alloc, h, int(lo.value),
                                               int(hi.value), workspace_size)
        shard = _lib.shard(1, vt, vs, vl)
        _lib.call("fce_vp_linear_stats", ctypes.byref(opts), ctypes.byref(shard), rows, dim,
                  h.ptr, W.ptr, _ptr(b), y.ptr, sa.ptr, ws_ptr, ws_bytes, call_stream)
        del ws_keep
    return stats


def _linear_args(fn: str, h: _Arr, W: _Arr, b: Optional[_Arr], dtype, hidden_row_stride):
    if len(h.shape) != 2:
        raise ValueError(f"hidden must be 2-D [rows, hidden], got shape {h.shape}")
    rows, dim = h.shape
    if len(W.shape) != 2:
        raise ValueError(f"weight must be 2-D [vocab_local, hidden], got shape {W.shape}")
    vl = W.shape[0]
    dtype_code = _float_code(h, _dtype_name(dtype), fn=fn)
    dname = _CODE_NAMES[dtype_code]
    _float_code(W, dname, "the hidden states' dtype", fn=fn)
    hrs = _matrix(h, what="[rows, hidden]")
    _check_stride_kw(hidden_row_stride, hrs, "hidden_row_stride")
    _matrix(W, cols=dim, dense=True, what="[vocab_local, hidden]")
    if b is not None:
        _float_code(b, dname, "the hidden states' dtype", fn=fn)
        _vector(b, vl, "[vocab_local]")
    return rows, dim, vl, dname, dtype_code, hrs


# ======================================================================== phase 3 ====
def vp_loss(gathered_stats, targets=None, *, vocab_total: int, rows=None, reduction="mean",
            ignore_index: int = -100, class_weights=None, label_smoothing: float = 0.0,
            z_loss_scale: float = 0.0, softcap: float = 0.0, logit_scale: float = 1.0,
            shift_seq_len: int = 0, shift: int = 0, token_scaling: bool = False,
            deterministic: bool = False, dtype="float32", target_dtype=None, backend=None,
            return_lse: bool = False, return_z_loss: bool = False, return_argmax: bool = False,
            return_accuracy: bool = False, loss=None, lse=None, z_loss=None, argmax=None,
            accuracy=None, error_flags=None, workspace=None, stream=None,
            check_targets: bool = False, entropy: bool = False,
            return_entropy: bool = False, batch_invariant: bool = False) -> VPLossResult:
    """Phase 3 (fce_vp_loss): the loss of the whole vocabulary from the ranks' gathered
    statistics [ranks, rows, VP_STATS] (any rank order; [ranks * rows, VP_STATS] too), identical
    on every rank. Outputs as :func:`fusedce.forward`'s (loss, and when asked lse, z_loss, argmax
    as global class indices, accuracy). ``dtype``: the logits' dtype (the same options as phase
    1; it does not change the result). ``check_targets`` reads the error flags (a host sync on
    CUDA) and raises ValueError for an out-of-range target or shards that do not tile.
    ``return_entropy``: each row's entropy too (docs/semantics.md rule 18), from statistics made
    with ``entropy=True``, which every call of the step must then pass (it is implied here).
    Class probabilities are not read: ``targets`` may be any rank's shard of q [rows,
    vocab_local], or None with ``rows`` and ``target_dtype`` (the probabilities' dtype).
    ``batch_invariant``: as :func:`vp_stats`'s (gathered statistics [ranks, rows,
    VP_STATS_INVARIANT])."""
    _lib.require_vp()
    s_explicit = _stream_int(stream)
    g = _describe(gathered_stats, "gathered_stats", s_explicit)
    vt, _ = _sizes(vocab_total)
    dtype_code = _FLOAT_CODES[_dtype_name(dtype) or "float32"]
    if targets is None:  # class probabilities, which the loss does not read
        tname = _dtype_name(target_dtype)
        if rows is None or tname not in _FLOAT_CODES:
            raise ValueError("targets=None needs rows= and a floating-point target_dtype= (class "
                             "probabilities, which vp_loss does not read)")
        y, rows, tcode = None, _int_option(rows, "rows"), _FLOAT_CODES[tname]
    else:
        y = _describe(targets, "targets", s_explicit)
        _check_same_device(g, y)
        if len(y.shape) == 2 and y.dtype in _FLOAT_CODES:  # class probabilities: not read
            tname = _dtype_name(target_dtype)
            if tname is not None and tname != y.dtype:
                raise TypeError(f"targets have dtype {y.dtype} but target_dtype={target_dtype!r}")
            tcode = _FLOAT_CODES[y.dtype]
        elif len(y.shape) != 1:
            raise ValueError(f"targets must be 1-D [rows] (class indices) or 2-D [rows, "
                             f"vocab_local] (class probabilities), got shape {y.shape}")
        else:
            tcode = _targets_code(y, y.shape[0], target_dtype)
        if rows is not None and _int_option(rows, "rows") != y.shape[0]:
            raise ValueError(f"rows={rows} disagrees with targets of shape {y.shape}")
        rows = y.shape[0]
    ranks = _gathered(g, rows, _width(batch_invariant))
    red = _reduction_code(reduction)
    w = _class_weights(class_weights, g, vt)
    kw = _opt_kw(reduction, ignore_index, class_weights, label_smoothing, z_loss_scale, softcap,
                 logit_scale, shift_seq_len, shift, token_scaling, deterministic, backend,
                 batch_invariant)
    call_stream = _call_stream(s_explicit, [g, y, w]) if g.is_cuda else 0
    alloc = _Alloc(g, call_stream)
    none = red == FCE_REDUCTION_NONE
    # class probabilities: the library does not read targets (NULL)
    y_ptr = 0 if (y is None or tcode in _FLOAT_CODES.values()) else y.ptr
    with _device_of(g):
        if loss is None:
            loss = alloc.empty((rows,) if none else (), "float32", "loss")
        la = _out(loss, "loss", g, "float32")
        _vector(la, rows if none else 1, "(the loss)", allow_scalar=not none)
        lse_a = zl_a = None
        if lse is None and return_lse:
            lse = alloc.empty((rows,), "float32", "lse")
        if lse is not None:
            lse_a = _out(lse, "lse", g, "float32")
            _vector(lse_a, rows, "[rows]")
        if z_loss is None and return_z_loss:
            z_loss = alloc.empty((), "float32", "z_loss")
        if z_loss is not None:
            zl_a = _out(z_loss, "z_loss", g, "float32")
            _vector(zl_a, 1, "()", allow_scalar=True)
        argmax, am_a, accuracy, acc_a = _argmax_accuracy(argmax, return_argmax, accuracy,
                                                         return_accuracy, alloc, g, rows, red)
        flags, flags_ptr = _error_flags(error_flags, alloc, g)
        opts = _options(g, dtype_code, tcode, red, kw, w)
        opts.vp_entropy = 1 if (entropy or return_entropy) else 0
        ent_a = None
        if return_entropy:
            ent = alloc.empty((rows,), "float32", "entropy")
            ent_a = _out(ent, "entropy", g, "float32")
        need = ctypes.c_size_t(0)
        query_for("fce_vp_loss", "fce_vp_loss_workspace_size", ctypes.byref(opts), ranks, rows,
                  vt, ctypes.byref(need))
        if workspace is None:
            ws_ptr, ws_bytes, ws_keep = alloc.workspace(int(need.value))
        else:
            ws_ptr, ws_bytes, ws_keep = _user_workspace(workspace, g)
        shard = _lib.shard(ranks, vt, 0, vt)
        out = _lib.outputs(loss=la.ptr, lse=_ptr(lse_a), z_loss=_ptr(zl_a), argmax=_ptr(am_a),
                           accuracy=_ptr(acc_a), error_flags=flags_ptr, entropy=_ptr(ent_a))
        _lib.call("fce_vp_loss", ctypes.byref(opts), ctypes.byref(shard), rows, y_ptr, g.ptr,
                  ctypes.byref(out), ws_ptr, ws_bytes, call_stream)
        del ws_keep
    if check_targets:
        check_error_flags(flags)
    return VPLossResult(loss, lse, z_loss, flags, argmax, accuracy,
                        ent if return_entropy else None)


def vp_backward(logits, targets, gathered_stats, grad_output=None, *, vocab_total: int,
                vocab_start: int, reduction="mean", ignore_index: int = -100,
                class_weights=None, label_smoothing: float = 0.0, z_loss_scale: float = 0.0,
                softcap: float = 0.0, logit_scale: float = 1.0, shift_seq_len: int = 0,
                shift: int = 0, token_scaling: bool = False, deterministic: bool = False,
                dtype=None, target_dtype=None, backend=None, row_stride=None,
                grad_row_stride=None, grad_logits=None, in_place: bool = False,
                workspace=None, stream=None, entropy: bool = False,
                batch_invariant: bool = False):
    """Phase 3, the gradient of this rank's logits [rows, vocab_local] (fce_vp_backward) from the
    gathered statistics, scaled by ``grad_output`` (a float, or float32 () for mean/sum, [rows]
    for none; default 1). Returns grad_logits (allocated unless given; ``in_place=True`` writes
    it over the logits). The step's error flags are :func:`vp_loss`'s. ``entropy``: the
    statistics were made with ``entropy=True``; ``batch_invariant``: as :func:`vp_stats`'s."""
    _lib.require_vp()
    s_explicit = _stream_int(stream)
    z = _describe(logits, "logits", s_explicit)
    y = _describe(targets, "targets", s_explicit)
    g = _describe(gathered_stats, "gathered_stats", s_explicit)
    _check_same_device(z, y, g)
    if len(z.shape) != 2:
        raise ValueError(f"logits must be 2-D [rows, vocab_local], got shape {z.shape}")
    rows, vl = z.shape
    vt, vs = _sizes(vocab_total, vocab_start)
    dtype_code = _float_code(z, _dtype_name(dtype), fn="fusedce.vocab_parallel.vp_backward")
    rs = _matrix(z, what="[rows, vocab_local]")
    _check_stride_kw(row_stride, rs, "row_stride")
    tcode = _targets_code(y, rows, target_dtype, vl, dtype_code)
    ranks = _gathered(g, rows, _width(batch_invariant))
    red = _reduction_code(reduction)
    w = _class_weights(class_weights, z, vt)
    if in_place and grad_logits is not None:
        raise ValueError("pass either in_place=True or grad_logits=, not both")
    kw = _opt_kw(reduction, ignore_index, class_weights, label_smoothing, z_loss_scale, softcap,
                 logit_scale, shift_seq_len, shift, token_scaling, deterministic, backend,
                 batch_invariant)
    call_stream = _call_stream(s_explicit, [z, y, g, w]) if z.is_cuda else 0
    alloc = _Alloc(z, call_stream)
    with _device_of(z):
        if in_place:
            _writable(z)
            grad_logits, g_a, grs = logits, z, rs
        else:
            if grad_logits is None:
                grad_logits = alloc.empty((rows, vl), _CODE_NAMES[dtype_code], "grad_logits",
                                          like=z)
            g_a = _out(grad_logits, "grad_logits", z)
            _float_code(g_a, _CODE_NAMES[dtype_code], "the logits' dtype")
            grs = _matrix(g_a, rows, vl, what="[rows, vocab_local]")
        _check_stride_kw(grad_row_stride, grs, "grad_row_stride")
        go_ptr, go_keep = _grad_output(grad_output, alloc, z, rows, red == FCE_REDUCTION_NONE)
        opts = _options(z, dtype_code, tcode, red, kw, w, row_stride=rs, grad_row_stride=grs)
        opts.vp_entropy = 1 if entropy else 0
        need = ctypes.c_size_t(0)
        query_for("fce_vp_backward", "fce_vp_backward_workspace_size", ctypes.byref(opts), ranks,
                  rows, vt, vl, ctypes.byref(need))
        if workspace is None:
            ws_ptr, ws_bytes, ws_keep = alloc.workspace(int(need.value))
        else:
            ws_ptr, ws_bytes, ws_keep = _user_workspace(workspace, z)
        shard = _lib.shard(ranks, vt, vs, vl)
        grads = _lib.gradients(grad_output=go_ptr, grad_logits=g_a.ptr)
        _lib.call("fce_vp_backward", ctypes.byref(opts), ctypes.byref(shard), rows, z.ptr, y.ptr,
                  g.ptr, ctypes.byref(grads), ws_ptr, ws_bytes, call_stream)
        del ws_keep, go_keep
    return grad_logits


def vp_linear_backward(hidden, weight, targets, gathered_stats, bias=None, grad_output=None, *,
                       vocab_total: int, vocab_start: int, reduction="mean",
                       ignore_index: int = -100, class_weights=None,
                       label_smoothing: float = 0.0, z_loss_scale: float = 0.0,
                       softcap: float = 0.0, logit_scale: float = 1.0, shift_seq_len: int = 0,
                       shift: int = 0, token_scaling: bool = False, deterministic: bool = False,
                       dtype=None, target_dtype=None, backend=None, hidden_row_stride=None,
                       return_grad=True, grad_hidden_dtype="float32", accumulate: bool = False,
                       grad_weight_fp32: bool = False, grad_hidden=None, grad_weight=None,
                       grad_bias=None, workspace=None, workspace_size="optimal",
                       stream=None, entropy: bool = False) -> VPLinearGrads:
    """Phase 3 of the fused linear + CE (fce_vp_linear_backward): the gradients of this rank,
    scaled by ``grad_output`` (default 1). ``return_grad``: True or a subset of ('hidden',
    'weight', 'bias'), or pass the buffers. grad_hidden [rows, hidden] is this rank's PARTIAL ∂h,
    of ``grad_hidden_dtype`` ('float32', the default, keeps the sum over ranks exact to float32;
    or the inputs' dtype): ALL-REDUCE (sum) it over the ranks. grad_weight [vocab_local, hidden]
    and grad_bias [vocab_local] are the shard's, complete (the inputs' dtype, or float32 with
    ``grad_weight_fp32``; ``accumulate`` adds into them). The step's error flags are
    :func:`vp_loss`'s. ``entropy``: the statistics were made with ``entropy=True``."""
    _lib.require_vp()
    s_explicit = _stream_int(stream)
    h = _describe(hidden, "hidden", s_explicit)
    W = _describe(weight, "weight", s_explicit)
    y = _describe(targets, "targets", s_explicit)
    g = _describe(gathered_stats, "gathered_stats", s_explicit)
    b = _describe(bias, "bias", s_explicit) if bias is not None else None
    _check_same_device(h, W, y, g, b)
    rows, dim, vl, dname, dtype_code, hrs = _linear_args(
        "fusedce.vocab_parallel.vp_linear_backward", h, W, b, dtype, hidden_row_stride)
    vt, vs = _sizes(vocab_total, vocab_start)
    tcode = _targets_code(y, rows, target_dtype, vl, dtype_code)
    ranks = _gathered(g, rows)
    red = _reduction_code(reduction)
    w = _class_weights(class_weights, h, vt)
    grads = _grad_set(return_grad, b is not None)
    gh_name = _dtype_name(grad_hidden_dtype) or "float32"
    if gh_name not in _FLOAT_CODES:  # float32 or the inputs' dtype: the library checks which
        raise TypeError(f"grad_hidden_dtype must be a floating-point dtype, got "
                        f"{grad_hidden_dtype!r}")
    gdtype = "float32" if grad_weight_fp32 else dname
    kw = _opt_kw(reduction, ignore_index, class_weights, label_smoothing, z_loss_scale, softcap,
                 logit_scale, shift_seq_len, shift, token_scaling, deterministic, backend)
    call_stream = _call_stream(s_explicit, [h, W, y, g, b, w]) if h.is_cuda else 0
    alloc = _Alloc(h, call_stream)
    with _device_of(h):
        (grad_hidden, grad_weight, grad_bias), (gh_a, gw_a, gb_a) = _linear_grads(
            alloc, h, W, b, grads, grad_hidden, grad_weight, grad_bias, rows=rows, dim=dim,
            vocab=vl, gh_dtype=gh_name, gh_like=h if gh_name == dname else None,
            gh_what="grad_hidden_dtype", grad_weight_fp32=grad_weight_fp32, wdtype=gdtype,
            accumulate=accumulate, vocab_name="vocab_local")
        go_ptr, go_keep = _grad_output(grad_output, alloc, h, rows, red == FCE_REDUCTION_NONE)
        opts = _options(h, dtype_code, tcode, red, kw, w, hidden_row_stride=hrs,
                        accumulate=accumulate, grad_weight_fp32=grad_weight_fp32)
        opts.vp_entropy = 1 if entropy else 0
        gh_code = _FLOAT_CODES[gh_name]
        lo, hi = ctypes.c_size_t(0), ctypes.c_size_t(0)
        query_for("fce_vp_linear_backward", "fce_vp_linear_backward_workspace_size",
                  ctypes.byref(opts), ranks, rows, dim, vt, vl, gh_code, ctypes.byref(lo),
                  ctypes.byref(hi))
        ws_ptr, ws_bytes, ws_keep = _workspace(workspace, alloc, h, int(lo.value),
                                               int(hi.value), workspace_size)
        shard = _lib.shard(ranks, vt, vs, vl)
        grads = _lib.gradients(grad_output=go_ptr, grad_hidden=_ptr(gh_a),
                               grad_weight=_ptr(gw_a), grad_bias=_ptr(gb_a),
                               grad_hidden_dtype=gh_code)
        _lib.call("fce_vp_linear_backward", ctypes.byref(opts), ctypes.byref(shard), rows, dim,
                  h.ptr, W.ptr, _ptr(b), y.ptr, g.ptr, ctypes.byref(grads), ws_ptr, ws_bytes,
                  call_stream)
        del ws_keep, go_keep
    return VPLinearGrads(grad_hidden, grad_weight, grad_bias)


# ================================================================ workspace sizes ====
def _query(dtype, target_dtype, reduction, class_weights, backend, kw, **extra):
    b = _backend_code(backend)
    w_ptr = _describe(class_weights, "class_weights").ptr if class_weights is not None else 0
    return _build_options(
        _ce_options(_reduction_code(reduction), kw),
        backend=b if b is not None else _lib.FCE_BACKEND_CPU,
        dtype=_FLOAT_CODES[_dtype_name(dtype) or "float32"],
        target_dtype=_target_dtype_code(target_dtype),
        class_weights_ptr=w_ptr, deterministic=kw["deterministic"], **extra)


def _qkw(ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, shift_seq_len,
         shift, token_scaling, deterministic):
    return dict(ignore_index=ignore_index, label_smoothing=label_smoothing,
                z_loss_scale=z_loss_scale, softcap=softcap, logit_scale=logit_scale,
                shift_seq_len=shift_seq_len, deterministic=deterministic, shift=shift,
                token_scaling=token_scaling)


def vp_loss_workspace_size(ranks: int, rows: int, vocab_total: int, *, backend="cpu",
                           dtype="float32", target_dtype="int64", reduction="mean",
                           ignore_index=-100, class_weights=None, label_smoothing=0.0,
                           z_loss_scale=0.0, softcap=0.0, logit_scale=1.0, shift_seq_len=0,
                           shift=0, token_scaling=False, deterministic=False) -> int:
    """fce_vp_loss_workspace_size: scratch bytes of :func:`vp_loss`."""
    _lib.require_vp()
    o = _query(dtype, target_dtype, reduction, class_weights, backend,
               _qkw(ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale,
                    shift_seq_len, shift, token_scaling, deterministic))
    out = ctypes.c_size_t(0)
    _lib.call("fce_vp_loss_workspace_size", ctypes.byref(o), int(ranks), int(rows),
              int(vocab_total), ctypes.byref(out))
    return int(out.value)


def vp_backward_workspace_size(ranks: int, rows: int, vocab_total: int, vocab_local: int, *,
                               backend="cpu", dtype="float32", target_dtype="int64",
                               reduction="mean", ignore_index=-100, class_weights=None,
                               label_smoothing=0.0, z_loss_scale=0.0, softcap=0.0,
                               logit_scale=1.0, shift_seq_len=0, shift=0, token_scaling=False,
                               deterministic=False) -> int:
    """fce_vp_backward_workspace_size: scratch bytes of :func:`vp_backward`."""
    _lib.require_vp()
    o = _query(dtype, target_dtype, reduction, class_weights, backend,
               _qkw(ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale,
                    shift_seq_len, shift, token_scaling, deterministic))
    out = ctypes.c_size_t(0)
    _lib.call("fce_vp_backward_workspace_size", ctypes.byref(o), int(ranks), int(rows),
              int(vocab_total), int(vocab_local), ctypes.byref(out))
    return int(out.value)


def vp_linear_stats_workspace_size(rows: int, hidden: int, vocab_local: int, *, backend="cpu",
                                   dtype="float32", target_dtype="int64", reduction="mean",
                                   ignore_index=-100, class_weights=None, label_smoothing=0.0,
                                   z_loss_scale=0.0, softcap=0.0, logit_scale=1.0,
                                   shift_seq_len=0, shift=0, token_scaling=False,
                                   deterministic=False) -> Tuple[int, int]:
    """fce_vp_linear_stats_workspace_size: (min_bytes, optimal_bytes)."""
    _lib.require_vp()
    o = _query(dtype, target_dtype, reduction, class_weights, backend,
               _qkw(ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale,
                    shift_seq_len, shift, token_scaling, deterministic))
    lo, hi = ctypes.c_size_t(0), ctypes.c_size_t(0)
    _lib.call("fce_vp_linear_stats_workspace_size", ctypes.byref(o), int(rows), int(hidden),
              int(vocab_local), ctypes.byref(lo), ctypes.byref(hi))
    return int(lo.value), int(hi.value)


def vp_linear_backward_workspace_size(ranks: int, rows: int, hidden: int, vocab_total: int,
                                      vocab_local: int, *, grad_hidden_dtype="float32",
                                      backend="cpu", dtype="float32", target_dtype="int64",
                                      reduction="mean", ignore_index=-100, class_weights=None,
                                      label_smoothing=0.0, z_loss_scale=0.0, softcap=0.0,
                                      logit_scale=1.0, shift_seq_len=0, shift=0,
                                      token_scaling=False, deterministic=False,
                                      accumulate=False,
                                      grad_weight_fp32=False) -> Tuple[int, int]:
    """fce_vp_linear_backward_workspace_size: (min_bytes, optimal_bytes)."""
    _lib.require_vp()
    o = _query(dtype, target_dtype, reduction, class_weights, backend,
               _qkw(ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale,
                    shift_seq_len, shift, token_scaling, deterministic),
               accumulate=accumulate, grad_weight_fp32=grad_weight_fp32)
    lo, hi = ctypes.c_size_t(0), ctypes.c_size_t(0)
    _lib.call("fce_vp_linear_backward_workspace_size", ctypes.byref(o), int(ranks), int(rows),
              int(hidden), int(vocab_total), int(vocab_local),
              _FLOAT_CODES[_dtype_name(grad_hidden_dtype) or "float32"], ctypes.byref(lo),
              ctypes.byref(hi))
    return int(lo.value), int(hi.value)


# ==================================================== distillation (rule 22) ====
class VPDistillLossResult(NamedTuple):
    """What :func:`vp_distill_loss` returns; entries not asked for are None."""

    loss: Any          # float32: () for mean/sum, [rows] for none (0 for rows not counted)
    lse: Any           # float32 [rows]: the student's log-sum-exp of a / T over the whole row
    error_flags: Any   # uint32 [1] (int32 for torch)


def _distill_opts(reduction, divergence, beta, temperature, ignore_index, softcap, logit_scale):
    return DistillOptions.from_keywords(
        reduction=_reduction_code(reduction), divergence=divergence, beta=beta,
        temperature=temperature, ignore_index=ignore_index, softcap=softcap,
        logit_scale=logit_scale)


def _distill_shards(fn: str, logits, teacher_logits, s_explicit, dtype):
    """The student's and the teacher's shards [rows, vocab_local] of one dtype: their _Arr,
    rows, vocab_local, the dtype code and both row strides."""
    z = _describe(logits, "logits", s_explicit)
    t = _describe(teacher_logits, "teacher_logits", s_explicit)
    if len(z.shape) != 2:
        raise ValueError(f"logits must be 2-D [rows, vocab_local], got shape {z.shape}")
    rows, vl = z.shape
    dtype_code = _float_code(z, _dtype_name(dtype), fn=fn)
    _float_code(t, _CODE_NAMES[dtype_code], "the logits' dtype", fn=fn)
    rs = _matrix(z, what="[rows, vocab_local]")
    trs = _matrix(t, rows, vl, what="[rows, vocab_local]")
    return z, t, rows, vl, dtype_code, rs, trs


def _queried_workspace(fn: str, workspace, alloc: _Alloc, ref: _Arr, *query_args):
    """(pointer, bytes, keep-alive) of the workspace of call ``fn``: the caller's, or one of
    the size its query (``fn``_workspace_size over query_args) returns, allocated."""
    need = ctypes.c_size_t(0)
    query_for(fn, fn + "_workspace_size", *query_args, ctypes.byref(need))
    if workspace is None:
        return alloc.workspace(int(need.value))
    return _user_workspace(workspace, ref)


def vp_distill_rounds(divergence="forward_kl", beta: float = 0.5) -> int:
    """fce_vp_distill_rounds: the rounds of statistics the divergence needs on shards: 1 for
    the forward and the reverse KL, 2 for the JSD with 0 < beta < 1."""
    opts = _distill_opts("mean", divergence, beta, 1.0, -100, 0.0, 1.0)
    t = _build_teacher(opts)
    n = ctypes.c_int32(0)
    _lib.call("fce_vp_distill_rounds", ctypes.byref(t), ctypes.byref(n))
    return int(n.value)


def vp_distill_stats(logits, teacher_logits, previous=None, *, vocab_total: int,
                     vocab_start: int, round: Optional[int] = None, divergence="forward_kl",
                     beta: float = 0.5, temperature: float = 1.0, reduction="mean",
                     ignore_index: int = -100, softcap: float = 0.0, logit_scale: float = 1.0,
                     dtype=None, backend=None, row_stride=None, stats=None, stream=None):
    """One round of the distillation's statistics (fce_vp_distill_stats) over this rank's
    shards of the student's and the teacher's logits [rows, vocab_local] (columns
    ``[vocab_start, vocab_start + vocab_local)``, one dtype): returns ``stats`` float32
    [rows, VP_STATS]. ``previous``: None in round 1; round 1's gathered statistics [ranks, rows,
    VP_STATS] in round 2 (the JSD with 0 < beta < 1, :func:`vp_distill_rounds`). ``round``
    defaults to 1 without ``previous``, 2 with it."""
    s_explicit = _stream_int(stream)
    z, t, rows, vl, dtype_code, rs, trs = _distill_shards(
        "fusedce.vocab_parallel.vp_distill_stats", logits, teacher_logits, s_explicit, dtype)
    _check_stride_kw(row_stride, rs, "row_stride")
    vt, vs = _sizes(vocab_total, vocab_start)
    p = _describe(previous, "previous", s_explicit) if previous is not None else None
    _check_same_device(z, t, p)
    ranks = _gathered(p, rows) if p is not None else 1
    rnd = (1 if p is None else 2) if round is None else _int_option(round, "round")
    opts = _distill_opts(reduction, divergence, beta, temperature, ignore_index, softcap,
                         logit_scale)
    call_stream = _call_stream(s_explicit, [z, t, p]) if z.is_cuda else 0
    alloc = _Alloc(z, call_stream)
    with _device_of(z):
        stats, sa = _stats_out(stats, alloc, z, rows)
        o = _build_options(opts.ce(), backend=_check_backend_kw(z, backend), dtype=dtype_code,
                           target_dtype=_target_dtype_code(None), row_stride=rs)
        teacher = _build_teacher(opts, logits=t.ptr, row_stride=trs)
        shard = _lib.shard(ranks, vt, vs, vl)
        _lib.call("fce_vp_distill_stats", ctypes.byref(o), ctypes.byref(teacher),
                  ctypes.byref(shard), rnd, rows, z.ptr, _ptr(p), sa.ptr, call_stream)
    return stats


def vp_distill_loss(gathered_stats, targets=None, *, vocab_total: int, rows=None,
                    divergence="forward_kl", beta: float = 0.5, temperature: float = 1.0,
                    reduction="mean", ignore_index: int = -100, softcap: float = 0.0,
                    logit_scale: float = 1.0, dtype="float32", target_dtype=None, backend=None,
                    return_lse: bool = False, loss=None, lse=None, error_flags=None,
                    workspace=None, stream=None,
                    check_targets: bool = False) -> VPDistillLossResult:
    """The divergence of the whole rows (fce_vp_distill_loss) from the LAST round's gathered
    statistics [ranks, rows, VP_STATS], identical on every rank: what :func:`fusedce.distill`
    returns for the unsharded logits. ``targets`` (int32/int64 [rows], optional): rows whose
    target is ``ignore_index`` are not counted; None counts every row (then ``rows=``).
    ``check_targets`` reads the error flags (a host sync on CUDA) and raises ValueError for
    statistics that do not tile the vocabulary or are of the wrong round."""
    s_explicit = _stream_int(stream)
    g = _describe(gathered_stats, "gathered_stats", s_explicit)
    vt, _ = _sizes(vocab_total)
    y = _describe(targets, "targets", s_explicit) if targets is not None else None
    _check_same_device(g, y)
    if y is None:
        if rows is None:
            raise ValueError("targets=None needs rows=")
        rows, tcode = _int_option(rows, "rows"), _target_dtype_code(target_dtype)
    else:
        if len(y.shape) != 1:
            raise ValueError(f"targets must be 1-D [rows], got shape {y.shape}")
        if rows is not None and _int_option(rows, "rows") != y.shape[0]:
            raise ValueError(f"rows={rows} disagrees with targets of shape {y.shape}")
        rows = y.shape[0]
        tcode = _targets_code(y, rows, target_dtype)
    ranks = _gathered(g, rows)
    opts = _distill_opts(reduction, divergence, beta, temperature, ignore_index, softcap,
                         logit_scale)
    call_stream = _call_stream(s_explicit, [g, y]) if g.is_cuda else 0
    alloc = _Alloc(g, call_stream)
    with _device_of(g):
        loss, la, lse, lse_a = _loss_lse(alloc, g, rows, opts.per_row, loss, lse, return_lse)
        flags, flags_ptr = _error_flags(error_flags, alloc, g)
        o = _build_options(opts.ce(), backend=_check_backend_kw(g, backend),
                           dtype=_FLOAT_CODES[_dtype_name(dtype) or "float32"],
                           target_dtype=tcode)
        teacher = _build_teacher(opts)
        ws_ptr, ws_bytes, ws_keep = _queried_workspace(
            "fce_vp_distill_loss", workspace, alloc, g, ctypes.byref(o), ctypes.byref(teacher),
            ranks, rows, vt)
        shard = _lib.shard(ranks, vt, 0, vt)
        out = _lib.outputs(loss=la.ptr, lse=_ptr(lse_a), error_flags=flags_ptr)
        _lib.call("fce_vp_distill_loss", ctypes.byref(o), ctypes.byref(teacher),
                  ctypes.byref(shard), rows, _ptr(y), g.ptr, ctypes.byref(out), ws_ptr, ws_bytes,
                  call_stream)
        del ws_keep
    if check_targets:
        check_error_flags(flags)
    return VPDistillLossResult(loss, lse, flags)


def vp_distill_backward(logits, teacher_logits, gathered_stats, targets=None, grad_output=None,
                        *, vocab_total: int, vocab_start: int, divergence="forward_kl",
                        beta: float = 0.5, temperature: float = 1.0, reduction="mean",
                        ignore_index: int = -100, softcap: float = 0.0,
                        logit_scale: float = 1.0, dtype=None, target_dtype=None, backend=None,
                        row_stride=None, grad_row_stride=None, grad_logits=None,
                        in_place: bool = False, workspace=None, stream=None):
    """The gradient of this rank's student columns (fce_vp_distill_backward) from the LAST
    round's gathered statistics, scaled by ``grad_output`` (a float, or float32 () for mean/sum,
    [rows] for none; default 1). Returns grad_logits [rows, vocab_local] (allocated unless
    given; ``in_place=True`` writes it over the logits). The teacher gets no gradient."""
    s_explicit = _stream_int(stream)
    z, t, rows, vl, dtype_code, rs, trs = _distill_shards(
        "fusedce.vocab_parallel.vp_distill_backward", logits, teacher_logits, s_explicit, dtype)
    _check_stride_kw(row_stride, rs, "row_stride")
    vt, vs = _sizes(vocab_total, vocab_start)
    g = _describe(gathered_stats, "gathered_stats", s_explicit)
    y = _describe(targets, "targets", s_explicit) if targets is not None else None
    _check_same_device(z, t, g, y)
    tcode = _targets_code(y, rows, target_dtype) if y is not None else _target_dtype_code(
        target_dtype)
    ranks = _gathered(g, rows)
    opts = _distill_opts(reduction, divergence, beta, temperature, ignore_index, softcap,
                         logit_scale)
    call_stream = _call_stream(s_explicit, [z, t, g, y]) if z.is_cuda else 0
    alloc = _Alloc(z, call_stream)
    with _device_of(z):
        grad_logits, g_a, grs = _grad_logits(
            alloc, logits, z, rs, _CODE_NAMES[dtype_code], in_place=in_place,
            grad_logits=grad_logits, return_grad=True, grad_row_stride=grad_row_stride)
        go_ptr, go_keep = _grad_output(grad_output, alloc, z, rows, opts.per_row)
        o = _build_options(opts.ce(), backend=_check_backend_kw(z, backend), dtype=dtype_code,
                           target_dtype=tcode, row_stride=rs, grad_row_stride=grs)
        teacher = _build_teacher(opts, logits=t.ptr, row_stride=trs)
        ws_ptr, ws_bytes, ws_keep = _queried_workspace(
            "fce_vp_distill_backward", workspace, alloc, z, ctypes.byref(o),
            ctypes.byref(teacher), ranks, rows, vt, vl)
        shard = _lib.shard(ranks, vt, vs, vl)
        grads = _lib.gradients(grad_output=go_ptr, grad_logits=g_a.ptr)
        _lib.call("fce_vp_distill_backward", ctypes.byref(o), ctypes.byref(teacher),
                  ctypes.byref(shard), rows, z.ptr, _ptr(y), g.ptr, ctypes.byref(grads), ws_ptr,
                  ws_bytes, call_stream)
        del ws_keep, go_keep
    return grad_logits


# ======================================== distillation from hidden states (rule 22) ====
class _LinearShards(NamedTuple):
    """The inputs of the linear distillation calls, described and checked."""

    h: _Arr
    W: _Arr
    th: _Arr
    tW: _Arr
    rows: int
    dim: int
    vocab_local: int
    teacher_dim: int
    dtype_code: int
    hrs: int   # the student's hidden row stride
    thrs: int  # the teacher's


def _linear_shards(fn: str, hidden, weight, teacher_hidden, teacher_weight, s_explicit, dtype,
                   hidden_row_stride) -> _LinearShards:
    """hidden [rows, D] and this rank's weight rows [vocab_local, D], the teacher's
    teacher_hidden [rows, D'] and weight rows [vocab_local, D'], all of one dtype."""
    h = _describe(hidden, "hidden", s_explicit)
    W = _describe(weight, "weight", s_explicit)
    th = _describe(teacher_hidden, "teacher_hidden", s_explicit)
    tW = _describe(teacher_weight, "teacher_weight", s_explicit)
    rows, dim, vl = _hidden_weight(h, W, "vocab_local")
    _, tdim, _ = _hidden_weight(th, tW, "vocab_local")
    dtype_code = _float_code(h, _dtype_name(dtype), fn=fn)
    for a in (W, th, tW):
        _float_code(a, _CODE_NAMES[dtype_code], "the hidden states' dtype", fn=fn)
    hrs = _matrix(h, what="[rows, hidden]")
    _check_stride_kw(hidden_row_stride, hrs, "hidden_row_stride")
    _matrix(W, cols=dim, dense=True, what="[vocab_local, hidden]")
    thrs = _matrix(th, rows, what="[rows, teacher hidden]")
    _matrix(tW, vl, tdim, dense=True, what="[vocab_local, teacher hidden]")
    return _LinearShards(h, W, th, tW, rows, dim, vl, tdim, dtype_code, hrs, thrs)


def vp_linear_distill_stats(hidden, weight, teacher_hidden, teacher_weight, previous=None, *,
                            vocab_total: int, vocab_start: int, round: Optional[int] = None,
                            divergence="forward_kl", beta: float = 0.5,
                            temperature: float = 1.0, reduction="mean",
                            ignore_index: int = -100, softcap: float = 0.0,
                            logit_scale: float = 1.0, dtype=None, backend=None,
                            hidden_row_stride=None, stats=None, workspace=None,
                            workspace_size="optimal", stream=None):
    """One round of the distillation's statistics from hidden states
    (fce_vp_linear_distill_stats): :func:`vp_distill_stats` of the logits hidden [rows, D] ·
    weightᵀ and teacher_hidden [rows, D'] · teacher_weightᵀ, weight and teacher_weight this
    rank's rows [vocab_local, D] and [vocab_local, D'] (no bias), both logits made piece by
    piece in the workspace (``workspace_size``: 'optimal', 'min' or bytes, when it is allocated
    here). Returns ``stats`` float32 [rows, VP_STATS]; ``previous`` and ``round`` as for
    :func:`vp_distill_stats`."""
    s_explicit = _stream_int(stream)
    a = _linear_shards("fusedce.vocab_parallel.vp_linear_distill_stats", hidden, weight,
                       teacher_hidden, teacher_weight, s_explicit, dtype, hidden_row_stride)
    vt, vs = _sizes(vocab_total, vocab_start)
    p = _describe(previous, "previous", s_explicit) if previous is not None else None
    _check_same_device(a.h, a.W, a.th, a.tW, p)
    ranks = _gathered(p, a.rows) if p is not None else 1
    rnd = (1 if p is None else 2) if round is None else _int_option(round, "round")
    opts = _distill_opts(reduction, divergence, beta, temperature, ignore_index, softcap,
                         logit_scale)
    call_stream = _call_stream(s_explicit, [a.h, a.W, a.th, a.tW, p]) if a.h.is_cuda else 0
    alloc = _Alloc(a.h, call_stream)
    with _device_of(a.h):
        stats, sa = _stats_out(stats, alloc, a.h, a.rows)
        o = _build_options(opts.ce(), backend=_check_backend_kw(a.h, backend),
                           dtype=a.dtype_code, target_dtype=_target_dtype_code(None),
                           hidden_row_stride=a.hrs)
        teacher = _build_teacher(opts, hidden_states=a.th.ptr, weight=a.tW.ptr,
                                 hidden=a.teacher_dim, hidden_row_stride=a.thrs)
        lo, hi = ctypes.c_size_t(0), ctypes.c_size_t(0)
        query_for("fce_vp_linear_distill_stats", "fce_vp_linear_distill_stats_workspace_size",
                  ctypes.byref(o), ctypes.byref(teacher), a.rows, a.dim, a.vocab_local,
                  ctypes.byref(lo), ctypes.byref(hi))
        ws_ptr, ws_bytes, ws_keep = _workspace(workspace, alloc, a.h, int(lo.value),
                                               int(hi.value), workspace_size)
        shard = _lib.shard(ranks, vt, vs, a.vocab_local)
        _lib.call("fce_vp_linear_distill_stats", ctypes.byref(o), ctypes.byref(teacher),
                  ctypes.byref(shard), rnd, a.rows, a.dim, a.h.ptr, a.W.ptr, 0, _ptr(p), sa.ptr,
                  ws_ptr, ws_bytes, call_stream)
        del ws_keep
    return stats


def vp_linear_distill_backward(hidden, weight, teacher_hidden, teacher_weight, gathered_stats,
                               targets=None, grad_output=None, *, vocab_total: int,
                               vocab_start: int, divergence="forward_kl", beta: float = 0.5,
                               temperature: float = 1.0, reduction="mean",
                               ignore_index: int = -100, softcap: float = 0.0,
                               logit_scale: float = 1.0, dtype=None, target_dtype=None,
                               backend=None, hidden_row_stride=None, return_grad=True,
                               grad_hidden_dtype="float32", accumulate: bool = False,
                               grad_weight_fp32: bool = False, grad_hidden=None,
                               grad_weight=None, workspace=None, workspace_size="optimal",
                               stream=None) -> VPLinearGrads:
    """The student's gradients of this rank from the LAST round's gathered statistics
    (fce_vp_linear_distill_backward), scaled by ``grad_output`` (default 1); the inputs as for
    :func:`vp_linear_distill_stats`. ``return_grad``: True or a subset of ('hidden',
    'weight'), or pass the buffers. grad_hidden [rows, D] is this rank's PARTIAL ∂h, of
    ``grad_hidden_dtype`` ('float32', the default, or the inputs' dtype): ALL-REDUCE (sum) it
    over the ranks. grad_weight [vocab_local, D] is the shard's, complete (the inputs' dtype, or
    float32 with ``grad_weight_fp32``; ``accumulate`` adds into it). grad_bias is None: the
    linear layers have no bias. The loss is :func:`vp_distill_loss`'s."""
    s_explicit = _stream_int(stream)
    a = _linear_shards("fusedce.vocab_parallel.vp_linear_distill_backward", hidden, weight,
                       teacher_hidden, teacher_weight, s_explicit, dtype, hidden_row_stride)
    vt, vs = _sizes(vocab_total, vocab_start)
    g = _describe(gathered_stats, "gathered_stats", s_explicit)
    y = _describe(targets, "targets", s_explicit) if targets is not None else None
    _check_same_device(a.h, a.W, a.th, a.tW, g, y)
    tcode = _targets_code(y, a.rows, target_dtype) if y is not None else _target_dtype_code(
        target_dtype)
    ranks = _gathered(g, a.rows)
    opts = _distill_opts(reduction, divergence, beta, temperature, ignore_index, softcap,
                         logit_scale)
    grads = _grad_set(return_grad, False)
    dname = _CODE_NAMES[a.dtype_code]
    gh_name = _dtype_name(grad_hidden_dtype) or "float32"
    if gh_name not in _FLOAT_CODES:  # float32 or the inputs' dtype: the library checks which
        raise TypeError(f"grad_hidden_dtype must be a floating-point dtype, got "
                        f"{grad_hidden_dtype!r}")
    gdtype = "float32" if grad_weight_fp32 else dname
    call_stream = (_call_stream(s_explicit, [a.h, a.W, a.th, a.tW, g, y]) if a.h.is_cuda
                   else 0)
    alloc = _Alloc(a.h, call_stream)
    with _device_of(a.h):
        (grad_hidden, grad_weight, _), (gh_a, gw_a, _) = _linear_grads(
            alloc, a.h, a.W, None, grads, grad_hidden, grad_weight, None, rows=a.rows,
            dim=a.dim, vocab=a.vocab_local, gh_dtype=gh_name,
            gh_like=a.h if gh_name == dname else None, gh_what="grad_hidden_dtype",
            grad_weight_fp32=grad_weight_fp32, wdtype=gdtype, accumulate=accumulate,
            vocab_name="vocab_local")
        go_ptr, go_keep = _grad_output(grad_output, alloc, a.h, a.rows, opts.per_row)
        o = _build_options(opts.ce(), backend=_check_backend_kw(a.h, backend),
                           dtype=a.dtype_code, target_dtype=tcode, hidden_row_stride=a.hrs,
                           accumulate=accumulate, grad_weight_fp32=grad_weight_fp32)
        teacher = _build_teacher(opts, hidden_states=a.th.ptr, weight=a.tW.ptr,
                                 hidden=a.teacher_dim, hidden_row_stride=a.thrs)
        gh_code = _FLOAT_CODES[gh_name]
        lo, hi = ctypes.c_size_t(0), ctypes.c_size_t(0)
        query_for("fce_vp_linear_distill_backward",
                  "fce_vp_linear_distill_backward_workspace_size", ctypes.byref(o),
                  ctypes.byref(teacher), ranks, a.rows, a.dim, vt, a.vocab_local, gh_code,
                  ctypes.byref(lo), ctypes.byref(hi))
        ws_ptr, ws_bytes, ws_keep = _workspace(workspace, alloc, a.h, int(lo.value),
                                               int(hi.value), workspace_size)
        shard = _lib.shard(ranks, vt, vs, a.vocab_local)
        gr = _lib.gradients(grad_output=go_ptr, grad_hidden=_ptr(gh_a), grad_weight=_ptr(gw_a),
                            grad_hidden_dtype=gh_code)
        _lib.call("fce_vp_linear_distill_backward", ctypes.byref(o), ctypes.byref(teacher),
                  ctypes.byref(shard), a.rows, a.dim, a.h.ptr, a.W.ptr, 0, _ptr(y), g.ptr,
                  ctypes.byref(gr), ws_ptr, ws_bytes, call_stream)
        del ws_keep, go_keep
    return VPLinearGrads(grad_hidden, grad_weight, None)


def _distill_query(divergence, beta, temperature, reduction, ignore_index, softcap, logit_scale,
                   backend, dtype, teacher_hidden, **fields):
    """The fce_options and fce_teacher of a workspace query of the linear distillation."""
    opts = _distill_opts(reduction, divergence, beta, temperature, ignore_index, softcap,
                         logit_scale)
    b = _backend_code(backend)
    o = _build_options(opts.ce(), backend=b if b is not None else _lib.FCE_BACKEND_CPU,
                       dtype=_FLOAT_CODES[_dtype_name(dtype) or "float32"],
                       target_dtype=_target_dtype_code(None), **fields)
    return o, _build_teacher(opts, hidden=int(teacher_hidden))


def vp_linear_distill_stats_workspace_size(rows: int, hidden: int, vocab_local: int,
                                           teacher_hidden: int, *, divergence="forward_kl",
                                           beta=0.5, temperature=1.0, backend="cpu",
                                           dtype="float32", reduction="mean",
                                           ignore_index=-100, softcap=0.0,
                                           logit_scale=1.0) -> Tuple[int, int]:
    """fce_vp_linear_distill_stats_workspace_size: (min_bytes, optimal_bytes)."""
    o, t = _distill_query(divergence, beta, temperature, reduction, ignore_index, softcap,
                          logit_scale, backend, dtype, teacher_hidden)
    lo, hi = ctypes.c_size_t(0), ctypes.c_size_t(0)
    _lib.call("fce_vp_linear_distill_stats_workspace_size", ctypes.byref(o), ctypes.byref(t),
              int(rows), int(hidden), int(vocab_local), ctypes.byref(lo), ctypes.byref(hi))
    return int(lo.value), int(hi.value)


def vp_linear_distill_backward_workspace_size(ranks: int, rows: int, hidden: int,
                                              vocab_total: int, vocab_local: int,
                                              teacher_hidden: int, *,
                                              grad_hidden_dtype="float32",
                                              divergence="forward_kl", beta=0.5,
                                              temperature=1.0, backend="cpu", dtype="float32",
                                              reduction="mean", ignore_index=-100, softcap=0.0,
                                              logit_scale=1.0, accumulate=False,
                                              grad_weight_fp32=False) -> Tuple[int, int]:
    """fce_vp_linear_distill_backward_workspace_size: (min_bytes, optimal_bytes)."""
    o, t = _distill_query(divergence, beta, temperature, reduction, ignore_index, softcap,
                          logit_scale, backend, dtype, teacher_hidden, accumulate=accumulate,
                          grad_weight_fp32=grad_weight_fp32)
    lo, hi = ctypes.c_size_t(0), ctypes.c_size_t(0)
    _lib.call("fce_vp_linear_distill_backward_workspace_size", ctypes.byref(o), ctypes.byref(t),
              int(ranks), int(rows), int(hidden), int(vocab_total), int(vocab_local),
              _FLOAT_CODES[_dtype_name(grad_hidden_dtype) or "float32"], ctypes.byref(lo),
              ctypes.byref(hi))
    return int(lo.value), int(hi.value)
