//! Waiting on the host for another process's CUDA work: a bounded spin on what signals it
//! (a sequence word, an event query), then sleeping polls — bounded by a deadline, ended
//! by the peer's death, and never a busy loop for long.

use crate::error::{Error, Result};
use crate::wait::Deadline;
use std::time::{Duration, Instant};

/// How long a host wait polls without sleeping: the producer's work is usually done, or
/// nearly, when its message arrives (`docs/measurements.md` has what a host wait costs).
const SPIN: Duration = Duration::from_micros(50);
/// Longest sleep between two looks once the spin ran out (each sleep doubles, from 8 µs).
const MAX_SLEEP: Duration = Duration::from_micros(500);
/// How often a sleeping wait asks whether the peer died (a `poll` each).
const LIVENESS_EVERY: Duration = Duration::from_millis(5);

/// Wait until `ready()` says so. `gone()` is asked every few ms; the peer's death ends the
/// wait with `PeerGone` (naming `what`), the deadline with `Timeout`. A `ready` error ends
/// it with that error. Sleeps are EINTR-safe (`std::thread::sleep` resumes).
pub(crate) fn host_wait(
    mut ready: impl FnMut() -> Result<bool>,
    deadline: &mut Deadline,
    gone: &dyn Fn() -> bool,
    what: &'static str,
) -> Result<()> {
    if ready()? {
        return Ok(());
    }
    let spin_end = Instant::now() + SPIN;
    while Instant::now() < spin_end {
        std::hint::spin_loop();
        if ready()? {
            return Ok(());
        }
    }
    let mut sleep = Duration::from_micros(8);
    let mut next_look = Instant::now();
    loop {
        if ready()? {
            return Ok(());
        }
        let now = Instant::now();
        if now >= next_look {
            if gone() {
                return Err(Error::peer_gone(format!("the peer died before its CUDA work for {what} completed")));
            }
            next_look = now + LIVENESS_EVERY;
        }
        let Some(left) = deadline.slice(sleep) else {
            return Err(deadline.timed_out(what));
        };
        std::thread::sleep(left);
        sleep = (sleep * 2).min(MAX_SLEEP);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wait::Wait;
    use std::cell::Cell;

    #[test]
    fn ready_deadline_and_death_each_end_the_wait() {
        let n = Cell::new(0);
        host_wait(|| { n.set(n.get() + 1); Ok(n.get() > 3) }, &mut Wait::Forever.deadline(), &|| false, "x").unwrap();
        assert_eq!(n.get(), 4);
        let t = Instant::now();
        let e = host_wait(|| Ok(false), &mut Wait::For(Duration::from_millis(30)).deadline(), &|| false, "the producer").unwrap_err();
        assert!(matches!(e, Error::Timeout { what: "the producer", .. }), "{e}");
        assert!(t.elapsed() >= Duration::from_millis(30) && t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        let e = host_wait(|| Ok(false), &mut Wait::Forever.deadline(), &|| true, "y").unwrap_err();
        assert!(e.is_peer_gone(), "{e}");
        let e = host_wait(|| Err(Error::InvalidArgument("bad".into())), &mut Wait::Forever.deadline(), &|| false, "z").unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        // Not waiting still looks once.
        host_wait(|| Ok(true), &mut Wait::Never.deadline(), &|| false, "w").unwrap();
        assert!(matches!(host_wait(|| Ok(false), &mut Wait::Never.deadline(), &|| false, "w"), Err(Error::Timeout { .. })));
    }

    #[test]
    fn a_long_wait_sleeps_rather_than_spins() {
        // 200 ms of waiting must cost far less CPU than wall time.
        let cpu = || {
            // SAFETY: rusage is plain integers; all-zero is a valid value.
            let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
            // SAFETY: valid out-pointer; RUSAGE_THREAD is this thread's usage.
            unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
            Duration::from_micros((ru.ru_utime.tv_sec * 1_000_000 + ru.ru_utime.tv_usec + ru.ru_stime.tv_sec * 1_000_000 + ru.ru_stime.tv_usec) as u64)
        };
        let before = cpu();
        let _ = host_wait(|| Ok(false), &mut Wait::For(Duration::from_millis(200)).deadline(), &|| false, "x");
        let used = cpu() - before;
        assert!(used < Duration::from_millis(80), "a 200 ms host wait used {used:?} of CPU");
    }
}
