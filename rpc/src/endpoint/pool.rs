//! The elastic worker pool that runs non-inline handlers: grows while every worker is
//! busy, up to `RpcConfig::max_workers`; idle workers exit after a while.

use super::Inner;
use crate::error::RpcError;
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

type Job = Box<dyn FnOnce() + Send>;

pub(super) struct Pool {
    pub(super) q: Mutex<PoolState>,
    pub(super) cv: Condvar,
}

pub(super) struct PoolState {
    pub(super) jobs: VecDeque<Job>,
    pub(super) idle: usize,
    pub(super) total: usize,
    pub(super) stop: bool,
}

impl Inner {
    pub(super) fn submit(self: &Arc<Self>, job: Job, call_id: i64) {
        let mut q = self.pool.q.lock();
        if q.stop {
            return;
        }
        if q.idle == 0 {
            if q.total >= self.cfg.max_workers {
                drop(q);
                return self.respond(
                    call_id,
                    Err(RpcError::Remote(format!("server busy: all {} workers are occupied", self.cfg.max_workers))),
                );
            }
            q.total += 1;
            q.idle += 1;
            let me = Arc::downgrade(self);
            let spawned = std::thread::Builder::new().name("tensorwire-rpc-worker".into()).spawn(move || worker(me));
            if spawned.is_err() {
                q.total -= 1;
                q.idle -= 1;
                drop(q);
                return self.respond(call_id, Err(RpcError::Remote("server could not start a worker thread".into())));
            }
        }
        q.idle -= 1;
        q.jobs.push_back(job);
        self.busy.fetch_add(1, Ordering::Relaxed);
        self.pool.cv.notify_one();
    }
}

fn worker(weak: std::sync::Weak<Inner>) {
    let idle_limit = Duration::from_secs(10);
    loop {
        let Some(inner) = weak.upgrade() else { return };
        let job = {
            let mut q = inner.pool.q.lock();
            loop {
                if q.stop {
                    q.total -= 1;
                    return;
                }
                if let Some(j) = q.jobs.pop_front() {
                    break j;
                }
                if inner.pool.cv.wait_for(&mut q, idle_limit).timed_out() && q.jobs.is_empty() {
                    q.total -= 1;
                    q.idle -= 1;
                    return;
                }
            }
        };
        drop(inner);
        job();
        let Some(inner) = weak.upgrade() else { return };
        inner.busy.fetch_sub(1, Ordering::Relaxed);
        inner.pool.q.lock().idle += 1;
    }
}
