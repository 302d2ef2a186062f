//! The bounce-buffer ring in C: copy bytes or a tensor view through the connection's
//! ring, receive a copy or an in-place borrow. `tw_ring_message_t` belongs to one thread
//! at a time; freeing a borrowed message releases its ring space.

use super::desc::tw_layout_t;
use super::peer::tw_peer_t;
use super::{arg, guard, need, put, put_opt, quiet, slice_arg, tw_result_e};
use tensorwire::desc::TensorDesc;

use super::wait_ms;
use tensorwire::ring::{RingItem, RingMessage};
use std::ffi::c_void;

/// Opaque received ring message.
pub struct tw_ring_message_t {
    inner: RingMessage,
}

/// Copy `len` bytes through the ring (waiting for space as `timeout_ms` says). Messages larger than half the ring go through in chunks.
///
/// # Safety
/// `peer` live; `data` readable for `len` bytes (may be NULL if 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_ring_send_bytes(
    peer: *const tw_peer_t,
    tag: u64,
    data: *const u8,
    len: usize,
    timeout_ms: i64,
) -> tw_result_e {
    guard("tw_peer_ring_send_bytes", || {
        // SAFETY: live per the contract; NULL refused.
        let p = unsafe { arg(peer, "peer")? };
        // SAFETY: readable for len bytes per the contract (NULL allowed if 0).
        let bytes = unsafe { slice_arg(data, len, "data")? };
        Ok(p.inner().ring_send(&[RingItem::bytes(tag, bytes)], wait_ms(timeout_ms))?)
    })
}

/// Copy the view `layout` of the `storage_len` bytes at `storage` through the ring,
/// packed contiguous; the receiver gets a descriptor of the packed tensor with it.
///
/// # Safety
/// `peer`, `layout` live/readable; `storage` readable for `storage_len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_ring_send_view(
    peer: *const tw_peer_t,
    tag: u64,
    storage: *const c_void,
    storage_len: usize,
    layout: *const tw_layout_t,
    timeout_ms: i64,
) -> tw_result_e {
    guard("tw_peer_ring_send_view", || {
        // SAFETY: live per the contract; NULL refused.
        let p = unsafe { arg(peer, "peer")? };
        // SAFETY: readable per the contract; NULL refused.
        let l = unsafe { arg(layout, "layout")? }.to_layout()?;
        // SAFETY: readable for storage_len bytes per the contract (NULL allowed if 0).
        let bytes = unsafe { slice_arg(storage.cast::<u8>(), storage_len, "storage")? };
        let item = RingItem::tensor(tag, l, bytes)?;
        Ok(p.inner().ring_send(&[item], wait_ms(timeout_ms))?)
    })
}

/// Receive the next ring message (waiting as `timeout_ms` says). With
/// `borrow`, a message that fits one ring record stays in the ring (no copy) until the
/// message is freed; otherwise, and for chunked messages, it is a private copy.
///
/// # Safety
/// `peer` live; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_ring_recv(
    peer: *const tw_peer_t,
    timeout_ms: i64,
    borrow: bool,
    out: *mut *mut tw_ring_message_t,
) -> tw_result_e {
    guard("tw_peer_ring_recv", || {
        // SAFETY: live per the contract; NULL refused.
        let p = unsafe { arg(peer, "peer")? };
        need(out, "out")?;
        let m = p.inner().ring_recv_with(borrow, wait_ms(timeout_ms))?;
        // SAFETY: checked non-null.
        unsafe { put(out, Box::into_raw(Box::new(tw_ring_message_t { inner: m })), "out") }
    })
}

/// The message's tag (0 if `msg` is NULL).
///
/// # Safety
/// NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_ring_message_tag(msg: *const tw_ring_message_t) -> u64 {
    // SAFETY: NULL or live per the contract.
    quiet(0, || unsafe { msg.as_ref() }.map_or(0, |m| m.inner.tag))
}

/// The message's bytes (the packed tensor for a tensor); their length goes to `*len`.
/// A borrowed message's bytes are in the ring, written by the peer: copy before trusting.
///
/// # Safety
/// `msg` NULL or live; `len` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_ring_message_data(msg: *const tw_ring_message_t, len: *mut usize) -> *const c_void {
    quiet(std::ptr::null(), || {
        // SAFETY: NULL or live per the contract.
        let Some(m) = (unsafe { msg.as_ref() }) else { return std::ptr::null() };
        // SAFETY: NULL or writable per the contract.
        unsafe { put_opt(len, m.inner.len()) };
        m.inner.as_ptr().cast()
    })
}

/// The descriptor of a tensor message (contiguous layout, storage kind RingSlot), or NULL
/// for a bytes message or a NULL `msg`. Valid while `msg`.
///
/// # Safety
/// NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_ring_message_desc(msg: *const tw_ring_message_t) -> *const TensorDesc {
    quiet(std::ptr::null(), || {
        // SAFETY: NULL or live per the contract.
        unsafe { msg.as_ref() }.and_then(|m| m.inner.desc.as_ref()).map_or(std::ptr::null(), |d| d as *const _)
    })
}

/// True if the bytes are still in the ring (released by `tw_ring_message_free`).
///
/// # Safety
/// NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_ring_message_is_borrowed(msg: *const tw_ring_message_t) -> bool {
    // SAFETY: NULL or live per the contract.
    quiet(false, || unsafe { msg.as_ref() }.is_some_and(|m| m.inner.is_borrowed()))
}

/// Free a message (releasing its ring space if borrowed). NULL is a no-op.
///
/// # Safety
/// NULL or a live handle, not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_ring_message_free(msg: *mut tw_ring_message_t) {
    // SAFETY: forwarded from this function's contract.
    unsafe { super::free_handle(msg) }
}

