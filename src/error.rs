//! The one error type of the transport. Every variant says what was wrong in words a user
//! can act on; `Display` is the message the C ABI and Python surface verbatim.

use std::fmt;
use std::io;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in tensorwire.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// An operating-system call failed; `op` names the call and what it was for.
    Io { op: &'static str, source: io::Error },
    /// The peer process exited or closed its end of the connection.
    PeerGone { detail: String },
    /// A wait ran past its timeout.
    Timeout { what: &'static str, after: std::time::Duration },
    /// A descriptor (from the peer or the caller) failed validation.
    InvalidDescriptor(String),
    /// A file descriptor handed to us is not a sealed memfd of the right size.
    InvalidSegment(String),
    /// The peer violated the wire protocol (bad message, bad handshake, bad table).
    Protocol(String),
    /// A lease handle does not name a live lease (out of range, stale generation,
    /// already released, or expired by its window).
    StaleLease(String),
    /// A per-peer quota (lease count, bytes, mapped segments) would be exceeded.
    QuotaExceeded(String),
    /// The caller passed an argument that cannot be used.
    InvalidArgument(String),
    /// CUDA was asked for but no driver is present on this machine.
    CudaUnavailable(String),
    /// A CUDA driver call failed.
    Cuda { call: &'static str, code: i32, name: String },
}

impl Error {
    pub(crate) fn io(op: &'static str, source: io::Error) -> Self {
        Error::Io { op, source }
    }

    /// `Error::Io` built from `errno` right after a failed libc call.
    pub(crate) fn last_os(op: &'static str) -> Self {
        Error::Io { op, source: io::Error::last_os_error() }
    }

    pub(crate) fn peer_gone(detail: impl Into<String>) -> Self {
        Error::PeerGone { detail: detail.into() }
    }

    /// True for `PeerGone`.
    pub fn is_peer_gone(&self) -> bool {
        matches!(self, Error::PeerGone { .. })
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io { op, source } => write!(f, "{op} failed: {source}"),
            Error::PeerGone { detail } => write!(f, "peer gone: {detail}"),
            Error::Timeout { what, after } => write!(f, "timed out after {after:?} waiting for {what}"),
            Error::InvalidDescriptor(m) => write!(f, "invalid tensor descriptor: {m}"),
            Error::InvalidSegment(m) => write!(f, "invalid segment: {m}"),
            Error::Protocol(m) => write!(f, "protocol violation by peer: {m}"),
            Error::StaleLease(m) => write!(f, "stale lease: {m}"),
            Error::QuotaExceeded(m) => write!(f, "quota exceeded: {m}"),
            Error::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
            Error::CudaUnavailable(m) => write!(f, "CUDA unavailable: {m}"),
            Error::Cuda { call, code, name } => write!(f, "CUDA call {call} failed: {name} ({code})"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}
