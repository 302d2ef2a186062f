//! The producing half: copies into arena slots on the caller's stream, records the
//! "written" events, publishes chunk records.

use crate::cuda::types::{CudaStream, DevicePtr};
use super::config::{CudaRingConfig, RingSetup};
use super::control::{credit_err, ctrl_bytes, Chunk, Ctrl, DESC_RING_BYTES, FLAG_FIRST, FLAG_LAST, HANDLES_OFF, LIVENESS_SLICE, STATE_BROKEN, STATE_CLOSED, STATE_READY, STATE_REFUSED};
use crate::cuda::driver::{ensure_context, memcpy_dtod_async, pointer_device, DeviceBuffer};
use crate::cuda::event::IpcEventSet;
use crate::cuda::order::{host_wait, CudaWait};
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
use std::time::Duration;

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
    /// How a slot's reuse waits for the consumer's copy out of it: on the host
    /// (`Stream`, `Host`) or by our stream (`Event`, `cuStreamWaitEvent`).
    wait_policy: CudaWait,
}

impl CudaRingSender {
    /// Allocate the arena and events on `cfg.device` (`CudaUnavailable` without a driver);
    /// slot reuse waits for the consumer as `wait_policy` says.
    pub fn create(cfg: CudaRingConfig, wait_policy: CudaWait) -> Result<CudaRingSender> {
        cfg.check()?;
        crate::cuda::driver::init()?;
        let arena = DeviceBuffer::alloc(cfg.device, cfg.arena_bytes())?;
        let _ctx = ensure_context(cfg.device)?;
        let exp = ipc::export_pointer(arena.ptr())?;
        let written = IpcEventSet::create(cfg.slots as usize)?;
        let ctrl = Ctrl::new(Arc::new(Segment::create(ctrl_bytes(cfg.slots))?), cfg.slots)?;
        let shared = RingShared::create(DESC_RING_BYTES)?;
        let descs_seg = shared.segment().clone();
        let descs = RingSender::new(shared);
        Ok(CudaRingSender { cfg, arena, arena_handle: exp.handle, written, read: None, ctrl, descs, descs_seg, seq: 0, broken: None, wait_policy })
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
        if c.seq >= slots {
            // Reuse: the copy-in waits for the consumer's copy-out of the previous use —
            // on the host unless the policy is `Event` (a GPU-side wait on the consumer's
            // IPC event costs a time-slice switch without MPS).
            let policy = self.wait_policy;
            let read = self.read_events()?;
            if policy == CudaWait::Event {
                read.wait(stream, slot)?;
            } else {
                host_wait(|| read.query(slot), deadline, gone, "the consumer's copy out of a GPU ring slot")?;
            }
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
}
