//! The elastic worker pool that runs non-inline handlers: a job goes to an idle worker,
//! or to a worker started for it while fewer than `RpcConfig::max_workers` exist; beyond
//! that the request is answered "server busy". Idle workers exit after a while.

use super::Inner;
use crate::error::RpcError;
use crossbeam_channel::{Receiver, Sender, TrySendError};
use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

pub(super) type Job = Box<dyn FnOnce() + Send>;

/// How long an idle worker waits for a job before it exits.
const IDLE_LIMIT: Duration = Duration::from_secs(10);

pub(super) struct Pool {
    /// Hands a job to a worker blocked in `recv`. Capacity zero: a send succeeds only if
    /// a worker is idle, so no job ever waits without a worker of its own (one that
    /// waited behind workers blocked in nested calls could deadlock them). `None` once the
    /// connection closed: dropping the sender ends every idle worker.
    handoff: Mutex<Option<Sender<Job>>>,
    jobs: Receiver<Job>,
    /// Worker threads alive, idle or running a job; at most `max_workers`.
    workers: AtomicUsize,
}

impl Pool {
    pub(super) fn new() -> Pool {
        let (tx, rx) = crossbeam_channel::bounded(0);
        Pool { handoff: Mutex::new(Some(tx)), jobs: rx, workers: AtomicUsize::new(0) }
    }

    /// No more jobs: idle workers exit now, running ones after their job.
    pub(super) fn stop(&self) {
        self.handoff.lock().take();
    }

    /// Count one more worker if under `max` (also the reader thread while it runs a sync
    /// handler itself: see `standby`).
    pub(super) fn reserve(&self, max: usize) -> bool {
        // Relaxed: a count checked against a limit; it publishes no data.
        self.workers.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| (n < max).then_some(n + 1)).is_ok()
    }

    /// Uncount what `reserve` counted.
    pub(super) fn unreserve(&self) {
        // Relaxed: as in `reserve`.
        self.workers.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Inner {
    /// Run `job` (the handler of request `call_id`) on the pool, or answer "server busy".
    pub(super) fn submit(self: &Arc<Self>, job: Job, call_id: i64) {
        if self.try_submit(job, call_id).is_err() {
            self.respond(call_id, Err(self.busy()));
        }
    }

    /// Run `job` on an idle worker, or on one started for it while fewer than
    /// `max_workers` exist; `Err(job)` when every worker is occupied and no more may start.
    pub(super) fn try_submit(self: &Arc<Self>, job: Job, call_id: i64) -> std::result::Result<(), Job> {
        let job = {
            let handoff = self.pool.handoff.lock();
            // Closed: the job is dropped (nobody is there to answer).
            let Some(tx) = handoff.as_ref() else { return Ok(()) };
            match tx.try_send(job) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Full(job)) => job,
                // The pool holds a receiver itself, so this does not happen.
                Err(TrySendError::Disconnected(_)) => return Ok(()),
            }
        };
        // No worker is idle: start one for this job.
        if !self.pool.reserve(self.cfg.max_workers) {
            return Err(job);
        }
        let me = Arc::downgrade(self);
        let jobs = self.pool.jobs.clone();
        let spawned = std::thread::Builder::new().name("tensorwire-rpc-worker".into()).spawn(move || worker(me, jobs, job));
        if spawned.is_err() {
            self.pool.workers.fetch_sub(1, Ordering::Relaxed);
            self.respond(call_id, Err(RpcError::Remote("server could not start a worker thread".into())));
        }
        Ok(())
    }

    /// The answer to a request no worker can take.
    pub(super) fn busy(&self) -> RpcError {
        RpcError::Remote(format!("server busy: all {} workers are occupied", self.cfg.max_workers))
    }
}

/// Run `first`, then whatever is handed over, until idle for `IDLE_LIMIT` or the pool
/// stops. Holds no reference to the endpoint while idle (its jobs hold their own).
fn worker(weak: std::sync::Weak<Inner>, jobs: Receiver<Job>, first: Job) {
    let _count = WorkerCount(weak);
    let mut job = first;
    loop {
        job();
        match jobs.recv_timeout(IDLE_LIMIT) {
            Ok(next) => job = next,
            Err(_) => return,
        }
    }
}

/// Uncounts the worker when it ends, also when a handler panics.
struct WorkerCount(std::sync::Weak<Inner>);

impl Drop for WorkerCount {
    fn drop(&mut self) {
        if let Some(inner) = self.0.upgrade() {
            inner.pool.workers.fetch_sub(1, Ordering::Relaxed);
        }
    }
}
