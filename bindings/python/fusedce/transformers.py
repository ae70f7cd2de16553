"""fusedce.transformers: Hugging Face causal LMs that train without building the logits.

    import fusedce.transformers
    model = AutoModelForCausalLM.from_pretrained(...)    # Llama, Mistral, Qwen2/3, Gemma 2/3
    fusedce.transformers.apply(model)                    # this model only; revert(model) undoes it
    fusedce.transformers.apply_to_llama()                # or: every LlamaForCausalLM, class-wide

Supported: the causal-LM classes ``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``Gemma2ForCausalLM`` and ``Gemma3ForCausalLM``
(Gemma 3's text model) of transformers ``>=4.51,<6`` (:data:`SUPPORTED_TRANSFORMERS`; 4.51.3,
4.57.6 and 5.23.0 are tested). Another version raises :class:`UnsupportedTransformersVersion`
naming that range (``FUSEDCE_TRANSFORMERS_ANY_VERSION=1`` skips the check, at your own risk).
transformers is imported when a function of this module is called, never when ``fusedce`` (or
this module) is imported.

What the patched ``forward`` does. It takes the original's arguments (positional ones too) plus
one keyword, ``skip_logits`` (Liger-Kernel's name):

* **the fused path**, taken by default when ``labels`` are given and the model is in training
  mode (``model.train()``), as Liger-Kernel's ``apply_liger_kernel_to_*``: the decoder runs as
  usual, then its last hidden states (after ``logits_to_keep``) go with ``lm_head.weight``
  (and ``lm_head.bias`` when there is one) to :func:`fusedce.torch.linear_cross_entropy`, which
  never holds the [tokens, vocab] logits (nor their float32 copy, nor their gradient). It follows
  transformers' ``ForCausalLMLoss``: position t is scored against ``labels[..., t + 1]`` (the
  causal shift done inside the library, ``shift=1``: no padded or shifted copy of the labels),
  the last position of each sequence and ``ignore_index`` (-100, or the ``ignore_index``
  keyword) are ignored; a ``shift_labels`` keyword is used as it is, unshifted; with
  ``num_items_in_batch`` (the Trainer's gradient-accumulation count) the loss is the sum over
  tokens divided by it, else the mean over non-ignored tokens; ``config.final_logit_softcapping``
  (Gemma 2, Gemma 3) is fusedce's ``softcap``. The output is the usual
  ``CausalLMOutputWithPast`` with ``logits=None`` (a tuple without logits for
  ``return_dict=False``, the loss first), ``past_key_values``, ``hidden_states`` and
  ``attentions`` as the decoder returned them.
* **otherwise the original forward, untouched**: no labels (generation, inference), evaluation
  mode (``model.eval()``: the Trainer's evaluation loop gets logits for its metrics, and the
  loss is transformers' own), ``skip_logits=False``, or a model the fused path cannot serve
  exactly (an ``lm_head`` that is not a plain ``torch.nn.Linear`` or has forward hooks, e.g. a
  LoRA-adapted or quantised head; a custom ``model.loss_function``): a warning says why, once.

So logits are returned only when asked for: call with ``skip_logits=False`` (per call) to get
them with transformers' loss in training, or evaluate in eval mode; ``skip_logits=True`` forces
the fused path (labels needed) in eval mode too, and ``apply(model, when="labels")`` makes it the
default whenever labels are given, training or not.

Differences from transformers' loss, all documented fusedce behaviour: the logits are formed
piece by piece in float32 from the hidden states (transformers rounds them to the model's dtype
first, and applies Gemma's softcap in that dtype), so 16-bit models get a loss within rounding of
transformers', not bit-identical; a mean over zero non-ignored labels is 0 with zero gradients
(transformers: NaN); a label outside [0, vocab) that is not ignored gives a NaN loss instead of an
error. The decoder is transformers' own code, unchanged (attention, rotary, norms, caches,
gradient checkpointing).

Other ways in: :func:`causal_lm_loss` is the loss alone (hidden states, head weight, labels), for
a model family this module does not patch; :func:`apply` takes a class for a class-wide patch;
``apply_to_llama`` and its siblings patch one family, class-wide when called without a model.
Apply before wrapping the model (PEFT's ``get_peft_model`` may come before or after: a PEFT model
is unwrapped to its base model; ``torch.compile``, FSDP, DeepSpeed after).

Sharded training. The fused path reads ``lm_head``'s weight the way the framework hands it to
the head's own forward. FSDP2 (``fully_shard``): with ``lm_head`` in an enclosing unit (the
root, say) its weight is already gathered when the patched forward runs; with ``lm_head`` its
own unit (``fully_shard(model.lm_head)``), or under DeepSpeed ZeRO-3, the loss is computed
INSIDE ``lm_head``'s call (its forward replaced for that call), so that the framework's hooks
run: the all-gather before, the reshard after, the all-gather again in the backward when it
resharded, and the reduce-scatter of ∂weight into the sharded parameter. Nothing beyond the
gathered weight the framework holds anyway and the workspace budget is allocated. FSDP(1)'s
``FullyShardedDataParallel`` wrapping the whole model gathers in the root's forward (lm_head
in the root unit). A tensor-parallel head (``parallelize_module`` with ``ColwiseParallel``: a
DTensor weight ``Shard(0)``) takes the vocabulary-parallel path by itself
(:func:`fusedce.torch.linear_cross_entropy` with a DTensor weight); so does FSDP2 over such a
head (2-D: data-parallel × tensor-parallel), inside ``lm_head``'s call with FSDP2's hooks and
without the tensor-parallel plan's (which would turn the input into a DTensor and expect logits
out): FSDP2 gathers the weight over the data-parallel ranks into its tensor-parallel shard.
"""

from __future__ import annotations

import functools
import inspect
import os
import types
import warnings
from typing import Optional

import torch

from .torch import linear_cross_entropy

__all__ = ["apply", "revert", "is_applied", "causal_lm_loss", "apply_to_llama",
           "apply_to_mistral", "apply_to_qwen2", "apply_to_qwen3", "apply_to_gemma2",
           "apply_to_gemma3", "SUPPORTED_TRANSFORMERS", "FAMILIES",
           "UnsupportedTransformersVersion", "check_version"]

SUPPORTED_TRANSFORMERS = ">=4.51,<6"
_MIN_VERSION = (4, 51)   # Qwen3 and Gemma3ForCausalLM, logits_to_keep, shift_labels
_END_VERSION = (6, 0)    # exclusive
_ANY_VERSION_ENV = "FUSEDCE_TRANSFORMERS_ANY_VERSION"

# family -> (modeling module, causal-LM class)
FAMILIES = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaForCausalLM"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "MistralForCausalLM"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("transformers.models.gemma2.modeling_gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("transformers.models.gemma3.modeling_gemma3", "Gemma3ForCausalLM"),
}
_FAMILY_OF = {v: k for k, v in FAMILIES.items()}
_WHEN = ("training", "labels")
_PATCH_ATTR = "_fusedce_patch"


class UnsupportedTransformersVersion(ImportError):
    """The installed transformers is outside :data:`SUPPORTED_TRANSFORMERS`."""


# ------------------------------------------------------------------ transformers ----
def _parse_version(text: str):
    try:
        from packaging.version import Version
        return tuple(Version(text).release[:2])
    except Exception:  # no packaging, or an odd string: the leading numbers
        nums = []
        for part in text.split(".")[:2]:
            digits = "".join(ch for ch in part if ch.isdigit())
            nums.append(int(digits) if digits else 0)
        return tuple(nums)


def check_version(version: Optional[str] = None) -> str:
    """Raise :class:`UnsupportedTransformersVersion` unless ``version`` (default: the installed
    transformers') is within :data:`SUPPORTED_TRANSFORMERS`; return it."""
    if version is None:
        try:
            import transformers
        except ImportError as e:
            raise ImportError(
                "fusedce.transformers needs Hugging Face transformers "
                f"{SUPPORTED_TRANSFORMERS} (pip install 'transformers{SUPPORTED_TRANSFORMERS}')"
            ) from e
        version = transformers.__version__
    if os.environ.get(_ANY_VERSION_ENV, "") not in ("", "0"):
        return version
    if not (_MIN_VERSION <= _parse_version(version) < _END_VERSION):
        raise UnsupportedTransformersVersion(
            f"fusedce.transformers supports transformers {SUPPORTED_TRANSFORMERS} (tested: "
            f"4.51.3, 4.57.6, 5.23.0); this is transformers {version}. Install a supported "
            f"version, or set {_ANY_VERSION_ENV}=1 to try anyway.")
    return version


def _family_class(family: str):
    import importlib
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; supported: {', '.join(FAMILIES)}")
    _load_hf()
    module, name = FAMILIES[family]
    return getattr(importlib.import_module(module), name)


def _family_in_mro(cls):
    """(family, the supported class itself) of cls or a base of it, else (None, None)."""
    for c in cls.__mro__:
        fam = _FAMILY_OF.get((c.__module__, c.__name__))
        if fam is not None:
            return fam, c
    return None, None


_HF = {}  # what the patched forward takes from transformers, imported once by _load_hf()


def _load_hf():
    """Check the version and import, once, what the patched forward uses: transformers' own
    slicing of the hidden states by ``logits_to_keep`` where it has one (5.x: ints, 1-D or 2-D
    positions, a boolean mask; else the 4.x rule), ForCausalLMLoss, CausalLMOutputWithPast."""
    if _HF:
        return _HF
    check_version()
    from transformers.modeling_outputs import CausalLMOutputWithPast
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        ForCausalLMLoss = None
    try:
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:
        def slice_logits_to_keep(hidden, logits_to_keep):
            idx = logits_to_keep
            if isinstance(idx, int):
                idx = slice(-idx, None)
            return hidden[:, idx, :]
    _HF.update(output=CausalLMOutputWithPast, loss=ForCausalLMLoss, slice=slice_logits_to_keep)
    return _HF


# ---------------------------------------------------------------------- the loss ----
def causal_lm_loss(hidden_states: torch.Tensor, weight: torch.Tensor,
                   labels: Optional[torch.Tensor] = None, *, bias: Optional[torch.Tensor] = None,
                   shift_labels: Optional[torch.Tensor] = None, num_items_in_batch=None,
                   ignore_index: int = -100, softcap: Optional[float] = None,
                   workspace_bytes: Optional[int] = None) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss(lm_head(hidden_states), labels, ...)`` through
    :func:`fusedce.torch.linear_cross_entropy`, without the logits.

    hidden_states [..., T, D] (or [N, D]); weight [V, D] (``lm_head.weight``, tied or not);
    labels [..., T] (the leading shape of hidden_states): position t is scored against
    labels[..., t + 1], the last position of each sequence ignored (fusedce's ``shift=1``, no
    copy); or ``shift_labels`` (already shifted, used as they are). ``num_items_in_batch``:
    reduction sum divided by it (an int or a tensor), else the mean over non-ignored labels.
    ``softcap``: Gemma's ``final_logit_softcapping`` (None or 0: none). Returns the float32 loss.
    """
    shift = 0
    if shift_labels is not None:
        targets = shift_labels
    elif labels is not None:
        targets = labels
        if targets.dim() >= 1 and targets.shape[-1] > 1:
            shift = 1
        else:  # sequences of one token: nothing to predict (transformers: every label ignored)
            targets = torch.full_like(targets, ignore_index)
    else:
        raise ValueError("causal_lm_loss needs labels or shift_labels")
    targets = targets.to(hidden_states.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = linear_cross_entropy(hidden_states, weight, targets, linear_bias=bias,
                                reduction=reduction, ignore_index=int(ignore_index),
                                softcap=float(softcap or 0.0), shift=shift,
                                workspace_bytes=workspace_bytes)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


# ------------------------------------------------------------- the fused forward ----
_warned = set()


def _warn_once(key, message):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=4)


def _is_fsdp_hook(module, hook) -> bool:
    """A forward (pre-)hook that FSDP2's fully_shard registered on module."""
    state = getattr(hook, "__self__", None)
    if state is not None and type(state).__name__ == "FSDPState":
        return True
    name = getattr(hook, "__qualname__", "")  # fully_shard of several modules together
    return name.startswith("_register_group_forward_hooks.")


def _head_access(head) -> Optional[str]:
    """How the fused path reads lm_head's parameters: "direct" (no hooks: its parameters as they
    are; a tensor-parallel DTensor weight included, its hooks only redistributing the layer's
    input and output), "module" (FSDP2's or DeepSpeed ZeRO-3's hooks gather the weight: the loss
    is computed inside the head's own call, so that they run), None (other hooks: not fusable)."""
    from .torch._dtensor import any_dtensor, is_tp_hook
    hooks = list(head._forward_pre_hooks.values()) + list(head._forward_hooks.values())
    if not hooks:
        return "direct"
    if hasattr(head.weight, "ds_id"):  # a ZeRO-3 partitioned parameter: its module hooks
        return "module"
    tp = any_dtensor(head.weight) and any(is_tp_hook(h) for h in hooks)
    if all(_is_fsdp_hook(head, h) or (tp and is_tp_hook(h)) for h in hooks):
        # FSDP2's hooks, with a tensor-parallel plan's (2-D: FSDP2 over a tensor-parallel
        # head; module_forward sets the plan's aside for the loss) or without
        return "module" if any(_is_fsdp_hook(head, h) for h in hooks) else "direct"
    return None


def _not_fusable(model) -> Optional[str]:
    """Why the fused path would not compute what the original forward does, or None."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear) or type(head).forward is not torch.nn.Linear.forward:
        return (f"lm_head is a {type(head).__name__}, not a plain torch.nn.Linear (a LoRA-adapted "
                "or quantised head?)")
    if "forward" in vars(head) or _head_access(head) is None:
        return ("lm_head has forward hooks or a replaced forward other than FSDP2's, ZeRO-3's or "
                "a tensor-parallel plan's (accelerate offloading?)")
    ref = _load_hf()["loss"]
    fn = getattr(model, "loss_function", None)
    if ref is not None and fn is not ref:
        return f"model.loss_function is {getattr(fn, '__name__', fn)!r}, not ForCausalLMLoss"
    return None


def _fused_forward(model, call: dict, workspace_bytes):
    labels = call.pop("labels")
    logits_to_keep = call.pop("logits_to_keep", None)
    legacy = call.pop("num_logits_to_keep", None)
    if logits_to_keep is None:
        logits_to_keep = legacy if legacy is not None else 0
    return_dict = call.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    # The decoder gets what the original forward gives it: every argument but labels,
    # logits_to_keep and return_dict (the loss keywords too, as transformers passes them).
    outputs = model.model(**call)
    hidden = outputs[0]
    if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        hidden = _load_hf()["slice"](hidden, logits_to_keep)
    head = model.lm_head

    def head_loss(h):  # lm_head's parameters read here: inside its own call for "module"
        return causal_lm_loss(
            h, head.weight, labels, bias=head.bias, shift_labels=call.get("shift_labels"),
            num_items_in_batch=call.get("num_items_in_batch"),
            ignore_index=call.get("ignore_index", -100),
            softcap=getattr(model.config, "final_logit_softcapping", None),
            workspace_bytes=workspace_bytes)
    if _head_access(head) == "module":
        from .torch._dtensor import module_forward
        loss = module_forward(head, head_loss, hidden)
    else:
        loss = head_loss(hidden)
    if isinstance(outputs, tuple):  # a decoder configured to return tuples
        return (loss,) + tuple(outputs[1:])
    out = _load_hf()["output"](
        loss=loss, logits=None, past_key_values=getattr(outputs, "past_key_values", None),
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None))
    return out if return_dict else out.to_tuple()


def _make_forward(original, call_original, positional, when: str, workspace_bytes):
    """The patched forward: ``call_original(self, *args, **kwargs)`` unless the fused path
    applies. ``positional``: the original's positional parameter names after self."""

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        skip_logits = kwargs.pop("skip_logits", None)
        if len(args) > len(positional):
            raise TypeError(f"forward() takes {len(positional)} positional arguments after self "
                            f"but {len(args)} were given")
        call = dict(zip(positional, args))
        for key in kwargs:
            if key in call:
                raise TypeError(f"forward() got multiple values for argument {key!r}")
        call.update(kwargs)
        labels = call.get("labels")
        if skip_logits is None:
            fused = labels is not None and (when == "labels" or self.training)
        else:
            fused = bool(skip_logits)
            if fused and labels is None:
                raise ValueError("skip_logits=True needs labels: without them there is no loss "
                                 "and the logits are the output")
        if fused:
            why = _not_fusable(self)
            if why is not None:
                if skip_logits:
                    raise ValueError(f"skip_logits=True, but the fused loss cannot serve this "
                                     f"model: {why}")
                _warn_once((type(self), why), f"fusedce.transformers: {why}; this "
                           f"{type(self).__name__} computes its logits and transformers' loss.")
                fused = False
        if not fused:
            return call_original(self, *args, **kwargs)
        return _fused_forward(self, call, workspace_bytes)

    setattr(forward, _PATCH_ATTR, {"original": original, "when": when,
                                    "workspace_bytes": workspace_bytes})
    return forward


def _positional_names(fn, bound: bool):
    params = list(inspect.signature(fn).parameters.values())
    names = [p.name for p in params
             if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                           inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    return names if bound else names[1:]


def _patch_info(fn):
    fn = getattr(fn, "__func__", fn)
    return getattr(fn, _PATCH_ATTR, None)


def _check_when(when):
    if when not in _WHEN:
        raise ValueError(f"when must be one of {_WHEN}, got {when!r}")


def _unwrap(target):
    """A PEFT model's base model (the transformers model it wraps), else target."""
    get_base = getattr(target, "get_base_model", None)
    if callable(get_base) and not isinstance(target, type):
        inner = get_base()
        if inner is not target:
            return inner
    return target


def _check_own_forward(cls, family_cls, what):
    fwd = getattr(cls, "forward")
    info = _patch_info(fwd)
    base = info["original"] if info is not None else fwd
    own = family_cls.__dict__.get("forward")
    own_info = _patch_info(own)
    if own_info is not None:
        own = own_info["original"]
    if base is not own:
        raise ValueError(
            f"{what} overrides {family_cls.__name__}.forward: fusedce.transformers replaces "
            "that forward and cannot know what the override does. Call "
            "fusedce.transformers.causal_lm_loss(hidden_states, lm_head.weight, labels, ...) in "
            "your forward instead.")


# ------------------------------------------------------------------------ the API ----
def apply(target, *, when: str = "training", workspace_bytes: Optional[int] = None):
    """Patch ``forward`` so that the loss goes through fusedce's fused linear cross-entropy.

    target  a model (an instance of a supported causal-LM class or of a subclass that does not
            override forward; a PEFT model is unwrapped to its base model): only this model is
            patched (its ``forward`` attribute); or a supported class (or such a subclass): every
            instance of it, made before or after, is patched (``cls.forward``).
    when    "training" (default, Liger's rule): the fused path when labels are given and the
            model is in training mode; "labels": whenever labels are given.
    workspace_bytes  the fused loss's scratch budget (None: fusedce's default, 1 GiB or
            FUSEDCE_WORKSPACE_BYTES).

    Applying again replaces the options. Returns target. Raises
    :class:`UnsupportedTransformersVersion` outside :data:`SUPPORTED_TRANSFORMERS`, TypeError for
    an unsupported model, ValueError for a subclass overriding forward.
    """
    _check_when(when)
    _load_hf()
    if isinstance(target, type):
        _patch_class(target, when, workspace_bytes)
        return target
    model = _unwrap(target)
    fam, family_cls = _family_in_mro(type(model))
    if fam is None:
        raise TypeError(
            f"fusedce.transformers.apply: {type(model).__name__} is not a supported causal LM "
            f"({', '.join(c for _, c in FAMILIES.values())}); for another model compute the loss "
            "with fusedce.transformers.causal_lm_loss")
    _check_own_forward(type(model), family_cls, type(model).__name__)
    previous = vars(model).get("forward")
    info = _patch_info(previous) if previous is not None else None
    if info is not None:  # patched already: new options, same original
        previous = info.get("instance_previous")
    if previous is not None:  # an instance-level forward (a hook wrapper): kept, called as is
        original = previous

        def call_original(self, *args, **kwargs):
            return previous(*args, **kwargs)
        positional = _positional_names(previous, bound=True)
    else:
        original = type(model).forward

        def call_original(self, *args, **kwargs):
            fn = type(self).forward  # the class's forward at call time (a class patch included)
            return fn(self, *args, **kwargs)
        positional = _positional_names(original, bound=False)
    fwd = _make_forward(original, call_original, positional, when, workspace_bytes)
    _patch_info(fwd)["instance_previous"] = previous
    model.forward = types.MethodType(fwd, model)
    return target


def _patch_class(cls, when, workspace_bytes):
    fam, family_cls = _family_in_mro(cls)
    if fam is None:
        raise TypeError(f"fusedce.transformers.apply: {cls.__name__} is not a supported causal-LM "
                        f"class ({', '.join(c for _, c in FAMILIES.values())})")
    _check_own_forward(cls, family_cls, cls.__name__)
    current = cls.__dict__.get("forward")
    info = _patch_info(current) if current is not None else None
    if info is not None:
        original, owned = info["original"], info["owned"]
    else:
        original, owned = getattr(cls, "forward"), "forward" in cls.__dict__
        # an inherited forward that is itself a patch of the base class: keep the real one
        inherited = _patch_info(original)
        if inherited is not None:
            original = inherited["original"]

    def call_original(self, *args, **kwargs):
        return original(self, *args, **kwargs)
    fwd = _make_forward(original, call_original, _positional_names(original, bound=False), when,
                        workspace_bytes)
    _patch_info(fwd)["owned"] = owned
    cls.forward = fwd


def revert(target):
    """Undo :func:`apply` on a model (its own ``forward`` back to what it was) or a class (the
    original ``cls.forward``). Nothing happens where nothing was applied. Returns target."""
    if isinstance(target, type):
        current = target.__dict__.get("forward")
        info = _patch_info(current) if current is not None else None
        if info is not None:
            if info["owned"]:
                target.forward = info["original"]
            else:
                delattr(target, "forward")
        return target
    model = _unwrap(target)
    current = vars(model).get("forward")
    info = _patch_info(current) if current is not None else None
    if info is not None:
        previous = info.get("instance_previous")
        if previous is None:
            del model.forward
        else:
            model.forward = previous
    return target


def is_applied(target) -> bool:
    """Whether ``forward`` of this model (its own, or its class's) or of this class is patched."""
    if isinstance(target, type):
        return _patch_info(getattr(target, "forward", None)) is not None
    return _patch_info(getattr(_unwrap(target), "forward", None)) is not None


def _family_apply(family: str):
    def apply_family(model=None, *, when: str = "training",
                     workspace_bytes: Optional[int] = None):
        cls = _family_class(family)
        if model is None:
            return apply(cls, when=when, workspace_bytes=workspace_bytes)
        inner = _unwrap(model)
        if not isinstance(inner, cls):
            raise TypeError(f"apply_to_{family} expects a {cls.__name__}, got "
                            f"{type(inner).__name__} (fusedce.transformers.apply picks the family "
                            "itself)")
        return apply(model, when=when, workspace_bytes=workspace_bytes)

    cls_name = FAMILIES[family][1]
    apply_family.__name__ = apply_family.__qualname__ = f"apply_to_{family}"
    apply_family.__doc__ = (
        f"apply(model) for a {cls_name}; without a model, patch {cls_name} class-wide (every "
        f"instance; undo with revert({cls_name})). Returns the model, or the class.")
    return apply_family


apply_to_llama = _family_apply("llama")
apply_to_mistral = _family_apply("mistral")
apply_to_qwen2 = _family_apply("qwen2")
apply_to_qwen3 = _family_apply("qwen3")
apply_to_gemma2 = _family_apply("gemma2")
apply_to_gemma3 = _family_apply("gemma3")
