//! The read side: the reader thread, leader/follower waiting for a response (see the
//! module docs of `endpoint`), frame reads and what a received frame becomes.

use super::Inner;
use super::calls::Slot;
use crate::error::{Result, RpcError};
use crate::frame::FrameDecoder;
use crate::message::Message;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

pub(super) struct ReaderState {
    pub(super) decoder: FrameDecoder,
    pub(super) buf: Vec<u8>,
}

/// Longest a leading caller blocks in `poll` before re-checking its slot (a cancel from
/// another thread is seen within this), and longest a follower sleeps before re-trying the
/// lead (a safety net: a stepping-down leader wakes a follower).
const WAIT_SLICE: Duration = Duration::from_millis(10);

pub(super) fn reader_loop(weak: std::sync::Weak<Inner>) {
    let mut seen_epoch = 0;
    loop {
        let Some(inner) = weak.upgrade() else { return };
        if inner.is_closed() {
            return;
        }
        let epoch = inner.lead_epoch.load(Ordering::Acquire);
        if epoch != seen_epoch && !inner.cfg.reader_yield.is_zero() {
            // Callers have been reading their own responses: stay off the socket a while
            // (they dispatch whatever else arrives) rather than wake for each frame —
            // unless callers are waiting with no one leading for them.
            seen_epoch = epoch;
            if !inner.followers.lock().is_empty() {
                continue;
            }
            let mut g = inner.idle.lock();
            if !inner.is_closed() {
                inner.idle_cv.wait_for(&mut g, inner.cfg.reader_yield);
            }
            continue;
        }
        // Whatever is already there (or buffered in the decoder), without blocking. The
        // lock is only contended while a caller leads; it is handed to us when that
        // caller steps down.
        let r = {
            let mut rs = inner.reader.lock();
            inner.read_frame_locked(&mut rs, Some(Instant::now()))
        };
        match r {
            Ok(Some(f)) => {
                inner.handle_frame(f, true);
                continue;
            }
            Ok(None) => {}
            Err(e) => {
                inner.shutdown_now(e);
                return;
            }
        }
        // Nothing buffered: poll briefly (yielding) before sleeping — a frame that arrives
        // within `spin` then costs no wake-up, which across CPUs is tens of µs on some
        // machines; yielding lets a peer that shares this CPU run meanwhile.
        let until = Instant::now() + inner.cfg.spin;
        let mut arrived = false;
        while Instant::now() < until {
            match tensorwire::sys::poll_events(&[(inner.sock.fd(), libc::POLLIN)], Some(Duration::ZERO)) {
                Ok(r) if r[0] != 0 => {
                    arrived = true;
                    break;
                }
                Ok(_) => std::thread::yield_now(),
                Err(e) => {
                    inner.shutdown_now(e.into());
                    return;
                }
            }
        }
        if arrived {
            continue;
        }
        // Wait for the socket without holding the read side, so that a caller that starts
        // waiting can take it. (EOF and shutdown wake this too.)
        if let Err(e) = tensorwire::sys::poll_events(&[(inner.sock.fd(), libc::POLLIN)], None) {
            inner.shutdown_now(e.into());
            return;
        }
    }
}

impl Inner {
    /// read side whenever it is free (see the module docs).
    pub(super) fn wait_slot(self: &Arc<Self>, slot: &Arc<Slot>, deadline: Option<Instant>) {
        let spin_until = Instant::now() + self.cfg.spin;
        loop {
            if slot.done.load(Ordering::Acquire) || deadline.is_some_and(|d| Instant::now() >= d) {
                return;
            }
            if let Some(rs) = self.reader.try_lock() {
                self.lead(rs, slot, deadline, spin_until);
                return;
            }
            if Instant::now() < spin_until {
                std::thread::yield_now();
                continue;
            }
            self.follow(slot, deadline);
        }
    }

    /// Read and dispatch frames until `slot` is done (or the deadline or the end), then
    /// step down.
    fn lead(self: &Arc<Self>, mut rs: parking_lot::MutexGuard<'_, ReaderState>, slot: &Arc<Slot>, deadline: Option<Instant>, spin_until: Instant) {
        self.lead_epoch.fetch_add(1, Ordering::AcqRel);
        loop {
            if slot.done.load(Ordering::Acquire) {
                break;
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                break;
            }
            // Spin phase: check the socket without sleeping; then sleep in poll, in
            // slices so that a cancel from another thread is noticed.
            let until = if now < spin_until {
                now
            } else {
                let s = now + WAIT_SLICE;
                deadline.map_or(s, |d| d.min(s))
            };
            match self.read_frame_locked(&mut rs, Some(until)) {
                // Responses complete their slots; requests go to the pool (never inline
                // here: this thread must get back to its own caller). Nothing in
                // `handle_frame` takes the `reader` lock.
                Ok(Some(f)) => self.handle_frame(f, false),
                Ok(None) => std::thread::yield_now(),
                Err(e) => {
                    self.shutdown_now(e);
                    break;
                }
            }
        }
        drop(rs);
        // Offer the lead to one follower (it re-checks its slot, then tries the lock).
        // Taking its result lock orders this after its registration check (see `follow`).
        let next = self.followers.lock().first().cloned();
        if let Some(s) = next {
            let _g = s.result.lock();
            s.cv.notify_all();
        }
    }

    /// Someone else leads: sleep until our slot is done, the lead is offered to us, the
    /// deadline, or a slice passes.
    fn follow(&self, slot: &Arc<Slot>, deadline: Option<Instant>) {
        let mut g = slot.result.lock();
        self.followers.lock().push(slot.clone());
        // A leader steps down by unlocking `reader`, then offering (under our result lock,
        // which we hold) to the first follower: if it is already unlocked, retry now;
        // otherwise its offer comes after our wait has begun.
        if g.is_none() && self.reader.is_locked() && !self.is_closed() {
            let s = Instant::now() + WAIT_SLICE;
            let until = deadline.map_or(s, |d| d.min(s));
            let _ = slot.cv.wait_until(&mut g, until);
        }
        drop(g);
        let mut f = self.followers.lock();
        if let Some(i) = f.iter().position(|x| Arc::ptr_eq(x, slot)) {
            f.swap_remove(i);
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
                return Err(self.close_reason.lock().clone().unwrap_or(RpcError::PeerGone("connection closed".into())));
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let ready = tensorwire::sys::poll_events(&[(self.sock.fd(), libc::POLLIN)], left)?;
            if ready[0] == 0 {
                if left.is_some() {
                    return Ok(None);
                }
                continue;
            }
            let mut fds = Vec::new();
            let n = self.sock.read_some(&mut rs.buf, &mut fds)?;
            if !fds.is_empty() {
                let mut q = self.fds.lock();
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
        self.fds.lock().pop_front()
    }

    fn handle_frame(self: &Arc<Self>, payload: Vec<u8>, may_inline: bool) {
        let msg = Message::decode_limited(&payload, self.cfg.json_limits());
        drop(payload); // the frame's text is not needed past decoding
        let msg = match msg {
            Ok(m) => m,
            Err(e) => {
                // Tell the peer why before hanging up (best effort; it may not read).
                let _ = self.write_frame(&crate::message::connection_notice(&e.to_string()));
                self.shutdown_now(e);
                return;
            }
        };
        match msg {
            Message::Close => {
                if !self.sent_close.swap(true, Ordering::AcqRel) {
                    let _ = self.write_frame(b"null");
                }
                self.shutdown_now(RpcError::PeerGone("the peer closed the connection".into()));
            }
            Message::Response { call_id: crate::message::NOTICE_CALL_ID, error: Some(e), .. } => {
                self.shutdown_now(RpcError::PeerGone(format!("the peer ended the connection: {e}")));
            }
            Message::Response { call_id, result, error } => {
                let slot = self.pending.lock().remove(&call_id);
                match slot {
                    Some(s) => {
                        let r = match error {
                            Some(e) => Err(RpcError::Remote(e)),
                            None => self.decode_tensors(result),
                        };
                        s.complete(r);
                    }
                    None if call_id < 0 || call_id >= self.next_id.load(Ordering::Relaxed) => {
                        self.shutdown_now(RpcError::Protocol(format!("response to call_id {call_id}, which was never sent")));
                    }
                    None => {
                        self.late.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Message::Call { object_id, call_id, parent_call_id, method, args, kwargs } => {
                self.dispatch(call_id, parent_call_id, object_id, method, args, kwargs, false, may_inline);
            }
            Message::Callback { callback_id, call_id, parent_call_id, args, kwargs } => {
                self.dispatch(call_id, parent_call_id, callback_id, "__call__".into(), args, kwargs, true, may_inline);
            }
        }
    }
}
