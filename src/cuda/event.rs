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
//! The ack table is a sealed memfd the producer creates; a hostile consumer writing it can
//! only break its own ordering (the producer treats any value as "maybe done" and never
//! reads anything else from it).

use super::driver::{call, current_device, ensure_context};
use crate::error::{Error, Result};
use crate::segment::Segment;
use cudarc::driver::sys;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// Interprocess events (`CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING`): created here
/// with handles to export, or opened from a peer's handles. Destroyed on drop (an opened
/// IPC event is released with `cuEventDestroy` as well, in a context of the events'
/// device). The caller keeps a context of that device current around every other call.
pub struct IpcEventSet {
    device: i32,
    events: Vec<usize>,
    handles: Vec<[u8; 64]>,
}

// SAFETY: CUevent handles are process-wide driver objects usable from any thread.
unsafe impl Send for IpcEventSet {}
// SAFETY: every method only passes the handles to thread-safe driver calls.
unsafe impl Sync for IpcEventSet {}

impl IpcEventSet {
    /// Create `n` interprocess events in the current context.
    pub fn create(n: usize) -> Result<IpcEventSet> {
        let mut set = IpcEventSet { device: current_device()?, events: Vec::with_capacity(n), handles: Vec::with_capacity(n) };
        let flags = sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32 | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        for _ in 0..n {
            let mut ev: sys::CUevent = std::ptr::null_mut();
            // SAFETY: valid out-pointer.
            call("cuEventCreate", || unsafe { sys::cuEventCreate(&mut ev, flags) })?;
            set.events.push(ev as usize);
            let mut h = sys::CUipcEventHandle { reserved: [0; 64] };
            // SAFETY: valid out-pointer and a live interprocess event.
            call("cuIpcGetEventHandle", || unsafe { sys::cuIpcGetEventHandle(&mut h, ev) })?;
            set.handles.push(h.reserved.map(|c| c as u8));
        }
        Ok(set)
    }

    /// Open a peer's event handles in the current context (the driver rejects a handle
    /// that names no live interprocess event).
    pub fn open(handles: &[[u8; 64]]) -> Result<IpcEventSet> {
        let mut set = IpcEventSet { device: current_device()?, events: Vec::with_capacity(handles.len()), handles: handles.to_vec() };
        for h in handles {
            let mut ev: sys::CUevent = std::ptr::null_mut();
            let handle = sys::CUipcEventHandle { reserved: h.map(|b| b as std::ffi::c_char) };
            // SAFETY: valid out-pointer; a bad handle is an error from the driver.
            call("cuIpcOpenEventHandle", || unsafe { sys::cuIpcOpenEventHandle(&mut ev, handle) })?;
            set.events.push(ev as usize);
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
        self.events.get(i).map(|&e| e as sys::CUevent).ok_or_else(|| {
            Error::InvalidDescriptor(format!("IPC event slot {i} out of range ({} events)", self.events.len()))
        })
    }

    /// Record event `i` on `stream`.
    pub fn record(&self, i: usize, stream: usize) -> Result<()> {
        let ev = self.event(i)?;
        // SAFETY: a live event of this set and the caller's stream handle.
        call("cuEventRecord", || unsafe { sys::cuEventRecord(ev, stream as sys::CUstream) })
    }

    /// Make `stream` wait for event `i`'s most recent record (a stream wait, never a
    /// device-wide synchronize).
    pub fn wait(&self, stream: usize, i: usize) -> Result<()> {
        let ev = self.event(i)?;
        // SAFETY: a live event of this set and the caller's stream handle.
        call("cuStreamWaitEvent", || unsafe { sys::cuStreamWaitEvent(stream as sys::CUstream, ev, 0) })
    }
}

impl IpcEventSet {
    /// True once the work before event `i`'s most recent record has completed (never
    /// blocks; an event never recorded counts as complete).
    pub fn query(&self, i: usize) -> Result<bool> {
        query_event(self.event(i)?)
    }
}

impl Drop for IpcEventSet {
    fn drop(&mut self) {
        // The set may be dropped on a thread whose current context is another device's, or
        // none.
        let _ctx = ensure_context(self.device);
        for &e in &self.events {
            // SAFETY: events created or opened by this set, destroyed once.
            let _ = call("cuEventDestroy", || unsafe { sys::cuEventDestroy_v2(e as sys::CUevent) });
        }
    }
}

/// The producer's pool.
pub struct EventPool {
    device: i32,
    events: IpcEventSet,
    acks: Arc<Segment>,
    issued: Vec<u64>,
    next: usize,
    seq: u64,
}

impl EventPool {
    /// Create and export `POOL_SIZE` interprocess events on `device`.
    pub fn new(device: i32) -> Result<EventPool> {
        let _ctx = ensure_context(device)?;
        let acks = Arc::new(Segment::create(POOL_SIZE * 8)?);
        let events = IpcEventSet::create(POOL_SIZE)?;
        Ok(EventPool { device, events, acks, issued: vec![0; POOL_SIZE], next: 0, seq: 0 })
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
        &self.acks
    }

    /// Record the next slot on `stream` (waiting up to `timeout` for the consumer to
    /// acknowledge that slot's previous use). Returns (slot, sequence).
    pub fn record(&mut self, stream: usize, timeout: Duration) -> Result<(u32, u64)> {
        let slot = self.next;
        let deadline = crate::deadline::after(timeout);
        // Acquire: pairs with the consumer's Release store in `RemoteEvents::wait`.
        while ack_word(&self.acks, slot).load(Ordering::Acquire) < self.issued[slot] {
            if Instant::now() >= deadline {
                return Err(Error::Timeout { what: "the consumer to finish with an IPC event slot", after: timeout });
            }
            std::thread::sleep(Duration::from_micros(20));
        }
        self.seq += 1;
        let _ctx = ensure_context(self.device)?;
        self.events.record(slot, stream)?;
        self.issued[slot] = self.seq;
        self.next = (slot + 1) % POOL_SIZE;
        Ok((slot as u32, self.seq))
    }
}

/// The consumer's view of the producer's pool.
pub struct RemoteEvents {
    device: i32,
    events: IpcEventSet,
    acks: Segment,
}

impl RemoteEvents {
    /// Open the producer's event handles (once per connection) and its ack table.
    pub fn open(device: i32, handles: &[[u8; 64]], acks: Segment) -> Result<RemoteEvents> {
        if handles.is_empty() || handles.len() > 1024 || acks.len() < handles.len() * 8 {
            return Err(Error::Protocol(format!(
                "{} IPC events with a {}-byte ack table",
                handles.len(),
                acks.len()
            )));
        }
        let _ctx = ensure_context(device)?;
        Ok(RemoteEvents { device, events: IpcEventSet::open(handles)?, acks })
    }

    /// Make `stream` wait for the producer's record `seq` in `slot`, then acknowledge it.
    pub fn wait(&self, slot: u32, seq: u64, stream: usize) -> Result<()> {
        let _ctx = ensure_context(self.device)?;
        self.events.wait(stream, slot as usize)?;
        // Release: pairs with the producer's Acquire load in `EventPool::record`; the wait
        // above was enqueued before the slot may be recorded again.
        ack_word(&self.acks, slot as usize).store(seq, Ordering::Release);
        Ok(())
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
    pub fn record(device: i32, stream: usize) -> Result<StreamMark> {
        let _ctx = ensure_context(device)?;
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        call("cuEventCreate", || unsafe { sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) })?;
        let mark = StreamMark { device, ev: ev as usize };
        // SAFETY: a live event of ours and the caller's stream.
        call("cuEventRecord", || unsafe { sys::cuEventRecord(ev, stream as sys::CUstream) })?;
        Ok(mark)
    }

    /// True once the work before the mark has completed (never blocks). Callable from any
    /// thread (the reaper's has no current context of its own).
    pub fn done(&self) -> Result<bool> {
        let _ctx = ensure_context(self.device)?;
        query_event(self.ev as sys::CUevent)
    }
}

impl Drop for StreamMark {
    fn drop(&mut self) {
        let _ctx = ensure_context(self.device);
        // SAFETY: an event we created, destroyed once.
        let _ = call("cuEventDestroy", || unsafe { sys::cuEventDestroy_v2(self.ev as sys::CUevent) });
    }
}
