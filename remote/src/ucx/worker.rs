//! One UCX context and one worker, torn down together.

use std::ffi::{CString, c_void};
use std::mem::MaybeUninit;
use std::ptr;
use std::time::{Duration, Instant};

use ucx_rs::sys;

use crate::error::EngineError;

/// UCX's status as text, for the error enums.
pub(crate) fn status_text(status: sys::ucs_status_t) -> String {
    ucx_rs::status_string(status).to_string()
}

/// A context with one worker (active messages + wakeup, serialized thread mode: the owner
/// guards every call with a lock).
pub(crate) struct Worker {
    context: sys::ucp_context_h,
    worker: sys::ucp_worker_h,
    efd: i32,
}

// SAFETY: the handles are plain pointers to UCX objects that are not tied to the creating
// thread; the worker is created in SERIALIZED mode and every use goes through `&mut self`
// (callers keep the `Worker` behind a mutex), so calls are never concurrent.
unsafe impl Send for Worker {}

impl Worker {
    /// `options` are UCX configuration names without the `UCX_` prefix (`("TLS", "tcp")`),
    /// applied over what UCX reads from the environment.
    pub(crate) fn new(options: &[(&str, &str)]) -> Result<Self, EngineError> {
        let ucx = |call: &'static str, status: sys::ucs_status_t| EngineError::Ucx {
            call,
            status: status_text(status),
        };
        let mut config: *mut sys::ucp_config_t = ptr::null_mut();
        // SAFETY: null prefix and file name read the environment; `config` is an out-pointer.
        let status = unsafe { sys::ucp_config_read(ptr::null(), ptr::null(), &mut config) };
        if status != sys::ucs_status_t_UCS_OK {
            return Err(ucx("ucp_config_read", status));
        }
        // Larger tcp segments than UCX's 8 KiB default: fewer fragments, system calls and
        // bounce-buffer round trips per transfer, which over tcp is where a large
        // transfer's time goes (docs/measurements.md, "Remote peers"). Each endpoint's
        // buffers are of this size. The environment (`UCX_TCP_TX_SEG_SIZE`,
        // `UCX_TCP_RX_SEG_SIZE`) and `options` win.
        let defaults = [("TCP_TX_SEG_SIZE", "256k"), ("TCP_RX_SEG_SIZE", "256k")];
        let defaults = defaults
            .iter()
            .filter(|(n, _)| std::env::var_os(format!("UCX_{n}")).is_none())
            .filter(|(n, _)| !options.iter().any(|(o, _)| o == n));
        // PUT off on tcp, last so that neither the environment nor `options` turns it back
        // on: we never put, and UCX's tcp transport writes a peer's PUT request to whatever
        // address it names. Our UCX (vendor/ucx-rs, its tcp patch) refuses one with data
        // where PUT is off and closes that connection; with PUT on, any peer could write
        // anywhere in this process.
        let forced = [("TCP_PUT_ENABLE", "n")];
        for (name, value) in defaults.chain(options.iter()).chain(forced.iter()) {
            let (Ok(n), Ok(v)) = (CString::new(*name), CString::new(*value)) else {
                // SAFETY: `config` came from `ucp_config_read` and is released once.
                unsafe { sys::ucp_config_release(config) };
                return Err(ucx(
                    "ucp_config_modify",
                    sys::ucs_status_t_UCS_ERR_INVALID_PARAM,
                ));
            };
            // SAFETY: `config` is live; both strings are NUL-terminated and outlive the call.
            let status = unsafe { sys::ucp_config_modify(config, n.as_ptr(), v.as_ptr()) };
            if status != sys::ucs_status_t_UCS_OK {
                // SAFETY: as above.
                unsafe { sys::ucp_config_release(config) };
                return Err(ucx("ucp_config_modify", status));
            }
        }
        // SAFETY: an all-zero `ucp_params_t` is a valid "no optional field" value (a
        // plain C struct of integers, pointers and nullable function pointers); we set the
        // fields we name in `field_mask`.
        let mut params: sys::ucp_params_t = unsafe { MaybeUninit::zeroed().assume_init() };
        params.field_mask = sys::ucp_params_field_UCP_PARAM_FIELD_FEATURES as u64;
        params.features =
            (sys::ucp_feature_UCP_FEATURE_AM | sys::ucp_feature_UCP_FEATURE_WAKEUP) as u64;
        let mut context: sys::ucp_context_h = ptr::null_mut();
        // SAFETY: `params` is initialised as above; a null config makes UCX read its
        // environment; `context` is a valid out-pointer.
        let status = unsafe {
            sys::ucp_init_version(
                sys::UCP_API_MAJOR,
                sys::UCP_API_MINOR,
                &params,
                config,
                &mut context,
            )
        };
        // SAFETY: the context copied what it needs; `config` is released once.
        unsafe { sys::ucp_config_release(config) };
        if status != sys::ucs_status_t_UCS_OK {
            return Err(ucx("ucp_init_version", status));
        }
        // SAFETY: zeroed worker params are valid (see above); we set the thread mode.
        let mut wparams: sys::ucp_worker_params_t = unsafe { MaybeUninit::zeroed().assume_init() };
        wparams.field_mask = sys::ucp_worker_params_field_UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64;
        wparams.thread_mode = sys::ucs_thread_mode_t_UCS_THREAD_MODE_SERIALIZED;
        let mut worker: sys::ucp_worker_h = ptr::null_mut();
        // SAFETY: `context` was just created; `wparams` and `worker` are valid pointers.
        let status = unsafe { sys::ucp_worker_create(context, &wparams, &mut worker) };
        if status != sys::ucs_status_t_UCS_OK {
            // SAFETY: the context has no worker and is not used again.
            unsafe { sys::ucp_cleanup(context) };
            return Err(ucx("ucp_worker_create", status));
        }
        let mut efd = -1;
        // SAFETY: `worker` is live; `efd` is a valid out-pointer.
        let status = unsafe { sys::ucp_worker_get_efd(worker, &mut efd) };
        if status != sys::ucs_status_t_UCS_OK {
            // SAFETY: both handles are live and not used again; worker before context.
            unsafe {
                sys::ucp_worker_destroy(worker);
                sys::ucp_cleanup(context);
            }
            return Err(ucx("ucp_worker_get_efd", status));
        }
        Ok(Worker {
            context,
            worker,
            efd,
        })
    }

    pub(crate) fn raw(&self) -> sys::ucp_worker_h {
        self.worker
    }

    /// The worker's address, copied out.
    pub(crate) fn address(&mut self) -> Result<Vec<u8>, EngineError> {
        let mut addr: *mut sys::ucp_address_t = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: the worker is live; both out-pointers are valid.
        let status = unsafe { sys::ucp_worker_get_address(self.worker, &mut addr, &mut len) };
        if status != sys::ucs_status_t_UCS_OK {
            return Err(EngineError::Ucx {
                call: "ucp_worker_get_address",
                status: status_text(status),
            });
        }
        // SAFETY: UCX returned `len` readable bytes at `addr`, valid until released below.
        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
        // SAFETY: `addr` came from `ucp_worker_get_address` on this worker, released once.
        unsafe { sys::ucp_worker_release_address(self.worker, addr) };
        Ok(bytes)
    }

    /// Installs `cb` as the handler of active messages `id`, called with `arg` from this
    /// worker's progress.
    ///
    /// # Safety
    /// `arg` must be valid for what `cb` does with it until the worker is destroyed.
    pub(crate) unsafe fn set_am_handler(
        &mut self,
        id: u32,
        cb: sys::ucp_am_recv_callback_t,
        arg: *mut c_void,
    ) -> Result<(), EngineError> {
        // SAFETY: zeroed handler params mean "no optional field"; we set the ones named.
        let mut p: sys::ucp_am_handler_param_t = unsafe { MaybeUninit::zeroed().assume_init() };
        p.field_mask = (sys::ucp_am_handler_param_field_UCP_AM_HANDLER_PARAM_FIELD_ID
            | sys::ucp_am_handler_param_field_UCP_AM_HANDLER_PARAM_FIELD_CB
            | sys::ucp_am_handler_param_field_UCP_AM_HANDLER_PARAM_FIELD_ARG)
            as u64;
        p.id = id;
        p.cb = cb;
        p.arg = arg;
        // SAFETY: the worker is live and ours; `arg` outlives it (the caller's contract).
        let status = unsafe { sys::ucp_worker_set_am_recv_handler(self.worker, &p) };
        if status != sys::ucs_status_t_UCS_OK {
            return Err(EngineError::Ucx {
                call: "ucp_worker_set_am_recv_handler",
                status: status_text(status),
            });
        }
        Ok(())
    }

    /// Progresses until nothing more happens; returns whether anything did.
    pub(crate) fn progress(&mut self) -> bool {
        let mut any = false;
        // SAFETY: the worker is live and we hold it exclusively (`&mut self`).
        while unsafe { sys::ucp_worker_progress(self.worker) } != 0 {
            any = true;
        }
        any
    }

    /// Arms the wakeup fd; `false` when events are already pending (progress again).
    pub(crate) fn arm(&mut self) -> bool {
        // SAFETY: the worker is live and exclusively ours.
        let status = unsafe { sys::ucp_worker_arm(self.worker) };
        status == sys::ucs_status_t_UCS_OK
    }

    pub(crate) fn efd(&self) -> i32 {
        self.efd
    }

    /// Progresses until `request` (from a `*_nbx` call) completes or `deadline` passes;
    /// returns its status, or `None` at the deadline (the request is still owned by the
    /// caller, who must make it complete and free it).
    pub(crate) fn wait(
        &mut self,
        request: *mut c_void,
        deadline: Option<Instant>,
    ) -> Option<sys::ucs_status_t> {
        loop {
            // SAFETY: `request` is a live request of this worker (not yet freed).
            let status = unsafe { sys::ucp_request_check_status(request) };
            if status != sys::ucs_status_t_UCS_INPROGRESS {
                return Some(status);
            }
            if self.progress() {
                continue;
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return None;
            }
            if self.arm() {
                let left = deadline.map_or(Duration::from_millis(10), |d| d - now);
                poll_fd(self.efd, left.min(Duration::from_millis(10)));
            }
        }
    }
}

/// Request parameters with only `flags` set (no callback: UCX returns a request to poll).
pub(crate) fn request_param(flags: u32) -> sys::ucp_request_param_t {
    // SAFETY: an all-zero `ucp_request_param_t` is the "no optional field" value (integers,
    // pointers and nullable function pointers only).
    let mut p: sys::ucp_request_param_t = unsafe { MaybeUninit::zeroed().assume_init() };
    if flags != 0 {
        p.op_attr_mask = sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_FLAGS;
        p.flags = flags;
    }
    p
}

/// Waits up to `timeout` for `fd` to be readable.
pub(crate) fn poll_fd(fd: i32, timeout: Duration) {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: one valid pollfd; the result only decides whether we progress sooner.
    unsafe { libc::poll(&mut pfd, 1, ms) };
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: owners close their endpoints and unmap their registrations before
        // dropping the worker; the worker then the context are destroyed exactly once.
        unsafe {
            sys::ucp_worker_destroy(self.worker);
            sys::ucp_cleanup(self.context);
        }
    }
}
