//! CPU connections: `Peer` as a Python class. `send` exports a view of a live segment
//! storage (found by address in `storage`'s registry) under a lease; `recv` hands the
//! imported storage to torch as a DLPack capsule whose owner is the `Imported`, so the
//! lease ends when torch's last view of it dies (or with the capsule, if never consumed).
//! The view itself (dtype name, sizes, strides, storage offset in elements) travels beside
//! the capsule; Python applies it with `view(dtype).as_strided(...)`.

use crate::dlpack;
use crate::errors::{IntoPy, refused};
use crate::storage;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::time::Duration;
use tensorwire::{DType, ExportOptions, Layout, Peer, PeerConfig, SharedTensor};

/// A connection to one peer process (`tensorwire::Peer`).
#[pyclass(module = "tensorwire._native", name = "Peer")]
pub struct PyPeer {
    pub(crate) peer: Peer,
}

fn dtype_named(py: Python<'_>, name: &str) -> PyResult<DType> {
    DType::ALL
        .into_iter()
        .find(|d| d.name() == name)
        .ok_or_else(|| refused(py, format!("tensorwire: dtype torch.{name} is not supported")))
}

/// What `recv` returns: the capsule, then the view to make of its bytes (dtype name,
/// sizes, strides, storage offset in elements), then the tag.
type Received = (Py<PyAny>, &'static str, Vec<i64>, Vec<i64>, i64, u64);

fn wait_for(timeout: Option<f64>) -> Option<Duration> {
    timeout.map(|s| Duration::from_secs_f64(s.clamp(0.0, 1e9)))
}

#[pymethods]
impl PyPeer {
    /// Two connected peers in this process (tests, benchmarks).
    #[staticmethod]
    fn pair(py: Python<'_>) -> PyResult<(PyPeer, PyPeer)> {
        let (a, b) = py.detach(|| Peer::pair(PeerConfig::default())).py_err(py)?;
        Ok((PyPeer { peer: a }, PyPeer { peer: b }))
    }

    /// A connection over an inherited socket fd, which it takes over.
    #[staticmethod]
    fn from_fd(py: Python<'_>, fd: RawFd) -> PyResult<PyPeer> {
        if fd < 0 {
            return Err(refused(py, format!("tensorwire: fd {fd} is not a descriptor")));
        }
        // SAFETY: the caller hands this fd over (as `tw_peer_from_fd` documents); it is
        // non-negative and owned by nothing else from here on.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        let peer = py.detach(|| Peer::from_fd(owned, PeerConfig::default())).py_err(py)?;
        Ok(PyPeer { peer })
    }

    /// Export the view (`dtype`, `sizes`, `strides`, `storage_offset` in elements) of the
    /// segment storage at `storage_ptr` (`storage_nbytes` long) under a lease; returns the
    /// lease as `generation << 32 | slot`.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (storage_ptr, storage_nbytes, dtype, sizes, strides, storage_offset, tag=0, window=None))]
    fn send(
        &self,
        py: Python<'_>,
        storage_ptr: usize,
        storage_nbytes: usize,
        dtype: &str,
        sizes: Vec<i64>,
        strides: Vec<i64>,
        storage_offset: i64,
        tag: u64,
        window: Option<f64>,
    ) -> PyResult<u64> {
        let (seg, off) = storage::segment_at(storage_ptr, storage_nbytes)
            .ok_or_else(|| refused(py, "tensorwire: the storage is not a live tensorwire segment".to_string()))?;
        let layout = Layout::strided(dtype_named(py, dtype)?, &sizes, &strides, storage_offset).py_err(py)?;
        let t = SharedTensor::new(seg, off, storage_nbytes, layout).py_err(py)?;
        let opts = ExportOptions { tag, window: wait_for(window) };
        let lease = py.detach(|| self.peer.export(&t, opts)).py_err(py)?;
        Ok((u64::from(lease.generation) << 32) | u64::from(lease.slot))
    }

    /// The next tensor: `(capsule, dtype name, sizes, strides, storage_offset, tag)`.
    #[pyo3(signature = (timeout=None))]
    fn recv(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Received> {
        let imp = py.detach(|| self.peer.recv_tensor(wait_for(timeout))).py_err(py)?;
        let layout = imp.layout();
        let (sizes, strides) = (layout.sizes().to_vec(), layout.strides().to_vec());
        let (name, offset, tag) = (layout.dtype.name(), layout.storage_offset, imp.tag());
        let (ptr, nbytes) = (imp.storage_ptr(), imp.storage_nbytes());
        let cap = dlpack::capsule(py, ptr, nbytes, (dlpack::DL_CPU, 0), Box::new(imp))?;
        Ok((cap, name, sizes, strides, offset, tag))
    }

    /// The lease table of this side's exports.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.peer.export_stats();
        let d = PyDict::new(py);
        d.set_item("live_leases", s.live_leases)?;
        d.set_item("live_bytes", s.live_bytes)?;
        d.set_item("granted", s.granted)?;
        d.set_item("released", s.released)?;
        Ok(d)
    }
}
