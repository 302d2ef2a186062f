//! Torch tensors as RPC tensor values, the sending side of `values` (whose module docs say
//! how each kind of tensor travels), and what `values` and `json_text` share: the depth
//! limit and type names. Both reach tensors through here, so neither needs the other for
//! them: `values` hands containers to `json_text`, and `json_text` hands each tensor in
//! them to this module.

use crate::errors::refused;
use crate::storage;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::intern;
use pyo3::types::{PyDict, PyTuple, PyType};
use tensorwire::{DType, Layout, SharedTensor};
use tensorwire_rpc::{Tensor, Value};

/// Deeper values are refused: a cyclic list would otherwise recurse without end, and the
/// peer's decoder refuses deeper JSON anyway (`RpcConfig::max_depth`).
pub(super) const MAX_DEPTH: usize = 256;

/// The refusal of a value deeper than [`MAX_DEPTH`] (or cyclic), before a byte is sent.
pub(super) fn too_deep(py: Python<'_>) -> PyErr {
    refused(py, format!("tensorwire.rpc: a value nested deeper than {MAX_DEPTH} levels (or a cyclic one) cannot be sent"))
}

fn torch_tensor_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    static TYPE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    TYPE.import(py, "torch", "Tensor")
}

pub(super) fn torch(py: Python<'_>) -> PyResult<Bound<'_, PyModule>> {
    py.import("torch")
}

/// `obj` as a tensor value when it is a torch tensor (`None` when it is not).
pub(super) fn tensor_value(obj: &Bound<'_, PyAny>) -> PyResult<Option<Value>> {
    if obj.is_instance(torch_tensor_type(obj.py())?)? {
        return tensor_to_value(obj).map(Some);
    }
    Ok(None)
}

pub(super) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "<unknown type>".into())
}

fn dtype_named(py: Python<'_>, name: &str) -> PyResult<DType> {
    DType::ALL
        .into_iter()
        .find(|d| d.name() == name)
        .ok_or_else(|| {
            refused(
                py,
                format!("tensorwire.rpc: dtype torch.{name} is not supported"),
            )
        })
}

pub(super) fn rpc_err(py: Python<'_>, e: tensorwire_rpc::RpcError) -> PyErr {
    super::errors::to_py(py, &e)
}

/// `torch.strided`, looked up once (a tensor's layout is compared with it by identity).
fn torch_strided(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    static STRIDED: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    STRIDED.import(py, "torch", "strided")
}

/// `torch.<name>` → tensorwire dtype for every dtype this torch has, built once: a sent
/// tensor's dtype is one dict lookup, not a `str()` and a search.
fn dtype_table(py: Python<'_>) -> PyResult<&Bound<'_, PyDict>> {
    static TABLE: PyOnceLock<Py<PyDict>> = PyOnceLock::new();
    TABLE
        .get_or_try_init(py, || {
            let torch = torch(py)?;
            let table = PyDict::new(py);
            for d in DType::ALL {
                // A dtype this torch lacks (an older one, without some float8) is absent:
                // such a tensor cannot exist here.
                if let Ok(obj) = torch.getattr(d.name()) {
                    table.set_item(obj, d as u8)?;
                }
            }
            Ok::<_, PyErr>(table.unbind())
        })
        .map(|t| t.bind(py))
}

fn tensor_dtype(t: &Bound<'_, PyAny>) -> PyResult<DType> {
    let py = t.py();
    let obj = t.getattr(intern!(py, "dtype"))?;
    if let Some(code) = dtype_table(py)?.get_item(&obj)? {
        if let Some(d) = DType::from_code(code.extract()?) {
            return Ok(d);
        }
    }
    let text = obj.str()?.to_string();
    dtype_named(py, text.strip_prefix("torch.").unwrap_or(&text))
}

/// A tensor's sizes or strides (a `torch.Size` or a tuple of ints), read item by item:
/// cheaper than a generic sequence extraction, which this runs for every tensor sent.
fn int_tuple(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    match obj.cast::<PyTuple>() {
        Ok(t) => t.iter().map(|x| x.extract::<i64>()).collect(),
        Err(_) => obj.extract(),
    }
}

fn tensor_to_value(t: &Bound<'_, PyAny>) -> PyResult<Value> {
    let py = t.py();
    // `is_cpu` first: the common case in one attribute read, the device's name only else.
    let cpu = t.getattr(intern!(py, "is_cpu"))?.is_truthy()?;
    if !cpu {
        let device: String = t.getattr("device")?.getattr("type")?.extract()?;
        if device != "cuda" {
            return Err(refused(
                py,
                format!(
                    "tensorwire.rpc: a {device} tensor cannot be sent (CPU and CUDA tensors only); move it with .cpu()"
                ),
            ));
        }
    }
    if !t.getattr(intern!(py, "layout"))?.is(torch_strided(py)?) {
        return Err(refused(
            py,
            "tensorwire.rpc: only strided (dense) tensors can be sent".into(),
        ));
    }
    if !cpu {
        return cuda_tensor_to_value(t);
    }
    let dtype = tensor_dtype(t)?;
    let sizes = int_tuple(&t.getattr(intern!(py, "shape"))?)?;
    let storage = t.call_method0(intern!(py, "untyped_storage"))?;
    let (sptr, snbytes): (usize, usize) = (
        storage.call_method0(intern!(py, "data_ptr"))?.extract()?,
        storage.call_method0(intern!(py, "nbytes"))?.extract()?,
    );
    let strides = int_tuple(&t.call_method0(intern!(py, "stride"))?)?;
    let offset: i64 = t.call_method0(intern!(py, "storage_offset"))?.extract()?;
    let layout = Layout::strided(dtype, &sizes, &strides, offset).map_err(|e| crate::errors::to_py(py, &e))?;
    if let Some((seg, off)) = storage::segment_at(sptr, snbytes) {
        let shared = SharedTensor::new(seg, off, snbytes, layout)
            .map_err(|e| crate::errors::to_py(py, &e))?;
        return Ok(Value::Tensor(Box::new(Tensor::Shared(shared))));
    }
    // A tensor received over tensorwire.rpc (any view of its storage): forwarded as the
    // producer's memory when sent, never copied.
    if let Some(v) = storage::rpc_import_view(sptr, snbytes, &layout) {
        return Ok(Value::Tensor(Box::new(v.map_err(|e| rpc_err(py, e))?)));
    }
    // A lazy conjugate or negative bit (complex views) would be lost as bytes: apply it.
    if matches!(dtype, DType::Complex32 | DType::Complex64 | DType::Complex128)
        && (t.call_method0("is_conj")?.is_truthy()? || t.call_method0("is_neg")?.is_truthy()?)
    {
        let resolved = t.call_method0("resolve_conj")?.call_method0("resolve_neg")?;
        return tensor_to_value(&resolved);
    }
    // Small: packed into a buffer of its own, which goes inside the frame on a connection
    // that negotiated inline tensors. Sent back to us, it arrives as private memory again.
    if layout.packed_bytes() <= crate::pool::MAX_OWNED as u64 {
        // SAFETY: the storage is `snbytes` bytes at `sptr`, kept alive by `t` (referenced
        // across the call) and not resized meanwhile: the GIL is held throughout.
        let owned = unsafe { crate::pool::owned_copy(sptr as *const u8, snbytes, &layout) }.map_err(|e| rpc_err(py, e))?;
        return Ok(Value::Tensor(Box::new(Tensor::Owned(std::sync::Arc::new(owned)))));
    }
    // Large: the whole storage moves into a segment in place on its first trip (as
    // `share_memory_()` does), so later sends of any view of it are zero-copy. Where
    // it cannot move (an older torch, a storage shared otherwise) it is copied once into
    // a fresh segment.
    if layout.packed_bytes() > crate::pool::MAX_POOLED as u64 {
        let moved: bool = py.import("tensorwire._ops")?.call_method1("share_for_send", (&storage,))?.extract()?;
        let (nptr, nnbytes): (usize, usize) = (
            storage.call_method0("data_ptr")?.extract()?,
            storage.call_method0("nbytes")?.extract()?,
        );
        if moved {
            if let Some((seg, off)) = storage::segment_at(nptr, nnbytes) {
                let shared = SharedTensor::new(seg, off, nnbytes, layout).map_err(|e| crate::errors::to_py(py, &e))?;
                return Ok(Value::Tensor(Box::new(Tensor::Shared(shared))));
            }
        }
        let n = usize::try_from(layout.packed_bytes()).unwrap_or(usize::MAX);
        let fresh = SharedTensor::zeros(Layout::contiguous(dtype, &sizes).map_err(|e| crate::errors::to_py(py, &e))?)
            .map_err(|e| crate::errors::to_py(py, &e))?;
        storage::remember_own(fresh.segment());
        let extent = layout.extent_bytes().map_err(|e| crate::errors::to_py(py, &e))?;
        if extent > nnbytes as u64 {
            return Err(refused(py, format!("tensorwire.rpc: the view {layout:?} passes the end of its storage of {nnbytes} bytes")));
        }
        if n > 0 {
            // SAFETY: the fresh segment holds `n` packed bytes and nobody else has it; the
            // tensor's storage (alive: `t` is referenced, and the GIL held, so nothing
            // resizes it) covers the view's extent, checked above.
            let dst = unsafe { std::slice::from_raw_parts_mut(fresh.storage_ptr(), n) };
            // SAFETY: as above.
            unsafe { tensorwire::desc::PackCursor::new(&layout).fill(nptr as *const u8, dst) };
        }
        return Ok(Value::Tensor(Box::new(Tensor::Shared(fresh))));
    }
    // Medium: packed into a recycled segment of this process's pool.
    // SAFETY: the storage is `snbytes` bytes at `sptr`, kept alive by `t` (referenced
    // across the call) and not resized meanwhile: the GIL is held throughout.
    let shared = unsafe { crate::pool::packed_copy(sptr as *const u8, snbytes, &layout) }
        .map_err(|e| crate::errors::to_py(py, &e))?;
    Ok(Value::Tensor(Box::new(Tensor::Shared(shared))))
}

pub(super) fn cuda_ops(py: Python<'_>) -> PyResult<Bound<'_, PyModule>> {
    py.import("tensorwire._cuda_ops")
}

/// A CUDA tensor as the Rust RPC's CUDA value: its storage exported zero-copy (each time
/// the value is sent) after the work queued on its device's current stream, under a lease
/// holding the storage. `_cuda_ops.export_parts` reads what the export needs (the same as
/// `tensorwire.send`). A storage that is a CUDA tensor received from a peer (held by
/// torch) cannot be exported again by the RPC layer (its memory is that peer's
/// allocation): it is cloned once, on the current stream, and the clone is sent. The
/// caller checked the layout (strided).
fn cuda_tensor_to_value(t: &Bound<'_, PyAny>) -> PyResult<Value> {
    let py = t.py();
    type Parts = (
        Py<PyAny>,
        u64,
        u64,
        i32,
        usize,
        String,
        Vec<i64>,
        Vec<i64>,
        i64,
        bool,
    );
    let ops = cuda_ops(py)?;
    let mut parts: Parts = ops.call_method1("export_parts", (t,))?.extract()?;
    if crate::cuda::import_at(parts.1, parts.2, parts.3).is_some() {
        let copy = t.call_method0("clone")?;
        parts = ops.call_method1("export_parts", (copy,))?.extract()?;
    }
    let (storage, ptr, nbytes, device, stream, dtype_name, sizes, strides, offset, _) = parts;
    let dtype = dtype_named(py, &dtype_name)?;
    let layout = Layout::strided(dtype, &sizes, &strides, offset)
        .map_err(|e| crate::errors::to_py(py, &e))?;
    // The storage is the lease's owner: dropped (decref deferred by PyO3 when off the GIL)
    // once every lease of every send has ended and the value is gone.
    let tensor = crate::cuda::rpc_tensor(ptr, nbytes, device, stream, layout, storage)
        .map_err(|e| rpc_err(py, e))?;
    Ok(Value::Tensor(Box::new(tensor)))
}
