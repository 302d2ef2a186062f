//! Python objects to RPC values and back: JSON data (None, bool, int of any size, float,
//! str, list, tuple, dict with str keys) and CPU and CUDA torch tensors. Nothing else is
//! sent: no pickle, and an object of another type is refused with its type named.
//!
//! Tensors: one whose storage is a live tensorwire segment (`tensorwire.rpc.empty`, or a
//! segment storage made by `_native.segment_storage`) travels as that segment under a
//! lease, no copy; one received over the RPC (any view of its storage) is forwarded as the
//! producer's memory. Any other CPU tensor is packed into a recycled segment (`crate::pool`)
//! when its view is at most `pool::MAX_POOLED` bytes, else its storage moves into a segment
//! in place (`tensorwire._ops.share_for_send`; copied once into a fresh segment where it
//! cannot move). A tensor that arrives reaches torch by DLPack over the imported storage;
//! its lease ends when torch's last view of it dies — or, when it is our own segment sent
//! back, as a view of that segment.
//!
//! CUDA tensors travel as the Rust RPC's CUDA value (native connections only; anything
//! else is `CudaUnavailable` before a byte is sent): the storage exported zero-copy after
//! the work queued on the sender's current stream of its device, under a lease holding the
//! storage; it arrives as a torch CUDA tensor ordered on the receiver's current stream of
//! that device as the connection's `cuda_wait` says, its lease released after the work
//! queued on that stream once torch's last view dies (`crate::cuda` holds the pieces
//! shared with `tensorwire.send`/`recv`; `tensorwire/_cuda_ops.py` the torch side).

use crate::dlpack;
use crate::errors::refused;
use crate::storage;
use super::tensors::{MAX_DEPTH, too_deep, cuda_ops, rpc_err, tensor_value, torch, type_name};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use std::sync::Arc;
use tensorwire::Layout;
use tensorwire_rpc::{Tensor, Value};

/// `torch.from_dlpack`, looked up once: importing `torch` again for each received tensor
/// (a `sys.modules` lookup under the import lock) cost about as much as the call.
fn from_dlpack(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    static FROM_DLPACK: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    FROM_DLPACK.import(py, "torch", "from_dlpack")
}

/// `obj` as a value to send.
pub fn to_value(obj: &Bound<'_, PyAny>) -> PyResult<Value> {
    to_value_at(obj, 0)
}

fn to_value_at(obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<Value> {
    let py = obj.py();
    if depth > MAX_DEPTH {
        return Err(too_deep(py));
    }
    if obj.is_none() {
        return Ok(Value::Null);
    }
    // bool before int: Python's bool is an int.
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if let Ok(i) = obj.cast::<PyInt>() {
        return Ok(match i.extract::<i64>() {
            Ok(v) => Value::Int(v),
            Err(_) => Value::BigInt(i.str()?.to_string()),
        });
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Ok(Value::Float(f.value()));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Value::Str(s.to_str()?.to_owned()));
    }
    // Containers go straight to the wire's text, with no tree (see `json_text`).
    if obj.cast::<PyList>().is_ok() || obj.cast::<PyTuple>().is_ok() || obj.cast::<PyDict>().is_ok() {
        return super::json_text::write(obj);
    }
    if let Some(v) = tensor_value(obj)? {
        return Ok(v);
    }
    Err(refused(
        py,
        format!(
            "tensorwire.rpc cannot send a {}: values are JSON data (None, bool, int, float, str, list, tuple, dict with str keys) and torch tensors, never pickled",
            type_name(obj)
        ),
    ))
}

/// A received value as a Python object.
pub fn to_py(py: Python<'_>, v: Value) -> PyResult<Py<PyAny>> {
    to_py_keys(py, v, &mut KeyMemo::default())
}

/// The dict keys made for one received value, by text: a key repeated across its dicts
/// (a list of records) becomes one `str`, made and hashed once, as `json.loads` shares
/// them. Bounded, so a value of many distinct keys costs no more than without it.
#[derive(Default)]
struct KeyMemo {
    keys: std::collections::HashMap<String, Py<PyString>>,
}

impl KeyMemo {
    /// Keys this long or longer are made each time (rarely repeated, costly to hash twice).
    const MAX_KEY_BYTES: usize = 64;
    /// Distinct keys remembered per value.
    const MAX_KEYS: usize = 1024;

    fn key(&mut self, py: Python<'_>, k: String) -> Py<PyString> {
        if k.len() >= Self::MAX_KEY_BYTES {
            return PyString::new(py, &k).unbind();
        }
        if let Some(s) = self.keys.get(&k) {
            return s.clone_ref(py);
        }
        let s = PyString::new(py, &k).unbind();
        if self.keys.len() < Self::MAX_KEYS {
            self.keys.insert(k, s.clone_ref(py));
        }
        s
    }
}

fn to_py_keys(py: Python<'_>, v: Value, memo: &mut KeyMemo) -> PyResult<Py<PyAny>> {
    Ok(match v {
        Value::Null => py.None(),
        Value::Bool(b) => PyBool::new(py, b).to_owned().into_any().unbind(),
        Value::Int(i) => i.into_pyobject(py)?.into_any().unbind(),
        Value::BigInt(digits) => py.get_type::<PyInt>().call1((digits,))?.unbind(),
        Value::Float(f) => PyFloat::new(py, f).into_any().unbind(),
        Value::Str(s) => PyString::new(py, &s).into_any().unbind(),
        Value::Array(items) => {
            let items = items
                .into_iter()
                .map(|x| to_py_keys(py, x, memo))
                .collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, items)?.into_any().unbind()
        }
        Value::Object(m) => {
            let d = PyDict::new(py);
            for (k, x) in m {
                d.set_item(memo.key(py, k), to_py_keys(py, x, memo)?)?;
            }
            d.into_any().unbind()
        }
        Value::Tensor(t) => tensor_to_py(py, *t)?,
        Value::Json(j) => {
            if !j.tensors().is_empty() {
                return Err(refused(
                    py,
                    "tensorwire.rpc: a value written to be sent (with tensors in it) arrived as a received one".into(),
                ));
            }
            super::json_text::read(py, j.text())?
        }
    })
}

/// A CPU view as torch reads it from DLPack in one step (its dtype, sizes, strides, first
/// element): one `from_dlpack` instead of that and a `view` and an `as_strided`, which cost
/// more than the rest of receiving it. `None` where DLPack cannot say it (a dtype torch may
/// not read from DLPack, a negative stride, no elements): the bytes-and-view path then.
fn typed_view(layout: &Layout, storage: *mut u8, nbytes: usize) -> Option<(*mut u8, dlpack::DLDataType, Vec<i64>, Vec<i64>)> {
    let dtype = dlpack::dl_dtype(layout.dtype)?;
    if nbytes == 0 || layout.numel() == 0 || layout.strides().iter().any(|&s| s < 0) {
        return None;
    }
    let first = usize::try_from(layout.storage_offset).ok()?.checked_mul(layout.dtype.size())?;
    // The view's extent was checked against the storage's bytes when it arrived; this
    // repeats the one bound the pointer arithmetic needs.
    if first >= nbytes || layout.extent_bytes().ok()? > nbytes as u64 {
        return None;
    }
    // SAFETY: `first < nbytes`, inside the storage.
    let data = unsafe { storage.add(first) };
    Some((data, dtype, layout.sizes().to_vec(), layout.strides().to_vec()))
}

fn tensor_to_py(py: Python<'_>, t: Tensor) -> PyResult<Py<PyAny>> {
    let layout = t.layout();
    let cap = match t {
        Tensor::Imported(imp) | Tensor::ImportedView(imp, _) => {
            // Our own memory sent back (a worker returning what it was given): a view of
            // our segment, the import let go at once. So the tensor is the one we sent
            // (same storage address), and sending it again exports our segment instead of
            // forwarding an import — a chain of forwards could otherwise grow by two
            // leases a round trip while each result is sent back in.
            if let Some((seg, base)) = storage::own_range(&imp) {
                let nbytes = imp.storage_nbytes();
                drop(imp);
                // SAFETY: `own_range` checked `base + nbytes` against the segment's length.
                let ptr = unsafe { seg.as_ptr().add(base) };
                let owner = storage::own_owner(seg);
                if let Some((data, dtype, sizes, strides)) = typed_view(&layout, ptr, nbytes) {
                    // SAFETY: `typed_view` kept the view inside the storage, which the
                    // segment (the owner) keeps mapped.
                    let cap = unsafe { dlpack::view_capsule(py, data, dtype, sizes, strides, (dlpack::DL_CPU, 0), owner)? };
                    return Ok(from_dlpack(py)?.call1((cap,))?.unbind());
                }
                let cap = dlpack::capsule(py, ptr, nbytes, (dlpack::DL_CPU, 0), owner)?;
                return bytes_view(py, cap, &layout);
            }
            let (ptr, nbytes) = (imp.storage_ptr(), imp.storage_nbytes());
            // Registered by address, so that the tensor (or any view of it) sent on is
            // forwarded as the producer's memory.
            let owner = Box::new(storage::RegisteredRpcImport::new(imp));
            if let Some((data, dtype, sizes, strides)) = typed_view(&layout, ptr, nbytes) {
                // SAFETY: `typed_view` kept the view inside the import's storage, which
                // the import (the owner) keeps mapped.
                let cap = unsafe { dlpack::view_capsule(py, data, dtype, sizes, strides, (dlpack::DL_CPU, 0), owner)? };
                return Ok(from_dlpack(py)?.call1((cap,))?.unbind());
            }
            dlpack::capsule(py, ptr, nbytes, (dlpack::DL_CPU, 0), owner)?
        }
        Tensor::Shared(shared) => {
            let (ptr, nbytes) = (shared.storage_ptr(), shared.storage_nbytes());
            dlpack::capsule(py, ptr, nbytes, (dlpack::DL_CPU, 0), Box::new(shared))?
        }
        Tensor::File(_) => {
            // A pyisolate peer's file_system tensor: copied (within the connection's copy
            // limit) into a segment of ours, the file is not kept mapped.
            let (bytes, _) = t.storage_copy().map_err(|e| rpc_err(py, e))?;
            let seg = Arc::new(
                tensorwire::Segment::create(bytes.len().max(1))
                    .map_err(|e| crate::errors::to_py(py, &e))?,
            );
            // SAFETY: the segment is fresh, at least `bytes.len()` long and not yet shared.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), seg.as_ptr(), bytes.len()) };
            let ptr = seg.as_ptr();
            dlpack::capsule(py, ptr, bytes.len(), (dlpack::DL_CPU, 0), Box::new(seg))?
        }
        Tensor::CudaImported(imp) => {
            // The receiver's current stream of the device waits for the producer (the
            // connection's `cuda_wait`); a device this process does not see is
            // `CudaUnavailable`, the import dropped (its lease goes back).
            let ops = cuda_ops(py)?;
            let stream: usize = ops
                .call_method1("import_stream", (imp.device(),))?
                .extract()?;
            let cap = crate::cuda::rpc_import_capsule(py, imp, stream)?;
            let view = ops.call_method1(
                "tensor_of_capsule",
                (
                    cap,
                    layout.dtype.name(),
                    layout.sizes().to_vec(),
                    layout.strides().to_vec(),
                    layout.storage_offset,
                ),
            )?;
            return Ok(view.unbind());
        }
        Tensor::Owned(o) => {
            // Arrived inside the frame: private memory, torch's own from here (the capsule
            // owns the buffer). Sent on, it is an ordinary tensor again.
            let mut owner = Box::new(Arc::unwrap_or_clone(o));
            let bytes = owner.bytes_mut();
            let (ptr, nbytes) = (bytes.as_mut_ptr(), bytes.len());
            if let Some((data, dtype, sizes, strides)) = typed_view(&layout, ptr, nbytes) {
                // SAFETY: `typed_view` kept the view inside the buffer, which the owner
                // keeps (a boxed heap buffer: moving the box does not move it).
                let cap = unsafe { dlpack::view_capsule(py, data, dtype, sizes, strides, (dlpack::DL_CPU, 0), owner)? };
                return Ok(from_dlpack(py)?.call1((cap,))?.unbind());
            }
            dlpack::capsule(py, ptr, nbytes, (dlpack::DL_CPU, 0), owner)?
        }
        Tensor::Cuda(_) => {
            return Err(refused(
                py,
                "tensorwire.rpc: a CUDA tensor of this process cannot arrive as a received value"
                    .into(),
            ));
        }
    };
    bytes_view(py, cap, &layout)
}

/// The view `layout` over a 1-D uint8 capsule of its storage.
fn bytes_view(py: Python<'_>, cap: Py<PyAny>, layout: &Layout) -> PyResult<Py<PyAny>> {
    let torch = torch(py)?;
    let bytes = from_dlpack(py)?.call1((cap,))?;
    let typed = bytes.call_method1("view", (torch.getattr(layout.dtype.name())?,))?;
    let view = typed.call_method1(
        "as_strided",
        (
            layout.sizes().to_vec(),
            layout.strides().to_vec(),
            layout.storage_offset,
        ),
    )?;
    Ok(view.unbind())
}
