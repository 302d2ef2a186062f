//! Listening sockets in C: `tw_listener_t` (bind, accept, free).

use super::config::{config, tw_peer_config_t};
use super::peer::{boxed_peer, path_arg, tw_peer_t};
use super::{arg, guard, need, put, tw_result_e, wait_ms};
use tensorwire::Listener;
use tensorwire::peer::Peer;
use std::ffi::c_char;

/// Opaque listening socket.
pub struct tw_listener_t {
    inner: Listener,
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

/// Accept one connection, waiting for it as `timeout_ms` says, and set it up (each step
/// waiting at most the config's handshake timeout).
///
/// # Safety
/// `listener` live; `cfg` NULL, or readable for the `size` bytes its first field says (`tw_peer_config_t::size`); `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_listener_accept(
    listener: *const tw_listener_t,
    timeout_ms: i64,
    cfg: *const tw_peer_config_t,
    out: *mut *mut tw_peer_t,
) -> tw_result_e {
    guard("tw_listener_accept", || {
        // SAFETY: live per the contract; NULL refused.
        let l = unsafe { arg(listener, "listener")? };
        need(out, "out")?;
        // SAFETY: per the contract.
        let p = Peer::accept(&l.inner, wait_ms(timeout_ms), unsafe { config(cfg) }?)?;
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
