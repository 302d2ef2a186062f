//! The sending half of a ring: bytes or tensor views (packed contiguous on the way in)
//! copied into records, a message larger than a record split into chunks.

use super::shared::{MmapRegion, RingShared};
use super::spsc::{Producer, FLAG_FIRST, FLAG_LAST};
use crate::waiting::waiter::Waiter;
use crate::desc::{Layout, PackCursor, StorageKind, TensorDesc};
use crate::error::{Error, Result};
use crate::waiting::spin_policy::SpinPolicy;
use crate::wait::{Deadline, Wait};
use bytemuck::Zeroable;
use std::marker::PhantomData;

/// Largest data part of a record of a chunked message (one larger than a record). Small
/// enough that copy-in and copy-out overlap (many chunks in flight, each handed over
/// within the waiting side's spin budget), large enough that per-chunk costs vanish.
const CHUNK_BYTES: u64 = 1 << 20;

/// What to send: bytes, or a tensor view over some storage.
pub struct RingItem<'a> {
    tag: u64,
    payload: Payload<'a>,
}

#[allow(clippy::large_enum_variant)] // short-lived, on the stack, one per send
enum Payload<'a> {
    Bytes(&'a [u8]),
    Tensor { layout: Layout, base: *const u8, _storage: PhantomData<&'a [u8]> },
}

impl<'a> RingItem<'a> {
    pub fn bytes(tag: u64, data: &'a [u8]) -> Self {
        RingItem { tag, payload: Payload::Bytes(data) }
    }

    /// A view `layout` over private `storage` (the view must fit inside it).
    pub fn tensor(tag: u64, layout: Layout, storage: &'a [u8]) -> Result<Self> {
        let need = layout.extent_bytes()?;
        if need > storage.len() as u64 {
            return Err(Error::InvalidArgument(format!("view needs {need} bytes of storage, storage has {}", storage.len())));
        }
        Ok(RingItem { tag, payload: Payload::Tensor { layout, base: storage.as_ptr(), _storage: PhantomData } })
    }

    /// A view of a shared tensor.
    pub fn shared(tag: u64, t: &'a crate::shared_tensor::SharedTensor) -> Self {
        RingItem { tag, payload: Payload::Tensor { layout: *t.layout(), base: t.storage_ptr(), _storage: PhantomData } }
    }

    fn len(&self) -> u64 {
        match &self.payload {
            Payload::Bytes(b) => b.len() as u64,
            Payload::Tensor { layout, .. } => layout.packed_bytes(),
        }
    }
}

/// The sending half of a ring.
pub struct RingSender {
    producer: Producer<'static, MmapRegion>,
    /// Whether a wait for space may spin now (not while the consumer shares our core).
    spin_policy: SpinPolicy,
    // Declared after `producer`: keeps the mapping its references point into alive.
    shared: RingShared,
}

impl RingSender {
    pub fn new(shared: RingShared) -> RingSender {
        let (ctrl, region) = shared.parts();
        RingSender { producer: Producer::new(ctrl, region), spin_policy: SpinPolicy::default(), shared }
    }

    pub fn capacity(&self) -> u64 {
        self.shared.capacity()
    }

    /// Send all `items` (one publish and at most one wake-up for the batch, unless the
    /// ring fills and the consumer must drain part of it first). `gone` is polled while
    /// waiting for space, which lasts as `wait` says; `spin` polls come before each sleep.
    pub fn send_many(&mut self, items: &[RingItem<'_>], wait: impl Into<Wait>, spin: u32, gone: &dyn Fn() -> bool) -> Result<()> {
        self.send_many_until(items, &mut wait.into().deadline(), spin, gone)
    }

    /// `send_many` within a caller's deadline (one clock for a larger wait).
    pub(crate) fn send_many_until(&mut self, items: &[RingItem<'_>], deadline: &mut Deadline, spin: u32, gone: &dyn Fn() -> bool) -> Result<()> {
        let r = self.push_all(items, deadline, spin, gone);
        // Records pushed are visible already (their stamps); wake a sleeping consumer for
        // them, also when a later item failed.
        self.producer.publish();
        r
    }

    /// Push every item's records, waiting for space where the ring is full.
    fn push_all(&mut self, items: &[RingItem<'_>], deadline: &mut Deadline, spin: u32, gone: &dyn Fn() -> bool) -> Result<()> {
        let mut waiter = Waiter::new(
            self.producer.doorbells().space_bell,
            spin,
            &self.spin_policy,
            deadline,
            "space in the ring (the consumer is not draining it)",
            "the consumer went away while the ring was full",
        );
        for item in items {
            let total = item.len();
            let desc = match &item.payload {
                Payload::Bytes(_) => None,
                Payload::Tensor { layout, .. } => {
                    let packed = Layout::contiguous(layout.dtype, layout.sizes())?;
                    let storage = crate::desc::StorageRef { nbytes: total, ..Zeroable::zeroed() };
                    Some(TensorDesc::new(&packed, StorageKind::RingSlot, storage))
                }
            };
            let mut cursor = match &item.payload {
                Payload::Tensor { layout, .. } => Some(PackCursor::new(layout)),
                Payload::Bytes(_) => None,
            };
            let mut sent: u64 = 0;
            let mut first = true;
            loop {
                let meta: &[u8] = match (&desc, first) {
                    (Some(d), true) => d.encode(),
                    _ => &[],
                };
                // A message that fits one record goes as one (so it can be borrowed);
                // a larger one in chunks of at most CHUNK_BYTES, so that the consumer
                // copies one chunk out while we copy the next in.
                let max = self.producer.max_data(meta.len() as u32) & !63;
                let max = if first && total <= max { max } else { max.min(CHUNK_BYTES) };
                let chunk = (total - sent).min(max);
                let last = sent + chunk == total;
                let flags = if first { FLAG_FIRST } else { 0 } | if last { FLAG_LAST } else { 0 };
                let payload = &item.payload;
                let mut fill = |dst: &mut [u8]| match payload {
                    Payload::Bytes(b) => dst.copy_from_slice(&b[sent as usize..sent as usize + dst.len()]),
                    Payload::Tensor { base, .. } => {
                        let c = cursor.as_mut().expect("tensor items have a cursor");
                        // SAFETY: `base` is valid for the view's extent (checked when the
                        // item was built, and the borrow `'a` keeps it alive).
                        let n = unsafe { c.fill(*base, dst) };
                        debug_assert_eq!(n, dst.len());
                    }
                };
                while !self.producer.try_push(flags, item.tag, total, meta, chunk, &mut fill)? {
                    // Full: wake the consumer for what we have, then wait for it to release
                    // space: poll its tail, sleep on the space doorbell. Both live on the
                    // consumer's cache line: read only here, when short of space, never on
                    // the fast path (that would pull the line over once per message).
                    self.producer.publish();
                    let producer = &self.producer;
                    waiter.wait(&|| producer.tail_moved(), gone)?;
                }
                sent += chunk;
                first = false;
                if last {
                    break;
                }
            }
        }
        Ok(())
    }
}
