//! `Listener`: a `tensorwire_rpc::Server` bound to a TCP or Unix address, whose accepted
//! connections become `Endpoint`s — how two Python processes that did not start each other
//! (another host, over TCP) talk `tensorwire.rpc`.

use super::endpoint::{PyEndpoint, config};
use super::errors::to_py;
use super::service;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tensorwire_rpc::Server;

/// Accepts connections on one address; each serves the same dict of objects.
#[pyclass(module = "tensorwire._native", name = "RpcListener")]
pub struct PyListener {
    server: Server,
}

#[pymethods]
impl PyListener {
    /// Binds `address` (`tcp://host:port`, port 0 for any; or a Unix socket path that must
    /// not exist). With `remote_tensors` (trusted peers only), a peer that offers them gets
    /// CPU tensors by UCX get. With `fs_tensors` (trusted pyisolate peers only), the
    /// `/dev/shm` files pyisolate's `TensorRef`s name are read; without, refused.
    #[new]
    #[pyo3(signature = (address, serve=None, remote_tensors=false, fs_tensors=false))]
    fn new(
        py: Python<'_>,
        address: &str,
        serve: Option<&Bound<'_, PyDict>>,
        remote_tensors: bool,
        fs_tensors: bool,
    ) -> PyResult<PyListener> {
        let reg = service::registry_of(serve)?;
        let cfg = config(py, remote_tensors, fs_tensors)?;
        let server = Server::bind(address, reg, cfg).map_err(|e| to_py(py, &e))?;
        Ok(PyListener { server })
    }

    /// The bound address (`tcp://ip:port` with the real port, or the socket path).
    #[getter]
    fn address(&self) -> String {
        self.server.local_addr()
    }

    /// Waits for the next connection (the GIL released) and returns its endpoint.
    fn accept(&self, py: Python<'_>) -> PyResult<PyEndpoint> {
        let ep = py
            .detach(|| self.server.accept())
            .map_err(|e| to_py(py, &e))?;
        Ok(PyEndpoint { ep })
    }
}
