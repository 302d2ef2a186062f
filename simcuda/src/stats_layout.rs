//! The layout of `simcuda_stats`'s output, in a file of its own with no dependencies so
//! that the tests read the same definition (`tests/common/gpu.rs` includes this file with
//! `#[path]`) instead of a copy kept in step by hand.
//!
//! Fields are only ever appended (the struct a test built against an older layout is a
//! prefix of the new one), and `version` says which layout the library filled.

/// Layout version this file describes.
pub const LAYOUT_VERSION: u64 = 3;

/// Counters of this process (a snapshot).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SimcudaStats {
    /// Layout version of this struct (2: `opening_calls` added; 3: `xproc_event_waits`,
    /// `value_waits`, `value_writes`, `host_registrations` added).
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
    /// Cross-process event stream waits enqueued so far (cumulative): `cuStreamWaitEvent`
    /// calls whose captured record was made by another process (the wait that costs a GPU
    /// time-slice switch on hardware without MPS).
    pub xproc_event_waits: u64,
    /// Stream value waits (`cuStreamWaitValue32/64*`) enqueued so far (cumulative).
    pub value_waits: u64,
    /// Stream value writes (`cuStreamWriteValue32/64*`) enqueued so far (cumulative).
    pub value_writes: u64,
    /// Live host memory registrations (`cuMemHostRegister` not yet unregistered).
    pub host_registrations: u64,
}
