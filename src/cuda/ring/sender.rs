//! The producing half: copies into arena slots on the caller's stream, signals each copy
//! (the slot's written word, or its "written" event), publishes chunk records.

use crate::cuda::types::{CudaStream, DevicePtr};
use super::config::{CudaRingConfig, RingSetup};
use super::control::{credit_err, ctrl_bytes, Chunk, Ctrl, DESC_RING_BYTES, FLAG_FIRST, FLAG_LAST, HANDLES_AT, LIVENESS_SLICE, MODE_EVENTS, MODE_WORDS, STATE_BROKEN, STATE_CLOSED, STATE_READY, STATE_REFUSED};
use super::words::{use_of, RingWords, Waits, Word};
use crate::cuda::driver::{ensure_context, memcpy_dtod_async, pointer_device, DeviceBuffer};
use crate::cuda::event::IpcEventSet;
use crate::cuda::order::{host_wait, CudaWait, PeerWatch};
use crate::cuda::ipc;
use crate::desc::{Layout, StorageKind, StorageRef, TensorDesc};
use crate::error::{Error, Result};
use crate::ring::{RingItem, RingSender, RingShared};
use crate::segment::Segment;
use bytemuck::Zeroable;
use std::os::fd::BorrowedFd;
use std::sync::atomic::Ordering;
use crate::wait::{Deadline, Wait};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the consumer chose to order by (known once it opened the ring).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Words,
    Events,
}

/// What a reuse wait for the consumer's copy out names in its error.
const READ_WAIT: &str = "the consumer's copy out of a GPU ring slot";

/// The producing half (one per direction, owned by the sending side).
pub struct CudaRingSender {
    cfg: CudaRingConfig,
    arena: DeviceBuffer,
    arena_handle: [u8; 64],
    /// Signal words, where this side offers them (its policy is not `Event` and the
    /// driver can register and write them).
    words: Option<RingWords>,
    /// "Written" events, for a consumer that orders by events.
    written: IpcEventSet,
    /// The consumer's "read" events (events mode), opened when first needed.
    read: Option<IpcEventSet>,
    /// The consumer's choice, once read from the control segment.
    mode: Option<Mode>,
    ctrl: Ctrl,
    descs: RingSender,
    descs_seg: Arc<Segment>,
    /// Chunks sent so far (the next chunk's sequence number).
    seq: u64,
    broken: Option<String>,
    /// How a slot's reuse waits for the consumer's copy out of it: by our stream on its
    /// read word (`Stream`), on the host (`Host`; and `Stream` in events mode), or by our
    /// stream on its read event (`Event`).
    waits: Waits,
}

impl CudaRingSender {
    /// Allocate the arena, words and events on `cfg.device` (`CudaUnavailable` without a
    /// driver); slot reuse waits for the consumer as `wait_policy` says, a stream's wait
    /// at most `wait_timeout` (then the ring breaks) and not past `peer`'s death.
    pub fn create(cfg: CudaRingConfig, wait_policy: CudaWait, wait_timeout: Wait, peer: Arc<PeerWatch>) -> Result<CudaRingSender> {
        cfg.check()?;
        crate::cuda::driver::init()?;
        let arena = DeviceBuffer::alloc(cfg.device, cfg.arena_bytes())?;
        let _ctx = ensure_context(cfg.device)?;
        let exp = ipc::export_pointer(arena.ptr())?;
        let words = if wait_policy == CudaWait::Event { None } else { RingWords::create(cfg.device, cfg.slots).ok() };
        let written = IpcEventSet::create(cfg.slots as usize)?;
        let ctrl = Ctrl::new(Arc::new(Segment::create(ctrl_bytes(cfg.slots))?), cfg.slots)?;
        let shared = RingShared::create(DESC_RING_BYTES)?;
        let descs_seg = shared.segment().clone();
        let descs = RingSender::new(shared);
        Ok(CudaRingSender {
            cfg,
            arena,
            arena_handle: exp.handle,
            words,
            written,
            read: None,
            mode: None,
            ctrl,
            descs,
            descs_seg,
            seq: 0,
            broken: None,
            waits: Waits::new(wait_policy, wait_timeout, peer),
        })
    }

    pub fn config(&self) -> CudaRingConfig {
        self.cfg
    }

    /// The setup message for the peer: payload and fds (control segment, descriptor ring,
    /// and the signal words where offered).
    pub fn setup(&self) -> (Vec<u8>, Vec<BorrowedFd<'_>>) {
        let s = RingSetup {
            cfg: self.cfg,
            arena: self.arena_handle,
            desc_ring_bytes: self.descs.capacity(),
            words: self.words.is_some(),
            written: self.written.handles().to_vec(),
        };
        let mut fds = vec![self.ctrl.seg.fd(), self.descs_seg.fd()];
        fds.extend(self.words.as_ref().map(RingWords::fd));
        (s.encode(), fds)
    }

    /// Whether the ring goes by its signal words (`None` until the consumer opened it).
    pub fn uses_words(&mut self) -> Result<Option<bool>> {
        Ok(self.mode()?.map(|m| m == Mode::Words))
    }

    /// The consumer's choice, once it published one.
    fn mode(&mut self) -> Result<Option<Mode>> {
        if self.mode.is_none() {
            // Acquire: pairs with the consumer's Release store of READY, made after its
            // mode word (BROKEN and CLOSED come only after READY).
            if !matches!(self.ctrl.state().load(Ordering::Acquire), STATE_READY | STATE_BROKEN | STATE_CLOSED) {
                return Ok(None);
            }
            // Relaxed: ordered by the Acquire load above.
            self.mode = Some(match self.ctrl.mode().load(Ordering::Relaxed) {
                MODE_WORDS if self.words.is_some() => Mode::Words,
                MODE_EVENTS => Mode::Events,
                m => {
                    return Err(Error::Protocol(format!(
                        "GPU ring broken: the consumer chose ordering mode {m}{}",
                        if self.words.is_none() { " (signal words were not offered)" } else { "" }
                    )))
                }
            });
        }
        Ok(self.mode)
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
        self.waits.check()?;
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
            self.ctrl.seg.read_at(HANDLES_AT, &mut raw)?;
            let handles: Vec<[u8; 64]> = raw.chunks_exact(64).map(|c| c.try_into().expect("64 bytes")).collect();
            self.read = Some(IpcEventSet::open(&handles)?);
        }
        Ok(self.read.as_ref().expect("opened above"))
    }

    /// Copy `layout.packed_bytes()` contiguous bytes at device address `src` through the
    /// ring, ordered after the work enqueued on `stream` so far (the copies are enqueued
    /// there). `layout` must be contiguous. Waits for free slots as `wait` says (`spin`
    /// polls before each sleep): one deadline for the whole message. A timeout before the first chunk leaves the ring
    /// usable; one part-way through a message breaks it (the consumer holds a partial
    /// message that nothing can complete in order) — size `slots` and timeouts so that a
    /// live consumer keeps up.
    #[allow(clippy::too_many_arguments)]
    pub fn send(&mut self, src: DevicePtr, layout: &Layout, stream: CudaStream, tag: u64, wait: impl Into<Wait>, spin: u32, gone: &dyn Fn() -> bool) -> Result<()> {
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
        let mut deadline = wait.into().deadline();
        for i in 0..chunks {
            let offset = i * self.cfg.slot_bytes;
            let len = (total - offset).min(self.cfg.slot_bytes);
            let mut flags = if i == 0 { FLAG_FIRST } else { 0 };
            if i + 1 == chunks {
                flags |= FLAG_LAST;
            }
            let chunk = Chunk { flags, seq: self.seq, offset, len, total };
            if let Err(e) = self.send_chunk(chunk, src, stream, tag, (i == 0).then_some(&desc), &mut deadline, spin, gone) {
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
        src: DevicePtr,
        stream: CudaStream,
        tag: u64,
        desc: Option<&TensorDesc>,
        deadline: &mut Deadline,
        spin: u32,
        gone: &dyn Fn() -> bool,
    ) -> Result<()> {
        let slots = self.cfg.slots as u64;
        // A consumer that refuses the ring never frees a slot: stop waiting then too.
        let waited = self.ctrl.credits(self.cfg.slots).wait(c.seq, spin, deadline.as_wait(), LIVENESS_SLICE, &|| {
            gone() || self.refused()
        });
        if let Err(e) = waited {
            self.check_usable()?;
            return Err(credit_err(e, deadline));
        }
        self.check_usable()?;
        let slot = (c.seq % slots) as usize;
        let value = use_of(c.seq, self.cfg.slots);
        // Before the consumer opened the ring its choice is unknown: signal both ways (no
        // slot is reused before then: reuse needs its credits).
        let mode = self.mode()?;
        if c.seq >= slots {
            // Reuse: the copy-in waits for the consumer's copy out of the slot's last use.
            match mode {
                Some(Mode::Words) => {
                    let words = self.words.as_ref().expect("words mode only where offered");
                    words.wait(slot, Word::Read, value.wrapping_sub(1), stream, &self.waits, deadline, gone, READ_WAIT)?;
                }
                Some(Mode::Events) => {
                    // On the host unless the policy is `Event` (a GPU-side wait on the
                    // consumer's IPC event costs a time-slice switch without MPS).
                    let policy = self.waits.policy;
                    let read = self.read_events()?;
                    if policy == CudaWait::Event {
                        read.wait(stream, slot)?;
                    } else {
                        host_wait(|| read.query(slot), deadline, gone, READ_WAIT)?;
                    }
                }
                None => {
                    return Err(Error::Protocol(
                        "GPU ring broken: the consumer freed slots before saying how it orders its copies".into(),
                    ))
                }
            }
        }
        // And our own last copy into the slot, which may have run on another stream and
        // which no copy-out ordered: a discarded message's, or a chunk's whose record could
        // not be pushed (timeout; it is copied again under the same sequence number).
        match (&self.words, mode) {
            (Some(w), Some(Mode::Words) | None) => w.after_own(slot, stream)?,
            // Waiting on a never-recorded event is a no-op.
            _ => self.written.wait(stream, slot)?,
        }
        let dst = self.arena.ptr() + slot as u64 * self.cfg.slot_bytes;
        memcpy_dtod_async(dst, src + c.offset, c.len, stream)?;
        // A copy into the slot is queued from here on: if nothing signals it, a later copy
        // (another stream) could race it, so nothing more may go through.
        let mut signalled = Ok(());
        if mode != Some(Mode::Events) {
            if let Some(w) = &mut self.words {
                signalled = w.signal(slot, Word::Written, value, stream);
            }
        }
        if mode != Some(Mode::Words) && signalled.is_ok() {
            signalled = self.written.record(slot, stream);
        }
        if let Err(e) = signalled {
            self.broken.get_or_insert_with(|| format!("signalling a copy into a slot failed: {e}"));
            return Err(e);
        }
        let rec = c.encode(desc);
        self.descs.send_many_until(&[RingItem::bytes(tag, &rec)], deadline, spin, gone)?;
        self.seq += 1;
        Ok(())
    }

    /// Wait (as `wait` says, or until `gone`) for the consumer to have freed every chunk
    /// sent and for its copies out of the arena to complete, so the arena can be freed.
    /// A consumer that is gone copies nothing any more (its context died with it).
    pub fn drain(&mut self, wait: impl Into<Wait>, gone: &dyn Fn() -> bool) {
        let mut deadline = wait.into().deadline();
        deadline.start();
        let credits = self.ctrl.credits(self.cfg.slots);
        // A consumer that broke frees nothing more, but may still be copying out of
        // earlier chunks: stop counting credits, still wait for its read events below.
        while credits.freed() < self.seq && !self.refused() {
            if deadline.expired() || gone() {
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
        match self.mode() {
            Ok(Some(Mode::Words)) => {
                // Each slot's last use: its read word reaches it once the copy out ran.
                let words = self.words.as_ref().expect("words mode only where offered");
                let slots = self.cfg.slots as u64;
                for slot in 0..slots.min(self.seq) {
                    let last = self.seq - 1 - (self.seq - 1 - slot) % slots;
                    let value = use_of(last, self.cfg.slots);
                    while matches!(words.reached(slot as usize, Word::Read, value), Ok(false)) && !deadline.expired() && !gone() {
                        std::thread::sleep(Duration::from_micros(200));
                    }
                }
                // And our own copies into the arena.
                words.wait_own(Instant::now() + deadline.remaining().unwrap_or(Duration::from_secs(1)));
            }
            Ok(Some(Mode::Events)) => {
                // Fewer chunks than slots were sent: the read events were never needed until now.
                if self.read_events().is_err() {
                    return;
                }
                let Some(read) = &self.read else { return };
                for i in 0..read.len() {
                    while matches!(read.query(i), Ok(false)) && !deadline.expired() && !gone() {
                        std::thread::sleep(Duration::from_micros(200));
                    }
                }
            }
            _ => {}
        }
    }
}
