//! The consuming half: validates each chunk record against what is due, copies slots out
//! on the caller's stream, frees them.

use crate::cuda::types::{CudaStream, DevicePtr};
use super::config::{CudaRingConfig, RingSetup};
use super::control::{ctrl_bytes, Chunk, Ctrl, FLAG_FIRST, FLAG_LAST, HANDLES_AT, MODE_EVENTS, MODE_WORDS, STATE_BROKEN, STATE_CLOSED, STATE_AT, STATE_READY, STATE_REFUSED};
use super::words::{use_of, RingWords, Waits, Word};
use crate::cuda::driver::{ensure_context, memcpy_dtod_async, pointer_device};
use crate::cuda::event::IpcEventSet;
use crate::cuda::order::{host_wait, CudaWait, PeerWatch};
use crate::cuda::ipc;
use crate::desc::{DeviceType, StorageKind, TensorDesc};
use crate::error::{Error, Result};
use crate::ring::{RingReceiver, RingShared};
use crate::segment::Segment;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, Ordering};
use crate::wait::{Deadline, Wait};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a host wait for a slot's copy-in waits for (its `Timeout` names it).
const WRITTEN_WAIT: &str = "the producer's copy into a GPU ring slot";

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

/// How the consumer orders its copies after the producer's and tells it when a slot is
/// free to reuse.
enum Order {
    /// The ring's signal words: the copy out waits for the slot's written word (by the
    /// caller's stream under `Stream`, on the host under `Host`), then raises its read word.
    Words(parking_lot::Mutex<RingWords>),
    /// IPC events: the producer's written events are waited for on the host (`Stream`,
    /// `Host`) or by the caller's stream (`Event`); our read events are recorded after
    /// each copy out.
    Events { written: IpcEventSet, read: IpcEventSet },
}

/// The consuming half (opened from the peer's setup).
pub struct CudaRingReceiver {
    cfg: CudaRingConfig,
    arena: ipc::IpcMapping,
    order: Order,
    ctrl: Ctrl,
    descs: RingReceiver,
    max_message: u64,
    state: parking_lot::Mutex<RecvState>,
    waits: Waits,
}

impl CudaRingReceiver {
    /// Map the peer's control segment (so a refusal can be reported there). The setup
    /// must have been decoded; `fd` is the first of its two fds.
    pub fn map_control(setup: &RingSetup, fd: OwnedFd) -> Result<Arc<Segment>> {
        Ok(Arc::new(Segment::from_fd_exact(fd, ctrl_bytes(setup.cfg.slots), "the GPU ring's control segment")?))
    }

    /// Tell the producer this side cannot open its ring (no CUDA here, or opening failed).
    pub fn refuse(ctrl: &Segment) {
        if ctrl.len() >= STATE_AT + 4 {
            // SAFETY: STATE_AT + 4 ≤ len, aligned; accessed atomically only.
            let state = unsafe { &*ctrl.as_ptr().add(STATE_AT).cast::<AtomicU32>() };
            // Release: pairs with the producer's Acquire load in `check_usable`.
            state.store(STATE_REFUSED, Ordering::Release);
        }
    }

    /// Open the producer's ring: its arena (once, through the handle cache), the
    /// descriptor ring, and its signal words (`words`, the third fd of its setup, where it
    /// offered them and our policy is not `Event`) — or its events, with ours created and
    /// published. Our copies wait for the producer's as `wait_policy` says, a stream's wait
    /// at most `wait_timeout` (then the ring breaks) and not past `peer`'s death.
    #[allow(clippy::too_many_arguments)]
    pub fn open(
        setup: RingSetup,
        ctrl: Arc<Segment>,
        desc_ring: OwnedFd,
        words: Option<OwnedFd>,
        max_desc_ring: usize,
        max_message: u64,
        wait_policy: CudaWait,
        wait_timeout: Wait,
        peer: Arc<PeerWatch>,
    ) -> Result<CudaRingReceiver> {
        setup.check_fds(2 + usize::from(words.is_some()))?;
        let cfg = setup.cfg;
        let ctrl = Ctrl::new(ctrl, cfg.slots)?;
        let descs = RingReceiver::new(RingShared::open(desc_ring, setup.desc_ring_bytes, max_desc_ring)?, 64 << 10);
        crate::cuda::driver::init()?;
        let _ctx = ensure_context(cfg.device)?;
        // Never kept warm in the handle cache: the producer frees the arena when its sender
        // goes, and a handle still open then is undefined behaviour.
        let arena = ipc::cache().open_unwarmed(cfg.device, setup.arena)?;
        ipc::check_range(0, cfg.arena_bytes(), arena.size())
            .map_err(|_| Error::Protocol(format!("GPU ring arena of {} bytes is smaller than {} slots of {}", arena.size(), cfg.slots, cfg.slot_bytes)))?;
        // Words where both sides can use them; a registration that fails here falls back
        // to events (the producer signals both until it reads our choice).
        let words = words.filter(|_| wait_policy != CudaWait::Event).and_then(|fd| RingWords::open(fd, cfg.device, cfg.slots).ok());
        let order = match words {
            Some(w) => {
                // Relaxed: published by the Release store of READY below.
                ctrl.mode().store(MODE_WORDS, Ordering::Relaxed);
                Order::Words(parking_lot::Mutex::new(w))
            }
            None => {
                let written = IpcEventSet::open(&setup.written)?;
                let read = IpcEventSet::create(cfg.slots as usize)?;
                let handles: Vec<u8> = read.handles().concat();
                ctrl.seg.write_at(HANDLES_AT, &handles)?;
                // Relaxed: published by the Release store of READY below.
                ctrl.mode().store(MODE_EVENTS, Ordering::Relaxed);
                Order::Events { written, read }
            }
        };
        // Release: pairs with the producer's Acquire loads in `mode` and `read_events`: the
        // mode word and the handles written above are visible once it sees READY.
        ctrl.state().store(STATE_READY, Ordering::Release);
        let state = RecvState { seq: 0, pending: None, buf: Vec::new(), broken: None };
        Ok(CudaRingReceiver {
            cfg,
            arena,
            order,
            ctrl,
            descs,
            max_message,
            state: parking_lot::Mutex::new(state),
            waits: Waits::new(wait_policy, wait_timeout, peer),
        })
    }

    /// Whether this ring goes by its signal words (else by IPC events).
    pub fn uses_words(&self) -> bool {
        matches!(self.order, Order::Words(_))
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
        deadline: &mut Deadline,
        spin: u32,
        gone: &dyn Fn() -> bool,
    ) -> Result<(u64, Chunk, Option<TensorDesc>)> {
        let (tag, _) = self.descs.recv_into_until(&mut st.buf, deadline, spin, gone)?;
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
    /// Waits as `wait` says, `spin` polls before each sleep.
    pub fn begin(&self, wait: impl Into<Wait>, spin: u32, gone: &dyn Fn() -> bool) -> Result<(u64, TensorDesc)> {
        let mut st = self.state.lock();
        if let Some(m) = &st.broken {
            return Err(Error::Protocol(format!("GPU ring broken earlier: {m}")));
        }
        if let Err(e) = self.waits.check() {
            self.mark_broken(&mut st, e.to_string());
            return Err(e);
        }
        if let Some(p) = st.pending {
            return Ok((p.tag, p.desc));
        }
        match self.next_chunk(&mut st, None, 0, &mut wait.into().deadline(), spin, gone) {
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
    pub fn finish(&self, dst: DevicePtr, capacity: u64, stream: CudaStream, wait: impl Into<Wait>, spin: u32, gone: &dyn Fn() -> bool) -> Result<()> {
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
        match self.consume(&mut st, &p, Some((dst, stream)), &mut wait.into().deadline(), spin, gone) {
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
    pub fn discard(&self, wait: impl Into<Wait>, spin: u32, gone: &dyn Fn() -> bool) -> Result<()> {
        let mut st = self.state.lock();
        let Some(p) = st.pending.take() else { return Ok(()) };
        let r = self.consume(&mut st, &p, None, &mut wait.into().deadline(), spin, gone);
        r.map_err(|(e, _)| self.cut_off(&mut st, e))
    }

    /// Copy (if `copy` names a destination and stream) and free every chunk of `p`. On
    /// failure, also says whether any chunk was freed (after which the message cannot be
    /// taken up again).
    fn consume(
        &self,
        st: &mut RecvState,
        p: &Pending,
        copy: Option<(DevicePtr, CudaStream)>,
        deadline: &mut Deadline,
        spin: u32,
        gone: &dyn Fn() -> bool,
    ) -> std::result::Result<(), (Error, bool)> {
        let credits = self.ctrl.credits(self.cfg.slots);
        let mut c = p.first;
        loop {
            let progressed = c.seq != p.first.seq;
            let slot = (c.seq % self.cfg.slots as u64) as usize;
            let value = use_of(c.seq, self.cfg.slots);
            match (&self.order, copy) {
                (Order::Words(words), Some((dst, stream))) => {
                    let mut words = words.lock();
                    let src = self.arena.base() + slot as u64 * self.cfg.slot_bytes;
                    words.after_own(slot, stream).map_err(|e| (e, progressed))?;
                    words.wait(slot, Word::Written, value, stream, &self.waits, deadline, gone, WRITTEN_WAIT).map_err(|e| (e, progressed))?;
                    memcpy_dtod_async(dst + c.offset, src, c.len, stream).map_err(|e| (e, progressed))?;
                    // A copy is queued from here on: if no word covers it, the slot must
                    // never be freed (reused under it), so the ring breaks.
                    words.signal(slot, Word::Read, value, stream).map_err(|e| (e, true))?;
                }
                (Order::Words(words), None) => {
                    // Nothing of ours reads the slot: once the producer's copy into it is
                    // done (on the host: there is no stream here), it is free.
                    let words = words.lock();
                    host_wait(|| words.reached(slot, Word::Written, value), deadline, gone, WRITTEN_WAIT).map_err(|e| (e, progressed))?;
                    words.raise(slot, Word::Read, value).map_err(|e| (e, true))?;
                }
                (Order::Events { written, read }, Some((dst, stream))) => {
                    let src = self.arena.base() + slot as u64 * self.cfg.slot_bytes;
                    // The producer's copy into the slot first: waited for on the host
                    // unless the policy is `Event` (see `CudaWait`).
                    if self.waits.policy == CudaWait::Event {
                        written.wait(stream, slot).map_err(|e| (e, progressed))?;
                    } else {
                        host_wait(|| written.query(slot), deadline, gone, WRITTEN_WAIT).map_err(|e| (e, progressed))?;
                    }
                    memcpy_dtod_async(dst + c.offset, src, c.len, stream).map_err(|e| (e, progressed))?;
                    // A copy is queued from here on: if no read event covers it, the slot
                    // must never be freed (reused under it), so the ring breaks.
                    read.record(slot, stream).map_err(|e| (e, true))?;
                }
                (Order::Events { .. }, None) => {}
            }
            credits.free(c.seq);
            if c.flags & FLAG_LAST != 0 {
                return Ok(());
            }
            let (_, next, _) = self.next_chunk(st, Some(p), c.offset + c.len, deadline, spin, gone).map_err(|e| (e, true))?;
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
            match &self.order {
                Order::Words(words) => words.lock().wait_own(deadline),
                Order::Events { read, .. } => {
                    for i in 0..read.len() {
                        while matches!(read.query(i), Ok(false)) && Instant::now() < deadline {
                            std::thread::sleep(Duration::from_micros(200));
                        }
                    }
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
    use crate::cuda::ring::test_support::*;

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
}
