//! simcuda's own strictness, checked through the raw driver API: what the real driver
//! documents (or does) and simcuda must do too, so that tensorwire's CUDA code tested on it
//! meets the same rules. Every test needs simcuda (`simcuda/run.sh cargo test --test
//! simcuda_driver`) and says SKIPPED otherwise.

mod common;

use common::gpu::*;
use cudarc::driver::sys::{self, CUresult};
use std::process::{Command, Stdio};
use tensorwire::cuda::driver::{DeviceBuffer, call, ensure_context};

const CHILD_ENV: &str = "TW_SIMDRV_CHILD";

fn on_simcuda(test: &str) -> bool {
    if !gpu(test) {
        return false;
    }
    if sim_stats().is_none() {
        eprintln!("SKIPPED {test}: needs simcuda, not a real driver (run under simcuda/run.sh)");
        return false;
    }
    true
}

/// Run `body` in a fresh thread (no current context).
fn on_fresh_thread<T: Send + 'static>(body: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(body).join().unwrap()
}

/// Re-run this binary's `child` test with CHILD_ENV=`what`; its exit status.
fn run_child(what: &str) -> std::process::ExitStatus {
    Command::new(std::env::current_exe().unwrap())
        .args(["child", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, what)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap()
}

#[test]
#[ignore = "entry point of the child processes"]
fn child() {
    match std::env::var(CHILD_ENV).as_deref() {
        // Before cuInit every call but the few documented ones is NOT_INITIALIZED.
        Ok("before_init") => {
            let mut n = 0;
            // SAFETY: valid out-pointer; the library is loaded by cudarc on first use.
            let r = unsafe { sys::cuDeviceGetCount(&mut n) };
            std::process::exit(if r == CUresult::CUDA_ERROR_NOT_INITIALIZED { 0 } else { 1 });
        }
        // A host read of a device pointer must fault.
        Ok("deref") => {
            let b = DeviceBuffer::alloc(0, 4096).unwrap();
            // SAFETY: deliberately not: this must crash the child (device memory is not
            // host memory); volatile so the read is not optimised away.
            let v = unsafe { std::ptr::read_volatile(b.ptr().get() as *const u8) };
            println!("{v}");
            std::process::exit(0);
        }
        _ => {}
    }
}

#[test]
fn calls_before_cuinit_are_not_initialized() {
    if !on_simcuda("calls_before_cuinit_are_not_initialized") {
        return;
    }
    assert!(run_child("before_init").success());
}

#[test]
fn a_host_dereference_of_a_device_pointer_faults() {
    if !on_simcuda("a_host_dereference_of_a_device_pointer_faults") {
        return;
    }
    use std::os::unix::process::ExitStatusExt;
    let st = run_child("deref");
    assert_eq!(st.signal(), Some(libc::SIGSEGV), "{st:?}");
}

#[test]
fn calls_without_a_current_context_are_invalid_context() {
    if !on_simcuda("calls_without_a_current_context_are_invalid_context") {
        return;
    }
    on_fresh_thread(|| {
        let mut p = 0;
        let mut d = 0;
        let mut c: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointers; no context is current on this new thread.
        unsafe {
            assert_eq!(sys::cuMemAlloc_v2(&mut p, 64), CUresult::CUDA_ERROR_INVALID_CONTEXT);
            assert_eq!(sys::cuCtxGetDevice(&mut d), CUresult::CUDA_ERROR_INVALID_CONTEXT);
            assert_eq!(sys::cuCtxPopCurrent_v2(&mut c), CUresult::CUDA_ERROR_INVALID_CONTEXT);
            assert_eq!(sys::cuCtxGetCurrent(&mut c), CUresult::CUDA_SUCCESS);
        }
        assert!(c.is_null());
    });
}

#[test]
fn ipc_memory_handles_follow_the_documented_rules() {
    if !on_simcuda("ipc_memory_handles_follow_the_documented_rules") {
        return;
    }
    let b = DeviceBuffer::alloc(0, 8192).unwrap();
    let _c = ensure_context(0).unwrap();
    let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: valid out-pointers and handles throughout.
    unsafe {
        assert_eq!(sys::cuIpcGetMemHandle(&mut h, b.ptr().get() + 256), CUresult::CUDA_ERROR_INVALID_VALUE, "interior pointer");
        assert_eq!(sys::cuIpcGetMemHandle(&mut h, b.ptr().get()), CUresult::CUDA_SUCCESS);
        let mut p = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        assert_eq!(sys::cuIpcOpenMemHandle_v2(&mut p, h, flags), CUresult::CUDA_ERROR_INVALID_CONTEXT, "exporting process");
        assert_eq!(sys::cuIpcCloseMemHandle(b.ptr().get()), CUresult::CUDA_ERROR_INVALID_VALUE, "not opened");
        let mut forged = h;
        forged.reserved[16] ^= 1;
        assert_ne!(sys::cuIpcOpenMemHandle_v2(&mut p, forged, flags), CUresult::CUDA_SUCCESS, "forged handle");
    }
    // In another process: a second open counts a reference and returns the same pointer;
    // the third close is an error; a free while it is open is reported.
    let handle = h.reserved.map(|c| c as u8);
    let before = sim_stats().unwrap().free_while_imported;
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["ipc_open_twice_helper", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env("TW_SIMDRV_HANDLE", handle.iter().map(|b| format!("{b:02x}")).collect::<String>())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = out;
    // Wait for the helper to say it holds the handle open.
    use std::io::{BufRead, Write};
    let mut line = String::new();
    let mut r = std::io::BufReader::new(out.stdout.take().unwrap());
    while !line.contains("HELD") {
        line.clear();
        assert!(r.read_line(&mut line).unwrap() > 0, "helper ended early");
    }
    assert!(line.contains("same=1"), "a second open must return the same pointer: {line}");
    drop(b);
    assert_eq!(sim_stats().unwrap().free_while_imported, before + 1, "the free under an open handle was reported");
    out.stdin.take().unwrap().write_all(b"x").unwrap();
    assert!(out.wait().unwrap().success());
}

#[test]
#[ignore = "helper process of ipc_memory_handles_follow_the_documented_rules"]
fn ipc_open_twice_helper() {
    let Ok(hex) = std::env::var("TW_SIMDRV_HANDLE") else { return };
    let bytes: Vec<u8> = (0..64).map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap()).collect();
    let h = sys::CUipcMemHandle { reserved: std::array::from_fn(|i| bytes[i] as std::ffi::c_char) };
    assert!(tensorwire::cuda::available());
    let _c = ensure_context(0).unwrap();
    let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
    let (mut p1, mut p2) = (0, 0);
    // SAFETY: valid out-pointers; the handle came from the parent.
    let same = unsafe {
        assert_eq!(sys::cuIpcOpenMemHandle_v2(&mut p1, h, flags), CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuIpcOpenMemHandle_v2(&mut p2, h, flags), CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuIpcCloseMemHandle(p1), CUresult::CUDA_SUCCESS);
        // One reference left: keep it open while the parent frees.
        let same = p1 == p2;
        let mut p3 = 0;
        assert_eq!(sys::cuIpcOpenMemHandle_v2(&mut p3, h, flags), CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuIpcCloseMemHandle(p3), CUresult::CUDA_SUCCESS);
        same
    };
    println!("HELD same={}", u8::from(same));
    let mut b = [0u8];
    let _ = std::io::Read::read(&mut std::io::stdin(), &mut b);
    // SAFETY: closing the last reference, then once too often.
    unsafe {
        assert_eq!(sys::cuIpcCloseMemHandle(p2), CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuIpcCloseMemHandle(p2), CUresult::CUDA_ERROR_INVALID_VALUE);
    }
}

#[test]
fn events_follow_the_documented_rules() {
    if !on_simcuda("events_follow_the_documented_rules") {
        return;
    }
    let s = Stream::new();
    let scratch = DeviceBuffer::alloc(0, 1 << 16).unwrap();
    let _c = ensure_context(0).unwrap();
    let mut ev: sys::CUevent = std::ptr::null_mut();
    let mut h = sys::CUipcEventHandle { reserved: [0; 64] };
    let ipc = sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32;
    let no_timing = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    // SAFETY: valid out-pointers, events and streams throughout.
    unsafe {
        assert_eq!(sys::cuEventCreate(&mut ev, ipc), CUresult::CUDA_ERROR_INVALID_VALUE, "INTERPROCESS without DISABLE_TIMING");
        assert_eq!(sys::cuEventCreate(&mut ev, no_timing), CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuIpcGetEventHandle(&mut h, ev), CUresult::CUDA_ERROR_INVALID_HANDLE, "not an interprocess event");
        assert_eq!(sys::cuEventQuery(ev), CUresult::CUDA_SUCCESS, "never recorded: complete");
        for _ in 0..200 {
            memset_async(scratch.ptr(), 1, 1 << 16, s.0);
        }
        assert_eq!(sys::cuEventRecord(ev, raw(s.0)), CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuEventQuery(ev), CUresult::CUDA_ERROR_NOT_READY, "recorded behind 200 queued ops");
        assert_eq!(sys::cuEventSynchronize(ev), CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuEventQuery(ev), CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuEventDestroy_v2(ev), CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuEventCreate(&mut ev, ipc | no_timing), CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuIpcGetEventHandle(&mut h, ev), CUresult::CUDA_SUCCESS);
        let mut opened: sys::CUevent = std::ptr::null_mut();
        assert_eq!(sys::cuIpcOpenEventHandle(&mut opened, h), CUresult::CUDA_ERROR_INVALID_CONTEXT, "exporting process");
        assert_eq!(sys::cuEventDestroy_v2(ev), CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuEventDestroy_v2(ev), CUresult::CUDA_ERROR_INVALID_HANDLE, "destroyed twice");
    }
}

/// Work on the legacy default stream waits for earlier work on blocking streams: a
/// synchronous read sees what a blocking stream wrote before it, delays or not.
#[test]
fn the_legacy_stream_orders_with_blocking_streams() {
    if !on_simcuda("the_legacy_stream_orders_with_blocking_streams") {
        return;
    }
    let s = Stream::new();
    let b = DeviceBuffer::alloc(0, 4096).unwrap();
    for i in 0..20u8 {
        for _ in 0..5 {
            memset_async(b.ptr(), i.wrapping_sub(1), 4096, s.0);
        }
        memset_async(b.ptr(), i, 4096, s.0);
        assert!(dtoh(b.ptr(), 4096).iter().all(|&x| x == i), "round {i}: the legacy stream overtook a blocking stream");
    }
}

#[test]
fn vmm_follows_the_documented_rules() {
    if !on_simcuda("vmm_follows_the_documented_rules") {
        return;
    }
    let before = sim_stats().unwrap();
    let a = tensorwire::cuda::vmm::VmmAllocation::create(0, 4096).unwrap();
    assert_eq!(a.size(), 2 << 20, "rounded up to the granularity");
    assert!(!tensorwire::cuda::driver::is_legacy_ipc_capable(a.ptr()).unwrap());
    let b = DeviceBuffer::alloc(0, 4096).unwrap();
    assert!(tensorwire::cuda::driver::is_legacy_ipc_capable(b.ptr()).unwrap());
    let _c = ensure_context(0).unwrap();
    let (mut base, mut size) = (0, 0);
    let mut h = 0;
    // SAFETY: valid out-pointers and addresses throughout.
    unsafe {
        assert_eq!(sys::cuMemGetAddressRange_v2(&mut base, &mut size, a.ptr().get() + 12345), CUresult::CUDA_SUCCESS);
        assert_eq!((base, size), (a.ptr().get(), 2 << 20), "VMM: the mapping");
        assert_eq!(sys::cuMemGetAddressRange_v2(&mut base, &mut size, b.ptr().get() + 100), CUresult::CUDA_SUCCESS);
        assert_eq!((base, size), (b.ptr().get(), 4096), "cuMemAlloc: the allocation");
        assert_eq!(sys::cuMemRetainAllocationHandle(&mut h, (a.ptr().get() + 4096) as *mut _), CUresult::CUDA_SUCCESS, "interior address");
        let mut h2 = 0;
        assert_eq!(sys::cuMemRetainAllocationHandle(&mut h2, b.ptr().get() as *mut _), CUresult::CUDA_ERROR_INVALID_VALUE, "not VMM");
        assert_eq!(sys::cuMemRelease(h), CUresult::CUDA_SUCCESS);
        let mut ipc = sys::CUipcMemHandle { reserved: [0; 64] };
        assert_eq!(sys::cuIpcGetMemHandle(&mut ipc, a.ptr().get()), CUresult::CUDA_ERROR_INVALID_VALUE, "VMM memory has no legacy handle");
    }
    // Export by fd and import in this process: the same pages.
    let fd = a.export_fd().unwrap();
    let imp = tensorwire::cuda::vmm::VmmAllocation::import_fd(&fd, 0, a.size()).unwrap();
    htod(a.ptr() + 100, b"vmm!");
    assert_eq!(dtoh(imp.ptr() + 100, 4), b"vmm!");
    // A mapping whose access was never set cannot be copied into.
    let (mut r, mut ph) = (0, 0);
    // SAFETY: as above.
    unsafe {
        let mut prop: sys::CUmemAllocationProp = std::mem::zeroed();
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        assert_eq!(sys::cuMemCreate(&mut ph, 2 << 20, &prop, 0), CUresult::CUDA_SUCCESS);
        let mut fd_out = -1i32;
        let posix = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        assert_eq!(sys::cuMemExportToShareableHandle((&mut fd_out as *mut i32).cast(), ph, posix, 0), CUresult::CUDA_ERROR_INVALID_VALUE, "fd type not requested");
        assert_eq!(sys::cuMemAddressReserve(&mut r, 2 << 20, 0, 0, 0), CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuMemMap(r, 2 << 20, 0, ph, 0), CUresult::CUDA_SUCCESS);
        let x = [1u8; 8];
        assert_eq!(sys::cuMemcpyHtoD_v2(r, x.as_ptr().cast(), 8), CUresult::CUDA_ERROR_INVALID_VALUE, "no access set");
        assert_eq!(sys::cuMemAddressFree(r, 2 << 20), CUresult::CUDA_ERROR_INVALID_VALUE, "still mapped");
        assert_eq!(sys::cuMemUnmap(r, 2 << 20), CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuMemAddressFree(r, 2 << 20), CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuMemRelease(ph), CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuMemRelease(ph), CUresult::CUDA_ERROR_INVALID_VALUE, "released twice");
    }
    drop((imp, fd, a));
    let after = sim_stats().unwrap();
    // Other tests of this binary run at the same time: compare only what no other test here
    // creates.
    assert_eq!((after.vmm_handles, after.vmm_mappings, after.vmm_reservations), (before.vmm_handles, before.vmm_mappings, before.vmm_reservations));
    let _ = call("cuCtxSynchronize", || CUresult::CUDA_SUCCESS);
}
