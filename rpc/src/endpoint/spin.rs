//! How the RPC's waits spin: busy looks that never yield the CPU, ended early by the first
//! sign that another task wants it, and not at all for a while after such signs.
//!
//! A wait for the peer's frame (the reader thread's, a leading caller's) or for the lead
//! (a follower's) looks again for up to `RpcConfig::spin` before it sleeps: a frame that
//! comes within the spin costs no sleep and wake-up. What the spin must not do is give
//! the CPU away. A `sched_yield` does exactly that when another runnable task shares our
//! CPU: the scheduler (EEVDF) moves the yielding thread's deadline a whole slice on, so a
//! CPU-bound task runs until the next scheduler tick, and our thread — runnable, not
//! asleep — is not woken by the frame it waits for (a wake-up would preempt the busy task;
//! being runnable does not). Every call then waits for a tick. So a step of the spin is
//! one look and a `spin_loop` hint, and the spin watches the clock between looks: a gap
//! over [`PREEMPTED`] means a CPU-bound task held this thread's CPU for a time slice, and
//! the spin stops and the wait sleeps (in `poll`, or on the call's channel), where the
//! frame's arrival wakes it. A shorter gap (the peer's turn on our CPU, an interrupt)
//! changes nothing: the spin goes on.
//!
//! A sign also pauses the spin for the next waits of the endpoint ([`SpinGate`]): 1, 2,
//! 4 … up to [`MAX_PAUSE`] waits sleep at once, each pause ended by one wait that spins
//! again as a probe (its frame seen within the spin, unpreempted, ends the pausing). While
//! CPUs are contended every spin risks the tick that preempts it; the sleeping waits do
//! not, and are woken as a sleeping thread is: at once, ahead of a busy task. A stray sign
//! on an idle machine (an interrupt) costs one wait its spin.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// A gap between two looks of a spin longer than this means another task held this
/// thread's CPU for a time slice: a look (a `poll` with no timeout, or a lock attempt)
/// takes about a microsecond, a short task's turn (the peer's, or an interrupt's) tens,
/// and a CPU-bound task that preempted us at a tick holds the CPU for milliseconds.
pub(super) const PREEMPTED: Duration = Duration::from_micros(200);

/// Most waits in a row that sleep at once before one spins again as a probe.
pub(super) const MAX_PAUSE: u32 = 256;

/// Whether the waits of one endpoint may spin (see the module docs). Private state of
/// this process; the peer shapes it only by when it answers.
pub(super) struct SpinGate {
    /// Waits left that sleep at once.
    paused: AtomicU32,
    /// Length of the next pause (doubles with each sign, back to 1 after a spin that paid).
    next: AtomicU32,
}

impl SpinGate {
    pub(super) fn new() -> SpinGate {
        SpinGate { paused: AtomicU32::new(0), next: AtomicU32::new(1) }
    }

    /// A spin for a wait that may spin up to `cap`: none while paused.
    pub(super) fn spin(&self, cap: Duration) -> Spin<'_> {
        // Relaxed (all three fields): counters of a heuristic; nothing is published through
        // them, and two waits racing on them at worst spin or sleep once more than planned.
        let paused = self.paused.load(Ordering::Relaxed);
        let cap = if paused > 0 {
            self.paused.store(paused - 1, Ordering::Relaxed);
            Duration::ZERO
        } else {
            cap
        };
        let now = Instant::now();
        Spin { gate: self, until: now + cap, last: now, probe: !cap.is_zero(), spun: false, paused: paused > 0 }
    }

    fn preempted(&self) {
        // Relaxed: as in `spin`.
        let n = self.next.load(Ordering::Relaxed);
        self.paused.store(n, Ordering::Relaxed);
        self.next.store((n * 2).min(MAX_PAUSE), Ordering::Relaxed);
    }

    fn paid(&self) {
        // Relaxed: as in `spin`.
        self.next.store(1, Ordering::Relaxed);
    }
}

/// One wait's spin: ask [`Spin::again`] after each look that found nothing.
pub(super) struct Spin<'a> {
    gate: &'a SpinGate,
    until: Instant,
    last: Instant,
    /// Whether this spin is still on (neither ran out nor ended).
    probe: bool,
    /// Whether it looked again at least once (a find at the first look says nothing
    /// about spinning).
    spun: bool,
    /// Whether this wait sleeps at once because the endpoint's spins are paused.
    paused: bool,
}

impl Spin<'_> {
    /// After a look that found nothing: whether to look again now (true, after a
    /// `spin_loop` hint) or sleep (the spin ran out, or the thread was preempted since the
    /// last look, which also pauses the endpoint's spins).
    pub(super) fn again(&mut self) -> bool {
        if !self.probe {
            return false;
        }
        let now = Instant::now();
        if now.saturating_duration_since(self.last) > PREEMPTED {
            self.probe = false;
            self.gate.preempted();
            return false;
        }
        if now >= self.until {
            self.probe = false;
            return false;
        }
        self.last = now;
        self.spun = true;
        std::hint::spin_loop();
        true
    }

    /// A look found something (a frame, the lead) while spinning: the spin ends, and it
    /// paid unless this thread was preempted since the last look (then that is the sign).
    pub(super) fn found(&mut self) {
        if !self.probe {
            return;
        }
        self.probe = false;
        if Instant::now().saturating_duration_since(self.last) > PREEMPTED {
            self.gate.preempted();
        } else if self.spun {
            self.gate.paid();
        }
    }

    /// Whether this wait does not spin because the endpoint's spins are paused: CPU-bound
    /// tasks took our CPU lately.
    pub(super) fn paused(&self) -> bool {
        self.paused
    }

    /// No spin for this wait after all (the thread may not leave its peer's CPU).
    pub(super) fn stop(&mut self) {
        self.probe = false;
    }

    /// Whether the spin is still on (it neither ran out nor was ended).
    pub(super) fn spinning(&self) -> bool {
        self.probe && Instant::now() < self.until
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_preempted_spin_stops_and_pauses_the_next_waits_doubling() {
        let gate = SpinGate::new();
        let cap = Duration::from_secs(1);
        let mut s = gate.spin(cap);
        assert!(s.again());
        s.last -= PREEMPTED * 2; // as if the thread was off its CPU since the last look
        assert!(!s.again(), "a preempted spin must stop");
        // One wait sleeps at once, then one probes.
        let mut paused = gate.spin(cap);
        assert!(paused.paused() && !paused.again());
        let mut probe = gate.spin(cap);
        assert!(probe.again());
        probe.last -= PREEMPTED * 2;
        assert!(!probe.again());
        // The second sign in a row pauses two waits.
        assert!(!gate.spin(cap).again());
        assert!(!gate.spin(cap).again());
        let mut probe = gate.spin(cap);
        assert!(probe.again());
        // A probe that finds its frame unpreempted ends the doubling.
        probe.found();
        let mut s = gate.spin(cap);
        assert!(s.again());
        s.last -= PREEMPTED * 2;
        assert!(!s.again());
        assert!(!gate.spin(cap).again());
        assert!(gate.spin(cap).again(), "after a spin that paid, one sign pauses one wait");
    }

    #[test]
    fn pauses_stop_growing_at_the_cap() {
        let gate = SpinGate::new();
        for _ in 0..20 {
            let mut s = gate.spin(Duration::from_secs(1));
            while s.probe && s.again() {
                s.last -= PREEMPTED * 2;
            }
            while gate.paused.load(Ordering::Relaxed) > 0 {
                assert!(!gate.spin(Duration::from_secs(1)).again());
            }
        }
        assert_eq!(gate.next.load(Ordering::Relaxed), MAX_PAUSE);
    }

    #[test]
    fn a_spin_runs_out_at_its_cap_without_a_sign() {
        let gate = SpinGate::new();
        let mut s = gate.spin(Duration::from_secs(1));
        assert!(s.again() && s.spinning());
        // Its time is up, and the last look was just now (no gap: not preempted).
        s.until = Instant::now();
        s.last = s.until;
        assert!(!s.again() && !s.spinning());
        assert_eq!(gate.paused.load(Ordering::Relaxed), 0, "running out is no sign of contention");
        assert!(gate.spin(Duration::from_secs(1)).again(), "the next wait spins");
        assert!(!gate.spin(Duration::ZERO).again(), "a zero cap never spins");
    }
}
