//! Thin, checked wrappers over the Linux calls the transport needs and std does not
//! offer: memfd + seals, SEQPACKET Unix sockets with SCM_RIGHTS / SCM_CREDENTIALS, pidfd,
//! poll, getrandom. Each returns `Error::Io` naming the call.

use crate::error::{Error, Result};
use std::ffi::CString;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use crate::wait::{Deadline, Wait};

/// Most fds one control message may carry; more is a protocol error.
pub const MAX_FDS_PER_MSG: usize = 8;

/// Retry a libc call while it fails with EINTR.
fn retry<T: PartialEq + Copy>(fail: T, mut f: impl FnMut() -> T) -> std::result::Result<T, std::io::Error> {
    loop {
        let r = f();
        if r != fail {
            return Ok(r);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING)`.
pub fn memfd_create(name: &str) -> Result<OwnedFd> {
    let c = CString::new(name).map_err(|_| Error::InvalidArgument("memfd name contains NUL".into()))?;
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call.
    let fd = unsafe { libc::memfd_create(c.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(Error::last_os("memfd_create"));
    }
    // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

pub fn ftruncate(fd: BorrowedFd<'_>, len: u64) -> Result<()> {
    let len = i64::try_from(len).map_err(|_| Error::InvalidArgument(format!("segment length {len} too large")))?;
    // SAFETY: plain syscall on a borrowed, open fd.
    let r = retry(-1, || unsafe { libc::ftruncate(fd.as_raw_fd(), len) });
    r.map(|_| ()).map_err(|e| Error::io("ftruncate (sizing segment)", e))
}

pub fn add_seals(fd: BorrowedFd<'_>, seals: i32) -> Result<()> {
    // SAFETY: F_ADD_SEALS takes an int argument; fd is open.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) };
    if r < 0 { Err(Error::last_os("fcntl(F_ADD_SEALS)")) } else { Ok(()) }
}

/// Seals of `fd`, or `None` if the file does not support sealing (not a memfd/shmem).
pub fn get_seals(fd: BorrowedFd<'_>) -> Option<i32> {
    // SAFETY: F_GET_SEALS takes no argument; fd is open.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if r < 0 { None } else { Some(r) }
}

pub fn fstat(fd: BorrowedFd<'_>) -> Result<libc::stat> {
    // SAFETY: zeroed `stat` is a valid bit pattern; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid out-pointer for the duration of the call.
    let r = unsafe { libc::fstat(fd.as_raw_fd(), &mut st) };
    if r < 0 { Err(Error::last_os("fstat")) } else { Ok(st) }
}

/// What `/proc/self/fd/N` points at (e.g. `/memfd:tensorwire (deleted)`).
pub fn fd_target(fd: BorrowedFd<'_>) -> Result<String> {
    let p = format!("/proc/self/fd/{}", fd.as_raw_fd());
    std::fs::read_link(&p)
        .map(|t| t.to_string_lossy().into_owned())
        .map_err(|e| Error::io("readlink /proc/self/fd", e))
}

/// Fill `buf` from the kernel CSPRNG.
/// The page size (4096 if the system does not say).
pub fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as u64 } else { 4096 }
}

/// Physical memory plus swap, in bytes (`sysinfo`): the most shared memory any process
/// on this machine can really fill. 64 GiB if the kernel does not say.
pub fn memory_and_swap_bytes() -> u64 {
    // SAFETY: zeroed `sysinfo` is a valid bit pattern; the kernel fills it.
    let mut si: libc::sysinfo = unsafe { std::mem::zeroed() };
    // SAFETY: `si` is a valid, writable `sysinfo`.
    if unsafe { libc::sysinfo(&mut si) } != 0 {
        return 64 << 30;
    }
    let unit = u64::from(si.mem_unit.max(1));
    (si.totalram as u64).saturating_add(si.totalswap as u64).saturating_mul(unit)
}

pub fn getrandom(buf: &mut [u8]) -> Result<()> {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: the pointer/length pair describes the unfilled tail of `buf`.
        let r = unsafe { libc::getrandom(buf[done..].as_mut_ptr().cast(), buf.len() - done, 0) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::io("getrandom", e));
        }
        done += r as usize;
    }
    Ok(())
}

fn owned(fd: RawFd, op: &'static str) -> Result<OwnedFd> {
    if fd < 0 {
        return Err(Error::last_os(op));
    }
    // SAFETY: `fd` is a fresh descriptor returned by the kernel, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC)`. Pass `cloexec = false` for the end
/// a child should inherit across exec.
pub fn seqpacket_pair() -> Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` is a valid out-array of two ints.
    let r = unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, fds.as_mut_ptr()) };
    if r < 0 {
        return Err(Error::last_os("socketpair(AF_UNIX, SOCK_SEQPACKET)"));
    }
    Ok((owned(fds[0], "socketpair")?, owned(fds[1], "socketpair")?))
}

/// Make `cmd`'s child inherit `fd` (FD_CLOEXEC cleared in the child only, after fork:
/// children spawned concurrently by other threads do not inherit it). Returns the fd
/// number the child sees.
pub fn inherit_in_child(cmd: &mut std::process::Command, fd: BorrowedFd<'_>) -> RawFd {
    use std::os::unix::process::CommandExt;
    let raw = fd.as_raw_fd();
    // SAFETY: the closure runs in the forked child before exec and only calls fcntl,
    // which is async-signal-safe; `raw` is open in the child because fork copies fds.
    unsafe {
        cmd.pre_exec(move || {
            if libc::fcntl(raw, libc::F_SETFD, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    raw
}

/// Set or clear FD_CLOEXEC.
pub fn set_cloexec(fd: BorrowedFd<'_>, on: bool) -> Result<()> {
    // SAFETY: F_GETFD/F_SETFD on an open fd.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) };
    if flags < 0 {
        return Err(Error::last_os("fcntl(F_GETFD)"));
    }
    let new = if on { flags | libc::FD_CLOEXEC } else { flags & !libc::FD_CLOEXEC };
    // SAFETY: as above.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, new) };
    if r < 0 { Err(Error::last_os("fcntl(F_SETFD)")) } else { Ok(()) }
}

fn sockaddr_un(path: &std::path::Path) -> Result<(libc::sockaddr_un, libc::socklen_t)> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: zeroed sockaddr_un is valid.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.is_empty() || bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(Error::InvalidArgument(format!(
            "socket path {:?} must be 1..{} bytes without NUL",
            path,
            addr.sun_path.len() - 1
        )));
    }
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    Ok((addr, len as libc::socklen_t))
}

fn seqpacket_socket() -> Result<OwnedFd> {
    // SAFETY: plain syscall.
    owned(unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) }, "socket(AF_UNIX, SOCK_SEQPACKET)")
}

/// Bind + listen a SEQPACKET socket at `path` (the file must not exist).
pub fn seqpacket_listen(path: &std::path::Path) -> Result<OwnedFd> {
    let (addr, len) = sockaddr_un(path)?;
    let fd = seqpacket_socket()?;
    // SAFETY: `addr` is a valid sockaddr_un of `len` bytes.
    let r = unsafe { libc::bind(fd.as_raw_fd(), (&addr as *const libc::sockaddr_un).cast(), len) };
    if r < 0 {
        return Err(Error::last_os("bind (listener socket path)"));
    }
    // SAFETY: plain syscall on an open socket.
    if unsafe { libc::listen(fd.as_raw_fd(), 128) } < 0 {
        return Err(Error::last_os("listen"));
    }
    Ok(fd)
}

pub fn seqpacket_connect(path: &std::path::Path) -> Result<OwnedFd> {
    let (addr, len) = sockaddr_un(path)?;
    let fd = seqpacket_socket()?;
    // SAFETY: `addr` is a valid sockaddr_un of `len` bytes.
    let r = retry(-1, || unsafe { libc::connect(fd.as_raw_fd(), (&addr as *const libc::sockaddr_un).cast(), len) });
    r.map_err(|e| Error::io("connect (socket path)", e))?;
    Ok(fd)
}

pub fn accept(listener: BorrowedFd<'_>) -> Result<OwnedFd> {
    // SAFETY: null address pointers are allowed by accept4.
    let r = retry(-1, || unsafe {
        libc::accept4(listener.as_raw_fd(), std::ptr::null_mut(), std::ptr::null_mut(), libc::SOCK_CLOEXEC)
    });
    owned(r.map_err(|e| Error::io("accept", e))?, "accept")
}

pub fn set_passcred(fd: BorrowedFd<'_>, on: bool) -> Result<()> {
    let v: libc::c_int = on.into();
    // SAFETY: `v` is a valid int option value of the given size.
    let r = unsafe {
        libc::setsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PASSCRED, (&v as *const libc::c_int).cast(), 4)
    };
    if r < 0 { Err(Error::last_os("setsockopt(SO_PASSCRED)")) } else { Ok(()) }
}

/// SO_PEERCRED: credentials of the process that connected (or created the pair).
pub fn peer_cred(fd: BorrowedFd<'_>) -> Result<libc::ucred> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid out-pointers of the advertised size.
    let r = unsafe {
        libc::getsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut cred as *mut libc::ucred).cast(), &mut len)
    };
    if r < 0 { Err(Error::last_os("getsockopt(SO_PEERCRED)")) } else { Ok(cred) }
}

/// Ancillary buffer big enough for MAX_FDS_PER_MSG fds plus one ucred, aligned for cmsghdr.
#[repr(C, align(8))]
struct CmsgBuf([u8; 256]);

/// Send one SEQPACKET message with optional fds and, if `with_creds`, our own ucred
/// (SCM_CREDENTIALS: the kernel checks it is really ours).
///
/// Waits for room in the socket buffer as `wait` says: a peer that stops reading must not
/// block the sender for ever. `Wait::Forever`: a plain blocking send (for stream sockets,
/// whose sends may be partial without blocking, and which carry their own SO_SNDTIMEO).
pub fn send_msg(sock: BorrowedFd<'_>, payload: &[u8], fds: &[BorrowedFd<'_>], with_creds: bool, wait: impl Into<Wait>) -> Result<()> {
    send_msg_until(sock, payload, fds, with_creds, &mut wait.into().deadline())
}

/// `send_msg` within a caller's deadline (one clock for a larger wait).
pub(crate) fn send_msg_until(
    sock: BorrowedFd<'_>,
    payload: &[u8],
    fds: &[BorrowedFd<'_>],
    with_creds: bool,
    deadline: &mut Deadline,
) -> Result<()> {
    if fds.len() > MAX_FDS_PER_MSG {
        return Err(Error::InvalidArgument(format!("{} fds in one message, at most {MAX_FDS_PER_MSG}", fds.len())));
    }
    let mut iov = libc::iovec { iov_base: payload.as_ptr() as *mut _, iov_len: payload.len() };
    let mut cbuf = CmsgBuf([0; 256]);
    // SAFETY: zeroed msghdr is valid; fields are filled below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    let fd_bytes = std::mem::size_of_val(fds) as u32;
    let cred_bytes = std::mem::size_of::<libc::ucred>() as u32;
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe {
        (if fds.is_empty() { 0 } else { libc::CMSG_SPACE(fd_bytes) }) + if with_creds { libc::CMSG_SPACE(cred_bytes) } else { 0 }
    } as usize;
    if space > 0 {
        msg.msg_control = cbuf.0.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: msg_control points at `cbuf` (256 bytes, 8-aligned) and msg_controllen
        // (`space` ≤ 256 for ≤ 8 fds + 1 ucred) bounds every CMSG_* walk below; each header
        // written is inside that buffer because CMSG_NXTHDR returns null past its end.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            if !fds.is_empty() {
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(fd_bytes) as _;
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                for (i, fd) in fds.iter().enumerate() {
                    data.add(i).write_unaligned(fd.as_raw_fd());
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
            if with_creds {
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_CREDENTIALS;
                (*c).cmsg_len = libc::CMSG_LEN(cred_bytes) as _;
                let cred = libc::ucred { pid: libc::getpid(), uid: libc::getuid(), gid: libc::getgid() };
                libc::CMSG_DATA(c).cast::<libc::ucred>().write_unaligned(cred);
            }
        }
    }
    let forever = deadline.remaining().is_none();
    let r = loop {
        // MSG_NOSIGNAL turns a dead peer into EPIPE instead of SIGPIPE; MSG_DONTWAIT lets
        // a full buffer come back as EAGAIN, waited for below.
        let flags = libc::MSG_NOSIGNAL | if forever { 0 } else { libc::MSG_DONTWAIT };
        // SAFETY: `msg` describes `iov` (pointing at `payload`) and `cbuf`, all alive for
        // the call.
        let r = retry(-1, || unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, flags) });
        match r {
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                if deadline.expired() {
                    return Err(deadline.timed_out("room in the peer's socket buffer (the peer is not reading)"));
                }
                let ev = poll_events(&[(sock, libc::POLLOUT)], deadline.as_wait())?;
                if ev[0] & (libc::POLLHUP | libc::POLLERR) != 0 && ev[0] & libc::POLLOUT == 0 {
                    return Err(Error::peer_gone("the peer closed the connection while we waited to send"));
                }
            }
            r => break r,
        }
    };
    match r {
        Ok(_) => Ok(()),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EPIPE) | Some(libc::ECONNRESET)) => {
            Err(Error::peer_gone(format!("sending a message: {e}")))
        }
        Err(e) => Err(Error::io("sendmsg", e)),
    }
}

/// One received message: payload length written into the caller's buffer, the fds that
/// came with it (already owned, so nothing leaks on any error path), and the sender's
/// kernel-verified credentials if SO_PASSCRED was on.
pub struct Received {
    pub len: usize,
    pub fds: Vec<OwnedFd>,
    pub cred: Option<libc::ucred>,
    /// The payload did not fit the buffer (MSG_TRUNC).
    pub truncated: bool,
    /// Some fds or credentials were dropped by the kernel for lack of room (MSG_CTRUNC).
    pub ctrunc: bool,
}

/// What a receive that does not wait found.
pub enum TryRecv {
    Message(Received),
    /// The peer closed (EOF).
    Closed,
    /// No message is there now.
    Empty,
}

/// Receive one SEQPACKET message into `buf`, waiting for one. Returns `Ok(None)` on EOF
/// (peer closed).
pub fn recv_msg(sock: BorrowedFd<'_>, buf: &mut [u8]) -> Result<Option<Received>> {
    match recv_msg_flags(sock, buf, 0)? {
        TryRecv::Message(r) => Ok(Some(r)),
        TryRecv::Closed => Ok(None),
        // A blocking socket (every socket here) does not say EAGAIN to a waiting receive.
        TryRecv::Empty => Err(Error::io("recvmsg", std::io::Error::from_raw_os_error(libc::EAGAIN))),
    }
}

/// Receive one SEQPACKET message into `buf` if one is there now (MSG_DONTWAIT): one
/// system call where a `poll` and then a receive would be two.
pub fn try_recv_msg(sock: BorrowedFd<'_>, buf: &mut [u8]) -> Result<TryRecv> {
    recv_msg_flags(sock, buf, libc::MSG_DONTWAIT)
}

fn recv_msg_flags(sock: BorrowedFd<'_>, buf: &mut [u8], flags: i32) -> Result<TryRecv> {
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let mut cbuf = CmsgBuf([0; 256]);
    // SAFETY: zeroed msghdr is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.0.as_mut_ptr().cast();
    msg.msg_controllen = cbuf.0.len() as _;
    // SAFETY: `msg` points at `iov` (over `buf`) and `cbuf`, both alive across the call.
    let r = retry(-1, || unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC | flags) });
    let n = match r {
        Ok(n) => n as usize,
        Err(e) if e.raw_os_error() == Some(libc::ECONNRESET) => return Ok(TryRecv::Closed),
        Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => return Ok(TryRecv::Empty),
        Err(e) => return Err(Error::io("recvmsg", e)),
    };
    let mut out = Received {
        len: n.min(buf.len()),
        fds: Vec::new(),
        cred: None,
        truncated: msg.msg_flags & libc::MSG_TRUNC != 0,
        ctrunc: msg.msg_flags & libc::MSG_CTRUNC != 0,
    };
    // SAFETY: the kernel filled `msg_controllen` bytes of `cbuf`; CMSG_FIRSTHDR/NXTHDR stay
    // inside that length, and each header's cmsg_len bounds the data read from it. fds
    // are taken into OwnedFd at once so they are closed on every later error path.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            let hdr = c.read_unaligned();
            let data = libc::CMSG_DATA(c);
            let data_len = (hdr.cmsg_len as usize).saturating_sub(data.offset_from(c.cast::<u8>()) as usize);
            if hdr.cmsg_level == libc::SOL_SOCKET && hdr.cmsg_type == libc::SCM_RIGHTS {
                for i in 0..data_len / std::mem::size_of::<RawFd>() {
                    let fd = data.cast::<RawFd>().add(i).read_unaligned();
                    out.fds.push(OwnedFd::from_raw_fd(fd));
                }
            } else if hdr.cmsg_level == libc::SOL_SOCKET
                && hdr.cmsg_type == libc::SCM_CREDENTIALS
                && data_len >= std::mem::size_of::<libc::ucred>()
            {
                out.cred = Some(data.cast::<libc::ucred>().read_unaligned());
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if n == 0 && out.fds.is_empty() && peer_hung_up(sock) {
        // SEQPACKET reports the peer's EOF as a zero-length read, and so reads a
        // zero-length message: only a hung-up socket is the end. An empty message from a
        // live peer is returned as one (the caller refuses it as malformed).
        return Ok(TryRecv::Closed);
    }
    Ok(TryRecv::Message(out))
}

/// True if this process cannot take one more fd now (EMFILE/ENFILE on a dup of `probe`):
/// tells a message whose fds the kernel dropped at receive (MSG_CTRUNC) because of our fd
/// limit from one that carried too many.
pub fn fd_table_full(probe: BorrowedFd<'_>) -> bool {
    // SAFETY: F_DUPFD_CLOEXEC on an open fd; a returned fd is closed at once below.
    let r = unsafe { libc::fcntl(probe.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
    if r >= 0 {
        // SAFETY: `r` is the fresh fd just returned, owned by nobody else.
        drop(unsafe { OwnedFd::from_raw_fd(r) });
        return false;
    }
    matches!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// True if the peer shut down or closed its end of `sock` (POLLRDHUP / POLLHUP now).
fn peer_hung_up(sock: BorrowedFd<'_>) -> bool {
    poll_events(&[(sock, libc::POLLRDHUP)], Wait::Never)
        .map(|r| r[0] & (libc::POLLRDHUP | libc::POLLHUP) != 0)
        .unwrap_or(true)
}

/// `poll` on up to a few fds for readability, waiting as `wait` says; returns which are
/// ready (or hung up).
pub fn poll_readable(fds: &[BorrowedFd<'_>], wait: impl Into<Wait>) -> Result<Vec<bool>> {
    let with: Vec<_> = fds.iter().map(|f| (*f, libc::POLLIN)).collect();
    Ok(poll_events(&with, wait)?[..fds.len()].iter().map(|&r| r != 0).collect())
}

/// Most fds `poll_events` takes at once.
pub const MAX_POLL_FDS: usize = 4;

/// `poll` with explicit event masks on up to `MAX_POLL_FDS` fds; returns each fd's
/// `revents` (entries past `fds.len()` are 0), waiting as `wait` says (all zero if it ran
/// out). No allocation: it sits on hot paths.
pub fn poll_events(fds: &[(BorrowedFd<'_>, libc::c_short)], wait: impl Into<Wait>) -> Result<[libc::c_short; MAX_POLL_FDS]> {
    if fds.len() > MAX_POLL_FDS {
        return Err(Error::InvalidArgument(format!("poll on {} fds, at most {MAX_POLL_FDS}", fds.len())));
    }
    let mut pfds = [libc::pollfd { fd: -1, events: 0, revents: 0 }; MAX_POLL_FDS];
    for (p, (f, ev)) in pfds.iter_mut().zip(fds) {
        *p = libc::pollfd { fd: f.as_raw_fd(), events: *ev, revents: 0 };
    }
    let mut out = [0; MAX_POLL_FDS];
    // A signal (EINTR) is not the end of the wait: poll again for what is left of it, so
    // a signal storm neither cuts a wait short (a false timeout) nor stretches it.
    let mut deadline = wait.into().deadline();
    loop {
        // Rounded up to whole ms (a wait of 0.5 ms is not "do not wait"); a remaining wait
        // longer than poll's `int` of ms sleeps that long, then polls again.
        let ms: libc::c_int = match deadline.remaining() {
            None => -1,
            Some(t) => (t.as_millis() + u128::from(t.subsec_nanos() % 1_000_000 != 0)).min(i32::MAX as u128) as libc::c_int,
        };
        // SAFETY: `pfds` is a valid array of at least `fds.len()` pollfd for the call.
        let r = unsafe { libc::poll(pfds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        // Nothing ready before a capped wait ran out: wait for the rest.
        if r > 0 || (r == 0 && deadline.expired()) {
            break;
        }
        if r == 0 {
            continue;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::io("poll", e));
        }
        if deadline.expired() {
            return Ok(out);
        }
    }
    for (o, p) in out.iter_mut().zip(&pfds[..fds.len()]) {
        *o = p.revents;
    }
    Ok(out)
}

/// `pidfd_open(pid)`: a pollable handle that becomes readable when the process exits.
/// `None` on kernels without pidfd (socket EOF still reports death there).
pub fn pidfd_open(pid: libc::pid_t) -> Option<OwnedFd> {
    // SAFETY: plain syscall with integer arguments.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if r < 0 {
        return None;
    }
    // SAFETY: the kernel returned a fresh fd owned by nobody else.
    Some(unsafe { OwnedFd::from_raw_fd(r as RawFd) })
}

/// How a process that a pidfd names ended, as the kernel reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessEnd {
    /// Still running (its pidfd is not readable).
    Running,
    /// It called `exit` with this status.
    Exited(i32),
    /// A signal ended it (`core`: it dumped core).
    Killed { signal: i32, core: bool },
    /// It has ended, but its status is not ours to read (not our child, or reaped already).
    Ended,
}

/// How the process behind `pidfd` ended, without reaping it: `waitid(P_PIDFD, …,
/// WEXITED | WNOHANG | WNOWAIT)` leaves the zombie and its status for whoever waits for it
/// (a `subprocess.Popen`, a `Child`). Only a parent can read a status; for any other
/// process an ended one is `Ended`, told by the pidfd being readable.
pub fn pidfd_process_end(pidfd: BorrowedFd<'_>) -> ProcessEnd {
    // SAFETY: siginfo_t is plain data; all zeroes is a valid value (si_pid 0: no child).
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is writable and outlives the call; the fd is valid (borrowed).
    let r = unsafe {
        libc::waitid(libc::P_PIDFD, pidfd.as_raw_fd() as libc::id_t, &mut info, libc::WEXITED | libc::WNOHANG | libc::WNOWAIT)
    };
    // SAFETY: `waitid` filled `info` for a child state change (si_pid != 0), else left it
    // zeroed; si_pid and si_status read the fields the kernel wrote for SIGCHLD info.
    let (pid, status) = unsafe { (info.si_pid(), info.si_status()) };
    if r == 0 && pid != 0 {
        return match info.si_code {
            libc::CLD_EXITED => ProcessEnd::Exited(status),
            libc::CLD_KILLED => ProcessEnd::Killed { signal: status, core: false },
            libc::CLD_DUMPED => ProcessEnd::Killed { signal: status, core: true },
            _ => ProcessEnd::Ended,
        };
    }
    // Not a child of ours (ECHILD), or a child still running (WNOHANG, si_pid 0): the
    // pidfd turns readable once the process has ended.
    match poll_readable(&[pidfd], Wait::Never) {
        Ok(r) if r[0] => ProcessEnd::Ended,
        _ => ProcessEnd::Running,
    }
}

/// A signal's name (`SIGKILL`) for the common ones, else `signal N`.
pub fn signal_name(signal: i32) -> String {
    let name = match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGSYS => "SIGSYS",
        _ => return format!("signal {signal}"),
    };
    name.to_string()
}

/// The CPU the calling thread runs on (u32::MAX if the kernel cannot say).
pub(crate) fn current_cpu() -> u32 {
    // SAFETY: sched_getcpu takes no arguments.
    let cpu = unsafe { libc::sched_getcpu() };
    u32::try_from(cpu).unwrap_or(u32::MAX)
}

/// What [`move_off_this_cpu`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CpuMove {
    /// The thread runs on another CPU now, with its affinity as it was.
    Moved,
    /// The thread may run on this CPU only (`taskset -c N`, a one-CPU cpuset): it stays.
    OnlyHere,
    /// A call failed (or the kernel could not say where we run): nothing changed.
    Failed,
}

/// Move the calling thread to another CPU it may run on, leaving its affinity as it was:
/// narrow the affinity to exclude the current CPU (the kernel migrates the thread at
/// once), then restore it (which does not move the thread back).
pub(crate) fn move_off_this_cpu() -> CpuMove {
    // SAFETY: sched_getcpu takes no arguments.
    let cpu = unsafe { libc::sched_getcpu() };
    if cpu < 0 {
        return CpuMove::Failed;
    }
    // SAFETY: cpu_set_t is plain bits; zeroed is the empty set.
    let mut allowed: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: `allowed` is a writable cpu_set_t of `size` bytes; 0 names this thread.
    if unsafe { libc::sched_getaffinity(0, size, &mut allowed) } != 0 {
        return CpuMove::Failed;
    }
    // SAFETY: CPU_ISSET only reads the set.
    if !unsafe { libc::CPU_ISSET(cpu as usize, &allowed) } {
        return CpuMove::Failed;
    }
    // SAFETY: CPU_COUNT only reads the set.
    if unsafe { libc::CPU_COUNT(&allowed) } < 2 {
        return CpuMove::OnlyHere;
    }
    let mut elsewhere = allowed;
    // SAFETY: cpu < CPU_SETSIZE (the kernel returned it and it is set in `allowed`).
    unsafe { libc::CPU_CLR(cpu as usize, &mut elsewhere) };
    // SAFETY: both sets are valid cpu_set_t values of `size` bytes; 0 names this thread.
    let moved = unsafe { libc::sched_setaffinity(0, size, &elsewhere) == 0 && libc::sched_setaffinity(0, size, &allowed) == 0 };
    if moved { CpuMove::Moved } else { CpuMove::Failed }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn affinity() -> libc::cpu_set_t {
        // SAFETY: zeroed is the empty set; the call fills a set of the size passed.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            assert_eq!(libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set), 0);
            set
        }
    }

    #[test]
    fn a_thread_allowed_one_cpu_is_not_moved_and_says_so() {
        std::thread::spawn(|| {
            let cpu = current_cpu();
            // SAFETY: zeroed is the empty set; CPU_SET writes bit `cpu` (the kernel named
            // it); sched_setaffinity reads a set of the size passed; 0: this thread.
            let only = unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(cpu as usize, &mut set);
                assert_eq!(libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set), 0);
                set
            };
            assert_eq!(move_off_this_cpu(), CpuMove::OnlyHere);
            assert_eq!(current_cpu(), cpu);
            let after = affinity();
            // SAFETY: CPU_EQUAL only reads the two sets.
            assert!(unsafe { libc::CPU_EQUAL(&only, &after) }, "the one-CPU affinity changed");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn moving_off_this_cpu_changes_the_cpu_and_keeps_the_affinity() {
        // In a thread of its own: the test harness's threads keep theirs.
        std::thread::spawn(|| {
            let before = affinity();
            // SAFETY: CPU_COUNT only reads the set.
            if unsafe { libc::CPU_COUNT(&before) } < 2 {
                eprintln!("SKIPPED: this thread may run on one CPU only; nowhere to move");
                return;
            }
            for _ in 0..3 {
                let cpu = current_cpu();
                assert_eq!(move_off_this_cpu(), CpuMove::Moved, "the move failed");
                assert_ne!(current_cpu(), cpu, "still on CPU {cpu} after the move");
                let after = affinity();
                // SAFETY: CPU_EQUAL only reads the two sets.
                assert!(unsafe { libc::CPU_EQUAL(&before, &after) }, "the thread's affinity was not restored");
            }
        })
        .join()
        .unwrap();
    }
}
