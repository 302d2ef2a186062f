//! Legacy IPC: memory handles (`cuIpcGetMemHandle`/`cuIpcOpenMemHandle`) and event
//! handles (`cuIpcGetEventHandle`/`cuIpcOpenEventHandle`).
//!
//! A handle names the exporter's memfd by process and fd number: 64 bytes =
//! magic (`SIMCUDAM` memory, `SIMCUDAE` event) | pid u32 | fd i32 | id u64 | size u64 |
//! device i32 | zero u32 | pid namespace u64 | zeros. A handle made in another pid
//! namespace is refused with CUDA_ERROR_INVALID_VALUE, as the driver refuses legacy IPC
//! across pid namespaces (a sandboxed process in its own cannot open its host's handles,
//! nor the host the sandbox's: they go by VMM fd). The importer opens `/proc/<pid>/fd/<fd>` (a process of the same
//! user may), checks that the link names the memfd `simcuda-mem-<id>` (or
//! `simcuda-event-<id>`) and that the page it maps holds that id, and maps the same pages.
//!
//! An allocation's metadata page (after its data) has 64 importer slots (pid, open
//! count): the exporter's `cuMemFree` looks there and reports a free while a live process
//! still has the handle open (documented as undefined behaviour) on stderr and in
//! `simcuda_stats().free_while_imported`.

use crate::memory::{self, Backing, Kind, PAGE, Region};
use crate::process::alive;
use crate::result::*;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

const MAGIC_MEM: &[u8; 8] = b"SIMCUDAM";
const MAGIC_EVENT: &[u8; 8] = b"SIMCUDAE";
const META_MAGIC: u64 = 0x5349_4d43_5544_414d;
const SLOTS: usize = 64;
pub const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: u32 = 1;

static FREE_WHILE_OPEN: AtomicU64 = AtomicU64::new(0);

fn meta(b: &Backing, data: u64) -> &[AtomicU64; 4 + SLOTS] {
    // SAFETY: the metadata page follows `data` bytes of data in every allocation's
    // backing (page-aligned, mapped while `b` lives); accessed only atomically.
    unsafe { &*b.at(data).cast::<[AtomicU64; 4 + SLOTS]>() }
}

/// Fill a new allocation's metadata page.
pub fn init_meta(b: &Backing, data: u64, size: u64, id: u64) {
    let m = meta(b, data);
    // Relaxed: written before the handle exists; importers reach it through the socket
    // that carries the handle.
    m[0].store(META_MAGIC, Ordering::Relaxed);
    m[1].store(id, Ordering::Relaxed);
    m[2].store(size, Ordering::Relaxed);
}

fn data_len(size: u64) -> u64 {
    size.div_ceil(PAGE) * PAGE
}


/// Count one more open of the allocation by this process (slot per process).
fn slot_add(b: &Backing, data: u64, delta: i64) -> R {
    let me = u64::from(std::process::id());
    let m = meta(b, data);
    for w in &m[4..] {
        // Acquire/AcqRel: the slots are only read as a whole word; pairs with the other
        // processes' CAS on the same word.
        let v = w.load(Ordering::Acquire);
        if v >> 32 == me {
            let n = (v & 0xffff_ffff) as i64 + delta;
            let nv = if n <= 0 { 0 } else { (me << 32) | n as u64 };
            if w.compare_exchange(v, nv, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                return Ok(());
            }
            return slot_add(b, data, delta);
        }
    }
    if delta < 0 {
        return Ok(());
    }
    for w in &m[4..] {
        // Acquire: as above.
        let v = w.load(Ordering::Acquire);
        let free = v == 0 || !alive((v >> 32) as u32);
        if free && w.compare_exchange(v, (me << 32) | 1, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            return Ok(());
        }
    }
    Err(TOO_MANY_PEERS)
}

/// Before an exporter's `cuMemFree`: report live importers that still have it open.
pub fn check_free_while_open(r: &Region) {
    let data = data_len(r.len);
    let me = u64::from(std::process::id());
    for w in &meta(&r.backing, data)[4..] {
        // Acquire: as in `slot_add`.
        let v = w.load(Ordering::Acquire);
        let (pid, n) = (v >> 32, v & 0xffff_ffff);
        if n > 0 && pid != me && alive(pid as u32) {
            // Relaxed: statistics.
            FREE_WHILE_OPEN.fetch_add(1, Ordering::Relaxed);
            eprintln!(
                "simcuda: cuMemFree of {:#x} ({} bytes) while process {pid} still has its IPC handle open {n} time(s) \
                 (undefined behaviour on a real driver)",
                r.start, r.len
            );
        }
    }
}

pub fn free_while_open() -> u64 {
    // Relaxed: statistics.
    FREE_WHILE_OPEN.load(Ordering::Relaxed)
}

fn encode(magic: &[u8; 8], fd: i32, id: u64, size: u64, device: i32) -> [u8; 64] {
    let mut h = [0u8; 64];
    h[..8].copy_from_slice(magic);
    h[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    h[12..16].copy_from_slice(&fd.to_le_bytes());
    h[16..24].copy_from_slice(&id.to_le_bytes());
    h[24..32].copy_from_slice(&size.to_le_bytes());
    h[32..36].copy_from_slice(&device.to_le_bytes());
    h[40..48].copy_from_slice(&pid_namespace().to_le_bytes());
    h
}

/// This process's pid namespace (the inode of `/proc/self/ns/pid`; 0 if unknown).
fn pid_namespace() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino())
}

struct Decoded {
    pid: u32,
    fd: i32,
    id: u64,
    size: u64,
}

fn decode(magic: &[u8; 8], h: &[u8; 64]) -> R<Decoded> {
    if &h[..8] != magic || h[36..40].iter().chain(&h[48..]).any(|&b| b != 0) {
        return Err(INVALID_HANDLE);
    }
    let u32_at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().expect("4 bytes"));
    let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().expect("8 bytes"));
    let (theirs, ours) = (u64_at(40), pid_namespace());
    if theirs != 0 && ours != 0 && theirs != ours {
        return Err(INVALID_VALUE);
    }
    Ok(Decoded { pid: u32_at(8), fd: u32_at(12) as i32, id: u64_at(16), size: u64_at(24) })
}

/// Open the exporter's memfd named `<prefix>-<id>` through /proc, checking the link.
fn open_exported(d: &Decoded, prefix: &str) -> R<OwnedFd> {
    let path = std::ffi::CString::new(format!("/proc/{}/fd/{}", d.pid, d.fd)).map_err(|_| INVALID_HANDLE)?;
    // SAFETY: a NUL-terminated path; the fd is checked below.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(MAP_FAILED);
    }
    // SAFETY: a fresh fd owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).map_err(|_| MAP_FAILED)?;
    let want = format!("/memfd:{prefix}-{} (deleted)", d.id);
    if link.to_string_lossy() != want {
        return Err(INVALID_HANDLE);
    }
    Ok(fd)
}

/// `cuIpcGetMemHandle`: only the base of a `cuMemAlloc` allocation (documented: "a pointer
/// to the base of an existing device memory allocation"); else CUDA_ERROR_INVALID_VALUE.
pub fn get_mem_handle(dptr: u64) -> R<[u8; 64]> {
    crate::context::current()?;
    let r = memory::find(dptr).ok_or(INVALID_VALUE)?;
    match r.kind {
        Kind::Alloc { id } if r.start == dptr => {
            Ok(encode(MAGIC_MEM, r.backing.fd().ok_or(INVALID_VALUE)?.as_raw_fd(), id, r.len, r.device))
        }
        _ => Err(INVALID_VALUE),
    }
}

struct Opened {
    dptr: u64,
    refs: u64,
}

/// This process's open handles by (device, allocation id).
static OPENED: Mutex<Option<HashMap<(i32, u64), Opened>>> = Mutex::new(None);

/// `cuIpcOpenMemHandle`: flags must be `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`; a handle of
/// this very process is CUDA_ERROR_INVALID_CONTEXT (what the driver answers); a second
/// open by the same context returns the same pointer and counts a reference (documented).
pub fn open_mem(h: &[u8; 64], flags: u32) -> R<u64> {
    let ctx = crate::context::current()?;
    if flags != CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS {
        return Err(INVALID_VALUE);
    }
    let d = decode(MAGIC_MEM, h)?;
    if d.pid == std::process::id() {
        return Err(INVALID_CONTEXT);
    }
    let mut opened = OPENED.lock().unwrap_or_else(|e| e.into_inner());
    let opened = opened.get_or_insert_with(HashMap::new);
    if let Some(o) = opened.get_mut(&(ctx.device, d.id)) {
        o.refs += 1;
        return Ok(o.dptr);
    }
    let fd = open_exported(&d, "simcuda-mem")?;
    let data = data_len(d.size);
    // SAFETY: fstat into a zeroed struct on our fd.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 || st.st_size as u64 != data + PAGE {
        return Err(INVALID_HANDLE);
    }
    let backing = Backing::map(fd, data + PAGE)?;
    let m = meta(&backing, data);
    // Relaxed: written before the handle was sent.
    if m[0].load(Ordering::Relaxed) != META_MAGIC || m[1].load(Ordering::Relaxed) != d.id || m[2].load(Ordering::Relaxed) != d.size {
        return Err(INVALID_HANDLE);
    }
    slot_add(&backing, data, 1)?;
    let start = memory::reserve_range(data)?;
    memory::insert(Region {
        start,
        len: d.size,
        device: ctx.device,
        backing: Arc::new(backing),
        offset: 0,
        kind: Kind::IpcOpen { id: d.id },
        accessible: true,
    });
    opened.insert((ctx.device, d.id), Opened { dptr: start, refs: 1 });
    Ok(start)
}

/// `cuIpcCloseMemHandle`: drops one reference; unmaps at zero. A pointer this process did
/// not open (or already closed to zero) is CUDA_ERROR_INVALID_VALUE (the documentation
/// lists it; the strict choice).
pub fn close_mem(dptr: u64) -> R {
    crate::context::current()?;
    let mut opened = OPENED.lock().unwrap_or_else(|e| e.into_inner());
    let opened = opened.get_or_insert_with(HashMap::new);
    let key = opened.iter().find(|(_, o)| o.dptr == dptr).map(|(k, _)| *k).ok_or(INVALID_VALUE)?;
    let o = opened.get_mut(&key).expect("found above");
    o.refs -= 1;
    if o.refs > 0 {
        return Ok(());
    }
    opened.remove(&key);
    let r = memory::remove(dptr).ok_or(INVALID_VALUE)?;
    let _ = slot_add(&r.backing, data_len(r.len), -1);
    memory::unreserve_range(r.start, data_len(r.len));
    Ok(())
}

pub fn open_handles() -> u64 {
    OPENED.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map_or(0, |m| m.len() as u64)
}

/// `cuIpcGetEventHandle`: the event must have been created with `CU_EVENT_INTERPROCESS |
/// CU_EVENT_DISABLE_TIMING` (documented), else CUDA_ERROR_INVALID_HANDLE.
pub fn get_event_handle(ev: usize) -> R<[u8; 64]> {
    let e = crate::events::get(ev)?;
    if e.flags & crate::events::CU_EVENT_INTERPROCESS == 0 {
        return Err(INVALID_HANDLE);
    }
    let b = e.state.backing().ok_or(INVALID_HANDLE)?;
    Ok(encode(MAGIC_EVENT, b.fd().ok_or(INVALID_HANDLE)?.as_raw_fd(), e.state.id(), 0, e.device))
}

/// `cuIpcOpenEventHandle`: in the current context; a handle of this very process is
/// CUDA_ERROR_INVALID_CONTEXT (the documentation is silent; the strict choice, like memory).
pub fn open_event(h: &[u8; 64]) -> R<usize> {
    let ctx = crate::context::current()?;
    let d = decode(MAGIC_EVENT, h)?;
    if d.pid == std::process::id() {
        return Err(INVALID_CONTEXT);
    }
    let fd = open_exported(&d, "simcuda-event")?;
    let backing = Backing::map(fd, PAGE)?;
    if !crate::events::backing_holds(&backing, d.id) {
        return Err(INVALID_HANDLE);
    }
    Ok(crate::events::insert_opened(backing, ctx.device))
}
