//! The client's pool of recycled segments for received remote tensors (feature `ucx`),
//! against a server in a child process (`support/remote.rs`): a free segment is used again
//! for the next tensor of its length, never while a tensor holds it or once its fd went
//! out; the pool is bounded by `remote_pool_bytes` and the connection budget, and goes
//! with the connection. UCX takes its transports from the environment; the test command
//! runs this with `UCX_TLS=tcp`.
#![cfg(feature = "ucx")]

#[path = "support/remote.rs"]
mod remote;

use remote::*;
use std::time::Duration;
use tensorwire_rpc::*;
use tensorwire_test_support::{pattern, role};

#[test]
fn child_role() {
    if role().as_deref() == Some("server") {
        serve();
    }
}

fn segment_of(v: &Value) -> std::sync::Arc<tensorwire::Segment> {
    match v.as_tensor() {
        Some(Tensor::Shared(s)) => s.segment().clone(),
        other => panic!("expected a tensor in a segment of ours, got {other:?}"),
    }
}

/// The client's pool: a segment comes back for the next tensor of its length once nothing
/// holds it, never while a tensor of the process does, never once its fd was handed out,
/// never for another length.
#[test]
fn received_tensors_reuse_free_segments_only() {
    if role().is_some() {
        return;
    }
    let server = Proc::server(true);
    let ep = client(&server.line, true);
    assert!(ep.negotiate_native(Duration::from_secs(10)).unwrap());
    let n = 1usize << 20;
    let make = |seed: u8, n: usize| {
        let v = ep.call("t", "make", vec![Value::Int(seed.into()), Value::Int(n as i64)]).unwrap();
        same(&v.as_tensor().unwrap().to_vec().unwrap(), &pattern(seed, n), &format!("tensor {seed}"));
        v
    };
    let a = make(1, n);
    let first = segment_of(&a).id();
    drop(a);
    let b = make(2, n);
    assert_eq!(segment_of(&b).id(), first, "a dropped tensor's segment is used again");
    assert_eq!(ep.remote_pool().2, 1);
    // Kept: the next tensor goes elsewhere, and the kept one's bytes stay.
    let c = make(3, n);
    assert_ne!(segment_of(&c).id(), first, "a kept tensor's segment is not used again");
    same(&b.as_tensor().unwrap().to_vec().unwrap(), &pattern(2, n), "the kept tensor");
    // A segment whose fd went out (to a peer, say) is never written again.
    let third = segment_of(&c).id();
    let _ = segment_of(&c).fd();
    drop(c);
    let d = make(4, n);
    assert_ne!(segment_of(&d).id(), third, "a segment whose fd was handed out is not used again");
    drop(d);
    // Another length takes a segment of its own.
    let e = make(5, n + 4096);
    let fourth = segment_of(&e).id();
    assert!(fourth != first && fourth != third);
    drop(b);
    let f = make(6, n);
    assert_eq!(segment_of(&f).id(), first, "free again once the kept tensor went");
    assert_eq!(ep.remote_imported_bytes(), (2 * n + 4096) as u64, "tensors held: e and f");
}

/// The memfds this process has open, by file identity.
fn open_memfds() -> Vec<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::metadata(e.ok()?.path()).ok())
        .map(|m| (m.dev(), m.ino()))
        .collect()
}

/// The pool keeps at most `remote_pool_bytes` (a tensor past it gets a segment of its own,
/// freed with it), and its segments go when the connection ends.
#[test]
fn the_pool_is_bounded_and_goes_with_the_connection() {
    if role().is_some() {
        return;
    }
    let server = Proc::server(true);
    let n = 1usize << 20;
    let cfg = RpcConfig { remote_tensors: true, remote_pool_bytes: 3 * n as u64, ..small_frames() };
    let ep = Endpoint::connect(&server.line, Registry::new(), cfg).unwrap();
    assert!(ep.negotiate_native(Duration::from_secs(10)).unwrap());
    let held: Vec<Value> = (0..5u8).map(|i| ep.call("t", "make", vec![Value::Int(i.into()), Value::Int(n as i64)]).unwrap()).collect();
    assert_eq!(ep.remote_pool(), (3, 3 * n as u64, 0), "three kept, two of their own");
    let idents: Vec<(u64, u64)> = held.iter().map(|v| segment_of(v).file_ident().unwrap()).collect();
    drop(held);
    let open = open_memfds();
    let still: Vec<bool> = idents.iter().map(|i| open.contains(i)).collect();
    assert_eq!(still, [true, true, true, false, false], "the kept segments stay, the others are freed");
    for i in 0..4u8 {
        drop(ep.call("t", "make", vec![Value::Int(i.into()), Value::Int(n as i64)]).unwrap());
    }
    assert_eq!(ep.remote_pool(), (3, 3 * n as u64, 4), "each import reused a kept segment");
    // Free kept segments make room for a new length within the pool's bytes…
    drop(ep.call("t", "make", vec![Value::Int(9), Value::Int(2 * n as i64)]).unwrap());
    assert_eq!(ep.remote_pool(), (2, 3 * n as u64, 4), "two free 1 MiB segments dropped for a 2 MiB one");
    // …and within the connection budget, which kept segments count towards.
    let cfg = RpcConfig { remote_tensors: true, remote_pool_bytes: 8 * n as u64, max_remote_connection_bytes: 4 * n as u64, ..small_frames() };
    let tight = Endpoint::connect(&server.line, Registry::new(), cfg).unwrap();
    assert!(tight.negotiate_native(Duration::from_secs(10)).unwrap());
    let three: Vec<Value> = (0..3u8).map(|i| tight.call("t", "make", vec![Value::Int(i.into()), Value::Int(n as i64)]).unwrap()).collect();
    drop(three);
    let big = tight.call("t", "make", vec![Value::Int(7), Value::Int(2 * n as i64)]).unwrap();
    same(&big.as_tensor().unwrap().to_vec().unwrap(), &pattern(7, 2 * n), "2 MiB");
    assert_eq!(tight.remote_pool(), (3, 4 * n as u64, 0), "one free 1 MiB segment dropped to stay within 4 MiB");
    // The server goes: the connection ends, and with it the pool.
    drop(server);
    assert!(eventually(true, || ep.is_closed()), "the connection ended");
    // The endpoint shows itself closed before its shutdown has dropped the remote state.
    let gone = || {
        let open = open_memfds();
        idents.iter().all(|i| !open.contains(i))
    };
    assert!(eventually(true, gone), "kept segments left after the connection ended");
    assert_eq!(ep.remote_pool(), (0, 0, 0));
}
