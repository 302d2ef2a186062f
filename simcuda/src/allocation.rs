//! `cuMemAlloc` / `cuMemFree`: device allocations (`memory`'s regions) with the IPC
//! metadata page each carries after its data (`ipc`), above both.

use crate::memory::{find, insert, new_id, remove, reserve_range, unreserve_range, Backing, Kind, Region, PAGE};
use crate::result::*;
use crate::{context, ipc};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

/// `cuMemAlloc`: `size` > 0 (0 is CUDA_ERROR_INVALID_VALUE, as documented), on the current
/// context's device; data pages plus one metadata page (IPC bookkeeping).
pub fn alloc(size: u64) -> R<u64> {
    let ctx = context::current()?;
    if size == 0 {
        return Err(INVALID_VALUE);
    }
    let data = size.div_ceil(PAGE).checked_mul(PAGE).ok_or(OUT_OF_MEMORY)?;
    let id = new_id();
    let backing = Backing::create(&format!("simcuda-mem-{id}"), data + PAGE)?;
    ipc::init_meta(&backing, data, size, id);
    let start = reserve_range(data)?;
    insert(Region { start, len: size, device: ctx.device, backing: Arc::new(backing), offset: 0, kind: Kind::Alloc { id }, accessible: true });
    // Relaxed: statistics.
    ALLOCS.fetch_add(1, Ordering::Relaxed);
    Ok(start)
}

/// `cuMemFree`: only the base of a `cuMemAlloc` allocation (anything else is
/// CUDA_ERROR_INVALID_VALUE). Reports a free while another process has the handle open.
pub fn free(dptr: u64) -> R {
    context::current()?;
    let r = find(dptr).ok_or(INVALID_VALUE)?;
    if r.start != dptr || !matches!(r.kind, Kind::Alloc { .. }) {
        return Err(INVALID_VALUE);
    }
    ipc::check_free_while_open(&r);
    remove(dptr);
    unreserve_range(r.start, r.len.div_ceil(PAGE) * PAGE);
    // Relaxed: statistics.
    ALLOCS.fetch_sub(1, Ordering::Relaxed);
    Ok(())
}

pub fn live_allocations() -> u64 {
    // Relaxed: statistics.
    ALLOCS.load(Ordering::Relaxed)
}
