//! The driver's event objects tensorwire uses: interprocess events created here or
//! opened from a peer's handles ([`IpcEventSet`]), and private marks recorded on a stream
//! ([`StreamMark`]). The cross-process protocols built on them live in `order/`: the
//! producer's pool (`order::event_pool`) and the consumer's claims on it
//! (`order::remote_events`).

use super::driver::{call, current_device, ensure_context};
use super::types::CudaStream;
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::sync::Arc;

/// True once the work before `ev`'s most recent record has completed (never blocks).
pub(crate) fn query_event(ev: sys::CUevent) -> Result<bool> {
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
pub(crate) fn stream_wait(stream: CudaStream, ev: sys::CUevent) -> Result<()> {
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

    /// Record the mark again on `stream` (of the mark's device; a context of it current):
    /// it now stands for the work enqueued there so far.
    pub fn record_again(&self, stream: CudaStream) -> Result<()> {
        // SAFETY: a live event of ours and the caller's stream.
        call("cuEventRecord", || unsafe { sys::cuEventRecord(self.ev as sys::CUevent, stream.raw()) })
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

