//! `simcuda_stats`: what this process holds in the simulated driver, for tests that look
//! the function up with dlsym (it exists only in simcuda, never in a real libcuda).

/// Counters of this process (a snapshot).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct SimcudaStats {
    /// Layout version of this struct (1).
    pub version: u64,
    /// Live `cuMemAlloc` allocations.
    pub allocations: u64,
    /// IPC memory handles open in this process (distinct mappings).
    pub ipc_open_handles: u64,
    /// Live events (created or opened).
    pub events: u64,
    /// Live created streams (the legacy streams are not counted).
    pub streams: u64,
    /// Sum of primary-context retain counts.
    pub context_retains: u64,
    /// VMM generic allocation handles not yet released.
    pub vmm_handles: u64,
    /// Live VMM mappings.
    pub vmm_mappings: u64,
    /// Live address reservations.
    pub vmm_reservations: u64,
    /// `cuMemFree` calls made while another live process had the allocation's IPC handle open.
    pub free_while_imported: u64,
    /// Calls failed on purpose by `SIMCUDA_FAIL`.
    pub faults_injected: u64,
}

pub fn snapshot() -> SimcudaStats {
    let (vmm_handles, vmm_mappings, vmm_reservations) = crate::vmm::counts();
    SimcudaStats {
        version: 1,
        allocations: crate::memory::live_allocations(),
        ipc_open_handles: crate::ipc::open_handles(),
        events: crate::events::live_events(),
        streams: crate::stream::live_streams(),
        context_retains: crate::context::live_retains(),
        vmm_handles,
        vmm_mappings,
        vmm_reservations,
        free_while_imported: crate::ipc::free_while_open(),
        faults_injected: crate::faults::injected(),
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
