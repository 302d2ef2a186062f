//! The importing side: endpoints to exporters and one-sided gets into local buffers.

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::ptr;
use std::sync::atomic::{AtomicI8, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use ucx_rs::sys;

use super::worker::{Worker, status_text};
use crate::blob::{ExportBlob, MAX_RKEY_LEN, MAX_WORKER_ADDRESS_LEN};
use crate::error::{EngineError, ImportError};

/// UCX parses packed keys and worker addresses without a length (`ucp_ep_rkey_unpack`,
/// `ucp_ep_create`). Each is handed over in a zero-filled copy this large, so whatever a
/// forged field makes UCX read stays inside memory we own: a packed key's reads are bounded
/// by 16 domains × (1 + 255) bytes plus its header and trailer.
const RKEY_PAD: usize = 9 + 16 * 256 + 4096;
const ADDRESS_PAD: usize = MAX_WORKER_ADDRESS_LEN + 16 * 1024;

/// One cached endpoint; boxed so its address (the error callback's argument) is stable.
struct Endpoint {
    ep: sys::ucp_ep_h,
    /// 0 while healthy; the status UCX reported when the peer failed.
    failed: AtomicI8,
}

unsafe extern "C" fn on_endpoint_error(
    arg: *mut c_void,
    _ep: sys::ucp_ep_h,
    status: sys::ucs_status_t,
) {
    // SAFETY: `arg` is the `Box<Endpoint>` this endpoint was created with; it is freed only
    // after the endpoint is closed, and UCX calls this from progress on our thread.
    let ep = unsafe { &*(arg as *const Endpoint) };
    ep.failed
        .store(if status == 0 { -1 } else { status }, Ordering::Relaxed);
}

struct State {
    endpoints: HashMap<Vec<u8>, Box<Endpoint>>,
    worker: Worker,
}

// SAFETY: endpoint handles belong to the worker and are used only under the `State` mutex.
unsafe impl Send for State {}

impl State {
    fn endpoint(&mut self, address: &[u8]) -> Result<&Endpoint, ImportError> {
        if !self.endpoints.contains_key(address) {
            let mut padded = vec![0u8; ADDRESS_PAD];
            padded[..address.len()].copy_from_slice(address);
            let mut ep = Box::new(Endpoint {
                ep: ptr::null_mut(),
                failed: AtomicI8::new(0),
            });
            // SAFETY: zeroed endpoint params mean "no optional field"; we set the ones named.
            let mut params: sys::ucp_ep_params_t = unsafe { MaybeUninit::zeroed().assume_init() };
            params.field_mask = (sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_ERR_HANDLER)
                as u64;
            params.address = padded.as_ptr() as *const sys::ucp_address_t;
            params.err_mode = sys::ucp_err_handling_mode_t_UCP_ERR_HANDLING_MODE_PEER;
            params.err_handler.cb = Some(on_endpoint_error);
            params.err_handler.arg = &*ep as *const Endpoint as *mut c_void;
            let mut handle: sys::ucp_ep_h = ptr::null_mut();
            // SAFETY: the worker is live and ours; `padded` outlives the call and holds the
            // address followed by zeros; the error argument outlives the endpoint (it is
            // dropped only after `close`).
            let mut status = unsafe { sys::ucp_ep_create(self.worker.raw(), &params, &mut handle) };
            if status == sys::ucs_status_t_UCS_ERR_UNREACHABLE {
                // UCX 1.22's shared-memory transports (posix/sysv without cma) refuse peer
                // error handling ("Destination is unreachable", measured): connect without
                // it. An exporter's death then shows as the import's timeout, not PeerLost.
                params.field_mask &=
                    !((sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                        | sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_ERR_HANDLER)
                        as u64);
                // SAFETY: as above, with fewer fields.
                status = unsafe { sys::ucp_ep_create(self.worker.raw(), &params, &mut handle) };
            }
            if status != sys::ucs_status_t_UCS_OK {
                return Err(ImportError::Connect(status_text(status)));
            }
            ep.ep = handle;
            self.endpoints.insert(address.to_vec(), ep);
        }
        Ok(&self.endpoints[address])
    }

    /// Closes an endpoint with FORCE (outstanding requests complete as cancelled) and
    /// waits for the close.
    fn close(&mut self, address: &[u8]) {
        if let Some(ep) = self.endpoints.remove(address) {
            close_endpoint(&mut self.worker, &ep);
        }
    }
}

fn close_endpoint(worker: &mut Worker, ep: &Endpoint) {
    // SAFETY: zeroed request params are "no optional field"; we set the close flags.
    let mut param: sys::ucp_request_param_t = unsafe { MaybeUninit::zeroed().assume_init() };
    param.op_attr_mask = sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = sys::ucp_ep_close_flags_t_UCP_EP_CLOSE_FLAG_FORCE;
    // SAFETY: `ep.ep` is a live endpoint of this worker, closed exactly once.
    let sp = unsafe { sys::ucp_ep_close_nbx(ep.ep, &param) };
    if let Ok(Some(req)) = ucx_rs::decode_status_ptr(sp) {
        worker.wait(req, None);
        // SAFETY: the request completed and is freed once.
        unsafe { sys::ucp_request_free(req) };
    }
}

impl Drop for State {
    fn drop(&mut self) {
        let eps: Vec<_> = self.endpoints.drain().map(|(_, e)| e).collect();
        for ep in eps {
            close_endpoint(&mut self.worker, &ep);
        }
    }
}

/// Imports exports into local buffers over UCX. The importing thread progresses the
/// worker; one import runs at a time per importer.
pub struct Importer {
    state: Mutex<State>,
}

impl Importer {
    /// Creates the context and worker, configured from the environment.
    pub fn new() -> Result<Self, EngineError> {
        Self::with_options(&[])
    }

    /// As [`Importer::new`], with UCX options (names without `UCX_`) over the environment.
    pub fn with_options(options: &[(&str, &str)]) -> Result<Self, EngineError> {
        let worker = Worker::new(options)?;
        Ok(Importer {
            state: Mutex::new(State {
                endpoints: HashMap::new(),
                worker,
            }),
        })
    }

    /// Endpoints currently open (one per exporter worker address).
    pub fn endpoints(&self) -> usize {
        self.state.lock().endpoints.len()
    }

    /// Reads the whole export into `dst`, which must be exactly the export's length.
    ///
    /// Returns when the bytes are in `dst`, or with an error after the transfer has been
    /// stopped: on `Timeout` the endpoint is force-closed, which completes the get as
    /// cancelled, so UCX never writes into `dst` after this returns.
    pub fn import(
        &self,
        blob: &ExportBlob,
        dst: &mut [u8],
        timeout: Duration,
    ) -> Result<(), ImportError> {
        if dst.len() as u64 != blob.length() {
            return Err(ImportError::LengthMismatch {
                export: blob.length(),
                buffer: dst.len(),
            });
        }
        let deadline = Instant::now() + timeout;
        let mut st = self.state.lock();
        let address = blob.worker_address();
        let ep = st.endpoint(address)?.ep;

        debug_assert!(blob.rkey().len() <= MAX_RKEY_LEN);
        let mut padded = vec![0u8; RKEY_PAD];
        padded[..blob.rkey().len()].copy_from_slice(blob.rkey());
        let mut rkey: sys::ucp_rkey_h = ptr::null_mut();
        // SAFETY: `ep` is live; the packed key was structurally checked by the blob and is
        // followed by zeros up to `RKEY_PAD`, which bounds what UCX reads.
        let status =
            unsafe { sys::ucp_ep_rkey_unpack(ep, padded.as_ptr() as *const c_void, &mut rkey) };
        if status != sys::ucs_status_t_UCS_OK {
            return Err(ImportError::Rkey(status_text(status)));
        }

        // SAFETY: zeroed request params: no callback, UCX returns a request to poll.
        let param: sys::ucp_request_param_t = unsafe { MaybeUninit::zeroed().assume_init() };
        // SAFETY: `dst` is a writable buffer of `blob.length()` bytes borrowed for this
        // call, and this call does not return until the request has completed (or failed
        // synchronously); `rkey` was unpacked for `ep`.
        let sp = unsafe {
            sys::ucp_get_nbx(
                ep,
                dst.as_mut_ptr() as *mut c_void,
                dst.len(),
                blob.address(),
                rkey,
                &param,
            )
        };
        let mut timed_out = false;
        let status = match ucx_rs::decode_status_ptr(sp) {
            Ok(None) => sys::ucs_status_t_UCS_OK,
            Err(s) => s,
            Ok(Some(req)) => {
                let s = match st.worker.wait(req, Some(deadline)) {
                    Some(s) => s,
                    None => {
                        timed_out = true;
                        // Cancel by force-closing the endpoint, then wait for the get.
                        let ep_box = st.endpoints.remove(address);
                        let close = ep_box.as_ref().map(|e| {
                            // SAFETY: zeroed params plus the FORCE flag, as in `close_endpoint`.
                            let mut p: sys::ucp_request_param_t =
                                unsafe { MaybeUninit::zeroed().assume_init() };
                            p.op_attr_mask = sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_FLAGS;
                            p.flags = sys::ucp_ep_close_flags_t_UCP_EP_CLOSE_FLAG_FORCE;
                            // SAFETY: the endpoint is live and closed exactly once here.
                            unsafe { sys::ucp_ep_close_nbx(e.ep, &p) }
                        });
                        let s = st
                            .worker
                            .wait(req, None)
                            .unwrap_or(sys::ucs_status_t_UCS_ERR_CANCELED);
                        if let Some(Ok(Some(creq))) = close.map(ucx_rs::decode_status_ptr) {
                            st.worker.wait(creq, None);
                            // SAFETY: the close request completed; freed once.
                            unsafe { sys::ucp_request_free(creq) };
                        }
                        drop(ep_box);
                        s
                    }
                };
                // SAFETY: the get request completed (its status is final); freed once.
                unsafe { sys::ucp_request_free(req) };
                s
            }
        };
        // SAFETY: `rkey` was unpacked above and is destroyed once, after its last use.
        unsafe { sys::ucp_rkey_destroy(rkey) };

        if timed_out {
            return Err(ImportError::Timeout);
        }
        if status == sys::ucs_status_t_UCS_OK {
            return Ok(());
        }
        let peer_failed = st
            .endpoints
            .get(address)
            .is_some_and(|e| e.failed.load(Ordering::Relaxed) != 0);
        st.close(address);
        if peer_failed {
            Err(ImportError::PeerLost(status_text(status)))
        } else {
            Err(ImportError::Transfer(status_text(status)))
        }
    }
}
