//! The importing side: endpoints to exporters, requests, and replies received into buffers
//! the import owns.
//!
//! An import sends an [`AM_REQUEST`] naming the export id, the length it expects and the
//! scope key from the blob, and progresses its worker until the exporter's [`AM_REPLY`]
//! has arrived: a status without payload (a named error), or the export's bytes — copied
//! from UCX's buffer when they came eagerly, received straight into the destination with
//! `ucp_am_recv_data_nbx` when they came by rendezvous. A reply is accepted only for a
//! request in progress, with a well-formed header and exactly the expected length;
//! anything else is dropped before a byte is written.
//!
//! One importer serves one control connection in the RPC layer: an exporter that stalls
//! delays only the imports of that connection, each within its own deadline.

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::ptr;
use std::sync::atomic::{AtomicI8, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use ucx_rs::sys;

use super::proto::{self, AM_REPLY, AM_REQUEST, Reply, Request, Status};
use super::worker::{Worker, poll_fd, request_param, status_text};
use crate::blob::{ExportBlob, MAX_WORKER_ADDRESS_LEN};
use crate::error::{EngineError, ImportError};
use crate::storage::Destination;

/// UCX parses worker addresses without a length (`ucp_ep_create`). Each is handed over in a
/// zero-filled copy this large, so whatever a forged address makes UCX read stays inside
/// memory we own.
const ADDRESS_PAD: usize = MAX_WORKER_ADDRESS_LEN + 16 * 1024;
/// How long a timed-out import waits for UCX to complete a receive it force-cancelled
/// before the destination is parked (kept until UCX is done with it).
const CANCEL_WAIT: Duration = Duration::from_secs(2);
/// How long an import keeps progressing, yielding, after progress found nothing, before it
/// arms the wakeup fd and sleeps.
const SPIN: Duration = Duration::from_micros(50);

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
    // Relaxed: read by the same thread after `ucp_worker_progress` returns.
    ep.failed
        .store(if status == 0 { -1 } else { status }, Ordering::Relaxed);
}

/// Where the reply to one request stands.
enum Phase {
    /// No reply yet.
    Waiting,
    /// A rendezvous reply's descriptor, not received yet.
    Rndv(*mut c_void),
    /// `ucp_am_recv_data_nbx`'s request, writing into the destination.
    Receiving(*mut c_void),
    /// The bytes are in, or the exporter said no.
    Done(Result<(), ImportError>),
}

struct Pending {
    export_id: u64,
    dst: *mut u8,
    len: usize,
    phase: Phase,
}

/// Requests in progress by token; reached from the reply handler.
struct Table {
    pending: Mutex<HashMap<u64, Pending>>,
}

// SAFETY: the raw pointers are UCX descriptors/requests of the importer's worker and the
// destination of an import in progress; all are used only by the thread holding the
// importer's state lock (the handler runs inside that thread's progress).
unsafe impl Send for Table {}
// SAFETY: as above; the map is behind a mutex.
unsafe impl Sync for Table {}

/// UCX's callback for [`AM_REPLY`] (see the module documentation).
unsafe extern "C" fn on_reply(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: `arg` is the importer's boxed `Table`, which outlives its worker; UCX passes a
    // valid `param` for the call.
    let (table, param) = unsafe { (&*(arg as *const Table), &*param) };
    let rndv = param.recv_attr & sys::ucp_am_recv_attr_t_UCP_AM_RECV_ATTR_FLAG_RNDV as u64 != 0;
    // Returning OK drops the data: eager bytes are freed, a rendezvous is completed on
    // the sender's side without moving its bytes.
    let drop_it = sys::ucs_status_t_UCS_OK;
    // SAFETY: UCX's header is `header_length` readable bytes for the call.
    let Some(reply) = Reply::parse(unsafe { proto::header(header, header_length) }) else {
        return drop_it;
    };
    let mut pending = table.pending.lock();
    // A reply for a request that timed out, or a second reply: nowhere to put it.
    let Some(p) = pending.get_mut(&reply.token) else {
        return drop_it;
    };
    if !matches!(p.phase, Phase::Waiting) {
        return drop_it;
    }
    let id = p.export_id;
    p.phase = match reply.status {
        Status::UnknownExport => Phase::Done(Err(ImportError::UnknownExport(id))),
        Status::LengthMismatch => Phase::Done(Err(ImportError::ExporterLengthMismatch {
            export: reply.length,
            requested: p.len as u64,
        })),
        Status::SendFailed => Phase::Done(Err(ImportError::Transfer(
            "the exporter could not start sending the export".into(),
        ))),
        Status::Ok if reply.length != p.len as u64 || length != p.len => {
            Phase::Done(Err(ImportError::BadReply(format!(
                "the exporter sent {length} bytes (header says {}) for a {}-byte export",
                reply.length, p.len
            ))))
        }
        Status::Ok if rndv => {
            // Kept: received by the importing thread once progress returns.
            p.phase = Phase::Rndv(data);
            return sys::ucs_status_t_UCS_INPROGRESS;
        }
        Status::Ok => {
            // SAFETY: eager data is `length` readable bytes for the call; `p.dst` is the
            // destination of the import in progress, `p.len == length` bytes, owned by
            // that import until its entry leaves this table.
            unsafe { ptr::copy_nonoverlapping(data as *const u8, p.dst, length) };
            Phase::Done(Ok(()))
        }
    };
    drop_it
}

struct State {
    worker: Worker,
    table: Box<Table>,
    endpoints: HashMap<Vec<u8>, Box<Endpoint>>,
    next_token: u64,
    /// Destinations of imports that gave up while a receive into them could not be
    /// stopped: kept, with that receive's request, until UCX completes it.
    parked: Vec<(*mut c_void, Box<dyn Destination>)>,
}

// SAFETY: endpoint handles and requests belong to the worker and are used only under the
// `State` mutex; destinations are `Send`.
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

    /// Closes an endpoint with FORCE (its outstanding requests complete as cancelled) and
    /// waits for the close.
    fn close(&mut self, address: &[u8]) {
        if let Some(ep) = self.endpoints.remove(address) {
            close_endpoint(&mut self.worker, &ep);
        }
    }

    /// Drops the parked destinations whose receive has completed.
    fn reap_parked(&mut self) {
        self.parked.retain(|(req, _)| {
            // SAFETY: a live request of this worker, not yet freed.
            let status = unsafe { sys::ucp_request_check_status(*req) };
            if status == sys::ucs_status_t_UCS_INPROGRESS {
                return true;
            }
            // SAFETY: completed; freed exactly once (the destination drops after).
            unsafe { sys::ucp_request_free(*req) };
            false
        });
    }
}

fn close_endpoint(worker: &mut Worker, ep: &Endpoint) {
    let param = request_param(sys::ucp_ep_close_flags_t_UCP_EP_CLOSE_FLAG_FORCE);
    // SAFETY: `ep.ep` is a live endpoint of this worker, closed exactly once.
    let sp = unsafe { sys::ucp_ep_close_nbx(ep.ep, &param) };
    if let Ok(Some(req)) = ucx_rs::decode_status_ptr(sp) {
        worker.wait(req, Some(Instant::now() + CANCEL_WAIT));
        // SAFETY: freed once; a request may be freed before it completes.
        unsafe { sys::ucp_request_free(req) };
    }
}

impl Drop for State {
    fn drop(&mut self) {
        let eps: Vec<_> = self.endpoints.drain().map(|(_, e)| e).collect();
        for ep in eps {
            close_endpoint(&mut self.worker, &ep);
        }
        for (req, _) in &self.parked {
            // SAFETY: live requests of this worker, freed once; UCX completes them as the
            // worker is destroyed, before the destinations drop (after this function).
            unsafe { sys::ucp_request_free(*req) };
        }
        // Fields drop in order: `worker` (destroyed, nothing in flight after) before the
        // table and the parked destinations.
    }
}

/// Imports exports into buffers over UCX. The importing thread progresses the worker; one
/// import runs at a time per importer (the RPC layer has one importer per connection).
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
        let mut worker = Worker::new(options)?;
        let table = Box::new(Table {
            pending: Mutex::new(HashMap::new()),
        });
        // SAFETY: the table is boxed in `State` next to the worker and dropped after it
        // (field order), so it outlives every callback.
        unsafe {
            worker.set_am_handler(
                AM_REPLY,
                Some(on_reply),
                &*table as *const Table as *mut c_void,
            )?
        };
        Ok(Importer {
            state: Mutex::new(State {
                worker,
                table,
                endpoints: HashMap::new(),
                next_token: 1,
                parked: Vec::new(),
            }),
        })
    }

    /// Endpoints currently open (one per exporter worker address).
    pub fn endpoints(&self) -> usize {
        self.state.lock().endpoints.len()
    }

    /// Destinations held back from failed imports until UCX is done with them.
    pub fn parked(&self) -> usize {
        let mut st = self.state.lock();
        st.reap_parked();
        st.parked.len()
    }

    /// Asks the exporter for the blob's export and receives it into `dst`, which must be
    /// exactly the export's length; gives `dst` back with the bytes in.
    ///
    /// On error `dst` is dropped — at once, or, when a receive into it was in flight and
    /// could not be stopped, once UCX has completed it — so UCX never writes into memory
    /// that is no longer this import's.
    pub fn import<D: Destination>(
        &self,
        blob: &ExportBlob,
        mut dst: D,
        timeout: Duration,
    ) -> Result<D, ImportError> {
        if dst.len() as u64 != blob.length() {
            return Err(ImportError::LengthMismatch {
                export: blob.length(),
                buffer: dst.len(),
            });
        }
        let deadline = Instant::now() + timeout;
        let mut st = self.state.lock();
        st.reap_parked();
        let address = blob.worker_address();
        let ep = st.endpoint(address)?.ep;
        let token = st.next_token;
        st.next_token += 1;
        st.table.pending.lock().insert(
            token,
            Pending {
                export_id: blob.export_id(),
                dst: dst.as_mut_ptr(),
                len: dst.len(),
                phase: Phase::Waiting,
            },
        );
        let request = Request {
            token,
            export_id: blob.export_id(),
            length: blob.length(),
            key: *blob.key(),
        }
        .encode();
        let param = request_param(
            sys::ucp_send_am_flags_UCP_AM_SEND_FLAG_REPLY
                | sys::ucp_send_am_flags_UCP_AM_SEND_FLAG_COPY_HEADER,
        );
        // SAFETY: `ep` is a live endpoint of our worker; the header is 48 readable bytes,
        // copied by UCX (COPY_HEADER); no payload.
        let sp = unsafe {
            sys::ucp_am_send_nbx(
                ep,
                AM_REQUEST,
                request.as_ptr() as *const c_void,
                request.len(),
                ptr::null(),
                0,
                &param,
            )
        };
        let send = match ucx_rs::decode_status_ptr(sp) {
            Ok(r) => r,
            Err(s) => {
                st.table.pending.lock().remove(&token);
                st.close(address);
                return Err(ImportError::Transfer(format!(
                    "sending the request: {}",
                    status_text(s)
                )));
            }
        };
        if let Some(req) = send {
            // SAFETY: the request references nothing of ours (the header was copied); a
            // request may be freed before it completes.
            unsafe { sys::ucp_request_free(req) };
        }

        let outcome = self.drive(&mut st, token, address, deadline);
        let p = st
            .table
            .pending
            .lock()
            .remove(&token)
            .expect("a pending import is removed only by its own call");
        // Relaxed: stored by the error callback on this thread, inside progress.
        let lost = st
            .endpoints
            .get(address)
            .map_or(0, |e| e.failed.load(Ordering::Relaxed));
        let r = self.finish(&mut st, address, outcome, p.phase, dst);
        if lost != 0 && st.endpoints.contains_key(address) {
            // The next import reconnects instead of failing on a dead endpoint.
            st.close(address);
            return r.map_err(|e| match e {
                ImportError::Transfer(s) => ImportError::PeerLost(s),
                e => e,
            });
        }
        r
    }

    /// The end of an import: `dst` given back, or dropped once UCX cannot write into it.
    fn finish<D: Destination>(
        &self,
        st: &mut State,
        address: &[u8],
        outcome: Result<(), ImportError>,
        phase: Phase,
        dst: D,
    ) -> Result<D, ImportError> {
        match (outcome, phase) {
            (_, Phase::Done(Ok(()))) => Ok(dst),
            (_, Phase::Done(Err(e))) => Err(e),
            (Err(e), Phase::Waiting) => {
                // Nothing of `dst` is with UCX: a late reply finds no entry and is dropped.
                if matches!(e, ImportError::PeerLost(_)) {
                    st.close(address);
                }
                Err(e)
            }
            (Err(e), Phase::Rndv(desc)) => {
                // SAFETY: a rendezvous descriptor kept from the handler, never received;
                // released once.
                unsafe { sys::ucp_am_data_release(st.worker.raw(), desc) };
                Err(e)
            }
            (Err(e), Phase::Receiving(req)) => {
                // Stop the receive: closing the endpoint with FORCE completes its requests
                // as cancelled. If UCX has not completed it by then, keep `dst` until it
                // has.
                st.close(address);
                match st.worker.wait(req, Some(Instant::now() + CANCEL_WAIT)) {
                    Some(_) => {
                        // SAFETY: completed; freed once. `dst` drops after.
                        unsafe { sys::ucp_request_free(req) };
                    }
                    None => st.parked.push((req, Box::new(dst))),
                }
                Err(e)
            }
            (Ok(()), _) => unreachable!("`drive` returns Ok only once the import is done"),
        }
    }

    /// Progresses until the import `token` is done (`Ok`), or fails (deadline, or the
    /// exporter lost). Starts and finishes the rendezvous receive.
    fn drive(
        &self,
        st: &mut State,
        token: u64,
        address: &[u8],
        deadline: Instant,
    ) -> Result<(), ImportError> {
        let mut idle_since: Option<Instant> = None;
        loop {
            let progressed = st.worker.progress();
            {
                let mut pending = st.table.pending.lock();
                let p = pending.get_mut(&token).expect("our own pending entry");
                match p.phase {
                    Phase::Done(_) => return Ok(()),
                    Phase::Rndv(desc) => {
                        let param = request_param(0);
                        // SAFETY: `desc` is a rendezvous descriptor the handler kept (it
                        // returned INPROGRESS); `p.dst` is `p.len` writable bytes owned by
                        // this import, which keeps them until the request completes (or
                        // parks them). The length was checked against the reply.
                        let sp = unsafe {
                            sys::ucp_am_recv_data_nbx(
                                st.worker.raw(),
                                desc,
                                p.dst as *mut c_void,
                                p.len,
                                &param,
                            )
                        };
                        p.phase = match ucx_rs::decode_status_ptr(sp) {
                            Ok(None) => Phase::Done(Ok(())),
                            Ok(Some(req)) => Phase::Receiving(req),
                            Err(s) => Phase::Done(Err(ImportError::Transfer(format!(
                                "receiving the export: {}",
                                status_text(s)
                            )))),
                        };
                        continue;
                    }
                    Phase::Receiving(req) => {
                        // SAFETY: a live request of this worker, not yet freed.
                        let s = unsafe { sys::ucp_request_check_status(req) };
                        if s != sys::ucs_status_t_UCS_INPROGRESS {
                            // SAFETY: completed; freed once.
                            unsafe { sys::ucp_request_free(req) };
                            p.phase = Phase::Done(if s == sys::ucs_status_t_UCS_OK {
                                Ok(())
                            } else {
                                Err(ImportError::Transfer(status_text(s)))
                            });
                            return Ok(());
                        }
                    }
                    Phase::Waiting => {}
                }
            }
            if let Some(e) = st.endpoints.get(address) {
                // Relaxed: stored by the error callback on this thread, inside progress.
                let f = e.failed.load(Ordering::Relaxed);
                if f != 0 {
                    return Err(ImportError::PeerLost(status_text(f)));
                }
            }
            let now = Instant::now();
            if progressed {
                idle_since = None;
                continue;
            }
            if now >= deadline {
                return Err(ImportError::Timeout);
            }
            // A short spin before sleeping: the next fragment of a transfer usually arrives
            // within it, and a sleep and wake-up per fragment costs more than the bytes.
            // Yielding, so a peer on this CPU runs meanwhile.
            let idle = *idle_since.get_or_insert(now);
            if now - idle < SPIN {
                std::thread::yield_now();
                continue;
            }
            if st.worker.arm() {
                poll_fd(st.worker.efd(), (deadline - now).min(Duration::from_millis(100)));
            }
        }
    }
}
