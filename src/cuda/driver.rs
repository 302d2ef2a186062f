//! The result layer over cudarc's raw driver bindings (cudarc's own safe layer does not
//! cover the IPC and VMM calls).
//!
//! cudarc loads libcuda at run time and *panics* when the library or a symbol is missing.
//! Every call here goes through [`call`]: the library is probed once (`is_culib_present`)
//! and `cuInit` run once; a machine without a driver gets `Error::CudaUnavailable` with a
//! clear message, a missing symbol too (the panic is caught), and a failing call gets
//! `Error::Cuda` naming the call and the CUDA error.

use super::types::{CudaCode, CudaStream, DevicePtr};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

/// Why this process has no usable driver: found once, then reported by every call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoDriver {
    /// libcuda.so could not be loaded.
    NoLibrary,
    /// The library that loaded has no `cuInit`.
    NoCuInit,
    /// `cuInit` failed (no usable GPU).
    InitFailed { code: CudaCode, name: String },
}

impl std::fmt::Display for NoDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoDriver::NoLibrary => write!(f, "no NVIDIA driver on this machine (libcuda.so could not be loaded)"),
            NoDriver::NoCuInit => write!(f, "libcuda.so has no cuInit"),
            NoDriver::InitFailed { name, .. } => write!(f, "cuInit failed: {name} — no usable GPU"),
        }
    }
}

static DRIVER: OnceLock<std::result::Result<(), NoDriver>> = OnceLock::new();

fn load() -> std::result::Result<(), NoDriver> {
    // SAFETY: probing for the shared library has no preconditions.
    if !unsafe { sys::is_culib_present() } {
        return Err(NoDriver::NoLibrary);
    }
    // SAFETY: cuInit has no preconditions; a missing symbol panics and is caught.
    match catch_unwind(|| unsafe { sys::cuInit(0) }) {
        Ok(sys::CUresult::CUDA_SUCCESS) => Ok(()),
        Ok(code) => Err(NoDriver::InitFailed { code: code.into(), name: error_name(code) }),
        Err(_) => Err(NoDriver::NoCuInit),
    }
}

/// Load the driver once; `CudaUnavailable` (saying why) if there is none.
pub fn init() -> Result<()> {
    DRIVER.get_or_init(load).as_ref().map_err(|why| Error::CudaUnavailable(why.to_string())).copied()
}

/// True if a CUDA driver loaded and initialised.
pub fn available() -> bool {
    init().is_ok()
}

/// The CUDA error's name, e.g. `CUDA_ERROR_INVALID_VALUE`.
pub fn error_name(code: sys::CUresult) -> String {
    let mut p: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: only called once the library is loaded (cuInit returned); the driver
    // writes a pointer to a static string or leaves `p` null.
    let r = catch_unwind(AssertUnwindSafe(|| unsafe { sys::cuGetErrorName(code, &mut p) }));
    if matches!(r, Ok(sys::CUresult::CUDA_SUCCESS)) && !p.is_null() {
        // SAFETY: the driver returned a NUL-terminated static string.
        return unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned();
    }
    format!("{code:?}")
}

/// Run one raw driver call: the driver must be present, a panic (missing symbol) is
/// `CudaUnavailable`, a failure is `Error::Cuda { call: what, .. }`.
pub fn call(what: &'static str, f: impl FnOnce() -> sys::CUresult) -> Result<()> {
    init()?;
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(sys::CUresult::CUDA_SUCCESS) => Ok(()),
        Ok(code) => Err(Error::Cuda { call: what, code: code.into(), name: error_name(code) }),
        Err(_) => Err(Error::CudaUnavailable(format!("the installed driver does not provide {what}"))),
    }
}

/// Number of CUDA devices.
pub fn device_count() -> Result<usize> {
    let mut n: std::ffi::c_int = 0;
    // SAFETY: `n` is a valid out-pointer.
    call("cuDeviceGetCount", || unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(n.max(0) as usize)
}

/// Keeps `device`'s context current for a scope; pops a pushed context on drop.
pub struct ContextGuard {
    pushed: bool,
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        if self.pushed {
            let mut old: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: pops the context `ensure_context` pushed on this thread.
            let _ = call("cuCtxPopCurrent", || unsafe { sys::cuCtxPopCurrent_v2(&mut old) });
        }
    }
}

fn primary_context(device: i32) -> Result<sys::CUcontext> {
    static PRIMARY: OnceLock<parking_lot::Mutex<std::collections::HashMap<i32, usize>>> = OnceLock::new();
    let mut map = PRIMARY.get_or_init(Default::default).lock();
    if let Some(&c) = map.get(&device) {
        return Ok(c as sys::CUcontext);
    }
    let mut dev: sys::CUdevice = 0;
    // SAFETY: valid out-pointer; the ordinal is checked by the driver.
    call("cuDeviceGet", || unsafe { sys::cuDeviceGet(&mut dev, device) })?;
    let mut c: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer and device handle. Retained for the process's lifetime on
    // purpose (PyTorch's runtime shares the primary context).
    call("cuDevicePrimaryCtxRetain", || unsafe { sys::cuDevicePrimaryCtxRetain(&mut c, dev) })?;
    map.insert(device, c as usize);
    Ok(c)
}

/// Make a context of `device` current on this thread for the guard's lifetime: the
/// caller's current context if it belongs to `device` (PyTorch's), else `device`'s
/// primary context, pushed and popped again when the guard drops — so a caller whose
/// current device is another GPU is left as it was.
pub fn ensure_context(device: i32) -> Result<ContextGuard> {
    let mut cur: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    call("cuCtxGetCurrent", || unsafe { sys::cuCtxGetCurrent(&mut cur) })?;
    if !cur.is_null() {
        let mut dev: sys::CUdevice = -1;
        // SAFETY: valid out-pointer; a context is current.
        call("cuCtxGetDevice", || unsafe { sys::cuCtxGetDevice(&mut dev) })?;
        if dev == device {
            return Ok(ContextGuard { pushed: false });
        }
    }
    let ctx = primary_context(device)?;
    // SAFETY: `ctx` is a retained primary context; popped by the guard.
    call("cuCtxPushCurrent", || unsafe { sys::cuCtxPushCurrent_v2(ctx) })?;
    Ok(ContextGuard { pushed: true })
}

/// The device of the context current on this thread (`CudaUnavailable`/`Cuda` errors
/// as usual; a thread with no current context is an error from the driver).
pub fn current_device() -> Result<i32> {
    let mut dev: sys::CUdevice = -1;
    // SAFETY: valid out-pointer.
    call("cuCtxGetDevice", || unsafe { sys::cuCtxGetDevice(&mut dev) })?;
    Ok(dev)
}

/// The device ordinal a device pointer belongs to.
pub fn pointer_device(dptr: DevicePtr) -> Result<i32> {
    int_pointer_attribute(dptr, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, "cuPointerGetAttribute(DEVICE_ORDINAL)", -1)
}

/// True if `dptr` lies in memory legacy IPC (`cuIpcGetMemHandle`) can share — false for
/// VMM (`cuMemCreate`) memory such as PyTorch's expandable segments.
pub fn is_legacy_ipc_capable(dptr: DevicePtr) -> Result<bool> {
    let attr = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE;
    // Starts at 0: the driver documents a boolean and may write fewer than 4 bytes.
    Ok(int_pointer_attribute(dptr, attr, "cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE)", 0)? != 0)
}

/// A pointer attribute whose value is one `int` (or a narrower boolean), starting from `init`.
fn int_pointer_attribute(dptr: DevicePtr, attr: sys::CUpointer_attribute, what: &'static str, init: i32) -> Result<i32> {
    let mut value: std::ffi::c_int = init;
    // SAFETY: the callers pass attributes whose value is one int, written to `value`; a
    // pointer the driver does not know is an error, not UB.
    call(what, || unsafe { sys::cuPointerGetAttribute((&mut value as *mut std::ffi::c_int).cast(), attr, dptr.get()) })?;
    Ok(value)
}

/// Enqueue a device-to-device copy of `n` bytes on `stream` (a context of the devices
/// must be current).
pub fn memcpy_dtod_async(dst: DevicePtr, src: DevicePtr, n: u64, stream: CudaStream) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    // SAFETY: the caller checked that both ranges lie inside live device allocations; the
    // copy is ordered on the caller's stream.
    call("cuMemcpyDtoDAsync", || unsafe { sys::cuMemcpyDtoDAsync_v2(dst.get(), src.get(), n as usize, stream.raw()) })
}

/// A device attribute's value (`cuDeviceGetAttribute`).
pub fn device_attribute(device: i32, attr: sys::CUdevice_attribute, what: &'static str) -> Result<i32> {
    let mut dev: sys::CUdevice = 0;
    // SAFETY: valid out-pointer; the ordinal is checked by the driver.
    call("cuDeviceGet", || unsafe { sys::cuDeviceGet(&mut dev, device) })?;
    let mut v: std::ffi::c_int = 0;
    // SAFETY: valid out-pointer and device handle; an attribute the driver does not know
    // is an error, not UB.
    call(what, || unsafe { sys::cuDeviceGetAttribute(&mut v, attr, dev) })?;
    Ok(v)
}

/// Page-lock `len` bytes of host memory at `ptr` and map them for the device
/// (`cuMemHostRegister` with `DEVICEMAP | PORTABLE`); returns the device address of `ptr`
/// (`cuMemHostGetDevicePointer`), which need not equal `ptr`. A context must be current.
///
/// # Safety
/// `ptr..ptr+len` must stay mapped until [`host_unregister`] is called, and no GPU work
/// may use the device address after that.
pub unsafe fn host_register(ptr: *mut u8, len: usize) -> Result<DevicePtr> {
    let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
    // SAFETY: the caller keeps the range mapped while registered.
    call("cuMemHostRegister", || unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, flags) })?;
    let mut d: sys::CUdeviceptr = 0;
    // SAFETY: valid out-pointer; `ptr` was registered with DEVICEMAP just above.
    let got = call("cuMemHostGetDevicePointer", || unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, ptr.cast(), 0) });
    if let Err(e) = got {
        // SAFETY: registered above, used by nothing yet.
        let _ = unsafe { host_unregister(ptr) };
        return Err(e);
    }
    Ok(DevicePtr(d))
}

/// Undo [`host_register`] (a context of the device must be current).
///
/// # Safety
/// `ptr` was registered by [`host_register`] and no GPU work still uses its device address.
pub unsafe fn host_unregister(ptr: *mut u8) -> Result<()> {
    // SAFETY: per the caller's contract.
    call("cuMemHostUnregister", || unsafe { sys::cuMemHostUnregister(ptr.cast()) })
}

/// Enqueue on `stream` a store of `value` to the 32-bit word at device address `word`,
/// after the stream's earlier work (with a memory barrier: the earlier writes are visible
/// to whoever sees the value).
pub fn stream_write_value32(stream: CudaStream, word: DevicePtr, value: u32) -> Result<()> {
    let flags = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
    // SAFETY: the callers pass the device address of a registered, live, 4-aligned word.
    call("cuStreamWriteValue32", || unsafe { sys::cuStreamWriteValue32_v2(stream.raw(), word.get(), value, flags) })
}

/// Make `stream`'s later work wait until the 32-bit word at device address `word` holds a
/// value at or past `value` in cyclic order (`(int32_t)(*word - value) >= 0`, the driver's
/// GEQ, which ignores wraparound).
pub fn stream_wait_value32(stream: CudaStream, word: DevicePtr, value: u32) -> Result<()> {
    let flags = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
    // SAFETY: the callers pass the device address of a registered, live, 4-aligned word.
    call("cuStreamWaitValue32", || unsafe { sys::cuStreamWaitValue32_v2(stream.raw(), word.get(), value, flags) })
}

/// Device memory from `cuMemAlloc` (legacy-IPC shareable), freed on drop.
pub struct DeviceBuffer {
    device: i32,
    ptr: DevicePtr,
    size: u64,
}

impl DeviceBuffer {
    /// Allocate `size` bytes on `device`.
    pub fn alloc(device: i32, size: u64) -> Result<DeviceBuffer> {
        let _ctx = ensure_context(device)?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer.
        call("cuMemAlloc", || unsafe { sys::cuMemAlloc_v2(&mut ptr, size.max(1) as usize) })?;
        Ok(DeviceBuffer { device, ptr: DevicePtr(ptr), size })
    }
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }
    pub fn size(&self) -> u64 {
        self.size
    }
    pub fn device(&self) -> i32 {
        self.device
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let _ctx = ensure_context(self.device);
        // SAFETY: memory we allocated, freed once.
        let _ = call("cuMemFree", || unsafe { sys::cuMemFree_v2(self.ptr.get()) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_every_entry_is_cuda_unavailable() {
        if available() {
            eprintln!("a CUDA driver is present: this no-GPU test has nothing to check");
            return;
        }
        for e in [device_count().unwrap_err(), ensure_context(0).err().unwrap(), call("cuInit", || unreachable!()).unwrap_err()] {
            assert!(matches!(e, Error::CudaUnavailable(_)), "{e}");
            assert!(matches!(e, Error::CudaUnavailable(_)) && e.to_string().contains("no NVIDIA driver"), "{e}");
        }
    }
}
