//! tensorwire-rpc: an RPC layer over tensorwire that speaks pyisolate's wire protocol.
//!
//! Frames are a 4-byte big-endian length and UTF-8 JSON ([`frame`]); messages are
//! pyisolate's `call` / `callback` / `response` and the `null` close frame ([`message`]);
//! values ([`value`]) are JSON as Python writes it ([`json`]), plus pyisolate 0.10.2's
//! tagged forms ([`tagged`]) and tensors ([`tensor`]). An [`Endpoint`] runs one full-duplex connection:
//! many calls outstanding both ways, nested calls with `parent_call_id`, timeouts,
//! cancellation, and `PeerGone` for every pending call when the peer dies. Objects are
//! served from a [`Registry`] of [`Service`]s (sync, inline and async handlers); remote
//! objects are called through [`RemoteObject`] (typed with serde) or [`Endpoint::call`].
//!
//! Threads, not async: a reader thread per connection and an elastic worker pool. An
//! "async handler" is one that answers later through a [`Responder`].
//!
//! Transports ([`Stream`]): a Unix socket path (as pyisolate's `PYISOLATE_UDS_ADDRESS`),
//! an inherited socketpair fd, or TCP (`tcp://host:port`) for a peer on another machine —
//! over TCP tensors are always *copied* (file_system refs only make sense on one machine,
//! so send plain data or `TensorValue`s there; native tensors need a Unix socket).
//!
//! Tensors travel natively (memfd segment by fd under a tensorwire lease, after
//! [`Endpoint::negotiate_native`]) or as pyisolate CPU `TensorRef`s backed by PyTorch
//! `file_system` shm files, which a Python peer with plain torch rebuilds.
//!
//! ```no_run
//! use tensorwire_rpc::{Endpoint, Registry, RpcConfig, Service, Value};
//! # fn main() -> tensorwire_rpc::Result<()> {
//! let reg = Registry::new();
//! reg.register("calc", Service::new("Calc").method_inline("add", |_, a| {
//!     Ok(Value::from(a.req(0, "a")?.as_i64().unwrap_or(0) + a.req(1, "b")?.as_i64().unwrap_or(0)))
//! }))?;
//! let (server, client) = Endpoint::pair(reg, Registry::new(), RpcConfig::default())?;
//! assert_eq!(client.call("calc", "add", vec![1.into(), 2.into()])?, Value::Int(3));
//! # drop(server); Ok(()) }
//! ```

mod accept;
pub mod base64;
pub mod config;
pub mod cuda_tensor;
pub mod endpoint;
pub mod error;
pub mod frame;
pub mod fs_tensor;
pub mod json;
mod limits;
pub mod message;
pub mod remote;
pub mod server;
pub mod stream;
pub mod tagged;
pub mod tensor;
pub mod tensor_handle;
#[cfg(feature = "ucx")]
pub mod ucx_tensor;
pub mod value;
pub mod worker;

pub use endpoint::{Args, CallCtx, CallOptions, Canceller, Endpoint, PendingCall, Registry, Responder, RpcConfig, Service, Stats};
pub use error::{Result, RpcError};
pub use message::Message;
pub use remote::RemoteObject;
pub use server::Server;
pub use stream::Stream;
pub use tensor::{CudaImportedTensor, CudaTensor, FsStrategy, FsTensor, ImportedTensor, OwnedTensor, Tensor};
pub use tensorwire::Wait;
pub use value::{JsonText, Map, Value};
pub use worker::{Limits, OnInterrupt, Output, PooledWorker, Sandbox, Worker, WorkerCall, WorkerPool, WorkerSpec, WorkerState};
