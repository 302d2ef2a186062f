//! `SharedTensor`: a tensor view over a region of a sealed shared segment, ready to
//! export under a lease or to copy through a ring.

use crate::desc::Layout;
use crate::error::{Error, Result};
use crate::segment::Segment;
use std::sync::Arc;

/// A tensor view over a region of a shared segment, ready to export.
#[derive(Clone, Debug)]
pub struct SharedTensor {
    pub(crate) segment: Arc<Segment>,
    pub(crate) offset: usize,
    pub(crate) nbytes: usize,
    pub(crate) layout: Layout,
}

impl SharedTensor {
    /// `layout` over the `nbytes` of `segment` starting at byte `offset`.
    pub fn new(segment: Arc<Segment>, offset: usize, nbytes: usize, layout: Layout) -> Result<SharedTensor> {
        if offset.checked_add(nbytes).is_none_or(|e| e > segment.len()) {
            return Err(Error::InvalidArgument(format!(
                "storage of {nbytes} bytes at offset {offset} passes the end of a {}-byte segment",
                segment.len()
            )));
        }
        let need = layout.extent_bytes()?;
        if need > nbytes as u64 {
            return Err(Error::InvalidArgument(format!("view needs {need} bytes of storage, storage has {nbytes}")));
        }
        Ok(SharedTensor { segment, offset, nbytes, layout })
    }

    /// A zeroed tensor with a storage of its own (a fresh segment just large enough).
    pub fn zeros(layout: Layout) -> Result<SharedTensor> {
        let n = layout.extent_bytes()? as usize;
        SharedTensor::new(Arc::new(Segment::create(n.max(1))?), 0, n, layout)
    }

    /// Another view of the same storage.
    pub fn view(&self, layout: Layout) -> Result<SharedTensor> {
        SharedTensor::new(self.segment.clone(), self.offset, self.nbytes, layout)
    }

    pub fn segment(&self) -> &Arc<Segment> {
        &self.segment
    }
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    pub fn storage_offset_bytes(&self) -> usize {
        self.offset
    }
    pub fn storage_nbytes(&self) -> usize {
        self.nbytes
    }
    /// Start of the storage (shared memory: the peer may write it).
    pub fn storage_ptr(&self) -> *mut u8 {
        // SAFETY: offset ≤ segment length, checked in `new`.
        unsafe { self.segment.as_ptr().add(self.offset) }
    }
    /// Copy `data` into the storage at byte `at`.
    pub fn write_storage(&self, at: usize, data: &[u8]) -> Result<()> {
        check_in(at, data.len(), self.nbytes)?;
        self.segment.write_at(self.offset + at, data)
    }
    /// Copy from the storage at byte `at`.
    pub fn read_storage(&self, at: usize, out: &mut [u8]) -> Result<()> {
        check_in(at, out.len(), self.nbytes)?;
        self.segment.read_at(self.offset + at, out)
    }
    /// The view's elements, packed row-major, copied to private memory (an error if the
    /// packed copy cannot be allocated, e.g. a huge stride-0 broadcast).
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = Vec::new();
        // SAFETY: `new` checked extent_bytes ≤ nbytes and the storage lies in the mapping.
        unsafe { self.layout.gather(self.storage_ptr(), &mut v) }?;
        Ok(v)
    }
}

pub(crate) fn check_in(at: usize, len: usize, size: usize) -> Result<()> {
    if at.checked_add(len).is_none_or(|e| e > size) {
        return Err(Error::InvalidArgument(format!("{len} bytes at {at} pass the end of a {size}-byte storage")));
    }
    Ok(())
}
