//! The exporting side: registrations, their scopes, and the progress thread.

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::ptr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;
use ucx_rs::sys;

use super::worker::{Worker, poll_fd, status_text};
use crate::blob::{Engine, ExportBlob, MAX_EXPORT_LEN};
use crate::error::{EngineError, ExportError, ReleaseError};
use crate::storage::Storage;

/// How long the progress thread sleeps on the wakeup fd before looking at its stop flag.
const IDLE_POLL: Duration = Duration::from_millis(100);

struct Registration {
    scope: u64,
    memh: sys::ucp_mem_h,
    // Dropped only after `memh` is unmapped (see `State::unmap`).
    _storage: Box<dyn Storage>,
}

/// Released registrations waiting for a worker flush: over tcp and shared memory UCX
/// answers a get with a reply request that reads the storage fragment by fragment as the
/// transport takes them (`ucp_rma_sw.c`), so a release or a scope's end may come while
/// such a reply is still queued. The storage is dropped (and unmapped) only once a flush
/// issued after the release has completed: the flush waits behind every queued send of
/// the worker, the get replies included, and completes (with an error) for a peer that
/// has failed.
struct Retired {
    /// The flush request (from `ucp_worker_flush_nbx`), freed when it completes.
    flush: *mut std::ffi::c_void,
    regs: Vec<Registration>,
}

struct State {
    worker: Worker,
    exports: HashMap<u64, Registration>,
    retired: Vec<Retired>,
}

// SAFETY: `memh` handles and flush requests belong to the worker (and its context) and are
// used only under the `State` mutex, like the worker itself; `Worker` is `Send`.
unsafe impl Send for State {}

impl State {
    fn unmap(&mut self, reg: Registration) {
        // SAFETY: `memh` was mapped on this context and is unmapped exactly once (the
        // registration was just removed from the map or the retired list). The storage
        // drops after this.
        unsafe { sys::ucp_mem_unmap(self.worker.context(), reg.memh) };
        drop(reg);
    }

    /// Unregisters `regs` once every send queued on the worker so far has gone out (see
    /// [`Retired`]); at once if nothing is queued.
    fn retire(&mut self, regs: Vec<Registration>) {
        if regs.is_empty() {
            return;
        }
        // SAFETY: zeroed request params: no callback, UCX returns a request to poll.
        let param: sys::ucp_request_param_t = unsafe { MaybeUninit::zeroed().assume_init() };
        // SAFETY: the worker is live and ours (under the state mutex).
        let sp = unsafe { sys::ucp_worker_flush_nbx(self.worker.raw(), &param) };
        match ucx_rs::decode_status_ptr(sp) {
            Ok(Some(flush)) => {
                self.retired.push(Retired { flush, regs });
                // SAFETY: the worker is live; this only wakes the progress thread, which
                // then progresses the flush and finishes the retirement.
                unsafe { sys::ucp_worker_signal(self.worker.raw()) };
            }
            // Nothing queued (or the flush itself failed, in which case UCX has nothing
            // left in flight to wait for): unregister now.
            Ok(None) | Err(_) => {
                for reg in regs {
                    self.unmap(reg);
                }
            }
        }
    }

    /// Unregisters the retired registrations whose flush has completed.
    fn reap(&mut self) {
        let mut i = 0;
        while i < self.retired.len() {
            // SAFETY: `flush` is a live request of this worker, not yet freed.
            let status = unsafe { sys::ucp_request_check_status(self.retired[i].flush) };
            if status == sys::ucs_status_t_UCS_INPROGRESS {
                i += 1;
                continue;
            }
            let done = self.retired.swap_remove(i);
            // SAFETY: the request completed; freed exactly once.
            unsafe { sys::ucp_request_free(done.flush) };
            for reg in done.regs {
                self.unmap(reg);
            }
        }
    }

    fn held(&self) -> usize {
        self.exports.len() + self.retired.iter().map(|r| r.regs.len()).sum::<usize>()
    }
}

impl Drop for State {
    fn drop(&mut self) {
        // The progress thread has stopped: what is still queued is never sent, so the
        // retired registrations go now, after their flush requests are freed (UCX
        // completes outstanding requests as the worker is destroyed; a request may be
        // freed before it completes).
        for r in std::mem::take(&mut self.retired) {
            // SAFETY: a live request of this worker, freed exactly once.
            unsafe { sys::ucp_request_free(r.flush) };
            for reg in r.regs {
                self.unmap(reg);
            }
        }
        let regs: Vec<_> = self.exports.drain().map(|(_, r)| r).collect();
        for reg in regs {
            self.unmap(reg);
        }
        // `worker` drops after this: no registration outlives its context.
    }
}

struct Shared {
    state: Mutex<State>,
    stop: AtomicBool,
    next_id: AtomicU64,
    next_scope: AtomicU64,
    address: Vec<u8>,
}

/// Exports storages over UCX and serves importers' gets from a progress thread.
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
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                worker,
                exports: HashMap::new(),
                retired: Vec::new(),
            }),
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

    /// A scope for one importer connection: its exports are released when it drops.
    pub fn scope(&self) -> PeerScope {
        PeerScope {
            shared: self.shared.clone(),
            id: self.shared.next_scope.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// Registrations currently held, over all scopes: live exports, and released ones
    /// whose storage a queued get reply may still read (held until the worker's flush).
    pub fn live_exports(&self) -> usize {
        self.shared.state.lock().held()
    }

    /// This worker's address (what every blob of this exporter carries).
    pub fn worker_address(&self) -> &[u8] {
        &self.shared.address
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        {
            let st = self.shared.state.lock();
            // SAFETY: the worker is live (the state is); `ucp_worker_signal` only wakes a
            // thread sleeping on its fd.
            unsafe { sys::ucp_worker_signal(st.worker.raw()) };
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn progress_loop(shared: &Shared) {
    while !shared.stop.load(Ordering::Acquire) {
        let efd = {
            let mut st = shared.state.lock();
            st.worker.progress();
            st.reap();
            if !st.worker.arm() {
                continue;
            }
            st.worker.efd()
        };
        poll_fd(efd, IDLE_POLL);
    }
}

/// The exports made for one importer connection.
///
/// Drop it when that connection dies: every export it still holds is unregistered and its
/// storage dropped.
pub struct PeerScope {
    shared: Arc<Shared>,
    id: u64,
}

impl PeerScope {
    /// Registers `storage` and returns the blob an importer needs to read it.
    pub fn export(&self, storage: impl Storage) -> Result<ExportBlob, ExportError> {
        let (ptr_, len) = (storage.as_ptr(), storage.len());
        if len == 0 {
            return Err(ExportError::Empty);
        }
        if len as u64 > MAX_EXPORT_LEN {
            return Err(ExportError::TooLong(len));
        }
        let mut st = self.shared.state.lock();
        let context = st.worker.context();
        // SAFETY: zeroed map params mean "no optional field"; we set address and length.
        let mut params: sys::ucp_mem_map_params_t = unsafe { MaybeUninit::zeroed().assume_init() };
        params.field_mask = (sys::ucp_mem_map_params_field_UCP_MEM_MAP_PARAM_FIELD_ADDRESS
            | sys::ucp_mem_map_params_field_UCP_MEM_MAP_PARAM_FIELD_LENGTH)
            as u64;
        params.address = ptr_ as *mut _;
        params.length = len;
        let mut memh: sys::ucp_mem_h = ptr::null_mut();
        // SAFETY: the range is live memory for as long as `storage` lives (its contract),
        // and `storage` is kept in the registration until after the unmap.
        let status = unsafe { sys::ucp_mem_map(context, &params, &mut memh) };
        if status != sys::ucs_status_t_UCS_OK {
            return Err(ExportError::Register {
                call: "ucp_mem_map",
                status: status_text(status),
            });
        }
        let mut rkey_buf: *mut std::ffi::c_void = ptr::null_mut();
        let mut rkey_len = 0usize;
        // SAFETY: `memh` was just mapped on `context`; both out-pointers are valid.
        let status = unsafe { sys::ucp_rkey_pack(context, memh, &mut rkey_buf, &mut rkey_len) };
        let unmap = |memh| {
            // SAFETY: `memh` is mapped on `context` and not recorded anywhere else.
            unsafe { sys::ucp_mem_unmap(context, memh) };
        };
        if status != sys::ucs_status_t_UCS_OK {
            unmap(memh);
            return Err(ExportError::Register {
                call: "ucp_rkey_pack",
                status: status_text(status),
            });
        }
        // SAFETY: UCX returned `rkey_len` readable bytes at `rkey_buf`, released right after.
        let rkey = unsafe { std::slice::from_raw_parts(rkey_buf as *const u8, rkey_len) }.to_vec();
        // SAFETY: `rkey_buf` came from `ucp_rkey_pack` and is released once.
        unsafe { sys::ucp_rkey_buffer_release(rkey_buf) };
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let blob = match ExportBlob::new(
            Engine::Ucx,
            id,
            ptr_ as u64,
            len as u64,
            self.shared.address.clone(),
            rkey,
        ) {
            Ok(b) => b,
            Err(e) => {
                unmap(memh);
                return Err(ExportError::Register {
                    call: "ucp_rkey_pack",
                    status: e.to_string(),
                });
            }
        };
        st.exports.insert(
            id,
            Registration {
                scope: self.id,
                memh,
                _storage: Box::new(storage),
            },
        );
        Ok(blob)
    }

    /// Releases one export of this scope (the importer is done with it).
    pub fn release(&self, export_id: u64) -> Result<(), ReleaseError> {
        let mut st = self.shared.state.lock();
        match st.exports.remove(&export_id) {
            Some(reg) if reg.scope == self.id => {
                st.retire(vec![reg]);
                Ok(())
            }
            Some(other) => {
                st.exports.insert(export_id, other);
                Err(ReleaseError::UnknownExport(export_id))
            }
            None => Err(ReleaseError::UnknownExport(export_id)),
        }
    }

    /// Exports this scope still holds.
    pub fn live(&self) -> usize {
        self.shared
            .state
            .lock()
            .exports
            .values()
            .filter(|r| r.scope == self.id)
            .count()
    }
}

impl Drop for PeerScope {
    fn drop(&mut self) {
        let mut st = self.shared.state.lock();
        let ids: Vec<u64> = st
            .exports
            .iter()
            .filter(|(_, r)| r.scope == self.id)
            .map(|(id, _)| *id)
            .collect();
        let regs = ids.into_iter().filter_map(|id| st.exports.remove(&id)).collect();
        st.retire(regs);
    }
}
