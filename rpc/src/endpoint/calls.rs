//! Calls this side makes: the per-call slot a response completes, `PendingCall` and its
//! `Canceller`, and starting a call (id, parent id, send).

use super::dispatch::HANDLING;
use super::{CallOptions, Inner};
use crate::error::{Result, RpcError};
use crate::json::Value;
use crate::message::Message;
use parking_lot::{Condvar, Mutex};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

pub(super) struct Slot {
    pub(super) done: AtomicBool,
    pub(super) result: Mutex<Option<Result<Value>>>,
    pub(super) cv: Condvar,
}

impl Slot {
    pub(super) fn new() -> Arc<Slot> {
        Arc::new(Slot { done: AtomicBool::new(false), result: Mutex::new(None), cv: Condvar::new() })
    }
    pub(super) fn complete(&self, r: Result<Value>) {
        let mut g = self.result.lock();
        if g.is_none() && !self.done.load(Ordering::Relaxed) {
            *g = Some(r);
            // Release: pairs with the Acquire load in `wait`, publishing the result.
            self.done.store(true, Ordering::Release);
            self.cv.notify_all();
        }
    }
}

/// A call in flight: wait for it, or cancel it.
pub struct PendingCall {
    pub(super) inner: Arc<Inner>,
    pub(super) id: i64,
    pub(super) slot: Arc<Slot>,
    pub(super) timeout: Option<Duration>,
    pub(super) what: String,
}

/// Cancels one pending call from any thread.
#[derive(Clone)]
pub struct Canceller {
    inner: std::sync::Weak<Inner>,
    id: i64,
    slot: Arc<Slot>,
}

impl Canceller {
    pub fn cancel(&self) {
        if let Some(i) = self.inner.upgrade() {
            i.pending.lock().remove(&self.id);
        }
        self.slot.complete(Err(RpcError::Cancelled));
    }
}

impl PendingCall {
    /// Our id for this request.
    pub fn call_id(&self) -> i64 {
        self.id
    }
    pub fn canceller(&self) -> Canceller {
        Canceller { inner: Arc::downgrade(&self.inner), id: self.id, slot: self.slot.clone() }
    }
    pub fn cancel(self) {
        self.canceller().cancel();
    }
    /// Has the response (or an error) arrived?
    pub fn is_done(&self) -> bool {
        self.slot.done.load(Ordering::Acquire)
    }
    /// Wait with the call's timeout.
    pub fn wait(self) -> Result<Value> {
        let t = self.timeout;
        self.wait_timeout(t)
    }
    /// Wait at most `timeout` (`None`: until the response or the connection ends).
    pub fn wait_timeout(self, timeout: Option<Duration>) -> Result<Value> {
        let deadline = timeout.map(|t| Instant::now() + t);
        self.inner.wait_slot(&self.slot, deadline);
        let taken = self.slot.result.lock().take();
        match taken {
            Some(r) => r,
            None => {
                self.inner.pending.lock().remove(&self.id);
                self.slot.complete(Err(RpcError::Cancelled));
                Err(RpcError::Timeout { what: self.what.clone(), after: timeout.unwrap_or_default() })
            }
        }
    }
}

impl Inner {
    pub(super) fn start(self: &Arc<Self>, opts: CallOptions, what: String, build: impl FnOnce(i64, Option<i64>) -> Message) -> Result<PendingCall> {
        if self.is_closed() {
            return Err(self.close_reason.lock().clone().unwrap_or(RpcError::PeerGone("connection closed".into())));
        }
        let parent = opts.parent_call_id.or_else(|| {
            HANDLING.with(|h| h.borrow().iter().rev().find(|(ep, _)| *ep == self.id).map(|(_, c)| *c))
        });
        let call_id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let msg = build(call_id, parent);
        let payload = self.encode(&msg)?;
        let slot = Slot::new();
        self.pending.lock().insert(call_id, slot.clone());
        self.calls_sent.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.write_frame(&payload) {
            self.pending.lock().remove(&call_id);
            return Err(e);
        }
        // The connection may have closed between the check and the insert: make sure
        // nobody waits on a slot that no one will complete.
        if self.is_closed() {
            if let Some(s) = self.pending.lock().remove(&call_id) {
                s.complete(Err(self.close_reason.lock().clone().unwrap_or(RpcError::PeerGone("connection closed".into()))));
            }
        }
        Ok(PendingCall { inner: self.clone(), id: call_id, slot, timeout: opts.timeout.or(self.cfg.default_timeout), what })
    }
}
