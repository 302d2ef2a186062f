//! Host memory registration: `cuMemHostRegister`, `cuMemHostUnregister`,
//! `cuMemHostGetDevicePointer`.
//!
//! A registration records the caller's range. With `CU_MEMHOSTREGISTER_DEVICEMAP` it also
//! gets a device address range of its own, reserved `PROT_NONE` like every device range
//! (`memory`): a region whose pages are the caller's, so copies and stream memory
//! operations on the device pointer reach the host pages, and two processes that register
//! their own shared mappings of one memfd see each other's writes through those pages. The
//! host pointer itself is not a device address (the strict choice: the device reports
//! `CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM` = 0, and the documentation says the device
//! pointer then does not match the host pointer), so code that hands the host pointer to
//! a stream operation fails here as it would on such a device.

use crate::memory::{self, Backing, Kind, PAGE, Region};
use crate::result::*;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

pub const PORTABLE: u32 = 1;
pub const DEVICEMAP: u32 = 2;
pub const IOMEMORY: u32 = 4;
pub const READ_ONLY: u32 = 8;

/// The device range of a `DEVICEMAP` registration.
struct DeviceRange {
    dptr: u64,
    /// The `PROT_NONE` reservation holding it (page-aligned; `dptr` keeps the host
    /// pointer's offset in its page, so alignment carries over).
    reserved: u64,
    reserved_len: u64,
}

struct Registration {
    len: u64,
    device: Option<DeviceRange>,
}

/// This process's registrations by host start address.
static REGS: Mutex<BTreeMap<u64, Registration>> = Mutex::new(BTreeMap::new());

fn regs() -> std::sync::MutexGuard<'static, BTreeMap<u64, Registration>> {
    REGS.lock().unwrap_or_else(|e| e.into_inner())
}

/// True if `[start, end)` is mapped in this process, readable, and writable when `write`
/// (from /proc/self/maps: a registration is rare, the file is short).
fn mapped(start: u64, end: u64, write: bool) -> bool {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else { return false };
    let mut at = start - start % PAGE;
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else { continue };
        let Some((s, e)) = range.split_once('-') else { continue };
        let (Ok(s), Ok(e)) = (u64::from_str_radix(s, 16), u64::from_str_radix(e, 16)) else { continue };
        if e <= at {
            continue;
        }
        // The lines are sorted: a mapping starting after `at` leaves a hole.
        if s > at {
            return false;
        }
        let p = perms.as_bytes();
        if p.first() != Some(&b'r') || (write && p.get(1) != Some(&b'w')) {
            return false;
        }
        at = e;
        if at >= end {
            return true;
        }
    }
    false
}

/// `cuMemHostRegister`: flags a subset of PORTABLE | DEVICEMAP | IOMEMORY | READ_ONLY, a
/// non-null pointer and a non-zero size (else CUDA_ERROR_INVALID_VALUE); a range that
/// overlaps a registered one is CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED (documented); the
/// range must be mapped, readable and (without READ_ONLY) writable, else
/// CUDA_ERROR_INVALID_VALUE. IOMEMORY (a third-party device's I/O space) is
/// CUDA_ERROR_NOT_SUPPORTED: there is none to simulate (a documented answer for it).
pub fn register(p: u64, size: u64, flags: u32) -> R {
    let ctx = crate::context::current()?;
    if !crate::settings::get().host_register {
        return Err(NOT_SUPPORTED);
    }
    if flags & !(PORTABLE | DEVICEMAP | IOMEMORY | READ_ONLY) != 0 || p == 0 || size == 0 {
        return Err(INVALID_VALUE);
    }
    let end = p.checked_add(size).ok_or(INVALID_VALUE)?;
    if flags & IOMEMORY != 0 {
        return Err(NOT_SUPPORTED);
    }
    let read_only = flags & READ_ONLY != 0;
    let mut regs = regs();
    if regs.range(..end).next_back().is_some_and(|(&s, r)| s + r.len > p) {
        return Err(HOST_MEMORY_ALREADY_REGISTERED);
    }
    if !mapped(p, end, !read_only) {
        return Err(INVALID_VALUE);
    }
    let device = if flags & DEVICEMAP != 0 {
        let in_page = p % PAGE;
        let reserved_len = (in_page + size).div_ceil(PAGE) * PAGE;
        let reserved = memory::reserve_range(reserved_len)?;
        let dptr = reserved + in_page;
        memory::insert(Region {
            start: dptr,
            len: size,
            device: ctx.device,
            backing: Arc::new(Backing::caller(p, size)),
            offset: 0,
            kind: Kind::HostRegistered { read_only },
            accessible: true,
        });
        Some(DeviceRange { dptr, reserved, reserved_len })
    } else {
        None
    };
    regs.insert(p, Registration { len: size, device });
    Ok(())
}

/// `cuMemHostUnregister`: `p` must be the start of a registered range (documented: "the
/// base address must be the same one specified to cuMemHostRegister"): an interior
/// pointer is CUDA_ERROR_INVALID_VALUE (calibrated: the H200's driver 580 answers so),
/// anything else CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED. Work already queued on the device
/// pointer still runs: it holds the region's pages (the caller's, which it keeps mapped
/// until that work ran, as pinned pages on hardware).
pub fn unregister(p: u64) -> R {
    crate::context::current()?;
    let mut regs = regs();
    let Some(r) = regs.remove(&p) else {
        let interior = regs.range(..p).next_back().is_some_and(|(&start, r)| p < start + r.len);
        return Err(if interior { INVALID_VALUE } else { HOST_MEMORY_NOT_REGISTERED });
    };
    drop(regs);
    if let Some(d) = r.device {
        memory::remove(d.dptr);
        memory::unreserve_range(d.reserved, d.reserved_len);
    }
    Ok(())
}

/// `cuMemHostGetDevicePointer`: flags must be 0 (documented); `p` anywhere inside a range
/// registered with DEVICEMAP (documented: fails if the memory was not mapped), else
/// CUDA_ERROR_INVALID_VALUE. The device pointer never equals the host pointer (see above).
pub fn device_pointer(p: u64, flags: u32) -> R<u64> {
    crate::context::current()?;
    if flags != 0 {
        return Err(INVALID_VALUE);
    }
    let regs = regs();
    let (&start, r) = regs.range(..=p).next_back().filter(|(s, r)| p < **s + r.len).ok_or(INVALID_VALUE)?;
    let d = r.device.as_ref().ok_or(INVALID_VALUE)?;
    Ok(d.dptr + (p - start))
}

/// Live registrations.
pub fn live() -> u64 {
    regs().len() as u64
}
