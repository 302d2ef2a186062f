//! Streams: each runs its work in order on its own worker thread, each op after a seeded
//! random delay (`SIMCUDA_SEED`, `SIMCUDA_MAX_DELAY_US`), so work that is not ordered by a
//! stream or an event overlaps in ways a test notices.
//!
//! The legacy default stream (handle 0 or `CU_STREAM_LEGACY`) of each device orders with
//! that device's blocking streams as the driver documents: work on it waits for all work
//! enqueued before on blocking streams, and work enqueued on a blocking stream waits for
//! the legacy stream's earlier work. Streams created `CU_STREAM_NON_BLOCKING` do neither.
//!
//! A normal exit (`exit`, a return from `main`) first lets every stream of the process
//! finish its queued work, as the driver does (a copy queued before `exit(0)` lands): see
//! [`drain_at_exit`]. A killed process's queued work is lost.

use crate::event_state::EventState;
use crate::result::*;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Once, OnceLock, Weak};
use std::time::{Duration, Instant};

pub const CU_STREAM_LEGACY: usize = 1;
pub const CU_STREAM_PER_THREAD: usize = 2;
pub const CU_STREAM_NON_BLOCKING: u32 = 1;

pub enum Op {
    Run(Box<dyn FnOnce() + Send>),
    /// Engine work (a copy, a memset): what a context switch between processes is paid
    /// for (`timeslice`).
    Work(Box<dyn FnOnce() + Send>),
    /// Wait until `stream` completed its first `n` ops.
    WaitStream(Arc<Stream>, u64),
    /// Wait until `event` completed record number `target` (0: nothing to wait for), then
    /// sleep for the duration (the cross-process cost model; usually zero).
    WaitEvent(Arc<EventState>, u64, Duration),
}

/// What a stream's worker is blocked on while it runs a wait op.
enum Blocked {
    Stream(Arc<Stream>),
    Event(Arc<EventState>, u64),
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
    serial: u64,
    /// The process whose thread works this stream (a child forked without exec has the
    /// stream's state but no worker).
    owner: u32,
    /// The wait the worker is blocked in, if any (read by the exit drain).
    blocked: Mutex<Option<Blocked>>,
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
            serial,
            owner: std::process::id(),
            blocked: Mutex::new(None),
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
                Op::Work(f) => {
                    crate::timeslice::take_turn();
                    f()
                }
                Op::WaitStream(s, n) => {
                    self.set_blocked(Some(Blocked::Stream(s.clone())));
                    s.wait_done(n);
                    self.set_blocked(None);
                }
                Op::WaitEvent(ev, target, then) => {
                    self.set_blocked(Some(Blocked::Event(ev.clone(), target)));
                    ev.wait_completed(target);
                    self.set_blocked(None);
                    if !then.is_zero() {
                        std::thread::sleep(then);
                    }
                }
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

    fn set_blocked(&self, b: Option<Blocked>) {
        *self.blocked.lock().unwrap_or_else(|e| e.into_inner()) = b;
    }

    fn wait_done(&self, n: u64) {
        let mut d = self.done.lock().unwrap_or_else(|e| e.into_inner());
        while *d < n {
            d = self.done_cv.wait(d).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Wait up to `limit` for the first `n` ops to complete; true if they did.
    fn wait_done_for(&self, n: u64, limit: Duration) -> bool {
        let d = self.done.lock().unwrap_or_else(|e| e.into_inner());
        let (d, _) = self.done_cv.wait_timeout_while(d, limit, |d| *d < n).unwrap_or_else(|e| e.into_inner());
        *d >= n
    }

    /// True if the worker is blocked in a wait that can never end: on an event whose
    /// recording process is gone, or on a stream that is itself so blocked.
    fn stuck(&self, depth: u32) -> bool {
        match &*self.blocked.lock().unwrap_or_else(|e| e.into_inner()) {
            None => false,
            Some(Blocked::Event(ev, target)) => ev.orphaned(*target),
            Some(Blocked::Stream(s)) => depth < 8 && s.stuck(depth + 1),
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

static DEVICES: OnceLock<Vec<DeviceStreams>> = OnceLock::new();

fn devices() -> &'static [DeviceStreams] {
    DEVICES.get_or_init(|| {
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

/// At a normal exit, wait up to `limit` for the work queued on every stream this process
/// works (legacy, created, destroyed but not yet finished): on hardware a copy queued
/// before `exit(0)` lands. A stream blocked in a wait that can never end (an event whose
/// recording process is gone) or still busy at the limit is reported on stderr and left.
pub fn drain_at_exit(limit: Duration) {
    let Some(devs) = DEVICES.get() else { return };
    let me = std::process::id();
    let deadline = Instant::now() + limit;
    let mut streams = Vec::new();
    for d in devs {
        streams.push(d.legacy.clone());
        streams.extend(d.enqueue.lock().unwrap_or_else(|e| e.into_inner()).iter().filter_map(Weak::upgrade));
    }
    let mut left = Vec::new();
    for s in streams.iter().filter(|s| s.owner == me) {
        loop {
            if s.idle() {
                break;
            }
            if s.stuck(0) {
                left.push(format!("stream {} (waits on an event whose recording process is gone)", s.serial));
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                left.push(format!("stream {} (still busy after {limit:?})", s.serial));
                break;
            }
            // Relaxed: a position; a stale one only ends this 20 ms wait early or late, and
            // `idle` reads it again on the next round.
            s.wait_done_for(s.enqueued.load(Ordering::Relaxed), (deadline - now).min(Duration::from_millis(20)));
        }
    }
    if !left.is_empty() {
        eprintln!("simcuda: at exit, queued work left unfinished on {}", left.join(", "));
    }
}

extern "C" fn drain_at_exit_hook() {
    let _ = std::panic::catch_unwind(|| drain_at_exit(crate::settings::get().exit_drain));
}

/// Register [`drain_at_exit`] to run at a normal exit (once per process; `cuInit` calls it).
pub fn install_exit_drain() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a function of this library that never unwinds; the library is
        // never unloaded before exit (cudarc keeps it loaded; glibc runs a shared object's
        // atexit handlers at its unload anyway).
        if unsafe { libc::atexit(drain_at_exit_hook) } != 0 {
            eprintln!("simcuda: atexit failed; work queued at exit may be lost");
        }
    });
}
