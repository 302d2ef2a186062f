//! Native tensors on a connection: the `native_hello` negotiation (one per connection)
//! that turns a SEQPACKET socketpair passed over the Unix socket into a
//! [`tensorwire::Peer`], and the set-up of the state that then holds it. Receiving what
//! the peer exports, and the claim of the export a received `TensorwireTensor` names, are
//! `native/claim.rs`'s.
//!
//! Inline tensors: the initiator's `native_hello` offers its `RpcConfig::inline_tensors`
//! (kwarg `inline_tensors`); a responder that offers them too answers
//! `{"native": true, "inline_tensors": N}` instead of `true`, and both then send and accept
//! owned tensors of up to the smaller limit inside the frame (`TensorwireInline`). A peer
//! that offers nothing gets the plain `true` and never sees the form; an initiator reads a
//! plain `true` as native tensors without inline ones.
//!
//! Attached tensors, the same way: the initiator offers its `RpcConfig::attached_tensors`
//! (kwarg `attached_tensors`), a responder that offers them too answers with the field
//! `attached_tensors` in its object, and each side then sends owned tensors of up to the
//! smaller limit as binary attachments of the frame (`TensorwireAttached`, preferred to
//! inline). Each side accepts attachments up to its own limit from the moment it offers
//! them (the initiator's hello, the responder's answer): the peer's first frame with one
//! may be read before the initiator's thread has read the answer.
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
use claim::NativeState;
use parking_lot::{Condvar, Mutex};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;
use tensorwire::Wait;

mod claim;

/// Native tensors on this connection: the negotiation's claim, the set-up in progress,
/// and the state once set up.
pub(super) struct Native {
    /// Set once set up; taken at the connection's end.
    state: Mutex<Option<Arc<NativeState>>>,
    /// Set by the first negotiation (ours or the peer's, native or remote): one per
    /// connection.
    claimed: AtomicBool,
    /// The peer's `native_hello` was accepted and our side is being set up in the
    /// background: a tensor sent meanwhile waits for it (`native_for_send`).
    setting_up: AtomicBool,
    /// Notified (under `state`'s lock) when the set-up ends, either way, and at the end.
    ready: Condvar,
    /// The negotiated limit of inline tensors we send (packed bytes; 0: none), set before
    /// the native state is installed (initiator) or our answer is written (responder).
    inline: AtomicUsize,
    /// The negotiated limit of attached tensors we send (packed bytes; 0: none), set as
    /// `inline` is.
    attach_send: AtomicUsize,
    /// Attached tensors we accept (our own limit, once offered; 0: none).
    attach_accept: AtomicUsize,
    /// Inline tensors we accept (our own limit, once offered; 0: none): from the offer on,
    /// not from the answer, because the peer may send one the moment it has answered, and
    /// our reader can read that frame before the negotiating thread has read the answer.
    inline_accept: AtomicUsize,
}

/// The `native_hello` kwarg and answer field that offer attached tensors.
const ATTACH_OFFER: &str = "attached_tensors";

/// The `native_hello` kwarg and answer field that offer inline tensors.
const INLINE_OFFER: &str = "inline_tensors";

/// The positive integer `v` offers, as a limit (`None`: no offer).
fn inline_offer(v: Option<&Value>) -> Option<usize> {
    v.and_then(Value::as_i64).filter(|&n| n > 0).map(|n| usize::try_from(n).unwrap_or(usize::MAX))
}

impl Native {
    pub(super) fn new() -> Native {
        Native {
            state: Mutex::new(None),
            claimed: AtomicBool::new(false),
            setting_up: AtomicBool::new(false),
            ready: Condvar::new(),
            inline: AtomicUsize::new(0),
            attach_send: AtomicUsize::new(0),
            attach_accept: AtomicUsize::new(0),
            inline_accept: AtomicUsize::new(0),
        }
    }

    /// The negotiated limit of inline tensors we send, in packed bytes (0: none negotiated).
    pub(super) fn inline_limit(&self) -> usize {
        // Acquire: pairs with the Release store in `set_inline`.
        self.inline.load(Ordering::Acquire)
    }

    fn set_inline(&self, limit: usize) {
        // Release: pairs with the Acquire load in `inline_limit`; stored before the native
        // state is installed or our answer goes out, so we send no inline tensor before
        // the peer has offered to read them (its `offer_inline`).
        self.inline.store(limit, Ordering::Release);
    }

    /// The negotiated limit of attached tensors we send, in packed bytes (0: none).
    pub(super) fn attach_limit(&self) -> usize {
        // Acquire: pairs with the Release store in `set_attach`.
        self.attach_send.load(Ordering::Acquire)
    }

    /// The largest attached tensor we accept (0: we offered none).
    pub(super) fn attach_accept_limit(&self) -> usize {
        // Relaxed: a limit read by the reader thread, which reads the peer's frames in
        // order; set before the frame that offers it is written (`offer_attach`).
        self.attach_accept.load(Ordering::Relaxed)
    }

    /// We offer (or answer) attached tensors up to `limit`: accept them from now on.
    fn offer_attach(&self, limit: usize) {
        // Relaxed: as where it is read; the offer's frame write orders it before any reply.
        self.attach_accept.store(limit, Ordering::Relaxed);
    }

    /// The largest inline tensor we accept (0: we offered none).
    pub(super) fn inline_accept_limit(&self) -> usize {
        // Relaxed: as `attach_accept_limit`.
        self.inline_accept.load(Ordering::Relaxed)
    }

    /// We offer (or answer) inline tensors up to `limit`: accept them from now on.
    fn offer_inline(&self, limit: usize) {
        // Relaxed: as `offer_attach`.
        self.inline_accept.store(limit, Ordering::Relaxed);
    }

    fn set_attach(&self, limit: usize) {
        // Release: pairs with the Acquire load in `attach_limit`, as `set_inline`.
        self.attach_send.store(limit, Ordering::Release);
    }

    /// Claim this connection's one negotiation: true for the first claim (until
    /// `unclaim`), false for every other.
    pub(super) fn claim(&self) -> bool {
        // AcqRel: the flag is the only state; the swap makes exactly one negotiation win.
        !self.claimed.swap(true, Ordering::AcqRel)
    }

    /// The claimed negotiation failed or was refused: a later one (either side's) may try.
    pub(super) fn unclaim(&self) {
        self.set_inline(0);
        self.set_attach(0);
        self.offer_attach(0);
        self.offer_inline(0);
        // Release: pairs with the AcqRel swap in `claim` and the Acquire load in `is_claimed`.
        self.claimed.store(false, Ordering::Release);
    }

    /// Whether a negotiation is claimed (in progress or done).
    #[cfg(feature = "ucx")]
    pub(super) fn is_claimed(&self) -> bool {
        // Acquire: pairs with the swap in `claim` and the store in `unclaim`.
        self.claimed.load(Ordering::Acquire)
    }

    /// At the connection's end: drop the state (waking its sweeper) and wake every wait
    /// for the set-up.
    pub(super) fn shut(&self) {
        if let Some(n) = self.state.lock().take() {
            n.wake();
        }
        self.ready.notify_all();
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
        if inner.native.state.lock().is_some() {
            return Ok(true);
        }
        if !inner.native.claim() {
            return Ok(inner.wait_native(super::calls::deadline_of(wait).0).is_some());
        }
        let r = inner.negotiate_as_initiator(wait);
        if !matches!(r, Ok(true)) {
            // Ours failed or was refused: a later attempt (either side's) may try again.
            inner.native.unclaim();
        }
        r
    }

    /// Whether tensors travel natively on this connection.
    pub fn native_enabled(&self) -> bool {
        self.inner().native.state.lock().is_some()
    }

    /// How many of the peer's segments this side keeps mapped for native tensors (`None`:
    /// not negotiated). A mapping outlives the tensors read through it, so that the next
    /// tensor in the same segment costs no `mmap`; it goes once the peer frees the
    /// segment and says so over the transport — whether or not another call comes.
    pub fn native_imported_segments(&self) -> Option<usize> {
        self.inner().native.state.lock().as_ref().map(|st| st.peer.imported_segments())
    }

    /// The CPU the peer last wrote to this connection from, as it said through the
    /// native transport (a hint: it may have moved since, or lie). `None` without native
    /// tensors, or before the peer wrote.
    pub fn native_peer_cpu(&self) -> Option<u32> {
        self.inner().native.state.lock().as_ref().and_then(|st| st.peer.peer_cpu())
    }
}

/// Where the two sides run. Two processes that hand frames back and forth on one core
/// stay there: each wake-up places the woken thread beside its waker, and two threads
/// that spin or yield are only split by the load balancer, which leaves recently run
/// threads where they are. A call then costs context switches on one CPU instead of a
/// spin on each of two — measured on a 2-CPU VM, 24–33 µs against 14–16 µs for add(1, 2)
/// from Python (`docs/DESIGN.md`, "Two processes on one core"). With native tensors the
/// transport's shared page says where the peer last wrote from, so the RPC's own frames
/// use it as the transport's messages do: each write notes its CPU there, and a wait that
/// finds the peer on its CPU moves off it first.
impl Inner {
    /// After a frame write: note this thread's CPU for the peer's waits
    /// ([`tensorwire::Peer::note_send_cpu`]). Nothing without native tensors.
    pub(super) fn note_send_cpu(&self) {
        if let Some(st) = &*self.native.state.lock() {
            st.peer.note_send_cpu();
        }
    }

    /// Before a wait for the peer's frame: move off the peer's CPU if it last wrote from
    /// ours ([`tensorwire::Peer::move_off_peer_cpu`]). True: the two share this CPU for
    /// good, so the wait must not spin (a spin there only delays the peer).
    pub(super) fn move_off_peer_cpu(&self) -> bool {
        let peer = match &*self.native.state.lock() {
            Some(st) => st.peer.clone(),
            None => return false,
        };
        peer.move_off_peer_cpu()
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
            kwargs: [(INLINE_OFFER, self.cfg.inline_tensors), (ATTACH_OFFER, self.cfg.attached_tensors)]
                .into_iter()
                .filter(|&(_, n)| n > 0)
                .map(|(k, n)| (k.to_owned(), Value::from(n as u64)))
                .collect(),
        };
        self.native.offer_attach(self.cfg.attached_tensors);
        self.native.offer_inline(self.cfg.inline_tensors);
        let sent = (|| {
            let mut payload = Vec::new();
            msg.encode(&mut payload, &mut |_| Err(RpcError::InvalidArgument("no tensors in hello".into())))?;
            let framed = frame::encode_frame(&payload)?;
            self.write_frame_with_fd(&framed, std::os::fd::AsFd::as_fd(&theirs))
        })();
        drop(theirs);
        if let Err(e) = sent {
            self.calls.take(call.id);
            return Err(e);
        }
        let (inline, attach) = match call.wait() {
            Ok(Value::Bool(true)) => (0, 0),
            // Only a peer we offered inline or attached tensors answers so.
            Ok(Value::Object(m))
                if (self.cfg.inline_tensors > 0 || self.cfg.attached_tensors > 0)
                    && m.get("native").and_then(Value::as_bool) == Some(true) =>
            {
                (
                    inline_offer(m.get(INLINE_OFFER)).map_or(0, |theirs| theirs.min(self.cfg.inline_tensors)),
                    inline_offer(m.get(ATTACH_OFFER)).map_or(0, |theirs| theirs.min(self.cfg.attached_tensors)),
                )
            }
            Ok(_) | Err(RpcError::Remote(_)) => {
                self.native.offer_attach(0);
                self.native.offer_inline(0);
                return Ok(false);
            }
            Err(e) => {
                self.native.offer_attach(0);
                self.native.offer_inline(0);
                return Err(e);
            }
        };
        let peer = tensorwire::Peer::from_fd(mine, self.cfg.peer_config.clone())?;
        self.native.set_inline(inline);
        self.native.set_attach(attach);
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
                // The first hello (or our own negotiation) wins, every later one is
                // refused.
                if !self.native.claim() {
                    return Err(RpcError::Remote(REFUSED_REPEAT.into()));
                }
                // The peer sets up its side after our answer; do ours in the background
                // (bounded by the transport's handshake timeout).
                let me = Arc::downgrade(self);
                let cfg = self.cfg.peer_config.clone();
                // Release: pairs with the Acquire load in `native_for_send`; set before our
                // answer goes out, so no tensor of ours can be sent before the peer's
                // native side exists and still miss the wait.
                self.native.setting_up.store(true, Ordering::Release);
                let inline = match inline_offer(kwargs.get(INLINE_OFFER)) {
                    Some(theirs) if self.cfg.inline_tensors > 0 => theirs.min(self.cfg.inline_tensors),
                    _ => 0,
                };
                self.native.set_inline(inline);
                if inline > 0 {
                    self.native.offer_inline(self.cfg.inline_tensors);
                }
                let attach = match inline_offer(kwargs.get(ATTACH_OFFER)) {
                    Some(theirs) if self.cfg.attached_tensors > 0 => theirs.min(self.cfg.attached_tensors),
                    _ => 0,
                };
                self.native.set_attach(attach);
                if attach > 0 {
                    self.native.offer_attach(self.cfg.attached_tensors);
                }
                std::thread::Builder::new()
                    .name("tensorwire-rpc-native-setup".into())
                    .spawn(move || {
                        let installed = tensorwire::Peer::from_fd(fd, cfg).map_err(RpcError::from);
                        if let Some(i) = me.upgrade() {
                            if installed.and_then(|peer| i.install_native(peer)).is_err() {
                                i.end_native_setup();
                            }
                        }
                    })
                    .map_err(|e| {
                        self.end_native_setup();
                        RpcError::io("spawning native setup", e)
                    })?;
                if inline == 0 && attach == 0 {
                    // What every peer that offered nothing (an older one) reads.
                    return Ok(Value::Bool(true));
                }
                let mut answer = Map::from_iter([("native".to_owned(), Value::Bool(true))]);
                if inline > 0 {
                    answer.insert(INLINE_OFFER.into(), Value::from(self.cfg.inline_tensors as u64));
                }
                if attach > 0 {
                    answer.insert(ATTACH_OFFER.into(), Value::from(self.cfg.attached_tensors as u64));
                }
                Ok(Value::Object(answer))
            }
            m => Err(RpcError::NotFound(format!("'{CONTROL_OBJECT_ID}' has no method '{m}'"))),
        }
    }

    /// Make `peer` this connection's native channel, and start its sweeper.
    pub(super) fn install_native(self: &Arc<Self>, peer: tensorwire::Peer) -> Result<()> {
        let st = NativeState::start(peer, Arc::downgrade(self))?;
        let mut native = self.native.state.lock();
        *native = Some(st);
        // Release: pairs with the Acquire load in `native_for_send` (under the same lock).
        self.native.setting_up.store(false, Ordering::Release);
        drop(native);
        self.native.ready.notify_all();
        Ok(())
    }

    /// The background set-up of our native side failed: senders stop waiting for it.
    fn end_native_setup(&self) {
        let native = self.native.state.lock();
        // Release: pairs with the Acquire load in `native_for_send` (under the same lock,
        // so a sender cannot miss the notification between its check and its wait).
        self.native.setting_up.store(false, Ordering::Release);
        drop(native);
        self.native.ready.notify_all();
    }

    /// The native state a tensor is sent by: the one negotiated, or — while our side of a
    /// negotiation the peer started is still being set up — the one that set-up makes,
    /// waited for up to the send timeout. Without the wait, a handler answering the
    /// peer's first call could send its tensor another way in that window (a file-system
    /// reference, which the peer refuses).
    pub(super) fn native_for_send(&self) -> Option<Arc<NativeState>> {
        let by = Instant::now() + self.cfg.send_timeout;
        let mut native = self.native.state.lock();
        // Acquire: pairs with the Release stores in `control`, `install_native` and
        // `end_native_setup`.
        while native.is_none() && self.native.setting_up.load(Ordering::Acquire) && !self.is_closed() {
            if self.native.ready.wait_until(&mut native, by).timed_out() {
                break;
            }
        }
        native.clone()
    }

    /// The native state once negotiated, waiting until `deadline` (`None`: no limit) or
    /// the end for a negotiation in progress.
    fn wait_native(&self, deadline: Option<Instant>) -> Option<Arc<NativeState>> {
        self.wait_set(&self.native.state, &self.native.ready, deadline)
    }

}
