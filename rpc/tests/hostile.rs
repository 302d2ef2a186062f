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

/// A handler that sleeps `d`, then answers `None`.
fn sleeps(d: Duration) -> impl Fn(&CallCtx, Args) -> Result<Value> + Send + Sync + 'static {
    move |_, _| {
        std::thread::sleep(d);
        Ok(Value::Null)
    }
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

/// A remote tensor where none was negotiated (a Unix socket, or a build without the `ucx`
/// feature): the call gets a named error, nothing is read or allocated, the connection
/// serves on.
#[test]
fn a_remote_tensor_never_negotiated_is_refused() {
    let (ep, mut raw) = server(RpcConfig::default());
    let read = |raw: &mut UnixStream| {
        let mut hdr = [0u8; 4];
        raw.read_exact(&mut hdr).unwrap();
        let mut body = vec![0u8; u32::from_be_bytes(hdr) as usize];
        raw.read_exact(&mut body).unwrap();
        String::from_utf8(body).unwrap()
    };
    raw.write_all(&frame(br#"{"kind": "call", "object_id": "calc", "call_id": 0, "parent_call_id": null, "method": "echo", "args": [{"__type__": "TensorwireRemote", "engine": "ucx", "worker_address": "AA==", "rkey": "AA==", "address": 4096, "length": 4096, "export_id": 1, "dtype": "torch.uint8", "tensor_size": [4096], "tensor_stride": [1], "tensor_offset": 0}], "kwargs": {}}"#)).unwrap();
    let r = read(&mut raw);
    assert!(r.contains("a remote tensor (TensorwireRemote) arrived"), "{r}");
    raw.write_all(&frame(br#"{"kind": "call", "object_id": "calc", "call_id": 1, "parent_call_id": null, "method": "echo", "args": [1], "kwargs": {}}"#)).unwrap();
    assert!(read(&mut raw).contains("\"result\": [1]"));
    assert!(!ep.is_closed());
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

/// A server with a `sum` method over a tensor argument (as the echo example has).
fn summing_server(cfg: RpcConfig) -> (Endpoint, Endpoint) {
    let reg = Registry::new();
    reg.register(
        "calc",
        Service::new("Calc").method("sum", |_, a| {
            let t = a.req(0, "t")?.as_tensor().ok_or_else(|| RpcError::Remote("expected a tensor".into()))?;
            Ok(Value::Float(t.to_f64_vec()?.iter().sum()))
        }),
    )
    .unwrap();
    Endpoint::pair(reg, Registry::new(), cfg).unwrap()
}

#[test]
fn a_native_broadcast_view_cannot_size_the_servers_copies() {
    let (_server, client) = summing_server(RpcConfig::default());
    assert!(client.negotiate_native(Duration::from_secs(5)).unwrap());
    // One float of storage viewed as 2^28 elements with stride 0 (valid: the view stays
    // inside its storage), sent natively: the server's copy would be sized by the view.
    let one = tensorwire::SharedTensor::zeros(tensorwire::Layout::contiguous(tensorwire::DType::Float32, &[1]).unwrap()).unwrap();
    one.write_storage(0, &2.5f32.to_ne_bytes()).unwrap();
    let wide = one.view(tensorwire::Layout::strided(tensorwire::DType::Float32, &[1 << 28], &[0], 0).unwrap()).unwrap();
    let e = client.call("calc", "sum", vec![Value::from(Tensor::Shared(wide))]).unwrap_err().to_string();
    assert!(e.contains("RpcConfig::max_tensor_copy") && e.contains("2147483648"), "{e}");
    // Within the limit the same kind of view is fine.
    let narrow = one.view(tensorwire::Layout::strided(tensorwire::DType::Float32, &[4], &[0], 0).unwrap()).unwrap();
    assert_eq!(client.call("calc", "sum", vec![Value::from(Tensor::Shared(narrow))]).unwrap(), Value::Float(10.0));
}

#[test]
fn the_copy_limit_is_a_config_field() {
    let cfg = RpcConfig { max_tensor_copy: 16, ..RpcConfig::default() };
    let (_server, client) = summing_server(cfg);
    assert!(client.negotiate_native(Duration::from_secs(5)).unwrap());
    let t = Tensor::from_f32(&[2], &[1.0, 2.0]).unwrap();
    assert_eq!(client.call("calc", "sum", vec![Value::from(t)]).unwrap(), Value::Float(3.0), "16 bytes of f64s fit");
    let t = Tensor::from_f32(&[3], &[1.0, 2.0, 3.0]).unwrap();
    let e = client.call("calc", "sum", vec![Value::from(t)]).unwrap_err().to_string();
    assert!(e.contains("over the 16-byte limit") && e.contains("max_tensor_copy"), "{e}");
}

#[test]
fn too_many_json_values_close_the_connection_naming_the_limit() {
    let cfg = RpcConfig { max_values: 1000, ..RpcConfig::default() };
    let (ep, mut raw) = server(cfg);
    let zeros = vec!["0"; 2000].join(", ");
    let msg = format!(r#"{{"kind": "call", "object_id": "calc", "call_id": 0, "parent_call_id": null, "method": "echo", "args": [[{zeros}]], "kwargs": {{}}}}"#);
    raw.write_all(&frame(msg.as_bytes())).unwrap();
    let why = closed_with(&ep);
    assert!(why.contains("more than 1000 JSON values") && why.contains("RpcConfig::max_values"), "{why}");
    // The peer was told why before the hang-up.
    let mut hdr = [0u8; 4];
    raw.read_exact(&mut hdr).unwrap();
    let mut body = vec![0u8; u32::from_be_bytes(hdr) as usize];
    raw.read_exact(&mut body).unwrap();
    let notice = String::from_utf8(body).unwrap();
    assert!(notice.contains("\"call_id\": -1") && notice.contains("max_values"), "{notice}");
    // Just under the limit is fine (999 zeros + the list + args + the message's values).
    let (ep, mut raw) = server(RpcConfig { max_values: 1000, ..RpcConfig::default() });
    let zeros = vec!["0"; 980].join(", ");
    let msg = format!(r#"{{"kind": "call", "object_id": "calc", "call_id": 0, "parent_call_id": null, "method": "echo", "args": [[{zeros}]], "kwargs": {{}}}}"#);
    raw.write_all(&frame(msg.as_bytes())).unwrap();
    raw.read_exact(&mut hdr).unwrap();
    let mut body = vec![0u8; u32::from_be_bytes(hdr) as usize];
    raw.read_exact(&mut body).unwrap();
    assert!(String::from_utf8_lossy(&body).contains("\"error\": null"));
    assert!(!ep.is_closed());
}

#[test]
fn a_client_refused_at_the_connection_cap_is_told_why() {
    let path = format!("/tmp/tw-hostile-cap-{}.sock", std::process::id());
    let _ = std::fs::remove_file(&path);
    let cfg = RpcConfig { max_connections: 1, ..RpcConfig::default() };
    let server = std::sync::Arc::new(Server::bind(&path, Registry::new(), cfg).unwrap());
    let s2 = server.clone();
    let t = std::thread::spawn(move || (s2.accept().map(|_| ()), s2.accept().map(|_| ())));
    let first = Endpoint::connect(&path, Registry::new(), RpcConfig::default()).unwrap();
    let second = Endpoint::connect(&path, Registry::new(), RpcConfig::default()).unwrap();
    let (a, b) = t.join().unwrap();
    assert!(a.is_ok());
    assert!(matches!(b, Err(RpcError::ConnectionLimit { open: 1, cap: 1 })), "{b:?}");
    let why = second.wait_closed().to_string();
    assert!(why.contains("server busy") && why.contains("RpcConfig::max_connections"), "{why}");
    assert!(!first.is_closed());
    assert_eq!(server.connections(), 1);
}

#[test]
fn requests_beyond_max_workers_are_answered_busy_and_the_pool_recovers() {
    // Two workers, both held by requests that block until released: a third request to a
    // pool handler is answered "server busy" at once (never queued behind them), and
    // once they return the pool serves again.
    let entered = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let release_rx = std::sync::Arc::new(std::sync::Mutex::new(release_rx));
    let e = entered.clone();
    let svc = Service::new("Slow")
        .method("hold", move |_, _| {
            e.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            release_rx.lock().unwrap().recv().unwrap();
            Ok(Value::Null)
        })
        .method("quick", |_, _| Ok(Value::Int(1)));
    let reg = Registry::new();
    reg.register("slow", svc).unwrap();
    let cfg = RpcConfig { max_workers: 2, ..RpcConfig::default() };
    let (server, client) = Endpoint::pair(reg, Registry::new(), cfg).unwrap();
    let held: Vec<_> = (0..2).map(|_| client.start_call("slow", "hold", vec![], Map::new(), CallOptions::default()).unwrap()).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while entered.load(std::sync::atomic::Ordering::SeqCst) < 2 {
        assert!(Instant::now() < deadline, "both held requests should reach a worker");
        std::thread::sleep(Duration::from_millis(1));
    }
    match client.call("slow", "quick", vec![]) {
        Err(RpcError::Remote(m)) => assert_eq!(m, "server busy: all 2 workers are occupied"),
        other => panic!("a third request should be answered busy, got {other:?}"),
    }
    release_tx.send(()).unwrap();
    release_tx.send(()).unwrap();
    for p in held {
        assert_eq!(p.wait().unwrap(), Value::Null);
    }
    // A worker that just answered may not be waiting for the next job yet: allow it a
    // moment, then the pool must serve again.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match client.call("slow", "quick", vec![]) {
            Ok(v) => break assert_eq!(v, Value::Int(1)),
            Err(RpcError::Remote(m)) if m.contains("busy") && Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => panic!("the pool should serve again once its workers are free: {e}"),
        }
    }
    drop(server);
}

#[test]
fn inline_requests_waiting_for_a_worker_are_bounded_by_frame_bytes() {
    // While a call of the server's leads its socket, requests for its inline handlers that
    // the (one-worker) pool cannot take wait in the lane — at most max_frame bytes of
    // their frames; beyond that they are answered "server busy", never held.
    let s_reg = Registry::new();
    s_reg.register("calc", Service::new("Calc").method_inline("hold", sleeps(Duration::from_millis(100)))).unwrap();
    let c_reg = Registry::new();
    c_reg.register("peer", Service::new("Peer").method("slow", sleeps(Duration::from_secs(1)))).unwrap();
    let (a, b) = Stream::pair().unwrap();
    let s = Endpoint::new(a, s_reg, RpcConfig { max_workers: 1, max_frame: 8192, ..RpcConfig::default() }).unwrap();
    let c = Endpoint::new(b, c_reg, RpcConfig::default()).unwrap();
    let s2 = s.clone();
    let leading = std::thread::spawn(move || s2.call("peer", "slow", vec![]));
    std::thread::sleep(Duration::from_millis(50));
    // 20 requests of about 2 KiB each, at once: 8 KiB of them may wait.
    let big = Value::Str("x".repeat(2000));
    let pend: Vec<_> = (0..20).map(|_| c.start_call("calc", "hold", vec![big.clone()], Map::new(), CallOptions::default()).unwrap()).collect();
    let (mut ok, mut busy) = (0, 0);
    for p in pend {
        match p.wait() {
            Ok(_) => ok += 1,
            Err(RpcError::Remote(m)) if m == "server busy: all 1 workers are occupied" => busy += 1,
            Err(e) => panic!("unexpected error {e}"),
        }
    }
    assert!(busy > 0 && (2..=10).contains(&ok), "{ok} served, {busy} answered busy: the lane should hold about 8 KiB of requests");
    assert_eq!(leading.join().unwrap().unwrap(), Value::Null);
}

#[test]
fn a_connection_without_a_first_message_is_closed_and_frees_its_slot() {
    // One slot, 300 ms for the first message: a client that connects and sends nothing,
    // or half a frame, is told why and cut off, and its slot is free again; one that
    // speaks in time stays, however long it is quiet afterwards.
    let path = format!("/tmp/tw-hostile-first-{}.sock", std::process::id());
    let _ = std::fs::remove_file(&path);
    let reg = Registry::new();
    reg.register("calc", Service::new("Calc").method_inline("echo", |_, a| Ok(Value::Array(a.args)))).unwrap();
    let cfg = RpcConfig { max_connections: 1, first_message_timeout: Some(Duration::from_millis(300)), ..RpcConfig::default() };
    let server = Server::bind(&path, reg, cfg).unwrap();
    let read_to_end = |s: &mut UnixStream| {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut got = Vec::new();
        let r = s.read_to_end(&mut got);
        assert!(r.is_ok(), "the server should close the connection, not leave it open: {r:?}");
        String::from_utf8_lossy(&got).into_owned()
    };
    for first_bytes in [&b""[..], &[0, 0, 0, 50, b'{', b'"']] {
        let mut raw = UnixStream::connect(&path).unwrap();
        let t0 = Instant::now();
        let ep = server.accept().unwrap();
        raw.write_all(first_bytes).unwrap();
        assert_eq!(server.connections(), 1);
        let told = read_to_end(&mut raw);
        assert!(told.contains("no complete message") && told.contains("RpcConfig::first_message_timeout"), "{told:?}");
        assert!(t0.elapsed() >= Duration::from_millis(250), "cut off too early: {:?}", t0.elapsed());
        assert!(matches!(ep.wait_closed(), RpcError::FirstMessageTimeout { after } if after == Duration::from_millis(300)));
        assert_eq!(server.connections(), 0, "the slot is free again");
    }
    let client = Endpoint::connect(&path, Registry::new(), RpcConfig::default()).unwrap();
    let ep = server.accept().unwrap();
    assert_eq!(client.call("calc", "echo", vec![1.into()]).unwrap(), Value::Array(vec![1.into()]));
    std::thread::sleep(Duration::from_millis(600));
    assert!(!ep.is_closed(), "{:?}", ep.close_reason());
    assert_eq!(client.call("calc", "echo", vec![2.into()]).unwrap(), Value::Array(vec![2.into()]));
}

/// A response naming a native tensor the peer never sent fails the call when its own
/// deadline passes, not at the claim's longer limit, and says which tensor never came.
#[test]
fn a_native_tag_never_sent_fails_the_call_at_its_deadline() {
    let liar = Registry::new();
    liar.register(
        "liar",
        Service::new("Liar").method_inline("give", |_, _| {
            Ok(Value::parse(br#"{"__type__": "TensorwireTensor", "tag": 987654321, "dtype": "torch.float32", "tensor_size": [4], "tensor_stride": [1], "tensor_offset": 0}"#).unwrap())
        }),
    )
    .unwrap();
    let (host, peer) = Endpoint::pair(Registry::new(), liar, RpcConfig::default()).unwrap();
    assert!(host.negotiate_native(Duration::from_secs(10)).unwrap());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !peer.native_enabled() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let asked = Duration::from_secs(2);
    let started = Instant::now();
    let e = host.call_with("liar", "give", vec![], Map::new(), CallOptions { timeout: Some(asked.into()), ..Default::default() }).unwrap_err();
    let took = started.elapsed();
    assert!(took < asked + Duration::from_secs(1), "a {asked:?} call took {took:?}");
    assert!(matches!(e, RpcError::Timeout { .. }), "{e:?}");
    // The connection still serves (the claim let go of the transport at the deadline).
    assert_eq!(peer.call("nothing", "x", vec![]).unwrap_err().to_string(), "Object ID nothing not registered");
}

/// A peer that never reads: a large write fails when `send_timeout` has passed — once
/// for the whole frame, not once per partial write — and the error says how long it
/// really waited.
#[test]
fn a_write_to_a_peer_that_never_reads_ends_at_send_timeout() {
    let send_timeout = Duration::from_secs(2);
    let (ep, _raw) = server(RpcConfig { send_timeout, ..RpcConfig::default() });
    // Far more than the socket buffers hold, and small (this process's peak RSS is
    // measured by another test).
    let big = Value::Str("x".repeat(4 << 20));
    let started = Instant::now();
    let e = ep.call_with("calc", "echo", vec![big], Map::new(), CallOptions { timeout: Some(Duration::from_secs(30).into()), ..Default::default() });
    let took = started.elapsed();
    let why = e.unwrap_err().to_string();
    assert!(took < send_timeout + Duration::from_secs(1), "send_timeout {send_timeout:?}, the write took {took:?}: {why}");
    assert!(why.contains("not reading") && why.contains("send_timeout is 2s"), "{why}");
    // "... still blocked after 2.0s ...": what it waited, no less than the bound and no
    // more than the call took.
    let waited: f64 = why.split("still blocked after ").nth(1).and_then(|r| r.split('s').next()).and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{why}"));
    assert!(waited >= 1.95 && waited <= took.as_secs_f64() + 0.05, "stated {waited}s, bound 2s, call took {took:?}: {why}");
}
