"""The FFI-call layer of fusedce.jax: registration of the XLA FFI targets of the shim
(libfusedce_jax.so, fusedce/jax_ffi), the flattening of a call's options into the shim's
attributes (:func:`_attrs`), the workspaces sized at trace time with the library's own queries
(per platform), and the jitted custom calls themselves. The custom_vjp wiring is in
_jax_vjp.py, the public functions in jax.py. How the workspace is handled: the docstring of
:mod:`fusedce.jax` ("Workspaces").
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from typing import Optional, Tuple

import numpy as np

import jax
import jax.numpy as jnp
from jax import custom_batching, lax

from . import _alloc, _lib
from . import jax_ffi as _shim_build
from ._args import _build_options
from ._options import CEOptions, Want

_NONE = 2  # FCE_REDUCTION_NONE
_F32 = jnp.float32

# the FFI targets: name -> symbol prefix in the shim (+ "Cpu" / "Cuda")
_TARGETS = {
    "fusedce_ce_fwd": "FusedceCeForward",
    "fusedce_ce_bwd": "FusedceCeBackward",
    "fusedce_linear_ce": "FusedceLinearCe",
    "fusedce_scale": "FusedceScale",
    "fusedce_distill": "FusedceDistill",
    "fusedce_linear_distill": "FusedceLinearDistill",
}

# ----------------------------------------------------------------- registration ----
_LOCK = threading.Lock()
_SHIM = None
_SHIM_PATH = None


def register() -> str:
    """Load libfusedce (the Python binding's) and the shim (building it if needed), bind the
    shim to the library and register the FFI targets for the "cpu" and "CUDA" platforms. Done
    once, on the first call of :func:`cross_entropy` / :func:`linear_cross_entropy` (or of
    the distillation calls); returns the shim's path."""
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
# The static arguments of a call: one CEOptions (the caller's options), one Want (what the
# library call writes: Want.from_library) and, for fce_linear_ce, the workspace budget; all
# hashable (nondiff arguments of the custom_vjp, static arguments of the jitted calls).
def _attrs(opts: CEOptions, workspace_bytes: int = 0, rescale: bool = False) -> dict:
    """The shim's attributes for these options: the one place they are flattened
    (CEOptions.as_ffi_attrs knows the order)."""
    iopts, fopts = opts.as_ffi_attrs(workspace_bytes, rescale)
    return {"iopts": np.array(iopts, dtype=np.int64), "fopts": np.array(fopts, dtype=np.float32)}


def _empty(dtype=_F32) -> jax.Array:
    return jnp.zeros((0,), dtype)


def _sds(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def _extra_shapes(want: Want, reduction: int, n: int):
    """(z_loss, accuracy, argmax-as-int32-pairs, entropy) output specs; (0,) for those not
    asked."""
    zl = _sds(() if want.z_loss else (0,), _F32)
    acc = _sds(((n,) if reduction == _NONE else ()) if want.accuracy else (0,), _F32)
    # int64 argmax, written as int32 pairs (int64 arrays need jax_enable_x64): the low word
    # (little-endian) holds the class, -1 included
    am = _sds((n, 2) if want.argmax else (0,), jnp.int32)
    return [zl, acc, am, _sds((n,) if want.entropy else (0,), _F32)]


def _or_empty(x) -> jax.Array:
    """An optional float32 input of a custom call: x, or an empty (0,) array for None."""
    return _empty() if x is None else jnp.asarray(x, _F32)


def _argmax_of(am: jax.Array) -> jax.Array:
    return am[:, 0] if am.ndim == 2 else am


# ------------------------------------------------------------------- workspaces ----
_CPU, _CUDA = _lib.FCE_BACKEND_CPU, _lib.FCE_BACKEND_CUDA
_FLOAT_CODES = {"float32": _lib.FCE_FLOAT32, "float16": _lib.FCE_FLOAT16,
                "bfloat16": _lib.FCE_BFLOAT16}
# A valid, aligned host address standing in the queries' options for the class weights the
# handler passes: the queries read only the options' values (and check the pointer's
# alignment), never the memory.
_PLACEHOLDER = np.zeros(4, np.int64)


@functools.lru_cache(maxsize=None)
def _cuda_usable() -> bool:
    """libfusedce has its CUDA backend and sees a device (asked once)."""
    try:
        return _lib.cuda_available()
    except Exception:  # pragma: no cover - a library that cannot answer has no CUDA for us
        return False


def _target_code(target_dtype) -> int:
    """The fce_dtype of a call's targets: class indices (int32/int64), or class probabilities
    of a float dtype (docs/semantics.md rule 19)."""
    name = jnp.dtype(target_dtype).name
    if name in _FLOAT_CODES:
        return _FLOAT_CODES[name]
    return _lib.FCE_INT64 if name == "int64" else _lib.FCE_INT32


def _query_options(opts: CEOptions, backend: int, dtype, target_dtype,
                   class_weights: bool) -> _lib.Options:
    """The fce_options the shim's handler builds (MakeOptions in fusedce_jax.cc) for these
    options, dtypes and class weights: what the workspace queries must see."""
    return _build_options(
        opts, backend=backend, dtype=_FLOAT_CODES[jnp.dtype(dtype).name],
        target_dtype=_target_code(target_dtype),
        class_weights_ptr=_PLACEHOLDER.ctypes.data if class_weights else 0)


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


def _ce_workspace(function: str, opts: CEOptions, logits, targets, cw):
    """fce_forward_workspace_size / fce_backward_workspace_size per platform (a failure raised
    as fce_forward's / fce_backward's: the call the query sizes)."""
    n, v = logits.shape

    def query(backend):
        o = _query_options(opts, backend, logits.dtype, targets.dtype, cw.shape[0] > 0)
        out = ctypes.c_size_t(0)
        _alloc.query_for(function[:-len("_workspace_size")], function, ctypes.byref(o), n, v,
                         ctypes.byref(out))
        return out.value
    return _per_platform(query)


def _linear_workspace(opts: CEOptions, budget: int, hidden, weight, targets, cw,
                      with_grad: bool):
    """fce_linear_ce's workspace per platform: on CUDA the fastest plan's (optimal_bytes) when
    it is within the budget (workspace_bytes), else the budget, never below min_bytes; on the
    CPU min_bytes (the workspace only decides where the chunk buffers live, fusedce.h)."""
    n, d = hidden.shape
    v = weight.shape[0]

    def query(backend):
        o = _query_options(opts, backend, hidden.dtype, targets.dtype, cw.shape[0] > 0)
        lo, hi = ctypes.c_size_t(0), ctypes.c_size_t(0)
        _alloc.query_for("fce_linear_ce", "fce_linear_ce_workspace_size", ctypes.byref(o), n, d,
                         v, 1 if with_grad else 0, ctypes.byref(lo), ctypes.byref(hi))
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
@functools.partial(jax.jit, static_argnames=("opts", "want", "with_grad"))
def _ce_fwd_call(logits, targets, cw, opts: CEOptions, want: Want, with_grad: bool,
                 upstream=(None, None, None)):
    """(loss, lse|(0,), z_loss, accuracy, argmax, entropy|(0,), grad|(0,)) from fusedce_ce_fwd;
    ``want``: what the library writes (lse only when want.lse); ``upstream``: the upstream
    gradients (grad_output, grad_lse, grad_entropy; None: 1, 0, 0) of the gradient written."""
    n, v = logits.shape
    outs = [_sds((n,) if opts.per_row else (), _F32),
            _sds((n,) if want.lse else (0,), _F32)] + _extra_shapes(want, opts.reduction, n) + [
            _sds((n, v) if with_grad else (0,), logits.dtype)]
    ws = _ce_workspace("fce_forward_workspace_size", opts, logits, targets, cw)
    return _ffi_call("fusedce_ce_fwd", outs,
                     (logits, targets, cw) + tuple(_or_empty(u) for u in upstream),
                     _attrs(opts), ws)


@functools.partial(jax.jit, static_argnames=("opts",))
def _ce_bwd_call(logits, targets, cw, lse, ct, grad1, opts: CEOptions, grad_lse=None):
    """fce_backward (grad1 None; with grad_lse, the upstream gradient of lse, when given) or
    fce_backward_rescale in place on grad1."""
    rescale = grad1 is not None
    ws = _ce_workspace("fce_backward_workspace_size", opts, logits, targets, cw)
    (grad,) = _ffi_call(
        "fusedce_ce_bwd", [_sds(logits.shape, logits.dtype)],
        (logits, targets, cw, lse, ct, grad1 if rescale else _empty(logits.dtype),
         _or_empty(grad_lse)),
        _attrs(opts, rescale=rescale), ws, input_output_aliases={5: 0} if rescale else None)
    return grad


@functools.partial(jax.jit, static_argnames=("opts", "want", "workspace_bytes", "need"))
def _linear_call(hidden, weight, bias, targets, cw, grad_output, opts: CEOptions, want: Want,
                 workspace_bytes: int, need: Tuple[bool, bool, bool], grad_lse=None,
                 grad_entropy=None):
    """(loss, lse, z_loss, accuracy, argmax, entropy, grad_hidden, grad_weight, grad_bias)
    from fusedce_linear_ce; ``want``: what the library writes; the gradients not in ``need``
    are (0,), those asked for include lse's and the entropy's for grad_lse / grad_entropy
    (None: 0); ``workspace_bytes``: the CUDA workspace budget."""
    n, d = hidden.shape
    v = weight.shape[0]
    dt = hidden.dtype
    need_bias = need[2] and bias is not None
    outs = [_sds((n,) if opts.per_row else (), _F32),
            _sds((n,) if want.lse else (0,), _F32)] + _extra_shapes(want, opts.reduction, n) + [
            _sds((n, d) if need[0] else (0,), dt),
            _sds((v, d) if need[1] else (0,), dt),
            _sds((v,) if need_bias else (0,), dt)]
    ws = _linear_workspace(opts, workspace_bytes, hidden, weight, targets, cw,
                           with_grad=bool(need[0] or need[1] or need_bias))
    return _ffi_call("fusedce_linear_ce", outs,
                     (hidden, weight, bias if bias is not None else _empty(dt), targets, cw,
                      _or_empty(grad_output), _or_empty(grad_lse), _or_empty(grad_entropy)),
                     _attrs(opts, workspace_bytes), ws)


def _scale(grad, ct):
    """grad * ct in place (fce_scale_gradient: a no-op launch when ct is exactly 1)."""
    return jax.ffi.ffi_call("fusedce_scale", _sds(grad.shape, grad.dtype),
                            vmap_method="sequential", input_output_aliases={0: 0})(
        grad, ct.astype(_F32).reshape(()))
