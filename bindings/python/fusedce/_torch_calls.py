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
import os
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from . import _lib

_CODE = {torch.float32: _lib.FCE_FLOAT32, torch.float16: _lib.FCE_FLOAT16,
         torch.bfloat16: _lib.FCE_BFLOAT16, torch.int32: _lib.FCE_INT32,
         torch.int64: _lib.FCE_INT64}

# ------------------------------------------------------------------ memory budget ----
DEFAULT_WORKSPACE_BYTES = 1 << 30  # linear CE through torch: ≤ 1 GiB beyond the gradients


def parse_bytes(text: str) -> int:
    """'1073741824', '512M', '1G', '128MiB' -> bytes."""
    t = text.strip().upper().replace("IB", "").replace("B", "")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMGT" else t
    value = int(float(num) * mult)
    if value < 0:
        raise ValueError(f"a byte count must be >= 0, got {text!r}")
    return value


def default_workspace_bytes() -> int:
    """The linear CE memory budget when a call gives none: FUSEDCE_WORKSPACE_BYTES, else 1 GiB."""
    env = os.environ.get("FUSEDCE_WORKSPACE_BYTES")
    if env:
        try:
            return parse_bytes(env)
        except (ValueError, IndexError):
            raise ValueError(f"FUSEDCE_WORKSPACE_BYTES={env!r} is not a byte count "
                             "(e.g. 1073741824, 512M, 1G)") from None
    return DEFAULT_WORKSPACE_BYTES


# ------------------------------------------------------------------------ options ----
_OPTIONS: Dict[tuple, _lib.Options] = {}
_SIZES: Dict[tuple, Tuple[int, int]] = {}


def options(backend: int, dtype: int, target_dtype: int, reduction: int, ignore_index: int,
            label_smoothing: float, z_loss: float, softcap: float, logit_scale: float,
            shift_seq_len: int, grad_weight_fp32: bool = False) -> Tuple[tuple, _lib.Options]:
    """(key, fce_options) for this option set, built once. Per-call fields (class_weights,
    strides, accumulate) are set by the caller on the returned struct before each call."""
    key = (backend, dtype, target_dtype, reduction, ignore_index, label_smoothing, z_loss,
           softcap, logit_scale, shift_seq_len, grad_weight_fp32)
    o = _OPTIONS.get(key)
    if o is None:
        o = _lib.default_options()
        o.backend, o.dtype, o.target_dtype, o.reduction = backend, dtype, target_dtype, reduction
        o.ignore_index, o.label_smoothing, o.z_loss_scale = ignore_index, label_smoothing, z_loss
        o.softcap, o.logit_scale, o.shift_seq_len = softcap, logit_scale, shift_seq_len
        o.grad_weight_fp32 = int(grad_weight_fp32)
        if len(_OPTIONS) > 256:
            _OPTIONS.clear()
        _OPTIONS[key] = o
    return key, o


def _stream(t: Tensor) -> Optional[int]:
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else None


def _backend(t: Tensor) -> int:
    return _lib.FCE_BACKEND_CUDA if t.is_cuda else _lib.FCE_BACKEND_CPU


def _check(status: int, fn: str) -> None:
    if status:
        _lib.check(status, fn)


def _workspace(nbytes: int, like: Tensor) -> Optional[Tensor]:
    return torch.empty(nbytes, dtype=torch.uint8, device=like.device) if nbytes else None


def _ptr(t: Optional[Tensor]) -> Optional[int]:
    return t.data_ptr() if t is not None else None


# ----------------------------------------------------------------- cross-entropy ----
def _ce_call_setup(which: str, logits: Tensor, targets: Tensor,
                   class_weights: Optional[Tensor], opts: tuple, grad_row_stride: int):
    """(library, fce_options, workspace bytes) of an fce_forward ('fwd') / fce_backward ('bwd')
    call on these tensors; the workspace query is made once per option set and size."""
    n, v = logits.shape
    key, o = options(_backend(logits), _CODE[logits.dtype], _CODE[targets.dtype], *opts)
    o.class_weights = _ptr(class_weights)
    o.row_stride = logits.stride(0) if n > 1 else v
    o.grad_row_stride = grad_row_stride
    lib = _lib.load()
    skey = (which, key, n, v)
    ws_bytes = _SIZES.get(skey)
    if ws_bytes is None:
        size = ctypes.c_size_t()
        fn = "fce_forward_workspace_size" if which == "fwd" else "fce_backward_workspace_size"
        _check(getattr(lib, fn)(ctypes.byref(o), n, v, ctypes.byref(size)), fn)
        ws_bytes = _SIZES[skey] = size.value
    return lib, o, ws_bytes


def ce_forward(logits: Tensor, targets: Tensor, class_weights: Optional[Tensor], opts: tuple,
               *, grad: Optional[Tensor] = None, want_lse: bool = True
               ) -> Tuple[Tensor, Optional[Tensor]]:
    """fce_forward on a [N, V] tensor whose last stride is 1: (loss, lse). With ``grad`` (dense
    [N, V], or ``logits`` itself for in place) the gradient for an upstream 1 is written in the
    same pass. ``opts`` = the positional arguments of :func:`options` after backend/dtype."""
    n, v = logits.shape
    grad_stride = 0
    if grad is not None:
        grad_stride = (logits.stride(0) if n > 1 else v) if grad is logits else v
    lib, o, ws_bytes = _ce_call_setup("fwd", logits, targets, class_weights, opts, grad_stride)
    reduction = opts[0]
    loss = torch.empty((n,) if reduction == _lib.FCE_REDUCTION_NONE else (), dtype=torch.float32,
                       device=logits.device)
    lse = torch.empty((n,), dtype=torch.float32, device=logits.device) if want_lse else None
    ws = _workspace(ws_bytes, logits)
    _check(lib.fce_forward(ctypes.byref(o), n, v, logits.data_ptr(), targets.data_ptr(),
                           loss.data_ptr(), _ptr(lse), None, _ptr(grad), None, None, _ptr(ws),
                           ws_bytes, _stream(logits)), "fce_forward")
    return loss, lse


def ce_backward(logits: Tensor, targets: Tensor, lse: Tensor, grad_output: Tensor,
                class_weights: Optional[Tensor], opts: tuple,
                rescale: Optional[Tensor] = None) -> Tensor:
    """fce_backward: a dense [N, V] gradient from the logits, the saved lse and the upstream
    gradient (float32: one value, or [N] for reduction 'none'). With ``rescale`` (the dense
    gradient fce_forward wrote for an upstream 1): fce_backward_rescale, in place into it."""
    n, v = logits.shape
    lib, o, ws_bytes = _ce_call_setup("bwd", logits, targets, class_weights, opts, 0)
    grad = rescale if rescale is not None else torch.empty((n, v), dtype=logits.dtype,
                                                           device=logits.device)
    ws = _workspace(ws_bytes, logits)
    fn = "fce_backward_rescale" if rescale is not None else "fce_backward"
    _check(getattr(lib, fn)(ctypes.byref(o), n, v, logits.data_ptr(), targets.data_ptr(),
                            lse.data_ptr(), grad_output.data_ptr(), grad.data_ptr(), None,
                            _ptr(ws), ws_bytes, _stream(logits)), fn)
    return grad


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
                        budget: int) -> int:
    """The workspace for this call: the full-speed size if it is within budget, else the budget,
    never below the minimum (fce_linear_ce_workspace_size)."""
    skey = ("lin", key, n, d, v, with_grad)
    sizes = _SIZES.get(skey)
    if sizes is None:
        lo, hi = ctypes.c_size_t(), ctypes.c_size_t()
        _check(_lib.load().fce_linear_ce_workspace_size(ctypes.byref(o), n, d, v, int(with_grad),
                                                        ctypes.byref(lo), ctypes.byref(hi)),
               "fce_linear_ce_workspace_size")
        sizes = _SIZES[skey] = (lo.value, hi.value)
    lo, hi = sizes
    return max(lo, min(hi, budget))


def linear_ce(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor,
              class_weights: Optional[Tensor], grad_output: Optional[Tensor], opts: tuple, *,
              grad_weight_fp32: bool, need: Tuple[bool, bool, bool], budget: int
              ) -> Tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """fce_linear_ce: (loss, lse, grad_hidden, grad_weight, grad_bias), the gradients asked for
    in ``need`` (None for the others) scaled by grad_output (None = 1). hidden [N, D] with last
    stride 1, weight [V, D] and bias [V] dense, all of one dtype."""
    n, d = hidden.shape
    v = weight.shape[0]
    key, o = options(_backend(hidden), _CODE[hidden.dtype], _CODE[targets.dtype], *opts,
                     grad_weight_fp32=grad_weight_fp32)
    o.class_weights = _ptr(class_weights)
    o.hidden_row_stride = hidden.stride(0) if n > 1 else d
    with_grad = any(need)
    # the budget covers everything this call allocates beyond the gradients: the workspace,
    # and lse / loss (and room for a targets conversion), 16 bytes a row
    ws_bytes = linear_ce_workspace(o, key, n, d, v, with_grad, max(0, budget - 16 * n - 4096))
    dev = hidden.device
    reduction = opts[0]
    loss = torch.empty((n,) if reduction == _lib.FCE_REDUCTION_NONE else (), dtype=torch.float32,
                       device=dev)
    lse = torch.empty((n,), dtype=torch.float32, device=dev)
    gw_dtype = torch.float32 if grad_weight_fp32 else hidden.dtype
    gh = torch.empty((n, d), dtype=hidden.dtype, device=dev) if need[0] else None
    gw = torch.empty((v, d), dtype=gw_dtype, device=dev) if need[1] else None
    gb = torch.empty((v,), dtype=gw_dtype, device=dev) if need[2] and bias is not None else None
    ws = _workspace(ws_bytes, hidden)
    _check(_lib.load().fce_linear_ce(
        ctypes.byref(o), n, d, v, hidden.data_ptr(), weight.data_ptr(), _ptr(bias),
        targets.data_ptr(), loss.data_ptr(), lse.data_ptr(), None, _ptr(gh), _ptr(gw), _ptr(gb),
        _ptr(grad_output), None, _ptr(ws), ws_bytes, _stream(hidden)), "fce_linear_ce")
    return loss, lse, gh, gw, gb
