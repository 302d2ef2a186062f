//! Virtual memory management: physical allocations (`cuMemCreate`, one memfd each),
//! address reservations, mappings, access, and POSIX-fd shareable handles.
//!
//! A generic allocation handle is a number in a table; its physical memory lives while
//! the handle is retained or mapped anywhere (documented for `cuMemRelease`). A mapping is
//! a region of the device address space (see `memory`) that is inaccessible until
//! `cuMemSetAccess`. The shareable handle is a real fd (a dup of the memfd) that travels
//! by SCM_RIGHTS; importing one checks that it is a simcuda VMM memfd.

use crate::memory::{self, Backing, Kind, Region};
use crate::result::*;
use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub const GRANULARITY: u64 = 2 << 20;
pub const HANDLE_TYPE_POSIX_FD: u32 = 1;
const LOCATION_DEVICE: u32 = 1;
const ALLOCATION_PINNED: u32 = 1;
const PROT_READWRITE: u32 = 3;

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct MemLocation {
    pub type_: u32,
    pub id: i32,
}

/// `CUmemAllocationProp` (the fields simcuda reads come first; the rest is opaque).
#[repr(C)]
pub struct AllocationProp {
    pub type_: u32,
    pub requested_handle_types: u32,
    pub location: MemLocation,
    pub win32_meta: *mut libc::c_void,
    pub alloc_flags: [u8; 8],
}

/// `CUmemAccessDesc`.
#[repr(C)]
pub struct AccessDesc {
    pub location: MemLocation,
    pub flags: u32,
}

struct Physical {
    backing: Arc<Backing>,
    device: i32,
    size: u64,
    shareable: bool,
    /// Handle references (create, import, retain) not yet released.
    refs: u64,
    /// Live mappings of it in this process.
    maps: u64,
}

struct Reservation {
    size: u64,
    /// The PROT_NONE range actually reserved (room for the alignment), freed whole.
    raw: u64,
    raw_len: u64,
}

struct State {
    phys: HashMap<u64, Physical>,
    /// Reservations by (aligned) start.
    reserved: BTreeMap<u64, Reservation>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);
static NEXT_HANDLE: AtomicU64 = AtomicU64::new(0x7600_0000_0001);

fn with<T>(f: impl FnOnce(&mut State) -> T) -> T {
    let mut g = STATE.lock().unwrap_or_else(|e| e.into_inner());
    f(g.get_or_insert_with(|| State { phys: HashMap::new(), reserved: BTreeMap::new() }))
}

fn check_location(l: &MemLocation) -> R<i32> {
    if l.type_ != LOCATION_DEVICE {
        return Err(INVALID_VALUE);
    }
    crate::context::check_device(l.id).map_err(|_| INVALID_DEVICE)?;
    Ok(l.id)
}

fn read_prop(p: *const AllocationProp) -> R<(i32, bool)> {
    if p.is_null() {
        return Err(INVALID_VALUE);
    }
    // SAFETY: the caller passes a valid CUmemAllocationProp (as the API requires).
    let p = unsafe { &*p };
    if p.type_ != ALLOCATION_PINNED {
        return Err(INVALID_VALUE);
    }
    Ok((check_location(&p.location)?, p.requested_handle_types & HANDLE_TYPE_POSIX_FD != 0))
}

/// `cuMemGetAllocationGranularity`: 2 MiB for both minimum and recommended.
pub fn granularity(prop: *const AllocationProp, option: u32) -> R<u64> {
    read_prop(prop)?;
    if option > 1 {
        return Err(INVALID_VALUE);
    }
    Ok(GRANULARITY)
}

fn new_handle(st: &mut State, p: Physical) -> u64 {
    // Relaxed: a unique counter.
    let h = NEXT_HANDLE.fetch_add(1, Ordering::Relaxed);
    st.phys.insert(h, p);
    h
}

/// `cuMemCreate`: size a multiple of the granularity, flags 0 (else INVALID_VALUE).
pub fn create(size: u64, prop: *const AllocationProp, flags: u64) -> R<u64> {
    crate::context::current()?;
    let (device, shareable) = read_prop(prop)?;
    if size == 0 || size % GRANULARITY != 0 || flags != 0 {
        return Err(INVALID_VALUE);
    }
    let backing = Backing::create(&format!("simcuda-vmm-{}", memory::new_id()), size)?;
    Ok(with(|st| new_handle(st, Physical { backing: Arc::new(backing), device, size, shareable, refs: 1, maps: 0 })))
}

fn forget_if_unused(st: &mut State, h: u64) {
    if st.phys.get(&h).is_some_and(|p| p.refs == 0 && p.maps == 0) {
        st.phys.remove(&h);
    }
}

/// `cuMemRelease`: an unknown (or fully released) handle is CUDA_ERROR_INVALID_VALUE
/// (documented as undefined behaviour; the strict choice).
pub fn release(h: u64) -> R {
    with(|st| {
        let p = st.phys.get_mut(&h).filter(|p| p.refs > 0).ok_or(INVALID_VALUE)?;
        p.refs -= 1;
        forget_if_unused(st, h);
        Ok(())
    })
}

pub fn address_reserve(size: u64, alignment: u64, addr: u64, flags: u64) -> R<u64> {
    crate::context::current()?;
    if size == 0 || size % GRANULARITY != 0 || flags != 0 || (alignment != 0 && !alignment.is_power_of_two()) {
        return Err(INVALID_VALUE);
    }
    // `addr` is a hint; simcuda ignores it (the documentation allows that).
    let _ = addr;
    let align = alignment.max(GRANULARITY);
    let raw_len = size + align;
    let raw = memory::reserve_range(raw_len)?;
    let start = raw.div_ceil(align) * align;
    with(|st| st.reserved.insert(start, Reservation { size, raw, raw_len }));
    Ok(start)
}

/// `cuMemAddressFree`: exactly a reservation (start and size), with nothing mapped in it
/// (a mapping left there is CUDA_ERROR_INVALID_VALUE: the documentation is silent; the
/// strict choice).
pub fn address_free(ptr: u64, size: u64) -> R {
    with(|st| {
        let r = st.reserved.get(&ptr).filter(|r| r.size == size).ok_or(INVALID_VALUE)?;
        let (raw, raw_len) = (r.raw, r.raw_len);
        let mapped = memory::with_regions(|m| m.range(ptr..ptr + size).next().is_some());
        if mapped {
            return Err(INVALID_VALUE);
        }
        st.reserved.remove(&ptr);
        memory::unreserve_range(raw, raw_len);
        Ok(())
    })
}

/// `cuMemMap`: inside one reservation, over no other mapping, `offset + size` inside the
/// physical allocation, flags 0.
pub fn map(ptr: u64, size: u64, offset: u64, h: u64, flags: u64) -> R {
    with(|st| {
        let inside = st.reserved.range(..=ptr).next_back().is_some_and(|(&s, r)| ptr + size <= s + r.size);
        if !inside || size == 0 || flags != 0 || size % GRANULARITY != 0 || offset % GRANULARITY != 0 {
            return Err(INVALID_VALUE);
        }
        let p = st.phys.get_mut(&h).filter(|p| p.refs > 0).ok_or(INVALID_HANDLE)?;
        if offset.checked_add(size).is_none_or(|e| e > p.size) {
            return Err(INVALID_VALUE);
        }
        let overlaps = memory::with_regions(|m| {
            m.range(..ptr + size).next_back().is_some_and(|(_, r)| r.start + r.len > ptr)
        });
        if overlaps {
            return Err(INVALID_VALUE);
        }
        p.maps += 1;
        memory::insert(Region {
            start: ptr,
            len: size,
            device: p.device,
            backing: p.backing.clone(),
            offset,
            kind: Kind::Vmm { handle: h },
            accessible: false,
        });
        Ok(())
    })
}

/// The VMM mappings exactly covering [ptr, ptr+size) (else INVALID_VALUE).
fn covering(ptr: u64, size: u64) -> R<Vec<u64>> {
    memory::with_regions(|m| {
        let mut at = ptr;
        let mut starts = Vec::new();
        for (_, r) in m.range(ptr..ptr + size) {
            if r.start != at || !matches!(r.kind, Kind::Vmm { .. }) {
                return Err(INVALID_VALUE);
            }
            starts.push(r.start);
            at = r.start + r.len;
        }
        if at != ptr + size || starts.is_empty() { Err(INVALID_VALUE) } else { Ok(starts) }
    })
}

/// `cuMemSetAccess`: read-write for a device location (read-only is not simulated:
/// CUDA_ERROR_NOT_SUPPORTED), over mapped ranges only.
pub fn set_access(ptr: u64, size: u64, desc: *const AccessDesc, count: usize) -> R {
    if desc.is_null() || count == 0 {
        return Err(INVALID_VALUE);
    }
    // SAFETY: the caller passes `count` valid access descriptors (as the API requires).
    let descs = unsafe { std::slice::from_raw_parts(desc, count) };
    for d in descs {
        check_location(&d.location)?;
        if d.flags != PROT_READWRITE {
            return Err(NOT_SUPPORTED);
        }
    }
    let starts = covering(ptr, size)?;
    memory::with_regions(|m| {
        for s in starts {
            if let Some(r) = m.get_mut(&s) {
                r.accessible = true;
            }
        }
    });
    Ok(())
}

/// `cuMemUnmap`: whole mappings only.
pub fn unmap(ptr: u64, size: u64) -> R {
    let starts = covering(ptr, size)?;
    with(|st| {
        for s in starts {
            if let Some(r) = memory::remove(s)
                && let Kind::Vmm { handle } = r.kind
            {
                if let Some(p) = st.phys.get_mut(&handle) {
                    p.maps -= 1;
                }
                forget_if_unused(st, handle);
            }
        }
    });
    Ok(())
}

/// `cuMemExportToShareableHandle` for `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: a new fd.
/// Other types, or memory created without that type requested, are
/// CUDA_ERROR_NOT_SUPPORTED / CUDA_ERROR_INVALID_VALUE.
pub fn export(out: *mut libc::c_void, h: u64, handle_type: u32, flags: u64) -> R {
    if handle_type != HANDLE_TYPE_POSIX_FD {
        return Err(NOT_SUPPORTED);
    }
    if out.is_null() || flags != 0 {
        return Err(INVALID_VALUE);
    }
    let fd = with(|st| {
        let p = st.phys.get(&h).filter(|p| p.refs > 0).ok_or(INVALID_VALUE)?;
        if !p.shareable {
            return Err(INVALID_VALUE);
        }
        let memfd = p.backing.fd().ok_or(INVALID_VALUE)?.as_raw_fd();
        // SAFETY: dup of a memfd we hold, close-on-exec.
        let fd = unsafe { libc::fcntl(memfd, libc::F_DUPFD_CLOEXEC, 0) };
        if fd < 0 { Err(OUT_OF_MEMORY) } else { Ok(fd) }
    })?;
    out_int(out, fd)
}

fn out_int(out: *mut libc::c_void, v: i32) -> R {
    // SAFETY: for the POSIX-fd type the caller passes a pointer to an int.
    unsafe { out.cast::<i32>().write(v) };
    Ok(())
}

/// `cuMemImportFromShareableHandle`: the fd (passed as the pointer value) must be a
/// simcuda VMM memfd; simcuda dups it (the caller keeps and closes its own).
pub fn import(os_handle: usize, handle_type: u32) -> R<u64> {
    let ctx = crate::context::current()?;
    if handle_type != HANDLE_TYPE_POSIX_FD {
        return Err(NOT_SUPPORTED);
    }
    let fd = i32::try_from(os_handle).map_err(|_| INVALID_VALUE)?;
    let link = std::fs::read_link(format!("/proc/self/fd/{fd}")).map_err(|_| INVALID_VALUE)?;
    if !link.to_string_lossy().starts_with("/memfd:simcuda-vmm-") {
        return Err(INVALID_VALUE);
    }
    // SAFETY: dup of the caller's fd, close-on-exec; checked below.
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return Err(INVALID_VALUE);
    }
    // SAFETY: a fresh fd owned by nobody else.
    let dup = unsafe { OwnedFd::from_raw_fd(dup) };
    // SAFETY: fstat into a zeroed struct on our fd.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(dup.as_raw_fd(), &mut stat) } != 0 || stat.st_size <= 0 || stat.st_size as u64 % GRANULARITY != 0 {
        return Err(INVALID_VALUE);
    }
    let size = stat.st_size as u64;
    let backing = Backing::map(dup, size)?;
    Ok(with(|st| new_handle(st, Physical { backing: Arc::new(backing), device: ctx.device, size, shareable: true, refs: 1, maps: 0 })))
}

/// `cuMemRetainAllocationHandle`: any address inside a VMM mapping (documented: "not
/// necessarily the start address"); else CUDA_ERROR_INVALID_VALUE.
pub fn retain(addr: u64) -> R<u64> {
    let r = memory::find(addr).ok_or(INVALID_VALUE)?;
    let Kind::Vmm { handle } = r.kind else { return Err(INVALID_VALUE) };
    with(|st| {
        let p = st.phys.get_mut(&handle).ok_or(INVALID_VALUE)?;
        p.refs += 1;
        Ok(handle)
    })
}

/// (handles retained, mappings, reservations).
pub fn counts() -> (u64, u64, u64) {
    with(|st| (st.phys.values().filter(|p| p.refs > 0).count() as u64, st.phys.values().map(|p| p.maps).sum(), st.reserved.len() as u64))
}
