//! simcuda's rules, checked through the raw driver API, in two kinds (simcuda/README.md's
//! semantics table says which rule is which):
//!
//! - Conformance tests: documented behaviour, or behaviour measured on hardware, that a
//!   real driver shows too. They run under any driver: under simcuda
//!   (`simcuda/run.sh cargo test --test simcuda_driver`) and against the real driver in
//!   `scripts/gpu_test.sh` (the `rust` stage), which is how simcuda is calibrated against
//!   hardware. Inside them, a rule where simcuda's answer is its own strict choice (the
//!   documentation is silent, or allows more than simcuda does) is checked with [`strict`]:
//!   exact on simcuda, printed as a `CALIBRATION` line on a real driver (never failing
//!   there), so a GPU run records what the hardware answers.
//! - simcuda-only tests ([`sim_only`], say SKIPPED on a real driver): its counters,
//!   settings, the exit-drain bound, the `PROT_NONE` device range, and strict choices a
//!   real driver does not share (e.g. the device pointer of registered host memory is not
//!   the host pointer).
//!
//! Tests that park a stream in a value wait use non-blocking streams: the tests of this
//! binary run in parallel, and legacy-stream work of another test must not queue behind
//! (or in front of) a parked stream.

mod common;

use common::gpu::*;
use cudarc::driver::sys::{self, CUresult};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tensorwire::cuda::driver::{DeviceBuffer, call, ensure_context};

const CHILD_ENV: &str = "TW_SIMDRV_CHILD";
const HANDLE_ENV: &str = "TW_SIMDRV_HANDLE";
const FD_ENV: &str = "TW_SIMDRV_FD";
const MODE_ENV: &str = "TW_SIMDRV_MODE";

const GEQ: u32 = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
const EQ: u32 = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_EQ as u32;
const AND: u32 = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_AND as u32;
const NOR: u32 = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_NOR as u32;
const FLUSH: u32 = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_FLUSH as u32;
const NO_MEMORY_BARRIER: u32 = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER as u32;
const PORTABLE: u32 = sys::CU_MEMHOSTREGISTER_PORTABLE;
const DEVICEMAP: u32 = sys::CU_MEMHOSTREGISTER_DEVICEMAP;
const IOMEMORY: u32 = sys::CU_MEMHOSTREGISTER_IOMEMORY;
const READ_ONLY: u32 = sys::CU_MEMHOSTREGISTER_READ_ONLY;
const OK: CUresult = CUresult::CUDA_SUCCESS;
const INVALID_VALUE: CUresult = CUresult::CUDA_ERROR_INVALID_VALUE;
const NOT_SUPPORTED: CUresult = CUresult::CUDA_ERROR_NOT_SUPPORTED;

/// True if the loaded driver is simcuda, unless TW_SIMDRV_PRETEND_REAL=1: then the tests
/// treat simcuda as a real driver (strict checks printed, simcuda-only tests skipped), which
/// runs the code path of a GPU run without a GPU.
fn on_sim() -> bool {
    sim_stats().is_some() && std::env::var("TW_SIMDRV_PRETEND_REAL").as_deref() != Ok("1")
}

/// A simcuda-only test runs (true) only under simcuda; elsewhere it says SKIPPED.
fn sim_only(test: &str) -> bool {
    if !gpu(test) {
        return false;
    }
    if !on_sim() {
        eprintln!("SKIPPED {test}: simcuda-only (its counters, settings or strict choices), not a real driver");
        return false;
    }
    true
}

/// A rule simcuda answers with its own strict choice: `got` must be `sim` on simcuda; on a
/// real driver the answer is printed (`CALIBRATION …`) and not checked.
#[track_caller]
fn strict<T: PartialEq + std::fmt::Debug>(rule: &str, got: T, sim: T) {
    if on_sim() {
        assert_eq!(got, sim, "{rule}");
    } else {
        println!("CALIBRATION {rule}: the real driver answers {got:?}; simcuda answers {sim:?}");
    }
}

/// Device 0's attribute `a` (needs no context).
fn attr(a: sys::CUdevice_attribute) -> i32 {
    let (mut v, mut dev) = (-1, 0);
    // SAFETY: valid out-pointers; device 0 exists (the caller checked `gpu`).
    unsafe {
        assert_eq!(sys::cuDeviceGet(&mut dev, 0), OK);
        assert_eq!(sys::cuDeviceGetAttribute(&mut v, a, dev), OK, "{a:?}");
    }
    v
}

/// True if the driver registers host memory and does 64-bit stream memory operations (32-bit
/// ones need no attribute since CUDA 12); otherwise says SKIPPED.
fn memops(test: &str) -> bool {
    use sys::CUdevice_attribute::*;
    if !gpu(test) {
        return false;
    }
    if attr(CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED) == 0 || attr(CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS) == 0 {
        eprintln!("SKIPPED {test}: the device reports no host registration or no 64-bit stream memory operations");
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

/// A child process playing `what` (this binary's `child` test), its stdout read by line.
struct Kid {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl Kid {
    /// Start it with `env` added and, if given, `fd` inherited (its number in FD_ENV).
    fn spawn(what: &str, env: &[(&str, String)], fd: Option<BorrowedFd<'_>>) -> Kid {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["child", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, what)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(fd) = fd {
            let n = tensorwire::sys::inherit_in_child(&mut cmd, fd);
            cmd.env(FD_ENV, n.to_string());
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        Kid { child, out }
    }

    /// Its output from `prefix` to the end of that line (the harness prints other lines).
    fn expect(&mut self, prefix: &str) -> String {
        let mut line = String::new();
        let mut seen = String::new();
        loop {
            line.clear();
            if self.out.read_line(&mut line).unwrap() == 0 {
                let mut err = String::new();
                let _ = self.child.stderr.take().unwrap().read_to_string(&mut err);
                panic!("the child ended before it printed {prefix:?}; its output:\n{seen}\nits stderr:\n{err}");
            }
            seen.push_str(&line);
            // The harness's "test child ... " has no newline: the line may follow it.
            if let Some(at) = line.find(prefix) {
                return line[at..].trim_end().to_string();
            }
        }
    }

    /// Close its stdin and wait for it (killed and failed after [`T`]); (exit status, its
    /// stderr).
    fn finish(mut self) -> (std::process::ExitStatus, String) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + T;
        let st = loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                break st;
            }
            if Instant::now() > deadline {
                kill9(&mut self.child);
                panic!("the child did not exit within {T:?}");
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let mut err = String::new();
        self.child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
        (st, err)
    }
}

fn hex(bytes: &[std::ffi::c_char; 64]) -> String {
    bytes.iter().map(|&b| format!("{:02x}", b as u8)).collect()
}

fn unhex(hex: &str) -> [std::ffi::c_char; 64] {
    std::array::from_fn(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap() as std::ffi::c_char)
}

/// A non-blocking stream of device 0 (no implicit ordering with the legacy stream).
struct NbStream(sys::CUstream);

impl NbStream {
    fn new() -> NbStream {
        let _c = ensure_context(0).unwrap();
        let mut s: sys::CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: valid out-pointer.
        call("cuStreamCreate", || unsafe { sys::cuStreamCreate(&mut s, flags) }).unwrap();
        NbStream(s)
    }

    fn sync(&self) {
        let _c = ensure_context(0).unwrap();
        // SAFETY: a live stream of device 0.
        call("cuStreamSynchronize", || unsafe { sys::cuStreamSynchronize(self.0) }).unwrap();
    }
}

impl Drop for NbStream {
    fn drop(&mut self) {
        let _c = ensure_context(0);
        // SAFETY: a stream we created, destroyed once.
        let _ = call("cuStreamDestroy", || unsafe { sys::cuStreamDestroy_v2(self.0) });
    }
}

/// `cuStreamWaitValue32_v2` (the raw result; the caller holds a context).
fn wait32(s: sys::CUstream, addr: u64, value: u32, flags: u32) -> CUresult {
    // SAFETY: plain values; the driver checks the stream and the address.
    unsafe { sys::cuStreamWaitValue32_v2(s, addr, value, flags) }
}

fn wait64(s: sys::CUstream, addr: u64, value: u64, flags: u32) -> CUresult {
    // SAFETY: as in `wait32`.
    unsafe { sys::cuStreamWaitValue64_v2(s, addr, value, flags) }
}

fn write32(s: sys::CUstream, addr: u64, value: u32, flags: u32) -> CUresult {
    // SAFETY: as in `wait32`.
    unsafe { sys::cuStreamWriteValue32_v2(s, addr, value, flags) }
}

fn write64(s: sys::CUstream, addr: u64, value: u64, flags: u32) -> CUresult {
    // SAFETY: as in `wait32`.
    unsafe { sys::cuStreamWriteValue64_v2(s, addr, value, flags) }
}

/// One shared page of host memory (a memfd, so another process can map it too) registered
/// with DEVICEMAP | PORTABLE: the host reads and stores its words, streams wait on and
/// write them through its device pointer.
struct HostWords {
    ptr: *mut u8,
    dptr: u64,
    fd: OwnedFd,
}

const PAGE: usize = 4096;

impl HostWords {
    fn new() -> HostWords {
        let fd = tensorwire::sys::memfd_create("tw-simdrv-words").unwrap();
        // SAFETY: ftruncate on our own memfd.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), PAGE as libc::off_t) }, 0);
        HostWords::map(fd)
    }

    /// Map `fd`'s first page shared and register it.
    fn map(fd: OwnedFd) -> HostWords {
        // SAFETY: a shared read-write mapping of one page of a memfd we hold; checked.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), PAGE, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        assert_ne!(p, libc::MAP_FAILED);
        let _c = ensure_context(0).unwrap();
        let mut dptr = 0;
        // SAFETY: the page is mapped read-write for the registration's lifetime (unregistered
        // in Drop before the munmap); valid out-pointer.
        unsafe {
            assert_eq!(sys::cuMemHostRegister_v2(p, PAGE, DEVICEMAP | PORTABLE), OK);
            assert_eq!(sys::cuMemHostGetDevicePointer_v2(&mut dptr, p, 0), OK);
        }
        HostWords { ptr: p.cast(), dptr, fd }
    }

    fn u32(&self, off: usize) -> &AtomicU32 {
        assert!(off % 4 == 0 && off + 4 <= PAGE);
        // SAFETY: an aligned word of the mapped page, which lives as long as `self`; the
        // device and other processes access it only as a whole word.
        unsafe { AtomicU32::from_ptr(self.ptr.add(off).cast()) }
    }

    fn u64(&self, off: usize) -> &AtomicU64 {
        assert!(off % 8 == 0 && off + 8 <= PAGE);
        // SAFETY: as in `u32`.
        unsafe { AtomicU64::from_ptr(self.ptr.add(off).cast()) }
    }

    fn dptr(&self, off: usize) -> u64 {
        self.dptr + off as u64
    }

    fn host(&self, off: usize) -> *mut std::ffi::c_void {
        // SAFETY: inside the mapped page.
        unsafe { self.ptr.add(off).cast() }
    }
}

impl Drop for HostWords {
    fn drop(&mut self) {
        let _c = ensure_context(0);
        // SAFETY: unregister, then unmap, the page `map` mapped and registered. A failing
        // test may leave stream work queued on the page: then it stays mapped (leaked), so
        // that work does not fault and take the other tests down with it.
        unsafe {
            let r = sys::cuMemHostUnregister(self.ptr.cast());
            if std::thread::panicking() {
                return;
            }
            libc::munmap(self.ptr.cast(), PAGE);
            assert_eq!(r, OK);
        }
    }
}

/// Assert that `cond` stays false for `d` (a wait that must not have been released).
#[track_caller]
fn stays_false(what: &str, d: Duration, cond: impl Fn() -> bool) {
    let end = Instant::now() + d;
    while Instant::now() < end {
        assert!(!cond(), "{what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
#[ignore = "entry point of the child processes"]
fn child() {
    let Ok(what) = std::env::var(CHILD_ENV) else { return };
    match what.as_str() {
        // Before cuInit every call but the few documented ones is NOT_INITIALIZED.
        "before_init" => {
            let mut n = 0;
            // SAFETY: valid out-pointer; the library is loaded by cudarc on first use.
            let r = unsafe { sys::cuDeviceGetCount(&mut n) };
            std::process::exit(if r == CUresult::CUDA_ERROR_NOT_INITIALIZED { 0 } else { 1 });
        }
        // A host read of a device pointer must fault.
        "deref" => {
            let b = DeviceBuffer::alloc(0, 4096).unwrap();
            // SAFETY: deliberately not: this must crash the child (device memory is not
            // host memory); volatile so the read is not optimised away.
            let v = unsafe { std::ptr::read_volatile(b.ptr().get() as *const u8) };
            println!("{v}");
            std::process::exit(0);
        }
        "value_wait_xproc" => child_value_wait_xproc(),
        "xproc_event" => child_xproc_event(),
        "exit_write" => child_exit_write(),
        "exit_stuck" => child_exit_stuck(),
        "record_pending" => child_record_pending(),
        "exit_orphan" => child_exit_orphan(),
        "switches" => child_switches(),
        "count_ops" => child_count_ops(),
        "value_wait_cost" => child_value_wait_cost(),
        "probe" => child_probe(),
        other => panic!("unknown child role {other}"),
    }
}

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
        .args(["ipc_open_twice_helper", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
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

// --- stream memory operations and host registration ---

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
        (CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1, memops),
        (CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V1, memops),
        (CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR_V1, memops),
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
    let bytes = pattern(64, 3);
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

fn child_value_wait_xproc() {
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
fn run_probe(what: &str) -> String {
    let mut kid = Kid::spawn("probe", &[(MODE_ENV, what.to_string())], None);
    let line = kid.expect("PROBE");
    let (st, err) = kid.finish();
    if !st.success() {
        return format!("{line} (the child then failed: {st:?}: {})", err.trim());
    }
    line
}

fn child_probe() {
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
        assert_eq!(sys::cuMemHostUnregister(at(1)), CUresult::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "not the registered start");
        assert_eq!(sys::cuMemHostUnregister(at(0)), OK);
        assert_eq!(sys::cuMemHostUnregister(at(0)), CUresult::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "unregistered twice");
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

// --- what queued work does at exit, and the cross-process cost model ---

/// A child opens the parent's IPC handle, writes it with `cuMemcpyHtoD_v2` from pageable
/// memory (staged and queued, behind a blocking stream's work), closes the handle and
/// exits normally: the parent reads the child's bytes (on an H200 it does). Once with a
/// `cuCtxSynchronize` after the close (the close must keep the pages for the queued copy),
/// once without (the exit must finish the queued copy).
#[test]
fn work_queued_before_a_normal_exit_completes() {
    if !gpu("work_queued_before_a_normal_exit_completes") {
        return;
    }
    for (mode, seed) in [("sync_after_close", 11u8), ("exit", 12u8)] {
        let b = DeviceBuffer::alloc(0, 1 << 16).unwrap();
        htod(b.ptr(), &[0u8; 1 << 16]);
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        {
            let _c = ensure_context(0).unwrap();
            // SAFETY: valid out-pointer; the base of a live allocation.
            assert_eq!(unsafe { sys::cuIpcGetMemHandle(&mut h, b.ptr().get()) }, OK);
        }
        let env = [
            (HANDLE_ENV, hex(&h.reserved)),
            (MODE_ENV, format!("{mode}:{seed}")),
            // simcuda: every op of the child waits up to 20 ms, so the copy is still queued at exit.
            ("SIMCUDA_MAX_DELAY_US", "20000".to_string()),
        ];
        let (st, err) = Kid::spawn("exit_write", &env, None).finish();
        assert!(st.success(), "{mode}: {st:?}: {err}");
        assert_eq!(dtoh(b.ptr(), 1 << 16), pattern(1 << 16, seed), "{mode}: the child's queued copy did not land");
    }
}

fn child_exit_write() {
    let h = sys::CUipcMemHandle { reserved: unhex(&std::env::var(HANDLE_ENV).unwrap()) };
    let mode = std::env::var(MODE_ENV).unwrap();
    let (mode, seed) = mode.split_once(':').unwrap();
    let bytes = pattern(1 << 16, seed.parse().unwrap());
    assert!(tensorwire::cuda::available());
    let blocking = Stream::new();
    let scratch = DeviceBuffer::alloc(0, 4096).unwrap();
    // Work ahead of the copy on a blocking stream: the legacy-stream copy waits for it.
    for _ in 0..10 {
        memset_async(scratch.ptr(), 1, 4096, blocking.0);
    }
    let _c = ensure_context(0).unwrap();
    let mut p = 0;
    let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
    // SAFETY: the parent's handle; `bytes` is readable for its length (pageable: staged).
    unsafe {
        assert_eq!(sys::cuIpcOpenMemHandle_v2(&mut p, h, flags), OK);
        assert_eq!(sys::cuMemcpyHtoD_v2(p, bytes.as_ptr().cast(), bytes.len()), OK);
        assert_eq!(sys::cuIpcCloseMemHandle(p), OK);
        if mode == "sync_after_close" {
            assert_eq!(sys::cuCtxSynchronize(), OK);
        }
    }
    std::process::exit(0);
}

/// simcuda-only: the exit drain is bounded (`SIMCUDA_EXIT_DRAIN_MS`): a stream parked on
/// a word nobody writes does not hold the exit forever, and the exit says so on stderr.
#[test]
fn the_exit_drain_gives_up_on_a_stream_that_cannot_finish() {
    if !sim_only("the_exit_drain_gives_up_on_a_stream_that_cannot_finish") {
        return;
    }
    let t0 = Instant::now();
    let (st, err) = Kid::spawn("exit_stuck", &[("SIMCUDA_EXIT_DRAIN_MS", "300".to_string())], None).finish();
    let took = t0.elapsed();
    assert!(st.success(), "{st:?}: {err}");
    assert!(err.contains("simcuda: at exit, queued work left unfinished"), "no note on stderr: {err}");
    assert!(took >= Duration::from_millis(300), "the exit did not wait for the queued work: {took:?}");
    assert!(took < Duration::from_secs(8), "the bound was not kept: {took:?}");
}

fn child_exit_stuck() {
    assert!(tensorwire::cuda::available());
    let d = DeviceBuffer::alloc(0, 4).unwrap();
    htod(d.ptr(), &[0u8; 4]);
    let s = NbStream::new();
    let _c = ensure_context(0).unwrap();
    assert_eq!(wait32(s.0, d.ptr().get(), 1, GEQ), OK);
    std::mem::forget((d, s));
    std::process::exit(0);
}

/// simcuda-only: a stream waiting on an event whose recording process died (SIGKILL while
/// the record was pending) can never finish: the exit does not wait for it at all, even
/// with the default 10 s bound.
#[test]
fn the_exit_drain_does_not_wait_for_a_dead_peers_event() {
    if !sim_only("the_exit_drain_does_not_wait_for_a_dead_peers_event") {
        return;
    }
    let _c = ensure_context(0).unwrap();
    let mut ev: sys::CUevent = std::ptr::null_mut();
    let mut h = sys::CUipcEventHandle { reserved: [0; 64] };
    let flags = (sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32) | (sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32);
    // SAFETY: valid out-pointers.
    unsafe {
        assert_eq!(sys::cuEventCreate(&mut ev, flags), OK);
        assert_eq!(sys::cuIpcGetEventHandle(&mut h, ev), OK);
    }
    let env = [(HANDLE_ENV, hex(&h.reserved))];
    let mut recorder = Kid::spawn("record_pending", &env, None);
    recorder.expect("RECORDED");
    kill9(&mut recorder.child);
    let t0 = Instant::now();
    let (st, err) = Kid::spawn("exit_orphan", &env, None).finish();
    let took = t0.elapsed();
    assert!(st.success(), "{st:?}: {err}");
    assert!(err.contains("recording process is gone"), "no note on stderr: {err}");
    assert!(took < Duration::from_secs(5), "the exit waited on a dead peer's event: {took:?}");
    // SAFETY: a live event, destroyed once.
    assert_eq!(unsafe { sys::cuEventDestroy_v2(ev) }, OK);
}

fn open_event_from_env() -> sys::CUevent {
    let h = sys::CUipcEventHandle { reserved: unhex(&std::env::var(HANDLE_ENV).unwrap()) };
    assert!(tensorwire::cuda::available());
    let _c = ensure_context(0).unwrap();
    let mut ev: sys::CUevent = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the parent's handle.
    assert_eq!(unsafe { sys::cuIpcOpenEventHandle(&mut ev, h) }, OK);
    ev
}

fn child_record_pending() {
    let ev = open_event_from_env();
    let d = DeviceBuffer::alloc(0, 4).unwrap();
    htod(d.ptr(), &[0u8; 4]);
    let s = NbStream::new();
    let _c = ensure_context(0).unwrap();
    assert_eq!(wait32(s.0, d.ptr().get(), 1, GEQ), OK);
    // SAFETY: an opened event and a live stream.
    assert_eq!(unsafe { sys::cuEventRecord(ev, s.0) }, OK);
    println!("RECORDED");
    let _ = std::io::stdin().read(&mut [0u8]);
    std::process::exit(0);
}

fn child_exit_orphan() {
    let ev = open_event_from_env();
    let s = NbStream::new();
    let _c = ensure_context(0).unwrap();
    // SAFETY: an opened event and a live stream.
    assert_eq!(unsafe { sys::cuStreamWaitEvent(s.0, ev, 0) }, OK);
    std::mem::forget(s);
    std::process::exit(0);
}

/// simcuda-only: a stream wait on a record another process made is counted as a
/// cross-process event wait and costs `SIMCUDA_XPROC_WAIT_US` on the stream (the measured
/// GPU time-slice switch), but nothing with `SIMCUDA_MPS=1` and nothing on host waits; a
/// wait on this process's own record is not counted.
#[test]
fn cross_process_event_stream_waits_are_counted_and_cost_a_time_slice() {
    if !sim_only("cross_process_event_stream_waits_are_counted_and_cost_a_time_slice") {
        return;
    }
    let _c = ensure_context(0).unwrap();
    let s = NbStream::new();
    let mut ev: sys::CUevent = std::ptr::null_mut();
    let mut h = sys::CUipcEventHandle { reserved: [0; 64] };
    let flags = (sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32) | (sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32);
    // SAFETY: valid out-pointers; a live stream.
    unsafe {
        assert_eq!(sys::cuEventCreate(&mut ev, flags), OK);
        assert_eq!(sys::cuEventRecord(ev, s.0), OK);
        assert_eq!(sys::cuIpcGetEventHandle(&mut h, ev), OK);
    }
    s.sync();
    let run = |mps: &str| {
        let env = [
            (HANDLE_ENV, hex(&h.reserved)),
            ("SIMCUDA_XPROC_WAIT_US", "20000".to_string()),
            ("SIMCUDA_MAX_DELAY_US", "0".to_string()),
            ("SIMCUDA_MPS", mps.to_string()),
        ];
        let mut kid = Kid::spawn("xproc_event", &env, None);
        let line = kid.expect("RESULT");
        let (st, err) = kid.finish();
        assert!(st.success(), "{st:?}: {err}");
        let field = |k: &str| -> u64 {
            line.split_whitespace().find_map(|f| f.strip_prefix(&format!("{k}="))).unwrap().parse().unwrap()
        };
        (field("waits"), field("stream_ms"), field("host_ms"))
    };
    let (waits, stream_ms, host_ms) = run("0");
    assert_eq!(waits, 8, "8 waits on the parent's record, none on the child's own");
    assert!(stream_ms >= 8 * 20, "each cross-process stream wait costs 20 ms: {stream_ms} ms");
    assert!(host_ms < 80, "host waits cost nothing: {host_ms} ms");
    let (waits, stream_ms, _) = run("1");
    assert_eq!(waits, 8, "counted under MPS too");
    assert!(stream_ms < 80, "no time-slice switch under MPS: {stream_ms} ms");
    // SAFETY: a live event, destroyed once.
    assert_eq!(unsafe { sys::cuEventDestroy_v2(ev) }, OK);
}

fn child_xproc_event() {
    let ev = open_event_from_env();
    let s = NbStream::new();
    let _c = ensure_context(0).unwrap();
    let before = sim_stats().unwrap().xproc_event_waits;
    let t0 = Instant::now();
    for _ in 0..8 {
        // SAFETY: an opened event and a live stream.
        assert_eq!(unsafe { sys::cuStreamWaitEvent(s.0, ev, 0) }, OK);
        s.sync();
    }
    let stream_ms = t0.elapsed().as_millis();
    let t0 = Instant::now();
    for _ in 0..8 {
        // SAFETY: an opened event.
        unsafe {
            assert_eq!(sys::cuEventSynchronize(ev), OK);
            assert_eq!(sys::cuEventQuery(ev), OK);
        }
    }
    let host_ms = t0.elapsed().as_millis();
    // This process's own record: not a cross-process wait.
    // SAFETY: an opened event and a live stream.
    unsafe {
        assert_eq!(sys::cuEventRecord(ev, s.0), OK);
        assert_eq!(sys::cuStreamWaitEvent(s.0, ev, 0), OK);
    }
    s.sync();
    let waits = sim_stats().unwrap().xproc_event_waits - before;
    println!("RESULT waits={waits} stream_ms={stream_ms} host_ms={host_ms}");
    std::process::exit(0);
}

/// simcuda-only: `SIMCUDA_VALUE_WAIT_US` is added to each stream value wait once its
/// condition holds (the cost model; 0 by default).
#[test]
fn stream_value_waits_cost_simcuda_value_wait_us() {
    if !sim_only("stream_value_waits_cost_simcuda_value_wait_us") {
        return;
    }
    let run = |us: &str| -> u64 {
        let env = [("SIMCUDA_VALUE_WAIT_US", us.to_string()), ("SIMCUDA_MAX_DELAY_US", "0".to_string())];
        let mut kid = Kid::spawn("value_wait_cost", &env, None);
        let line = kid.expect("RESULT ms=");
        let (st, err) = kid.finish();
        assert!(st.success(), "{st:?}: {err}");
        line["RESULT ms=".len()..].parse().unwrap()
    };
    let ms = run("20000");
    assert!(ms >= 5 * 20, "5 waits of 20 ms each: {ms} ms");
    let ms = run("0");
    assert!(ms < 80, "no cost by default: {ms} ms");
}

fn child_value_wait_cost() {
    assert!(tensorwire::cuda::available());
    let w = HostWords::new();
    let s = NbStream::new();
    let _c = ensure_context(0).unwrap();
    let t0 = Instant::now();
    for _ in 0..5 {
        assert_eq!(wait32(s.0, w.dptr(0), 0, GEQ), OK);
        s.sync();
    }
    println!("RESULT ms={}", t0.elapsed().as_millis());
    drop(w);
    std::process::exit(0);
}

/// simcuda-only: `SIMCUDA_NO_MEMOPS=1` and `SIMCUDA_NO_HOST_REGISTER=1` turn support off
/// (attributes 0, calls CUDA_ERROR_NOT_SUPPORTED) so fallbacks can be tested; each leaves
/// the other capability alone. `SIMCUDA_MPS=1` reports MPS_ENABLED.
#[test]
fn the_off_switches_report_and_refuse() {
    if !sim_only("the_off_switches_report_and_refuse") {
        return;
    }
    for (k, mode) in [("SIMCUDA_NO_MEMOPS", "no_memops"), ("SIMCUDA_NO_HOST_REGISTER", "no_host_register"), ("SIMCUDA_MPS", "mps")] {
        let env = [(k, "1".to_string()), (MODE_ENV, mode.to_string())];
        let (st, err) = Kid::spawn("switches", &env, None).finish();
        assert!(st.success(), "{k}=1: {st:?}: {err}");
    }
}

fn child_switches() {
    use sys::CUdevice_attribute::*;
    let mode = std::env::var(MODE_ENV).unwrap();
    assert!(tensorwire::cuda::available());
    let (no_memops, no_register) = (mode == "no_memops", mode == "no_host_register");
    for a in [
        CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1,
        CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V1,
        CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR_V1,
        CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
        CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR,
    ] {
        assert_eq!(attr(a), i32::from(!no_memops), "{a:?}");
    }
    assert_eq!(attr(CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED), i32::from(!no_register));
    assert_eq!(attr(CU_DEVICE_ATTRIBUTE_MPS_ENABLED), i32::from(mode == "mps"));
    let d = DeviceBuffer::alloc(0, 64).unwrap();
    htod(d.ptr(), &[0u8; 64]);
    let s = NbStream::new();
    let _c = ensure_context(0).unwrap();
    let want = if no_memops { NOT_SUPPORTED } else { OK };
    let a = d.ptr().get();
    assert_eq!(wait32(s.0, a, 0, GEQ), want);
    assert_eq!(wait64(s.0, a, 0, GEQ), want);
    assert_eq!(write32(s.0, a + 8, 1, 0), want);
    assert_eq!(write64(s.0, a + 16, 1, 0), want);
    let mut x = [0u64; 512];
    let r = unsafe {
        // SAFETY: the array lives until after the unregister below.
        sys::cuMemHostRegister_v2(x.as_mut_ptr().cast(), 4096, DEVICEMAP)
    };
    assert_eq!(r, if no_register { NOT_SUPPORTED } else { OK });
    if r == OK {
        // SAFETY: registered just above.
        assert_eq!(unsafe { sys::cuMemHostUnregister(x.as_mut_ptr().cast()) }, OK);
    }
    s.sync();
    std::process::exit(0);
}

/// simcuda-only: the counters of stream value ops and host registrations (exact, in a
/// child process of its own) and the stats layout version.
#[test]
fn stats_count_value_ops_and_host_registrations() {
    if !sim_only("stats_count_value_ops_and_host_registrations") {
        return;
    }
    assert_eq!(sim_stats().unwrap().version, SIM_STATS_VERSION, "simcuda_stats layout version");
    let (st, err) = Kid::spawn("count_ops", &[], None).finish();
    assert!(st.success(), "{st:?}: {err}");
}

fn child_count_ops() {
    assert!(tensorwire::cuda::available());
    let before = sim_stats().unwrap();
    let w = HostWords::new();
    assert_eq!(sim_stats().unwrap().host_registrations, before.host_registrations + 1);
    let s = NbStream::new();
    let _c = ensure_context(0).unwrap();
    w.u64(0).store(1, Ordering::SeqCst);
    assert_eq!(wait32(s.0, w.dptr(0), 1, GEQ), OK);
    assert_eq!(wait64(s.0, w.dptr(0), 1, EQ), OK);
    assert_eq!(wait32(s.0, w.dptr(0), 1, AND), OK);
    assert_eq!(write32(s.0, w.dptr(8), 1, 0), OK);
    assert_eq!(write64(s.0, w.dptr(16), 1, 0), OK);
    assert_eq!(wait32(s.0, w.dptr(2), 1, GEQ), INVALID_VALUE, "a refused call is not counted");
    s.sync();
    let after = sim_stats().unwrap();
    assert_eq!((after.value_waits - before.value_waits, after.value_writes - before.value_writes), (3, 2));
    drop(w);
    assert_eq!(sim_stats().unwrap().host_registrations, before.host_registrations);
    std::process::exit(0);
}
