"""fusedce.torch: fused cross-entropy for torch, with autograd and torch.compile support.

    from fusedce.torch import cross_entropy, linear_cross_entropy
    loss = cross_entropy(logits, targets)                        # like F.cross_entropy
    loss = linear_cross_entropy(hidden, lm_head.weight, targets)  # logits piece by piece, ≤ 1 GiB

CUDA tensors run on the CUDA backend on ``torch.cuda.current_stream()`` of their device; CPU
tensors run on the CPU backend. The losses are float32 whatever the input dtype (torch's
autocast also computes cross-entropy in float32).

How the gradient is computed (the training path):

* :func:`cross_entropy`, reduction 'mean' or 'sum', gradient needed: ONE pass over the logits in
  the forward (``fce_forward`` with a gradient buffer, upstream gradient 1) writes the loss, lse
  and the gradient; the backward hands that buffer to autograd after ``fce_backward_rescale``,
  which reads the upstream scalar on the device: exactly 1 (a plain ``loss.backward()``) costs
  one launch and no pass; 0 or ±2^k (GradScaler, power-of-two accumulation) an exact in-place
  scale; any other value recomputes the gradient from the logits (kept by reference), so it is
  rounded once, as torch's. No host synchronisation, graph-capturable. The gradient buffer is
  the one the backward returns (no memory beyond it). With ``inplace_backward=True`` the
  gradient is written over the logits instead and scaled with ``fce_scale_gradient`` (a 16-bit
  gradient is then rounded twice for an upstream value that is not ±2^k, as Liger's and
  Quack's).
* :func:`cross_entropy`, reduction 'none': the forward saves lse [N]; the backward calls
  ``fce_backward`` with the per-row upstream gradient (one more read of the logits).
* :func:`linear_cross_entropy` cannot save the logits (they exist only piece by piece), so for
  reduction 'mean' and 'sum' the forward (``fce_linear_ce``) computes the gradients of hidden,
  weight and bias in their own dtypes for an upstream gradient of 1, in the same call as the
  loss, and the backward scales them in place (``fce_scale_gradient``: free when the upstream
  gradient is 1, exact for ±2^k; for other values a 16-bit grad_hidden / grad_weight is rounded
  twice). With a bias that needs a gradient the forward computes the loss only and the backward
  computes everything with the real upstream gradient (8·N·D·V; LLM heads have no bias). Its scratch memory is the budget ``workspace_bytes`` (default 1 GiB); nothing of
  size [V, D] or [N, V] is allocated beyond the gradients returned. For reduction 'none' the
  forward computes the loss only and the backward calls ``fce_linear_ce`` again with the
  per-row upstream gradient (one recomputation of the logits, chunk by chunk).
* Gradients are only computed when autograd will need them (grad mode on and an input
  requiring grad): evaluate under ``torch.no_grad()``.

Extra outputs (``return_z_loss``, ``return_token_accuracy``, ``return_predicted_tokens``,
``return_lse``, ``return_entropy``) come from the same library call as the loss (the accuracy
and the argmax from the logits it reads or forms anyway, never a second pass); with any of them
set the functions return a ``CrossEntropyOutput`` named tuple ``(loss, z_loss, token_accuracy,
predicted_tokens, lse, entropy)`` holding the loss and the outputs asked for, in that order
(:data:`OUTPUT_FIELDS`). The loss, lse and the entropy are differentiable (docs/semantics.md
rule 18); z_loss, token_accuracy and predicted_tokens are not. While lse and the entropy get
no gradient the loss's gradient takes the paths above unchanged; when they get one, the
backward computes the whole gradient in ONE library call: ``fce_backward`` with grad_lse when
only lse has one, else ``fce_forward`` with every upstream gradient (the forward's one-pass
gradient is then not used); :func:`linear_cross_entropy` calls ``fce_linear_ce`` again with
them. Under ``torch.compile`` an lse or entropy returned from the compiled region may be given
a zero gradient rather than none, which takes that one call too.

Differences from torch, on purpose:

* a 'mean' over zero non-ignored targets is 0 with zero gradients (torch gives NaN);
* a target outside [0, C) that is not ``ignore_index`` gives a NaN loss (no host sync to raise
  an error; torch raises), unless ``check_targets=True``: then the library's error flag is read
  after the call (a host synchronisation) and torch's IndexError is raised;
* float64 inputs are refused (TypeError: the
  library computes in float32 and casts nothing behind the caller's back; cast with
  ``.float()``), where torch would compute in float64;
* no double backward (the gradients are not differentiable again).

Class-probability targets: a floating ``target`` of the input's shape (the logits' shape for
:func:`linear_cross_entropy`: input's leading dimensions and V) and dtype holds the probabilities
q, as torch's ``F.cross_entropy(input, probabilities)``: label smoothing, class weights and the
reductions as torch ('mean' divides by the rows), the z-loss and softcap as for class indices;
every row is scored. Refused with ValueError naming the keyword (no target class):
``use_token_scaling``, ``shift_seq_len`` / ``shift``, ``return_token_accuracy``,
``check_targets``, and an ``ignore_index >= 0`` (torch's rule). When the target requires a
gradient it gets one, -g (1 - ε) w_j log p_j, computed with torch ops from the [N, V] logits (of
:func:`linear_cross_entropy`: formed whole for it, in the backward): that case costs what
torch's costs.

Distillation: :func:`distill` (student logits against teacher logits) and
:func:`linear_distill` (student hidden states and head against the teacher's, logits never
held whole): forward KL, reverse KL or Liger's generalised JSD at a temperature, gradients for
the student only (_distill.py).

Autocast: :func:`cross_entropy` takes logits of any of float32/float16/bfloat16 as they are
(computing in float32 inside, as autocast's own cross-entropy does). :func:`linear_cross_entropy`
runs its matmul in the autocast dtype when autocast is on for the inputs' device: hidden, weight
and bias are cast inside the op, and a float32 weight gets its gradient in float32 directly.

Under ``torch.compile`` everything goes through ``torch.library.custom_op`` with
``register_fake`` and ``register_autograd``, so ``torch.compile(fullgraph=True)`` traces these
functions without graph breaks (but ``inplace_backward=True``, a plain autograd.Function). In eager
mode :func:`cross_entropy` runs plain autograd.Functions calling the library directly instead
(the same calls: the custom ops' dispatch costs host time a small call notices).

Errors: what the library checks (option ranges, the causal shift's values, ...) it reports
itself, naming the option (:class:`fusedce.FusedCEError` subclasses, ValueError for invalid
arguments).

The modules behind this one (fusedce/torch/): _ops.py (the custom ops and autograd Functions),
_args.py (argument handling, the return convention), _calls.py (the direct C calls),
_soft.py (class-probability targets), _distill.py and _distill_ops.py (the distillation
losses and their ops), distributed.py (:mod:`fusedce.torch.distributed`). The options travel
from the public function to the C struct as one :class:`fusedce._options.CEOptions` (one
:class:`fusedce._options.DistillOptions` for a distillation), the outputs asked for as one
:class:`fusedce._options.Want`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _alloc
from .._lib import FCE_REDUCTION_NONE
from .._options import OUTPUT_FIELDS, CEOptions
# the ops first: they check the torch version (>= 2.4, torch.library.custom_op)
from ._ops import (_compiling, _CrossEntropyInPlace, _CrossEntropyOnePass,
                   _CrossEntropySavedLse, _ce_forward, _ce_forward_grad, _cw, _linear_ce)
from . import _calls as _tc
from . import _dtensor, _soft
from ._distill import distill, linear_distill
from ._args import (_finish, _float_input, _linear_dtype, _reduction, _resolve_shift, _targets,
                    _z_loss_rows, want as _want)

__all__ = ["cross_entropy", "linear_cross_entropy", "module_linear_cross_entropy",
           "distill", "linear_distill",
           "CrossEntropyLoss",
           "LinearCrossEntropyLoss", "DEFAULT_WORKSPACE_BYTES", "OUTPUT_FIELDS"]

# the linear CE budget without env or kwarg (FUSEDCE_WORKSPACE_BYTES, else 1 GiB), as fusedce.jax
DEFAULT_WORKSPACE_BYTES = _alloc.DEFAULT_WORKSPACE_BYTES


def cross_entropy(input: Tensor, target: Tensor, weight: Optional[Tensor] = None,
                  ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0, *, z_loss: float = 0.0, softcap: float = 0.0,
                  logit_scale: float = 1.0, shift_seq_len: int = 0, shift: int = 0,
                  use_token_scaling: bool = False, return_z_loss: bool = False,
                  return_token_accuracy: bool = False, return_predicted_tokens: bool = False,
                  return_lse: bool = False, return_entropy: bool = False,
                  check_targets: bool = False, inplace_backward: bool = False,
                  batch_invariant: bool = False):
    """torch.nn.functional.cross_entropy, fused, plus the options below. When autograd will
    need the gradient (grad mode on, input requiring grad) and the reduction is 'mean' or
    'sum', the forward reads the logits once and writes the gradient once, for an upstream
    gradient of 1; the backward turns it into the gradient for the upstream scalar (nothing
    to do when that is exactly 1; an exact scale for ±2^k; a recomputation from the logits
    otherwise, so the gradient is rounded once — decided on the device). Reduction 'none' saves lse and
    computes the gradient in the backward (one more read of the logits). Under
    ``torch.no_grad()``, or when input does not require grad, only the loss is computed.

    z_loss        lambda: adds lambda * lse^2 per row (PaLM; Liger's lse_square_scale). For
                  'mean' the z-loss terms are divided by the number of non-ignored rows (not
                  by the class weights' sum, as Liger).
    softcap       c > 0: logits become c * tanh(logits / c) first (Gemma 2);
    logit_scale   s: logits are multiplied by s before anything else;
    shift_seq_len, shift   causal shift without a copy (docs/semantics.md rule 1): with sequences of
                  T rows, row b*T+t of the (flattened) logits is scored against target
                  b*T+t+k and the last k positions of each sequence are ignored.
                  ``shift_seq_len=T`` alone: k = 1 (as before 0.3). ``shift=k`` alone (CCE's
                  integer shift; True = 1): T = target.shape[-1] (a 1-D target is one
                  sequence), so ``cross_entropy(z.view(B * T, V), y.view(B, T), shift=1)`` is
                  ``F.cross_entropy(z.view(B, T, V)[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1))``.
                  Both: k within sequences of T. 0 <= k < T. For reduction 'none' the loss keeps
                  every position (the last k of each sequence hold 0): CCE's is ``loss[..., :-k]``.
    use_token_scaling  each row's loss (its z-loss term included) and gradient times its
                  predicted probability of the target, p_y, treated as a constant (Liger's);
    return_z_loss      also return the z-loss part of the loss (for logging; not
                  differentiable): float32 () for 'mean'/'sum' (the library's total), per row
                  (the shape of the 'none' loss) for 'none', as Liger;
    return_token_accuracy  also return the accuracy of the argmax prediction, computed by the
                  library from the logits it reads anyway: float32 () for 'mean'/'sum' (the
                  fraction of non-ignored rows whose argmax is the target; 0 when every row is
                  ignored), 1.0/0.0 per row for 'none' (0 for ignored rows). Unweighted;
    return_predicted_tokens  also return each row's argmax class (int64, the shape of the
                  'none' loss; -1 for ignored rows; ties: the lowest index, as torch.argmax);
    return_lse    also return each row's log-sum-exp of the (scaled, capped) logits (float32,
                  the shape of the 'none' loss; written for ignored rows too; CCE's), with its
                  gradient (d lse / d z_j = s * p_j * (1 - (a_j / c)^2));
    return_entropy  also return each row's entropy of the softmax of the scaled, capped logits
                  a, H = lse - sum_j p_j a_j (float32, the shape of the 'none' loss; ignored
                  rows too), with its gradient (-p_j (a_j - sum_k p_k a_k), through the
                  scale and softcap);
    check_targets after the call, read the library's error flag (a host synchronisation: slow
                  on CUDA, not allowed inside CUDA-graph capture; inside the op, so no graph
                  break under torch.compile) and raise IndexError("Target 123 is out of
                  bounds.") as torch does when a target is outside [0, C) and not
                  ignore_index. Off by default: such a row gets a NaN loss and gradient, no
                  sync;
    inplace_backward  write the gradient OVER the logits (as Liger and Quack do): saves the
                  [N, V] gradient buffer, but the logits' values are destroyed by the forward,
                  so nothing else may read them afterwards (not even another loss). Only for
                  'mean'/'sum' with a gradient; dense logits (others are copied first). The
                  upstream scalar is applied by scaling (16-bit: rounded twice unless it is
                  ±2^k). Runs as a torch.autograd.Function (torch.compile breaks the graph).
                  A gradient reaching lse or the entropy then raises (the logits are gone).
    batch_invariant  each row's loss ('none'), lse, entropy, predicted token and gradient row
                  are bitwise the same whatever the other rows of the batch (fce_options'
                  batch_invariant, docs/semantics.md rule 21: e.g. a sampler's per-token
                  log-probs against the trainer's). Not the 'mean'/'sum' loss, nor a 'mean'
                  gradient (scaled by the batch's count). CUDA: rows 16-byte aligned.

    With inplace_backward=True the gradient is handed to autograd once: a second backward
    through the same graph (retain_graph=True) raises. Without it, a second backward recomputes.

    Returns the loss (a tensor) when no return_* flag is set; otherwise a ``CrossEntropyOutput``
    named tuple of the loss followed by the outputs asked for, always in the order
    ``(loss, z_loss, token_accuracy, predicted_tokens, lse, entropy)``
    (:data:`OUTPUT_FIELDS`): e.g.
    ``loss, lse = cross_entropy(z, y, return_lse=True)`` (CCE's pair), ``loss, z_loss, acc,
    pred = cross_entropy(z, y, return_z_loss=True, return_token_accuracy=True,
    return_predicted_tokens=True)`` (Liger's four), or by name (``out.token_accuracy``). The
    loss, lse and the entropy are differentiable, the other outputs not.

    input is (C,), (N, C) or (N, C, d1, ...) as in torch (the last form is copied to put the
    classes last; give [N, C] for speed). A row stride larger than C (e.g. a slice of padded
    logits) is used without a copy. The loss is float32.

    target holds class indices (an integer tensor: (), (N) or (N, d1, ...)), or class
    probabilities: a floating tensor of input's shape and dtype, as torch's (the module's
    docstring says what is refused with them, and how the target's own gradient is made).
    """
    red = _reduction(reduction)
    fn = "fusedce.torch.cross_entropy"
    input = _float_input(input, fn, "input")
    out_shape = q = None
    if target.is_floating_point():  # class probabilities, of the input's shape
        q = _soft.target(target, tuple(input.shape), input.dtype, fn)
        if input.dim() == 1:
            logits, q, out_shape = input.unsqueeze(0), q.unsqueeze(0), ()
        elif input.dim() == 2:
            logits = input
        elif input.dim() > 2:
            logits = input.movedim(1, -1).reshape(-1, input.shape[1])
            q = q.movedim(1, -1).reshape(-1, input.shape[1])
            out_shape = (input.shape[0],) + tuple(input.shape[2:])
        else:
            raise ValueError("input must have at least one dimension (the classes)")
        tgt = q.detach().contiguous()
    elif input.dim() == 1:
        logits, tgt = input.unsqueeze(0), _targets(target)
        out_shape = ()
    elif input.dim() == 2:
        logits, tgt = input, _targets(target)
        if target.dim() != 1:  # [B, T] targets of [B*T, C] logits: per-row outputs [B, T]
            out_shape = tuple(target.shape)
    elif input.dim() > 2:
        logits = input.movedim(1, -1).reshape(-1, input.shape[1])
        tgt = _targets(target)
        out_shape = tuple(target.shape)
    else:
        raise ValueError("input must have at least one dimension (the classes)")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if tgt.shape[0] != logits.shape[0]:
        raise ValueError(f"target has {tgt.shape[0]} elements for {logits.shape[0]} rows of "
                         f"logits (input {tuple(input.shape)}, target {tuple(target.shape)})")
    if weight is not None and (weight.dim() != 1 or weight.shape[0] != logits.shape[1]):
        raise ValueError(f"weight must have shape ({logits.shape[1]},), got "
                         f"{tuple(weight.shape)}")
    t, k = _resolve_shift(shift, shift_seq_len, tuple(target.shape), logits.shape[0])
    opts = CEOptions.cached(red, ignore_index, label_smoothing, z_loss, softcap, logit_scale, t,
                            k, use_token_scaling, batch_invariant)
    want = _want(return_z_loss, return_token_accuracy, return_predicted_tokens, return_lse,
                 return_entropy)
    if q is not None:
        _soft.check_options(opts, ignore_index, want, check_targets, fn)
        if inplace_backward and q.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{fn}: inplace_backward=True with a target that requires grad: "
                             "its gradient needs the logits, which the forward overwrites")
    lib_want = want.from_library(red)  # what the C call writes (lse included)
    check = bool(check_targets)
    need_grad = torch.is_grad_enabled() and logits.requires_grad
    if red != FCE_REDUCTION_NONE and need_grad:
        if inplace_backward:
            if logits.stride(0) != logits.shape[1] and logits.shape[0] > 1:
                logits = logits.contiguous()
            loss, lse, zl, acc, am, ent = _CrossEntropyInPlace.apply(logits, tgt, weight, opts,
                                                                     lib_want, check)
        elif _compiling():
            loss, lse, _, zl, acc, am, ent = _ce_forward_grad(logits, tgt, weight,
                                                              *opts.as_op_args(),
                                                              lib_want.as_op_arg(), check)
        elif lib_want:
            loss, lse, zl, acc, am, ent = _CrossEntropyOnePass.apply(logits, tgt, weight, opts,
                                                                     lib_want, check)
        else:
            loss = _CrossEntropyOnePass.apply(logits, tgt, weight, opts, lib_want, check)
            lse = zl = acc = am = ent = None
    elif not _compiling() and not need_grad:
        loss, lse, zl, acc, am, ent = _tc.ce_forward(logits, tgt, _cw(weight), opts,
                                                     want_lse=lib_want.lse, want=lib_want,
                                                     check_targets=check)
    elif not _compiling():  # reduction 'none' with a gradient
        loss, lse, zl, acc, am, ent = _CrossEntropySavedLse.apply(logits, tgt, weight, opts,
                                                                  lib_want, check)
    else:
        loss, lse, zl, acc, am, ent = _ce_forward(logits, tgt, weight, *opts.as_op_args(),
                                                  lib_want.as_op_arg(), check)

    if q is not None:
        loss = _soft.with_target_grad(loss, q, logits, None, None, weight, opts)
    if not want and red != FCE_REDUCTION_NONE:
        return loss
    v = logits.shape[1]
    return _finish(want, red, out_shape, loss, lse, zl, acc, am, lambda: _soft.z_loss_rows(
        lse, opts) if q is not None else _z_loss_rows(
        lse, tgt, v, opts,
        lambda y: logits.detach().gather(1, y.unsqueeze(1)).squeeze(1)), ent)


def linear_cross_entropy(input: Tensor, linear_weight: Tensor, target: Tensor, *,
                         linear_bias: Optional[Tensor] = None, weight: Optional[Tensor] = None,
                         reduction: str = "mean", ignore_index: int = -100,
                         label_smoothing: float = 0.0, z_loss: float = 0.0,
                         softcap: float = 0.0, logit_scale: float = 1.0,
                         shift_seq_len: int = 0, shift: int = 0,
                         use_token_scaling: bool = False, return_z_loss: bool = False,
                         return_token_accuracy: bool = False,
                         return_predicted_tokens: bool = False, return_lse: bool = False,
                         return_entropy: bool = False, check_targets: bool = False,
                         workspace_bytes: Optional[int] = None, batch_invariant: bool = False):
    """cross_entropy(F.linear(input, linear_weight, linear_bias), target, ...) without ever
    holding the [N, V] logits (fce_linear_ce).

    input [..., D] (leading dimensions flattened), linear_weight [V, D] (an nn.Linear(D, V) or a
    tied embedding's weight), linear_bias [V], target [...] (the leading dimensions of input;
    or class probabilities [..., V], floating, of the matmul's dtype), weight [V] class
    weights; the other keywords, the return convention (the loss, or a
    ``CrossEntropyOutput`` named tuple ``(loss, z_loss, token_accuracy, predicted_tokens,
    lse, entropy)`` restricted to what was asked for; lse and the entropy differentiable,
    their gradients reaching input, linear_weight and linear_bias through a recompute) and
    the causal shift as in :func:`cross_entropy`
    (``shift=k`` alone: T = target.shape[-1], as CCE's ``linear_cross_entropy(e [B, T, D], c,
    targets [B, T], shift=k)``). The accuracy and predicted tokens come from the logits the
    library computes piece by piece. With ``use_token_scaling``, reduction 'none' and
    ``return_z_loss``, the per-row z-loss needs p_y: the target rows of linear_weight are
    gathered ([N, D], the size of input) to get the target logits. Under autocast the matmul
    runs in the autocast dtype. The loss is float32; for reduction 'none' it has the shape of
    target (so have the per-row outputs).

    DTensor arguments (``torch.distributed.tensor``): a replicated ``linear_weight`` is used
    as its local tensor; one sharded over the vocabulary (``Shard(0)``, e.g. ``parallelize_module``
    with ``ColwiseParallel``) takes the vocabulary-parallel path
    (:func:`fusedce.torch.distributed.vocab_parallel_linear_cross_entropy`) over its mesh's
    group by itself, ``input`` a plain tensor the same on every rank of it or a DTensor
    (``Shard(0)`` over the rows: sequence parallelism); gradients come back as DTensors in the
    parameters' placements; other placements raise ValueError (docs/vocab-parallel.md). A weight
    that FSDP2 or ZeRO-3 shards must be read inside its module's forward:
    :func:`module_linear_cross_entropy`.

    workspace_bytes  the memory budget of the call beyond the inputs and the gradients it
                  returns (its scratch workspace); None = FUSEDCE_WORKSPACE_BYTES from the
                  environment (e.g. "512M"), else 1 GiB (fusedce.torch.DEFAULT_WORKSPACE_BYTES).
                  The library picks its fastest plan within it (dev/NOTES.md): token chunks of
                  the logits when they fit with few enough chunks, else the vocab-sliced plan
                  (8·N·D·V instead of 6·N·D·V FLOPs; its float32 [N, D] ∂h accumulator counts
                  towards the budget). A budget below the library's minimum (a few MiB) gets
                  the minimum.
    batch_invariant  as in :func:`cross_entropy`; the plan is then fixed (token chunks of a
                  size set by V and the dtype), whatever the budget.
    """
    if _dtensor.any_dtensor(input, linear_weight, linear_bias):
        if batch_invariant:
            raise ValueError("batch_invariant is not supported with DTensor arguments (the "
                             "vocabulary-parallel calls refuse it)")
        return _dtensor.linear_cross_entropy(
            input, linear_weight, target, linear_bias, weight, dict(
                reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing,
                z_loss=z_loss, softcap=softcap, logit_scale=logit_scale,
                shift_seq_len=shift_seq_len, shift=shift, use_token_scaling=use_token_scaling,
                return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy,
                return_predicted_tokens=return_predicted_tokens, return_lse=return_lse,
                return_entropy=return_entropy, check_targets=check_targets,
                workspace_bytes=workspace_bytes))
    red = _reduction(reduction)
    if input.dim() < 1:
        raise ValueError("input must be [..., D]")
    if linear_weight.dim() != 2 or linear_weight.shape[1] != input.shape[-1]:
        raise ValueError(f"linear_weight must be [V, {input.shape[-1]}], got "
                         f"{tuple(linear_weight.shape)}")
    vocab = linear_weight.shape[0]
    if linear_bias is not None and (linear_bias.dim() != 1 or linear_bias.shape[0] != vocab):
        raise ValueError(f"linear_bias must be [{vocab}], got {tuple(linear_bias.shape)}")
    if weight is not None and (weight.dim() != 1 or weight.shape[0] != vocab):
        raise ValueError(f"weight must have shape ({vocab},), got {tuple(weight.shape)}")
    fn = "fusedce.torch.linear_cross_entropy"
    hidden = input.reshape(-1, input.shape[-1])
    cdt = _linear_dtype(fn, (("input", input), ("linear_weight", linear_weight),
                             ("linear_bias", linear_bias)))
    q, out_shape = None, tuple(target.shape)
    if target.is_floating_point():  # class probabilities [..., V]
        q = _soft.target(target, tuple(input.shape[:-1]) + (vocab,), cdt, fn,
                         autocast=cdt != input.dtype).reshape(-1, vocab)
        tgt, out_shape = q.detach().contiguous(), tuple(input.shape[:-1])
    else:
        tgt = _targets(target)
    if tgt.shape[0] != hidden.shape[0]:
        raise ValueError(f"target has {tgt.shape[0]} elements for {hidden.shape[0]} rows of "
                         f"input (input {tuple(input.shape)}, target {tuple(target.shape)})")
    t, k = _resolve_shift(shift, shift_seq_len, tuple(target.shape), hidden.shape[0])
    grad_on = torch.is_grad_enabled()
    need_h = grad_on and input.requires_grad
    need_w = grad_on and linear_weight.requires_grad
    need_b = grad_on and linear_bias is not None and linear_bias.requires_grad
    # gradients in the forward (scaled in the backward), except for 'none' (per-row upstream
    # gradient) and a bias that needs a gradient (its 16-bit sum would be rounded twice)
    in_forward = red != FCE_REDUCTION_NONE and not need_b
    budget = (_alloc.default_workspace_bytes() if workspace_bytes is None
              else int(workspace_bytes))
    if budget < 0:
        raise ValueError(f"workspace_bytes must be >= 0, got {workspace_bytes}")
    opts = CEOptions.cached(red, ignore_index, label_smoothing, z_loss, softcap, logit_scale, t,
                            k, use_token_scaling, batch_invariant)
    want = _want(return_z_loss, return_token_accuracy, return_predicted_tokens, return_lse,
                 return_entropy)
    if q is not None:
        _soft.check_options(opts, ignore_index, want, check_targets, fn)
    loss, lse, _, _, _, zl, acc, am, ent = _linear_ce(
        hidden, linear_weight, linear_bias, tgt, weight, None, None, None, *opts.as_op_args(),
        _tc.CODE_OF_TORCH[cdt], budget, bool(need_h and in_forward),
        bool(need_w and in_forward), bool(need_b and in_forward),
        want.from_library(red).as_op_arg(), bool(check_targets))

    def target_logit(y):
        h = hidden.detach().to(cdt)
        a = (h.float() * linear_weight.detach().to(cdt)[y].float()).sum(-1)
        if linear_bias is not None:
            a = a + linear_bias.detach().to(cdt)[y].float()
        return a

    if q is not None:
        loss = _soft.with_target_grad(loss, q, hidden.to(cdt), linear_weight.to(cdt),
                                      linear_bias.to(cdt) if linear_bias is not None else None,
                                      weight, opts)
        return _finish(want, red, out_shape, loss, lse, zl, acc, am,
                       lambda: _soft.z_loss_rows(lse, opts), ent)
    return _finish(want, red, out_shape, loss, lse, zl, acc, am,
                   lambda: _z_loss_rows(lse, tgt, vocab, opts, target_logit), ent)


def module_linear_cross_entropy(module: torch.nn.Module, input: Tensor, target: Tensor,
                                **kwargs):
    """``linear_cross_entropy(input, module.weight, target, linear_bias=module.bias, **kwargs)``
    computed as ``module(input)``: the module's forward is replaced for this one call, so its
    hooks run around the loss as around its own forward. For an output layer whose weight a
    framework gathers in forward hooks: FSDP2 (``fully_shard(lm_head)``: the pre-forward
    all-gather, the reshard after it, and in the backward the all-gather again if it was
    resharded and the reduce-scatter of ∂weight into the sharded parameter's gradient) and
    DeepSpeed ZeRO-3 (its parameter fetch and release). Nothing beyond what the framework
    itself gathers and the workspace budget is held. The weight read there may be a DTensor
    (FSDP2 over a tensor-parallel weight): handled as :func:`linear_cross_entropy` does.
    ``module``: an ``nn.Linear`` (or any module with ``weight`` [V, D] and ``bias`` [V] or None);
    a tensor-parallel plan's hooks (parallelize_module), which change the input and expect logits
    out, are set aside for the call: the DTensor weight takes the vocabulary-parallel path."""
    def forward(hidden):
        return linear_cross_entropy(hidden, module.weight, target,
                                    linear_bias=getattr(module, "bias", None), **kwargs)
    return _dtensor.module_forward(module, forward, input)


class _LossOptions(torch.nn.Module):
    """The options both loss modules hold (torch.nn.CrossEntropyLoss's, plus fusedce's)."""

    def __init__(self, weight: Optional[Tensor] = None, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0, *, z_loss: float = 0.0,
                 softcap: float = 0.0, logit_scale: float = 1.0, shift_seq_len: int = 0,
                 shift: int = 0, use_token_scaling: bool = False, return_z_loss: bool = False,
                 return_token_accuracy: bool = False, return_predicted_tokens: bool = False,
                 return_lse: bool = False, return_entropy: bool = False,
                 check_targets: bool = False):
        super().__init__()
        _reduction(reduction)
        self.register_buffer("weight", weight)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.logit_scale = logit_scale
        self.shift_seq_len = shift_seq_len
        self.shift = shift
        self.use_token_scaling = use_token_scaling
        self.return_z_loss = return_z_loss
        self.return_token_accuracy = return_token_accuracy
        self.return_predicted_tokens = return_predicted_tokens
        self.return_lse = return_lse
        self.return_entropy = return_entropy
        self.check_targets = check_targets

    def _kwargs(self) -> dict:
        return dict(z_loss=self.z_loss, softcap=self.softcap, logit_scale=self.logit_scale,
                    shift_seq_len=self.shift_seq_len, shift=self.shift,
                    use_token_scaling=self.use_token_scaling, return_z_loss=self.return_z_loss,
                    return_token_accuracy=self.return_token_accuracy,
                    return_predicted_tokens=self.return_predicted_tokens,
                    return_lse=self.return_lse, return_entropy=self.return_entropy,
                    check_targets=self.check_targets)

    def extra_repr(self) -> str:
        text = (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, "
                f"softcap={self.softcap}, logit_scale={self.logit_scale}, "
                f"shift_seq_len={self.shift_seq_len}")
        for name in ("shift", "use_token_scaling", "return_z_loss", "return_token_accuracy",
                     "return_predicted_tokens", "return_lse", "return_entropy",
                     "check_targets"):
            if getattr(self, name):
                text += f", {name}={getattr(self, name)}"
        return text


class CrossEntropyLoss(_LossOptions):
    """torch.nn.CrossEntropyLoss with fusedce's :func:`cross_entropy` (and its extra options,
    inplace_backward and the return_* flags included: with one set, forward returns the
    CrossEntropyOutput named tuple)."""

    def __init__(self, *args, inplace_backward: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.inplace_backward = inplace_backward

    def forward(self, input: Tensor, target: Tensor):
        return cross_entropy(input, target, self.weight, self.ignore_index, self.reduction,
                             self.label_smoothing, inplace_backward=self.inplace_backward,
                             **self._kwargs())


class LinearCrossEntropyLoss(_LossOptions):
    """Loss of a language-model head: forward(input [..., D], linear_weight [V, D], target,
    linear_bias=None) = :func:`linear_cross_entropy`. The head's weight is an argument, so a
    tied embedding or an nn.Linear's weight can be passed as it is. workspace_bytes: the memory
    budget, as for :func:`linear_cross_entropy`."""

    def __init__(self, *args, workspace_bytes: Optional[int] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.workspace_bytes = workspace_bytes

    def forward(self, input: Tensor, linear_weight: Tensor, target: Tensor,
                linear_bias: Optional[Tensor] = None):
        return linear_cross_entropy(
            input, linear_weight, target, linear_bias=linear_bias, weight=self.weight,
            reduction=self.reduction, ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing, workspace_bytes=self.workspace_bytes,
            **self._kwargs())


# fusedce.torch.distributed: the vocabulary-parallel functions (imported with fusedce.torch, so
# that the attribute is there after ``import fusedce.torch``, as before it was a module)
from . import distributed  # noqa: E402,F401
