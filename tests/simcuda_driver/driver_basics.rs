//! Initialisation, contexts, error names, IPC memory handles, events, the legacy stream, VMM.

use super::*;

#[test]
fn calls_before_cuinit_are_not_initialized() {
    if !gpu("calls_before_cuinit_are_not_initialized") {
        return;
    }
    assert!(run_child("before_init").success());
}

#[test]
fn a_host_dereference_of_a_device_pointer_faults() {
    // simcuda-only: hardware faults too on a machine without host access to device memory,
    // but one with HMM/ATS may not.
    if !sim_only("a_host_dereference_of_a_device_pointer_faults") {
        return;
    }
    use std::os::unix::process::ExitStatusExt;
    let st = run_child("deref");
    assert_eq!(st.signal(), Some(libc::SIGSEGV), "{st:?}");
}

#[test]
fn calls_without_a_current_context_are_invalid_context() {
    if !gpu("calls_without_a_current_context_are_invalid_context") {
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
            assert_eq!(sys::cuCtxGetCurrent(&mut c), OK);
            let mut x = 0u32;
            let r = sys::cuMemHostRegister_v2((&raw mut x).cast(), 4, PORTABLE);
            strict("cuMemHostRegister_v2 without a current context", r, CUresult::CUDA_ERROR_INVALID_CONTEXT);
            if r == OK {
                assert_eq!(sys::cuMemHostUnregister((&raw mut x).cast()), OK);
            }
            let r = wait32(std::ptr::null_mut(), 0, 0, GEQ);
            strict("cuStreamWaitValue32_v2 (address 0) without a current context", r, CUresult::CUDA_ERROR_INVALID_CONTEXT);
        }
        assert!(c.is_null());
    });
}

#[test]
fn cuda_error_names_cover_the_new_codes() {
    if !gpu("cuda_error_names_cover_the_new_codes") {
        return;
    }
    for (code, name) in [
        (CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"),
        (CUresult::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"),
        (NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED"),
    ] {
        assert_eq!(tensorwire::cuda::driver::error_name(code), name);
        let mut s: *const std::ffi::c_char = std::ptr::null();
        // SAFETY: valid out-pointer; the driver writes a static string.
        assert_eq!(unsafe { sys::cuGetErrorString(code, &mut s) }, OK);
        assert!(!s.is_null());
    }
}

#[test]
fn ipc_memory_handles_follow_the_documented_rules() {
    if !gpu("ipc_memory_handles_follow_the_documented_rules") {
        return;
    }
    let b = DeviceBuffer::alloc(0, 8192).unwrap();
    let _c = ensure_context(0).unwrap();
    let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
    let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
    // SAFETY: valid out-pointers and handles throughout.
    unsafe {
        strict("cuIpcGetMemHandle of an interior pointer", sys::cuIpcGetMemHandle(&mut h, b.ptr().get() + 256), INVALID_VALUE);
        assert_eq!(sys::cuIpcGetMemHandle(&mut h, b.ptr().get()), OK);
        let mut p = 0;
        assert_eq!(sys::cuIpcOpenMemHandle_v2(&mut p, h, flags), CUresult::CUDA_ERROR_INVALID_CONTEXT, "exporting process [S10]");
        strict("cuIpcCloseMemHandle of a pointer never opened", sys::cuIpcCloseMemHandle(b.ptr().get()), INVALID_VALUE);
        if on_sim() {
            let mut forged = h;
            forged.reserved[16] ^= 1;
            assert_ne!(sys::cuIpcOpenMemHandle_v2(&mut p, forged, flags), OK, "forged handle");
        }
    }
    // In another process: a second open counts a reference and returns the same pointer;
    // the third close is an error; on simcuda a free while it is open is reported (on a
    // real driver that free is undefined behaviour: the helper closes first there).
    let before = on_sim().then(|| sim_stats().unwrap().free_while_imported);
    let mut out = Command::new(std::env::current_exe().unwrap())
        .args(["driver_basics::ipc_open_twice_helper", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env(HANDLE_ENV, hex(&h.reserved))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Wait for the helper to say it holds the handle open.
    let mut line = String::new();
    let mut r = BufReader::new(out.stdout.take().unwrap());
    while !line.contains("HELD") {
        line.clear();
        assert!(r.read_line(&mut line).unwrap() > 0, "helper ended early");
    }
    assert!(line.contains("same=1"), "a second open must return the same pointer: {line}");
    if let Some(before) = before {
        drop(b);
        assert_eq!(sim_stats().unwrap().free_while_imported, before + 1, "the free under an open handle was reported");
    }
    out.stdin.take().unwrap().write_all(b"x").unwrap();
    // The helper's answer to a close once too often, checked (or printed) here.
    while !line.starts_with("CLOSED") {
        line.clear();
        assert!(r.read_line(&mut line).unwrap() > 0, "helper ended early");
        line = line.split_once("CLOSED").map_or(String::new(), |(_, rest)| format!("CLOSED{rest}"));
    }
    strict("cuIpcCloseMemHandle once too often", line.trim_end(), "CLOSED CUDA_ERROR_INVALID_VALUE");
    assert!(out.wait().unwrap().success());
}

#[test]
#[ignore = "helper process of ipc_memory_handles_follow_the_documented_rules"]
fn ipc_open_twice_helper() {
    let Ok(hex) = std::env::var(HANDLE_ENV) else { return };
    let h = sys::CUipcMemHandle { reserved: unhex(&hex) };
    assert!(tensorwire::cuda::available());
    let _c = ensure_context(0).unwrap();
    let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
    let (mut p1, mut p2) = (0, 0);
    // SAFETY: valid out-pointers; the handle came from the parent.
    let same = unsafe {
        assert_eq!(sys::cuIpcOpenMemHandle_v2(&mut p1, h, flags), OK);
        assert_eq!(sys::cuIpcOpenMemHandle_v2(&mut p2, h, flags), OK);
        assert_eq!(sys::cuIpcCloseMemHandle(p1), OK);
        // One reference left: keep it open while the parent frees.
        let same = p1 == p2;
        let mut p3 = 0;
        assert_eq!(sys::cuIpcOpenMemHandle_v2(&mut p3, h, flags), OK);
        assert_eq!(sys::cuIpcCloseMemHandle(p3), OK);
        same
    };
    println!("HELD same={}", u8::from(same));
    let mut b = [0u8];
    let _ = std::io::stdin().read(&mut b);
    // SAFETY: closing the last reference, then once too often (the parent checks the answer).
    unsafe {
        assert_eq!(sys::cuIpcCloseMemHandle(p2), OK);
        println!("CLOSED {:?}", sys::cuIpcCloseMemHandle(p2));
    }
}

#[test]
fn events_follow_the_documented_rules() {
    let test = "events_follow_the_documented_rules";
    if !gpu(test) {
        return;
    }
    let _c = ensure_context(0).unwrap();
    let mut ev: sys::CUevent = std::ptr::null_mut();
    let mut h = sys::CUipcEventHandle { reserved: [0; 64] };
    let ipc = sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32;
    let no_timing = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    // SAFETY: valid out-pointers, events and streams throughout.
    unsafe {
        assert_eq!(sys::cuEventCreate(&mut ev, ipc), INVALID_VALUE, "INTERPROCESS without DISABLE_TIMING [S5]");
        assert_eq!(sys::cuEventCreate(&mut ev, no_timing), OK);
        strict("cuIpcGetEventHandle of an event without INTERPROCESS", sys::cuIpcGetEventHandle(&mut h, ev), CUresult::CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(sys::cuEventQuery(ev), OK, "never recorded: complete");
    }
    // NOT_READY until the most recent record completes: recorded behind a stream value
    // wait the host releases (holds on any driver), or, without memory operations, behind
    // 200 queued memsets (holds on simcuda, whose ops are delayed).
    if memops(test) {
        let w = HostWords::new();
        let s = NbStream::new();
        // SAFETY: a live event and stream.
        unsafe {
            assert_eq!(wait32(s.0, w.dptr(0), 1, GEQ), OK);
            assert_eq!(sys::cuEventRecord(ev, s.0), OK);
            assert_eq!(sys::cuEventQuery(ev), CUresult::CUDA_ERROR_NOT_READY, "recorded behind a parked stream");
            std::thread::sleep(Duration::from_millis(20));
            assert_eq!(sys::cuEventQuery(ev), CUresult::CUDA_ERROR_NOT_READY, "still parked");
            w.u32(0).store(1, Ordering::SeqCst);
            assert_eq!(sys::cuEventSynchronize(ev), OK);
            assert_eq!(sys::cuEventQuery(ev), OK);
        }
        s.sync();
    } else if on_sim() {
        let s = Stream::new();
        let scratch = DeviceBuffer::alloc(0, 1 << 16).unwrap();
        for _ in 0..200 {
            memset_async(scratch.ptr(), 1, 1 << 16, s.0);
        }
        let _c = ensure_context(0).unwrap();
        // SAFETY: a live event and stream.
        unsafe {
            assert_eq!(sys::cuEventRecord(ev, raw(s.0)), OK);
            assert_eq!(sys::cuEventQuery(ev), CUresult::CUDA_ERROR_NOT_READY, "recorded behind 200 queued ops");
            assert_eq!(sys::cuEventSynchronize(ev), OK);
            assert_eq!(sys::cuEventQuery(ev), OK);
        }
    }
    // SAFETY: as above.
    unsafe {
        assert_eq!(sys::cuEventDestroy_v2(ev), OK);
        assert_eq!(sys::cuEventCreate(&mut ev, ipc | no_timing), OK);
        assert_eq!(sys::cuIpcGetEventHandle(&mut h, ev), OK);
        let mut opened: sys::CUevent = std::ptr::null_mut();
        let r = sys::cuIpcOpenEventHandle(&mut opened, h);
        strict("cuIpcOpenEventHandle in the exporting process", r, CUresult::CUDA_ERROR_INVALID_CONTEXT);
        if r == OK {
            assert_eq!(sys::cuEventDestroy_v2(opened), OK);
        }
        assert_eq!(sys::cuEventDestroy_v2(ev), OK);
        if on_sim() {
            // Undefined behaviour on a real driver: only simcuda is asked.
            assert_eq!(sys::cuEventDestroy_v2(ev), CUresult::CUDA_ERROR_INVALID_HANDLE, "destroyed twice");
        }
    }
}

/// `cuStreamWaitEvent` waits for the record most recent when it is called, not for a
/// later one: a stream held back until after the event was recorded again still passes
/// its wait once the earlier record completed, while the later record is pending.
#[test]
fn a_stream_wait_captures_the_record_at_call_time() {
    let test = "a_stream_wait_captures_the_record_at_call_time";
    if !memops(test) {
        return;
    }
    let w = HostWords::new();
    let (a, b) = (NbStream::new(), NbStream::new());
    let _c = ensure_context(0).unwrap();
    let mut ev: sys::CUevent = std::ptr::null_mut();
    // SAFETY: valid out-pointer; live streams and event.
    unsafe {
        assert_eq!(sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32), OK);
        assert_eq!(sys::cuEventRecord(ev, a.0), OK);
        a.sync();
        // B: held back (word 0), then the event wait (captures record 1), then a marker.
        assert_eq!(wait32(b.0, w.dptr(0), 1, GEQ), OK);
        assert_eq!(sys::cuStreamWaitEvent(b.0, ev, 0), OK);
        assert_eq!(write32(b.0, w.dptr(4), 1, 0), OK);
        // Record 2, behind a parked stream.
        assert_eq!(wait32(a.0, w.dptr(8), 1, GEQ), OK);
        assert_eq!(sys::cuEventRecord(ev, a.0), OK);
        assert_eq!(sys::cuEventQuery(ev), CUresult::CUDA_ERROR_NOT_READY);
    }
    w.u32(0).store(1, Ordering::SeqCst);
    wait_until("B passes its wait on the earlier record", T, || w.u32(4).load(Ordering::SeqCst) == 1);
    // SAFETY: a live event.
    assert_eq!(unsafe { sys::cuEventQuery(ev) }, CUresult::CUDA_ERROR_NOT_READY, "record 2 still pending");
    w.u32(8).store(1, Ordering::SeqCst);
    a.sync();
    b.sync();
    // SAFETY: a live event, destroyed once.
    assert_eq!(unsafe { sys::cuEventDestroy_v2(ev) }, OK);
}

/// Work on the legacy default stream waits for earlier work on blocking streams: a
/// synchronous read sees what a blocking stream wrote before it, delays or not.
#[test]
fn the_legacy_stream_orders_with_blocking_streams() {
    if !gpu("the_legacy_stream_orders_with_blocking_streams") {
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
    if !gpu("vmm_follows_the_documented_rules") {
        return;
    }
    let before = on_sim().then(|| sim_stats().unwrap());
    let a = tensorwire::cuda::vmm::VmmAllocation::create(0, 4096).unwrap();
    strict("VMM granularity (4096 bytes rounded up to)", a.size(), 2 << 20);
    assert!(!tensorwire::cuda::driver::is_legacy_ipc_capable(a.ptr()).unwrap());
    let b = DeviceBuffer::alloc(0, 4096).unwrap();
    assert!(tensorwire::cuda::driver::is_legacy_ipc_capable(b.ptr()).unwrap());
    let _c = ensure_context(0).unwrap();
    let (mut base, mut size) = (0, 0);
    let mut h = 0;
    // SAFETY: valid out-pointers and addresses throughout.
    unsafe {
        assert_eq!(sys::cuMemGetAddressRange_v2(&mut base, &mut size, a.ptr().get() + 12345), OK);
        strict("cuMemGetAddressRange inside a VMM mapping", (base, size), (a.ptr().get(), a.size() as usize));
        assert_eq!(sys::cuMemGetAddressRange_v2(&mut base, &mut size, b.ptr().get() + 100), OK);
        assert_eq!((base, size), (b.ptr().get(), 4096), "cuMemAlloc: the allocation");
        assert_eq!(sys::cuMemRetainAllocationHandle(&mut h, (a.ptr().get() + 4096) as *mut _), OK, "interior address [S8]");
        let mut h2 = 0;
        strict("cuMemRetainAllocationHandle of cuMemAlloc memory", sys::cuMemRetainAllocationHandle(&mut h2, b.ptr().get() as *mut _), INVALID_VALUE);
        assert_eq!(sys::cuMemRelease(h), OK);
        let mut ipc = sys::CUipcMemHandle { reserved: [0; 64] };
        strict("cuIpcGetMemHandle of VMM memory", sys::cuIpcGetMemHandle(&mut ipc, a.ptr().get()), INVALID_VALUE);
    }
    // Export by fd and import in this process: the same pages.
    let fd = a.export_fd().unwrap();
    let imp = tensorwire::cuda::vmm::VmmAllocation::import_fd(&fd, 0, a.size()).unwrap();
    htod(a.ptr() + 100, b"vmm!");
    assert_eq!(dtoh(imp.ptr() + 100, 4), b"vmm!");
    let (mut r, mut ph) = (0, 0);
    // SAFETY: as above.
    unsafe {
        let mut prop: sys::CUmemAllocationProp = std::mem::zeroed();
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        assert_eq!(sys::cuMemCreate(&mut ph, 2 << 20, &prop, 0), OK);
        let mut fd_out = -1i32;
        let posix = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        let got = sys::cuMemExportToShareableHandle((&mut fd_out as *mut i32).cast(), ph, posix, 0);
        strict("cuMemExportToShareableHandle of memory created without the fd type", got, INVALID_VALUE);
        if got == OK {
            libc::close(fd_out);
        }
        assert_eq!(sys::cuMemAddressReserve(&mut r, 2 << 20, 0, 0, 0), OK);
        assert_eq!(sys::cuMemMap(r, 2 << 20, 0, ph, 0), OK);
        if on_sim() {
            // A copy into a mapping whose access was never set faults the context on
            // hardware (sticky): only simcuda is asked; so is a free of a range still mapped.
            let x = [1u8; 8];
            assert_eq!(sys::cuMemcpyHtoD_v2(r, x.as_ptr().cast(), 8), INVALID_VALUE, "no access set");
            assert_eq!(sys::cuMemAddressFree(r, 2 << 20), INVALID_VALUE, "still mapped");
        }
        assert_eq!(sys::cuMemUnmap(r, 2 << 20), OK);
        assert_eq!(sys::cuMemAddressFree(r, 2 << 20), OK);
        assert_eq!(sys::cuMemRelease(ph), OK);
        if on_sim() {
            // Undefined behaviour on a real driver.
            assert_eq!(sys::cuMemRelease(ph), INVALID_VALUE, "released twice");
        }
    }
    drop((imp, fd, a));
    if let Some(before) = before {
        let after = sim_stats().unwrap();
        // Other tests of this binary run at the same time: compare only what no other test
        // here creates.
        assert_eq!(
            (after.vmm_handles, after.vmm_mappings, after.vmm_reservations),
            (before.vmm_handles, before.vmm_mappings, before.vmm_reservations)
        );
    }
}
