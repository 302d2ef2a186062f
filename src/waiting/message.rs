//! A connection's receive, waiting for the next message: on the socket itself (spin,
//! yield or sleep in `poll(2)`, as the spin policy says), or, once both sides share a
//! page, on the peer's message doorbell ([`super::waiter`]), looking at the socket
//! whenever it rings. What is received and how it is framed is `crate::connection`'s.

use super::spin_policy::{hand_over, Outcome, Plan, SpinClock, SpinPolicy};
use super::waiter::Waiter;
use crate::doorbell::Doorbell;
use crate::error::{Error, Result};
use crate::sys;
use crate::wait::{Deadline, Wait};
use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

/// What a receive waits on: the socket, and the peer's pidfd where there is one.
#[derive(Clone, Copy)]
pub(crate) struct Watched<'a> {
    pub(crate) sock: BorrowedFd<'a>,
    pub(crate) pidfd: Option<BorrowedFd<'a>>,
}

/// What ended a wait on the socket that did not time out.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum SocketReady {
    /// The socket has a message or its end.
    Readable,
    /// The peer's process ended, with nothing left on the socket.
    PeerExited,
}

impl Watched<'_> {
    /// The socket and the pidfd, for one `poll(2)`.
    fn poll(&self, wait: impl Into<Wait>) -> Result<Vec<bool>> {
        let both;
        let fds: &[BorrowedFd<'_>] = match self.pidfd {
            Some(p) => {
                both = [self.sock, p];
                &both
            }
            None => std::slice::from_ref(&self.sock),
        };
        sys::poll_readable(fds, wait)
    }

    fn peer_exited(&self) -> bool {
        self.pidfd.is_some_and(|p| sys::poll_readable(&[p], Wait::Never).is_ok_and(|r| r[0]))
    }
}

/// Wait until the socket is readable, the peer exits or the deadline passes (a `Timeout`
/// naming what was awaited). A spin of up to `spin` (never past the deadline) comes
/// first while `policy` allows, a few yields instead while the peer shares our core,
/// then a sleep in `poll(2)` on the socket and the pidfd.
pub(crate) fn socket_readable(watched: Watched<'_>, spin: Duration, policy: &SpinPolicy, deadline: &mut Deadline) -> Result<SocketReady> {
    let cap = deadline.remaining().map_or(spin, |t| t.min(spin));
    let sock = std::slice::from_ref(&watched.sock);
    let mut ready = vec![false];
    // How long a spin ran before it gave up on seeing the message (None: no spin, or
    // it ended otherwise).
    let mut ran_out = None;
    // Not a spin while the peer shares our core (`spin_policy` says why: on one core, a
    // spin that does not hand the core over burns its whole window every time).
    let plan = if cap.is_zero() { Plan::Sleep } else { policy.next() };
    if plan == Plan::Spin {
        let mut clock = SpinClock::start(Instant::now());
        let mut first = true;
        loop {
            ready = sys::poll_readable(sock, Wait::Never)?;
            let now = Instant::now();
            // What ran on our core during that step: a reply that came with another
            // task's turn (the yield handed it the core) came from our core.
            let step = clock.step(now);
            if ready[0] {
                // Only a wait counts: not a message there at the first look.
                if !first {
                    policy.record(SpinClock::outcome(step));
                }
                break;
            }
            if clock.spun(now) >= cap {
                ran_out = Some(clock.spun(now));
                break;
            }
            first = false;
            // Yield, not a bare spin: when the peer shares this CPU, it may run now and
            // reply (then the next step sees the hand-over); when it runs elsewhere, this
            // returns at once. Not `crossbeam_utils::Backoff`: this poll is bounded by the
            // configured time, not by Backoff's step count, each round is already a
            // poll(2) call, and Backoff's first steps spin without yielding — the very
            // thing that keeps a peer on this CPU from replying.
            std::thread::yield_now();
        }
    } else if plan == Plan::Yield {
        // The peer shares our core: no spin, but a few yields before sleeping. When the
        // scheduler runs the peer at one, the reply is there with no wake-up; when it
        // does not, they cost a few system calls.
        ready[0] = hand_over(|| Ok::<_, Error>(sys::poll_readable(sock, Wait::Never)?[0]))?;
    }
    if !ready[0] {
        let slept_from = ran_out.map(|_| Instant::now());
        ready = watched.poll(deadline.as_wait())?;
        if let (Some(spun), Some(from), true) = (ran_out, slept_from, ready[0]) {
            policy.record(Outcome::after_sleep(spun, from.elapsed()));
        }
    }
    if ready[0] {
        Ok(SocketReady::Readable)
    } else if ready.get(1).copied().unwrap_or(false) {
        Ok(SocketReady::PeerExited)
    } else {
        Err(deadline.timed_out("a message from the peer"))
    }
}

/// Take the next message with `try_take` (a receive that does not wait), waiting between
/// looks on the peer's message doorbell `bell`: spin on it once for up to `spin` while
/// `policy` allows, then sleep on it in slices, looking at the socket whenever it rings
/// and between slices. The peer writes the doorbell: after `doorbell::FALSE_RINGS` rings
/// that brought no message this stops sleeping on it and sleeps in `poll(2)` on the
/// socket and the peer's pidfd instead ([`super::waiter`] says why). The peer's exit is
/// `Error::PeerGone`.
pub(crate) fn rung<T>(
    bell: Doorbell<'_>,
    watched: Watched<'_>,
    spin: Duration,
    policy: &SpinPolicy,
    deadline: &mut Deadline,
    mut try_take: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    // The sleep without the doorbell: until the socket has something (a message or its
    // end) or the peer's process ends; what it found is looked at by the next `try_take`.
    let on_socket = move |slice: Duration| -> Result<()> { watched.poll(slice).map(drop) };
    let mut waiter = Waiter::new(bell, spin, policy, deadline, "a message from the peer", "exited").for_the_bell_only(&on_socket);
    let exited = || watched.peer_exited();
    loop {
        // The sequence first, then the socket: a message sent after this look rings a
        // sequence other than `seen`, so the wait below returns for it.
        let seen = waiter.current();
        // The look is a receive that does not wait: one system call, not a `poll` and
        // then the receive.
        if let Some(msg) = try_take()? {
            return Ok(msg);
        }
        waiter.wait(&|| bell.current() != seen, &exited)?;
    }
}
