//! Bulk transfer of tensor storages between processes that may sit on different machines.
//!
//! The interface is engine-neutral: an exporter **registers** a storage (pointer + length,
//! kept alive by its owner) and gets an [`ExportBlob`] — small, versioned, self-describing
//! bytes (engine, worker address, remote key, address, length) that travel over the
//! caller's control connection. The importer **imports** from a blob into a buffer it
//! allocated (a one-sided get) and then tells the exporter to **release** the export over
//! the same connection. An export is held until it is released or until the exporter-side
//! scope of the connection it was made for is dropped (the connection died).
//!
//! The first engine is UCX (feature `ucx`, through the `ucx-rs` crate's raw `sys` layer);
//! see the `ucx` module. Blobs are decoded by [`ExportBlob::decode`], which copies nothing it has
//! not bounds-checked and names every rejection ([`BlobError`]).
//!
//! Layout: `blob.rs` (the wire format of an export blob), `storage.rs` (what can be
//! registered and who keeps it alive), `error.rs` (one error enum per operation),
//! `ucx/` (the engine: `worker.rs` owns a UCX context + worker, `export.rs` the exporter
//! and its progress thread, `import.rs` the importer, `rkey.rs` the structural check of a
//! packed remote key).

mod blob;
mod error;
mod storage;
#[cfg(feature = "ucx")]
pub mod ucx;

pub use blob::{
    BLOB_VERSION, Engine, ExportBlob, MAX_EXPORT_LEN, MAX_RKEY_LEN, MAX_WORKER_ADDRESS_LEN,
};
pub use error::{BlobError, EngineError, ExportError, ImportError, ReleaseError};
pub use storage::Storage;
