//! Whether the connection is open, and why it closed: the first reason recorded is the
//! one every pending call, `wait_closed` and `close_reason` report.

use crate::error::RpcError;
use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

pub(super) struct Closing {
    /// Set once, by the shutdown (`finish`).
    closed: AtomicBool,
    /// The first reason recorded; set before or by `finish`, never changed after.
    reason: Mutex<Option<RpcError>>,
    /// Notified when `finish` sets `closed` (under `reason`'s lock).
    cv: Condvar,
    /// Our `null` close frame went out (or is going): it is sent at most once.
    sent_close: AtomicBool,
}

impl Closing {
    pub(super) fn new() -> Closing {
        Closing { closed: AtomicBool::new(false), reason: Mutex::new(None), cv: Condvar::new(), sent_close: AtomicBool::new(false) }
    }

    pub(super) fn is_closed(&self) -> bool {
        // Acquire: pairs with the AcqRel swap in `finish`.
        self.closed.load(Ordering::Acquire)
    }

    /// Why the connection ended, if it has (or a reason was recorded ahead of the end).
    pub(super) fn reason(&self) -> Option<RpcError> {
        self.reason.lock().clone()
    }

    /// Why calls fail now that the connection is closed.
    pub(super) fn error(&self) -> RpcError {
        self.reason().unwrap_or(RpcError::PeerGone("connection closed".into()))
    }

    /// Record `reason` unless one was: it becomes the one the shutdown reports.
    pub(super) fn record(&self, reason: &RpcError) {
        self.reason.lock().get_or_insert_with(|| reason.clone());
    }

    /// Whether this caller sends the `null` close frame (true once per connection).
    pub(super) fn take_close_frame(&self) -> bool {
        // AcqRel: the flag is the only state; the swap makes exactly one sender win.
        !self.sent_close.swap(true, Ordering::AcqRel)
    }

    /// Mark the connection closed: the first reason recorded (`reason` if none was), or
    /// `None` when it was closed already (the shutdown has run or is running).
    pub(super) fn finish(&self, reason: RpcError) -> Option<RpcError> {
        // AcqRel: pairs with the Acquire load in `is_closed`; exactly one caller shuts down.
        if self.closed.swap(true, Ordering::AcqRel) {
            return None;
        }
        let mut g = self.reason.lock();
        let first = g.get_or_insert(reason).clone();
        self.cv.notify_all();
        Some(first)
    }

    /// Wait until a reason is recorded, or until `deadline` (`None`: no limit).
    pub(super) fn wait_until(&self, deadline: Option<Instant>) {
        let mut g = self.reason.lock();
        while g.is_none() {
            match deadline {
                Some(d) => {
                    if self.cv.wait_until(&mut g, d).timed_out() {
                        break;
                    }
                }
                None => self.cv.wait(&mut g),
            }
        }
    }

    /// Wait for the end; returns why.
    pub(super) fn wait(&self) -> RpcError {
        let mut g = self.reason.lock();
        loop {
            if let Some(e) = g.as_ref() {
                return e.clone();
            }
            self.cv.wait(&mut g);
        }
    }
}
