//! Imported tensors in C: `tw_imported_t` (CPU or CUDA), its accessors, stream waits and
//! release.

use super::desc::tw_layout_t;
use tensorwire::lease::LeaseId;
use super::{arg, get, guard, need, quiet, tw_result_e};
use tensorwire::cuda::CudaStream;
use tensorwire::desc::TensorDesc;
use tensorwire::error::Error;
use tensorwire::peer::{CudaImported, Imported};
use std::ffi::c_void;


/// Opaque imported tensor: a view of the peer's memory (CPU, or CUDA device memory),
/// valid until released.
pub struct tw_imported_t {
    pub(super) inner: AnyImport,
}

// Lives in a boxed handle (`tw_imported_t`), one per import: the CPU variant's spare
// bytes cost nothing worth a second allocation for the CUDA one.
#[allow(clippy::large_enum_variant)]
pub(super) enum AnyImport {
    /// Shared with the leases of its forwards (`tw_peer_export_imported`).
    Cpu(std::sync::Arc<Imported>),
    /// Shared with the leases of its forwards (`tw_peer_export_imported_cuda`).
    Cuda(std::sync::Arc<CudaImported>),
}

impl AnyImport {
    fn desc(&self) -> &TensorDesc {
        match self {
            AnyImport::Cpu(i) => i.desc(),
            AnyImport::Cuda(i) => i.desc(),
        }
    }
    fn data_ptr(&self) -> *mut c_void {
        match self {
            AnyImport::Cpu(i) => i.data_ptr().cast(),
            AnyImport::Cuda(i) => i.data_ptr().get() as usize as *mut c_void,
        }
    }
    fn storage_ptr(&self) -> *mut c_void {
        match self {
            AnyImport::Cpu(i) => i.storage_ptr().cast(),
            AnyImport::Cuda(i) => i.storage_ptr().get() as usize as *mut c_void,
        }
    }
    fn tag(&self) -> u64 {
        match self {
            AnyImport::Cpu(i) => i.tag(),
            AnyImport::Cuda(i) => i.tag(),
        }
    }
    fn lease(&self) -> LeaseId {
        let d = self.desc();
        LeaseId { slot: d.storage.lease_slot, generation: d.storage.lease_gen }
    }
    fn release(self) -> tensorwire::Result<()> {
        match self {
            // Forwarded and still leased downstream: the forward's lease holds the
            // import, and the lease goes back when the last forward ends.
            AnyImport::Cpu(i) => std::sync::Arc::try_unwrap(i).map_or(Ok(()), Imported::release),
            AnyImport::Cuda(i) => std::sync::Arc::try_unwrap(i).map_or(Ok(()), CudaImported::release),
        }
    }
}

/// The imported tensor's validated descriptor (NULL if `imp` is NULL). Valid while `imp`.
///
/// # Safety
/// NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_imported_desc(imp: *const tw_imported_t) -> *const TensorDesc {
    // SAFETY: NULL or live per the contract.
    quiet(std::ptr::null(), || unsafe { imp.as_ref() }.map_or(std::ptr::null(), |i| i.inner.desc() as *const _))
}

/// The imported view's layout.
///
/// # Safety
/// `imp` live; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_imported_layout(imp: *const tw_imported_t, out: *mut tw_layout_t) -> tw_result_e {
    // SAFETY: forwarded from this function's contract.
    unsafe { get("tw_imported_layout", (imp, "imp"), out, |i| Ok(tw_layout_t::from_layout(&i.inner.desc().layout()))) }
}

/// Address of the view's element 0 in this process (NULL if `imp` is NULL); for a CUDA
/// import a device address (see `tw_imported_device`).
///
/// # Safety
/// NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_imported_data(imp: *const tw_imported_t) -> *mut c_void {
    // SAFETY: NULL or live per the contract.
    quiet(std::ptr::null_mut(), || unsafe { imp.as_ref() }.map_or(std::ptr::null_mut(), |i| i.inner.data_ptr().cast()))
}

/// Start of the view's storage (NULL if `imp` is NULL).
///
/// # Safety
/// NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_imported_storage(imp: *const tw_imported_t) -> *mut c_void {
    // SAFETY: NULL or live per the contract.
    quiet(std::ptr::null_mut(), || unsafe { imp.as_ref() }.map_or(std::ptr::null_mut(), |i| i.inner.storage_ptr().cast()))
}

/// Bytes of the view's storage (0 if `imp` is NULL).
///
/// # Safety
/// NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_imported_storage_len(imp: *const tw_imported_t) -> usize {
    // SAFETY: NULL or live per the contract.
    quiet(0, || unsafe { imp.as_ref() }.map_or(0, |i| i.inner.desc().storage.nbytes as usize))
}

/// The tag the producer sent with the tensor (0 if `imp` is NULL).
///
/// # Safety
/// NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_imported_tag(imp: *const tw_imported_t) -> u64 {
    // SAFETY: NULL or live per the contract.
    quiet(0, || unsafe { imp.as_ref() }.map_or(0, |i| i.inner.tag()))
}

/// The lease the import holds.
///
/// # Safety
/// `imp` live; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_imported_lease(imp: *const tw_imported_t, out: *mut LeaseId) -> tw_result_e {
    // SAFETY: forwarded from this function's contract.
    unsafe { get("tw_imported_lease", (imp, "imp"), out, |i| Ok(i.inner.lease())) }
}

/// Device of an import: -1 for CPU memory, else the CUDA device ordinal (-2 if `imp`
/// is NULL).
///
/// # Safety
/// NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_imported_device(imp: *const tw_imported_t) -> i32 {
    // SAFETY: NULL or live per the contract.
    quiet(-2, || match unsafe { imp.as_ref() }.map(|i| &i.inner) {
        None => -2,
        Some(AnyImport::Cpu(_)) => -1,
        Some(AnyImport::Cuda(c)) => c.device(),
    })
}

/// Order `stream` (a CUstream; 0 for the legacy default stream) after the producer's
/// last write to a CUDA import, as the connection's `cuda_wait` says: the stream waits
/// on the producer's signal word and this returns at once (`TW_CUDA_WAIT_STREAM`), this
/// call waits (`TW_CUDA_WAIT_HOST`), or the stream waits on the producer's IPC event
/// (`TW_CUDA_WAIT_EVENT`) — never a device-wide synchronize. Call before the first use on
/// that stream. `TW_ERR_INVALID_ARGUMENT` for a CPU import.
///
/// # Safety
/// `imp` live; `stream` a valid stream of the import's device's current context.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_imported_cuda_wait(imp: *const tw_imported_t, stream: usize) -> tw_result_e {
    guard("tw_imported_cuda_wait", || {
        // SAFETY: live per the contract; NULL refused.
        match &unsafe { arg(imp, "imp")? }.inner {
            AnyImport::Cuda(c) => Ok(c.wait_on(CudaStream(stream))?),
            AnyImport::Cpu(_) => Err(Error::InvalidArgument("not a CUDA import".into()).into()),
        }
    })
}

/// Whether the producer's CUDA work for this import arrived as it should: `TW_OK` while
/// a stream's wait for it is pending or after it ended normally; `TW_ERR_PEER_GONE` or
/// `TW_ERR_TIMEOUT` once this side had to end that wait (the producer died, or its
/// signal did not come within the config's `cuda_wait_timeout_ms`) — the contents are
/// then undefined. A CPU import: `TW_OK`.
///
/// # Safety
/// `imp` live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_imported_cuda_status(imp: *const tw_imported_t) -> tw_result_e {
    guard("tw_imported_cuda_status", || {
        // SAFETY: live per the contract; NULL refused.
        match &unsafe { arg(imp, "imp")? }.inner {
            AnyImport::Cuda(c) => Ok(c.status()?),
            AnyImport::Cpu(_) => Ok(()),
        }
    })
}

/// Release the lease once the work enqueued so far on `stream` has completed, without
/// blocking (a CUDA import: an event is recorded on the stream and the lease released
/// when it is reached; a CPU import is released now), and free the handle either way. A
/// CUDA import forwarded with `tw_peer_export_imported_cuda` whose forward is still
/// leased: the handle lets go once the stream's work is done, and the lease goes back
/// when the last forward ends (`TW_OK`).
///
/// # Safety
/// `imp` a live handle, not used afterwards; `stream` valid for the import's device.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_imported_release_after(imp: *mut tw_imported_t, stream: usize) -> tw_result_e {
    guard("tw_imported_release_after", || {
        need(imp, "imp")?;
        // SAFETY: live handle from Box::into_raw, consumed once.
        let b = unsafe { Box::from_raw(imp) };
        match b.inner {
            AnyImport::Cuda(c) => c.release_shared_after(CudaStream(stream))?,
            cpu => cpu.release()?,
        }
        Ok(())
    })
}

/// Release the lease and free the handle (freed whatever the result). `TW_ERR_PEER_GONE`
/// if the producer is gone; `TW_ERR_STALE_LEASE` if its window ran out first. An import
/// forwarded with `tw_peer_export_imported` whose forward is still leased: only the
/// handle is freed (`TW_OK`); the lease goes back when the last forward ends.
///
/// # Safety
/// `imp` a live handle, not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_imported_release(imp: *mut tw_imported_t) -> tw_result_e {
    guard("tw_imported_release", || {
        need(imp, "imp")?;
        // SAFETY: live handle from Box::into_raw, consumed once.
        let b = unsafe { Box::from_raw(imp) };
        Ok(b.inner.release()?)
    })
}

/// Free an imported tensor, releasing its lease if still held (errors ignored). NULL is
/// a no-op.
///
/// # Safety
/// NULL or a live handle, not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_imported_free(imp: *mut tw_imported_t) {
    // SAFETY: forwarded from this function's contract.
    unsafe { super::free_handle(imp) }
}
