//! Exported driver entry points, part 1: initialisation, errors, devices, contexts,
//! streams, events and IPC event handles. Named by their ABI symbols (what cuda.h's
//! macros map the API names to, and what cudarc's dynamic loading looks up). Each runs in
//! `guard` (initialisation check, fault injection, no unwinding into C); the pointer
//! arguments are the C caller's, as the driver API defines them.

use crate::guard::guard;
use crate::result::*;
use crate::{context, events, ipc, stream};
use std::ffi::c_char;

/// A `CUipcEventHandle` / `CUipcMemHandle` passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IpcHandle {
    pub reserved: [u8; 64],
}

#[unsafe(no_mangle)]
pub extern "C" fn cuInit(flags: u32) -> CuResult {
    guard("cuInit", false, || {
        context::init(flags)?;
        // Work queued before a normal exit still runs (stream.rs).
        crate::stream::install_exit_drain();
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut i32) -> CuResult {
    // Claims the version cudarc's bindings were generated for (13.2).
    guard("cuDriverGetVersion", false, || out(v, 13020))
}

fn lookup(code: CuResult, p: *mut *const c_char, name: bool) -> R {
    let (_, n, s) = CODES.iter().find(|c| c.0 == code).ok_or(INVALID_VALUE)?;
    out(p, if name { n.as_ptr() } else { s.as_ptr() }.cast())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(code: CuResult, p: *mut *const c_char) -> CuResult {
    guard("cuGetErrorName", false, || lookup(code, p, true))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(code: CuResult, p: *mut *const c_char) -> CuResult {
    guard("cuGetErrorString", false, || lookup(code, p, false))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut i32) -> CuResult {
    guard("cuDeviceGetCount", true, || out(n, context::device_count()))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut i32, ordinal: i32) -> CuResult {
    guard("cuDeviceGet", true, || {
        context::check_device(ordinal)?;
        out(dev, ordinal)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: i32, dev: i32) -> CuResult {
    guard("cuDeviceGetName", true, || {
        context::check_device(dev)?;
        let s = format!("simcuda device {dev}\0");
        if name.is_null() || len <= 0 {
            return Err(INVALID_VALUE);
        }
        let n = s.len().min(len as usize);
        // SAFETY: the caller passes `len` writable bytes; the last one written is NUL.
        unsafe {
            std::ptr::copy_nonoverlapping(s.as_ptr().cast(), name, n);
            *name.add(n - 1) = 0;
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: i32) -> CuResult {
    guard("cuDeviceTotalMem_v2", true, || {
        context::check_device(dev)?;
        out(bytes, 80usize << 30)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(v: *mut i32, attr: i32, dev: i32) -> CuResult {
    guard("cuDeviceGetAttribute", true, || {
        context::check_device(dev)?;
        let settings = crate::settings::get();
        let memops = i32::from(settings.memops);
        let value = match attr {
            1 => 1024,      // MAX_THREADS_PER_BLOCK
            10 => 32,       // WARP_SIZE
            16 => 132,      // MULTIPROCESSOR_COUNT
            19 => 1,        // CAN_MAP_HOST_MEMORY
            33 => dev + 1,  // PCI_BUS_ID
            34 => 0,        // PCI_DEVICE_ID
            41 => 1,        // UNIFIED_ADDRESSING
            75 => 9,        // COMPUTE_CAPABILITY_MAJOR
            76 => 0,        // COMPUTE_CAPABILITY_MINOR
            // The device pointer of registered host memory is not the host pointer
            // (host_register.rs: the strict choice).
            91 => 0,        // CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM
            // The v1 attributes describe the v1 entry points; CUDA 13's driver (580 on an
            // H200) answers 0 for all three while its v2 memops work: calibrated.
            92 => 0,        // CAN_USE_STREAM_MEM_OPS_V1
            93 => 0,        // CAN_USE_64_BIT_STREAM_MEM_OPS_V1
            94 => 0,        // CAN_USE_STREAM_WAIT_VALUE_NOR_V1
            // CU_STREAM_WAIT_VALUE_FLUSH is refused, as on x86 (memops.rs).
            98 => 0,        // CAN_FLUSH_REMOTE_WRITES
            99 => i32::from(settings.host_register), // HOST_REGISTER_SUPPORTED
            102 => 1,       // VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
            103 => 1,       // HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
            113 => 1,       // READ_ONLY_HOST_REGISTER_SUPPORTED
            122 => memops,  // CAN_USE_64_BIT_STREAM_MEM_OPS
            123 => memops,  // CAN_USE_STREAM_WAIT_VALUE_NOR
            125 => 1,       // IPC_EVENT_SUPPORTED
            133 => i32::from(settings.mps), // MPS_ENABLED
            // Not simulated: an error, not a made-up value.
            _ => return Err(INVALID_VALUE),
        };
        out(v, value)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut usize, dev: i32) -> CuResult {
    guard("cuDevicePrimaryCtxRetain", true, || {
        if pctx.is_null() {
            return Err(INVALID_VALUE);
        }
        let h = context::retain(dev)?;
        out(pctx, h)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: i32) -> CuResult {
    guard("cuDevicePrimaryCtxRelease_v2", true, || context::release(dev))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut usize) -> CuResult {
    guard("cuCtxGetCurrent", true, || out(pctx, context::current_handle()))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetCurrent(ctx: usize) -> CuResult {
    guard("cuCtxSetCurrent", true, || context::set(ctx))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxPushCurrent_v2(ctx: usize) -> CuResult {
    guard("cuCtxPushCurrent_v2", true, || context::push(ctx))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(pctx: *mut usize) -> CuResult {
    guard("cuCtxPopCurrent_v2", true, || {
        let h = context::pop()?;
        if !pctx.is_null() {
            out(pctx, h)?;
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut i32) -> CuResult {
    guard("cuCtxGetDevice", true, || out(dev, context::current()?.device))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize() -> CuResult {
    guard("cuCtxSynchronize", true, stream::synchronize_device)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(ps: *mut usize, flags: u32) -> CuResult {
    guard("cuStreamCreate", true, || {
        if ps.is_null() {
            return Err(INVALID_VALUE);
        }
        out(ps, stream::create(flags)?)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamDestroy_v2(s: usize) -> CuResult {
    guard("cuStreamDestroy_v2", true, || stream::destroy(s))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamSynchronize(s: usize) -> CuResult {
    guard("cuStreamSynchronize", true, || {
        stream::resolve(s)?.synchronize();
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamQuery(s: usize) -> CuResult {
    guard("cuStreamQuery", true, || if stream::resolve(s)?.idle() { Ok(()) } else { Err(NOT_READY) })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWaitEvent(s: usize, ev: usize, flags: u32) -> CuResult {
    guard("cuStreamWaitEvent", true, || events::stream_wait(s, ev, flags))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(pev: *mut usize, flags: u32) -> CuResult {
    guard("cuEventCreate", true, || {
        if pev.is_null() {
            return Err(INVALID_VALUE);
        }
        out(pev, events::create(flags)?)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventDestroy_v2(ev: usize) -> CuResult {
    guard("cuEventDestroy_v2", true, || events::destroy(ev))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecord(ev: usize, s: usize) -> CuResult {
    guard("cuEventRecord", true, || events::record(ev, s))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventQuery(ev: usize) -> CuResult {
    guard("cuEventQuery", true, || events::query(ev))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventSynchronize(ev: usize) -> CuResult {
    guard("cuEventSynchronize", true, || events::synchronize(ev))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcGetEventHandle(h: *mut IpcHandle, ev: usize) -> CuResult {
    guard("cuIpcGetEventHandle", true, || out(h, IpcHandle { reserved: ipc::get_event_handle(ev)? }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcOpenEventHandle(pev: *mut usize, h: IpcHandle) -> CuResult {
    guard("cuIpcOpenEventHandle", true, || {
        if pev.is_null() {
            return Err(INVALID_VALUE);
        }
        out(pev, ipc::open_event(&h.reserved)?)
    })
}
