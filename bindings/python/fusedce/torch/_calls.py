"""Direct C calls for torch tensors: the hot path of :mod:`fusedce.torch`.

:mod:`fusedce.core` accepts any array (NumPy, DLPack, CUDA array interface) and checks and
describes every argument in Python; that costs 100-200 µs a call. The torch layer knows its
tensors already, so it calls the C ABI here directly: one cached ``fce_options`` per option set,
cached workspace-size queries, tensor pointers straight from ``data_ptr()``, and no checks the C
library makes itself (its message is raised as it is). Nothing here allocates device memory but
through torch (the workspace is a torch tensor, so torch's caching allocator serves it).
"""

from __future__ import annotations

import ctypes
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .. import _alloc, _lib
from .._options import NOTHING, CEOptions, Want

_CODE = {torch.float32: _lib.FCE_FLOAT32, torch.float16: _lib.FCE_FLOAT16,
         torch.bfloat16: _lib.FCE_BFLOAT16, torch.int32: _lib.FCE_INT32,
         torch.int64: _lib.FCE_INT64}
# the floating-point dtypes the library computes in, and back
TORCH_OF_CODE = {_lib.FCE_FLOAT32: torch.float32, _lib.FCE_FLOAT16: torch.float16,
                 _lib.FCE_BFLOAT16: torch.bfloat16}
CODE_OF_TORCH = {v: k for k, v in TORCH_OF_CODE.items()}


# ------------------------------------------------------------------------ options ----
_OPTIONS: Dict[tuple, _lib.Options] = {}
_SIZES: Dict[tuple, Tuple[int, int]] = {}


def options(backend: int, dtype: int, target_dtype: int, opts: CEOptions,
            grad_weight_fp32: bool = False) -> Tuple[tuple, _lib.Options]:
    """(key, fce_options) for this option set: a copy of the struct built once for it, the
    caller's own (a C call reads it with the GIL released, so no struct another thread may be
    setting is handed out). The one place the torch layer turns a :class:`CEOptions` into the
    C struct, field by name. Per-call fields (class_weights, strides) are set by the caller on
    it before the call; the outputs travel in an fce_outputs (_lib.outputs)."""
    key = (backend, dtype, target_dtype, opts, grad_weight_fp32)
    o = _OPTIONS.get(key)
    if o is None:
        o = _lib.default_options()
        o.backend, o.dtype, o.target_dtype = backend, dtype, target_dtype
        o.reduction, o.ignore_index = opts.reduction, opts.ignore_index
        o.label_smoothing, o.z_loss_scale = opts.label_smoothing, opts.z_loss
        o.softcap, o.logit_scale = opts.softcap, opts.logit_scale
        o.shift_seq_len, o.shift = opts.shift_seq_len, opts.shift
        o.token_scaling = int(opts.token_scaling)
        o.batch_invariant = int(opts.batch_invariant)
        o.grad_weight_fp32 = int(grad_weight_fp32)
        if len(_OPTIONS) > 256:
            _OPTIONS.clear()
        _OPTIONS[key] = o
    return key, type(o).from_buffer_copy(o)


# torch's current stream of a device as a cudaStream_t, without building a torch.cuda.Stream
# (a few µs a call, two calls a loss + backward); torch.cuda.current_stream where it is absent
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(t: Tensor) -> Optional[int]:
    if not t.is_cuda:
        return None
    if _RAW_STREAM is not None:
        return _RAW_STREAM(t.get_device())
    return torch.cuda.current_stream(t.device).cuda_stream


def _backend(t: Tensor) -> int:
    return _lib.FCE_BACKEND_CUDA if t.is_cuda else _lib.FCE_BACKEND_CPU


def _check(status: int, fn: str) -> None:
    if status:
        _lib.check(status, fn)


def _workspace(nbytes: int, like: Tensor) -> Optional[Tensor]:
    return torch.empty(nbytes, dtype=torch.uint8, device=like.device) if nbytes else None


def _ptr(t: Optional[Tensor]) -> Optional[int]:
    return t.data_ptr() if t is not None else None


def extras(want: Want, n: int, reduction: int, device):
    """(z_loss, accuracy, argmax) buffers for what ``want`` asks the library for (None where
    not asked; its lse is the caller's)."""
    if not (want.z_loss or want.accuracy or want.argmax):
        return None, None, None
    z_loss = torch.empty((), dtype=torch.float32, device=device) if want.z_loss else None
    accuracy = (torch.empty((n,) if reduction == _lib.FCE_REDUCTION_NONE else (),
                            dtype=torch.float32, device=device)
                if want.accuracy else None)
    argmax = torch.empty((n,), dtype=torch.int64, device=device) if want.argmax else None
    return z_loss, accuracy, argmax


def _flags(check_targets: bool, like: Tensor) -> Optional[Tensor]:
    return torch.zeros((1,), dtype=torch.int32, device=like.device) if check_targets else None


def row_targets(targets: Tensor, ignore_index: int, shift_seq_len: int, shift: int) -> Tensor:
    """The target each row is scored against (docs/semantics.md rule 1): targets[r + k] for rows with
    t = r mod T < T - k, ignore_index for the others; targets itself without a shift."""
    if not shift_seq_len:
        return targets
    t, k = int(shift_seq_len), max(int(shift), 1)
    y = targets.reshape(-1, t)
    out = torch.full_like(y, ignore_index)
    if k < t:
        out[:, :t - k] = y[:, k:]
    return out.reshape(-1)


def check_flags(flags: Optional[Tensor], targets: Tensor, vocab: int, opts: CEOptions) -> None:
    """check_targets: read the error flags (a host synchronisation) and raise as torch does
    (IndexError "Target 12345 is out of bounds.") when a target was out of range."""
    if flags is None:
        return
    value = int(flags.item()) & 0xFFFFFFFF
    if not value:
        return
    ignore_index = opts.ignore_index
    if value & _lib.FCE_FLAG_TARGET_OUT_OF_RANGE:
        y = row_targets(targets.to(torch.int64), ignore_index, opts.shift_seq_len, opts.shift)
        bad = (y != ignore_index) & ((y < 0) | (y >= vocab))
        if bool(bad.any()):
            raise IndexError(f"Target {int(y[bad][0].item())} is out of bounds.")
        raise IndexError("a target is out of bounds (outside [0, %d) and not ignore_index)"
                         % vocab)
    raise RuntimeError(f"fusedce reported error flags {value:#x}")


# ----------------------------------------------------------------- cross-entropy ----
# (fce_options, workspace bytes, room) of one fce_forward / fce_backward call shape: the
# options struct is this plan's own copy with the row strides set, never changed once made (a C
# call reads it with the GIL released, so a struct shared between calls must not change under
# it); a call with class weights or forward outputs gets a copy with those pointers set. room:
# for a forward, the larger of its workspace and that of the fce_backward(_rescale) of the same
# logits (ce_forward's lse_workspace); for a backward, its own.
_PLANS: Dict[tuple, Tuple[_lib.Options, int, int]] = {}


def _ce_plan(which: str, logits: Tensor, targets: Tensor, class_weights: Optional[Tensor],
             opts: CEOptions, grad_row_stride: int) -> Tuple[_lib.Options, int, int]:
    """(fce_options, workspace bytes, room) of an fce_forward ('fwd') / fce_backward ('bwd')
    call on these tensors. The options and the workspace queries are made once per option set,
    shape and strides."""
    n, v = logits.shape
    row_stride = logits.stride(0) if n > 1 or logits.stride(0) > v else v
    pkey = (which, logits.dtype, targets.dtype, logits.is_cuda, opts, n, v, row_stride,
            grad_row_stride, class_weights is not None)
    plan = _PLANS.get(pkey)
    if plan is None:
        _, o = options(_backend(logits), _CODE[logits.dtype], _CODE[targets.dtype], opts)
        lib = _lib.load()
        size = ctypes.c_size_t()
        # the pointers set for the queries (they may need workspace), then cleared: the plan's
        # struct holds none of a call's pointers
        o.class_weights = _ptr(class_weights)
        o.row_stride, o.grad_row_stride = row_stride, grad_row_stride
        if which == "fwd":
            _alloc.check_query(
                lib.fce_forward_workspace_size(ctypes.byref(o), n, v, ctypes.byref(size)),
                "fce_forward_workspace_size", "fce_forward")
            ws_bytes = size.value
            o.grad_row_stride = 0  # the backward's query (a failure there is the backward's)
            bad = lib.fce_backward_workspace_size(ctypes.byref(o), n, v, ctypes.byref(size))
            room = max(ws_bytes, 0 if bad else size.value)
            o.grad_row_stride = grad_row_stride
        else:
            _alloc.check_query(
                lib.fce_backward_workspace_size(ctypes.byref(o), n, v, ctypes.byref(size)),
                "fce_backward_workspace_size", "fce_backward")
            ws_bytes = room = size.value
        o.class_weights = None
        if len(_PLANS) > 1024:
            _PLANS.clear()
        plan = _PLANS[pkey] = (o, ws_bytes, room)
    if class_weights is not None:
        o = type(plan[0]).from_buffer_copy(plan[0])
        o.class_weights = _ptr(class_weights)
        return o, plan[1], plan[2]
    return plan


def _aligned_rows(logits: Tensor, opts: CEOptions) -> Optional[Tensor]:
    """Under batch_invariant on CUDA the C calls need every row of logits to start 16-byte
    aligned (docs/semantics.md rule 21): logits whose rows do not (a vocabulary of 50257 in 16
    bits, a view at an odd row) copied into rows padded to a multiple of 16 bytes, as a [N, V]
    view of the new buffer; None when they already are, or the flag is off, or on the CPU. The
    stride decides, never the row count: a row alone and in a batch take the same copy."""
    if not opts.batch_invariant or not logits.is_cuda:
        return None
    n, v = logits.shape
    es = logits.element_size()
    stride = logits.stride(0) if n > 1 or logits.stride(0) > v else v
    if (stride * es) % 16 == 0 and logits.data_ptr() % 16 == 0:
        return None
    padded = torch.empty((n, -(-v * es // 16) * 16 // es), dtype=logits.dtype,
                         device=logits.device)[:, :v]
    padded.copy_(logits)
    return padded


def _aux_offset(n: int) -> int:
    """Where the workspace starts in a saved-lse buffer (see ce_forward's lse_workspace), in
    float32 elements: after the n lse values, on 256 bytes."""
    return (n + 63) // 64 * 64


def ce_forward(logits: Tensor, targets: Tensor, class_weights: Optional[Tensor],
               opts: CEOptions, *, grad: Optional[Tensor] = None, want_lse: bool = True,
               want: Want = NOTHING, check_targets: bool = False,
               lse_workspace: bool = False, upstream: Optional[tuple] = None) -> tuple:
    """fce_forward on a [N, V] tensor whose last stride is 1: (loss, lse, z_loss, accuracy,
    argmax, entropy), the last four None unless ``want`` asks for them. With ``grad``
    (dense [N, V], or ``logits`` itself for in place) the gradient for an upstream 1 is written
    in the same pass; with ``upstream`` (grad_output, grad_lse, grad_entropy: float32 tensors
    or None, grad_output None meaning 1) the gradient of the loss, lse and entropy for those. ``check_targets``: read the error flags after the call (a host sync) and
    raise IndexError on an out-of-range target. ``lse_workspace`` (the training path, lse kept
    for the backward only): lse is returned as a float32 buffer whose first N values are lse and
    whose tail is the workspace of this call and of the ce_backward(rescale=...,
    lse_workspace=True) that follows, so that a loss + backward allocates once for both."""
    padded = _aligned_rows(logits, opts)
    if padded is not None:  # (in place: into the padded rows, then copied back over logits)
        in_place = grad is logits
        out = ce_forward(padded, targets, class_weights, opts, grad=padded if in_place else grad,
                         want_lse=want_lse, want=want, check_targets=check_targets,
                         lse_workspace=lse_workspace, upstream=upstream)
        if in_place:
            logits.copy_(padded)
        return out
    n, v = logits.shape
    grad_stride = 0
    if grad is not None:
        grad_stride = ((logits.stride(0) if n > 1 or logits.stride(0) > v else v) if grad is logits
                       else v)
    reduction = opts.reduction
    dev = logits.device
    z_loss, accuracy, argmax = extras(want, n, reduction, dev)
    entropy = torch.empty((n,), dtype=torch.float32, device=dev) if want.entropy else None
    o, ws_bytes, room = _ce_plan("fwd", logits, targets, class_weights, opts, grad_stride)
    loss = torch.empty((n,) if reduction == _lib.FCE_REDUCTION_NONE else (), dtype=torch.float32,
                       device=dev)
    if lse_workspace:
        lse = torch.empty((_aux_offset(n) + (room + 3) // 4,), dtype=torch.float32, device=dev)
        ws = None
        ws_ptr = lse.data_ptr() + 4 * _aux_offset(n) if ws_bytes else None
    else:
        lse = torch.empty((n,), dtype=torch.float32, device=dev) if want_lse else None
        ws = _workspace(ws_bytes, logits)
        ws_ptr = _ptr(ws)
    flags = _flags(check_targets, logits)
    out = _lib.outputs(loss=loss.data_ptr(), lse=_ptr(lse), z_loss=_ptr(z_loss),
                       argmax=_ptr(argmax), accuracy=_ptr(accuracy), error_flags=_ptr(flags),
                       entropy=_ptr(entropy))
    go, gl, ge = upstream if upstream is not None else (None, None, None)
    grads = _lib.gradients(grad_logits=_ptr(grad), grad_output=_ptr(go), grad_lse=_ptr(gl),
                           grad_entropy=_ptr(ge))
    _check(_lib.load().fce_forward(ctypes.byref(o), n, v, logits.data_ptr(), targets.data_ptr(),
                                   ctypes.byref(out), ctypes.byref(grads), ws_ptr, ws_bytes,
                                   _stream(logits)), "fce_forward")
    if flags is not None:
        check_flags(flags, targets, v, opts)
    return loss, lse, z_loss, accuracy, argmax, entropy


def ce_backward(logits: Tensor, targets: Tensor, lse: Tensor, grad_output: Tensor,
                class_weights: Optional[Tensor], opts: CEOptions,
                rescale: Optional[Tensor] = None, lse_workspace: bool = False,
                grad_lse: Optional[Tensor] = None, out: Optional[Tensor] = None) -> Tensor:
    """fce_backward: a dense [N, V] gradient from the logits, the saved lse and the upstream
    gradient (float32: one value, or [N] for reduction 'none'), plus that of lse for
    ``grad_lse`` (float32 [N]) when given; written into ``out`` (dense [N, V]) when given. With
    ``rescale`` (the dense gradient fce_forward wrote for an upstream 1): fce_backward_rescale,
    in place into it. ``lse_workspace``: lse is the buffer ce_forward(lse_workspace=True)
    returned, whose tail is the workspace."""
    padded = _aligned_rows(logits, opts)
    if padded is not None:
        logits = padded
    n, v = logits.shape
    o, ws_bytes, _ = _ce_plan("bwd", logits, targets, class_weights, opts, 0)
    grad = rescale if rescale is not None else out
    if grad is None:
        grad = torch.empty((n, v), dtype=logits.dtype, device=logits.device)
    ws = None
    if lse_workspace and 4 * (lse.numel() - _aux_offset(n)) >= ws_bytes:
        ws_ptr = lse.data_ptr() + 4 * _aux_offset(n) if ws_bytes else None
    else:
        ws = _workspace(ws_bytes, logits)
        ws_ptr = _ptr(ws)
    lib = _lib.load()
    if rescale is not None:
        fn, call = "fce_backward_rescale", lib.fce_backward_rescale
    else:
        fn, call = "fce_backward", lib.fce_backward
    grads = _lib.gradients(grad_output=grad_output.data_ptr(), grad_logits=grad.data_ptr(),
                           grad_lse=_ptr(grad_lse))
    _check(call(ctypes.byref(o), n, v, logits.data_ptr(), targets.data_ptr(), lse.data_ptr(),
                None, ctypes.byref(grads), ws_ptr, ws_bytes, _stream(logits)), fn)
    return grad


def upstream(grad_output: Optional[Tensor], n: int, opts: CEOptions, like: Tensor) -> Tensor:
    """The loss's upstream gradient as the C calls take it: float32, dense; zeros (of the loss's
    shape) where the loss got none (only lse or the entropy did)."""
    if grad_output is None:
        return torch.zeros((n,) if opts.per_row else (), dtype=torch.float32,
                           device=like.device)
    return _f32_or_none(grad_output)


def ce_grad(logits: Tensor, targets: Tensor, lse: Optional[Tensor],
            class_weights: Optional[Tensor], opts: CEOptions, grad_output: Optional[Tensor],
            grad_lse: Optional[Tensor], grad_entropy: Optional[Tensor],
            out: Optional[Tensor] = None) -> Tensor:
    """The gradient of loss + sum(grad_lse * lse) + sum(grad_entropy * entropy) over the logits
    (docs/semantics.md rule 18) in ONE C call: fce_backward with grad_lse (from the saved lse)
    when the entropy has no upstream gradient, else fce_forward with every upstream gradient
    (its loss to a scratch buffer). grad_output None: the loss got no gradient. ``out``: a dense
    [N, V] buffer to write it into."""
    go = upstream(grad_output, logits.shape[0], opts, logits)
    gl, ge = _f32_or_none(grad_lse), _f32_or_none(grad_entropy)
    if ge is None:
        return ce_backward(logits, targets, lse, go, class_weights, opts, grad_lse=gl, out=out)
    grad = out if out is not None else torch.empty(logits.shape, dtype=logits.dtype,
                                                   device=logits.device)
    ce_forward(logits, targets, class_weights, opts, grad=grad, want_lse=False,
               upstream=(go, gl, ge))
    return grad


def _f32_or_none(t: Optional[Tensor]) -> Optional[Tensor]:
    if t is None or (t.dtype == torch.float32 and t.is_contiguous()):
        return t
    return t.to(torch.float32).contiguous()


def scale_(grad: Tensor, grad_output: Tensor) -> None:
    """grad *= grad_output (one float32 on grad's device) in place, on the device: a no-op
    launch when it is exactly 1 (fce_scale_gradient). grad must be dense."""
    if grad.dtype not in (torch.float32, torch.float16, torch.bfloat16):  # float64 inputs
        grad.mul_(grad_output.to(grad.dtype))
        return
    g = grad_output
    if g.dtype != torch.float32 or g.device != grad.device:
        g = g.to(device=grad.device, dtype=torch.float32)
    _check(_lib.load().fce_scale_gradient(_backend(grad), _CODE[grad.dtype], grad.numel(),
                                          grad.data_ptr(), g.data_ptr(), _stream(grad)),
           "fce_scale_gradient")


# ------------------------------------------------------------------------- linear ----
def linear_ce_workspace(o: _lib.Options, key: tuple, n: int, d: int, v: int, with_grad: bool,
                        budget: int, want: Want = NOTHING) -> int:
    """The workspace for this call: the full-speed size if it is within budget, else the budget,
    never below the minimum (fce_linear_ce_workspace_size), for the argmax / accuracy outputs
    of ``want``."""
    skey = ("lin", key, n, d, v, with_grad, want.accuracy, want.argmax)
    sizes = _SIZES.get(skey)
    if sizes is None:
        lo, hi = ctypes.c_size_t(), ctypes.c_size_t()
        _alloc.check_query(
            _lib.load().fce_linear_ce_workspace_size(ctypes.byref(o), n, d, v, int(with_grad),
                                                     ctypes.byref(lo), ctypes.byref(hi)),
            "fce_linear_ce_workspace_size", "fce_linear_ce")
        sizes = _SIZES[skey] = (lo.value, hi.value)
    lo, hi = sizes
    return max(lo, min(hi, budget))


def linear_ce(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor,
              class_weights: Optional[Tensor], grad_output: Optional[Tensor],
              opts: CEOptions, *, grad_weight_fp32: bool, need: Tuple[bool, bool, bool],
              workspace_bytes: int, want: Want = NOTHING, check_targets: bool = False,
              grad_lse: Optional[Tensor] = None, grad_entropy: Optional[Tensor] = None) -> tuple:
    """fce_linear_ce: (loss, lse, grad_hidden, grad_weight, grad_bias, z_loss, accuracy,
    argmax, entropy), the gradients asked for in ``need`` and the outputs ``want`` asks the
    library for (None for the others), the gradients scaled by grad_output (None = 1) and
    including those of lse and the entropy for ``grad_lse`` / ``grad_entropy`` (float32 [N]). hidden [N, D] with
    last stride 1, weight [V, D] and bias [V] dense, all of one dtype. ``workspace_bytes``: the
    budget of everything the call allocates beyond the gradients."""
    n, d = hidden.shape
    v = weight.shape[0]
    key, o = options(_backend(hidden), _CODE[hidden.dtype], _CODE[targets.dtype], opts,
                     grad_weight_fp32=grad_weight_fp32)
    o.class_weights = _ptr(class_weights)
    o.hidden_row_stride = hidden.stride(0) if n > 1 else d
    with_grad = any(need)
    dev = hidden.device
    reduction = opts.reduction
    z_loss, accuracy, argmax = extras(want, n, reduction, dev)
    # the budget covers everything this call allocates beyond the gradients: the workspace,
    # and lse / loss (and room for a targets conversion), 16 bytes a row, 12 more with extras
    row_bytes = 16 + (12 if z_loss is not None or accuracy is not None or argmax is not None
                      else 0) + (4 if want.entropy else 0)  # + argmax, accuracy, entropy
    ws_bytes = linear_ce_workspace(o, key, n, d, v, with_grad,
                                   max(0, workspace_bytes - row_bytes * n - 4096), want)
    loss = torch.empty((n,) if reduction == _lib.FCE_REDUCTION_NONE else (), dtype=torch.float32,
                       device=dev)
    lse = torch.empty((n,), dtype=torch.float32, device=dev)
    entropy = torch.empty((n,), dtype=torch.float32, device=dev) if want.entropy else None
    gw_dtype = torch.float32 if grad_weight_fp32 else hidden.dtype
    gh = torch.empty((n, d), dtype=hidden.dtype, device=dev) if need[0] else None
    gw = torch.empty((v, d), dtype=gw_dtype, device=dev) if need[1] else None
    gb = torch.empty((v,), dtype=gw_dtype, device=dev) if need[2] and bias is not None else None
    flags = _flags(check_targets, hidden)
    ws = _workspace(ws_bytes, hidden)
    out = _lib.outputs(loss=loss.data_ptr(), lse=lse.data_ptr(), z_loss=_ptr(z_loss),
                       argmax=_ptr(argmax), accuracy=_ptr(accuracy), error_flags=_ptr(flags),
                       entropy=_ptr(entropy))
    grads = _lib.gradients(grad_output=_ptr(grad_output), grad_hidden=_ptr(gh),
                           grad_weight=_ptr(gw), grad_bias=_ptr(gb), grad_lse=_ptr(grad_lse),
                           grad_entropy=_ptr(grad_entropy))
    _check(_lib.load().fce_linear_ce(
        ctypes.byref(o), n, d, v, hidden.data_ptr(), weight.data_ptr(), _ptr(bias),
        targets.data_ptr(), ctypes.byref(out), ctypes.byref(grads), _ptr(ws), ws_bytes,
        _stream(hidden)), "fce_linear_ce")
    check_flags(flags, targets, v, opts)
    return loss, lse, gh, gw, gb, z_loss, accuracy, argmax, entropy
