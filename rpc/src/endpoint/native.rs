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
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tensorwire::Wait;

pub(super) struct NativeState {
    pub(super) peer: Arc<tensorwire::Peer>,
    /// Imported tensors (and the transport's refusals of tensors) by tag, waiting for the
    /// JSON that names them.
    arrived: Mutex<Arrivals>,
    cv: Condvar,
}

/// Refusals kept for the calls naming their tags, per connection; past this the oldest
/// goes (a call naming it then waits for its tensor, as for a tag never sent).
const MAX_REFUSALS: usize = 64;

#[derive(Default)]
struct Arrivals {
    by_tag: HashMap<u64, Arrival>,
    /// Tags refusals were filed under, oldest first (some may have been claimed or
    /// replaced since): bounds the refusals kept to [`MAX_REFUSALS`].
    refused: VecDeque<u64>,
}

impl Arrivals {
    /// File the transport's refusal of the tensor tagged `tag` (its lease already given
    /// back), for the call that names it.
    fn refuse(&mut self, tag: u64, why: String) {
        if self.refused.len() >= MAX_REFUSALS {
            if let Some(old) = self.refused.pop_front() {
                if matches!(self.by_tag.get(&old), Some(Arrival::Refused(_))) {
                    self.by_tag.remove(&old);
                }
            }
        }
        self.refused.push_back(tag);
        self.by_tag.insert(tag, Arrival::Refused(why));
    }
}

impl NativeState {
    pub(super) fn wake(&self) {
        self.cv.notify_all();
    }
}

/// An export of the peer's, received before (or while) the JSON naming it is decoded —
/// or the transport's refusal of it.
enum Arrival {
    Cpu(tensorwire::Imported),
    Cuda(tensorwire::CudaImported),
    /// The tensor message with this tag was refused (the error's text).
    Refused(String),
}

impl Arrival {
    fn what(&self) -> String {
        match self {
            Arrival::Cpu(_) => "a CPU tensor".into(),
            Arrival::Cuda(t) => format!("a CUDA tensor of device {}", t.device()),
            Arrival::Refused(_) => "a refusal".into(),
        }
    }
}

pub(super) const REFUSED_REPEAT: &str =
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
    ///
    /// Over TCP there is no memory to share: with the `ucx` feature and
    /// `RpcConfig::remote_tensors` set this negotiates remote tensors instead (CPU tensors
    /// read by the peer with a UCX get; see `Endpoint::remote_enabled`), and returns
    /// whether the peer agreed; otherwise `Ok(false)` (tensors are copied into the JSON).
    pub fn negotiate_native(&self, wait: impl Into<Wait>) -> Result<bool> {
        let inner = self.inner();
        let wait = wait.into();
        if !inner.is_unix {
            // TCP: remote tensors, where built in and configured.
            #[cfg(feature = "ucx")]
            return inner.negotiate_remote(wait);
            #[cfg(not(feature = "ucx"))]
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
        let (mine, theirs) = tensorwire::os::seqpacket_pair()?;
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
    pub(super) fn control(self: &Arc<Self>, method: &str, args: &[Value], kwargs: &Map) -> Result<Value> {
        let _ = (args, kwargs); // read by the `ucx` feature's methods
        match method {
            #[cfg(feature = "ucx")]
            "native_hello" if !self.is_unix => self.answer_remote_hello(kwargs),
            #[cfg(feature = "ucx")]
            "remote_release" => self.remote_release(args),
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
        let st = Arc::new(NativeState { peer: Arc::new(peer), arrived: Mutex::new(Arrivals::default()), cv: Condvar::new() });
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
                            st2.arrived.lock().by_tag.insert(t.tag(), Arrival::Cpu(t));
                            st2.cv.notify_all();
                        }
                        Ok(tensorwire::Incoming::CudaTensor(t)) => {
                            st2.arrived.lock().by_tag.insert(t.tag(), Arrival::Cuda(t));
                            st2.cv.notify_all();
                        }
                        Ok(tensorwire::Incoming::Message { .. }) => {}
                        Err(tensorwire::Error::Timeout { .. }) => {}
                        // The connection is over (or its socket failed): nothing more comes.
                        Err(tensorwire::Error::PeerGone { .. } | tensorwire::Error::Io { .. }) => return,
                        // One message refused (a forged descriptor, a driver that could
                        // not open the memory, ...; its lease already given back): the
                        // connection goes on, and the call naming its tag gets the
                        // refusal at once.
                        Err(e) => {
                            if let Some(tag) = st2.peer.refused_tag() {
                                st2.arrived.lock().refuse(tag, e.to_string());
                                st2.cv.notify_all();
                            }
                            if matches!(e, tensorwire::Error::Resource { .. }) {
                                // Out of fds or memory: the next receive may fail the same
                                // way at once; do not spin on it.
                                std::thread::sleep(Duration::from_millis(5));
                            }
                        }
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
        self.wait_set(&self.native, &self.native_ready, deadline)
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
            if let Some(t) = arrived.by_tag.remove(&tag) {
                let layout = match &t {
                    Arrival::Cpu(t) => t.layout(),
                    Arrival::Cuda(t) => t.layout(),
                    Arrival::Refused(why) => {
                        return Err(RpcError::Transport(format!("native tensor {tag} was refused: {why}")));
                    }
                };
                // A mismatch drops (releases) the import: the peer gets its lease back.
                if layout != want {
                    return Err(RpcError::Protocol(format!("native tensor {tag}: JSON says {want:?}, descriptor says {layout:?}")));
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Refusals are kept for the calls naming their tags, at most `MAX_REFUSALS` of them:
    /// a peer whose every tensor is refused cannot grow the map. Claimed or replaced
    /// entries are not evicted in a refusal's place.
    #[test]
    fn refusals_kept_are_bounded_oldest_first() {
        let mut a = Arrivals::default();
        for tag in 0..(3 * MAX_REFUSALS) as u64 {
            a.refuse(tag, format!("no {tag}"));
        }
        assert_eq!(a.by_tag.len(), MAX_REFUSALS);
        assert!(a.refused.len() <= MAX_REFUSALS);
        let first_kept = (2 * MAX_REFUSALS) as u64;
        assert!(matches!(a.by_tag.get(&first_kept), Some(Arrival::Refused(m)) if *m == format!("no {first_kept}")));
        assert!(!a.by_tag.contains_key(&(first_kept - 1)));
        // A tag claimed meanwhile: its refusal is gone; evicting its old entry later
        // removes nothing else.
        a.by_tag.remove(&first_kept);
        for tag in 0..MAX_REFUSALS as u64 {
            a.refuse(1_000_000 + tag, String::new());
        }
        assert_eq!(a.by_tag.len(), MAX_REFUSALS);
    }
}
