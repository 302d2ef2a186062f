//! When a wait may spin: not while the process it waits for shares our core.
//!
//! Every blocking receive here spins before it sleeps (the socket receive polls and yields
//! for up to `PeerConfig::recv_spin`, a ring wait polls its doorbell up to
//! `PeerConfig::ring_spin` times): a reply that comes within the spin is taken without a
//! wake-up. That pays only while the other process runs on another core. When both run on
//! one core — which the scheduler often chooses on its own (a woken process is placed next
//! to its waker when no core is idle; two processes that never sleep are not re-placed at
//! all), and which `taskset -c 0` forces — the reply cannot come until we stop:
//!
//! * a ring spin (pause, poll) holds the core for its whole budget every time;
//! * a socket spin yields, which hands the core over only if the scheduler picks the other
//!   process at that yield — and with EEVDF it need not (a yield reorders only the
//!   yielder's own group, and only while it is eligible).
//!
//! So each waiting side keeps a [`SpinPolicy`], fed with what its waits found
//! ([`Outcome`]). A spin that saw the reply keeps spinning on. Signs that the core is
//! shared — the spin ran out and the reply came soon after we went to sleep (the other
//! side needed our core), or the reply came with a step of a yielding spin that ran
//! another task for a turn (the yield handed it our core) — in two waits in a row stop
//! spinning for a pause of 1, 2, 4 … up to [`MAX_PAUSE`] waits, each pause ended by
//! one wait that probes with a spin again (so two processes the scheduler separates get
//! their spin back within one pause). The first wait of a pause sleeps at once: its
//! wake-up lets the scheduler place the two processes on different cores if one is idle
//! (it picks an idle core for a woken process). The others yield the core a few times
//! ([`hand_over`]), then sleep: when the scheduler runs the other side at one of those
//! yields, the reply is there without a wake-up; when it does not, they cost a few system
//! calls, not a spin's window. A spin that ran out before a
//! long sleep (the other side was busy or idle), or whose reply came while a busy task
//! held our core for a time slice, says nothing about where the other side runs and
//! changes nothing. The configured spin stays a cap: the policy only ever spins less (and
//! a configured spin of 0 still sleeps at once, without the yields). `docs/measurements.md`
//! ("Spinning, and not while the other side shares our core") has what was measured, and
//! where the thresholds below come from.
//!
//! Private state of one process, read and written by the waits of one side: nothing here
//! is read from memory or messages the peer writes. A peer shapes it only by when it
//! replies, which at worst makes us spin (within the cap) or sleep.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Most waits in a row that do not spin before one probes with a spin again.
pub(crate) const MAX_PAUSE: u32 = 256;

/// A sleep after a spin that ran out counts as "soon" if it lasted at most this many
/// times the spin. Co-scheduled, the sleep holds the other side's work plus its own
/// spin (as long as ours with the same settings); on another core a reply this close
/// after a full spin that saw nothing would be a coincidence.
const SOON: u32 = 2;

/// A step of a yielding spin (one poll and one yield) that took longer than this let
/// another task run on our core: well above a step with nobody else to run, well below
/// the other process's turn of a round trip.
pub(crate) const HANDED_OVER: Duration = Duration::from_micros(3);

/// A step longer than this ran a task for a time slice: a CPU-bound task that preempted
/// us, not the other side's reply turn.
pub(crate) const TIME_SLICE: Duration = Duration::from_micros(200);

/// What one wait that spun found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The spin saw what it waited for with our core to itself: spinning pays.
    Spun,
    /// The side we wait for runs on our core: the spin ran out and the reply came soon
    /// after we slept, or came with a yield that ran another task for a turn.
    CoreShared,
    /// Nothing about where the other side runs: the spin ran out and the sleep after it
    /// was long (the other side was busy or idle), or the reply came while a task ran on
    /// our core for a time slice (a CPU-bound one that preempted us).
    Unclear,
}

impl Outcome {
    /// A wait whose spin ran out after `spun` and whose sleep then ended, with what it
    /// waited for, after `slept`.
    pub(crate) fn after_sleep(spun: Duration, slept: Duration) -> Outcome {
        if slept <= spun.saturating_mul(SOON) { Outcome::CoreShared } else { Outcome::Unclear }
    }
}

/// How the next wait of a side goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Spin (up to the configured cap), then sleep.
    Spin,
    /// The other side shares our core: sleep at once (the first wait of a pause, whose
    /// wake-up lets the scheduler move one of the two processes to an idle core).
    Sleep,
    /// The other side shares our core: yield it the core a few times ([`hand_over`]),
    /// then sleep.
    Yield,
}

/// How a waiting side waits (see the module docs). One per waiting side (a connection's
/// receive, a ring's receiver, a ring's sender), shared by its waits.
///
/// Relaxed loads and stores, not read-modify-writes: waits of one side are serialised
/// (or, when two threads wait on one ring at once, a lost update only shifts a pause by a
/// wait); the words publish nothing.
#[derive(Debug, Default)]
pub(crate) struct SpinPolicy {
    /// Waits left in the current pause (they do not spin).
    skip: AtomicU32,
    /// Length of the last pause (0: spinning, no pause since the last spin that paid);
    /// each probe that finds the core still shared doubles it, up to `MAX_PAUSE`.
    pause: AtomicU32,
    /// While spinning: the last wait that spun found the core shared. One such wait alone
    /// does not pause spinning, two in a row do: with the other side on another core a
    /// stray one happens now and then, and a pause costs its waits a wake-up each.
    armed: AtomicBool,
}

impl SpinPolicy {
    /// How the wait about to start goes (only asked by waits whose cap allows a spin).
    /// A wait that may not spin counts the pause down.
    pub(crate) fn next(&self) -> Plan {
        let skip = self.skip.load(Ordering::Relaxed);
        if skip == 0 {
            return Plan::Spin;
        }
        self.skip.store(skip - 1, Ordering::Relaxed);
        if skip == self.pause.load(Ordering::Relaxed) { Plan::Sleep } else { Plan::Yield }
    }

    /// What a wait that spun found.
    pub(crate) fn record(&self, outcome: Outcome) {
        match outcome {
            Outcome::Spun => {
                self.pause.store(0, Ordering::Relaxed);
                self.armed.store(false, Ordering::Relaxed);
            }
            Outcome::CoreShared => {
                let last = self.pause.load(Ordering::Relaxed);
                if last == 0 && !self.armed.swap(true, Ordering::Relaxed) {
                    return;
                }
                let pause = last.saturating_mul(2).clamp(1, MAX_PAUSE);
                self.pause.store(pause, Ordering::Relaxed);
                self.skip.store(pause, Ordering::Relaxed);
            }
            Outcome::Unclear => {}
        }
    }
}

/// Most yields a `Plan::Yield` wait makes, to hand our core to the other side, before it
/// sleeps. On one core the scheduler often runs the other side only at the
/// second or third yield, or preempts its turn and comes back to us before the reply; a
/// few yields then save a sleep and a wake-up. When yields hand nothing over, they cost
/// this many system calls, not a spin's window.
pub(crate) const HAND_OVER_YIELDS: u32 = 4;

/// `Plan::Yield`: yield our core until `arrived` says the reply is there (true), at most
/// `HAND_OVER_YIELDS` times (false: sleep).
pub(crate) fn hand_over<E>(mut arrived: impl FnMut() -> Result<bool, E>) -> Result<bool, E> {
    for _ in 0..HAND_OVER_YIELDS {
        std::thread::yield_now();
        if arrived()? {
            return Ok(true);
        }
    }
    Ok(false)
}

/// What ran on our core during one step of a yielding spin (one poll and one yield).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Nobody else: the step was short.
    Alone,
    /// Another task ran for a turn (longer than [`HANDED_OVER`]): if the reply came with
    /// it, the other side ran on our core.
    Turn,
    /// Another task ran for a time slice (longer than [`TIME_SLICE`]).
    Slice,
}

/// The clock of a yielding spin: started at the spin's first poll, read once per step.
pub(crate) struct SpinClock {
    start: Instant,
    last: Instant,
}

impl SpinClock {
    pub(crate) fn start(now: Instant) -> SpinClock {
        SpinClock { start: now, last: now }
    }

    /// A step ended at `now`: what ran on our core meanwhile.
    pub(crate) fn step(&mut self, now: Instant) -> Step {
        let took = now.saturating_duration_since(self.last);
        self.last = now;
        if took > TIME_SLICE {
            Step::Slice
        } else if took > HANDED_OVER {
            Step::Turn
        } else {
            Step::Alone
        }
    }

    /// How long the spin has lasted at `now`.
    pub(crate) fn spun(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.start)
    }

    /// What a spin whose step `step` saw the reply found.
    pub(crate) fn outcome(step: Step) -> Outcome {
        match step {
            Step::Alone => Outcome::Spun,
            Step::Turn => Outcome::CoreShared,
            Step::Slice => Outcome::Unclear,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    /// The next `n` waits of `p`: `s` spins, `z` sleeps at once, `y` yields then sleeps.
    fn next(p: &SpinPolicy, n: usize) -> String {
        (0..n)
            .map(|_| match p.next() {
                Plan::Spin => 's',
                Plan::Sleep => 'z',
                Plan::Yield => 'y',
            })
            .collect()
    }

    /// The next `n` waits of `p` once it has recorded `outcomes`.
    fn after(p: &SpinPolicy, outcomes: &[Outcome], n: usize) -> String {
        outcomes.iter().for_each(|&o| p.record(o));
        next(p, n)
    }

    #[test]
    fn spins_while_spinning_pays() {
        let p = SpinPolicy::default();
        assert_eq!(next(&p, 5), "sssss");
        for _ in 0..100 {
            assert_eq!(after(&p, &[Outcome::Spun], 1), "s");
        }
    }

    #[test]
    fn one_wait_that_finds_the_core_shared_does_not_pause_two_in_a_row_do() {
        let p = SpinPolicy::default();
        assert_eq!(after(&p, &[Outcome::CoreShared], 3), "sss");
        // A spin that pays in between: the next one alone does not pause either.
        assert_eq!(after(&p, &[Outcome::Spun, Outcome::CoreShared], 3), "sss");
        // An unclear wait in between does not disarm.
        assert_eq!(after(&p, &[Outcome::Unclear, Outcome::CoreShared], 3), "zss");
    }

    #[test]
    fn a_shared_core_pauses_spinning_for_doubling_pauses_each_ended_by_one_probe() {
        let p = SpinPolicy::default();
        // The first wait that finds the core shared only arms the policy.
        p.record(Outcome::CoreShared);
        let mut pauses = Vec::new();
        for _ in 0..11 {
            // The second wait, then each probe, spins and finds the core shared.
            p.record(Outcome::CoreShared);
            let mut pause = String::new();
            loop {
                match p.next() {
                    Plan::Spin => break, // the probe: recorded by the next round
                    Plan::Sleep => pause.push('z'),
                    Plan::Yield => pause.push('y'),
                }
                assert!(pause.len() <= MAX_PAUSE as usize, "a pause longer than MAX_PAUSE");
            }
            // Each pause opens with one sleep (a chance to be placed apart), then yields.
            assert_eq!(pause, format!("z{}", "y".repeat(pause.len() - 1)));
            pauses.push(pause.len());
        }
        assert_eq!(pauses, [1, 2, 4, 8, 16, 32, 64, 128, 256, 256, 256]);
    }

    #[test]
    fn a_probe_that_pays_resumes_spinning_and_the_next_pause_starts_short() {
        let p = SpinPolicy::default();
        p.record(Outcome::CoreShared);
        for _ in 0..4 {
            p.record(Outcome::CoreShared);
            while p.next() != Plan::Spin {}
        }
        // The probe saw the reply on its own core: spinning is back, for good.
        assert_eq!(after(&p, &[Outcome::Spun], 10), "ssssssssss");
        // Shared again later: two in a row, and the pause starts over at one wait.
        assert_eq!(after(&p, &[Outcome::CoreShared, Outcome::CoreShared], 3), "zss");
    }

    #[test]
    fn an_unclear_wait_neither_pauses_nor_ends_a_pause() {
        let p = SpinPolicy::default();
        assert_eq!(after(&p, &[Outcome::Unclear], 3), "sss");
        // A pause of 2, then an unclear wait (as a probe would record it): the pause runs on.
        assert_eq!(after(&p, &[Outcome::CoreShared, Outcome::CoreShared, Outcome::CoreShared, Outcome::Unclear], 3), "zys");
        // The doubling carries on from where it was: Unclear did not reset it.
        assert_eq!(after(&p, &[Outcome::CoreShared], 5), "zyyys");
    }

    #[test]
    fn a_sleep_soon_after_a_spin_that_ran_out_means_a_shared_core() {
        // Measured shapes: a socket spin of 50 µs whose yields did not hand over, then the
        // reply 5 µs into the sleep; a ring spin of 22 µs, then the other side's own spin
        // and reply, 25 µs.
        assert_eq!(Outcome::after_sleep(50 * US, 5 * US), Outcome::CoreShared);
        assert_eq!(Outcome::after_sleep(22 * US, 25 * US), Outcome::CoreShared);
        assert_eq!(Outcome::after_sleep(22 * US, 44 * US), Outcome::CoreShared);
        // Longer: the other side was busy or idle.
        assert_eq!(Outcome::after_sleep(22 * US, 45 * US), Outcome::Unclear);
        assert_eq!(Outcome::after_sleep(50 * US, Duration::from_millis(3)), Outcome::Unclear);
        assert_eq!(Outcome::after_sleep(Duration::MAX, Duration::MAX), Outcome::CoreShared);
    }

    #[test]
    fn a_hand_over_yields_until_the_reply_is_there_and_no_more_than_its_cap() {
        let mut looks = 0;
        assert_eq!(hand_over(|| Ok::<_, ()>({ looks += 1; looks == 3 })), Ok(true));
        assert_eq!(looks, 3, "it stops at the look that sees the reply");
        looks = 0;
        assert_eq!(hand_over(|| Ok::<_, ()>({ looks += 1; false })), Ok(false));
        assert_eq!(looks, HAND_OVER_YIELDS, "then it sleeps");
        assert_eq!(hand_over(|| Err::<bool, _>("poll failed")), Err("poll failed"));
    }

    #[test]
    fn a_reply_that_comes_with_a_turn_of_another_task_means_a_shared_core() {
        let t0 = Instant::now();
        let mut c = SpinClock::start(t0);
        // Steps of poll + yield with nobody else to run.
        let mut t = t0 + US / 2;
        assert_eq!(c.step(t), Step::Alone);
        t += HANDED_OVER;
        assert_eq!(c.step(t), Step::Alone);
        // A yield that ran the other process for its turn (measured: 5–18 µs).
        t += 5 * US;
        assert_eq!(c.step(t), Step::Turn);
        t += TIME_SLICE;
        assert_eq!(c.step(t), Step::Turn);
        // A busy task that preempted us for its time slice.
        t += TIME_SLICE + US;
        assert_eq!(c.step(t), Step::Slice);
        assert_eq!(c.spun(t), US / 2 + HANDED_OVER + 5 * US + TIME_SLICE + TIME_SLICE + US);
        // A clock read before the last one (never, but no panic): nobody ran.
        assert_eq!(c.step(t0), Step::Alone);
        // The reply seen at the end of each kind of step.
        assert_eq!(SpinClock::outcome(Step::Alone), Outcome::Spun);
        assert_eq!(SpinClock::outcome(Step::Turn), Outcome::CoreShared);
        assert_eq!(SpinClock::outcome(Step::Slice), Outcome::Unclear);
    }
}
