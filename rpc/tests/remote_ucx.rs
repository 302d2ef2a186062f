//! Remote tensors over loopback TCP (feature `ucx`), between real processes: this test
//! binary re-runs itself as a server (child role `server`) or as a client that
//! holds an export and is then killed (`holder`). UCX takes its transports from the
//! environment; the test command runs this with `UCX_TLS=tcp`.
//!
//! - bytes are checked on the importer, both ways, contiguous and strided, up to a size the
//!   inline form cannot carry;
//! - the exporter's registration is gone after the importer's release, after the
//!   importer's connection closes, and after the importer is SIGKILLed;
//! - a peer without the capability (pyisolate's raw protocol, a tensorwire-rpc peer with
//!   `remote_tensors` off) gets inline `TensorValue` bytes;
//! - hostile remote values are named errors and the server serves on;
//! - what a hostile importer can ask the server's exporter for (forged ids, another
//!   connection's ids, a replay after release): named errors, the server serves on;
//! - the per-message and per-connection budgets on what a peer can make us allocate;
//! - a stalled exporter delays only its own connection's imports;
//! - an importer SIGKILLed mid-transfer leaves no export behind.
#![cfg(feature = "ucx")]

#[path = "support/remote.rs"]
mod remote;

use remote::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};
use tensorwire_rpc::*;
use tensorwire_test_support::{pattern, role, say};

// ---------------------------------------------------------------- child roles

/// A client that makes the server export a tensor, never releases it, and waits to be
/// killed.
fn hold() -> ! {
    let mut raw = Raw::connect(&std::env::var("TW_SERVER").unwrap());
    raw.hello();
    let (v, e) = raw.call("t", "make", vec![Value::Int(3), Value::Int(1 << 20)]);
    assert!(e.is_none() && is_remote(&v), "{v:?} {e:?}");
    say("held");
    std::thread::sleep(Duration::from_secs(60));
    std::process::exit(1);
}

/// A client that imports a 256 MiB tensor from the server over and over, until killed.
fn pull() -> ! {
    let ep = client(&std::env::var("TW_SERVER").unwrap(), true);
    assert!(ep.negotiate_native(Duration::from_secs(10)).unwrap());
    ep.call("t", "make", vec![Value::Int(1), Value::Int(4096)]).unwrap();
    say("pulling");
    loop {
        ep.call("t", "make", vec![Value::Int(3), Value::Int(256 << 20)]).unwrap();
    }
}

/// An exporter on its own (the UCX side of a peer): exports 1 MiB and prints the value
/// fields a `TensorwireRemote` needs, then serves until stdin closes.
fn lone_exporter() -> ! {
    let exporter = tensorwire_remote::ucx::Exporter::new().unwrap();
    let scope = exporter.scope().unwrap();
    let blob = scope.export(pattern(4, 1 << 20)).unwrap();
    say(&format!("{} {} {}", blob.export_id(), base64::encode(blob.key()), base64::encode(blob.worker_address())));
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    std::process::exit(0);
}

#[test]
fn child_role() {
    match role().as_deref() {
        Some("server") => serve(),
        Some("holder") => hold(),
        Some("puller") => pull(),
        Some("lone_exporter") => lone_exporter(),
        _ => {}
    }
}

// ---------------------------------------------------------------- a raw peer

/// A peer speaking the wire protocol by hand (as pyisolate, or as a forger would).
struct Raw {
    s: TcpStream,
    next: i64,
    /// Calls the server made to us (its releases), in order.
    incoming: Vec<Value>,
}

impl Raw {
    fn connect(addr: &str) -> Raw {
        let s = TcpStream::connect(addr.strip_prefix("tcp://").unwrap()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        Raw { s, next: 1, incoming: Vec::new() }
    }

    fn send(&mut self, v: &Value) {
        let p = v.to_json().unwrap().into_bytes();
        let mut f = (p.len() as u32).to_be_bytes().to_vec();
        f.extend_from_slice(&p);
        self.s.write_all(&f).unwrap();
    }

    fn read(&mut self) -> Value {
        let mut h = [0u8; 4];
        self.s.read_exact(&mut h).unwrap();
        let mut p = vec![0u8; u32::from_be_bytes(h) as usize];
        self.s.read_exact(&mut p).unwrap();
        Value::parse(&p).unwrap()
    }

    /// Call and wait for the response: (result, error).
    fn call_kw(&mut self, obj: &str, method: &str, args: Vec<Value>, kwargs: Map) -> (Value, Option<String>) {
        let id = self.next;
        self.next += 1;
        self.send(&Value::object([
            ("kind", "call".into()),
            ("object_id", obj.into()),
            ("call_id", Value::Int(id)),
            ("parent_call_id", Value::Null),
            ("method", method.into()),
            ("args", Value::Array(args)),
            ("kwargs", Value::Object(kwargs)),
        ]));
        loop {
            let v = self.read();
            let m = v.as_object().unwrap();
            match m.get("kind").and_then(Value::as_str) {
                Some("response") if m.get("call_id") == Some(&Value::Int(id)) => {
                    let err = m.get("error").and_then(Value::as_str).map(str::to_owned);
                    return (m.get("result").cloned().unwrap_or(Value::Null), err);
                }
                Some("call") => self.incoming.push(v.clone()),
                _ => {}
            }
        }
    }

    fn call(&mut self, obj: &str, method: &str, args: Vec<Value>) -> (Value, Option<String>) {
        self.call_kw(obj, method, args, Map::new())
    }

    /// Negotiate remote tensors as tensorwire-rpc does.
    fn hello(&mut self) {
        let mut kw = Map::new();
        kw.insert("remote_engines".into(), Value::Array(vec!["ucx".into()]));
        let (v, e) = self.call_kw("__tensorwire__", "native_hello", vec![Value::Int(1)], kw);
        assert!(e.is_none(), "{e:?}");
        assert_eq!(v.as_object().and_then(|m| m.get("remote_engine")), Some(&Value::from("ucx")));
    }

    /// Export ids the server asked us to release so far.
    fn released(&self) -> Vec<i64> {
        self.incoming
            .iter()
            .filter_map(|c| {
                let m = c.as_object()?;
                (m.get("method")?.as_str()? == "remote_release").then(|| m.get("args")?.as_array()?.first()?.as_i64())?
            })
            .collect()
    }
}

fn is_remote(v: &Value) -> bool {
    v.as_object().and_then(|m| m.get("__type__")).and_then(Value::as_str) == Some("TensorwireRemote")
}

fn server_live(ep: &Endpoint) -> i64 {
    ep.call("t", "live", vec![]).unwrap().as_i64().unwrap()
}

fn tensor_arg(seed: u8, n: usize) -> Value {
    Value::from(Tensor::from_bytes(tensorwire::DType::UInt8, &[n as i64], &pattern(seed, n)).unwrap())
}

// ---------------------------------------------------------------- tests

#[test]
fn tensors_travel_by_ucx_both_ways_and_are_released() {
    if role().is_some() {
        return;
    }
    let server = Proc::server(true);
    let ep = client(&server.line, true);
    assert!(ep.negotiate_native(Duration::from_secs(10)).unwrap());
    assert!(ep.remote_enabled());
    // Server → client: the client imports; the server's export is gone after the release.
    for (i, n) in [4usize << 10, 1 << 20, 16 << 20].into_iter().enumerate() {
        let seed = i as u8 + 1;
        let v = ep.call("t", "make", vec![Value::Int(seed.into()), Value::Int(n as i64)]).unwrap();
        let t = v.as_tensor().expect("a tensor");
        assert!(matches!(t, Tensor::Shared(_)), "imported into memory of ours");
        same(&t.to_vec().unwrap(), &pattern(seed, n), &format!("{n} bytes"));
        assert_eq!(eventually(0, || server_live(&ep)), 0, "the server's export of {n} bytes is released");
    }
    // A strided view travels with its layout over the whole storage.
    let v = ep.call("t", "make_view", vec![Value::Int(9), Value::Int(4096)]).unwrap();
    let want: Vec<u8> = pattern(9, 4096).into_iter().skip(1).step_by(2).collect();
    same(&v.as_tensor().unwrap().to_vec().unwrap(), &want, "strided view");
    assert_eq!(eventually(0, || server_live(&ep)), 0);
    // Client → server: the server imports; our export is gone after its release.
    for (i, n) in [4usize << 10, 16 << 20].into_iter().enumerate() {
        let seed = i as u8 + 20;
        let ok = ep.call("t", "check", vec![tensor_arg(seed, n), Value::Int(seed.into())]).unwrap();
        assert_eq!(ok, Value::Bool(true), "{n} bytes");
        assert_eq!(eventually(0, || ep.remote_exports_live()), 0, "our export of {n} bytes is released");
    }
    // Those could not have gone inline: without remote tensors 2 MiB is over the frame cap.
    let inline = client(&server.line, false);
    assert!(!inline.negotiate_native(Duration::from_secs(10)).unwrap());
    let e = inline.call("t", "check", vec![tensor_arg(1, 2 << 20), Value::Int(1)]).unwrap_err();
    assert!(e.to_string().contains("frame cap"), "{e}");
}

#[test]
fn a_peer_without_the_capability_gets_inline_bytes() {
    if role().is_some() {
        return;
    }
    let server = Proc::server(true);
    // pyisolate's view: it never negotiates, and reads a TensorValue.
    let mut raw = Raw::connect(&server.line);
    let (v, e) = raw.call("t", "make", vec![Value::Int(5), Value::Int(64)]);
    assert!(e.is_none(), "{e:?}");
    let m = v.as_object().expect("a dict");
    assert_eq!(m.get("__type__"), Some(&Value::from("TensorValue")), "{v:?}");
    // A tensorwire-rpc peer with remote tensors off: negotiation says no, bytes inline.
    let ep = client(&server.line, false);
    assert!(!ep.negotiate_native(Duration::from_secs(10)).unwrap());
    let v = ep.call("t", "make", vec![Value::Int(6), Value::Int(4096)]).unwrap();
    same(&v.as_tensor().unwrap().to_vec().unwrap(), &pattern(6, 4096), "inline");
    assert_eq!(ep.call("t", "check", vec![tensor_arg(7, 4096), Value::Int(7)]).unwrap(), Value::Bool(true));
    assert_eq!(server_live(&ep), 0, "nothing was exported");
    // A server with remote tensors off refuses the offer; our client falls back.
    let off = Proc::server(false);
    let ep = client(&off.line, true);
    assert!(!ep.negotiate_native(Duration::from_secs(10)).unwrap());
    assert!(!ep.remote_enabled());
    let v = ep.call("t", "make", vec![Value::Int(8), Value::Int(4096)]).unwrap();
    same(&v.as_tensor().unwrap().to_vec().unwrap(), &pattern(8, 4096), "inline");
    let mut raw = Raw::connect(&off.line);
    let mut kw = Map::new();
    kw.insert("remote_engines".into(), Value::Array(vec!["ucx".into()]));
    let (_, e) = raw.call_kw("__tensorwire__", "native_hello", vec![Value::Int(1)], kw);
    assert!(e.unwrap().contains("remote_tensors"));
}

#[test]
fn exports_are_held_until_release_close_or_death() {
    if role().is_some() {
        return;
    }
    let server = Proc::server(true);
    let observer = client(&server.line, false);
    let mut raw = Raw::connect(&server.line);
    raw.hello();
    let (v, e) = raw.call("t", "make", vec![Value::Int(2), Value::Int(4096)]);
    assert!(e.is_none() && is_remote(&v), "{v:?} {e:?}");
    let id = v.as_object().unwrap().get("export_id").unwrap().as_i64().unwrap();
    assert_eq!(server_live(&observer), 1, "held while the importer has not released it");
    // Someone else's id, or garbage: named errors, the export stays.
    let (_, e) = raw.call("__tensorwire__", "remote_release", vec![Value::Int(id + 1000)]);
    assert!(e.unwrap().contains("no live export"));
    let (_, e) = raw.call("__tensorwire__", "remote_release", vec![Value::from("x")]);
    assert!(e.unwrap().contains("not a non-negative integer"));
    assert_eq!(server_live(&observer), 1);
    let (_, e) = raw.call("__tensorwire__", "remote_release", vec![Value::Int(id)]);
    assert!(e.is_none(), "{e:?}");
    assert_eq!(server_live(&observer), 0, "released");
    // Not released, then the connection closes: dropped with it.
    let (v, _) = raw.call("t", "make", vec![Value::Int(2), Value::Int(4096)]);
    assert!(is_remote(&v));
    assert_eq!(server_live(&observer), 1);
    drop(raw);
    assert_eq!(eventually(0, || server_live(&observer)), 0, "dropped with the connection");
    // Not released, then the importer is SIGKILLed.
    let mut holder = Proc::spawn("holder", &[("TW_SERVER", &server.line)]);
    assert_eq!(holder.line, "held");
    assert_eq!(server_live(&observer), 1);
    holder.child.kill().unwrap();
    holder.child.wait().unwrap();
    assert_eq!(eventually(0, || server_live(&observer)), 0, "dropped when the importer died");
}

#[test]
fn hostile_remote_values_are_named_errors() {
    if role().is_some() {
        return;
    }
    let server = Proc::server(true);
    // A remote value on a connection that never negotiated.
    let mut raw = Raw::connect(&server.line);
    let mut other = Raw::connect(&server.line);
    other.hello();
    let (genuine, _) = other.call("t", "make", vec![Value::Int(4), Value::Int(4096)]);
    let genuine = genuine.as_object().unwrap().clone();
    let (_, e) = raw.call("t", "check", vec![Value::Object(genuine.clone()), Value::Int(4)]);
    assert!(e.unwrap().contains("never negotiated"));
    raw.hello();
    let with = |k: &str, v: Option<Value>| {
        let mut m = genuine.clone();
        match v {
            Some(v) => m.insert(k.into(), v),
            None => m.shift_remove(k),
        };
        Value::Object(m)
    };
    let b64 = |b: &[u8]| Value::Str(base64::encode(b));
    let cases: Vec<(Value, &str)> = vec![
        (with("key", None), "no \"key\" field"),
        (with("engine", Some("nixl".into())), "names engine \"nixl\""),
        (with("length", Some(Value::Int(-5))), "\"length\" is negative"),
        (with("length", Some(Value::Int(1 << 45))), "max_remote_message_bytes"),
        (with("length", Some(Value::Int(300 << 20))), "max_tensor_copy"),
        (with("export_id", Some("0x1000".into())), "\"export_id\" is a str"),
        (with("worker_address", Some(b64(&[0x0f; 100]))), "BadWorkerAddress"),
        (with("worker_address", Some("not base64!".into())), "\"worker_address\""),
        (with("worker_address", Some(Value::Str("A".repeat(100_000)))), "\"worker_address\" is 100000 characters"),
        (with("key", Some(b64(&[0xff; 12]))), "BadKey(12)"),
        (with("tensor_size", Some(Value::Array(vec![Value::Int(8192)]))), "needs 8192 bytes"),
        (with("tensor_stride", Some(Value::Array(vec![Value::Int(-1)]))), "geometry"),
        (with("dtype", Some("torch.nope".into())), "dtype"),
    ];
    for (v, want) in cases {
        let (r, e) = raw.call("t", "check", vec![v.clone(), Value::Int(4)]);
        let e = e.unwrap_or_else(|| panic!("{v:?} was accepted: {r:?}"));
        assert!(e.contains(want), "{e:?} should name {want:?}");
        // Refused while validating, before any allocation or transfer (the copy limit and
        // the message budget have errors of their own).
        assert!(
            e.starts_with("cannot decode value") || want == "max_tensor_copy" || want == "max_remote_message_bytes",
            "{e:?} is not a decode error"
        );
    }
    // A value whose id was readable is released even though it was refused.
    let id = genuine.get("export_id").unwrap().as_i64().unwrap();
    assert!(raw.released().contains(&id), "releases sent: {:?}", raw.released());
    // An exporter that is gone: the read fails with a named error, in bounded time.
    let dead = Proc::server(true);
    let mut dead_raw = Raw::connect(&dead.line);
    dead_raw.hello();
    let (gone, _) = dead_raw.call("t", "make", vec![Value::Int(4), Value::Int(4096)]);
    assert!(is_remote(&gone));
    drop(dead);
    let t0 = Instant::now();
    let (_, e) = raw.call("t", "check", vec![gone, Value::Int(4)]);
    let e = e.expect("a dead exporter's tensor cannot be read");
    assert!(e.contains("remote tensor transfer"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    // The server serves on, and reads a genuine value correctly.
    let (ok, e) = raw.call("t", "check", vec![Value::Object(genuine), Value::Int(4)]);
    assert_eq!((ok, e), (Value::Bool(true), None));
}

/// The fields of a remote value: (export id, key, worker address).
fn remote_fields(v: &Value) -> (u64, Vec<u8>, Vec<u8>) {
    let m = v.as_object().unwrap();
    let b = |k: &str| base64::decode(m.get(k).unwrap().as_str().unwrap()).unwrap();
    (m.get("export_id").unwrap().as_i64().unwrap() as u64, b("key"), b("worker_address"))
}

fn import_as(importer: &tensorwire_remote::ucx::Importer, id: u64, len: u64, key: &[u8], wa: &[u8]) -> std::result::Result<Vec<u8>, tensorwire_remote::ImportError> {
    let blob = tensorwire_remote::ExportBlob::from_parts(tensorwire_remote::Engine::Ucx, id, len, key, wa).unwrap();
    importer.import(&blob, vec![0u8; len as usize], Duration::from_secs(5))
}

/// A peer that asks the server's exporter for what it likes, with its own UCX importer:
/// its own export works; an id never handed out, another connection's id, and its own id
/// replayed after the release are named errors (the replay killed the exporter with
/// SIGSEGV when it was a one-sided get); the server serves on.
#[test]
fn a_hostile_importer_reads_only_its_own_exports() {
    if role().is_some() {
        return;
    }
    use tensorwire_remote::ImportError;
    let server = Proc::server(true);
    let (mut a, mut b) = (Raw::connect(&server.line), Raw::connect(&server.line));
    a.hello();
    b.hello();
    let (va, _) = a.call("t", "make", vec![Value::Int(11), Value::Int(1 << 20)]);
    let (vb, _) = b.call("t", "make", vec![Value::Int(12), Value::Int(1 << 20)]);
    let (ida, key, wa) = remote_fields(&va);
    let (idb, _, _) = remote_fields(&vb);
    let importer = tensorwire_remote::ucx::Importer::new().unwrap();
    same(&import_as(&importer, ida, 1 << 20, &key, &wa).unwrap(), &pattern(11, 1 << 20), "own export");
    assert_eq!(
        import_as(&importer, ida + 1000, 1 << 20, &key, &wa).map(|v| v.len()),
        Err(ImportError::UnknownExport(ida + 1000))
    );
    assert_eq!(
        import_as(&importer, idb, 1 << 20, &key, &wa).map(|v| v.len()),
        Err(ImportError::UnknownExport(idb)),
        "another connection's export"
    );
    assert!(matches!(import_as(&importer, ida, 64 << 20, &key, &wa), Err(ImportError::ExporterLengthMismatch { .. })));
    let (_, e) = a.call("__tensorwire__", "remote_release", vec![Value::Int(ida as i64)]);
    assert!(e.is_none(), "{e:?}");
    assert_eq!(
        import_as(&importer, ida, 1 << 20, &key, &wa).map(|v| v.len()),
        Err(ImportError::UnknownExport(ida)),
        "replayed after release"
    );
    // The server is alive and serves both connections on.
    let (v, e) = a.call("t", "make", vec![Value::Int(13), Value::Int(4096)]);
    assert!(e.is_none() && is_remote(&v), "{e:?}");
    let (id, key, wa) = remote_fields(&v);
    same(&import_as(&importer, id, 4096, &key, &wa).unwrap(), &pattern(13, 4096), "after the attacks");
    same(&import_as(&importer, idb, 1 << 20, &remote_fields(&vb).1, &wa).unwrap(), &pattern(12, 1 << 20), "b's own");
}

/// A frame naming one 4 MiB export 16 times is refused whole by the per-message budget,
/// before any import, with its exports released; the per-connection budget counts what
/// this connection's received tensors still hold, and frees as they drop.
#[test]
fn budgets_bound_what_a_peer_makes_us_allocate() {
    if role().is_some() {
        return;
    }
    let server = Proc::spawn(
        "server",
        &[("TW_REMOTE_ON", "1"), ("TW_MSG_BUDGET", &(16u64 << 20).to_string()), ("TW_CONN_BUDGET", &(10u64 << 20).to_string())],
    );
    // The per-message budget, against a raw peer with an exporter of its own.
    let exporter = tensorwire_remote::ucx::Exporter::new().unwrap();
    let scope = exporter.scope().unwrap();
    let blob = scope.export(pattern(2, 4 << 20)).unwrap();
    let value = Value::object([
        ("__type__", "TensorwireRemote".into()),
        ("engine", "ucx".into()),
        ("worker_address", Value::Str(base64::encode(blob.worker_address()))),
        ("key", Value::Str(base64::encode(blob.key()))),
        ("length", Value::Int(4 << 20)),
        ("export_id", Value::Int(blob.export_id() as i64)),
        ("dtype", "torch.uint8".into()),
        ("tensor_size", Value::Array(vec![Value::Int(4 << 20)])),
        ("tensor_stride", Value::Array(vec![Value::Int(1)])),
        ("tensor_offset", Value::Int(0)),
    ]);
    let mut raw = Raw::connect(&server.line);
    raw.hello();
    let (r, e) = raw.call("t", "check", vec![value.clone(), Value::Int(2)]);
    assert_eq!((r, e), (Value::Bool(true), None), "one 4 MiB tensor is within both budgets");
    let (_, e) = raw.call("t", "keep", vec![Value::Array(vec![value.clone(); 16])]);
    let e = e.expect("16 × 4 MiB in one message accepted");
    assert!(e.contains("max_remote_message_bytes") && e.contains("67108864 bytes"), "{e}");
    // Its exports were released, each time it was named.
    let released = raw.released().iter().filter(|&&i| i == blob.export_id() as i64).count();
    assert_eq!(released, 1 + 16, "releases: {:?}", raw.released());
    // The per-connection budget (10 MiB): two kept 4 MiB tensors fit, a third does not;
    // once the server drops them it fits again.
    let ep = client(&server.line, true);
    assert!(ep.negotiate_native(Duration::from_secs(10)).unwrap());
    for i in 0..2 {
        ep.call("t", "keep", vec![tensor_arg(i, 4 << 20)]).unwrap();
    }
    let e = ep.call("t", "keep", vec![tensor_arg(3, 4 << 20)]).unwrap_err().to_string();
    assert!(e.contains("max_remote_connection_bytes"), "{e}");
    ep.call("t", "forget", vec![]).unwrap();
    ep.call("t", "keep", vec![tensor_arg(4, 4 << 20)]).unwrap();
    assert_eq!(eventually(0, || ep.remote_exports_live()), 0, "every export released, refused or not");
}

/// Waits until every thread of `pid` is stopped: `kill` returns before a group stop has
/// reached each thread.
fn wait_stopped(pid: u32) {
    let until = Instant::now() + Duration::from_secs(5);
    let stopped = || {
        std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().all(|t| {
            let stat = std::fs::read_to_string(t.unwrap().path().join("stat")).unwrap_or_default();
            stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('T'))
        })
    };
    while !stopped() {
        assert!(Instant::now() < until, "{pid} did not stop");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// An exporter that stops (SIGSTOP) while the server imports from it holds that import to
/// its own deadline; an import on another connection of the server, at the same time,
/// completes at once.
#[test]
fn a_stalled_exporter_delays_no_other_connection() {
    if role().is_some() {
        return;
    }
    // The stalled import's deadline is long against five healthy imports (milliseconds each
    // when idle) so that a loaded machine cannot make them look delayed by it.
    let server = Proc::spawn("server", &[("TW_REMOTE_ON", "1"), ("TW_IMPORT_TIMEOUT_S", "8")]);
    let stalled = Proc::spawn("lone_exporter", &[]);
    let f: Vec<&str> = stalled.line.split(' ').collect();
    let value = Value::object([
        ("__type__", "TensorwireRemote".into()),
        ("engine", "ucx".into()),
        ("worker_address", f[2].into()),
        ("key", f[1].into()),
        ("length", Value::Int(1 << 20)),
        ("export_id", Value::Int(f[0].parse().unwrap())),
        ("dtype", "torch.uint8".into()),
        ("tensor_size", Value::Array(vec![Value::Int(1 << 20)])),
        ("tensor_stride", Value::Array(vec![Value::Int(1)])),
        ("tensor_offset", Value::Int(0)),
    ]);
    let mut raw = Raw::connect(&server.line);
    raw.hello();
    // First while it runs: the server's importer for this connection is connected.
    let (r, e) = raw.call("t", "check", vec![value.clone(), Value::Int(4)]);
    assert_eq!((r, e), (Value::Bool(true), None));
    let healthy = client(&server.line, true);
    assert!(healthy.negotiate_native(Duration::from_secs(10)).unwrap());
    healthy.call("t", "check", vec![tensor_arg(1, 1 << 20), Value::Int(1)]).unwrap();

    // SAFETY: stopping our own child by pid; it is killed and reaped by its `Proc`.
    unsafe { libc::kill(stalled.child.id() as i32, libc::SIGSTOP) };
    wait_stopped(stalled.child.id());
    let t = std::thread::spawn(move || {
        let t0 = Instant::now();
        let (_, e) = raw.call("t", "check", vec![value, Value::Int(4)]);
        (e, t0.elapsed())
    });
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    for i in 0..5u8 {
        let ok = healthy.call("t", "check", vec![tensor_arg(i, 1 << 20), Value::Int(i.into())]).unwrap();
        assert_eq!(ok, Value::Bool(true));
    }
    let took = t0.elapsed();
    // Done while the stalled import still waits for its deadline: had the healthy imports
    // queued behind it, they would end only after it.
    assert!(!t.is_finished(), "5 imports on a healthy connection ended after the stalled import ({took:?})");
    assert!(took < Duration::from_secs(6), "5 imports on a healthy connection took {took:?} beside a stalled one");
    let (e, stalled_took) = t.join().unwrap();
    let e = e.unwrap_or_else(|| panic!("an import from a stopped exporter completed in {stalled_took:?}"));
    assert!(e.contains("Timeout"), "{e}");
    assert!(stalled_took < Duration::from_secs(14), "{stalled_took:?}");
    // SAFETY: as above.
    unsafe { libc::kill(stalled.child.id() as i32, libc::SIGCONT) };
}

/// An importer SIGKILLed while it receives a 256 MiB tensor: the server's export goes (its
/// connection ends, the send to the dead peer fails), and the server serves on.
#[test]
fn an_importer_killed_mid_transfer_leaves_no_export() {
    if role().is_some() {
        return;
    }
    let server = Proc::server(true);
    let observer = client(&server.line, false);
    let mut puller = Proc::spawn("puller", &[("TW_SERVER", &server.line)]);
    assert_eq!(puller.line, "pulling");
    std::thread::sleep(Duration::from_millis(300));
    puller.child.kill().unwrap();
    puller.child.wait().unwrap();
    assert_eq!(eventually(0, || server_live(&observer)), 0, "exports left after the importer died");
    let ep = client(&server.line, true);
    assert!(ep.negotiate_native(Duration::from_secs(10)).unwrap());
    let v = ep.call("t", "make", vec![Value::Int(5), Value::Int(1 << 20)]).unwrap();
    same(&v.as_tensor().unwrap().to_vec().unwrap(), &pattern(5, 1 << 20), "after the death");
}
