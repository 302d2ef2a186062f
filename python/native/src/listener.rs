//! Listening Unix sockets: `Listener` as a Python class (`bind`, `accept` with the
//! connection options, `close`), what the ops `listen`, `accept` and `close_listener` need.

use crate::config::{peer_config, wait_ms};
use crate::peer::PyPeer;
use crate::errors::IntoPy;
use pyo3::prelude::*;
use std::sync::{Arc, Mutex, PoisonError};
use tensorwire::{Listener, Peer};

/// A listening socket (`tensorwire::Listener`); closing it removes the socket file.
#[pyclass(module = "tensorwire._native", name = "Listener")]
pub struct PyListener {
    /// `None` once closed; an `accept` in progress holds its own reference, so the socket
    /// goes when both let go (as the extension's handle registry does).
    listener: Mutex<Option<Arc<Listener>>>,
}

#[pymethods]
impl PyListener {
    /// Listen on a new Unix socket at `path`.
    #[staticmethod]
    fn bind(py: Python<'_>, path: String) -> PyResult<PyListener> {
        let l = Listener::bind(&path).py_err_in(py, "tw_listener_bind")?;
        Ok(PyListener { listener: Mutex::new(Some(Arc::new(l))) })
    }

    /// Wait for one connection (`timeout_ms`: < 0 no limit, 0 do not wait, n > 0 at most
    /// n ms) and handshake with it; `options` as in `Peer.from_fd`, checked first.
    #[pyo3(signature = (timeout_ms=-1, options=None))]
    fn accept(&self, py: Python<'_>, timeout_ms: i64, options: Option<Vec<i64>>) -> PyResult<PyPeer> {
        let cfg = peer_config(py, options)?;
        let l = self.listener.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let peer = py
            .detach(|| match l {
                Some(l) => Peer::accept(&l, wait_ms(timeout_ms), cfg),
                None => Err(tensorwire::Error::InvalidArgument("the listener is closed".into())),
            })
            .py_err_in(py, "tw_listener_accept")?;
        Ok(PyPeer::new(peer))
    }

    /// Stop listening and remove the socket file (idempotent).
    fn close(&self, py: Python<'_>) {
        let l = py.detach(|| self.listener.lock().unwrap_or_else(PoisonError::into_inner).take());
        drop(l);
    }
}
