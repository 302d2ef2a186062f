//! Slot credits: a producer reuses one of `slots` fixed slots only after the consumer said
//! it is done with the slot's previous use.
//!
//! The producer numbers its uses 0, 1, 2, …; use `seq` takes slot `seq % slots`. The
//! consumer, done with use `seq`, stores `freed = seq + 1` (uses are freed in order) and
//! rings a doorbell; the producer may start use `seq` once `seq − freed < slots`. Used by
//! the GPU bounce ring (`cuda::ring`), where "done" means the consumer's copy-out and the
//! event that orders the slot's next copy-in are enqueued.
//!
//! `freed` lives in memory a hostile consumer can write. The producer reads it as a claim
//! and checks it: a value past what was issued breaks the ring; a value that never
//! advances only makes waits time out. Modelled in `loom/tests/loom.rs` (`credits_*`).

use crate::doorbell::{Doorbell, DoorbellWords, FALSE_RINGS, UNTRUSTED_SLICE};
use crate::sync::{AtomicU64, Ordering};
use crate::wait::Wait;
use std::time::Duration;

/// Why a producer may not use its next slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CreditError {
    /// `freed` claims uses the producer never issued (hostile or corrupt consumer).
    Corrupt { freed: u64, issued: u64 },
    /// The consumer freed nothing for the whole timeout.
    Timeout,
    /// `gone()` said the consumer went away.
    Gone,
}

/// A view of the credit words in shared memory.
#[derive(Clone, Copy)]
pub struct Credits<'a> {
    freed: &'a AtomicU64,
    bell: Doorbell<'a>,
    slots: u64,
}

impl<'a> Credits<'a> {
    pub fn new(freed: &'a AtomicU64, bell: &'a DoorbellWords, slots: u64) -> Self {
        Credits { freed, bell: Doorbell::new(bell), slots: slots.max(1) }
    }

    /// Producer: may use `seq` (the next use; `seq` uses were issued before it) start now?
    pub fn poll(&self, seq: u64) -> Result<bool, CreditError> {
        // Acquire: pairs with the Release store in `free`; everything the consumer did
        // before freeing (enqueueing its copy-out and its release event) happens-before
        // the producer reuses the slot.
        let freed = self.freed.load(Ordering::Acquire);
        if freed > seq {
            return Err(CreditError::Corrupt { freed, issued: seq });
        }
        Ok(seq - freed < self.slots)
    }

    /// Producer: wait until use `seq` may start: spin `spin` polls (once per call), then
    /// sleep on the doorbell in slices of at most `slice` (checking `gone` between them),
    /// for as long as `wait` says in all.
    ///
    /// The consumer writes the doorbell, and can move it without freeing anything: a move
    /// only makes the producer look again. The spin is not renewed by a move, every look
    /// after the first checks the deadline, and after `doorbell::FALSE_RINGS` (16) wake-ups by the
    /// doorbell the call stops sleeping on it (plain sleeps of `doorbell::UNTRUSTED_SLICE` (1 ms), a look
    /// between), so a consumer playing with it costs a waiting producer no spinning core
    /// and no time past its deadline (an honest one frees the one use we wait for with
    /// its ring).
    pub fn wait(
        &self,
        seq: u64,
        spin: u32,
        wait: impl Into<Wait>,
        slice: Duration,
        gone: &dyn Fn() -> bool,
    ) -> Result<(), CreditError> {
        // The clock starts when the spin is over: the fast path reads none.
        let mut deadline = wait.into().deadline();
        let mut spin = deadline.spins(spin);
        let mut rings = 0;
        loop {
            let seen = self.bell.current();
            if self.poll(seq)? {
                return Ok(());
            }
            if self.bell.spin(seen, std::mem::take(&mut spin)) {
                continue;
            }
            let Some(nap) = deadline.slice(slice) else { return Err(CreditError::Timeout) };
            if gone() {
                return Err(CreditError::Gone);
            }
            if rings >= FALSE_RINGS {
                std::thread::sleep(nap.min(UNTRUSTED_SLICE));
            } else if self.bell.wait(seen, 0, nap) {
                rings += 1;
            }
        }
    }

    /// Consumer: use `seq` is done with (uses are freed in order).
    pub fn free(&self, seq: u64) {
        // Release: pairs with the producer's Acquire load in `poll`.
        self.freed.store(seq + 1, Ordering::Release);
        self.bell.ring();
    }

    /// What the consumer has freed so far (a claim, when read by the producer).
    pub fn freed(&self) -> u64 {
        // Acquire: as in `poll`.
        self.freed.load(Ordering::Acquire)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn words() -> (AtomicU64, DoorbellWords) {
        (AtomicU64::new(0), DoorbellWords::default())
    }

    #[test]
    fn slots_are_reused_only_after_free() {
        let (freed, bell) = words();
        let c = Credits::new(&freed, &bell, 2);
        assert_eq!(c.poll(0), Ok(true));
        assert_eq!(c.poll(1), Ok(true));
        assert_eq!(c.poll(2), Ok(false), "use 2 reuses slot 0, which use 0 still holds");
        c.free(0);
        assert_eq!(c.poll(2), Ok(true));
        assert_eq!(c.poll(3), Ok(false));
    }

    #[test]
    fn a_claim_past_what_was_issued_is_corrupt() {
        let (freed, bell) = words();
        let c = Credits::new(&freed, &bell, 4);
        freed.store(9, Ordering::Relaxed);
        assert_eq!(c.poll(3), Err(CreditError::Corrupt { freed: 9, issued: 3 }));
        let slice = Duration::from_millis(1);
        assert_eq!(c.wait(3, 0, Duration::from_secs(5), slice, &|| false), Err(CreditError::Corrupt { freed: 9, issued: 3 }));
    }

    #[test]
    fn waits_end_at_the_timeout_or_when_the_consumer_is_gone() {
        let (freed, bell) = words();
        let c = Credits::new(&freed, &bell, 1);
        let slice = Duration::from_millis(2);
        assert_eq!(c.wait(1, 10, Duration::from_millis(20), slice, &|| false), Err(CreditError::Timeout));
        assert_eq!(c.wait(1, 10, Duration::from_secs(60), slice, &|| true), Err(CreditError::Gone));
        let t = std::time::Instant::now();
        assert_eq!(c.wait(1, 0, Wait::Never, Duration::from_secs(60), &|| false), Err(CreditError::Timeout));
        assert!(t.elapsed() < Duration::from_secs(30), "not waiting is over at once");
    }

    #[test]
    fn a_free_on_another_thread_wakes_the_waiting_producer() {
        let (freed, bell) = words();
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                Credits::new(&freed, &bell, 1).free(0);
            });
            let c = Credits::new(&freed, &bell, 1);
            assert_eq!(c.wait(1, 0, Duration::from_secs(60), Duration::from_secs(60), &|| false), Ok(()));
        });
    }

    /// This thread's CPU time so far.
    fn thread_cpu() -> Duration {
        // SAFETY: clock_gettime writes one timespec into the value we own.
        let ts = unsafe {
            let mut ts: libc::timespec = std::mem::zeroed();
            assert_eq!(libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts), 0);
            ts
        };
        Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
    }

    /// A consumer that rings the credit doorbell without freeing anything (as fast as it
    /// can, waking sleepers each time) neither stretches the producer's wait past its
    /// timeout nor makes it spin: under a quarter of the wall time in CPU, and the
    /// timeout kept within 10% + 100 ms.
    #[test]
    fn a_bell_rung_for_nothing_neither_stretches_nor_spins_a_wait() {
        let (freed, bell) = words();
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    Doorbell::new(&bell).ring();
                    crate::sync::futex::wake_all(&bell.seq);
                }
            });
            let c = Credits::new(&freed, &bell, 1);
            let wait = Duration::from_millis(500);
            let (cpu0, t0) = (thread_cpu(), std::time::Instant::now());
            let r = c.wait(1, 2000, wait, Duration::from_millis(50), &|| false);
            let (wall, cpu) = (t0.elapsed(), thread_cpu() - cpu0);
            stop.store(true, Ordering::Relaxed);
            assert_eq!(r, Err(CreditError::Timeout));
            assert!(wall < wait + wait / 10 + Duration::from_millis(100), "the wait took {wall:?}");
            assert!(cpu * 4 < wall, "the wait used {cpu:?} of CPU in {wall:?}");
        });
    }
}
