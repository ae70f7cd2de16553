"""Argument handling and the return convention shared by :mod:`fusedce.torch` and
:mod:`fusedce.torch.distributed`: reductions, targets, input dtypes, the causal shift, and the
optional outputs (``CrossEntropyOutput``, from a :class:`fusedce._options.Want`) with the
per-row z-loss made from lse.

Values the library checks (a negative shift or shift_seq_len, rows that are no whole number of
sequences, option ranges) are left to it: its message, naming the option, is raised as it is.
"""

from __future__ import annotations

import collections
import itertools

import torch
from torch import Tensor

from .. import _args, _arrays
from .._lib import FCE_REDUCTION_NONE
from .._options import NOTHING, CEOptions, Want
from . import _calls as _tc

_REDUCTIONS = {"mean": 0, "sum": 1, "none": FCE_REDUCTION_NONE}


def _reduction(reduction: str) -> int:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    return _REDUCTIONS[reduction]


def _targets(target: Tensor) -> Tensor:
    if target.is_floating_point():
        raise TypeError("fusedce supports class-index targets only (int64/int32), not class "
                        "probabilities")
    if target.dtype not in (torch.int64, torch.int32):
        target = target.to(torch.int64)
    return target if target.dim() == 1 else target.reshape(-1)


def _float_input(x: Tensor, fn: str, name: str) -> Tensor:
    """A floating-point input as the library takes it: float32, float16 or bfloat16, unchanged.
    Any other dtype is refused, float64 included: torch would compute in it, the library cannot,
    and casting it behind the caller's back would hand back float32 results for float64 inputs
    (the message says how to cast it)."""
    if x.dtype not in _tc.CODE_OF_TORCH:
        raise _arrays._dtype_unsupported(f"{fn}: {name}", str(x.dtype).replace("torch.", ""),
                                         ".float()")
    return x


def _linear_dtype(fn: str, tensors) -> torch.dtype:
    """The dtype the linear layer's matmul runs in, as F.linear's: the autocast dtype when
    autocast is on for the first tensor's device, else that tensor's own, which the others must
    have too. ``tensors``: (name, tensor or None), the hidden states first. Every one must be
    float32, float16 or bfloat16 (_float_input), under autocast too: autocast leaves a float64
    tensor as it is, and F.linear would compute in float64."""
    (hname, hidden), rest = tensors[0], tensors[1:]
    for name, t in tensors:
        if t is not None:
            _float_input(t, fn, name)
    dev = hidden.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        cdt = torch.get_autocast_dtype(dev)
        if cdt not in _tc.CODE_OF_TORCH:
            raise TypeError(f"{fn}: the autocast dtype {cdt} is not supported; supported: "
                            "float32, float16, bfloat16")
        return cdt
    for name, t in rest:
        if t is not None and t.dtype != hidden.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {hname} has {hidden.dtype} "
                            "(as for F.linear, they must match outside autocast)")
    return hidden.dtype


# (T, k) for the C options from the two spellings of the causal shift: ``shift_seq_len=T``
# alone means k = 1, ``shift=k`` alone takes T = target.shape[-1], k = 1 is passed as 0
_resolve_shift = _args._resolve_shift


# ------------------------------------------------------------- extra outputs ----
# The optional outputs, in the order they follow the loss in the returned tuple: Liger's
# (loss, z_loss, token_accuracy, predicted_tokens), then CCE's lse, then the entropy
# (OUTPUT_FIELDS). One named tuple type per combination asked for.
_OUTPUT_TYPES = {
    want: collections.namedtuple("CrossEntropyOutput", ("loss",) + want.fields())
    for want in (Want(*flags) for flags in itertools.product((False, True), repeat=5)) if want
}


def want(return_z_loss, return_token_accuracy, return_predicted_tokens, return_lse,
         return_entropy=False) -> Want:
    """The outputs the return_* keywords ask for."""
    if not (return_z_loss or return_token_accuracy or return_predicted_tokens or return_lse
            or return_entropy):
        return NOTHING
    return Want(z_loss=bool(return_z_loss), accuracy=bool(return_token_accuracy),
                argmax=bool(return_predicted_tokens), lse=bool(return_lse),
                entropy=bool(return_entropy))


def _transform(a: Tensor, logit_scale: float, softcap: float) -> Tensor:
    """a = c * tanh(s * z / c), in float32, as the library does before anything else."""
    a = a.float() * logit_scale
    if softcap > 0:
        a = softcap * torch.tanh(a / softcap)
    return a


def _z_loss_rows(lse: Tensor, targets: Tensor, vocab: int, opts: CEOptions,
                 target_logit) -> Tensor:
    """Per-row z-loss for reduction 'none' (Liger's): lambda * lse^2 for every non-ignored row
    (out-of-range targets included, docs/semantics.md rule 3), times the detached p_y with token
    scaling (valid rows), 0 for ignored rows. ``target_logit(y)`` gives the raw logit of class
    y[r] in row r (only called with token scaling)."""
    ignore_index, lam = opts.ignore_index, opts.z_loss
    lse = lse.detach()  # (a returned lse carries a gradient; this output does not)
    if lam == 0.0:
        return torch.zeros_like(lse)
    y = _tc.row_targets(targets.to(torch.int64), ignore_index, opts.shift_seq_len, opts.shift)
    counted = y != ignore_index
    zl = lam * lse.square()
    if opts.token_scaling:
        valid = counted & (y >= 0) & (y < vocab)
        a_y = _transform(target_logit(y.clamp(0, vocab - 1)), opts.logit_scale, opts.softcap)
        zl = torch.where(valid, zl * torch.exp(a_y - lse), zl)
    return torch.where(counted, zl, torch.zeros_like(zl))


def _finish(want: Want, red: int, out_shape, loss: Tensor, lse, zl, acc, am, z_rows,
            entropy=None):
    """The return value: the loss alone, or the CrossEntropyOutput named tuple of the loss and
    the outputs asked for. Per-row outputs take out_shape (the shape of a 'none' loss).
    ``z_rows()``: the per-row z-loss of reduction 'none' (not differentiable)."""
    def rows(t):
        return t.reshape(out_shape) if out_shape is not None else t

    if red == FCE_REDUCTION_NONE:
        loss = rows(loss)
    if not want:
        return loss
    values = [loss]
    if want.z_loss:
        values.append(rows(z_rows()) if red == FCE_REDUCTION_NONE else zl)
    if want.accuracy:
        values.append(rows(acc) if red == FCE_REDUCTION_NONE else acc)
    if want.argmax:
        values.append(rows(am))
    if want.lse:
        values.append(rows(lse))
    if want.entropy:
        values.append(rows(entropy))
    return _OUTPUT_TYPES[want](*values)
