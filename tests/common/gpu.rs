//! Helpers for the CUDA tests (`tests/cuda_sim.rs`): raw driver calls for filling and
//! reading device memory, streams, the simulated driver's counters (only when the loaded
//! libcuda is simcuda: found by dlsym of `simcuda_stats`); the child-process harness is
//! `process` (re-exported here).
//!
//! The same tests run on a real GPU: nothing here depends on simcuda except
//! [`sim_stats`], which returns `None` on a real driver.

#![allow(dead_code)]

use cudarc::driver::sys;
use tensorwire::cuda::driver::{call, ensure_context};
use tensorwire::cuda::{CudaStream, DevicePtr};

pub use super::process::*;
/// Patterned test bytes (`pattern(seed, len)`), as every crate's tests write them.
pub use tensorwire_test_support::pattern;

/// True if a CUDA driver with a device is loaded; otherwise says loudly that `test` was
/// skipped (run the suite under `simcuda/run.sh`, or on a GPU machine).
pub fn gpu(test: &str) -> bool {
    if tensorwire::cuda::available() && tensorwire::cuda::device_count().unwrap_or(0) > 0 {
        return true;
    }
    eprintln!("SKIPPED {test}: no CUDA driver loaded (run under simcuda/run.sh, or on a GPU machine)");
    false
}

/// `simcuda_stats` layout: simcuda's own definition (one file with no dependencies), so the
/// tests and the library cannot disagree on it.
#[path = "../../simcuda/src/stats_layout.rs"]
mod stats_layout;
#[allow(unused_imports)] // the layout version: not every test binary checks it
pub use stats_layout::{LAYOUT_VERSION as SIM_STATS_VERSION, SimcudaStats as SimStats};

/// The simulated driver's counters for this process; `None` on a real driver.
pub fn sim_stats() -> Option<SimStats> {
    type F = unsafe extern "C" fn(*mut SimStats) -> i32;
    // SAFETY: dlopen of the already-loaded driver (NOLOAD: never loads anything new) and
    // a symbol lookup; the handle is left open (the library stays loaded anyway).
    let f = unsafe {
        let h = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        let h = if h.is_null() { libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) } else { h };
        if h.is_null() {
            return None;
        }
        let s = libc::dlsym(h, c"simcuda_stats".as_ptr());
        if s.is_null() {
            return None;
        }
        std::mem::transmute::<*mut libc::c_void, F>(s)
    };
    let mut st = SimStats::default();
    // SAFETY: simcuda's exported function, writing one SimcudaStats.
    (unsafe { f(&mut st) } == 0).then_some(st)
}

/// Copy `bytes` to device memory at `dptr` (legacy stream; the copy is ordered before
/// later legacy-stream work and blocking streams' work).
pub fn htod(dptr: DevicePtr, bytes: &[u8]) {
    let _c = ensure_context(0).unwrap();
    // SAFETY: `bytes` is readable for its length; dptr is a live allocation of the caller's.
    call("cuMemcpyHtoD", || unsafe { sys::cuMemcpyHtoD_v2(dptr.get(), bytes.as_ptr().cast(), bytes.len()) }).unwrap();
}

/// Queue a copy of `bytes` to `dptr` on `stream` (staged at once: `bytes` may go).
pub fn htod_async(dptr: DevicePtr, bytes: &[u8], stream: CudaStream) {
    let _c = ensure_context(0).unwrap();
    // SAFETY: as in `htod`; pageable memory is staged before the call returns.
    call("cuMemcpyHtoDAsync", || unsafe { sys::cuMemcpyHtoDAsync_v2(dptr.get(), bytes.as_ptr().cast(), bytes.len(), raw(stream)) })
        .unwrap();
}

/// Read `n` bytes at `dptr` (legacy stream, synchronous).
pub fn dtoh(dptr: DevicePtr, n: usize) -> Vec<u8> {
    let _c = ensure_context(0).unwrap();
    let mut v = vec![0u8; n];
    // SAFETY: `v` has room for n bytes.
    call("cuMemcpyDtoH", || unsafe { sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), dptr.get(), n) }).unwrap();
    v
}

/// Read `n` bytes at `dptr`, ordered on `stream` (returns once read).
pub fn dtoh_on(dptr: DevicePtr, n: usize, stream: CudaStream) -> Vec<u8> {
    let _c = ensure_context(0).unwrap();
    let mut v = vec![0u8; n];
    // SAFETY: `v` has room for n bytes; the call returns once the copy completed, then
    // the stream is synchronised (pinned-memory drivers return earlier).
    call("cuMemcpyDtoHAsync", || unsafe { sys::cuMemcpyDtoHAsync_v2(v.as_mut_ptr().cast(), dptr.get(), n, raw(stream)) })
        .unwrap();
    sync(stream);
    v
}

/// Queue a memset of `n` bytes at `dptr` on `stream`.
pub fn memset_async(dptr: DevicePtr, v: u8, n: usize, stream: CudaStream) {
    let _c = ensure_context(0).unwrap();
    // SAFETY: dptr is a live allocation of the caller's with room for n bytes.
    call("cuMemsetD8Async", || unsafe { sys::cuMemsetD8Async(dptr.get(), v, n, raw(stream)) }).unwrap();
}

/// The driver's handle of `stream`.
pub fn raw(stream: CudaStream) -> sys::CUstream {
    stream.0 as sys::CUstream
}

/// A stream of device 0.
pub struct Stream(pub CudaStream);

impl Stream {
    pub fn new() -> Stream {
        let _c = ensure_context(0).unwrap();
        let mut s: sys::CUstream = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        call("cuStreamCreate", || unsafe { sys::cuStreamCreate(&mut s, 0) }).unwrap();
        Stream(CudaStream(s as usize))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _c = ensure_context(0);
        // SAFETY: a stream we created, destroyed once.
        let _ = call("cuStreamDestroy", || unsafe { sys::cuStreamDestroy_v2(raw(self.0)) });
    }
}

pub fn sync(stream: CudaStream) {
    let _c = ensure_context(0).unwrap();
    // SAFETY: a live stream of the current context.
    call("cuStreamSynchronize", || unsafe { sys::cuStreamSynchronize(raw(stream)) }).unwrap();
}

