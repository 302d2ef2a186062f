//! The endpoint: one full-duplex connection speaking the pyisolate protocol.
//!
//! Threads: one reader thread per connection reads frames, matches responses to pending
//! calls by `call_id`, and dispatches requests — inline handlers on itself, the rest on an
//! elastic worker pool (grows when every worker is busy, e.g. blocked in a nested call, up
//! to `max_workers`; beyond that requests are answered "busy").
//!
//! Reading is leader/follower: the read side of the socket (the `reader` lock) belongs to
//! whoever holds it. A caller waiting for a response takes it if it is free and reads the
//! socket itself — its own response then needs no thread hand-off — dispatching every
//! other frame on the way (responses to their waiters, requests to the pool). A caller
//! that finds it taken follows: a short spin, then a condvar on its per-call slot, until
//! its response, its timeout, a cancel, the connection's end, or the lead is offered to it
//! (a leader stepping down wakes one follower). The reader thread watches the socket
//! without holding the lock, so a caller can always take it; while callers keep leading it
//! steps back (for [`RpcConfig::reader_yield`] at a time) instead of waking for every frame they read.
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

mod native;

pub use crate::config::RpcConfig;
use crate::error::{Result, RpcError};
use crate::frame::{self, FrameDecoder};
use crate::json::{Map, Value};
use crate::message::Message;
use crate::service::{Args, CallCtx, Handler, Registry, Responder};
use crate::stream::Stream;
use crate::tensor::{FsTensor, Tensor};
use native::NativeState;
use parking_lot::{Condvar, Mutex};
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Reserved object id for tensorwire's own negotiation (native tensors).
pub const CONTROL_OBJECT_ID: &str = "__tensorwire__";

/// Options of one call.
#[derive(Debug, Clone, Default)]
pub struct CallOptions {
    /// Overrides `RpcConfig::default_timeout`.
    pub timeout: Option<Duration>,
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

struct Slot {
    done: AtomicBool,
    result: Mutex<Option<Result<Value>>>,
    cv: Condvar,
}

impl Slot {
    fn new() -> Arc<Slot> {
        Arc::new(Slot { done: AtomicBool::new(false), result: Mutex::new(None), cv: Condvar::new() })
    }
    fn complete(&self, r: Result<Value>) {
        let mut g = self.result.lock();
        if g.is_none() && !self.done.load(Ordering::Relaxed) {
            *g = Some(r);
            // Release: pairs with the Acquire load in `wait`, publishing the result.
            self.done.store(true, Ordering::Release);
            self.cv.notify_all();
        }
    }
}

type Job = Box<dyn FnOnce() + Send>;

struct Pool {
    q: Mutex<PoolState>,
    cv: Condvar,
}

struct PoolState {
    jobs: VecDeque<Job>,
    idle: usize,
    total: usize,
    stop: bool,
}

pub(crate) struct Inner {
    cfg: RpcConfig,
    id: u64,
    registry: Registry,
    /// The connection's one socket (one fd): written under `writer`, read by whoever
    /// holds `reader`, polled by the reader thread holding neither.
    sock: Stream,
    /// Serializes frame writes.
    writer: Mutex<()>,
    /// The read side of the socket: whoever holds this lock reads (the leader).
    reader: Mutex<ReaderState>,
    /// Bumped each time a waiting caller takes the lead.
    lead_epoch: AtomicU64,
    /// Callers waiting for a response while someone else leads (offered the lead in turn).
    followers: Mutex<Vec<Arc<Slot>>>,
    /// The reader thread sleeps here while callers lead.
    idle: Mutex<()>,
    idle_cv: Condvar,
    /// fds that arrived on the socket, waiting for the message that claims them.
    fds: Mutex<VecDeque<OwnedFd>>,
    callbacks: Mutex<HashMap<String, crate::service::SyncHandler>>,
    pending: Mutex<HashMap<i64, Arc<Slot>>>,
    next_id: AtomicI64,
    closed: AtomicBool,
    close_reason: Mutex<Option<RpcError>>,
    closed_cv: Condvar,
    sent_close: AtomicBool,
    pool: Pool,
    busy: AtomicUsize,
    keeper: Mutex<VecDeque<(Instant, Arc<FsTensor>)>>,
    native: Mutex<Option<Arc<NativeState>>>,
    /// Set by the first native negotiation (ours or the peer's): one per connection.
    native_claimed: AtomicBool,
    native_ready: Condvar,
    next_tag: AtomicU64,
    calls_sent: AtomicU64,
    handled: AtomicU64,
    late: AtomicU64,
    is_unix: bool,
}

struct ReaderState {
    decoder: FrameDecoder,
    buf: Vec<u8>,
}

/// Longest a leading caller blocks in `poll` before re-checking its slot (a cancel from
/// another thread is seen within this), and longest a follower sleeps before re-trying the
/// lead (a safety net: a stepping-down leader wakes a follower).
const WAIT_SLICE: Duration = Duration::from_millis(10);

static ENDPOINT_IDS: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// (endpoint id, call id) of the requests this thread is handling, innermost last.
    static HANDLING: RefCell<Vec<(u64, i64)>> = const { RefCell::new(Vec::new()) };
}

struct HandlingGuard;
impl HandlingGuard {
    fn enter(ep: u64, call_id: i64) -> HandlingGuard {
        HANDLING.with(|h| h.borrow_mut().push((ep, call_id)));
        HandlingGuard
    }
}
impl Drop for HandlingGuard {
    fn drop(&mut self) {
        HANDLING.with(|h| h.borrow_mut().pop());
    }
}

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

/// A call in flight: wait for it, or cancel it.
pub struct PendingCall {
    inner: Arc<Inner>,
    id: i64,
    slot: Arc<Slot>,
    timeout: Option<Duration>,
    what: String,
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

impl Endpoint {
    /// Start an endpoint on `stream`, serving `registry`.
    pub fn new(stream: Stream, registry: Registry, cfg: RpcConfig) -> Result<Endpoint> {
        stream.set_write_timeout(Some(cfg.send_timeout))?;
        let is_unix = stream.is_unix();
        let inner = Arc::new(Inner {
            id: ENDPOINT_IDS.fetch_add(1, Ordering::Relaxed),
            registry,
            sock: stream,
            writer: Mutex::new(()),
            reader: Mutex::new(ReaderState {
                decoder: FrameDecoder::new(cfg.max_frame),
                buf: vec![0u8; 64 * 1024],
            }),
            lead_epoch: AtomicU64::new(0),
            followers: Mutex::new(Vec::new()),
            idle: Mutex::new(()),
            idle_cv: Condvar::new(),
            fds: Mutex::new(VecDeque::new()),
            callbacks: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicI64::new(0),
            closed: AtomicBool::new(false),
            close_reason: Mutex::new(None),
            closed_cv: Condvar::new(),
            sent_close: AtomicBool::new(false),
            pool: Pool { q: Mutex::new(PoolState { jobs: VecDeque::new(), idle: 0, total: 0, stop: false }), cv: Condvar::new() },
            busy: AtomicUsize::new(0),
            keeper: Mutex::new(VecDeque::new()),
            native: Mutex::new(None),
            native_claimed: AtomicBool::new(false),
            native_ready: Condvar::new(),
            next_tag: AtomicU64::new(1),
            calls_sent: AtomicU64::new(0),
            handled: AtomicU64::new(0),
            late: AtomicU64::new(0),
            is_unix,
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
        &self.inner().registry
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
        tensorwire::sys::getrandom(&mut rnd)?;
        let h = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        let id = format!("{}-{}-{}-{}-{}", h(&rnd[..4]), h(&rnd[4..6]), h(&rnd[6..8]), h(&rnd[8..10]), h(&rnd[10..]));
        self.inner().callbacks.lock().insert(id.clone(), Arc::new(f));
        Ok(crate::tagged::callable(&id, name))
    }

    pub fn unregister_callback(&self, callable: &Value) -> bool {
        match crate::tagged::as_callback_id(callable) {
            Ok(id) => self.inner().callbacks.lock().remove(id).is_some(),
            Err(_) => false,
        }
    }

    /// Send the `null` close frame, wait (at most `timeout`) for the peer to answer or
    /// hang up, then close.
    pub fn close(&self, timeout: Duration) {
        let inner = self.inner();
        if !inner.closed.load(Ordering::Acquire) && !inner.sent_close.swap(true, Ordering::AcqRel) {
            let _ = inner.write_frame(b"null");
        }
        let deadline = Instant::now() + timeout;
        let mut g = inner.close_reason.lock();
        while g.is_none() {
            if inner.closed_cv.wait_until(&mut g, deadline).timed_out() {
                break;
            }
        }
        drop(g);
        inner.shutdown_now(RpcError::PeerGone("the connection was closed".into()));
    }

    /// Block until the connection ends; returns why.
    pub fn wait_closed(&self) -> RpcError {
        let inner = self.inner();
        let mut g = inner.close_reason.lock();
        loop {
            if let Some(e) = g.as_ref() {
                return e.clone();
            }
            inner.closed_cv.wait(&mut g);
        }
    }

    pub fn is_closed(&self) -> bool {
        self.inner().closed.load(Ordering::Acquire)
    }

    /// Why the connection ended, if it has.
    pub fn close_reason(&self) -> Option<RpcError> {
        self.inner().close_reason.lock().clone()
    }

    pub fn stats(&self) -> Stats {
        let i = self.inner();
        Stats {
            calls_sent: i.calls_sent.load(Ordering::Relaxed),
            requests_handled: i.handled.load(Ordering::Relaxed),
            late_responses: i.late.load(Ordering::Relaxed),
        }
    }

    /// Calls waiting for a response.
    pub fn pending_calls(&self) -> usize {
        self.inner().pending.lock().len()
    }

    pub(crate) fn send_response(&self, call_id: i64, r: Result<Value>) {
        self.inner().respond(call_id, r);
    }
}

fn reader_loop(weak: std::sync::Weak<Inner>) {
    let mut seen_epoch = 0;
    loop {
        let Some(inner) = weak.upgrade() else { return };
        if inner.is_closed() {
            return;
        }
        let epoch = inner.lead_epoch.load(Ordering::Acquire);
        if epoch != seen_epoch && !inner.cfg.reader_yield.is_zero() {
            // Callers have been reading their own responses: stay off the socket a while
            // (they dispatch whatever else arrives) rather than wake for each frame —
            // unless callers are waiting with no one leading for them.
            seen_epoch = epoch;
            if !inner.followers.lock().is_empty() {
                continue;
            }
            let mut g = inner.idle.lock();
            if !inner.is_closed() {
                inner.idle_cv.wait_for(&mut g, inner.cfg.reader_yield);
            }
            continue;
        }
        // Whatever is already there (or buffered in the decoder), without blocking. The
        // lock is only contended while a caller leads; it is handed to us when that
        // caller steps down.
        let r = {
            let mut rs = inner.reader.lock();
            inner.read_frame_locked(&mut rs, Some(Instant::now()))
        };
        match r {
            Ok(Some(f)) => {
                inner.handle_frame(f, true);
                continue;
            }
            Ok(None) => {}
            Err(e) => {
                inner.shutdown_now(e);
                return;
            }
        }
        // Nothing buffered: poll briefly (yielding) before sleeping — a frame that arrives
        // within `spin` then costs no wake-up, which across CPUs is tens of µs on some
        // machines; yielding lets a peer that shares this CPU run meanwhile.
        let until = Instant::now() + inner.cfg.spin;
        let mut arrived = false;
        while Instant::now() < until {
            match tensorwire::sys::poll_events(&[(inner.sock.fd(), libc::POLLIN)], Some(Duration::ZERO)) {
                Ok(r) if r[0] != 0 => {
                    arrived = true;
                    break;
                }
                Ok(_) => std::thread::yield_now(),
                Err(e) => {
                    inner.shutdown_now(e.into());
                    return;
                }
            }
        }
        if arrived {
            continue;
        }
        // Wait for the socket without holding the read side, so that a caller that starts
        // waiting can take it. (EOF and shutdown wake this too.)
        if let Err(e) = tensorwire::sys::poll_events(&[(inner.sock.fd(), libc::POLLIN)], None) {
            inner.shutdown_now(e.into());
            return;
        }
    }
}

impl Inner {
    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Wait until `slot` is done, `deadline` passes, or the connection ends, leading the
    /// read side whenever it is free (see the module docs).
    fn wait_slot(self: &Arc<Self>, slot: &Arc<Slot>, deadline: Option<Instant>) {
        let spin_until = Instant::now() + self.cfg.spin;
        loop {
            if slot.done.load(Ordering::Acquire) || deadline.is_some_and(|d| Instant::now() >= d) {
                return;
            }
            if let Some(rs) = self.reader.try_lock() {
                self.lead(rs, slot, deadline, spin_until);
                return;
            }
            if Instant::now() < spin_until {
                std::thread::yield_now();
                continue;
            }
            self.follow(slot, deadline);
        }
    }

    /// Read and dispatch frames until `slot` is done (or the deadline or the end), then
    /// step down.
    fn lead(self: &Arc<Self>, mut rs: parking_lot::MutexGuard<'_, ReaderState>, slot: &Arc<Slot>, deadline: Option<Instant>, spin_until: Instant) {
        self.lead_epoch.fetch_add(1, Ordering::AcqRel);
        loop {
            if slot.done.load(Ordering::Acquire) {
                break;
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                break;
            }
            // Spin phase: check the socket without sleeping; then sleep in poll, in
            // slices so that a cancel from another thread is noticed.
            let until = if now < spin_until {
                now
            } else {
                let s = now + WAIT_SLICE;
                deadline.map_or(s, |d| d.min(s))
            };
            match self.read_frame_locked(&mut rs, Some(until)) {
                // Responses complete their slots; requests go to the pool (never inline
                // here: this thread must get back to its own caller). Nothing in
                // `handle_frame` takes the `reader` lock.
                Ok(Some(f)) => self.handle_frame(f, false),
                Ok(None) => std::thread::yield_now(),
                Err(e) => {
                    self.shutdown_now(e);
                    break;
                }
            }
        }
        drop(rs);
        // Offer the lead to one follower (it re-checks its slot, then tries the lock).
        // Taking its result lock orders this after its registration check (see `follow`).
        let next = self.followers.lock().first().cloned();
        if let Some(s) = next {
            let _g = s.result.lock();
            s.cv.notify_all();
        }
    }

    /// Someone else leads: sleep until our slot is done, the lead is offered to us, the
    /// deadline, or a slice passes.
    fn follow(&self, slot: &Arc<Slot>, deadline: Option<Instant>) {
        let mut g = slot.result.lock();
        self.followers.lock().push(slot.clone());
        // A leader steps down by unlocking `reader`, then offering (under our result lock,
        // which we hold) to the first follower: if it is already unlocked, retry now;
        // otherwise its offer comes after our wait has begun.
        if g.is_none() && self.reader.is_locked() && !self.is_closed() {
            let s = Instant::now() + WAIT_SLICE;
            let until = deadline.map_or(s, |d| d.min(s));
            let _ = slot.cv.wait_until(&mut g, until);
        }
        drop(g);
        let mut f = self.followers.lock();
        if let Some(i) = f.iter().position(|x| Arc::ptr_eq(x, slot)) {
            f.swap_remove(i);
        }
    }

    /// Next whole frame (owned), reading the socket as needed; the caller holds the read
    /// side. `deadline`: `None` blocks; a passed deadline still checks the socket once.
    /// `Ok(None)` when nothing whole arrived by then.
    fn read_frame_locked(&self, rs: &mut ReaderState, deadline: Option<Instant>) -> Result<Option<Vec<u8>>> {
        loop {
            if let Some(f) = rs.decoder.next_frame_owned()? {
                return Ok(Some(f));
            }
            if self.is_closed() {
                return Err(self.close_reason.lock().clone().unwrap_or(RpcError::PeerGone("connection closed".into())));
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let ready = tensorwire::sys::poll_events(&[(self.sock.fd(), libc::POLLIN)], left)?;
            if ready[0] == 0 {
                if left.is_some() {
                    return Ok(None);
                }
                continue;
            }
            let mut fds = Vec::new();
            let n = self.sock.read_some(&mut rs.buf, &mut fds)?;
            if !fds.is_empty() {
                let mut q = self.fds.lock();
                for fd in fds {
                    // At most a few fds may wait for the message that claims them; more is
                    // abuse and they are closed.
                    if q.len() < 4 {
                        q.push_back(fd);
                    }
                }
            }
            if n == 0 {
                let mid = rs.decoder.buffered();
                return Err(if mid > 0 {
                    RpcError::PeerGone(format!("connection closed by the peer in the middle of a frame ({mid} bytes buffered)"))
                } else {
                    RpcError::PeerGone("connection closed by the peer".into())
                });
            }
            let (buf, dec) = (&rs.buf[..n], &mut rs.decoder);
            dec.push(buf)?;
        }
    }

    fn take_fd(&self) -> Option<OwnedFd> {
        self.fds.lock().pop_front()
    }

    fn write_frame(&self, payload: &[u8]) -> Result<()> {
        if payload.len() > self.cfg.max_frame {
            return Err(RpcError::InvalidArgument(format!(
                "message of {} bytes is over the {}-byte frame cap",
                payload.len(),
                self.cfg.max_frame
            )));
        }
        // A small frame goes in one write; a large one as header + payload (no copy).
        let (head, body) =
            if payload.len() <= 64 * 1024 { (frame::encode_frame(payload)?, &[][..]) } else { (frame::header(payload.len())?.to_vec(), payload) };
        let framed_len = head.len() + body.len();
        let w = self.writer.lock();
        if let Err(e) = self.sock.write_all(&head).and_then(|_| self.sock.write_all(body)) {
            drop(w);
            let err = if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
                RpcError::Protocol(format!(
                    "the peer is not reading: a {}-byte write blocked for {:?} (RpcConfig::send_timeout)",
                    framed_len,
                    self.cfg.send_timeout
                ))
            } else {
                RpcError::io("writing to the peer", e)
            };
            self.shutdown_now(err.clone());
            return Err(err);
        }
        Ok(())
    }

    fn encode(&self, msg: &Message) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(128);
        msg.encode(&mut out, &mut |t| self.encode_tensor(t))?;
        Ok(out)
    }

    fn start(self: &Arc<Self>, opts: CallOptions, what: String, build: impl FnOnce(i64, Option<i64>) -> Message) -> Result<PendingCall> {
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

    fn respond(&self, call_id: i64, r: Result<Value>) {
        let msg = match r {
            Ok(v) => Message::Response { call_id, result: v, error: None },
            Err(e) => Message::Response { call_id, result: Value::Null, error: Some(e.to_string()) },
        };
        let payload = match self.encode(&msg) {
            Ok(p) => p,
            Err(e) => {
                // As pyisolate does: a result that cannot be sent becomes an error.
                let m = Message::Response { call_id, result: Value::Null, error: Some(format!("Response serialization failed: {e}")) };
                match self.encode(&m) {
                    Ok(p) => p,
                    Err(_) => return,
                }
            }
        };
        let payload = if payload.len() > self.cfg.max_frame {
            let m = Message::Response {
                call_id,
                result: Value::Null,
                error: Some(format!("response of {} bytes is over the {}-byte frame cap", payload.len(), self.cfg.max_frame)),
            };
            match self.encode(&m) {
                Ok(p) => p,
                Err(_) => return,
            }
        } else {
            payload
        };
        let _ = self.write_frame(&payload);
    }

    /// Close now: fail every pending call with `reason`, stop workers, shut the socket.
    fn shutdown_now(&self, reason: RpcError) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        {
            let mut g = self.close_reason.lock();
            if g.is_none() {
                *g = Some(reason.clone());
            }
            self.closed_cv.notify_all();
        }
        let pending: Vec<_> = self.pending.lock().drain().map(|(_, s)| s).collect();
        for s in pending {
            s.complete(Err(reason.clone()));
        }
        {
            let mut q = self.pool.q.lock();
            q.stop = true;
            q.jobs.clear();
            self.pool.cv.notify_all();
        }
        self.sock.shutdown();
        self.callbacks.lock().clear();
        self.keeper.lock().clear();
        self.fds.lock().clear();
        {
            let _g = self.idle.lock();
            self.idle_cv.notify_all();
        }
        if let Some(n) = self.native.lock().take() {
            n.wake();
        }
        self.native_ready.notify_all();
    }

    fn handle_frame(self: &Arc<Self>, payload: Vec<u8>, may_inline: bool) {
        let msg = Message::decode_limited(&payload, self.cfg.json_limits());
        drop(payload); // the frame's text is not needed past decoding
        let msg = match msg {
            Ok(m) => m,
            Err(e) => {
                // Tell the peer why before hanging up (best effort; it may not read).
                let _ = self.write_frame(&crate::message::connection_notice(&e.to_string()));
                self.shutdown_now(e);
                return;
            }
        };
        match msg {
            Message::Close => {
                if !self.sent_close.swap(true, Ordering::AcqRel) {
                    let _ = self.write_frame(b"null");
                }
                self.shutdown_now(RpcError::PeerGone("the peer closed the connection".into()));
            }
            Message::Response { call_id: crate::message::NOTICE_CALL_ID, error: Some(e), .. } => {
                self.shutdown_now(RpcError::PeerGone(format!("the peer ended the connection: {e}")));
            }
            Message::Response { call_id, result, error } => {
                let slot = self.pending.lock().remove(&call_id);
                match slot {
                    Some(s) => {
                        let r = match error {
                            Some(e) => Err(RpcError::Remote(e)),
                            None => self.decode_tensors(result),
                        };
                        s.complete(r);
                    }
                    None if call_id < 0 || call_id >= self.next_id.load(Ordering::Relaxed) => {
                        self.shutdown_now(RpcError::Protocol(format!("response to call_id {call_id}, which was never sent")));
                    }
                    None => {
                        self.late.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Message::Call { object_id, call_id, parent_call_id, method, args, kwargs } => {
                self.dispatch(call_id, parent_call_id, object_id, method, args, kwargs, false, may_inline);
            }
            Message::Callback { callback_id, call_id, parent_call_id, args, kwargs } => {
                self.dispatch(call_id, parent_call_id, callback_id, "__call__".into(), args, kwargs, true, may_inline);
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn dispatch(
        self: &Arc<Self>,
        call_id: i64,
        parent_call_id: Option<i64>,
        target: String,
        method: String,
        args: Vec<Value>,
        kwargs: Map,
        callback: bool,
        may_inline: bool,
    ) {
        self.handled.fetch_add(1, Ordering::Relaxed);
        if !callback && target == CONTROL_OBJECT_ID {
            let r = self.control(&method);
            self.respond(call_id, r);
            return;
        }
        let handler = if callback {
            match self.callbacks.lock().get(&target) {
                Some(h) => Handler::Sync(h.clone()),
                None => return self.respond(call_id, Err(RpcError::NotFound(format!("Callback ID {target} not found")))),
            }
        } else {
            let Some(svc) = self.registry.get(&target) else {
                return self.respond(call_id, Err(RpcError::NotFound(format!("Object ID {target} not registered"))));
            };
            match svc.handler(&method) {
                Some(h) => h.clone(),
                None => {
                    return self.respond(
                        call_id,
                        Err(RpcError::NotFound(format!("'{}' object has no attribute '{method}'", svc.type_name()))),
                    );
                }
            }
        };
        // Decode tensors in the arguments (file_system refs, native tags).
        let decoded = (|| -> Result<Args> {
            let args = args.into_iter().map(|v| self.decode_tensors(v)).collect::<Result<Vec<_>>>()?;
            let kwargs = kwargs.into_iter().map(|(k, v)| Ok((k, self.decode_tensors(v)?))).collect::<Result<Map>>()?;
            Ok(Args { args, kwargs })
        })();
        let a = match decoded {
            Ok(a) => a,
            Err(e) => return self.respond(call_id, Err(e)),
        };
        let ctx = CallCtx {
            endpoint: Endpoint { inner: self.clone(), keep: None },
            call_id,
            parent_call_id,
            target,
            method,
        };
        match handler {
            Handler::Inline(f) if may_inline => {
                let r = {
                    let _g = HandlingGuard::enter(self.id, call_id);
                    f(&ctx, a)
                };
                self.respond(call_id, r);
            }
            Handler::Inline(f) | Handler::Sync(f) => {
                let me = self.clone();
                self.submit(Box::new(move || {
                    let r = {
                        let _g = HandlingGuard::enter(me.id, call_id);
                        f(&ctx, a)
                    };
                    me.respond(call_id, r);
                }), call_id);
            }
            Handler::Async(f) => {
                let me = self.clone();
                self.submit(Box::new(move || {
                    let responder = Responder { endpoint: Some(ctx.endpoint.clone()), call_id };
                    let _g = HandlingGuard::enter(me.id, call_id);
                    f(ctx, a, responder);
                }), call_id);
            }
        }
    }

    fn submit(self: &Arc<Self>, job: Job, call_id: i64) {
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

    /// Replace tensor references in a received value by tensors.
    fn decode_tensors(&self, v: Value) -> Result<Value> {
        match v {
            Value::Array(a) => Ok(Value::Array(a.into_iter().map(|x| self.decode_tensors(x)).collect::<Result<_>>()?)),
            Value::Object(m) => match m.get("__type__").and_then(Value::as_str) {
                Some("TensorRef") if self.cfg.accept_fs_tensors && m.get("device").and_then(Value::as_str) == Some("cpu") => {
                    let f = FsTensor::from_tensor_ref(&m)?.with_max_copy(self.cfg.max_tensor_copy);
                    Ok(Value::from(Tensor::File(Arc::new(f))))
                }
                Some("TensorwireTensor") => self.claim_native(&m),
                Some("TensorValue") => Ok(Value::from(crate::tensor::from_tensor_value(&m)?)),
                _ => Ok(Value::Object(m.into_iter().map(|(k, x)| Ok((k, self.decode_tensors(x)?))).collect::<Result<_>>()?)),
            },
            other => Ok(other),
        }
    }

    /// How a tensor goes on the wire.
    fn encode_tensor(&self, t: &Tensor) -> Result<Value> {
        let native = self.native.lock().clone();
        if let Some(device) = t.cuda_device() {
            let Some(n) = native else {
                return Err(RpcError::CudaNotNative(format!(
                    "a {:?} tensor on cuda:{device} travels only as a native tensor; this connection has none (call negotiate_native on a Unix socket first)",
                    t.layout()
                )));
            };
            let Tensor::Cuda(c) = t else {
                return Err(RpcError::InvalidArgument(
                    "a CUDA tensor imported from a peer cannot be sent on: its memory is that peer's allocation opened here; copy it into an allocation of your own and send a Tensor::Cuda".into(),
                ));
            };
            let tag = self.next_tag.fetch_add(1, Ordering::Relaxed);
            c.export(&n.peer, tag)?;
            return Ok(crate::tensor::native_ref(tag, &c.layout(), Some(device)));
        }
        if let Some(n) = native {
            let shared = match t {
                Tensor::Shared(s) => s.clone(),
                other => {
                    let (storage, layout) = other.storage_copy()?;
                    let s = tensorwire::SharedTensor::zeros(tensorwire::Layout::contiguous(tensorwire::DType::UInt8, &[storage.len() as i64])?)?;
                    s.write_storage(0, &storage)?;
                    s.view(layout)?
                }
            };
            let tag = self.next_tag.fetch_add(1, Ordering::Relaxed);
            n.peer.export(&shared, tensorwire::ExportOptions { tag, window: None })?;
            return Ok(crate::tensor::native_ref(tag, shared.layout(), None));
        }
        if !self.is_unix {
            // TCP: the peer may be on another machine; copy the data into the JSON.
            return crate::tensor::to_tensor_value(t);
        }
        let fs = t.to_fs()?;
        let v = fs.to_tensor_ref(self.cfg.fs_strategy);
        let now = Instant::now();
        let mut k = self.keeper.lock();
        while k.front().is_some_and(|(t, _)| now.duration_since(*t) > self.cfg.fs_keep) {
            k.pop_front();
        }
        k.push_back((now, fs));
        Ok(v)
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
