//! Exports in C: CPU views of segments, forwarded imports (CPU and CUDA) and CUDA memory,
//! each under a lease whose end calls the caller's release callback.

use super::desc::tw_layout_t;
use super::imported::{tw_imported_t, AnyImport};
use super::peer::{tw_lease_t, tw_peer_t};
use super::segment::tw_segment_t;
use super::{arg, guard, tw_result_e};
use crate::cuda::{CudaStream, DevicePtr};
use crate::error::Error;
use crate::peer::{ExportOptions, SharedTensor};
use std::ffi::c_void;
use std::time::Duration;

/// The options every C export takes: a tag and a keeper window in ms (0: none).
fn options(tag: u64, window_ms: u64) -> ExportOptions {
    ExportOptions { tag, window: (window_ms > 0).then(|| Duration::from_millis(window_ms)) }
}

/// Write the granted lease to `out` unless it is NULL.
///
/// # Safety
/// `out` NULL or writable.
unsafe fn put_lease(out: *mut tw_lease_t, id: crate::LeaseId) {
    if !out.is_null() {
        // SAFETY: non-null and writable per the caller's contract.
        unsafe { out.write(tw_lease_t { slot: id.slot, generation: id.generation }) };
    }
}

/// Called exactly once with its context when an exported lease ends.
pub type tw_release_fn = Option<unsafe extern "C" fn(ctx: *mut c_void)>;

/// The C owner of an export: the callback + context, and the segment it keeps mapped.
struct CallbackOwner {
    release: unsafe extern "C" fn(*mut c_void),
    ctx: *mut c_void,
}

// SAFETY: the C contract of `tw_peer_export` says the callback may run on any thread,
// so the context is the caller's to make thread-safe.
unsafe impl Send for CallbackOwner {}

impl Drop for CallbackOwner {
    fn drop(&mut self) {
        // SAFETY: the caller supplied a valid function for this context, to be called
        // exactly once; Drop runs once.
        unsafe { (self.release)(self.ctx) }
    }
}

/// Export a view of `nbytes` of `seg` at byte `offset` to the peer under a lease.
/// `release(ctx)` is called exactly once, from any thread, when the lease ends (the peer
/// releases, `window_ms` > 0 runs out, the peer dies, or `tw_peer_free`) — and also when
/// this call fails, before it returns. `release` may be NULL (nothing to call). The
/// segment's fd travels with the first export of that segment on this connection.
///
/// # Safety
/// `peer`, `seg`, `layout` live/readable; `out_lease` NULL or writable; `release`
/// callable with `ctx` from any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_export(
    peer: *const tw_peer_t,
    seg: *const tw_segment_t,
    offset: usize,
    nbytes: usize,
    layout: *const tw_layout_t,
    tag: u64,
    window_ms: u64,
    release: tw_release_fn,
    ctx: *mut c_void,
    out_lease: *mut tw_lease_t,
) -> tw_result_e {
    // Built first so that every failure below drops it, which runs the callback.
    let owner = release.map(|f| CallbackOwner { release: f, ctx });
    guard("tw_peer_export", move || {
        // SAFETY: live per the contract; NULL refused.
        let p = unsafe { arg(peer, "peer")? };
        // SAFETY: live per the contract; NULL refused.
        let s = unsafe { arg(seg, "seg")? };
        // SAFETY: readable per the contract; NULL refused.
        let l = unsafe { arg(layout, "layout")? }.to_layout()?;
        let t = SharedTensor::new(s.inner.clone(), offset, nbytes, l)?;
        let keep = t.segment().clone();
        let owner: crate::Owner = match owner {
            Some(o) => Box::new((o, keep)),
            None => Box::new(keep),
        };
        let id = p.inner.export_with_owner(&t, owner, options(tag, window_ms))?;
        // SAFETY: NULL or writable per the contract.
        unsafe { put_lease(out_lease, id) };
        Ok(())
    })
}

/// Forward a CPU tensor received from a peer (on any connection, this one included) to
/// this peer as the same memory, without a copy: the producer's fd travels on, under a
/// new lease whose owner holds the import. `layout` is the view to send, over the
/// import's storage (as `tw_imported_storage` / `tw_imported_storage_len` give it); NULL
/// sends the import's own view. The import's lease goes back to its producer only when
/// this lease has ended (release, `window_ms`, the peer's death, `tw_peer_free`) and
/// `imp` has been freed or released — `tw_imported_release` of a forwarded import
/// returns `TW_OK` and leaves the release to the last forward. `release(ctx)` as for
/// `tw_peer_export` (called when this lease ends, or before a failing call returns).
/// `TW_ERR_INVALID_ARGUMENT` for a CUDA import (forwarded with
/// `tw_peer_export_imported_cuda`, which takes a stream) or a view that does not fit the
/// storage.
///
/// # Safety
/// `peer`, `imp` live; `layout` NULL or readable; `out_lease` NULL or writable;
/// `release` callable with `ctx` from any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_export_imported(
    peer: *const tw_peer_t,
    imp: *const tw_imported_t,
    layout: *const tw_layout_t,
    tag: u64,
    window_ms: u64,
    release: tw_release_fn,
    ctx: *mut c_void,
    out_lease: *mut tw_lease_t,
) -> tw_result_e {
    let send = move |p: &crate::Peer, imp: &AnyImport, view, extra| match imp {
        AnyImport::Cpu(i) => p.export_imported_with(i.clone(), view, extra, options(tag, window_ms)),
        AnyImport::Cuda(_) => Err(Error::InvalidArgument(
            "a CUDA import is forwarded with tw_peer_export_imported_cuda (it orders the forward on a stream)".into(),
        )),
    };
    // SAFETY: forwarded from this function's contract.
    unsafe { forward("tw_peer_export_imported", peer, imp, layout, (release, ctx), out_lease, send) }
}

/// Forward a CUDA tensor received from a peer (on any connection, this one included) to
/// this peer as the same device memory: the IPC handle or the producer's VMM fd travels
/// on as it came (nothing is opened or exported through the driver again), under a new
/// lease whose owner holds the import. `stream` (a CUstream of the import's device; 0:
/// the legacy default stream) first waits for the producer's writes, then an event
/// recorded there orders the consumer: it sees the producer's writes and this process's
/// work enqueued on `stream` before the call. `layout`, the lease's life, `imp`'s release
/// (`tw_imported_release` or `tw_imported_release_after` of a forwarded import return
/// `TW_OK` and leave the lease to the last forward) and `release(ctx)` as for
/// `tw_peer_export_imported`. `TW_ERR_INVALID_ARGUMENT` for a CPU import, a view that does
/// not fit the storage, or a connection that already carries another device's memory.
///
/// # Safety
/// As for `tw_peer_export_imported`; `stream` a valid stream of the import's device.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_export_imported_cuda(
    peer: *const tw_peer_t,
    imp: *const tw_imported_t,
    layout: *const tw_layout_t,
    stream: usize,
    tag: u64,
    window_ms: u64,
    release: tw_release_fn,
    ctx: *mut c_void,
    out_lease: *mut tw_lease_t,
) -> tw_result_e {
    let send = move |p: &crate::Peer, imp: &AnyImport, view, extra| match imp {
        AnyImport::Cuda(i) => p.export_cuda_imported_with(i.clone(), view, CudaStream(stream), extra, options(tag, window_ms)),
        AnyImport::Cpu(_) => Err(Error::InvalidArgument("a CPU import is forwarded with tw_peer_export_imported (no stream)".into())),
    };
    // SAFETY: forwarded from this function's contract.
    unsafe { forward("tw_peer_export_imported_cuda", peer, imp, layout, (release, ctx), out_lease, send) }
}

/// What both forwards share: the C owner built first (so that every failure drops it,
/// which runs the callback), the arguments checked behind `name`'s panic boundary, the
/// view (NULL: the import's own), the owner riding in the forward's lease, the lease
/// written out.
///
/// # Safety
/// As for `tw_peer_export_imported`.
unsafe fn forward(
    name: &'static str,
    peer: *const tw_peer_t,
    imp: *const tw_imported_t,
    layout: *const tw_layout_t,
    (release, ctx): (tw_release_fn, *mut c_void),
    out_lease: *mut tw_lease_t,
    send: impl FnOnce(&crate::Peer, &AnyImport, Option<crate::Layout>, crate::Owner) -> crate::Result<crate::LeaseId>,
) -> tw_result_e {
    let owner = release.map(|f| CallbackOwner { release: f, ctx });
    guard(name, move || {
        // SAFETY: live per the contract; NULL refused.
        let p = unsafe { arg(peer, "peer")? };
        // SAFETY: live per the contract; NULL refused.
        let i = unsafe { arg(imp, "imp")? };
        // SAFETY: NULL or readable per the contract.
        let view = match unsafe { layout.as_ref() } {
            Some(l) => Some(l.to_layout()?),
            None => None,
        };
        let extra: crate::Owner = match owner {
            Some(o) => Box::new(o),
            None => Box::new(()),
        };
        let id = send(&p.inner, &i.inner, view, extra)?;
        // SAFETY: NULL or writable per the contract.
        unsafe { put_lease(out_lease, id) };
        Ok(())
    })
}

/// Export `nbytes` of CUDA device memory at `dptr` (any pointer into a cudaMalloc
/// allocation; PyTorch's caching allocator qualifies) viewed as `layout`, under a lease,
/// after the work enqueued on `stream` (a CUstream; 0: legacy default stream) — an IPC
/// event recorded there orders the consumer. `release(ctx)` as for `tw_peer_export`.
/// `TW_ERR_CUDA_UNAVAILABLE` on a machine without a driver.
///
/// # Safety
/// As for `tw_peer_export`; `stream` a valid stream of `dptr`'s device.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_export_cuda(
    peer: *const tw_peer_t,
    dptr: u64,
    nbytes: u64,
    layout: *const tw_layout_t,
    stream: usize,
    tag: u64,
    window_ms: u64,
    release: tw_release_fn,
    ctx: *mut c_void,
    out_lease: *mut tw_lease_t,
) -> tw_result_e {
    let owner = release.map(|f| CallbackOwner { release: f, ctx });
    guard("tw_peer_export_cuda", move || {
        // SAFETY: live per the contract; NULL refused.
        let p = unsafe { arg(peer, "peer")? };
        // SAFETY: readable per the contract; NULL refused.
        let l = unsafe { arg(layout, "layout")? }.to_layout()?;
        let owner: crate::Owner = match owner {
            Some(o) => Box::new(o),
            None => Box::new(()),
        };
        let id = p.inner.export_cuda(DevicePtr(dptr), nbytes, &l, CudaStream(stream), owner, options(tag, window_ms))?;
        // SAFETY: NULL or writable per the contract.
        unsafe { put_lease(out_lease, id) };
        Ok(())
    })
}
