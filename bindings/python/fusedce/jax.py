"""fusedce.jax: fused cross-entropy for JAX, with autodiff, ``jax.jit``, ``jax.grad`` and
``jax.vmap``.

    from fusedce.jax import cross_entropy, linear_cross_entropy
    loss = cross_entropy(logits, targets)                    # logits [..., V], targets [...]
    loss = linear_cross_entropy(hidden, weight, targets)     # hidden [..., D], weight [V, D]
    grads = jax.grad(lambda w: linear_cross_entropy(h, w, y))(w)

The library's calls run as XLA FFI custom calls (``jax.ffi``): arrays on a GPU run on the CUDA
backend on the stream XLA gives the call; arrays on the CPU run on the CPU backend. The
library's workspace is one more result of each custom call, a uint8 buffer sized at trace time
with the library's own queries and dropped at once (under ``jax.jit`` an XLA temporary; see
"Workspaces" below). No host synchronisation, no copy of the inputs. The
handlers live in a small C++ shim, libfusedce_jax.so (``fusedce/jax_ffi/fusedce_jax.cc`` and
``fusedce_jax_distill.cc``), which calls libfusedce's public C ABI; it is compiled on first
use against the installed jaxlib's FFI headers (``jax.ffi.include_dir()``) with the C++ compiler (``$CXX``, ``c++``) and
cached in ``~/.cache/fusedce/jax`` (see :mod:`fusedce.jax_ffi`), or taken prebuilt from
``FUSEDCE_JAX_LIBRARY``. ``python -m fusedce.jax build [--output DIR]`` builds it ahead of time;
``python -m fusedce.jax info`` says which is used. The losses are float32 whatever the input
dtype; float64 inputs are computed in float32.

How the gradients are computed (``jax.custom_vjp``, the same plan as :mod:`fusedce.torch`):

* :func:`cross_entropy`, reduction 'mean' / 'sum', differentiated: the forward rule makes ONE
  pass over the logits (``fce_forward`` with a gradient buffer, upstream gradient 1) that
  writes the loss, lse and the gradient; the backward rule applies the cotangent with
  ``fce_backward_rescale`` IN PLACE on that buffer (the residual is aliased to the output, so
  XLA reuses it): exactly 1 — ``jax.grad`` of the loss itself — costs one launch and no pass;
  0 or ±2^k an exact scale; any other value recomputes the gradient from the logits (kept as a
  residual), so it is rounded once, as XLA's own. Undifferentiated calls (and the primal of
  ``jax.value_and_grad``'s loss) compute only the loss.
* :func:`cross_entropy`, reduction 'none': the forward saves lse [N]; the backward calls
  ``fce_backward`` with the per-row cotangent (one more read of the logits).
* :func:`linear_cross_entropy` never forms the [N, V] logits, so for 'mean' / 'sum' the forward
  rule (``fce_linear_ce``) computes the gradients of the inputs being differentiated (hidden,
  weight: ``custom_vjp(symbolic_zeros=True)`` says which) for an upstream gradient of 1 in the
  same call as the loss, and the backward rule scales them in place with
  ``fce_scale_gradient`` (free when the cotangent is 1, exact for ±2^k; a 16-bit gradient is
  rounded twice for other values). With a bias being differentiated, or reduction 'none', the
  forward computes the loss only and the backward calls ``fce_linear_ce`` again with the real
  cotangent (one recomputation of the logits, chunk by chunk). The workspace on CUDA is the
  fastest plan's within the budget ``workspace_bytes`` (default ``FUSEDCE_WORKSPACE_BYTES`` or
  1 GiB), never below the library's minimum; on the CPU the minimum.
* The loss, lse and the entropy are differentiable: a cotangent of lse or the entropy joins the
  loss's in ONE library call (``fce_backward`` with grad_lse when only lse has one, else
  ``fce_forward`` with every cotangent; ``fce_linear_ce`` recomputed with them for
  :func:`linear_cross_entropy`). The other extras (z_loss, accuracy, predicted tokens) are
  constants, and so are ``class_weights``. No higher-order derivatives (the gradients are not
  differentiable again).
* ``jax.vmap`` runs the batched calls one after another (``jax.custom_batching.sequential_vmap``
  around each call and the dropping of its workspace, so a batch never stacks workspaces).

Workspaces: ``fce_forward`` / ``fce_backward(_rescale)`` / ``fce_linear_ce`` take caller-owned
scratch. XLA's FFI ``ScratchAllocator`` is not dependable on every jaxlib GPU client (it can
return nothing), so the workspace is instead the LAST result of each custom call: ``uint8
[bytes]``, with ``bytes`` from ``fce_forward_workspace_size``, ``fce_backward_workspace_size`` or
``fce_linear_ce_workspace_size`` (through :mod:`fusedce._lib`) for exactly the options the shim's
handler builds, queried when the call is traced. XLA allocates it like any other output (on a
GPU in the executable's temporary memory, ordered on the call's stream); the handler checks it
holds what the library asks for and is 16-byte aligned (clear errors otherwise) and passes all of
it (NULL when empty). The CPU and CUDA backends need different sizes and JAX knows the platform
only when lowering, so when the two sizes differ the call is staged with
``jax.lax.platform_dependent`` (XLA only ever compiles the branch of its platform). Where
libfusedce has no usable CUDA backend at trace time the CUDA branch gets an empty workspace: run
on a GPU, its handler then says so instead of computing.

Differences from optax / ``jax.nn`` conventions, on purpose (the library's, as fusedce.torch):
a 'mean' over zero non-ignored rows is 0 with zero gradients; a target outside [0, V) that is
not ``ignore_index`` gives a NaN loss (no host synchronisation to raise). Class-probability
targets (float targets [..., V] in :func:`cross_entropy` and :func:`linear_cross_entropy`) are
constants: they get no gradient.

Distillation (:func:`distill`, :func:`linear_distill`, fce_distill / fce_linear_distill): the
divergence between the student's and the teacher's softmax per row, differentiable in the
student's inputs only, the gradients planned as the cross-entropy's ('mean' / 'sum': written
with the loss, scaled in the backward; 'none': computed in the backward).

Errors: what the library checks (option ranges, the causal shift's values, ...) it reports
itself at trace time, from the workspace queries (:class:`fusedce.FusedCEError` subclasses,
ValueError for invalid arguments), naming the option.

The modules behind this one: _jax_calls.py (registration, workspaces, the custom calls),
_jax_vjp.py (the custom_vjp rules), jax_ffi/ (the shim and its build).
"""


from __future__ import annotations

import argparse
import collections
import functools
import sys
from typing import Optional

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from . import _alloc, _args, _lib
from . import jax_ffi as _shim_build
from ._jax_calls import (_F32, _TARGETS, _argmax_of, _attrs, _ce_bwd_call,  # noqa: F401
                         _ce_fwd_call, _ce_workspace, _cuda_usable, _empty, _extra_shapes,
                         _ffi_call, _linear_call, _linear_workspace, _per_platform,
                         _query_options, _scale, _sds, register, shim_path)
from ._jax_vjp import (_ce, _ce_bwd, _ce_fwd, _is_zero, _linear, _linear_bwd,  # noqa: F401
                       _linear_fwd, _need_marker, _primal)
from ._jax_distill import _distill, _linear_distill, check_ready
from ._options import OUTPUT_FIELDS, CEOptions, DistillOptions, Want, divergence_code

__all__ = ["cross_entropy", "linear_cross_entropy", "distill", "linear_distill", "register",
           "shim_path",
           "DEFAULT_WORKSPACE_BYTES", "OUTPUT_FIELDS"]

DEFAULT_WORKSPACE_BYTES = _alloc.DEFAULT_WORKSPACE_BYTES
_REDUCTIONS = {"mean": 0, "sum": 1, "none": 2}


@functools.lru_cache(maxsize=None)
def _output_type(want: Want):
    """The CrossEntropyOutput named tuple of the loss and the outputs ``want`` asks for."""
    return collections.namedtuple("CrossEntropyOutput", ("loss",) + want.fields())


def _reduction(reduction: str) -> int:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    return _REDUCTIONS[reduction]


# (T, k) for the C options, as fusedce.torch: ``shift_seq_len=T`` alone means k = 1; ``shift=k``
# alone takes T = target.shape[-1]; k = 1 is passed as 0 (the C default)
_resolve_shift = _args._resolve_shift
# the linear CE workspace budget: FUSEDCE_WORKSPACE_BYTES, else 1 GiB (as fusedce.torch)
_default_workspace_bytes = _alloc.default_workspace_bytes


def _targets(targets, fn: str = "fusedce.jax.cross_entropy") -> jax.Array:
    targets = jnp.asarray(targets)
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"{fn}: targets must be class indices (an integer array)"
                        + (" or class probabilities (a float array of the logits' shape)"
                           if fn.endswith(".cross_entropy") else "") + f", not {targets.dtype}")
    if targets.dtype not in (jnp.int32, jnp.int64):
        targets = targets.astype(jnp.int32)
    return targets.reshape(-1)


def _float(x, name: str) -> jax.Array:
    x = jnp.asarray(x)
    if x.dtype == jnp.float64:
        return x.astype(_F32)  # computed in float32 (documented); the cast's VJP casts back
    if x.dtype not in (jnp.float32, jnp.float16, jnp.bfloat16):
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    return x


def _class_weights(class_weights, vocab: int) -> jax.Array:
    if class_weights is None:
        return jnp.zeros((0,), _F32)
    w = jnp.asarray(class_weights)
    if w.shape != (vocab,):
        raise ValueError(f"class_weights must have shape ({vocab},), got {w.shape}")
    return lax.stop_gradient(w.astype(_F32))


# ------------------------------------------------------------------ public API ----
def _row_targets(y, ignore_index: int, t: int, k: int):
    """The target each row is scored against (docs/semantics.md rule 1)."""
    if not t:
        return y
    k = max(k, 1)
    yy = y.reshape(-1, t)
    out = jnp.full_like(yy, ignore_index)
    if k < t:
        out = out.at[:, :t - k].set(yy[:, k:])
    return out.reshape(-1)


def _transform(a, logit_scale: float, softcap: float):
    a = a.astype(_F32) * logit_scale
    if softcap > 0:
        a = softcap * jnp.tanh(a / softcap)
    return a


def _z_loss_rows(lse, y, vocab: int, opts: CEOptions, target_logit):
    """Per-row z-loss for reduction 'none' (Liger's), as fusedce.torch: lambda * lse^2 for the
    counted rows (times the constant p_y with token scaling), 0 for ignored rows."""
    if opts.z_loss == 0.0:
        return jnp.zeros_like(lse)
    y = _row_targets(y, opts.ignore_index, opts.shift_seq_len, opts.shift)
    counted = y != opts.ignore_index
    zl = opts.z_loss * jnp.square(lse)
    if opts.token_scaling:
        valid = counted & (y >= 0) & (y < vocab)
        a_y = _transform(target_logit(jnp.clip(y, 0, vocab - 1)), opts.logit_scale, opts.softcap)
        zl = jnp.where(valid, zl * jnp.exp(a_y - lse), zl)
    return jnp.where(counted, zl, jnp.zeros_like(zl))


def _finish(want: Want, opts: CEOptions, out_shape, outs, z_rows):
    """The loss, or the CrossEntropyOutput of the loss and the outputs ``want`` asks for, from
    the library call's (loss, lse, z_loss, accuracy, argmax, entropy): lse and the entropy
    differentiable, z_loss, accuracy and argmax not."""
    loss, lse, zl, acc, am, ent = outs
    rows = (lambda t: t.reshape(out_shape))
    if opts.per_row:
        loss = rows(loss)
    if not want:
        return loss
    sg = lax.stop_gradient
    values = [loss]
    if want.z_loss:
        values.append(sg(rows(z_rows(sg(lse))) if opts.per_row else zl))
    if want.accuracy:
        values.append(sg(rows(acc) if opts.per_row else acc))
    if want.argmax:
        values.append(rows(_argmax_of(am)))
    if want.lse:
        values.append(rows(lse))
    if want.entropy:
        values.append(rows(ent))
    return _output_type(want)(*values)


def _zero_rows_result(want: Want, opts: CEOptions, out_shape):
    """The result for zero rows, the library's empty problem (docs/semantics.md "Zero rows":
    the reduced loss, z-loss and accuracy 0, every per-row output empty), made here: a custom
    call would have nothing to compute, and its constant result differentiates to the zero
    gradients the library writes."""
    reduced = out_shape if opts.per_row else ()
    loss = jnp.zeros(reduced, _F32)
    if not want:
        return loss
    values = [loss]
    if want.z_loss:
        values.append(jnp.zeros(reduced, _F32))
    if want.accuracy:
        values.append(jnp.zeros(reduced, _F32))
    if want.argmax:
        values.append(jnp.zeros(out_shape, jnp.int32))
    if want.lse:
        values.append(jnp.zeros(out_shape, _F32))
    if want.entropy:
        values.append(jnp.zeros(out_shape, _F32))
    return _output_type(want)(*values)


def _ce_options(reduction: str, ignore_index, label_smoothing, z_loss, softcap, logit_scale,
                shift_seq_len, shift, use_token_scaling, target_shape, rows,
                batch_invariant=False) -> CEOptions:
    """The CEOptions of a call from the public keywords (the causal shift resolved as
    fusedce.torch's: ``shift=k`` alone takes T = the last dimension of targets)."""
    t, k = _resolve_shift(shift, shift_seq_len, target_shape, rows)
    return CEOptions(reduction=_reduction(reduction), ignore_index=ignore_index,
                     label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                     logit_scale=logit_scale, shift_seq_len=t, shift=k,
                     token_scaling=use_token_scaling, batch_invariant=bool(batch_invariant))


def cross_entropy(logits, targets, *, reduction: str = "mean", ignore_index: int = -100,
                  class_weights=None, label_smoothing: float = 0.0, z_loss: float = 0.0,
                  softcap: float = 0.0, logit_scale: float = 1.0, shift_seq_len: int = 0,
                  shift: int = 0, use_token_scaling: bool = False,
                  return_z_loss: bool = False, return_token_accuracy: bool = False,
                  return_predicted_tokens: bool = False, return_lse: bool = False,
                  return_entropy: bool = False, batch_invariant: bool = False):
    """Cross-entropy of ``logits [..., V]`` (classes last, as optax) against integer
    ``targets [...]`` (one per row: ``targets.size`` = the number of rows), fused: the mean
    (default), sum or per-row ('none', shaped as ``targets``) of

        loss_i = (1 - eps) * w[y_i] * (lse_i - a_i[y_i]) + eps / V * sum_j w_j (lse_i - a_ij)
                 + z_loss * lse_i^2,        a = softcap * tanh(logit_scale * z / softcap)

    ``optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()`` is
    ``cross_entropy(logits, targets)`` when no target is ``ignore_index``.

    reduction     'mean' (the cross-entropy terms / the sum of w[y_i] over non-ignored rows,
                  the z-loss terms / their count), 'sum' or 'none';
    ignore_index  rows whose target equals it get loss 0 and zero gradient (-100);
    class_weights w [V] (a constant: not differentiated), or None;
    label_smoothing eps in [0, 1);
    z_loss        lambda: adds lambda * lse^2 per row (PaLM);
    softcap       c > 0: logits become c * tanh(logits / c) first (Gemma 2);
    logit_scale   s: logits are multiplied by s before anything else;
    shift_seq_len, shift  causal shift without a copy, as fusedce.torch: with sequences of T
                  rows, row b*T+t is scored against target b*T+t+k, the last k positions of
                  each sequence are ignored. ``shift=k`` alone takes T = targets.shape[-1];
    use_token_scaling  each row's loss and gradient times its (constant) p_y (Liger's);
    return_z_loss, return_token_accuracy, return_predicted_tokens, return_lse, return_entropy
                  also return these (from the same library call), in a ``CrossEntropyOutput``
                  named tuple ``(loss, z_loss, token_accuracy, predicted_tokens, lse,
                  entropy)`` holding the loss and the outputs asked for, in that order (as
                  fusedce.torch; predicted_tokens is int32). lse (of the scaled, capped logits)
                  and the entropy (H = lse - sum p a, float32 per row, ignored rows too) are
                  differentiable; the others are constants.
    batch_invariant  each row's loss ('none'), lse, entropy, predicted token and gradient row
                  bitwise the same whatever the other rows (docs/semantics.md rule 21).

    Class-probability targets: float ``targets`` of the logits' shape [..., V] (and dtype;
    float64 is taken as float32) are scored as torch's ``F.cross_entropy(logits,
    probabilities)``: loss_i = -sum_j w_j q'_j log p_ij, q' = (1 - eps) q + eps / V, plus the
    z-loss; every row is scored ('mean' divides by the rows, class weights or not; a
    non-negative ``ignore_index`` is refused), the targets are constants (no gradient), and
    ``use_token_scaling``, the causal shift and ``return_token_accuracy`` are refused (there
    is no target class); the per-row outputs have the logits' leading shape.

    The loss is float32 (computed in float32 inside for 16-bit logits). Differentiable in
    ``logits`` (``jax.grad``, ``jax.vjp``; not ``jax.jvp``/``jax.jacfwd``, a custom_vjp).
    """
    z = _float(logits, "logits")
    if z.ndim < 1:
        raise ValueError("logits must have at least one dimension (the classes)")
    y_in = jnp.asarray(targets)
    vocab = z.shape[-1]
    if vocab < 1:
        raise ValueError("logits must have at least one class")
    rows = int(np.prod(z.shape[:-1], dtype=np.int64))
    z = z.reshape(rows, vocab)
    if jnp.issubdtype(y_in.dtype, jnp.floating):
        return _soft_call(
            "fusedce.jax.cross_entropy", y_in, tuple(jnp.shape(logits)), z.dtype, rows,
            class_weights, lambda q, cw, opts, lib_want: _ce(z, q, cw, opts, lib_want),
            reduction=reduction, ignore_index=ignore_index,
            label_smoothing=label_smoothing, z_loss=z_loss,
            softcap=softcap, logit_scale=logit_scale, shift_seq_len=shift_seq_len, shift=shift,
            use_token_scaling=use_token_scaling, return_z_loss=return_z_loss,
            return_token_accuracy=return_token_accuracy,
            return_predicted_tokens=return_predicted_tokens, return_lse=return_lse,
            return_entropy=return_entropy, batch_invariant=batch_invariant)
    y = _targets(y_in)
    if y.shape[0] != rows:
        raise ValueError(f"targets has {y.shape[0]} elements for {rows} rows of logits "
                         f"(logits {tuple(jnp.shape(logits))}, targets {tuple(y_in.shape)})")
    out_shape = tuple(y_in.shape)
    opts = _ce_options(reduction, ignore_index, label_smoothing, z_loss, softcap, logit_scale,
                       shift_seq_len, shift, use_token_scaling, out_shape, rows,
                       batch_invariant)
    want = Want(z_loss=bool(return_z_loss), accuracy=bool(return_token_accuracy),
                argmax=bool(return_predicted_tokens), lse=bool(return_lse),
                entropy=bool(return_entropy))
    if rows == 0:
        return _zero_rows_result(want, opts, out_shape)
    register()
    outs = _ce(z, y, _class_weights(class_weights, vocab), opts,
               want.from_library(opts.reduction))
    return _finish(want, opts, out_shape, outs, lambda lse: _z_loss_rows(
        lse, y, vocab, opts,
        lambda yy: jnp.take_along_axis(lax.stop_gradient(z), yy[:, None], axis=1)[:, 0]))


def _soft_call(fn, q_in, logits_shape, dtype, rows, class_weights, call, **setup):
    """A call against class probabilities q [..., V] (torch's F.cross_entropy(input,
    probabilities), docs/semantics.md rule 19): the same custom calls with a float target
    dtype, ``call(q, class_weights, opts, want_from_library)`` making them (over logits or
    fused with the linear layer); every row is scored, 'mean' divides by the rows. ``setup``:
    the caller's options, checked by :func:`_soft_setup`."""
    q, opts, want, out_shape = _soft_setup(fn, q_in, logits_shape, dtype, rows, **setup)
    if rows == 0:
        return _zero_rows_result(want, opts, out_shape)
    register()
    outs = call(q, _class_weights(class_weights, logits_shape[-1]), opts,
                want.from_library(opts.reduction))
    return _finish(want, opts, out_shape, outs, lambda lse: _soft_z_loss_rows(lse, opts))


def _soft_z_loss_rows(lse, opts: CEOptions):
    """Per-row z-loss with class-probability targets: lambda lse^2 on every row (no row is
    ignored)."""
    return opts.z_loss * jnp.square(lse) if opts.z_loss else jnp.zeros_like(lse)


def _soft_setup(fn, q_in, logits_shape, dtype, rows, *, reduction, ignore_index,
                label_smoothing, z_loss, softcap, logit_scale, shift_seq_len, shift,
                use_token_scaling, return_z_loss, return_token_accuracy,
                return_predicted_tokens, return_lse, return_entropy, batch_invariant):
    """(q [rows, V] as a constant, CEOptions, Want, the per-row shape) of a call with
    class-probability targets, checked as fusedce.torch checks them, naming ``fn``."""
    vocab = logits_shape[-1]
    if tuple(q_in.shape) != tuple(logits_shape):
        raise ValueError(f"{fn}: targets of class probabilities must have the shape of the "
                         f"logits {tuple(logits_shape)}, got {tuple(q_in.shape)}")
    q = q_in.astype(_F32) if q_in.dtype == jnp.float64 else q_in
    if q.dtype != dtype:
        raise TypeError(f"{fn}: targets (class probabilities) have dtype {q.dtype} but the "
                        f"logits have {dtype}: they must match")
    refused = (("use_token_scaling", use_token_scaling),
               ("shift_seq_len / shift", bool(shift_seq_len) or bool(shift)),
               ("return_token_accuracy", return_token_accuracy))
    for name, on in refused:
        if on:
            raise ValueError(f"{fn}: {name} is not supported with class-probability targets "
                             "(there is no target class)")
    if ignore_index >= 0:  # torch's rule: every row is scored
        raise ValueError(f"{fn}: ignore_index ({ignore_index}) is not supported with "
                         "class-probability targets (every row is scored)")
    out_shape = tuple(logits_shape[:-1])
    opts = _ce_options(reduction, ignore_index, label_smoothing, z_loss, softcap, logit_scale,
                       0, 0, False, out_shape, rows, batch_invariant)
    want = Want(z_loss=bool(return_z_loss), accuracy=False,
                argmax=bool(return_predicted_tokens), lse=bool(return_lse),
                entropy=bool(return_entropy))
    return lax.stop_gradient(q.reshape(rows, vocab)), opts, want, out_shape


def linear_cross_entropy(hidden, weight, targets, bias=None, *, reduction: str = "mean",
                         ignore_index: int = -100, class_weights=None,
                         label_smoothing: float = 0.0, z_loss: float = 0.0,
                         softcap: float = 0.0, logit_scale: float = 1.0,
                         shift_seq_len: int = 0, shift: int = 0,
                         use_token_scaling: bool = False, return_z_loss: bool = False,
                         return_token_accuracy: bool = False,
                         return_predicted_tokens: bool = False, return_lse: bool = False,
                         return_entropy: bool = False, workspace_bytes: Optional[int] = None,
                         batch_invariant: bool = False):
    """``cross_entropy(hidden @ weight.T + bias, targets, ...)`` without ever holding the
    [N, V] logits (fce_linear_ce): hidden [..., D] (leading dimensions flattened into rows),
    weight [V, D] (a Dense(D -> V) kernel transposed, or a tied embedding table), bias [V] or
    None, targets [...] (the leading dimensions of hidden; or class probabilities [..., V], as
    for :func:`cross_entropy`). hidden, weight and bias must have one dtype (float32, float16
    or bfloat16; cast a float32 master copy to the compute dtype before the call: JAX's cast
    carries the gradient back). The other keywords and the return
    convention are :func:`cross_entropy`'s.

    Differentiable in hidden, weight and bias (only the ones being differentiated are
    computed). workspace_bytes: the CUDA workspace budget beyond the inputs and the gradients
    (None: FUSEDCE_WORKSPACE_BYTES, else 1 GiB): the custom call's workspace result (an XLA
    temporary under jit) is the library's fastest plan's size when that fits, else the budget,
    never below the library's minimum (a few MiB); the CPU backend gets the minimum. The loss is
    float32.
    """
    h = _float(hidden, "hidden")
    wt = _float(weight, "weight")
    b = _float(bias, "bias") if bias is not None else None
    if h.ndim < 1:
        raise ValueError("hidden must be [..., D]")
    d = h.shape[-1]
    if wt.ndim != 2 or wt.shape[1] != d:
        raise ValueError(f"weight must be [V, {d}], got {wt.shape}")
    vocab = wt.shape[0]
    if b is not None and b.shape != (vocab,):
        raise ValueError(f"bias must be [{vocab}], got {b.shape}")
    for name, arr in (("weight", wt), ("bias", b)):
        if arr is not None and arr.dtype != h.dtype:
            raise TypeError(f"{name} has dtype {arr.dtype} but hidden has {h.dtype}: cast them "
                            "to one compute dtype")
    rows = int(np.prod(h.shape[:-1], dtype=np.int64))
    h = h.reshape(rows, d)
    y_in = jnp.asarray(targets)
    budget = _default_workspace_bytes() if workspace_bytes is None else int(workspace_bytes)
    if budget < 0:
        raise ValueError(f"workspace_bytes must be >= 0, got {workspace_bytes}")
    if jnp.issubdtype(y_in.dtype, jnp.floating):
        return _soft_call(
            "fusedce.jax.linear_cross_entropy", y_in, tuple(jnp.shape(hidden))[:-1] + (vocab,),
            h.dtype, rows, class_weights,
            lambda q, cw, opts, lib_want: _linear(h, wt, b, q, cw, opts, lib_want, budget),
            reduction=reduction, ignore_index=ignore_index,
            label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
            logit_scale=logit_scale, shift_seq_len=shift_seq_len, shift=shift,
            use_token_scaling=use_token_scaling, return_z_loss=return_z_loss,
            return_token_accuracy=return_token_accuracy,
            return_predicted_tokens=return_predicted_tokens, return_lse=return_lse,
            return_entropy=return_entropy, batch_invariant=batch_invariant)
    y = _targets(y_in, "fusedce.jax.linear_cross_entropy")
    if y.shape[0] != rows:
        raise ValueError(f"targets has {y.shape[0]} elements for {rows} rows of hidden "
                         f"(hidden {tuple(jnp.shape(hidden))}, targets {tuple(y_in.shape)})")
    out_shape = tuple(y_in.shape)
    opts = _ce_options(reduction, ignore_index, label_smoothing, z_loss, softcap, logit_scale,
                       shift_seq_len, shift, use_token_scaling, out_shape, rows,
                       batch_invariant)
    want = Want(z_loss=bool(return_z_loss), accuracy=bool(return_token_accuracy),
                argmax=bool(return_predicted_tokens), lse=bool(return_lse),
                entropy=bool(return_entropy))
    if rows == 0:
        return _zero_rows_result(want, opts, out_shape)
    register()
    outs = _linear(h, wt, b, y, _class_weights(class_weights, vocab), opts,
                   want.from_library(opts.reduction), budget)

    def target_logit(yy):
        hh, ww = lax.stop_gradient(h), lax.stop_gradient(wt)
        a = jnp.sum(hh.astype(_F32) * ww[yy].astype(_F32), axis=-1)
        if b is not None:
            a = a + lax.stop_gradient(b)[yy].astype(_F32)
        return a

    return _finish(want, opts, out_shape, outs,
                   lambda lse: _z_loss_rows(lse, y, vocab, opts, target_logit))


# ------------------------------------------------------------------- distillation ----
def _distill_options(reduction, divergence, beta, temperature, ignore_index, softcap,
                     logit_scale, fn: str) -> DistillOptions:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{fn}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    try:
        return DistillOptions.from_keywords(
            reduction=_REDUCTIONS[reduction], divergence=divergence_code(divergence), beta=beta,
            temperature=temperature, ignore_index=ignore_index, softcap=softcap,
            logit_scale=logit_scale)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{fn}: {e}") from None


def _distill_targets(targets, lead: tuple, fn: str) -> jax.Array:
    """Class indices [N] (only ignore_index is read: those rows are not counted), or an empty
    int32 array for None (every row counts)."""
    if targets is None:
        return jnp.zeros((0,), jnp.int32)
    y = jnp.asarray(targets)
    if not jnp.issubdtype(y.dtype, jnp.integer):
        raise TypeError(f"{fn}: targets must hold integers (rows equal to ignore_index are not "
                        f"counted), got {y.dtype}")
    if tuple(y.shape) != lead:
        raise ValueError(f"{fn}: targets must have the shape {lead} (the student's leading "
                         f"dimensions), got {tuple(y.shape)}")
    if y.dtype not in (jnp.int32, jnp.int64):
        y = y.astype(jnp.int32)
    return lax.stop_gradient(y.reshape(-1))


def _distill_float(x, fn: str, name: str) -> jax.Array:
    x = jnp.asarray(x)
    if x.dtype == jnp.float64:
        return x.astype(_F32)  # computed in float32, as cross_entropy
    if x.dtype not in (jnp.float32, jnp.float16, jnp.bfloat16):
        raise TypeError(f"{fn}: {name} must be float32, float16 or bfloat16, got {x.dtype}")
    return x


def distill(student_logits, teacher_logits, targets=None, *, divergence: str = "forward_kl",
            beta: float = 0.5, temperature: float = 1.0, reduction: str = "mean",
            ignore_index: int = -100, softcap: float = 0.0, logit_scale: float = 1.0):
    """The divergence between the student's and the teacher's softmax per row (fce_distill,
    as :func:`fusedce.torch.distill`), differentiable in ``student_logits`` only. With the
    student's logits a and the teacher's t both put through ``logit_scale`` and ``softcap``
    and divided by the temperature T: p = softmax(a / T), q = softmax(t / T);

    divergence  'forward_kl': KL(q || p); 'reverse_kl': KL(p || q); 'jsd': Liger's generalised
                JSD(beta), m = beta q + (1 - beta) p: beta KL(q || m) + (1 - beta) KL(p || m)
                for 0 < beta < 1, KL(q || p) at beta 0, KL(p || q) at beta 1. No T^2 factor.
    targets     [...] (the leading dimensions) integers, or None: rows equal to
                ``ignore_index`` are not counted (loss 0, zero gradient); None counts every row.
    reduction   'mean' (over the counted rows; 0 with a zero gradient when none counts),
                'sum' or 'none' (the leading shape).

    student_logits [..., V]; teacher_logits of the same shape (cast to the student's dtype, a
    constant). ``beta`` (in [0, 1]) and ``temperature`` (> 0) are checked by the library when
    the call is traced. The loss is float32."""
    fn = "fusedce.jax.distill"
    z = _distill_float(student_logits, fn, "student_logits")
    t = _distill_float(teacher_logits, fn, "teacher_logits")
    if z.ndim < 1:
        raise ValueError(f"{fn}: student_logits must be [..., V], got a scalar")
    if t.shape != z.shape:
        raise ValueError(f"{fn}: teacher_logits must have the shape of student_logits "
                         f"{tuple(z.shape)}, got {tuple(t.shape)}")
    lead, vocab = tuple(z.shape[:-1]), z.shape[-1]
    if vocab < 1:
        raise ValueError(f"{fn}: student_logits must have at least one class")
    opts = _distill_options(reduction, divergence, beta, temperature, ignore_index, softcap,
                            logit_scale, fn)
    y = _distill_targets(targets, lead, fn)
    rows = int(np.prod(lead, dtype=np.int64))
    if rows == 0:  # the library's empty problem: 0, and a constant's zero gradient
        return jnp.zeros(lead if opts.per_row else (), _F32)
    check_ready(fn)
    t = lax.stop_gradient(t.astype(z.dtype)).reshape(rows, vocab)
    loss = _distill(z.reshape(rows, vocab), t, y, opts)
    return loss.reshape(lead) if opts.per_row else loss


def linear_distill(hidden, weight, teacher_hidden, teacher_weight, targets=None, *,
                   divergence: str = "forward_kl", beta: float = 0.5, temperature: float = 1.0,
                   reduction: str = "mean", ignore_index: int = -100, softcap: float = 0.0,
                   logit_scale: float = 1.0, workspace_bytes: Optional[int] = None):
    """:func:`distill` of ``hidden @ weight.T`` (the student's head) against ``teacher_hidden
    @ teacher_weight.T`` (the teacher's) without either [N, V] logits ever held whole
    (fce_linear_distill: token chunks), as :func:`fusedce.torch.linear_distill`;
    differentiable in hidden and weight (only those being differentiated are computed).

    hidden [..., D] and weight [V, D] (no bias) of one dtype; teacher_hidden [..., D'] (the
    same leading dimensions) and teacher_weight [V, D'] (the same vocabulary), cast to the
    student's dtype (constants). ``workspace_bytes``: the CUDA workspace budget (None:
    FUSEDCE_WORKSPACE_BYTES, else 1 GiB), never below the library's minimum; where that is below
    the token-chunk plan's, a 16-bit grad_weight is accumulated in float32 and rounded once (as
    fusedce.torch); the CPU backend gets the minimum. The loss is float32."""
    fn = "fusedce.jax.linear_distill"
    h = _distill_float(hidden, fn, "hidden")
    wt = _distill_float(weight, fn, "weight")
    th = _distill_float(teacher_hidden, fn, "teacher_hidden")
    tw = _distill_float(teacher_weight, fn, "teacher_weight")
    if h.ndim < 1:
        raise ValueError(f"{fn}: hidden must be [..., D], got a scalar")
    d = h.shape[-1]
    if wt.ndim != 2 or wt.shape[1] != d:
        raise ValueError(f"{fn}: weight must be [V, {d}], got {tuple(wt.shape)}")
    if wt.dtype != h.dtype:
        raise TypeError(f"{fn}: weight has dtype {wt.dtype} but hidden has {h.dtype}: cast "
                        "them to one compute dtype")
    vocab = wt.shape[0]
    lead = tuple(h.shape[:-1])
    if th.ndim < 1 or tuple(th.shape[:-1]) != lead:
        raise ValueError(f"{fn}: teacher_hidden must be [{', '.join(map(str, lead))}, D'] (the "
                         f"leading dimensions of hidden), got {tuple(th.shape)}")
    td = th.shape[-1]
    if tw.ndim != 2 or tuple(tw.shape) != (vocab, td):
        raise ValueError(f"{fn}: teacher_weight must be [{vocab}, {td}] (the student's "
                         f"vocabulary, the teacher's hidden size), got {tuple(tw.shape)}")
    budget = _default_workspace_bytes() if workspace_bytes is None else int(workspace_bytes)
    if budget < 0:
        raise ValueError(f"{fn}: workspace_bytes must be >= 0, got {workspace_bytes}")
    opts = _distill_options(reduction, divergence, beta, temperature, ignore_index, softcap,
                            logit_scale, fn)
    y = _distill_targets(targets, lead, fn)
    rows = int(np.prod(lead, dtype=np.int64))
    if rows == 0:
        return jnp.zeros(lead if opts.per_row else (), _F32)
    check_ready(fn)
    sg = lax.stop_gradient
    loss = _linear_distill(h.reshape(rows, d), wt, sg(th.astype(h.dtype)).reshape(rows, td),
                           sg(tw.astype(h.dtype)), y, opts, budget)
    return loss.reshape(lead) if opts.per_row else loss


# --------------------------------------------------------------------- command line ----
def _main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fusedce.jax",
                                description="Build or inspect libfusedce_jax.so, the XLA FFI "
                                            "shim of fusedce.jax.")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile the shim (into the cache, or --output DIR)")
    b.add_argument("--output", help="folder to write libfusedce_jax.so to (default: the cache)")
    b.add_argument("--force", action="store_true", help="rebuild even if cached")
    sub.add_parser("info", help="say which shim and library are used, and register them")
    args = p.parse_args(argv)
    if args.cmd == "build":
        path = _shim_build.build(args.output, force=args.force, verbose=True)
        print(path)
        return 0
    import jaxlib
    print("jax %s, jaxlib %s, devices: %s" % (jax.__version__, jaxlib.__version__,
                                              ", ".join(str(d) for d in jax.devices())))
    print("libfusedce: %s (%s)" % (_lib.library_path(), _lib.library_origin()))
    print("shim: %s" % register())
    return 0


if __name__ == "__main__":
    sys.exit(_main())
