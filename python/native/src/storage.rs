//! Shared storages: sealed segments made by Rust and handed to torch by DLPack, segments
//! over a trusted peer's fd (`from_torch_fd`), and the registries that recognise them — and
//! received imports — again by address when a tensor over one is exported or asked about
//! (the binding's counterpart of the C++ extension's `segment_of` / `import_of`, which look
//! at the storage's deleter; here the storage pointer and size are all Python hands over).

use crate::dlpack;
use crate::errors::{IntoPy, op_error};
use pyo3::prelude::*;
use std::collections::BTreeMap;
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use tensorwire::{Imported, Layout, Segment};
use tensorwire_rpc::{ImportedTensor, Tensor};

/// A segment torch holds through a capsule: sealed (ours, exportable as it is) or not (a
/// trusted peer's fd: exported by copy, as the extension does).
struct Entry {
    seg: Weak<Segment>,
    sealed: bool,
    /// Capsules over this segment torch holds (one made here, and one per received tensor
    /// that is a range of it, sent back to us): the entry goes with the last.
    holders: usize,
}

/// Live segments that torch holds through a capsule, by base address.
static LIVE: Mutex<BTreeMap<usize, Entry>> = Mutex::new(BTreeMap::new());

/// Received CPU imports that torch holds through a capsule, by storage address. Two imports
/// of the same memory can share an address (the import cache maps a range once), hence a
/// list.
static IMPORTS: Mutex<BTreeMap<usize, Vec<Weak<Imported>>>> = Mutex::new(BTreeMap::new());

fn lock<T>(m: &'static Mutex<T>) -> MutexGuard<'static, T> {
    // Nothing panics while holding these locks; a poisoned map is still consistent.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What a capsule over a segment owns: the segment, and its registry entry until torch's
/// last view of the storage dies.
struct Registered(Arc<Segment>);

impl Drop for Registered {
    fn drop(&mut self) {
        let base = self.0.as_ptr() as usize;
        let mut map = lock(&LIVE);
        // Another segment may already be mapped at this address only after this one is
        // unmapped, which happens after this drop; remove the entry only if it is ours.
        if let Some(e) = map.get_mut(&base).filter(|e| std::ptr::eq(e.seg.as_ptr(), Arc::as_ptr(&self.0))) {
            e.holders -= 1;
            if e.holders == 0 {
                map.remove(&base);
            }
        }
    }
}

/// What a capsule over a received tensor owns: the import (its drop ends the lease once no
/// forwarded lease holds it either), and its registry entry.
struct RegisteredImport(Arc<Imported>);

impl Drop for RegisteredImport {
    fn drop(&mut self) {
        let base = self.0.storage_ptr() as usize;
        let mut map = lock(&IMPORTS);
        if let Some(list) = map.get_mut(&base) {
            list.retain(|w| !std::ptr::eq(w.as_ptr(), Arc::as_ptr(&self.0)) && w.strong_count() > 0);
            if list.is_empty() {
                map.remove(&base);
            }
        }
    }
}

/// CPU tensors received over `tensorwire.rpc` that torch holds through a capsule, by
/// storage address (a list: two imports of the same memory share an address, as above).
static RPC_IMPORTS: Mutex<BTreeMap<usize, Vec<Weak<ImportedTensor>>>> = Mutex::new(BTreeMap::new());

/// What a capsule over a tensor received over `tensorwire.rpc` owns: the import (its lease
/// ends once torch's last view dies and no forward of it is leased), and its registry
/// entry, so that a view of it sent on is forwarded as the producer's memory.
pub struct RegisteredRpcImport(Arc<ImportedTensor>);

impl RegisteredRpcImport {
    pub fn new(imp: Arc<ImportedTensor>) -> RegisteredRpcImport {
        let base = imp.storage_ptr() as usize;
        lock(&RPC_IMPORTS).entry(base).or_default().push(Arc::downgrade(&imp));
        RegisteredRpcImport(imp)
    }
}

impl Drop for RegisteredRpcImport {
    fn drop(&mut self) {
        let base = self.0.storage_ptr() as usize;
        let mut map = lock(&RPC_IMPORTS);
        if let Some(list) = map.get_mut(&base) {
            list.retain(|w| !std::ptr::eq(w.as_ptr(), Arc::as_ptr(&self.0)) && w.strong_count() > 0);
            if list.is_empty() {
                map.remove(&base);
            }
        }
    }
}

/// Registered imports whose storage starts at most this far below a looked-up address
/// are considered (imports of ranges of one window can share lower addresses).
const RPC_IMPORT_LOOKBACK: usize = 8;

/// The RPC import whose storage contains `[ptr, ptr + nbytes)` (a torch storage made from
/// its capsule: torch's storage starts at the view's first element), with `layout` (a view
/// whose offset counts elements from `ptr`) restated over the import's storage — `None` if
/// no live import holds that memory or the view is not at a whole element from the
/// import's start (then it is copied as private memory).
pub fn rpc_import_view(ptr: usize, nbytes: usize, layout: &Layout) -> Option<tensorwire_rpc::Result<Tensor>> {
    let map = lock(&RPC_IMPORTS);
    let end = ptr.checked_add(nbytes)?;
    let imp = map
        .range(..=ptr)
        .rev()
        .take(RPC_IMPORT_LOOKBACK)
        .flat_map(|(_, list)| list.iter().filter_map(Weak::upgrade))
        .find(|imp| {
            let base = imp.storage_ptr() as usize;
            ptr >= base && end <= base + imp.storage_nbytes()
        })?;
    drop(map);
    let es = layout.dtype.size();
    let skip = ptr - imp.storage_ptr() as usize;
    if skip % es != 0 {
        return None;
    }
    let offset = layout.storage_offset.checked_add(i64::try_from(skip / es).ok()?)?;
    let view = match Layout::strided(layout.dtype, layout.sizes(), layout.strides(), offset) {
        Ok(v) => v,
        Err(e) => return Some(Err(e.into())),
    };
    Some(Tensor::imported_view(imp, view))
}

/// The transport's import behind a registered RPC import whose storage starts at `ptr`
/// and holds at least `nbytes` (to forward it through a `Peer`, as `import_at`).
fn rpc_import_at(ptr: usize, nbytes: usize) -> Option<Arc<Imported>> {
    let map = lock(&RPC_IMPORTS);
    map.get(&ptr)?
        .iter()
        .filter_map(Weak::upgrade)
        .find(|imp| imp.storage_nbytes() >= nbytes)
        .map(|imp| Arc::clone(imp.inner()))
}

fn entry_at(ptr: usize, nbytes: usize) -> Option<(Arc<Segment>, usize, bool)> {
    let map = lock(&LIVE);
    let (&base, e) = map.range(..=ptr).next_back()?;
    let seg = e.seg.upgrade()?;
    let off = ptr - base;
    (off.checked_add(nbytes)? <= seg.len()).then_some((seg, off, e.sealed))
}

/// The sealed segment whose mapping contains `[ptr, ptr + nbytes)`, and the offset of
/// `ptr` in it (what can be exported as it is).
pub fn segment_at(ptr: usize, nbytes: usize) -> Option<(Arc<Segment>, usize)> {
    entry_at(ptr, nbytes).and_then(|(seg, off, sealed)| sealed.then_some((seg, off)))
}

/// The import whose storage starts at `ptr` and is at least `nbytes` long (a received
/// tensor's storage, to forward as the producer's memory).
pub fn import_at(ptr: usize, nbytes: usize) -> Option<Arc<Imported>> {
    let found = lock(&IMPORTS).get(&ptr).and_then(|list| list.iter().filter_map(Weak::upgrade).find(|imp| imp.storage_nbytes() >= nbytes));
    found.or_else(|| rpc_import_at(ptr, nbytes))
}

/// A `"dltensor"` capsule over a received import's storage; registered so that a view of it
/// sent on is forwarded as the same memory.
pub fn import_capsule(py: Python<'_>, imp: Imported) -> PyResult<Py<PyAny>> {
    let imp = Arc::new(imp);
    let (ptr, nbytes) = (imp.storage_ptr(), imp.storage_nbytes());
    lock(&IMPORTS).entry(ptr as usize).or_default().push(Arc::downgrade(&imp));
    dlpack::capsule(py, ptr, nbytes, (dlpack::DL_CPU, 0), Box::new(RegisteredImport(imp)))
}

/// Count one more capsule over `seg` in the registry (see `Entry::holders`).
fn register_live(seg: &Arc<Segment>, sealed: bool) {
    let base = seg.as_ptr() as usize;
    let mut map = lock(&LIVE);
    match map.get_mut(&base) {
        Some(e) if std::ptr::eq(e.seg.as_ptr(), Arc::as_ptr(seg)) => e.holders += 1,
        _ => {
            map.insert(base, Entry { seg: Arc::downgrade(seg), sealed, holders: 1 });
        }
    }
}

/// Segments this process made that a peer may send back (pooled, `segment_storage`, fresh
/// copies), by file identity: a received tensor that is a range of one of them is handed
/// to torch as that segment, not as an import of it (see `own_range`).
static OWN: Mutex<Vec<(FileIdent, Weak<Segment>)>> = Mutex::new(Vec::new());

/// A file's `(st_dev, st_ino)`.
type FileIdent = (u64, u64);

/// Remember `seg` as ours (one `fstat`). Dead entries go when the list would grow past
/// twice what was live at the last sweep.
pub fn remember_own(seg: &Arc<Segment>) {
    static SWEEP_AT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(64);
    let Ok(ident) = seg.file_ident() else { return };
    let mut own = lock(&OWN);
    // Relaxed: a heuristic bound, read and written under the OWN lock.
    if own.len() >= SWEEP_AT.load(std::sync::atomic::Ordering::Relaxed) {
        own.retain(|(_, w)| w.strong_count() > 0);
        SWEEP_AT.store((own.len() * 2).max(64), std::sync::atomic::Ordering::Relaxed);
    }
    own.push((ident, Arc::downgrade(seg)));
}

/// The segment of ours a received CPU tensor maps (a peer sent our memory back: a worker
/// returning what it was given), and the storage's byte offset in it.
pub fn own_range(imp: &Imported) -> Option<(Arc<Segment>, usize)> {
    let (ident, base) = imp.file_range();
    let seg = lock(&OWN).iter().rev().filter(|(i, _)| *i == ident).find_map(|(_, w)| w.upgrade())?;
    let base = usize::try_from(base).ok()?;
    (base.checked_add(imp.storage_nbytes())? <= seg.len()).then_some((seg, base))
}

/// The owner of a capsule over a segment of ours that came back from a peer: registered as
/// a live segment, so that sending the tensor again exports it as it is.
pub fn own_owner(seg: Arc<Segment>) -> Box<dyn Send> {
    register_live(&seg, true);
    Box::new(Registered(seg))
}

fn capsule_over(py: Python<'_>, seg: Arc<Segment>, nbytes: usize, sealed: bool) -> PyResult<Py<PyAny>> {
    let data = seg.as_ptr();
    register_live(&seg, sealed);
    dlpack::capsule(py, data, nbytes, (dlpack::DL_CPU, 0), Box::new(Registered(seg)))
}

/// A `"dltensor"` capsule (1-D uint8, `nbytes` long) over a fresh zeroed sealed segment;
/// Python views it as the dtype and shape it wants.
#[pyfunction]
pub fn segment_storage(py: Python<'_>, nbytes: usize) -> PyResult<Py<PyAny>> {
    // A segment cannot be empty; an empty storage gets one byte it never uses.
    let seg = Arc::new(Segment::create(nbytes.max(1)).py_err_in(py, "tw_segment_new")?);
    remember_own(&seg);
    capsule_over(py, seg, nbytes, true)
}

/// The op `from_torch_fd`'s storage: a capsule (1-D uint8, `nbytes` long) over a TRUSTED
/// peer's `fd` (e.g. PyTorch's `_share_fd_cpu_`), mapped without requiring seals, for the
/// view (`dtype`, `sizes`, `strides`, `storage_offset` in elements). `fd` stays the
/// caller's: the segment owns a close-on-exec duplicate. Every check of the op on these
/// arguments is here, with the op's message ([`op_error`]; the package checks only the
/// torch dtype): the fd, `nbytes` and the offset, then the duplicate and the mapping
/// (the library's errors), then the view, which must fit in `nbytes`. Exporting the
/// storage copies it (peers accept only sealed segments).
#[pyfunction]
#[pyo3(signature = (fd, nbytes, dtype, sizes, strides, storage_offset=0))]
pub fn trusted_fd_storage(
    py: Python<'_>,
    fd: i64,
    nbytes: i64,
    dtype: &str,
    sizes: Vec<i64>,
    strides: Vec<i64>,
    storage_offset: i64,
) -> PyResult<Py<PyAny>> {
    let Some(fd) = RawFd::try_from(fd).ok().filter(|&fd| fd >= 0) else {
        return Err(op_error(py, format!("tensorwire.from_torch_fd: fd {fd} is not a valid descriptor")));
    };
    let Some(nbytes) = usize::try_from(nbytes).ok().filter(|&n| n > 0) else {
        return Err(op_error(py, format!("tensorwire.from_torch_fd: nbytes must be > 0, got {nbytes}")));
    };
    if storage_offset < 0 {
        return Err(op_error(py, format!("tensorwire.from_torch_fd: negative storage_offset {storage_offset}")));
    }
    let dtype = crate::view::dtype_named(py, dtype)?;
    // SAFETY: F_DUPFD_CLOEXEC reads and writes no memory of ours; on a descriptor that is
    // not open it fails (EBADF) and changes nothing.
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        let e = std::io::Error::last_os_error();
        return Err(op_error(py, format!("tensorwire.from_torch_fd: cannot duplicate fd {fd}: {e}")));
    }
    // SAFETY: `dup` is the descriptor fcntl just made for this call: open, and owned by
    // nothing else.
    let owned = unsafe { OwnedFd::from_raw_fd(dup) };
    let seg = py.detach(|| Segment::from_trusted_fd(owned, nbytes)).py_err_in(py, "tw_segment_from_trusted_fd")?;
    // The view, checked as the C++ extension's `tensor_over_segment` checks it.
    crate::view::check_view(py, "tensor_over_segment", sizes.len(), strides.len())?;
    let need = Layout::strided(dtype, &sizes, &strides, storage_offset)
        .and_then(|l| l.extent_bytes())
        .py_err_in(py, "tw_layout_extent_bytes")?;
    if need > nbytes as u64 {
        return Err(op_error(py, format!("tensorwire: the view needs {need} bytes of storage, the segment provides {nbytes}")));
    }
    capsule_over(py, Arc::new(seg), nbytes, false)
}

/// What the storage `[ptr, ptr + nbytes)` is: `"sealed"` (a segment of ours: exported as
/// it is), `"import"` (a received tensor's storage: forwarded as the producer's memory),
/// `"trusted"` (a trusted peer's fd: exported by copy), or None (plain memory).
#[pyfunction]
pub fn storage_kind(ptr: usize, nbytes: usize) -> Option<&'static str> {
    if import_at(ptr, nbytes).is_some() {
        return Some("import");
    }
    entry_at(ptr, nbytes).map(|(_, _, sealed)| if sealed { "sealed" } else { "trusted" })
}

/// The op `segment_fd`: `(fd, segment length, byte offset of ptr in it)` for a storage in
/// a live segment (sealed or trusted); the fd is a close-on-exec dup the caller owns. Any
/// other storage is the op's refusal ([`op_error`]).
#[pyfunction]
pub fn segment_fd(py: Python<'_>, ptr: usize, nbytes: usize) -> PyResult<(RawFd, usize, usize)> {
    let Some((seg, off, _)) = entry_at(ptr, nbytes) else {
        return Err(op_error(
            py,
            "tensorwire.segment_fd: the tensor does not live in a tensorwire segment; create it with tensorwire.empty/zeros \
             or copy it with tensorwire.to_shared"
                .into(),
        ));
    };
    let fd = seg.fd().try_clone_to_owned().map_err(|e| {
        crate::errors::raise(py, "Error", None, format!("tensorwire.segment_fd: dup failed: {e}"))
    })?;
    Ok((fd.into_raw_fd(), seg.len(), off))
}

/// Whether `nbytes` at address `ptr` lie inside a live sealed tensorwire segment (a storage
/// made by `segment_storage` that torch still holds).
#[pyfunction]
pub fn is_segment(ptr: usize, nbytes: usize) -> bool {
    segment_at(ptr, nbytes).is_some()
}

/// How many segment storages torch holds now (for tests and `doctor`).
#[pyfunction]
pub fn live_segments() -> usize {
    lock(&LIVE).len()
}
