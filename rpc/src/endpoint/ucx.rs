//! Remote tensors on a TCP connection (feature `ucx`).
//!
//! Negotiation: over TCP, [`Endpoint::negotiate_native`] sends the same `native_hello` as
//! on a Unix socket, without a socket fd and with `remote_engines: ["ucx"]` in its
//! kwargs. A peer that speaks remote tensors and has `RpcConfig::remote_tensors` set
//! answers `{"remote_engine": "ucx"}`; any other answer (pyisolate has no
//! `__tensorwire__` object; a tensorwire-rpc peer without the feature or the setting
//! refuses) leaves the connection on inline `TensorValue`s. One negotiation per
//! connection, as on a Unix socket.
//!
//! Sending: a CPU tensor's storage is exported by the process's UCX exporter in this
//! connection's [`PeerScope`] (a `Tensor::Shared`'s memfd in place; any other tensor as a
//! private copy) and goes as a `TensorwireRemote` value ([`crate::ucx_tensor`]) carrying
//! the export's id and the scope's random key. The export is held — the storage kept
//! alive — until the peer sends `__tensorwire__.remote_release(export_id)` or the
//! connection ends (the scope is dropped with the connection's state), at most
//! `RpcConfig::max_remote_exports` at a time. The peer can ask for nothing but these
//! exports, whole: the exporter sends an export's own bytes, never an address the peer
//! names.
//!
//! Receiving: before a message's values are decoded, its remote tensors' lengths are
//! summed and checked against `RpcConfig::max_remote_message_bytes` and, with what this
//! connection's imports already hold, `RpcConfig::max_remote_connection_bytes`; a message
//! past either is refused whole and its exports released. Each value is then validated
//! ([`crate::ucx_tensor::parse`]), a fresh memfd segment of the export's length is
//! allocated (within `RpcConfig::max_tensor_copy` and the connection budget), the bytes
//! are received into it (within `RpcConfig::remote_import_timeout`) by this connection's
//! own importer, and the release is sent — also when the read failed, so the exporter
//! never holds an export for a value we refused. The tensor is an ordinary
//! `Tensor::Shared` of ours.
//!
//! Engines: one UCX exporter (context, worker and progress thread) per process, made on
//! the first negotiation, and one importer (context and worker) per connection, made on
//! its first remote tensor, so a stalled peer delays only its own connection's imports.
//! Both are configured from the environment (`UCX_TLS`, `UCX_NET_DEVICES`, ...).

use super::{CONTROL_OBJECT_ID, CallOptions, Endpoint, Inner};
use crate::error::{Result, RpcError};
use crate::limits::check_tensor_copy;
use crate::message::Message;
use crate::tensor::Tensor;
use crate::ucx_tensor::{self, ENGINE_UCX};
use crate::value::{Map, Value};
use parking_lot::{Condvar, Mutex};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};
use tensorwire::{Segment, SharedTensor, Wait};
use tensorwire_remote::ucx::{Exporter, Importer, PeerScope};
use tensorwire_remote::{Destination, Storage};

/// The kwarg of `native_hello` that announces the engines we can use.
const REMOTE_ENGINES: &str = "remote_engines";
/// The key of the answer that names the engine chosen.
const REMOTE_ENGINE: &str = "remote_engine";
/// How long a received remote tensor waits for a negotiation still in progress.
const NEGOTIATION_WAIT: Duration = Duration::from_secs(10);

static EXPORTER: OnceLock<std::result::Result<Exporter, String>> = OnceLock::new();

/// The process's UCX exporter, started on first use.
fn exporter() -> Result<&'static Exporter> {
    EXPORTER
        .get_or_init(|| Exporter::new().map_err(|e| format!("starting the UCX exporter: {e}")))
        .as_ref()
        .map_err(|e| RpcError::RemoteTransfer(e.clone()))
}

/// Remote tensors on this connection: the state once negotiated (the claim of the one
/// negotiation is `Native`'s).
pub(super) struct Remote {
    /// Set once negotiated; dropped (every export to the peer released) at the end.
    state: Mutex<Option<Arc<RemoteState>>>,
    /// Notified (under `state`'s lock) when it is set, and at the end.
    ready: Condvar,
}

impl Remote {
    pub(super) fn new() -> Remote {
        Remote { state: Mutex::new(None), ready: Condvar::new() }
    }

    /// At the connection's end: drop the state and wake every wait for it.
    pub(super) fn shut(&self) {
        // Taken under its lock, dropped outside it: the scope's drop unregisters.
        let remote = self.state.lock().take();
        drop(remote);
        self.ready.notify_all();
    }
}

/// A connection's remote-tensor state: the exports the peer may ask for, and what we
/// import from it.
pub(super) struct RemoteState {
    /// Dropped with the connection's state: every export still held is dropped.
    scope: PeerScope,
    /// This connection's importer, made on the first remote tensor received.
    importer: OnceLock<std::result::Result<Importer, String>>,
    /// Segments imported on this connection, for the connection budget: a segment counts
    /// while anything (an import in progress, a tensor of the application) holds it.
    imported: Mutex<Vec<(Weak<Segment>, u64)>>,
}

impl RemoteState {
    fn importer(&self) -> Result<&Importer> {
        self.importer
            .get_or_init(|| Importer::new().map_err(|e| format!("starting this connection's UCX importer: {e}")))
            .as_ref()
            .map_err(|e| RpcError::RemoteTransfer(e.clone()))
    }

    /// Bytes of imported segments still alive.
    fn held_bytes(&self) -> u64 {
        let mut v = self.imported.lock();
        v.retain(|(w, _)| w.strong_count() > 0);
        v.iter().map(|(_, n)| n).sum()
    }
}

/// A segment an import writes into; given back when the bytes are in.
struct SegmentDest(Arc<Segment>, usize);

// SAFETY: the segment was just created for this import, is mapped read-write for at least
// `self.1` bytes, and its fd has not been passed to anyone: until the importer gives the
// value back, nothing else reads or writes the memory (the `Weak` kept for the budget never
// upgrades). The mapping stays in place while the `Arc` lives; both methods return the same
// values on every call.
unsafe impl Destination for SegmentDest {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.0.as_ptr()
    }
    fn len(&self) -> usize {
        self.1
    }
}

/// The remote tensors of one message: (total length, export ids).
fn remote_values(v: &Value, total: &mut u64, ids: &mut Vec<u64>) {
    match v {
        Value::Array(a) => a.iter().for_each(|x| remote_values(x, total, ids)),
        Value::Object(m) => match m.get("__type__").and_then(Value::as_str) {
            Some(ucx_tensor::REMOTE_TENSOR_TYPE) => {
                *total = total.saturating_add(ucx_tensor::length(m).unwrap_or(0));
                ids.extend(ucx_tensor::export_id(m));
            }
            _ => m.values().for_each(|x| remote_values(x, total, ids)),
        },
        _ => {}
    }
}

/// A `Tensor::Shared`'s storage, registered in place.
struct SharedStorage(SharedTensor);

// SAFETY: the storage is `storage_nbytes()` bytes at `storage_ptr()` inside the segment's
// mapping (checked by `SharedTensor::new`); the mapping stays in place while the segment
// lives, and this value holds the segment (`Arc<Segment>`). Both methods return the same
// values on every call. Other holders may write the memory concurrently; the importer
// then reads whatever is there, as a native peer would.
unsafe impl Storage for SharedStorage {
    fn as_ptr(&self) -> *const u8 {
        self.0.storage_ptr()
    }
    fn len(&self) -> usize {
        self.0.storage_nbytes()
    }
}

impl Endpoint {
    /// Whether CPU tensors travel as remote (UCX) tensors on this connection.
    pub fn remote_enabled(&self) -> bool {
        self.inner().remote.state.lock().is_some()
    }

    /// Remote exports the peer has not released yet on this connection.
    pub fn remote_exports_live(&self) -> usize {
        self.inner().remote.state.lock().as_ref().map_or(0, |r| r.scope.live())
    }

    /// Remote exports not released yet over every connection of this process (0 before
    /// the first negotiation).
    pub fn process_remote_exports() -> usize {
        match EXPORTER.get() {
            Some(Ok(e)) => e.live_exports(),
            _ => 0,
        }
    }

    /// Bytes of remote tensors received on this connection that are still alive (what
    /// `RpcConfig::max_remote_connection_bytes` bounds).
    pub fn remote_imported_bytes(&self) -> u64 {
        self.inner().remote.state.lock().as_ref().map_or(0, |r| r.held_bytes())
    }
}

impl Inner {
    /// [`Endpoint::negotiate_native`] on a TCP connection.
    pub(super) fn negotiate_remote(self: &Arc<Self>, wait: Wait) -> Result<bool> {
        if !self.cfg.remote_tensors {
            return Ok(false);
        }
        if self.remote.state.lock().is_some() {
            return Ok(true);
        }
        // As in `negotiate_native`, one negotiation per connection wins.
        if !self.native.claim() {
            return Ok(self.wait_remote(super::calls::deadline_of(wait).0).is_some());
        }
        let r = self.negotiate_remote_as_initiator(wait);
        if !matches!(r, Ok(true)) {
            self.native.unclaim();
        }
        r
    }

    fn negotiate_remote_as_initiator(self: &Arc<Self>, wait: Wait) -> Result<bool> {
        // Our own exporter first: announce only what we can do.
        exporter()?;
        let mut kwargs = Map::new();
        kwargs.insert(REMOTE_ENGINES.into(), Value::Array(vec![ENGINE_UCX.into()]));
        let opts = CallOptions { timeout: Some(wait), parent_call_id: None };
        let call = self.start(opts, "remote tensor negotiation".into(), |call_id, parent_call_id| Message::Call {
            object_id: CONTROL_OBJECT_ID.into(),
            call_id,
            parent_call_id,
            method: "native_hello".into(),
            args: vec![Value::Int(1)],
            kwargs,
        })?;
        match call.wait() {
            Ok(Value::Object(m)) if m.get(REMOTE_ENGINE).and_then(Value::as_str) == Some(ENGINE_UCX) => {}
            Ok(_) | Err(RpcError::Remote(_)) => return Ok(false),
            Err(e) => return Err(e),
        }
        self.install_remote()?;
        Ok(true)
    }

    /// Our answer to a `native_hello` that came over TCP.
    pub(super) fn answer_remote_hello(&self, kwargs: &Map) -> Result<Value> {
        let offered = match kwargs.get(REMOTE_ENGINES) {
            Some(Value::Array(a)) => a.iter().any(|e| e.as_str() == Some(ENGINE_UCX)),
            _ => false,
        };
        if !offered || !self.cfg.remote_tensors {
            return Err(RpcError::Remote("remote tensors are disabled on this endpoint (RpcConfig::remote_tensors)".into()));
        }
        if !self.native.claim() {
            return Err(RpcError::Remote(super::native::REFUSED_REPEAT.into()));
        }
        if let Err(e) = exporter().and_then(|_| self.install_remote()) {
            self.native.unclaim();
            return Err(RpcError::Remote(format!("remote tensors unavailable here: {e}")));
        }
        let mut m = Map::new();
        m.insert(REMOTE_ENGINE.into(), ENGINE_UCX.into());
        Ok(Value::Object(m))
    }

    fn install_remote(&self) -> Result<()> {
        let scope = exporter()?
            .scope()
            .map_err(|e| RpcError::RemoteTransfer(format!("making this connection's export scope: {e}")))?;
        let mut g = self.remote.state.lock();
        if self.is_closed() {
            return Err(self.closed_error());
        }
        *g = Some(Arc::new(RemoteState { scope, importer: OnceLock::new(), imported: Mutex::new(Vec::new()) }));
        self.remote.ready.notify_all();
        Ok(())
    }

    /// The remote state once negotiated, waiting until `deadline` (`None`: no limit) or
    /// the end for a negotiation in progress.
    fn wait_remote(&self, deadline: Option<Instant>) -> Option<Arc<RemoteState>> {
        self.wait_set(&self.remote.state, &self.remote.ready, deadline)
    }

    /// The remote state if negotiated.
    pub(super) fn remote_state(&self) -> Option<Arc<RemoteState>> {
        self.remote.state.lock().clone()
    }

    /// A CPU tensor as a `TensorwireRemote` value: its storage registered for the peer.
    pub(super) fn export_remote(&self, st: &RemoteState, t: &Tensor) -> Result<Value> {
        let live = st.scope.live();
        if live >= self.cfg.max_remote_exports {
            return Err(RpcError::RemoteTransfer(format!(
                "the peer holds {live} unreleased remote tensors, the cap is {} (RpcConfig::max_remote_exports)",
                self.cfg.max_remote_exports
            )));
        }
        let (exported, layout) = match t {
            Tensor::Shared(s) if s.storage_nbytes() > 0 => (st.scope.export(SharedStorage(s.clone())), *s.layout()),
            other => {
                let (bytes, layout) = other.storage_copy()?;
                if bytes.is_empty() {
                    // Nothing to register: an empty storage goes inline.
                    return crate::tensor::to_tensor_value(t);
                }
                (st.scope.export(bytes), layout)
            }
        };
        let blob = exported.map_err(|e| RpcError::RemoteTransfer(format!("exporting the storage of a {layout:?} tensor: {e}")))?;
        ucx_tensor::to_value(&blob, &layout).inspect_err(|_| {
            let _ = st.scope.release(blob.export_id());
        })
    }

    /// The tensor a received `TensorwireRemote` names, read into memory of ours; the
    /// export is released whatever happens once its id is known.
    pub(super) fn claim_remote(self: &Arc<Self>, m: &Map) -> Result<Value> {
        let negotiating = !self.is_unix && self.native.is_claimed();
        let st = if negotiating { self.wait_remote(Some(Instant::now() + NEGOTIATION_WAIT)) } else { self.remote_state() };
        let Some(st) = st else {
            return Err(RpcError::Protocol(format!(
                "a remote tensor ({}) arrived but remote tensors were never negotiated on this connection",
                ucx_tensor::REMOTE_TENSOR_TYPE
            )));
        };
        let id = ucx_tensor::export_id(m);
        let r = self.read_remote(&st, m);
        if let Some(id) = id {
            self.send_release(id);
        }
        r.map(|t| Value::from(Tensor::Shared(t)))
    }

    /// The budgets on a received message, checked before any of its values is decoded:
    /// the sum of its remote tensors' lengths against `max_remote_message_bytes`, and with
    /// what this connection's imports hold, against `max_remote_connection_bytes`. A
    /// message past either is refused whole, and every export it names released.
    pub(super) fn check_remote_budget(self: &Arc<Self>, values: &[&Value]) -> Result<()> {
        let Some(st) = self.remote_state() else {
            return Ok(());
        };
        let (mut total, mut ids) = (0u64, Vec::new());
        for v in values {
            remote_values(v, &mut total, &mut ids);
        }
        if ids.is_empty() {
            return Ok(());
        }
        let held = st.held_bytes();
        let refusal = if total > self.cfg.max_remote_message_bytes {
            format!(
                "a message names {} remote tensors totalling {total} bytes, over the per-message budget of {} \
                 (RpcConfig::max_remote_message_bytes); none was read",
                ids.len(),
                self.cfg.max_remote_message_bytes
            )
        } else if held.saturating_add(total) > self.cfg.max_remote_connection_bytes {
            format!(
                "a message names remote tensors totalling {total} bytes while this connection's imports hold {held}, \
                 over the per-connection budget of {} (RpcConfig::max_remote_connection_bytes); none was read",
                self.cfg.max_remote_connection_bytes
            )
        } else {
            return Ok(());
        };
        for id in ids {
            self.send_release(id);
        }
        Err(RpcError::RemoteTransfer(refusal))
    }

    fn read_remote(&self, st: &RemoteState, m: &Map) -> Result<SharedTensor> {
        let r = ucx_tensor::parse(m)?;
        let (id, length, layout) = (r.blob.export_id(), r.blob.length(), r.layout);
        let what = || format!("the storage of remote {layout:?} tensor {id}");
        let n = check_tensor_copy(what, length, self.cfg.max_tensor_copy)?;
        // The connection budget again, per tensor: messages decoded at the same time were
        // each checked alone.
        let held = st.held_bytes();
        if held.saturating_add(n as u64) > self.cfg.max_remote_connection_bytes {
            return Err(RpcError::RemoteTransfer(format!(
                "remote tensor {id} ({n} bytes) would take this connection's imports from {held} bytes past its budget of {} \
                 (RpcConfig::max_remote_connection_bytes)",
                self.cfg.max_remote_connection_bytes
            )));
        }
        let importer = st.importer()?;
        let seg = Arc::new(Segment::create(n)?);
        st.imported.lock().push((Arc::downgrade(&seg), n as u64));
        let dst = importer
            .import(&r.blob, SegmentDest(seg, n), self.cfg.remote_import_timeout)
            .map_err(|e| RpcError::RemoteTransfer(format!("reading remote tensor {id} ({length} bytes) from the peer: {e}")))?;
        Ok(SharedTensor::new(dst.0, 0, n, layout)?)
    }

    /// Tell the peer we are done with its export `id` (the response is not waited for).
    fn send_release(self: &Arc<Self>, id: u64) {
        let opts = CallOptions { timeout: Some(Wait::Forever), parent_call_id: None };
        let _ = self.start(opts, format!("the release of remote tensor {id}"), |call_id, parent_call_id| Message::Call {
            object_id: CONTROL_OBJECT_ID.into(),
            call_id,
            parent_call_id,
            method: "remote_release".into(),
            args: vec![Value::from(id)],
            kwargs: Map::new(),
        });
    }

    /// `__tensorwire__.remote_release(export_id, ...)` from the peer.
    pub(super) fn remote_release(&self, args: &[Value]) -> Result<Value> {
        let st = self
            .remote_state()
            .ok_or_else(|| RpcError::Remote("remote_release: remote tensors were never negotiated on this connection".into()))?;
        let mut unknown = Vec::new();
        for a in args {
            let id = a
                .as_i64()
                .and_then(|i| u64::try_from(i).ok())
                .ok_or_else(|| RpcError::Remote(format!("remote_release: an export id is a {}, not a non-negative integer", a.type_name())))?;
            if st.scope.release(id).is_err() {
                unknown.push(id);
            }
        }
        if unknown.is_empty() {
            Ok(Value::Null)
        } else {
            Err(RpcError::Remote(format!("remote_release: no live export {unknown:?} on this connection")))
        }
    }
}
