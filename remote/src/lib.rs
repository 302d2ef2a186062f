//! Bulk transfer of tensor storages between processes that may sit on different machines.
//!
//! The interface is engine-neutral: an exporter **exports** a storage (pointer + length,
//! kept alive by its owner) in a scope (one per importer connection) and gets an
//! [`ExportBlob`] — small, versioned, self-describing bytes (engine, export id, length, the
//! scope's random key, the exporter's worker address) that travel over the caller's
//! control connection. The importer **imports** from a blob into a buffer it owns: it asks
//! the exporter for the export by id and key, and the exporter sends exactly that export's
//! bytes (two-sided: nothing the importer sends names an address in the exporter). Then the
//! importer tells the exporter to **release** the export over the control connection. An
//! export is held until it is released or until its scope is dropped (the connection died).
//!
//! The first engine is UCX (feature `ucx`, through the `ucx-rs` crate's raw `sys` layer);
//! see the `ucx` module. Blobs are decoded by [`ExportBlob::decode`], which copies nothing it has
//! not bounds-checked and names every rejection ([`BlobError`]).
//!
//! Layout: `blob.rs` (the wire format of an export blob), `storage.rs` (what can be
//! exported or imported into, and who keeps it alive), `error.rs` (one error enum per
//! operation), `ucx/` (the engine: `worker.rs` owns a UCX context + worker, `proto.rs` the
//! request and reply headers, `export.rs` the exporter and its progress thread, `import.rs`
//! the importer).

mod blob;
mod error;
mod storage;
#[cfg(feature = "ucx")]
pub mod ucx;

pub use blob::{BLOB_VERSION, Engine, ExportBlob, KEY_LEN, MAX_EXPORT_LEN, MAX_WORKER_ADDRESS_LEN};
pub use error::{BlobError, EngineError, ExportError, ImportError, ReleaseError};
pub use storage::{Destination, Storage};
