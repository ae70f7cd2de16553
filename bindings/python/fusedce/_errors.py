"""Errors: the fce_status codes of include/fusedce.h and the exception raised for each.

A failing call raises the :class:`FusedCEError` subclass of its status; its text is the
library's own message (``fce_last_error()``: the function and the argument it is about), with
the status name appended. The checks the library makes are never repeated in Python: their one
source of truth is the library, and its message is the one the user reads
(:func:`fusedce._lib.check`). Nothing here loads the library, and nothing here imports
_lib.py: the dependency goes one way, _lib.py imports this module (and, once the library is
loaded, hands it fce_status_string through :func:`set_status_lookup`).
"""

from __future__ import annotations

# fce_status (append-only in the header, so a code we do not know is still reported).
FCE_SUCCESS = 0
FCE_ERROR_INVALID_ARGUMENT = 1
FCE_ERROR_NULL_POINTER = 2
FCE_ERROR_MISALIGNED = 3
FCE_ERROR_UNSUPPORTED = 4
FCE_ERROR_WORKSPACE_TOO_SMALL = 5
FCE_ERROR_BACKEND_UNAVAILABLE = 6
FCE_ERROR_CUDA = 7
FCE_ERROR_CUBLAS = 8
FCE_ERROR_INTERNAL = 9
FCE_ERROR_OUT_OF_MEMORY = 10  # 0.4: host memory ran out (the CPU backend's buffers)


_STATUS_LOOKUP = None  # fce_status_string of the loaded library (set_status_lookup), else None


def set_status_lookup(lookup) -> None:
    """Called by _lib.load() with its status_string once the library is loaded."""
    global _STATUS_LOOKUP
    _STATUS_LOOKUP = lookup


def _status_string(status: int) -> str:
    """fce_status_string() when the library is loaded (never loads it), else the number."""
    lookup = _STATUS_LOOKUP
    if lookup is None:
        return str(status)
    return lookup(status)


class FusedCEError(RuntimeError):
    """A non-success fce_status. ``status`` is the code, ``message`` fce_last_error()."""

    def __init__(self, status: int, message: str, function: str = ""):
        self.status = int(status)
        self.message = message
        self.function = function
        self.status_string = _status_string(status)
        text = message or self.status_string
        if message and self.status_string not in message:
            text = f"{message} [{self.status_string}]"
        super().__init__(text)


class InvalidArgumentError(FusedCEError, ValueError):
    """FCE_ERROR_INVALID_ARGUMENT."""


class NullPointerError(FusedCEError, ValueError):
    """FCE_ERROR_NULL_POINTER."""


class MisalignedError(FusedCEError, ValueError):
    """FCE_ERROR_MISALIGNED."""


class UnsupportedError(FusedCEError):
    """FCE_ERROR_UNSUPPORTED; also raised by the binding for a feature the loaded library is too
    old for ("<feature>: needs libfusedce >= 0.x"; bindings/README.md, "Library versions")."""


class WorkspaceTooSmallError(FusedCEError, ValueError):
    """FCE_ERROR_WORKSPACE_TOO_SMALL."""


class BackendUnavailableError(FusedCEError):
    """FCE_ERROR_BACKEND_UNAVAILABLE: no CUDA backend in this build, or no device."""


class CudaError(FusedCEError):
    """FCE_ERROR_CUDA."""


class CublasError(FusedCEError):
    """FCE_ERROR_CUBLAS."""


class InternalError(FusedCEError):
    """FCE_ERROR_INTERNAL: a bug in fusedce."""


class OutOfMemoryError(FusedCEError, MemoryError):
    """FCE_ERROR_OUT_OF_MEMORY: host memory ran out (the CPU backend's buffers)."""


class LibraryNotFoundError(ImportError):
    """libfusedce could not be found or loaded (see fusedce._lib for the search order)."""


class VersionMismatchError(ImportError):
    """The library's major version differs from the header this binding mirrors."""


ERRORS = {
    FCE_ERROR_INVALID_ARGUMENT: InvalidArgumentError,
    FCE_ERROR_NULL_POINTER: NullPointerError,
    FCE_ERROR_MISALIGNED: MisalignedError,
    FCE_ERROR_UNSUPPORTED: UnsupportedError,
    FCE_ERROR_WORKSPACE_TOO_SMALL: WorkspaceTooSmallError,
    FCE_ERROR_BACKEND_UNAVAILABLE: BackendUnavailableError,
    FCE_ERROR_CUDA: CudaError,
    FCE_ERROR_CUBLAS: CublasError,
    FCE_ERROR_INTERNAL: InternalError,
    FCE_ERROR_OUT_OF_MEMORY: OutOfMemoryError,
}


def error_for_status(status: int, message: str, function: str = "") -> FusedCEError:
    """The exception object for a status code (FusedCEError itself for a code we do not know)."""
    return ERRORS.get(int(status), FusedCEError)(status, message, function)


def as_call(error: FusedCEError, query: str, call: str) -> FusedCEError:
    """The failure of a workspace query that a binding made for a compute call (fusedce.forward
    sizes its workspace with fce_forward_workspace_size, then calls fce_forward), as the failure
    of that call: the query checks the options and sizes the call checks, in the library's
    words, but it is not a function the user called. The message's leading "<query>: " becomes
    "<call>: "; the status, and so the exception's class, stay."""
    message = error.message
    if message.startswith(query + ": "):
        message = call + message[len(query):]
    return error_for_status(error.status, message, call)
