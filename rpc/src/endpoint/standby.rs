//! Sync handlers on the reader thread, and the standby reader that watches the socket
//! meanwhile.
//!
//! A sync handler normally runs on the worker pool: the reader thread hands it over and
//! goes back to the socket. That hand-off wakes a parked pool thread for every request —
//! on an idle virtual CPU tens of µs, more than a small call costs otherwise (a Python
//! worker's `add(1, 2)`). So the reader thread runs the request's sync handler itself
//! when nothing else it read is waiting behind it (no byte of a later frame buffered), and
//! hands the *socket* to a standby thread for as long as the handler runs, without waking
//! it: the standby sleeps in `epoll_wait` on an epoll set of its own that is empty while
//! the reader thread reads; the reader thread adds the socket to that set before it runs
//! the handler (a request already waiting wakes the standby at once) and removes it after.
//! So a handler that blocks, runs long, or calls its peer back loses nothing: the
//! standby reads the next requests meanwhile (and hands them to the pool, as the reader
//! thread did before — it never runs a sync handler itself, so at most one sync handler at
//! a time occupies a reader); a call the handler makes reads its own response as a leader
//! (`reading`), the standby waiting for the read side in the meantime. The price per
//! request is two `epoll_ctl` calls instead of a thread wake-up.
//!
//! The standby is started on the first sync request the reader thread would run (a
//! connection that serves none, e.g. a host's, never starts it); it ends with the
//! connection (`Inner::shutdown_now` adds the shut socket to its set, which wakes it). A
//! kernel without epoll, or a failure to start it, keeps the pool hand-off. Turned off by
//! `RpcConfig::inline_sync` = false.

use super::Inner;
use crate::error::RpcError;
use parking_lot::Mutex;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

/// The standby's state: not started, running, or could not start (never tried again).
const NOT_STARTED: u8 = 0;
const RUNNING: u8 = 1;
const UNAVAILABLE: u8 = 2;

pub(super) struct Standby {
    /// Read and written by the reader thread only (it alone starts the standby).
    state: AtomicU8,
    /// The standby's epoll set (shared with its thread, which may outlive the endpoint's
    /// last handle by the time it takes to wake).
    epoll: Mutex<Option<Arc<OwnedFd>>>,
}

impl Standby {
    pub(super) fn new() -> Standby {
        Standby { state: AtomicU8::new(NOT_STARTED), epoll: Mutex::new(None) }
    }
}

/// The socket in (`add`) or out of the standby's set. Errors are ignored by callers where
/// noted: adding twice (`EEXIST`) or removing what is not there (`ENOENT`) is harmless.
fn ctl(epoll: &OwnedFd, op: libc::c_int, sock: RawFd) -> std::io::Result<()> {
    let mut ev = libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLRDHUP) as u32, u64: 0 };
    // SAFETY: both fds are open for the call (the epoll fd is owned by `epoll`, the socket by
    // the endpoint, which the caller holds); `ev` is a valid epoll_event for its duration.
    let r = unsafe { libc::epoll_ctl(epoll.as_raw_fd(), op, sock, &mut ev) };
    if r < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
}

impl Inner {
    /// On the reader thread, before it runs a sync handler itself: count it as one of
    /// the `max_workers` handlers running (it is one, on this thread) and make sure the
    /// standby watches the socket meanwhile. False: run it on the pool instead (inline
    /// sync handlers off, `max_workers` reached, the standby could not start, or the socket
    /// could not be handed over).
    pub(super) fn hand_socket_to_standby(self: &Arc<Self>) -> bool {
        if !self.cfg.inline_sync || !self.pool.reserve(self.cfg.max_workers) {
            return false;
        }
        if self.hand_socket() {
            return true;
        }
        self.pool.unreserve();
        false
    }

    fn hand_socket(self: &Arc<Self>) -> bool {
        // Relaxed: only the reader thread reads and writes `state` (it alone starts the
        // standby); the epoll fd itself is under its mutex.
        let epoll = match self.standby.state.load(Ordering::Relaxed) {
            RUNNING => self.standby.epoll.lock().clone(),
            UNAVAILABLE => None,
            _ => self.start_standby(),
        };
        let Some(epoll) = epoll else { return false };
        ctl(&epoll, libc::EPOLL_CTL_ADD, self.sock.fd().as_raw_fd()).is_ok()
    }

    /// On the reader thread, after the handler: the socket is the reader thread's again,
    /// and the handler no longer counts against `max_workers`.
    pub(super) fn take_socket_from_standby(&self) {
        self.pool.unreserve();
        if let Some(epoll) = self.standby.epoll.lock().as_ref() {
            // ENOENT (not there) cannot happen: only this thread adds and removes it
            // while the connection is open; at its end nothing here matters.
            let _ = ctl(epoll, libc::EPOLL_CTL_DEL, self.sock.fd().as_raw_fd());
        }
    }

    /// At the connection's end: wake the standby (the shut socket is readable) so that it
    /// sees the end and exits.
    pub(super) fn wake_standby(&self) {
        if let Some(epoll) = self.standby.epoll.lock().as_ref() {
            // EEXIST: the socket is there already and its shutdown woke the standby.
            let _ = ctl(epoll, libc::EPOLL_CTL_ADD, self.sock.fd().as_raw_fd());
        }
    }

    fn start_standby(self: &Arc<Self>) -> Option<Arc<OwnedFd>> {
        // SAFETY: plain syscall with an integer flag.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            // Relaxed: as in `hand_socket_to_standby`.
            self.standby.state.store(UNAVAILABLE, Ordering::Relaxed);
            return None;
        }
        // SAFETY: a fresh fd the kernel just returned, owned by nobody else.
        let epoll = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
        *self.standby.epoll.lock() = Some(epoll.clone());
        let (weak, theirs) = (Arc::downgrade(self), epoll.clone());
        let spawned = std::thread::Builder::new().name("tensorwire-rpc-standby".into()).spawn(move || standby_loop(weak, theirs));
        if spawned.is_err() {
            self.standby.epoll.lock().take();
            // Relaxed: as above.
            self.standby.state.store(UNAVAILABLE, Ordering::Relaxed);
            return None;
        }
        // Relaxed: as above.
        self.standby.state.store(RUNNING, Ordering::Relaxed);
        // The connection may have ended before the epoll fd was stored: `shutdown_now`
        // then found none to wake. It sets `closed` before it looks under the mutex, and
        // we stored under it before this load, so one of the two sees the other.
        if self.is_closed() {
            self.wake_standby();
        }
        Some(epoll)
    }
}

/// Sleep until the socket is in our set and readable (or shut); then read and dispatch
/// what arrived, as the reader thread would, except that sync handlers go to the pool.
fn standby_loop(weak: std::sync::Weak<Inner>, epoll: Arc<OwnedFd>) {
    let mut events = [libc::epoll_event { events: 0, u64: 0 }; 1];
    loop {
        // SAFETY: the epoll fd is open (we hold it); `events` is valid for one entry.
        let n = unsafe { libc::epoll_wait(epoll.as_raw_fd(), events.as_mut_ptr(), 1, -1) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            if let Some(inner) = weak.upgrade() {
                inner.shutdown_now(RpcError::io("epoll_wait (the standby reader)", e));
            }
            return;
        }
        let Some(inner) = weak.upgrade() else { return };
        if inner.is_closed() {
            return;
        }
        if let Err(e) = inner.read_available() {
            inner.shutdown_now(e);
            return;
        }
    }
}
