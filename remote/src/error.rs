//! One error enum per operation; none of them is ever a panic.

use std::fmt;

/// Why an export blob was rejected by [`crate::ExportBlob::decode`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlobError {
    /// Fewer bytes than the fixed header, or than the header says follow.
    Truncated { needed: usize, got: usize },
    /// Bytes left over after the fields the header describes.
    TrailingBytes { extra: usize },
    /// The first four bytes are not the blob magic.
    BadMagic,
    /// A version this build does not speak.
    UnsupportedVersion(u16),
    /// An engine id this build does not know.
    UnknownEngine(u8),
    /// Flag bits this version does not define.
    UnknownFlags(u8),
    /// Length zero or above [`crate::MAX_EXPORT_LEN`].
    BadLength(u64),
    /// Worker address empty, longer than [`crate::MAX_WORKER_ADDRESS_LEN`], or of an address
    /// version UCX does not know.
    BadWorkerAddress(usize),
    /// A scope key of this many bytes; it must be [`crate::KEY_LEN`].
    BadKey(usize),
}

/// Why an engine (context + worker) could not be started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineError {
    /// A UCX call failed: which call, and UCX's status string.
    Ucx { call: &'static str, status: String },
    /// The progress thread could not be spawned.
    Thread(String),
    /// The system's random source failed (a scope's key).
    Random(String),
}

/// Why a storage could not be exported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExportError {
    /// Empty storages are not exported (nothing to register).
    Empty,
    /// Longer than [`crate::MAX_EXPORT_LEN`].
    TooLong(usize),
    /// The blob could not be built (the exporter's worker address is one UCX would refuse).
    Blob(BlobError),
}

/// Why an import failed. The destination buffer's contents are unspecified after an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImportError {
    /// The destination buffer's length differs from the export's.
    LengthMismatch { export: u64, buffer: usize },
    /// The worker address in the blob could not be connected to.
    Connect(String),
    /// The exporter has no live export with this id under the blob's key: never made,
    /// released already, or another connection's.
    UnknownExport(u64),
    /// The exporter's export has a different length than the blob says.
    ExporterLengthMismatch { export: u64, requested: u64 },
    /// The exporter's answer was not a well-formed answer to our request.
    BadReply(String),
    /// The transfer failed (the request's send, the receive, or their completion).
    Transfer(String),
    /// The exporter went away (its endpoint reported an error) during the transfer.
    PeerLost(String),
    /// The transfer did not complete in time; it was cancelled before returning.
    Timeout,
}

/// Why a release was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReleaseError {
    /// No live export with this id in this scope (already released, or another scope's).
    UnknownExport(u64),
}

macro_rules! display_via_debug {
    ($($t:ty),*) => {$(
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(self, f)
            }
        }
        impl std::error::Error for $t {}
    )*};
}
display_via_debug!(
    BlobError,
    EngineError,
    ExportError,
    ImportError,
    ReleaseError
);
