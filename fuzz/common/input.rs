//! Shared by the fuzz targets (included with `#[path]`): reading numbers out of the
//! fuzzer's bytes, and a raw peer end of a SEQPACKET socketpair that sends whatever the
//! fuzzer says.
#![allow(dead_code)]

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use tensorwire::Segment;

/// The fuzzer's bytes, read front to back; past the end every read gives zeros, so a
/// short input is still a complete (if dull) script.
pub struct Input<'a> {
    pub d: &'a [u8],
}

impl<'a> Input<'a> {
    pub fn new(d: &'a [u8]) -> Self {
        Input { d }
    }
    pub fn is_empty(&self) -> bool {
        self.d.is_empty()
    }
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.d.len());
        let (a, b) = self.d.split_at(n);
        self.d = b;
        a
    }
    fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let b = self.bytes(N);
        out[..b.len()].copy_from_slice(b);
        out
    }
    pub fn u8(&mut self) -> u8 {
        self.array::<1>()[0]
    }
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.array())
    }
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }
    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }
}

/// The connection's message framing (src/connection.rs): 4-byte magic, 4-byte kind.
pub const MSG_MAGIC: [u8; 4] = *b"TWM1";
pub const HELLO_MAGIC: [u8; 8] = *b"TWHELLO1";

/// A framed message: magic, kind, payload.
pub fn framed(kind: u32, payload: &[u8]) -> Vec<u8> {
    let mut m = MSG_MAGIC.to_vec();
    m.extend_from_slice(&kind.to_le_bytes());
    m.extend_from_slice(payload);
    m
}

/// A well-formed hello as `Connection::establish_with` sends it.
pub fn hello(version: u32, max_message: u32) -> Vec<u8> {
    let mut p = HELLO_MAGIC.to_vec();
    p.extend_from_slice(&version.to_le_bytes());
    p.extend_from_slice(&max_message.to_le_bytes());
    framed(0, &p)
}

/// A memfd of `len` bytes holding `fill` at its start; sealed against shrink/grow (as a
/// tensorwire segment is) unless `unsealed`.
pub fn memfd(len: usize, fill: &[u8], unsealed: bool) -> OwnedFd {
    if unsealed || len == 0 {
        let fd = tensorwire::os::memfd_create("fuzz").expect("memfd_create");
        tensorwire::os::ftruncate(fd.as_fd(), len as u64).expect("ftruncate");
        if !fill.is_empty() && len > 0 {
            let n = fill.len().min(len);
            // SAFETY: `fill[..n]` is a valid buffer; pwrite copies it into the file.
            let r = unsafe { libc::pwrite(std::os::fd::AsRawFd::as_raw_fd(&fd), fill.as_ptr().cast(), n, 0) };
            assert_eq!(r, n as isize, "pwrite into a fresh memfd");
        }
        return fd;
    }
    let seg = Segment::create(len).expect("Segment::create");
    seg.write_at(0, &fill[..fill.len().min(len)]).expect("write_at");
    dup(seg.fd())
}

pub fn dup(fd: BorrowedFd<'_>) -> OwnedFd {
    fd.try_clone_to_owned().expect("dup")
}

/// Send one raw SEQPACKET message (no credentials) from the fuzzer's end.
pub fn send_raw(sock: BorrowedFd<'_>, payload: &[u8], fds: &[BorrowedFd<'_>]) -> bool {
    tensorwire::os::send_msg(sock, payload, fds, false, Some(std::time::Duration::from_millis(100))).is_ok()
}

/// No more messages from the fuzzer's end: the other side sees EOF after reading what
/// was sent, so nothing under test ever waits for a timeout.
pub fn shutdown_write(sock: BorrowedFd<'_>) {
    // SAFETY: plain syscall on a valid socket fd.
    unsafe { libc::shutdown(std::os::fd::AsRawFd::as_raw_fd(&sock), libc::SHUT_WR) };
}
