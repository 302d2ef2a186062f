//! The inline lane: where requests for inline handlers wait when the worker pool is full.
//!
//! Inline handlers run on the reader thread and need no worker. A caller that waits for
//! its response and reads the socket itself (see `reading`) cannot run them — it must get
//! back to its own caller, and it holds the read side — so it hands them to the pool, like
//! the rest. A burst of them beyond `RpcConfig::max_workers` (the peer's many outstanding
//! calls, read while one of our calls waited) was then answered "server busy", though the
//! reader thread would have run them one after another. Now what the pool cannot take
//! queues here, in order, for one thread per connection (started on first use), bounded by
//! [`LANE_REQUESTS`] requests and `RpcConfig::max_frame` bytes of the frames they came in
//! (about what the reader thread holds working through a backlog, however large the
//! requests); past that they are answered "server busy" as before.
//!
//! The lane thread may itself wait for a response (its handler calls the peer). While it
//! waits it runs the lane's next requests too (`Inner::wait_reply`), so inline handlers
//! that call each other back and forth through the lane cannot deadlock on it.

use super::Inner;
use super::pool::Job;
use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;
use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Most requests waiting in the lane.
pub(super) const LANE_REQUESTS: usize = 1024;

thread_local! {
    /// The endpoint whose lane thread this is (0: none; endpoint ids start at 1).
    static LANE_OF: Cell<u64> = const { Cell::new(0) };
}

/// A waiting request: the frame bytes it came in, and the job that runs it.
type Waiting = (usize, Job);

pub(super) struct Lane {
    /// `None` once the connection closed (idle lane thread: it exits).
    tx: Mutex<Option<Sender<Waiting>>>,
    rx: Receiver<Waiting>,
    /// Frame bytes of the requests waiting (at most `max_frame`, or one request).
    bytes: Arc<AtomicUsize>,
    started: AtomicBool,
}

impl Lane {
    pub(super) fn new() -> Lane {
        let (tx, rx) = crossbeam_channel::bounded(LANE_REQUESTS);
        Lane { tx: Mutex::new(Some(tx)), rx, bytes: Arc::new(AtomicUsize::new(0)), started: AtomicBool::new(false) }
    }

    /// Whether requests wait (a waiting caller on the lane thread runs them).
    pub(super) fn has_waiting(&self) -> bool {
        !self.rx.is_empty()
    }

    /// Where requests arrive, for a wait that also wakes for them.
    pub(super) fn arrivals(&self) -> &Receiver<Waiting> {
        &self.rx
    }

    /// No more requests; those waiting are dropped unanswered (the connection is gone),
    /// which also releases the endpoint they hold.
    pub(super) fn stop(&self) {
        self.tx.lock().take();
        while self.rx.try_recv().is_ok() {}
    }
}

impl Inner {
    /// Queue `job` (an inline request the pool had no worker for, from a frame of
    /// `frame_len` bytes). `Err(job)` when the lane is full or its thread cannot start.
    pub(super) fn queue_inline(self: &Arc<Self>, job: Job, frame_len: usize) -> std::result::Result<(), Job> {
        let lane = &self.lane;
        // Relaxed: a count against a limit; the job itself travels through the channel.
        // Only the thread holding the read side queues, so the check and the add do not
        // race with another queueing (taking a job only lowers the count).
        let queued = lane.bytes.load(Ordering::Relaxed);
        if queued > 0 && queued.saturating_add(frame_len) > self.cfg.max_frame {
            return Err(job);
        }
        // Relaxed: only the thread holding the read side gets here (as above); the flag
        // guards nothing but the one spawn.
        if !lane.started.swap(true, Ordering::Relaxed) {
            let (rx, bytes, id) = (lane.rx.clone(), lane.bytes.clone(), self.id);
            let spawned = std::thread::Builder::new().name("tensorwire-rpc-inline".into()).spawn(move || {
                LANE_OF.set(id);
                while let Ok(waiting) = rx.recv() {
                    run(&bytes, waiting);
                }
            });
            if spawned.is_err() {
                lane.started.store(false, Ordering::Relaxed);
                return Err(job);
            }
        }
        let tx = lane.tx.lock();
        let Some(tx) = tx.as_ref() else { return Ok(()) };
        lane.bytes.fetch_add(frame_len, Ordering::Relaxed);
        tx.try_send((frame_len, job)).map_err(|e| {
            lane.bytes.fetch_sub(frame_len, Ordering::Relaxed);
            e.into_inner().1
        })
    }

    /// Whether the current thread is this endpoint's lane thread (which runs the lane's
    /// requests while it waits).
    pub(super) fn on_lane_thread(&self) -> bool {
        LANE_OF.get() == self.id
    }

    /// On the lane thread: run the next waiting request, if any. True if one ran.
    pub(super) fn run_lane_job(&self) -> bool {
        match self.lane.rx.try_recv() {
            Ok(waiting) => {
                run(&self.lane.bytes, waiting);
                true
            }
            Err(_) => false,
        }
    }
}

fn run(bytes: &AtomicUsize, (frame_len, job): Waiting) {
    // Relaxed: as in `queue_inline`.
    bytes.fetch_sub(frame_len, Ordering::Relaxed);
    job();
}
