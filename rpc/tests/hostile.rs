//! A hostile or broken peer on a raw socket: truncated frames, lengths over the cap,
//! invalid UTF-8, JSON that is not an object, unknown kinds, responses to unknown ids, a
//! peer that writes and never reads. Each gets a clear error; nothing crashes; memory
//! stays bounded.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};
use tensorwire_rpc::*;

fn server(cfg: RpcConfig) -> (Endpoint, UnixStream) {
    let (a, b) = UnixStream::pair().unwrap();
    let reg = Registry::new();
    reg.register("calc", Service::new("Calc").method_inline("echo", |_, a| Ok(Value::Array(a.args)))).unwrap();
    (Endpoint::new(Stream::Unix(a), reg, cfg).unwrap(), b)
}

fn frame(payload: &[u8]) -> Vec<u8> {
    let mut v = (payload.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(payload);
    v
}

fn closed_with(ep: &Endpoint) -> String {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !ep.is_closed() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    ep.close_reason().expect("connection should be closed").to_string()
}

#[test]
fn bad_frames_close_the_connection_with_a_clear_error() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (0xFFFF_FFF0u32.to_be_bytes().to_vec(), "over the 1048576-byte cap"),
        (frame(b"\xff\xfe{}"), "not valid UTF-8"),
        (frame(b"[1, 2]"), "expected an object or null"),
        (frame(b"{\"kind\": \"bogus\", \"call_id\": 1}"), "unknown message kind"),
        (frame(b"{\"kind\": \"response\", \"call_id\": 77, \"result\": 1, \"error\": null}"), "never sent"),
        (frame(b"{\"kind\": \"call\", \"call_id\": 1}"), "no \"object_id\""),
        (frame(b"{not json"), "invalid JSON"),
        (frame(&[b'['; 100_000]), "nesting deeper"),
    ];
    for (bytes, want) in cases {
        let cfg = RpcConfig { max_frame: 1 << 20, ..RpcConfig::default() };
        let (ep, mut raw) = server(cfg);
        let pending = ep.start_call("x", "y", vec![], Map::new(), CallOptions::default()).unwrap();
        raw.write_all(&bytes).unwrap();
        let why = closed_with(&ep);
        assert!(why.contains(want), "{why:?} should mention {want:?}");
        // The pending call fails with the same reason instead of hanging.
        let r = pending.wait();
        assert!(r.is_err());
    }
}

#[test]
fn truncated_frame_then_hangup_is_peer_gone() {
    let (ep, mut raw) = server(RpcConfig::default());
    raw.write_all(&[0, 0, 0, 50, b'{', b'"']).unwrap();
    drop(raw);
    let why = closed_with(&ep);
    assert!(why.contains("in the middle of a frame"), "{why}");
}

#[test]
fn huge_declared_length_allocates_nothing_up_front() {
    // A 60 MiB frame is under the default cap; the peer sends the header and 10 bytes.
    let (ep, mut raw) = server(RpcConfig::default());
    raw.write_all(&(60u32 << 20).to_be_bytes()).unwrap();
    raw.write_all(b"{\"kind\": ").unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(!ep.is_closed(), "a partial frame is not an error yet");
    // Peak RSS stays far below the declared size.
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let rss_kb: u64 = status.lines().find(|l| l.starts_with("VmHWM")).unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(rss_kb < 50 * 1024, "peak RSS {rss_kb} kB");
}

#[test]
fn valid_requests_still_work_and_null_closes() {
    let (ep, mut raw) = server(RpcConfig::default());
    raw.write_all(&frame(br#"{"kind": "call", "object_id": "calc", "call_id": 0, "parent_call_id": null, "method": "echo", "args": [NaN, "\u00e9"], "kwargs": {}}"#)).unwrap();
    let mut hdr = [0u8; 4];
    raw.read_exact(&mut hdr).unwrap();
    let mut body = vec![0u8; u32::from_be_bytes(hdr) as usize];
    raw.read_exact(&mut body).unwrap();
    assert_eq!(std::str::from_utf8(&body).unwrap(), "{\"kind\": \"response\", \"call_id\": 0, \"result\": [NaN, \"\u{e9}\"], \"error\": null}");
    raw.write_all(&frame(b"null")).unwrap();
    raw.read_exact(&mut hdr).unwrap();
    let mut body = vec![0u8; u32::from_be_bytes(hdr) as usize];
    raw.read_exact(&mut body).unwrap();
    assert_eq!(body, b"null", "the close frame is answered");
    assert!(closed_with(&ep).contains("closed the connection"));
}

#[test]
fn a_peer_that_writes_and_never_reads_is_cut_off() {
    let cfg = RpcConfig { send_timeout: Duration::from_millis(300), ..RpcConfig::default() };
    let (ep, raw) = server(cfg);
    // Flood requests whose responses are large, never reading any of them.
    let big = "x".repeat(64 * 1024);
    let writer = std::thread::spawn(move || {
        let mut raw = raw;
        for i in 0..2000 {
            let msg = format!(
                r#"{{"kind": "call", "object_id": "calc", "call_id": {i}, "parent_call_id": null, "method": "echo", "args": ["{big}"], "kwargs": {{}}}}"#
            );
            if raw.write_all(&frame(msg.as_bytes())).is_err() {
                break;
            }
        }
        raw
    });
    let why = closed_with(&ep);
    assert!(why.contains("not reading"), "{why}");
    drop(writer.join().unwrap());
}

#[test]
fn oversize_outgoing_messages_are_refused_locally() {
    let cfg = RpcConfig { max_frame: 1024, ..RpcConfig::default() };
    let (ep, _raw) = server(cfg);
    let e = ep.call("calc", "echo", vec![Value::Str("y".repeat(4096))]).unwrap_err().to_string();
    assert!(e.contains("frame cap"), "{e}");
    assert!(!ep.is_closed());
}
