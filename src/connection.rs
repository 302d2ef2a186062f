//! A Unix-socket connection between two processes carrying small control messages with
//! fds attached.
//!
//! SOCK_SEQPACKET keeps message boundaries and ties each message's fds to it, so no
//! framing state can be desynchronised by a hostile peer. The handshake exchanges a hello
//! carrying SCM_CREDENTIALS, which the kernel verifies, so the peer pid is right even for
//! an inherited socketpair (where SO_PEERCRED would name the pair's creator). A pidfd on
//! that pid plus socket EOF turn peer death into `Error::PeerGone`, never a hang.

use crate::error::{Error, Result};
use crate::sys;
use parking_lot::Mutex;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use crate::wait::{Deadline, Wait};
use std::time::Duration;

const MSG_MAGIC: u32 = u32::from_le_bytes(*b"TWM1");
const HELLO_MAGIC: u64 = u64::from_le_bytes(*b"TWHELLO1");
/// Wire protocol version exchanged in the hello.
pub const PROTOCOL_VERSION: u32 = 1;
const HEADER: usize = 8;
const KIND_HELLO: u32 = 0;
/// The kernel's default overflow uid/gid, which it reports for a message sent without
/// credentials.
const OVERFLOW_ID: u32 = 65534;

/// Default cap on one control message's payload.
pub const DEFAULT_MAX_MESSAGE: usize = 64 * 1024;

/// One control message.
#[derive(Debug)]
pub struct Message {
    pub kind: u32,
    pub payload: Vec<u8>,
    pub fds: Vec<OwnedFd>,
    /// The message carried fds this process could not take (it is at its open-file
    /// limit: the kernel dropped them). Only [`Connection::recv_lossy`] returns such a
    /// message, so its caller can undo what the message stood for (e.g. a lease).
    pub fds_lost: bool,
}

/// How long a send waits for room in the peer's socket buffer by default.
pub const DEFAULT_SEND_TIMEOUT: Wait = Wait::For(Duration::from_secs(10));

/// A connected, handshaken peer socket.
pub struct Connection {
    sock: OwnedFd,
    peer_pid: i32,
    pidfd: Option<OwnedFd>,
    gone: AtomicBool,
    max_message: usize,
    recv_buf: Mutex<Vec<u8>>,
    /// How long `recv` polls without blocking before it sleeps (see `set_recv_spin`).
    recv_spin: Duration,
    /// How long `send` waits for room in the peer's socket buffer.
    send_timeout: Wait,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection").field("peer_pid", &self.peer_pid).finish()
    }
}

impl Connection {
    /// Handshake over a connected SEQPACKET socket (either end of a socketpair, an
    /// accepted or a connecting socket). Both sides call this; it fails with `Timeout`
    /// if the peer's hello does not come within what `wait` says.
    pub fn establish(sock: OwnedFd, wait: impl Into<Wait>) -> Result<Connection> {
        Self::establish_with(sock, wait, DEFAULT_MAX_MESSAGE)
    }

    pub fn establish_with(sock: OwnedFd, wait: impl Into<Wait>, max_message: usize) -> Result<Connection> {
        // One clock for sending our hello and reading the peer's.
        let mut deadline = wait.into().deadline();
        // SO_PASSCRED before the peer's hello can be read: the kernel then delivers the
        // credentials it verified for the sender.
        sys::set_passcred(sock.as_fd(), true)?;
        let mut hello = Vec::with_capacity(16);
        hello.extend_from_slice(&HELLO_MAGIC.to_le_bytes());
        hello.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        hello.extend_from_slice(&(max_message as u32).to_le_bytes());
        send_framed(sock.as_fd(), KIND_HELLO, &hello, &[], true, &mut deadline)?;

        let ready = sys::poll_readable(&[sock.as_fd()], deadline.as_wait())?;
        if !ready[0] {
            return Err(deadline.timed_out("the peer's hello"));
        }
        let mut buf = vec![0u8; 256];
        let got = sys::recv_msg(sock.as_fd(), &mut buf)?
            .ok_or_else(|| Error::peer_gone("closed the connection during the handshake"))?;
        if got.truncated || got.len < HEADER + 16 || !got.fds.is_empty() {
            return Err(Error::Protocol(format!("malformed hello ({} bytes, {} fds)", got.len, got.fds.len())));
        }
        let (kind, body) = parse_header(&buf[..got.len])?;
        if kind != KIND_HELLO || u64::from_le_bytes(body[0..8].try_into().unwrap()) != HELLO_MAGIC {
            return Err(Error::Protocol("first message is not a tensorwire hello".into()));
        }
        let version = u32::from_le_bytes(body[8..12].try_into().unwrap());
        if version != PROTOCOL_VERSION {
            return Err(Error::Protocol(format!("peer speaks protocol {version}, this build speaks {PROTOCOL_VERSION}")));
        }
        let cred = got
            .cred
            .ok_or_else(|| Error::Protocol("hello carried no SCM_CREDENTIALS: peer identity unknown".into()))?;
        // A hello sent without SCM_CREDENTIALS before our SO_PASSCRED took effect arrives
        // with the kernel's "no credentials" stand-in: pid 0 and the overflow uid and gid
        // (65534 unless /proc/sys/kernel/overflow[ug]id was changed). It names no process.
        // (pid 0 with a real uid is an honest peer whose pid is not visible in our pid
        // namespace, e.g. our parent when we run in a new one: accepted, as before, with
        // peer death seen by EOF only.)
        if cred.pid == 0 && cred.uid == OVERFLOW_ID && cred.gid == OVERFLOW_ID {
            return Err(Error::Protocol(
                "hello carried no SCM_CREDENTIALS (the kernel reports pid 0, uid and gid 65534): peer identity unknown".into(),
            ));
        }
        sys::set_passcred(sock.as_fd(), false)?;
        let pidfd = sys::pidfd_open(cred.pid);
        Ok(Connection {
            sock,
            peer_pid: cred.pid,
            pidfd,
            gone: AtomicBool::new(false),
            max_message,
            recv_buf: Mutex::new(vec![0u8; max_message + HEADER + 1]),
            recv_spin: Duration::ZERO,
            send_timeout: DEFAULT_SEND_TIMEOUT,
        })
    }

    /// A connected pair inside this process (both ends handshaken).
    pub fn pair() -> Result<(Connection, Connection)> {
        let (a, b) = sys::seqpacket_pair()?;
        let t = std::thread::spawn(move || Connection::establish(b, Duration::from_secs(10)));
        let a = Connection::establish(a, Duration::from_secs(10))?;
        let b = t.join().map_err(|_| Error::Protocol("handshake thread panicked".into()))??;
        Ok((a, b))
    }

    /// Connect to a listener at `path` (the handshake waits as `wait` says).
    pub fn connect(path: &Path, wait: impl Into<Wait>) -> Result<Connection> {
        Connection::establish(sys::seqpacket_connect(path)?, wait)
    }

    /// Poll for up to `spin` without blocking before `recv` sleeps: a reply that comes
    /// within it is taken without a wake-up (a sleeping receiver costs the sender a
    /// cross-CPU wake-up, tens of µs on some VMs). Zero: block at once.
    pub fn set_recv_spin(&mut self, spin: Duration) {
        self.recv_spin = spin;
    }

    /// How long a send may wait for room in the peer's socket buffer before it fails
    /// with `Timeout` (a peer that stops reading cannot block us for ever, unless this is
    /// `Wait::Forever`).
    pub fn set_send_timeout(&mut self, wait: impl Into<Wait>) {
        self.send_timeout = wait.into();
    }

    /// The peer's process id, as verified by the kernel at the handshake.
    pub fn peer_pid(&self) -> i32 {
        self.peer_pid
    }

    /// True once the peer is known to be gone: EOF seen, the socket hung up (the peer
    /// closed or shut down its end), or its process exited. One `poll`, no blocking.
    pub fn is_peer_gone(&self) -> bool {
        // Acquire/Release on `gone`: a plain flag; pairs with the stores below and in
        // `gone_error`, nothing else is published through it.
        if self.gone.load(Ordering::Acquire) {
            return true;
        }
        let sock = (self.sock.as_fd(), libc::POLLRDHUP);
        let both;
        let fds: &[_] = match &self.pidfd {
            Some(p) => {
                both = [sock, (p.as_fd(), libc::POLLIN)];
                &both
            }
            None => std::slice::from_ref(&sock),
        };
        let hung = sys::poll_events(fds, Wait::Never)
            .map(|r| r.iter().any(|&ev| ev & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR | libc::POLLIN) != 0))
            .unwrap_or(false);
        if hung {
            self.gone.store(true, Ordering::Release);
        }
        hung
    }

    fn gone_error(&self, what: &str) -> Error {
        self.gone.store(true, Ordering::Release);
        Error::peer_gone(format!("process {} {what}", self.peer_pid))
    }

    /// Send one message (`payload` ≤ the max message size, ≤ 8 fds). Safe to call from
    /// several threads: each SEQPACKET send is atomic.
    pub fn send(&self, kind: u32, payload: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
        if kind == KIND_HELLO {
            return Err(Error::InvalidArgument("message kind 0 is reserved for the handshake".into()));
        }
        if payload.len() > self.max_message {
            return Err(Error::InvalidArgument(format!(
                "message of {} bytes exceeds the {}-byte limit",
                payload.len(),
                self.max_message
            )));
        }
        match send_framed(self.sock.as_fd(), kind, payload, fds, false, &mut self.send_timeout.deadline()) {
            Err(Error::PeerGone { .. }) => Err(self.gone_error("closed the connection")),
            r => r,
        }
    }

    /// Receive the next message, waiting as `wait` says (`Wait::Forever`: until the peer
    /// sends or dies). One receiver at a time (serialised internally). A message whose fds
    /// this process could not take (open-file limit) is `Error::Resource`.
    pub fn recv(&self, wait: impl Into<Wait>) -> Result<Message> {
        let msg = self.recv_lossy(wait)?;
        if msg.fds_lost {
            return Err(fds_lost_error());
        }
        Ok(msg)
    }

    /// `recv`, but a message whose fds were dropped for our open-file limit is returned
    /// (with `fds_lost` set) so the caller can undo what it stood for.
    pub fn recv_lossy(&self, wait: impl Into<Wait>) -> Result<Message> {
        self.recv_lossy_until(&mut wait.into().deadline())
    }

    /// `recv_lossy` within a caller's deadline (one clock for a larger wait).
    pub(crate) fn recv_lossy_until(&self, deadline: &mut Deadline) -> Result<Message> {
        let mut buf = self.recv_buf.lock();
        let mut wait: Vec<BorrowedFd<'_>> = vec![self.sock.as_fd()];
        if let Some(p) = &self.pidfd {
            wait.push(p.as_fd());
        }
        let spin = deadline.remaining().map_or(self.recv_spin, |t| t.min(self.recv_spin));
        let mut ready = vec![false];
        if !spin.is_zero() {
            let mut spun = Wait::For(spin).deadline();
            loop {
                ready = sys::poll_readable(&wait[..1], Wait::Never)?;
                if ready[0] || spun.expired() {
                    break;
                }
                // Yield, not a bare spin: when the peer shares this CPU, it runs now and
                // replies; when it runs elsewhere, this returns at once. Not
                // `crossbeam_utils::Backoff`: this poll is bounded by the configured time
                // (`recv_spin`), not by Backoff's step count, each round is already a
                // poll(2) call, and Backoff's first steps spin without yielding — the
                // very thing that keeps a peer on this CPU from replying.
                std::thread::yield_now();
            }
        }
        if !ready[0] {
            ready = sys::poll_readable(&wait, deadline.as_wait())?;
        }
        if !ready[0] {
            if ready.get(1).copied().unwrap_or(false) {
                return Err(self.gone_error("exited"));
            }
            return Err(deadline.timed_out("a message from the peer"));
        }
        let got = match sys::recv_msg(self.sock.as_fd(), &mut buf)? {
            Some(g) => g,
            None => return Err(self.gone_error("closed the connection")),
        };
        if got.truncated {
            return Err(Error::Protocol(format!("message larger than the {}-byte limit", self.max_message)));
        }
        if got.len == 0 {
            return Err(Error::Protocol("empty message (every message starts with an 8-byte header)".into()));
        }
        // The control buffer has room for more fds than a message may carry (its size is
        // rounded up for alignment): count them, not only the kernel's truncation flag.
        // The fds are owned by `got` and closed when it drops.
        let fds_lost = got.ctrunc && got.fds.len() <= sys::MAX_FDS_PER_MSG && sys::fd_table_full(self.sock.as_fd());
        if (got.ctrunc && !fds_lost) || got.fds.len() > sys::MAX_FDS_PER_MSG {
            return Err(Error::Protocol(format!("message carried more than {} fds", sys::MAX_FDS_PER_MSG)));
        }
        let (kind, body) = parse_header(&buf[..got.len])?;
        // The buffer holds one byte more than the largest message so that MSG_TRUNC marks
        // anything larger; a message exactly one byte over still fits it whole.
        if body.len() > self.max_message {
            return Err(Error::Protocol(format!(
                "message of {} bytes exceeds the {}-byte limit",
                body.len(),
                self.max_message
            )));
        }
        if kind == KIND_HELLO {
            return Err(Error::Protocol("second hello after the handshake".into()));
        }
        Ok(Message { kind, payload: body.to_vec(), fds: got.fds, fds_lost })
    }

    /// Raw socket (for polling alongside other fds).
    pub fn socket(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }
}

/// The error for a message whose fds the kernel dropped because we are at our fd limit.
pub(crate) fn fds_lost_error() -> Error {
    Error::Resource { what: "recvmsg (taking the fds a message carried)", errno: libc::EMFILE }
}

fn send_framed(
    sock: BorrowedFd<'_>,
    kind: u32,
    payload: &[u8],
    fds: &[BorrowedFd<'_>],
    creds: bool,
    deadline: &mut Deadline,
) -> Result<()> {
    let mut buf = Vec::with_capacity(HEADER + payload.len());
    buf.extend_from_slice(&MSG_MAGIC.to_le_bytes());
    buf.extend_from_slice(&kind.to_le_bytes());
    buf.extend_from_slice(payload);
    sys::send_msg_until(sock, &buf, fds, creds, deadline)
}

fn parse_header(msg: &[u8]) -> Result<(u32, &[u8])> {
    if msg.len() < HEADER {
        return Err(Error::Protocol(format!("message of {} bytes is shorter than its {HEADER}-byte header", msg.len())));
    }
    let magic = u32::from_le_bytes(msg[0..4].try_into().unwrap());
    if magic != MSG_MAGIC {
        return Err(Error::Protocol(format!("bad message magic {magic:#010x}")));
    }
    Ok((u32::from_le_bytes(msg[4..8].try_into().unwrap()), &msg[HEADER..]))
}

/// A listening socket path; connections from it are handshaken on accept.
pub struct Listener {
    sock: OwnedFd,
    path: PathBuf,
}

impl Listener {
    /// Listen at `path` (which must not exist). The socket file is removed on drop.
    pub fn bind(path: impl AsRef<Path>) -> Result<Listener> {
        let path = path.as_ref().to_path_buf();
        Ok(Listener { sock: sys::seqpacket_listen(&path)?, path })
    }

    /// Accept one connection (waiting for it as `wait` says) and handshake it (waiting
    /// for the peer's hello as `handshake` says: a client that connects and says nothing
    /// must not hold the accept for ever).
    pub fn accept(&self, wait: impl Into<Wait>, handshake: impl Into<Wait>) -> Result<Connection> {
        let mut deadline = wait.into().deadline();
        if !sys::poll_readable(&[self.sock.as_fd()], deadline.as_wait())?[0] {
            return Err(deadline.timed_out("a connection"));
        }
        let fd = sys::accept(self.sock.as_fd())?;
        let conn = Connection::establish(fd, handshake)?;
        // For accepted sockets SO_PEERCRED is the connecting process: it must agree with
        // the credentials the hello carried.
        let pc = sys::peer_cred(conn.socket())?;
        if pc.pid != conn.peer_pid {
            return Err(Error::Protocol(format!(
                "hello credentials name pid {} but the connecting process is {}",
                conn.peer_pid, pc.pid
            )));
        }
        Ok(conn)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pair_exchanges_messages_and_fds_and_reports_eof() {
        let (a, b) = Connection::pair().unwrap();
        assert_eq!(a.peer_pid(), std::process::id() as i32);
        let seg = crate::Segment::create(128).unwrap();
        a.send(7, b"hi", &[seg.fd()]).unwrap();
        let m = b.recv(Duration::from_secs(5)).unwrap();
        assert_eq!((m.kind, &m.payload[..], m.fds.len()), (7, &b"hi"[..], 1));
        assert!(matches!(b.recv(Duration::from_millis(10)), Err(Error::Timeout { .. })));
        assert!(a.send(1, &vec![0; DEFAULT_MAX_MESSAGE + 1], &[]).is_err());
        drop(a);
        assert!(b.recv(Wait::Forever).unwrap_err().is_peer_gone());
    }

    #[test]
    fn no_wait_is_over_at_once_and_a_huge_wait_is_no_limit() {
        let (a, b) = Connection::pair().unwrap();
        let t = std::time::Instant::now();
        let e = b.recv(Wait::Never).unwrap_err();
        assert!(matches!(e, Error::Timeout { after, .. } if after.is_zero()), "{e}");
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        // What is there is taken without waiting.
        a.send(4, b"now", &[]).unwrap();
        assert_eq!(b.recv(Wait::Never).unwrap().kind, 4);
        // A wait too long for the clock waits (here for a message sent later), not zero.
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(30));
                a.send(5, b"later", &[]).unwrap();
            });
            assert_eq!(b.recv(Duration::MAX).unwrap().kind, 5);
        });
        let dir = std::env::temp_dir().join(format!("tw-listen-never-{}", std::process::id()));
        let _ = std::fs::remove_file(&dir);
        let l = Listener::bind(&dir).unwrap();
        let e = l.accept(Wait::Never, Duration::from_secs(5)).unwrap_err();
        assert!(matches!(e, Error::Timeout { what: "a connection", .. }), "{e}");
    }

    #[test]
    fn hello_without_credentials_is_refused() {
        // The raw end sends a well-formed hello without SCM_CREDENTIALS before the other
        // end has SO_PASSCRED on: the kernel then reports pid 0, which must not become
        // the peer's identity (found by the conn_hello fuzz target).
        let (ours, raw) = sys::seqpacket_pair().unwrap();
        let mut hello = Vec::new();
        hello.extend_from_slice(&HELLO_MAGIC.to_le_bytes());
        hello.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        hello.extend_from_slice(&1024u32.to_le_bytes());
        send_framed(raw.as_fd(), KIND_HELLO, &hello, &[], false, &mut Wait::For(Duration::from_secs(1)).deadline()).unwrap();
        let e = Connection::establish(ours, Duration::from_secs(5)).unwrap_err();
        assert!(matches!(&e, Error::Protocol(m) if m.contains("no SCM_CREDENTIALS")), "{e}");
    }

    #[test]
    fn listener_path_works() {
        let dir = std::env::temp_dir().join(format!("tw-listen-{}", std::process::id()));
        let _ = std::fs::remove_file(&dir);
        let l = Listener::bind(&dir).unwrap();
        let p = dir.clone();
        let t = std::thread::spawn(move || Connection::connect(&p, Duration::from_secs(5)).unwrap());
        let server = l.accept(Duration::from_secs(5), Duration::from_secs(5)).unwrap();
        let client = t.join().unwrap();
        client.send(3, b"x", &[]).unwrap();
        assert_eq!(server.recv(Duration::from_secs(5)).unwrap().kind, 3);
    }
}
