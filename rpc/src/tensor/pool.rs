//! This process's recycled segments for tensors copied into shared memory to be sent: an
//! owned tensor a connection can neither attach nor carry inline (a peer that offered
//! neither, or one past the limits), and, through the Python binding, ordinary tensors of
//! at most [`MAX_POOLED`] bytes. One pool per process, not per connection: a
//! segment is free again exactly when nothing holds it (no lease of any connection — a
//! peer's release or death ends its leases — and no value of ours), which its reference
//! count says without asking a connection. So a segment sent again costs neither side a
//! system call for memory: its fd is in the consumer's fd slot and its window stays mapped.
//!
//! Size classes are powers of two from one page to [`MAX_POOLED`]; at most
//! [`MAX_PER_CLASS`] segments a class and [`MAX_POOL_BYTES`] in all. A request
//! too large for a class, or whose class is full and busy, gets a fresh segment of its own
//! (counted in `unpooled`), freed once its leases end.

use std::sync::atomic::{AtomicU64, Ordering, fence};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use tensorwire::{DType, Layout, Segment, SharedTensor};

/// The largest request served from the pool.
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

static POOL: Mutex<Pool> = Mutex::new(Pool {
    classes: [const { Vec::new() }; CLASSES],
    bytes: 0,
});

/// Told of every segment this module creates (the Python binding remembers them as its
/// own, so that one a peer sends back is handed to torch as the segment itself).
static ON_CREATE: OnceLock<fn(&Arc<Segment>)> = OnceLock::new();

/// Counters for tests and stats. Their Relaxed increments and loads are statistics
/// only: they pair with nothing, order no other memory, and nothing is decided from
/// them (a reader may see one counter move before another).
static CREATED: AtomicU64 = AtomicU64::new(0);
static REUSED: AtomicU64 = AtomicU64::new(0);
static UNPOOLED: AtomicU64 = AtomicU64::new(0);

/// What the pool did and keeps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Pooled segments made (and kept).
    pub created: u64,
    /// Requests that found a free pooled segment.
    pub reused: u64,
    /// Fresh segments made outside the pool (too large, or the class full and busy).
    pub unpooled: u64,
    /// Segments kept now.
    pub pooled: usize,
    /// Their bytes.
    pub pooled_bytes: usize,
    /// Kept segments something other than the pool holds now (a lease, a value).
    pub busy: usize,
}

/// The pool's counters and contents now.
pub fn stats() -> PoolStats {
    let pool = POOL.lock().unwrap_or_else(PoisonError::into_inner);
    PoolStats {
        created: CREATED.load(Ordering::Relaxed),
        reused: REUSED.load(Ordering::Relaxed),
        unpooled: UNPOOLED.load(Ordering::Relaxed),
        pooled: pool.classes.iter().map(Vec::len).sum(),
        pooled_bytes: pool.bytes,
        busy: pool
            .classes
            .iter()
            .flatten()
            .filter(|s| Arc::strong_count(s) > 1)
            .count(),
    }
}

/// Have `f` called with each segment the pool creates from now on (the first caller's
/// `f` stays; later calls change nothing).
pub fn on_create(f: fn(&Arc<Segment>)) {
    let _ = ON_CREATE.set(f);
}

fn created(seg: &Arc<Segment>) {
    if let Some(f) = ON_CREATE.get() {
        f(seg);
    }
}

fn class_of(nbytes: usize) -> Option<usize> {
    if nbytes > MAX_POOLED {
        return None;
    }
    let size = nbytes.max(MIN_CLASS).next_power_of_two();
    Some((size / MIN_CLASS).trailing_zeros() as usize)
}

/// A segment of at least `nbytes` (≥ 1) that nothing else holds: a free pooled one, a
/// new pooled one while its class and the pool have room, else a fresh one of its own.
pub fn take(nbytes: usize) -> tensorwire::Result<Arc<Segment>> {
    let Some(class) = class_of(nbytes) else {
        UNPOOLED.fetch_add(1, Ordering::Relaxed);
        let seg = Arc::new(Segment::create(nbytes.max(1))?);
        created(&seg);
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
    if pool.classes[class].len() < MAX_PER_CLASS && pool.bytes + size <= MAX_POOL_BYTES {
        pool.classes[class].push(seg.clone());
        pool.bytes += size;
        CREATED.fetch_add(1, Ordering::Relaxed);
    } else {
        UNPOOLED.fetch_add(1, Ordering::Relaxed);
    }
    drop(pool);
    created(&seg);
    Ok(seg)
}

/// `storage` (the bytes of a tensor's storage) copied into a segment of the pool, as
/// `layout` over it.
pub fn storage_copy(storage: &[u8], layout: Layout) -> tensorwire::Result<SharedTensor> {
    let seg = take(storage.len())?;
    let s = SharedTensor::new(
        seg,
        0,
        storage.len(),
        Layout::contiguous(DType::UInt8, &[storage.len() as i64])?,
    )?;
    s.write_storage(0, storage)?;
    s.view(layout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_cover_one_page_to_the_limit() {
        assert_eq!(class_of(0), Some(0));
        assert_eq!(class_of(4096), Some(0));
        assert_eq!(class_of(4097), Some(1));
        assert_eq!(class_of(MAX_POOLED), Some(CLASSES - 1));
        assert_eq!(class_of(MAX_POOLED + 1), None);
    }

    /// A segment comes back only once its holders are gone.
    #[test]
    fn recycles_free_segments_only() {
        let l = Layout::contiguous(DType::UInt8, &[300_000]).unwrap();
        let data: Vec<u8> = (0..300_000u32).map(|i| i as u8).collect();
        let a = storage_copy(&data, l).unwrap();
        assert_eq!(a.to_vec().unwrap(), data);
        let b = storage_copy(&data, l).unwrap();
        assert_ne!(
            b.segment().id(),
            a.segment().id(),
            "a held segment is not handed out again"
        );
        let first = a.segment().id();
        drop(a);
        let c = storage_copy(&data, l).unwrap();
        assert_eq!(c.segment().id(), first, "a free segment is used again");
    }
}
