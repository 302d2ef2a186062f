//! Received user messages in C: `tw_message_t` (payload and fds).

use super::{put_opt, quiet};
use std::ffi::c_int;
use std::os::fd::{IntoRawFd, OwnedFd};


/// Opaque received user message (payload + fds).
pub struct tw_message_t {
    pub(super) payload: Vec<u8>,
    pub(super) fds: Vec<Option<OwnedFd>>,
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
        // SAFETY: NULL or writable per the contract.
        unsafe { put_opt(len, m.payload.len()) };
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
