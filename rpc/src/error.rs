//! Errors of the RPC layer. Every message says what went wrong and, where it helps, what
//! to do about it.

use std::fmt;
use std::time::Duration;

pub type Result<T, E = RpcError> = std::result::Result<T, E>;

/// Everything that can go wrong in tensorwire-rpc.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum RpcError {
    /// The peer closed the connection or died; every pending call fails with this.
    PeerGone(String),
    /// A call got no response within its timeout.
    Timeout { what: String, after: Duration },
    /// The caller cancelled the call.
    Cancelled,
    /// The remote handler failed; this is the `error` string of its response.
    Remote(String),
    /// The peer broke the wire protocol (bad frame, bad message); the connection is closed.
    Protocol(String),
    /// A frame's declared length is over the configured cap; the connection is closed.
    FrameTooLarge { len: u64, cap: usize },
    /// A value could not be decoded (bad JSON, bad tagged form, wrong type).
    Decode(String),
    /// No object / method / callback of that name is registered here.
    NotFound(String),
    /// The caller passed something unusable.
    InvalidArgument(String),
    /// A socket or file operation failed.
    Io(String),
    /// The tensorwire transport reported an error (native tensors).
    Transport(String),
}

impl RpcError {
    pub fn is_peer_gone(&self) -> bool {
        matches!(self, RpcError::PeerGone(_))
    }
    pub(crate) fn io(what: &str, e: std::io::Error) -> RpcError {
        match e.kind() {
            std::io::ErrorKind::BrokenPipe
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::UnexpectedEof => RpcError::PeerGone(format!("{what}: {e}")),
            _ => RpcError::Io(format!("{what}: {e}")),
        }
    }
}

impl fmt::Display for RpcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RpcError::PeerGone(d) => write!(f, "peer gone: {d}"),
            RpcError::Timeout { what, after } => write!(f, "timed out after {after:?} waiting for {what}"),
            RpcError::Cancelled => write!(f, "call cancelled by the caller"),
            RpcError::Remote(m) => write!(f, "{m}"),
            RpcError::Protocol(m) => write!(f, "protocol violation by peer: {m}"),
            RpcError::FrameTooLarge { len, cap } => write!(
                f,
                "protocol violation by peer: frame of {len} bytes is over the {cap}-byte cap (raise RpcConfig::max_frame if this peer is trusted to send more)"
            ),
            RpcError::Decode(m) => write!(f, "cannot decode value: {m}"),
            RpcError::NotFound(m) => write!(f, "{m}"),
            RpcError::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
            RpcError::Io(m) => write!(f, "I/O error: {m}"),
            RpcError::Transport(m) => write!(f, "transport: {m}"),
        }
    }
}

impl std::error::Error for RpcError {}

impl From<tensorwire::Error> for RpcError {
    fn from(e: tensorwire::Error) -> RpcError {
        if e.is_peer_gone() { RpcError::PeerGone(e.to_string()) } else { RpcError::Transport(e.to_string()) }
    }
}
