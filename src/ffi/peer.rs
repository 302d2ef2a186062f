//! Connections, exports, imports and messages in C.
//!
//! Thread-safety: a `tw_peer_t` may be used from several threads at once for export,
//! send, stats and reap; `tw_peer_recv` must be called by one thread at a time. A
//! `tw_listener_t` may be shared. `tw_imported_t` and `tw_message_t` belong to one thread
//! at a time (move them between threads freely). Release callbacks run on whichever
//! thread ends the lease (often tensorwire's reaper thread) and must not throw.

use super::desc::tw_layout_t;
use super::segment::tw_segment_t;
use super::{arg, guard, need, put, quiet, tw_result_e, Fail};
use crate::desc::TensorDesc;
use crate::error::Error;
use crate::lease::LeaseStats;
use crate::peer::{ExportOptions, Imported, Incoming, Peer, PeerConfig, SharedTensor};
use crate::Listener;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::os::fd::{BorrowedFd, FromRawFd, IntoRawFd, OwnedFd};

use std::time::Duration;

/// Limits for one connection (`tw_peer_config_default` fills the defaults).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tw_peer_config_t {
    /// Leases the peer may hold at once.
    pub max_leases: u32,
    /// Largest lease table accepted from the peer.
    pub max_peer_table_capacity: u32,
    /// Bytes the peer may hold under lease at once.
    pub max_lease_bytes: u64,
    /// Window for exports that name none, in ms (0: none).
    pub default_window_ms: u64,
    /// Largest control message.
    pub max_message: u64,
    /// Most peer segments mapped at once.
    pub max_import_segments: u64,
    /// Connection setup timeout in ms.
    pub handshake_timeout_ms: u64,
    /// Data area of the ring this side sends through (power of two ≥ 4096; 0: none).
    pub ring_bytes: u64,
    /// Largest ring accepted from the peer.
    pub max_peer_ring_bytes: u64,
    /// Largest message reassembled from ring chunks.
    pub max_ring_message: u64,
    /// Polls before a ring wait sleeps.
    pub ring_spin: u32,
    pub reserved: u32,
    /// While leases are live, how often (µs) released leases are collected and their
    /// release callbacks run (also at each export and `tw_peer_reap`).
    pub reap_interval_us: u64,
    /// How long (µs) a receive polls before sleeping (0: sleep at once).
    pub recv_spin_us: u64,
    /// Device of this side's GPU bounce ring (-1: no GPU ring). With one, creating the
    /// peer needs a CUDA driver.
    pub cuda_ring_device: i32,
    /// Slots in the GPU ring's arena.
    pub cuda_ring_slots: u32,
    /// Bytes per GPU ring slot (a multiple of 256, at least 4096); larger tensors go
    /// through in chunks.
    pub cuda_ring_slot_bytes: u64,
    /// Most bytes of the peer's segments mapped here at once (only the ranges its
    /// descriptors name are mapped); over it an import fails with
    /// `TW_ERR_QUOTA_EXCEEDED`. Default: RAM plus swap.
    pub max_import_mapped_bytes: u64,
    /// How long (ms) a send may wait for room in the peer's socket buffer before it fails
    /// with `TW_ERR_TIMEOUT` (the export's lease is taken back).
    pub send_timeout_ms: u64,
}

impl From<&tw_peer_config_t> for PeerConfig {
    fn from(c: &tw_peer_config_t) -> Self {
        PeerConfig {
            max_leases: c.max_leases,
            max_lease_bytes: c.max_lease_bytes,
            default_window: (c.default_window_ms > 0).then(|| Duration::from_millis(c.default_window_ms)),
            max_message: c.max_message as usize,
            max_import_segments: c.max_import_segments as usize,
            max_import_mapped_bytes: c.max_import_mapped_bytes,
            send_timeout: Duration::from_millis(c.send_timeout_ms),
            max_peer_table_capacity: c.max_peer_table_capacity,
            handshake_timeout: Duration::from_millis(c.handshake_timeout_ms),
            ring_bytes: c.ring_bytes as usize,
            max_peer_ring_bytes: c.max_peer_ring_bytes as usize,
            max_ring_message: c.max_ring_message,
            ring_spin: c.ring_spin,
            reap_interval: Duration::from_micros(c.reap_interval_us.max(1)),
            recv_spin: Duration::from_micros(c.recv_spin_us),
            cuda_ring: (c.cuda_ring_device >= 0).then_some(crate::cuda::ring::CudaRingConfig {
                device: c.cuda_ring_device,
                slots: c.cuda_ring_slots,
                slot_bytes: c.cuda_ring_slot_bytes,
            }),
        }
    }
}

/// Names a lease: slot in the producer's table and its generation.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct tw_lease_t {
    pub slot: u32,
    pub generation: u32,
}

/// What a producer exported to one peer.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct tw_lease_stats_t {
    pub live_leases: u64,
    pub live_bytes: u64,
    pub granted: u64,
    pub released: u64,
    pub expired: u64,
    pub reclaimed: u64,
}

impl From<LeaseStats> for tw_lease_stats_t {
    fn from(s: LeaseStats) -> Self {
        tw_lease_stats_t {
            live_leases: s.live_leases,
            live_bytes: s.live_bytes,
            granted: s.granted,
            released: s.released,
            expired: s.expired,
            reclaimed: s.reclaimed,
        }
    }
}

/// Called exactly once with its context when an exported lease ends.
pub type tw_release_fn = Option<unsafe extern "C" fn(ctx: *mut c_void)>;

/// Opaque connection handle.
pub struct tw_peer_t {
    inner: Peer,
}

impl tw_peer_t {
    pub(crate) fn inner(&self) -> &Peer {
        &self.inner
    }
    pub(crate) fn config(&self) -> &PeerConfig {
        self.inner.config()
    }
}

/// Opaque listening socket.
pub struct tw_listener_t {
    inner: Listener,
}

/// Opaque imported tensor: a view of the peer's memory (CPU, or CUDA device memory),
/// valid until released.
pub struct tw_imported_t {
    inner: AnyImport,
}

// Lives in a boxed handle (`tw_imported_t`), one per import: the CPU variant's spare
// bytes cost nothing worth a second allocation for the CUDA one.
#[allow(clippy::large_enum_variant)]
enum AnyImport {
    /// Shared with the leases of its forwards (`tw_peer_export_imported`).
    Cpu(std::sync::Arc<Imported>),
    Cuda(crate::peer::CudaImported),
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
            AnyImport::Cuda(i) => i.data_ptr() as usize as *mut c_void,
        }
    }
    fn storage_ptr(&self) -> *mut c_void {
        match self {
            AnyImport::Cpu(i) => i.storage_ptr().cast(),
            AnyImport::Cuda(i) => i.storage_ptr() as usize as *mut c_void,
        }
    }
    fn tag(&self) -> u64 {
        match self {
            AnyImport::Cpu(i) => i.tag(),
            AnyImport::Cuda(i) => i.tag(),
        }
    }
    fn lease(&self) -> tw_lease_t {
        let d = self.desc();
        tw_lease_t { slot: d.storage.lease_slot, generation: d.storage.lease_gen }
    }
    fn release(self) -> crate::Result<()> {
        match self {
            // Forwarded and still leased downstream: the forward's lease holds the
            // import, and the lease goes back when the last forward ends.
            AnyImport::Cpu(i) => std::sync::Arc::try_unwrap(i).map_or(Ok(()), Imported::release),
            AnyImport::Cuda(i) => i.release(),
        }
    }
}

/// Opaque received user message (payload + fds).
pub struct tw_message_t {
    payload: Vec<u8>,
    fds: Vec<Option<OwnedFd>>,
}

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

/// Fill `out` with the default limits.
///
/// # Safety
/// `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_config_default(out: *mut tw_peer_config_t) -> tw_result_e {
    guard("tw_peer_config_default", || {
        let d = PeerConfig::default();
        let c = tw_peer_config_t {
            max_leases: d.max_leases,
            max_peer_table_capacity: d.max_peer_table_capacity,
            max_lease_bytes: d.max_lease_bytes,
            default_window_ms: d.default_window.map_or(0, |w| w.as_millis() as u64),
            max_message: d.max_message as u64,
            max_import_segments: d.max_import_segments as u64,
            handshake_timeout_ms: d.handshake_timeout.as_millis() as u64,
            ring_bytes: d.ring_bytes as u64,
            max_peer_ring_bytes: d.max_peer_ring_bytes as u64,
            max_ring_message: d.max_ring_message,
            ring_spin: d.ring_spin,
            reserved: 0,
            reap_interval_us: d.reap_interval.as_micros() as u64,
            recv_spin_us: d.recv_spin.as_micros() as u64,
            cuda_ring_device: -1,
            cuda_ring_slots: crate::cuda::ring::CudaRingConfig::default().slots,
            cuda_ring_slot_bytes: crate::cuda::ring::CudaRingConfig::default().slot_bytes,
            max_import_mapped_bytes: d.max_import_mapped_bytes,
            send_timeout_ms: d.send_timeout.as_millis() as u64,
        };
        // SAFETY: writable per the contract; NULL refused.
        unsafe { put(out, c, "out") }
    })
}

/// # Safety
/// `cfg` NULL or readable.
unsafe fn config(cfg: *const tw_peer_config_t) -> PeerConfig {
    // SAFETY: NULL or readable per the callers' contracts.
    unsafe { cfg.as_ref() }.map_or_else(PeerConfig::default, PeerConfig::from)
}

/// A connected SEQPACKET socket pair (close-on-exec; see `tw_fd_set_inheritable`).
///
/// # Safety
/// `out_a`, `out_b` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_socketpair(out_a: *mut c_int, out_b: *mut c_int) -> tw_result_e {
    guard("tw_socketpair", || {
        need(out_a, "out_a")?;
        need(out_b, "out_b")?;
        let (a, b) = crate::sys::seqpacket_pair()?;
        // SAFETY: both checked non-null; writable per the contract.
        unsafe {
            put(out_a, a.into_raw_fd(), "out_a")?;
            put(out_b, b.into_raw_fd(), "out_b")
        }
    })
}

/// Let `fd` survive exec (clear FD_CLOEXEC) or not.
#[unsafe(no_mangle)]
pub extern "C" fn tw_fd_set_inheritable(fd: c_int, inheritable: bool) -> tw_result_e {
    guard("tw_fd_set_inheritable", || {
        if fd < 0 {
            return Err(Error::InvalidArgument(format!("fd {fd} is not a valid descriptor")).into());
        }
        // SAFETY: the fd is only borrowed for the fcntl calls; the caller keeps it open.
        let b = unsafe { BorrowedFd::borrow_raw(fd) };
        Ok(crate::sys::set_cloexec(b, !inheritable)?)
    })
}

fn boxed_peer(p: Peer) -> *mut tw_peer_t {
    Box::into_raw(Box::new(tw_peer_t { inner: p }))
}

/// Handshake over a connected SEQPACKET socket (an end of `tw_socketpair`, inherited or
/// not) and set up leases. Takes ownership of `fd`. `cfg` may be NULL (defaults).
///
/// # Safety
/// `fd` open and owned by the caller; `cfg` NULL or readable; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_from_fd(fd: c_int, cfg: *const tw_peer_config_t, out: *mut *mut tw_peer_t) -> tw_result_e {
    guard("tw_peer_from_fd", || {
        if fd < 0 {
            return Err(Error::InvalidArgument(format!("fd {fd} is not a valid descriptor")).into());
        }
        // SAFETY: ownership of the open fd is transferred to us.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        need(out, "out")?;
        // SAFETY: per the contract.
        let p = Peer::from_fd(owned, unsafe { config(cfg) })?;
        // SAFETY: checked non-null.
        unsafe { put(out, boxed_peer(p), "out") }
    })
}

fn path_arg<'a>(path: *const c_char) -> Result<&'a str, Fail> {
    // SAFETY: callers' contracts: NULL or a NUL-terminated string (NULL refused).
    let c = unsafe { CStr::from_ptr(arg(path, "path")?) };
    Ok(c.to_str().map_err(|_| Error::InvalidArgument("path is not UTF-8".into()))?)
}

/// Connect to a listener at `path`.
///
/// # Safety
/// `path` a C string; `cfg` NULL or readable; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_connect(path: *const c_char, cfg: *const tw_peer_config_t, out: *mut *mut tw_peer_t) -> tw_result_e {
    guard("tw_peer_connect", || {
        need(out, "out")?;
        // SAFETY: per the contract.
        let p = Peer::connect(path_arg(path)?, unsafe { config(cfg) })?;
        // SAFETY: checked non-null.
        unsafe { put(out, boxed_peer(p), "out") }
    })
}

/// Listen at `path` (must not exist; removed when the listener is freed).
///
/// # Safety
/// `path` a C string; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_listener_bind(path: *const c_char, out: *mut *mut tw_listener_t) -> tw_result_e {
    guard("tw_listener_bind", || {
        need(out, "out")?;
        let l = Listener::bind(path_arg(path)?)?;
        // SAFETY: checked non-null.
        unsafe { put(out, Box::into_raw(Box::new(tw_listener_t { inner: l })), "out") }
    })
}

/// Accept and handshake one connection (waits at most the config's handshake timeout).
///
/// # Safety
/// `listener` live; `cfg` NULL or readable; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_listener_accept(
    listener: *const tw_listener_t,
    cfg: *const tw_peer_config_t,
    out: *mut *mut tw_peer_t,
) -> tw_result_e {
    guard("tw_listener_accept", || {
        // SAFETY: live per the contract; NULL refused.
        let l = unsafe { arg(listener, "listener")? };
        need(out, "out")?;
        // SAFETY: per the contract.
        let p = Peer::accept(&l.inner, unsafe { config(cfg) })?;
        // SAFETY: checked non-null.
        unsafe { put(out, boxed_peer(p), "out") }
    })
}

/// Free a listener (removes its socket file). NULL is a no-op.
///
/// # Safety
/// NULL or a live handle, not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_listener_free(listener: *mut tw_listener_t) {
    // SAFETY: forwarded from this function's contract.
    unsafe { super::free_handle(listener) }
}

/// End the connection and free the handle. Every lease this side granted ends (release
/// callbacks run before this returns); the peer sees the connection close. Imports
/// still held stay readable. NULL is a no-op.
///
/// # Safety
/// NULL or a live handle, not used afterwards (nor concurrently).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_free(peer: *mut tw_peer_t) {
    // SAFETY: forwarded from this function's contract.
    unsafe { super::free_handle(peer) }
}

/// The peer's pid as verified by the kernel (-1 if `peer` is NULL).
///
/// # Safety
/// NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_pid(peer: *const tw_peer_t) -> i32 {
    // SAFETY: NULL or live per the contract.
    quiet(-1, || unsafe { peer.as_ref() }.map_or(-1, |p| p.inner.peer_pid()))
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
        let window = (window_ms > 0).then(|| Duration::from_millis(window_ms));
        let id = p.inner.export_with_owner(&t, owner, ExportOptions { tag, window })?;
        if !out_lease.is_null() {
            // SAFETY: non-null and writable per the contract.
            unsafe { out_lease.write(tw_lease_t { slot: id.slot, generation: id.generation }) };
        }
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
/// `TW_ERR_INVALID_ARGUMENT` for a CUDA import or a view that does not fit the storage.
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
    // Built first so that every failure below drops it, which runs the callback.
    let owner = release.map(|f| CallbackOwner { release: f, ctx });
    guard("tw_peer_export_imported", move || {
        // SAFETY: live per the contract; NULL refused.
        let p = unsafe { arg(peer, "peer")? };
        // SAFETY: live per the contract; NULL refused.
        let i = match &unsafe { arg(imp, "imp")? }.inner {
            AnyImport::Cpu(i) => i.clone(),
            AnyImport::Cuda(_) => {
                return Err(Error::InvalidArgument(
                    "a CUDA import cannot be forwarded (only CPU imports can); copy it to memory of this process first".into(),
                )
                .into());
            }
        };
        // SAFETY: NULL or readable per the contract.
        let view = match unsafe { layout.as_ref() } {
            Some(l) => Some(l.to_layout()?),
            None => None,
        };
        let window = (window_ms > 0).then(|| Duration::from_millis(window_ms));
        let opts = ExportOptions { tag, window };
        // The C owner (if any) ends with the lease: it rides in the lease of the forward.
        let id = match owner {
            Some(o) => p.inner.export_imported_with(i, view, Box::new(o), opts)?,
            None => p.inner.export_imported(i, view, opts)?,
        };
        if !out_lease.is_null() {
            // SAFETY: non-null and writable per the contract.
            unsafe { out_lease.write(tw_lease_t { slot: id.slot, generation: id.generation }) };
        }
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
        let window = (window_ms > 0).then(|| Duration::from_millis(window_ms));
        let id = p.inner.export_cuda(dptr, nbytes, &l, stream, owner, ExportOptions { tag, window })?;
        if !out_lease.is_null() {
            // SAFETY: non-null and writable per the contract.
            unsafe { out_lease.write(tw_lease_t { slot: id.slot, generation: id.generation }) };
        }
        Ok(())
    })
}

/// This process's CUDA IPC handle cache: how many times it called cuIpcOpenMemHandle,
/// and how many handles are open now (either may be NULL).
///
/// # Safety
/// Each pointer NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_cuda_ipc_cache_stats(opens: *mut u64, open_handles: *mut u64) {
    quiet((), || {
        let c = crate::cuda::ipc::cache();
        if !opens.is_null() {
            // SAFETY: non-null; the caller passes a writable pointer or NULL.
            unsafe { opens.write(c.opens()) };
        }
        if !open_handles.is_null() {
            // SAFETY: as above.
            unsafe { open_handles.write(c.stats().0 as u64) };
        }
    })
}

/// How many unused opened IPC handles the cache keeps open (default 0: each handle closes
/// as soon as its last import is released). An opt-in: only for producers that keep
/// exported memory allocated — CUDA calls an exporter's `cuMemFree` before the importer
/// closed the handle undefined behaviour.
#[unsafe(no_mangle)]
pub extern "C" fn tw_cuda_ipc_cache_keep_warm(n: usize) {
    quiet((), || crate::cuda::ipc::cache().set_keep_warm(n))
}

/// True if a CUDA driver is present and initialised.
#[unsafe(no_mangle)]
pub extern "C" fn tw_cuda_available() -> bool {
    quiet(false, crate::cuda::available)
}

/// Number of CUDA devices; `TW_ERR_CUDA_UNAVAILABLE` (with the reason) without a driver.
///
/// # Safety
/// `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_cuda_device_count(out: *mut i32) -> tw_result_e {
    guard("tw_cuda_device_count", || {
        need(out, "out")?;
        let n = crate::cuda::device_count()?;
        // SAFETY: checked non-null.
        unsafe { put(out, n as i32, "out") }
    })
}

/// Send a user message (≤ the max message size) with up to 8 fds (borrowed, not closed).
///
/// # Safety
/// `peer` live; `data` readable for `len` bytes (may be NULL if 0); `fds` readable for
/// `nfds` ints (may be NULL if 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_send_message(
    peer: *const tw_peer_t,
    data: *const u8,
    len: usize,
    fds: *const c_int,
    nfds: usize,
) -> tw_result_e {
    guard("tw_peer_send_message", || {
        // SAFETY: live per the contract; NULL refused.
        let p = unsafe { arg(peer, "peer")? };
        let payload = if len == 0 {
            &[][..]
        } else {
            // SAFETY: non-null (checked) and readable for len bytes per the contract.
            unsafe { std::slice::from_raw_parts(arg(data, "data")?, len) }
        };
        let raw = if nfds == 0 {
            &[][..]
        } else {
            // SAFETY: non-null (checked) and readable for nfds ints per the contract.
            unsafe { std::slice::from_raw_parts(arg(fds, "fds")?, nfds) }
        };
        if raw.iter().any(|&f| f < 0) {
            return Err(Error::InvalidArgument("negative fd in fds".into()).into());
        }
        // SAFETY: the caller keeps these fds open for the duration of the call.
        let borrowed: Vec<BorrowedFd<'_>> = raw.iter().map(|&f| unsafe { BorrowedFd::borrow_raw(f) }).collect();
        Ok(p.inner.send_message(payload, &borrowed)?)
    })
}

/// Receive the next tensor or user message, waiting at most `timeout_ms` (negative: until
/// one arrives or the peer dies). On success exactly one of `*out_tensor` and
/// `*out_message` is set non-NULL and the other to NULL.
///
/// # Safety
/// `peer` live; `out_tensor`, `out_message` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_recv(
    peer: *const tw_peer_t,
    timeout_ms: i64,
    out_tensor: *mut *mut tw_imported_t,
    out_message: *mut *mut tw_message_t,
) -> tw_result_e {
    guard("tw_peer_recv", || {
        // SAFETY: live per the contract; NULL refused.
        let p = unsafe { arg(peer, "peer")? };
        need(out_tensor, "out_tensor")?;
        need(out_message, "out_message")?;
        let t = (timeout_ms >= 0).then(|| Duration::from_millis(timeout_ms as u64));
        let (tensor, message) = match p.inner.recv(t)? {
            Incoming::Tensor(i) => (Box::into_raw(Box::new(tw_imported_t { inner: AnyImport::Cpu(i.into()) })), std::ptr::null_mut()),
            Incoming::CudaTensor(i) => (Box::into_raw(Box::new(tw_imported_t { inner: AnyImport::Cuda(i) })), std::ptr::null_mut()),
            Incoming::Message { payload, fds } => (
                std::ptr::null_mut(),
                Box::into_raw(Box::new(tw_message_t { payload, fds: fds.into_iter().map(Some).collect() })),
            ),
        };
        // SAFETY: both checked non-null and writable per the contract.
        unsafe {
            out_tensor.write(tensor);
            out_message.write(message);
        }
        Ok(())
    })
}

/// Counters of what this side exported to the peer.
///
/// # Safety
/// `peer` live; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_stats(peer: *const tw_peer_t, out: *mut tw_lease_stats_t) -> tw_result_e {
    guard("tw_peer_stats", || {
        // SAFETY: live per the contract; NULL refused.
        let s = unsafe { arg(peer, "peer")? }.inner.export_stats();
        // SAFETY: writable per the contract; NULL refused.
        unsafe { put(out, s.into(), "out") }
    })
}

/// Process releases, expired windows and peer death now (the background reaper does
/// this too); then report as `tw_peer_stats` (`out` may be NULL).
///
/// # Safety
/// `peer` live; `out` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_reap(peer: *const tw_peer_t, out: *mut tw_lease_stats_t) -> tw_result_e {
    guard("tw_peer_reap", || {
        // SAFETY: live per the contract; NULL refused.
        let s = unsafe { arg(peer, "peer")? }.inner.reap_now();
        if !out.is_null() {
            // SAFETY: non-null and writable per the contract.
            unsafe { out.write(s.into()) };
        }
        Ok(())
    })
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
    guard("tw_imported_layout", || {
        // SAFETY: live per the contract; NULL refused.
        let l = unsafe { arg(imp, "imp")? }.inner.desc().layout();
        // SAFETY: writable per the contract; NULL refused.
        unsafe { put(out, tw_layout_t::from_layout(&l), "out") }
    })
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
pub unsafe extern "C" fn tw_imported_lease(imp: *const tw_imported_t, out: *mut tw_lease_t) -> tw_result_e {
    guard("tw_imported_lease", || {
        // SAFETY: live per the contract; NULL refused.
        let l = unsafe { arg(imp, "imp")? }.inner.lease();
        // SAFETY: writable per the contract; NULL refused.
        unsafe { put(out, l, "out") }
    })
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

/// Make `stream` (a CUstream; 0 for the legacy default stream) wait for the producer's
/// last write to a CUDA import — an IPC event wait, never a device-wide synchronize. Call
/// before the first use on that stream. `TW_ERR_INVALID_ARGUMENT` for a CPU import.
///
/// # Safety
/// `imp` live; `stream` a valid stream of the import's device's current context.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_imported_cuda_wait(imp: *const tw_imported_t, stream: usize) -> tw_result_e {
    guard("tw_imported_cuda_wait", || {
        // SAFETY: live per the contract; NULL refused.
        match &unsafe { arg(imp, "imp")? }.inner {
            AnyImport::Cuda(c) => Ok(c.wait_on(stream)?),
            AnyImport::Cpu(_) => Err(Error::InvalidArgument("not a CUDA import".into()).into()),
        }
    })
}

/// Release the lease once the work enqueued so far on `stream` has completed, without
/// blocking (a CUDA import: an event is recorded on the stream and the lease released
/// when it is reached; a CPU import is released now), and free the handle either way.
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
            AnyImport::Cuda(c) => c.release_after(stream)?,
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

/// The message's payload; its length goes to `*len` (if `len` is not NULL).
///
/// # Safety
/// `msg` NULL or live; `len` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_message_data(msg: *const tw_message_t, len: *mut usize) -> *const u8 {
    quiet(std::ptr::null(), || {
        // SAFETY: NULL or live per the contract.
        let Some(m) = (unsafe { msg.as_ref() }) else { return std::ptr::null() };
        if !len.is_null() {
            // SAFETY: non-null and writable per the contract.
            unsafe { len.write(m.payload.len()) };
        }
        m.payload.as_ptr()
    })
}

/// Number of fds that came with the message (0 if `msg` is NULL).
///
/// # Safety
/// NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_message_fd_count(msg: *const tw_message_t) -> usize {
    // SAFETY: NULL or live per the contract.
    quiet(0, || unsafe { msg.as_ref() }.map_or(0, |m| m.fds.len()))
}

/// Take ownership of fd `index` (the caller must close it); -1 if out of range, already
/// taken, or `msg` is NULL. Fds not taken are closed by `tw_message_free`.
///
/// # Safety
/// NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_message_take_fd(msg: *mut tw_message_t, index: usize) -> c_int {
    quiet(-1, || {
        // SAFETY: NULL or live (and not used concurrently) per the contract.
        let Some(m) = (unsafe { msg.as_mut() }) else { return -1 };
        m.fds.get_mut(index).and_then(Option::take).map_or(-1, IntoRawFd::into_raw_fd)
    })
}

/// Free a message (closing fds not taken). NULL is a no-op.
///
/// # Safety
/// NULL or a live handle, not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_message_free(msg: *mut tw_message_t) {
    // SAFETY: forwarded from this function's contract.
    unsafe { super::free_handle(msg) }
}

