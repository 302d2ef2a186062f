//! `Endpoint`: one RPC connection (`tensorwire_rpc::Endpoint`) as a Python class — calls
//! out (blocking, or started and waited for later), the objects it serves, native tensors.
//! Every blocking wait releases the GIL, so the connection's handler threads (which take
//! it to run Python handlers) keep serving while a call waits.

use super::errors::to_py;
use super::{service, values};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use super::wait::{SLICE, sliced};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tensorwire_rpc::{
    Canceller, CallOptions, Endpoint, Map, PendingCall, Result, RpcConfig, Value, Wait,
};

/// Seconds (`None`: no limit) as the RPC layer's wait.
pub fn wait_of(timeout: Option<f64>) -> Wait {
    match timeout {
        Some(s) => Wait::from(Duration::from_secs_f64(s.clamp(0.0, 1e9))),
        None => Wait::Forever,
    }
}

/// The connection settings of `connect` and `Listener`: the defaults, plus remote tensors
/// when asked for — refused by name in a build without the `ucx` feature rather than
/// silently falling back, so a caller who asked for them knows they cannot be had — and
/// pyisolate's file-system tensors when asked for (`fs_tensors`).
pub fn config(py: Python<'_>, remote_tensors: bool, fs_tensors: bool) -> PyResult<RpcConfig> {
    if remote_tensors && !cfg!(feature = "ucx") {
        return Err(crate::errors::refused(
            py,
            "tensorwire.rpc: remote_tensors needs tensorwire._native built with the `ucx` \
             feature (build_info()['ucx_built'] is False); the default wheel has no UCX"
                .to_string(),
        ));
    }
    Ok(RpcConfig {
        remote_tensors,
        accept_fs_tensors: fs_tensors,
        // Values are read into Python objects from their text (`json_text`).
        json_text: true,
        ..RpcConfig::default()
    })
}

/// Positional and keyword arguments as values (converted with the GIL held, before the
/// call releases it).
pub fn arguments(
    args: &Bound<'_, PyTuple>,
    kwargs: Option<&Bound<'_, PyDict>>,
) -> PyResult<(Vec<Value>, Map)> {
    let positional = args
        .iter()
        .map(|a| values::to_value(&a))
        .collect::<PyResult<Vec<_>>>()?;
    let mut named = Map::new();
    if let Some(kw) = kwargs {
        for (k, v) in kw.iter() {
            named.insert(k.extract::<String>()?, values::to_value(&v)?);
        }
    }
    Ok((positional, named))
}

/// Start a call (`start`, GIL released) and wait for it up to `timeout` seconds (`None`:
/// no limit) interruptibly: a signal's exception abandons the call (its answer is dropped
/// when it comes; the connection has no cancel message).
pub fn wait_call(
    py: Python<'_>,
    start: impl FnOnce() -> Result<PendingCall> + Send,
    timeout: Option<f64>,
) -> PyResult<Value> {
    let asked = timeout.map(|s| Duration::from_secs_f64(s.clamp(0.0, 1e9)));
    let by = asked.and_then(|d| Instant::now().checked_add(d));
    let state: (Option<_>, Option<PendingCall>) = (Some(start), None);
    let r = sliced(
        py,
        state,
        |(start, pending)| {
            if let Some(start) = start.take() {
                match start() {
                    Ok(p) => *pending = Some(p),
                    Err(e) => return Some(Err(e)),
                }
            }
            let p = pending.as_ref()?;
            let now = Instant::now();
            let slice = by.map_or(SLICE, |by| SLICE.min(by.saturating_duration_since(now)));
            match p.wait_slice(slice) {
                Some(r) => Some(r),
                None if by.is_some_and(|by| Instant::now() >= by) => {
                    Some(pending.take()?.expire(asked.unwrap_or_default()))
                }
                None => None,
            }
        },
        |(_, pending)| {
            if let Some(p) = pending {
                p.cancel();
            }
        },
    )?;
    r.map_err(|e| to_py(py, &e))
}

/// A connection to one peer.
#[pyclass(module = "tensorwire._native", name = "Endpoint")]
pub struct PyEndpoint {
    pub(super) ep: Endpoint,
}

impl PyEndpoint {
    /// What `call` and `start` share: the arguments converted (GIL held) and the call's
    /// send, to run with the GIL released — inside `call`'s interruptible wait, or on its
    /// own for `start`.
    fn sender<'a>(
        &'a self,
        object_id: &'a str,
        method: &'a str,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
        timeout: Option<f64>,
    ) -> PyResult<impl FnOnce() -> Result<PendingCall> + Send + 'a> {
        let (positional, named) = arguments(args, kwargs)?;
        let opts = CallOptions {
            timeout: Some(wait_of(timeout)),
            parent_call_id: None,
        };
        Ok(move || self.ep.start_call(object_id, method, positional, named, opts))
    }
}

#[pymethods]
impl PyEndpoint {
    /// Two connected endpoints in this process, each serving its dict of objects; with
    /// `native`, tensors travel as shared segments under leases. With `fs_tensors`, both
    /// read the `/dev/shm` files pyisolate `TensorRef`s name (without: refused).
    #[staticmethod]
    #[pyo3(signature = (serve_a=None, serve_b=None, native=true, fs_tensors=false))]
    fn pair(
        py: Python<'_>,
        serve_a: Option<&Bound<'_, PyDict>>,
        serve_b: Option<&Bound<'_, PyDict>>,
        native: bool,
        fs_tensors: bool,
    ) -> PyResult<(PyEndpoint, PyEndpoint)> {
        let (ra, rb) = (
            service::registry_of(serve_a)?,
            service::registry_of(serve_b)?,
        );
        let cfg = RpcConfig {
            accept_fs_tensors: fs_tensors,
            json_text: true,
            ..RpcConfig::default()
        };
        let (a, b) = py
            .detach(|| Endpoint::pair(ra, rb, cfg))
            .map_err(|e| to_py(py, &e))?;
        if native {
            py.detach(|| a.negotiate_native(Duration::from_secs(10)))
                .map_err(|e| to_py(py, &e))?;
        }
        Ok((PyEndpoint { ep: a }, PyEndpoint { ep: b }))
    }

    /// An endpoint over a connected Unix socket `fd`, which it takes over. With
    /// `fs_tensors` (a trusted pyisolate peer), it reads the `/dev/shm` files the peer's
    /// `TensorRef`s name; without, they are refused.
    #[staticmethod]
    #[pyo3(signature = (fd, serve=None, fs_tensors=false))]
    fn from_fd(
        py: Python<'_>,
        fd: RawFd,
        serve: Option<&Bound<'_, PyDict>>,
        fs_tensors: bool,
    ) -> PyResult<PyEndpoint> {
        if fd < 0 {
            return Err(crate::errors::refused(
                py,
                format!("tensorwire.rpc: fd {fd} is not a descriptor"),
            ));
        }
        let reg = service::registry_of(serve)?;
        // SAFETY: the caller hands this fd over; it is non-negative and owned by nothing
        // else from here on (an fd that is not a socket fails in `from_fd`, which closes it).
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        let cfg = RpcConfig {
            accept_fs_tensors: fs_tensors,
            json_text: true,
            ..RpcConfig::default()
        };
        let ep = py
            .detach(|| Endpoint::from_fd(owned, reg, cfg))
            .map_err(|e| to_py(py, &e))?;
        Ok(PyEndpoint { ep })
    }

    /// An endpoint connected to `address` (`tcp://host:port` or a Unix socket path),
    /// serving the dict `serve`. With `remote_tensors` (trusted peers only; a build with
    /// the `ucx` feature), offers them and waits up to `timeout` seconds for the answer:
    /// CPU tensors then travel by UCX get instead of inline, where the peer agrees. With
    /// `fs_tensors` (a trusted pyisolate peer), it reads the `/dev/shm` files the peer's
    /// `TensorRef`s name; without, they are refused.
    #[staticmethod]
    #[pyo3(signature = (address, serve=None, remote_tensors=false, timeout=10.0, fs_tensors=false))]
    fn connect(
        py: Python<'_>,
        address: &str,
        serve: Option<&Bound<'_, PyDict>>,
        remote_tensors: bool,
        timeout: f64,
        fs_tensors: bool,
    ) -> PyResult<PyEndpoint> {
        let reg = service::registry_of(serve)?;
        let cfg = config(py, remote_tensors, fs_tensors)?;
        let ep = py
            .detach(|| Endpoint::connect(address, reg, cfg))
            .map_err(|e| to_py(py, &e))?;
        if remote_tensors {
            let e = ep.clone();
            py.detach(move || e.negotiate_native(wait_of(Some(timeout))))
                .map_err(|e| to_py(py, &e))?;
        }
        Ok(PyEndpoint { ep })
    }

    /// Whether CPU tensors travel as remote (UCX) tensors on this connection.
    #[getter]
    fn remote(&self) -> bool {
        #[cfg(feature = "ucx")]
        return self.ep.remote_enabled();
        #[cfg(not(feature = "ucx"))]
        false
    }

    /// Serve `obj` to the peer as `object_id`.
    fn register(&self, object_id: &str, obj: &Bound<'_, PyAny>) -> PyResult<()> {
        service::register(self.ep.registry(), object_id, obj)
    }

    /// Offer native tensors and wait up to `timeout` seconds for the peer's answer; whether
    /// they are on.
    #[pyo3(signature = (timeout=10.0))]
    fn negotiate_native(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let ep = self.ep.clone();
        py.detach(move || ep.negotiate_native(wait_of(Some(timeout))))
            .map_err(|e| to_py(py, &e))
    }

    /// `object_id.method(*args, **kwargs)` on the peer; waits up to `timeout` seconds.
    /// Ctrl-C raises `KeyboardInterrupt` within ~50 ms and abandons the call.
    #[pyo3(signature = (object_id, method, args, kwargs=None, timeout=None))]
    fn call(
        &self,
        py: Python<'_>,
        object_id: &str,
        method: &str,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
        timeout: Option<f64>,
    ) -> PyResult<Py<PyAny>> {
        let send = self.sender(object_id, method, args, kwargs, timeout)?;
        let r = wait_call(py, send, timeout)?;
        values::to_py(py, r)
    }

    /// Send the call now and return a handle to wait for its result later (many calls
    /// can be in flight on one connection).
    #[pyo3(signature = (object_id, method, args, kwargs=None, timeout=None))]
    fn start(
        &self,
        py: Python<'_>,
        object_id: &str,
        method: &str,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
        timeout: Option<f64>,
    ) -> PyResult<PyPendingCall> {
        let send = self.sender(object_id, method, args, kwargs, timeout)?;
        let pending = py.detach(send).map_err(|e| to_py(py, &e))?;
        Ok(PyPendingCall {
            canceller: pending.canceller(),
            pending: Mutex::new(Some(pending)),
        })
    }

    /// Close: tell the peer, wait up to `timeout` seconds for it to hang up, then close.
    #[pyo3(signature = (timeout=1.0))]
    fn close(&self, py: Python<'_>, timeout: f64) {
        let ep = self.ep.clone();
        py.detach(move || ep.close(wait_of(Some(timeout))));
    }

    #[getter]
    fn closed(&self) -> bool {
        self.ep.is_closed()
    }

    #[getter]
    fn native(&self) -> bool {
        self.ep.native_enabled()
    }

    /// Calls waiting for their response.
    #[getter]
    fn pending_calls(&self) -> usize {
        self.ep.pending_calls()
    }
}

/// A call sent and not yet waited for.
#[pyclass(module = "tensorwire._native", name = "PendingCall")]
pub struct PyPendingCall {
    pending: Mutex<Option<PendingCall>>,
    /// Cancels it while another thread waits for it (an `acall` whose task is cancelled).
    canceller: Canceller,
}

#[pymethods]
impl PyPendingCall {
    /// Its result (or its error); waits up to `timeout` seconds more. Once only. Ctrl-C
    /// raises `KeyboardInterrupt` within ~50 ms and abandons the call.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        let pending = self
            .pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
            .ok_or_else(|| {
                crate::errors::refused(
                    py,
                    "tensorwire.rpc: this call's result was already taken".into(),
                )
            })?;
        let r = wait_call(py, move || Ok(pending), timeout)?;
        values::to_py(py, r)
    }

    /// Whether its response (or its failure) is in.
    fn done(&self) -> bool {
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .is_none_or(|p| p.is_done())
    }

    /// Give up on it: its result, if it still comes, is dropped; a `wait` in another thread
    /// raises at once.
    fn cancel(&self) {
        self.canceller.cancel();
        if let Some(p) = self
            .pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
        {
            p.cancel();
        }
    }
}
