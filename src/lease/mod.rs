//! Leases (keeper windows): exported memory stays alive until the consumer is done.
//!
//! Per peer, the producer creates a lease table in a sealed memfd and hands it to the
//! consumer at connection setup. The table holds only slot words (`slot.rs`) and a
//! doorbell; the owners — whatever keeps the memory alive — live in the producer's
//! private [`Exporter`]. An owner is dropped exactly once, by whichever of these removes
//! it from the private table first: the consumer's release (seen by the reaper), the
//! lease's window running out, or the peer's death / the connection's end.

pub mod slot;

#[cfg(not(loom))]
mod table;
cfg_not_loom! {
    pub use table::{lost_fd_slots, release_doorbell, Exporter, Reclaimed, ImportTable, LeaseId, LeaseStats, Owner, ShownStorage, StorageKeeper, MessageLine};
    pub use crate::wire::lease_table::{MESSAGE_LINE_OFFSET, TABLE_HEADER_BYTES, TABLE_VERSION};
}
