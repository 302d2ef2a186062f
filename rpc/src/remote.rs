//! [`RemoteObject`]: a typed proxy for one object the peer serves — calls with serde
//! types through an [`Endpoint`], or from a `RemoteObjectHandle` the peer sent.

use crate::endpoint::{CallOptions, Endpoint, PendingCall};
use crate::error::{Result, RpcError};
use crate::value::{Map, Value};

/// A typed proxy for one remote object: `client.call("add", (1, 2))` with serde types.
#[derive(Clone)]
pub struct RemoteObject {
    endpoint: Endpoint,
    object_id: String,
    opts: CallOptions,
}

impl RemoteObject {
    pub fn new(endpoint: &Endpoint, object_id: &str) -> RemoteObject {
        RemoteObject { endpoint: endpoint.clone(), object_id: object_id.to_owned(), opts: CallOptions::default() }
    }
    /// From a `RemoteObjectHandle` value the peer sent.
    pub fn from_handle(endpoint: &Endpoint, handle: &Value) -> Result<RemoteObject> {
        match crate::tagged::classify(handle)? {
            Some(crate::tagged::Tagged::RemoteObject { object_id, .. }) => Ok(RemoteObject::new(endpoint, object_id)),
            _ => Err(RpcError::Decode(format!("expected a RemoteObjectHandle, got {}", handle.type_name()))),
        }
    }
    /// Per-call options (timeout, parent) for calls through this proxy.
    pub fn with_options(mut self, opts: CallOptions) -> RemoteObject {
        self.opts = opts;
        self
    }
    pub fn object_id(&self) -> &str {
        &self.object_id
    }
    /// Call with untyped values.
    pub fn call_values(&self, method: &str, args: Vec<Value>, kwargs: Map) -> Result<Value> {
        self.endpoint.call_with(&self.object_id, method, args, kwargs, self.opts.clone())
    }
    /// Start a call without waiting.
    pub fn start(&self, method: &str, args: Vec<Value>, kwargs: Map) -> Result<PendingCall> {
        self.endpoint.start_call(&self.object_id, method, args, kwargs, self.opts.clone())
    }
    /// Typed call: `args` serializes to a JSON array (a tuple or Vec), the result
    /// deserializes into `R`.
    pub fn call<A: serde::Serialize, R: serde::de::DeserializeOwned>(&self, method: &str, args: A) -> Result<R> {
        let args = match Value::from_serde(&args)? {
            Value::Array(a) => a,
            Value::Null => Vec::new(),
            one => vec![one],
        };
        self.call_values(method, args, Map::new())?.to_serde()
    }
}
