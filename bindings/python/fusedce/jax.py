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
handlers live in a small C++ shim, libfusedce_jax.so (``fusedce/jax_ffi/fusedce_jax.cc``),
which calls libfusedce's public C ABI; it is compiled on first use against the installed
jaxlib's FFI headers (``jax.ffi.include_dir()``) with the C++ compiler (``$CXX``, ``c++``) and
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
* Only the loss is differentiable: the extra outputs (``return_*``) are constants, and so are
  ``class_weights``. No higher-order derivatives (the gradients are not differentiable again).
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
not ``ignore_index`` gives a NaN loss (no host synchronisation to raise); class-probability
targets are not supported.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import functools
import os
import sys
import threading
from typing import NamedTuple, Optional, Tuple

import numpy as np

import jax
import jax.numpy as jnp
from jax import custom_batching, lax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from . import _lib
from . import jax_ffi as _shim_build

__all__ = ["cross_entropy", "linear_cross_entropy", "register", "shim_path",
           "DEFAULT_WORKSPACE_BYTES", "OUTPUT_FIELDS"]

DEFAULT_WORKSPACE_BYTES = 1 << 30
OUTPUT_FIELDS = ("loss", "z_loss", "token_accuracy", "predicted_tokens", "lse")
_REDUCTIONS = {"mean": 0, "sum": 1, "none": 2}
_NONE = 2
_F32 = jnp.float32
_OUTPUT_TYPES = {
    mask: collections.namedtuple(
        "CrossEntropyOutput",
        ("loss",) + tuple(f for i, f in enumerate(OUTPUT_FIELDS[1:]) if mask >> i & 1))
    for mask in range(1, 16)
}

# the FFI targets: name -> symbol prefix in the shim (+ "Cpu" / "Cuda")
_TARGETS = {
    "fusedce_ce_fwd": "FusedceCeForward",
    "fusedce_ce_bwd": "FusedceCeBackward",
    "fusedce_linear_ce": "FusedceLinearCe",
    "fusedce_scale": "FusedceScale",
}

# ----------------------------------------------------------------- registration ----
_LOCK = threading.Lock()
_SHIM = None
_SHIM_PATH = None


def register() -> str:
    """Load libfusedce (the Python binding's) and the shim (building it if needed), bind the
    shim to the library and register the FFI targets for the "cpu" and "CUDA" platforms. Done
    once, on the first call of :func:`cross_entropy` / :func:`linear_cross_entropy`; returns
    the shim's path."""
    global _SHIM, _SHIM_PATH
    with _LOCK:
        if _SHIM is not None:
            return _SHIM_PATH
        _lib.load()
        path = _shim_build.library_path()
        shim = ctypes.CDLL(path)
        shim.fce_jax_abi.restype = ctypes.c_uint
        shim.fce_jax_init.restype = ctypes.c_int
        shim.fce_jax_init.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        shim.fce_jax_init_error.restype = ctypes.c_char_p
        if shim.fce_jax_abi() != _shim_build.SHIM_ABI:
            raise ImportError("%s has handler ABI %d, this fusedce.jax expects %d: rebuild it "
                              "(python -m fusedce.jax build)" % (path, shim.fce_jax_abi(),
                                                                  _shim_build.SHIM_ABI))
        lib_path = _lib.library_path()
        if shim.fce_jax_init(os.fsencode(lib_path), _lib.options_size()) != 0:
            raise ImportError("fusedce.jax: binding %s to %s failed: %s" % (
                path, lib_path, shim.fce_jax_init_error().decode("utf-8", "replace")))
        for name, symbol in _TARGETS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(shim, symbol + "Cpu")),
                                        platform="cpu")
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(shim, symbol + "Cuda")),
                                        platform="CUDA")
        _SHIM, _SHIM_PATH = shim, path
        return path


def shim_path() -> Optional[str]:
    """The path of the loaded shim (None before :func:`register`)."""
    return _SHIM_PATH


# ---------------------------------------------------------------------- options ----
class _Cfg(NamedTuple):
    """The static options of one call (hashable: a nondiff argument of the custom_vjp)."""
    reduction: int
    ignore_index: int
    label_smoothing: float
    z_loss: float
    softcap: float
    logit_scale: float
    shift_seq_len: int
    shift: int                # 0 means 1 (the C default)
    token_scaling: bool
    extras: int               # 1 z_loss (library total, mean/sum), 2 accuracy, 4 argmax
    want_lse: bool
    workspace_bytes: int = 0  # linear CE only

    def attrs(self, rescale: bool = False) -> dict:
        iopts = np.array([self.reduction, self.ignore_index, self.shift_seq_len, self.shift,
                          int(self.token_scaling), self.workspace_bytes, int(rescale), 0],
                         dtype=np.int64)
        fopts = np.array([self.label_smoothing, self.z_loss, self.softcap, self.logit_scale],
                         dtype=np.float32)
        return {"iopts": iopts, "fopts": fopts}


def _reduction(reduction: str) -> int:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    return _REDUCTIONS[reduction]


def _resolve_shift(shift, shift_seq_len, target_shape: tuple, rows: int) -> Tuple[int, int]:
    """(T, k) for the C options, as fusedce.torch: ``shift_seq_len=T`` alone means k = 1;
    ``shift=k`` alone takes T = target.shape[-1]; k = 1 is passed as 0 (the C default)."""
    t, k = int(shift_seq_len), int(shift)
    if t < 0:
        raise ValueError(f"shift_seq_len must be >= 0, got {shift_seq_len}")
    if k < 0:
        raise ValueError(f"shift must be >= 0, got {shift}")
    if k:
        if not t:
            t = int(target_shape[-1]) if len(target_shape) else rows
        if k >= t:
            raise ValueError(f"shift must be in [0, {t}) (the sequence length), got {k}")
    if t and rows % t:
        raise ValueError(f"the {rows} rows are not a whole number of sequences of "
                         f"shift_seq_len={t}")
    return t, (0 if k == 1 else k)


def _parse_bytes(text: str) -> int:
    t = text.strip().upper().replace("IB", "").replace("B", "")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMGT" else t
    return int(float(num) * mult)


def _default_workspace_bytes() -> int:
    env = os.environ.get("FUSEDCE_WORKSPACE_BYTES")
    if env:
        try:
            return _parse_bytes(env)
        except (ValueError, IndexError):
            raise ValueError(f"FUSEDCE_WORKSPACE_BYTES={env!r} is not a byte count "
                             "(e.g. 1073741824, 512M, 1G)") from None
    return DEFAULT_WORKSPACE_BYTES


def _targets(targets) -> jax.Array:
    targets = jnp.asarray(targets)
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError("fusedce supports class-index targets only (an integer array), not "
                        f"{targets.dtype}")
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


def _empty(dtype=_F32) -> jax.Array:
    return jnp.zeros((0,), dtype)


def _sds(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def _extra_shapes(cfg: _Cfg, n: int):
    """(z_loss, accuracy, argmax-as-int32-pairs) output specs; (0,) for those not asked."""
    zl = _sds(() if cfg.extras & 1 and cfg.reduction != _NONE else (0,), _F32)
    acc = _sds(((n,) if cfg.reduction == _NONE else ()) if cfg.extras & 2 else (0,), _F32)
    # int64 argmax, written as int32 pairs (int64 arrays need jax_enable_x64): the low word
    # (little-endian) holds the class, -1 included
    am = _sds((n, 2) if cfg.extras & 4 else (0,), jnp.int32)
    return [zl, acc, am]


def _argmax_of(am: jax.Array) -> jax.Array:
    return am[:, 0] if am.ndim == 2 else am


# ------------------------------------------------------------------- workspaces ----
_CPU, _CUDA = _lib.FCE_BACKEND_CPU, _lib.FCE_BACKEND_CUDA
_FLOAT_CODES = {"float32": _lib.FCE_FLOAT32, "float16": _lib.FCE_FLOAT16,
                "bfloat16": _lib.FCE_BFLOAT16}
# A valid, aligned host address standing in the queries' options for the pointers the handler
# sets (class_weights, argmax, accuracy): the queries read only the options' values (and check
# the pointers' alignment), never the memory.
_PLACEHOLDER = np.zeros(4, np.int64)


@functools.lru_cache(maxsize=None)
def _cuda_usable() -> bool:
    """libfusedce has its CUDA backend and sees a device (asked once)."""
    try:
        return _lib.cuda_available()
    except Exception:  # pragma: no cover - a library that cannot answer has no CUDA for us
        return False


def _query_options(cfg: _Cfg, backend: int, dtype, target_dtype, class_weights: bool,
                   accuracy: bool = False, argmax: bool = False) -> _lib.Options:
    """The fce_options the shim's handler builds (MakeOptions, SetExtras in fusedce_jax.cc) for
    these static options, dtypes and optional buffers: what the workspace queries must see."""
    o = _lib.default_options()  # struct_size: _lib.options_size(), the shim's too (fce_jax_init)
    o.backend = backend
    o.dtype = _FLOAT_CODES[jnp.dtype(dtype).name]
    o.target_dtype = _lib.FCE_INT64 if jnp.dtype(target_dtype) == jnp.int64 else _lib.FCE_INT32
    o.reduction = cfg.reduction
    o.ignore_index = cfg.ignore_index
    o.shift_seq_len = cfg.shift_seq_len
    o.label_smoothing = cfg.label_smoothing
    o.z_loss_scale = cfg.z_loss
    o.softcap = cfg.softcap
    o.logit_scale = cfg.logit_scale
    placeholder = _PLACEHOLDER.ctypes.data
    if class_weights:
        o.class_weights = placeholder
    if o.struct_size >= _lib.FCE_OPTIONS_SIZE_V0_3:
        o.shift = cfg.shift
        o.token_scaling = 1 if cfg.token_scaling else 0
        o.argmax = placeholder if argmax else None
        o.accuracy = placeholder if accuracy else None
    else:  # the shim refuses these with a 0.1/0.2 library; say so now
        for on, what in ((cfg.shift, "shift"), (cfg.token_scaling, "use_token_scaling"),
                         (argmax, "return_predicted_tokens"),
                         (accuracy, "return_token_accuracy")):
            if on:
                _lib.require_options_v0_3(what)
    return o


def _per_platform(query) -> Tuple[int, int]:
    """(CPU bytes, CUDA bytes) from ``query(backend)``. CUDA where libfusedce has no usable CUDA
    backend gets 0 (its handler would say so at run time); a backend whose query fails gets 0
    as well, its handler then reporting the library's error, which is raised here instead when
    no backend answered (an option out of its domain: the library's message, at trace time)."""
    sizes = []
    answered, error = 0, None
    for backend, usable in ((_CPU, True), (_CUDA, _cuda_usable())):
        size = 0
        if usable:
            try:
                size = int(query(backend))
                answered += 1
            except _lib.FusedCEError as e:
                error = error or e
        sizes.append(size)
    if not answered and error is not None:
        raise error
    return sizes[0], sizes[1]


def _ce_workspace(function: str, cfg: _Cfg, logits, targets, cw, extras: bool):
    """fce_forward_workspace_size / fce_backward_workspace_size per platform."""
    n, v = logits.shape

    def query(backend):
        o = _query_options(cfg, backend, logits.dtype, targets.dtype, cw.shape[0] > 0,
                           accuracy=extras and bool(cfg.extras & 2),
                           argmax=extras and bool(cfg.extras & 4))
        out = ctypes.c_size_t(0)
        _lib.call(function, ctypes.byref(o), n, v, ctypes.byref(out))
        return out.value
    return _per_platform(query)


def _linear_workspace(cfg: _Cfg, hidden, weight, targets, cw, with_grad: bool):
    """fce_linear_ce's workspace per platform: on CUDA the fastest plan's (optimal_bytes) when
    it is within the budget cfg.workspace_bytes, else the budget, never below min_bytes; on the
    CPU min_bytes (the workspace only decides where the chunk buffers live, fusedce.h)."""
    n, d = hidden.shape
    v = weight.shape[0]
    budget = cfg.workspace_bytes

    def query(backend):
        o = _query_options(cfg, backend, hidden.dtype, targets.dtype, cw.shape[0] > 0,
                           accuracy=bool(cfg.extras & 2), argmax=bool(cfg.extras & 4))
        lo, hi = ctypes.c_size_t(0), ctypes.c_size_t(0)
        _lib.call("fce_linear_ce_workspace_size", ctypes.byref(o), n, d, v,
                  1 if with_grad else 0, ctypes.byref(lo), ctypes.byref(hi))
        if backend == _CPU:
            return lo.value
        return hi.value if hi.value < budget else max(budget, lo.value)
    return _per_platform(query)


def _ffi_call(target: str, outs, args, attrs: dict, workspace: Tuple[int, int],
              input_output_aliases=None):
    """The custom call ``target`` with the results ``outs`` and one more, the workspace
    ``uint8 [bytes]``, which is dropped; ``workspace``: (CPU bytes, CUDA bytes), staged with
    lax.platform_dependent when they differ (the "default" branch, CUDA's, also stands for
    platforms without a registered handler, which XLA then names). Batched by
    sequential_vmap around the call AND the drop, so vmap never stacks workspaces."""
    def call(nbytes: int):
        fn = jax.ffi.ffi_call(target, list(outs) + [_sds((nbytes,), jnp.uint8)],
                              vmap_method="sequential",
                              input_output_aliases=input_output_aliases)
        return lambda *a: tuple(fn(*a, **attrs)[:-1])

    cpu, cuda = workspace
    if cpu == cuda:
        body = call(cpu)
    else:
        on_cpu, on_cuda = call(cpu), call(cuda)

        def body(*a):
            return lax.platform_dependent(*a, cpu=on_cpu, default=on_cuda)
    return custom_batching.sequential_vmap(body)(*args)


# -------------------------------------------------------------------- the calls ----
# Each jitted: eager use compiles the custom call, its platform branch and the drop of the
# workspace together (the workspace is then an XLA temporary, never an array handed back);
# under an outer jit they are inlined.
@functools.partial(jax.jit, static_argnames=("cfg", "with_grad", "want_lse"))
def _ce_fwd_call(logits, targets, cw, cfg: _Cfg, with_grad: bool, want_lse: bool):
    """(loss, lse|(0,), z_loss, accuracy, argmax, grad|(0,)) from fusedce_ce_fwd."""
    n, v = logits.shape
    outs = [_sds((n,) if cfg.reduction == _NONE else (), _F32),
            _sds((n,) if want_lse else (0,), _F32)] + _extra_shapes(cfg, n) + [
            _sds((n, v) if with_grad else (0,), logits.dtype)]
    ws = _ce_workspace("fce_forward_workspace_size", cfg, logits, targets, cw, extras=True)
    return _ffi_call("fusedce_ce_fwd", outs, (logits, targets, cw), cfg.attrs(), ws)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _ce_bwd_call(logits, targets, cw, lse, ct, grad1, cfg: _Cfg):
    """fce_backward (grad1 None) or fce_backward_rescale in place on grad1."""
    rescale = grad1 is not None
    ws = _ce_workspace("fce_backward_workspace_size", cfg, logits, targets, cw, extras=False)
    (grad,) = _ffi_call(
        "fusedce_ce_bwd", [_sds(logits.shape, logits.dtype)],
        (logits, targets, cw, lse, ct, grad1 if rescale else _empty(logits.dtype)),
        cfg.attrs(rescale=rescale), ws, input_output_aliases={5: 0} if rescale else None)
    return grad


@functools.partial(jax.jit, static_argnames=("cfg", "need"))
def _linear_call(hidden, weight, bias, targets, cw, grad_output, cfg: _Cfg,
                 need: Tuple[bool, bool, bool]):
    """(loss, lse, z_loss, accuracy, argmax, grad_hidden, grad_weight, grad_bias) from
    fusedce_linear_ce; the gradients not in ``need`` are (0,)."""
    n, d = hidden.shape
    v = weight.shape[0]
    dt = hidden.dtype
    need_bias = need[2] and bias is not None
    outs = [_sds((n,) if cfg.reduction == _NONE else (), _F32),
            _sds((n,) if cfg.want_lse else (0,), _F32)] + _extra_shapes(cfg, n) + [
            _sds((n, d) if need[0] else (0,), dt),
            _sds((v, d) if need[1] else (0,), dt),
            _sds((v,) if need_bias else (0,), dt)]
    ws = _linear_workspace(cfg, hidden, weight, targets, cw,
                           with_grad=bool(need[0] or need[1] or need_bias))
    return _ffi_call("fusedce_linear_ce", outs,
                     (hidden, weight, bias if bias is not None else _empty(dt), targets, cw,
                      grad_output if grad_output is not None else _empty()), cfg.attrs(), ws)


def _scale(grad, ct):
    """grad * ct in place (fce_scale_gradient: a no-op launch when ct is exactly 1)."""
    return jax.ffi.ffi_call("fusedce_scale", _sds(grad.shape, grad.dtype),
                            vmap_method="sequential", input_output_aliases={0: 0})(
        grad, ct.astype(_F32).reshape(()))


def _primal(p):
    """(value, perturbed) of a custom_vjp(symbolic_zeros=True) forward-rule argument."""
    if isinstance(p, CustomVJPPrimal):
        return p.value, bool(p.perturbed)
    return p, False


def _is_zero(ct) -> bool:
    return ct is None or isinstance(ct, SymbolicZero)


# --------------------------------------------------------------- cross_entropy vjp ----
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ce(logits, targets, cw, cfg: _Cfg):
    loss, lse, zl, acc, am, _ = _ce_fwd_call(logits, targets, cw, cfg, False, cfg.want_lse)
    return loss, lse, zl, acc, am


def _ce_fwd(logits, targets, cw, cfg: _Cfg):
    z, dz = _primal(logits)
    y, _ = _primal(targets)
    w, _ = _primal(cw)
    if not dz:  # nothing to differentiate here
        loss, lse, zl, acc, am, _ = _ce_fwd_call(z, y, w, cfg, False, cfg.want_lse)
        return (loss, lse, zl, acc, am), None
    one_pass = cfg.reduction != _NONE
    loss, lse, zl, acc, am, grad1 = _ce_fwd_call(z, y, w, cfg, one_pass, True)
    out_lse = lse if cfg.want_lse else _empty()
    return (loss, out_lse, zl, acc, am), (z, y, w, lse, grad1 if one_pass else None)


def _ce_bwd(cfg: _Cfg, res, cts):
    ct = cts[0]
    if res is None or _is_zero(ct):
        return None, None, None
    z, y, w, lse, grad1 = res
    ct = jnp.asarray(ct, _F32).reshape((z.shape[0],) if cfg.reduction == _NONE else ())
    return _ce_bwd_call(z, y, w, lse, ct, grad1, cfg), None, None


_ce.defvjp(_ce_fwd, _ce_bwd, symbolic_zeros=True)


# -------------------------------------------------------- linear_cross_entropy vjp ----
def _need_marker(flags):
    """A pytree (residuals hold arrays only) saying which gradients the backward computes."""
    return tuple(() if f else None for f in flags)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _linear(hidden, weight, bias, targets, cw, cfg: _Cfg):
    loss, lse, zl, acc, am, _, _, _ = _linear_call(hidden, weight, bias, targets, cw, None, cfg,
                                                   (False, False, False))
    return loss, lse, zl, acc, am


def _linear_fwd(hidden, weight, bias, targets, cw, cfg: _Cfg):
    h, dh = _primal(hidden)
    wt, dw = _primal(weight)
    b, db = _primal(bias) if bias is not None else (None, False)
    y, _ = _primal(targets)
    w, _ = _primal(cw)
    db = db and b is not None
    if not (dh or dw or db):
        loss, lse, zl, acc, am, _, _, _ = _linear_call(h, wt, b, y, w, None, cfg,
                                                       (False, False, False))
        return (loss, lse, zl, acc, am), None
    out_lse = (lambda lse: lse if cfg.want_lse else _empty())
    if cfg.reduction != _NONE and not db:
        # gradients for an upstream 1 in the same call as the loss; scaled in the backward
        loss, lse, zl, acc, am, gh, gw, _ = _linear_call(h, wt, b, y, w, None, cfg,
                                                         (dh, dw, False))
        return (loss, out_lse(lse), zl, acc, am), ((gh if dh else None, gw if dw else None),
                                                    None)
    # reduction 'none' (per-row cotangent) or a bias to differentiate (its 16-bit sum would be
    # rounded twice by a scale): the loss now, everything with the real cotangent later
    loss, lse, zl, acc, am, _, _, _ = _linear_call(h, wt, b, y, w, None, cfg,
                                                   (False, False, False))
    return (loss, out_lse(lse), zl, acc, am), (None, ((h, wt, b, y, w), _need_marker(
        (dh, dw, db))))


def _linear_bwd(cfg: _Cfg, res, cts):
    ct = cts[0]
    nones = (None, None)
    if res is None or _is_zero(ct):
        return (None, None, None) + nones
    scaled, recompute = res
    if scaled is not None:
        gh, gw = scaled
        ct = jnp.asarray(ct, _F32).reshape(())
        return ((_scale(gh, ct) if gh is not None else None),
                (_scale(gw, ct) if gw is not None else None), None) + nones
    (h, wt, b, y, w), marker = recompute
    need = tuple(m is not None for m in marker)
    ct = jnp.asarray(ct, _F32).reshape((h.shape[0],) if cfg.reduction == _NONE else ())
    _, _, _, _, _, gh, gw, gb = _linear_call(h, wt, b, y, w, ct, cfg, need)
    return ((gh if need[0] else None), (gw if need[1] else None),
            (gb if need[2] else None)) + nones


_linear.defvjp(_linear_fwd, _linear_bwd, symbolic_zeros=True)


# ------------------------------------------------------------------ public API ----
def _output_mask(return_z_loss, return_token_accuracy, return_predicted_tokens, return_lse):
    return ((1 if return_z_loss else 0) | (2 if return_token_accuracy else 0)
            | (4 if return_predicted_tokens else 0) | (8 if return_lse else 0))


def _row_targets(y, ignore_index: int, t: int, k: int):
    """The target each row is scored against (SEMANTICS.md rule 1)."""
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


def _z_loss_rows(lse, y, vocab: int, cfg: _Cfg, target_logit):
    """Per-row z-loss for reduction 'none' (Liger's), as fusedce.torch: lambda * lse^2 for the
    counted rows (times the constant p_y with token scaling), 0 for ignored rows."""
    if cfg.z_loss == 0.0:
        return jnp.zeros_like(lse)
    y = _row_targets(y, cfg.ignore_index, cfg.shift_seq_len, cfg.shift)
    counted = y != cfg.ignore_index
    zl = cfg.z_loss * jnp.square(lse)
    if cfg.token_scaling:
        valid = counted & (y >= 0) & (y < vocab)
        a_y = _transform(target_logit(jnp.clip(y, 0, vocab - 1)), cfg.logit_scale, cfg.softcap)
        zl = jnp.where(valid, zl * jnp.exp(a_y - lse), zl)
    return jnp.where(counted, zl, jnp.zeros_like(zl))


def _finish(mask: int, cfg: _Cfg, out_shape, outs, z_rows):
    loss, lse, zl, acc, am = outs
    rows = (lambda t: t.reshape(out_shape))
    if cfg.reduction == _NONE:
        loss = rows(loss)
    if not mask:
        return loss
    sg = lax.stop_gradient
    values = [loss]
    if mask & 1:
        values.append(sg(rows(z_rows(sg(lse))) if cfg.reduction == _NONE else zl))
    if mask & 2:
        values.append(sg(rows(acc) if cfg.reduction == _NONE else acc))
    if mask & 4:
        values.append(rows(_argmax_of(am)))
    if mask & 8:
        values.append(sg(rows(lse)))
    return _OUTPUT_TYPES[mask](*values)


def _zero_rows_result(mask, cfg, out_shape, n_dtype_like):
    """The result for zero rows (no library call: it needs rows >= 1)."""
    loss = jnp.zeros(out_shape if cfg.reduction == _NONE else (), _F32)
    if not mask:
        return loss
    empty_rows = jnp.zeros(out_shape, _F32)
    values = [loss]
    if mask & 1:
        values.append(empty_rows if cfg.reduction == _NONE else jnp.zeros((), _F32))
    if mask & 2:
        values.append(empty_rows if cfg.reduction == _NONE else jnp.zeros((), _F32))
    if mask & 4:
        values.append(jnp.zeros(out_shape, jnp.int32))
    if mask & 8:
        values.append(empty_rows)
    return _OUTPUT_TYPES[mask](*values)


def cross_entropy(logits, targets, *, reduction: str = "mean", ignore_index: int = -100,
                  class_weights=None, label_smoothing: float = 0.0, z_loss: float = 0.0,
                  softcap: float = 0.0, logit_scale: float = 1.0, shift_seq_len: int = 0,
                  shift: int = 0, use_token_scaling: bool = False,
                  return_z_loss: bool = False, return_token_accuracy: bool = False,
                  return_predicted_tokens: bool = False, return_lse: bool = False):
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
    return_z_loss, return_token_accuracy, return_predicted_tokens, return_lse  also return
                  these (constants, from the same library call), in a ``CrossEntropyOutput``
                  named tuple ``(loss, z_loss, token_accuracy, predicted_tokens, lse)`` holding
                  the loss and the outputs asked for, in that order (as fusedce.torch;
                  predicted_tokens is int32).

    The loss is float32 (computed in float32 inside for 16-bit logits). Differentiable in
    ``logits`` (``jax.grad``, ``jax.vjp``; not ``jax.jvp``/``jax.jacfwd``, a custom_vjp).
    """
    red = _reduction(reduction)
    z = _float(logits, "logits")
    if z.ndim < 1:
        raise ValueError("logits must have at least one dimension (the classes)")
    y_in = jnp.asarray(targets)
    vocab = z.shape[-1]
    if vocab < 1:
        raise ValueError("logits must have at least one class")
    rows = int(np.prod(z.shape[:-1], dtype=np.int64))
    z = z.reshape(rows, vocab)
    y = _targets(y_in)
    if y.shape[0] != rows:
        raise ValueError(f"targets has {y.shape[0]} elements for {rows} rows of logits "
                         f"(logits {tuple(jnp.shape(logits))}, targets {tuple(y_in.shape)})")
    out_shape = tuple(y_in.shape)
    t, k = _resolve_shift(shift, shift_seq_len, out_shape, rows)
    mask = _output_mask(return_z_loss, return_token_accuracy, return_predicted_tokens,
                        return_lse)
    want_lse = bool(mask & 8) or (bool(mask & 1) and red == _NONE)
    cfg = _Cfg(red, int(ignore_index), float(label_smoothing), float(z_loss), float(softcap),
               float(logit_scale), t, k, bool(use_token_scaling), mask & 7, want_lse)
    if rows == 0:
        return _zero_rows_result(mask, cfg, out_shape, z)
    register()
    outs = _ce(z, y, _class_weights(class_weights, vocab), cfg)
    return _finish(mask, cfg, out_shape, outs, lambda lse: _z_loss_rows(
        lse, y, vocab, cfg,
        lambda yy: jnp.take_along_axis(lax.stop_gradient(z), yy[:, None], axis=1)[:, 0]))


def linear_cross_entropy(hidden, weight, targets, bias=None, *, reduction: str = "mean",
                         ignore_index: int = -100, class_weights=None,
                         label_smoothing: float = 0.0, z_loss: float = 0.0,
                         softcap: float = 0.0, logit_scale: float = 1.0,
                         shift_seq_len: int = 0, shift: int = 0,
                         use_token_scaling: bool = False, return_z_loss: bool = False,
                         return_token_accuracy: bool = False,
                         return_predicted_tokens: bool = False, return_lse: bool = False,
                         workspace_bytes: Optional[int] = None):
    """``cross_entropy(hidden @ weight.T + bias, targets, ...)`` without ever holding the
    [N, V] logits (fce_linear_ce): hidden [..., D] (leading dimensions flattened into rows),
    weight [V, D] (a Dense(D -> V) kernel transposed, or a tied embedding table), bias [V] or
    None, targets [...] (the leading dimensions of hidden). hidden, weight and bias must have
    one dtype (float32, float16 or bfloat16; cast a float32 master copy to the compute dtype
    before the call: JAX's cast carries the gradient back). The other keywords and the return
    convention are :func:`cross_entropy`'s.

    Differentiable in hidden, weight and bias (only the ones being differentiated are
    computed). workspace_bytes: the CUDA workspace budget beyond the inputs and the gradients
    (None: FUSEDCE_WORKSPACE_BYTES, else 1 GiB): the custom call's workspace result (an XLA
    temporary under jit) is the library's fastest plan's size when that fits, else the budget,
    never below the library's minimum (a few MiB); the CPU backend gets the minimum. The loss is
    float32.
    """
    red = _reduction(reduction)
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
    y = _targets(y_in)
    if y.shape[0] != rows:
        raise ValueError(f"targets has {y.shape[0]} elements for {rows} rows of hidden "
                         f"(hidden {tuple(jnp.shape(hidden))}, targets {tuple(y_in.shape)})")
    out_shape = tuple(y_in.shape)
    t, k = _resolve_shift(shift, shift_seq_len, out_shape, rows)
    budget = _default_workspace_bytes() if workspace_bytes is None else int(workspace_bytes)
    if budget < 0:
        raise ValueError(f"workspace_bytes must be >= 0, got {workspace_bytes}")
    mask = _output_mask(return_z_loss, return_token_accuracy, return_predicted_tokens,
                        return_lse)
    want_lse = bool(mask & 8) or (bool(mask & 1) and red == _NONE)
    cfg = _Cfg(red, int(ignore_index), float(label_smoothing), float(z_loss), float(softcap),
               float(logit_scale), t, k, bool(use_token_scaling), mask & 7, want_lse, budget)
    if rows == 0:
        return _zero_rows_result(mask, cfg, out_shape, h)
    register()
    outs = _linear(h, wt, b, y, _class_weights(class_weights, vocab), cfg)

    def target_logit(yy):
        hh, ww = lax.stop_gradient(h), lax.stop_gradient(wt)
        a = jnp.sum(hh.astype(_F32) * ww[yy].astype(_F32), axis=-1)
        if b is not None:
            a = a + lax.stop_gradient(b)[yy].astype(_F32)
        return a

    return _finish(mask, cfg, out_shape, outs,
                   lambda lse: _z_loss_rows(lse, y, vocab, cfg, target_logit))


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
