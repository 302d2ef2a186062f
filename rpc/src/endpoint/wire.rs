//! What goes on the socket: frame writes, message encoding, and tensors inside values
//! (native, attached to or inline in the frame where negotiated, file-backed, or copied
//! into the JSON on TCP).

use super::Inner;
use crate::error::{Result, RpcError};
use crate::frame;
use crate::value::Value;
use crate::message::Message;
use crate::tensor::{Attachments, FsTensor, OwnedTensor, Tensor};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The write side of the connection and what sending tensors keeps.
pub(super) struct Writer {
    /// Serializes frame writes.
    lock: Mutex<()>,
    /// The next tag of a native tensor we send.
    next_tag: AtomicU64,
    /// File-system tensors sent, kept for `RpcConfig::fs_keep` so the peer can open them.
    keeper: Mutex<VecDeque<(Instant, Arc<FsTensor>)>>,
}

impl Writer {
    pub(super) fn new() -> Writer {
        Writer { lock: Mutex::new(()), next_tag: AtomicU64::new(1), keeper: Mutex::new(VecDeque::new()) }
    }

    /// At the connection's end: let go of the file-system tensors kept for the peer.
    pub(super) fn shut(&self) {
        self.keeper.lock().clear();
    }
}

impl Inner {
    pub(super) fn write_frame(&self, payload: &[u8]) -> Result<()> {
        if payload.len() > self.cfg.max_frame {
            return Err(RpcError::InvalidArgument(format!(
                "message of {} bytes is over the {}-byte frame cap",
                payload.len(),
                self.cfg.max_frame
            )));
        }
        // A small frame goes in one write; a large one as header + payload (no copy).
        let (head, body) =
            if payload.len() <= 64 * 1024 { (frame::encode_frame(payload)?, &[][..]) } else { (frame::header(payload.len())?.to_vec(), payload) };
        let framed_len = head.len() + body.len();
        let w = self.wire.lock.lock();
        // One bound for the whole frame (see `Stream::write_all_by`); one of more than a
        // century is as good as none.
        let started = Instant::now();
        let by = started + self.cfg.send_timeout.min(Duration::from_secs(u32::MAX.into()));
        if let Err(e) = self.sock.write_all_by(&head, by).and_then(|_| self.sock.write_all_by(body, by)) {
            let waited = started.elapsed();
            drop(w);
            let err = if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
                RpcError::Protocol(format!(
                    "the peer is not reading: a {framed_len}-byte write was still blocked after {waited:.1?} (RpcConfig::send_timeout is {:?})",
                    self.cfg.send_timeout
                ))
            } else {
                RpcError::io("writing to the peer", e)
            };
            self.shutdown_now(err.clone());
            return Err(err);
        }
        drop(w);
        self.note_send_cpu();
        Ok(())
    }

    /// Write an already framed message with `fd` attached (Unix sockets only), between
    /// other frame writes.
    pub(super) fn write_frame_with_fd(&self, framed: &[u8], fd: BorrowedFd<'_>) -> Result<()> {
        let _w = self.wire.lock.lock();
        self.sock.write_with_fd(framed, fd)
    }

    pub(super) fn encode(&self, msg: &Message) -> Result<Vec<u8>> {
        // The envelope and the values' text: one allocation, no copies while it grows.
        let mut out = Vec::with_capacity(128 + msg.text_len());
        // Inline tensors take at most half a frame of each message (their base64 is 4/3 of
        // their bytes); past that they go as exports, so many small tensors in one value
        // do not push it over the frame cap.
        let mut inline_budget = self.cfg.max_frame / 2;
        let mut attached = Vec::new();
        msg.encode(&mut out, &mut |t| self.encode_tensor(t, &mut inline_budget, &mut attached))?;
        if !attached.is_empty() {
            crate::tensor::append_attachments(&mut out, &attached)?;
        }
        Ok(out)
    }

    /// Replace tensor references in a received value by tensors; a native tensor not yet
    /// arrived is waited for until `claim_by` (see `claim_deadline`); an attached one is
    /// taken from `att`, its frame's attachments.
    pub(super) fn decode_tensors(self: &Arc<Self>, v: Value, claim_by: Instant, att: &mut Attachments) -> Result<Value> {
        match v {
            // In place: rebuilding every list and dict of a large value cost as much as
            // parsing it.
            Value::Array(mut a) => {
                for x in &mut a {
                    *x = self.decode_tensors(std::mem::take(x), claim_by, att)?;
                }
                Ok(Value::Array(a))
            }
            Value::Object(m) => match m.get("__type__").and_then(Value::as_str) {
                Some("TensorRef") if !self.cfg.accept_fs_tensors => Err(RpcError::Decode(format!(
                    "a file-system tensor (pyisolate TensorRef naming {:?}) arrived, and this endpoint does not open files a \
                     peer names: RpcConfig::accept_fs_tensors (Python: fs_tensors=True) turns that on, for a trusted pyisolate \
                     peer only (tensorwire peers send native tensors)",
                    crate::fs_tensor::clip(m.get("storage_key").and_then(Value::as_str).unwrap_or("?"), 80)
                ))),
                Some("TensorRef") if m.get("device").and_then(Value::as_str) == Some("cpu") => {
                    let f = FsTensor::from_tensor_ref(&m)?.with_max_copy(self.cfg.max_tensor_copy);
                    Ok(Value::from(Tensor::File(Arc::new(f))))
                }
                Some("TensorwireTensor") => self.claim_native(&m, claim_by),
                Some(crate::tensor::ATTACHED_TENSOR_TYPE) => {
                    Ok(Value::from(att.take(&m, self.native.attach_accept_limit(), self.cfg.max_tensor_copy)?))
                }
                Some(crate::tensor::INLINE_TENSOR_TYPE) => match self.native.inline_accept_limit() {
                    0 => Err(RpcError::Decode(
                        "an inline tensor (TensorwireInline) arrived on a connection that never negotiated inline tensors".into(),
                    )),
                    limit => Ok(Value::from(crate::tensor::from_inline(&m, limit, self.cfg.max_tensor_copy)?)),
                },
                Some("TensorValue") => Ok(Value::from(crate::tensor::from_tensor_value(&m)?)),
                #[cfg(feature = "ucx")]
                Some(crate::ucx_tensor::REMOTE_TENSOR_TYPE) => self.claim_remote(&m),
                #[cfg(not(feature = "ucx"))]
                Some("TensorwireRemote") => Err(RpcError::Protocol(
                    "a remote tensor (TensorwireRemote) arrived, but this build has no remote tensors (tensorwire-rpc's ucx feature) and never offered them".into(),
                )),
                _ => {
                    let mut m = m;
                    for x in m.values_mut() {
                        *x = self.decode_tensors(std::mem::take(x), claim_by, att)?;
                    }
                    Ok(Value::Object(m))
                }
            },
            other => Ok(other),
        }
    }

    /// Without remote tensors a message has no remote-tensor budget to check.
    #[cfg(not(feature = "ucx"))]
    pub(super) fn check_remote_budget(self: &Arc<Self>, _values: &[&Value]) -> Result<()> {
        Ok(())
    }

    /// How a tensor goes on the wire. An attached one's bytes are added to `attached`, in
    /// the order of their indices.
    fn encode_tensor(&self, t: &Tensor, inline_budget: &mut usize, attached: &mut Vec<Arc<OwnedTensor>>) -> Result<Value> {
        let native = self.native_for_send();
        if let Some(device) = t.cuda_device() {
            let Some(n) = native else {
                return Err(RpcError::CudaNotNative(format!(
                    "a {:?} tensor on cuda:{device} travels only as a native tensor; this connection has none (call negotiate_native on a Unix socket first)",
                    t.layout()
                )));
            };
            let Tensor::Cuda(c) = t else {
                return Err(RpcError::InvalidArgument(
                    "a CUDA tensor imported from a peer cannot be sent on: its memory is that peer's allocation opened here; copy it into an allocation of your own and send a Tensor::Cuda".into(),
                ));
            };
            let tag = self.wire.next_tag.fetch_add(1, Ordering::Relaxed);
            c.export(&n.peer, tag)?;
            return Ok(crate::tensor::native_ref(tag, &c.layout(), Some(device)));
        }
        if let Some(n) = native {
            // An owned tensor (private memory: an ordinary small tensor, or one that
            // arrived inline) within the negotiated limit goes inside the frame: no
            // segment, lease or transport message. One that arrived inline and is sent
            // back goes inline again.
            if let Tensor::Owned(o) = t {
                let len = o.bytes().len();
                // Attached where negotiated (a limit of 0 is none: an empty tensor is no
                // exception): the bytes as they are after the JSON, no base64 either way,
                // and the receiver reads none of them as text.
                let attach = self.native.attach_limit();
                if attach > 0 && len <= attach && len <= *inline_budget && attached.len() < crate::tensor::MAX_ATTACHMENTS {
                    *inline_budget -= len;
                    attached.push(Arc::clone(o));
                    return Ok(crate::tensor::attached_value(o, attached.len() - 1));
                }
                let text = len.div_ceil(3) * 4;
                let inline = self.native.inline_limit();
                if inline > 0 && len <= inline && text <= *inline_budget {
                    *inline_budget -= text;
                    return Ok(crate::tensor::inline_value(o));
                }
            }
            // A tensor the peer (or another peer) exported to us goes on as the same
            // memory: the transport forwards the producer's memfd under a lease that
            // holds the import, never a copy.
            let forward = match t {
                Tensor::Imported(imp) => Some((imp, imp.layout())),
                Tensor::ImportedView(imp, l) => Some((imp, *l)),
                _ => None,
            };
            if let Some((imp, layout)) = forward {
                let tag = self.wire.next_tag.fetch_add(1, Ordering::Relaxed);
                let shared: Arc<tensorwire::Imported> = Arc::clone(imp.inner());
                n.peer.export_imported(shared, Some(layout), tensorwire::ExportOptions { tag, window: None })?;
                return Ok(crate::tensor::native_ref(tag, &layout, None));
            }
            // Anything else is copied into a segment of the process's pool, not a fresh
            // one per send: an owned tensor a peer took neither attached nor inline (an
            // older tensorwire, or one past its limits) is sent again and again.
            let shared = match t {
                Tensor::Shared(s) => s.clone(),
                Tensor::Owned(o) => crate::tensor::pool::storage_copy(o.bytes(), o.layout())?,
                other => {
                    let (storage, layout) = other.storage_copy()?;
                    crate::tensor::pool::storage_copy(&storage, layout)?
                }
            };
            let tag = self.wire.next_tag.fetch_add(1, Ordering::Relaxed);
            n.peer.export(&shared, tensorwire::ExportOptions { tag, window: None })?;
            return Ok(crate::tensor::native_ref(tag, shared.layout(), None));
        }
        if !self.is_unix {
            // TCP: the peer may be on another machine. A peer that agreed to remote
            // tensors reads the storage itself; any other gets the data in the JSON.
            #[cfg(feature = "ucx")]
            if let Some(r) = self.remote_state() {
                return self.export_remote(&r, t);
            }
            return crate::tensor::to_tensor_value(t);
        }
        let fs = t.to_fs()?;
        let v = fs.to_tensor_ref(self.cfg.fs_strategy);
        let now = Instant::now();
        let mut k = self.wire.keeper.lock();
        while k.front().is_some_and(|(t, _)| now.duration_since(*t) > self.cfg.fs_keep) {
            k.pop_front();
        }
        k.push_back((now, fs));
        Ok(v)
    }
}
