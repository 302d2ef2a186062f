//! CPU connections: `Peer` as a Python class (opened from an fd, by `connect`, or by a
//! listener's `accept`), with what the ops `send`, `recv`, `stats`, `peer_pid` need.
//! `send` exports a view of a live sealed segment (found by address in `storage`'s
//! registry) under a lease, or forwards a received tensor's import as the same memory;
//! `recv` hands the imported storage to torch as a DLPack capsule whose owner is the
//! `Imported`, so the lease ends when torch's last view of it dies (or with the capsule, if
//! never consumed). The view itself (dtype name, sizes, strides, storage offset in
//! elements) travels beside the capsule; Python applies it with
//! `view(dtype).as_strided(...)`. A CUDA import goes to `crate::cuda::pending`.

use crate::config::{peer_config, wait_ms};
use crate::errors::{IntoPy, nonneg, op_error, raise, refused};
use crate::view::{check_view, dtype_named, view_layout};
use crate::peer::PyPeer;
use crate::storage;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::sync::PoisonError;
use std::time::Duration;
use tensorwire::{DType, ExportOptions, Incoming, Layout, Peer, PeerConfig, SharedTensor, Wait};

/// What `recv` returns: the capsule (or the CUDA module's pending import), then the view to
/// make of its bytes (dtype name, sizes, strides, storage offset in elements), then the tag.
type Received = (Py<PyAny>, &'static str, Vec<i64>, Vec<i64>, i64, u64);

/// A wait from seconds (`timeout`, None: no limit) or, where given, the ops' `timeout_ms`.
pub(crate) fn wait_of(timeout: Option<f64>, timeout_ms: Option<i64>) -> Wait {
    match (timeout_ms, timeout) {
        (Some(ms), _) => wait_ms(ms),
        (None, Some(s)) => Wait::For(Duration::from_secs_f64(s.clamp(0.0, 1e9))),
        (None, None) => Wait::Forever,
    }
}

#[pymethods]
impl PyPeer {
    /// Two connected peers in this process (tests, benchmarks).
    #[staticmethod]
    fn pair(py: Python<'_>) -> PyResult<(PyPeer, PyPeer)> {
        let (a, b) = py.detach(|| Peer::pair(PeerConfig::default())).py_err(py)?;
        Ok((PyPeer::new(a), PyPeer::new(b)))
    }

    /// A connection over an inherited socket fd, which it takes over; `options` are the ten
    /// connection options in schema order (see `config`), checked before the fd is.
    #[staticmethod]
    #[pyo3(signature = (fd, options=None))]
    fn from_fd(py: Python<'_>, fd: i64, options: Option<Vec<i64>>) -> PyResult<PyPeer> {
        let cfg = peer_config(py, options)?;
        let Ok(fd) = RawFd::try_from(fd) else {
            return Err(raise(py, "Error", None, format!("tensorwire.from_fd: fd {fd} is not a valid descriptor")));
        };
        if fd < 0 {
            return Err(raise(py, "Error", None, format!("tensorwire.from_fd: fd {fd} is not a valid descriptor")));
        }
        // SAFETY: the caller hands this fd over (as `tw_peer_from_fd` documents); it is
        // non-negative and owned by nothing else from here on.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        let peer = py.detach(|| Peer::from_fd(owned, cfg)).py_err_in(py, "tw_peer_from_fd")?;
        Ok(PyPeer::new(peer))
    }

    /// Connect to a listening process at `path` (`options` as in `from_fd`).
    #[staticmethod]
    #[pyo3(signature = (path, options=None))]
    fn connect(py: Python<'_>, path: String, options: Option<Vec<i64>>) -> PyResult<PyPeer> {
        let cfg = peer_config(py, options)?;
        let peer = py.detach(|| Peer::connect(&path, cfg)).py_err_in(py, "tw_peer_connect")?;
        Ok(PyPeer::new(peer))
    }

    /// The other process's pid (from the kernel).
    fn peer_pid(&self) -> i32 {
        self.peer.peer_pid()
    }

    /// Export the view (`dtype`, `sizes`, `strides`, `storage_offset` in elements) of the
    /// storage at `storage_ptr` (`storage_nbytes` long) under a lease: a received tensor's
    /// storage is forwarded as the producer's memory, a live sealed segment exported as it
    /// is; anything else is `Refused` unless `copy` says to pack the view into a recycled
    /// segment of the binding's pool (the package's send of a small private tensor). Returns
    /// the lease as `generation << 32 | slot`. `window` (seconds) or `window_ms` (> 0)
    /// bound how long the peer may hold it (neither: the connection's default window).
    /// `owner`, if given, is held by the lease until it ends. A negative `tag` or
    /// `window_ms` is refused as the torch op `send` refuses it (the package's op passes
    /// them through).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (storage_ptr, storage_nbytes, dtype, sizes, strides, storage_offset, tag=0, window=None, window_ms=0, owner=None, copy=false))]
    fn send(
        &self,
        py: Python<'_>,
        storage_ptr: usize,
        storage_nbytes: usize,
        dtype: &str,
        sizes: Vec<i64>,
        strides: Vec<i64>,
        storage_offset: i64,
        tag: i64,
        window: Option<f64>,
        window_ms: i64,
        owner: Option<Py<PyAny>>,
        copy: bool,
    ) -> PyResult<u64> {
        let tag = nonneg(py, "send", "tag", tag)?;
        let window_ms = nonneg(py, "send", "window_ms", window_ms)?;
        let layout = view_layout(py, "send", "tw_peer_export", dtype, &sizes, &strides, storage_offset)?;
        let window = match window {
            Some(s) => Some(Duration::from_secs_f64(s.clamp(0.0, 1e9))),
            None => (window_ms > 0).then(|| Duration::from_millis(window_ms)),
        };
        let opts = ExportOptions { tag, window };
        // The lease holds `owner` (the package passes the torch storage, as the extension's
        // lease holds its c10::Storage). It may be dropped on any thread, without the GIL:
        // PyO3 then defers the decref to the next time a thread holds the GIL.
        let extra: tensorwire::Owner = Box::new(owner);
        let lease = if copy {
            // SAFETY: the caller (the package's `send`, holding the GIL and the tensor)
            // passes its storage's address and size; nothing resizes it meanwhile.
            let t = unsafe { crate::pool::packed_copy(storage_ptr as *const u8, storage_nbytes, &layout) }
                .py_err_in(py, "tw_peer_export")?;
            py.detach(|| self.peer.export(&t, opts)).py_err_in(py, "tw_peer_export")?
        } else if let Some(imp) = storage::import_at(storage_ptr, storage_nbytes) {
            py.detach(|| self.peer.export_imported_with(imp, Some(layout), extra, opts)).py_err_in(py, "tw_peer_export_imported")?
        } else {
            let (seg, off) = storage::segment_at(storage_ptr, storage_nbytes).ok_or_else(|| {
                refused(py, "tensorwire: the storage is not a live tensorwire segment".to_string())
            })?;
            let t = SharedTensor::new(seg, off, storage_nbytes, layout).py_err_in(py, "tw_peer_export")?;
            py.detach(|| self.peer.export_with_owner(&t, extra, opts)).py_err_in(py, "tw_peer_export")?
        };
        Ok((u64::from(lease.generation) << 32) | u64::from(lease.slot))
    }

    /// The next tensor: `(capsule or CUDA pending import, dtype name, sizes, strides,
    /// storage_offset, tag)`. `timeout` in seconds (None: no limit) or the ops' `timeout_ms`.
    #[pyo3(signature = (timeout=None, timeout_ms=None))]
    fn recv(&self, py: Python<'_>, timeout: Option<f64>, timeout_ms: Option<i64>) -> PyResult<Received> {
        let wait = wait_of(timeout, timeout_ms);
        let incoming = py
            .detach(|| {
                let _one = self.recv_mu.lock().unwrap_or_else(PoisonError::into_inner);
                self.peer.recv(wait)
            })
            .py_err_in(py, "tw_peer_recv")?;
        match incoming {
            Incoming::Tensor(imp) => {
                let layout = imp.layout();
                let (sizes, strides) = (layout.sizes().to_vec(), layout.strides().to_vec());
                let (name, offset, tag) = (layout.dtype.name(), layout.storage_offset, imp.tag());
                let cap = storage::import_capsule(py, imp)?;
                Ok((cap, name, sizes, strides, offset, tag))
            }
            Incoming::CudaTensor(imp) => {
                let layout = imp.layout();
                let (sizes, strides) = (layout.sizes().to_vec(), layout.strides().to_vec());
                let (name, offset, tag) = (layout.dtype.name(), layout.storage_offset, imp.tag());
                let pending = crate::cuda::pending(py, imp, tag)?;
                Ok((pending, name, sizes, strides, offset, tag))
            }
            Incoming::Message { payload, .. } => Err(raise(
                py,
                "Error",
                None,
                format!(
                    "tensorwire.recv: expected a tensor, the peer sent a user message of {} bytes (dropped)",
                    payload.len()
                ),
            )),
        }
    }

    /// The lease table of this side's exports, after processing pending releases and the
    /// peer's death: `live_leases`, `live_bytes`, `granted`, `released`, `expired`,
    /// `reclaimed`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.detach(|| self.peer.reap_now());
        let d = PyDict::new(py);
        d.set_item("live_leases", s.live_leases)?;
        d.set_item("live_bytes", s.live_bytes)?;
        d.set_item("granted", s.granted)?;
        d.set_item("released", s.released)?;
        d.set_item("expired", s.expired)?;
        d.set_item("reclaimed", s.reclaimed)?;
        Ok(d)
    }

    /// The six counters of `stats` as a list, in the op's order.
    fn stats_list(&self, py: Python<'_>) -> [u64; 6] {
        let s = py.detach(|| self.peer.reap_now());
        [s.live_leases, s.live_bytes, s.granted, s.released, s.expired, s.reclaimed]
    }
}

/// `(torch name, element size)` of every dtype tensorwire carries, for the package's dtype
/// checks (the one table: `tensorwire::DType`).
#[pyfunction]
pub fn dtypes() -> Vec<(&'static str, usize)> {
    DType::ALL.into_iter().map(|d| (d.name(), d.size())).collect()
}

/// The contiguous strides and the storage bytes of a new tensor of `sizes` (the ops
/// `empty` and `zeros`, and `to_shared`'s copy), checked as those ops check them: at most
/// `MAX_NDIM` dimensions, none negative ([`op_error`]); then the library's own checks.
#[pyfunction]
pub fn empty_layout(py: Python<'_>, dtype: &str, sizes: Vec<i64>) -> PyResult<(Vec<i64>, u64)> {
    check_view(py, "empty", sizes.len(), sizes.len())?;
    if let Some(s) = sizes.iter().find(|&&s| s < 0) {
        return Err(op_error(py, format!("tensorwire.empty: negative dimension {s} in size {sizes:?}")));
    }
    let l = Layout::contiguous(dtype_named(py, dtype)?, &sizes).py_err_in(py, "tw_layout_contiguous")?;
    let nbytes = l.extent_bytes().py_err_in(py, "tw_layout_extent_bytes")?;
    Ok((l.strides().to_vec(), nbytes))
}
