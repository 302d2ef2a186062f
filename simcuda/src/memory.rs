//! Device memory: memfd pages behind a `PROT_NONE` device address range.
//!
//! Each allocation (`cuMemAlloc`, an opened IPC handle, a VMM mapping) is a region of the
//! process's device address space: a range reserved `PROT_NONE` (a host dereference of a
//! device pointer faults, as on hardware) that maps to an offset in a [`Backing`], a memfd
//! whose pages simcuda reaches through a private read-write alias mapping. A `cuMemAlloc`
//! memfd carries one extra metadata page after its data (see `ipc`), which the
//! importers of its IPC handle map too. Registered host memory (`host_register`) is a
//! region too: its device range maps to the caller's own pages.

use crate::result::*;
use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

pub const PAGE: u64 = 4096;

/// Whose pages a [`Backing`] reaches.
enum Pages {
    /// A memfd; the alias is simcuda's own mapping of it (unmapped on drop).
    Memfd(OwnedFd),
    /// Host memory the caller registered (`cuMemHostRegister`): the alias is the caller's
    /// own address, which the caller keeps mapped while it is registered or in use by
    /// queued work (as it must keep pinned pages on hardware); never unmapped here.
    Caller,
}

/// The pages behind device addresses: a memfd and this process's read-write alias of all
/// of it, or registered host memory.
pub struct Backing {
    pages: Pages,
    alias: usize,
    pub len: u64,
}

// SAFETY: the alias is a shared mapping owned by this value (or the caller's registered
// pages); every access goes through raw copies or atomics whose ordering the stream
// workers and events provide, as on a device.
unsafe impl Send for Backing {}
// SAFETY: as above.
unsafe impl Sync for Backing {}

impl Backing {
    /// A new zero-filled memfd of `len` bytes named `name` (shown in /proc/*/fd links).
    pub fn create(name: &str, len: u64) -> R<Backing> {
        let cname = std::ffi::CString::new(name).map_err(|_| INVALID_VALUE)?;
        // SAFETY: a NUL-terminated name; the returned fd is checked below.
        let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(OUT_OF_MEMORY);
        }
        // SAFETY: a fresh fd owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: plain ftruncate on our fd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(OUT_OF_MEMORY);
        }
        Backing::map(fd, len)
    }

    /// Map an existing memfd of (at least) `len` bytes.
    pub fn map(fd: OwnedFd, len: u64) -> R<Backing> {
        // SAFETY: a shared read-write mapping of `len` bytes of a file we hold; checked below.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len as usize, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0)
        };
        if p == libc::MAP_FAILED {
            return Err(MAP_FAILED);
        }
        Ok(Backing { pages: Pages::Memfd(fd), alias: p as usize, len })
    }

    /// The caller's registered host range `[addr, addr + len)` (not mapped or owned here).
    pub fn caller(addr: u64, len: u64) -> Backing {
        Backing { pages: Pages::Caller, alias: addr as usize, len }
    }

    /// The memfd, if the pages are one (None for registered host memory).
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        match &self.pages {
            Pages::Memfd(fd) => Some(fd.as_fd()),
            Pages::Caller => None,
        }
    }

    /// Host address of byte `off` of the alias (callers check `off` against `len`).
    pub fn at(&self, off: u64) -> *mut u8 {
        (self.alias + off as usize) as *mut u8
    }
}

impl Drop for Backing {
    fn drop(&mut self) {
        if let Pages::Memfd(_) = self.pages {
            // SAFETY: unmapping the alias this value mapped; nothing else refers to it
            // (every user holds an Arc to this value).
            unsafe { libc::munmap(self.alias as *mut libc::c_void, self.len as usize) };
        }
    }
}

/// Reserve `len` bytes of device address space: `PROT_NONE`, never backed in the host.
pub fn reserve_range(len: u64) -> R<u64> {
    // SAFETY: an anonymous PROT_NONE reservation; checked below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(OUT_OF_MEMORY);
    }
    Ok(p as u64)
}

pub fn unreserve_range(start: u64, len: u64) {
    // SAFETY: a range `reserve_range` returned, released once by its owner.
    unsafe { libc::munmap(start as *mut libc::c_void, len as usize) };
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `cuMemAlloc`: legacy-IPC capable; `id` names it in IPC handles.
    Alloc { id: u64 },
    /// An opened IPC handle (exporter's allocation `id`).
    IpcOpen { id: u64 },
    /// A VMM mapping of physical allocation `handle`.
    Vmm { handle: u64 },
    /// The device range of host memory registered with `CU_MEMHOSTREGISTER_DEVICEMAP`
    /// (`read_only`: registered `CU_MEMHOSTREGISTER_READ_ONLY`, never written by the device).
    HostRegistered { read_only: bool },
}

#[derive(Clone)]
pub struct Region {
    pub start: u64,
    pub len: u64,
    pub device: i32,
    pub backing: Arc<Backing>,
    /// Offset of the region's first byte in the backing.
    pub offset: u64,
    pub kind: Kind,
    /// VMM mappings are inaccessible until `cuMemSetAccess`.
    pub accessible: bool,
}

static REGIONS: RwLock<BTreeMap<u64, Region>> = RwLock::new(BTreeMap::new());

pub fn insert(r: Region) {
    REGIONS.write().unwrap_or_else(|e| e.into_inner()).insert(r.start, r);
}

pub fn remove(start: u64) -> Option<Region> {
    REGIONS.write().unwrap_or_else(|e| e.into_inner()).remove(&start)
}

/// The region containing `dptr`, if any.
pub fn find(dptr: u64) -> Option<Region> {
    let map = REGIONS.read().unwrap_or_else(|e| e.into_inner());
    let (_, r) = map.range(..=dptr).next_back()?;
    (dptr < r.start + r.len.max(1)).then(|| r.clone())
}

pub fn with_regions<T>(f: impl FnOnce(&mut BTreeMap<u64, Region>) -> T) -> T {
    f(&mut REGIONS.write().unwrap_or_else(|e| e.into_inner()))
}

/// What a copy reads or writes: `n` bytes of a backing from an offset (kept alive by the
/// Arc until the queued copy ran, as the device keeps freed memory's pages until the work
/// using it finished; registered host pages are the caller's to keep mapped).
#[derive(Clone)]
pub struct Span {
    pub backing: Arc<Backing>,
    pub off: u64,
    pub n: u64,
}

/// Resolve `n` bytes at device address `dptr`: the whole range must lie in one accessible
/// region, else CUDA_ERROR_INVALID_VALUE (the driver's answer to a bad pointer argument).
pub fn span(dptr: u64, n: u64) -> R<Span> {
    let r = find(dptr).ok_or(INVALID_VALUE)?;
    let end = dptr.checked_add(n).ok_or(INVALID_VALUE)?;
    if end > r.start + r.len || !r.accessible {
        return Err(INVALID_VALUE);
    }
    Ok(Span { backing: r.backing.clone(), off: r.offset + (dptr - r.start), n })
}

/// As [`span`], for bytes the device writes: host memory registered read-only is
/// CUDA_ERROR_INVALID_VALUE too (the device must not write it; hardware would fault, simcuda
/// refuses at the call: the strict choice).
pub fn span_for_write(dptr: u64, n: u64) -> R<Span> {
    if matches!(find(dptr).map(|r| r.kind), Some(Kind::HostRegistered { read_only: true })) {
        return Err(INVALID_VALUE);
    }
    span(dptr, n)
}

/// Copy between two spans of equal length (may overlap).
pub fn copy(dst: &Span, src: &Span) {
    // SAFETY: both spans were checked to lie inside their backings' aliases, which their
    // Arcs keep mapped (registered host pages: the caller keeps them mapped while work on
    // them is queued); `copy` allows overlap.
    unsafe { std::ptr::copy(src.backing.at(src.off), dst.backing.at(dst.off), src.n as usize) };
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A process-unique, system-unique id (pid in the high bits).
pub fn new_id() -> u64 {
    // Relaxed: a unique counter.
    (u64::from(std::process::id()) << 32) | NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

