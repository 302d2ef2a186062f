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
//! Sending: a CPU tensor's storage is registered with the process's UCX exporter in this
//! connection's [`PeerScope`] (a `Tensor::Shared`'s memfd in place; any other tensor as a
//! private copy) and goes as a `TensorwireRemote` value ([`crate::ucx_tensor`]). The
//! export is held — the storage kept alive and registered — until the peer sends
//! `__tensorwire__.remote_release(export_id)` or the connection ends (the scope is dropped
//! with the connection's state), at most `RpcConfig::max_remote_exports` at a time.
//!
//! Receiving: the value is validated ([`crate::ucx_tensor::parse`]), a fresh memfd segment
//! of the export's length is allocated (within `RpcConfig::max_tensor_copy`), the bytes
//! are read into it with one UCX get (within `RpcConfig::remote_import_timeout`), and the
//! release is sent — also when the read failed, so the exporter never holds an export for
//! a value we refused. The tensor is an ordinary `Tensor::Shared` of ours.
//!
//! Engines: one UCX exporter (context, worker and progress thread) and one importer per
//! process, made on the first negotiation, configured from the environment (`UCX_TLS`,
//! `UCX_NET_DEVICES`, ...). Imports are serialised on the importer.

use super::{CONTROL_OBJECT_ID, CallOptions, Endpoint, Inner};
use crate::error::{Result, RpcError};
use crate::limits::check_tensor_copy;
use crate::message::Message;
use crate::tensor::Tensor;
use crate::ucx_tensor::{self, ENGINE_UCX};
use crate::value::{Map, Value};
use std::sync::{Arc, OnceLock};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tensorwire::{SharedTensor, Wait};
use tensorwire_remote::Storage;
use tensorwire_remote::ucx::{Exporter, Importer, PeerScope};

/// The kwarg of `native_hello` that announces the engines we can use.
const REMOTE_ENGINES: &str = "remote_engines";
/// The key of the answer that names the engine chosen.
const REMOTE_ENGINE: &str = "remote_engine";
/// How long a received remote tensor waits for a negotiation still in progress.
const NEGOTIATION_WAIT: Duration = Duration::from_secs(10);

struct Engines {
    exporter: Exporter,
    importer: Importer,
}

static ENGINES: OnceLock<std::result::Result<Engines, String>> = OnceLock::new();

/// The process's UCX engines, started on first use.
fn engines() -> Result<&'static Engines> {
    ENGINES
        .get_or_init(|| {
            let exporter = Exporter::new().map_err(|e| format!("starting the UCX exporter: {e}"))?;
            let importer = Importer::new().map_err(|e| format!("starting the UCX importer: {e}"))?;
            Ok(Engines { exporter, importer })
        })
        .as_ref()
        .map_err(|e| RpcError::RemoteTransfer(e.clone()))
}

/// A connection's remote-tensor state: the exports the peer may read.
pub(super) struct RemoteState {
    /// Dropped with the connection's state: every export still held is unregistered.
    scope: PeerScope,
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
        self.inner().remote.lock().is_some()
    }

    /// Remote exports the peer has not released yet on this connection.
    pub fn remote_exports_live(&self) -> usize {
        self.inner().remote.lock().as_ref().map_or(0, |r| r.scope.live())
    }

    /// Remote exports not released yet over every connection of this process (0 before
    /// the first negotiation).
    pub fn process_remote_exports() -> usize {
        match ENGINES.get() {
            Some(Ok(e)) => e.exporter.live_exports(),
            _ => 0,
        }
    }
}

impl Inner {
    /// [`Endpoint::negotiate_native`] on a TCP connection.
    pub(super) fn negotiate_remote(self: &Arc<Self>, wait: Wait) -> Result<bool> {
        if !self.cfg.remote_tensors {
            return Ok(false);
        }
        if self.remote.lock().is_some() {
            return Ok(true);
        }
        // AcqRel: as in `negotiate_native`, one negotiation per connection wins.
        if self.native_claimed.swap(true, Ordering::AcqRel) {
            return Ok(self.wait_remote(super::calls::deadline_of(wait).0).is_some());
        }
        let r = self.negotiate_remote_as_initiator(wait);
        if !matches!(r, Ok(true)) {
            self.native_claimed.store(false, Ordering::Release);
        }
        r
    }

    fn negotiate_remote_as_initiator(self: &Arc<Self>, wait: Wait) -> Result<bool> {
        // Our own engines first: announce only what we can do.
        engines()?;
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
        if self.native_claimed.swap(true, Ordering::AcqRel) {
            return Err(RpcError::Remote(super::native::REFUSED_REPEAT.into()));
        }
        if let Err(e) = engines().and_then(|_| self.install_remote()) {
            self.native_claimed.store(false, Ordering::Release);
            return Err(RpcError::Remote(format!("remote tensors unavailable here: {e}")));
        }
        let mut m = Map::new();
        m.insert(REMOTE_ENGINE.into(), ENGINE_UCX.into());
        Ok(Value::Object(m))
    }

    fn install_remote(&self) -> Result<()> {
        let scope = engines()?.exporter.scope();
        let mut g = self.remote.lock();
        if self.is_closed() {
            return Err(self.closed_error());
        }
        *g = Some(Arc::new(RemoteState { scope }));
        self.remote_ready.notify_all();
        Ok(())
    }

    /// The remote state once negotiated, waiting until `deadline` (`None`: no limit) or
    /// the end for a negotiation in progress.
    fn wait_remote(&self, deadline: Option<Instant>) -> Option<Arc<RemoteState>> {
        self.wait_set(&self.remote, &self.remote_ready, deadline)
    }

    /// The remote state if negotiated.
    pub(super) fn remote_state(&self) -> Option<Arc<RemoteState>> {
        self.remote.lock().clone()
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
        let blob = exported.map_err(|e| RpcError::RemoteTransfer(format!("registering the storage of a {layout:?} tensor: {e}")))?;
        ucx_tensor::to_value(&blob, &layout).inspect_err(|_| {
            let _ = st.scope.release(blob.export_id());
        })
    }

    /// The tensor a received `TensorwireRemote` names, read into memory of ours; the
    /// export is released whatever happens once its id is known.
    pub(super) fn claim_remote(self: &Arc<Self>, m: &Map) -> Result<Value> {
        let negotiating = !self.is_unix && self.native_claimed.load(Ordering::Acquire);
        let st = if negotiating { self.wait_remote(Some(Instant::now() + NEGOTIATION_WAIT)) } else { self.remote_state() };
        if st.is_none() {
            return Err(RpcError::Protocol(format!(
                "a remote tensor ({}) arrived but remote tensors were never negotiated on this connection",
                ucx_tensor::REMOTE_TENSOR_TYPE
            )));
        }
        let id = ucx_tensor::export_id(m);
        let r = self.read_remote(m);
        if let Some(id) = id {
            self.send_release(id);
        }
        r.map(|t| Value::from(Tensor::Shared(t)))
    }

    fn read_remote(&self, m: &Map) -> Result<SharedTensor> {
        let r = ucx_tensor::parse(m)?;
        let (id, length, layout) = (r.blob.export_id(), r.blob.length(), r.layout);
        let what = || format!("the storage of remote {layout:?} tensor {id}");
        let n = check_tensor_copy(what, length, self.cfg.max_tensor_copy)?;
        let seg = tensorwire::Segment::create(n)?;
        // SAFETY: the segment was just created and mapped read-write for `n` bytes (its
        // length is at least `n`); its fd has not been passed to anyone, so this slice is
        // the only access to the memory until it ends below.
        let dst = unsafe { std::slice::from_raw_parts_mut(seg.as_ptr(), n) };
        engines()?
            .importer
            .import(&r.blob, dst, self.cfg.remote_import_timeout)
            .map_err(|e| RpcError::RemoteTransfer(format!("reading remote tensor {id} ({length} bytes) from the peer: {e}")))?;
        Ok(SharedTensor::new(Arc::new(seg), 0, n, layout)?)
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
