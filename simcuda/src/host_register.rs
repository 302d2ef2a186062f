//! Registered host memory (`cuMemHostRegister`, `cuMemHostGetDevicePointer`,
//! `cuMemHostUnregister`). A registered range gets a device address range of its own —
//! reserved `PROT_NONE`, so code that passes the host pointer where the device pointer is
//! required fails (the strict reading; `CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM` answers
//! 0) — whose region reaches the registered host pages themselves: a stream's write to it
//! is a store to those pages, seen by the host and by any other process mapping the same
//! file, and a host store to them is seen by the stream.

use crate::memory::{self, Backing, Kind, Region};
use crate::result::*;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub const PORTABLE: u32 = 1;
pub const DEVICEMAP: u32 = 2;
pub const IOMEMORY: u32 = 4;
pub const READ_ONLY: u32 = 8;

/// `SIMCUDA_NO_HOST_REGISTER=1`: the device cannot register host memory.
pub fn supported() -> bool {
    std::env::var("SIMCUDA_NO_HOST_REGISTER").as_deref() != Ok("1")
}

struct Registration {
    len: u64,
    device_start: u64,
    devicemap: bool,
}

/// Host start address → registration.
static REGISTERED: Mutex<BTreeMap<u64, Registration>> = Mutex::new(BTreeMap::new());
static LIVE: AtomicU64 = AtomicU64::new(0);

/// True if every page of `ptr..ptr+len` is mapped in this process.
fn mapped(ptr: u64, len: u64) -> bool {
    let page = memory::PAGE;
    let start = ptr / page * page;
    let pages = (ptr + len).div_ceil(page) * page - start;
    let mut vec = vec![0u8; (pages / page) as usize];
    // SAFETY: mincore only reports on the range; it fails with ENOMEM where a page is not
    // mapped, which is what we ask.
    unsafe { libc::mincore(start as *mut libc::c_void, pages as usize, vec.as_mut_ptr()) == 0 }
}

/// `cuMemHostRegister_v2`.
pub fn register(ptr: u64, len: u64, flags: u32) -> R {
    let ctx = crate::context::current()?;
    if !supported() {
        return Err(NOT_SUPPORTED);
    }
    if ptr == 0 || len == 0 || flags & !(PORTABLE | DEVICEMAP | IOMEMORY | READ_ONLY) != 0 {
        return Err(INVALID_VALUE);
    }
    let end = ptr.checked_add(len).ok_or(INVALID_VALUE)?;
    let mut reg = REGISTERED.lock().unwrap_or_else(|e| e.into_inner());
    let overlaps = reg.range(..end).next_back().is_some_and(|(s, r)| s + r.len > ptr);
    if overlaps {
        return Err(HOST_MEMORY_ALREADY_REGISTERED);
    }
    if !mapped(ptr, len) {
        return Err(INVALID_VALUE);
    }
    let device_start = memory::reserve_range(len.div_ceil(memory::PAGE) * memory::PAGE)?;
    let backing = Backing::borrow(ptr, len)?;
    memory::insert(Region {
        start: device_start,
        len,
        device: ctx.device,
        backing: Arc::new(backing),
        offset: 0,
        kind: Kind::Host,
        accessible: true,
    });
    reg.insert(ptr, Registration { len, device_start, devicemap: flags & DEVICEMAP != 0 });
    // Relaxed: statistics.
    LIVE.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// `cuMemHostUnregister`: `ptr` must be the start of a registered range. Work already
/// queued on it keeps its pages reachable (its region's backing is shared by the queued
/// ops), as the driver leaves such work undefined.
pub fn unregister(ptr: u64) -> R {
    crate::context::current()?;
    let r = REGISTERED.lock().unwrap_or_else(|e| e.into_inner()).remove(&ptr).ok_or(HOST_MEMORY_NOT_REGISTERED)?;
    memory::remove(r.device_start);
    memory::unreserve_range(r.device_start, r.len.div_ceil(memory::PAGE) * memory::PAGE);
    // Relaxed: statistics.
    LIVE.fetch_sub(1, Ordering::Relaxed);
    Ok(())
}

/// `cuMemHostGetDevicePointer_v2`: flags must be 0; `ptr` inside a range registered with
/// `DEVICEMAP`.
pub fn device_pointer(ptr: u64, flags: u32) -> R<u64> {
    crate::context::current()?;
    if flags != 0 {
        return Err(INVALID_VALUE);
    }
    let reg = REGISTERED.lock().unwrap_or_else(|e| e.into_inner());
    let (start, r) = reg.range(..=ptr).next_back().ok_or(INVALID_VALUE)?;
    if ptr >= start + r.len || !r.devicemap {
        return Err(INVALID_VALUE);
    }
    Ok(r.device_start + (ptr - start))
}

pub fn live() -> u64 {
    // Relaxed: statistics.
    LIVE.load(Ordering::Relaxed)
}
