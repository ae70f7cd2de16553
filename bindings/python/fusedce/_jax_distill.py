"""The distillation calls of fusedce.jax (fce_distill, fce_linear_distill as the XLA FFI
targets fusedce_distill and fusedce_linear_distill of the shim, fusedce/jax_ffi/
fusedce_jax_distill.cc) and their custom_vjp rules; the public functions are in jax.py.

The plan, as :mod:`fusedce.torch`'s: reduction 'mean' / 'sum', differentiated: the forward
call writes the student's gradients (logits; hidden, weight) for an upstream gradient of 1
with the loss, and the backward scales them in place with ``fce_scale_gradient`` (free when
the cotangent is 1). Reduction 'none': the forward computes the loss only and the backward
calls the library again with the per-row cotangent. The teacher gets no gradient. The
workspace is the last result of each custom call, sized at trace time per platform, as for
the cross-entropy calls (the docstring of :mod:`fusedce.jax`, "Workspaces").
"""

from __future__ import annotations

import ctypes
import functools
from typing import Tuple

import numpy as np

import jax
import jax.numpy as jnp

from . import _alloc, _lib
from . import _jax_calls as _calls
from ._args import _build_options, _build_teacher
from ._jax_calls import (_CPU, _CUDA, _F32, _FLOAT_CODES, _cuda_usable, _empty, _ffi_call,
                         _per_platform, _scale, _sds)
from ._jax_vjp import _is_zero, _need_marker, _primal
from ._options import DistillOptions


def check_ready(fn: str):
    """Register the handlers; raise when the loaded library lacks the distillation calls."""
    _calls.register()
    missing = _lib.lacks(_lib.DISTILL_SYMBOLS)
    if missing:
        raise RuntimeError(f"{fn}: the loaded libfusedce has no distillation calls "
                           f"({_lib.library_path()} lacks {', '.join(missing)})")


def _dattrs(opts: DistillOptions) -> dict:
    """The attributes MakeDistill in fusedce_jax_distill.cc reads."""
    return {"iopts": np.array([opts.reduction, opts.ignore_index, opts.divergence], np.int64),
            "fopts": np.array([opts.beta, opts.temperature, opts.softcap, opts.logit_scale],
                              np.float32)}


def _query_options(opts: DistillOptions, backend: int, dtype, targets,
                   grad_weight_fp32: bool = False):
    """The fce_options the handler builds: int32 targets when there are none (the library
    reads target_dtype only with targets)."""
    tdt = _lib.FCE_INT64 if targets.dtype == jnp.int64 else _lib.FCE_INT32
    return _build_options(opts.ce(), backend=backend, dtype=_FLOAT_CODES[jnp.dtype(dtype).name],
                          target_dtype=tdt, grad_weight_fp32=grad_weight_fp32)


def _distill_workspace(opts: DistillOptions, logits, targets) -> Tuple[int, int]:
    n, v = logits.shape

    def query(backend):
        o = _query_options(opts, backend, logits.dtype, targets)
        t = _build_teacher(opts)
        out = ctypes.c_size_t(0)
        _alloc.query_for("fce_distill", "fce_distill_workspace_size", ctypes.byref(o),
                         ctypes.byref(t), n, v, ctypes.byref(out))
        return out.value
    return _per_platform(query)


def _linear_sizes(opts: DistillOptions, backend: int, hidden, weight, teacher_hidden, targets,
                  with_grad: bool, fp32: bool) -> Tuple[int, int]:
    """(min_bytes, optimal_bytes) of fce_linear_distill_workspace_size."""
    n, d = hidden.shape
    o = _query_options(opts, backend, hidden.dtype, targets, fp32)
    t = _build_teacher(opts, hidden=teacher_hidden.shape[1])
    lo, hi = ctypes.c_size_t(0), ctypes.c_size_t(0)
    _alloc.query_for("fce_linear_distill", "fce_linear_distill_workspace_size", ctypes.byref(o),
                     ctypes.byref(t), n, d, weight.shape[0], 1 if with_grad else 0,
                     ctypes.byref(lo), ctypes.byref(hi))
    return lo.value, hi.value


def _cuda_bytes(lo: int, hi: int, budget: int) -> int:
    """CUDA: the fastest plan's workspace when within the budget, else the budget, never below
    min_bytes (as linear_cross_entropy's)."""
    return hi if hi < budget else max(budget, lo)


def _grad_weight_fp32(opts: DistillOptions, budget: int, hidden, weight, teacher_hidden,
                      targets, need: Tuple[bool, bool]) -> bool:
    """Whether a 16-bit grad_weight is accumulated in float32 (and rounded once after the
    call), as fusedce.torch does: CUDA refuses a 16-bit grad_weight below the token-chunk
    plan's workspace (fusedce.h, fce_linear_distill), which the budget may not hold. Decided
    from the CUDA sizes, and then used on both platforms, whose results must have one type."""
    if not need[1] or jnp.dtype(hidden.dtype) == jnp.float32 or not _cuda_usable():
        return False
    try:
        lo, hi = _linear_sizes(opts, _CUDA, hidden, weight, teacher_hidden, targets, True, False)
    except _lib.FusedCEError:
        return False  # the workspace query reports it (_per_platform)
    return _cuda_bytes(lo, hi, budget) < hi


def _linear_workspace(opts: DistillOptions, budget: int, hidden, weight, teacher_hidden,
                      targets, need: Tuple[bool, bool], fp32: bool) -> Tuple[int, int]:
    """CPU: min_bytes. CUDA: :func:`_cuda_bytes`."""
    with_grad = need[0] or need[1]

    def query(backend):
        lo, hi = _linear_sizes(opts, backend, hidden, weight, teacher_hidden, targets,
                               with_grad, fp32)
        return lo if backend == _CPU else _cuda_bytes(lo, hi, budget)
    return _per_platform(query)


def _upstream(grad_output):
    return _empty() if grad_output is None else jnp.asarray(grad_output, _F32)


# -------------------------------------------------------------------- the calls ----
@functools.partial(jax.jit, static_argnames=("opts", "with_grad"))
def _distill_call(logits, teacher, targets, grad_output, opts: DistillOptions, with_grad: bool):
    """(loss, grad|(0,)) from fusedce_distill; grad_output None: an upstream of 1."""
    n, v = logits.shape
    outs = [_sds((n,) if opts.per_row else (), _F32),
            _sds((n, v) if with_grad else (0,), logits.dtype)]
    ws = _distill_workspace(opts, logits, targets)
    return _ffi_call("fusedce_distill", outs, (logits, teacher, targets, _upstream(grad_output)),
                     _dattrs(opts), ws)


@functools.partial(jax.jit, static_argnames=("opts", "budget", "need"))
def _linear_distill_call(hidden, weight, teacher_hidden, teacher_weight, targets, grad_output,
                         opts: DistillOptions, budget: int, need: Tuple[bool, bool]):
    """(loss, grad_hidden|(0,), grad_weight|(0,)) from fusedce_linear_distill."""
    n, d = hidden.shape
    v = weight.shape[0]
    fp32 = _grad_weight_fp32(opts, budget, hidden, weight, teacher_hidden, targets, need)
    outs = [_sds((n,) if opts.per_row else (), _F32),
            _sds((n, d) if need[0] else (0,), hidden.dtype),
            _sds((v, d) if need[1] else (0,), _F32 if fp32 else weight.dtype)]
    ws = _linear_workspace(opts, budget, hidden, weight, teacher_hidden, targets, need, fp32)
    loss, gh, gw = _ffi_call("fusedce_linear_distill", outs,
                             (hidden, weight, teacher_hidden, teacher_weight, targets,
                              _upstream(grad_output)), _dattrs(opts), ws)
    return loss, gh, gw.astype(weight.dtype)


def _row_or_scalar_ct(ct, opts: DistillOptions, n: int):
    return jnp.asarray(ct, _F32).reshape((n,) if opts.per_row else ())


# ------------------------------------------------------------------ distill vjp ----
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _distill(logits, teacher, targets, opts: DistillOptions):
    return _distill_call(logits, teacher, targets, None, opts, False)[0]


def _distill_fwd(logits, teacher, targets, opts: DistillOptions):
    z, dz = _primal(logits)
    t, _ = _primal(teacher)
    y, _ = _primal(targets)
    if not dz:
        return _distill_call(z, t, y, None, opts, False)[0], None
    if not opts.per_row:  # the gradient for an upstream 1 with the loss; scaled later
        loss, grad1 = _distill_call(z, t, y, None, opts, True)
        return loss, (grad1, None)
    return _distill_call(z, t, y, None, opts, False)[0], (None, (z, t, y))


def _distill_bwd(opts: DistillOptions, res, ct):
    if res is None or _is_zero(ct):
        return None, None, None
    grad1, inputs = res
    if grad1 is not None:
        return _scale(grad1, jnp.asarray(ct, _F32).reshape(())), None, None
    z, t, y = inputs
    grad = _distill_call(z, t, y, _row_or_scalar_ct(ct, opts, z.shape[0]), opts, True)[1]
    return grad, None, None


_distill.defvjp(_distill_fwd, _distill_bwd, symbolic_zeros=True)


# ----------------------------------------------------------- linear_distill vjp ----
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _linear_distill(hidden, weight, teacher_hidden, teacher_weight, targets,
                    opts: DistillOptions, budget: int):
    return _linear_distill_call(hidden, weight, teacher_hidden, teacher_weight, targets, None,
                                opts, budget, (False, False))[0]


def _linear_distill_fwd(hidden, weight, teacher_hidden, teacher_weight, targets,
                        opts: DistillOptions, budget: int):
    h, dh = _primal(hidden)
    w, dw = _primal(weight)
    th, _ = _primal(teacher_hidden)
    tw, _ = _primal(teacher_weight)
    y, _ = _primal(targets)

    def call(need, ct=None):
        return _linear_distill_call(h, w, th, tw, y, ct, opts, budget, need)
    if not (dh or dw):
        return call((False, False))[0], None
    if not opts.per_row:  # the gradients for an upstream 1 with the loss; scaled later
        loss, gh, gw = call((dh, dw))
        return loss, ((gh if dh else None, gw if dw else None), None)
    return call((False, False))[0], (None, ((h, w, th, tw, y), _need_marker((dh, dw))))


def _linear_distill_bwd(opts: DistillOptions, budget: int, res, ct):
    nones = (None, None, None)
    if res is None or _is_zero(ct):
        return (None, None) + nones
    scaled, recompute = res
    if scaled is not None:
        gh, gw = scaled
        c = jnp.asarray(ct, _F32).reshape(())
        return ((_scale(gh, c) if gh is not None else None),
                (_scale(gw, c) if gw is not None else None)) + nones
    (h, w, th, tw, y), marker = recompute
    need = tuple(m is not None for m in marker)
    _, gh, gw = _linear_distill_call(h, w, th, tw, y, _row_or_scalar_ct(ct, opts, h.shape[0]),
                                     opts, budget, need)
    return ((gh if need[0] else None), (gw if need[1] else None)) + nones


_linear_distill.defvjp(_linear_distill_fwd, _linear_distill_bwd, symbolic_zeros=True)
