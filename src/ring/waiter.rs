//! Waiting for the other side of a ring: the sender for space, the receiver for a
//! message. Both wait the same way: poll the doorbell the other side rings, then sleep on
//! it in slices, checking between slices that the other process still lives, until the
//! caller's deadline.

use crate::doorbell::Doorbell;
use crate::error::{Error, Result};
use crate::wait::Deadline;
use std::time::Duration;

/// How long one sleep lasts before the peer's liveness is checked again.
const LIVENESS_SLICE: Duration = Duration::from_millis(50);

/// The slow half of one blocking ring call, on the call's deadline (its clock starts at
/// the first wait that finds nothing, so a call that never waits reads no clock).
pub(super) struct Waiter<'a, 'd> {
    bell: Doorbell<'a>,
    /// Polls before each sleep.
    spin: u32,
    deadline: &'d mut Deadline,
    /// What the call waits for (the timeout error names it).
    waiting_for: &'static str,
    /// What it means that the other process went away while we waited.
    gone: &'static str,
}

impl<'a, 'd> Waiter<'a, 'd> {
    pub(super) fn new(
        bell: Doorbell<'a>,
        spin: u32,
        deadline: &'d mut Deadline,
        waiting_for: &'static str,
        gone: &'static str,
    ) -> Self {
        Waiter { bell, spin, deadline, waiting_for, gone }
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
        if self.bell.spin(seen, self.deadline.spins(self.spin)) {
            return Ok(());
        }
        let Some(nap) = self.deadline.slice(LIVENESS_SLICE) else {
            return Err(self.deadline.timed_out(self.waiting_for));
        };
        if peer_gone() {
            return Err(Error::peer_gone(self.gone));
        }
        self.bell.wait(seen, 0, nap);
        Ok(())
    }
}
