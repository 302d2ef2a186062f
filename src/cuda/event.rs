//! Pooled IPC events: cross-process stream ordering without a device-wide synchronize.
//!
//! Per connection the producer creates a pool of events with
//! `CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING` once and exports their handles once.
//! For each send it records the next slot on its stream after the last write and sends
//! (slot, sequence); the consumer makes its own stream wait (`cuStreamWaitEvent`) and then
//! acknowledges the sequence in a shared ack table. A slot is recorded again only once the
//! consumer has acknowledged its previous sequence: `cuStreamWaitEvent` captures the
//! event's state when it is called, so after the acknowledgement a new record cannot
//! change what the consumer's stream waits for.
//!
//! Every record is acknowledged exactly once, or given back: an import that fails, or is
//! dropped without a wait, acknowledges its record ([`EventClaim`]'s drop); an export whose
//! message never went out cancels its record ([`EventPool::cancel`]). Otherwise one lost
//! acknowledgement would stall every export once the pool wrapped around to its slot. An
//! import waits on the producer's event once; further streams wait on a private event
//! recorded after that wait (the slot may be recorded again by then).
//!
//! The ack table is a sealed memfd the producer creates; a hostile consumer writing it can
//! only break its own ordering (the producer treats any value as "maybe done" and never
//! reads anything else from it).

use super::driver::{call, current_device, ensure_context};
use super::types::CudaStream;
use crate::error::{Error, Result};
use crate::segment::Segment;
use cudarc::driver::sys;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use crate::wait::Wait;
use std::time::Duration;

/// Events per connection.
pub const POOL_SIZE: usize = 32;

fn ack_word(seg: &Segment, slot: usize) -> &AtomicU64 {
    assert!((slot + 1) * 8 <= seg.len());
    // SAFETY: slot*8+8 ≤ len (checked), 8-aligned in a page-aligned mapping; the words are
    // only accessed atomically.
    unsafe { &*seg.as_ptr().add(slot * 8).cast::<AtomicU64>() }
}

/// True once the work before `ev`'s most recent record has completed (never blocks).
fn query_event(ev: sys::CUevent) -> Result<bool> {
    let mut ready = true;
    // SAFETY: the callers pass a live event they own or opened.
    call("cuEventQuery", || match unsafe { sys::cuEventQuery(ev) } {
        sys::CUresult::CUDA_ERROR_NOT_READY => {
            ready = false;
            sys::CUresult::CUDA_SUCCESS
        }
        other => other,
    })?;
    Ok(ready)
}

/// Make `stream` wait for `ev`'s most recent record (a context of their device current).
fn stream_wait(stream: CudaStream, ev: sys::CUevent) -> Result<()> {
    // SAFETY: the callers pass a live event they own or opened and their stream handle.
    call("cuStreamWaitEvent", || unsafe { sys::cuStreamWaitEvent(stream.raw(), ev, 0) })
}

/// One driver event, destroyed when the last holder drops it (in a context of its device:
/// the holder may be on a thread whose current context is another device's, or none).
struct OwnedEvent {
    device: i32,
    ev: usize,
}

impl Drop for OwnedEvent {
    fn drop(&mut self) {
        let _ctx = ensure_context(self.device);
        // SAFETY: an event created or opened once, destroyed once (last holder).
        let _ = call("cuEventDestroy", || unsafe { sys::cuEventDestroy_v2(self.ev as sys::CUevent) });
    }
}

/// Interprocess events this process created, by handle: the driver refuses to open a
/// handle in the process that made it, so an open of one of these (both ends of a
/// connection in one process) shares the event itself. Weak: the creator's set owns them.
static OWN_EVENTS: parking_lot::Mutex<Vec<([u8; 64], std::sync::Weak<OwnedEvent>)>> = parking_lot::Mutex::new(Vec::new());

/// Interprocess events (`CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING`): created here
/// with handles to export, or opened from a peer's handles (or shared, for handles this
/// process created). Destroyed when the last set holding them drops (an opened IPC event
/// is released with `cuEventDestroy` as well). The caller keeps a context of that device
/// current around every other call.
pub struct IpcEventSet {
    events: Vec<Arc<OwnedEvent>>,
    handles: Vec<[u8; 64]>,
}

// SAFETY: CUevent handles are process-wide driver objects usable from any thread.
unsafe impl Send for IpcEventSet {}
// SAFETY: every method only passes the handles to thread-safe driver calls.
unsafe impl Sync for IpcEventSet {}

impl IpcEventSet {
    /// Create `n` interprocess events in the current context.
    pub fn create(n: usize) -> Result<IpcEventSet> {
        let device = current_device()?;
        let mut set = IpcEventSet { events: Vec::with_capacity(n), handles: Vec::with_capacity(n) };
        let flags = sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32 | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        for _ in 0..n {
            let mut ev: sys::CUevent = std::ptr::null_mut();
            // SAFETY: valid out-pointer.
            call("cuEventCreate", || unsafe { sys::cuEventCreate(&mut ev, flags) })?;
            let owned = Arc::new(OwnedEvent { device, ev: ev as usize });
            set.events.push(owned.clone());
            let mut h = sys::CUipcEventHandle { reserved: [0; 64] };
            // SAFETY: valid out-pointer and a live interprocess event.
            call("cuIpcGetEventHandle", || unsafe { sys::cuIpcGetEventHandle(&mut h, ev) })?;
            let handle = h.reserved.map(|c| c as u8);
            set.handles.push(handle);
            let mut own = OWN_EVENTS.lock();
            own.retain(|(_, w)| w.strong_count() > 0);
            own.push((handle, Arc::downgrade(&owned)));
        }
        Ok(set)
    }

    /// Open a peer's event handles in the current context (the driver rejects a handle
    /// that names no live interprocess event); a handle this process created shares the
    /// event instead.
    pub fn open(handles: &[[u8; 64]]) -> Result<IpcEventSet> {
        let device = current_device()?;
        let mut set = IpcEventSet { events: Vec::with_capacity(handles.len()), handles: handles.to_vec() };
        for h in handles {
            let own = OWN_EVENTS.lock().iter().find(|(k, _)| k == h).and_then(|(_, w)| w.upgrade());
            if let Some(ev) = own {
                set.events.push(ev);
                continue;
            }
            let mut ev: sys::CUevent = std::ptr::null_mut();
            let handle = sys::CUipcEventHandle { reserved: h.map(|b| b as std::ffi::c_char) };
            // SAFETY: valid out-pointer; a bad handle is an error from the driver.
            call("cuIpcOpenEventHandle", || unsafe { sys::cuIpcOpenEventHandle(&mut ev, handle) })?;
            set.events.push(Arc::new(OwnedEvent { device, ev: ev as usize }));
        }
        Ok(set)
    }

    pub fn len(&self) -> usize {
        self.events.len()
    }
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }
    /// The exportable handles (of created events; of opened ones, what was opened).
    pub fn handles(&self) -> &[[u8; 64]] {
        &self.handles
    }

    fn event(&self, i: usize) -> Result<sys::CUevent> {
        self.events.get(i).map(|e| e.ev as sys::CUevent).ok_or_else(|| {
            Error::InvalidDescriptor(format!("IPC event slot {i} out of range ({} events)", self.events.len()))
        })
    }

    /// Record event `i` on `stream`.
    pub fn record(&self, i: usize, stream: CudaStream) -> Result<()> {
        let ev = self.event(i)?;
        // SAFETY: a live event of this set and the caller's stream handle.
        call("cuEventRecord", || unsafe { sys::cuEventRecord(ev, stream.raw()) })
    }

    /// Make `stream` wait for event `i`'s most recent record (a stream wait, never a
    /// device-wide synchronize).
    pub fn wait(&self, stream: CudaStream, i: usize) -> Result<()> {
        stream_wait(stream, self.event(i)?)
    }
}

impl IpcEventSet {
    /// True once the work before event `i`'s most recent record has completed (never
    /// blocks; an event never recorded counts as complete).
    pub fn query(&self, i: usize) -> Result<bool> {
        query_event(self.event(i)?)
    }
}

/// The producer's bookkeeping of its pool, apart from the driver (so it is tested without a
/// GPU): the sequence each slot was last issued with, the next slot, and the consumer's
/// ack table. A slot may be recorded again once the consumer acknowledged its last issue.
struct Ledger {
    acks: Arc<Segment>,
    issued: Vec<u64>,
    next: usize,
    seq: u64,
}

impl Ledger {
    fn new(acks: Arc<Segment>, slots: usize) -> Ledger {
        Ledger { acks, issued: vec![0; slots], next: 0, seq: 0 }
    }

    /// Is the next slot free (its last issue acknowledged)?
    fn next_free(&self) -> bool {
        // Acquire: pairs with the consumer's Release store in `RemoteEvents::ack`: its
        // stream wait on the slot's last record was enqueued before it acknowledged.
        ack_word(&self.acks, self.next).load(Ordering::Acquire) >= self.issued[self.next]
    }

    /// Wait (as `wait` says) until the next slot is free; returns it.
    fn reserve(&self, wait: impl Into<Wait>) -> Result<usize> {
        let mut deadline = wait.into().deadline();
        while !self.next_free() {
            if deadline.expired() {
                return Err(deadline.timed_out("the consumer to finish with an IPC event slot"));
            }
            std::thread::sleep(Duration::from_micros(20));
        }
        Ok(self.next)
    }

    /// The reserved slot was recorded: issue it under the next sequence number.
    fn issue(&mut self, slot: usize) -> u64 {
        self.seq += 1;
        self.issued[slot] = self.seq;
        self.next = (slot + 1) % self.issued.len();
        self.seq
    }

    /// The record issued as (`slot`, `seq`) will never reach the consumer (the export
    /// failed before its message went out): nobody will wait on it or acknowledge it, so
    /// the slot is free again at once (its previous issue was acknowledged before it was
    /// reserved).
    fn cancel(&mut self, slot: usize, seq: u64) {
        if self.issued.get(slot) == Some(&seq) {
            self.issued[slot] = 0;
        }
    }
}

/// The producer's pool.
pub struct EventPool {
    device: i32,
    events: IpcEventSet,
    ledger: Ledger,
}

impl EventPool {
    /// Create and export `POOL_SIZE` interprocess events on `device`.
    pub fn new(device: i32) -> Result<EventPool> {
        let _ctx = ensure_context(device)?;
        let acks = Arc::new(Segment::create(POOL_SIZE * 8)?);
        let events = IpcEventSet::create(POOL_SIZE)?;
        Ok(EventPool { device, events, ledger: Ledger::new(acks, POOL_SIZE) })
    }

    pub fn device(&self) -> i32 {
        self.device
    }
    /// Handles to send to the consumer (once per connection).
    pub fn handles(&self) -> &[[u8; 64]] {
        self.events.handles()
    }
    /// The ack table to send with them.
    pub fn acks(&self) -> &Arc<Segment> {
        &self.ledger.acks
    }

    /// Record the next slot on `stream` (waiting as `wait` says for the consumer to
    /// acknowledge that slot's previous use). Returns (slot, sequence). If the record
    /// never reaches the consumer, the caller must [`cancel`](EventPool::cancel) it.
    pub fn record(&mut self, stream: CudaStream, wait: impl Into<Wait>) -> Result<(u32, u64)> {
        let slot = self.ledger.reserve(wait)?;
        let _ctx = ensure_context(self.device)?;
        self.events.record(slot, stream)?;
        Ok((slot as u32, self.ledger.issue(slot)))
    }

    /// Give back a record whose message was never sent (a refused lease, a failed send):
    /// otherwise its slot would wait for an acknowledgement that never comes, and every
    /// export would time out once the pool wrapped around to it.
    pub fn cancel(&mut self, slot: u32, seq: u64) {
        self.ledger.cancel(slot as usize, seq);
    }
}

/// The consumer's view of the producer's pool.
pub struct RemoteEvents {
    device: i32,
    /// How many events the producer announced (the ack table holds as many words).
    count: usize,
    /// The opened events, or why they could not be opened here (reported at every wait):
    /// the table still takes acknowledgements then, so the producer's slots do not jam.
    events: Result<IpcEventSet>,
    acks: Segment,
}

impl RemoteEvents {
    /// Open the producer's event handles (once per connection) and its ack table. A
    /// malformed announcement is an error; events this process cannot open (no usable
    /// CUDA here) give an ack-only view: claims work and acknowledge, waits fail saying why.
    pub fn open(device: i32, handles: &[[u8; 64]], acks: Segment) -> Result<RemoteEvents> {
        if handles.is_empty() || handles.len() > 1024 || acks.len() < handles.len() * 8 {
            return Err(Error::Protocol(format!(
                "{} IPC events with a {}-byte ack table",
                handles.len(),
                acks.len()
            )));
        }
        let events = ensure_context(device).and_then(|_ctx| IpcEventSet::open(handles));
        Ok(RemoteEvents { device, count: handles.len(), events, acks })
    }

    /// Could the events be opened here? (`Err`: why not.)
    pub fn usable(&self) -> std::result::Result<(), &Error> {
        self.events.as_ref().map(|_| ())
    }

    /// Claim the producer's record `seq` in `slot` (named by a descriptor): it is waited on
    /// at most once and acknowledged exactly once, also when it is never waited on.
    pub fn claim(self: &Arc<Self>, slot: u32, seq: u64) -> Result<EventClaim> {
        if slot as usize >= self.count {
            return Err(Error::InvalidDescriptor(format!("IPC event slot {slot} out of range ({} events)", self.count)));
        }
        Ok(EventClaim { events: self.clone(), slot, seq, state: parking_lot::Mutex::new(ClaimState::Open) })
    }

    /// Make `stream` wait for the record in `slot` (checked by `claim`).
    fn wait(&self, slot: u32, stream: CudaStream) -> Result<()> {
        let events = self.events.as_ref().map_err(|why| {
            Error::CudaUnavailable(format!("the producer's IPC events could not be opened here: {why}"))
        })?;
        let _ctx = ensure_context(self.device)?;
        events.wait(stream, slot as usize)
    }

    /// Tell the producer we will never wait on record `seq` of `slot` again (`slot` checked
    /// by `claim`).
    fn ack(&self, slot: u32, seq: u64) {
        // Release: pairs with the producer's Acquire load in `Ledger::next_free`; a stream
        // wait on the record, if any, was enqueued before, so a later record of the slot
        // cannot change what that wait captured.
        ack_word(&self.acks, slot as usize).store(seq, Ordering::Release);
    }
}

enum ClaimState {
    /// Not waited on yet (or every wait so far failed to enqueue).
    Open,
    /// Waited on and acknowledged; the mark recorded on the first stream right after its
    /// wait orders any further stream (None if that mark could not be recorded).
    Waited(Option<StreamMark>),
}

/// The consumer's claim on one record of the producer's pool (one import). The first
/// [`wait_on`](EventClaim::wait_on) makes a stream wait for the producer's record and then
/// acknowledges it; after that the producer may record the slot again, so a second stream
/// waits on a private mark recorded on the first one instead. Dropped without a wait, the
/// claim acknowledges the record, so the producer's slot never jams.
pub struct EventClaim {
    events: Arc<RemoteEvents>,
    slot: u32,
    seq: u64,
    state: parking_lot::Mutex<ClaimState>,
}

impl EventClaim {
    /// Make `stream` wait for the producer's write (a stream wait, never a device-wide
    /// synchronize).
    pub fn wait_on(&self, stream: CudaStream) -> Result<()> {
        let mut st = self.state.lock();
        match &*st {
            ClaimState::Waited(Some(mark)) => mark.order(stream),
            ClaimState::Waited(None) => Err(Error::InvalidArgument(
                "this CUDA import ordered its first stream, but the event that would order a second one could not be \
                 recorded: use the first stream"
                    .into(),
            )),
            ClaimState::Open => {
                // A wait that could not be enqueued changes nothing: the claim stays open
                // (a later call may succeed; the drop acknowledges).
                self.events.wait(self.slot, stream)?;
                // The wait is enqueued: this claim never waits on the record again.
                self.events.ack(self.slot, self.seq);
                *st = ClaimState::Waited(StreamMark::record(self.events.device, stream).ok());
                Ok(())
            }
        }
    }
}

impl Drop for EventClaim {
    fn drop(&mut self) {
        if matches!(*self.state.get_mut(), ClaimState::Open) {
            self.events.ack(self.slot, self.seq);
        }
    }
}

/// A private (non-IPC) event recorded on a stream: "everything enqueued on the stream so
/// far has finished" once [`StreamMark::done`] says so. Used to release an import's lease
/// only after the consumer's GPU work that reads it has completed, without blocking.
pub struct StreamMark {
    device: i32,
    ev: usize,
}

// SAFETY: CUevent handles are process-wide driver objects usable from any thread.
unsafe impl Send for StreamMark {}

impl StreamMark {
    /// Record a mark on `stream` of `device`.
    pub fn record(device: i32, stream: CudaStream) -> Result<StreamMark> {
        let _ctx = ensure_context(device)?;
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        call("cuEventCreate", || unsafe { sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) })?;
        let mark = StreamMark { device, ev: ev as usize };
        // SAFETY: a live event of ours and the caller's stream.
        call("cuEventRecord", || unsafe { sys::cuEventRecord(ev, stream.raw()) })?;
        Ok(mark)
    }

    /// True once the work before the mark has completed (never blocks). Callable from any
    /// thread (the reaper's has no current context of its own).
    pub fn done(&self) -> Result<bool> {
        let _ctx = ensure_context(self.device)?;
        query_event(self.ev as sys::CUevent)
    }

    /// Make `stream` (of the mark's device) wait for the mark.
    pub fn order(&self, stream: CudaStream) -> Result<()> {
        let _ctx = ensure_context(self.device)?;
        stream_wait(stream, self.ev as sys::CUevent)
    }
}

impl Drop for StreamMark {
    fn drop(&mut self) {
        let _ctx = ensure_context(self.device);
        // SAFETY: an event we created, destroyed once.
        let _ = call("cuEventDestroy", || unsafe { sys::cuEventDestroy_v2(self.ev as sys::CUevent) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ack(acks: &Segment, slot: usize, seq: u64) {
        ack_word(acks, slot).store(seq, Ordering::Release);
    }

    #[test]
    fn a_slot_waits_for_its_acknowledgement_and_a_cancelled_issue_frees_it() {
        let acks = Arc::new(Segment::create(2 * 8).unwrap());
        let mut l = Ledger::new(acks.clone(), 2);
        let short = Duration::from_millis(5);
        let s0 = l.reserve(short).unwrap();
        assert_eq!((s0, l.issue(s0)), (0, 1));
        let s1 = l.reserve(short).unwrap();
        assert_eq!((s1, l.issue(s1)), (1, 2));
        // Slot 0 again: its issue 1 is not acknowledged yet.
        let e = l.reserve(short).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        ack(&acks, 0, 1);
        assert_eq!(l.reserve(short).unwrap(), 0);
        assert_eq!(l.issue(0), 3);
        // Issue 3's message never went out: cancelling it frees slot 0 without an ack...
        ack(&acks, 1, 2);
        assert_eq!(l.reserve(short).unwrap(), 1);
        assert_eq!(l.issue(1), 4);
        l.cancel(0, 3);
        assert_eq!(l.reserve(short).unwrap(), 0, "a cancelled issue must not jam its slot");
        // ...but a cancel naming an older issue of the slot changes nothing.
        assert_eq!(l.issue(0), 5);
        l.cancel(0, 3);
        ack(&acks, 1, 4);
        assert_eq!(l.reserve(short).unwrap(), 1);
        assert_eq!(l.issue(1), 6);
        assert!(matches!(l.reserve(short), Err(Error::Timeout { .. })), "slot 0's issue 5 is still unacknowledged");
        // Not waiting fails at once; a timeout too long for the clock is not zero.
        let t = std::time::Instant::now();
        assert!(matches!(l.reserve(Wait::Never), Err(Error::Timeout { .. })));
        assert!(t.elapsed() < Duration::from_secs(1));
        ack(&acks, 0, 5);
        assert_eq!(l.reserve(Duration::MAX).unwrap(), 0);
    }
}
