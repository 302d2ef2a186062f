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
//! ([`crate::ucx_tensor::parse`]), a memfd segment of the export's length is taken from
//! the connection's pool of recycled segments or allocated (within
//! `RpcConfig::max_tensor_copy` and the connection budget), the bytes are received into it
//! (within `RpcConfig::remote_import_timeout`) by this connection's own importer, and the
//! release is sent — also when the read failed, so the exporter never holds an export for
//! a value we refused. The tensor is an ordinary `Tensor::Shared` of ours.
//!
//! Recycling ([`ImportPool`]): a fresh segment costs a `memfd_create`, a mapping, a page
//! fault per page on the first write and the unmapping after, none of which a reused one
//! repeats. So each connection keeps the segments it imported
//! into (up to `RpcConfig::remote_pool_bytes`) and imports into one again once nothing
//! else holds it — no tensor of the process, no import in flight, no weak reference, and
//! its fd never handed out (a peer given the fd could keep it mapped) — and only for a
//! tensor of exactly its length, which the import then overwrites whole. Kept segments
//! count towards the connection budget and go with the connection.
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
use std::sync::atomic::{Ordering, fence};
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
/// Most segments a connection's pool keeps (each import looks through them).
const MAX_POOLED_SEGMENTS: usize = 64;

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
    /// The segments imported into on this connection: kept for reuse, or tracked for the
    /// connection budget while anything holds them.
    pool: Mutex<ImportPool>,
}

impl RemoteState {
    fn importer(&self) -> Result<&Importer> {
        self.importer
            .get_or_init(|| Importer::new().map_err(|e| format!("starting this connection's UCX importer: {e}")))
            .as_ref()
            .map_err(|e| RpcError::RemoteTransfer(e.clone()))
    }

    /// Bytes of imported segments something besides the pool holds (imports in progress,
    /// tensors of the process): what the connection budget's refusals count. Free kept
    /// segments are dropped to make room instead ([`ImportPool::take`]).
    fn held_bytes(&self) -> u64 {
        self.pool.lock().held_bytes()
    }
}

/// A connection's imported segments (see the module docs, "Recycling"). Bounded by
/// `RpcConfig::remote_pool_bytes` and [`MAX_POOLED_SEGMENTS`]; a segment past either is
/// tracked only by a `Weak` for the budget and freed when its last holder drops it.
#[derive(Default)]
struct ImportPool {
    /// Segments kept for reuse, in use or free, least recently taken first.
    kept: Vec<Arc<Segment>>,
    /// Bytes of `kept`.
    kept_bytes: u64,
    /// Segments not kept, while they live: (segment, bytes).
    unpooled: Vec<(Weak<Segment>, u64)>,
    /// Imports that went into a kept segment.
    reused: u64,
}

/// Whether only the pool holds `seg`: no other `Arc` and no `Weak` (none can appear while
/// the pool's lock is held, as nothing else can reach the segment).
fn only_pool_holds(seg: &Arc<Segment>) -> bool {
    Arc::strong_count(seg) == 1 && Arc::weak_count(seg) == 0
}

impl ImportPool {
    fn held_bytes(&mut self) -> u64 {
        self.unpooled.retain(|(w, _)| w.strong_count() > 0);
        let kept: u64 = self.kept.iter().filter(|s| Arc::strong_count(s) > 1).map(|s| s.len() as u64).sum();
        kept + self.unpooled.iter().map(|(_, n)| n).sum::<u64>()
    }

    /// Takes out of `kept` what can never be written again: a segment whose fd was handed
    /// out (tracked as unpooled while something holds it), or one free of the pool but
    /// with a weak reference left.
    fn sweep(&mut self) {
        let mut i = 0;
        while i < self.kept.len() {
            let s = &self.kept[i];
            let strong = Arc::strong_count(s);
            if s.fd_handed_out() || (strong == 1 && Arc::weak_count(s) > 0) {
                let s = self.kept.remove(i);
                self.kept_bytes -= s.len() as u64;
                if strong > 1 {
                    self.unpooled.push((Arc::downgrade(&s), s.len() as u64));
                }
            } else {
                i += 1;
            }
        }
    }

    /// A segment of exactly `n` bytes that nothing else holds, for an import to overwrite:
    /// a free kept one, else a fresh one (kept while `cap` bytes and [`MAX_POOLED_SEGMENTS`]
    /// allow). Free kept segments are dropped, least recently taken first, while keeping
    /// them would take the connection's imported segments (kept and not) past `budget`
    /// with the new one, or the pool past its bounds.
    fn take(&mut self, n: usize, cap: u64, budget: u64) -> tensorwire::Result<Arc<Segment>> {
        self.sweep();
        if let Some(i) = self.kept.iter().position(|s| s.len() == n && only_pool_holds(s)) {
            // Acquire: pairs with the Release decrement of the last other holder's drop (a
            // tensor of the application, the import that filled it), so its reads of the
            // old bytes, and its `Segment::fd` if it made one, happen before what we do now.
            fence(Ordering::Acquire);
            if !self.kept[i].fd_handed_out() {
                let s = self.kept.remove(i);
                self.kept.push(s.clone());
                self.reused += 1;
                return Ok(s);
            }
            self.sweep();
        }
        let n64 = n as u64;
        let fits_pool = |p: &ImportPool| p.kept.len() < MAX_POOLED_SEGMENTS && p.kept_bytes.saturating_add(n64) <= cap;
        loop {
            self.unpooled.retain(|(w, _)| w.strong_count() > 0);
            let total = self.kept_bytes + self.unpooled.iter().map(|(_, b)| b).sum::<u64>();
            let want_room = total.saturating_add(n64) > budget || (n64 <= cap && !fits_pool(self));
            if !want_room {
                break;
            }
            let Some(i) = self.kept.iter().position(|s| Arc::strong_count(s) == 1) else {
                break;
            };
            let s = self.kept.remove(i);
            self.kept_bytes -= s.len() as u64;
        }
        let seg = Arc::new(Segment::create(n)?);
        if fits_pool(self) {
            self.kept.push(seg.clone());
            self.kept_bytes += n64;
        } else {
            self.unpooled.push((Arc::downgrade(&seg), n64));
        }
        Ok(seg)
    }
}

/// A segment an import writes into; given back when the bytes are in.
struct SegmentDest(Arc<Segment>, usize);

// SAFETY: the segment is this import's alone (`ImportPool::take`: fresh, or kept and held
// by nothing else — no `Arc` but the pool's, no `Weak` that could upgrade, its fd never
// handed out), is mapped read-write for exactly `self.1` bytes, and the pool hands it to
// no one else while this value holds it: until the importer gives the value back, nothing
// else reads or writes the memory. The mapping stays in place while the `Arc` lives; both
// methods return the same values on every call.
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

    /// Bytes of remote tensors received on this connection that are still alive, not
    /// counting free segments of the connection's pool (what the refusals of
    /// `RpcConfig::max_remote_connection_bytes` count).
    pub fn remote_imported_bytes(&self) -> u64 {
        self.inner().remote.state.lock().as_ref().map_or(0, |r| r.held_bytes())
    }

    /// This connection's pool of segments for remote tensors: (segments kept, their bytes,
    /// imports that reused one). `RpcConfig::remote_pool_bytes` bounds the bytes.
    pub fn remote_pool(&self) -> (usize, u64, u64) {
        self.inner().remote.state.lock().as_ref().map_or((0, 0, 0), |r| {
            let p = r.pool.lock();
            (p.kept.len(), p.kept_bytes, p.reused)
        })
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
        *g = Some(Arc::new(RemoteState { scope, importer: OnceLock::new(), pool: Mutex::new(ImportPool::default()) }));
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
        let seg = st.pool.lock().take(n, self.cfg.remote_pool_bytes, self.cfg.max_remote_connection_bytes)?;
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
