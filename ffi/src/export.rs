//! Exports in C: CPU views of segments, forwarded imports (CPU and CUDA) and CUDA memory,
//! each under a lease whose end calls the caller's release callback.

use super::desc::tw_layout_t;
use super::imported::{tw_imported_t, AnyImport};
use super::peer::tw_peer_t;
use tensorwire::lease::LeaseId;
use super::segment::tw_segment_t;
use super::{arg, guard, put_opt, tw_result_e, Fail};
use tensorwire::cuda::{CudaStream, DevicePtr};
use tensorwire::error::Error;
use tensorwire::peer::{ExportOptions, SharedTensor};
use std::ffi::c_void;
use std::time::Duration;

/// The options every C export takes: a tag and a keeper window in ms (0: none).
fn options(tag: u64, window_ms: u64) -> ExportOptions {
    ExportOptions { tag, window: (window_ms > 0).then(|| Duration::from_millis(window_ms)) }
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
    out_lease: *mut LeaseId,
) -> tw_result_e {
    let send = |p: &tensorwire::Peer, owner: Option<CallbackOwner>| {
        // SAFETY: live per the contract; NULL refused.
        let s = unsafe { arg(seg, "seg")? };
        // SAFETY: readable per the contract; NULL refused.
        let l = unsafe { arg(layout, "layout")? }.to_layout()?;
        let t = SharedTensor::new(s.inner.clone(), offset, nbytes, l)?;
        // The lease keeps the segment mapped; the callback runs first when it ends.
        let owner = Box::new((owner, t.segment().clone()));
        Ok(p.export_with_owner(&t, owner, options(tag, window_ms))?)
    };
    // SAFETY: forwarded from this function's contract.
    unsafe { export("tw_peer_export", peer, (release, ctx), out_lease, send) }
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
    out_lease: *mut LeaseId,
) -> tw_result_e {
    let send = |p: &tensorwire::Peer, imp: &AnyImport, view, owner| match imp {
        AnyImport::Cpu(i) => p.export_imported_with(i.clone(), view, owner, options(tag, window_ms)),
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
    out_lease: *mut LeaseId,
) -> tw_result_e {
    let send = |p: &tensorwire::Peer, imp: &AnyImport, view, owner| match imp {
        AnyImport::Cuda(i) => p.export_cuda_imported_with(i.clone(), view, CudaStream(stream), owner, options(tag, window_ms)),
        AnyImport::Cpu(_) => Err(Error::InvalidArgument("a CPU import is forwarded with tw_peer_export_imported (no stream)".into())),
    };
    // SAFETY: forwarded from this function's contract.
    unsafe { forward("tw_peer_export_imported_cuda", peer, imp, layout, (release, ctx), out_lease, send) }
}

/// What both forwards share on top of [`export`]: the import checked, the view (NULL:
/// the import's own), the owner riding in the forward's lease.
///
/// # Safety
/// As for `tw_peer_export_imported`.
unsafe fn forward(
    name: &'static str,
    peer: *const tw_peer_t,
    imp: *const tw_imported_t,
    layout: *const tw_layout_t,
    release: (tw_release_fn, *mut c_void),
    out_lease: *mut LeaseId,
    send: impl FnOnce(&tensorwire::Peer, &AnyImport, Option<tensorwire::Layout>, tensorwire::Owner) -> tensorwire::Result<tensorwire::LeaseId>,
) -> tw_result_e {
    let forward = |p: &tensorwire::Peer, owner: Option<CallbackOwner>| {
        // SAFETY: live per the contract; NULL refused.
        let i = unsafe { arg(imp, "imp")? };
        // SAFETY: NULL or readable per the contract.
        let view = match unsafe { layout.as_ref() } {
            Some(l) => Some(l.to_layout()?),
            None => None,
        };
        Ok(send(p, &i.inner, view, owned(owner))?)
    };
    // SAFETY: forwarded from the caller's contract.
    unsafe { export(name, peer, release, out_lease, forward) }
}

/// What every C export shares: the C owner built first (so that every failure drops it,
/// which runs the callback), `peer` checked behind `name`'s panic boundary, the export
/// made by `send` (which checks its own arguments and gives the owner to the lease), the
/// granted lease written to `out_lease` unless it is NULL.
///
/// # Safety
/// `peer` live; `out_lease` NULL or writable; `release` callable with `ctx` from any
/// thread.
unsafe fn export(
    name: &'static str,
    peer: *const tw_peer_t,
    (release, ctx): (tw_release_fn, *mut c_void),
    out_lease: *mut LeaseId,
    send: impl FnOnce(&tensorwire::Peer, Option<CallbackOwner>) -> Result<LeaseId, Fail>,
) -> tw_result_e {
    let owner = release.map(|f| CallbackOwner { release: f, ctx });
    guard(name, move || {
        // SAFETY: live per the contract; NULL refused.
        let p = unsafe { arg(peer, "peer")? };
        let id = send(&p.inner, owner)?;
        // SAFETY: NULL or writable per the contract.
        unsafe { put_opt(out_lease, id) };
        Ok(())
    })
}

/// The caller's owner as a lease owner (nothing to call: an empty one).
fn owned(owner: Option<CallbackOwner>) -> tensorwire::Owner {
    match owner {
        Some(o) => Box::new(o),
        None => Box::new(()),
    }
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
    out_lease: *mut LeaseId,
) -> tw_result_e {
    let send = |p: &tensorwire::Peer, owner| {
        // SAFETY: readable per the contract; NULL refused.
        let l = unsafe { arg(layout, "layout")? }.to_layout()?;
        Ok(p.export_cuda(DevicePtr(dptr), nbytes, &l, CudaStream(stream), owned(owner), options(tag, window_ms))?)
    };
    // SAFETY: forwarded from this function's contract.
    unsafe { export("tw_peer_export_cuda", peer, (release, ctx), out_lease, send) }
}
