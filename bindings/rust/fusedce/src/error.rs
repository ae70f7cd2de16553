//! `Error`: an fce_status code and the message of fce_last_error().
use std::ffi::CStr;
use std::fmt;

use crate::sys;

/// What went wrong, one variant per `fce_status` failure code (the codes are append-only;
/// codes newer than this crate arrive as [`Status::Other`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Status {
    /// A size, option or enum out of its domain (FCE_ERROR_INVALID_ARGUMENT).
    InvalidArgument,
    /// A required pointer is NULL (FCE_ERROR_NULL_POINTER).
    NullPointer,
    /// A pointer not aligned to its element, or the workspace to 16 bytes (FCE_ERROR_MISALIGNED).
    Misaligned,
    /// A valid request this build or device cannot do (FCE_ERROR_UNSUPPORTED).
    Unsupported,
    /// The workspace is below what the query returned (FCE_ERROR_WORKSPACE_TOO_SMALL).
    WorkspaceTooSmall,
    /// CUDA backend not built in, or no CUDA device (FCE_ERROR_BACKEND_UNAVAILABLE).
    BackendUnavailable,
    /// The CUDA runtime reported an error (FCE_ERROR_CUDA).
    Cuda,
    /// cuBLASLt reported an error (FCE_ERROR_CUBLAS).
    Cublas,
    /// A bug in fusedce (FCE_ERROR_INTERNAL).
    Internal,
    /// A code this crate does not know yet.
    Other(u32),
}

impl Status {
    /// The `fce_status` value.
    pub fn code(self) -> u32 {
        match self {
            Status::InvalidArgument => sys::FCE_ERROR_INVALID_ARGUMENT,
            Status::NullPointer => sys::FCE_ERROR_NULL_POINTER,
            Status::Misaligned => sys::FCE_ERROR_MISALIGNED,
            Status::Unsupported => sys::FCE_ERROR_UNSUPPORTED,
            Status::WorkspaceTooSmall => sys::FCE_ERROR_WORKSPACE_TOO_SMALL,
            Status::BackendUnavailable => sys::FCE_ERROR_BACKEND_UNAVAILABLE,
            Status::Cuda => sys::FCE_ERROR_CUDA,
            Status::Cublas => sys::FCE_ERROR_CUBLAS,
            Status::Internal => sys::FCE_ERROR_INTERNAL,
            Status::Other(code) => code,
        }
    }

    /// The status for a failure code (`FCE_SUCCESS` is not one: it maps to `Other(0)`).
    pub fn from_code(code: u32) -> Status {
        match code {
            sys::FCE_ERROR_INVALID_ARGUMENT => Status::InvalidArgument,
            sys::FCE_ERROR_NULL_POINTER => Status::NullPointer,
            sys::FCE_ERROR_MISALIGNED => Status::Misaligned,
            sys::FCE_ERROR_UNSUPPORTED => Status::Unsupported,
            sys::FCE_ERROR_WORKSPACE_TOO_SMALL => Status::WorkspaceTooSmall,
            sys::FCE_ERROR_BACKEND_UNAVAILABLE => Status::BackendUnavailable,
            sys::FCE_ERROR_CUDA => Status::Cuda,
            sys::FCE_ERROR_CUBLAS => Status::Cublas,
            sys::FCE_ERROR_INTERNAL => Status::Internal,
            other => Status::Other(other),
        }
    }

    /// The library's description, `fce_status_string()` ("FCE_ERROR_NULL_POINTER: a required
    /// pointer is NULL").
    pub fn description(self) -> String {
        // SAFETY: fce_status_string takes any value and returns a static C string.
        let p = unsafe { sys::fce_status_string(self.code()) };
        if p.is_null() {
            return format!("fce_status {}", self.code());
        }
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// A failed fusedce call: the status code and the message that names the wrong argument
/// (`fce_last_error()`, e.g. "fce_forward: options->row_stride (3) is less than vocab (4)").
/// Checks made by this crate before calling the library (slice lengths, dtypes) produce the
/// same type, with messages that start with "fusedce::".
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    status: Status,
    message: String,
}

impl Error {
    /// An error with this status and message.
    pub fn new(status: Status, message: impl Into<String>) -> Error {
        Error {
            status,
            message: message.into(),
        }
    }

    /// The status.
    pub fn status(&self) -> Status {
        self.status
    }

    /// The numeric `fce_status` code.
    pub fn code(&self) -> u32 {
        self.status.code()
    }

    /// The message (may be empty if the library left none).
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Reads `fce_last_error()` of this thread for a call that returned `code`.
    pub(crate) fn last(code: u32) -> Error {
        // SAFETY: fce_last_error returns a thread-local C string, valid until the next call on
        // this thread; it is copied at once.
        let p = unsafe { sys::fce_last_error() };
        let message = if p.is_null() {
            String::new()
        } else {
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        };
        Error::new(Status::from_code(code), message)
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Error {
        Error::new(Status::InvalidArgument, message)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.status {
            Status::InvalidArgument => "FCE_ERROR_INVALID_ARGUMENT",
            Status::NullPointer => "FCE_ERROR_NULL_POINTER",
            Status::Misaligned => "FCE_ERROR_MISALIGNED",
            Status::Unsupported => "FCE_ERROR_UNSUPPORTED",
            Status::WorkspaceTooSmall => "FCE_ERROR_WORKSPACE_TOO_SMALL",
            Status::BackendUnavailable => "FCE_ERROR_BACKEND_UNAVAILABLE",
            Status::Cuda => "FCE_ERROR_CUDA",
            Status::Cublas => "FCE_ERROR_CUBLAS",
            Status::Internal => "FCE_ERROR_INTERNAL",
            Status::Other(code) => return write!(f, "{} (fce_status {code})", self.message),
        };
        if self.message.is_empty() {
            write!(f, "{name}")
        } else {
            write!(f, "{} ({name})", self.message)
        }
    }
}

impl std::error::Error for Error {}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// Turns a returned fce_status into a Result, reading the last-error message on failure.
pub(crate) fn check(status: sys::fce_status) -> Result<()> {
    if status == sys::FCE_SUCCESS {
        Ok(())
    } else {
        Err(Error::last(status))
    }
}

/// [`check`] for a workspace query (`query`, an `fce_*_workspace_size`) made to size the
/// workspace of the compute call `call`: a failure is reported as that call's, its message's
/// leading "query: " made "call: ". The query checks the options and sizes the call checks, in
/// the library's words, but the caller called `call` (through this crate), not the query.
pub(crate) fn check_query(status: sys::fce_status, query: &str, call: &str) -> Result<()> {
    check(status).map_err(|e| {
        let message = match e.message.strip_prefix(query) {
            Some(rest) if rest.starts_with(": ") => format!("{call}{rest}"),
            _ => e.message,
        };
        Error::new(e.status, message)
    })
}
