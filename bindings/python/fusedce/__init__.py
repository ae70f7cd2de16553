"""fusedce: fused cross-entropy kernels (libfusedce) for Python.

    import fusedce
    r = fusedce.forward(logits, targets, reduction="mean", return_grad=True)
    r.loss, r.grad_logits

The core (this namespace, :mod:`fusedce.core`) takes NumPy arrays (CPU backend), torch tensors
and any ``__cuda_array_interface__`` / DLPack array; :mod:`fusedce.torch` adds autograd,
``torch.compile`` support and ``torch.nn`` modules. The shared library is loaded on first use
(``FUSEDCE_LIBRARY`` when set, else the one ``pip install`` put in the package, then the
system path); see :mod:`fusedce._lib`. ``python -m fusedce`` says which and what it was built
with. Its major version must be this binding's; an older minor works for everything it has
(what it lacks raises :class:`UnsupportedError` "...: needs libfusedce >= 0.x"), a newer minor
too (bindings/README.md, "Library versions").

Errors: a failing call raises the :class:`FusedCEError` subclass of its fce_status, with the
library's own message (it names the function and the argument).
"""

from ._lib import (HEADER_VERSION_MAJOR, HEADER_VERSION_MINOR, HEADER_VERSION_NUMBER,
                   HEADER_VERSION_PATCH, BackendUnavailableError, CublasError, CudaError,
                   FusedCEError, InternalError, InvalidArgumentError, LibraryNotFoundError,
                   MisalignedError, NullPointerError, OutOfMemoryError, UnsupportedError,
                   VersionMismatchError, WorkspaceTooSmallError, build_info, cuda_available,
                   last_error, library_origin, library_path, load, status_string)
from .core import (REDUCTIONS, DistillResult, ForwardResult, LinearCEResult,
                   LinearDistillResult, backward, backward_workspace_size,
                   bfloat16_bits_to_float, check_error_flags, distill, distill_workspace_size,
                   float_to_bfloat16_bits, forward, forward_workspace_size, linear_ce,
                   linear_ce_workspace_size, linear_distill, linear_distill_workspace_size)

__version__ = "%d.%d.%d" % (HEADER_VERSION_MAJOR, HEADER_VERSION_MINOR, HEADER_VERSION_PATCH)


def library_version():
    """(major, minor, patch) of the loaded libfusedce (fce_version())."""
    from . import _lib
    v = _lib.version()
    return (v // 10000, v // 100 % 100, v % 100)


__all__ = [
    "forward", "backward", "linear_ce", "forward_workspace_size", "backward_workspace_size",
    "linear_ce_workspace_size", "ForwardResult", "LinearCEResult", "REDUCTIONS",
    "distill", "linear_distill", "distill_workspace_size", "linear_distill_workspace_size",
    "DistillResult", "LinearDistillResult",
    "check_error_flags", "float_to_bfloat16_bits", "bfloat16_bits_to_float", "cuda_available",
    "last_error", "status_string", "library_path", "library_origin", "library_version",
    "build_info", "load", "FusedCEError",
    "InvalidArgumentError", "NullPointerError", "MisalignedError", "UnsupportedError",
    "WorkspaceTooSmallError", "BackendUnavailableError", "CudaError", "CublasError",
    "InternalError", "OutOfMemoryError", "LibraryNotFoundError", "VersionMismatchError",
    "__version__",
    "HEADER_VERSION_MAJOR", "HEADER_VERSION_MINOR", "HEADER_VERSION_PATCH", "HEADER_VERSION_NUMBER",
]
