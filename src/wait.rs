//! How long a blocking call may wait: one vocabulary for every blocking call.
//!
//! Every blocking call of the crate takes `impl Into<Wait>`: a [`Duration`] (at most that
//! long), an [`Instant`] (until then), an `Option<Duration>` (`None`: no limit), or one of
//! the variants ([`Wait::Never`]: do not block, [`Wait::Forever`]: no limit). The C ABI says
//! the same with `int64_t timeout_ms` (negative: no limit, 0: do not wait), Python with
//! `timeout: Optional[float]` seconds (`None`: no limit, 0: do not wait).
//!
//! Inside a call, a `Deadline` (crate-private) is the wait's clock: started once (the first time the call
//! would block, so a fast path reads no clock), saturating (a timeout too long to add to
//! `Instant::now()` is no limit, never an overflow), handed by reference to the inner waits
//! (poll, futex, ring space) so they share one end, and naming what the caller asked for
//! when it runs out.

use crate::error::Error;
use std::time::{Duration, Instant};

/// How long a blocking call may wait (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Wait {
    /// Do not block: take what is ready now, else fail with `Error::Timeout` at once.
    Never,
    /// At most this long from the call (`Duration::ZERO`: as `Never`; a duration too long
    /// for the clock: as `Forever`).
    For(Duration),
    /// Until this instant (one already past: as `Never`).
    Until(Instant),
    /// No limit.
    Forever,
}

impl From<Duration> for Wait {
    fn from(d: Duration) -> Wait {
        Wait::For(d)
    }
}

impl From<Instant> for Wait {
    fn from(t: Instant) -> Wait {
        Wait::Until(t)
    }
}

/// `None`: no limit; `Some(d)`: at most `d`.
impl From<Option<Duration>> for Wait {
    fn from(d: Option<Duration>) -> Wait {
        d.map_or(Wait::Forever, Wait::For)
    }
}

impl Wait {
    /// This wait's clock, for one blocking call; it starts when first read.
    pub(crate) fn deadline(self) -> Deadline {
        Deadline { wait: self, clock: None }
    }
}

/// One blocking call's clock (see the module docs). Pass it by `&mut` to inner waits: a
/// copy would start its own clock.
#[derive(Debug)]
pub(crate) struct Deadline {
    wait: Wait,
    clock: Option<Clock>,
}

#[derive(Debug, Clone, Copy)]
struct Clock {
    /// `None`: no limit.
    end: Option<Instant>,
    /// What the caller asked for, for the error: the timeout, or from the call's start to
    /// its instant.
    asked: Duration,
}

impl Deadline {
    fn clock(&mut self) -> Clock {
        let wait = self.wait;
        *self.clock.get_or_insert_with(|| {
            let now = Instant::now();
            match wait {
                Wait::Never => Clock { end: Some(now), asked: Duration::ZERO },
                // Saturating: a timeout past what an `Instant` can hold is no limit.
                Wait::For(d) => Clock { end: now.checked_add(d), asked: d },
                Wait::Until(t) => Clock { end: Some(t), asked: t.saturating_duration_since(now) },
                Wait::Forever => Clock { end: None, asked: Duration::MAX },
            }
        })
    }

    /// Start the clock now (if it has not started): before a call's first step that could
    /// take time, so that everything after it counts.
    pub(crate) fn start(&mut self) {
        self.clock();
    }

    /// Polls to spend before sleeping: `spin`, or none when the caller asked not to wait.
    pub(crate) fn spins(&self, spin: u32) -> u32 {
        if matches!(self.wait, Wait::Never | Wait::For(Duration::ZERO)) { 0 } else { spin }
    }

    /// What is left: `None` for no limit, zero once the deadline passed.
    pub(crate) fn remaining(&mut self) -> Option<Duration> {
        if self.wait == Wait::Never {
            return Some(Duration::ZERO);
        }
        self.clock().end.map(|e| e.saturating_duration_since(Instant::now()))
    }

    /// What is left, at most `slice` (for waits that wake up now and then to check that
    /// the peer is alive); `None` once the deadline passed.
    pub(crate) fn slice(&mut self, slice: Duration) -> Option<Duration> {
        match self.remaining() {
            None => Some(slice),
            Some(r) if r.is_zero() => None,
            Some(r) => Some(r.min(slice)),
        }
    }

    /// True once the deadline passed (at once for `Wait::Never`).
    pub(crate) fn expired(&mut self) -> bool {
        self.remaining().is_some_and(|r| r.is_zero())
    }

    /// The same end as a `Wait`, for an inner call that reports only "in time or not".
    pub(crate) fn as_wait(&mut self) -> Wait {
        if self.wait == Wait::Never {
            return Wait::Never;
        }
        self.clock().end.map_or(Wait::Forever, Wait::Until)
    }

    /// The error for a wait for `what` that ran out: it names what the caller asked for.
    pub(crate) fn timed_out(&mut self, what: &'static str) -> Error {
        Error::Timeout { what, after: self.clock().asked }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn conversions_say_what_the_caller_wrote() {
        let d = Duration::from_millis(5);
        let t = Instant::now() + d;
        assert_eq!(Wait::from(d), Wait::For(d));
        assert_eq!(Wait::from(t), Wait::Until(t));
        assert_eq!(Wait::from(Some(d)), Wait::For(d));
        assert_eq!(Wait::from(None::<Duration>), Wait::Forever);
    }

    #[test]
    fn never_and_zero_are_over_at_once() {
        for w in [Wait::Never, Wait::For(Duration::ZERO), Wait::Until(Instant::now())] {
            let mut dl = w.deadline();
            assert!(dl.expired(), "{w:?}");
            assert_eq!(dl.remaining(), Some(Duration::ZERO), "{w:?}");
            assert_eq!(dl.slice(Duration::from_secs(1)), None, "{w:?}");
            assert_eq!(dl.spins(100), if matches!(w, Wait::Until(_)) { 100 } else { 0 }, "{w:?}");
            assert_eq!(dl.as_wait().deadline().remaining(), Some(Duration::ZERO), "{w:?}");
        }
        assert!(Wait::Until(Instant::now() - Duration::from_secs(1)).deadline().expired());
    }

    #[test]
    fn huge_timeouts_saturate_to_no_limit_not_to_zero() {
        for w in [Wait::For(Duration::MAX), Wait::For(Duration::from_secs(u64::MAX / 2)), Wait::Forever] {
            let mut dl = w.deadline();
            assert!(!dl.expired(), "{w:?}");
            assert_eq!(dl.remaining(), None, "{w:?}");
            assert_eq!(dl.slice(Duration::from_millis(3)), Some(Duration::from_millis(3)), "{w:?}");
            assert_eq!(dl.as_wait(), Wait::Forever, "{w:?}");
            assert_eq!(dl.spins(100), 100, "{w:?}");
        }
        // Long but representable: a real end, far away.
        let year = Duration::from_secs(365 * 24 * 3600);
        let r = Wait::For(year).deadline().remaining().unwrap();
        assert!(r > year - Duration::from_secs(60) && r <= year, "{r:?}");
    }

    #[test]
    fn the_clock_starts_once_and_counts_down() {
        let mut dl = Wait::For(Duration::from_millis(300)).deadline();
        dl.start();
        let end = match dl.as_wait() {
            Wait::Until(t) => t,
            w => panic!("{w:?}"),
        };
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(dl.as_wait(), Wait::Until(end), "a started clock keeps its end");
        let r = dl.remaining().unwrap();
        assert!(r <= Duration::from_millis(280) && r > Duration::ZERO, "{r:?}");
        assert_eq!(dl.slice(Duration::from_millis(1)), Some(Duration::from_millis(1)));
    }

    #[test]
    fn the_timeout_error_names_what_was_asked() {
        let msg = |e: Error| e.to_string();
        let mut dl = Wait::For(Duration::from_millis(50)).deadline();
        assert_eq!(msg(dl.timed_out("x")), "timed out after 50ms waiting for x");
        let mut dl = Wait::Until(Instant::now() + Duration::from_secs(2)).deadline();
        match dl.timed_out("x") {
            Error::Timeout { after, .. } => assert!(after > Duration::from_millis(1900) && after <= Duration::from_secs(2)),
            e => panic!("{e}"),
        }
        assert_eq!(msg(Wait::Never.deadline().timed_out("x")), "timed out at once (no wait was asked for) waiting for x");
    }
}
