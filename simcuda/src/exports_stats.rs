//! `simcuda_stats`: what this process holds in the simulated driver, for tests that look
//! the function up with dlsym (it exists only in simcuda, never in a real libcuda). The
//! struct's layout is in `stats_layout.rs`; the counters bumped as things happen in
//! `stats.rs`; the rest is read from each module here, at the top.

use crate::stats;
pub use crate::stats_layout::{LAYOUT_VERSION, SimcudaStats};
use std::sync::atomic::{AtomicU64, Ordering};

fn read(c: &AtomicU64) -> u64 {
    // Relaxed: statistics.
    c.load(Ordering::Relaxed)
}

pub fn snapshot() -> SimcudaStats {
    let (vmm_handles, vmm_mappings, vmm_reservations) = crate::vmm::counts();
    SimcudaStats {
        version: LAYOUT_VERSION,
        allocations: crate::allocation::live_allocations(),
        ipc_open_handles: crate::ipc::open_handles(),
        events: crate::events::live_events(),
        streams: crate::stream::live_streams(),
        context_retains: crate::context::live_retains(),
        vmm_handles,
        vmm_mappings,
        vmm_reservations,
        free_while_imported: crate::ipc::free_while_open(),
        faults_injected: crate::faults::injected(),
        opening_calls: std::array::from_fn(|i| read(&stats::OPENING_CALLS[i])),
        xproc_event_waits: read(&stats::XPROC_EVENT_WAITS),
        value_waits: read(&stats::VALUE_WAITS),
        value_writes: read(&stats::VALUE_WRITES),
        host_registrations: crate::host_register::live(),
    }
}

/// Fill `*out` with this process's counters; 0 on success, 1 for a null pointer.
///
/// # Safety
/// `out` must be null or point to writable memory for one `SimcudaStats`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn simcuda_stats(out: *mut SimcudaStats) -> i32 {
    if out.is_null() {
        return 1;
    }
    let s = std::panic::catch_unwind(snapshot).unwrap_or_default();
    // SAFETY: non-null, and the caller promises room for one SimcudaStats.
    unsafe { out.write(s) };
    0
}
