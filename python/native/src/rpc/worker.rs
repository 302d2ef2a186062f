//! Workers from Python: a `WorkerSpec` built from keyword arguments, a supervised `Worker`,
//! a warm `WorkerPool`, and the child's side (`serve_worker`, and `host`, the connection
//! back to the supervisor for callbacks). The supervision itself — deadlines, crashes,
//! replacement, the sandbox — is `tensorwire_rpc::worker`'s.

use super::endpoint::{PyEndpoint, arguments};
use super::errors::to_py;
use super::wait::{SLICE, in_background, sliced};
use super::{service, values};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};
use std::ops::Deref;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tensorwire_rpc::worker::{
    self, Limits, OnInterrupt, Output, PooledWorker, Sandbox, Worker, WorkerCall, WorkerPool,
    WorkerSpec, WorkerState,
};
use tensorwire_rpc::{Canceller, Endpoint, Map, RpcConfig, RpcError, Value};

fn seconds(s: f64) -> Duration {
    Duration::from_secs_f64(s.clamp(0.0, 1e9))
}

/// A sandbox from Python: `(read paths, write paths, deny_network, deny_exec, namespaces,
/// gpu)`.
type SandboxArgs = (Vec<PathBuf>, Vec<PathBuf>, bool, bool, bool, bool);

/// How to start a worker (`tensorwire.rpc.spawn` and `WorkerPool` build one).
#[pyclass(module = "tensorwire._native", name = "WorkerSpec")]
#[derive(Clone)]
pub struct PySpec {
    pub(crate) spec: WorkerSpec,
    /// What an interrupted (Ctrl-C) or cancelled call does to the worker.
    on_interrupt: OnInterrupt,
}

impl PySpec {
    /// `spec` with this one's Python-side settings (the interrupt policy).
    pub(crate) fn with_spec(&self, spec: WorkerSpec) -> PySpec {
        PySpec { spec, on_interrupt: self.on_interrupt }
    }
}

#[pymethods]
impl PySpec {
    /// `program args...` with `env` added to this process's environment. `output`:
    /// `"inherit"`, `"capture"` (the last `capture_bytes` of each stream) or `"prefix"`
    /// (each line after `prefix`). Limits in bytes / files / CPU seconds; a `sandbox` is
    /// `(read paths, write paths, deny_network, deny_exec, namespaces)`. Times in seconds.
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (program, args, *, env=Vec::new(), cwd=None, output="inherit", prefix=String::new(), capture_bytes=1 << 16,
                        address_space=None, open_files=None, cpu_seconds=None, sandbox=None,
                        handshake_timeout=60.0, call_timeout=None, serve=None, native=true))]
    fn new(
        program: PathBuf,
        args: Vec<String>,
        env: Vec<(String, String)>,
        cwd: Option<PathBuf>,
        output: &str,
        prefix: String,
        capture_bytes: usize,
        address_space: Option<u64>,
        open_files: Option<u64>,
        cpu_seconds: Option<u64>,
        sandbox: Option<SandboxArgs>,
        handshake_timeout: f64,
        call_timeout: Option<f64>,
        serve: Option<&Bound<'_, PyDict>>,
        native: bool,
        py: Python<'_>,
    ) -> PyResult<PySpec> {
        let output = match output {
            "inherit" => Output::Inherit,
            "capture" => Output::Capture {
                max_bytes: capture_bytes,
            },
            "prefix" => Output::Prefixed(prefix),
            other => {
                return Err(crate::errors::refused(
                    py,
                    format!(
                        "tensorwire.rpc: output={other:?}: use \"inherit\", \"capture\" or \"prefix\""
                    ),
                ));
            }
        };
        let mut spec = WorkerSpec::new(program)
            .args(args)
            .output(output)
            .limits(Limits {
                address_space,
                open_files,
                cpu_seconds,
            })
            .handshake_timeout(seconds(handshake_timeout))
            .registry(service::registry_of(serve)?)
            // Results are read into Python objects from their text (`json_text`).
            .rpc_config(RpcConfig { json_text: true, ..RpcConfig::default() })
            .native_tensors(native);
        for (k, v) in env {
            spec = spec.env(k, v);
        }
        if let Some(dir) = cwd {
            spec = spec.current_dir(dir);
        }
        if let Some(t) = call_timeout {
            spec = spec.call_timeout(seconds(t));
        }
        if let Some((read, write, deny_network, deny_exec, namespaces, gpu)) = sandbox {
            spec = spec.sandbox(Sandbox {
                read,
                write,
                deny_network,
                deny_exec,
                namespaces,
                gpu,
            });
        }
        Ok(PySpec {
            spec,
            on_interrupt: OnInterrupt::Kill,
        })
    }

    /// This spec with `policy` for interrupted calls: `"kill"` (the worker is killed and
    /// replaced in the background) or `"abandon"` (the call's answer is dropped; the
    /// worker keeps running it).
    fn with_on_interrupt(&self, py: Python<'_>, policy: &str) -> PyResult<PySpec> {
        let on_interrupt = match policy {
            "kill" => OnInterrupt::Kill,
            "abandon" => OnInterrupt::Abandon,
            other => {
                return Err(crate::errors::refused(
                    py,
                    format!("tensorwire.rpc: on_interrupt={other:?}: use \"kill\" or \"abandon\""),
                ));
            }
        };
        Ok(PySpec {
            spec: self.spec.clone(),
            on_interrupt,
        })
    }
}

/// A worker held by a Python object: its own, or one out of a pool.
#[derive(Clone)]
enum Held {
    Own(Arc<Worker>),
    Pooled(Arc<PooledWorker>),
}

impl Deref for Held {
    type Target = Worker;
    fn deref(&self) -> &Worker {
        match self {
            Held::Own(w) => w,
            Held::Pooled(p) => p,
        }
    }
}

enum CallState {
    /// Not sent yet: it waits for the worker's process to be ready.
    Due {
        object: String,
        method: String,
        args: Vec<Value>,
        kwargs: Map,
        deadline: Option<Duration>,
    },
    Out(WorkerCall),
    Over,
}

/// A call on a worker, waited for in slices and cancellable from another thread (an
/// `acall` whose task is cancelled) by the worker's `on_interrupt` policy.
#[pyclass(module = "tensorwire._native", name = "WorkerCall")]
pub struct PyWorkerCall {
    w: Held,
    on: OnInterrupt,
    /// Held by the thread waiting for one slice (never while waiting for the GIL).
    state: Mutex<CallState>,
    cancelled: AtomicBool,
    canceller: Mutex<Option<Canceller>>,
}

impl PyWorkerCall {
    fn new(
        w: Held,
        on: OnInterrupt,
        object_id: &str,
        method: &str,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
        timeout: Option<f64>,
    ) -> PyResult<PyWorkerCall> {
        let (args, kwargs) = arguments(args, kwargs)?;
        Ok(PyWorkerCall {
            w,
            on,
            state: Mutex::new(CallState::Due {
                object: object_id.to_owned(),
                method: method.to_owned(),
                args,
                kwargs,
                deadline: timeout.map(seconds),
            }),
            cancelled: AtomicBool::new(false),
            canceller: Mutex::new(None),
        })
    }

    /// One slice (GIL released): send the call once the worker is ready, then wait for
    /// its answer. `None`: still out.
    fn step(&self) -> Option<tensorwire_rpc::Result<Value>> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let began = Instant::now();
        if let CallState::Due { .. } = &*state {
            // Acquire: pairs with the Release store in `cancel_now`.
            if self.cancelled.load(Ordering::Acquire) {
                *state = CallState::Over;
                return Some(Err(RpcError::Cancelled));
            }
            if !self.w.wait_ready(SLICE) {
                return None;
            }
            let CallState::Due {
                object,
                method,
                args,
                kwargs,
                deadline,
            } = std::mem::replace(&mut *state, CallState::Over)
            else {
                unreachable!("matched above under the same lock")
            };
            let call = match self.w.start_call(&object, &method, args, kwargs, deadline) {
                Ok(c) => c,
                Err(e) => return Some(Err(e)),
            };
            *self.canceller.lock().unwrap_or_else(PoisonError::into_inner) = call.canceller();
            // Acquire: as above; a cancel that came while the call was being sent.
            if self.cancelled.load(Ordering::Acquire) {
                self.w.cancel_call(call, self.on);
                return Some(Err(RpcError::Cancelled));
            }
            *state = CallState::Out(call);
        }
        let CallState::Out(call) = &mut *state else {
            return Some(Err(RpcError::Cancelled));
        };
        let r = self
            .w
            .wait_call(call, SLICE.saturating_sub(began.elapsed()))?;
        let CallState::Out(call) = std::mem::replace(&mut *state, CallState::Over) else {
            unreachable!("matched above under the same lock")
        };
        // Acquire: as above. Cancelled at the connection by `cancel_now` while this
        // thread waited: the policy is this thread's to apply.
        if matches!(r, Err(RpcError::Cancelled)) && self.cancelled.load(Ordering::Acquire) {
            self.w.cancel_call(call, self.on);
        }
        Some(r)
    }

    /// Cancel by the policy (GIL released): at once when no thread waits for a slice;
    /// else the waiting thread wakes with `Cancelled` and applies it.
    fn cancel_now(&self) {
        // Release: pairs with the Acquire loads in `step`.
        self.cancelled.store(true, Ordering::Release);
        if let Some(c) = self
            .canceller
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            c.cancel();
        }
        if let Ok(mut state) = self.state.try_lock() {
            if let CallState::Out(call) = std::mem::replace(&mut *state, CallState::Over) {
                self.w.cancel_call(call, self.on);
            }
        }
    }

    /// Wait for the answer in slices, checking Python's signals between them; a signal's
    /// exception cancels the call by the policy and is raised.
    fn run(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let r = sliced(py, (), |()| self.step(), |()| self.cancel_now())?;
        values::to_py(py, r.map_err(|e| to_py(py, &e))?)
    }
}

#[pymethods]
impl PyWorkerCall {
    /// Its result (or its error), waiting as long as its deadline allows. Once only.
    fn wait(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.run(py)
    }

    /// Give it up as the worker's `on_interrupt` says; a `wait` in another thread then
    /// raises.
    fn cancel(&self, py: Python<'_>) {
        py.detach(|| self.cancel_now());
    }
}

fn closed(py: Python<'_>) -> PyErr {
    to_py(py, &RpcError::PeerGone("the worker was closed".into()))
}

/// What `Worker` and `PooledWorker` share, as their Python base class `WorkerHandle`: the
/// worker they hold (`None` once closed or released), its interrupt policy, and the
/// methods both expose, written once.
#[pyclass(module = "tensorwire._native", name = "WorkerHandle", subclass)]
pub struct PyWorkerHandle {
    w: Mutex<Option<Held>>,
    on: OnInterrupt,
}

impl PyWorkerHandle {
    fn new(w: Held, on: OnInterrupt) -> PyWorkerHandle {
        PyWorkerHandle { w: Mutex::new(Some(w)), on }
    }

    fn get(&self, py: Python<'_>) -> PyResult<Held> {
        self.w
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| closed(py))
    }

    /// Let go of the worker (GIL released): its own is ended, a pooled one goes back.
    fn end(&self, py: Python<'_>) {
        let w = self.w.lock().unwrap_or_else(PoisonError::into_inner).take();
        py.detach(move || drop(w));
    }
}

#[pymethods]
impl PyWorkerHandle {
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
        self.start(py, object_id, method, args, kwargs, timeout)?.run(py)
    }

    /// The call, to wait for (`WorkerCall.wait`) or cancel from another thread.
    #[pyo3(signature = (object_id, method, args, kwargs=None, timeout=None))]
    fn start(
        &self,
        py: Python<'_>,
        object_id: &str,
        method: &str,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
        timeout: Option<f64>,
    ) -> PyResult<PyWorkerCall> {
        PyWorkerCall::new(self.get(py)?, self.on, object_id, method, args, kwargs, timeout)
    }

    /// `(state, pid, why)`: `("ready", pid, "")` or `("down", None, why)`.
    fn state(&self, py: Python<'_>) -> PyResult<(String, Option<u32>, String)> {
        Ok(match self.get(py)?.state() {
            WorkerState::Ready { pid } => ("ready".into(), Some(pid), String::new()),
            WorkerState::Down { why } => ("down".into(), None, why),
        })
    }

    /// Whether it could serve again as it is (running, nothing in flight, never killed).
    fn is_clean(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.get(py)?.is_clean())
    }

    /// `(stdout, stderr)` captured so far, or `None` when the output is not captured.
    fn output<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Option<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)>> {
        Ok(self
            .get(py)?
            .output()
            .map(|c| (PyBytes::new(py, &c.stdout()), PyBytes::new(py, &c.stderr()))))
    }

    /// Kill the running process (its process group) now; the next call starts a new one.
    fn kill(&self, py: Python<'_>) -> PyResult<()> {
        let w = self.get(py)?;
        py.detach(move || w.kill());
        Ok(())
    }
}

/// A supervised worker (`tensorwire_rpc::worker::Worker`).
#[pyclass(module = "tensorwire._native", name = "Worker", extends = PyWorkerHandle)]
pub struct PyWorker;

#[pymethods]
impl PyWorker {
    #[staticmethod]
    fn spawn(py: Python<'_>, spec: &PySpec) -> PyResult<Py<PyWorker>> {
        let (on, spec) = (spec.on_interrupt, spec.spec.clone());
        let w = in_background(py, "a worker's start", move || spec.spawn())?
            .map_err(|e| to_py(py, &e))?;
        Py::new(py, PyClassInitializer::from(PyWorkerHandle::new(Held::Own(Arc::new(w)), on)).add_subclass(PyWorker))
    }

    /// End the worker: a clean close, then SIGKILL after a grace period.
    fn close(slf: PyRef<'_, Self>, py: Python<'_>) {
        slf.as_super().end(py)
    }
}

/// Pre-warmed workers (`tensorwire_rpc::worker::WorkerPool`).
#[pyclass(module = "tensorwire._native", name = "WorkerPool")]
pub struct PyWorkerPool {
    pool: Mutex<Option<Arc<WorkerPool>>>,
    on: OnInterrupt,
}

#[pymethods]
impl PyWorkerPool {
    /// Start `size` workers and wait for their handshakes (Ctrl-C interrupts the wait;
    /// the workers are ended when their starts finish).
    #[new]
    fn new(py: Python<'_>, spec: &PySpec, size: usize) -> PyResult<PyWorkerPool> {
        let (on, spec) = (spec.on_interrupt, spec.spec.clone());
        let pool = in_background(py, "a pool's start", move || WorkerPool::new(spec, size))?
            .map_err(|e| to_py(py, &e))?;
        Ok(PyWorkerPool {
            pool: Mutex::new(Some(Arc::new(pool))),
            on,
        })
    }

    /// An idle worker, else the next to come back or finish its start; one is started
    /// (cold) only while the pool is below its size. Waits up to `timeout` seconds
    /// (`None`: no limit), then raises `Timeout`. Ctrl-C interrupts the wait.
    #[pyo3(signature = (timeout=None))]
    fn get(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PyPooledWorker>> {
        let pool = self
            .pool
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| closed(py))?;
        let w = match pool.take_idle() {
            Some(w) => w,
            // A start (cold) or a wait: off this thread, so that Ctrl-C interrupts it (a
            // worker it gets after that goes back to the pool).
            None => in_background(py, "a pool's get", move || {
                pool.get_timeout(timeout.map(seconds))
            })?
            .map_err(|e| to_py(py, &e))?,
        };
        Py::new(py, PyClassInitializer::from(PyWorkerHandle::new(Held::Pooled(Arc::new(w)), self.on)).add_subclass(PyPooledWorker))
    }

    fn idle(&self) -> usize {
        self.pool
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map_or(0, |p| p.idle())
    }

    /// Wait up to `timeout` seconds until `n` workers are idle; whether they are.
    fn wait_idle(&self, py: Python<'_>, n: usize, timeout: f64) -> bool {
        let pool = self
            .pool
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        py.detach(move || pool.is_some_and(|p| p.wait_idle(n, seconds(timeout))))
    }

    /// Why the last background start of a replacement failed, if one did.
    fn last_start_error(&self) -> Option<String> {
        self.pool
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .and_then(|p| p.last_start_error())
    }

    /// End every idle worker; workers handed out end when they come back.
    fn close(&self, py: Python<'_>) {
        let pool = self
            .pool
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        py.detach(move || drop(pool));
    }
}

/// A worker handed out by a pool; `release` gives it back (kept only if clean).
#[pyclass(module = "tensorwire._native", name = "PooledWorker", extends = PyWorkerHandle)]
pub struct PyPooledWorker;

#[pymethods]
impl PyPooledWorker {
    /// Give it back to its pool (kept warm only if it finished cleanly).
    fn release(slf: PyRef<'_, Self>, py: Python<'_>) {
        slf.as_super().end(py)
    }
}

/// The child's connection to its supervisor while `serve_worker` runs.
static HOST: Mutex<Option<Endpoint>> = Mutex::new(None);

/// In a worker process: serve `objects` (object id -> object) to the supervisor that
/// started it, until the supervisor closes the connection. Applies the sandbox it asked
/// for before answering the handshake.
#[pyfunction]
pub fn serve_worker(py: Python<'_>, objects: &Bound<'_, PyDict>) -> PyResult<()> {
    let reg = service::registry_of(Some(objects))?;
    let ep = py
        .detach(|| worker::connect(reg, RpcConfig { json_text: true, ..RpcConfig::default() }))
        .map_err(|e| to_py(py, &e))?;
    *HOST.lock().unwrap_or_else(PoisonError::into_inner) = Some(ep.clone());
    let why = py.detach(|| ep.wait_closed());
    HOST.lock().unwrap_or_else(PoisonError::into_inner).take();
    match why {
        RpcError::PeerGone(_) => Ok(()),
        e => Err(to_py(py, &e)),
    }
}

/// In a worker process serving: the connection to its supervisor (to call the objects it
/// serves back). Outside one: `None`.
#[pyfunction]
pub fn host() -> Option<PyEndpoint> {
    HOST.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
        .map(|ep| PyEndpoint { ep })
}

/// In a worker process: apply the system-call policy of the sandbox its supervisor asked
/// for, before the worker runs code it does not trust (its target's import); whether it
/// is sandboxed. Idempotent: `serve_worker` calls it too.
#[pyfunction]
pub fn enter_sandbox(py: Python<'_>) -> PyResult<bool> {
    worker::enter_sandbox().map_err(|e| to_py(py, &e))
}

/// What containment this machine gives: `{"user_namespaces": bool, "user_namespaces_why":
/// str, "landlock_abi": int, "landlock_scopes": bool, "seccomp": bool}`.
#[pyfunction]
pub fn containment(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let c = worker::probe();
    let d = PyDict::new(py);
    d.set_item("user_namespaces", c.user_namespaces)?;
    d.set_item("user_namespaces_why", c.user_namespaces_why.clone())?;
    d.set_item("landlock_abi", c.landlock_abi)?;
    d.set_item("landlock_scopes", c.landlock_scopes())?;
    d.set_item("seccomp", c.seccomp)?;
    Ok(d)
}

/// The variables of the supervisor's environment a sandboxed worker gets: `(names,
/// prefixes)` (`tensorwire_rpc::worker::KEPT_ENV`, `KEPT_ENV_PREFIXES`).
#[pyfunction]
pub fn kept_env() -> (Vec<&'static str>, Vec<&'static str>) {
    (worker::KEPT_ENV.to_vec(), worker::KEPT_ENV_PREFIXES.to_vec())
}
