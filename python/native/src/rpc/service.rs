//! Python objects served to the peer: each public callable attribute (a name without a
//! leading `_`) of the object becomes a method. A call runs on one of the endpoint's
//! handler threads, which takes the GIL; many calls can be in flight, and a handler may
//! call the peer back (the peer serves that on its own threads).

use super::errors::remote_text;
use super::values;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::sync::Arc;
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
    let mut service = Service::new(&type_name);
    let shared = Arc::new(obj.clone().unbind());
    for name in obj.dir()?.iter() {
        let name: String = name.extract()?;
        if name.starts_with('_') || !obj.getattr(name.as_str()).is_ok_and(|a| a.is_callable()) {
            continue;
        }
        let target = shared.clone();
        let method = name.clone();
        service = service.method(&name, move |_, args| call(&target, &method, args));
    }
    reg.register(object_id, service)
        .map_err(|e| super::errors::to_py(py, &e))
}

/// Run `target.method(*args, **kwargs)` under the GIL.
fn call(target: &Py<PyAny>, method: &str, args: Args) -> tensorwire_rpc::Result<Value> {
    Python::attach(|py| {
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
