//! The counters `simcuda_stats` reports that are bumped where the thing happens (the
//! snapshot and the export: `exports_stats.rs`).

use std::sync::atomic::{AtomicU64, Ordering};

/// The calls that share or open memory, counted at every call (whatever its outcome) so a
/// test can show that a path makes none of them: `opening_calls` in [`SimcudaStats`].
pub const OPENING: [&str; 4] =
    ["cuIpcGetMemHandle", "cuIpcOpenMemHandle_v2", "cuMemExportToShareableHandle", "cuMemImportFromShareableHandle"];
pub static OPENING_CALLS: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];

/// Cumulative counters bumped where the thing happens (see [`SimcudaStats`]).
pub static XPROC_EVENT_WAITS: AtomicU64 = AtomicU64::new(0);
pub static VALUE_WAITS: AtomicU64 = AtomicU64::new(0);
pub static VALUE_WRITES: AtomicU64 = AtomicU64::new(0);

/// Count a call of `name` if it is one of [`OPENING`].
pub fn called(name: &str) {
    if let Some(i) = OPENING.iter().position(|n| *n == name) {
        // Relaxed: statistics.
        OPENING_CALLS[i].fetch_add(1, Ordering::Relaxed);
    }
}

/// Add one to a cumulative counter.
pub fn count(c: &AtomicU64) {
    // Relaxed: statistics.
    c.fetch_add(1, Ordering::Relaxed);
}

