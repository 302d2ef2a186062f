//! Consumer death with 1000 leases outstanding: every owner dropped exactly once, and no
//! fd or memfd mapping left in the producer. Its own test binary, so nothing else in the
//! process opens fds while it counts them.

mod common;

use common::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tensorwire::{DType, ExportOptions, Layout, PeerConfig, SharedTensor};

#[test]
#[ignore = "child-process entry point; the other tests run it in a subprocess"]
fn child_entry() {
    child_main();
}

fn run_holder_and_kill(n: usize) -> (usize, usize) {
    let dropped = Arc::new(AtomicUsize::new(0));
    let (mut child, peer) = spawn_child("hold", PeerConfig::default());
    for i in 0..n {
        let t = SharedTensor::zeros(Layout::contiguous(DType::Float32, &[16, 64]).unwrap()).unwrap();
        let owner = Box::new(Counted(dropped.clone(), t.segment().clone()));
        peer.export_with_owner(&t, owner, ExportOptions { tag: i as u64, window: None }).unwrap();
    }
    peer.send_message(b"report", &[]).unwrap();
    assert_eq!(recv_words(&peer), vec![n as u64]);
    assert_eq!(peer.export_stats().live_leases, n as u64);
    assert_eq!(dropped.load(Ordering::SeqCst), 0, "no owner may drop while the child holds its lease");
    kill9(&mut child);
    wait_until("every owner dropped after the consumer died", T, || dropped.load(Ordering::SeqCst) == n);
    let s = peer.export_stats();
    assert_eq!((s.live_leases, s.live_bytes, s.reclaimed), (0, 0, n as u64));
    let err = peer.recv(T).unwrap_err();
    assert!(err.is_peer_gone(), "{err}");
    drop(peer);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(dropped.load(Ordering::SeqCst), n, "an owner dropped twice");
    (open_fds(), memfd_maps())
}

#[test]
fn consumer_sigkilled_holding_1000_leases_every_owner_dropped_nothing_leaked() {
    // Warm up once so lazily created process state (thread stacks, caches) is in place.
    run_holder_and_kill(3);
    let (fds0, maps0) = (open_fds(), memfd_maps());
    let (fds1, maps1) = run_holder_and_kill(1000);
    assert_eq!(fds1, fds0, "fds left behind in the producer");
    assert_eq!(maps1, maps0, "memfd mappings left behind in the producer");
}

