//! `WorkerPool`: workers started ahead of need (their start-up — a Python child's imports —
//! paid once), handed out one at a time, taken back only when cleanly finished.

use super::{Worker, WorkerSpec};
use crate::Result;
use parking_lot::{Condvar, Mutex};
use std::ops::Deref;
use std::sync::Arc;

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
            std::thread::spawn(move || spec.spawn())
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

    /// A warm worker when one is idle; otherwise one started now (cold). A worker that does
    /// not come back clean is replaced in the background.
    pub fn get(&self) -> Result<PooledWorker> {
        let warm = {
            let mut s = self.shared.state.lock();
            s.out += 1;
            s.idle.pop()
        };
        let worker = match warm {
            Some(w) => w,
            None => match self.shared.spec.spawn() {
                Ok(w) => w,
                Err(e) => {
                    self.shared.state.lock().out -= 1;
                    return Err(e);
                }
            },
        };
        Ok(PooledWorker { worker: Some(worker), shared: self.shared.clone() })
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
            let r = sh.spec.spawn();
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
        }
    }
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
        }
    }
}
