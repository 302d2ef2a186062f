//! Waiting for the other side of a ring: the sender for space, the receiver for a
//! message — and a peer's control-message receive (`Connection`), which sleeps on the
//! message doorbell of the peer's lease table. All wait the same way: poll what they wait
//! for (the receiver the stamp of the next record, the sender the consumer's tail, a
//! connection its doorbell's sequence) while the side's [`SpinPolicy`] allows (not while
//! the other process shares our core), then sleep on the doorbell the other side rings,
//! in slices, checking between slices that the other process still lives, until the
//! caller's deadline.
//!
//! The doorbell is the other process's to write: it can move it without sending anything
//! (as fast as it can, backwards, to random values). A move only makes the caller look
//! again, and what one call spends on moves that bring nothing is bounded:
//! * the spin is per call: the first wait of a call spins (as its policy allows), and a
//!   later one only after a wait whose own look saw progress (a ring's stamp or tail; a
//!   connection's look is only the doorbell, so its call spins once);
//! * every wait of a call but the first checks the deadline first, so a call whose waits
//!   keep ending early still ends on time;
//! * a wake-up by the doorbell after which the caller found nothing (it waits again) is a
//!   *false ring*. After [`FALSE_RINGS`] of them in one call the doorbell is not slept on
//!   any more for the rest of the call: a connection sleeps in `poll(2)` on its socket and
//!   the peer's pidfd (which only a message or the peer's end wakes), a ring in plain
//!   sleeps of [`UNTRUSTED_SLICE`] with a look between. An honest peer rings after what
//!   it writes, so it causes at most a ring or two that a look finds already taken.

use crate::doorbell::{Doorbell, Slept, FALSE_RINGS, UNTRUSTED_SLICE};
use crate::error::{Error, Result};
use crate::sync::spin_hint;
use super::spin_policy::{hand_over, Outcome, Plan, SpinPolicy};
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

/// How a wait ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Woke {
    /// `ready` held: for a ring, progress (the caller's look validates it).
    Ready,
    /// The doorbell moved and `ready` did not hold.
    Rang,
    /// The sleep slice ran out.
    Slice,
}

/// How a call sleeps once its doorbell is not trusted (see the module docs).
pub(crate) enum Untrusted<'a> {
    /// Plain sleeps of [`UNTRUSTED_SLICE`] (a ring: its look is at shared memory).
    Sleep,
    /// Wait at most the given time for what the caller looks at to be ready (a
    /// connection: `poll(2)` on its socket and the peer's pidfd). Its end is a hint: the
    /// caller looks again either way.
    Until(&'a dyn Fn(Duration) -> Result<()>),
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
    /// `ready` is only a look at the doorbell (a connection), so it holding is no
    /// progress: only the caller returning is.
    ready_is_the_bell: bool,
    /// How this call's last wait ended (`None`: it has not waited yet).
    last: Option<Woke>,
    /// Wake-ups by the doorbell after which the caller found nothing.
    false_rings: u32,
    /// How to sleep after [`FALSE_RINGS`].
    untrusted: Untrusted<'a>,
}

impl<'a, 'd> Waiter<'a, 'd> {
    /// A ring's waiter: polls up to `spin` (a count of polls, or a time) before it
    /// sleeps; `ready` is a look at what the other side writes before it rings.
    pub(crate) fn new(
        bell: Doorbell<'a>,
        spin: impl Into<SpinBudget>,
        policy: &'a SpinPolicy,
        deadline: &'d mut Deadline,
        waiting_for: &'static str,
        gone: &'static str,
    ) -> Self {
        Waiter {
            bell,
            spin: spin.into(),
            policy,
            deadline,
            waiting_for,
            gone,
            ready_is_the_bell: false,
            last: None,
            false_rings: 0,
            untrusted: Untrusted::Sleep,
        }
    }

    /// A waiter whose `ready` only says the doorbell moved (a connection's receive: what
    /// it waits for is on the socket); once the doorbell is not trusted it waits with
    /// `untrusted`.
    pub(crate) fn for_the_bell_only(mut self, untrusted: &'a dyn Fn(Duration) -> Result<()>) -> Self {
        self.ready_is_the_bell = true;
        self.untrusted = Untrusted::Until(untrusted);
        self
    }

    /// The doorbell's sequence now (for a caller whose `ready` is "the sequence moved").
    pub(crate) fn current(&self) -> u32 {
        self.bell.current()
    }

    /// Doorbell wake-ups after which the caller found nothing, so far in this call.
    #[cfg(test)]
    pub(crate) fn false_rings(&self) -> u32 {
        self.false_rings
    }

    /// Wait for `ready` (a look at shared memory the other side writes before it rings):
    /// poll it (if this call may spin now and the policy allows), then (with the clock
    /// and a liveness check from `peer_gone`) sleep one slice on the doorbell — or, once
    /// the doorbell brought nothing [`FALSE_RINGS`] times, without it. Returns to let the
    /// caller look again (`ready` is a hint: the caller validates what it finds); fails
    /// past the deadline or once the peer is gone. Calling it again says that the look
    /// found nothing.
    pub(crate) fn wait(&mut self, ready: &dyn Fn() -> bool, peer_gone: &dyn Fn() -> bool) -> Result<()> {
        let again = self.last.take();
        // However the earlier waits of this call ended, it ends at its deadline (a spin
        // that a moving doorbell ends at once never reaches the sleep's check).
        if again.is_some() && self.deadline.expired() {
            return Err(self.deadline.timed_out(self.waiting_for));
        }
        // The spin is per call: renewed only by progress, never by a doorbell move.
        let may_spin = match again {
            None => true,
            Some(Woke::Ready) if !self.ready_is_the_bell => true,
            Some(Woke::Ready | Woke::Rang) => {
                self.false_rings = self.false_rings.saturating_add(1);
                false
            }
            Some(Woke::Slice) => false,
        };
        if self.false_rings >= FALSE_RINGS {
            return self.wait_untrusted(peer_gone);
        }
        let woke = self.spin_then_sleep(may_spin, ready, peer_gone)?;
        self.last = Some(woke);
        Ok(())
    }

    /// The doorbell brought nothing too often in this call: sleep one slice without it.
    fn wait_untrusted(&mut self, peer_gone: &dyn Fn() -> bool) -> Result<()> {
        let slice = match self.untrusted {
            Untrusted::Sleep => UNTRUSTED_SLICE,
            Untrusted::Until(_) => LIVENESS_SLICE,
        };
        let Some(nap) = self.deadline.slice(slice) else {
            return Err(self.deadline.timed_out(self.waiting_for));
        };
        if peer_gone() {
            return Err(Error::peer_gone(self.gone));
        }
        match self.untrusted {
            Untrusted::Sleep => std::thread::sleep(nap),
            Untrusted::Until(until) => until(nap)?,
        }
        self.last = Some(Woke::Slice);
        Ok(())
    }

    fn spin_then_sleep(&mut self, may_spin: bool, ready: &dyn Fn() -> bool, peer_gone: &dyn Fn() -> bool) -> Result<Woke> {
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
        // (`spin_policy` has the numbers). A spin of 0 sleeps at once, and so does a wait
        // that may not spin again in this call (the policy is not asked: it hears only
        // about waits that spun or yielded).
        let plan = if untimed == 0 || !may_spin { Plan::Sleep } else { self.policy.next() };
        if plan == Plan::Spin {
            if poll(ready, untimed) {
                self.policy.record(Outcome::Spun);
                return Ok(Woke::Ready);
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
                return Ok(Woke::Ready);
            }
            ran_out = Some(start.elapsed());
        } else if plan == Plan::Yield {
            // The other side shares our core: no spin, but a few yields before sleeping.
            // When the scheduler runs the other side at one, what we wait for is there
            // with no futex call on either side; when it does not, they cost a few system
            // calls.
            let Ok(moved) = hand_over(|| Ok::<_, Infallible>(ready()));
            if moved {
                return Ok(Woke::Ready);
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
        // The sleep is on the sequence just read: a doorbell that keeps moving ends it at
        // once, which the caller's next wait counts as a false ring.
        let woke = match self.bell.sleep_until(ready, nap) {
            Slept::Ready => Woke::Ready,
            Slept::Rang => Woke::Rang,
            Slept::TimedOut => Woke::Slice,
        };
        if let (Some(spun), Some(from), true) = (ran_out, slept_from, woke != Woke::Slice) {
            self.policy.record(Outcome::after_sleep(spun, from.elapsed()));
        }
        Ok(woke)
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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::doorbell::DoorbellWords;
    use crate::wait::Wait;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Run `waits` of one call against a doorbell another thread moves as fast as it can
    /// (waking sleepers): how many times the call waited, and its false rings.
    fn against_a_moving_bell(bell_only: bool, wait: Duration) -> (u32, u32, Result<()>) {
        let words = DoorbellWords::default();
        let stop = AtomicBool::new(false);
        let policy = SpinPolicy::default();
        std::thread::scope(|s| {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    Doorbell::new(&words).ring();
                    // A move that wakes sleepers whether or not they counted themselves.
                    crate::sync::futex::wake_all(&words.seq);
                }
            });
            let mut deadline = Wait::For(wait).deadline();
            let idle = |_: Duration| -> Result<()> {
                std::thread::sleep(UNTRUSTED_SLICE);
                Ok(())
            };
            let bell = Doorbell::new(&words);
            let w = Waiter::new(bell, 2000u32, &policy, &mut deadline, "a test", "gone");
            let mut w = if bell_only { w.for_the_bell_only(&idle) } else { w };
            let mut waits = 0;
            let r = loop {
                let seen = bell.current();
                let ready = || bell_only && bell.current() != seen;
                waits += 1;
                if let Err(e) = w.wait(&ready, &|| false) {
                    break Err(e);
                }
            };
            let false_rings = w.false_rings();
            stop.store(true, Ordering::Relaxed);
            (waits, false_rings, r)
        })
    }

    /// A doorbell that moves without what it announces: the call counts the rings that
    /// brought nothing, stops sleeping on the doorbell after `FALSE_RINGS` of them, and
    /// still ends at its deadline — for a ring's waiter (whose look is at shared memory)
    /// and a connection's (whose look is the doorbell itself).
    #[test]
    fn a_doorbell_that_rings_for_nothing_is_not_slept_on_for_long() {
        for bell_only in [false, true] {
            let t = Instant::now();
            let (waits, false_rings, r) = against_a_moving_bell(bell_only, Duration::from_millis(200));
            assert!(matches!(r, Err(Error::Timeout { .. })), "bell_only {bell_only}: {r:?}");
            assert!(t.elapsed() < Duration::from_millis(400), "bell_only {bell_only}: {:?}", t.elapsed());
            assert_eq!(false_rings, FALSE_RINGS, "bell_only {bell_only}");
            // FALSE_RINGS waits on the doorbell, then slices of 1 ms (a sleep at least
            // that long each): at most one wait per ms of the call, and the first ones.
            assert!(waits <= FALSE_RINGS + 1 + 200, "bell_only {bell_only}: {waits} waits in 200 ms");
        }
    }
}
