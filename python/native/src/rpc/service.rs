//! Python objects served to the peer: each public callable attribute (a name without a
//! leading `_`) of the object becomes a method, and a callable object (a function, an
//! instance with `__call__`; not a class) answers `__call__` too. Any other method is an
//! `AttributeError` naming the method and the object's type, with the methods it has. A call runs on the endpoint's reader thread
//! (a lone request, while a standby reads the socket) or one of its handler threads, which
//! takes the GIL, keeping its Python thread state between calls; many calls can be in
//! flight, and a handler may call the peer back (the peer serves that on its own threads).

use super::errors::{TRACEBACK_MARKER, remote_text};
use super::values;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Once};
use tensorwire_rpc::{Args, Registry, RpcError, Service, Value};

/// A registry serving each `object_id -> object` of `objects`.
pub fn registry_of(objects: Option<&Bound<'_, PyDict>>) -> PyResult<Registry> {
    let reg = Registry::new();
    if let Some(objects) = objects {
        for (id, obj) in objects.iter() {
            let id: String = id.extract()?;
            register(&reg, &id, &obj)?;
        }
    }
    Ok(reg)
}

/// Serve `obj` as `object_id` in `reg`.
pub fn register(reg: &Registry, object_id: &str, obj: &Bound<'_, PyAny>) -> PyResult<()> {
    let py = obj.py();
    let type_name = obj.get_type().name()?.to_string();
    // Arguments without tagged objects come as JSON text, read straight into Python
    // objects (`json_text`).
    let mut service = Service::new(&type_name).json_text();
    let shared = Arc::new(obj.clone().unbind());
    let mut names = Vec::new();
    for name in obj.dir()?.iter() {
        let name: String = name.extract()?;
        if name.starts_with('_') || !obj.getattr(name.as_str()).is_ok_and(|a| a.is_callable()) {
            continue;
        }
        let target = shared.clone();
        let method = name.clone();
        service = service.method(&name, move |_, args| call(&target, &method, args));
        names.push(name);
    }
    if obj.is_callable() && !obj.is_instance_of::<pyo3::types::PyType>() {
        let target = shared.clone();
        service = service.method("__call__", move |_, args| call(&target, "__call__", args));
        names.push("__call__".into());
    }
    const SHOWN: usize = 20;
    let has = match names.len() {
        0 => "it serves no methods".to_string(),
        n if n <= SHOWN => format!("it serves {}", names.join(", ")),
        n => format!("it serves {}, and {} more", names[..SHOWN].join(", "), n - SHOWN),
    };
    // As Python says it, so that the caller's `RemoteError` names `AttributeError`.
    service = service.fallback(move |ctx, _| {
        Err(RpcError::Remote(format!(
            "AttributeError: '{type_name}' object has no method '{}' ({has}){TRACEBACK_MARKER}",
            ctx.method
        )))
    });
    reg.register(object_id, service)
        .map_err(|e| super::errors::to_py(py, &e))
}

/// Set by an `atexit` hook once the interpreter starts to finalize: from then on a thread
/// that ends leaves its Python thread state alone (taking the GIL then may end the thread
/// inside its destructor).
static FINALIZING: AtomicBool = AtomicBool::new(false);
static ATEXIT: Once = Once::new();

/// A Python thread state this thread keeps between handlers (see `keep_thread_state`),
/// released when the thread ends.
struct KeptState;

impl Drop for KeptState {
    fn drop(&mut self) {
        // Acquire: pairs with the Release store in the atexit hook, so a thread ending after
        // the hook ran sees it (the hook runs before the interpreter tears thread states
        // down; a thread that ends in between still finds the interpreter initialized).
        // SAFETY: `Py_IsInitialized` may be called at any time.
        if FINALIZING.load(Ordering::Acquire) || unsafe { pyo3::ffi::Py_IsInitialized() } == 0 {
            return;
        }
        // SAFETY: the interpreter runs and this thread holds the extra count taken in
        // `keep_thread_state`: Ensure takes the GIL with that state (count 2), the first
        // Release drops the count to 1 keeping the GIL (it was "locked" when taken), the
        // second to 0, which clears and deletes the state and releases the GIL.
        unsafe {
            let g = pyo3::ffi::PyGILState_Ensure();
            pyo3::ffi::PyGILState_Release(pyo3::ffi::PyGILState_STATE::PyGILState_LOCKED);
            pyo3::ffi::PyGILState_Release(g);
        }
    }
}

thread_local! {
    static KEPT: std::cell::OnceCell<KeptState> = const { std::cell::OnceCell::new() };
}

/// Keep this thread's Python thread state after the handler returns. Each `attach` from a
/// thread Python did not start otherwise creates a thread state and deletes it again
/// (`PyGILState_Ensure` / `Release`), which costs a handler on the RPC threads a few µs
/// and an `mmap` / `munmap` of its frame stack every call. One extra count, taken once
/// per thread and given back when the thread ends, keeps it.
fn keep_thread_state(py: Python<'_>) {
    if KEPT.with(|k| k.get().is_some()) {
        return;
    }
    ATEXIT.call_once(|| {
        let hook = pyo3::types::PyCFunction::new_closure(py, None, None, |_, _| {
            // Release: pairs with the Acquire load in `KeptState::drop`.
            FINALIZING.store(true, Ordering::Release);
        });
        if let Ok(hook) = hook {
            let _ = py.import("atexit").and_then(|m| m.call_method1("register", (hook,)));
        }
    });
    // SAFETY: attached (`py`); this thread's state exists, and one more count keeps it
    // when the enclosing `attach` ends. `KeptState` gives the count back.
    unsafe { pyo3::ffi::PyGILState_Ensure() };
    KEPT.with(|k| {
        let _ = k.set(KeptState);
    });
}

/// Run `target.method(*args, **kwargs)` under the GIL.
fn call(target: &Py<PyAny>, method: &str, args: Args) -> tensorwire_rpc::Result<Value> {
    Python::attach(|py| {
        keep_thread_state(py);
        let run = || -> PyResult<Value> {
            let f = target.bind(py).getattr(method)?;
            let positional = args
                .args
                .into_iter()
                .map(|v| values::to_py(py, v))
                .collect::<PyResult<Vec<_>>>()?;
            let kwargs = PyDict::new(py);
            for (k, v) in args.kwargs {
                kwargs.set_item(k, values::to_py(py, v)?)?;
            }
            let out = f.call(PyTuple::new(py, positional)?, Some(&kwargs))?;
            values::to_value(&out)
        };
        run().map_err(|e| RpcError::Remote(remote_text(py, &e)))
    })
}
