//! The CPU ring (a bounce buffer registered once per connection): `ring_send` packs any
//! strided view of a storage into it (in chunks when larger than half the ring, as
//! `src/peer/ring.rs` does), `ring_recv` returns the next tensor's bytes as a private copy
//! the capsule owns (no further copy), what the ops `ring_send` / `ring_recv` need.

use crate::config::wait_ms;
use crate::peer::PyPeer;
use crate::dlpack;
use crate::errors::{IntoPy, nonneg, raise};
use crate::view::view_layout;
use pyo3::prelude::*;
use std::sync::PoisonError;
use tensorwire::RingItem;

/// Pack the view (`dtype` by torch name, `sizes`, `strides`, `storage_offset` in elements)
/// of the CPU storage at `storage_ptr` (`storage_nbytes` long) into the peer's ring, waiting
/// at most `timeout_ms` for space (< 0: no limit). A negative `tag` is refused as the torch
/// op `ring_send` refuses it.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (conn, storage_ptr, storage_nbytes, dtype, sizes, strides, storage_offset, tag=0, timeout_ms=-1))]
pub fn ring_send(
    py: Python<'_>,
    conn: PyRef<'_, PyPeer>,
    storage_ptr: usize,
    storage_nbytes: usize,
    dtype: &str,
    sizes: Vec<i64>,
    strides: Vec<i64>,
    storage_offset: i64,
    tag: i64,
    timeout_ms: i64,
) -> PyResult<()> {
    let tag = nonneg(py, "ring_send", "tag", tag)?;
    let layout = view_layout(py, "ring_send", "tw_peer_ring_send_view", dtype, &sizes, &strides, storage_offset)?;
    let peer = &conn.peer;
    // The item holds a raw pointer (not `Send`): it is made on the thread that sends it.
    py.detach(|| {
        let bytes: &[u8] = if storage_nbytes == 0 {
            &[]
        } else {
            // SAFETY: the package passes the address and size of a live CPU torch storage
            // (`untyped_storage().data_ptr()` / `.nbytes()`) whose tensor its caller's
            // frame holds for the whole call, so the bytes stay mapped and readable; the
            // ring only reads them (a concurrent writer can tear the copy, as with any
            // memcpy).
            unsafe { std::slice::from_raw_parts(storage_ptr as *const u8, storage_nbytes) }
        };
        let item = RingItem::tensor(tag, layout, bytes)?;
        peer.ring_send(&[item], wait_ms(timeout_ms))
    })
    .py_err_in(py, "tw_peer_ring_send_view")
}

/// The next ring tensor: `(capsule of its packed bytes, or None when empty, dtype name,
/// sizes, strides, tag)`; the bytes are this process's private copy, owned by the capsule.
#[pyfunction]
#[pyo3(signature = (conn, timeout_ms=-1))]
#[allow(clippy::type_complexity)]
pub fn ring_recv(
    py: Python<'_>,
    conn: PyRef<'_, PyPeer>,
    timeout_ms: i64,
) -> PyResult<(Option<Py<PyAny>>, &'static str, Vec<i64>, Vec<i64>, u64)> {
    let c = &*conn;
    let msg = py
        .detach(|| {
            let _one = c.ring_recv_mu.lock().unwrap_or_else(PoisonError::into_inner);
            // Not borrowed: a private copy (the peer cannot scribble it), so torch can own
            // it without another copy.
            c.peer.ring_recv_with(false, wait_ms(timeout_ms))
        })
        .py_err_in(py, "tw_peer_ring_recv")?;
    let Some(desc) = msg.desc else {
        return Err(raise(
            py,
            "Error",
            None,
            format!("tensorwire.ring_recv: expected a tensor, the peer sent {} bytes through the ring (dropped)", msg.len()),
        ));
    };
    let layout = desc.layout();
    let need = layout.extent_bytes().py_err_in(py, "tw_layout_extent_bytes")?;
    let len = msg.len();
    if need > len as u64 || layout.storage_offset != 0 {
        return Err(raise(
            py,
            "Error",
            None,
            format!(
                "tensorwire.ring_recv: the descriptor needs {need} bytes at offset {}, the message has {len}",
                layout.storage_offset
            ),
        ));
    }
    let (sizes, strides) = (layout.sizes().to_vec(), layout.strides().to_vec());
    let (name, tag) = (layout.dtype.name(), msg.tag);
    if len == 0 {
        return Ok((None, name, sizes, strides, tag));
    }
    let ptr = msg.as_ptr().cast_mut();
    let cap = dlpack::capsule(py, ptr, len, (dlpack::DL_CPU, 0), Box::new(msg))?;
    Ok((Some(cap), name, sizes, strides, tag))
}
