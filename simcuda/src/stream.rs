//! Streams: each runs its work in order on its own worker thread, each op after a seeded
//! random delay (`SIMCUDA_SEED`, `SIMCUDA_MAX_DELAY_US`), so work that is not ordered by a
//! stream or an event overlaps in ways a test notices.
//!
//! The legacy default stream (handle 0 or `CU_STREAM_LEGACY`) of each device orders with
//! that device's blocking streams as the driver documents: work on it waits for all work
//! enqueued before on blocking streams, and work enqueued on a blocking stream waits for
//! the legacy stream's earlier work. Streams created `CU_STREAM_NON_BLOCKING` do neither.

use crate::events::EventState;
use crate::result::*;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::Duration;

pub const CU_STREAM_LEGACY: usize = 1;
pub const CU_STREAM_PER_THREAD: usize = 2;
pub const CU_STREAM_NON_BLOCKING: u32 = 1;

pub enum Op {
    Run(Box<dyn FnOnce() + Send>),
    /// Wait until `stream` completed its first `n` ops.
    WaitStream(Arc<Stream>, u64),
    /// Wait until `event` completed record number `target` (0: nothing to wait for).
    WaitEvent(Arc<EventState>, u64),
}

struct Queue {
    ops: VecDeque<Op>,
    closing: bool,
}

pub struct Stream {
    pub device: i32,
    pub blocking: bool,
    queue: Mutex<Queue>,
    wake: Condvar,
    /// Ops enqueued so far (written under the device's enqueue lock).
    enqueued: AtomicU64,
    done: Mutex<u64>,
    done_cv: Condvar,
}

impl Stream {
    fn spawn(device: i32, blocking: bool, serial: u64) -> Arc<Stream> {
        let s = Arc::new(Stream {
            device,
            blocking,
            queue: Mutex::new(Queue { ops: VecDeque::new(), closing: false }),
            wake: Condvar::new(),
            enqueued: AtomicU64::new(0),
            done: Mutex::new(0),
            done_cv: Condvar::new(),
        });
        let worker = s.clone();
        let seed = settings().0 ^ serial.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        std::thread::Builder::new()
            .name(format!("simcuda-stream-{serial}"))
            .spawn(move || worker.run(seed))
            .expect("simcuda: cannot start a stream worker thread");
        s
    }

    fn run(self: Arc<Self>, mut rng: u64) {
        let max_delay = settings().1;
        loop {
            let op = {
                let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if let Some(op) = q.ops.pop_front() {
                        break op;
                    }
                    if q.closing {
                        return;
                    }
                    q = self.wake.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            if max_delay > 0 {
                let d = splitmix(&mut rng) % (max_delay + 1);
                std::thread::sleep(Duration::from_micros(d));
            }
            match op {
                Op::Run(f) => f(),
                Op::WaitStream(s, n) => s.wait_done(n),
                Op::WaitEvent(ev, target) => ev.wait_completed(target),
            }
            let mut d = self.done.lock().unwrap_or_else(|e| e.into_inner());
            *d += 1;
            self.done_cv.notify_all();
        }
    }

    fn push(&self, op: Op) {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        q.ops.push_back(op);
        // Relaxed: written under the device's enqueue lock, which orders it with readers.
        self.enqueued.fetch_add(1, Ordering::Relaxed);
        self.wake.notify_one();
    }

    fn wait_done(&self, n: u64) {
        let mut d = self.done.lock().unwrap_or_else(|e| e.into_inner());
        while *d < n {
            d = self.done_cv.wait(d).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Block until every op enqueued so far has run.
    pub fn synchronize(&self) {
        // Relaxed: a position read by the thread that enqueued (or after its lock).
        self.wait_done(self.enqueued.load(Ordering::Relaxed));
    }

    /// True if every op enqueued so far has run.
    pub fn idle(&self) -> bool {
        // Relaxed: as in `synchronize`.
        *self.done.lock().unwrap_or_else(|e| e.into_inner()) >= self.enqueued.load(Ordering::Relaxed)
    }

    fn close(&self) {
        self.queue.lock().unwrap_or_else(|e| e.into_inner()).closing = true;
        self.wake.notify_one();
    }
}

fn splitmix(s: &mut u64) -> u64 {
    *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *s;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// (seed, max delay in µs).
fn settings() -> (u64, u64) {
    static S: OnceLock<(u64, u64)> = OnceLock::new();
    *S.get_or_init(|| {
        let seed = std::env::var("SIMCUDA_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
        let delay = std::env::var("SIMCUDA_MAX_DELAY_US").ok().and_then(|v| v.parse().ok()).unwrap_or(200);
        (seed, delay)
    })
}

struct DeviceStreams {
    /// Held while enqueueing, so legacy/blocking positions are read consistently.
    enqueue: Mutex<Vec<Weak<Stream>>>,
    legacy: Arc<Stream>,
}

static SERIAL: AtomicU64 = AtomicU64::new(0);

fn next_serial() -> u64 {
    // Relaxed: a unique counter.
    SERIAL.fetch_add(1, Ordering::Relaxed)
}

fn devices() -> &'static [DeviceStreams] {
    static D: OnceLock<Vec<DeviceStreams>> = OnceLock::new();
    D.get_or_init(|| {
        (0..crate::context::device_count())
            .map(|d| DeviceStreams { enqueue: Mutex::new(Vec::new()), legacy: Stream::spawn(d, true, next_serial()) })
            .collect()
    })
}

fn dev(d: i32) -> &'static DeviceStreams {
    &devices()[d as usize]
}

static HANDLES: Mutex<Option<HashMap<usize, Arc<Stream>>>> = Mutex::new(None);
static NEXT_HANDLE: AtomicU64 = AtomicU64::new(0x5300_0000_1000);

/// `cuStreamCreate` on the current context's device.
pub fn create(flags: u32) -> R<usize> {
    let ctx = crate::context::current()?;
    if flags & !CU_STREAM_NON_BLOCKING != 0 {
        return Err(INVALID_VALUE);
    }
    let blocking = flags & CU_STREAM_NON_BLOCKING == 0;
    let s = Stream::spawn(ctx.device, blocking, next_serial());
    dev(ctx.device).enqueue.lock().unwrap_or_else(|e| e.into_inner()).push(Arc::downgrade(&s));
    // Relaxed: a unique counter.
    let h = NEXT_HANDLE.fetch_add(0x10, Ordering::Relaxed) as usize;
    HANDLES.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(HashMap::new).insert(h, s);
    Ok(h)
}

/// The stream behind a handle: 0, `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD` name the
/// current context's legacy stream; a created stream must belong to the current context's
/// device (else CUDA_ERROR_INVALID_HANDLE, the strict choice). A context must be current.
pub fn resolve(h: usize) -> R<Arc<Stream>> {
    let ctx = crate::context::current()?;
    if h == 0 || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD {
        return Ok(dev(ctx.device).legacy.clone());
    }
    let s = HANDLES.lock().unwrap_or_else(|e| e.into_inner()).as_ref().and_then(|m| m.get(&h).cloned()).ok_or(INVALID_HANDLE)?;
    if s.device != ctx.device {
        return Err(INVALID_HANDLE);
    }
    Ok(s)
}

/// `cuStreamDestroy`: returns at once; queued work still runs, then the worker ends.
pub fn destroy(h: usize) -> R {
    crate::context::current()?;
    let s = HANDLES.lock().unwrap_or_else(|e| e.into_inner()).as_mut().and_then(|m| m.remove(&h)).ok_or(INVALID_HANDLE)?;
    s.close();
    Ok(())
}

pub fn live_streams() -> u64 {
    HANDLES.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map_or(0, |m| m.len() as u64)
}

/// Enqueue `op` on `s` with the legacy stream's implicit ordering.
pub fn enqueue(s: &Arc<Stream>, op: Op) {
    let d = dev(s.device);
    let mut blocking = d.enqueue.lock().unwrap_or_else(|e| e.into_inner());
    if Arc::ptr_eq(s, &d.legacy) {
        blocking.retain(|w| w.strong_count() > 0);
        for b in blocking.iter().filter_map(Weak::upgrade).filter(|b| b.blocking) {
            // Relaxed: written under this lock.
            let n = b.enqueued.load(Ordering::Relaxed);
            if n > 0 {
                s.push(Op::WaitStream(b, n));
            }
        }
    } else if s.blocking {
        // Relaxed: written under this lock.
        let n = d.legacy.enqueued.load(Ordering::Relaxed);
        if n > 0 {
            s.push(Op::WaitStream(d.legacy.clone(), n));
        }
    }
    s.push(op);
}

/// Wait (at most until `end`) for every op queued so far on every stream of this process;
/// false if some stream had not finished by then.
fn drain_until(end: std::time::Instant) -> bool {
    let mut all: Vec<Arc<Stream>> = HANDLES.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map_or_else(Vec::new, |m| m.values().cloned().collect());
    for d in devices() {
        all.push(d.legacy.clone());
        all.extend(d.enqueue.lock().unwrap_or_else(|e| e.into_inner()).iter().filter_map(Weak::upgrade));
    }
    all.iter().all(|s| {
        // Relaxed: as in `synchronize`.
        let n = s.enqueued.load(Ordering::Relaxed);
        let mut d = s.done.lock().unwrap_or_else(|e| e.into_inner());
        while *d < n {
            let now = std::time::Instant::now();
            if now >= end {
                return false;
            }
            d = s.done_cv.wait_timeout(d, end - now).unwrap_or_else(|e| e.into_inner()).0;
        }
        true
    })
}

/// At a normal exit, work the process queued still runs, as on a real driver (a child
/// that queued a copy into its parent's memory and exited: the parent sees the bytes).
/// Bounded: a stream waiting on what never comes (a dead peer's event) must not hold the
/// exit for good. A SIGKILLed process's queued work is lost, as on hardware.
extern "C" fn drain_at_exit() {
    if !drain_until(std::time::Instant::now() + Duration::from_secs(10)) {
        eprintln!("simcuda: a stream still had queued work 10 s after exit began; exiting without it");
    }
}

/// Register [`drain_at_exit`] (once, at `cuInit`).
pub fn drain_on_exit() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a plain `extern "C" fn()` that lives as long as the library
        // (simcuda is never unloaded: cudarc keeps it loaded for the process's life).
        unsafe { libc::atexit(drain_at_exit) };
    });
}

/// `cuCtxSynchronize`: every stream of the current context's device.
pub fn synchronize_device() -> R {
    let ctx = crate::context::current()?;
    let d = dev(ctx.device);
    let streams: Vec<Arc<Stream>> =
        d.enqueue.lock().unwrap_or_else(|e| e.into_inner()).iter().filter_map(Weak::upgrade).collect();
    d.legacy.synchronize();
    for s in streams {
        s.synchronize();
    }
    Ok(())
}
