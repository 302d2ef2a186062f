//! Exported driver entry points, part 2: memory, copies, IPC memory handles, pointer
//! attributes and VMM. Copies follow the documented host-synchronisation rules for
//! pageable host memory (the strictest the documentation allows):
//! - `cuMemcpyHtoD`: the legacy stream is synchronised, the host bytes are staged, the
//!   copy is queued on the legacy stream and the call returns (the copy may not be done).
//! - `cuMemcpyDtoH`, `cuMemcpyDtoHAsync`: return once the copy completed.
//! - `cuMemcpyHtoDAsync`: stages the host bytes at once, queues the copy.
//! - `cuMemcpyDtoD`, `cuMemcpyDtoDAsync`, `cuMemsetD8`, `cuMemsetD8Async`: queued, no host
//!   synchronisation.

use crate::exports_ctx::IpcHandle;
use crate::memory::{self, Kind, Span};
use crate::guard::guard;
use crate::result::*;
use crate::stream::{self, Op};
use crate::{context, ipc, vmm};
use std::ffi::c_void;
use std::sync::{Arc, Condvar, Mutex};

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut u64, size: usize) -> CuResult {
    guard("cuMemAlloc_v2", true, || {
        if dptr.is_null() {
            return Err(INVALID_VALUE);
        }
        out(dptr, crate::allocation::alloc(size as u64)?)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(dptr: u64) -> CuResult {
    guard("cuMemFree_v2", true, || crate::allocation::free(dptr))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAddressRange_v2(base: *mut u64, size: *mut usize, dptr: u64) -> CuResult {
    guard("cuMemGetAddressRange_v2", true, || {
        context::current()?;
        // Documented for cuMemAlloc memory; registered host memory's device range is not
        // an allocation (the strict choice: CUDA_ERROR_NOT_FOUND).
        let r = memory::find(dptr).filter(|r| !matches!(r.kind, Kind::HostRegistered { .. })).ok_or(NOT_FOUND)?;
        if !base.is_null() {
            out(base, r.start)?;
        }
        if !size.is_null() {
            out(size, r.len as usize)?;
        }
        Ok(())
    })
}

/// Host bytes the C caller passed, copied now (staging).
fn stage(src: *const c_void, n: usize) -> R<Vec<u8>> {
    if src.is_null() {
        return Err(INVALID_VALUE);
    }
    // SAFETY: the caller passes `n` readable host bytes (as the API requires).
    Ok(unsafe { std::slice::from_raw_parts(src.cast::<u8>(), n) }.to_vec())
}

fn write_host(dst: usize, from: &Span) {
    // SAFETY: the DtoH caller passed `n` writable host bytes at `dst` and waits for this
    // op before it returns; the span lies inside its backing (mapped: see `htod`).
    unsafe { std::ptr::copy_nonoverlapping(from.backing.at(from.off), dst as *mut u8, from.n as usize) };
}

fn htod(dst: u64, src: *const c_void, n: usize, s: usize, sync_first: bool) -> R {
    let stream = stream::resolve(s)?;
    if n == 0 {
        return Ok(());
    }
    let span = memory::span_for_write(dst, n as u64)?;
    let bytes = stage(src, n)?;
    if sync_first {
        stream.synchronize();
    }
    stream::enqueue(
        &stream,
        Op::Work(Box::new(move || {
            // SAFETY: the span lies inside its backing (checked by `span`; kept mapped by its
            // Arc, or registered host pages the caller keeps mapped); `bytes` has n bytes.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), span.backing.at(span.off), bytes.len()) };
        })),
    );
    Ok(())
}

/// Queue `op` on `s` and return once it ran.
fn run_and_wait(s: &Arc<stream::Stream>, op: impl FnOnce() + Send + 'static) {
    let done = Arc::new((Mutex::new(false), Condvar::new()));
    let d2 = done.clone();
    stream::enqueue(
        s,
        Op::Work(Box::new(move || {
            op();
            *d2.0.lock().unwrap_or_else(|e| e.into_inner()) = true;
            d2.1.notify_all();
        })),
    );
    let mut g = done.0.lock().unwrap_or_else(|e| e.into_inner());
    while !*g {
        g = done.1.wait(g).unwrap_or_else(|e| e.into_inner());
    }
}

fn dtoh(dst: *mut c_void, src: u64, n: usize, s: usize) -> R {
    let stream = stream::resolve(s)?;
    if n == 0 {
        return Ok(());
    }
    if dst.is_null() {
        return Err(INVALID_VALUE);
    }
    let span = memory::span(src, n as u64)?;
    let dst = dst as usize;
    run_and_wait(&stream, move || write_host(dst, &span));
    Ok(())
}

fn dtod(dst: u64, src: u64, n: usize, s: usize) -> R {
    let stream = stream::resolve(s)?;
    if n == 0 {
        return Ok(());
    }
    let (d, sp) = (memory::span_for_write(dst, n as u64)?, memory::span(src, n as u64)?);
    stream::enqueue(&stream, Op::Work(Box::new(move || memory::copy(&d, &sp))));
    Ok(())
}

fn memset8(dst: u64, v: u8, n: usize, s: usize) -> R {
    let stream = stream::resolve(s)?;
    if n == 0 {
        return Ok(());
    }
    let d = memory::span_for_write(dst, n as u64)?;
    stream::enqueue(
        &stream,
        Op::Work(Box::new(move || {
            // SAFETY: the span lies inside its backing (checked by `span`; kept mapped by its
            // Arc, or registered host pages the caller keeps mapped).
            unsafe { std::ptr::write_bytes(d.backing.at(d.off), v, d.n as usize) };
        })),
    );
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, n: usize) -> CuResult {
    guard("cuMemcpyHtoD_v2", true, || htod(dst, src, n, 0, true))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(dst: u64, src: *const c_void, n: usize, s: usize) -> CuResult {
    guard("cuMemcpyHtoDAsync_v2", true, || htod(dst, src, n, s, false))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, n: usize) -> CuResult {
    guard("cuMemcpyDtoH_v2", true, || dtoh(dst, src, n, 0))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: u64, n: usize, s: usize) -> CuResult {
    guard("cuMemcpyDtoHAsync_v2", true, || dtoh(dst, src, n, s))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoD_v2(dst: u64, src: u64, n: usize) -> CuResult {
    guard("cuMemcpyDtoD_v2", true, || dtod(dst, src, n, 0))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoDAsync_v2(dst: u64, src: u64, n: usize, s: usize) -> CuResult {
    guard("cuMemcpyDtoDAsync_v2", true, || dtod(dst, src, n, s))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD8_v2(dst: u64, v: u8, n: usize) -> CuResult {
    guard("cuMemsetD8_v2", true, || memset8(dst, v, n, 0))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD8Async(dst: u64, v: u8, n: usize, s: usize) -> CuResult {
    guard("cuMemsetD8Async", true, || memset8(dst, v, n, s))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcGetMemHandle(h: *mut IpcHandle, dptr: u64) -> CuResult {
    guard("cuIpcGetMemHandle", true, || out(h, IpcHandle { reserved: ipc::get_mem_handle(dptr)? }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcOpenMemHandle_v2(pdptr: *mut u64, h: IpcHandle, flags: u32) -> CuResult {
    guard("cuIpcOpenMemHandle_v2", true, || {
        if pdptr.is_null() {
            return Err(INVALID_VALUE);
        }
        out(pdptr, ipc::open_mem(&h.reserved, flags)?)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuIpcCloseMemHandle(dptr: u64) -> CuResult {
    guard("cuIpcCloseMemHandle", true, || ipc::close_mem(dptr))
}

/// `cuPointerGetAttribute`: needs no current context (unified addressing). Booleans are
/// written as one byte (the documented `bool`), so a caller that reads an int must
/// initialise it. An unknown pointer or an attribute not simulated is
/// CUDA_ERROR_INVALID_VALUE.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuPointerGetAttribute(data: *mut c_void, attr: i32, ptr: u64) -> CuResult {
    guard("cuPointerGetAttribute", true, || {
        if data.is_null() {
            return Err(INVALID_VALUE);
        }
        let r = memory::find(ptr).ok_or(INVALID_VALUE)?;
        match attr {
            1 => out(data.cast::<usize>(), context::handle(context::check_device(r.device)?)),
            // CU_MEMORYTYPE_HOST for registered host memory, else CU_MEMORYTYPE_DEVICE.
            2 => out(data.cast::<u32>(), if matches!(r.kind, Kind::HostRegistered { .. }) { 1 } else { 2 }),
            3 => out(data.cast::<u64>(), ptr),
            9 => out(data.cast::<i32>(), r.device),
            10 => out(data.cast::<u8>(), u8::from(matches!(r.kind, Kind::Alloc { .. }))),
            11 => out(data.cast::<u64>(), r.start),
            12 => out(data.cast::<usize>(), r.len as usize),
            13 => out(data.cast::<u8>(), 1),
            14 => out(data.cast::<u64>(), u64::from(matches!(r.kind, Kind::Vmm { .. }))),
            _ => Err(INVALID_VALUE),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(g: *mut usize, prop: *const vmm::AllocationProp, option: u32) -> CuResult {
    guard("cuMemGetAllocationGranularity", true, || out(g, vmm::granularity(prop, option)? as usize))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(h: *mut u64, size: usize, prop: *const vmm::AllocationProp, flags: u64) -> CuResult {
    guard("cuMemCreate", true, || {
        if h.is_null() {
            return Err(INVALID_VALUE);
        }
        out(h, vmm::create(size as u64, prop, flags)?)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemRelease(h: u64) -> CuResult {
    guard("cuMemRelease", true, || vmm::release(h))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressReserve(p: *mut u64, size: usize, align: usize, addr: u64, flags: u64) -> CuResult {
    guard("cuMemAddressReserve", true, || {
        if p.is_null() {
            return Err(INVALID_VALUE);
        }
        out(p, vmm::address_reserve(size as u64, align as u64, addr, flags)?)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAddressFree(ptr: u64, size: usize) -> CuResult {
    guard("cuMemAddressFree", true, || vmm::address_free(ptr, size as u64))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemMap(ptr: u64, size: usize, offset: usize, h: u64, flags: u64) -> CuResult {
    guard("cuMemMap", true, || vmm::map(ptr, size as u64, offset as u64, h, flags))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemUnmap(ptr: u64, size: usize) -> CuResult {
    guard("cuMemUnmap", true, || vmm::unmap(ptr, size as u64))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemSetAccess(ptr: u64, size: usize, desc: *const vmm::AccessDesc, count: usize) -> CuResult {
    guard("cuMemSetAccess", true, || vmm::set_access(ptr, size as u64, desc, count))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemExportToShareableHandle(out_h: *mut c_void, h: u64, ty: u32, flags: u64) -> CuResult {
    guard("cuMemExportToShareableHandle", true, || vmm::export(out_h, h, ty, flags))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(h: *mut u64, os: *mut c_void, ty: u32) -> CuResult {
    guard("cuMemImportFromShareableHandle", true, || {
        if h.is_null() {
            return Err(INVALID_VALUE);
        }
        out(h, vmm::import(os as usize, ty)?)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(h: *mut u64, addr: *mut c_void) -> CuResult {
    guard("cuMemRetainAllocationHandle", true, || {
        if h.is_null() {
            return Err(INVALID_VALUE);
        }
        out(h, vmm::retain(addr as u64)?)
    })
}
