//! The `Peer` class's state: a connection and the locks that keep one receiver of each kind
//! at a time. Its methods are in `connection` (CPU) and its CUDA functions in `cuda`; both
//! take the type from here, so neither module needs the other's class.

use pyo3::prelude::*;
use std::sync::Mutex;
use tensorwire::Peer;

/// A connection to one peer process (`tensorwire::Peer`).
#[pyclass(module = "tensorwire._native", name = "Peer")]
pub struct PyPeer {
    pub(crate) peer: Peer,
    /// One CPU receiver at a time, as the extension's `recv` (the C ABI asks for it).
    pub(crate) recv_mu: Mutex<()>,
    /// One CPU ring receiver at a time.
    pub(crate) ring_recv_mu: Mutex<()>,
}

impl PyPeer {
    pub(crate) fn new(peer: Peer) -> PyPeer {
        PyPeer { peer, recv_mu: Mutex::new(()), ring_recv_mu: Mutex::new(()) }
    }
}
