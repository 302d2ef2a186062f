//! The byte streams an endpoint runs over: a Unix stream socket (a path, as pyisolate's
//! `PYISOLATE_UDS_ADDRESS`, or an inherited socketpair fd) or TCP (a peer on another
//! machine: tensors are then always copied into the JSON-side form, never shared).
//!
//! Reads and writes take `&self`: an endpoint reads and writes the one socket from
//! different threads without a second fd (a dup per direction would triple what each
//! connection costs in fds).

use crate::error::{Result, RpcError};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};
use tensorwire::Wait;

/// One connected stream.
#[derive(Debug)]
pub enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    /// Connect to a Unix socket path; a `tcp://host:port` address connects over TCP
    /// (pyisolate accepts the same two forms in `PYISOLATE_UDS_ADDRESS`).
    pub fn connect(addr: &str) -> Result<Stream> {
        if let Some(hp) = addr.strip_prefix("tcp://") {
            let s = TcpStream::connect(hp).map_err(|e| RpcError::io(&format!("connecting to {addr}"), e))?;
            let _ = s.set_nodelay(true);
            Ok(Stream::Tcp(s))
        } else {
            Ok(Stream::Unix(UnixStream::connect(addr).map_err(|e| RpcError::io(&format!("connecting to {addr}"), e))?))
        }
    }

    /// From an inherited (or socketpair) Unix stream socket fd.
    pub fn from_fd(fd: OwnedFd) -> Stream {
        Stream::Unix(UnixStream::from(fd))
    }

    /// A connected Unix stream pair (tests, in-process use).
    pub fn pair() -> Result<(Stream, Stream)> {
        let (a, b) = UnixStream::pair().map_err(|e| RpcError::io("socketpair", e))?;
        Ok((Stream::Unix(a), Stream::Unix(b)))
    }

    pub fn is_unix(&self) -> bool {
        matches!(self, Stream::Unix(_))
    }

    pub fn try_clone(&self) -> Result<Stream> {
        match self {
            Stream::Unix(s) => s.try_clone().map(Stream::Unix),
            Stream::Tcp(s) => s.try_clone().map(Stream::Tcp),
        }
        .map_err(|e| RpcError::io("dup of the socket", e))
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Stream::Unix(s) => s.as_fd(),
            Stream::Tcp(s) => s.as_fd(),
        }
    }

    pub fn set_write_timeout(&self, t: Option<Duration>) -> Result<()> {
        match self {
            Stream::Unix(s) => s.set_write_timeout(t),
            Stream::Tcp(s) => s.set_write_timeout(t),
        }
        .map_err(|e| RpcError::io("setting the send timeout", e))
    }

    pub fn shutdown(&self) {
        let _ = match self {
            Stream::Unix(s) => s.shutdown(Shutdown::Both),
            Stream::Tcp(s) => s.shutdown(Shutdown::Both),
        };
    }

    /// Read some bytes; fds that came with them (Unix only) are appended to `fds`.
    /// `Ok(0)` is EOF.
    pub fn read_some(&self, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> Result<usize> {
        match self {
            Stream::Unix(s) => match tensorwire::os::recv_msg(s.as_fd(), buf)? {
                None => Ok(0),
                Some(r) => {
                    fds.extend(r.fds);
                    Ok(r.len)
                }
            },
            Stream::Tcp(s) => loop {
                match (&*s).read(buf) {
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok(0),
                    Err(e) => return Err(RpcError::io("reading from the peer", e)),
                }
            },
        }
    }

    /// Write all of `data`; a timeout here means the peer stopped reading.
    pub fn write_all(&self, data: &[u8]) -> std::io::Result<()> {
        match self {
            Stream::Unix(s) => (&*s).write_all(data),
            Stream::Tcp(s) => (&*s).write_all(data),
        }
    }

    /// Write all of `data` by `deadline`, however many partial writes it takes; what
    /// does not fit waits for room until then (`TimedOut` after). Not `write_all` under
    /// SO_SNDTIMEO: that bounds each blocking write, and one that moved some bytes
    /// returns short and the next waits afresh, so a large write to a peer that stops
    /// reading would wait several times the bound.
    pub fn write_all_by(&self, mut data: &[u8], deadline: Instant) -> std::io::Result<()> {
        let fd = self.fd();
        while !data.is_empty() {
            // SAFETY: `data` is a valid buffer of `data.len()` bytes for the call; `fd` is
            // our open socket. MSG_NOSIGNAL: a peer gone is EPIPE, not SIGPIPE.
            let n = unsafe { libc::send(fd.as_raw_fd(), data.as_ptr().cast(), data.len(), libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
            if n >= 0 {
                data = &data[n as usize..];
                continue;
            }
            let e = std::io::Error::last_os_error();
            match e.kind() {
                std::io::ErrorKind::Interrupted => {}
                std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(std::io::ErrorKind::TimedOut.into());
                    }
                    // Blocks (no spin) until there is room, the peer hangs up (the next
                    // send says how), or the deadline.
                    tensorwire::os::poll_events(&[(fd, libc::POLLOUT)], Wait::Until(deadline)).map_err(std::io::Error::other)?;
                }
                _ => return Err(e),
            }
        }
        Ok(())
    }

    /// Write `data` with `fd` attached (SCM_RIGHTS; Unix only). The whole of `data` goes
    /// in one sendmsg, so keep it small.
    pub fn write_with_fd(&self, data: &[u8], fd: BorrowedFd<'_>) -> Result<()> {
        match self {
            Stream::Unix(s) => Ok(tensorwire::os::send_msg(s.as_fd(), data, &[fd], false, None)?),
            Stream::Tcp(_) => Err(RpcError::InvalidArgument("fds cannot travel over TCP".into())),
        }
    }
}
