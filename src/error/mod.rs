//! The one error type of the transport. Every variant says what was wrong in words a user
//! can act on; `Display` is the message the C ABI and Python surface verbatim.

#[cfg(not(loom))]
pub mod cuda_code;
pub mod codes;
pub mod ring;

pub use codes::{ResultCode, RESULT_CODES};
pub use ring::{RingBroken, RingError};
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
    /// A wait ran out: `after` is what the caller asked for (the timeout, or from the
    /// call to its deadline; zero for `Wait::Never`).
    Timeout { what: &'static str, after: std::time::Duration },
    /// A descriptor (from the peer or the caller) failed validation.
    InvalidDescriptor(String),
    /// A file descriptor handed to us is not a sealed memfd of the right size.
    InvalidSegment(String),
    /// The peer violated the wire protocol (bad message, bad handshake, bad table).
    Protocol(String),
    /// The peer wrote something into a shared ring that its protocol does not allow; the
    /// ring is unusable for good (every later call on it fails with the same reason).
    RingBroken(RingBroken),
    /// A lease handle does not name a live lease (out of range, stale generation,
    /// already released, or expired by its window).
    StaleLease(String),
    /// A per-peer quota (lease count, bytes, mapped segments) would be exceeded.
    QuotaExceeded(String),
    /// The caller passed an argument that cannot be used.
    InvalidArgument(String),
    /// CUDA was asked for but no driver is present on this machine.
    CudaUnavailable(String),
    /// A CUDA driver call failed: `code` is the driver's result, `name` its name for it
    /// (e.g. `CUDA_ERROR_INVALID_VALUE`), for messages.
    // Not in the loom model build, which compiles no CUDA code (`crate::cuda` is out).
    #[cfg(not(loom))]
    Cuda { call: &'static str, code: cuda_code::CudaCode, name: String },
    /// The machine or a process limit said no: no fd (`EMFILE`/`ENFILE`), no address
    /// space or memory (`ENOMEM`, e.g. under `RLIMIT_AS`), no room on a file system or
    /// under a file-size limit (`ENOSPC`/`EFBIG`), no lockable memory (`EPERM`/`EAGAIN`
    /// of `mlock`). `what` names the call and what it was for; `errno` is the OS's code.
    Resource { what: &'static str, errno: i32 },
}

/// What kind of failure an [`Error`] is, without its details (as `std::io::ErrorKind`):
/// for matching, and what the C ABI's result code and the Python exception class are
/// chosen by. A ring the peer broke is a `Protocol` failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    Io,
    PeerGone,
    Timeout,
    InvalidDescriptor,
    InvalidSegment,
    Protocol,
    StaleLease,
    QuotaExceeded,
    InvalidArgument,
    CudaUnavailable,
    Cuda,
    Resource,
}

impl Error {
    /// The kind of this failure.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Io { .. } => ErrorKind::Io,
            Error::PeerGone { .. } => ErrorKind::PeerGone,
            Error::Timeout { .. } => ErrorKind::Timeout,
            Error::InvalidDescriptor(_) => ErrorKind::InvalidDescriptor,
            Error::InvalidSegment(_) => ErrorKind::InvalidSegment,
            Error::Protocol(_) | Error::RingBroken(_) => ErrorKind::Protocol,
            Error::StaleLease(_) => ErrorKind::StaleLease,
            Error::QuotaExceeded(_) => ErrorKind::QuotaExceeded,
            Error::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Error::CudaUnavailable(_) => ErrorKind::CudaUnavailable,
            #[cfg(not(loom))]
            Error::Cuda { .. } => ErrorKind::Cuda,
            Error::Resource { .. } => ErrorKind::Resource,
        }
    }

    /// An OS call failed: `Resource` when the failure is a limit of the machine or the
    /// process (so callers can tell "raise a limit / free something" from a real fault),
    /// `Io` otherwise.
    pub(crate) fn io(op: &'static str, source: io::Error) -> Self {
        match source.raw_os_error() {
            Some(errno @ (libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::ENOSPC | libc::EFBIG | libc::EDQUOT)) => {
                Error::Resource { what: op, errno }
            }
            _ => Error::Io { op, source },
        }
    }

    /// `Error::Io` built from `errno` right after a failed libc call.
    pub(crate) fn last_os(op: &'static str) -> Self {
        Error::io(op, io::Error::last_os_error())
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
            Error::Timeout { what, after } if after.is_zero() => {
                write!(f, "timed out at once (no wait was asked for) waiting for {what}")
            }
            Error::Timeout { what, after } => write!(f, "timed out after {after:?} waiting for {what}"),
            Error::InvalidDescriptor(m) => write!(f, "invalid tensor descriptor: {m}"),
            Error::InvalidSegment(m) => write!(f, "invalid segment: {m}"),
            Error::Protocol(m) => write!(f, "protocol violation by peer: {m}"),
            Error::RingBroken(why) => write!(f, "protocol violation by peer: ring broken: {why}"),
            Error::StaleLease(m) => write!(f, "stale lease: {m}"),
            Error::QuotaExceeded(m) => write!(f, "quota exceeded: {m}"),
            Error::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
            Error::CudaUnavailable(m) => write!(f, "CUDA unavailable: {m}"),
            #[cfg(not(loom))]
            Error::Cuda { call, code, name } => write!(f, "CUDA call {call} failed: {name} ({code})"),
            Error::Resource { what, errno } => {
                let hint = match *errno {
                    libc::EMFILE => "this process is at its open-file limit (raise `ulimit -n`, or release imports)",
                    libc::ENFILE => "the system is out of open files",
                    libc::ENOMEM => "out of memory or address space (an RLIMIT_AS / `ulimit -v` limit, or the machine)",
                    libc::ENOSPC | libc::EDQUOT => "no room left (shared-memory file system full or a quota reached)",
                    libc::EFBIG => "over this process's file-size limit (`ulimit -f`)",
                    _ => "a resource limit was reached",
                };
                write!(f, "out of resources: {what} failed: {} — {hint}", io::Error::from_raw_os_error(*errno))
            }
        }
    }
}

impl From<RingError> for Error {
    fn from(e: RingError) -> Self {
        match e {
            RingError::Broken(why) => Error::RingBroken(why),
            RingError::TooLarge { size, max } => {
                Error::InvalidArgument(format!("record of {size} bytes exceeds the ring's {max}-byte record limit"))
            }
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
