//! [`RpcConfig`]: the limits and behaviour of an endpoint (and of a [`crate::Server`]'s
//! accept loop). Every limit on what a peer can make this process hold is a field here
//! with a default that is safe against a hostile peer; going over one is a named
//! [`crate::RpcError`] variant whose message names the field.

use crate::frame;
use crate::json;
use crate::tensor::FsStrategy;
use std::time::Duration;
use tensorwire::Wait;

/// Default [`RpcConfig::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// Default [`RpcConfig::first_message_timeout`].
pub const DEFAULT_FIRST_MESSAGE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default [`RpcConfig::max_tensor_copy`]: 256 MiB.
pub const DEFAULT_MAX_TENSOR_COPY: usize = 256 << 20;
/// Default [`RpcConfig::remote_import_timeout`].
pub const DEFAULT_REMOTE_IMPORT_TIMEOUT: Duration = Duration::from_secs(60);
/// Default [`RpcConfig::max_remote_exports`].
pub const DEFAULT_MAX_REMOTE_EXPORTS: usize = 1024;
/// Default [`RpcConfig::remote_pool_bytes`]: 256 MiB.
pub const DEFAULT_REMOTE_POOL_BYTES: u64 = 256 << 20;
/// Default [`RpcConfig::max_remote_message_bytes`]: 512 MiB.
pub const DEFAULT_MAX_REMOTE_MESSAGE_BYTES: u64 = 512 << 20;
/// Default [`RpcConfig::max_remote_connection_bytes`]: 2 GiB.
pub const DEFAULT_MAX_REMOTE_CONNECTION_BYTES: u64 = 2 << 30;

/// Default [`RpcConfig::inline_tensors`]: 2 KiB, about where base64 in the frame stops
/// being cheaper than a segment export (docs/measurements.md, "Ordinary tensors").
pub const DEFAULT_INLINE_TENSORS: usize = 2 << 10;

/// Default [`RpcConfig::attached_tensors`]: 16 KiB, about where a tensor's bytes in the
/// frame stop being cheaper than a segment export (docs/measurements.md, "Attachments").
pub const DEFAULT_ATTACHED_TENSORS: usize = 16 << 10;

/// Limits and behaviour of one endpoint.
#[derive(Debug, Clone)]
pub struct RpcConfig {
    /// Largest frame accepted or sent (default 64 MiB).
    pub max_frame: usize,
    /// Deepest JSON nesting accepted (default 256).
    pub max_depth: usize,
    /// Most JSON values (scalars, lists, dicts and dict keys, each counting one) decoded
    /// from one frame (default 1,048,576). A value costs this process about 32 bytes
    /// however few bytes it took on the wire (`0, ` is three), so this, not the frame
    /// cap, bounds what decoding one frame can cost: about 64 MiB with the default.
    pub max_values: usize,
    /// Largest private copy of a peer's tensor, in bytes (default 256 MiB): `to_vec`,
    /// `to_f64_vec`, storage copies and `TensorValue`s of tensors the peer sent. A view
    /// can name far more elements than its storage holds (stride 0), so the peer, not
    /// the data, would otherwise choose the size. Zero-copy access (reading the storage
    /// in place) is not limited.
    pub max_tensor_copy: usize,
    /// Most connections a [`crate::Server`] serves at once (default 256); a connection
    /// over it is told "server busy" and closed. Each costs one fd and one reader thread
    /// (once its reader thread has run a sync handler, also a standby thread and an epoll
    /// fd: see `inline_sync`; once it negotiates native tensors, the transport's fds and
    /// threads).
    pub max_connections: usize,
    /// How long a connection a [`crate::Server`] accepted may go without a complete first
    /// message from the peer (default 10 s; `None`: no limit). A peer that connects and
    /// sends nothing, or part of a frame, would otherwise hold one of the
    /// `max_connections` slots for good; when the time passes it is told why and the
    /// connection is closed ([`crate::RpcError::FirstMessageTimeout`]). A server that
    /// speaks first (a peer that only answers) should allow for its own first call.
    /// Endpoints made with `Endpoint::new`, `connect`, `from_fd` or `pair` have no such
    /// limit.
    pub first_message_timeout: Option<Duration>,
    /// How long a call waits for its response when its `CallOptions` say nothing
    /// (default `Wait::Forever`: until the response or the connection's end).
    pub default_timeout: Wait,
    /// How long one frame write may take before the peer counts as not reading (default
    /// 30 s; the connection is then closed). One bound for the whole frame, however many
    /// partial writes it takes, so a peer that reads a little now and then cannot stretch
    /// it.
    pub send_timeout: Duration,
    /// Most worker threads (handlers running or blocked at once); a request beyond it is
    /// answered "server busy" — except one for an inline handler, which waits in the
    /// connection's inline lane (up to 1024 requests and `max_frame` bytes of their
    /// frames; see `endpoint::lane`) when it was a waiting caller that read it.
    pub max_workers: usize,
    /// How long a wait spins before it blocks (default 200 µs; zero: block at once): a
    /// caller waiting for its response, and the reader thread once it has read all that
    /// arrived. A reply that comes within it costs no sleep and wake-up. It must outlast
    /// the peer's wake-up plus its work on a message, or the two sides fall into a state
    /// that feeds itself: each answers after the other's spin ended, so every message
    /// pays a wake-up on each side, call after call. The spin never yields the CPU; it
    /// ends early when the thread was preempted, and the endpoint's waits then sleep at
    /// once for a while (see `endpoint::spin`).
    pub spin: Duration,
    /// How long the reader thread stays off the socket once a waiting caller has been
    /// reading it (callers that keep calling read their own responses and dispatch
    /// whatever else arrives; the reader thread then wakes about once per this period
    /// instead of once per frame — on a loaded machine those wakes cost the callers).
    /// The price: a request from the peer that arrives while none of our calls is waiting
    /// may wait up to this long. Zero: the reader thread never steps back.
    pub reader_yield: Duration,
    /// Let the reader thread run a sync handler itself (default `true`) when nothing
    /// else it read waits behind the request, while a standby thread watches the socket
    /// (see `endpoint::standby`): one thread wake-up less per request. `false`: every sync
    /// handler runs on the worker pool. On, a connection that serves sync requests costs
    /// one more thread (the standby, started with the first) and an epoll fd.
    pub inline_sync: bool,
    /// Open the files CPU `TensorRef`s (pyisolate's file_system tensors) name (default
    /// `false`). Off, a received `TensorRef` is refused (`RpcError::Decode`, naming this
    /// field): a peer must not make this process open, map or unlink a file of its
    /// choosing. Turn it on only for a trusted peer that speaks pyisolate's wire and no
    /// native tensors; even then the file must be one directly in `/dev/shm`, a file this
    /// process did not create is only read (opened `O_NOFOLLOW` read-only, mapped
    /// private), and only files this process created are ever written or unlinked (see
    /// [`crate::tensor`] on trust). What this endpoint sends is not affected.
    pub accept_fs_tensors: bool,
    /// Strategy for the `TensorRef`s we send.
    pub fs_strategy: FsStrategy,
    /// How long we hold our reference to a file_system tensor we sent (the receiver must
    /// open it within this time with the borrowed strategy).
    pub fs_keep: Duration,
    /// Accept native-tensor negotiation from the peer (Unix sockets only; once per
    /// connection).
    pub native_tensors: bool,
    /// Transport limits for the native-tensor channel.
    pub peer_config: tensorwire::PeerConfig,
    /// Largest [`Tensor::Owned`](crate::Tensor::Owned) (packed bytes) that travels inside
    /// the frame, base64 in a `TensorwireInline` object, rather than as a segment export
    /// (default 2 KiB; 0: never). Offered in `native_hello` and used only when both sides
    /// offer it: each then sends and accepts up to the smaller of the two, and a received
    /// inline tensor over it is refused. Peers that did not negotiate it (pyisolate, TCP)
    /// never see the form.
    pub inline_tensors: usize,
    /// Largest [`Tensor::Owned`](crate::Tensor::Owned) (packed bytes) that travels as a
    /// binary attachment of its frame, named by a `TensorwireAttached` object, rather than
    /// as a segment export (default 16 KiB; 0: never). Offered in `native_hello` and used
    /// only when both sides offer it: each then sends up to the smaller of the two (and
    /// prefers it to `inline_tensors`), and a received attachment over our own limit is
    /// refused. Peers that did not negotiate it never receive a frame with attachments.
    pub attached_tensors: usize,
    /// Offer and accept remote tensors on a TCP connection (default on in a build with the
    /// crate's `ucx` feature, off without it; used only when both sides set it): CPU
    /// tensors then travel as `TensorwireRemote` values — the receiver asks the sender's
    /// UCX exporter for the export by id and key, and the exporter sends exactly that
    /// tensor's storage — instead of being copied into the JSON. A peer can read only what
    /// was sent to it on its own connection; a peer we import from chooses the address UCX
    /// connects to and, within the budgets below, how much we allocate. See DESIGN.md,
    /// "Remote peers".
    pub remote_tensors: bool,
    /// Longest one remote tensor's import may take before it is cancelled and the value
    /// fails with `RpcError::RemoteTransfer` (default 60 s).
    pub remote_import_timeout: Duration,
    /// Most remote exports the peer may hold unreleased on this connection (default
    /// 1024); a send beyond it fails with `RpcError::RemoteTransfer`. Each holds the
    /// storage of one sent tensor until the peer releases it or the connection ends.
    pub max_remote_exports: usize,
    /// Most bytes the remote tensors of one received message may make us allocate
    /// (default 512 MiB); a message naming more is refused whole, before any import, with
    /// `RpcError::RemoteTransfer` (its exports are released).
    pub max_remote_message_bytes: u64,
    /// Most bytes of remote tensors received on this connection that may be alive at once
    /// (default 2 GiB): imports in progress plus imported tensors still held by this
    /// process. A message that would go past it is refused whole, as above.
    pub max_remote_connection_bytes: u64,
    /// Most bytes of segments this connection keeps to receive remote tensors into again
    /// (default 256 MiB; 0 keeps none): a segment whose tensor the process has dropped is
    /// reused for the next remote tensor of exactly its length, saving the allocation and
    /// the page faults of a fresh one. Kept segments count towards
    /// `max_remote_connection_bytes` too (free ones are dropped first to make room), and go
    /// when the connection ends. See DESIGN.md, "Remote peers".
    pub remote_pool_bytes: u64,
    /// Hand received values that hold no tagged object (no tensor, no pyisolate form) to
    /// their consumer as [`Value::Json`](crate::Value::Json) text, checked but not
    /// parsed into a tree (default `false`): for a consumer that builds its own objects
    /// from the text, as the Python binding does. Only where the consumer says it reads
    /// text: a service built with [`Service::json_text`](crate::Service::json_text), and
    /// [`PendingCall::wait_slice`](crate::PendingCall::wait_slice) (and so
    /// [`Worker::wait_call`](crate::Worker::wait_call)); every other request
    /// handler, and every other wait for a response, gets the tree as before.
    pub json_text: bool,
}

impl Default for RpcConfig {
    fn default() -> Self {
        RpcConfig {
            max_frame: frame::DEFAULT_MAX_FRAME,
            max_depth: json::DEFAULT_MAX_DEPTH,
            max_values: json::DEFAULT_MAX_VALUES,
            max_tensor_copy: DEFAULT_MAX_TENSOR_COPY,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            first_message_timeout: Some(DEFAULT_FIRST_MESSAGE_TIMEOUT),
            default_timeout: Wait::Forever,
            send_timeout: Duration::from_secs(30),
            max_workers: 64,
            spin: Duration::from_micros(200),
            reader_yield: Duration::from_millis(1),
            inline_sync: true,
            accept_fs_tensors: false,
            fs_strategy: FsStrategy::Borrowed,
            fs_keep: Duration::from_secs(10),
            native_tensors: true,
            peer_config: tensorwire::PeerConfig::default(),
            inline_tensors: DEFAULT_INLINE_TENSORS,
            attached_tensors: DEFAULT_ATTACHED_TENSORS,
            remote_tensors: cfg!(feature = "ucx"),
            json_text: false,
            remote_import_timeout: DEFAULT_REMOTE_IMPORT_TIMEOUT,
            max_remote_exports: DEFAULT_MAX_REMOTE_EXPORTS,
            max_remote_message_bytes: DEFAULT_MAX_REMOTE_MESSAGE_BYTES,
            max_remote_connection_bytes: DEFAULT_MAX_REMOTE_CONNECTION_BYTES,
            remote_pool_bytes: DEFAULT_REMOTE_POOL_BYTES,
        }
    }
}

impl RpcConfig {
    /// The JSON decode limits of this config.
    pub fn json_limits(&self) -> json::Limits {
        json::Limits { max_depth: self.max_depth, max_values: self.max_values }
    }
}
