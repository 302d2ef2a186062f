//! Recycled segments for ordinary CPU tensors, and owned buffers for small ones.
//!
//! A view of at most [`MAX_OWNED`] packed bytes is packed into a heap buffer of its own
//! (`Tensor::Owned`), which a connection that negotiated inline tensors carries inside
//! the frame: no segment, lease or transport message, the cheapest way for a few KiB.
//! Where it can go neither attached nor inline (a peer that offered neither, an older
//! tensorwire) the RPC layer copies it into a segment of the same pool when sending.
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
//! The pool itself is the RPC layer's (`tensorwire_rpc::tensor::pool`: size classes, its
//! bounds, and why a free segment is safe to write), so that it and the binding share one.

use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Once};
use tensorwire::desc::PackCursor;
use tensorwire::{Layout, Segment, SharedTensor};
use tensorwire_rpc::OwnedTensor;
use tensorwire_rpc::tensor::pool;

/// The largest packed view copied into an owned buffer (to go in the frame) rather than a
/// pooled segment: the RPC layer's default attachment limit, which the binding's
/// connections use.
pub const MAX_OWNED: usize = tensorwire_rpc::config::DEFAULT_ATTACHED_TENSORS;

/// The largest packed view copied into a pooled segment; larger ones are moved into shared
/// memory in place by the Python side (`tensorwire.rpc`'s rule) or go into a fresh segment.
pub const MAX_POOLED: usize = pool::MAX_POOLED;

/// Counters for tests and `pool_stats` (the pool's own are `tensorwire_rpc`'s):
/// `COPIES` ordinary tensors copied into segments, `OWNED` small ordinary tensors packed
/// into heap buffers of their own (to go inline). Their Relaxed increments and loads are
/// statistics only: they pair with nothing, order no other memory, and nothing is decided
/// from them (a reader may see one counter move before another).
static COPIES: AtomicU64 = AtomicU64::new(0);
static OWNED: AtomicU64 = AtomicU64::new(0);

/// A segment of at least `nbytes` from the process's pool (shared with the RPC layer, which
/// copies an owned tensor a peer takes neither attached nor inline into it). Every segment
/// the pool creates is remembered as ours, so one a peer sends back is handed to torch as
/// the segment itself.
fn take(nbytes: usize) -> tensorwire::Result<Arc<Segment>> {
    remember_pooled();
    pool::take(nbytes)
}

/// Make the RPC layer's pool tell `storage` of each segment it creates; before any tensor
/// of this binding can reach the pool (both `owned_copy` and `packed_copy` call it).
fn remember_pooled() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| pool::on_create(crate::storage::remember_own));
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
    // A connection may copy it into a pooled segment when sending.
    remember_pooled();
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
    let st = pool::stats();
    let d = PyDict::new(py);
    d.set_item("created", st.created)?;
    d.set_item("reused", st.reused)?;
    d.set_item("unpooled", st.unpooled)?;
    d.set_item("copies", COPIES.load(Ordering::Relaxed))?;
    d.set_item("owned", OWNED.load(Ordering::Relaxed))?;
    d.set_item("max_owned", MAX_OWNED)?;
    d.set_item("pooled", st.pooled)?;
    d.set_item("pooled_bytes", st.pooled_bytes)?;
    d.set_item("max_pooled", MAX_POOLED)?;
    d.set_item("max_per_class", pool::MAX_PER_CLASS)?;
    d.set_item("max_pool_bytes", pool::MAX_POOL_BYTES)?;
    Ok(d)
}

/// How many pooled segments something other than the pool holds now (a lease of some
/// connection, or a value being sent): for tests that a peer's death gives them back.
#[pyfunction]
pub fn pool_busy() -> usize {
    pool::stats().busy
}

#[cfg(test)]
mod tests {
    use super::*;
    use tensorwire::DType;

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
