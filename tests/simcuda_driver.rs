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
            let n = tensorwire::os::inherit_in_child(&mut cmd, fd);
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
        let fd = tensorwire::os::memfd_create("tw-simdrv-words").unwrap();
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
        "timeslice" => child_timeslice(),
        "probe" => child_probe(),
        other => panic!("unknown child role {other}"),
    }
}

// The tests, by subject (each module sees everything above through `use super::*`).
#[path = "simcuda_driver/driver_basics.rs"]
mod driver_basics;
#[path = "simcuda_driver/exit_and_cost.rs"]
mod exit_and_cost;
#[path = "simcuda_driver/memops.rs"]
mod memops;

use exit_and_cost::*;
use memops::*;
