//! Receiving a connection's native tensors: the exports (and the transport's refusals of
//! them) filed by tag as they come off the transport, and the claim of the one a received
//! `TensorwireTensor` names (CPU: a leased memfd view; CUDA: the peer's allocation opened
//! through the transport's handle cache, held until the value naming it is dropped).
//!
//! Who receives from the transport: the thread that decodes a `TensorwireTensor` and
//! needs its tag. The sender puts a tensor on the transport before the frame that names
//! it, so by then it is (almost always) waiting in the socket, and the claiming thread
//! takes it without a wake-up of any other thread — on a busy or small machine each
//! wake-up costs tens of µs, more than the rest of the call. One thread receives at a
//! time (the `receiving` role, under the arrivals lock); it files what it gets for other
//! tags and wakes their claimants, who then take the role in turn. A sweeper thread per
//! connection drains, every `SWEEP` while no claimant receives, what no claim has taken
//! yet — the transport's own messages (a `FORGET` that lets a mapping of a freed segment
//! go), and tensors queued ahead of a frame still being written — so that nothing waits
//! on the next call to be read.

use crate::endpoint::Inner;
use crate::error::{Result, RpcError};
use crate::tensor::{CudaImportedTensor, ImportedTensor, Tensor};
use crate::value::{Map, Value};
use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tensorwire::Wait;

/// A connection's native tensors once negotiated: the transport peer, and what came off it
/// that no claim has taken yet.
pub(in crate::endpoint) struct NativeState {
    pub(in crate::endpoint) peer: Arc<tensorwire::Peer>,
    /// Imported tensors (and the transport's refusals of tensors) by tag, waiting for the
    /// JSON that names them.
    arrived: Mutex<Arrivals>,
    cv: Condvar,
}

impl NativeState {
    /// The state over `peer`, its sweeper started (it ends with the endpoint behind
    /// `endpoint`, or with the transport).
    pub(super) fn start(peer: tensorwire::Peer, endpoint: std::sync::Weak<Inner>) -> Result<Arc<NativeState>> {
        let st = Arc::new(NativeState { peer: Arc::new(peer), arrived: Mutex::new(Arrivals::default()), cv: Condvar::new() });
        let st2 = st.clone();
        std::thread::Builder::new()
            .name("tw-native-sweep".into())
            .spawn(move || st2.sweep(endpoint))
            .map_err(|e| RpcError::io("spawning the native sweeper", e))?;
        Ok(st)
    }
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
    /// A thread is receiving from the transport (a claimant, or the sweeper): no other
    /// may start a receive until it files what it got.
    receiving: bool,
    /// The transport ended (the peer is gone, or its socket failed): what every claim
    /// still waiting gets.
    ended: Option<RpcError>,
}

impl Arrivals {
    /// File the transport's refusal of the tensor tagged `tag` (its lease already given
    /// back), for the call that names it.
    fn refuse(&mut self, tag: u64, kind: tensorwire::ErrorKind, why: String) {
        if self.refused.len() >= MAX_REFUSALS {
            if let Some(old) = self.refused.pop_front() {
                if matches!(self.by_tag.get(&old), Some(Arrival::Refused(..))) {
                    self.by_tag.remove(&old);
                }
            }
        }
        self.refused.push_back(tag);
        self.by_tag.insert(tag, Arrival::Refused(kind, why));
    }
}

/// How often the sweeper looks for what no claim took (see the module's text).
const SWEEP: Duration = Duration::from_millis(10);
/// The most messages one sweep takes before it lets a claimant have the transport.
const SWEEP_BATCH: usize = 64;

/// What one receive from the transport left for the receiving thread to do next.
enum Received {
    /// Something was filed (or a message of no interest taken): look again.
    Filed,
    /// Nothing came within the receive's wait.
    Nothing,
    /// The transport refused a message for want of fds or memory: the next receive may
    /// fail the same way at once, so pause before it.
    Starved,
    /// The transport ended; `Arrivals::ended` says how.
    Ended,
}

impl NativeState {
    pub(super) fn wake(&self) {
        self.cv.notify_all();
    }

    /// Receive one message from the transport as `wait` says, the caller holding the
    /// `receiving` role (and not the arrivals lock), and file it.
    fn receive(&self, wait: Wait) -> Received {
        let r = self.peer.recv(wait);
        let mut arrived = self.arrived.lock();
        let received = match r {
            // A tag the peer repeats replaces (and so releases) the earlier unclaimed
            // import: the map never holds more than one per tag.
            Ok(tensorwire::Incoming::Tensor(t)) => {
                arrived.by_tag.insert(t.tag(), Arrival::Cpu(t));
                Received::Filed
            }
            Ok(tensorwire::Incoming::CudaTensor(t)) => {
                arrived.by_tag.insert(t.tag(), Arrival::Cuda(t));
                Received::Filed
            }
            Ok(tensorwire::Incoming::Message { .. }) => Received::Filed,
            Err(tensorwire::Error::Timeout { .. }) => Received::Nothing,
            // The connection is over (or its socket failed): nothing more comes.
            Err(e @ (tensorwire::Error::PeerGone { .. } | tensorwire::Error::Io { .. })) => {
                arrived.ended = Some(RpcError::from(e));
                Received::Ended
            }
            // One message refused (a forged descriptor, a driver that could not open the
            // memory, ...; its lease already given back): the connection goes on, and
            // the call naming its tag gets the refusal at once.
            Err(e) => {
                if let Some(tag) = self.peer.refused_tag() {
                    arrived.refuse(tag, e.kind(), e.to_string());
                }
                if matches!(e, tensorwire::Error::Resource { .. }) { Received::Starved } else { Received::Filed }
            }
        };
        arrived.receiving = false;
        drop(arrived);
        // Claimants: theirs may have come, or the role is free to take.
        self.cv.notify_all();
        received
    }

    /// The sweeper: every [`SWEEP`] while the connection lasts, take what the transport
    /// holds unclaimed (see the module's text), unless a claimant is receiving. While
    /// messages keep coming (a frame naming many tensors, whose sender waits for room on
    /// the transport) it takes them as fast as they come, [`SWEEP_BATCH`] at a time.
    fn sweep(self: Arc<Self>, endpoint: std::sync::Weak<Inner>) {
        let mut pause = true;
        loop {
            if pause {
                std::thread::sleep(SWEEP);
            }
            if endpoint.upgrade().is_none_or(|i| i.is_closed()) {
                return;
            }
            pause = true;
            for _ in 0..SWEEP_BATCH {
                {
                    let mut arrived = self.arrived.lock();
                    if arrived.ended.is_some() {
                        return;
                    }
                    if arrived.receiving {
                        break;
                    }
                    arrived.receiving = true;
                }
                match self.receive(Wait::Never) {
                    Received::Filed => pause = false,
                    Received::Nothing | Received::Starved => {
                        pause = true;
                        break;
                    }
                    Received::Ended => return,
                }
            }
        }
    }
}

/// An export of the peer's, received before (or while) the JSON naming it is decoded —
/// or the transport's refusal of it.
enum Arrival {
    Cpu(tensorwire::Imported),
    Cuda(tensorwire::CudaImported),
    /// The tensor message with this tag was refused (the error's kind and text).
    Refused(tensorwire::ErrorKind, String),
}

impl Arrival {
    fn what(&self) -> String {
        match self {
            Arrival::Cpu(_) => "a CPU tensor".into(),
            Arrival::Cuda(t) => format!("a CUDA tensor of device {}", t.device()),
            Arrival::Refused(..) => "a refusal".into(),
        }
    }
}

impl Inner {
    /// The tensor a received `TensorwireTensor` names: the peer's export with that tag,
    /// which must match the JSON's layout; waited for until `deadline`.
    pub(in crate::endpoint) fn claim_native(&self, m: &Map, deadline: Instant) -> Result<Value> {
        let tag = m
            .get("tag")
            .and_then(Value::as_i64)
            .and_then(|t| u64::try_from(t).ok())
            .ok_or_else(|| RpcError::Decode("TensorwireTensor has no integer tag".into()))?;
        let want = crate::tensor::layout_from_ref(m)?;
        let want_cuda = crate::tensor::device_from_ref(m)?;
        let started = Instant::now();
        let st = self
            .wait_native(Some(deadline))
            .ok_or_else(|| RpcError::Protocol("a native tensor arrived but native tensors were never negotiated".into()))?;
        let mut arrived = st.arrived.lock();
        loop {
            if let Some(t) = arrived.by_tag.remove(&tag) {
                let layout = match &t {
                    Arrival::Cpu(t) => t.layout(),
                    Arrival::Cuda(t) => t.layout(),
                    Arrival::Refused(kind, why) => {
                        return Err(RpcError::Transport { kind: *kind, message: format!("native tensor {tag} was refused: {why}") });
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
            if let Some(e) = &arrived.ended {
                return Err(e.clone());
            }
            let timed_out = || RpcError::Timeout {
                what: format!("native tensor {tag}, which the peer's message names (it never came on the transport)"),
                after: started.elapsed(),
            };
            if self.is_closed() || Instant::now() >= deadline {
                return Err(timed_out());
            }
            if arrived.receiving {
                // Another thread receives: it files ours if that comes, and wakes us.
                if st.cv.wait_until(&mut arrived, deadline).timed_out() {
                    return Err(timed_out());
                }
                continue;
            }
            arrived.receiving = true;
            let received = parking_lot::MutexGuard::unlocked(&mut arrived, || st.receive(Wait::Until(deadline)));
            if matches!(received, Received::Starved) {
                parking_lot::MutexGuard::unlocked(&mut arrived, || std::thread::sleep(Duration::from_millis(1)));
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
            a.refuse(tag, tensorwire::ErrorKind::StaleLease, format!("no {tag}"));
        }
        assert_eq!(a.by_tag.len(), MAX_REFUSALS);
        assert!(a.refused.len() <= MAX_REFUSALS);
        let first_kept = (2 * MAX_REFUSALS) as u64;
        assert!(matches!(a.by_tag.get(&first_kept), Some(Arrival::Refused(tensorwire::ErrorKind::StaleLease, m)) if *m == format!("no {first_kept}")));
        assert!(!a.by_tag.contains_key(&(first_kept - 1)));
        // A tag claimed meanwhile: its refusal is gone; evicting its old entry later
        // removes nothing else.
        a.by_tag.remove(&first_kept);
        for tag in 0..MAX_REFUSALS as u64 {
            a.refuse(1_000_000 + tag, tensorwire::ErrorKind::Protocol, String::new());
        }
        assert_eq!(a.by_tag.len(), MAX_REFUSALS);
    }
}
