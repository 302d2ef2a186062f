//! tensorwire's errors as the Python classes of `tensorwire.errors`, chosen by the Rust
//! error's kind (no message parsing): the hierarchy stays the one Python users catch.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use tensorwire::error::{ResultCode, RESULT_CODES};
use tensorwire::{Error, ErrorKind};

/// The `tensorwire.errors` class name and the C ABI result name for a kind, from the
/// library's table (`tensorwire::error::RESULT_CODES`), so `e.code` reads as it does from
/// the extension.
pub(crate) fn class_and_code(kind: ErrorKind) -> (&'static str, &'static str) {
    let r = ResultCode::of_kind(kind);
    (r.class, r.name)
}

/// The result codes, by number: `(code, name, kind, class)` (`kind`: the Rust
/// `ErrorKind`'s name, `None` for codes that are no library error; `class`: the
/// `tensorwire.errors` class, `""` for `TW_OK`). `tensorwire.errors` builds its
/// code-to-class table from it.
#[pyfunction]
pub fn result_codes() -> Vec<(u32, &'static str, Option<String>, &'static str)> {
    RESULT_CODES.iter().map(|r| (r.code, r.name, r.kind.map(|k| format!("{k:?}")), r.class)).collect()
}

/// A `tensorwire.errors` exception (returned, for Python to raise) for a failure of `kind` (an `ErrorKind` name) that the
/// binding's Python side met itself (an OS call made there), with the code and message
/// prefix the library gives that kind: `"tensorwire (TW_ERR_…): {message}"`.
#[pyfunction]
pub fn library_error(py: Python<'_>, kind: &str, message: String) -> PyResult<Py<pyo3::exceptions::PyBaseException>> {
    let r = RESULT_CODES
        .iter()
        .find(|r| r.kind.is_some_and(|k| format!("{k:?}") == kind))
        .ok_or_else(|| pyo3::exceptions::PyValueError::new_err(format!("no error kind {kind:?}")))?;
    Ok(raise(py, r.class, Some(r.name), format!("tensorwire ({}): {message}", r.name)).into_value(py))
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

/// The refusal of one of the ops' own checks (`"tensorwire.<op>: …"`): the base
/// `tensorwire.errors.Error` without a code, as the package's op layer and the C++
/// extension's `TORCH_CHECK`s raise it. The binding owns the message; the op layer calls
/// through and does not check again.
pub fn op_error(py: Python<'_>, message: String) -> PyErr {
    raise(py, "Error", None, message)
}

/// A `Refused` for an argument the binding itself rejects (the C ABI's
/// `TW_ERR_INVALID_ARGUMENT`).
pub fn refused(py: Python<'_>, message: String) -> PyErr {
    let (class, code) = class_and_code(ErrorKind::InvalidArgument);
    raise(py, class, Some(code), message)
}

/// `v` as a u64, or the refusal the ops give a negative `name` argument of `op` (the torch
/// ops pass ints through; the extension checks the same, with the same message).
pub fn nonneg(py: Python<'_>, op: &str, name: &str, v: i64) -> PyResult<u64> {
    u64::try_from(v).map_err(|_| refused(py, format!("tensorwire.{op}: {name} must be >= 0, got {v}")))
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
