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
    /// The tensorwire transport reported an error (native tensors): `kind` is the
    /// transport's kind of it ([`RpcError::kind`]), `message` its text.
    Transport { kind: tensorwire::ErrorKind, message: String },
    /// A server already serves `RpcConfig::max_connections` connections; the new one was
    /// refused (told so, then closed).
    ConnectionLimit { open: usize, cap: usize },
    /// A connection a server accepted brought no complete message within
    /// `RpcConfig::first_message_timeout`; the peer was told so and the connection closed.
    FirstMessageTimeout { after: Duration },
    /// A frame holds more JSON than a decode limit allows (`field`: the `RpcConfig` field
    /// that sets it, e.g. `max_values`, `max_depth`); the connection is closed.
    DecodeLimit { what: String, field: &'static str },
    /// A private copy of a peer's tensor (`to_vec`, `to_f64_vec`, a storage copy, a
    /// `TensorValue`) would take more than `RpcConfig::max_tensor_copy` bytes.
    TensorCopyLimit { what: String, need: u64, cap: usize },
    /// An allocation within the limits failed (out of memory or address space).
    OutOfMemory { what: String, bytes: u64 },
    /// No CUDA driver (or no device) in this process: CUDA tensors cannot be made, sent
    /// or received here.
    CudaUnavailable(String),
    /// A CUDA driver call failed (the message names the call and the driver's error).
    Cuda(String),
    /// A CUDA tensor was to be sent on a connection without native tensors (TCP, a
    /// pyisolate peer, or before `negotiate_native`).
    CudaNotNative(String),
    /// This machine cannot give what was asked for (a sandbox level its kernel lacks):
    /// the message names what is missing and how to get it.
    Unsupported(String),
    /// A remote tensor (feature `ucx`) could not be registered, read or released: the
    /// engine's error, with which tensor and which step.
    RemoteTransfer(String),
}

impl RpcError {
    pub fn is_peer_gone(&self) -> bool {
        matches!(self, RpcError::PeerGone(_))
    }
    /// The transport's kind of a [`RpcError::Transport`] error (match on it rather than
    /// its text); `None` for every other variant.
    pub fn kind(&self) -> Option<tensorwire::ErrorKind> {
        match self {
            RpcError::Transport { kind, .. } => Some(*kind),
            _ => None,
        }
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
            RpcError::Transport { message, .. } => write!(f, "transport: {message}"),
            RpcError::ConnectionLimit { open, cap } => write!(
                f,
                "server busy: {open} connections are open, the cap is {cap} (RpcConfig::max_connections); try again later"
            ),
            RpcError::FirstMessageTimeout { after } => write!(
                f,
                "the peer sent no complete message within {after:?} of connecting (RpcConfig::first_message_timeout); connection closed"
            ),
            RpcError::DecodeLimit { what, field } => {
                write!(f, "protocol violation by peer: {what} (limit set by RpcConfig::{field})")
            }
            RpcError::TensorCopyLimit { what, need, cap } => write!(
                f,
                "{what} needs {need} bytes, over the {cap}-byte limit on private copies of a peer's tensor (RpcConfig::max_tensor_copy; read the storage in place, or raise the limit for a trusted peer)"
            ),
            RpcError::OutOfMemory { what, bytes } => write!(f, "out of memory: could not allocate {bytes} bytes for {what}"),
            RpcError::CudaUnavailable(m) => write!(f, "CUDA unavailable: {m}"),
            RpcError::Cuda(m) => write!(f, "{m}"),
            RpcError::CudaNotNative(m) => write!(f, "CUDA tensor needs native mode: {m}"),
            RpcError::RemoteTransfer(m) => write!(f, "remote tensor transfer: {m}"),
            RpcError::Unsupported(m) => write!(f, "unsupported on this machine: {m}"),
        }
    }
}

impl std::error::Error for RpcError {}

impl From<tensorwire::Error> for RpcError {
    fn from(e: tensorwire::Error) -> RpcError {
        match e {
            tensorwire::Error::CudaUnavailable(m) => RpcError::CudaUnavailable(m),
            e @ tensorwire::Error::Cuda { .. } => RpcError::Cuda(e.to_string()),
            e if e.is_peer_gone() => RpcError::PeerGone(e.to_string()),
            e => RpcError::Transport { kind: e.kind(), message: e.to_string() },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::RpcError;
    use tensorwire::ErrorKind;

    #[test]
    fn a_transport_error_keeps_its_kind_and_its_text() {
        let cases = [
            (tensorwire::Error::QuotaExceeded("too many leases".into()), ErrorKind::QuotaExceeded),
            (tensorwire::Error::StaleLease("slot 3 generation 2".into()), ErrorKind::StaleLease),
            (tensorwire::Error::InvalidDescriptor("bad dtype".into()), ErrorKind::InvalidDescriptor),
            (tensorwire::Error::Protocol("bad message".into()), ErrorKind::Protocol),
        ];
        for (e, kind) in cases {
            let text = format!("transport: {e}");
            let r = RpcError::from(e);
            assert!(matches!(&r, RpcError::Transport { kind: k, .. } if *k == kind), "{r:?}");
            assert_eq!(r.kind(), Some(kind));
            assert_eq!(r.to_string(), text, "the text is the transport's, as before the kind was kept");
        }
    }

    #[test]
    fn only_transport_errors_have_a_kind() {
        let not_transport = [
            RpcError::from(tensorwire::Error::CudaUnavailable("no driver".into())),
            RpcError::from(tensorwire::Error::PeerGone { detail: "hung up".into() }),
            RpcError::Protocol("bad frame".into()),
            RpcError::Remote("ValueError: x".into()),
        ];
        for e in not_transport {
            assert_eq!(e.kind(), None, "{e:?}");
        }
    }
}
