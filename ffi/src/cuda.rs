//! CUDA in C: driver presence, device count and the process's IPC handle cache.

use super::{guard, need, put, put_opt, quiet, tw_result_e};


/// This process's CUDA IPC handle cache: how many times it called cuIpcOpenMemHandle,
/// and how many handles are open now (either may be NULL).
///
/// # Safety
/// Each pointer NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_cuda_ipc_cache_stats(opens: *mut u64, open_handles: *mut u64) {
    quiet((), || {
        let c = tensorwire::cuda::ipc::cache();
        // SAFETY: each NULL or writable per the contract.
        unsafe {
            put_opt(opens, c.opens());
            put_opt(open_handles, c.stats().0 as u64);
        }
    })
}

/// How many unused opened IPC handles the cache keeps open (default 0: each handle closes
/// as soon as its last import is released). An opt-in: only for producers that keep
/// exported memory allocated — CUDA calls an exporter's `cuMemFree` before the importer
/// closed the handle undefined behaviour.
#[unsafe(no_mangle)]
pub extern "C" fn tw_cuda_ipc_cache_keep_warm(n: usize) {
    quiet((), || tensorwire::cuda::ipc::cache().set_keep_warm(n))
}

/// True if a CUDA driver is present and initialised.
#[unsafe(no_mangle)]
pub extern "C" fn tw_cuda_available() -> bool {
    quiet(false, tensorwire::cuda::available)
}

/// Number of CUDA devices; `TW_ERR_CUDA_UNAVAILABLE` (with the reason) without a driver.
///
/// # Safety
/// `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_cuda_device_count(out: *mut i32) -> tw_result_e {
    guard("tw_cuda_device_count", || {
        need(out, "out")?;
        let n = tensorwire::cuda::device_count()?;
        // SAFETY: checked non-null.
        unsafe { put(out, n as i32, "out") }
    })
}
