//! Shared storages: sealed segments made by Rust and handed to torch by DLPack, and the
//! registry that recognises them again by address when a tensor over one is exported
//! (the binding's counterpart of the C++ extension's `segment_of`, which looks at the
//! storage's deleter; here the storage pointer is all Python hands over).

use crate::dlpack;
use crate::errors::IntoPy;
use pyo3::prelude::*;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use tensorwire::Segment;

/// Live segments that torch holds through a capsule, by base address.
static LIVE: Mutex<BTreeMap<usize, Weak<Segment>>> = Mutex::new(BTreeMap::new());

fn live() -> std::sync::MutexGuard<'static, BTreeMap<usize, Weak<Segment>>> {
    // Nothing panics while holding the lock; a poisoned map is still consistent.
    LIVE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What a capsule over a segment owns: the segment, and its registry entry until torch's
/// last view of the storage dies.
struct Registered(Arc<Segment>);

impl Drop for Registered {
    fn drop(&mut self) {
        let base = self.0.as_ptr() as usize;
        let mut map = live();
        // Another segment may already be mapped at this address only after this one is
        // unmapped, which happens after this drop; remove the entry only if it is ours.
        if map.get(&base).is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(&self.0))) {
            map.remove(&base);
        }
    }
}

/// The segment whose mapping contains `[ptr, ptr + nbytes)`, and the offset of `ptr` in it.
pub fn segment_at(ptr: usize, nbytes: usize) -> Option<(Arc<Segment>, usize)> {
    let map = live();
    let (&base, weak) = map.range(..=ptr).next_back()?;
    let seg = weak.upgrade()?;
    let off = ptr - base;
    (off.checked_add(nbytes)? <= seg.len()).then_some((seg, off))
}

/// A `"dltensor"` capsule (1-D uint8, `nbytes` long) over a fresh zeroed sealed segment;
/// Python views it as the dtype and shape it wants.
#[pyfunction]
pub fn segment_storage(py: Python<'_>, nbytes: usize) -> PyResult<Py<PyAny>> {
    let seg = Arc::new(Segment::create(nbytes.max(1)).py_err(py)?);
    let data = seg.as_ptr();
    live().insert(data as usize, Arc::downgrade(&seg));
    dlpack::capsule(py, data, nbytes, (dlpack::DL_CPU, 0), Box::new(Registered(seg)))
}

/// Whether `nbytes` at address `ptr` lie inside a live tensorwire segment (a storage made
/// by `segment_storage` that torch still holds).
#[pyfunction]
pub fn is_segment(ptr: usize, nbytes: usize) -> bool {
    segment_at(ptr, nbytes).is_some()
}

/// How many segment storages torch holds now (for tests and `doctor`).
#[pyfunction]
pub fn live_segments() -> usize {
    live().len()
}
