"""The C calls and collectives of :mod:`fusedce.torch.distributed`: the vocabulary-parallel
calls (``fce_vp_*``) on torch tensors, the statistics' all-gather and the ∂hidden all-reduce over
a torch.distributed group, and the all-gather callback of the fused step (``fce_vp_linear_ce``).
The options arrive as one :class:`fusedce._options.CEOptions` (the C struct is filled from it by
:func:`fusedce.torch._calls.options`), the outputs asked of the library as one
:class:`fusedce._options.Want`, the shard as one :class:`Layout`.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _alloc, _lib
from .._lib import FCE_VP_STATS as VP_STATS
from .._lib import FCE_VP_STATS_INVARIANT as VP_STATS_INVARIANT
from .._options import CEOptions, Want
from . import _calls as _tc


class Layout(NamedTuple):
    """Where this rank's shard lies, and the group it is sharded over (None: one rank)."""

    group: object
    size: int          # ranks in the group
    vocab_start: int   # this rank's first class
    vocab_total: int   # the whole vocabulary


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
    """[size * rows, width]: the group's statistics [rows, width], rank-major (what fce_vp_loss
    reads as [ranks, rows, width])."""
    if group is None:  # no torch.distributed: one rank
        return stats
    out = stats.new_empty((size * stats.shape[0], stats.shape[1]))
    _gather_into(out, stats, group, size)
    return out


def _all_reduce_sum(t: Tensor, group, size: int) -> None:
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)


SCATTER = "scatter"  # reduce_grad_hidden's sequence-parallel mode: hidden's rows sharded


def _gather_tokens(hidden: Tensor, group, size: int) -> Tensor:
    """[size * n, D]: the group's hidden rows [n, D], rank-major (sequence parallelism: rank r
    holds rows [r·n, (r+1)·n)), by one all_gather_into_tensor on the current stream."""
    if group is None:
        return hidden
    h = hidden.contiguous()
    out = h.new_empty((size * h.shape[0],) + tuple(h.shape[1:]))
    _gather_into(out, h, group, size)
    return out


_SCATTER_FALLBACK = set()  # backends whose reduce_scatter_tensor raised: all_reduce, then narrow


def _reduce_grad_hidden(gh: Tensor, group, size: int, mode) -> Tensor:
    """This rank's float32 partial ∂hidden [N, D] reduced over the group (sum): all of it
    (mode True), this rank's rows [N / size, D] (SCATTER: reduce_scatter_tensor, the backward
    of the sequence-parallel all-gather), or left as it is (False)."""
    if group is None or not mode:
        return gh
    if mode != SCATTER:
        _all_reduce_sum(gh, group, size)
        return gh
    n = gh.shape[0] // size
    backend = str(dist.get_backend(group))
    if backend not in _SCATTER_FALLBACK and hasattr(dist, "reduce_scatter_tensor"):
        out = gh.new_empty((n,) + tuple(gh.shape[1:]))
        try:
            dist.reduce_scatter_tensor(out, gh, op=dist.ReduceOp.SUM, group=group)
            return out
        except (RuntimeError, NotImplementedError):
            if backend == "nccl":
                raise
            _SCATTER_FALLBACK.add(backend)
    _all_reduce_sum(gh, group, size)
    return gh.narrow(0, dist.get_rank(group) * n, n).clone()


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


def _opts_struct(t: Tensor, dtype, targets: Tensor, opts: CEOptions, class_weights,
                 grad_weight_fp32: bool = False, entropy: bool = False):
    """(key, fce_options) of a call on t (its backend) computing in dtype: the struct of
    _calls.options with the class weights set and the row strides 0 (the caller's to set);
    ``entropy``: vp_entropy, the statistics with the entropy's sums (every call of the step)."""
    key, o = _tc.options(_tc._backend(t), _tc._CODE[dtype], _tc._CODE[targets.dtype], opts,
                         grad_weight_fp32=grad_weight_fp32)
    o.class_weights = _tc._ptr(class_weights)
    o.vp_entropy = 1 if entropy else 0
    o.row_stride = o.grad_row_stride = o.hidden_row_stride = 0
    return key, o


def _vp_loss(o, key, size: int, n: int, vt: int, targets: Tensor, gathered: Tensor,
             reduction: int, want: Want, check: bool, stream):
    """fce_vp_loss: (loss, lse, z_loss, accuracy, argmax, flags, entropy), lse and the others
    None unless ``want`` asks for them (the entropy needs ``o.vp_entropy``)."""
    dev = gathered.device
    z_loss, accuracy, argmax = _tc.extras(want, n, reduction, dev)
    skey = ("vp_loss", key, size, n, vt, argmax is not None, accuracy is not None)
    ws_bytes = _query(skey, "fce_vp_loss_workspace_size", ctypes.byref(o), size, n, vt)[0]
    loss = torch.empty((n,) if reduction == _lib.FCE_REDUCTION_NONE else (),
                       dtype=torch.float32, device=dev)
    lse = torch.empty((n,), dtype=torch.float32, device=dev) if want.lse else None
    ent = torch.empty((n,), dtype=torch.float32, device=dev) if want.entropy else None
    flags = torch.zeros((1,), dtype=torch.int32, device=dev) if check else None
    ws = _tc._workspace(ws_bytes, gathered)
    shard = _lib.shard(size, vt, 0, vt)
    out = _lib.outputs(loss=loss.data_ptr(), lse=_tc._ptr(lse), z_loss=_tc._ptr(z_loss),
                       argmax=_tc._ptr(argmax), accuracy=_tc._ptr(accuracy),
                       error_flags=_tc._ptr(flags), entropy=_tc._ptr(ent))
    status = _lib.load().fce_vp_loss(
        ctypes.byref(o), ctypes.byref(shard), n, targets.data_ptr(), gathered.data_ptr(),
        ctypes.byref(out), _tc._ptr(ws), ws_bytes, stream)
    _check(status, "fce_vp_loss")
    return loss, lse, z_loss, accuracy, argmax, flags, ent


def _check_flags(flags: Optional[Tensor], targets: Tensor, vt: int, opts: CEOptions) -> None:
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
def _ce_forward(logits, targets, cw, layout: Layout, opts: CEOptions, want: Want, check: bool,
                stream):
    """fce_vp_stats, the all-gather, fce_vp_loss: ((loss, lse, z_loss, accuracy, argmax,
    entropy), the gathered statistics)."""
    group, size, vs, vt = layout
    n, vl = logits.shape
    key, o = _opts_struct(logits, logits.dtype, targets, opts, cw, entropy=want.entropy)
    o.row_stride = logits.stride(0) if n > 1 else vl
    width = VP_STATS_INVARIANT if opts.batch_invariant else VP_STATS  # (rule 21's exact sums)
    stats = torch.empty((n, width), dtype=torch.float32, device=logits.device)
    shard = _lib.shard(size, vt, vs, vl)
    _check(_lib.load().fce_vp_stats(ctypes.byref(o), ctypes.byref(shard), n, logits.data_ptr(),
                                    targets.data_ptr(), stats.data_ptr(), stream), "fce_vp_stats")
    gathered = _all_gather(stats, group, size)
    out = _vp_loss(o, key, size, n, vt, targets, gathered, opts.reduction, want, check, stream)
    _check_flags(out[5], targets, vt, opts)
    return out[:5] + out[6:], gathered


def _upstream(grad_loss, grad_lse, grad_entropy, like: Tensor, reduction: int):
    """The float32 upstream gradients of a gradient call: the loss's (0 when None: only lse or
    the entropy got one), lse's and the entropy's ([rows], None: none)."""
    if grad_loss is None:
        shape = (like.shape[0],) if reduction == _lib.FCE_REDUCTION_NONE else ()
        grad_loss = torch.zeros(shape, dtype=torch.float32, device=like.device)
    rows = [None if g is None else g.to(torch.float32).reshape(-1).contiguous()
            for g in (grad_lse, grad_entropy)]
    return (grad_loss.to(torch.float32).contiguous(), *rows)


def _ce_backward(logits, targets, cw, gathered, layout: Layout, opts: CEOptions, grad_loss,
                 inplace: bool, grad_lse=None, grad_entropy=None, entropy: bool = False):
    """fce_vp_backward: the gradient of this rank's logits for the upstream grad_loss, and
    grad_lse / grad_entropy (docs/semantics.md rule 18; ``entropy``: the statistics carry the
    entropy's sums), written over the logits when ``inplace``."""
    _, size, vs, vt = layout
    n, vl = logits.shape
    up, gl, ge = _upstream(grad_loss, grad_lse, grad_entropy, logits, opts.reduction)
    key, o = _opts_struct(logits, logits.dtype, targets, opts, cw, entropy=entropy)
    o.row_stride = logits.stride(0) if n > 1 else vl
    if inplace:
        grad = logits
        o.grad_row_stride = o.row_stride
    else:
        grad = torch.empty((n, vl), dtype=logits.dtype, device=logits.device)
        o.grad_row_stride = vl
    ws_bytes = _query(("vp_bwd", key, size, n, vt, vl), "fce_vp_backward_workspace_size",
                      ctypes.byref(o), size, n, vt, vl)[0]
    ws = _tc._workspace(ws_bytes, logits)
    shard = _lib.shard(size, vt, vs, vl)
    grads = _lib.gradients(grad_output=up.data_ptr(), grad_logits=grad.data_ptr(),
                           grad_lse=_tc._ptr(gl), grad_entropy=_tc._ptr(ge))
    _check(_lib.load().fce_vp_backward(
        ctypes.byref(o), ctypes.byref(shard), n, logits.data_ptr(), targets.data_ptr(),
        gathered.data_ptr(), ctypes.byref(grads), _tc._ptr(ws), ws_bytes,
        _tc._stream(logits)), "fce_vp_backward")
    return grad


# ===================================================== fused linear + CE, sharded ====
def _linear_setup(hidden, weight, bias, targets, cw, opts: CEOptions, cdt,
                  fp32_grads: bool = False, entropy: bool = False):
    """(h, w, b, key, o) of a linear call: the inputs cast to cdt (hidden with last stride 1,
    weight and bias dense) and the fce_options (with the hidden row stride) for them;
    ``fp32_grads``: grad_weight_fp32."""
    h = hidden.to(cdt)
    if h.stride(-1) != 1:
        h = h.contiguous()
    w = weight.to(cdt).contiguous()
    b = bias.to(cdt).contiguous() if bias is not None else None
    n, d = h.shape
    key, o = _opts_struct(h, cdt, targets, opts, cw, grad_weight_fp32=fp32_grads, entropy=entropy)
    o.hidden_row_stride = h.stride(0) if n > 1 else d
    return h, w, b, key, o


def _fp32_grads(weight, cdt) -> bool:
    """A float32 weight computed in a 16-bit dtype (autocast) gets its gradient in float32."""
    return weight.dtype == torch.float32 and cdt != torch.float32


def _linear_forward(hidden, weight, bias, targets, cw, layout: Layout, opts: CEOptions, cdt,
                    budget: int, want: Want, check: bool, stream):
    """fce_vp_linear_stats within the budget, the all-gather, fce_vp_loss: ((loss, lse, z_loss,
    accuracy, argmax, entropy), the gathered statistics)."""
    group, size, vs, vt = layout
    h, w, b, key, o = _linear_setup(hidden, weight, bias, targets, cw, opts, cdt,
                                    entropy=want.entropy)
    n, d = h.shape
    vl = w.shape[0]
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
    out = _vp_loss(o, key, size, n, vt, targets, gathered, opts.reduction, want, check, stream)
    _check_flags(out[5], targets, vt, opts)
    return out[:5] + out[6:], gathered


def _linear_backward(hidden, weight, bias, targets, cw, gathered, layout: Layout,
                     opts: CEOptions, cdt, budget: int, need, reduce_grad_hidden: bool,
                     grad_loss, grad_lse=None, grad_entropy=None,
                     entropy: bool = False) -> tuple:
    """fce_vp_linear_backward within the budget: (∂hidden, ∂weight, ∂bias) for the upstream
    grad_loss, those of ``need`` (None for the others); ∂hidden all-reduced (sum, float32) over
    the group when reduce_grad_hidden, then in hidden's dtype; ∂weight and ∂bias in theirs."""
    group, size, vs, vt = layout
    need_h, need_w, need_b = need
    fp32_grads = _fp32_grads(weight, cdt)
    h, w, b, key, o = _linear_setup(hidden, weight, bias, targets, cw, opts, cdt, fp32_grads,
                                    entropy=entropy)
    n, d = h.shape
    vl = w.shape[0]
    dev = h.device
    gw_dtype = torch.float32 if fp32_grads else cdt
    gh = torch.empty((n, d), dtype=torch.float32, device=dev) if need_h else None
    gw = torch.empty((vl, d), dtype=gw_dtype, device=dev) if need_w else None
    gb = torch.empty((vl,), dtype=gw_dtype, device=dev) if need_b else None
    up, gl, ge = _upstream(grad_loss, grad_lse, grad_entropy, h, opts.reduction)
    lo, hi = _query(("vp_lin_bwd", key, size, n, d, vt, vl),
                    "fce_vp_linear_backward_workspace_size", ctypes.byref(o), size, n, d, vt,
                    vl, _lib.FCE_FLOAT32, pair=True)
    ws_bytes = max(lo, min(hi, max(0, budget)))
    ws = _tc._workspace(ws_bytes, h)
    shard = _lib.shard(size, vt, vs, vl)
    grads = _lib.gradients(grad_output=up.data_ptr(), grad_hidden=_tc._ptr(gh),
                           grad_weight=_tc._ptr(gw), grad_bias=_tc._ptr(gb),
                           grad_lse=_tc._ptr(gl), grad_entropy=_tc._ptr(ge))
    _check(_lib.load().fce_vp_linear_backward(
        ctypes.byref(o), ctypes.byref(shard), n, d, h.data_ptr(), w.data_ptr(),
        _tc._ptr(b), targets.data_ptr(), gathered.data_ptr(), ctypes.byref(grads),
        _tc._ptr(ws), ws_bytes, _tc._stream(h)), "fce_vp_linear_backward")
    del ws
    if gh is not None:  # float32: the sum exact to float32
        gh = _reduce_grad_hidden(gh, group, size, reduce_grad_hidden).to(hidden.dtype)
    if gw is not None:
        gw = gw.to(weight.dtype)
    if gb is not None:
        gb = gb.to(bias.dtype)
    return gh, gw, gb


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


def _linear_fused(hidden, weight, bias, targets, cw, layout: Layout, opts: CEOptions, cdt,
                  budget: int, want: Want, check: bool, need, reduce_grad_hidden: bool,
                  grad_output, stream, grad_lse=None, grad_entropy=None,
                  entropy: bool = False):
    """fce_vp_linear_ce with the gradients of ``need`` (hidden, weight, bias) for the upstream
    grad_output (None: 1) and grad_lse / grad_entropy ([rows] float32 or None; ``entropy``, or
    want.entropy: the statistics carry the entropy's sums): (loss, lse, z_loss, accuracy,
    argmax, (∂hidden, ∂weight, ∂bias), entropy), None for what was not asked for; ∂hidden
    all-reduced (sum, float32) over the group when reduce_grad_hidden, then in hidden's dtype;
    ∂weight and ∂bias in theirs. The workspace is freed before the all-reduce and the casts."""
    group, size, vs, vt = layout
    fp32_grads = _fp32_grads(weight, cdt)
    h, w, b, key, o = _linear_setup(hidden, weight, bias, targets, cw, opts, cdt, fp32_grads,
                                    entropy=entropy or want.entropy)
    n, d = h.shape
    vl = w.shape[0]
    dev = h.device
    reduction = opts.reduction
    z_loss, accuracy, argmax = _tc.extras(want, n, reduction, dev)
    ws_bytes = _fused_workspace(o, key, size, n, d, vt, vl, max(0, budget), h.is_cuda,
                                (cw is not None, argmax is not None, accuracy is not None))
    loss = torch.empty((n,) if reduction == _lib.FCE_REDUCTION_NONE else (),
                       dtype=torch.float32, device=dev)
    lse = torch.empty((n,), dtype=torch.float32, device=dev) if want.lse else None
    ent = torch.empty((n,), dtype=torch.float32, device=dev) if want.entropy else None
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
                       error_flags=_tc._ptr(flags), entropy=_tc._ptr(ent))
    gl, ge = (None if g is None else g.to(torch.float32).reshape(-1).contiguous()
              for g in (grad_lse, grad_entropy))
    grads = _lib.gradients(grad_output=_tc._ptr(grad_output), grad_hidden=_tc._ptr(gh),
                           grad_weight=_tc._ptr(gw), grad_bias=_tc._ptr(gb),
                           grad_lse=_tc._ptr(gl), grad_entropy=_tc._ptr(ge))
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
    if gh is not None:  # float32: the sum exact to float32 (the partial then dropped)
        gh = _reduce_grad_hidden(gh, group, size, reduce_grad_hidden).to(hidden.dtype)
    if gw is not None:
        gw = gw.to(weight.dtype)
    if gb is not None:
        gb = gb.to(bias.dtype)
    return loss, lse, z_loss, accuracy, argmax, (gh, gw, gb), ent
