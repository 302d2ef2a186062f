//! tensorwire: move PyTorch tensors between processes on one machine.
//!
//! The transport layer: sealed memfd [`Segment`]s shared by fd, validated [`TensorDesc`]
//! descriptors, per-peer lease tables that keep exported memory alive exactly as long as
//! the consumer needs it, and futex [`doorbell`]s. [`Peer`] ties them together over a
//! Unix-socket [`Connection`].
//!
//! ```no_run
//! use tensorwire::{DType, ExportOptions, Layout, Peer, PeerConfig, SharedTensor, Wait};
//! # fn main() -> tensorwire::Result<()> {
//! let (a, b) = Peer::pair(PeerConfig::default())?;
//! let t = SharedTensor::zeros(Layout::contiguous(DType::Float32, &[2, 3])?)?;
//! a.export(&t.view(t.layout().transpose(0, 1)?)?, ExportOptions::default())?;
//! let imported = b.recv_tensor(Wait::Forever)?; // aliases a's memory, zero-copy
//! assert_eq!(imported.layout().sizes(), &[3, 2]);
//! imported.release()?;                         // a's owner is dropped now
//! # Ok(()) }
//! ```

#![cfg_attr(loom, allow(dead_code, unused_imports))]

/// Items that exist only outside the loom model build (`--cfg loom` compiles just the
/// shared-memory protocols and their `sync` shim), as tokio's `cfg_*!` macros do: every
/// such re-export, here and in the modules (`lease`, `ring`). (`sync` picks std's or
/// loom's atomics with a `cfg` pair: both builds have them.)
macro_rules! cfg_not_loom {
    ($($item:item)*) => { $( #[cfg(not(loom))] $item )* };
}

pub mod error;
pub mod lease;
pub mod sync;
pub mod doorbell;
pub mod credits;
pub mod wait;
pub mod ring;
pub mod signal_word;
pub mod wire;

// Module declarations stay outside the macro: cbindgen does not expand macros, and it
// finds the types the C ABI names (the header's `tw_desc_t`, `tw_lease_t`) in their files.
#[cfg(not(loom))]
pub mod connection;
#[cfg(not(loom))]
pub mod cuda;
#[cfg(not(loom))]
pub mod desc;
#[cfg(not(loom))]
pub(crate) mod import_cache;
#[cfg(not(loom))]
pub mod peer;
#[cfg(not(loom))]
pub mod segment;
#[cfg(not(loom))]
mod shared_tensor;
#[cfg(not(loom))]
mod waiting;
#[cfg(not(loom))]
pub(crate) mod sys;
#[cfg(not(loom))]
pub mod os;
#[cfg(not(loom))]
mod payload;

cfg_not_loom! {
    pub use connection::{Connection, Listener};
    pub use desc::{DType, DeviceType, Layout, StorageKind, StorageRef, TensorDesc, DESC_SIZE, MAX_NDIM};
    pub use lease::{LeaseId, LeaseStats, Owner};
    pub use ring::{RingItem, RingMessage};
    pub use peer::{CudaImported, ExportOptions, Imported, Incoming, Peer, PeerConfig, SharedTensor};
    pub use segment::Segment;
}

pub use error::{Error, ErrorKind, Result};
pub use wait::Wait;

/// What the C ABI crate (`tensorwire-ffi`, ffi/) needs beyond this crate's public API:
/// only that crate uses it, and it may change with any release. Everything else the C ABI
/// calls is public API.
#[doc(hidden)]
#[cfg(not(loom))]
pub mod ffi_support {
    pub use crate::with_connection_options;
    use crate::{Error, Wait};

    /// The error of a wait `wait` for `what` that ran out, naming the time the caller
    /// asked for (as the library's own waits report it).
    pub fn timed_out(wait: Wait, what: &'static str) -> Error {
        wait.deadline().timed_out(what)
    }
}

/// The README's Rust examples, compiled and run as this crate's doctests so that they
/// stay true (its C examples are compiled by `tests/readme.rs`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeExamples;
