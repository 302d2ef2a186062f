//! The read side: the reader thread, leader/follower waiting for a response (see the
//! module docs of `endpoint`), frame reads and what a received frame becomes.
//!
//! Waits spin briefly before they block — for at most `RpcConfig::spin` (200 µs by
//! default; zero: block at once), never yielding the CPU, and not at all while there are
//! signs that other tasks want it (`spin`). Why: the response or request waited for often
//! arrives within microseconds, and a thread that blocked must then be woken, which across
//! CPUs costs tens of µs on some machines — more than the whole round trip otherwise. Past
//! the spin every wait blocks: in `poll` on the socket, or on the call's reply channel and
//! the baton (`follow`).

use super::Inner;
use super::calls::ReplyRx;
use super::dispatch::Request;
use super::spin::{Spin, SpinGate};
use crate::error::{Result, RpcError};
use crate::frame::FrameDecoder;
use crate::message::Message;
use crate::tensor::{AttachmentRefusal, Attachments};
use crossbeam_channel::{Receiver, Select, Sender};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The read side of the connection and the state of who reads it.
pub(super) struct Reading {
    /// Whoever holds this lock reads the socket (the leader).
    reader: Mutex<ReaderState>,
    /// Bumped each time a waiting caller takes the lead.
    lead_epoch: AtomicU64,
    /// When a connection a server accepted must have brought its first complete message
    /// (`RpcConfig::first_message_timeout`); the reader thread enforces it.
    first_message_by: Option<Instant>,
    /// Set by the first complete frame from the peer.
    got_message: AtomicBool,
    /// Callers asleep waiting for a response while someone else leads (a hint for the
    /// reader thread, which keeps reading while any wait).
    followers: AtomicUsize,
    /// The lead, offered: whoever stops reading leaves it, and it wakes one follower to
    /// try the read side.
    baton: Token,
    /// Wakes the reader thread from stepping back (`RpcConfig::reader_yield`) at shutdown.
    reader_wake: Token,
    /// Whether this endpoint's waits may spin now (see `spin`).
    spin_gate: SpinGate,
    /// fds that arrived on the socket, waiting for the message that claims them.
    fds: Mutex<VecDeque<OwnedFd>>,
}

impl Reading {
    pub(super) fn new(max_frame: usize, first_message_by: Option<Instant>) -> Reading {
        Reading {
            reader: Mutex::new(ReaderState { decoder: FrameDecoder::new(max_frame), buf: vec![0u8; 64 * 1024] }),
            lead_epoch: AtomicU64::new(0),
            first_message_by,
            got_message: AtomicBool::new(false),
            followers: AtomicUsize::new(0),
            baton: Token::new(),
            reader_wake: Token::new(),
            spin_gate: SpinGate::new(),
            fds: Mutex::new(VecDeque::new()),
        }
    }

    /// At the connection's end: close the fds no message claimed, and wake the reader
    /// thread from stepping back.
    pub(super) fn shut(&self) {
        self.fds.lock().clear();
        self.reader_wake.give();
    }
}

struct ReaderState {
    decoder: FrameDecoder,
    buf: Vec<u8>,
}

/// A signal that holds at most one token: `give` leaves one unless one is already
/// waiting (it never blocks), and one waiter takes it. A token given while nobody waits
/// stays for the next waiter, so no give is lost.
struct Token {
    tx: Sender<()>,
    rx: Receiver<()>,
}

impl Token {
    fn new() -> Token {
        let (tx, rx) = crossbeam_channel::bounded(1);
        Token { tx, rx }
    }
    fn give(&self) {
        let _ = self.tx.try_send(());
    }
}

/// Longest a leading caller blocks in `poll` before re-checking its reply channel (a
/// cancel from another thread completes the channel; the leader sees it within this).
const WAIT_SLICE: Duration = Duration::from_millis(10);

pub(super) fn reader_loop(weak: std::sync::Weak<Inner>) {
    let mut seen_epoch = 0;
    loop {
        let Some(inner) = weak.upgrade() else { return };
        if inner.is_closed() {
            return;
        }
        if inner.first_message_left() == Some(Duration::ZERO) {
            inner.cut_silent_peer();
            return;
        }
        // Relaxed: a counter read as a hint; no data is published through it.
        let epoch = inner.reading.lead_epoch.load(Ordering::Relaxed);
        if epoch != seen_epoch && !inner.cfg.reader_yield.is_zero() {
            // Callers have been reading their own responses: stay off the socket a while
            // (they dispatch whatever else arrives) rather than wake for each frame —
            // unless callers are waiting with no one leading for them.
            seen_epoch = epoch;
            if inner.reading.followers.load(Ordering::Relaxed) > 0 {
                continue;
            }
            // Stepping back from reading: a follower that arrives meanwhile takes the
            // lead instead of sleeping until we are back.
            inner.reading.baton.give();
            let _ = inner.reading.reader_wake.rx.recv_timeout(inner.cfg.reader_yield);
            continue;
        }
        // Whatever is already there (or buffered in the decoder), without blocking. The
        // lock is only contended while a caller leads; it is handed to us when that
        // caller steps down.
        let r = {
            // While the peer's first message is awaited, wait for the read side no longer
            // than that (a caller may lead meanwhile, for as long as its call takes).
            let rs = match inner.first_message_left() {
                Some(left) => inner.reading.reader.try_lock_for(left),
                None if inner.cfg.reader_yield.is_zero() => Some(inner.reading.reader.lock()),
                None => inner.reading.reader.try_lock(),
            };
            let Some(mut rs) = rs else {
                // A caller leads, for longer than a step back: step back again rather than
                // park on the lock, whose release would then wake this thread for nothing
                // at the end of every call.
                if inner.first_message_left().is_none() {
                    let _ = inner.reading.reader_wake.rx.recv_timeout(inner.cfg.reader_yield);
                }
                continue;
            };
            // With the frame: whether anything of a later one is buffered already (then
            // its sync handler must not hold this thread; see `standby`).
            inner.read_frame_locked(&mut rs, Some(Instant::now())).map(|f| f.map(|f| (f, rs.decoder.buffered() == 0)))
        };
        match r {
            Ok(Some((f, last))) => {
                inner.handle_frame(f, true, last);
                continue;
            }
            Ok(None) => {}
            Err(e) => {
                inner.shutdown_now(e);
                return;
            }
        }
        // Nothing buffered: check the socket for up to `spin` before sleeping in poll
        // (see the module docs) — not at all where the peer shares our CPU for good, and
        // off its CPU first where it shares it for now (see `native`).
        // Not while the spins are paused: see `lead`.
        let mut spin = inner.reading.spin_gate.spin(inner.cfg.spin);
        if !spin.paused() && inner.move_off_peer_cpu() {
            spin.stop();
        }
        let arrived = loop {
            match tensorwire::os::poll_events(&[(inner.sock.fd(), libc::POLLIN)], Some(Duration::ZERO)) {
                Ok(r) if r[0] != 0 => {
                    spin.found();
                    break true;
                }
                Ok(_) if spin.again() => {}
                Ok(_) => break false,
                Err(e) => {
                    inner.shutdown_now(e.into());
                    return;
                }
            }
        };
        if arrived {
            continue;
        }
        // Wait for the socket without holding the read side, so that a caller that starts
        // waiting can take it. (EOF and shutdown wake this too; so does the end of the
        // time for the peer's first message.)
        if let Err(e) = tensorwire::os::poll_events(&[(inner.sock.fd(), libc::POLLIN)], inner.first_message_left()) {
            inner.shutdown_now(e.into());
            return;
        }
    }
}

impl Inner {
    /// Wait for a call's reply until `deadline`: lead (read the socket) whenever the read
    /// side is free, else follow (see the module docs of `endpoint`). On this endpoint's
    /// lane thread, run the lane's waiting requests meanwhile (see `lane`). `None`: the
    /// deadline passed first.
    pub(super) fn wait_reply(self: &Arc<Self>, reply: &ReplyRx, deadline: Option<Instant>) -> Option<Result<crate::value::Value>> {
        let mut spin = self.reading.spin_gate.spin(self.cfg.spin);
        let lane = self.on_lane_thread();
        loop {
            if let Ok(r) = reply.try_recv() {
                return Some(r);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return None;
            }
            if lane && self.run_lane_job() {
                continue;
            }
            if let Some(rs) = self.reading.reader.try_lock() {
                self.lead(rs, reply, deadline, &mut spin, lane);
                continue;
            }
            // Someone leads. Within the spin, look again: the reply, or the lead freed by a
            // leader whose own response came in, is often microseconds away.
            if spin.again() {
                continue;
            }
            if let Some(r) = self.follow(reply, deadline, lane) {
                return Some(r);
            }
        }
    }

    /// Read and dispatch frames until `reply` is complete (or the deadline or the end, or
    /// — on the lane thread — a request waits in the lane), then step down.
    fn lead(self: &Arc<Self>, mut rs: parking_lot::MutexGuard<'_, ReaderState>, reply: &ReplyRx, deadline: Option<Instant>, spin: &mut Spin<'_>, lane: bool) {
        // Relaxed: a counter the reader thread reads as a hint.
        self.reading.lead_epoch.fetch_add(1, Ordering::Relaxed);
        // Off the peer's CPU before waiting for its frame (see `native`); pinned beside
        // it, wait without spinning. Not while the spins are paused: the CPUs are
        // contended, there is no idle one to move to, and a thread moved onto a busy CPU
        // waits there for the busy task's time slice.
        let pinned = !spin.paused() && self.move_off_peer_cpu();
        loop {
            if !reply.is_empty() || (lane && self.lane.has_waiting()) {
                break;
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                break;
            }
            // Within `spin`, check the socket without sleeping; then sleep in poll, in
            // slices, so that a cancel from another thread is noticed.
            let spinning = !pinned && spin.spinning();
            let until = if spinning {
                now
            } else {
                let s = now + WAIT_SLICE;
                deadline.map_or(s, |d| d.min(s))
            };
            match self.read_frame_locked(&mut rs, Some(until)) {
                // Responses complete their calls; requests go to the pool (never inline
                // here: this thread must get back to its own caller). Nothing in
                // `handle_frame` takes the `reader` lock.
                Ok(Some(f)) => {
                    if spinning {
                        spin.found();
                    }
                    self.handle_frame(f, false, false)
                }
                Ok(None) if spinning => {
                    spin.again();
                }
                Ok(None) => {}
                Err(e) => {
                    self.shutdown_now(e);
                    break;
                }
            }
        }
        drop(rs);
        // Offer the lead: a follower wakes and tries the read side.
        self.reading.baton.give();
    }

    /// Someone else leads: sleep until our reply, the lead is offered (the baton), the
    /// deadline, or — on the lane thread — a request in the lane (which this runs).
    /// `None`: no reply yet (try again).
    fn follow(&self, reply: &ReplyRx, deadline: Option<Instant>, lane: bool) -> Option<Result<crate::value::Value>> {
        // Relaxed: a hint for the reader thread (see `reader_loop`); the baton, not this
        // count, is what guarantees a follower is woken when the read side frees up.
        self.reading.followers.fetch_add(1, Ordering::Relaxed);
        let mut sel = Select::new();
        let on_reply = sel.recv(reply);
        let on_baton = sel.recv(&self.reading.baton.rx);
        if lane {
            sel.recv(self.lane.arrivals());
        }
        let ready = match deadline {
            None => Some(sel.ready()),
            Some(d) => sel.ready_deadline(d).ok(),
        };
        self.reading.followers.fetch_sub(1, Ordering::Relaxed);
        match ready {
            Some(i) if i == on_reply => reply.try_recv().ok(),
            Some(i) if i == on_baton => {
                // Taken, so that a token left while the read side was already taken again
                // wakes nobody twice; the lead is tried next.
                let _ = self.reading.baton.rx.try_recv();
                None
            }
            Some(_) => {
                self.run_lane_job();
                None
            }
            None => None,
        }
    }

    /// Next whole frame (owned), reading the socket as needed; the caller holds the read
    /// side. `deadline`: `None` blocks; a passed deadline still checks the socket once.
    /// `Ok(None)` when nothing whole arrived by then.
    fn read_frame_locked(&self, rs: &mut ReaderState, deadline: Option<Instant>) -> Result<Option<Vec<u8>>> {
        loop {
            if let Some(f) = rs.decoder.next_frame_owned()? {
                return Ok(Some(f));
            }
            if self.is_closed() {
                return Err(self.closed_error());
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let ready = tensorwire::os::poll_events(&[(self.sock.fd(), libc::POLLIN)], left)?;
            if ready[0] == 0 {
                if left.is_some() {
                    return Ok(None);
                }
                continue;
            }
            let mut fds = Vec::new();
            let n = self.sock.read_some(&mut rs.buf, &mut fds)?;
            if !fds.is_empty() {
                let mut q = self.reading.fds.lock();
                for fd in fds {
                    // At most a few fds may wait for the message that claims them; more is
                    // abuse and they are closed.
                    if q.len() < 4 {
                        q.push_back(fd);
                    }
                }
            }
            if n == 0 {
                let mid = rs.decoder.buffered();
                return Err(if mid > 0 {
                    RpcError::PeerGone(format!("connection closed by the peer in the middle of a frame ({mid} bytes buffered)"))
                } else {
                    RpcError::PeerGone("connection closed by the peer".into())
                });
            }
            let (buf, dec) = (&rs.buf[..n], &mut rs.decoder);
            dec.push(buf)?;
        }
    }

    pub(super) fn take_fd(&self) -> Option<OwnedFd> {
        self.reading.fds.lock().pop_front()
    }

    /// The standby reader (see `standby`): read and dispatch whatever has arrived,
    /// without blocking (waiting for the read side while a caller leads), as the reader
    /// thread would — except that sync handlers go to the pool.
    pub(super) fn read_available(self: &Arc<Self>) -> Result<()> {
        loop {
            let f = {
                let mut rs = self.reading.reader.lock();
                self.read_frame_locked(&mut rs, Some(Instant::now()))?
            };
            match f {
                Some(f) => self.handle_frame(f, true, false),
                None => return Ok(()),
            }
        }
    }

    /// What a frame read by a reader thread (`on_reader_thread`: the reader thread or the
    /// standby) or a leading caller becomes. `may_hold`: the reader thread read it and
    /// nothing after it, so it may run a sync handler itself (see `standby`).
    fn handle_frame(self: &Arc<Self>, payload: Vec<u8>, on_reader_thread: bool, may_hold: bool) {
        let frame_len = payload.len();
        // Relaxed: a flag only the reader thread acts on (a frame read by a caller counts
        // as soon as it is seen; none is missed, only seen a loop later).
        if !self.reading.got_message.load(Ordering::Relaxed) {
            self.reading.got_message.store(true, Ordering::Relaxed);
        }
        // A frame with attachments keeps its bytes until its values take them; any other's
        // text is not needed past decoding.
        let (msg, mut att) = if Attachments::marked(&payload) {
            match Attachments::split(payload) {
                Ok(att) if self.native.attach_accept_limit() > 0 => (self.decode_message(att.json()), att),
                Ok(_) => (Err(RpcError::Protocol(AttachmentRefusal::NotNegotiated.to_string())), Attachments::none()),
                Err(r) => (Err(r.into()), Attachments::none()),
            }
        } else {
            (self.decode_message(&payload), Attachments::none())
        };
        let msg = match msg {
            Ok(m) => m,
            Err(e) => {
                self.hang_up(e);
                return;
            }
        };
        match msg {
            Message::Close => {
                if self.closing.take_close_frame() {
                    let _ = self.write_frame(b"null");
                }
                self.shutdown_now(RpcError::PeerGone("the peer closed the connection".into()));
            }
            Message::Response { call_id: crate::message::NOTICE_CALL_ID, error: Some(e), .. } => {
                self.shutdown_now(RpcError::PeerGone(format!("the peer ended the connection: {e}")));
            }
            Message::Response { call_id, result, error } => {
                let waiting = self.calls.take(call_id);
                match waiting {
                    Some(s) => {
                        let r = match error {
                            Some(e) => Err(RpcError::Remote(e)),
                            None => self
                                .check_remote_budget(&[&result])
                                .and_then(|()| self.decode_tensors(result, super::claim_deadline(s.deadline()), &mut att))
                                .and_then(|v| att.check_all_taken().map(|()| v)),
                        };
                        s.complete(r);
                    }
                    None if !self.calls.was_sent(call_id) => {
                        self.shutdown_now(RpcError::Protocol(format!("response to call_id {call_id}, which was never sent")));
                    }
                    None => {
                        self.calls.count_late();
                    }
                }
            }
            Message::Call { object_id, call_id, parent_call_id, method, args, kwargs } => {
                self.stepping_away(on_reader_thread);
                let req = Request { call_id, parent_call_id, target: object_id, method, args, kwargs, callback: false, frame_len, att };
                self.dispatch(req, on_reader_thread, may_hold);
            }
            Message::Callback { callback_id, call_id, parent_call_id, args, kwargs } => {
                self.stepping_away(on_reader_thread);
                let req = Request { call_id, parent_call_id, target: callback_id, method: "__call__".into(), args, kwargs, callback: true, frame_len, att };
                self.dispatch(req, on_reader_thread, may_hold);
            }
        }
    }

    fn decode_message(&self, json: &[u8]) -> Result<Message> {
        if self.cfg.json_text {
            Message::decode_text(json, self.cfg.json_limits())
        } else {
            Message::decode_limited(json, self.cfg.json_limits())
        }
    }

    /// Time left for the peer's first complete message, while one is awaited (a
    /// connection a server accepted; see `RpcConfig::first_message_timeout`).
    fn first_message_left(&self) -> Option<Duration> {
        let by = self.reading.first_message_by?;
        // Relaxed: as where it is set.
        if self.reading.got_message.load(Ordering::Relaxed) {
            return None;
        }
        Some(by.saturating_duration_since(Instant::now()))
    }

    /// The first message did not come in time: tell the peer why (best effort) and close.
    fn cut_silent_peer(&self) {
        let e = RpcError::FirstMessageTimeout { after: self.cfg.first_message_timeout.unwrap_or_default() };
        self.hang_up(e);
    }

    /// The reader thread is about to handle a request (an inline handler, or a response
    /// written to a peer that may not be reading): it stops reading for a while, so a
    /// follower that found it holding the read side must not sleep until it is back.
    fn stepping_away(&self, reader_thread: bool) {
        if reader_thread {
            self.reading.baton.give();
        }
    }
}
