//! tensorwire's errors as the Python classes of `tensorwire.errors`, chosen by the Rust
//! error's kind (no message parsing): the hierarchy stays the one Python users catch.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use tensorwire::{Error, ErrorKind};

/// The `tensorwire.errors` class name and the C ABI result name for a kind; the same
/// table as `CODES`/`BASE_CODES` there, so `e.code` reads as it did from the extension.
pub(crate) fn class_and_code(kind: ErrorKind) -> (&'static str, &'static str) {
    match kind {
        ErrorKind::PeerGone => ("PeerGone", "TW_ERR_PEER_GONE"),
        ErrorKind::Timeout => ("Timeout", "TW_ERR_TIMEOUT"),
        ErrorKind::Protocol => ("Refused", "TW_ERR_PROTOCOL"),
        ErrorKind::InvalidDescriptor => ("Refused", "TW_ERR_INVALID_DESCRIPTOR"),
        ErrorKind::InvalidSegment => ("Refused", "TW_ERR_INVALID_SEGMENT"),
        ErrorKind::InvalidArgument => ("Refused", "TW_ERR_INVALID_ARGUMENT"),
        ErrorKind::StaleLease => ("Refused", "TW_ERR_STALE_LEASE"),
        ErrorKind::QuotaExceeded => ("QuotaExceeded", "TW_ERR_QUOTA_EXCEEDED"),
        ErrorKind::Resource => ("ResourceExhausted", "TW_ERR_RESOURCE"),
        ErrorKind::CudaUnavailable => ("CudaUnavailable", "TW_ERR_CUDA_UNAVAILABLE"),
        ErrorKind::Cuda => ("Error", "TW_ERR_CUDA"),
        ErrorKind::Io => ("Error", "TW_ERR_IO"),
        // A kind newer than this table: the base class, as `translate` does for an
        // unknown code.
        _ => ("Error", "TW_ERR_IO"),
    }
}

/// `err` as the matching `tensorwire.errors` exception, its message prefixed as the C ABI's
/// (`"tensorwire (TW_ERR_…): …"`). Falls back to `RuntimeError` only if that module cannot
/// be imported (a broken install), never panics.
pub fn to_py(py: Python<'_>, err: &Error) -> PyErr {
    let (class, code) = class_and_code(err.kind());
    raise(py, class, Some(code), format!("tensorwire ({code}): {err}"))
}

/// `err` as `to_py` does, its message naming the C ABI function that reports the same
/// failure (`"tensorwire (TW_ERR_IO): tw_peer_connect: …"`), as the C++ extension's ops
/// read: `func` is that function's name.
pub fn to_py_in(py: Python<'_>, err: &Error, func: &str) -> PyErr {
    let (class, code) = class_and_code(err.kind());
    raise(py, class, Some(code), format!("tensorwire ({code}): {func}: {err}"))
}

/// A `tensorwire.errors.<class>(message, code)` exception.
pub fn raise(py: Python<'_>, class: &str, code: Option<&str>, message: String) -> PyErr {
    let made = py
        .import("tensorwire.errors")
        .and_then(|m| m.getattr(class))
        .and_then(|cls| cls.call1((message.clone(), code)));
    match made {
        Ok(exc) => PyErr::from_value(exc),
        Err(_) => PyRuntimeError::new_err(message),
    }
}

/// A `Refused` for an argument the binding itself rejects (the C ABI's
/// `TW_ERR_INVALID_ARGUMENT`).
pub fn refused(py: Python<'_>, message: String) -> PyErr {
    raise(py, "Refused", Some("TW_ERR_INVALID_ARGUMENT"), message)
}

/// `Result<T, tensorwire::Error>` into a Python result.
pub trait IntoPy<T> {
    fn py_err(self, py: Python<'_>) -> PyResult<T>;
    /// As `py_err`, the message naming the C ABI function `func` (`to_py_in`).
    fn py_err_in(self, py: Python<'_>, func: &str) -> PyResult<T>;
}

impl<T> IntoPy<T> for tensorwire::Result<T> {
    fn py_err(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py(py, &e))
    }

    fn py_err_in(self, py: Python<'_>, func: &str) -> PyResult<T> {
        self.map_err(|e| to_py_in(py, &e, func))
    }
}
