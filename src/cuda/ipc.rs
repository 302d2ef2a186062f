//! CUDA IPC memory: export a device pointer as (handle of its allocation's base, offset),
//! and open handles through a per-process cache.
//!
//! `cuIpcGetMemHandle` names a whole allocation, so the export records the view's offset
//! from the allocation base (`cuMemGetAddressRange`). Opening a handle costs about a
//! millisecond and older drivers allow one open per process, so every import goes through
//! [`HandleCache`]: each (device, handle) is opened once while any import of it lives,
//! ref-counted by live imports, and closed when the last one goes.
//!
//! The driver refuses to open a handle in the process that exported it
//! (CUDA_ERROR_INVALID_CONTEXT). So `export_pointer` remembers the handles this process
//! made, and an import of one of them (both ends of a connection in one process) uses the
//! allocation's own pointer, after checking it is still that allocation; the lease and the
//! event order apply as for any import.
//!
//! Keeping unused handles open (`set_keep_warm(n)`, LRU) is an opt-in: CUDA documents
//! that an exporter freeing the memory (`cuMemFree`) while an importer still has the
//! handle open is undefined behaviour, and a producer's allocator may free a block once
//! its lease ended (PyTorch's `empty_cache`). Turn it on only with producers that keep
//! their exported blocks allocated (PyTorch's caching allocator, without `empty_cache`).

use super::driver::{call, ensure_context};
use super::types::DevicePtr;
use crate::error::{Error, Result};
use cudarc::driver::sys;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// What a producer sends for a device pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcExport {
    pub device: i32,
    /// `cuIpcGetMemHandle` of the allocation base.
    pub handle: [u8; 64],
    /// Size of the whole allocation.
    pub alloc_size: u64,
    /// Offset of the exported pointer from the allocation base.
    pub offset: u64,
}

/// Export `dptr` (any pointer into a `cudaMalloc`/`cuMemAlloc` allocation).
pub fn export_pointer(dptr: DevicePtr) -> Result<IpcExport> {
    let device = super::driver::pointer_device(dptr)?;
    let _ctx = ensure_context(device)?;
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: valid out-pointers.
    call("cuMemGetAddressRange", || unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, dptr.get()) })?;
    let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: valid out-pointer; `base` is an allocation base.
    call("cuIpcGetMemHandle", || unsafe { sys::cuIpcGetMemHandle(&mut h, base) })?;
    let handle = h.reserved.map(|c| c as u8);
    remember_export(device, handle, base, size as u64);
    Ok(IpcExport { device, handle, alloc_size: size as u64, offset: dptr.get() - base })
}

/// Handles this process exported: (device, handle) → (base, size), most recent last.
/// Bounded: the oldest are forgotten (an import of a forgotten handle of this process then
/// fails as the driver says, instead of growing without end).
static EXPORTED: parking_lot::Mutex<std::collections::VecDeque<(Key, u64, u64)>> =
    parking_lot::Mutex::new(std::collections::VecDeque::new());
const EXPORTED_MAX: usize = 4096;

fn remember_export(device: i32, handle: [u8; 64], base: u64, size: u64) {
    let mut e = EXPORTED.lock();
    e.retain(|(k, ..)| *k != (device, handle));
    if e.len() >= EXPORTED_MAX {
        e.pop_front();
    }
    e.push_back(((device, handle), base, size));
}

/// If this process exported `key` and the allocation is still there (same base and size
/// as the driver reports now), its base and size.
fn own_export(key: &Key) -> Result<Option<(u64, u64)>> {
    let Some((base, size)) = EXPORTED.lock().iter().rev().find(|(k, ..)| k == key).map(|&(_, b, s)| (b, s)) else {
        return Ok(None);
    };
    let (mut b2, mut s2): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: valid out-pointers; an address that is no longer allocated is an error.
    let live = call("cuMemGetAddressRange", || unsafe { sys::cuMemGetAddressRange_v2(&mut b2, &mut s2, base) });
    if live.is_ok() && b2 == base && s2 as u64 == size {
        return Ok(Some((base, size)));
    }
    Err(Error::InvalidDescriptor(
        "CUDA IPC handle of this process whose allocation was freed (the import came too late)".into(),
    ))
}

struct Entry {
    base: u64,
    size: u64,
    refs: usize,
    last_use: u64,
    /// May stay open unused (`keep_warm`); false once opened through `open_unwarmed`.
    warm_ok: bool,
    /// This process's own allocation (not opened through the driver; nothing to close).
    own: bool,
}

type Key = (i32, [u8; 64]);

/// Per-process cache of opened IPC memory handles.
pub struct HandleCache {
    map: Mutex<HashMap<Key, Entry>>,
    keep_warm: AtomicU64,
    clock: AtomicU64,
    opens: AtomicU64,
}

/// A live import of an opened allocation; dropping it releases the reference.
pub struct IpcMapping {
    key: Key,
    base: u64,
    size: u64,
}

impl IpcMapping {
    /// Device address of the allocation base in this process.
    pub fn base(&self) -> DevicePtr {
        DevicePtr(self.base)
    }
    /// Size of the allocation (as this process's driver reports it).
    pub fn size(&self) -> u64 {
        self.size
    }
    pub fn device(&self) -> i32 {
        self.key.0
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        cache().release(&self.key);
    }
}

/// The process's handle cache.
pub fn cache() -> &'static HandleCache {
    static CACHE: OnceLock<HandleCache> = OnceLock::new();
    CACHE.get_or_init(|| HandleCache::new(0))
}

impl HandleCache {
    fn new(keep_warm: u64) -> HandleCache {
        HandleCache {
            map: Mutex::new(HashMap::new()),
            keep_warm: AtomicU64::new(keep_warm),
            clock: AtomicU64::new(0),
            opens: AtomicU64::new(0),
        }
    }

    /// Open (or reuse) the allocation behind `handle` on `device`.
    pub fn open(&self, device: i32, handle: [u8; 64]) -> Result<IpcMapping> {
        self.open_with(device, handle, true)
    }

    /// Like `open`, but the handle is closed as soon as its last import goes, whatever
    /// `keep_warm` says (for memory the exporter frees on its own schedule, e.g. a GPU
    /// ring's arena).
    pub fn open_unwarmed(&self, device: i32, handle: [u8; 64]) -> Result<IpcMapping> {
        self.open_with(device, handle, false)
    }

    fn open_with(&self, device: i32, handle: [u8; 64], warm_ok: bool) -> Result<IpcMapping> {
        let key = (device, handle);
        // Relaxed: a process-private LRU clock; only its order of values matters, and the
        // map's mutex orders the entries it stamps.
        let now = self.clock.fetch_add(1, Ordering::Relaxed);
        let mut map = self.map.lock();
        if let Some(e) = map.get_mut(&key) {
            e.refs += 1;
            e.last_use = now;
            e.warm_ok &= warm_ok;
            return Ok(IpcMapping { key, base: e.base, size: e.size });
        }
        let _ctx = ensure_context(device)?;
        if let Some((base, size)) = own_export(&key)? {
            map.insert(key, Entry { base, size, refs: 1, last_use: now, warm_ok, own: true });
            return Ok(IpcMapping { key, base, size });
        }
        let h = sys::CUipcMemHandle { reserved: handle.map(|b| b as std::ffi::c_char) };
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; the handle bytes came from the peer and are checked by
        // the driver (an invalid handle is an error, not UB).
        call("cuIpcOpenMemHandle", || unsafe {
            sys::cuIpcOpenMemHandle_v2(&mut base, h, sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32)
        })?;
        // Relaxed: a statistics counter, read on its own.
        self.opens.fetch_add(1, Ordering::Relaxed);
        let (mut b2, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: valid out-pointers; `base` was just mapped.
        if let Err(e) = call("cuMemGetAddressRange", || unsafe { sys::cuMemGetAddressRange_v2(&mut b2, &mut size, base) }) {
            // SAFETY: closing the mapping we just opened.
            let _ = call("cuIpcCloseMemHandle", || unsafe { sys::cuIpcCloseMemHandle(base) });
            return Err(e);
        }
        map.insert(key, Entry { base, size: size as u64, refs: 1, last_use: now, warm_ok, own: false });
        Ok(IpcMapping { key, base, size: size as u64 })
    }

    fn release(&self, key: &Key) {
        let mut map = self.map.lock();
        if let Some(e) = map.get_mut(key) {
            e.refs -= 1;
        }
        self.trim(&mut map);
    }

    /// Close idle handles that may not stay warm, and the least recently used idle ones
    /// beyond `keep_warm`.
    fn trim(&self, map: &mut HashMap<Key, Entry>) {
        // Relaxed: a setting read under the map's mutex; a racing `set_keep_warm` trims
        // again itself.
        let keep = self.keep_warm.load(Ordering::Relaxed) as usize;
        let mut idle: Vec<(bool, u64, Key)> =
            map.iter().filter(|(_, e)| e.refs == 0).map(|(k, e)| (e.warm_ok, e.last_use, *k)).collect();
        let warm = idle.iter().filter(|(ok, ..)| *ok).count();
        let close = idle.len() - warm.min(keep);
        if close > 0 {
            // Not-warmable first (false < true), then oldest first.
            idle.sort();
            for (_, _, k) in idle.iter().take(close) {
                if let Some(e) = map.remove(k).filter(|e| !e.own) {
                    let _ctx = ensure_context(k.0);
                    // SAFETY: the base came from cuIpcOpenMemHandle and has no users left.
                    let _ = call("cuIpcCloseMemHandle", || unsafe { sys::cuIpcCloseMemHandle(e.base) });
                }
            }
        }
    }

    /// Keep at most `n` unused handles open (0, the default: close each when its last
    /// import goes). See the module's note before raising it.
    pub fn set_keep_warm(&self, n: usize) {
        // Relaxed: a setting; `trim` below and every later release read it under the map's mutex.
        self.keep_warm.store(n as u64, Ordering::Relaxed);
        self.trim(&mut self.map.lock());
    }

    /// How many times this process called `cuIpcOpenMemHandle`.
    pub fn opens(&self) -> u64 {
        // Relaxed: a statistics counter.
        self.opens.load(Ordering::Relaxed)
    }

    /// (open handles, of which in use).
    pub fn stats(&self) -> (usize, usize) {
        let map = self.map.lock();
        (map.len(), map.values().filter(|e| e.refs > 0).count())
    }
}

/// Check that `nbytes` at `offset` lie inside an opened allocation of `size` bytes.
pub fn check_range(offset: u64, nbytes: u64, size: u64) -> Result<()> {
    match offset.checked_add(nbytes) {
        Some(end) if end <= size => Ok(()),
        _ => Err(Error::InvalidDescriptor(format!(
            "CUDA allocation too small: descriptor needs {nbytes} bytes at offset {offset}, allocation has {size}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache_with(entries: &[(u8, usize, u64, bool)], keep: u64) -> HandleCache {
        let c = HandleCache::new(keep);
        for &(id, refs, last_use, warm_ok) in entries {
            c.map.lock().insert((0, [id; 64]), Entry { base: 0, size: 0, refs, last_use, warm_ok, own: false });
        }
        c
    }

    fn open_ids(c: &HandleCache) -> Vec<u8> {
        let mut v: Vec<u8> = c.map.lock().keys().map(|k| k.1[0]).collect();
        v.sort();
        v
    }

    // No driver is needed: closing a handle without one fails quietly, and the entry goes
    // either way (which is what these tests look at).
    #[test]
    fn idle_handles_close_unless_kept_warm_least_recently_used_first() {
        // (id, refs, last_use, warm_ok)
        let entries = [(1, 0, 5, true), (2, 0, 1, true), (3, 1, 0, true), (4, 0, 9, true), (5, 0, 7, false)];
        let c = cache_with(&entries, 0);
        c.trim(&mut c.map.lock());
        assert_eq!(open_ids(&c), [3], "keep_warm 0: only the handle in use stays open");

        let c = cache_with(&entries, 2);
        c.trim(&mut c.map.lock());
        assert_eq!(open_ids(&c), [1, 3, 4], "keep_warm 2: the two most recently used warmable idle handles stay");

        let c = cache_with(&entries, 16);
        c.trim(&mut c.map.lock());
        assert_eq!(open_ids(&c), [1, 2, 3, 4], "an unwarmable idle handle (a ring arena) closes whatever keep_warm says");
        assert_eq!(c.stats(), (4, 1));
    }
}
