//! Incoming requests: which handler runs where (inline, on the pool), the thread-local
//! record of the requests a thread is handling (for `parent_call_id`), and responses.

use super::{Endpoint, Inner, CONTROL_OBJECT_ID};
use crate::error::{Result, RpcError};
use crate::value::{Map, Value};
use crate::message::Message;
use super::service::{Args, CallCtx, Handler, Responder};
use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::Ordering;

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

    #[allow(clippy::too_many_arguments)]
    pub(super) fn dispatch(
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
}
