//! Blocking waits that Ctrl-C interrupts. A wait runs with the GIL released in slices of
//! at most [`SLICE`] and checks Python's signals between them (`check_signals` is a no-op
//! off the main thread), so a `KeyboardInterrupt` is raised within a slice of the signal;
//! what the interrupted wait was waiting for is then cancelled by its caller's policy.

use pyo3::prelude::*;
use std::sync::mpsc;
use std::time::Duration;

/// The longest a blocking wait goes without checking Python's signals.
pub const SLICE: Duration = Duration::from_millis(50);

/// Run `step` on `state` with the GIL released until it answers (`Some`); each step waits
/// at most about [`SLICE`]. When a signal handler raises between steps, `cancel` gets the
/// state (GIL released) and the handler's exception is returned.
pub fn sliced<S: Send, T: Send>(
    py: Python<'_>,
    mut state: S,
    mut step: impl FnMut(&mut S) -> Option<T> + Send,
    cancel: impl FnOnce(S) + Send,
) -> PyResult<T> {
    loop {
        if let Some(t) = py.detach(|| step(&mut state)) {
            return Ok(t);
        }
        if let Err(e) = py.check_signals() {
            py.detach(move || cancel(state));
            return Err(e);
        }
    }
}

/// Run `f` on a thread of its own and wait for it interruptibly. Interrupted, `f` still
/// runs to its end and what it returns is dropped there (a started worker is ended, a
/// pooled one goes back to its pool).
pub fn in_background<T: Send + 'static>(
    py: Python<'_>,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> PyResult<T> {
    let (tx, rx) = mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("tensorwire-start".into())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .map_err(|e| {
            crate::errors::raise(
                py,
                "ResourceExhausted",
                None,
                format!("tensorwire.rpc: cannot start a thread for {what}: {e}"),
            )
        })?;
    let r = sliced(
        py,
        rx,
        |rx| match rx.recv_timeout(SLICE) {
            Ok(t) => Some(Some(t)),
            Err(mpsc::RecvTimeoutError::Timeout) => None,
            Err(mpsc::RecvTimeoutError::Disconnected) => Some(None),
        },
        drop,
    )?;
    r.ok_or_else(|| {
        crate::errors::raise(
            py,
            "Error",
            None,
            format!("tensorwire.rpc: {what} ended without an answer (its thread panicked)"),
        )
    })
}
