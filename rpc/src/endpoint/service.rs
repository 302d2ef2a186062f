//! Services: objects registered by `object_id` with named methods.
//!
//! A method is one of
//! - **sync**: `Fn(&CallCtx, Args) -> Result<Value>`, run on the endpoint's worker pool,
//!   or on the reader thread with a standby reading the socket meanwhile (see
//!   `standby`; `RpcConfig::inline_sync`) — either way it may block, and may call the
//!   peer (nested calls carry `parent_call_id`);
//! - **inline**: the same signature, run on the connection's reader thread — no thread
//!   hand-off, for short handlers. It may still call the peer: a wait on the reader thread
//!   reads the connection itself until its answer arrives, so nothing deadlocks;
//! - **async**: `Fn(CallCtx, Args, Responder)`: the handler returns at once and answers
//!   later, from any thread, through the [`Responder`] (dropping it unanswered sends an
//!   error, so the caller never waits forever).
//!
//! These types and [`Endpoint`] refer to each other (an endpoint serves a [`Registry`]; a
//! handler's [`CallCtx`] and [`Responder`] hold the endpoint), so they live in one module,
//! `endpoint`. Calling a remote object through a typed proxy is [`crate::remote`].

use super::{CallOptions, Endpoint};
use crate::error::{Result, RpcError};
use crate::value::{Map, Value};
use parking_lot::RwLock;
use std::collections::HashMap;
use std::sync::Arc;

/// Positional and keyword arguments of a request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Args {
    pub args: Vec<Value>,
    pub kwargs: Map,
}

impl Args {
    pub fn new(args: Vec<Value>) -> Args {
        Args { args, kwargs: Map::new() }
    }
    /// Positional argument `i`, or keyword `name`.
    pub fn get(&self, i: usize, name: &str) -> Option<&Value> {
        self.args.get(i).or_else(|| self.kwargs.get(name))
    }
    /// Like `get`, but missing is an error naming the parameter.
    pub fn req(&self, i: usize, name: &str) -> Result<&Value> {
        self.get(i, name).ok_or_else(|| RpcError::Remote(format!("missing required argument {name:?} (position {i})")))
    }
}

/// What a handler knows about the request it serves.
#[derive(Clone)]
pub struct CallCtx {
    pub endpoint: Endpoint,
    /// The peer's id for this request.
    pub call_id: i64,
    pub parent_call_id: Option<i64>,
    /// The object id (calls) or callback id (callbacks).
    pub target: String,
    /// The method (`"__call__"` for callbacks).
    pub method: String,
}

impl CallCtx {
    /// Call the peer as part of handling this request (`parent_call_id` = this call).
    pub fn call(&self, object_id: &str, method: &str, args: Vec<Value>, kwargs: Map) -> Result<Value> {
        let opts = CallOptions { parent_call_id: Some(self.call_id), ..CallOptions::default() };
        self.endpoint.call_with(object_id, method, args, kwargs, opts)
    }
    /// Invoke a callable the peer passed us, as part of handling this request.
    pub fn invoke(&self, callable: &Value, args: Vec<Value>, kwargs: Map) -> Result<Value> {
        let id = crate::tagged::as_callback_id(callable)?;
        let opts = CallOptions { parent_call_id: Some(self.call_id), ..CallOptions::default() };
        self.endpoint.start_callback(id, args, kwargs, opts)?.wait()
    }
}

pub type SyncHandler = Arc<dyn Fn(&CallCtx, Args) -> Result<Value> + Send + Sync>;
pub type AsyncHandler = Arc<dyn Fn(CallCtx, Args, Responder) + Send + Sync>;

#[derive(Clone)]
pub enum Handler {
    Sync(SyncHandler),
    Inline(SyncHandler),
    Async(AsyncHandler),
}

/// One object's methods.
#[derive(Clone, Default)]
pub struct Service {
    methods: HashMap<String, Handler>,
    type_name: String,
    fallback: Option<Handler>,
    json_text: bool,
}

impl Service {
    pub fn new(type_name: &str) -> Service {
        Service { methods: HashMap::new(), type_name: type_name.to_owned(), fallback: None, json_text: false }
    }
    /// Its handlers read arguments as [`Value::Json`] text where they hold no tagged
    /// object, on an endpoint with `RpcConfig::json_text` (elsewhere, and by default, a
    /// handler gets the tree).
    pub fn json_text(mut self) -> Self {
        self.json_text = true;
        self
    }
    pub(crate) fn takes_json_text(&self) -> bool {
        self.json_text
    }
    /// A blocking method, run on the worker pool (or on the reader thread while a
    /// standby reads: see `RpcConfig::inline_sync`).
    pub fn method(mut self, name: &str, f: impl Fn(&CallCtx, Args) -> Result<Value> + Send + Sync + 'static) -> Self {
        self.methods.insert(name.to_owned(), Handler::Sync(Arc::new(f)));
        self
    }
    /// A short method run on the reader thread (no hand-off; see the module docs).
    pub fn method_inline(mut self, name: &str, f: impl Fn(&CallCtx, Args) -> Result<Value> + Send + Sync + 'static) -> Self {
        self.methods.insert(name.to_owned(), Handler::Inline(Arc::new(f)));
        self
    }
    /// A method that answers later through its [`Responder`].
    pub fn method_async(mut self, name: &str, f: impl Fn(CallCtx, Args, Responder) + Send + Sync + 'static) -> Self {
        self.methods.insert(name.to_owned(), Handler::Async(Arc::new(f)));
        self
    }
    /// What answers a method the service does not have (`CallCtx::method` names it),
    /// instead of the endpoint's `NotFound`: e.g. an error in the served language's terms.
    pub fn fallback(mut self, f: impl Fn(&CallCtx, Args) -> Result<Value> + Send + Sync + 'static) -> Self {
        self.fallback = Some(Handler::Sync(Arc::new(f)));
        self
    }
    pub fn type_name(&self) -> &str {
        &self.type_name
    }
    pub(crate) fn handler(&self, method: &str) -> Option<&Handler> {
        self.methods.get(method).or(self.fallback.as_ref())
    }
}

/// Services by object id; share one registry among many endpoints (a server).
#[derive(Clone, Default)]
pub struct Registry {
    inner: Arc<RwLock<HashMap<String, Arc<Service>>>>,
}

impl Registry {
    pub fn new() -> Registry {
        Registry::default()
    }
    /// Register `service` as `object_id`; an id already taken is an error (as in pyisolate).
    pub fn register(&self, object_id: &str, service: Service) -> Result<()> {
        let mut m = self.inner.write();
        if m.contains_key(object_id) {
            return Err(RpcError::InvalidArgument(format!("Object ID {object_id} already registered")));
        }
        m.insert(object_id.to_owned(), Arc::new(service));
        Ok(())
    }
    pub fn unregister(&self, object_id: &str) -> bool {
        self.inner.write().remove(object_id).is_some()
    }
    pub fn get(&self, object_id: &str) -> Option<Arc<Service>> {
        self.inner.read().get(object_id).cloned()
    }
    /// A `RemoteObjectHandle` for a registered object.
    pub fn handle(&self, object_id: &str) -> Result<Value> {
        let s = self.get(object_id).ok_or_else(|| RpcError::NotFound(format!("Object ID {object_id} not registered")))?;
        Ok(crate::tagged::remote_handle(object_id, s.type_name()))
    }
}

/// Completes one request, once, from any thread. Dropped unanswered, it answers with an
/// error.
pub struct Responder {
    pub(crate) endpoint: Option<Endpoint>,
    pub(crate) call_id: i64,
}

impl Responder {
    pub fn call_id(&self) -> i64 {
        self.call_id
    }
    /// Answer with `r` (an `Err` becomes the response's `error` string).
    pub fn respond(mut self, r: Result<Value>) {
        if let Some(ep) = self.endpoint.take() {
            ep.send_response(self.call_id, r);
        }
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        if let Some(ep) = self.endpoint.take() {
            ep.send_response(self.call_id, Err(RpcError::Remote("handler dropped its responder without answering".into())));
        }
    }
}
