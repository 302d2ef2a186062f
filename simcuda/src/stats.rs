//! `simcuda_stats`: what this process holds in the simulated driver, for tests that look
//! the function up with dlsym (it exists only in simcuda, never in a real libcuda).

use std::sync::atomic::{AtomicU64, Ordering};

/// The calls that share or open memory, counted at every call (whatever its outcome) so a
/// test can show that a path makes none of them: `opening_calls` in [`SimcudaStats`].
const OPENING: [&str; 4] =
    ["cuIpcGetMemHandle", "cuIpcOpenMemHandle_v2", "cuMemExportToShareableHandle", "cuMemImportFromShareableHandle"];
static OPENING_CALLS: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];

/// Count a call of `name` if it is one of [`OPENING`].
pub fn called(name: &str) {
    if let Some(i) = OPENING.iter().position(|n| *n == name) {
        // Relaxed: statistics.
        OPENING_CALLS[i].fetch_add(1, Ordering::Relaxed);
    }
}

/// Counters of this process (a snapshot).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct SimcudaStats {
    /// Layout version of this struct (2: `opening_calls` added; 3: the stream memory
    /// operation and cross-process wait counters after it).
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
    /// Calls so far (cumulative, failed ones too) of `cuIpcGetMemHandle`,
    /// `cuIpcOpenMemHandle_v2`, `cuMemExportToShareableHandle`,
    /// `cuMemImportFromShareableHandle`, in that order.
    pub opening_calls: [u64; 4],
    /// Stream waits enqueued on an event record another process made (cumulative): what
    /// costs a GPU time-slice switch on hardware without MPS.
    pub xproc_event_waits: u64,
    /// Stream waits on a word enqueued (`cuStreamWaitValue32/64`, cumulative).
    pub value_waits: u64,
    /// Stream writes of a word enqueued (`cuStreamWriteValue32/64`, cumulative).
    pub value_writes: u64,
    /// Live host registrations (`cuMemHostRegister`).
    pub host_registrations: u64,
}

static XPROC_EVENT_WAITS: AtomicU64 = AtomicU64::new(0);
static VALUE_WAITS: AtomicU64 = AtomicU64::new(0);
static VALUE_WRITES: AtomicU64 = AtomicU64::new(0);

/// Count a cross-process event stream wait.
pub fn xproc_event_wait() {
    // Relaxed: statistics.
    XPROC_EVENT_WAITS.fetch_add(1, Ordering::Relaxed);
}

/// Count a stream value wait.
pub fn value_wait() {
    // Relaxed: statistics.
    VALUE_WAITS.fetch_add(1, Ordering::Relaxed);
}

/// Count a stream value write.
pub fn value_write() {
    // Relaxed: statistics.
    VALUE_WRITES.fetch_add(1, Ordering::Relaxed);
}

pub fn snapshot() -> SimcudaStats {
    let (vmm_handles, vmm_mappings, vmm_reservations) = crate::vmm::counts();
    SimcudaStats {
        version: 3,
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
        // Relaxed: statistics.
        opening_calls: std::array::from_fn(|i| OPENING_CALLS[i].load(Ordering::Relaxed)),
        // Relaxed: statistics.
        xproc_event_waits: XPROC_EVENT_WAITS.load(Ordering::Relaxed),
        value_waits: VALUE_WAITS.load(Ordering::Relaxed),
        value_writes: VALUE_WRITES.load(Ordering::Relaxed),
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
