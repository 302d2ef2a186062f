//! Recycled segments for ordinary CPU tensors, and owned buffers for small ones.
//!
//! A view of at most [`MAX_OWNED`] packed bytes is packed into a heap buffer of its own
//! (`Tensor::Owned`), which a connection that negotiated inline tensors carries inside
//! the frame: no segment, lease or transport message, the cheapest way for a few KiB.
//! (Where it cannot go inline the RPC layer copies it into a segment when sending.)
//!
//! Larger views: the view of a tensor that is not in shared
//! memory (`torch.randn`, a model's output) is packed into a segment of this process's
//! pool, not a fresh one per send, and the segment is used again once nothing holds it.
//!
//! Why segments, not the connection's ring: a received tensor is handed to torch as a view
//! of the sender's memory whose lifetime is torch's last view, so borrowing a ring record
//! for it would stall the ring behind any tensor the receiver keeps; the ring's other
//! mode, copying out, costs the receiver an allocation and a copy per tensor and gives it
//! private memory, which would then be copied again if sent back. A pooled segment travels
//! as every segment does (a leased export), so after its first trip on a connection it
//! costs neither side a system call for memory: its fd is in the consumer's fd slot and
//! its window stays mapped there (a segment stays live, so no `FORGET` is sent for it).
//!
//! Why one pool per process, not per connection: the binding turns a Python value into an
//! RPC value before it knows the connection it goes on (and a value may go on several);
//! and a segment is free again exactly when nothing holds it — no lease of any connection
//! (a peer's death or release ends its leases) and no value of ours — which the segment's
//! reference count says without asking a connection.
//!
//! Size classes are powers of two from one page to [`MAX_POOLED`]; at most
//! [`MAX_PER_CLASS`] segments a class and [`MAX_POOL_BYTES`] in all. A tensor too large
//! for a class, or whose class is full and busy, goes into a fresh segment of its own
//! (counted in `unpooled`), which is freed as before once its leases end.

use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::atomic::{AtomicU64, Ordering, fence};
use std::sync::{Arc, Mutex, PoisonError};
use tensorwire::desc::PackCursor;
use tensorwire::{Layout, Segment, SharedTensor};
use tensorwire_rpc::OwnedTensor;

/// The largest packed view copied into an owned buffer (to go in the frame) rather than a
/// pooled segment: the RPC layer's default attachment limit, which the binding's
/// connections use.
pub const MAX_OWNED: usize = tensorwire_rpc::config::DEFAULT_ATTACHED_TENSORS;

/// The largest packed view copied into a pooled segment; larger ones are moved into shared
/// memory in place by the Python side (`tensorwire.rpc`'s rule) or go into a fresh segment.
pub const MAX_POOLED: usize = 1 << 20;
/// The smallest class: one page (a segment is mapped in pages anyway).
const MIN_CLASS: usize = 4096;
/// Segments kept per size class.
pub const MAX_PER_CLASS: usize = 16;
/// Bytes kept in all classes together.
pub const MAX_POOL_BYTES: usize = 32 << 20;

const CLASSES: usize = (MAX_POOLED / MIN_CLASS).trailing_zeros() as usize + 1;

struct Pool {
    classes: [Vec<Arc<Segment>>; CLASSES],
    bytes: usize,
}

static POOL: Mutex<Pool> = Mutex::new(Pool { classes: [const { Vec::new() }; CLASSES], bytes: 0 });

/// Counters for tests and `pool_stats`: `CREATED` segments the pool made and keeps,
/// `REUSED` sends that found a free pooled one, `UNPOOLED` fresh segments made outside the
/// pool, `COPIES` ordinary tensors copied into segments, `OWNED` small ordinary tensors
/// packed into heap buffers of their own (to go inline). Their Relaxed increments and loads
/// are statistics only: they pair with nothing, order no other memory, and nothing is
/// decided from them (a reader may see one counter move before another).
static CREATED: AtomicU64 = AtomicU64::new(0);
static REUSED: AtomicU64 = AtomicU64::new(0);
static UNPOOLED: AtomicU64 = AtomicU64::new(0);
static COPIES: AtomicU64 = AtomicU64::new(0);
static OWNED: AtomicU64 = AtomicU64::new(0);

fn class_of(nbytes: usize) -> Option<usize> {
    if nbytes > MAX_POOLED {
        return None;
    }
    let size = nbytes.max(MIN_CLASS).next_power_of_two();
    Some((size / MIN_CLASS).trailing_zeros() as usize)
}

/// A segment of at least `nbytes` (≥ 1) that nothing else holds: a free pooled one, a new
/// pooled one while its class and the pool have room, else a fresh one of its own.
fn take(nbytes: usize) -> tensorwire::Result<Arc<Segment>> {
    let Some(class) = class_of(nbytes) else {
        UNPOOLED.fetch_add(1, Ordering::Relaxed);
        let seg = Arc::new(Segment::create(nbytes.max(1))?);
        crate::storage::remember_own(&seg);
        return Ok(seg);
    };
    let size = MIN_CLASS << class;
    let mut pool = POOL.lock().unwrap_or_else(PoisonError::into_inner);
    // Only the pool hands out clones, under this lock, so a count of one cannot rise
    // while we look: the segment is free. Weak references (the transport's fd-slot and
    // lease keepers) never write a segment's data.
    if let Some(seg) = pool.classes[class].iter().find(|s| Arc::strong_count(s) == 1) {
        // Acquire: pairs with the Release decrement of the last holder's drop (a lease
        // owner dropped after the consumer's release, a value dropped), so its reads of
        // the old contents happen before our writes of the new ones.
        fence(Ordering::Acquire);
        REUSED.fetch_add(1, Ordering::Relaxed);
        return Ok(seg.clone());
    }
    let seg = Arc::new(Segment::create(size)?);
    crate::storage::remember_own(&seg);
    if pool.classes[class].len() < MAX_PER_CLASS && pool.bytes + size <= MAX_POOL_BYTES {
        pool.classes[class].push(seg.clone());
        pool.bytes += size;
        CREATED.fetch_add(1, Ordering::Relaxed);
    } else {
        UNPOOLED.fetch_add(1, Ordering::Relaxed);
    }
    Ok(seg)
}

/// The view `layout` of the storage at `base` (of `storage_nbytes` bytes), packed row-major
/// into a recycled segment: a contiguous tensor of the same dtype and sizes.
///
/// # Safety
/// `base` must be valid for reads of `storage_nbytes` bytes for the whole call, and no one
/// may write those bytes meanwhile (the caller holds the GIL and a reference to the torch
/// tensor).
pub unsafe fn packed_copy(base: *const u8, storage_nbytes: usize, layout: &Layout) -> tensorwire::Result<SharedTensor> {
    let need = layout.extent_bytes()?;
    if need > storage_nbytes as u64 {
        return Err(tensorwire::Error::InvalidArgument(format!(
            "the view {layout:?} needs {need} bytes of storage, the tensor's storage has {storage_nbytes}"
        )));
    }
    let packed = usize::try_from(layout.packed_bytes())
        .map_err(|_| tensorwire::Error::InvalidArgument(format!("the view {layout:?} is too large to copy")))?;
    let seg = take(packed)?;
    if packed > 0 {
        // SAFETY: `seg` is at least `packed` bytes long, mapped, and nobody else holds it
        // (`take`), so nothing reads or writes it meanwhile.
        let dst = unsafe { std::slice::from_raw_parts_mut(seg.as_ptr(), packed) };
        // SAFETY: `base` covers the view's extent (checked above, per the caller's contract).
        let written = unsafe { PackCursor::new(layout).fill(base, dst) };
        debug_assert_eq!(written, packed);
    }
    COPIES.fetch_add(1, Ordering::Relaxed);
    let contiguous = Layout::contiguous(layout.dtype, layout.sizes())?;
    SharedTensor::new(seg, 0, packed, contiguous)
}

/// The view `layout` of the storage at `base` (of `storage_nbytes` bytes), packed row-major
/// into a heap buffer of its own: a contiguous tensor of the same dtype and sizes.
///
/// # Safety
/// As for [`packed_copy`].
pub unsafe fn owned_copy(base: *const u8, storage_nbytes: usize, layout: &Layout) -> tensorwire_rpc::Result<OwnedTensor> {
    let need = layout.extent_bytes()?;
    if need > storage_nbytes as u64 {
        return Err(tensorwire_rpc::RpcError::InvalidArgument(format!(
            "the view {layout:?} needs {need} bytes of storage, the tensor's storage has {storage_nbytes}"
        )));
    }
    let mut t = OwnedTensor::zeroed(layout.dtype, layout.sizes(), usize::MAX)?;
    let dst = t.bytes_mut();
    if !dst.is_empty() {
        // SAFETY: `base` covers the view's extent (checked above, per the caller's
        // contract); `dst` holds exactly the view's packed bytes.
        let written = unsafe { PackCursor::new(layout).fill(base, dst) };
        debug_assert_eq!(written, dst.len());
    }
    OWNED.fetch_add(1, Ordering::Relaxed);
    Ok(t)
}

/// The recycled-segment pool's counters: `created` (pooled segments made), `reused` (sends
/// that found a free pooled segment), `unpooled` (fresh segments made outside the pool),
/// `copies` (ordinary tensors copied into segments), `owned` (small ordinary tensors
/// packed into owned buffers, to go inline), `pooled` and `pooled_bytes` (what it keeps now), and
/// its bounds.
#[pyfunction]
pub fn pool_stats(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let (pooled, bytes) = {
        let pool = POOL.lock().unwrap_or_else(PoisonError::into_inner);
        (pool.classes.iter().map(Vec::len).sum::<usize>(), pool.bytes)
    };
    let d = PyDict::new(py);
    d.set_item("created", CREATED.load(Ordering::Relaxed))?;
    d.set_item("reused", REUSED.load(Ordering::Relaxed))?;
    d.set_item("unpooled", UNPOOLED.load(Ordering::Relaxed))?;
    d.set_item("copies", COPIES.load(Ordering::Relaxed))?;
    d.set_item("owned", OWNED.load(Ordering::Relaxed))?;
    d.set_item("max_owned", MAX_OWNED)?;
    d.set_item("pooled", pooled)?;
    d.set_item("pooled_bytes", bytes)?;
    d.set_item("max_pooled", MAX_POOLED)?;
    d.set_item("max_per_class", MAX_PER_CLASS)?;
    d.set_item("max_pool_bytes", MAX_POOL_BYTES)?;
    Ok(d)
}

/// How many pooled segments something other than the pool holds now (a lease of some
/// connection, or a value being sent): for tests that a peer's death gives them back.
#[pyfunction]
pub fn pool_busy() -> usize {
    let pool = POOL.lock().unwrap_or_else(PoisonError::into_inner);
    pool.classes.iter().flatten().filter(|s| Arc::strong_count(s) > 1).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tensorwire::DType;

    #[test]
    fn classes_cover_one_page_to_the_limit() {
        assert_eq!(class_of(0), Some(0));
        assert_eq!(class_of(4096), Some(0));
        assert_eq!(class_of(4097), Some(1));
        assert_eq!(class_of(MAX_POOLED), Some(CLASSES - 1));
        assert_eq!(class_of(MAX_POOLED + 1), None);
    }

    /// A strided view packs bit-exact, and a segment comes back only once its holders are
    /// gone.
    #[test]
    fn packs_views_and_recycles_free_segments() {
        let src: Vec<u8> = (0..64u8).collect();
        // A 4x4 int32 tensor viewed transposed.
        let l = Layout::strided(DType::Int32, &[4, 4], &[1, 4], 0).unwrap();
        // SAFETY: `src` is 64 bytes, alive and unwritten across the call.
        let a = unsafe { packed_copy(src.as_ptr(), src.len(), &l) }.unwrap();
        let mut want = Vec::new();
        // SAFETY: as above.
        unsafe { l.gather(src.as_ptr(), &mut want) }.unwrap();
        assert_eq!(a.to_vec().unwrap(), want);
        let first = a.segment().id();
        // SAFETY: as above.
        let b = unsafe { packed_copy(src.as_ptr(), src.len(), &l) }.unwrap();
        assert_ne!(b.segment().id(), first, "a held segment is not handed out again");
        drop(a);
        // SAFETY: as above.
        let c = unsafe { packed_copy(src.as_ptr(), src.len(), &l) }.unwrap();
        assert_eq!(c.segment().id(), first, "a free segment is used again");
        let short = Layout::strided(DType::Int32, &[17], &[1], 0).unwrap();
        // SAFETY: as above; the view is refused before any read.
        assert!(unsafe { packed_copy(src.as_ptr(), src.len(), &short) }.is_err());
    }
}
