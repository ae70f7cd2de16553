"""The torch ops of fusedce.torch: ``torch.library.custom_op`` operators (with ``register_fake``
and ``register_autograd``, what ``torch.compile`` traces) and the plain ``torch.autograd.Function``
s eager mode runs, over the direct C calls of :mod:`fusedce.torch._calls`. How the gradient is
computed on each path: the docstring of :mod:`fusedce.torch`. The public functions and modules
are in fusedce/torch/__init__.py, argument handling and the return convention in _args.py.

The options travel as one :class:`fusedce._options.CEOptions` and the outputs asked for as one
:class:`fusedce._options.Want`; a custom op takes them flattened (``*opts.as_op_args()``,
``want.as_op_arg()``) and rebuilds them (``CEOptions.from_op_args``, ``Want.from_op_arg``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .._lib import FCE_REDUCTION_NONE
from .._options import N_OP_ARGS, NOTHING, CEOptions, Want
from . import _calls as _tc

if not hasattr(torch, "library") or not hasattr(torch.library, "custom_op"):
    raise ImportError(f"fusedce.torch needs torch >= 2.4 (torch.library.custom_op); this is "
                      f"torch {torch.__version__}")


def _cw(class_weights: Optional[Tensor]) -> Optional[Tensor]:
    if class_weights is None:
        return None
    return _f32(class_weights)


def _f32(t: Tensor) -> Tensor:
    """t as a dense float32 tensor (itself when it is one: no call, no copy)."""
    if t.dtype == torch.float32 and t.is_contiguous():
        return t
    return t.to(torch.float32).contiguous()


# ============================================================ cross_entropy ops ====
# Every op below takes the options as the scalars of CEOptions.as_op_args (ignore_index ...
# token_scaling, batch_invariant, in that order) and the outputs asked of the library as
# ``want``, an int (Want.as_op_arg); an op returns an empty [0] tensor for an output not asked for.
def _or_empty(t: Optional[Tensor], like: Tensor, dtype=torch.float32) -> Tensor:
    return t if t is not None else like.new_empty((0,), dtype=dtype)


def _fake_extras(like: Tensor, n, reduction: int, want: Want):
    """The (z_loss, accuracy, argmax) outputs of an op, as fake tensors."""
    z = like.new_empty(() if want.z_loss else (0,), dtype=torch.float32)
    acc_shape = ((n,) if reduction == FCE_REDUCTION_NONE else ()) if want.accuracy else (0,)
    acc = like.new_empty(acc_shape, dtype=torch.float32)
    am = like.new_empty((n,) if want.argmax else (0,), dtype=torch.int64)
    return z, acc, am


def _fake_entropy(like: Tensor, n, want: Want) -> Tensor:
    return like.new_empty((n,) if want.entropy else (0,), dtype=torch.float32)


def _present(grad: Optional[Tensor]) -> Optional[Tensor]:
    """The upstream gradient of an op's lse or entropy output: None where none flows (or the
    output is an empty [0] placeholder, not asked for)."""
    return None if grad is None or grad.numel() == 0 else grad


# ---- the training path for 'mean' / 'sum': loss and gradient in ONE pass over the logits
@torch.library.custom_op("fusedce::ce_forward_grad", mutates_args=())
def _ce_forward_grad(logits: Tensor, targets: Tensor, class_weights: Optional[Tensor],
                     ignore_index: int, reduction: int, label_smoothing: float, z_loss: float,
                     softcap: float, logit_scale: float, shift_seq_len: int, shift: int,
                     token_scaling: bool, batch_invariant: bool, want: int, check_targets: bool
                     ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, lse, dloss/dlogits for an upstream gradient of 1, z_loss, accuracy, argmax,
    entropy): one read, one write."""
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    loss, lse, zl, acc, am, ent = _tc.ce_forward(
        logits, targets, _cw(class_weights),
        CEOptions.from_op_args(ignore_index, reduction, label_smoothing, z_loss, softcap,
                               logit_scale, shift_seq_len, shift, token_scaling, batch_invariant),
        grad=grad, want=Want.from_op_arg(want), check_targets=check_targets)
    return (loss, lse, grad, _or_empty(zl, logits), _or_empty(acc, logits),
            _or_empty(am, logits, torch.int64), _or_empty(ent, logits))


@_ce_forward_grad.register_fake
def _ce_forward_grad_fake(logits, targets, class_weights, ignore_index, reduction,
                          label_smoothing, z_loss, softcap, logit_scale, shift_seq_len, shift,
                          token_scaling, batch_invariant, want, check_targets):
    n = logits.shape[0]
    w = Want.from_op_arg(want)
    return (logits.new_empty((), dtype=torch.float32),
            logits.new_empty((n,), dtype=torch.float32),
            logits.new_empty(logits.shape)) + _fake_extras(logits, n, reduction, w) + (
                _fake_entropy(logits, n, w),)


@torch.library.custom_op("fusedce::ce_rescale_", mutates_args=("grad",))
def _ce_rescale_(grad: Tensor, grad_loss: Tensor, logits: Tensor, targets: Tensor, lse: Tensor,
                 class_weights: Optional[Tensor], ignore_index: int, reduction: int,
                 label_smoothing: float, z_loss: float, softcap: float, logit_scale: float,
                 shift_seq_len: int, shift: int, token_scaling: bool,
                 batch_invariant: bool) -> None:
    """fce_backward_rescale: grad (the forward's, for an upstream 1) becomes the gradient for
    grad_loss, rounded once: nothing when it is 1, an exact in-place scale for ±2^k, else
    computed again from the logits; decided on the device."""
    _tc.ce_backward(logits, targets, lse, _f32(grad_loss), _cw(class_weights),
                    CEOptions.from_op_args(ignore_index, reduction, label_smoothing, z_loss,
                                           softcap, logit_scale, shift_seq_len, shift,
                                           token_scaling, batch_invariant), rescale=grad)


@_ce_rescale_.register_fake
def _ce_rescale_fake(grad, grad_loss, logits, targets, lse, class_weights, ignore_index,
                     reduction, label_smoothing, z_loss, softcap, logit_scale, shift_seq_len,
                     shift, token_scaling, batch_invariant):
    return None


@torch.library.custom_op("fusedce::scale_", mutates_args=("grad",))
def _scale_(grad: Tensor, grad_output: Tensor) -> None:
    """grad *= grad_output (a scalar) in place on the device; a no-op launch when it is 1."""
    _tc.scale_(grad, grad_output)


@_scale_.register_fake
def _scale_fake(grad, grad_output):
    return None


def _hand_out_once(ctx) -> None:
    """A gradient written over the logits (inplace_backward) is scaled in place and handed to
    autograd, which may keep that very buffer: a second backward through the same graph
    (retain_graph=True) cannot use it again, so it raises with what to do instead."""
    if getattr(ctx, "handed_out", False):
        raise RuntimeError(
            "fusedce.torch.cross_entropy(inplace_backward=True): the gradient was written over "
            "the logits in the forward pass and handed to autograd once; a second backward "
            "through the same graph (retain_graph=True, gradcheck) needs inplace_backward=False.")
    ctx.handed_out = True


_CE_FORWARD_GRAD_INPUTS = 3 + N_OP_ARGS + 2


def _ce_forward_grad_setup(ctx, inputs, output):
    logits, targets, class_weights = inputs[:3]
    _, lse, grad, zl, acc, am, _ = output
    ctx.mark_non_differentiable(grad, zl, acc, am)  # (the loss, lse and entropy are)
    ctx.set_materialize_grads(False)  # else autograd makes a zero [N, V] "gradient" for grad
    # the logits are kept (a reference: they are the caller's input) so that an upstream
    # gradient other than 1 or ±2^k, or a second backward, can recompute exactly
    ctx.save_for_backward(logits, targets, class_weights, lse)
    ctx.grad = grad  # not version-tracked: the first backward rescales it in place
    ctx.options = CEOptions.from_op_args(*inputs[3:3 + N_OP_ARGS])


def _ce_forward_grad_backward(ctx, grad_loss, grad_lse, _grad, _zl, _acc, _am, grad_entropy):
    nones = (None,) * (_CE_FORWARD_GRAD_INPUTS - 1)
    grad_lse, grad_entropy = _present(grad_lse), _present(grad_entropy)
    extra = grad_lse is not None or grad_entropy is not None
    if not ctx.needs_input_grad[0] or (grad_loss is None and not extra):
        return (None,) + nones  # (undefined: no gradient flows)
    logits, targets, class_weights, lse = ctx.saved_tensors
    grad = ctx.grad
    if extra:  # every gradient in one call (the forward's is not used)
        ctx.grad = None
        grad = _ce_grad(grad_loss, grad_lse, grad_entropy, logits, targets, lse, class_weights,
                        *ctx.options.as_op_args())
    elif grad is not None:  # the first backward: the forward's gradient, made the right one
        ctx.grad = None
        _ce_rescale_(grad, grad_loss, logits, targets, lse, class_weights,
                     *ctx.options.as_op_args())
    else:  # handed out already (retain_graph): computed again
        grad = _ce_backward(grad_loss, logits, targets, lse, class_weights,
                            *ctx.options.as_op_args())
    return (grad,) + nones


_ce_forward_grad.register_autograd(_ce_forward_grad_backward, setup_context=_ce_forward_grad_setup)


def _non_differentiable(ctx, *tensors) -> None:
    ctx.mark_non_differentiable(*(t for t in tensors if t is not None))


def _outputs(ctx, loss, lse, zl, acc, am, ent) -> tuple:
    """A Function's (loss, lse, z_loss, accuracy, argmax, entropy), None where not asked for:
    the loss, lse and the entropy differentiable, the other three not, and no zero gradients
    made for the outputs that get none (None in the backward: the loss's fast path)."""
    ctx.set_materialize_grads(False)
    _non_differentiable(ctx, zl, acc, am)
    return loss, lse, zl, acc, am, ent


def _grad_logits(ctx, grad_loss, grad_lse, grad_entropy, out=None):
    """The gradient of the logits for the upstream gradients of the loss, lse and the entropy
    (any of them None), from the saved logits, in one C call (_calls.ce_grad)."""
    logits, targets, cw, lse = ctx.saved_tensors
    return _tc.ce_grad(logits, targets, lse, cw, ctx.opts, grad_loss, grad_lse, grad_entropy,
                       out=out)


class _CrossEntropyOnePass(torch.autograd.Function):
    """The same one-pass training path as fusedce::ce_forward_grad + ce_rescale_, as a plain
    autograd.Function calling the C library directly: what eager mode runs (the custom ops'
    dispatch costs tens of µs a call; torch.compile traces the custom ops instead).
    Returns the loss alone when neither an extra nor lse is asked for (the common case: every
    output of a Function costs host time), else (loss, lse or None, z_loss, accuracy, argmax,
    entropy), None for the extras not asked for. When lse or the entropy gets a gradient the
    backward computes the whole gradient again in one call (_calls.ce_grad) into the
    forward's buffer. lse, unless returned, is kept for the backward in one
    buffer with the workspace of both calls (_calls.ce_forward's lse_workspace). ``want``: what
    the library writes (Want.from_library), lse included."""

    @staticmethod
    def forward(ctx, logits, targets, class_weights, opts, want, check_targets):
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        cw = _cw(class_weights)
        # lse returned: its own tensor; else kept with the workspace (lse_workspace)
        ctx.lse_workspace = not want.lse
        loss, lse, zl, acc, am, ent = _tc.ce_forward(logits, targets, cw, opts, grad=grad,
                                                     want=want, check_targets=check_targets,
                                                     lse_workspace=ctx.lse_workspace)
        ctx.save_for_backward(logits, targets, cw, lse)
        ctx.grad, ctx.opts = grad, opts
        if not want:
            ctx.set_materialize_grads(False)
            return loss
        return _outputs(ctx, loss, lse if want.lse else None, zl, acc, am, ent)

    @staticmethod
    def backward(ctx, grad_loss, grad_lse=None, _zl=None, _acc=None, _am=None,
                 grad_entropy=None):
        if grad_lse is not None or grad_entropy is not None:
            grad, ctx.grad = ctx.grad, None  # its buffer reused
            return (_grad_logits(ctx, grad_loss, grad_lse, grad_entropy, grad),) + (None,) * 5
        if grad_loss is None:
            return (None,) * 6
        logits, targets, cw, lse = ctx.saved_tensors
        up = _f32(grad_loss)
        if ctx.grad is not None:  # the first backward: fce_backward_rescale, in place
            grad, ctx.grad = ctx.grad, None
            _tc.ce_backward(logits, targets, lse, up, cw, ctx.opts, rescale=grad,
                            lse_workspace=ctx.lse_workspace)
        else:  # a second backward through the graph: computed again
            grad = _tc.ce_backward(logits, targets, lse, up, cw, ctx.opts)
        return (grad,) + (None,) * 5


class _CrossEntropySavedLse(torch.autograd.Function):
    """Reduction 'none' with a gradient, in eager mode: the forward saves lse, the backward calls
    fce_backward with the per-row upstream gradient (fusedce::ce_forward + ce_backward as a plain
    autograd.Function: the custom ops' dispatch costs host time; torch.compile traces those).
    Returns (loss, lse, z_loss, accuracy, argmax, entropy), None for the extras not asked
    for; gradients of lse and the entropy join the loss's in the same call (_calls.ce_grad)."""

    @staticmethod
    def forward(ctx, logits, targets, class_weights, opts, want, check_targets):
        cw = _cw(class_weights)
        loss, lse, zl, acc, am, ent = _tc.ce_forward(logits, targets, cw, opts, want=want,
                                                     check_targets=check_targets)
        ctx.save_for_backward(logits, targets, cw, lse)
        ctx.opts = opts
        return _outputs(ctx, loss, lse, zl, acc, am, ent)

    @staticmethod
    def backward(ctx, grad_loss, grad_lse, _zl, _acc, _am, grad_entropy):
        if not ctx.needs_input_grad[0] or (
                grad_loss is None and grad_lse is None and grad_entropy is None):
            return (None,) * 6
        return (_grad_logits(ctx, grad_loss, grad_lse, grad_entropy),) + (None,) * 5


_IS_COMPILING = getattr(getattr(torch, "compiler", None), "is_compiling", None)


def _compiling() -> bool:
    return bool(_IS_COMPILING()) if _IS_COMPILING is not None else False


class _CrossEntropyInPlace(torch.autograd.Function):
    """inplace_backward=True: the one pass writes the gradient over the logits themselves (a
    plain autograd.Function, as Liger's and Quack's: torch.compile breaks the graph here).
    Returns (loss, lse or None, z_loss, accuracy, argmax, entropy); a gradient reaching lse or
    the entropy raises (the logits it needs were overwritten)."""

    @staticmethod
    def forward(ctx, logits, targets, class_weights, opts, want, check_targets):
        loss, lse, zl, acc, am, ent = _tc.ce_forward(logits, targets, _cw(class_weights), opts,
                                                     grad=logits, want_lse=want.lse, want=want,
                                                     check_targets=check_targets)
        ctx.save_for_backward(logits)
        return _outputs(ctx, loss, lse, zl, acc, am, ent)

    @staticmethod
    def backward(ctx, grad_loss, grad_lse, _zl, _acc, _am, grad_entropy):
        if grad_lse is not None or grad_entropy is not None:
            raise RuntimeError(
                "fusedce.torch.cross_entropy(inplace_backward=True): the gradient of lse or the "
                "entropy needs the logits, which the forward overwrote; use "
                "inplace_backward=False (or detach lse / the entropy)")
        if grad_loss is None:
            return (None,) * 6
        _hand_out_once(ctx)
        (grad,) = ctx.saved_tensors
        _scale_(grad, grad_loss)
        return (grad,) + (None,) * 5


# ---- reduction 'none' (and no gradient needed): the loss, lse saved, fce_backward later
@torch.library.custom_op("fusedce::ce_forward", mutates_args=())
def _ce_forward(logits: Tensor, targets: Tensor, class_weights: Optional[Tensor],
                ignore_index: int, reduction: int, label_smoothing: float, z_loss: float,
                softcap: float, logit_scale: float, shift_seq_len: int, shift: int,
                token_scaling: bool, batch_invariant: bool, want: int, check_targets: bool
                ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, lse, z_loss, accuracy, argmax, entropy)."""
    loss, lse, zl, acc, am, ent = _tc.ce_forward(
        logits, targets, _cw(class_weights),
        CEOptions.from_op_args(ignore_index, reduction, label_smoothing, z_loss, softcap,
                               logit_scale, shift_seq_len, shift, token_scaling, batch_invariant),
        want=Want.from_op_arg(want), check_targets=check_targets)
    return (loss, lse, _or_empty(zl, logits), _or_empty(acc, logits),
            _or_empty(am, logits, torch.int64), _or_empty(ent, logits))


@_ce_forward.register_fake
def _ce_forward_fake(logits, targets, class_weights, ignore_index, reduction, label_smoothing,
                     z_loss, softcap, logit_scale, shift_seq_len, shift, token_scaling,
                     batch_invariant, want,
                     check_targets):
    n = logits.shape[0]
    w = Want.from_op_arg(want)
    loss = logits.new_empty((n,) if reduction == FCE_REDUCTION_NONE else (), dtype=torch.float32)
    return (loss, logits.new_empty((n,), dtype=torch.float32)) + _fake_extras(
        logits, n, reduction, w) + (_fake_entropy(logits, n, w),)


@torch.library.custom_op("fusedce::ce_backward", mutates_args=())
def _ce_backward(grad_loss: Tensor, logits: Tensor, targets: Tensor, lse: Tensor,
                 class_weights: Optional[Tensor], ignore_index: int, reduction: int,
                 label_smoothing: float, z_loss: float, softcap: float, logit_scale: float,
                 shift_seq_len: int, shift: int, token_scaling: bool,
                 batch_invariant: bool) -> Tensor:
    return _tc.ce_backward(logits, targets, lse, _f32(grad_loss), _cw(class_weights),
                           CEOptions.from_op_args(ignore_index, reduction, label_smoothing,
                                                  z_loss, softcap, logit_scale, shift_seq_len,
                                                  shift, token_scaling, batch_invariant))


@_ce_backward.register_fake
def _ce_backward_fake(grad_loss, logits, targets, lse, class_weights, ignore_index, reduction,
                      label_smoothing, z_loss, softcap, logit_scale, shift_seq_len, shift,
                      token_scaling, batch_invariant):
    return logits.new_empty(logits.shape)  # dense [N, V] whatever the logits' row stride


@torch.library.custom_op("fusedce::ce_grad", mutates_args=())
def _ce_grad(grad_loss: Optional[Tensor], grad_lse: Optional[Tensor],
             grad_entropy: Optional[Tensor], logits: Tensor, targets: Tensor, lse: Tensor,
             class_weights: Optional[Tensor], ignore_index: int, reduction: int,
             label_smoothing: float, z_loss: float, softcap: float, logit_scale: float,
             shift_seq_len: int, shift: int, token_scaling: bool, batch_invariant: bool) -> Tensor:
    """The gradient of the loss, lse and the entropy together (any upstream gradient None), in
    one C call: _calls.ce_grad."""
    return _tc.ce_grad(logits, targets, lse, _cw(class_weights),
                       CEOptions.from_op_args(ignore_index, reduction, label_smoothing, z_loss,
                                              softcap, logit_scale, shift_seq_len, shift,
                                              token_scaling, batch_invariant),
                       grad_loss, grad_lse, grad_entropy)


@_ce_grad.register_fake
def _ce_grad_fake(grad_loss, grad_lse, grad_entropy, logits, *_args):
    return logits.new_empty(logits.shape)


def _ce_setup_context(ctx, inputs, output):
    logits, targets, class_weights = inputs[:3]
    _, lse, zl, acc, am, _ = output
    ctx.save_for_backward(logits, targets, class_weights, lse)
    ctx.options = CEOptions.from_op_args(*inputs[3:3 + N_OP_ARGS])
    ctx.mark_non_differentiable(zl, acc, am)  # (the loss, lse and entropy are differentiable)
    ctx.set_materialize_grads(False)


def _ce_autograd_backward(ctx, grad_loss, grad_lse, _zl, _acc, _am, grad_entropy):
    nones = (None,) * (_CE_FORWARD_GRAD_INPUTS - 1)
    grad_lse, grad_entropy = _present(grad_lse), _present(grad_entropy)
    extra = grad_lse is not None or grad_entropy is not None
    if not ctx.needs_input_grad[0] or (grad_loss is None and not extra):
        return (None,) + nones
    logits, targets, class_weights, lse = ctx.saved_tensors
    if extra:
        grad_logits = _ce_grad(grad_loss, grad_lse, grad_entropy, logits, targets, lse,
                               class_weights, *ctx.options.as_op_args())
    else:
        grad_logits = _ce_backward(grad_loss, logits, targets, lse, class_weights,
                                   *ctx.options.as_op_args())
    return (grad_logits,) + nones


_ce_forward.register_autograd(_ce_autograd_backward, setup_context=_ce_setup_context)


# ========================================================= linear_ce op (fused) ====
@torch.library.custom_op("fusedce::linear_ce", mutates_args=())
def _linear_ce(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor,
               class_weights: Optional[Tensor], grad_output: Optional[Tensor],
               grad_lse: Optional[Tensor], grad_entropy: Optional[Tensor],
               ignore_index: int, reduction: int, label_smoothing: float, z_loss: float,
               softcap: float, logit_scale: float, shift_seq_len: int, shift: int,
               token_scaling: bool, batch_invariant: bool, compute_dtype: int,
               workspace_bytes: int, need_hidden: bool,
               need_weight: bool, need_bias: bool, want: int, check_targets: bool
               ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                          Tensor]:
    """loss, lse, the gradients asked for (empty [0] tensors for the others), scaled by
    grad_output (None = 1) and including those of lse and the entropy for grad_lse /
    grad_entropy ([N] each, None = 0), the extras asked for (z_loss, accuracy, argmax; empty
    [0] for the others) and the entropy ([N], or empty [0] when not asked for). Inputs are cast to compute_dtype (an fce_dtype code) inside; the workspace is
    at most workspace_bytes (never below the library's minimum)."""
    cdt = _tc.TORCH_OF_CODE[compute_dtype]
    h = hidden.to(cdt)
    if h.stride(-1) != 1:
        h = h.contiguous()
    w = weight.to(cdt).contiguous()
    b = bias.to(cdt).contiguous() if bias is not None else None
    # A float32 weight computed in a lower precision gets its gradient in float32 directly: the
    # caller's own float32 buffer is then the library's accumulator (no extra memory). A 16-bit
    # weight gets a 16-bit gradient, never a float32 copy of it.
    fp32_grads = weight.dtype == torch.float32 and cdt != torch.float32
    g = _f32(grad_output) if grad_output is not None else None
    loss, lse, gh, gw, gb, zl, acc, am, ent = _tc.linear_ce(
        h, w, b, targets.contiguous(), _cw(class_weights), g,
        CEOptions.from_op_args(ignore_index, reduction, label_smoothing, z_loss, softcap,
                               logit_scale, shift_seq_len, shift, token_scaling, batch_invariant),
        grad_weight_fp32=fp32_grads, need=(need_hidden, need_weight, need_bias),
        workspace_bytes=int(workspace_bytes), want=Want.from_op_arg(want),
        check_targets=check_targets,
        grad_lse=_f32(grad_lse) if grad_lse is not None else None,
        grad_entropy=_f32(grad_entropy) if grad_entropy is not None else None)
    empty = hidden.new_empty((0,))
    gh = gh.to(hidden.dtype) if gh is not None else empty
    gw = gw.to(weight.dtype) if gw is not None else weight.new_empty((0,))
    gb = gb.to(weight.dtype) if gb is not None else weight.new_empty((0,))
    return (loss, lse, gh, gw, gb, _or_empty(zl, hidden), _or_empty(acc, hidden),
            _or_empty(am, hidden, torch.int64), _or_empty(ent, hidden))


@_linear_ce.register_fake
def _linear_ce_fake(hidden, weight, bias, targets, class_weights, grad_output, grad_lse,
                    grad_entropy, ignore_index, reduction, label_smoothing, z_loss, softcap, logit_scale, shift_seq_len,
                    shift, token_scaling, batch_invariant, compute_dtype, workspace_bytes,
                    need_hidden,
                    need_weight, need_bias, want, check_targets):
    n = hidden.shape[0]
    loss = hidden.new_empty((n,) if reduction == FCE_REDUCTION_NONE else (), dtype=torch.float32)
    lse = hidden.new_empty((n,), dtype=torch.float32)
    gh = hidden.new_empty(hidden.shape) if need_hidden else hidden.new_empty((0,))
    gw = weight.new_empty(weight.shape) if need_weight else weight.new_empty((0,))
    gb = (bias.new_empty(bias.shape, dtype=weight.dtype) if (need_bias and bias is not None)
          else weight.new_empty((0,)))
    w = Want.from_op_arg(want)
    return (loss, lse, gh, gw, gb) + _fake_extras(hidden, n, reduction, w) + (
        _fake_entropy(hidden, n, w),)


_LINEAR_CE_INPUTS = 8 + N_OP_ARGS + 7


def _linear_ce_setup_context(ctx, inputs, output):
    hidden, weight, bias, targets, class_weights, grad_output = inputs[:6]
    opts = CEOptions.from_op_args(*inputs[8:8 + N_OP_ARGS])
    (compute_dtype, workspace_bytes, need_hidden, need_weight, need_bias, _want,
     _check_targets) = inputs[8 + N_OP_ARGS:]
    _, lse, gh, gw, gb, zl, acc, am, _ = output
    ctx.mark_non_differentiable(gh, gw, gb, zl, acc, am)  # (loss, lse, entropy are)
    # no zero "gradients" for the outputs autograd does not differentiate (they would be as
    # large as the gradients themselves)
    ctx.set_materialize_grads(False)
    # Gradients computed in the forward with an upstream gradient of 1 are scaled in place by
    # the scalar upstream gradient later; otherwise (reduction 'none', or the op called with a
    # grad_output) the backward recomputes them with the real upstream gradient.
    ctx.grad_in_forward = (bool(need_hidden or need_weight or need_bias)
                           and not opts.per_row and grad_output is None)
    ctx.computed = (bool(need_hidden), bool(need_weight), bool(need_bias and bias is not None))
    ctx.has_bias = bias is not None
    ctx.options, ctx.compute_dtype, ctx.workspace_bytes = opts, compute_dtype, workspace_bytes
    # The inputs are kept (they are alive anyway: the weight is a parameter, hidden [N, D] is
    # small) so that a second backward through the same graph can recompute the gradients.
    # The gradients are kept as tensors without version tracking (the backward scales them in
    # place and hands them out).
    ctx.grads = (gh, gw, gb)
    ctx.save_for_backward(hidden, weight, bias, targets, class_weights)


def _linear_ce_autograd_backward(ctx, grad_loss, grad_lse, _gh, _gw, _gb, _zl, _acc, _am,
                                 grad_entropy):
    nones = (None,) * (_LINEAR_CE_INPUTS - 3)
    grad_lse, grad_entropy = _present(grad_lse), _present(grad_entropy)
    extra = grad_lse is not None or grad_entropy is not None
    need = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]),
            bool(ctx.needs_input_grad[2]) and ctx.has_bias)
    if (grad_loss is None and not extra) or not any(need):
        return (None,) * 3 + nones
    hidden, weight, bias, targets, class_weights = ctx.saved_tensors
    computed = ctx.grads is not None
    if (ctx.grad_in_forward and computed and not extra and
            all(c or not n for c, n in zip(ctx.computed, need))):
        # the first backward: scale the forward's gradients in place (free for an upstream 1)
        out = [g if n else None for g, n in zip(ctx.grads, need)]
        for g in out:
            if g is not None:
                _scale_(g, grad_loss)
        ctx.grads = None  # handed out: a later backward recomputes
    else:  # recompute with the real upstream gradients (per row for reduction 'none'; those
        # of lse and the entropy with the loss's, in the same call)
        if grad_loss is None:
            grad_loss = _tc.upstream(None, hidden.shape[0], ctx.options, hidden)
        gh, gw, gb = _linear_ce(
            hidden, weight, bias, targets, class_weights, grad_loss, grad_lse, grad_entropy,
            *ctx.options.as_op_args(), ctx.compute_dtype, ctx.workspace_bytes, *need,
            NOTHING.as_op_arg(), False)[2:5]
        out = [g if n else None for g, n in zip((gh, gw, gb), need)]
    return tuple(out) + nones


_linear_ce.register_autograd(_linear_ce_autograd_backward, setup_context=_linear_ce_setup_context)
