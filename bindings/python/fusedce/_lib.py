"""The ctypes core: find and load libfusedce, mirror include/fusedce.h, raise on statuses.

Everything here is a one-to-one image of the C header written for FCE_VERSION 1.0.0; nothing
above the C ABI (arrays, allocation, frameworks) lives in this module (see core.py); the status
codes and their exceptions are in _errors.py.

Library versions (the rule every binding follows, bindings/README.md "Library versions"): the
library's major version must equal the binding's (:class:`VersionMismatchError` otherwise); an
older minor is accepted, and what it lacks raises :class:`UnsupportedError` "<feature>: needs
libfusedce >= 0.x; the loaded library (...) is 0.y.z" when asked for; a newer minor is accepted.
What "lacks" means here: a function added later (:data:`SINCE`: calling one the
library does not have raises, and :func:`require_vp` / :func:`has_vp` for the
vocabulary-parallel calls, 0.4; :func:`has_vp_linear_ce` for their one-call fused linear CE,
fce_vp_linear_ce, 0.5, which fusedce.torch.distributed uses when it is there).

The library is searched in this order:
  1. the path in the environment variable FUSEDCE_LIBRARY (a file, or a folder holding
     libfusedce.so or libfusedce.so.0), when it is set: an explicit choice, never silently
     replaced by another library;
  2. inside this package: fusedce/lib/libfusedce.so* (where the wheels, ``pip install .`` and
     ``pip wheel`` put the library), then fusedce/libfusedce.so* (where a developer
     may copy one);
  3. the system: ctypes.util.find_library("fusedce"), then "libfusedce.so.0" (the soname) and
     "libfusedce.so" through the dynamic loader's own path (LD_LIBRARY_PATH, ldconfig).
:func:`library_origin` says which of them the loaded library came from.

cuBLASLt (the CUDA backend's GEMMs) is not linked into libfusedce: the library loads
libcublasLt.so.<CUDA major> itself the first time the CUDA backend is asked for with a device
(lib/cuda/cublaslt_loader.cpp: FUSEDCE_CUBLASLT, a copy already in the process, the nvidia-cublas
wheel in the package's own site-packages, the dynamic loader's path). Before loading a library
that pip built with the CUDA backend (fusedce/_build.py says which cuBLASLt), this module
preloads that cuBLASLt from the ``nvidia`` namespace package wherever it is on sys.path, as
torch does for its own CUDA libraries, so that fusedce and nvidia-cublas installed into two
different site-packages folders still find each other (:func:`cublaslt_preload` says what
happened). Skipped when FUSEDCE_CUBLASLT is set, when the soname is already loaded, and on a
machine with no NVIDIA driver (no /proc/driver/nvidia, /dev/nvidiactl or /dev/dxg), where the
~0.5 GB library would cost an import second for nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
import threading

# fce_status and the exception of each status: fusedce/_errors.py (re-exported here)
from ._errors import (FCE_ERROR_BACKEND_UNAVAILABLE, FCE_ERROR_CUBLAS, FCE_ERROR_CUDA,  # noqa: F401
                      FCE_ERROR_INTERNAL, FCE_ERROR_INVALID_ARGUMENT, FCE_ERROR_MISALIGNED,
                      FCE_ERROR_NULL_POINTER, FCE_ERROR_OUT_OF_MEMORY, FCE_ERROR_UNSUPPORTED,
                      FCE_ERROR_WORKSPACE_TOO_SMALL, FCE_SUCCESS, BackendUnavailableError,
                      CublasError, CudaError, FusedCEError, InternalError, InvalidArgumentError,
                      LibraryNotFoundError, MisalignedError, NullPointerError, OutOfMemoryError,
                      UnsupportedError, VersionMismatchError, WorkspaceTooSmallError,
                      error_for_status)
from ._errors import ERRORS as _ERRORS  # noqa: F401
from ._errors import set_status_lookup as _set_status_lookup

# ---------------------------------------------------------------- the header we mirror ----
HEADER_VERSION_MAJOR = 1
HEADER_VERSION_MINOR = 0
HEADER_VERSION_PATCH = 0
HEADER_VERSION_NUMBER = (HEADER_VERSION_MAJOR * 10000 + HEADER_VERSION_MINOR * 100
                         + HEADER_VERSION_PATCH)

# fce_dtype
FCE_FLOAT32 = 0
FCE_FLOAT16 = 1
FCE_BFLOAT16 = 2
FCE_INT32 = 3
FCE_INT64 = 4

# fce_reduction
FCE_REDUCTION_MEAN = 0
FCE_REDUCTION_SUM = 1
FCE_REDUCTION_NONE = 2

# fce_backend
FCE_BACKEND_CUDA = 0
FCE_BACKEND_CPU = 1

# error_flags bits
FCE_FLAG_TARGET_OUT_OF_RANGE = 1
FCE_FLAG_SHARDS_INCONSISTENT = 2  # 0.4: gathered vocabulary shards that do not tile [0, V)

# vocabulary-parallel (0.4): float32 per row of a shard's statistics (the layout is internal)
FCE_VP_STATS = 8
FCE_VP_STATS_INVARIANT = 44
# vocabulary-parallel distillation (1.0): the same, per row and round
FCE_VP_DISTILL_STATS = 8


class Options(ctypes.Structure):
    """fce_options, field for field. Only ever appended to, like the C struct."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("class_weights", ctypes.c_void_p),
        ("ignore_index", ctypes.c_int64),
        ("row_stride", ctypes.c_int64),
        ("grad_row_stride", ctypes.c_int64),
        ("shift_seq_len", ctypes.c_int64),
        ("hidden_row_stride", ctypes.c_int64),
        ("backend", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
        ("target_dtype", ctypes.c_int32),
        ("reduction", ctypes.c_int32),
        ("label_smoothing", ctypes.c_float),
        ("z_loss_scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("logit_scale", ctypes.c_float),
        ("deterministic", ctypes.c_int32),
        ("accumulate", ctypes.c_int32),
        ("grad_weight_fp32", ctypes.c_int32),
        ("vp_entropy", ctypes.c_int32),
        ("shift", ctypes.c_int64),
        ("token_scaling", ctypes.c_int32),
        ("batch_invariant", ctypes.c_int32),
    ]


class Outputs(ctypes.Structure):
    """fce_outputs: what a call writes besides the gradients (addresses in the backend's memory,
    None for NULL). Only ever appended to, like the C struct."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("loss", ctypes.c_void_p),         # float* [1] (mean/sum) or [rows] (none)
        ("lse", ctypes.c_void_p),          # float* [rows], or NULL
        ("z_loss", ctypes.c_void_p),       # float* [1], or NULL
        ("argmax", ctypes.c_void_p),       # int64_t* [rows], or NULL
        ("accuracy", ctypes.c_void_p),     # float* [1] (mean/sum) or [rows] (none), or NULL
        ("error_flags", ctypes.c_void_p),  # uint32_t* [1], or NULL
        ("entropy", ctypes.c_void_p),      # float* [rows], or NULL
    ]


class Gradients(ctypes.Structure):
    """fce_gradients: the gradients a call writes and the upstream gradient (addresses in the
    backend's memory, None for NULL). Only ever appended to, like the C struct."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("grad_output", ctypes.c_void_p),
        ("grad_logits", ctypes.c_void_p),
        ("grad_hidden", ctypes.c_void_p),
        ("grad_weight", ctypes.c_void_p),
        ("grad_bias", ctypes.c_void_p),
        ("grad_hidden_dtype", ctypes.c_int32),
        ("reserved0", ctypes.c_int32),
        ("grad_lse", ctypes.c_void_p),      # const float* [rows], or NULL (= 0)
        ("grad_entropy", ctypes.c_void_p),  # const float* [rows], or NULL (= 0)
    ]


# fce_vp_all_gather_fn: fce_status (*)(void* context, const float* send, float* recv,
# int64_t count, void* stream), the all-gather fce_vp_linear_ce runs its collective through
# (fce_vp_shard.all_gather).
# The pointers arrive as ints (None for NULL); a Python exception must not escape it (ctypes
# would print it and return 0, FCE_SUCCESS): catch it, return a failing status, re-raise it
# after the call. Keep the object alive for as long as the call runs.
VP_ALL_GATHER_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)


class VpShard(ctypes.Structure):
    """fce_vp_shard: where this rank's vocabulary shard lies, and (fce_vp_linear_ce only) the
    all-gather that reaches the other ranks."""

    _fields_ = [
        ("ranks", ctypes.c_int64),
        ("vocab_total", ctypes.c_int64),
        ("vocab_start", ctypes.c_int64),
        ("vocab_local", ctypes.c_int64),
        ("all_gather", VP_ALL_GATHER_FN),
        ("context", ctypes.c_void_p),
    ]


# fce_divergence (distillation)
FCE_DIVERGENCE_FORWARD_KL = 0  # KL(teacher || student)
FCE_DIVERGENCE_REVERSE_KL = 1  # KL(student || teacher)
FCE_DIVERGENCE_JSD = 2         # generalised JSD(beta), Liger's definition


class Teacher(ctypes.Structure):
    """fce_teacher: the teacher of a distillation call (addresses in the backend's memory, None
    for NULL). Only ever appended to, like the C struct."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("divergence", ctypes.c_int32),
        ("beta", ctypes.c_float),
        ("temperature", ctypes.c_float),
        ("reserved0", ctypes.c_int32),
        ("logits", ctypes.c_void_p),             # fce_distill: [rows, row_stride]
        ("row_stride", ctypes.c_int64),
        ("hidden_states", ctypes.c_void_p),      # fce_linear_distill: [rows, hidden_row_stride]
        ("weight", ctypes.c_void_p),             # fce_linear_distill: [vocab, hidden]
        ("hidden", ctypes.c_int64),
        ("hidden_row_stride", ctypes.c_int64),
    ]


# sizeof of the versioned structs on every LP64 platform the library supports.
FCE_OPTIONS_SIZE_V1_0 = 120
FCE_OUTPUTS_SIZE_V1_0 = 64
FCE_GRADIENTS_SIZE_V1_0 = 72
FCE_TEACHER_SIZE_V1_0 = 72
OPTIONS_C_SIZEOF = FCE_OPTIONS_SIZE_V1_0
assert ctypes.sizeof(Options) == OPTIONS_C_SIZEOF, ctypes.sizeof(Options)
assert ctypes.sizeof(Outputs) == FCE_OUTPUTS_SIZE_V1_0, ctypes.sizeof(Outputs)
assert ctypes.sizeof(Gradients) == FCE_GRADIENTS_SIZE_V1_0, ctypes.sizeof(Gradients)
assert ctypes.sizeof(Teacher) == FCE_TEACHER_SIZE_V1_0, ctypes.sizeof(Teacher)


def outputs(loss=None, lse=None, z_loss=None, argmax=None, accuracy=None,
            error_flags=None, entropy=None) -> Outputs:
    """An fce_outputs of these addresses (ints, or None / 0 for NULL), by name."""
    return Outputs(FCE_OUTPUTS_SIZE_V1_0, loss or None, lse or None, z_loss or None,
                   argmax or None, accuracy or None, error_flags or None, entropy or None)


def gradients(grad_output=None, grad_logits=None, grad_hidden=None, grad_weight=None,
              grad_bias=None, grad_hidden_dtype=FCE_FLOAT32, grad_lse=None,
              grad_entropy=None) -> Gradients:
    """An fce_gradients of these addresses (ints, or None / 0 for NULL), by name."""
    return Gradients(FCE_GRADIENTS_SIZE_V1_0, grad_output or None, grad_logits or None,
                     grad_hidden or None, grad_weight or None, grad_bias or None,
                     int(grad_hidden_dtype), 0, grad_lse or None, grad_entropy or None)


def teacher(divergence=FCE_DIVERGENCE_FORWARD_KL, beta=0.5, temperature=1.0, logits=None,
            row_stride=0, hidden_states=None, weight=None, hidden=0,
            hidden_row_stride=0) -> Teacher:
    """An fce_teacher of these values and addresses (ints, or None / 0 for NULL), by name; the
    defaults are FCE_TEACHER_INIT's."""
    return Teacher(FCE_TEACHER_SIZE_V1_0, int(divergence), float(beta), float(temperature), 0,
                   logits or None, int(row_stride), hidden_states or None, weight or None,
                   int(hidden), int(hidden_row_stride))


def shard(ranks, vocab_total, vocab_start, vocab_local, all_gather=None) -> VpShard:
    """An fce_vp_shard; all_gather: a VP_ALL_GATHER_FN (fce_vp_linear_ce), else NULL."""
    s = VpShard(int(ranks), int(vocab_total), int(vocab_start), int(vocab_local))
    if all_gather is not None:
        s.all_gather = all_gather
    return s


# --------------------------------------------------------------------------- loading ----
_LIB = None
_LIB_PATH = None
_LIB_ORIGIN = None
_LIB_VERSION = 0
_LIB_MISSING = frozenset()  # the functions added after 0.1 that the loaded library lacks
_CUBLASLT_PRELOAD = "not tried"
_LOCK = threading.Lock()

# where the package's own copy of the library lives (CMakeLists.txt's last block installs it)
PACKAGED_LIBRARY_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib")


def _candidates():
    """(origin, path-or-name) pairs, in search order."""
    env = os.environ.get("FUSEDCE_LIBRARY")
    if env:
        if os.path.isdir(env):
            for name in ("libfusedce.so", "libfusedce.so.%d" % HEADER_VERSION_MAJOR,
                         "libfusedce.dylib"):
                yield ("FUSEDCE_LIBRARY", os.path.join(env, name))
        else:
            yield ("FUSEDCE_LIBRARY", env)
        return  # an explicit choice is never silently replaced by another library
    here = os.path.dirname(PACKAGED_LIBRARY_DIR)
    for folder, origin in ((PACKAGED_LIBRARY_DIR, "packaged"), (here, "beside the package")):
        for path in sorted(glob.glob(os.path.join(folder, "libfusedce.so*"))) + sorted(
            glob.glob(os.path.join(folder, "libfusedce*.dylib"))
        ):
            yield (origin, path)
    found = ctypes.util.find_library("fusedce")
    if found:
        yield ("ctypes.util.find_library", found)
    yield ("system loader", "libfusedce.so.%d" % HEADER_VERSION_MAJOR)
    yield ("system loader", "libfusedce.so")


_DRIVER_MARKERS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg")


def _preload_cublaslt() -> str:
    """Load the cuBLASLt this package's library was built for from an ``nvidia`` namespace
    package on sys.path (see the module's docstring); returns what happened, in words."""
    try:
        from . import _build
    except ImportError:
        return "not needed (no fusedce/_build.py: a source tree; the library looks itself)"
    if not _build.CUDA_BACKEND:
        return "not needed (the packaged library has no CUDA backend)"
    if os.environ.get("FUSEDCE_CUBLASLT"):
        return "skipped: FUSEDCE_CUBLASLT is set (the library loads that file)"
    soname = _build.CUBLASLT_SONAME
    try:
        ctypes.CDLL(soname, mode=os.RTLD_NOLOAD)
        return "not needed: %s is already loaded in the process" % soname
    except OSError:
        pass
    if not any(os.path.exists(m) for m in _DRIVER_MARKERS):
        return "skipped: no NVIDIA driver on this machine (%s)" % ", ".join(_DRIVER_MARKERS)
    failures = []
    for entry in sys.path:
        path = os.path.join(entry or os.getcwd(), _build.CUBLASLT_WHEEL_DIR, soname)
        if not os.path.isfile(path):
            continue
        try:
            ctypes.CDLL(path)
            return "loaded %s" % path
        except OSError as e:
            failures.append("%s: %s" % (path, e))
    return "not found: no %s/%s on sys.path%s" % (
        _build.CUBLASLT_WHEEL_DIR, soname, ("; " + "; ".join(failures)) if failures else "")


def _warn_if_cuda_skipped() -> None:
    """A package that pip built from source without the CUDA backend because nvcc was missing
    says so once, on a machine with an NVIDIA driver (pip shows no build output)."""
    try:
        from . import _build
    except ImportError:
        return
    why = getattr(_build, "CUDA_SKIPPED", None)
    if why and not _build.CUDA_BACKEND and any(os.path.exists(m) for m in _DRIVER_MARKERS):
        import warnings
        warnings.warn(
            "fusedce: this package has no CUDA backend: %s. CUDA arrays will raise "
            "BackendUnavailableError. pip install fusedce-cu13 (or fusedce-cu12) has it "
            "ready-made; or install the CUDA toolkit and build again (pip install "
            "--force-reinstall --no-cache-dir ...)." % why, UserWarning, stacklevel=3)


def cublaslt_preload() -> str:
    """What :func:`load` did to preload cuBLASLt, in words (the module's docstring)."""
    load()
    return _CUBLASLT_PRELOAD


# The functions appended to the C ABI after 0.1, with the FCE_VERSION_NUMBER that added them.
VP_SYMBOLS = ("fce_vp_stats", "fce_vp_loss_workspace_size", "fce_vp_loss",
              "fce_vp_backward_workspace_size", "fce_vp_backward",
              "fce_vp_linear_stats_workspace_size", "fce_vp_linear_stats",
              "fce_vp_linear_backward_workspace_size", "fce_vp_linear_backward")
# the one-call vocabulary-parallel linear CE (0.5): optional, fusedce.torch.distributed falls
# back to the two-phase calls above without it (has_vp_linear_ce)
VP_LINEAR_CE_SYMBOLS = ("fce_vp_linear_ce_workspace_size", "fce_vp_linear_ce")
# distillation (1.0): a library without them raises UnsupportedError when they are called
DISTILL_SYMBOLS = ("fce_distill_workspace_size", "fce_distill",
                   "fce_linear_distill_workspace_size", "fce_linear_distill")
# vocabulary-parallel distillation (1.0)
VP_DISTILL_SYMBOLS = ("fce_vp_distill_rounds", "fce_vp_distill_stats",
                      "fce_vp_distill_loss_workspace_size", "fce_vp_distill_loss",
                      "fce_vp_distill_backward_workspace_size", "fce_vp_distill_backward")
# ... from hidden states (1.0)
VP_LINEAR_DISTILL_SYMBOLS = ("fce_vp_linear_distill_stats_workspace_size",
                             "fce_vp_linear_distill_stats",
                             "fce_vp_linear_distill_backward_workspace_size",
                             "fce_vp_linear_distill_backward")
SINCE = {"fce_scale_gradient": 200, "fce_backward_rescale": 200, "fce_build_info": 300,
         **{name: 400 for name in VP_SYMBOLS}, **{name: 500 for name in VP_LINEAR_CE_SYMBOLS},
         **{name: 10000
            for name in DISTILL_SYMBOLS + VP_DISTILL_SYMBOLS + VP_LINEAR_DISTILL_SYMBOLS}}


def _declare(lib) -> frozenset:
    """Set the signatures of the library's functions; returns the names of the functions added
    after 0.1 that it lacks (each replaced by one raising UnsupportedError: needs >= 0.x)."""
    c = ctypes
    i64, sz, vp, fp = c.c_int64, c.c_size_t, c.c_void_p, c.c_void_p
    opt = c.POINTER(Options)
    out, grd, shd = c.POINTER(Outputs), c.POINTER(Gradients), c.POINTER(VpShard)
    tch = c.POINTER(Teacher)
    psz = c.POINTER(sz)
    st = c.c_int  # fce_status: a C enum, int-sized
    sigs = {
        "fce_version": (c.c_uint, []),
        "fce_status_string": (c.c_char_p, [st]),
        "fce_last_error": (c.c_char_p, []),
        "fce_options_default": (None, [opt]),
        "fce_forward_workspace_size": (st, [opt, i64, i64, psz]),
        "fce_forward": (st, [opt, i64, i64, vp, vp, out, grd, vp, sz, vp]),
        "fce_backward_workspace_size": (st, [opt, i64, i64, psz]),
        "fce_backward": (st, [opt, i64, i64, vp, vp, fp, out, grd, vp, sz, vp]),
        "fce_linear_ce_workspace_size": (st, [opt, i64, i64, i64, c.c_int, psz, psz]),
        "fce_linear_ce": (st, [opt, i64, i64, i64, vp, vp, vp, vp, out, grd, vp, sz, vp]),
        "fce_cuda_available": (c.c_int, []),
        # ---- added later (SINCE); absent from older libraries of the same major version
        "fce_scale_gradient": (st, [c.c_int32, c.c_int32, i64, vp, fp, vp]),
        "fce_backward_rescale": (st, [opt, i64, i64, vp, vp, fp, out, grd, vp, sz, vp]),
        "fce_build_info": (c.c_char_p, []),
        "fce_vp_stats": (st, [opt, shd, i64, vp, vp, fp, vp]),
        "fce_vp_loss_workspace_size": (st, [opt, i64, i64, i64, psz]),
        "fce_vp_loss": (st, [opt, shd, i64, vp, fp, out, vp, sz, vp]),
        "fce_vp_backward_workspace_size": (st, [opt, i64, i64, i64, i64, psz]),
        "fce_vp_backward": (st, [opt, shd, i64, vp, vp, fp, grd, vp, sz, vp]),
        "fce_vp_linear_stats_workspace_size": (st, [opt, i64, i64, i64, psz, psz]),
        "fce_vp_linear_stats": (st, [opt, shd, i64, i64, vp, vp, vp, vp, fp, vp, sz, vp]),
        "fce_vp_linear_backward_workspace_size": (
            st, [opt, i64, i64, i64, i64, i64, c.c_int32, psz, psz]),
        "fce_vp_linear_backward": (
            st, [opt, shd, i64, i64, vp, vp, vp, vp, fp, grd, vp, sz, vp]),
        "fce_vp_linear_ce_workspace_size": (
            st, [opt, i64, i64, i64, i64, i64, c.c_int, c.c_int32, psz, psz]),
        "fce_vp_linear_ce": (
            st, [opt, shd, i64, i64, vp, vp, vp, vp, out, grd, vp, sz, vp]),
        "fce_distill_workspace_size": (st, [opt, tch, i64, i64, psz]),
        "fce_distill": (st, [opt, tch, i64, i64, vp, vp, out, grd, vp, sz, vp]),
        "fce_linear_distill_workspace_size": (
            st, [opt, tch, i64, i64, i64, c.c_int, psz, psz]),
        "fce_linear_distill": (
            st, [opt, tch, i64, i64, i64, vp, vp, vp, out, grd, vp, sz, vp]),
        "fce_vp_distill_rounds": (st, [tch, c.POINTER(c.c_int32)]),
        "fce_vp_distill_stats": (st, [opt, tch, shd, c.c_int32, i64, vp, fp, fp, vp]),
        "fce_vp_distill_loss_workspace_size": (st, [opt, tch, i64, i64, i64, psz]),
        "fce_vp_distill_loss": (st, [opt, tch, shd, i64, vp, fp, out, vp, sz, vp]),
        "fce_vp_distill_backward_workspace_size": (st, [opt, tch, i64, i64, i64, i64, psz]),
        "fce_vp_distill_backward": (st, [opt, tch, shd, i64, vp, vp, fp, grd, vp, sz, vp]),
        "fce_vp_linear_distill_stats_workspace_size": (st, [opt, tch, i64, i64, i64, psz, psz]),
        "fce_vp_linear_distill_stats": (
            st, [opt, tch, shd, c.c_int32, i64, i64, vp, vp, vp, fp, fp, vp, sz, vp]),
        "fce_vp_linear_distill_backward_workspace_size": (
            st, [opt, tch, i64, i64, i64, i64, i64, c.c_int32, psz, psz]),
        "fce_vp_linear_distill_backward": (
            st, [opt, tch, shd, i64, i64, vp, vp, vp, vp, fp, grd, vp, sz, vp]),
    }
    missing = []
    for name, (restype, argtypes) in sigs.items():
        if name in SINCE and not hasattr(lib, name):
            missing.append(name)
            setattr(lib, name, _lacking(name))
            continue
        fn = getattr(lib, name)  # AttributeError names the missing symbol
        fn.restype = restype
        fn.argtypes = argtypes
    return frozenset(missing)


def _lacking(name: str):
    """What stands for a function the loaded library does not have."""
    def call(*_args):
        require(name, SINCE[name])
        raise UnsupportedError(FCE_ERROR_UNSUPPORTED, "%s: the loaded library (%s, %s) lacks it"
                               % (name, _LIB_PATH, format_version(_LIB_VERSION)), name)
    call.__name__ = name
    return call


def check_version(library_version: int, header_version: int = HEADER_VERSION_NUMBER) -> None:
    """Raise VersionMismatchError unless the majors of the two FCE_VERSION_NUMBERs agree (any
    minor is accepted: bindings/README.md "Library versions")."""
    lib_major = int(library_version) // 10000
    hdr_major = int(header_version) // 10000
    if lib_major != hdr_major:
        raise VersionMismatchError(
            "libfusedce version %s (major %d) does not match the version %s (major %d) this "
            "binding was written for: the major versions must be equal; rebuild the library or "
            "install a matching binding"
            % (format_version(library_version), lib_major, format_version(header_version),
               hdr_major))


def require(what: str, since: int, detail: str = "") -> None:
    """Raise UnsupportedError "<what>: needs libfusedce >= 0.x; the loaded library (...) is
    0.y.z" when the loaded library is older than the FCE_VERSION_NUMBER ``since``."""
    load()
    if _LIB_VERSION < since:
        raise UnsupportedError(
            FCE_ERROR_UNSUPPORTED, "%s: needs libfusedce >= %d.%d%s; the loaded library (%s) is %s"
            % (what, since // 10000, since // 100 % 100, " (%s)" % detail if detail else "",
               _LIB_PATH, format_version(_LIB_VERSION)))


def _options_size_of(library_version: int) -> int:
    """The struct_size to pass a library of this FCE_VERSION_NUMBER: the 1.0 struct (a library
    of another major version is refused before any call)."""
    del library_version
    return FCE_OPTIONS_SIZE_V1_0


def options_size() -> int:
    """The struct_size every fce_options this binding passes carries: FCE_OPTIONS_SIZE_V1_0."""
    load()
    return _options_size_of(_LIB_VERSION)


def lacks(names) -> list:
    """Those of these functions (added after 0.1) that the loaded library lacks."""
    load()
    return [name for name in names if name in _LIB_MISSING]


def has_vp() -> bool:
    """True when the loaded library has the vocabulary-parallel calls (fce_vp_*, 0.4)."""
    load()
    return _LIB_VERSION >= 400 and not _LIB_MISSING.intersection(VP_SYMBOLS)


def has_vp_linear_ce() -> bool:
    """True when the loaded library has the vocabulary-parallel calls and the one-call fused
    linear CE (fce_vp_linear_ce and its workspace query, 0.5)."""
    return has_vp() and not _LIB_MISSING.intersection(VP_LINEAR_CE_SYMBOLS)


def require_vp(what: str = "the vocabulary-parallel calls (fce_vp_*)") -> None:
    """Raise UnsupportedError unless the loaded library has the vocabulary-parallel calls
    (libfusedce 0.4 or later)."""
    require(what, 400, "fce_vp_*")
    if not has_vp():
        raise UnsupportedError(
            FCE_ERROR_UNSUPPORTED, "%s: the loaded library (%s, %s) lacks %s" %
            (what, _LIB_PATH, format_version(_LIB_VERSION),
             ", ".join(n for n in VP_SYMBOLS if n in _LIB_MISSING)))


def format_version(number: int) -> str:
    number = int(number)
    return "%d.%d.%d" % (number // 10000, number // 100 % 100, number % 100)


def load(reload: bool = False):
    """The loaded ctypes.CDLL (loading it on first use). Raises LibraryNotFoundError."""
    global _LIB, _LIB_PATH, _LIB_ORIGIN, _LIB_VERSION, _LIB_MISSING, _CUBLASLT_PRELOAD
    lib = _LIB  # every call of every binding comes here: no lock once loaded (_LIB is set last)
    if lib is not None and not reload:
        return lib
    with _LOCK:
        if _LIB is not None and not reload:
            return _LIB
        if _CUBLASLT_PRELOAD == "not tried":
            _CUBLASLT_PRELOAD = _preload_cublaslt()
            _warn_if_cuda_skipped()
        tried = []
        for origin, path in _candidates():
            if os.sep in path and not os.path.exists(path):
                tried.append(f"{path} ({origin}: no such file)")
                continue
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                tried.append(f"{path} ({origin}: {e})")
                continue
            try:
                missing = _declare(lib)
            except AttributeError as e:
                tried.append(f"{path} ({origin}: not a fusedce library: {e})")
                continue
            lib_version = lib.fce_version()
            check_version(lib_version)
            size = _options_size_of(lib_version)
            probe = Options()
            probe.struct_size = size
            probe.batch_invariant = probe.vp_entropy = 7  # overwritten with their defaults 0
            lib.fce_options_default(ctypes.byref(probe))
            if (probe.struct_size != size or probe.ignore_index != -100
                    or probe.logit_scale != 1.0 or probe.target_dtype != FCE_INT64
                    or probe.batch_invariant != 0 or probe.vp_entropy != 0):
                raise VersionMismatchError(
                    "fce_options_default() of libfusedce %s (struct_size %d) does not fill the "
                    "defaults this binding expects: the header and this binding disagree" %
                    (format_version(lib_version), size))
            _LIB_PATH, _LIB_ORIGIN = path, origin
            _LIB_VERSION, _LIB_MISSING = int(lib_version), missing
            _LIB = lib
            _set_status_lookup(status_string)  # exceptions name the status in its words
            return lib
        raise LibraryNotFoundError(
            "libfusedce not found; `pip install fusedce-cu13` (or -cu12) installs a package with "
            "it, `pip install .` in the repository builds it into the package, or set "
            "FUSEDCE_LIBRARY to the path of libfusedce.so (e.g. build/libfusedce.so). "
            "Tried:\n  " + "\n  ".join(tried or ["(nothing: no candidate)"]))


def library_path() -> str:
    """The path (or, for one found by the dynamic loader, the name) of the loaded library."""
    load()
    return _LIB_PATH


def library_origin() -> str:
    """Where the loaded library was found: "FUSEDCE_LIBRARY", "packaged" (fusedce/lib, put there
    by pip), "beside the package", "ctypes.util.find_library" or "system loader"."""
    load()
    return _LIB_ORIGIN


def build_info():
    """fce_build_info(): one line naming the library's version, backends and BLAS; None for a
    library older than 0.3, which does not have it."""
    lib = load()
    if "fce_build_info" in _LIB_MISSING:
        return None
    s = lib.fce_build_info()
    return s.decode("utf-8", "replace") if s else ""


# ----------------------------------------------------------------- thin C wrappers ----
def version() -> int:
    """fce_version(): the FCE_VERSION_NUMBER the library was built with."""
    return int(load().fce_version())


def status_string(status: int) -> str:
    s = load().fce_status_string(int(status))
    return s.decode("utf-8", "replace") if s else ""


def last_error() -> str:
    s = load().fce_last_error()
    return s.decode("utf-8", "replace") if s else ""


def cuda_available() -> bool:
    return bool(load().fce_cuda_available())


def default_options() -> Options:
    """fce_options_default() into a new Options whose struct_size is :func:`options_size`
    (fields past an older library's struct keep their zero defaults)."""
    o = Options()
    o.struct_size = options_size()
    load().fce_options_default(ctypes.byref(o))
    return o


def scale_gradient(backend: int, dtype: int, count: int, grad_ptr, grad_output_ptr,
                   stream=None) -> None:
    """fce_scale_gradient: grad[i] *= *grad_output for i < count, in place. grad_ptr and
    grad_output_ptr are addresses (ints, or None for NULL) in the backend's memory, stream a
    cudaStream_t address or None; raises the FusedCEError subclass for a failing status."""
    call("fce_scale_gradient", int(backend), int(dtype), int(count), grad_ptr, grad_output_ptr,
         stream)


def backward_rescale(options: Options, rows: int, vocab: int, logits_ptr, targets_ptr, lse_ptr,
                     grad_output_ptr, grad_logits_ptr, error_flags_ptr=None, workspace_ptr=None,
                     workspace_bytes: int = 0, stream=None) -> None:
    """fce_backward_rescale: grad_logits, holding the gradient fce_forward wrote with grad_output
    NULL (an upstream 1), becomes the gradient for the upstream scalar *grad_output (reductions
    mean and sum), as if fce_forward had been given it: exactly 1 writes nothing, 0 or a power
    of two scales it in place, anything else computes it again from the logits and lse.
    ``options`` is an Options struct (the forward's); the pointers are addresses (ints, or None
    for NULL) in the backend's memory, the workspace fce_backward_workspace_size's, stream a
    cudaStream_t address or None; raises the FusedCEError subclass for a failing status."""
    out = outputs(error_flags=error_flags_ptr)
    grads = gradients(grad_output=grad_output_ptr, grad_logits=grad_logits_ptr)
    call("fce_backward_rescale", ctypes.byref(options), int(rows), int(vocab), logits_ptr,
         targets_ptr, lse_ptr, ctypes.byref(out), ctypes.byref(grads), workspace_ptr,
         int(workspace_bytes), stream)


def check(status: int, function: str) -> None:
    """Raise the FusedCEError subclass for a failing status, with fce_last_error(): the
    library's own message, naming the function and the argument (the binding does not repeat the
    checks the library makes: this message is the one the user reads)."""
    if status != FCE_SUCCESS:
        message = last_error()  # read on the same thread, right after the failing call
        raise error_for_status(status, message or f"{function} failed", function)


def call(function: str, *args) -> None:
    """Call fce_<function>(*args) and check its status."""
    fn = getattr(load(), function)
    check(fn(*args), function)
