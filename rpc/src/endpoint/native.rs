//! Native tensors on a connection: the `native_hello` negotiation (one per connection)
//! that turns a SEQPACKET socketpair passed over the Unix socket into a
//! [`tensorwire::Peer`], the receiver thread that collects the peer's exports, and the
//! claim of an export named by a received `TensorwireTensor` (CPU: a leased memfd view;
//! CUDA: the peer's allocation opened through the transport's handle cache, held until
//! the value naming it is dropped).
//!
//! One negotiation per connection: each one costs a transport peer (threads, a ring,
//! several fds), so a second `native_hello` — from a peer that repeats it, or racing our
//! own [`Endpoint::negotiate_native`] — is refused with an error response and its fd
//! closed, never set up beside the first.

use super::{CONTROL_OBJECT_ID, Endpoint, Inner};
use crate::error::{Result, RpcError};
use crate::frame;
use crate::value::{Map, Value};
use crate::message::Message;
use crate::tensor::{CudaImportedTensor, ImportedTensor, Tensor};
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tensorwire::Wait;

pub(super) struct NativeState {
    pub(super) peer: Arc<tensorwire::Peer>,
    /// Imported tensors by tag, waiting for the JSON that names them.
    arrived: Mutex<HashMap<u64, Arrival>>,
    cv: Condvar,
}

impl NativeState {
    pub(super) fn wake(&self) {
        self.cv.notify_all();
    }
}

/// An export of the peer's, received before (or while) the JSON naming it is decoded.
enum Arrival {
    Cpu(tensorwire::Imported),
    Cuda(tensorwire::CudaImported),
}

impl Arrival {
    fn layout(&self) -> tensorwire::Layout {
        match self {
            Arrival::Cpu(t) => t.layout(),
            Arrival::Cuda(t) => t.layout(),
        }
    }
    fn what(&self) -> String {
        match self {
            Arrival::Cpu(_) => "a CPU tensor".into(),
            Arrival::Cuda(t) => format!("a CUDA tensor of device {}", t.device()),
        }
    }
}

const REFUSED_REPEAT: &str =
    "native_hello refused: native tensors were already negotiated on this connection (one native_hello per connection)";

impl Endpoint {
    /// Set up native tensors with the peer: a fresh SEQPACKET socketpair, one end passed
    /// over this Unix socket, becomes a tensorwire [`tensorwire::Peer`]; from then on
    /// tensors we send travel as leased memfd segments (zero-copy). `Ok(false)` if the
    /// peer does not support it (e.g. a pyisolate peer) — tensors then go as file_system
    /// `TensorRef`s. Waits for the peer's answer as `wait` says (a `Duration`, an
    /// `Instant`, `Wait::Forever`, `Wait::Never`). Once per connection: if a negotiation
    /// (ours or the peer's) already started, this waits for it (as long) and reports how it
    /// went.
    pub fn negotiate_native(&self, wait: impl Into<Wait>) -> Result<bool> {
        let inner = self.inner();
        let wait = wait.into();
        if !inner.is_unix {
            return Ok(false);
        }
        if inner.native.lock().is_some() {
            return Ok(true);
        }
        // AcqRel: the flag is the only state; the swap makes exactly one negotiation win.
        if inner.native_claimed.swap(true, Ordering::AcqRel) {
            return Ok(inner.wait_native(super::calls::deadline_of(wait).0).is_some());
        }
        let r = inner.negotiate_as_initiator(wait);
        if !matches!(r, Ok(true)) {
            // Ours failed or was refused: a later attempt (either side's) may try again.
            inner.native_claimed.store(false, Ordering::Release);
        }
        r
    }

    /// Whether tensors travel natively on this connection.
    pub fn native_enabled(&self) -> bool {
        self.inner().native.lock().is_some()
    }
}

impl Inner {
    fn negotiate_as_initiator(self: &Arc<Self>, wait: Wait) -> Result<bool> {
        let (mine, theirs) = tensorwire::sys::seqpacket_pair()?;
        let call = self.register_call("native tensor negotiation".into(), wait);
        let msg = Message::Call {
            object_id: CONTROL_OBJECT_ID.into(),
            call_id: call.id,
            parent_call_id: None,
            method: "native_hello".into(),
            args: vec![Value::Int(1)],
            kwargs: Map::new(),
        };
        let sent = (|| {
            let mut payload = Vec::new();
            msg.encode(&mut payload, &mut |_| Err(RpcError::InvalidArgument("no tensors in hello".into())))?;
            let framed = frame::encode_frame(&payload)?;
            let _w = self.writer.lock();
            self.sock.write_with_fd(&framed, std::os::fd::AsFd::as_fd(&theirs))
        })();
        drop(theirs);
        if let Err(e) = sent {
            self.pending.lock().remove(&call.id);
            return Err(e);
        }
        match call.wait() {
            Ok(Value::Bool(true)) => {}
            Ok(_) | Err(RpcError::Remote(_)) => return Ok(false),
            Err(e) => return Err(e),
        }
        let peer = tensorwire::Peer::from_fd(mine, self.cfg.peer_config.clone())?;
        self.install_native(peer)?;
        Ok(true)
    }

    /// Requests to our reserved control object.
    pub(super) fn control(self: &Arc<Self>, method: &str) -> Result<Value> {
        match method {
            "native_hello" => {
                // The socket the hello carried (if any) is ours to close unless used.
                let fd = self.take_fd();
                if !self.cfg.native_tensors || !self.is_unix {
                    return Err(RpcError::Remote("native tensors are disabled on this endpoint".into()));
                }
                let fd = fd.ok_or_else(|| RpcError::Remote("native_hello arrived without a socket fd".into()))?;
                // AcqRel: as in `negotiate_native`; the first hello (or our own
                // negotiation) wins, every later one is refused.
                if self.native_claimed.swap(true, Ordering::AcqRel) {
                    return Err(RpcError::Remote(REFUSED_REPEAT.into()));
                }
                // The peer sets up its side after our answer; do ours in the background
                // (bounded by the transport's handshake timeout).
                let me = Arc::downgrade(self);
                let cfg = self.cfg.peer_config.clone();
                std::thread::Builder::new()
                    .name("tensorwire-rpc-native-setup".into())
                    .spawn(move || {
                        if let Ok(peer) = tensorwire::Peer::from_fd(fd, cfg) {
                            if let Some(i) = me.upgrade() {
                                let _ = i.install_native(peer);
                            }
                        }
                    })
                    .map_err(|e| RpcError::io("spawning native setup", e))?;
                Ok(Value::Bool(true))
            }
            m => Err(RpcError::NotFound(format!("'{CONTROL_OBJECT_ID}' has no method '{m}'"))),
        }
    }

    /// Make `peer` this connection's native channel and start collecting its exports.
    pub(super) fn install_native(self: &Arc<Self>, peer: tensorwire::Peer) -> Result<()> {
        let st = Arc::new(NativeState { peer: Arc::new(peer), arrived: Mutex::new(HashMap::new()), cv: Condvar::new() });
        let st2 = st.clone();
        let me = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("tensorwire-rpc-native-recv".into())
            .spawn(move || {
                loop {
                    if me.upgrade().is_none_or(|i| i.is_closed()) {
                        return;
                    }
                    match st2.peer.recv(Some(Duration::from_millis(200))) {
                        // A tag the peer repeats replaces (and so releases) the earlier
                        // unclaimed import: the map never holds more than one per tag.
                        Ok(tensorwire::Incoming::Tensor(t)) => {
                            st2.arrived.lock().insert(t.tag(), Arrival::Cpu(t));
                            st2.cv.notify_all();
                        }
                        Ok(tensorwire::Incoming::CudaTensor(t)) => {
                            st2.arrived.lock().insert(t.tag(), Arrival::Cuda(t));
                            st2.cv.notify_all();
                        }
                        Ok(tensorwire::Incoming::Message { .. }) => {}
                        Err(tensorwire::Error::Timeout { .. }) => {}
                        Err(_) => return,
                    }
                }
            })
            .map_err(|e| RpcError::io("spawning the native receiver", e))?;
        *self.native.lock() = Some(st);
        self.native_ready.notify_all();
        Ok(())
    }

    /// The native state once negotiated, waiting until `deadline` (`None`: no limit) or
    /// the end for a negotiation in progress.
    fn wait_native(&self, deadline: Option<Instant>) -> Option<Arc<NativeState>> {
        let mut g = self.native.lock();
        while g.is_none() && !self.is_closed() {
            match deadline {
                Some(d) => {
                    if self.native_ready.wait_until(&mut g, d).timed_out() {
                        break;
                    }
                }
                None => self.native_ready.wait(&mut g),
            }
        }
        g.clone()
    }

    /// The tensor a received `TensorwireTensor` names: the peer's export with that tag,
    /// which must match the JSON's layout.
    pub(super) fn claim_native(&self, m: &Map) -> Result<Value> {
        let tag = m
            .get("tag")
            .and_then(Value::as_i64)
            .and_then(|t| u64::try_from(t).ok())
            .ok_or_else(|| RpcError::Decode("TensorwireTensor has no integer tag".into()))?;
        let want = crate::tensor::layout_from_ref(m)?;
        let want_cuda = crate::tensor::device_from_ref(m)?;
        let deadline = Instant::now() + Duration::from_secs(10);
        let st = self
            .wait_native(Some(deadline))
            .ok_or_else(|| RpcError::Protocol("a native tensor arrived but native tensors were never negotiated".into()))?;
        let mut arrived = st.arrived.lock();
        loop {
            if let Some(t) = arrived.remove(&tag) {
                // A mismatch drops (releases) the import: the peer gets its lease back.
                if t.layout() != want {
                    return Err(RpcError::Protocol(format!("native tensor {tag}: JSON says {want:?}, descriptor says {:?}", t.layout())));
                }
                let max = self.cfg.max_tensor_copy;
                return match (t, want_cuda) {
                    (Arrival::Cpu(t), None) => Ok(Value::from(Tensor::Imported(Arc::new(ImportedTensor::new(t, max))))),
                    (Arrival::Cuda(t), Some(d)) if t.device() == d => {
                        Ok(Value::from(Tensor::CudaImported(Arc::new(CudaImportedTensor::new(t, max)))))
                    }
                    (t, _) => Err(RpcError::Protocol(format!(
                        "native tensor {tag}: JSON names device {}, the transport delivered {}",
                        want_cuda.map_or("cpu".into(), crate::cuda_tensor::device_name),
                        t.what()
                    ))),
                };
            }
            if self.is_closed() || st.cv.wait_until(&mut arrived, deadline).timed_out() {
                return Err(RpcError::Timeout { what: format!("native tensor {tag}"), after: Duration::from_secs(10) });
            }
        }
    }
}
