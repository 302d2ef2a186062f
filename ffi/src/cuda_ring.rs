//! The GPU bounce ring in C: copy a contiguous CUDA tensor through the connection's
//! device arena (no handle opened per message), and receive it in two steps — learn the
//! shape, allocate, copy out on your stream.

use super::desc::tw_layout_t;
use tensorwire::cuda::{CudaStream, DevicePtr};
use super::peer::tw_peer_t;
use super::{arg, guard, need, put, put_opt, tw_result_e, wait_ms};

/// Copy the contiguous CUDA tensor `layout` at device address `src` through this side's
/// GPU ring (`tw_peer_config_t::cuda_ring_device` ≥ 0), ordered after the work already
/// enqueued on `stream` (a CUstream; 0: the legacy default stream) — the copies are
/// enqueued there, nothing synchronizes. Larger than a slot: in chunks. Waits for free
/// slots as `timeout_ms` says.
///
/// # Safety
/// `peer` live, `layout` readable; `src` device memory of the ring's device holding the
/// layout's packed bytes, valid until the copies on `stream` ran; `stream` a valid
/// stream of that device.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_cuda_ring_send(
    peer: *const tw_peer_t,
    src: u64,
    layout: *const tw_layout_t,
    stream: usize,
    tag: u64,
    timeout_ms: i64,
) -> tw_result_e {
    guard("tw_peer_cuda_ring_send", || {
        // SAFETY: live per the contract; NULL refused.
        let p = unsafe { arg(peer, "peer")? };
        // SAFETY: readable per the contract; NULL refused.
        let l = unsafe { arg(layout, "layout")? }.to_layout()?;
        Ok(p.inner().cuda_ring_send(DevicePtr(src), &l, CudaStream(stream), tag, wait_ms(timeout_ms))?)
    })
}

/// Wait (as `timeout_ms` says) for the next message in the peer's GPU
/// ring and describe it: tag, contiguous layout, device and byte count (outputs may be
/// NULL except `layout`). Then call `tw_peer_cuda_ring_recv_finish` with memory of that
/// size on that device, or `tw_peer_cuda_ring_discard`. Calling this again first
/// describes the same message.
///
/// # Safety
/// `peer` live; outputs NULL or writable (`layout` writable).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_cuda_ring_recv(
    peer: *const tw_peer_t,
    timeout_ms: i64,
    out_tag: *mut u64,
    layout: *mut tw_layout_t,
    out_device: *mut i32,
    out_nbytes: *mut u64,
) -> tw_result_e {
    guard("tw_peer_cuda_ring_recv", || {
        // SAFETY: live per the contract; NULL refused.
        let p = unsafe { arg(peer, "peer")? };
        need(layout, "layout")?;
        let (tag, desc) = p.inner().cuda_ring_recv(wait_ms(timeout_ms))?;
        let l = desc.layout();
        // SAFETY: each output NULL or writable per the contract; `layout` checked non-null.
        unsafe {
            put_opt(out_tag, tag);
            put_opt(out_device, i32::from(desc.device_index));
            put_opt(out_nbytes, desc.storage.nbytes);
            put(layout, tw_layout_t::from_layout(&l), "layout")
        }
    })
}

/// Copy the message `tw_peer_cuda_ring_recv` described into `capacity` bytes of device
/// memory at `dst` on `stream` (ordered after the producer's writes by a stream wait;
/// nothing synchronizes) and free its ring slots. Waits for later chunks at most
/// `timeout_ms`. A failure part-way breaks the ring (the error says why).
///
/// # Safety
/// `peer` live; `dst` device memory of the ring's device, writable for `capacity` bytes,
/// valid until the copies on `stream` ran; `stream` a valid stream of that device.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_cuda_ring_recv_finish(
    peer: *const tw_peer_t,
    dst: u64,
    capacity: u64,
    stream: usize,
    timeout_ms: i64,
) -> tw_result_e {
    guard("tw_peer_cuda_ring_recv_finish", || {
        // SAFETY: live per the contract; NULL refused.
        let p = unsafe { arg(peer, "peer")? };
        Ok(p.inner().cuda_ring_recv_finish(DevicePtr(dst), capacity, CudaStream(stream), wait_ms(timeout_ms))?)
    })
}

/// Drop the message `tw_peer_cuda_ring_recv` described without copying it (no-op if none
/// is pending).
///
/// # Safety
/// `peer` live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_cuda_ring_discard(peer: *const tw_peer_t, timeout_ms: i64) -> tw_result_e {
    guard("tw_peer_cuda_ring_discard", || {
        // SAFETY: live per the contract; NULL refused.
        let p = unsafe { arg(peer, "peer")? };
        Ok(p.inner().cuda_ring_discard(wait_ms(timeout_ms))?)
    })
}
