//! Incoming requests: which handler runs where (inline, on the pool, in the lane), the
//! thread-local record of the requests a thread is handling (for `parent_call_id`), and
//! responses.

use super::pool::Job;
use super::service::{Args, CallCtx, Handler, Registry, Responder, SyncHandler};
use super::{CONTROL_OBJECT_ID, Endpoint, Inner};
use crate::error::{Result, RpcError};
use crate::message::Message;
use crate::value::{Map, Value};
use parking_lot::Mutex;
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// What this endpoint serves: its registry, the callbacks it registered for the peer,
/// and the count of requests handled.
pub(super) struct Handlers {
    registry: Registry,
    callbacks: Mutex<HashMap<String, SyncHandler>>,
    /// Requests dispatched (`Stats::requests_handled`).
    handled: AtomicU64,
}

impl Handlers {
    pub(super) fn new(registry: Registry) -> Handlers {
        Handlers { registry, callbacks: Mutex::new(HashMap::new()), handled: AtomicU64::new(0) }
    }

    pub(super) fn registry(&self) -> &Registry {
        &self.registry
    }

    pub(super) fn add_callback(&self, id: String, f: SyncHandler) {
        self.callbacks.lock().insert(id, f);
    }

    /// Whether `id` was registered.
    pub(super) fn remove_callback(&self, id: &str) -> bool {
        self.callbacks.lock().remove(id).is_some()
    }

    /// At the connection's end: drop every callback (and what it holds).
    pub(super) fn clear_callbacks(&self) {
        self.callbacks.lock().clear();
    }

    pub(super) fn handled(&self) -> u64 {
        self.handled.load(Ordering::Relaxed)
    }
}

thread_local! {
    /// (endpoint id, call id) of the requests this thread is handling, innermost last.
    pub(super) static HANDLING: RefCell<Vec<(u64, i64)>> = const { RefCell::new(Vec::new()) };
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

impl Inner {
    pub(super) fn respond(&self, call_id: i64, r: Result<Value>) {
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

    /// Run the handler of `req`: an inline one here if `on_reader_thread`, else (and
    /// every other kind) on the pool — an inline one the pool cannot take waits in the
    /// lane instead of being answered "server busy" (see `lane`). A sync one runs here
    /// too when `may_hold` (the reader thread, nothing read after it) and the standby
    /// takes the socket meanwhile (see `standby`).
    pub(super) fn dispatch(self: &Arc<Self>, req: Request, on_reader_thread: bool, may_hold: bool) {
        self.handlers.handled.fetch_add(1, Ordering::Relaxed);
        let Request { call_id, parent_call_id, target, method, args, kwargs, callback, frame_len, mut att } = req;
        // Arguments that came as JSON text (`RpcConfig::json_text`) are parsed into the
        // tree here unless the handler reads text.
        let limits = self.cfg.json_limits();
        let tree = |args: Vec<Value>, kwargs: Map| -> Result<(Vec<Value>, Map)> {
            let args = args.into_iter().map(|v| v.into_tree(limits)).collect::<Result<Vec<_>>>()?;
            let kwargs = kwargs.into_iter().map(|(k, v)| Ok((k, v.into_tree(limits)?))).collect::<Result<Map>>()?;
            Ok((args, kwargs))
        };
        if !callback && target == CONTROL_OBJECT_ID {
            let r = tree(args, kwargs).and_then(|(args, kwargs)| self.control(&method, &args, &kwargs));
            self.respond(call_id, r);
            return;
        }
        let (handler, text) = if callback {
            match self.handlers.callbacks.lock().get(&target) {
                Some(h) => (Handler::Sync(h.clone()), false),
                None => return self.respond(call_id, Err(RpcError::NotFound(format!("Callback ID {target} not found")))),
            }
        } else {
            let Some(svc) = self.handlers.registry.get(&target) else {
                return self.respond(call_id, Err(RpcError::NotFound(format!("Object ID {target} not registered"))));
            };
            match svc.handler(&method) {
                Some(h) => (h.clone(), svc.takes_json_text()),
                None => {
                    return self.respond(
                        call_id,
                        Err(RpcError::NotFound(format!("'{}' object has no attribute '{method}'", svc.type_name()))),
                    );
                }
            }
        };
        let (args, kwargs) = if text || !self.cfg.json_text {
            (args, kwargs)
        } else {
            match tree(args, kwargs) {
                Ok(a) => a,
                Err(e) => return self.respond(call_id, Err(e)),
            }
        };
        // Decode tensors in the arguments (file_system refs, native tags).
        let decoded = (|| -> Result<Args> {
            self.check_remote_budget(&args.iter().chain(kwargs.values()).collect::<Vec<_>>())?;
            let by = super::claim_deadline(None);
            let args = args.into_iter().map(|v| self.decode_tensors(v, by, &mut att)).collect::<Result<Vec<_>>>()?;
            let kwargs = kwargs.into_iter().map(|(k, v)| Ok((k, self.decode_tensors(v, by, &mut att)?))).collect::<Result<Map>>()?;
            att.check_all_taken()?;
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
            Handler::Inline(f) if on_reader_thread => {
                let r = {
                    let _g = HandlingGuard::enter(self.id, call_id);
                    f(&ctx, a)
                };
                self.respond(call_id, r);
            }
            Handler::Inline(f) => {
                let job = self.sync_job(f, ctx, a);
                if let Err(job) = self.try_submit(job, call_id) {
                    if self.queue_inline(job, frame_len).is_err() {
                        self.respond(call_id, Err(self.busy()));
                    }
                }
            }
            Handler::Sync(f) if on_reader_thread && may_hold && self.hand_socket_to_standby() => {
                let r = {
                    let _g = HandlingGuard::enter(self.id, call_id);
                    // This thread is the connection's reader: a panicking handler must not
                    // end it.
                    run_caught(|| f(&ctx, a))
                };
                // Answer first, then take the socket back: a response the peer does not
                // read yet may block this write, and the standby keeps reading meanwhile.
                self.respond(call_id, r);
                self.take_socket_from_standby();
            }
            Handler::Sync(f) => self.submit(self.sync_job(f, ctx, a), call_id),
            Handler::Async(f) => {
                let me = self.clone();
                self.submit(Box::new(move || {
                    let call_id = ctx.call_id;
                    let responder = Responder { endpoint: Some(ctx.endpoint.clone()), call_id };
                    let _g = HandlingGuard::enter(me.id, call_id);
                    f(ctx, a, responder);
                }), call_id);
            }
        }
    }

    /// A job that runs a handler and sends its response.
    fn sync_job(self: &Arc<Self>, f: SyncHandler, ctx: CallCtx, a: Args) -> Job {
        let me = self.clone();
        Box::new(move || {
            let call_id = ctx.call_id;
            let r = {
                let _g = HandlingGuard::enter(me.id, call_id);
                run_caught(|| f(&ctx, a))
            };
            me.respond(call_id, r);
        })
    }
}

/// Run a sync handler; a panic in it is its answer (an error), not the end of the thread
/// that ran it — the connection's reader thread, or a pool worker whose caller would
/// otherwise wait for an answer that never comes.
fn run_caught(f: impl FnOnce() -> Result<Value>) -> Result<Value> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| Err(RpcError::Remote("the handler panicked".into())))
}

/// A request read from the peer, on its way to its handler.
pub(super) struct Request {
    pub(super) call_id: i64,
    pub(super) parent_call_id: Option<i64>,
    /// The object id (calls) or callback id (callbacks).
    pub(super) target: String,
    pub(super) method: String,
    pub(super) args: Vec<Value>,
    pub(super) kwargs: Map,
    pub(super) callback: bool,
    /// Bytes of the frame it came in (what counts while it waits in the lane).
    pub(super) frame_len: usize,
    /// The frame's attachments, for its tensors to take.
    pub(super) att: crate::tensor::Attachments,
}
