//! The accept loop's policy ([`crate::Server::serve_forever`]): what a failed `accept`
//! means, how long to back off, how to refuse a connection, and how to log without
//! flooding.
//!
//! A failed accept never stops the server unless the listener itself is broken (EBADF,
//! EINVAL, ENOTSOCK, EFAULT). Out of fds (EMFILE/ENFILE) the waiting connection would
//! otherwise sit in the backlog, neither served nor refused: the server keeps one spare
//! fd (`/dev/null`) for that case, closes it, accepts the waiting connection, tells it
//! the server is out of file descriptors, closes it and reopens the spare — then backs
//! off briefly if no spare could be had. Other resource errors (ENOMEM, ENOBUFS) back
//! off; per-connection errors (ECONNABORTED, EPROTO, network errors passed on by TCP)
//! are retried at once.

use crate::message::connection_notice;
use crate::stream::Stream;
use std::fs::File;
use std::time::{Duration, Instant};

/// What a failed `accept` calls for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AcceptFailure {
    /// The listener is unusable: stop serving.
    Fatal,
    /// This process or the system is out of fds.
    OutOfFds,
    /// Out of memory or buffers: back off.
    Resource,
    /// This one connection failed (aborted, a network error): accept the next.
    Transient,
}

pub(crate) fn classify(e: &std::io::Error) -> AcceptFailure {
    match e.raw_os_error() {
        Some(libc::EBADF | libc::EINVAL | libc::ENOTSOCK | libc::EFAULT) => AcceptFailure::Fatal,
        Some(libc::EMFILE | libc::ENFILE) => AcceptFailure::OutOfFds,
        Some(libc::ENOMEM | libc::ENOBUFS) => AcceptFailure::Resource,
        _ => AcceptFailure::Transient,
    }
}

const BACKOFF_FIRST: Duration = Duration::from_millis(5);
const BACKOFF_MAX: Duration = Duration::from_millis(500);

/// Exponential back-off, 5 ms doubling to 500 ms, reset by a successful accept.
#[derive(Debug, Default)]
pub(crate) struct Backoff {
    delay: Duration,
}

impl Backoff {
    pub(crate) fn reset(&mut self) {
        self.delay = Duration::ZERO;
    }
    /// The next delay to sleep.
    pub(crate) fn next_delay(&mut self) -> Duration {
        self.delay = (self.delay * 2).clamp(BACKOFF_FIRST, BACKOFF_MAX);
        self.delay
    }
}

/// One line per second at most to stderr; lines in between are counted and the count
/// is reported with the next line.
pub(crate) struct RateLimitedLog {
    prefix: String,
    last: Option<Instant>,
    suppressed: u64,
}

impl RateLimitedLog {
    pub(crate) fn new(prefix: String) -> RateLimitedLog {
        RateLimitedLog { prefix, last: None, suppressed: 0 }
    }
    pub(crate) fn log(&mut self, msg: impl FnOnce() -> String) {
        if self.last.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            self.suppressed += 1;
            return;
        }
        let more = match std::mem::take(&mut self.suppressed) {
            0 => String::new(),
            n => format!(" ({n} more since the last line)"),
        };
        eprintln!("{}: {}{more}", self.prefix, msg());
        self.last = Some(Instant::now());
    }
}

/// Tell a connection why it is not served (a connection notice, then the `null` close
/// frame) and close it. Best effort: a fresh socket's send buffer is empty, and the
/// write may block at most 100 ms.
pub(crate) fn refuse(s: Stream, reason: &str) {
    let _ = s.set_write_timeout(Some(Duration::from_millis(100)));
    let notice = connection_notice(reason);
    let mut out = Vec::with_capacity(notice.len() + 12);
    out.extend_from_slice(&(notice.len() as u32).to_be_bytes());
    out.extend_from_slice(&notice);
    out.extend_from_slice(&4u32.to_be_bytes());
    out.extend_from_slice(b"null");
    let _ = s.write_all(&out);
    s.shutdown();
}

/// One fd held in reserve so that a server out of fds can still accept a waiting
/// connection to refuse it.
pub(crate) struct SpareFd(Option<File>);

impl SpareFd {
    pub(crate) fn new() -> SpareFd {
        SpareFd(File::open("/dev/null").ok())
    }
    /// Close the spare (freeing one fd); false if there was none.
    pub(crate) fn release(&mut self) -> bool {
        self.0.take().is_some()
    }
    /// Reopen the spare (false if still out of fds).
    pub(crate) fn restore(&mut self) -> bool {
        if self.0.is_none() {
            self.0 = File::open("/dev/null").ok();
        }
        self.0.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification_and_backoff() {
        let e = |n| std::io::Error::from_raw_os_error(n);
        assert_eq!(classify(&e(libc::EMFILE)), AcceptFailure::OutOfFds);
        assert_eq!(classify(&e(libc::ENFILE)), AcceptFailure::OutOfFds);
        assert_eq!(classify(&e(libc::ENOBUFS)), AcceptFailure::Resource);
        assert_eq!(classify(&e(libc::ECONNABORTED)), AcceptFailure::Transient);
        assert_eq!(classify(&e(libc::EPROTO)), AcceptFailure::Transient);
        assert_eq!(classify(&e(libc::EBADF)), AcceptFailure::Fatal);
        let mut b = Backoff::default();
        let d: Vec<_> = (0..10).map(|_| b.next_delay()).collect();
        assert_eq!(d[0], BACKOFF_FIRST);
        assert!(d.windows(2).all(|w| w[1] >= w[0]) && d[9] == BACKOFF_MAX);
        b.reset();
        assert_eq!(b.next_delay(), BACKOFF_FIRST);
    }

    #[test]
    fn a_refused_connection_reads_the_reason_then_the_close() {
        let (a, b) = Stream::pair().unwrap();
        refuse(a, "server busy (RpcConfig::max_connections)");
        let mut got = Vec::new();
        let mut fds = Vec::new();
        let mut buf = [0u8; 512];
        loop {
            match b.read_some(&mut buf, &mut fds).unwrap() {
                0 => break,
                n => got.extend_from_slice(&buf[..n]),
            }
        }
        let mut d = crate::frame::FrameDecoder::new(1 << 16);
        d.push(&got).unwrap();
        let notice = crate::message::Message::decode(d.next_frame().unwrap().unwrap(), 8).unwrap();
        assert!(matches!(notice, crate::message::Message::Response { call_id: -1, error: Some(ref e), .. } if e.contains("max_connections")));
        assert_eq!(d.next_frame().unwrap().unwrap(), b"null");
    }
}
