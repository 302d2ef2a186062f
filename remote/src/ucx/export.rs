//! The exporting side: exports, their scopes, and the progress thread that answers
//! requests.
//!
//! An importer asks for an export with an [`AM_REQUEST`] active message naming an export id
//! and a scope key; the progress thread's handler looks the pair up and answers on the
//! importer's connection with an [`AM_REPLY`] whose payload is that export's storage, sent
//! from the storage's own pointer and length (UCX picks eager or rendezvous by size). A
//! request names no address: whatever it holds, the exporter reads nothing but whole
//! exports of the scope the key names. Anything else — a malformed request, an id unknown,
//! released or under another key, a length that differs — is answered with a status and
//! no payload, or dropped.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use ucx_rs::sys;

use super::proto::{self, AM_REPLY, AM_REQUEST, Reply, Request, Status};
use super::worker::{Worker, poll_fd, request_param};
use crate::blob::{Engine, ExportBlob, KEY_LEN, MAX_EXPORT_LEN};
use crate::error::{EngineError, ExportError, ReleaseError};
use crate::storage::Storage;

/// How long the progress thread sleeps on the wakeup fd before looking at its stop flag.
const IDLE_POLL: Duration = Duration::from_millis(100);
/// How long the progress thread keeps progressing, yielding, after the last event before
/// it arms the wakeup fd and sleeps.
const SPIN: Duration = Duration::from_micros(50);

/// One export: its storage, shared with the sends reading it.
struct Export {
    scope: u64,
    key: [u8; KEY_LEN],
    /// The storage's range, read once at export time (the `Storage` contract: it never
    /// changes), so no other thread calls into the storage.
    ptr: *const u8,
    len: usize,
    /// Only held (and finally dropped), never used through a shared reference.
    _storage: Box<dyn Storage>,
}

// SAFETY: `ptr` points into `_storage`, which is `Send`; the storage is never accessed
// through `&Export` (only `ptr`/`len`, plain values, are read), so sharing an `Export`
// between threads shares nothing of the storage but its address; UCX reads the bytes,
// which the `Storage` contract allows concurrently with anyone.
unsafe impl Send for Export {}
// SAFETY: as above.
unsafe impl Sync for Export {}

/// A reply send UCX has not completed yet; the export it reads is held until it has.
struct InFlight {
    request: *mut c_void,
    export: Arc<Export>,
}

/// What the request handler needs; reached from UCX's callback through a pointer that
/// stays valid until the worker is destroyed (see `Shared`'s drop).
struct Table {
    exports: Mutex<HashMap<u64, Arc<Export>>>,
    sends: Mutex<Vec<InFlight>>,
}

// SAFETY: the send requests are UCX requests of the exporter's worker; they are checked and
// freed only under the worker's lock (the progress thread, `live_exports`) or in `Shared`'s
// drop after the progress thread has stopped.
unsafe impl Send for Table {}
// SAFETY: as above; every field is behind a mutex.
unsafe impl Sync for Table {}

impl Table {
    /// Frees the completed sends and drops their hold on the export.
    fn reap(&self) {
        let done: Vec<InFlight> = {
            let mut sends = self.sends.lock();
            let mut done = Vec::new();
            let mut i = 0;
            while i < sends.len() {
                // SAFETY: a live request of this worker, not yet freed.
                let status = unsafe { sys::ucp_request_check_status(sends[i].request) };
                if status == sys::ucs_status_t_UCS_INPROGRESS {
                    i += 1;
                } else {
                    done.push(sends.swap_remove(i));
                }
            }
            done
        };
        for d in done {
            // SAFETY: the request completed; freed exactly once.
            unsafe { sys::ucp_request_free(d.request) };
        }
    }

    /// Exports held: live ones and released ones a send still reads.
    fn held(&self) -> usize {
        let exports = self.exports.lock();
        let sends = self.sends.lock();
        let mut released: Vec<*const Export> = sends
            .iter()
            .filter(|s| !exports.values().any(|e| Arc::ptr_eq(e, &s.export)))
            .map(|s| Arc::as_ptr(&s.export))
            .collect();
        released.sort();
        released.dedup();
        exports.len() + released.len()
    }
}

/// The exporter's answer to one request: `payload` is sent from the export's own memory.
///
/// # Safety
/// Called from the request handler only, with the `reply_ep` UCX passed to it.
unsafe fn answer(table: &Table, reply_ep: sys::ucp_ep_h, status: Status, token: u64, export: Option<Arc<Export>>) {
    let length = export.as_ref().map_or(0, |e| e.len as u64);
    let reply = Reply { status, token, length }.encode();
    let (ptr, len) = match (&export, status) {
        (Some(e), Status::Ok) => (e.ptr as *const c_void, e.len),
        _ => (std::ptr::null(), 0),
    };
    // The header is copied by UCX at the call; the payload is read until the send completes,
    // and the export (and so the storage) is held in `sends` until then.
    let param = request_param(sys::ucp_send_am_flags_UCP_AM_SEND_FLAG_COPY_HEADER);
    // SAFETY: `reply_ep` is the endpoint UCX handed to the handler; `reply` is 24 readable
    // bytes; `ptr..ptr+len` is the export's storage (readable for the `Storage`'s lifetime,
    // which the `Arc` pushed below extends past the send's completion) or empty.
    let sp = unsafe {
        sys::ucp_am_send_nbx(
            reply_ep,
            AM_REPLY,
            reply.as_ptr() as *const c_void,
            reply.len(),
            ptr,
            len,
            &param,
        )
    };
    match ucx_rs::decode_status_ptr(sp) {
        Ok(Some(request)) => match export {
            Some(export) => table.sends.lock().push(InFlight { request, export }),
            // SAFETY: a header-only send reads nothing of ours after the call (the header
            // was copied); the request may be freed before it completes.
            None => unsafe { sys::ucp_request_free(request) },
        },
        Ok(None) => {}
        // The importer sees no answer and times out; nothing of ours is referenced.
        Err(_) => {}
    }
}

/// UCX's callback for [`AM_REQUEST`]: looks up the export and answers (see the module
/// documentation). Runs inside `ucp_worker_progress` on the progress thread.
unsafe extern "C" fn on_request(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    _data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: `arg` is the `Table` inside the exporter's `Arc<Shared>`, which outlives the
    // worker; UCX passes a valid `param` for the call.
    let (table, param) = unsafe { (&*(arg as *const Table), &*param) };
    let rndv = param.recv_attr & sys::ucp_am_recv_attr_t_UCP_AM_RECV_ATTR_FLAG_RNDV as u64 != 0;
    // A request carries no payload: refuse a rendezvous one (its sender's send fails), drop
    // eager bytes (UCX frees them when we return).
    let drop_it = if rndv {
        sys::ucs_status_t_UCS_ERR_INVALID_PARAM
    } else {
        sys::ucs_status_t_UCS_OK
    };
    if length != 0
        || param.recv_attr & sys::ucp_am_recv_attr_t_UCP_AM_RECV_ATTR_FIELD_REPLY_EP as u64 == 0
        || param.reply_ep.is_null()
    {
        return drop_it;
    }
    // SAFETY: UCX's header is `header_length` readable bytes for the call.
    let Some(req) = Request::parse(unsafe { proto::header(header, header_length) }) else {
        return drop_it;
    };
    let found = table.exports.lock().get(&req.export_id).cloned();
    let (status, export) = match found {
        Some(e) if e.key == req.key && e.len as u64 == req.length => (Status::Ok, Some(e)),
        Some(e) if e.key == req.key => (Status::LengthMismatch, Some(e)),
        _ => (Status::UnknownExport, None),
    };
    // SAFETY: called from this handler with UCX's reply endpoint.
    unsafe { answer(table, param.reply_ep, status, req.token, export) };
    sys::ucs_status_t_UCS_OK
}

struct Shared {
    /// Dropped by hand in `Drop`, before `table`: the worker's callbacks point into it.
    state: std::mem::ManuallyDrop<Mutex<Worker>>,
    table: Arc<Table>,
    stop: AtomicBool,
    next_id: AtomicU64,
    next_scope: AtomicU64,
    address: Vec<u8>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The progress thread has stopped (it holds an `Arc<Shared>`). Free the requests
        // still in flight (UCX completes them as the worker is destroyed), destroy the
        // worker, and only then drop the exports those sends were reading.
        let sends = std::mem::take(&mut *self.table.sends.lock());
        for s in &sends {
            // SAFETY: live requests of this worker, freed exactly once; a request may be
            // freed before it completes.
            unsafe { sys::ucp_request_free(s.request) };
        }
        // SAFETY: `state` is dropped exactly once, here; nothing uses it after.
        unsafe { std::mem::ManuallyDrop::drop(&mut self.state) };
        drop(sends);
    }
}

/// Exports storages over UCX and answers importers' requests from a progress thread.
///
/// Dropping the exporter stops the thread; exports still held by live [`PeerScope`]s keep
/// their memory until those scopes drop, but are no longer served.
pub struct Exporter {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Exporter {
    /// Creates the context, worker and progress thread, configured from the environment.
    pub fn new() -> Result<Self, EngineError> {
        Self::with_options(&[])
    }

    /// As [`Exporter::new`], with UCX options (names without `UCX_`, e.g. `("TLS", "tcp")`)
    /// applied over the environment.
    pub fn with_options(options: &[(&str, &str)]) -> Result<Self, EngineError> {
        let mut worker = Worker::new(options)?;
        let address = worker.address()?;
        let table = Arc::new(Table {
            exports: Mutex::new(HashMap::new()),
            sends: Mutex::new(Vec::new()),
        });
        // SAFETY: the table is held by `Shared`, whose drop destroys the worker before the
        // table can go (`ManuallyDrop` above); the handler only reads it through `&`.
        unsafe {
            worker.set_am_handler(
                AM_REQUEST,
                Some(on_request),
                Arc::as_ptr(&table) as *mut c_void,
            )?
        };
        let shared = Arc::new(Shared {
            state: std::mem::ManuallyDrop::new(Mutex::new(worker)),
            table,
            stop: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
            next_scope: AtomicU64::new(1),
            address,
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("tw-remote-ucx".into())
            .spawn(move || progress_loop(&s))
            .map_err(|e| EngineError::Thread(e.to_string()))?;
        Ok(Exporter {
            shared,
            thread: Some(thread),
        })
    }

    /// A scope for one importer connection, with a fresh random key: its exports can be
    /// asked for only with that key, and are released when it drops.
    pub fn scope(&self) -> Result<PeerScope, EngineError> {
        let mut key = [0u8; KEY_LEN];
        let mut got = 0;
        while got < KEY_LEN {
            // SAFETY: writes at most `KEY_LEN - got` bytes into `key[got..]`.
            let n = unsafe {
                libc::getrandom(key[got..].as_mut_ptr() as *mut c_void, KEY_LEN - got, 0)
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(EngineError::Random(e.to_string()));
            }
            got += n as usize;
        }
        Ok(PeerScope {
            shared: self.shared.clone(),
            id: self.shared.next_scope.fetch_add(1, Ordering::Relaxed),
            key,
        })
    }

    /// Exports currently held, over all scopes: live ones, and released ones whose bytes a
    /// send still reads (held until the send completes).
    pub fn live_exports(&self) -> usize {
        // Under the worker's lock, so the sends' states are not read while progress
        // updates them.
        let _worker = self.shared.state.lock();
        self.shared.table.reap();
        self.shared.table.held()
    }

    /// This worker's address (what every blob of this exporter carries).
    pub fn worker_address(&self) -> &[u8] {
        &self.shared.address
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        // Release: pairs with the Acquire load in `progress_loop`.
        self.shared.stop.store(true, Ordering::Release);
        {
            let w = self.shared.state.lock();
            // SAFETY: the worker is live; `ucp_worker_signal` only wakes a thread sleeping
            // on its fd.
            unsafe { sys::ucp_worker_signal(w.raw()) };
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn progress_loop(shared: &Shared) {
    let mut active = Instant::now();
    // Acquire: pairs with the Release store in `Exporter::drop`.
    while !shared.stop.load(Ordering::Acquire) {
        let efd = {
            let mut w = shared.state.lock();
            if w.progress() {
                active = Instant::now();
            }
            shared.table.reap();
            // A short spin after the last event before sleeping: the next request of a
            // busy importer usually comes within it, and a wake-up per request costs more
            // than a small transfer. Yielding, so a peer on this CPU runs meanwhile.
            if active.elapsed() < SPIN {
                drop(w);
                std::thread::yield_now();
                continue;
            }
            if !w.arm() {
                continue;
            }
            w.efd()
        };
        poll_fd(efd, IDLE_POLL);
    }
}

/// The exports made for one importer connection.
///
/// Drop it when that connection dies: every export it still holds is dropped (once no
/// send reads it).
pub struct PeerScope {
    shared: Arc<Shared>,
    id: u64,
    key: [u8; KEY_LEN],
}

impl PeerScope {
    /// Exports `storage` and returns the blob an importer needs to ask for it.
    pub fn export(&self, storage: impl Storage) -> Result<ExportBlob, ExportError> {
        let len = storage.len();
        if len == 0 {
            return Err(ExportError::Empty);
        }
        if len as u64 > MAX_EXPORT_LEN {
            return Err(ExportError::TooLong(len));
        }
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let blob = ExportBlob::new(
            Engine::Ucx,
            id,
            len as u64,
            self.key,
            self.shared.address.clone(),
        )
        .map_err(ExportError::Blob)?;
        self.shared.table.exports.lock().insert(
            id,
            Arc::new(Export {
                scope: self.id,
                key: self.key,
                ptr: storage.as_ptr(),
                len,
                _storage: Box::new(storage),
            }),
        );
        Ok(blob)
    }

    /// Releases one export of this scope (the importer is done with it). A send still
    /// reading it completes first; the storage drops after.
    pub fn release(&self, export_id: u64) -> Result<(), ReleaseError> {
        let mut exports = self.shared.table.exports.lock();
        match exports.get(&export_id) {
            Some(e) if e.scope == self.id => {
                let e = exports.remove(&export_id);
                drop(exports);
                drop(e);
                Ok(())
            }
            _ => Err(ReleaseError::UnknownExport(export_id)),
        }
    }

    /// Exports this scope still holds.
    pub fn live(&self) -> usize {
        self.shared
            .table
            .exports
            .lock()
            .values()
            .filter(|r| r.scope == self.id)
            .count()
    }
}

impl Drop for PeerScope {
    fn drop(&mut self) {
        let gone: Vec<Arc<Export>> = {
            let mut exports = self.shared.table.exports.lock();
            let ids: Vec<u64> = exports
                .iter()
                .filter(|(_, e)| e.scope == self.id)
                .map(|(id, _)| *id)
                .collect();
            ids.into_iter().filter_map(|id| exports.remove(&id)).collect()
        };
        drop(gone);
    }
}
