//! CUDA IPC memory: export a device pointer as (handle of its allocation's base, offset),
//! and open handles through a per-process cache.
//!
//! `cuIpcGetMemHandle` names a whole allocation, so the export records the view's offset
//! from the allocation base (`cuMemGetAddressRange`). Opening a handle costs about a
//! millisecond and older drivers allow one open per process, so every import goes through
//! [`HandleCache`]: each (device, handle) is opened once, ref-counted by live imports,
//! kept open a while when unused (LRU, `keep_warm` entries) and closed after that.

use super::driver::{call, ensure_context};
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
pub fn export_pointer(dptr: u64) -> Result<IpcExport> {
    let device = super::driver::pointer_device(dptr)?;
    let _ctx = ensure_context(device)?;
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: valid out-pointers.
    call("cuMemGetAddressRange", || unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, dptr) })?;
    let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: valid out-pointer; `base` is an allocation base.
    call("cuIpcGetMemHandle", || unsafe { sys::cuIpcGetMemHandle(&mut h, base) })?;
    Ok(IpcExport { device, handle: h.reserved.map(|c| c as u8), alloc_size: size as u64, offset: dptr - base })
}

struct Entry {
    base: u64,
    size: u64,
    refs: usize,
    last_use: u64,
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
    pub fn base(&self) -> u64 {
        self.base
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
    CACHE.get_or_init(|| HandleCache {
        map: Mutex::new(HashMap::new()),
        keep_warm: AtomicU64::new(16),
        clock: AtomicU64::new(0),
        opens: AtomicU64::new(0),
    })
}

impl HandleCache {
    /// Open (or reuse) the allocation behind `handle` on `device`.
    pub fn open(&self, device: i32, handle: [u8; 64]) -> Result<IpcMapping> {
        let key = (device, handle);
        let now = self.clock.fetch_add(1, Ordering::Relaxed);
        let mut map = self.map.lock();
        if let Some(e) = map.get_mut(&key) {
            e.refs += 1;
            e.last_use = now;
            return Ok(IpcMapping { key, base: e.base, size: e.size });
        }
        let _ctx = ensure_context(device)?;
        let h = sys::CUipcMemHandle { reserved: handle.map(|b| b as std::ffi::c_char) };
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; the handle bytes came from the peer and are checked by
        // the driver (an invalid handle is an error, not UB).
        call("cuIpcOpenMemHandle", || unsafe {
            sys::cuIpcOpenMemHandle_v2(&mut base, h, sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32)
        })?;
        self.opens.fetch_add(1, Ordering::Relaxed);
        let (mut b2, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: valid out-pointers; `base` was just mapped.
        if let Err(e) = call("cuMemGetAddressRange", || unsafe { sys::cuMemGetAddressRange_v2(&mut b2, &mut size, base) }) {
            // SAFETY: closing the mapping we just opened.
            let _ = call("cuIpcCloseMemHandle", || unsafe { sys::cuIpcCloseMemHandle(base) });
            return Err(e);
        }
        map.insert(key, Entry { base, size: size as u64, refs: 1, last_use: now });
        Ok(IpcMapping { key, base, size: size as u64 })
    }

    fn release(&self, key: &Key) {
        let mut map = self.map.lock();
        if let Some(e) = map.get_mut(key) {
            e.refs -= 1;
        }
        self.trim(&mut map);
    }

    /// Close the least recently used idle handles beyond `keep_warm`.
    fn trim(&self, map: &mut HashMap<Key, Entry>) {
        // Keep at most `keep_warm` unused handles open; close the least recently used.
        let keep = self.keep_warm.load(Ordering::Relaxed) as usize;
        let mut idle: Vec<(u64, Key)> = map.iter().filter(|(_, e)| e.refs == 0).map(|(k, e)| (e.last_use, *k)).collect();
        if idle.len() > keep {
            idle.sort();
            for (_, k) in idle.iter().take(idle.len() - keep) {
                if let Some(e) = map.remove(k) {
                    let _ctx = ensure_context(k.0);
                    // SAFETY: the base came from cuIpcOpenMemHandle and has no users left.
                    let _ = call("cuIpcCloseMemHandle", || unsafe { sys::cuIpcCloseMemHandle(e.base) });
                }
            }
        }
    }

    /// Keep at most `n` unused handles open (0: close each when its last import goes).
    pub fn set_keep_warm(&self, n: usize) {
        self.keep_warm.store(n as u64, Ordering::Relaxed);
        self.trim(&mut self.map.lock());
    }

    /// How many times this process called `cuIpcOpenMemHandle`.
    pub fn opens(&self) -> u64 {
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
