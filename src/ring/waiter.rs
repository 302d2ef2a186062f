//! Waiting for the other side of a ring: the sender for space, the receiver for a
//! message — and a peer's control-message receive (`Connection`), which sleeps on the
//! message doorbell of the peer's lease table. All wait the same way: poll what they wait
//! for (the receiver the stamp of the next record, the sender the consumer's tail, a
//! connection its doorbell's sequence) while the side's [`SpinPolicy`] allows (not while
//! the other process shares our core), then sleep on the doorbell the other side rings,
//! in slices, checking between slices that the other process still lives, until the
//! caller's deadline.

use crate::doorbell::Doorbell;
use crate::error::{Error, Result};
use crate::sync::spin_hint;
use crate::spin_policy::{hand_over, Outcome, Plan, SpinPolicy};
use crate::wait::Deadline;
use std::convert::Infallible;
use std::time::{Duration, Instant};

/// How long one sleep lasts before the peer's liveness is checked again.
const LIVENESS_SLICE: Duration = Duration::from_millis(50);

/// Polls a spin makes before it reads the clock: a reply within them (a ring round trip
/// between two cores takes well under a microsecond) costs no clock read; only a spin
/// that lasts is timed, for its [`Outcome`].
const UNTIMED_POLLS: u32 = 256;

/// How long a wait polls its doorbell before it sleeps.
#[derive(Clone, Copy, Debug)]
pub(crate) enum SpinBudget {
    /// This many polls (the ring's `PeerConfig::ring_spin`).
    Polls(u32),
    /// About this long (a connection's `PeerConfig::recv_spin`), the clock read every
    /// [`UNTIMED_POLLS`] polls.
    For(Duration),
}

impl From<u32> for SpinBudget {
    fn from(polls: u32) -> Self {
        SpinBudget::Polls(polls)
    }
}

impl From<Duration> for SpinBudget {
    fn from(time: Duration) -> Self {
        SpinBudget::For(time)
    }
}

/// The slow half of one blocking ring call, on the call's deadline (its clock starts at
/// the first wait that finds nothing, so a call that never waits reads no clock).
pub(crate) struct Waiter<'a, 'd> {
    bell: Doorbell<'a>,
    /// Most polling before each sleep.
    spin: SpinBudget,
    /// Whether this side may spin now (the ring half's, kept across calls).
    policy: &'a SpinPolicy,
    deadline: &'d mut Deadline,
    /// What the call waits for (the timeout error names it).
    waiting_for: &'static str,
    /// What it means that the other process went away while we waited.
    gone: &'static str,
}

impl<'a, 'd> Waiter<'a, 'd> {
    /// A waiter that polls up to `spin` (a count of polls, or a time) before each sleep.
    pub(crate) fn new(
        bell: Doorbell<'a>,
        spin: impl Into<SpinBudget>,
        policy: &'a SpinPolicy,
        deadline: &'d mut Deadline,
        waiting_for: &'static str,
        gone: &'static str,
    ) -> Self {
        Waiter { bell, spin: spin.into(), policy, deadline, waiting_for, gone }
    }

    /// The doorbell's sequence now (for a caller whose `ready` is "the sequence moved").
    pub(crate) fn current(&self) -> u32 {
        self.bell.current()
    }

    /// Wait for `ready` (a look at shared memory the other side writes before it rings):
    /// poll it (if the policy allows), then (with the clock and a liveness check from
    /// `peer_gone`) sleep one slice on the doorbell. Returns to let the caller look again
    /// (`ready` is a hint: the caller validates what it finds); fails past the deadline or
    /// once the peer is gone.
    pub(crate) fn wait(&mut self, ready: &dyn Fn() -> bool, peer_gone: &dyn Fn() -> bool) -> Result<()> {
        // No spin at all for a call that may not wait (`Deadline::spins`).
        let cap = match self.spin {
            SpinBudget::Polls(n) => SpinBudget::Polls(self.deadline.spins(n)),
            SpinBudget::For(_) if self.deadline.spins(1) == 0 => SpinBudget::For(Duration::ZERO),
            b => b,
        };
        let untimed = match cap {
            SpinBudget::Polls(n) => n.min(UNTIMED_POLLS),
            SpinBudget::For(d) if d.is_zero() => 0,
            SpinBudget::For(_) => UNTIMED_POLLS,
        };
        // A spin that ran out: how long it lasted (its untimed polls aside).
        let mut ran_out = None;
        // How this wait goes: not a spin while the other process shares our core, where
        // the spin would hold the core it needs to ring for the whole budget, every time
        // (`spin_policy` has the numbers). A spin of 0 sleeps at once.
        let plan = if untimed == 0 { Plan::Sleep } else { self.policy.next() };
        if plan == Plan::Spin {
            if poll(ready, untimed) {
                self.policy.record(Outcome::Spun);
                return Ok(());
            }
            let start = Instant::now();
            let rang = match cap {
                SpinBudget::Polls(n) => poll(ready, n.saturating_sub(UNTIMED_POLLS)),
                SpinBudget::For(d) => loop {
                    if start.elapsed() >= d {
                        break false;
                    }
                    if poll(ready, UNTIMED_POLLS) {
                        break true;
                    }
                },
            };
            if rang {
                self.policy.record(Outcome::Spun);
                return Ok(());
            }
            ran_out = Some(start.elapsed());
        } else if plan == Plan::Yield {
            // The other side shares our core: no spin, but a few yields before sleeping.
            // When the scheduler runs the other side at one, what we wait for is there
            // with no futex call on either side; when it does not, they cost a few system
            // calls.
            let Ok(moved) = hand_over(|| Ok::<_, Infallible>(ready()));
            if moved {
                return Ok(());
            }
        }
        let Some(nap) = self.deadline.slice(LIVENESS_SLICE) else {
            return Err(self.deadline.timed_out(self.waiting_for));
        };
        if peer_gone() {
            return Err(Error::peer_gone(self.gone));
        }
        let slept_from = ran_out.map(|_| Instant::now());
        // The other side writes what `ready` sees (a stamp, the tail) before it rings.
        let rang = self.bell.sleep_unless(ready, nap);
        if let (Some(spun), Some(from), true) = (ran_out, slept_from, rang) {
            self.policy.record(Outcome::after_sleep(spun, from.elapsed()));
        }
        Ok(())
    }
}

/// Poll `ready` up to `polls` times, one pause between polls (as `Doorbell::spin`, whose
/// reasons apply: the budget is the caller's, counted in polls); then once more.
fn poll(ready: &dyn Fn() -> bool, polls: u32) -> bool {
    for _ in 0..polls {
        if ready() {
            return true;
        }
        spin_hint();
    }
    ready()
}
