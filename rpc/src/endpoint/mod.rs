//! The endpoint: one full-duplex connection speaking the pyisolate protocol.
//!
//! Threads: one reader thread per connection reads frames, matches responses to pending
//! calls by `call_id`, and dispatches requests — inline handlers on itself, a sync
//! handler on itself too when nothing else it read waits behind the request (a standby
//! thread watches the socket meanwhile: `standby`), the rest on an elastic worker pool
//! (grows when every worker is busy, e.g. blocked in a nested call, up to `max_workers`,
//! which also counts the reader thread's sync handler; beyond that requests are answered
//! "busy"). A waiting caller that
//! reads an inline handler's request hands it to the pool too, or, when every worker is
//! occupied, to the connection's inline lane (`lane`) rather than answer it "busy" for
//! want of a worker it does not need (up to the lane's bounds).
//!
//! Reading is leader/follower: the read side of the socket (the `reader` lock) belongs to
//! whoever holds it. A caller waiting for a response takes it if it is free and reads the
//! socket itself — its own response then needs no thread hand-off — dispatching every
//! other frame on the way (responses to their waiters, requests to the pool). A caller
//! that finds it taken follows: a short spin, then a wait on its call's reply channel and
//! the baton, until its response, its timeout, a cancel, the connection's end, or the lead
//! is offered to it (whoever stops reading — a leader stepping down, the reader thread
//! turning to a request or stepping back — leaves the baton, which wakes one follower).
//! The reader thread watches the socket without holding the lock, so a caller can always
//! take it; while callers keep leading it steps back (for [`RpcConfig::reader_yield`] at a
//! time) instead of waking for every frame they read.
//! Any thread that waits — the reader thread inside an inline handler, a worker inside a
//! sync handler — can lead, so re-entrant calls never deadlock. On peer death every
//! pending call fails with `PeerGone`.
//!
//! Ids: each side numbers its own requests from 0; responses carry the request's id; the
//! two directions never mix. `parent_call_id` is set automatically on calls made while a
//! handler of this endpoint runs on the current thread.
//!
//! Cancellation and timeouts are local (the protocol has no cancel message): the caller
//! stops waiting and a late response is dropped (counted in [`Stats::late_responses`]).
//!
//! Files: this one holds `Endpoint`, its shared state (`Inner`: the connection and one
//! part per concern, each part defined in the file that changes it and reached by others
//! through its methods), constructors and shutdown; `calls` (`Calls`: pending calls,
//! starting a call), `reading` (`Reading`: reader thread, leader/follower waits, frame
//! reads), `dispatch` (`Handlers`: incoming requests, responses), `closing` (`Closing`:
//! open or closed, and why), `pool` (worker pool), `lane` (inline requests the pool had
//! no worker for), `standby` (sync handlers on the reader thread, and who reads
//! meanwhile), `service` (what an endpoint serves, and a handler's context), `wire`
//! (`Writer`: frame writes, message and tensor encoding), `native` (`Native`: native
//! tensors), `ucx` (`Remote`: remote tensors over TCP, feature `ucx`).

mod calls;
mod closing;
mod dispatch;
mod lane;
mod native;
mod pool;
mod reading;
mod service;
mod spin;
mod standby;
#[cfg(feature = "ucx")]
mod ucx;
mod wire;

pub use calls::{Canceller, PendingCall};
pub use service::{Args, AsyncHandler, CallCtx, Handler, Registry, Responder, Service, SyncHandler};
use lane::Lane;
use pool::Pool;
use standby::Standby;
use reading::reader_loop;
pub use crate::config::RpcConfig;
use crate::error::{Result, RpcError};
use crate::value::{Map, Value};
use crate::message::Message;
use crate::stream::Stream;
use parking_lot::{Condvar, Mutex};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;
use tensorwire::Wait;

/// Reserved object id for tensorwire's own negotiation (native tensors).
pub const CONTROL_OBJECT_ID: &str = "__tensorwire__";

/// Options of one call.
#[derive(Debug, Clone, Default)]
pub struct CallOptions {
    /// How long to wait for the response (`None`: `RpcConfig::default_timeout`).
    pub timeout: Option<Wait>,
    /// `parent_call_id` to send; `None`: the request this thread is handling, if any.
    pub parent_call_id: Option<i64>,
}

/// Counters.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    pub calls_sent: u64,
    pub requests_handled: u64,
    /// Responses to calls that had already timed out or been cancelled.
    pub late_responses: u64,
}

/// State shared by an endpoint's handles, its reader thread, workers and pending calls:
/// the connection, and one part per concern, each defined and changed in its own file.
pub(crate) struct Inner {
    cfg: RpcConfig,
    id: u64,
    /// The connection's one socket (one fd): written by `wire`, read by whoever leads in
    /// `reading`, polled by the reader thread and the standby.
    sock: Stream,
    is_unix: bool,
    /// Frame writes, tensor tags, kept file-system tensors (`wire`).
    wire: wire::Writer,
    /// The read side: leader/follower, the reader thread's pacing, fds received (`reading`).
    reading: reading::Reading,
    /// Our calls waiting for a response, their ids and counters (`calls`).
    calls: calls::Calls,
    /// What this endpoint serves, its callbacks and the requests handled (`dispatch`).
    handlers: dispatch::Handlers,
    /// Open or closed, and why (`closing`).
    closing: closing::Closing,
    /// The elastic worker pool (`pool`).
    pool: Pool,
    /// Inline requests the pool had no worker for (see `lane`).
    lane: Lane,
    /// Watches the socket while the reader thread runs a sync handler (see `standby`).
    standby: Standby,
    /// Native tensors: negotiation and set-up (`native`).
    native: native::Native,
    /// Remote tensors (TCP, feature `ucx`), once negotiated (`ucx`).
    #[cfg(feature = "ucx")]
    remote: ucx::Remote,
}

static ENDPOINT_IDS: AtomicU64 = AtomicU64::new(1);

/// A handle to a connection. Cloning is cheap; the connection closes when the last
/// handle is dropped (or on [`Endpoint::close`]).
#[derive(Clone)]
pub struct Endpoint {
    inner: Arc<Inner>,
    /// `None` for the endpoint handed to handlers: it does not keep the connection open.
    keep: Option<Arc<Handle>>,
}

struct Handle {
    inner: Arc<Inner>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.inner.shutdown_now(RpcError::PeerGone("the endpoint was dropped".into()));
    }
}

impl Endpoint {
    /// Start an endpoint on `stream`, serving `registry`.
    pub fn new(stream: Stream, registry: Registry, cfg: RpcConfig) -> Result<Endpoint> {
        Endpoint::start(stream, registry, cfg, None)
    }

    /// A connection a [`crate::Server`] accepted: closed if no complete message arrives
    /// within `RpcConfig::first_message_timeout`.
    pub(crate) fn accepted(stream: Stream, registry: Registry, cfg: RpcConfig) -> Result<Endpoint> {
        // A timeout too large for an `Instant` is no limit at all.
        let by = cfg.first_message_timeout.and_then(|t| Instant::now().checked_add(t));
        Endpoint::start(stream, registry, cfg, by)
    }

    fn start(stream: Stream, registry: Registry, cfg: RpcConfig, first_message_by: Option<Instant>) -> Result<Endpoint> {
        stream.set_write_timeout(Some(cfg.send_timeout))?;
        let is_unix = stream.is_unix();
        let inner = Arc::new(Inner {
            id: ENDPOINT_IDS.fetch_add(1, Ordering::Relaxed),
            sock: stream,
            is_unix,
            wire: wire::Writer::new(),
            reading: reading::Reading::new(cfg.max_frame, first_message_by),
            calls: calls::Calls::new(),
            handlers: dispatch::Handlers::new(registry),
            closing: closing::Closing::new(),
            pool: Pool::new(),
            lane: Lane::new(),
            standby: Standby::new(),
            native: native::Native::new(),
            #[cfg(feature = "ucx")]
            remote: ucx::Remote::new(),
            cfg,
        });
        let weak = Arc::downgrade(&inner);
        std::thread::Builder::new()
            .name("tensorwire-rpc-reader".into())
            .spawn(move || reader_loop(weak))
            .map_err(|e| RpcError::io("spawning the reader thread", e))?;
        Ok(Endpoint { keep: Some(Arc::new(Handle { inner: inner.clone() })), inner })
    }

    /// Connect to a Unix socket path (or `tcp://host:port`).
    pub fn connect(addr: &str, registry: Registry, cfg: RpcConfig) -> Result<Endpoint> {
        Endpoint::new(Stream::connect(addr)?, registry, cfg)
    }

    /// Connect to the address in `$PYISOLATE_UDS_ADDRESS` (as a pyisolate child does).
    pub fn connect_env(registry: Registry, cfg: RpcConfig) -> Result<Endpoint> {
        let addr = std::env::var("PYISOLATE_UDS_ADDRESS")
            .map_err(|_| RpcError::InvalidArgument("PYISOLATE_UDS_ADDRESS is not set".into()))?;
        Endpoint::connect(&addr, registry, cfg)
    }

    /// From an inherited Unix stream socket fd (one end of a socketpair).
    pub fn from_fd(fd: OwnedFd, registry: Registry, cfg: RpcConfig) -> Result<Endpoint> {
        Endpoint::new(Stream::from_fd(fd), registry, cfg)
    }

    /// Two connected endpoints in this process.
    pub fn pair(a: Registry, b: Registry, cfg: RpcConfig) -> Result<(Endpoint, Endpoint)> {
        let (x, y) = Stream::pair()?;
        Ok((Endpoint::new(x, a, cfg.clone())?, Endpoint::new(y, b, cfg)?))
    }

    fn inner(&self) -> &Arc<Inner> {
        &self.inner
    }

    /// Whether this handle keeps the connection open (false for handler contexts).
    pub fn is_owner(&self) -> bool {
        self.keep.is_some()
    }

    pub fn registry(&self) -> &Registry {
        self.inner().handlers.registry()
    }

    /// Call `object_id.method(*args, **kwargs)` on the peer and wait.
    pub fn call(&self, object_id: &str, method: &str, args: Vec<Value>) -> Result<Value> {
        self.call_with(object_id, method, args, Map::new(), CallOptions::default())
    }

    pub fn call_with(&self, object_id: &str, method: &str, args: Vec<Value>, kwargs: Map, opts: CallOptions) -> Result<Value> {
        self.start_call(object_id, method, args, kwargs, opts)?.wait()
    }

    /// Send a call and return at once.
    pub fn start_call(&self, object_id: &str, method: &str, args: Vec<Value>, kwargs: Map, opts: CallOptions) -> Result<PendingCall> {
        let what = format!("the response to {object_id}.{method}()");
        self.inner().start(opts, what, |call_id, parent_call_id| Message::Call {
            object_id: object_id.to_owned(),
            call_id,
            parent_call_id,
            method: method.to_owned(),
            args,
            kwargs,
        })
    }

    /// Invoke a peer's callable (by its callback id) and return at once.
    pub fn start_callback(&self, callback_id: &str, args: Vec<Value>, kwargs: Map, opts: CallOptions) -> Result<PendingCall> {
        let what = format!("the response to callback {callback_id}");
        self.inner().start(opts, what, |call_id, parent_call_id| Message::Callback {
            callback_id: callback_id.to_owned(),
            call_id,
            parent_call_id,
            args,
            kwargs,
        })
    }

    /// Invoke a callable value the peer sent (`__pyisolate_callable__`) and wait.
    pub fn invoke(&self, callable: &Value, args: Vec<Value>) -> Result<Value> {
        let id = crate::tagged::as_callback_id(callable)?;
        self.start_callback(id, args, Map::new(), CallOptions::default())?.wait()
    }

    /// Register `f` as a callback and return the callable value to pass to the peer,
    /// which can then invoke it with `kind: "callback"`. It stays registered until
    /// [`Endpoint::unregister_callback`] or the connection ends.
    pub fn register_callback(&self, name: &str, f: impl Fn(&CallCtx, Args) -> Result<Value> + Send + Sync + 'static) -> Result<Value> {
        let mut rnd = [0u8; 16];
        tensorwire::os::getrandom(&mut rnd)?;
        let h = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        let id = format!("{}-{}-{}-{}-{}", h(&rnd[..4]), h(&rnd[4..6]), h(&rnd[6..8]), h(&rnd[8..10]), h(&rnd[10..]));
        self.inner().handlers.add_callback(id.clone(), Arc::new(f));
        Ok(crate::tagged::callable(&id, name))
    }

    pub fn unregister_callback(&self, callable: &Value) -> bool {
        match crate::tagged::as_callback_id(callable) {
            Ok(id) => self.inner().handlers.remove_callback(id),
            Err(_) => false,
        }
    }

    /// Send the `null` close frame, wait as `wait` says (a `Duration`, an `Instant`,
    /// `Wait::Forever`, `Wait::Never`) for the peer to answer or hang up, then close.
    pub fn close(&self, wait: impl Into<Wait>) {
        let inner = self.inner();
        if !inner.is_closed() && inner.closing.take_close_frame() {
            let _ = inner.write_frame(b"null");
        }
        inner.closing.wait_until(calls::deadline_of(wait.into()).0);
        inner.shutdown_now(RpcError::PeerGone("the connection was closed".into()));
    }

    /// Block until the connection ends; returns why.
    pub fn wait_closed(&self) -> RpcError {
        self.inner().closing.wait()
    }

    pub fn is_closed(&self) -> bool {
        self.inner().is_closed()
    }

    /// Why the connection ended, if it has.
    pub fn close_reason(&self) -> Option<RpcError> {
        self.inner().closing.reason()
    }

    pub fn stats(&self) -> Stats {
        let i = self.inner();
        Stats {
            calls_sent: i.calls.sent(),
            requests_handled: i.handlers.handled(),
            late_responses: i.calls.late(),
        }
    }

    /// Calls waiting for a response.
    pub fn pending_calls(&self) -> usize {
        self.inner().calls.len()
    }

    pub(crate) fn send_response(&self, call_id: i64, r: Result<Value>) {
        self.inner().respond(call_id, r);
    }
}

impl Inner {
    fn is_closed(&self) -> bool {
        self.closing.is_closed()
    }

    /// `slot`'s value once a negotiation sets it (and notifies `set`), waiting until
    /// `deadline` (`None`: no limit) or the connection's end.
    fn wait_set<T: Clone>(&self, slot: &Mutex<Option<T>>, set: &Condvar, deadline: Option<Instant>) -> Option<T> {
        let mut g = slot.lock();
        while g.is_none() && !self.is_closed() {
            match deadline {
                Some(d) => {
                    if set.wait_until(&mut g, d).timed_out() {
                        break;
                    }
                }
                None => set.wait(&mut g),
            }
        }
        g.clone()
    }

    /// Close because the peer broke the protocol: record why first, then tell the peer
    /// (best effort; it may not read), then close. In this order a peer that hangs up as
    /// soon as it reads the notice cannot make its hang-up the reason our calls fail with.
    fn hang_up(&self, reason: RpcError) {
        self.closing.record(&reason);
        let _ = self.write_frame(&crate::message::connection_notice(&reason.to_string()));
        self.shutdown_now(reason);
    }

    /// Close now: fail every pending call with the first reason recorded (`reason` if
    /// none was), stop workers, shut the socket.
    fn shutdown_now(&self, reason: RpcError) {
        let Some(reason) = self.closing.finish(reason) else {
            return;
        };
        for s in self.calls.drain() {
            s.complete(Err(reason.clone()));
        }
        self.pool.stop();
        self.lane.stop();
        self.sock.shutdown();
        self.wake_standby();
        self.handlers.clear_callbacks();
        self.wire.shut();
        self.reading.shut();
        self.native.shut();
        #[cfg(feature = "ucx")]
        self.remote.shut();
    }
}

/// How long the claims of one frame wait for the native tensors it names (the sender puts
/// them on the transport before the frame, so only a peer that lies waits this long).
const CLAIM_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Until when the native tensors a received frame names are waited for: [`CLAIM_WAIT`]
/// from now for the whole frame, and never past `call`, the deadline of the call of ours
/// whose response it is (a frame naming a tag never sent then fails that call when its
/// own wait would have ended, not later). Here, not in `native`, because the reader and
/// the dispatcher, which `native` itself uses, ask for it.
pub(super) fn claim_deadline(call: Option<Instant>) -> Instant {
    let limit = Instant::now() + CLAIM_WAIT;
    call.map_or(limit, |d| d.min(limit))
}
