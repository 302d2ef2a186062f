//! RPC errors as `tensorwire.errors` classes, chosen by variant (no message parsing), and
//! a Python handler's exception as the `error` string of a response.
//!
//! A handler's exception travels as pyisolate's `error` string (a pyisolate peer shows
//! it as it is): `"<type>: <message>"`, then [`TRACEBACK_MARKER`] and the traceback text.
//! A `Remote` error that has the marker becomes `tensorwire.RemoteError` with the remote
//! type's name and the traceback; one without (a Rust or pyisolate peer) keeps its text
//! and an empty traceback.

use crate::errors::raise;
use pyo3::prelude::*;
use tensorwire_rpc::RpcError;

/// The line between an exception's `type: message` and its traceback in a response.
pub const TRACEBACK_MARKER: &str = "\n--- remote traceback ---\n";

/// `err` as a Python exception.
pub fn to_py(py: Python<'_>, err: &RpcError) -> PyErr {
    let class = match err {
        RpcError::Remote(text) => return remote(py, text),
        RpcError::PeerGone(_) => "PeerGone",
        RpcError::Timeout { .. } | RpcError::FirstMessageTimeout { .. } => "Timeout",
        RpcError::Protocol(_)
        | RpcError::FrameTooLarge { .. }
        | RpcError::Decode(_)
        | RpcError::DecodeLimit { .. }
        | RpcError::NotFound(_)
        | RpcError::InvalidArgument(_)
        | RpcError::Unsupported(_) => "Refused",
        RpcError::TensorCopyLimit { .. } => "QuotaExceeded",
        RpcError::OutOfMemory { .. } | RpcError::ConnectionLimit { .. } => "ResourceExhausted",
        RpcError::CudaUnavailable(_) | RpcError::CudaNotNative(_) => "CudaUnavailable",
        // The transport's own class for its kind, as for a transport call's error.
        RpcError::Transport { kind, .. } => crate::errors::class_and_code(*kind).0,
        _ => "Error",
    };
    raise(py, class, None, format!("tensorwire.rpc: {err}"))
}

fn remote(py: Python<'_>, text: &str) -> PyErr {
    // Only our own format names the type: another peer's text is kept whole.
    let (head, traceback, remote_type) = match text.rsplit_once(TRACEBACK_MARKER) {
        Some((h, tb)) => (h, tb, h.split_once(": ").map_or(h, |(t, _)| t)),
        None => (text, "", ""),
    };
    let made = py
        .import("tensorwire.errors")
        .and_then(|m| m.getattr("RemoteError"))
        .and_then(|cls| {
            cls.call1((
                format!("the remote call raised {head}"),
                remote_type,
                traceback,
            ))
        });
    match made {
        Ok(exc) => PyErr::from_value(exc),
        Err(e) => e,
    }
}

/// A handler's exception as a response's `error` string (see the module docs).
pub fn remote_text(py: Python<'_>, err: &PyErr) -> String {
    let ty = err.get_type(py);
    let module = ty.module().map(|m| m.to_string()).unwrap_or_default();
    let name = ty
        .qualname()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "Exception".into());
    let full = if module.is_empty() || module == "builtins" {
        name
    } else {
        format!("{module}.{name}")
    };
    let message = err
        .value(py)
        .str()
        .map(|s| s.to_string())
        .unwrap_or_default();
    let traceback = py
        .import("traceback")
        .and_then(|tb| tb.call_method1("format_exception", (err.get_type(py), err.value(py), err.traceback(py))))
        .and_then(|lines| lines.extract::<Vec<String>>())
        .map(|lines| lines.concat())
        .unwrap_or_default();
    format!("{full}: {message}{TRACEBACK_MARKER}{traceback}")
}
