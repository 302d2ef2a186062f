//! A Unix-socket connection between two processes carrying small control messages with
//! fds attached.
//!
//! SOCK_SEQPACKET keeps message boundaries and ties each message's fds to it, so no
//! framing state can be desynchronised by a hostile peer. The handshake exchanges a hello
//! carrying SCM_CREDENTIALS, which the kernel verifies, so the peer pid is right even for
//! an inherited socketpair (where SO_PEERCRED would name the pair's creator). A pidfd on
//! that pid plus socket EOF turn peer death into `Error::PeerGone`, never a hang.

use crate::doorbell::Doorbell;
use crate::error::{Error, Result};
use crate::sys;
use parking_lot::Mutex;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use crate::waiting::cpu::{self, CpuMoves, MessageBells};
use crate::waiting::message::{self, SocketReady, Watched};
use crate::waiting::spin_policy::SpinPolicy;
use crate::wait::{Deadline, Wait};
use crate::wire::connection::{HELLO_MAGIC, KIND_HELLO, MSG_HEADER, MSG_MAGIC, PROTOCOL_VERSION};
use std::time::Duration;

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

/// How long a peer found gone by its socket's end may take to be seen ended by its pidfd
/// (its files close before its exit is signalled); paid once, only by a peer that lives on.
const PROCESS_END_GRACE: Duration = Duration::from_millis(50);

/// How long a send waits for room in the peer's socket buffer by default.
pub const DEFAULT_SEND_TIMEOUT: Wait = Wait::For(Duration::from_secs(10));

/// A connected, handshaken peer socket.
pub struct Connection {
    sock: OwnedFd,
    peer_pid: i32,
    /// The peer runs in our pid namespace (see [`Connection::shares_pid_namespace`]).
    same_pid_ns: bool,
    pidfd: Option<OwnedFd>,
    gone: AtomicBool,
    /// What became of the peer, worked out the first time it is found gone (see
    /// `peer_end`).
    end: std::sync::OnceLock<String>,
    max_message: usize,
    recv_buf: Mutex<Vec<u8>>,
    /// How long `recv` polls without blocking before it sleeps (see `set_recv_spin`).
    recv_spin: Duration,
    /// Whether `recv` may spin now (not while the peer shares our core).
    recv_spin_policy: SpinPolicy,
    /// How long `send` waits for room in the peer's socket buffer.
    send_timeout: Wait,
    /// Doorbells that replace poll(2) on the socket for waking a receiver, once both
    /// sides have a shared page (a `Peer`'s lease tables): see [`MessageBells`].
    bells: Option<MessageBells>,
    /// Its receives' moves off the peer's CPU.
    cpu_moves: CpuMoves,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection").field("peer_pid", &self.peer_pid).finish()
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        if let Some(b) = &self.bells {
            // A peer asleep on our bell would see our end close only at its next slice:
            // end the connection first (its socket reads EOF), then ring.
            // SAFETY: shutdown(2) on a socket we own; no memory is passed.
            unsafe { libc::shutdown(self.sock.as_raw_fd(), libc::SHUT_RDWR) };
            Doorbell::new(&b.ours.get().bell).ring();
        }
    }
}

/// This process's pid namespace, as the inode of `/proc/self/ns/pid` (0 where `/proc`
/// cannot tell: the peer then decides by whether it can see our pid).
fn pid_namespace_id() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino())
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
        let own_ns = pid_namespace_id();
        let mut hello = Vec::with_capacity(24);
        hello.extend_from_slice(&HELLO_MAGIC.to_le_bytes());
        hello.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        hello.extend_from_slice(&(max_message as u32).to_le_bytes());
        hello.extend_from_slice(&own_ns.to_le_bytes());
        send_framed(sock.as_fd(), KIND_HELLO, &hello, &[], true, &mut deadline)?;

        let ready = sys::poll_readable(&[sock.as_fd()], deadline.as_wait())?;
        if !ready[0] {
            return Err(deadline.timed_out("the peer's hello"));
        }
        let mut buf = vec![0u8; 256];
        let got = sys::recv_msg(sock.as_fd(), &mut buf)?
            .ok_or_else(|| Error::peer_gone("closed the connection during the handshake"))?;
        if got.truncated || got.len < MSG_HEADER + 16 || !got.fds.is_empty() {
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
        // A process that runs as the overflow ids itself (`nobody`, whose worker in a new
        // pid namespace sees its supervisor exactly so) cannot tell the two apart: it
        // accepts, as for any peer it cannot see.
        // SAFETY: getuid and getgid cannot fail.
        let we_are_overflow = unsafe { libc::getuid() == OVERFLOW_ID && libc::getgid() == OVERFLOW_ID };
        if cred.pid == 0 && cred.uid == OVERFLOW_ID && cred.gid == OVERFLOW_ID && !we_are_overflow {
            return Err(Error::Protocol(
                "hello carried no SCM_CREDENTIALS (the kernel reports pid 0, uid and gid 65534): peer identity unknown".into(),
            ));
        }
        sys::set_passcred(sock.as_fd(), false)?;
        // The peer's pid namespace as it says (0: unknown, or a peer that predates the
        // field). A peer we cannot see (pid 0) is in another namespace whatever it says;
        // a peer that lies about being in ours only makes its own CUDA imports fail.
        let peer_ns = body.get(16..24).map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap()));
        let same_pid_ns = cred.pid != 0 && (peer_ns == 0 || own_ns == 0 || peer_ns == own_ns);
        let pidfd = sys::pidfd_open(cred.pid);
        Ok(Connection {
            sock,
            peer_pid: cred.pid,
            same_pid_ns,
            pidfd,
            gone: AtomicBool::new(false),
            end: std::sync::OnceLock::new(),
            max_message,
            recv_buf: Mutex::new(vec![0u8; max_message + MSG_HEADER + 1]),
            recv_spin: Duration::ZERO,
            recv_spin_policy: SpinPolicy::default(),
            send_timeout: DEFAULT_SEND_TIMEOUT,
            bells: None,
            cpu_moves: CpuMoves::default(),
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
    /// cross-CPU wake-up, tens of µs on some VMs). Zero: block at once. A cap: while the
    /// peer seems to share our core, `recv` spins less or not at all (`spin_policy`).
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

    /// Whether the peer runs in this process's pid namespace. A sandboxed worker (pid 1
    /// of its own) does not, and the CUDA driver opens a legacy IPC handle only inside one
    /// pid namespace: CUDA memory then travels by VMM fd (`Peer::export_cuda`).
    pub fn shares_pid_namespace(&self) -> bool {
        self.same_pid_ns
    }

    /// True if a receive, a send or an [`Self::is_peer_gone`] already found the peer gone.
    /// No system call: for paths that lose nothing by learning it later (the reaper's
    /// next pass looks).
    pub(crate) fn known_gone(&self) -> bool {
        // Acquire: pairs with the Release stores in `is_peer_gone` and `gone_error`.
        self.gone.load(Ordering::Acquire)
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
        Error::peer_gone(self.peer_end(what).to_owned())
    }

    /// What became of the peer, as the kernel tells it through the pidfd: "process 7 was
    /// killed by SIGKILL (signal 9)", "process 7 exited with status 3" (a child of ours),
    /// "process 7 exited" (another's), or, while its process lives on (or without a
    /// pidfd), "process 7 <what>". Worked out once, then kept.
    pub(crate) fn peer_end(&self, what: &str) -> &str {
        self.end.get_or_init(|| {
            let pid = self.peer_pid;
            let Some(pidfd) = &self.pidfd else { return format!("process {pid} {what}") };
            // A dying process's files close before the kernel marks it ended, so its
            // socket's end can come first: give the pidfd a moment (not for a peer in
            // this very process, which is not ending).
            if u32::try_from(pid).ok() != Some(std::process::id()) {
                let _ = sys::poll_readable(&[pidfd.as_fd()], Wait::For(PROCESS_END_GRACE));
            }
            match sys::pidfd_process_end(pidfd.as_fd()) {
                sys::ProcessEnd::Killed { signal, core } => format!(
                    "process {pid} was killed by {} (signal {signal}{})",
                    sys::signal_name(signal),
                    if core { ", core dumped" } else { "" }
                ),
                sys::ProcessEnd::Exited(status) => format!("process {pid} exited with status {status}"),
                sys::ProcessEnd::Ended => format!("process {pid} exited"),
                sys::ProcessEnd::Running => format!("process {pid} {what}"),
            }
        })
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
            Err(e) => Err(e),
            Ok(()) => {
                // After the message is queued: a receiver that reads the bell's sequence
                // and then finds the socket empty sleeps until this ring.
                if let Some(b) = &self.bells {
                    let line = b.ours.get();
                    // Relaxed: a hint read on its own (see `MessageLine::sender_cpu`).
                    line.sender_cpu.store(sys::current_cpu().wrapping_add(1), Ordering::Relaxed);
                    Doorbell::new(&line.bell).ring();
                }
                Ok(())
            }
        }
    }

    /// Wake receivers with doorbells instead of the socket from now on (both sides of a
    /// `Peer` switch once they have each other's lease table).
    pub(crate) fn set_message_bells(&mut self, bells: MessageBells) {
        self.bells = Some(bells);
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
        let watched = Watched { sock: self.sock.as_fd(), pidfd: self.pidfd.as_ref().map(|p| p.as_fd()) };
        let Some(bells) = &self.bells else {
            return match message::socket_readable(watched, self.recv_spin, &self.recv_spin_policy, deadline)? {
                SocketReady::Readable => self.take(&mut buf[..]),
                SocketReady::PeerExited => Err(self.gone_error("exited")),
            };
        };
        // A message already there is taken first: moving off the peer's CPU (below) is for
        // a receive that is about to wait, and costs a migration of this thread — which a
        // thread that finds its message waiting (the usual case when the peer sent it
        // before telling us about it another way) must not pay.
        if let Some(msg) = self.try_take(&mut buf[..])? {
            return Ok(msg);
        }
        // Nor does a receive that may not wait move (a look with `Wait::Never`).
        if deadline.expired() {
            return Err(deadline.timed_out("a message from the peer"));
        }
        let spin = if self.cpu_moves.move_off_peer_cpu(bells) { Duration::ZERO } else { self.recv_spin };
        let bell = Doorbell::new(&bells.theirs.get().bell);
        match message::rung(bell, watched, spin, &self.recv_spin_policy, deadline, || self.try_take(&mut buf[..])) {
            Err(Error::PeerGone { .. }) => Err(self.gone_error("exited")),
            r => r,
        }
    }

    /// Whether a receive has tried to move off the peer's CPU yet.
    #[cfg(test)]
    pub(crate) fn tried_a_move(&self) -> bool {
        self.cpu_moves.tried()
    }

    /// Our message line's CPU word (tests stand in for a peer that moved).
    #[cfg(test)]
    pub(crate) fn our_sender_cpu(&self) -> &std::sync::atomic::AtomicU32 {
        &self.bells.as_ref().expect("a Peer's connection has message bells").ours.get().sender_cpu
    }

    /// Before a wait on one of the peer's rings: move off the peer's CPU
    /// (`waiting::cpu::CpuMoves`). True when the peer last ran on our CPU and we could not
    /// move: the wait must not spin.
    pub(crate) fn shares_core_with_peer(&self) -> bool {
        self.bells.as_ref().is_some_and(|b| self.cpu_moves.move_off_peer_cpu(b))
    }

    /// The CPU the peer last sent from, as its message line says (a hint; see
    /// `lease::MessageLine::sender_cpu`).
    pub(crate) fn peer_sender_cpu(&self) -> Option<u32> {
        let b = self.bells.as_ref()?;
        // Relaxed: a hint read on its own, paired with nothing (as in `CpuMoves`).
        let plus_one = b.theirs.get().sender_cpu.load(Ordering::Relaxed);
        plus_one.checked_sub(1)
    }

    /// After a send through one of our rings: store the CPU we sent from in our message
    /// line if it changed, so that the peer's ring waits know where we run (as a control
    /// message's send does, without writing the line each time).
    pub(crate) fn note_send_cpu(&self) {
        if let Some(b) = &self.bells {
            cpu::note_send_cpu(b);
        }
    }

    /// Read the message the socket has ready (or its EOF) and check its framing.
    fn take(&self, buf: &mut [u8]) -> Result<Message> {
        let got = sys::recv_msg(self.sock.as_fd(), buf)?;
        self.framed(got, buf)
    }

    /// The message the socket has now, if any (see [`Self::take`]).
    fn try_take(&self, buf: &mut [u8]) -> Result<Option<Message>> {
        match sys::try_recv_msg(self.sock.as_fd(), buf)? {
            sys::TryRecv::Empty => Ok(None),
            sys::TryRecv::Closed => self.framed(None, buf).map(Some),
            sys::TryRecv::Message(got) => self.framed(Some(got), buf).map(Some),
        }
    }

    /// Check a received message's framing (`None`: the peer closed).
    fn framed(&self, got: Option<sys::Received>, buf: &[u8]) -> Result<Message> {
        let Some(got) = got else {
            return Err(self.gone_error("closed the connection"));
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
    let mut buf = Vec::with_capacity(MSG_HEADER + payload.len());
    buf.extend_from_slice(&MSG_MAGIC.to_le_bytes());
    buf.extend_from_slice(&kind.to_le_bytes());
    buf.extend_from_slice(payload);
    sys::send_msg_until(sock, &buf, fds, creds, deadline)
}

fn parse_header(msg: &[u8]) -> Result<(u32, &[u8])> {
    if msg.len() < MSG_HEADER {
        return Err(Error::Protocol(format!("message of {} bytes is shorter than its {MSG_HEADER}-byte header", msg.len())));
    }
    let magic = u32::from_le_bytes(msg[0..4].try_into().unwrap());
    if magic != MSG_MAGIC {
        return Err(Error::Protocol(format!("bad message magic {magic:#010x}")));
    }
    Ok((u32::from_le_bytes(msg[4..8].try_into().unwrap()), &msg[MSG_HEADER..]))
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
