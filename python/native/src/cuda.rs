//! CUDA for Python: what `cpp/src/cuda.cpp` and `cuda_info.cpp` do for `torch.ops`, over
//! the crate's Rust API, with torch reached only through integers (device pointers, the
//! `cudaStream_t` of `torch.cuda.current_stream(d).cuda_stream`, device indices) and
//! DLPack. `tensorwire/_cuda_ops.py` is the torch side.
//!
//! - **Export** (`cuda_send`): the storage (base pointer, byte size) under a lease that
//!   holds a Python reference to it (the caching allocator cannot reuse the block before
//!   the consumer released it), ordered after the work queued on `stream`. A storage
//!   that is a received CUDA import torch still holds (found by address in `LIVE`) is
//!   forwarded as the same memory (`Peer::export_cuda_imported`), as the C++ op does.
//! - **Import** (`pending` → `CudaPending.capsule(stream)`): `stream` is ordered after
//!   the producer's work as the connection's `cuda_wait` says (`CudaImported::wait_on`),
//!   then torch gets a `kDLCUDA` capsule of the storage's bytes. When torch's last view
//!   dies the capsule's owner releases the lease once the work queued on **that same
//!   stream** (the one given at receive time) has completed — the C++ op also uses the
//!   stream it waited on (`CudaImportCtx::stream`); work on other streams must be ordered
//!   before it by the user (`record_stream` semantics do not reach us).
//! - **GPU ring** (`cuda_ring_send`, `cuda_ring_recv` + `cuda_ring_recv_finish` or
//!   `cuda_ring_discard`): Python allocates the destination with torch between the steps.
//! - **Info**: `cuda_built`, `cuda_available`, `cuda_device_count`, the IPC handle cache.
//!
//! Errors are the C ABI's: class and `.code` by kind, message
//! `"tensorwire (TW_ERR_…): tw_<function>: …"` as the C++ ops raise them.

use crate::peer::PyPeer;
use crate::dlpack;
use crate::errors::{self, nonneg, refused};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;
use tensorwire::cuda::{CudaStream, DevicePtr};
use tensorwire::{CudaImported, DType, Error, ExportOptions, Layout, Owner, Peer, Wait};

// --- the core, without Python (tested on simcuda below) ----------------------------------

/// A timeout in ms as the ops take it: < 0 no limit, 0 do not wait.
fn wait_ms(ms: i64) -> Wait {
    match ms {
        ..0 => Wait::Forever,
        0 => Wait::Never,
        ms => Wait::For(Duration::from_millis(ms.unsigned_abs())),
    }
}

fn dtype_named(name: &str) -> Option<DType> {
    DType::ALL.into_iter().find(|d| d.name() == name)
}

/// CUDA imports torch holds through a capsule, by (storage address, serial): several live
/// imports may share an address (two messages of one allocation).
static LIVE: Mutex<BTreeMap<(u64, u64), Weak<CudaImported>>> = Mutex::new(BTreeMap::new());
static SERIAL: AtomicU64 = AtomicU64::new(0);

fn live() -> MutexGuard<'static, BTreeMap<(u64, u64), Weak<CudaImported>>> {
    // Nothing panics while holding the lock; a poisoned map is still consistent.
    LIVE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The live import whose storage starts at `ptr` on `device` and holds `nbytes` — the
/// storage torch made from its capsule (which starts exactly at the import's storage).
pub(crate) fn import_at(ptr: u64, nbytes: u64, device: i32) -> Option<Arc<CudaImported>> {
    let map = live();
    map.range((ptr, 0)..=(ptr, u64::MAX))
        .filter_map(|(_, w)| w.upgrade())
        .find(|imp| imp.device() == device && nbytes <= imp.storage_nbytes())
}

/// What a CUDA capsule owns: the import (shared with the leases of its forwards) and the
/// stream it was ordered on. Dropped by the capsule's deleter (any thread, no Python):
/// leaves the registry, then lets the import go once the work queued on `stream` so far
/// has completed (a mark the reaper polls; nothing blocks). If the mark cannot be
/// recorded, the import is let go at once (as the C++ deleter does).
pub(crate) struct TorchHold {
    imp: Option<Arc<CudaImported>>,
    key: (u64, u64),
    stream: CudaStream,
}

impl Drop for TorchHold {
    fn drop(&mut self) {
        live().remove(&self.key);
        if let Some(imp) = self.imp.take() {
            let _ = imp.release_shared_after(self.stream);
        }
    }
}

/// Order `stream` after the producer's writes to `imp` (its connection's `cuda_wait`),
/// then hold it for torch: registered by address until the returned hold drops. On
/// failure `imp` is dropped, which gives its lease back at once.
fn hold(imp: CudaImported, stream: CudaStream) -> tensorwire::Result<TorchHold> {
    imp.wait_on(stream)?;
    let imp = Arc::new(imp);
    let key = (imp.storage_ptr().get(), SERIAL.fetch_add(1, Ordering::Relaxed));
    live().insert(key, Arc::downgrade(&imp));
    Ok(TorchHold { imp: Some(imp), key, stream })
}

/// One CUDA export as `send` makes it: `nbytes` of storage at `ptr` on `device`, viewed as
/// `layout`, after the work queued on `stream`, under a lease holding `owner`. A storage
/// that is a received import torch holds is forwarded as the same memory (returns true).
#[allow(clippy::too_many_arguments)]
fn export(
    peer: &Peer,
    ptr: u64,
    nbytes: u64,
    device: i32,
    layout: &Layout,
    stream: CudaStream,
    owner: Owner,
    opts: ExportOptions,
) -> Result<bool, (&'static str, Error)> {
    if let Some(imp) = import_at(ptr, nbytes, device) {
        return peer
            .export_cuda_imported_with(imp, Some(*layout), stream, owner, opts)
            .map(|_| true)
            .map_err(|e| ("tw_peer_export_imported_cuda", e));
    }
    peer.export_cuda(DevicePtr(ptr), nbytes, layout, stream, owner, opts)
        .map(|_| false)
        .map_err(|e| ("tw_peer_export_cuda", e))
}

/// `ptr` is device memory of `device` (asked of the driver: a host or stale pointer is
/// refused here rather than handed to a copy engine).
fn check_device_ptr(ptr: u64, device: Option<i32>, what: &str) -> Result<(), String> {
    if ptr == 0 {
        return Err(format!("{what}: the device pointer is NULL"));
    }
    match tensorwire::cuda::driver::pointer_device(DevicePtr(ptr)) {
        Ok(d) if device.is_none_or(|want| want == d) => Ok(()),
        Ok(d) => Err(format!("{what}: {ptr:#x} is memory of CUDA device {d}, not of device {}", device.unwrap_or(-1))),
        Err(e) => Err(format!("{what}: {ptr:#x} is not CUDA device memory ({e})")),
    }
}

// --- Python --------------------------------------------------------------------------------

/// `err` as the C++ op raised it: the class and `.code` by kind, the message naming the C
/// ABI function (`"tensorwire (CODE): tw_…: …"`). Where `tensorwire.errors` cannot be
/// imported (a broken install, the Rust tests) the fallback `RuntimeError` names it too.
fn named(py: Python<'_>, function: &str, err: &Error) -> PyErr {
    let base = errors::to_py(py, err);
    let v = base.value(py);
    let code: Option<String> = v.getattr("code").ok().and_then(|c| c.extract().ok());
    let class = v.get_type().name().map(|n| n.to_string());
    match (code, class) {
        (Some(code), Ok(class)) => errors::raise(py, &class, Some(&code), format!("tensorwire ({code}): {function}: {err}")),
        _ => {
            let msg = v.str().map(|s| s.to_string()).unwrap_or_default();
            PyRuntimeError::new_err(msg.replacen("): ", &format!("): {function}: "), 1))
        }
    }
}

fn layout_of(py: Python<'_>, op: &str, dtype: &str, sizes: &[i64], strides: &[i64], offset: i64) -> PyResult<Layout> {
    crate::view::check_view(py, op, sizes.len(), strides.len())?;
    let dt = dtype_named(dtype).ok_or_else(|| refused(py, format!("tensorwire.{op}: dtype torch.{dtype} is not supported")))?;
    Layout::strided(dt, sizes, strides, offset).map_err(|e| named(py, &format!("tensorwire.{op}"), &e))
}

/// A received CUDA tensor not yet handed to torch: `capsule(stream)` orders `stream` after
/// the producer and makes the DLPack capsule (once). Dropped without a capsule, the lease
/// goes back at once.
#[pyclass(module = "tensorwire._native", name = "CudaPending", frozen)]
pub struct CudaPending {
    imp: Mutex<Option<CudaImported>>,
    device: i32,
    tag: u64,
    dtype: &'static str,
    sizes: Vec<i64>,
    strides: Vec<i64>,
    storage_offset: i64,
    nbytes: u64,
}

/// `Incoming::CudaTensor` for Python: a `CudaPending` (see there). Called by
/// `connection.rs`'s `recv`.
pub(crate) fn pending(py: Python<'_>, imp: CudaImported, tag: u64) -> PyResult<Py<PyAny>> {
    let l = imp.layout();
    let p = CudaPending {
        device: imp.device(),
        tag,
        dtype: l.dtype.name(),
        sizes: l.sizes().to_vec(),
        strides: l.strides().to_vec(),
        storage_offset: l.storage_offset,
        nbytes: imp.storage_nbytes(),
        imp: Mutex::new(Some(imp)),
    };
    Ok(Py::new(py, p)?.into_any())
}

#[pymethods]
impl CudaPending {
    /// The CUDA device index of the memory (in this process's numbering).
    #[getter]
    fn device(&self) -> i32 {
        self.device
    }
    #[getter]
    fn tag(&self) -> u64 {
        self.tag
    }
    /// The storage's byte size (the capsule's length).
    #[getter]
    fn nbytes(&self) -> u64 {
        self.nbytes
    }
    /// The producer's view: `(dtype name, sizes, strides, storage_offset in elements)`.
    #[getter]
    fn view(&self) -> (&'static str, Vec<i64>, Vec<i64>, i64) {
        (self.dtype, self.sizes.clone(), self.strides.clone(), self.storage_offset)
    }

    /// Order `stream` (a `cudaStream_t` of the import's device as an int; 0: the legacy
    /// default stream) after the producer's writes, then return a `"dltensor"` capsule
    /// (1-D uint8, the whole storage, kDLCUDA on `device`). When torch's last view of it
    /// dies, the lease is released once the work queued on this same `stream` by then has
    /// completed. Once only.
    fn capsule(&self, py: Python<'_>, stream: usize) -> PyResult<Py<PyAny>> {
        let imp = self
            .imp
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .ok_or_else(|| refused(py, "tensorwire.recv: this CUDA tensor was already handed to torch".to_string()))?;
        torch_capsule(py, imp, stream, "tensorwire.recv")
    }
}

/// Order `stream` after the producer's writes to `imp` (blocking without the GIL under
/// `cuda_wait=host`), register it, and return the `"dltensor"` capsule torch takes (1-D
/// uint8 over the whole storage, kDLCUDA on the import's device), whose owner releases the
/// lease after the work queued on `stream` once torch's last view dies. On failure `imp`
/// is dropped: its lease goes back at once.
fn torch_capsule(py: Python<'_>, imp: CudaImported, stream: usize, op: &str) -> PyResult<Py<PyAny>> {
    let device = imp.device();
    let stream = CudaStream(stream);
    let held = py.detach(move || hold(imp, stream)).map_err(|e| named(py, "tw_imported_cuda_wait", &e))?;
    let (ptr, nbytes) = match &held.imp {
        Some(imp) => (imp.storage_ptr().get(), imp.storage_nbytes()),
        None => unreachable!("a fresh hold has its import"),
    };
    let nbytes = usize::try_from(nbytes).map_err(|_| refused(py, format!("{op}: {nbytes} bytes do not fit")))?;
    // The capsule's data is a device address; it is never dereferenced on the host.
    dlpack::capsule(py, ptr as *mut u8, nbytes, (dlpack::DL_CUDA, device), Box::new(held))
}

// --- tensorwire.rpc values (`rpc/values.rs`) ----------------------------------------------

/// A CUDA storage of ours as an RPC tensor (`tensorwire_rpc::Tensor::Cuda`): `nbytes` at
/// `ptr` on `device` viewed as `layout`, exported each time it is sent after the work
/// queued on `stream` by then, under a lease holding `owner` (the torch storage). The
/// driver is asked that `ptr` is memory of `device`.
pub(crate) fn rpc_tensor(
    ptr: u64,
    nbytes: u64,
    device: i32,
    stream: usize,
    layout: Layout,
    owner: impl Send + Sync + 'static,
) -> tensorwire_rpc::Result<tensorwire_rpc::Tensor> {
    if nbytes == 0 || ptr.checked_add(nbytes).is_none() {
        return Err(tensorwire_rpc::RpcError::InvalidArgument(format!(
            "a CUDA storage of {nbytes} bytes at {ptr:#x} cannot be shared"
        )));
    }
    let t = tensorwire_rpc::CudaTensor::new(ptr, nbytes, layout, device, stream, owner)?;
    Ok(tensorwire_rpc::Tensor::Cuda(Arc::new(t)))
}

/// A CUDA tensor an RPC peer sent us, handed to torch: `stream` (the receiver's current
/// stream of its device) is ordered after the producer as the connection's `cuda_wait`
/// says, and the capsule's owner releases the lease after the work queued on `stream`
/// once torch's last view dies (as `CudaPending::capsule`). Registered like a `recv`
/// import, so sending it on is recognised (`import_at`).
pub(crate) fn rpc_import_capsule(py: Python<'_>, t: Arc<tensorwire_rpc::CudaImportedTensor>, stream: usize) -> PyResult<Py<PyAny>> {
    // Decoding makes one handle per tensor reference: nobody else holds it.
    let t = Arc::try_unwrap(t)
        .map_err(|_| refused(py, "tensorwire.rpc: a received CUDA tensor is shared elsewhere; it cannot be handed to torch".to_string()))?;
    torch_capsule(py, t.into_inner(), stream, "tensorwire.rpc")
}

/// Export the CUDA storage (`storage_ptr`, `storage_nbytes`; `owner` is kept alive by the
/// lease — pass the tensor's `untyped_storage()`) viewed as (`dtype`, `sizes`, `strides`,
/// `storage_offset` in elements), after the work queued on `stream` of `device`. Returns
/// true if the storage was a received CUDA tensor sent on as the same memory (forward).
#[pyfunction]
#[pyo3(signature = (conn, owner, storage_ptr, storage_nbytes, device, stream, dtype, sizes, strides, storage_offset, tag=0, window_ms=0))]
#[allow(clippy::too_many_arguments)]
fn cuda_send(
    py: Python<'_>,
    conn: PyRef<'_, PyPeer>,
    owner: Py<PyAny>,
    storage_ptr: u64,
    storage_nbytes: u64,
    device: i32,
    stream: usize,
    dtype: &str,
    sizes: Vec<i64>,
    strides: Vec<i64>,
    storage_offset: i64,
    tag: i64,
    window_ms: i64,
) -> PyResult<bool> {
    let tag = nonneg(py, "send", "tag", tag)?;
    let window_ms = nonneg(py, "send", "window_ms", window_ms)?;
    if storage_nbytes == 0 {
        return Err(refused(py, "tensorwire.send: an empty CUDA storage has no allocation to share".to_string()));
    }
    if storage_ptr.checked_add(storage_nbytes).is_none() {
        return Err(refused(py, format!("tensorwire.send: {storage_nbytes} bytes at {storage_ptr:#x} wrap around")));
    }
    check_device_ptr(storage_ptr, Some(device), "tensorwire.send").map_err(|m| refused(py, m))?;
    let layout = layout_of(py, "send", dtype, &sizes, &strides, storage_offset)?;
    let opts = ExportOptions { tag, window: (window_ms > 0).then(|| Duration::from_millis(window_ms)) };
    let peer = &conn.peer;
    let stream = CudaStream(stream);
    // Own memory: the lease holds the storage, dropped without the GIL when the lease
    // ends (PyO3 defers that decref to the next time this process enters `_native` or
    // returns from a blocking call in it). A forward's lease holds the import itself,
    // which is all the memory needs: holding the storage too would keep the upstream
    // lease until that deferred decref (a relay blocked in `recv` would hold it).
    let owner: Owner = if import_at(storage_ptr, storage_nbytes, device).is_some() {
        drop(owner);
        Box::new(())
    } else {
        Box::new(owner)
    };
    py.detach(|| export(peer, storage_ptr, storage_nbytes, device, &layout, stream, owner, opts))
        .map_err(|(f, e)| named(py, f, &e))
}

/// Copy the contiguous CUDA tensor (`dtype`, `sizes`, `strides`; element 0 at `data_ptr` of
/// `device`) through this side's GPU ring, the copies queued on `stream` after its work.
#[pyfunction]
#[pyo3(signature = (conn, data_ptr, device, stream, dtype, sizes, strides, tag=0, timeout_ms=-1))]
#[allow(clippy::too_many_arguments)]
fn cuda_ring_send(
    py: Python<'_>,
    conn: PyRef<'_, PyPeer>,
    data_ptr: u64,
    device: i32,
    stream: usize,
    dtype: &str,
    sizes: Vec<i64>,
    strides: Vec<i64>,
    tag: i64,
    timeout_ms: i64,
) -> PyResult<()> {
    let tag = nonneg(py, "ring_send", "tag", tag)?;
    let layout = layout_of(py, "ring_send", dtype, &sizes, &strides, 0)?;
    if layout.packed_bytes() > 0 {
        check_device_ptr(data_ptr, Some(device), "tensorwire.ring_send").map_err(|m| refused(py, m))?;
    }
    let peer = &conn.peer;
    py.detach(|| peer.cuda_ring_send(DevicePtr(data_ptr), &layout, CudaStream(stream), tag, wait_ms(timeout_ms)))
        .map_err(|e| named(py, "tw_peer_cuda_ring_send", &e))
}

/// The next message of the peer's GPU ring: `(tag, dtype name, sizes, device, nbytes)`.
/// Then `cuda_ring_recv_finish` into `nbytes` of memory on `device`, or
/// `cuda_ring_discard`; calling this again first describes the same message. One
/// receiving thread per connection (the package serialises them).
#[pyfunction]
#[pyo3(signature = (conn, timeout_ms=-1))]
fn cuda_ring_recv(py: Python<'_>, conn: PyRef<'_, PyPeer>, timeout_ms: i64) -> PyResult<(u64, &'static str, Vec<i64>, i32, u64)> {
    let peer = &conn.peer;
    let (tag, desc) = py.detach(|| peer.cuda_ring_recv(wait_ms(timeout_ms))).map_err(|e| named(py, "tw_peer_cuda_ring_recv", &e))?;
    let l = desc.layout();
    Ok((tag, l.dtype.name(), l.sizes().to_vec(), i32::from(desc.device_index), desc.storage.nbytes))
}

/// Copy the message `cuda_ring_recv` described into `capacity` bytes at `dst_ptr` (device
/// memory of the ring's device), on `stream` after the producer's copy in; frees its slots.
#[pyfunction]
#[pyo3(signature = (conn, dst_ptr, capacity, stream, timeout_ms=-1))]
fn cuda_ring_recv_finish(py: Python<'_>, conn: PyRef<'_, PyPeer>, dst_ptr: u64, capacity: u64, stream: usize, timeout_ms: i64) -> PyResult<()> {
    if capacity > 0 {
        check_device_ptr(dst_ptr, None, "tensorwire.cuda_ring_recv").map_err(|m| refused(py, m))?;
        if dst_ptr.checked_add(capacity).is_none() {
            return Err(refused(py, format!("tensorwire.cuda_ring_recv: {capacity} bytes at {dst_ptr:#x} wrap around")));
        }
    }
    let peer = &conn.peer;
    py.detach(|| peer.cuda_ring_recv_finish(DevicePtr(dst_ptr), capacity, CudaStream(stream), wait_ms(timeout_ms)))
        .map_err(|e| named(py, "tw_peer_cuda_ring_recv_finish", &e))
}

/// Drop the message `cuda_ring_recv` described without copying it (no-op if none).
#[pyfunction]
#[pyo3(signature = (conn, timeout_ms=-1))]
fn cuda_ring_discard(py: Python<'_>, conn: PyRef<'_, PyPeer>, timeout_ms: i64) -> PyResult<()> {
    let peer = &conn.peer;
    py.detach(|| peer.cuda_ring_discard(wait_ms(timeout_ms))).map_err(|e| named(py, "tw_peer_cuda_ring_discard", &e))
}

/// The next message, which must be a CUDA tensor, as a `CudaPending` (diagnostics and
/// `tests/gpu_smoke.py`; the package's `recv` takes every kind of message and calls
/// `pending` itself). Anything else is dropped and refused.
#[pyfunction]
#[pyo3(signature = (conn, timeout_ms=-1))]
fn cuda_recv(py: Python<'_>, conn: PyRef<'_, PyPeer>, timeout_ms: i64) -> PyResult<Py<PyAny>> {
    let peer = &conn.peer;
    match py.detach(|| peer.recv(wait_ms(timeout_ms))).map_err(|e| named(py, "tw_peer_recv", &e))? {
        tensorwire::Incoming::CudaTensor(imp) => {
            let tag = imp.tag();
            pending(py, imp, tag)
        }
        other => Err(refused(py, format!("tensorwire.cuda_recv: expected a CUDA tensor, got {other:?} (dropped)"))),
    }
}

/// True: this binding has CUDA (the driver is loaded at run time, no toolkit at build).
#[pyfunction]
fn cuda_built() -> bool {
    true
}

/// True if a CUDA driver is present and initialised.
#[pyfunction]
fn cuda_available(py: Python<'_>) -> bool {
    py.detach(tensorwire::cuda::available)
}

/// Number of CUDA devices; `CudaUnavailable` with the reason without a driver.
#[pyfunction]
fn cuda_device_count(py: Python<'_>) -> PyResult<usize> {
    py.detach(tensorwire::cuda::device_count).map_err(|e| named(py, "tw_cuda_device_count", &e))
}

/// This process's IPC handle cache: `[cuIpcOpenMemHandle calls so far, handles open now]`.
#[pyfunction]
fn cuda_ipc_cache_stats() -> [u64; 2] {
    let c = tensorwire::cuda::ipc::cache();
    [c.opens(), c.stats().0 as u64]
}

/// How many unused opened IPC handles stay open (default 0).
#[pyfunction]
fn cuda_ipc_cache_keep_warm(py: Python<'_>, n: i64) -> PyResult<()> {
    let n = nonneg(py, "cuda_ipc_cache_keep_warm", "n", n)?;
    tensorwire::cuda::ipc::cache().set_keep_warm(usize::try_from(n).unwrap_or(usize::MAX));
    Ok(())
}

/// Add the CUDA class and functions to `_native`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<CudaPending>()?;
    m.add_function(wrap_pyfunction!(cuda_send, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_recv, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_ring_send, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_ring_recv, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_ring_recv_finish, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_ring_discard, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_built, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_device_count, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_ipc_cache_stats, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_ipc_cache_keep_warm, m)?)?;
    Ok(())
}

/// On simcuda (`simcuda/run.sh cargo test -p tensorwire-python cuda`) or a GPU; without a
/// driver each test says SKIPPED and passes. Both ends of each connection are in this
/// process: the import is the exporter's own pointer (no IPC handle is opened), still
/// under the lease and the stream order.
#[cfg(test)]
#[path = "cuda_tests.rs"]
mod tests;

