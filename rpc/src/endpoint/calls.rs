//! Calls this side makes: the one-shot reply channel a response completes, `PendingCall`
//! and its `Canceller`, and starting a call (id, parent id, send).

use super::dispatch::HANDLING;
use super::{CallOptions, Inner};
use crate::error::{Result, RpcError};
use crate::value::Value;
use crate::message::Message;
use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tensorwire::Wait;

/// The sending half of a call's reply channel (capacity 1), and the call's deadline as
/// its options set it (`None`: none). The response, a cancel, a timeout or the
/// connection's end completes it; the first completion is the one the caller reads, and
/// any later one is never read (dropped with the channel).
#[derive(Clone)]
pub(super) struct ReplyTx(Sender<Result<Value>>, Option<Instant>);

impl ReplyTx {
    pub(super) fn complete(&self, r: Result<Value>) {
        // Full: completed already. Never blocks.
        let _ = self.0.try_send(r);
    }

    /// When the call's own wait ends: decoding its response (a native tensor it names)
    /// waits no longer than that.
    pub(super) fn deadline(&self) -> Option<Instant> {
        self.1
    }
}

/// Our calls waiting for a response, by id, and the counters of our calls.
pub(super) struct Calls {
    pending: Mutex<HashMap<i64, ReplyTx>>,
    /// The next call id (ids count from 0; never reused on a connection).
    next_id: AtomicI64,
    /// Calls sent (`Stats::calls_sent`).
    sent: AtomicU64,
    /// Responses that came after their call stopped waiting (`Stats::late_responses`).
    late: AtomicU64,
}

impl Calls {
    pub(super) fn new() -> Calls {
        Calls { pending: Mutex::new(HashMap::new()), next_id: AtomicI64::new(0), sent: AtomicU64::new(0), late: AtomicU64::new(0) }
    }

    /// The pending call `id`, no longer pending (`None`: it was not, or is no longer).
    pub(super) fn take(&self, id: i64) -> Option<ReplyTx> {
        self.pending.lock().remove(&id)
    }

    /// Whether `id` is one of ours: a response to any other breaks the protocol.
    pub(super) fn was_sent(&self, id: i64) -> bool {
        id >= 0 && id < self.next_id.load(Ordering::Relaxed)
    }

    /// A response came for a call that no longer waits.
    pub(super) fn count_late(&self) {
        self.late.fetch_add(1, Ordering::Relaxed);
    }

    /// Every pending call, no longer pending (the connection ended).
    pub(super) fn drain(&self) -> Vec<ReplyTx> {
        self.pending.lock().drain().map(|(_, s)| s).collect()
    }

    pub(super) fn len(&self) -> usize {
        self.pending.lock().len()
    }

    pub(super) fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    pub(super) fn late(&self) -> u64 {
        self.late.load(Ordering::Relaxed)
    }
}

/// The receiving half: whoever waits for the call reads it (see `Inner::wait_reply`).
pub(super) type ReplyRx = Receiver<Result<Value>>;

/// A call in flight: wait for it, or cancel it.
pub struct PendingCall {
    pub(super) inner: Arc<Inner>,
    pub(super) id: i64,
    pub(super) reply: ReplyRx,
    /// For cancellers; holding it also keeps the channel connected while we may wait.
    pub(super) complete: ReplyTx,
    /// How long `wait` waits.
    pub(super) timeout: Wait,
    pub(super) what: String,
}

/// Cancels one pending call from any thread.
#[derive(Clone)]
pub struct Canceller {
    inner: std::sync::Weak<Inner>,
    id: i64,
    complete: ReplyTx,
}

impl Canceller {
    pub fn cancel(&self) {
        if let Some(i) = self.inner.upgrade() {
            i.calls.take(self.id);
        }
        self.complete.complete(Err(RpcError::Cancelled));
    }
}

impl PendingCall {
    /// Our id for this request.
    pub fn call_id(&self) -> i64 {
        self.id
    }
    pub fn canceller(&self) -> Canceller {
        Canceller { inner: Arc::downgrade(&self.inner), id: self.id, complete: self.complete.clone() }
    }
    pub fn cancel(self) {
        self.canceller().cancel();
    }
    /// Has the response (or an error) arrived?
    pub fn is_done(&self) -> bool {
        !self.reply.is_empty()
    }
    /// Wait as long as the call's options (or `RpcConfig::default_timeout`) say.
    pub fn wait(self) -> Result<Value> {
        let t = self.timeout;
        self.wait_timeout(t)
    }
    /// Wait as `wait` says: a `Duration` (at most that long), an `Instant` (until then),
    /// `Wait::Forever` or `None` (until the response or the connection's end),
    /// `Wait::Never` (the response if it is in, else `Timeout` at once).
    pub fn wait_timeout(self, wait: impl Into<Wait>) -> Result<Value> {
        let (deadline, asked) = deadline_of(wait.into());
        let limits = self.inner.cfg.json_limits();
        if let Some(r) = self.inner.wait_reply(&self.reply, deadline) {
            return r.and_then(|v| v.into_tree(limits));
        }
        self.expire(asked)
    }
    /// Wait at most `slice` and keep the call when its answer has not come (`None`): for
    /// a caller that must do something between waits — a Python caller checks its
    /// signals — and then waits again, cancels, or gives up with [`expire`](Self::expire).
    /// On an endpoint with `RpcConfig::json_text` the result may be [`Value::Json`] text
    /// (every other wait parses it into the tree).
    pub fn wait_slice(&self, slice: Duration) -> Option<Result<Value>> {
        self.inner.wait_reply(&self.reply, Instant::now().checked_add(slice))
    }
    /// How long [`wait`](Self::wait) waits: the call's options, or the endpoint's default.
    pub fn timeout(&self) -> Wait {
        self.timeout
    }
    /// Give up waiting: `Timeout` (naming `after`, the wait the caller asked for) unless
    /// the answer is in. A later answer is dropped and counted.
    pub fn expire(self, after: Duration) -> Result<Value> {
        // Unless it was completed between the caller's deadline and this removal.
        self.inner.calls.take(self.id);
        let limits = self.inner.cfg.json_limits();
        self.reply.try_recv().unwrap_or_else(|_| Err(RpcError::Timeout { what: self.what.clone(), after })).and_then(|v| v.into_tree(limits))
    }
}

/// The instant a wait that starts now ends (`None`: no limit), and what the caller asked
/// for (for the `Timeout` error). A timeout too long for an `Instant` is no limit.
pub(super) fn deadline_of(wait: Wait) -> (Option<Instant>, Duration) {
    let now = Instant::now();
    match wait {
        Wait::Never => (Some(now), Duration::ZERO),
        Wait::For(d) => (now.checked_add(d), d),
        Wait::Until(t) => (Some(t), t.saturating_duration_since(now)),
        Wait::Forever => (None, Duration::MAX),
    }
}

impl Inner {
    /// A new call id with its reply channel, registered as pending.
    pub(super) fn register_call(self: &Arc<Self>, what: String, timeout: Wait) -> PendingCall {
        let id = self.calls.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, reply) = crossbeam_channel::bounded(1);
        let complete = ReplyTx(tx, deadline_of(timeout).0);
        self.calls.pending.lock().insert(id, complete.clone());
        PendingCall { inner: self.clone(), id, reply, complete, timeout, what }
    }

    pub(super) fn start(self: &Arc<Self>, opts: CallOptions, what: String, build: impl FnOnce(i64, Option<i64>) -> Message) -> Result<PendingCall> {
        if self.is_closed() {
            return Err(self.closed_error());
        }
        let parent = opts.parent_call_id.or_else(|| {
            HANDLING.with(|h| h.borrow().iter().rev().find(|(ep, _)| *ep == self.id).map(|(_, c)| *c))
        });
        let call = self.register_call(what, opts.timeout.unwrap_or(self.cfg.default_timeout));
        let payload = match self.encode(&build(call.id, parent)) {
            Ok(p) => p,
            Err(e) => {
                self.calls.take(call.id);
                return Err(e);
            }
        };
        self.calls.sent.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.write_frame(&payload) {
            self.calls.take(call.id);
            return Err(e);
        }
        // The connection may have closed between the check and the insert: make sure
        // nobody waits on a reply that no one will complete.
        if self.is_closed() {
            if let Some(s) = self.calls.take(call.id) {
                s.complete(Err(self.closed_error()));
            }
        }
        Ok(call)
    }

    /// Why calls fail now that the connection is closed.
    pub(super) fn closed_error(&self) -> RpcError {
        self.closing.error()
    }
}
