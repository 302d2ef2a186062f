//! Events. An event's state is two counters: how many times it was recorded (bumped when
//! `cuEventRecord` is called) and the highest record whose preceding work completed
//! (written by the stream worker when the record is reached). A query is NOT_READY until
//! the most recent record completed; `cuStreamWaitEvent` captures the record most recent
//! when it is called; an event never recorded is complete. An interprocess event keeps
//! its counters in a memfd page that the processes opening its handle map too, so
//! records and waits work across processes. Each record also notes the recording
//! process, so a stream wait on a record another process made can be told apart: that is
//! what costs a GPU time-slice switch on hardware without MPS (`SIMCUDA_XPROC_WAIT_US`).

use crate::event_state::{EventState, Mem, WORDS, W_ID, W_RECORDED, W_COMPLETED, W_RECORDER};
use crate::memory::Backing;
use crate::result::*;
use crate::stream::{self, Op};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub const CU_EVENT_BLOCKING_SYNC: u32 = 1;
pub const CU_EVENT_DISABLE_TIMING: u32 = 2;
pub const CU_EVENT_INTERPROCESS: u32 = 4;

pub struct Event {
    pub state: Arc<EventState>,
    pub device: i32,
    pub flags: u32,
}

static EVENTS: Mutex<Option<HashMap<usize, Arc<Event>>>> = Mutex::new(None);
static NEXT_HANDLE: AtomicU64 = AtomicU64::new(0x4500_0000_1000);

fn insert(e: Event) -> usize {
    // Relaxed: a unique counter.
    let h = NEXT_HANDLE.fetch_add(0x10, Ordering::Relaxed) as usize;
    EVENTS.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(HashMap::new).insert(h, Arc::new(e));
    h
}

pub fn get(h: usize) -> R<Arc<Event>> {
    EVENTS.lock().unwrap_or_else(|e| e.into_inner()).as_ref().and_then(|m| m.get(&h).cloned()).ok_or(INVALID_HANDLE)
}

/// `cuEventCreate`. Documented: `CU_EVENT_INTERPROCESS` must come with
/// `CU_EVENT_DISABLE_TIMING` (else CUDA_ERROR_INVALID_VALUE); unknown flags too.
pub fn create(flags: u32) -> R<usize> {
    let ctx = crate::context::current()?;
    if flags & !(CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS) != 0 {
        return Err(INVALID_VALUE);
    }
    let id = crate::memory::new_id();
    let mem = if flags & CU_EVENT_INTERPROCESS != 0 {
        if flags & CU_EVENT_DISABLE_TIMING == 0 {
            return Err(INVALID_VALUE);
        }
        let b = Backing::create(&format!("simcuda-event-{id}"), crate::memory::PAGE)?;
        Mem::Shared(b)
    } else {
        Mem::Local(Box::new([const { AtomicU64::new(0) }; WORDS]))
    };
    let state = EventState { mem };
    // Relaxed: published to other threads by the table's mutex, to other processes by
    // the handle (sent after this returns, through a socket).
    state.words()[W_ID].store(id, Ordering::Relaxed);
    Ok(insert(Event { state: Arc::new(state), device: ctx.device, flags }))
}

/// An opened interprocess event (from `ipc`).
pub fn insert_opened(backing: Backing, device: i32) -> usize {
    insert(Event { state: Arc::new(EventState { mem: Mem::Shared(backing) }), device, flags: CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING })
}

/// Check that an opened backing holds the event `id` (the handle's claim).
pub fn backing_holds(backing: &Backing, id: u64) -> bool {
    // SAFETY: a mapped page (at least 32 bytes), accessed atomically.
    let w = unsafe { &*backing.at(0).cast::<[AtomicU64; WORDS]>() };
    // Relaxed: written once by the creator before it made the handle.
    w[W_ID].load(Ordering::Relaxed) == id
}

pub fn destroy(h: usize) -> R {
    EVENTS.lock().unwrap_or_else(|e| e.into_inner()).as_mut().and_then(|m| m.remove(&h)).map(|_| ()).ok_or(INVALID_HANDLE)
}

pub fn live_events() -> u64 {
    EVENTS.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map_or(0, |m| m.len() as u64)
}

/// `cuEventRecord`: the event and the stream must be of one device (documented: "hEvent
/// and hStream must be from the same context", else CUDA_ERROR_INVALID_HANDLE).
pub fn record(h: usize, stream_h: usize) -> R {
    let ev = get(h)?;
    let s = stream::resolve(stream_h)?;
    if s.device != ev.device {
        return Err(INVALID_HANDLE);
    }
    // Relaxed: published by the fetch_add below (see `recorder`).
    ev.state.words()[W_RECORDER].store(u64::from(std::process::id()), Ordering::Relaxed);
    // AcqRel: pairs with the Acquire loads of `recorded` in query/wait (any process).
    let target = ev.state.words()[W_RECORDED].fetch_add(1, Ordering::AcqRel) + 1;
    let state = ev.state.clone();
    stream::enqueue(
        &s,
        Op::Run(Box::new(move || {
            // Release: pairs with the Acquire load in `completed`; the stream's earlier
            // ops ran before this one on this worker.
            state.words()[W_COMPLETED].fetch_max(target, Ordering::Release);
        })),
    );
    Ok(())
}

/// `cuEventQuery`: SUCCESS once the most recent record's work completed (or never
/// recorded), else CUDA_ERROR_NOT_READY.
pub fn query(h: usize) -> R {
    let ev = get(h)?;
    let target = ev.state.recorded();
    if ev.state.completed() >= target { Ok(()) } else { Err(NOT_READY) }
}

pub fn synchronize(h: usize) -> R {
    let ev = get(h)?;
    let target = ev.state.recorded();
    ev.state.wait_completed(target);
    Ok(())
}

/// `cuStreamWaitEvent`: the stream's later work waits for the record most recent now.
/// Flags other than 0 are CUDA_ERROR_INVALID_VALUE (only the default is simulated).
///
/// A wait on a record another process made is a cross-process event stream wait: counted
/// (`xproc_event_waits`), and without `SIMCUDA_MPS=1` the stream then also sleeps
/// `SIMCUDA_XPROC_WAIT_US` once the event completed (the GPU time-slice switch such a wait
/// costs on hardware). Host waits (`cuEventSynchronize`, `cuEventQuery`) pay nothing.
pub fn stream_wait(stream_h: usize, h: usize, flags: u32) -> R {
    if flags != 0 {
        return Err(INVALID_VALUE);
    }
    let ev = get(h)?;
    let s = stream::resolve(stream_h)?;
    let target = ev.state.recorded();
    let mut penalty = Duration::ZERO;
    if target > 0 && ev.state.recorder() != std::process::id() {
        crate::stats::count(&crate::stats::XPROC_EVENT_WAITS);
        let settings = crate::settings::get();
        if !settings.mps {
            penalty = settings.xproc_wait;
        }
    }
    stream::enqueue(&s, Op::WaitEvent(ev.state.clone(), target, penalty));
    Ok(())
}
