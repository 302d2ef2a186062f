//! Connections, exports, imports and messages in C.
//!
//! Thread-safety: a `tw_peer_t` may be used from several threads at once for export,
//! send, stats and reap; `tw_peer_recv` must be called by one thread at a time. A
//! `tw_listener_t` may be shared. `tw_imported_t` and `tw_message_t` belong to one thread
//! at a time (move them between threads freely). Release callbacks run on whichever
//! thread ends the lease (often tensorwire's reaper thread) and must not throw.

use super::config::{config, tw_peer_config_t};
use super::imported::{tw_imported_t, AnyImport};
use super::message::tw_message_t;
use super::{arg, get, guard, need, put, put_opt, quiet, slice_arg, tw_result_e, Fail};
use tensorwire::error::Error;
use tensorwire::lease::LeaseStats;
use tensorwire::peer::{Incoming, Peer};
use std::ffi::{c_char, c_int, CStr};
use std::os::fd::{BorrowedFd, FromRawFd, IntoRawFd, OwnedFd};

// The C ABI's lease types are the library's own (`#[repr(C)]`; cbindgen.toml renames them
// in the header); Rust callers of this module may use the C names too.
pub use tensorwire::lease::{LeaseId as tw_lease_t, LeaseStats as tw_lease_stats_t};

/// Opaque connection handle.
pub struct tw_peer_t {
    pub(super) inner: Peer,
}

impl tw_peer_t {
    pub(crate) fn inner(&self) -> &Peer {
        &self.inner
    }
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
        let (a, b) = tensorwire::os::seqpacket_pair()?;
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
        Ok(tensorwire::os::set_cloexec(b, !inheritable)?)
    })
}

pub(super) fn boxed_peer(p: Peer) -> *mut tw_peer_t {
    Box::into_raw(Box::new(tw_peer_t { inner: p }))
}

/// Handshake over a connected SEQPACKET socket (an end of `tw_socketpair`, inherited or
/// not) and set up leases. Takes ownership of `fd`. `cfg` may be NULL (defaults).
///
/// # Safety
/// `fd` open and owned by the caller; `cfg` NULL, or readable for the `size` bytes its first field says (`tw_peer_config_t::size`); `out` writable.
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
        let p = Peer::from_fd(owned, unsafe { config(cfg) }?)?;
        // SAFETY: checked non-null.
        unsafe { put(out, boxed_peer(p), "out") }
    })
}

pub(super) fn path_arg<'a>(path: *const c_char) -> Result<&'a str, Fail> {
    // SAFETY: callers' contracts: NULL or a NUL-terminated string (NULL refused).
    let c = unsafe { CStr::from_ptr(arg(path, "path")?) };
    Ok(c.to_str().map_err(|_| Error::InvalidArgument("path is not UTF-8".into()))?)
}

/// Connect to a listener at `path`.
///
/// # Safety
/// `path` a C string; `cfg` NULL, or readable for the `size` bytes its first field says (`tw_peer_config_t::size`); `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_connect(path: *const c_char, cfg: *const tw_peer_config_t, out: *mut *mut tw_peer_t) -> tw_result_e {
    guard("tw_peer_connect", || {
        need(out, "out")?;
        // SAFETY: per the contract.
        let p = Peer::connect(path_arg(path)?, unsafe { config(cfg) }?)?;
        // SAFETY: checked non-null.
        unsafe { put(out, boxed_peer(p), "out") }
    })
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
        // SAFETY: readable for len bytes per the contract (NULL allowed if 0).
        let payload = unsafe { slice_arg(data, len, "data")? };
        // SAFETY: readable for nfds ints per the contract (NULL allowed if 0).
        let raw = unsafe { slice_arg(fds, nfds, "fds")? };
        if raw.iter().any(|&f| f < 0) {
            return Err(Error::InvalidArgument("negative fd in fds".into()).into());
        }
        // SAFETY: the caller keeps these fds open for the duration of the call.
        let borrowed: Vec<BorrowedFd<'_>> = raw.iter().map(|&f| unsafe { BorrowedFd::borrow_raw(f) }).collect();
        Ok(p.inner.send_message(payload, &borrowed)?)
    })
}

/// Receive the next tensor or user message, waiting as `timeout_ms` says (negative: until
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
        let (tensor, message) = match p.inner.recv(super::wait_ms(timeout_ms))? {
            Incoming::Tensor(i) => (Box::into_raw(Box::new(tw_imported_t { inner: AnyImport::Cpu(i.into()) })), std::ptr::null_mut()),
            Incoming::CudaTensor(i) => (Box::into_raw(Box::new(tw_imported_t { inner: AnyImport::Cuda(i.into()) })), std::ptr::null_mut()),
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
pub unsafe extern "C" fn tw_peer_stats(peer: *const tw_peer_t, out: *mut LeaseStats) -> tw_result_e {
    // SAFETY: forwarded from this function's contract.
    unsafe { get("tw_peer_stats", (peer, "peer"), out, |p| Ok(p.inner.export_stats())) }
}

/// Process releases, expired windows and peer death now (the background reaper does
/// this too); then report as `tw_peer_stats` (`out` may be NULL).
///
/// # Safety
/// `peer` live; `out` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_reap(peer: *const tw_peer_t, out: *mut LeaseStats) -> tw_result_e {
    guard("tw_peer_reap", || {
        // SAFETY: live per the contract; NULL refused.
        let s = unsafe { arg(peer, "peer")? }.inner.reap_now();
        // SAFETY: NULL or writable per the contract.
        unsafe { put_opt(out, s) };
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// The lease types are the C ABI itself now: a Rust-side edit (a field moved, added
    /// or retyped) must not change what C programs built against the header read.
    #[test]
    fn lease_types_keep_their_c_layout() {
        assert_eq!((size_of::<tw_lease_t>(), offset_of!(tw_lease_t, slot), offset_of!(tw_lease_t, generation)), (8, 0, 4));
        let offsets = [
            offset_of!(tw_lease_stats_t, live_leases),
            offset_of!(tw_lease_stats_t, live_bytes),
            offset_of!(tw_lease_stats_t, granted),
            offset_of!(tw_lease_stats_t, released),
            offset_of!(tw_lease_stats_t, expired),
            offset_of!(tw_lease_stats_t, reclaimed),
        ];
        assert_eq!((size_of::<tw_lease_stats_t>(), offsets), (48, [0, 8, 16, 24, 32, 40]));
    }
}
