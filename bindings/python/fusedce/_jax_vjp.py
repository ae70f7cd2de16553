"""The custom_vjp wiring of fusedce.jax: which custom calls the forward and backward rules of
:func:`fusedce.jax.cross_entropy` and :func:`fusedce.jax.linear_cross_entropy` make (the plan
is in the docstring of :mod:`fusedce.jax`, "How the gradients are computed"); the calls
themselves are in _jax_calls.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from ._jax_calls import _F32, _ce_bwd_call, _ce_fwd_call, _empty, _linear_call, _scale
from ._options import NOTHING, CEOptions, Want


def _primal(p):
    """(value, perturbed) of a custom_vjp(symbolic_zeros=True) forward-rule argument."""
    if isinstance(p, CustomVJPPrimal):
        return p.value, bool(p.perturbed)
    return p, False


def _is_zero(ct) -> bool:
    return ct is None or isinstance(ct, SymbolicZero)


def _row_ct(ct):
    """The cotangent of a per-row output (lse, entropy) as float32 [N], None where it is zero
    (symbolic) or the output is the empty (0,) placeholder of one not asked for."""
    if _is_zero(ct) or ct.size == 0:
        return None
    return jnp.asarray(ct, _F32).reshape(-1)


def _loss_ct(ct, opts: CEOptions, n: int):
    """The loss's cotangent as the library takes it (float32 () or [N]); zeros where it is a
    symbolic zero (only lse or the entropy has a cotangent)."""
    shape = (n,) if opts.per_row else ()
    if _is_zero(ct):
        return jnp.zeros(shape, _F32)
    return jnp.asarray(ct, _F32).reshape(shape)


# --------------------------------------------------------------- cross_entropy vjp ----
# opts: the caller's options; want: what the library call writes (Want.from_library)
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _ce(logits, targets, cw, opts: CEOptions, want: Want):
    return _ce_fwd_call(logits, targets, cw, opts, want, False)[:6]


def _ce_fwd(logits, targets, cw, opts: CEOptions, want: Want):
    z, dz = _primal(logits)
    y, _ = _primal(targets)
    w, _ = _primal(cw)
    if not dz:  # nothing to differentiate here
        return _ce_fwd_call(z, y, w, opts, want, False)[:6], None
    one_pass = not opts.per_row
    loss, lse, zl, acc, am, ent, grad1 = _ce_fwd_call(z, y, w, opts, want.replace(lse=True),
                                                      one_pass)
    out_lse = lse if want.lse else _empty()
    return (loss, out_lse, zl, acc, am, ent), (z, y, w, lse, grad1 if one_pass else None)


def _ce_bwd(opts: CEOptions, want: Want, res, cts):
    ct, ct_lse, ct_ent = cts[0], _row_ct(cts[1]), _row_ct(cts[5])
    if res is None or (_is_zero(ct) and ct_lse is None and ct_ent is None):
        return None, None, None
    z, y, w, lse, grad1 = res
    ct = _loss_ct(ct, opts, z.shape[0])
    if ct_ent is not None:  # every cotangent in one fce_forward (its loss a scratch output)
        grad = _ce_fwd_call(z, y, w, opts, NOTHING, True, (ct, ct_lse, ct_ent))[-1]
    elif ct_lse is not None:  # fce_backward with grad_lse, from the saved lse
        grad = _ce_bwd_call(z, y, w, lse, ct, None, opts, grad_lse=ct_lse)
    else:
        grad = _ce_bwd_call(z, y, w, lse, ct, grad1, opts)
    return grad, None, None


_ce.defvjp(_ce_fwd, _ce_bwd, symbolic_zeros=True)


# -------------------------------------------------------- linear_cross_entropy vjp ----
def _need_marker(flags):
    """A pytree (residuals hold arrays only) saying which gradients the backward computes."""
    return tuple(() if f else None for f in flags)


# opts, want: as _ce's; workspace_bytes: the CUDA workspace budget
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _linear(hidden, weight, bias, targets, cw, opts: CEOptions, want: Want,
            workspace_bytes: int):
    return _linear_call(hidden, weight, bias, targets, cw, None, opts, want, workspace_bytes,
                        (False, False, False))[:6]


def _linear_fwd(hidden, weight, bias, targets, cw, opts: CEOptions, want: Want,
                workspace_bytes: int):
    h, dh = _primal(hidden)
    wt, dw = _primal(weight)
    b, db = _primal(bias) if bias is not None else (None, False)
    y, _ = _primal(targets)
    w, _ = _primal(cw)
    db = db and b is not None

    def call(need):
        return _linear_call(h, wt, b, y, w, None, opts, want, workspace_bytes, need)
    if not (dh or dw or db):
        return call((False, False, False))[:6], None
    # the inputs, for a recompute (also when lse or the entropy, returned, get a cotangent)
    recompute = ((h, wt, b, y, w), _need_marker((dh, dw, db)))
    if not opts.per_row and not db:
        # gradients for an upstream 1 in the same call as the loss; scaled in the backward
        outs = call((dh, dw, False))
        gh, gw = outs[6:8]
        return outs[:6], ((gh if dh else None, gw if dw else None),
                          recompute if (want.lse or want.entropy) else None)
    # reduction 'none' (per-row cotangent) or a bias to differentiate (its 16-bit sum would be
    # rounded twice by a scale): the loss now, everything with the real cotangent later
    return call((False, False, False))[:6], (None, recompute)


def _linear_bwd(opts: CEOptions, want: Want, workspace_bytes: int, res, cts):
    ct, ct_lse, ct_ent = cts[0], _row_ct(cts[1]), _row_ct(cts[5])
    nones = (None, None)
    extra = ct_lse is not None or ct_ent is not None
    if res is None or (_is_zero(ct) and not extra):
        return (None, None, None) + nones
    scaled, recompute = res
    if scaled is not None and not extra:
        gh, gw = scaled
        ct = jnp.asarray(ct, _F32).reshape(())
        return ((_scale(gh, ct) if gh is not None else None),
                (_scale(gw, ct) if gw is not None else None), None) + nones
    # recompute with the real cotangents: the loss's and those of lse and the entropy
    (h, wt, b, y, w), marker = recompute
    need = tuple(m is not None for m in marker)
    ct = _loss_ct(ct, opts, h.shape[0])
    gh, gw, gb = _linear_call(h, wt, b, y, w, ct, opts, want, workspace_bytes, need,
                              ct_lse, ct_ent)[6:9]
    return ((gh if need[0] else None), (gw if need[1] else None),
            (gb if need[2] else None)) + nones


_linear.defvjp(_linear_fwd, _linear_bwd, symbolic_zeros=True)
