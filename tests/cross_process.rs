//! Cross-process tests: every case runs a real child process (this test binary
//! re-executed) on the other end of the connection.

mod common;

use common::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tensorwire::{DType, Error, ExportOptions, Incoming, Layout, Peer, PeerConfig, SharedTensor};


/// Entry point of the child processes (run by `spawn_child`, never on its own).
#[test]
#[ignore = "child-process entry point; the other tests run it in a subprocess"]
fn child_entry() {
    child_main();
}

fn patterned(layout: Layout, storage_bytes: usize, seed: u8) -> SharedTensor {
    let t = SharedTensor::zeros(Layout::contiguous(DType::UInt8, &[storage_bytes as i64]).unwrap())
        .unwrap()
        .view(layout)
        .unwrap();
    let data: Vec<u8> = (0..storage_bytes).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
    t.write_storage(0, &data).unwrap();
    t
}

#[test]
fn every_dtype_and_noncontiguous_views_roundtrip_and_alias() {
    let (mut child, peer) = spawn_child("verify", PeerConfig::default());
    let mut cases = Vec::new();
    for d in DType::ALL {
        let base = Layout::contiguous(d, &[6, 10]).unwrap();
        let bytes = base.extent_bytes().unwrap() as usize;
        cases.push((format!("{} contiguous", d.name()), base, bytes));
        cases.push((format!("{} transposed", d.name()), base.transpose(0, 1).unwrap(), bytes));
        cases.push((format!("{} sliced", d.name()), base.slice(1, 2, 9, 3).unwrap().slice(0, 1, 6, 2).unwrap(), bytes));
        let row = Layout::contiguous(d, &[1, 10]).unwrap();
        cases.push((format!("{} expanded", d.name()), row.expand(0, 7).unwrap(), row.extent_bytes().unwrap() as usize));
    }
    let zero_d = Layout::contiguous(DType::Float64, &[]).unwrap();
    cases.push(("0-d scalar".into(), zero_d, 8));
    let empty = Layout::contiguous(DType::Float32, &[0, 5]).unwrap();
    cases.push(("empty".into(), empty, 4));

    for (i, (name, layout, bytes)) in cases.iter().enumerate() {
        let t = patterned(*layout, *bytes, i as u8);
        let expect = fnv1a(&t.to_vec().unwrap());
        assert_eq!(t.to_vec().unwrap().len() as u64, layout.packed_bytes(), "{name}");
        let at = layout.storage_offset as usize * layout.dtype.size();
        let mut before = [0u8];
        if layout.numel() > 0 {
            t.read_storage(at, &mut before).unwrap();
        }
        peer.export(&t, ExportOptions { tag: i as u64, window: None }).unwrap();
        let reply = recv_words(&peer);
        assert_eq!(reply, vec![i as u64, expect], "{name}: checksum in the child differs");
        if layout.numel() > 0 {
            let mut after = [0u8];
            t.read_storage(at, &mut after).unwrap();
            assert_eq!(after[0], !before[0], "{name}: the child's write is not visible here (not zero-copy)");
        }
    }
    wait_until("all leases released", T, || peer.export_stats().live_leases == 0);
    let s = peer.export_stats();
    assert_eq!((s.granted, s.released), (cases.len() as u64, cases.len() as u64));

    // Segments we dropped are forgotten by the child (its mappings go away).
    peer.reap_now();
    peer.send_message(&words(&[QUERY]), &[]).unwrap();
    assert_eq!(recv_words(&peer), vec![0], "child still maps segments this side dropped");
    peer.send_message(&words(&[DONE]), &[]).unwrap();
    assert!(child.wait().unwrap().success());
}

#[test]
fn already_shared_segment_travels_once() {
    let (mut child, peer) = spawn_child("verify", PeerConfig::default());
    let t = patterned(Layout::contiguous(DType::Int32, &[256]).unwrap(), 1024, 3);
    for i in 0..50u64 {
        peer.export(&t, ExportOptions { tag: i, window: None }).unwrap();
        assert_eq!(recv_words(&peer)[0], i);
    }
    peer.send_message(&words(&[QUERY]), &[]).unwrap();
    assert_eq!(recv_words(&peer), vec![1], "the child should map the shared segment once");
    peer.send_message(&words(&[DONE]), &[]).unwrap();
    assert!(child.wait().unwrap().success());
}

#[test]
fn producer_sigkilled_mappings_stay_readable_and_next_call_is_peer_gone() {
    let (mut child, peer) = spawn_child("produce_and_die", PeerConfig::default());
    let mut imported = Vec::new();
    for _ in 0..3 {
        imported.push(peer.recv_tensor(T).unwrap());
    }
    match peer.recv(T).unwrap() {
        Incoming::Message { payload, .. } => assert_eq!(payload, b"ready"),
        other => panic!("{other:?}"),
    }
    kill9(&mut child);
    for t in &imported {
        let v = t.to_vec().unwrap();
        assert_eq!(v, vec![t.tag() as u8 + 1; 4096], "mapping unreadable after the producer died");
    }
    let start = std::time::Instant::now();
    let err = peer.recv(Duration::from_secs(20)).unwrap_err();
    assert!(matches!(err, Error::PeerGone { .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(5), "peer death took {:?} to notice", start.elapsed());
    for t in imported {
        assert!(t.release().unwrap_err().is_peer_gone());
    }
    let t = SharedTensor::zeros(Layout::contiguous(DType::UInt8, &[8]).unwrap()).unwrap();
    assert!(peer.export(&t, ExportOptions::default()).unwrap_err().is_peer_gone());
}

#[test]
fn window_expiry_and_quotas() {
    let cfg = PeerConfig { max_leases: 4, max_lease_bytes: 10_000, ..PeerConfig::default() };
    let (mut child, peer) = spawn_child("hold", cfg);
    let dropped = Arc::new(AtomicUsize::new(0));
    let mk = |n: i64| SharedTensor::zeros(Layout::contiguous(DType::UInt8, &[n]).unwrap()).unwrap();
    let a = mk(4000);
    peer.export_with_owner(&a, Box::new(Counted(dropped.clone(), a.segment().clone())), ExportOptions {
        tag: 0,
        window: Some(Duration::from_millis(150)),
    })
    .unwrap();
    peer.export(&mk(4000), ExportOptions::default()).unwrap();
    let err = peer.export(&mk(4000), ExportOptions::default()).unwrap_err();
    assert!(matches!(err, Error::QuotaExceeded(_)) && err.to_string().contains("10000-byte limit"), "{err}");
    peer.export(&mk(10), ExportOptions::default()).unwrap();
    peer.export(&mk(10), ExportOptions::default()).unwrap();
    let err = peer.export(&mk(10), ExportOptions::default()).unwrap_err();
    assert!(matches!(err, Error::QuotaExceeded(_)) && err.to_string().contains("peer holds 4 leases, the limit is 4"), "{err}");
    // The windowed lease expires although the child still holds it.
    wait_until("the window to expire", T, || dropped.load(Ordering::SeqCst) == 1);
    let s = peer.export_stats();
    assert_eq!((s.live_leases, s.expired), (3, 1));
    peer.export(&mk(10), ExportOptions::default()).unwrap();
    peer.send_message(b"report", &[]).unwrap();
    assert_eq!(recv_words(&peer), vec![5]);
    kill9(&mut child);
}

#[test]
fn listener_path_between_processes() {
    use tensorwire::Listener;
    let path = std::env::temp_dir().join(format!("tw-test-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = Listener::bind(&path).unwrap();
    let mut child = tensorwire_test_support::RoleCommand::new("listener_client")
        .test("listener_client_entry")
        .env("TW_TEST_PATH", &path)
        .stdout(std::process::Stdio::null())
        .spawn();
    let peer = Peer::accept(&listener, T, PeerConfig::default()).unwrap();
    assert_eq!(peer.peer_pid() as u32, child.id());
    let t = peer.recv_tensor(T).unwrap();
    assert_eq!(t.to_vec().unwrap(), (0..64u8).collect::<Vec<_>>());
    t.release().unwrap();
    assert!(child.wait().unwrap().success());
}

#[test]
#[ignore = "child-process entry point; listener_path_between_processes runs it"]
fn listener_client_entry() {
    let Ok(path) = std::env::var("TW_TEST_PATH") else { return };
    let peer = Peer::connect(&path, PeerConfig::default()).unwrap();
    let t = SharedTensor::zeros(Layout::contiguous(DType::UInt8, &[64]).unwrap()).unwrap();
    t.write_storage(0, &(0..64u8).collect::<Vec<_>>()).unwrap();
    peer.export(&t, ExportOptions::default()).unwrap();
    wait_until("release", T, || peer.export_stats().released == 1);
}

#[test]
fn a_tensor_in_flight_when_the_producer_closes_is_peer_gone_not_stale() {
    let (a, b) = Peer::pair(PeerConfig::default()).unwrap();
    let t = SharedTensor::zeros(Layout::contiguous(DType::UInt8, &[64]).unwrap()).unwrap();
    a.export(&t, ExportOptions::default()).unwrap();
    drop(a); // closing ends every lease it granted, the one in flight too
    let err = b.recv(T).unwrap_err();
    assert!(err.is_peer_gone() && err.to_string().contains("ended with it"), "{err}");
}

#[test]
fn live_bytes_count_each_storage_once() {
    // The byte quota is what the peer's leases keep alive: two views of one 64 MiB
    // storage hold 64 MiB, not 128; a second storage is what passes the limit.
    const STORAGE: u64 = 64 << 20;
    let cfg = PeerConfig { max_lease_bytes: STORAGE, ..PeerConfig::default() };
    let (mut child, peer) = spawn_child("hold", cfg);
    let t = SharedTensor::zeros(Layout::contiguous(DType::Float32, &[4096, 4096]).unwrap()).unwrap();
    let tt = t.view(t.layout().transpose(0, 1).unwrap()).unwrap();
    peer.export(&t, ExportOptions::default()).unwrap();
    peer.export(&tt, ExportOptions::default()).unwrap();
    let s = peer.export_stats();
    assert_eq!((s.live_leases, s.live_bytes), (2, STORAGE), "{s:?}");
    let other = SharedTensor::zeros(Layout::contiguous(DType::UInt8, &[4096]).unwrap()).unwrap();
    let err = peer.export(&other, ExportOptions::default()).unwrap_err();
    assert!(
        matches!(err, Error::QuotaExceeded(_)) && err.to_string().contains(&format!("peer holds {STORAGE} bytes")),
        "{err}"
    );
    peer.send_message(b"report", &[]).unwrap();
    assert_eq!(recv_words(&peer), vec![2]); // the child holds both views
    assert_eq!(peer.export_stats().live_bytes, STORAGE);
    kill9(&mut child);
    wait_until("the child's leases to be reclaimed", T, || {
        peer.reap_now();
        peer.export_stats().live_leases == 0
    });
    let s = peer.export_stats();
    assert_eq!((s.live_bytes, s.reclaimed), (0, 2), "{s:?}");
}

#[test]
fn a_dead_peer_is_reported_as_killed_or_exited() {
    use std::os::unix::process::ExitStatusExt;
    // Killed: the signal, read through the pidfd while the child is not yet reaped.
    let (mut child, peer) = spawn_child("hold", PeerConfig::default());
    // SAFETY: plain kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    let err = peer.recv(T).unwrap_err();
    let want = format!("process {} was killed by SIGKILL (signal 9)", child.id());
    assert!(err.is_peer_gone() && err.to_string().contains(&want), "{err}");
    // Reading it reaped nothing: the status is still the parent's to collect.
    assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
    let t = SharedTensor::zeros(Layout::contiguous(DType::UInt8, &[8]).unwrap()).unwrap();
    let err = peer.export(&t, ExportOptions::default()).unwrap_err();
    assert!(err.is_peer_gone(), "{err}");

    // Exited with a status of its own.
    let (mut child, peer) = spawn_child("exit_with", PeerConfig::default());
    peer.send_message(&words(&[3]), &[]).unwrap();
    let err = peer.recv(T).unwrap_err();
    let want = format!("process {} exited with status 3", child.id());
    assert!(err.is_peer_gone() && err.to_string().contains(&want), "{err}");
    assert_eq!(child.wait().unwrap().code(), Some(3));

    // A peer that closes its end and lives on (here: in this process) closed the connection.
    let (a, b) = Peer::pair(PeerConfig::default()).unwrap();
    drop(b);
    let err = a.recv(T).unwrap_err();
    assert!(err.is_peer_gone() && err.to_string().contains("closed the connection"), "{err}");
}
