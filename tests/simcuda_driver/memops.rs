//! Stream memory operations and host registration.

use super::*;

/// The device attributes of stream memory operations and host registration. The values a
/// real driver reports are printed for calibration (simcuda's: 91 = 0 is its strict
/// choice; hardware on x86 usually says 1).
#[test]
fn device_attributes_describe_memops_and_host_registration() {
    use sys::CUdevice_attribute::*;
    if !gpu("device_attributes_describe_memops_and_host_registration") {
        return;
    }
    let env_on = |k: &str| std::env::var(k).as_deref() == Ok("1");
    let memops = i32::from(!env_on("SIMCUDA_NO_MEMOPS"));
    for (a, sim) in [
        (CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 1),
        (CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, 0),
        // CUDA 13's driver answers 0 for the v1 attributes (measured, driver 580).
        (CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1, 0),
        (CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V1, 0),
        (CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR_V1, 0),
        (CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, memops),
        (CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR, memops),
        (CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED, i32::from(!env_on("SIMCUDA_NO_HOST_REGISTER"))),
        (CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED, 1),
        (CU_DEVICE_ATTRIBUTE_MPS_ENABLED, i32::from(env_on("SIMCUDA_MPS"))),
    ] {
        strict(&format!("{a:?}"), attr(a), sim);
    }
}

/// The documented wait conditions, each both holding at once and parking the stream until
/// the host stores a value that makes it hold: GEQ is cyclic (`(int32_t)(*addr - value) >=
/// 0`, so 5 is "at or after" 0xFFFF_FFF0), EQ, AND (`(*addr & value) != 0`), NOR
/// (`~(*addr | value) != 0`), and the 64-bit forms (64-bit compares: a word of 1 << 32 is at
/// or after 1, which a 32-bit compare of the low words would deny).
#[test]
fn stream_value_waits_follow_the_documented_conditions() {
    let test = "stream_value_waits_follow_the_documented_conditions";
    if !memops(test) {
        return;
    }
    let nor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR) != 0;
    let w = HostWords::new();
    let s = NbStream::new();
    let _c = ensure_context(0).unwrap();
    // (name, 64-bit, initial word, compare value, flags, holds at once, the store that releases it)
    let cases: &[(&str, bool, u64, u64, u32, bool, u64)] = &[
        ("GEQ32 wraparound", false, 0x0000_0005, 0xFFFF_FFF0, GEQ, true, 0),
        ("GEQ32 equal", false, 7, 7, GEQ, true, 0),
        ("GEQ32 below", false, 0xFFFF_FFF0, 5, GEQ, false, 5),
        ("EQ32", false, 7, 7, EQ, true, 0),
        ("EQ32 other", false, 6, 7, EQ, false, 7),
        ("AND32", false, 0b0110, 0b0100, AND, true, 0),
        ("AND32 disjoint", false, 0b0110, 0b1001, AND, false, 0b1000),
        ("NOR32", false, 0b0001, 0b0010, NOR, true, 0),
        ("NOR32 all ones", false, 0xFFFF_0000, 0x0000_FFFF, NOR, false, 0),
        ("GEQ64 wraparound", true, 5, u64::MAX - 15, GEQ, true, 0),
        ("GEQ64 high word", true, 1 << 32, 1, GEQ, true, 0),
        ("GEQ64 below", true, 1 << 32, (1 << 32) + 1, GEQ, false, 1 << 33),
        ("EQ64", true, 0x1_0000_0007, 0x1_0000_0007, EQ, true, 0),
        ("EQ64 low word only", true, 0x2_0000_0007, 0x1_0000_0007, EQ, false, 0x1_0000_0007),
        ("NOR64", true, 0xFFFF_FFFF, 0, NOR, true, 0),
    ];
    for (i, &(name, wide, init, value, flags, at_once, release)) in cases.iter().enumerate() {
        if flags == NOR && !nor {
            eprintln!("{test}: {name} skipped (the device reports no NOR waits)");
            continue;
        }
        // Word at 16 i, the stream's marker at 16 i + 8.
        let (word, marker) = (16 * i, 16 * i + 8);
        let set = |v: u64| if wide { w.u64(word).store(v, Ordering::SeqCst) } else { w.u32(word).store(v as u32, Ordering::SeqCst) };
        set(init);
        let r = if wide { wait64(s.0, w.dptr(word), value, flags) } else { wait32(s.0, w.dptr(word), value as u32, flags) };
        assert_eq!(r, OK, "{name}");
        assert_eq!(write32(s.0, w.dptr(marker), 1, 0), OK, "{name}");
        let passed = || w.u32(marker).load(Ordering::SeqCst) == 1;
        if !at_once {
            stays_false(&format!("{name}: the wait must park the stream"), Duration::from_millis(50), passed);
            set(release);
        }
        wait_until(&format!("{name}: the wait passes"), T, passed);
    }
    s.sync();
}

/// A host store to registered memory releases a waiting stream, and the stream's write
/// after its wait reaches the host; 64-bit writes too.
#[test]
fn a_host_store_releases_a_stream_value_wait() {
    if !memops("a_host_store_releases_a_stream_value_wait") {
        return;
    }
    let w = HostWords::new();
    let s = NbStream::new();
    let _c = ensure_context(0).unwrap();
    assert_eq!(wait32(s.0, w.dptr(0), 42, EQ), OK);
    assert_eq!(write64(s.0, w.dptr(8), 0x0123_4567_89AB_CDEF, 0), OK);
    stays_false("parked until the host store", Duration::from_millis(30), || w.u64(8).load(Ordering::SeqCst) != 0);
    w.u32(0).store(42, Ordering::SeqCst);
    wait_until("the stream's write after the wait", T, || w.u64(8).load(Ordering::SeqCst) == 0x0123_4567_89AB_CDEF);
    s.sync();
}

/// A stream write on one stream releases another stream's wait on device memory
/// (`cuMemAlloc`), and copies on the device pointer of registered memory reach the host.
#[test]
fn a_stream_write_releases_another_streams_wait() {
    if !memops("a_stream_write_releases_another_streams_wait") {
        return;
    }
    let w = HostWords::new();
    let d = DeviceBuffer::alloc(0, 4096).unwrap();
    htod(d.ptr(), &[0u8; 16]);
    let (a, b) = (NbStream::new(), NbStream::new());
    let _c = ensure_context(0).unwrap();
    assert_eq!(wait64(b.0, d.ptr().get() + 8, 3, GEQ), OK);
    assert_eq!(write32(b.0, w.dptr(0), 7, 0), OK);
    stays_false("parked until stream A writes", Duration::from_millis(30), || w.u32(0).load(Ordering::SeqCst) != 0);
    assert_eq!(write64(a.0, d.ptr().get() + 8, 3, 0), OK);
    wait_until("B passes once A wrote", T, || w.u32(0).load(Ordering::SeqCst) == 7);
    b.sync();
    a.sync();
    // Copies through the device pointer read and write the host page.
    let bytes = pattern(3, 64);
    // SAFETY: 64 readable bytes; the device pointer covers the registered page.
    assert_eq!(unsafe { sys::cuMemcpyHtoD_v2(w.dptr(256), bytes.as_ptr().cast(), 64) }, OK);
    // SAFETY: a context is current.
    assert_eq!(unsafe { sys::cuCtxSynchronize() }, OK);
    // SAFETY: the page is mapped; 64 bytes inside it.
    assert_eq!(unsafe { std::slice::from_raw_parts(w.host(256).cast::<u8>(), 64) }, &bytes[..]);
    let mut back = [0u8; 8];
    w.u64(512).store(0x1122_3344_5566_7788, Ordering::SeqCst);
    // SAFETY: 8 writable bytes; the device pointer covers the registered page.
    assert_eq!(unsafe { sys::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), w.dptr(512), 8) }, OK);
    assert_eq!(u64::from_ne_bytes(back), 0x1122_3344_5566_7788);
}

/// Two processes register their own mappings of one memfd page: a wait in the child is
/// released by a stream write in the parent, a second one by the parent's host store, and
/// the child's stream writes after each wait reach the parent through the page (the
/// H200's measured behaviour, driver 580).
#[test]
fn a_value_wait_in_another_process_is_released_by_a_stream_write_or_a_host_store() {
    if !memops("a_value_wait_in_another_process_is_released_by_a_stream_write_or_a_host_store") {
        return;
    }
    let w = HostWords::new();
    let s = NbStream::new();
    let mut kid = Kid::spawn("value_wait_xproc", &[], Some(w.fd.as_fd()));
    kid.expect("WAITING");
    stays_false("the child's first wait parks its stream", Duration::from_millis(50), || w.u32(4).load(Ordering::SeqCst) != 0);
    {
        let _c = ensure_context(0).unwrap();
        assert_eq!(write32(s.0, w.dptr(0), 1, 0), OK);
    }
    wait_until("the child passes its first wait (the parent's stream write)", T, || w.u32(4).load(Ordering::SeqCst) == 1);
    stays_false("the child's second wait parks its stream", Duration::from_millis(50), || w.u32(12).load(Ordering::SeqCst) != 0);
    w.u32(8).store(5, Ordering::SeqCst);
    wait_until("the child passes its second wait (the parent's host store)", T, || w.u32(12).load(Ordering::SeqCst) == 1);
    let (st, err) = kid.finish();
    assert!(st.success(), "{st:?}: {err}");
    s.sync();
}

pub(super) fn child_value_wait_xproc() {
    let fd: i32 = std::env::var(FD_ENV).unwrap().parse().unwrap();
    // SAFETY: the parent handed this fd down; nothing else here owns it.
    let w = HostWords::map(unsafe { OwnedFd::from_raw_fd(fd) });
    let s = NbStream::new();
    let _c = ensure_context(0).unwrap();
    assert_eq!(wait32(s.0, w.dptr(0), 1, GEQ), OK);
    assert_eq!(write32(s.0, w.dptr(4), 1, 0), OK);
    assert_eq!(wait32(s.0, w.dptr(8), 5, EQ), OK);
    assert_eq!(write32(s.0, w.dptr(12), 1, 0), OK);
    println!("WAITING");
    s.sync();
    drop(w);
    std::process::exit(0);
}

/// Make one call that a real driver might take and then fault on, in a child process (a
/// fault is a sticky error for the whole process): "PROBE <the call's answer>, then <a
/// stream synchronize's answer>", or what went wrong.
pub(super) fn run_probe(what: &str) -> String {
    let mut kid = Kid::spawn("probe", &[(MODE_ENV, what.to_string())], None);
    let line = kid.expect("PROBE");
    let (st, err) = kid.finish();
    if !st.success() {
        return format!("{line} (the child then failed: {st:?}: {})", err.trim());
    }
    line
}

pub(super) fn child_probe() {
    let mode = std::env::var(MODE_ENV).unwrap();
    assert!(tensorwire::cuda::available());
    let w = HostWords::new();
    let s = NbStream::new();
    let _c = ensure_context(0).unwrap();
    let r = match mode.as_str() {
        "wait32_unaligned" => wait32(s.0, w.dptr(2), 0, GEQ),
        "wait64_unaligned" => wait64(s.0, w.dptr(4), 0, GEQ),
        "write32_unaligned" => write32(s.0, w.dptr(66), 1, 0),
        "wait32_unknown" => wait32(s.0, 0x1000, 0, GEQ),
        "write32_read_only" => {
            // SAFETY: a fresh private page, made read-only, registered READ_ONLY; the child
            // exits without unmapping it.
            unsafe {
                let m = libc::mmap(std::ptr::null_mut(), PAGE, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
                assert_ne!(m, libc::MAP_FAILED);
                assert_eq!(libc::mprotect(m, PAGE, libc::PROT_READ), 0);
                assert_eq!(sys::cuMemHostRegister_v2(m, PAGE, DEVICEMAP | READ_ONLY), OK);
                let mut dptr = 0;
                assert_eq!(sys::cuMemHostGetDevicePointer_v2(&mut dptr, m, 0), OK);
                write32(s.0, dptr, 1, 0)
            }
        }
        other => panic!("unknown probe {other}"),
    };
    // SAFETY: a live stream of the current context.
    let sync = unsafe { sys::cuStreamSynchronize(s.0) };
    println!("PROBE {r:?}, then {sync:?}");
    std::process::exit(0);
}

/// Arguments the documentation refuses, and simcuda's strict refusals (printed, not
/// checked, on a real driver).
#[test]
fn stream_memory_operations_refuse_bad_arguments() {
    if !memops("stream_memory_operations_refuse_bad_arguments") {
        return;
    }
    let w = HostWords::new();
    let d = DeviceBuffer::alloc(0, 4).unwrap();
    let s = NbStream::new();
    let _c = ensure_context(0).unwrap();
    w.u64(0).store(u64::MAX, Ordering::SeqCst);
    // Bad flags (checked on words whose waits would hold at once, in case one is taken).
    assert_eq!(wait32(s.0, w.dptr(0), 0, 4), INVALID_VALUE, "wait flags 4");
    assert_eq!(wait32(s.0, w.dptr(0), 0, 1 << 29), INVALID_VALUE, "wait flags 1 << 29");
    assert_eq!(wait64(s.0, w.dptr(0), 0, 7), INVALID_VALUE, "64-bit wait flags 7");
    assert_eq!(write32(s.0, w.dptr(64), 1, 2), INVALID_VALUE, "write flags 2");
    assert_eq!(write64(s.0, w.dptr(64), 1, 4), INVALID_VALUE, "64-bit write flags 4");
    strict("cuStreamWriteValue32_v2 with NO_MEMORY_BARRIER (documented as not supported in the v2 API)", write32(s.0, w.dptr(64), 1, NO_MEMORY_BARRIER), INVALID_VALUE);
    // FLUSH: supported on selected platforms only (CAN_FLUSH_REMOTE_WRITES); simcuda says 0.
    strict(
        "CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES",
        attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES),
        0,
    );
    strict("cuStreamWaitValue32_v2 with EQ | FLUSH (a wait that holds)", wait32(s.0, w.dptr(0), u32::MAX, EQ | FLUSH), NOT_SUPPORTED);
    // Addresses: unaligned, unknown (asked in a child: a driver that took them might fault
    // the GPU, a sticky error for the rest of the process), past the allocation (harmless on
    // hardware, whose allocations are page-granular).
    for (rule, probe) in [
        ("cuStreamWaitValue32_v2 on an unaligned address", "wait32_unaligned"),
        ("cuStreamWaitValue64_v2 on a 4-byte aligned address", "wait64_unaligned"),
        ("cuStreamWriteValue32_v2 on an unaligned address", "write32_unaligned"),
        ("cuStreamWaitValue32_v2 on address 0x1000", "wait32_unknown"),
    ] {
        strict(rule, run_probe(probe), "PROBE CUDA_ERROR_INVALID_VALUE, then CUDA_SUCCESS".to_string());
    }
    strict("cuStreamWriteValue32_v2 past a 4-byte allocation", write32(s.0, d.ptr().get() + 4, 1, 0), INVALID_VALUE);
    strict("cuStreamWriteValue64_v2 straddling a 4-byte allocation's end", write64(s.0, d.ptr().get(), 1, 0), INVALID_VALUE);
    // The older (v1) name, which CUDA 11 binaries call (cudarc binds it for CUDA 11 only, so
    // it is looked up here): NO_MEMORY_BARRIER is its flag.
    type WriteV1 = unsafe extern "C" fn(sys::CUstream, u64, u32, u32) -> CUresult;
    // SAFETY: dlopen of the already-loaded driver (NOLOAD) and a symbol lookup; a symbol of
    // that name has the v1 signature (cuda.h of CUDA 11).
    let v1 = unsafe {
        let h = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        let f = if h.is_null() { std::ptr::null_mut() } else { libc::dlsym(h, c"cuStreamWriteValue32".as_ptr()) };
        (!f.is_null()).then(|| std::mem::transmute::<*mut libc::c_void, WriteV1>(f))
    };
    // SAFETY: plain values; the word is inside the registered page.
    let r = v1.map(|f| unsafe { f(s.0, w.dptr(64), 1, NO_MEMORY_BARRIER) });
    strict("cuStreamWriteValue32 (v1) with NO_MEMORY_BARRIER", r, Some(OK));
    s.sync();
    if on_sim() {
        assert_eq!(w.u32(64).load(Ordering::SeqCst), 1, "the v1 write landed");
    }
}

/// simcuda-only (strict): the device pointer of registered host memory is a different
/// address from the host pointer, and the host pointer is not a device address (hardware
/// that reports CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 1 takes it).
#[test]
fn the_host_pointer_of_registered_memory_is_not_a_device_pointer() {
    if !sim_only("the_host_pointer_of_registered_memory_is_not_a_device_pointer") {
        return;
    }
    let w = HostWords::new();
    let s = NbStream::new();
    let _c = ensure_context(0).unwrap();
    assert_ne!(w.dptr(0), w.host(0) as u64);
    let host = w.host(0) as u64;
    assert_eq!(wait32(s.0, host, 0, GEQ), INVALID_VALUE);
    assert_eq!(write32(s.0, host, 1, 0), INVALID_VALUE);
    let x = [1u8; 4];
    // SAFETY: 4 readable bytes; the destination is refused before anything is copied.
    assert_eq!(unsafe { sys::cuMemcpyHtoD_v2(host, x.as_ptr().cast(), 4) }, INVALID_VALUE);
    // The device range is not host memory: a host read of it would fault (as for every
    // simcuda device range); cuMemGetAddressRange does not call it an allocation.
    let (mut base, mut size) = (0, 0);
    // SAFETY: valid out-pointers.
    assert_eq!(unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, w.dptr(0)) }, CUresult::CUDA_ERROR_NOT_FOUND);
}

/// Registration errors the documentation names, and simcuda's strict ones.
#[test]
fn host_registration_follows_the_documented_rules() {
    if !memops("host_registration_follows_the_documented_rules") {
        return;
    }
    let _c = ensure_context(0).unwrap();
    let len = 4 * PAGE;
    // SAFETY: a fresh private anonymous mapping of 4 pages; unmapped at the end.
    let m = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
    assert_ne!(m, libc::MAP_FAILED);
    let at = |i: usize| (m as usize + i * PAGE) as *mut std::ffi::c_void;
    let mut dptr = 0;
    // SAFETY: every pointer below is inside the mapping unless the check is about one that
    // is not; registrations are undone before the unmap.
    unsafe {
        assert_eq!(sys::cuMemHostRegister_v2(at(0), PAGE, 16), INVALID_VALUE, "unknown flag");
        assert_eq!(sys::cuMemHostRegister_v2(at(0), 0, PORTABLE), INVALID_VALUE, "size 0");
        assert_eq!(sys::cuMemHostRegister_v2(std::ptr::null_mut(), PAGE, PORTABLE), INVALID_VALUE, "null");
        assert_eq!(sys::cuMemHostRegister_v2(at(0), 2 * PAGE, DEVICEMAP | PORTABLE), OK);
        assert_eq!(
            sys::cuMemHostRegister_v2(at(1), 2 * PAGE, PORTABLE),
            CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
            "overlapping a registered range"
        );
        assert_eq!(sys::cuMemHostGetDevicePointer_v2(&mut dptr, at(0), 1), INVALID_VALUE, "flags must be 0");
        let mut d0 = 0;
        assert_eq!(sys::cuMemHostGetDevicePointer_v2(&mut d0, at(0), 0), OK);
        assert_eq!(sys::cuMemHostGetDevicePointer_v2(&mut dptr, at(0).byte_add(100), 0), OK);
        assert_eq!(dptr, d0 + 100, "an interior pointer maps to the same offset");
        strict("cuMemHostGetDevicePointer_v2 of memory never registered", sys::cuMemHostGetDevicePointer_v2(&mut dptr, at(3), 0), INVALID_VALUE);
        // Measured on the H200's driver 580: an interior pointer is an invalid value.
        assert_eq!(sys::cuMemHostUnregister(at(1)), INVALID_VALUE, "not the registered start");
        assert_eq!(sys::cuMemHostUnregister(at(0)), OK);
        strict("cuMemHostUnregister of a range unregistered already", sys::cuMemHostUnregister(at(0)), CUresult::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
        // Without DEVICEMAP: no device pointer on simcuda (hardware with unified addressing
        // maps all registered memory).
        assert_eq!(sys::cuMemHostRegister_v2(at(2), PAGE, PORTABLE), OK);
        strict("cuMemHostGetDevicePointer_v2 of memory registered without DEVICEMAP", sys::cuMemHostGetDevicePointer_v2(&mut dptr, at(2), 0), INVALID_VALUE);
        assert_eq!(sys::cuMemHostUnregister(at(2)), OK);
        // A range with an unmapped page in it.
        assert_eq!(libc::munmap(at(3), PAGE), 0);
        let r = sys::cuMemHostRegister_v2(at(2), 2 * PAGE, PORTABLE);
        strict("cuMemHostRegister_v2 of a range with an unmapped page", r, INVALID_VALUE);
        if r == OK {
            assert_eq!(sys::cuMemHostUnregister(at(2)), OK);
        }
        // Read-only pages: only with READ_ONLY; the device must not write them.
        assert_eq!(libc::mprotect(at(2), PAGE, libc::PROT_READ), 0);
        let r = sys::cuMemHostRegister_v2(at(2), PAGE, DEVICEMAP);
        strict("cuMemHostRegister_v2 of read-only pages without READ_ONLY", r, INVALID_VALUE);
        if r == OK {
            assert_eq!(sys::cuMemHostUnregister(at(2)), OK);
        }
        if attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED) != 0 {
            assert_eq!(sys::cuMemHostRegister_v2(at(2), PAGE, DEVICEMAP | READ_ONLY), OK);
            assert_eq!(sys::cuMemHostGetDevicePointer_v2(&mut dptr, at(2), 0), OK);
            let s = NbStream::new();
            assert_eq!(wait32(s.0, dptr, 0, GEQ), OK, "the device may read it");
            s.sync();
            assert_eq!(sys::cuMemHostUnregister(at(2)), OK);
            strict(
                "cuStreamWriteValue32_v2 to host memory registered READ_ONLY",
                run_probe("write32_read_only"),
                "PROBE CUDA_ERROR_INVALID_VALUE, then CUDA_SUCCESS".to_string(),
            );
        }
        if on_sim() {
            // No I/O memory to simulate (hardware may take this flag on real MMIO only).
            assert_eq!(sys::cuMemHostRegister_v2(at(0), PAGE, IOMEMORY), NOT_SUPPORTED, "IOMEMORY");
        }
        libc::munmap(m, 3 * PAGE);
    }
}
