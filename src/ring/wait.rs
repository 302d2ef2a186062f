//! Waiting for the other side of a ring: the sender for space, the receiver for a
//! message. Both wait the same way: poll the doorbell the other side rings, then sleep on
//! it in slices, checking between slices that the other process still lives, until the
//! caller's deadline.

use crate::doorbell::Doorbell;
use crate::error::{Error, Result};
use std::time::{Duration, Instant};

/// How long one sleep lasts before the peer's liveness is checked again.
const LIVENESS_SLICE: Duration = Duration::from_millis(50);

/// Spin budget and timeout for one blocking ring call.
#[derive(Debug, Clone, Copy)]
pub struct Wait {
    /// Polls before sleeping in the futex.
    pub spin: u32,
    /// Give up after this long.
    pub timeout: Duration,
}

/// The slow half of one blocking ring call: the deadline starts at the first wait that
/// finds nothing (a call that never waits never reads the clock).
pub(super) struct Waiter<'a> {
    bell: Doorbell<'a>,
    wait: Wait,
    deadline: Option<Instant>,
    /// What the call waits for (the timeout error names it).
    waiting_for: &'static str,
    /// What it means that the other process went away while we waited.
    gone: &'static str,
}

impl<'a> Waiter<'a> {
    pub(super) fn new(bell: Doorbell<'a>, wait: Wait, waiting_for: &'static str, gone: &'static str) -> Self {
        Waiter { bell, wait, deadline: None, waiting_for, gone }
    }

    /// The doorbell's sequence now: read it before looking at the ring, so that a ring
    /// between the look and [`wait`](Self::wait) is not missed.
    pub(super) fn current(&self) -> u32 {
        self.bell.current()
    }

    /// Wait for the doorbell to move on from `seen`: spin, then (with the clock and a
    /// liveness check from `peer_gone`) sleep one slice. Returns to let the caller look
    /// again; fails past the deadline or once the peer is gone.
    pub(super) fn wait(&mut self, seen: u32, peer_gone: &dyn Fn() -> bool) -> Result<()> {
        if self.bell.spin(seen, self.wait.spin) {
            return Ok(());
        }
        let now = Instant::now();
        let end = *self.deadline.get_or_insert_with(|| crate::deadline::after(self.wait.timeout));
        if now >= end {
            return Err(Error::Timeout { what: self.waiting_for, after: self.wait.timeout });
        }
        if peer_gone() {
            return Err(Error::peer_gone(self.gone));
        }
        self.bell.wait(seen, 0, Some((end - now).min(LIVENESS_SLICE)));
        Ok(())
    }
}
