//! `tensorwire.rpc`'s native half: the `tensorwire-rpc` crate (pyisolate's wire, no
//! pickle) for Python hosts and children. One file a job: `values` (Python objects and
//! tensors to RPC values and back), `tensors` (torch tensors to tensor values, which both
//! `values` and `json_text` use), `json_text` (Python objects to the wire's JSON text and
//! back, no tree between), `errors` (RPC errors as `tensorwire.errors` classes,
//! a handler's exception as a response), `service` (Python objects served), `endpoint`
//! (a connection), `listener` (accepting connections on a TCP or Unix address), `worker`
//! (supervised workers, the pool, the child's side), `wait` (blocking waits Ctrl-C
//! interrupts).

mod endpoint;
mod errors;
mod json_text;
mod listener;
mod service;
mod tensors;
mod values;
mod wait;
mod worker;
mod zygote;

use pyo3::prelude::*;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<endpoint::PyEndpoint>()?;
    m.add_class::<endpoint::PyPendingCall>()?;
    m.add_class::<listener::PyListener>()?;
    m.add_class::<worker::PySpec>()?;
    m.add_class::<worker::PyWorkerHandle>()?;
    m.add_class::<worker::PyWorker>()?;
    m.add_class::<worker::PyWorkerPool>()?;
    m.add_class::<worker::PyPooledWorker>()?;
    m.add_class::<worker::PyWorkerCall>()?;
    m.add_function(wrap_pyfunction!(worker::serve_worker, m)?)?;
    m.add_function(wrap_pyfunction!(worker::host, m)?)?;
    m.add_function(wrap_pyfunction!(worker::enter_sandbox, m)?)?;
    m.add_function(wrap_pyfunction!(worker::containment, m)?)?;
    m.add_function(wrap_pyfunction!(worker::kept_env, m)?)?;
    m.add_function(wrap_pyfunction!(zygote::spec_with_zygote, m)?)?;
    m.add_function(wrap_pyfunction!(zygote::zygote_pid, m)?)?;
    m.add_function(wrap_pyfunction!(zygote::zygote_fork, m)?)?;
    m.add("TRACEBACK_MARKER", errors::TRACEBACK_MARKER)?;
    Ok(())
}
