"""The options of a loss and the outputs asked for, by name: :class:`CEOptions` and :class:`Want`;
the options of a distillation: :class:`DistillOptions`.

A public function (``fusedce.torch.cross_entropy``, ``linear_cross_entropy``, the functions of
``fusedce.torch.distributed``, ``fusedce.jax``'s, and ``fusedce.core``'s and
``fusedce.vocab_parallel``'s through :meth:`CEOptions.from_keywords`) builds one ``CEOptions``
from its keywords and hands it down unchanged to the one place that fills the C
``fce_options`` struct (``fusedce.torch._calls.options``, ``fusedce._args._build_options``).
Custom ops (``torch.library.custom_op``) take only tensors and scalars: there the options are
flattened by :meth:`CEOptions.as_op_args` and rebuilt by :meth:`CEOptions.from_op_args`; the
XLA FFI custom calls of ``fusedce.jax`` take them as two attribute arrays made by
:meth:`CEOptions.as_ffi_attrs`. These are the only code that knows the order of the fields.
Likewise the optional outputs travel as one :class:`Want`, flattened to an int by
:meth:`Want.as_op_arg` at an op boundary only.

Nothing here imports torch or jax, or loads the library.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Tuple

from ._lib import (FCE_DIVERGENCE_FORWARD_KL, FCE_DIVERGENCE_JSD, FCE_DIVERGENCE_REVERSE_KL,
                   FCE_REDUCTION_MEAN, FCE_REDUCTION_NONE)


def int_option(value, name: str) -> int:
    """An int64 option given by the caller: an int (not a bool, not a float that ctypes would
    truncate) that fits int64; its range is the library's to check."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if not -(2 ** 63) <= value < 2 ** 63:
        raise ValueError(f"{name} ({value}) does not fit in int64")
    return value


def float_option(value, name: str) -> float:
    """A real option given by the caller (its domain is the library's to check)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {value!r}") from None


def _cast_fields(options, casts) -> None:
    """Give each field of a frozen options dataclass its declared type (``casts``: (name,
    type) pairs): an option given as a NumPy scalar or a bool where an int is declared is
    stored as the plain Python value, so that equal options hash alike."""
    for f, cast in casts:
        value = getattr(options, f)
        if type(value) is not cast:
            object.__setattr__(options, f, cast(value))


@dataclass(frozen=True)
class CEOptions:
    """The fce_options values of a loss that the caller chooses (the library's names in
    brackets where they differ). Per-call values (dtypes, backend, strides, pointers) are not
    here: the code that makes the C call reads them from the tensors. Class weights are a
    tensor argument of their own. Hashable: a cache key for the C structs built from it."""

    reduction: int = FCE_REDUCTION_MEAN  # an fce_reduction code
    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0  # (z_loss_scale)
    softcap: float = 0.0
    logit_scale: float = 1.0
    shift_seq_len: int = 0
    shift: int = 0  # the C value: 0 means 1 when shift_seq_len is set
    token_scaling: bool = False
    batch_invariant: bool = False  # each row's results independent of the batch (rule 21)

    def __post_init__(self):
        _cast_fields(self, _CASTS)

    def __hash__(self) -> int:
        """The fields' hash, computed once (every C call's plan cache is keyed on the
        options), on first use: not while torch.compile traces a constructor."""
        try:
            return self.__dict__["_hash"]
        except KeyError:
            h = hash(tuple(getattr(self, f) for f, _ in _CASTS))
            object.__setattr__(self, "_hash", h)
            return h

    @property
    def per_row(self) -> bool:
        """Reduction 'none': the loss (and the accuracy) has one value per row."""
        return self.reduction == FCE_REDUCTION_NONE

    @classmethod
    def cached(cls, reduction: int, ignore_index, label_smoothing, z_loss, softcap, logit_scale,
               shift_seq_len, shift, token_scaling, batch_invariant) -> "CEOptions":
        """The same as the constructor with these fields, from a cache of the option sets
        seen (a training loop passes the same few again and again: one dict lookup instead
        of building and hashing a new one each call)."""
        key = (reduction, ignore_index, label_smoothing, z_loss, softcap, logit_scale,
               shift_seq_len, shift, token_scaling, batch_invariant)
        if not all(type(v) in _PLAIN for v in key):  # a tensor, say: never cached
            return cls(*key)
        opts = _CACHED.get(key)
        if opts is not None:
            return opts
        opts = cls(*key)
        if len(_CACHED) > 256:
            _CACHED.clear()
        _CACHED[key] = opts
        return opts

    def replace(self, **changes) -> "CEOptions":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_keywords(cls, *, reduction: int, ignore_index=-100, label_smoothing=0.0,
                      z_loss_scale=0.0, softcap=0.0, logit_scale=1.0, shift_seq_len=0,
                      shift=0, token_scaling=False, batch_invariant=False) -> "CEOptions":
        """The options of a ``fusedce.core`` / ``fusedce.vocab_parallel`` call, keywords with
        the C names (``z_loss_scale``; ``shift`` the C value), checked for what ctypes cannot
        see: an int option must be an int (a float would be truncated), a real one a number.
        ``reduction``: an fce_reduction code (``fusedce._args._reduction_code``)."""
        return cls(reduction=reduction, ignore_index=int_option(ignore_index, "ignore_index"),
                   label_smoothing=float_option(label_smoothing, "label_smoothing"),
                   z_loss=float_option(z_loss_scale, "z_loss_scale"),
                   softcap=float_option(softcap, "softcap"),
                   logit_scale=float_option(logit_scale, "logit_scale"),
                   shift_seq_len=int_option(shift_seq_len, "shift_seq_len"),
                   shift=int_option(shift, "shift"), token_scaling=bool(token_scaling),
                   batch_invariant=bool(batch_invariant))

    # ---- the custom-op boundary: the only place that knows the order of the fields
    def as_op_args(self) -> tuple:
        """The fields as the positional scalars of a custom op, in :data:`OP_ARG_NAMES`
        order (every op taking options declares these parameters, in this order)."""
        return (self.ignore_index, self.reduction, self.label_smoothing, self.z_loss,
                self.softcap, self.logit_scale, self.shift_seq_len, self.shift,
                self.token_scaling, self.batch_invariant)

    @classmethod
    def from_op_args(cls, ignore_index, reduction, label_smoothing, z_loss, softcap,
                     logit_scale, shift_seq_len, shift, token_scaling,
                     batch_invariant=False) -> "CEOptions":
        """The inverse of :meth:`as_op_args`."""
        return cls(reduction=reduction, ignore_index=ignore_index,
                   label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                   logit_scale=logit_scale, shift_seq_len=shift_seq_len, shift=shift,
                   token_scaling=token_scaling, batch_invariant=batch_invariant)

    # ---- the XLA FFI boundary (fusedce.jax): the attributes of the shim's handlers
    def as_ffi_attrs(self, workspace_bytes: int = 0, rescale: bool = False) -> Tuple[tuple, tuple]:
        """(iopts, fopts): the int64 and float32 attribute arrays of fusedce.jax's custom calls,
        in :data:`FFI_INT_NAMES` / :data:`FFI_FLOAT_NAMES` order (what MakeOptions in
        fusedce/jax_ffi/fusedce_jax.cc reads). ``workspace_bytes``: fce_linear_ce's budget;
        ``rescale``: fce_backward_rescale in place of fce_backward."""
        return ((self.reduction, self.ignore_index, self.shift_seq_len, self.shift,
                 int(self.token_scaling), int(workspace_bytes), int(bool(rescale)),
                 int(self.batch_invariant)),
                (self.label_smoothing, self.z_loss, self.softcap, self.logit_scale))


_CASTS = tuple((f.name, {"int": int, "float": float, "bool": bool}[f.type])
               for f in dataclasses.fields(CEOptions))
_CACHED: dict = {}  # CEOptions.cached: the option sets seen, by their arguments
_PLAIN = (int, float, bool)  # the argument types CEOptions.cached keys on
OP_ARG_NAMES = ("ignore_index", "reduction", "label_smoothing", "z_loss", "softcap",
                "logit_scale", "shift_seq_len", "shift", "token_scaling", "batch_invariant")
N_OP_ARGS = len(OP_ARG_NAMES)  # the scalars CEOptions.as_op_args gives
FFI_INT_NAMES = ("reduction", "ignore_index", "shift_seq_len", "shift", "token_scaling",
                 "workspace_bytes", "rescale", "batch_invariant")
FFI_FLOAT_NAMES = ("label_smoothing", "z_loss", "softcap", "logit_scale")


@dataclass(frozen=True)
class Want:
    """The optional outputs asked for (the ``return_*`` keywords), in the order they follow
    the loss in the returned ``CrossEntropyOutput``: z_loss, token accuracy, predicted tokens
    (argmax), lse, entropy. :meth:`from_library` says what the library call itself must
    write."""

    z_loss: bool = False
    accuracy: bool = False
    argmax: bool = False
    lse: bool = False
    entropy: bool = False

    def __bool__(self) -> bool:
        return self.z_loss or self.accuracy or self.argmax or self.lse or self.entropy

    def replace(self, **changes) -> "Want":
        return dataclasses.replace(self, **changes)

    def fields(self) -> tuple:
        """The names of the CrossEntropyOutput fields asked for, after "loss"."""
        return tuple(name for name, on in zip(OUTPUT_FIELDS[1:], (
            self.z_loss, self.accuracy, self.argmax, self.lse, self.entropy)) if on)

    def from_library(self, reduction: int) -> "Want":
        """What the C call writes for these outputs: the z-loss total only for 'mean'/'sum'
        (a 'none' z-loss is made per row from lse, the library giving only the total), and
        lse when it is returned or that per-row z-loss needs it."""
        none = reduction == FCE_REDUCTION_NONE
        return Want(z_loss=self.z_loss and not none, accuracy=self.accuracy,
                    argmax=self.argmax, lse=self.lse or (self.z_loss and none),
                    entropy=self.entropy)

    # ---- the custom-op boundary
    def as_op_arg(self) -> int:
        """One int for a custom op's scalar argument (:meth:`from_op_arg` reads it)."""
        return (int(self.z_loss) | int(self.accuracy) << 1 | int(self.argmax) << 2
                | int(self.lse) << 3 | int(self.entropy) << 4)

    @classmethod
    def from_op_arg(cls, value: int) -> "Want":
        value = int(value)
        return cls(z_loss=bool(value & 1), accuracy=bool(value & 2), argmax=bool(value & 4),
                   lse=bool(value & 8), entropy=bool(value & 16))


NOTHING = Want()
# The fields of CrossEntropyOutput: the loss, then the optional outputs in Want's order (Liger's
# (loss, z_loss, token_accuracy, predicted_tokens), then CCE's lse, then the entropy).
OUTPUT_FIELDS = ("loss", "z_loss", "token_accuracy", "predicted_tokens", "lse", "entropy")


# ================================================================== distillation ====
DIVERGENCES = {"forward_kl": FCE_DIVERGENCE_FORWARD_KL, "reverse_kl": FCE_DIVERGENCE_REVERSE_KL,
               "jsd": FCE_DIVERGENCE_JSD}


def divergence_code(divergence) -> int:
    """An fce_divergence from its name ('forward_kl', 'reverse_kl', 'jsd') or its code (an int:
    the library checks its value)."""
    if isinstance(divergence, str):
        if divergence.lower() in DIVERGENCES:
            return DIVERGENCES[divergence.lower()]
    elif isinstance(divergence, numbers.Integral) and not isinstance(divergence, bool):
        return int(divergence)
    raise ValueError(f"divergence must be 'forward_kl', 'reverse_kl' or 'jsd', got "
                     f"{divergence!r}")


@dataclass(frozen=True)
class DistillOptions:
    """The values of a distillation call (fce_distill, fce_linear_distill) that the caller
    chooses: those of fce_options (reduction, ignore_index, softcap, logit_scale: :meth:`ce`)
    and those of fce_teacher (divergence, beta, temperature). Per-call values (dtypes, strides,
    pointers, the teacher's hidden size) are read from the tensors where the C call is made.
    Hashable."""

    reduction: int = FCE_REDUCTION_MEAN  # an fce_reduction code
    ignore_index: int = -100
    divergence: int = FCE_DIVERGENCE_FORWARD_KL  # an fce_divergence code
    beta: float = 0.5
    temperature: float = 1.0
    softcap: float = 0.0
    logit_scale: float = 1.0

    def __post_init__(self):
        _cast_fields(self, _DISTILL_CASTS)

    @property
    def per_row(self) -> bool:
        return self.reduction == FCE_REDUCTION_NONE

    @classmethod
    def from_keywords(cls, *, reduction: int, divergence="forward_kl", beta=0.5,
                      temperature=1.0, ignore_index=-100, softcap=0.0,
                      logit_scale=1.0) -> "DistillOptions":
        """The options of a public call, checked for what ctypes cannot see (types; the
        ranges are the library's to check). ``reduction``: an fce_reduction code."""
        return cls(reduction=reduction, ignore_index=int_option(ignore_index, "ignore_index"),
                   divergence=divergence_code(divergence), beta=float_option(beta, "beta"),
                   temperature=float_option(temperature, "temperature"),
                   softcap=float_option(softcap, "softcap"),
                   logit_scale=float_option(logit_scale, "logit_scale"))

    def ce(self) -> CEOptions:
        """The fce_options part: what the code filling the C struct from a CEOptions takes
        (label smoothing, z-loss, token scaling and the shift stay off: the library refuses
        them in a distillation)."""
        return CEOptions(reduction=self.reduction, ignore_index=self.ignore_index,
                         softcap=self.softcap, logit_scale=self.logit_scale)

    # ---- the custom-op boundary: the only place that knows the order of the fields
    def as_op_args(self) -> tuple:
        """The fields as the positional scalars of a custom op, in
        :data:`DISTILL_OP_ARG_NAMES` order."""
        return (self.reduction, self.ignore_index, self.divergence, self.beta,
                self.temperature, self.softcap, self.logit_scale)

    @classmethod
    def from_op_args(cls, reduction, ignore_index, divergence, beta, temperature, softcap,
                     logit_scale) -> "DistillOptions":
        """The inverse of :meth:`as_op_args`."""
        return cls(reduction=reduction, ignore_index=ignore_index, divergence=divergence,
                   beta=beta, temperature=temperature, softcap=softcap,
                   logit_scale=logit_scale)


_DISTILL_CASTS = tuple((f.name, {"int": int, "float": float}[f.type])
                       for f in dataclasses.fields(DistillOptions))
DISTILL_OP_ARG_NAMES = ("reduction", "ignore_index", "divergence", "beta", "temperature",
                        "softcap", "logit_scale")
N_DISTILL_OP_ARGS = len(DISTILL_OP_ARG_NAMES)
