//! Cross-process wait/wake on a 32-bit sequence word in shared memory.
//!
//! `ring` bumps the sequence and issues a (non-private) `FUTEX_WAKE` only when the waiter
//! count says someone may be asleep. `wait` spins for a bounded budget, then registers as a
//! waiter and sleeps in `FUTEX_WAIT` on the sequence it last saw. No lost wake-up: the
//! waker's `seq += 1; load waiters` and the waiter's `waiters += 1; load seq` are all
//! SeqCst, so at least one of them sees the other's write (Dekker); and if the waker
//! skipped the wake, the waiter's FUTEX_WAIT compares against the old sequence and returns
//! at once. Modelled in `loom/tests/loom.rs`.
//!
//! Both words may be scribbled by a hostile peer. That can only cost wake-ups (every wait
//! has a timeout) or spurious FUTEX_WAKE calls; nothing is read from them but "changed?".

use crate::sync::{futex, spin_hint, AtomicU32, Ordering};
use crate::wait::Wait;

/// Wake-ups by a doorbell that brought nothing, in one blocking call, before the call
/// stops sleeping on that doorbell (the other process writes it, and can move it without
/// doing what a ring announces: as fast as it can, backwards, to random values). Each
/// costs a futex call and a look (a few µs); an honest peer causes one or two at most (a
/// ring that lags what it announced, which an earlier look already took). Used by every
/// wait on a peer's doorbell: `waiting::waiter` (rings, a connection's receive) and
/// `credits`.
pub(crate) const FALSE_RINGS: u32 = 16;

/// How such a call sleeps after [`FALSE_RINGS`] when it has nothing else to sleep on:
/// plain sleeps this long with a look between (a few µs each: well under 1% of a core;
/// what it waits for, if it comes, is seen within this).
pub(crate) const UNTRUSTED_SLICE: std::time::Duration = std::time::Duration::from_millis(1);

/// The two shared words a doorbell lives on.
#[repr(C)]
#[derive(Default)]
pub struct DoorbellWords {
    /// Bumped on every ring.
    pub seq: AtomicU32,
    /// Number of waiters that may be asleep in FUTEX_WAIT.
    pub waiters: AtomicU32,
}

/// Why [`Doorbell::sleep_until`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slept {
    /// What the caller waits for was there at the look before the sleep.
    Ready,
    /// The sequence moved (a ring; or a peer writing the word).
    Rang,
    /// The wait ran out.
    TimedOut,
}

/// A view of a doorbell's words (in shared memory, or anywhere for tests).
#[derive(Clone, Copy)]
pub struct Doorbell<'a> {
    words: &'a DoorbellWords,
}

impl<'a> Doorbell<'a> {
    pub fn new(words: &'a DoorbellWords) -> Self {
        Doorbell { words }
    }

    /// The current sequence. Acquire: pairs with the Release half of `ring`'s SeqCst
    /// fetch_add, so whatever the ringer wrote before ringing is visible after this load.
    pub fn current(&self) -> u32 {
        self.words.seq.load(Ordering::Acquire)
    }

    /// Wake whoever waits for a sequence other than the one before this ring.
    pub fn ring(&self) {
        // SeqCst (Release for the data published before the ring; SC with the waiter's
        // `waiters += 1` / `seq` load pair so one side sees the other).
        self.words.seq.fetch_add(1, Ordering::SeqCst);
        // SeqCst: pairs with the waiter's SeqCst `waiters.fetch_add` (see module docs).
        if self.words.waiters.load(Ordering::SeqCst) != 0 {
            futex::wake_all(&self.words.seq);
        }
    }

    /// Poll up to `spin` times for the sequence to differ from `seen` (no syscall).
    ///
    /// Not `crossbeam_utils::Backoff`: the budget is the caller's, counted in polls
    /// (`PeerConfig::ring_spin`, and the C and Python configs that carry it), and each
    /// poll is one pause so that a waiting side sees a ring within one cache-line
    /// transfer. Backoff's growing pauses (up to 64 per step) would add that much latency
    /// to every hand-off, its yields would spend the budget in syscalls, and its own limit
    /// would replace the configured one. Past the budget the wait sleeps in the futex.
    pub fn spin(&self, seen: u32, spin: u32) -> bool {
        for _ in 0..spin {
            if self.current() != seen {
                return true;
            }
            spin_hint();
        }
        self.current() != seen
    }

    /// Sleep until `ready` holds or the bell rings, at most as `wait` says: read the
    /// sequence, look, then sleep on the sequence read. The ringer makes `ready` true
    /// before it rings, so when the look finds nothing, the ring that follows comes after
    /// the read and ends the sleep (no lost wake-up; modelled in `loom/tests/loom_ring.rs`).
    /// Returns true if `ready` held or the bell rang, false if the wait ran out.
    pub fn sleep_unless(&self, ready: &dyn Fn() -> bool, wait: impl Into<Wait>) -> bool {
        self.sleep_until(ready, wait) != Slept::TimedOut
    }

    /// `sleep_unless`, saying why it returned: `ready` held, the bell rang (with `ready`
    /// false at the look: for a caller that counts rings that brought nothing), or the
    /// wait ran out.
    pub fn sleep_until(&self, ready: &dyn Fn() -> bool, wait: impl Into<Wait>) -> Slept {
        let seen = self.current();
        if ready() {
            Slept::Ready
        } else if self.wait(seen, 0, wait) {
            Slept::Rang
        } else {
            Slept::TimedOut
        }
    }

    /// Wait until the sequence differs from `seen`: spin `spin` times, then sleep.
    /// Returns false if the wait ran out first (`Wait::Forever` waits without limit; the
    /// transport always passes a limit).
    pub fn wait(&self, seen: u32, spin: u32, wait: impl Into<Wait>) -> bool {
        let mut deadline = wait.into().deadline();
        if self.spin(seen, deadline.spins(spin)) {
            return true;
        }
        // SeqCst: the waiter half of the Dekker pair with `ring`.
        self.words.waiters.fetch_add(1, Ordering::SeqCst);
        let changed = loop {
            // A read-modify-write, not a load: it reads the latest `seq` in modification
            // order, so if it still sees `seen`, the ringer's `fetch_add` comes later in
            // that order, synchronises with this RMW, and so sees our `waiters`
            // increment: no lost wake-up even under acquire/release alone (a SeqCst load
            // would do in C11; loom models SeqCst more weakly). Only on the sleep path.
            if self.words.seq.fetch_add(0, Ordering::SeqCst) != seen {
                break true;
            }
            let remaining = deadline.remaining();
            if remaining.is_some_and(|r| r.is_zero()) {
                break false;
            }
            futex::wait(&self.words.seq, seen, remaining);
        };
        // Relaxed: only a hint for `ring`; a stale count costs one spare FUTEX_WAKE.
        self.words.waiters.fetch_sub(1, Ordering::Relaxed);
        changed
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    #[test]
    fn wait_times_out_then_wakes() {
        let w = Arc::new(DoorbellWords::default());
        let d = Doorbell::new(&w);
        let ring_later = || {
            let w = w.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(30));
                Doorbell::new(&w).ring();
            })
        };
        let seen = d.current();
        assert!(!d.wait(seen, 10, Duration::from_millis(20)));
        // Not waiting is over at once.
        let t = Instant::now();
        assert!(!d.wait(seen, 0, Wait::Never));
        assert!(t.elapsed() < Duration::from_secs(1));
        let t = ring_later();
        assert!(d.wait(seen, 0, Duration::from_secs(10)));
        t.join().unwrap();
        // A timeout too long for the clock is no limit (the ring ends it), not zero.
        let seen = d.current();
        let t = ring_later();
        assert!(d.wait(seen, 0, Duration::MAX));
        t.join().unwrap();
    }
}
