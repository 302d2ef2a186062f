//! The connection handshake and message framing, driven through a real SEQPACKET
//! socketpair whose other end sends the fuzzer's messages (src/connection.rs).
//!
//! The raw end sends a first message (a well-formed hello with fuzzed version, or raw
//! bytes; with or without SCM_CREDENTIALS), then up to 8 further messages (framed with a fuzzed kind, or raw), some
//! carrying an fd, then shuts down its write side so nothing waits for a timeout.
//! `Connection::establish_with` must accept exactly a well-formed hello, and each later
//! `recv` must return exactly the well-formed messages (payload, kind, fds intact) and
//! refuse the others — never panic, never hand out more than `max_message` bytes.
#![no_main]

#[path = "../common/input.rs"]
mod input;

use input::{Input, framed, hello, memfd, send_raw, shutdown_write};
use libfuzzer_sys::fuzz_target;
use std::os::fd::AsFd;
use std::time::Duration;
use tensorwire::Connection;

/// The connection's hello receive buffer (a larger hello is truncated, so refused).
const HELLO_BUF: usize = 256;

struct Sent {
    bytes: Vec<u8>,
    fds: usize,
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    let mode = inp.u8();
    let max_message = 16 + usize::from(inp.u16() % 2048);
    let (ours, raw) = tensorwire::os::seqpacket_pair().expect("socketpair");

    // The hello: well-formed but for what the fuzzer picks, or raw bytes.
    let first = if mode & 1 == 0 {
        let version = if mode & 2 == 0 { tensorwire::wire::connection::PROTOCOL_VERSION } else { inp.u32() };
        let mut h = hello(version, inp.u32());
        if mode & 4 != 0 {
            // Trailing bytes are allowed (a later protocol may extend the hello).
            let n = usize::from(inp.u16() % 300);
            h.extend_from_slice(inp.bytes(n));
        }
        h
    } else {
        let n = usize::from(inp.u16() % 300);
        inp.bytes(n).to_vec()
    };
    let hello_fd = mode & 8 != 0;
    let fd = memfd(64, b"fuzz", false);
    let mut sent = Vec::new();
    let hello_fds = if hello_fd { vec![fd.as_fd()] } else { Vec::new() };
    // With SCM_CREDENTIALS, as a real peer sends its hello, or without (then the kernel
    // reports pid 0: no identity).
    let hello_creds = mode & 0x10 == 0;
    if tensorwire::os::send_msg(raw.as_fd(), &first, &hello_fds, hello_creds, Some(Duration::from_millis(100))).is_err() {
        return;
    }
    let count = inp.u8() % 9;
    for _ in 0..count {
        let flags = inp.u8();
        let len = if flags & 4 != 0 {
            // Around the size limit: max_message + header, one either side.
            max_message + 8 + usize::from(inp.u8() % 3) - 1
        } else {
            usize::from(inp.u16() % 600)
        };
        let bytes = if flags & 1 != 0 {
            let kind = if flags & 8 != 0 { inp.u32() } else { 1 + u32::from(inp.u8() % 8) };
            let body_len = len.saturating_sub(8);
            // Zero-filled past the fuzzer's bytes, so the length is what was asked for.
            let mut body = inp.bytes(body_len).to_vec();
            body.resize(body_len, 0);
            framed(kind, &body)
        } else {
            inp.bytes(len).to_vec()
        };
        let nfds = usize::from(flags >> 5 & 3);
        let fds: Vec<_> = (0..nfds).map(|_| fd.as_fd()).collect();
        if !send_raw(raw.as_fd(), &bytes, &fds) {
            break;
        }
        sent.push(Sent { bytes, fds: nfds });
    }
    shutdown_write(raw.as_fd());

    let hello_ok = !hello_fd
        && hello_creds
        && first.len() >= 24
        && first.len() <= HELLO_BUF
        && first[0..4] == input::MSG_MAGIC
        && first[4..8] == [0; 4]
        && first[8..16] == input::HELLO_MAGIC
        && first[16..20] == tensorwire::wire::connection::PROTOCOL_VERSION.to_le_bytes();
    let conn = match Connection::establish_with(ours, Duration::from_secs(5), max_message) {
        Ok(c) => {
            assert!(hello_ok, "accepted a malformed hello {first:02x?} (fd: {hello_fd}, credentials: {hello_creds})");
            c
        }
        Err(e) => {
            assert!(!hello_ok, "refused a well-formed hello {first:02x?}: {e}");
            assert!(!e.to_string().is_empty());
            return;
        }
    };
    assert_eq!(conn.peer_pid(), std::process::id() as i32, "the kernel-verified pid is ours");

    for s in &sent {
        let ok = s.bytes.len() >= 8
            && s.bytes.len() - 8 <= max_message
            && s.bytes[0..4] == input::MSG_MAGIC
            && s.bytes[4..8] != [0; 4];
        match conn.recv(Some(Duration::from_secs(5))) {
            Ok(m) => {
                assert!(ok, "accepted a malformed message {:02x?}", s.bytes);
                assert!(m.payload.len() <= max_message);
                assert_eq!(m.kind.to_le_bytes(), s.bytes[4..8]);
                assert_eq!(m.payload, s.bytes[8..], "payload changed on the way");
                assert_eq!(m.fds.len(), s.fds, "fds lost or added");
                assert!(!m.fds_lost);
            }
            Err(e) => {
                assert!(!ok, "refused a well-formed message of {} bytes: {e}", s.bytes.len());
                // One bad message ends what this test can predict (a zero-length one
                // reads as EOF).
                return;
            }
        }
    }
    // Everything sent was read: the next read sees the shutdown.
    let end = conn.recv(Some(Duration::from_secs(5))).expect_err("nothing more was sent");
    assert!(end.is_peer_gone(), "after the last message: {end}");
});
