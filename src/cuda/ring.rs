//! GPU bounce ring: one device arena per direction per connection, registered once, that
//! any CUDA tensor is copied through — no handle is opened per message.
//!
//! The producer allocates the arena (`slots` × `slot_bytes`, `cuMemAlloc`, one legacy IPC
//! handle), `slots` interprocess "written" events, a small control segment and a CPU ring
//! for descriptors, and sends them once at connection setup. The consumer opens the arena
//! and the events once, creates its own `slots` interprocess "read" events and publishes
//! their handles in the control segment.
//!
//! A send of `n` bytes goes through `⌈n / slot_bytes⌉` chunks (at least one). Chunk `seq`
//! takes slot `seq % slots`:
//!
//! ```text
//! producer (its stream)                          consumer (its stream)
//!   wait credit: seq − freed < slots   (CPU)
//!   stream waits read[slot]   (if reused)
//!   cuMemcpyDtoDAsync  src → slot
//!   record written[slot]
//!   push record (seq, offset, len[, desc])  ──►  pop record, validate
//!                                                stream waits written[slot]
//!                                                cuMemcpyDtoDAsync  slot → dst
//!                                                record read[slot]
//!                                     ◄──  freed = seq + 1  (credits::free)
//! ```
//!
//! Neither side blocks on the GPU. An event is re-recorded only after the other side has
//! enqueued its wait on the previous record: `written[slot]` again only after the consumer
//! freed the slot (which it does after enqueueing its wait), `read[slot]` again only after
//! the producer published the slot's next use (after enqueueing its wait) — so
//! `cuStreamWaitEvent`, which captures an event's most recent record when it is called,
//! always captures the intended one.
//!
//! The consumer receives in two steps, so the caller can allocate the destination once it
//! knows the shape: [`CudaRingReceiver::begin`] waits for a message's first record and
//! returns its tag and descriptor; [`CudaRingReceiver::finish`] copies every chunk into the
//! caller's device memory on the caller's stream (clone-on-receive) and frees the slots;
//! [`CudaRingReceiver::discard`] frees them without copying.
//!
//! The ring carries contiguous bytes: a strided view is packed on the device first (the
//! torch extension calls `.contiguous()` on the current stream).
//!
//! Hostile peers: the consumer copies each record to private memory (the descriptor ring
//! does) and checks magic, sequence, slot bounds, offsets, the descriptor and the total
//! against its limits; the producer checks `freed` (credits) and leaves the consumer's
//! event handles to the driver. Any violation breaks the ring with an error naming it.

use super::driver::{ensure_context, memcpy_dtod_async, pointer_device, DeviceBuffer};
use super::event::IpcEventSet;
use super::ipc;
use crate::credits::{CreditError, Credits};
use crate::desc::{DeviceType, Layout, StorageKind, StorageRef, TensorDesc, DESC_SIZE};
use crate::doorbell::DoorbellWords;
use crate::error::{Error, Result};
use crate::ring::{RingItem, RingReceiver, RingSender, RingShared, Wait};
use crate::segment::Segment;
use bytemuck::Zeroable;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most slots per ring.
pub const MAX_SLOTS: u32 = 1024;
/// Smallest and largest slot.
pub const MIN_SLOT_BYTES: u64 = 4096;
pub const MAX_SLOT_BYTES: u64 = 1 << 32;
/// The CPU ring the chunk records travel through.
const DESC_RING_BYTES: usize = 64 << 10;
/// How long a sleeping wait goes before it looks at the peer's liveness again.
const LIVENESS_SLICE: Duration = Duration::from_millis(20);

// Control segment layout (created by the producer, written by both; each word on its own
// cache line): the consumer's `freed` count and its doorbell, the consumer's state, then
// its `slots` event handles.
const FREED_OFF: usize = 0;
const BELL_OFF: usize = 64;
const STATE_OFF: usize = 128;
const HANDLES_OFF: usize = 256;
/// Consumer state: 0 not yet opened; opened, read events published; could not open;
/// broken (it found a bad record or lost a message part-way and frees nothing more);
/// closed (its copies out finished, or it stopped waiting for them; it is about to destroy
/// its read events and close the arena: the producer must not touch those events again).
const STATE_READY: u32 = 1;
const STATE_REFUSED: u32 = 2;
const STATE_BROKEN: u32 = 3;
const STATE_CLOSED: u32 = 4;

fn ctrl_bytes(slots: u32) -> usize {
    HANDLES_OFF + slots as usize * 64
}

/// Chunk records: a 64-byte header, plus the message's descriptor in the first chunk.
const REC_MAGIC: u32 = u32::from_le_bytes(*b"TWGR");
const REC_HEADER: usize = 64;
const FLAG_FIRST: u32 = 1;
const FLAG_LAST: u32 = 2;

/// Shape of one direction's GPU ring (`PeerConfig::cuda_ring`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaRingConfig {
    /// Device the arena lives on; tensors sent through the ring must be on it.
    pub device: i32,
    /// Slots in the arena (more slots: more chunks in flight).
    pub slots: u32,
    /// Bytes per slot (a message larger than a slot goes through in chunks).
    pub slot_bytes: u64,
}

impl Default for CudaRingConfig {
    fn default() -> Self {
        CudaRingConfig { device: 0, slots: 8, slot_bytes: 4 << 20 }
    }
}

impl CudaRingConfig {
    /// Check the shape (`InvalidArgument` naming the bad field).
    pub fn check(&self) -> Result<()> {
        if self.device < 0 || self.device > 255 {
            return Err(Error::InvalidArgument(format!("GPU ring device {} out of range 0..=255", self.device)));
        }
        if self.slots == 0 || self.slots > MAX_SLOTS {
            return Err(Error::InvalidArgument(format!("GPU ring of {} slots (1..={MAX_SLOTS})", self.slots)));
        }
        if !(MIN_SLOT_BYTES..=MAX_SLOT_BYTES).contains(&self.slot_bytes) || self.slot_bytes % 256 != 0 {
            return Err(Error::InvalidArgument(format!(
                "GPU ring slot of {} bytes (a multiple of 256 in {MIN_SLOT_BYTES}..={MAX_SLOT_BYTES})",
                self.slot_bytes
            )));
        }
        Ok(())
    }

    fn arena_bytes(&self) -> u64 {
        self.slots as u64 * self.slot_bytes
    }
}

/// What the producer sends once at setup, with two fds (control segment, descriptor ring).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingSetup {
    pub cfg: CudaRingConfig,
    /// IPC handle of the arena allocation.
    pub arena: [u8; 64],
    /// Data bytes of the descriptor ring.
    pub desc_ring_bytes: u64,
    /// Handles of the producer's `slots` "written" events.
    pub written: Vec<[u8; 64]>,
}

const SETUP_FIXED: usize = 4 + 4 + 8 + 8 + 64;

impl RingSetup {
    pub fn encode(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(SETUP_FIXED + 64 * self.written.len());
        p.extend_from_slice(&self.cfg.device.to_le_bytes());
        p.extend_from_slice(&self.cfg.slots.to_le_bytes());
        p.extend_from_slice(&self.cfg.slot_bytes.to_le_bytes());
        p.extend_from_slice(&self.desc_ring_bytes.to_le_bytes());
        p.extend_from_slice(&self.arena);
        for h in &self.written {
            p.extend_from_slice(h);
        }
        p
    }

    /// Parse and check a peer's setup payload.
    pub fn decode(p: &[u8]) -> Result<RingSetup> {
        let bad = |m: String| Error::Protocol(format!("GPU ring setup: {m}"));
        if p.len() < SETUP_FIXED {
            return Err(bad(format!("{} bytes, expected at least {SETUP_FIXED}", p.len())));
        }
        let u32_at = |o: usize| u32::from_le_bytes(p[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(p[o..o + 8].try_into().expect("8 bytes"));
        let cfg = CudaRingConfig { device: u32_at(0) as i32, slots: u32_at(4), slot_bytes: u64_at(8) };
        cfg.check().map_err(|e| bad(e.to_string()))?;
        let desc_ring_bytes = u64_at(16);
        let want = SETUP_FIXED + 64 * cfg.slots as usize;
        if p.len() != want {
            return Err(bad(format!("{} bytes for {} slots, expected {want}", p.len(), cfg.slots)));
        }
        let arena = p[24..88].try_into().expect("64 bytes");
        let written = p[SETUP_FIXED..].chunks_exact(64).map(|c| c.try_into().expect("64 bytes")).collect();
        Ok(RingSetup { cfg, arena, desc_ring_bytes, written })
    }
}

/// The control words in the shared control segment.
struct Ctrl {
    seg: Arc<Segment>,
}

impl Ctrl {
    fn new(seg: Arc<Segment>, slots: u32) -> Result<Ctrl> {
        if seg.len() < ctrl_bytes(slots) {
            return Err(Error::Protocol(format!(
                "GPU ring control segment of {} bytes, {} needed for {slots} slots",
                seg.len(),
                ctrl_bytes(slots)
            )));
        }
        Ok(Ctrl { seg })
    }

    fn credits(&self, slots: u32) -> Credits<'_> {
        // SAFETY: FREED_OFF + 8 and BELL_OFF + 8 ≤ HANDLES_OFF ≤ len (checked in `new`),
        // 8-aligned offsets in a page-aligned mapping; the words are only accessed
        // atomically (a hostile peer writing them can only make waits time out or be
        // reported as corrupt, see `credits`).
        unsafe {
            let base = self.seg.as_ptr();
            Credits::new(&*base.add(FREED_OFF).cast::<AtomicU64>(), &*base.add(BELL_OFF).cast::<DoorbellWords>(), slots as u64)
        }
    }

    fn state(&self) -> &AtomicU32 {
        // SAFETY: STATE_OFF + 4 ≤ len (checked in `new`), aligned; accessed atomically only.
        unsafe { &*self.seg.as_ptr().add(STATE_OFF).cast::<AtomicU32>() }
    }
}

/// One chunk record, parsed from private memory.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    flags: u32,
    seq: u64,
    offset: u64,
    len: u64,
    total: u64,
}

impl Chunk {
    fn encode(&self, desc: Option<&TensorDesc>) -> Vec<u8> {
        let mut r = vec![0u8; REC_HEADER];
        r[0..4].copy_from_slice(&REC_MAGIC.to_le_bytes());
        r[4..8].copy_from_slice(&self.flags.to_le_bytes());
        r[8..16].copy_from_slice(&self.seq.to_le_bytes());
        r[16..24].copy_from_slice(&self.offset.to_le_bytes());
        r[24..32].copy_from_slice(&self.len.to_le_bytes());
        r[32..40].copy_from_slice(&self.total.to_le_bytes());
        if let Some(d) = desc {
            r.extend_from_slice(d.encode());
        }
        r
    }

    fn decode(r: &[u8]) -> Result<(Chunk, Option<TensorDesc>)> {
        let bad = |m: String| Error::Protocol(format!("GPU ring record: {m}"));
        if r.len() != REC_HEADER && r.len() != REC_HEADER + DESC_SIZE {
            return Err(bad(format!("{} bytes, expected {REC_HEADER} or {}", r.len(), REC_HEADER + DESC_SIZE)));
        }
        let u32_at = |o: usize| u32::from_le_bytes(r[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(r[o..o + 8].try_into().expect("8 bytes"));
        if u32_at(0) != REC_MAGIC {
            return Err(bad(format!("bad magic {:#010x}", u32_at(0))));
        }
        let c = Chunk { flags: u32_at(4), seq: u64_at(8), offset: u64_at(16), len: u64_at(24), total: u64_at(32) };
        if c.flags & !(FLAG_FIRST | FLAG_LAST) != 0 || r[40..REC_HEADER].iter().any(|&b| b != 0) {
            return Err(bad(format!("unknown flags {:#x} or non-zero reserved bytes", c.flags)));
        }
        let first = c.flags & FLAG_FIRST != 0;
        if first != (r.len() > REC_HEADER) {
            return Err(bad("a first chunk must carry the descriptor, and only a first chunk".into()));
        }
        let desc = if first { Some(TensorDesc::decode(&r[REC_HEADER..])?) } else { None };
        Ok((c, desc))
    }
}

fn credit_err(e: CreditError, timeout: Duration) -> Error {
    match e {
        CreditError::Corrupt { freed, issued } => Error::Protocol(format!(
            "GPU ring broken: the consumer claims {freed} chunks freed, only {issued} were sent"
        )),
        CreditError::Timeout => Error::Timeout { what: "the consumer to free a GPU ring slot", after: timeout },
        CreditError::Gone => Error::peer_gone("the consumer went away while the GPU ring was full"),
    }
}

/// The producing half (one per direction, owned by the sending side).
pub struct CudaRingSender {
    cfg: CudaRingConfig,
    arena: DeviceBuffer,
    arena_handle: [u8; 64],
    written: IpcEventSet,
    /// The consumer's "read" events, opened when first needed (a slot's second use).
    read: Option<IpcEventSet>,
    ctrl: Ctrl,
    descs: RingSender,
    descs_seg: Arc<Segment>,
    /// Chunks sent so far (the next chunk's sequence number).
    seq: u64,
    broken: Option<String>,
}

impl CudaRingSender {
    /// Allocate the arena and events on `cfg.device` (`CudaUnavailable` without a driver).
    pub fn create(cfg: CudaRingConfig) -> Result<CudaRingSender> {
        cfg.check()?;
        super::driver::init()?;
        let arena = DeviceBuffer::alloc(cfg.device, cfg.arena_bytes())?;
        let _ctx = ensure_context(cfg.device)?;
        let exp = ipc::export_pointer(arena.ptr())?;
        let written = IpcEventSet::create(cfg.slots as usize)?;
        let ctrl = Ctrl::new(Arc::new(Segment::create(ctrl_bytes(cfg.slots))?), cfg.slots)?;
        let shared = RingShared::create(DESC_RING_BYTES)?;
        let descs_seg = shared.segment().clone();
        let descs = RingSender::new(shared);
        Ok(CudaRingSender { cfg, arena, arena_handle: exp.handle, written, read: None, ctrl, descs, descs_seg, seq: 0, broken: None })
    }

    pub fn config(&self) -> CudaRingConfig {
        self.cfg
    }

    /// The setup message for the peer: payload and fds (control segment, descriptor ring).
    pub fn setup(&self) -> (Vec<u8>, [BorrowedFd<'_>; 2]) {
        let s = RingSetup {
            cfg: self.cfg,
            arena: self.arena_handle,
            desc_ring_bytes: self.descs.capacity(),
            written: self.written.handles().to_vec(),
        };
        (s.encode(), [self.ctrl.seg.fd(), self.descs_seg.fd()])
    }

    /// True once the consumer reported that it cannot open the ring, that it broke, or that
    /// it closed: it frees no slot any more.
    fn refused(&self) -> bool {
        // Acquire: pairs with the consumer's Release stores in `CudaRingReceiver::refuse`,
        // `mark_broken` and its drop (CLOSED).
        matches!(self.ctrl.state().load(Ordering::Acquire), STATE_REFUSED | STATE_BROKEN | STATE_CLOSED)
    }

    fn check_usable(&self) -> Result<()> {
        if let Some(m) = &self.broken {
            return Err(Error::Protocol(format!("GPU ring broken earlier: {m}")));
        }
        // Acquire: as in `refused`.
        match self.ctrl.state().load(Ordering::Acquire) {
            STATE_BROKEN => {
                return Err(Error::Protocol(
                    "GPU ring broken: the consumer reported it (a bad record, or a message cut off part-way)".into(),
                ));
            }
            // Its read events are destroyed: waiting on them now would be undefined.
            STATE_CLOSED => return Err(Error::peer_gone("the consumer closed its end of the GPU ring")),
            _ => {}
        }
        if self.refused() {
            return Err(Error::CudaUnavailable(
                "the peer could not open this connection's GPU ring (no usable CUDA device there)".into(),
            ));
        }
        Ok(())
    }

    /// Open the consumer's read events (published once in the control segment).
    fn read_events(&mut self) -> Result<&IpcEventSet> {
        if self.read.is_none() {
            // Acquire: pairs with the consumer's Release store of READY after writing the
            // handles (BROKEN comes only after READY).
            if !matches!(self.ctrl.state().load(Ordering::Acquire), STATE_READY | STATE_BROKEN) {
                return Err(Error::Protocol(
                    "GPU ring broken: the consumer freed slots before publishing its events".into(),
                ));
            }
            let mut raw = vec![0u8; self.cfg.slots as usize * 64];
            self.ctrl.seg.read_at(HANDLES_OFF, &mut raw)?;
            let handles: Vec<[u8; 64]> = raw.chunks_exact(64).map(|c| c.try_into().expect("64 bytes")).collect();
            self.read = Some(IpcEventSet::open(&handles)?);
        }
        Ok(self.read.as_ref().expect("opened above"))
    }

    /// Copy `layout.packed_bytes()` contiguous bytes at device address `src` through the
    /// ring, ordered after the work enqueued on `stream` so far (the copies are enqueued
    /// there). `layout` must be contiguous. Waits for free slots as `wait` says: one
    /// deadline for the whole message. A timeout before the first chunk leaves the ring
    /// usable; one part-way through a message breaks it (the consumer holds a partial
    /// message that nothing can complete in order) — size `slots` and timeouts so that a
    /// live consumer keeps up.
    pub fn send(&mut self, src: u64, layout: &Layout, stream: usize, tag: u64, wait: Wait, gone: &dyn Fn() -> bool) -> Result<()> {
        self.check_usable()?;
        if !layout.is_contiguous() {
            return Err(Error::InvalidArgument(
                "the GPU ring copies contiguous bytes: pack the view first (torch: .contiguous())".into(),
            ));
        }
        let total = layout.packed_bytes();
        let _ctx = ensure_context(self.cfg.device)?;
        if total > 0 {
            let dev = pointer_device(src)?;
            if dev != self.cfg.device {
                return Err(Error::InvalidArgument(format!(
                    "this connection's GPU ring is on device {}; the tensor is on device {dev}",
                    self.cfg.device
                )));
            }
        }
        let packed = Layout::contiguous(layout.dtype, layout.sizes())?;
        let desc = TensorDesc::new_cuda(
            &packed,
            self.cfg.device as u8,
            StorageKind::RingSlot,
            StorageRef { nbytes: total, ..Zeroable::zeroed() },
        );
        let chunks = total.div_ceil(self.cfg.slot_bytes).max(1);
        let deadline = crate::deadline::after(wait.timeout);
        for i in 0..chunks {
            let left = deadline.saturating_duration_since(Instant::now());
            let chunk_wait = Wait { timeout: left, ..wait };
            let offset = i * self.cfg.slot_bytes;
            let len = (total - offset).min(self.cfg.slot_bytes);
            let mut flags = if i == 0 { FLAG_FIRST } else { 0 };
            if i + 1 == chunks {
                flags |= FLAG_LAST;
            }
            let chunk = Chunk { flags, seq: self.seq, offset, len, total };
            if let Err(e) = self.send_chunk(chunk, src, stream, tag, (i == 0).then_some(&desc), chunk_wait, gone) {
                let e = match e {
                    Error::Timeout { what, .. } => Error::Timeout { what, after: wait.timeout },
                    e => e,
                };
                if i > 0 || matches!(e, Error::Protocol(_)) {
                    // The consumer holds part of a message (or the peer broke the ring):
                    // nothing more can go through in order.
                    self.broken.get_or_insert_with(|| format!("a send failed after {i} of {chunks} chunks: {e}"));
                }
                return Err(e);
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn send_chunk(
        &mut self,
        c: Chunk,
        src: u64,
        stream: usize,
        tag: u64,
        desc: Option<&TensorDesc>,
        wait: Wait,
        gone: &dyn Fn() -> bool,
    ) -> Result<()> {
        let slots = self.cfg.slots as u64;
        // A consumer that refuses the ring never frees a slot: stop waiting then too.
        let waited = self.ctrl.credits(self.cfg.slots).wait(c.seq, wait.spin, wait.timeout, LIVENESS_SLICE, &|| {
            gone() || self.refused()
        });
        if let Err(e) = waited {
            self.check_usable()?;
            return Err(credit_err(e, wait.timeout));
        }
        self.check_usable()?;
        let slot = (c.seq % slots) as usize;
        if c.seq >= slots {
            // Reuse: the copy-in waits for the consumer's copy-out of the previous use.
            self.read_events()?.wait(stream, slot)?;
        }
        // And for our own last copy into the slot, which may have run on another stream and
        // which no copy-out ordered: a discarded message records no read, and a chunk whose
        // record could not be pushed (timeout) is copied again under the same sequence
        // number. Waiting on a never-recorded event is a no-op.
        self.written.wait(stream, slot)?;
        let dst = self.arena.ptr() + slot as u64 * self.cfg.slot_bytes;
        memcpy_dtod_async(dst, src + c.offset, c.len, stream)?;
        if let Err(e) = self.written.record(slot, stream) {
            // A copy into the slot is queued that no event covers: a later copy (another
            // stream) could race it, so nothing more may go through.
            self.broken.get_or_insert_with(|| format!("recording the slot's event after a copy failed: {e}"));
            return Err(e);
        }
        let rec = c.encode(desc);
        self.descs.send_many(&[RingItem::bytes(tag, &rec)], wait, gone)?;
        self.seq += 1;
        Ok(())
    }

    /// Wait (at most `timeout`, or until `gone`) for the consumer to have freed every chunk
    /// sent and for its copies out of the arena to complete, so the arena can be freed.
    /// A consumer that is gone copies nothing any more (its context died with it).
    pub fn drain(&mut self, timeout: Duration, gone: &dyn Fn() -> bool) {
        let deadline = crate::deadline::after(timeout);
        let credits = self.ctrl.credits(self.cfg.slots);
        // A consumer that broke frees nothing more, but may still be copying out of
        // earlier chunks: stop counting credits, still wait for its read events below.
        while credits.freed() < self.seq && !self.refused() {
            if Instant::now() >= deadline || gone() {
                return;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        // Acquire: as in `refused`. A consumer that refused never opened the arena; one that
        // closed finished (or gave up on) its copies and destroys its read events.
        if self.seq == 0 || gone() || matches!(self.ctrl.state().load(Ordering::Acquire), STATE_REFUSED | STATE_CLOSED) {
            return;
        }
        let Ok(_ctx) = ensure_context(self.cfg.device) else { return };
        // Fewer chunks than slots were sent: the read events were never needed until now.
        if self.read_events().is_err() {
            return;
        }
        let Some(read) = &self.read else { return };
        for i in 0..read.len() {
            while matches!(read.query(i), Ok(false)) && Instant::now() < deadline && !gone() {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }
}

/// A message whose first record has arrived and whose chunks are not yet consumed.
#[derive(Debug, Clone, Copy)]
struct Pending {
    tag: u64,
    desc: TensorDesc,
    first: Chunk,
}

struct RecvState {
    /// The next chunk sequence number expected.
    seq: u64,
    pending: Option<Pending>,
    buf: Vec<u8>,
    broken: Option<String>,
}

/// What the consumer expects of the next record.
#[derive(Debug, Clone, Copy)]
struct Due {
    seq: u64,
    /// Byte offset in the message (0 for a new message).
    offset: u64,
    /// Tag and total of the message being received, `None` when a new one is due.
    message: Option<(u64, u64)>,
}

/// Check a decoded record against the ring's shape, the consumer's limit and what is due.
fn check_chunk(cfg: &CudaRingConfig, max_message: u64, due: &Due, tag: u64, c: &Chunk, desc: Option<&TensorDesc>) -> Result<()> {
    let bad = |m: String| Err(Error::Protocol(format!("GPU ring record {}: {m}", c.seq)));
    if c.seq != due.seq {
        return bad(format!("sequence {} where {} was due", c.seq, due.seq));
    }
    if c.len > cfg.slot_bytes {
        return bad(format!("{} bytes in a {}-byte slot", c.len, cfg.slot_bytes));
    }
    if c.total > max_message {
        return bad(format!("message of {} bytes exceeds the {max_message}-byte limit", c.total));
    }
    let first = c.flags & FLAG_FIRST != 0;
    match due.message {
        None if !first => return bad("a message continues where a new one was due".into()),
        Some(_) if first => return bad("a new message starts before the last one ended".into()),
        Some((t, total)) if t != tag || total != c.total => return bad("a chunk of another message".into()),
        _ => {}
    }
    if c.offset != due.offset || c.offset.checked_add(c.len).is_none_or(|e| e > c.total) {
        return bad(format!(
            "{} bytes at offset {} of a {}-byte message (offset {} due)",
            c.len, c.offset, c.total, due.offset
        ));
    }
    let end = c.offset + c.len;
    if (end == c.total) != (c.flags & FLAG_LAST != 0) || (c.len == 0 && c.total != 0) {
        return bad("chunk boundaries do not match the message's end".into());
    }
    if let Some(d) = desc {
        let l = d.layout();
        if d.kind() != Some(StorageKind::RingSlot)
            || d.device_type != DeviceType::Cuda as u8
            || i32::from(d.device_index) != cfg.device
            || !l.is_contiguous()
            || l.storage_offset != 0
            || d.storage.nbytes != c.total
            || l.packed_bytes() != c.total
        {
            return bad(format!("descriptor does not describe {} contiguous bytes in this ring on device {}", c.total, cfg.device));
        }
    }
    Ok(())
}

/// The consuming half (opened from the peer's setup).
pub struct CudaRingReceiver {
    cfg: CudaRingConfig,
    arena: ipc::IpcMapping,
    written: IpcEventSet,
    read: IpcEventSet,
    ctrl: Ctrl,
    descs: RingReceiver,
    max_message: u64,
    state: parking_lot::Mutex<RecvState>,
}

impl CudaRingReceiver {
    /// Map the peer's control segment (so a refusal can be reported there). The setup
    /// must have been decoded; `fd` is the first of its two fds.
    pub fn map_control(setup: &RingSetup, fd: OwnedFd) -> Result<Arc<Segment>> {
        Ok(Arc::new(Segment::from_fd_exact(fd, ctrl_bytes(setup.cfg.slots), "the GPU ring's control segment")?))
    }

    /// Tell the producer this side cannot open its ring (no CUDA here, or opening failed).
    pub fn refuse(ctrl: &Segment) {
        if ctrl.len() >= STATE_OFF + 4 {
            // SAFETY: STATE_OFF + 4 ≤ len, aligned; accessed atomically only.
            let state = unsafe { &*ctrl.as_ptr().add(STATE_OFF).cast::<AtomicU32>() };
            // Release: pairs with the producer's Acquire load in `check_usable`.
            state.store(STATE_REFUSED, Ordering::Release);
        }
    }

    /// Open the producer's ring: its arena (once, through the handle cache), its events,
    /// the descriptor ring; create and publish our read events.
    pub fn open(
        setup: RingSetup,
        ctrl: Arc<Segment>,
        desc_ring: OwnedFd,
        max_desc_ring: usize,
        max_message: u64,
    ) -> Result<CudaRingReceiver> {
        let cfg = setup.cfg;
        let ctrl = Ctrl::new(ctrl, cfg.slots)?;
        let descs = RingReceiver::new(RingShared::open(desc_ring, setup.desc_ring_bytes, max_desc_ring)?, 64 << 10);
        super::driver::init()?;
        let _ctx = ensure_context(cfg.device)?;
        // Never kept warm in the handle cache: the producer frees the arena when its sender
        // goes, and a handle still open then is undefined behaviour.
        let arena = ipc::cache().open_unwarmed(cfg.device, setup.arena)?;
        ipc::check_range(0, cfg.arena_bytes(), arena.size())
            .map_err(|_| Error::Protocol(format!("GPU ring arena of {} bytes is smaller than {} slots of {}", arena.size(), cfg.slots, cfg.slot_bytes)))?;
        let written = IpcEventSet::open(&setup.written)?;
        let read = IpcEventSet::create(cfg.slots as usize)?;
        let handles: Vec<u8> = read.handles().concat();
        ctrl.seg.write_at(HANDLES_OFF, &handles)?;
        // Release: pairs with the producer's Acquire load in `read_events`: the handles
        // written above are visible once it sees READY.
        ctrl.state().store(STATE_READY, Ordering::Release);
        let state = RecvState { seq: 0, pending: None, buf: Vec::new(), broken: None };
        Ok(CudaRingReceiver { cfg, arena, written, read, ctrl, descs, max_message, state: parking_lot::Mutex::new(state) })
    }

    pub fn config(&self) -> CudaRingConfig {
        self.cfg
    }

    /// Pop the next record and check it against what is due.
    fn next_chunk(
        &self,
        st: &mut RecvState,
        expect: Option<&Pending>,
        offset: u64,
        wait: Wait,
        gone: &dyn Fn() -> bool,
    ) -> Result<(u64, Chunk, Option<TensorDesc>)> {
        let (tag, _) = self.descs.recv_into(&mut st.buf, wait, gone)?;
        let (c, desc) = Chunk::decode(&st.buf)?;
        let due = Due { seq: st.seq, offset, message: expect.map(|p| (p.tag, p.first.total)) };
        check_chunk(&self.cfg, self.max_message, &due, tag, &c, desc.as_ref())?;
        st.seq += 1;
        Ok((tag, c, desc))
    }

    /// Break the ring for good, and tell the producer, which would otherwise wait for
    /// credits that never come.
    fn mark_broken(&self, st: &mut RecvState, why: String) {
        st.broken.get_or_insert(why);
        // Release: pairs with the producer's Acquire loads in `refused`/`check_usable`.
        self.ctrl.state().store(STATE_BROKEN, Ordering::Release);
    }

    fn fail(&self, st: &mut RecvState, e: Error) -> Error {
        if matches!(e, Error::Protocol(_) | Error::InvalidDescriptor(_) | Error::Cuda { .. }) {
            self.mark_broken(st, e.to_string());
        }
        e
    }

    /// A message failed part-way: the rest of its chunks cannot be matched any more.
    fn cut_off(&self, st: &mut RecvState, e: Error) -> Error {
        self.mark_broken(st, format!("a message was cut off: {e}"));
        e
    }

    /// Wait for the next message's first record: its tag and (validated, contiguous)
    /// descriptor. Calling again before `finish`/`discard` returns the same message.
    pub fn begin(&self, wait: Wait, gone: &dyn Fn() -> bool) -> Result<(u64, TensorDesc)> {
        let mut st = self.state.lock();
        if let Some(m) = &st.broken {
            return Err(Error::Protocol(format!("GPU ring broken earlier: {m}")));
        }
        if let Some(p) = st.pending {
            return Ok((p.tag, p.desc));
        }
        match self.next_chunk(&mut st, None, 0, wait, gone) {
            Ok((tag, first, Some(desc))) => {
                st.pending = Some(Pending { tag, desc, first });
                Ok((tag, desc))
            }
            Ok(_) => unreachable!("a first chunk always carries its descriptor (checked in decode)"),
            Err(e) => Err(self.fail(&mut st, e)),
        }
    }

    /// Copy the pending message into `capacity` bytes of device memory at `dst` on
    /// `stream` (ordered after the producer's writes, without blocking on the GPU), and
    /// free its slots. Waits for later chunks as `wait` says.
    pub fn finish(&self, dst: u64, capacity: u64, stream: usize, wait: Wait, gone: &dyn Fn() -> bool) -> Result<()> {
        let mut st = self.state.lock();
        let p = st.pending.ok_or_else(|| Error::InvalidArgument("no GPU ring message is pending: call begin first".into()))?;
        if capacity < p.first.total {
            return Err(Error::InvalidArgument(format!(
                "destination of {capacity} bytes for a {}-byte message",
                p.first.total
            )));
        }
        let _ctx = ensure_context(self.cfg.device)?;
        if p.first.total > 0 {
            let dev = pointer_device(dst)?;
            if dev != self.cfg.device {
                return Err(Error::InvalidArgument(format!(
                    "destination on device {dev}; this GPU ring delivers on device {}",
                    self.cfg.device
                )));
            }
        }
        if gone() {
            // Its arena went with its context: copying out of it now would fault here.
            return Err(Error::peer_gone("the producer went away before its GPU ring message was copied out"));
        }
        st.pending = None;
        match self.consume(&mut st, &p, Some((dst, stream)), wait, gone) {
            Ok(()) => Ok(()),
            // Nothing freed yet (e.g. a bad stream): the message stays pending, the ring usable.
            Err((e, false)) => {
                st.pending = Some(p);
                Err(e)
            }
            Err((e, true)) => Err(self.cut_off(&mut st, e)),
        }
    }

    /// Free the pending message's slots without copying it.
    pub fn discard(&self, wait: Wait, gone: &dyn Fn() -> bool) -> Result<()> {
        let mut st = self.state.lock();
        let Some(p) = st.pending.take() else { return Ok(()) };
        let r = self.consume(&mut st, &p, None, wait, gone);
        r.map_err(|(e, _)| self.cut_off(&mut st, e))
    }

    /// Copy (if `copy` names a destination and stream) and free every chunk of `p`. On
    /// failure, also says whether any chunk was freed (after which the message cannot be
    /// taken up again).
    fn consume(
        &self,
        st: &mut RecvState,
        p: &Pending,
        copy: Option<(u64, usize)>,
        wait: Wait,
        gone: &dyn Fn() -> bool,
    ) -> std::result::Result<(), (Error, bool)> {
        let credits = self.ctrl.credits(self.cfg.slots);
        let deadline = crate::deadline::after(wait.timeout);
        let mut c = p.first;
        loop {
            let progressed = c.seq != p.first.seq;
            let slot = (c.seq % self.cfg.slots as u64) as usize;
            if let Some((dst, stream)) = copy {
                let src = self.arena.base() + slot as u64 * self.cfg.slot_bytes;
                self.written
                    .wait(stream, slot)
                    .and_then(|()| memcpy_dtod_async(dst + c.offset, src, c.len, stream))
                    .map_err(|e| (e, progressed))?;
                // A copy is queued from here on: if no read event covers it, the slot must
                // never be freed (reused under it), so the ring breaks.
                self.read.record(slot, stream).map_err(|e| (e, true))?;
            }
            credits.free(c.seq);
            if c.flags & FLAG_LAST != 0 {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let (_, next, _) = self
                .next_chunk(st, Some(p), c.offset + c.len, Wait { timeout: left, ..wait }, gone)
                .map_err(|e| match e {
                    Error::Timeout { what, .. } => (Error::Timeout { what, after: wait.timeout }, true),
                    e => (e, true),
                })?;
            c = next;
        }
    }
}

impl Drop for CudaRingReceiver {
    fn drop(&mut self) {
        // Copies out of the arena may still be running on the callers' streams; the arena
        // mapping (closed when the last import of its handle goes) must outlive them.
        // Bounded, and never a device-wide synchronize.
        if let Ok(_ctx) = ensure_context(self.cfg.device) {
            let deadline = Instant::now() + Duration::from_secs(1);
            for i in 0..self.read.len() {
                while matches!(self.read.query(i), Ok(false)) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
        }
        // Before the fields drop (read events destroyed, arena closed): the producer must
        // not wait on our read events any more. Release: pairs with the producer's Acquire
        // loads in `refused`/`check_usable`/`drain`.
        self.ctrl.state().store(STATE_CLOSED, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desc::DType;

    fn cfg() -> CudaRingConfig {
        CudaRingConfig { device: 0, slots: 4, slot_bytes: 4096 }
    }

    #[test]
    fn setup_round_trips_and_rejects_bad_shapes() {
        let s = RingSetup { cfg: cfg(), arena: [7; 64], desc_ring_bytes: 65536, written: vec![[1; 64]; 4] };
        assert_eq!(RingSetup::decode(&s.encode()).unwrap(), s);
        let p = s.encode();
        let err = |p: &[u8]| RingSetup::decode(p).unwrap_err().to_string();
        assert!(err(&p[..10]).contains("expected at least"));
        assert!(err(&p[..p.len() - 1]).contains("for 4 slots"));
        let mut q = p.clone();
        q[4..8].copy_from_slice(&0u32.to_le_bytes());
        assert!(err(&q).contains("0 slots"));
        let mut q = p.clone();
        q[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(err(&q).contains("slots"));
        let mut q = p.clone();
        q[8..16].copy_from_slice(&4097u64.to_le_bytes());
        assert!(err(&q).contains("slot of 4097 bytes"));
        let mut q = p;
        q[0..4].copy_from_slice(&(-1i32).to_le_bytes());
        assert!(err(&q).contains("device -1"));
    }

    fn first(total: u64, len: u64) -> (Chunk, TensorDesc) {
        let l = Layout::contiguous(DType::UInt8, &[total as i64]).unwrap();
        let d = TensorDesc::new_cuda(&l, 0, StorageKind::RingSlot, StorageRef { nbytes: total, ..Zeroable::zeroed() });
        let flags = FLAG_FIRST | if len == total { FLAG_LAST } else { 0 };
        (Chunk { flags, seq: 0, offset: 0, len, total }, d)
    }

    #[test]
    fn records_round_trip() {
        let (c, d) = first(10_000, 4096);
        let (c2, d2) = Chunk::decode(&c.encode(Some(&d))).unwrap();
        assert_eq!((c2.flags, c2.seq, c2.offset, c2.len, c2.total), (c.flags, 0, 0, 4096, 10_000));
        assert_eq!(d2.unwrap(), d);
        let mut r = c.encode(None);
        assert!(Chunk::decode(&r).unwrap_err().to_string().contains("must carry the descriptor"));
        r[0] ^= 1;
        assert!(Chunk::decode(&r).unwrap_err().to_string().contains("bad magic"));
        let mut r = c.encode(Some(&d));
        r[50] = 1;
        assert!(Chunk::decode(&r).unwrap_err().to_string().contains("reserved"));
        assert!(Chunk::decode(&[0; 100]).unwrap_err().to_string().contains("100 bytes"));
    }

    #[test]
    fn chunks_are_checked_against_what_is_due() {
        let cfg = cfg();
        let new = Due { seq: 0, offset: 0, message: None };
        let (c, d) = first(10_000, 4096);
        check_chunk(&cfg, 1 << 20, &new, 5, &c, Some(&d)).unwrap();
        let err = |due: &Due, tag: u64, c: &Chunk, d: Option<&TensorDesc>| check_chunk(&cfg, 1 << 20, due, tag, c, d).unwrap_err().to_string();
        // Out of sequence, oversized, over the limit.
        assert!(err(&Due { seq: 3, ..new }, 5, &c, Some(&d)).contains("3 was due"));
        assert!(err(&new, 5, &Chunk { len: 8192, ..c }, Some(&d)).contains("4096-byte slot"));
        let (big, bd) = first(2 << 20, 4096);
        assert!(err(&new, 5, &big, Some(&bd)).contains("limit"));
        // The second chunk: right offset, same message, not a new start.
        let mid = Chunk { flags: 0, seq: 1, offset: 4096, len: 4096, total: 10_000 };
        let due = Due { seq: 1, offset: 4096, message: Some((5, 10_000)) };
        check_chunk(&cfg, 1 << 20, &due, 5, &mid, None).unwrap();
        assert!(err(&due, 6, &mid, None).contains("another message"));
        assert!(err(&Due { offset: 0, ..due }, 5, &mid, None).contains("offset 0 due"));
        assert!(err(&due, 5, &Chunk { flags: FLAG_FIRST, ..mid }, Some(&d)).contains("starts before"));
        assert!(err(&new, 5, &Chunk { seq: 0, ..mid }, None).contains("continues where a new one"));
        // End flags must match the bytes.
        assert!(err(&due, 5, &Chunk { flags: FLAG_LAST, ..mid }, None).contains("boundaries"));
        let last = Chunk { flags: FLAG_LAST, seq: 2, offset: 8192, len: 1808, total: 10_000 };
        check_chunk(&cfg, 1 << 20, &Due { seq: 2, offset: 8192, ..due }, 5, &last, None).unwrap();
        assert!(err(&Due { seq: 2, offset: 8192, ..due }, 5, &Chunk { len: 2000, ..last }, None).contains("offset 8192"));
        // The descriptor must describe the message's bytes on this ring's device.
        let (c, mut d) = first(4096, 4096);
        d.storage.nbytes = 4000;
        assert!(err(&new, 5, &c, Some(&d)).contains("contiguous bytes"));
        let (c, mut d) = first(4096, 4096);
        d.device_index = 3;
        assert!(err(&new, 5, &c, Some(&d)).contains("device 0"));
        // An empty message is one empty chunk.
        let (c, d) = first(0, 0);
        check_chunk(&cfg, 1 << 20, &new, 5, &c, Some(&d)).unwrap();
    }

    #[test]
    fn config_limits() {
        assert!(cfg().check().is_ok());
        assert!(CudaRingConfig::default().check().is_ok());
        for bad in [
            CudaRingConfig { slots: 0, ..cfg() },
            CudaRingConfig { slots: MAX_SLOTS + 1, ..cfg() },
            CudaRingConfig { slot_bytes: 1000, ..cfg() },
            CudaRingConfig { slot_bytes: 4096 + 1, ..cfg() },
            CudaRingConfig { device: -1, ..cfg() },
        ] {
            assert!(matches!(bad.check(), Err(Error::InvalidArgument(_))), "{bad:?}");
        }
    }
}
