//! `WorkerPool`: workers started ahead of need (their start-up — a Python child's imports —
//! paid once), handed out one at a time, taken back only when cleanly finished.

use super::{Worker, WorkerSpec};
use crate::{Result, RpcError};
use parking_lot::{Condvar, Mutex};
use std::ops::Deref;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A pool of `size` warm workers of one spec.
pub struct WorkerPool {
    shared: Arc<Shared>,
}

struct Shared {
    spec: WorkerSpec,
    size: usize,
    state: Mutex<PoolState>,
    changed: Condvar,
}

#[derive(Default)]
struct PoolState {
    idle: Vec<Worker>,
    /// Workers being started in the background.
    warming: usize,
    /// Workers handed out and not yet back.
    out: usize,
    /// Why the last background start failed, if it did.
    failed: Option<String>,
    closed: bool,
}

/// A worker out of the pool; dropping it returns it if it finished cleanly (it runs,
/// nothing in flight, never killed or broken), else ends it and a replacement is warmed.
pub struct PooledWorker {
    worker: Option<Worker>,
    shared: Arc<Shared>,
}

impl WorkerPool {
    /// Start `size` workers (in parallel) and wait until all answered their handshake.
    pub fn new(spec: WorkerSpec, size: usize) -> Result<WorkerPool> {
        let started: Vec<_> = (0..size).map(|_| {
            let spec = spec.clone();
            std::thread::spawn(move || start(&spec))
        }).collect();
        let mut idle = Vec::with_capacity(size);
        let mut first_err = None;
        for t in started {
            match t.join().expect("a worker start-up thread panicked") {
                Ok(w) => idle.push(w),
                Err(e) => first_err = first_err.or(Some(e)),
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        let state = PoolState { idle, ..PoolState::default() };
        Ok(WorkerPool { shared: Arc::new(Shared { spec, size, state: Mutex::new(state), changed: Condvar::new() }) })
    }

    /// A warm worker: an idle one, else the next one to come back or finish its start.
    /// One is started now (cold) only while the pool — idle, starting and handed out — is
    /// below its size. Waits as long as it takes (see [`get_timeout`](Self::get_timeout)).
    /// A worker that does not come back clean is replaced in the background.
    pub fn get(&self) -> Result<PooledWorker> {
        self.get_timeout(None)
    }

    /// [`get`](Self::get), waiting at most `timeout` (`None`: no limit) for a worker
    /// while the pool is at its size; then `Timeout` naming the size.
    pub fn get_timeout(&self, timeout: Option<Duration>) -> Result<PooledWorker> {
        let by = timeout.and_then(|t| Instant::now().checked_add(t));
        loop {
            let slice_end = by.unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
            if let Some(w) = self.try_get(slice_end)? {
                return Ok(w);
            }
            if by.is_some_and(|by| Instant::now() >= by) {
                return Err(self.none_within(timeout.unwrap_or_default()));
            }
        }
    }

    /// [`get`](Self::get), waiting no later than `until` while the pool is at its size:
    /// `Ok(None)` when no worker came by then (a caller that must stay responsive waits
    /// in slices; [`none_within`](Self::none_within) is the error to give up with).
    pub fn try_get(&self, until: Instant) -> Result<Option<PooledWorker>> {
        let mut s = self.shared.state.lock();
        loop {
            if s.closed {
                return Err(RpcError::PeerGone("the worker pool was closed".into()));
            }
            if let Some(w) = s.idle.pop() {
                s.out += 1;
                return Ok(Some(PooledWorker { worker: Some(w), shared: self.shared.clone() }));
            }
            if s.idle.len() + s.warming + s.out < self.shared.size {
                s.out += 1;
                drop(s);
                return match start(&self.shared.spec) {
                    Ok(w) => Ok(Some(PooledWorker { worker: Some(w), shared: self.shared.clone() })),
                    Err(e) => {
                        self.shared.state.lock().out -= 1;
                        self.shared.changed.notify_all();
                        Err(e)
                    }
                };
            }
            if self.shared.changed.wait_until(&mut s, until).timed_out() {
                return Ok(None);
            }
        }
    }

    /// An idle worker, if one is, without waiting or starting one.
    pub fn take_idle(&self) -> Option<PooledWorker> {
        let mut s = self.shared.state.lock();
        let w = s.idle.pop()?;
        s.out += 1;
        Some(PooledWorker { worker: Some(w), shared: self.shared.clone() })
    }

    /// The error of a `get` that found no worker within `after`: every one of the pool's
    /// workers is handed out or starting.
    pub fn none_within(&self, after: Duration) -> RpcError {
        let n = self.shared.size;
        RpcError::Timeout {
            what: format!("a worker from the pool of {n} (all {n} are handed out or starting; release one, or make the pool larger)"),
            after,
        }
    }

    /// How many workers it keeps: idle, starting and handed out together.
    pub fn size(&self) -> usize {
        self.shared.size
    }

    /// Why the last background start of a replacement failed, if one did (the pool then
    /// starts workers when asked, cold).
    pub fn last_start_error(&self) -> Option<String> {
        self.shared.state.lock().failed.clone()
    }

    /// Idle workers now.
    pub fn idle(&self) -> usize {
        self.shared.state.lock().idle.len()
    }

    /// Wait until `n` workers are idle (background starts finished), or `within` passes.
    pub fn wait_idle(&self, n: usize, within: std::time::Duration) -> bool {
        let by = std::time::Instant::now() + within;
        let mut s = self.shared.state.lock();
        while s.idle.len() < n {
            if self.shared.changed.wait_until(&mut s, by).timed_out() {
                return s.idle.len() >= n;
            }
        }
        true
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        let idle = {
            let mut s = self.shared.state.lock();
            s.closed = true;
            std::mem::take(&mut s.idle)
        };
        drop(idle); // each Worker's drop closes and reaps its process
    }
}

impl Shared {
    /// Start one worker in the background if the pool (idle, warming and handed out) is
    /// below its size.
    fn top_up(shared: &Arc<Shared>) {
        {
            let mut s = shared.state.lock();
            if s.closed || s.idle.len() + s.warming + s.out >= shared.size {
                return;
            }
            s.warming += 1;
        }
        let sh = shared.clone();
        let started = std::thread::Builder::new().name("tensorwire-pool-warm".into()).spawn(move || {
            let r = start(&sh.spec);
            let mut s = sh.state.lock();
            s.warming -= 1;
            match r {
                Ok(w) if !s.closed => s.idle.push(w),
                Ok(_) => {}
                Err(e) => s.failed = Some(e.to_string()),
            }
            drop(s);
            sh.changed.notify_all();
        });
        if started.is_err() {
            shared.state.lock().warming -= 1;
            shared.changed.notify_all();
        }
    }
}

/// A worker for the pool: its replacements are the pool's to start.
fn start(spec: &WorkerSpec) -> Result<Worker> {
    let w = spec.spawn()?;
    w.no_background_replacement();
    Ok(w)
}

impl Deref for PooledWorker {
    type Target = Worker;
    fn deref(&self) -> &Worker {
        self.worker.as_ref().expect("present until dropped")
    }
}

impl Drop for PooledWorker {
    fn drop(&mut self) {
        let Some(w) = self.worker.take() else { return };
        let mut s = self.shared.state.lock();
        s.out -= 1;
        if !s.closed && w.is_clean() && s.idle.len() < self.shared.size {
            s.idle.push(w);
            drop(s);
            self.shared.changed.notify_all();
        } else {
            drop(s);
            drop(w); // ends the process
            Shared::top_up(&self.shared);
            // A `get` waiting while the pool was at its size may start one itself now,
            // when the top-up could not.
            self.shared.changed.notify_all();
        }
    }
}
