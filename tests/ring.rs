//! Ring tests between real processes: a million small messages in order with checksums,
//! sizes up to 4x the ring (chunked), views packed on the way in, backpressure, timeouts,
//! borrow vs copy, batching, and either side dying mid-stream.

mod common;

use common::*;
use std::time::{Duration, Instant};
use tensorwire::{DType, Error, Layout, PeerConfig, RingItem, SharedTensor, Wait};

const RING: usize = 64 << 10;
const MILLION: u64 = 1_000_000;

fn cfg() -> PeerConfig {
    PeerConfig { ring_bytes: RING, ..PeerConfig::default() }
}

fn wait(ms: u64) -> Wait {
    Wait::For(Duration::from_millis(ms))
}

fn payload(i: u64) -> Vec<u8> {
    let len = (i % 61) as usize;
    (0..len).map(|k| (i as u8).wrapping_mul(7).wrapping_add(k as u8)).collect()
}

fn big(i: u64) -> Vec<u8> {
    // Sizes from tiny to 4x the ring, not multiples of anything.
    let len = [0usize, 1, 63, 64, 65, 4095, RING / 2 - 200, RING / 2, RING, 3 * RING + 17, 4 * RING][(i % 11) as usize];
    (0..len).map(|k| (k as u8) ^ (i as u8).wrapping_mul(13)).collect()
}

#[test]
#[ignore = "child-process entry point; the other tests run it in a subprocess"]
fn child_entry() {
    let Some((role, peer)) = child_peer_with(cfg()) else { return };
    match role.as_str() {
        // Receive a million small messages, check order and contents, report a checksum.
        "million_rx" => {
            let mut sum = 0u64;
            let mut i = 0u64;
            while i < MILLION {
                for m in peer.ring_recv_many(512, false, wait(20_000)).unwrap() {
                    assert_eq!(m.tag, i, "out of order");
                    let v = m.into_vec();
                    assert_eq!(v, payload(i), "message {i} corrupted");
                    sum = sum.wrapping_add(fnv1a(&v));
                    i += 1;
                }
            }
            peer.send_message(&words(&[sum]), &[]).unwrap();
            let _ = peer.recv(T);
        }
        // Echo every message back through our own ring, verifying tensor descriptors.
        "echo" => loop {
            let m = match peer.ring_recv_with(false, wait(20_000)) {
                Ok(m) => m,
                Err(e) if e.is_peer_gone() => return,
                Err(e) => panic!("{e}"),
            };
            let tag = m.tag;
            let v = m.into_vec();
            peer.ring_send(&[RingItem::bytes(tag, &v)], Duration::from_secs(20)).unwrap();
        },
        // Send a few messages, say so, then wait to be killed.
        "send_then_die" => {
            peer.ring_send(&[RingItem::bytes(1, b"one"), RingItem::bytes(2, b"two")], T).unwrap();
            peer.send_message(b"sent", &[]).unwrap();
            let _ = peer.recv(tensorwire::Wait::Forever);
        }
        // Never read the ring; wait to be killed.
        "stall" => {
            peer.send_message(b"ready", &[]).unwrap();
            let _ = peer.recv(tensorwire::Wait::Forever);
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn a_million_small_messages_in_order_with_checksums() {
    let (mut child, peer) = spawn_child("million_rx", cfg());
    let mut sum = 0u64;
    let mut i = 0u64;
    let start = Instant::now();
    while i < MILLION {
        let batch: Vec<(u64, Vec<u8>)> = (i..(i + 256).min(MILLION)).map(|k| (k, payload(k))).collect();
        let items: Vec<RingItem<'_>> = batch.iter().map(|(k, v)| RingItem::bytes(*k, v)).collect();
        peer.ring_send(&items, Duration::from_secs(20)).unwrap();
        sum = batch.iter().fold(sum, |s, (_, v)| s.wrapping_add(fnv1a(v)));
        i += batch.len() as u64;
    }
    assert_eq!(recv_words(&peer), vec![sum], "checksum over a million messages differs");
    eprintln!("1e6 messages in {:?}", start.elapsed());
    drop(peer);
    child.wait().unwrap();
}

#[test]
fn sizes_up_to_four_times_the_ring_round_trip() {
    let (mut child, peer) = spawn_child("echo", cfg());
    for i in 0..33u64 {
        let data = big(i);
        peer.ring_send(&[RingItem::bytes(i, &data)], T).unwrap();
        let back = peer.ring_recv(T).unwrap();
        assert_eq!(back.tag, i);
        assert_eq!(back.len(), data.len());
        assert!(back.into_vec() == data, "message {i} of {} bytes corrupted", data.len());
    }
    drop(peer);
    child.wait().unwrap();
}

#[test]
fn strided_views_are_packed_and_described() {
    let (mut child, peer) = spawn_child("echo", cfg());
    let base = SharedTensor::zeros(Layout::contiguous(DType::Float32, &[300, 200]).unwrap()).unwrap();
    let raw: Vec<u8> = (0..base.storage_nbytes()).map(|k| (k % 251) as u8).collect();
    base.write_storage(0, &raw).unwrap();
    // A transposed view larger than the ring (240 KB): chunked and packed on the way.
    let t = base.view(base.layout().transpose(0, 1).unwrap()).unwrap();
    let want = t.to_vec().unwrap();
    peer.ring_send(&[RingItem::shared(7, &t)], T).unwrap();
    let back = peer.ring_recv(T).unwrap();
    assert_eq!((back.tag, back.into_vec() == want), (7, true));
    // The descriptor travels with the data (here checked locally on a fresh pair).
    let (a, b) = tensorwire::Peer::pair(cfg()).unwrap();
    let small = Layout::contiguous(DType::Int16, &[10, 4]).unwrap().transpose(0, 1).unwrap();
    let storage: Vec<u8> = (0..80u8).collect();
    a.ring_send(&[RingItem::tensor(3, small, &storage).unwrap()], T).unwrap();
    let m = b.ring_recv(T).unwrap();
    let d = m.desc.expect("tensor messages carry a descriptor");
    assert_eq!((d.layout().sizes(), d.layout().dtype), (&[4i64, 10][..], DType::Int16));
    assert!(d.layout().is_contiguous());
    let mut packed = Vec::new();
    // SAFETY: storage holds the view's 80-byte extent.
    unsafe { small.gather(storage.as_ptr(), &mut packed) }.unwrap();
    assert_eq!(m.into_vec(), packed);
    drop(peer);
    child.wait().unwrap();
}

#[test]
fn borrowed_messages_stay_in_place_and_release_in_ring_order() {
    let (a, b) = tensorwire::Peer::pair(PeerConfig { ring_bytes: 4096, ..PeerConfig::default() }).unwrap();
    // 4096-byte ring, 2048-byte records max: two records of 1984 bytes fill it.
    let blob = |k: u8| vec![k; 1900];
    a.ring_send(&[RingItem::bytes(1, &blob(1)), RingItem::bytes(2, &blob(2))], T).unwrap();
    let m1 = b.ring_recv_with(true, wait(5000)).unwrap();
    let m2 = b.ring_recv_with(true, wait(5000)).unwrap();
    assert!(m1.is_borrowed() && m2.is_borrowed());
    // Zero copies: the bytes are read in place, and they are right.
    // SAFETY: m2 is borrowed and alive; its 1900 bytes stay in the ring until it drops.
    assert_eq!(unsafe { std::slice::from_raw_parts(m2.as_ptr(), m2.len()) }, &blob(2)[..]);
    // The ring is full until the oldest borrow goes: releasing m2 first frees nothing.
    drop(m2);
    let err = a.ring_send(&[RingItem::bytes(3, &blob(3))], Duration::from_millis(100)).unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    drop(m1); // now both records are released together
    a.ring_send(&[RingItem::bytes(3, &blob(3))], Duration::from_secs(5)).unwrap();
    let m3 = b.ring_recv_with(true, wait(5000)).unwrap();
    assert_eq!((m3.tag, m3.into_vec()), (3, blob(3)));
    // Messages larger than a record are always copies.
    let huge = vec![9u8; 10_000];
    std::thread::scope(|s| {
        s.spawn(|| a.ring_send(&[RingItem::bytes(5, &huge)], T).unwrap());
        let m5 = b.ring_recv_with(true, wait(5000)).unwrap();
        assert!(!m5.is_borrowed());
        assert_eq!(m5.into_vec(), huge);
    });
}

#[test]
fn no_wait_is_over_at_once_and_a_huge_wait_is_no_limit() {
    let (a, b) = tensorwire::Peer::pair(PeerConfig { ring_bytes: 4096, ..PeerConfig::default() }).unwrap();
    let start = Instant::now();
    let err = b.ring_recv(Wait::Never).unwrap_err();
    assert!(matches!(err, Error::Timeout { after, .. } if after.is_zero()), "{err}");
    // A full ring: a send that may not wait fails at once, naming what it waited for.
    let blob = vec![1u8; 1900];
    a.ring_send(&[RingItem::bytes(1, &blob), RingItem::bytes(2, &blob)], T).unwrap();
    let err = a.ring_send(&[RingItem::bytes(3, &blob)], Wait::Never).unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }) && err.to_string().contains("at once"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(2), "took {:?}", start.elapsed());
    // What is there is taken without waiting.
    assert_eq!(b.ring_recv(Wait::Never).unwrap().tag, 1);
    assert_eq!(b.ring_recv(Wait::Never).unwrap().tag, 2);
    // A wait too long for the clock waits (for a message sent later), not zero.
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(50));
            a.ring_send(&[RingItem::bytes(4, b"late")], T).unwrap();
        });
        assert_eq!(b.ring_recv(Duration::MAX).unwrap().tag, 4);
    });
}

#[test]
fn backpressure_and_timeouts_never_overwrite() {
    let (mut child, peer) = spawn_child("stall", cfg());
    match peer.recv(T).unwrap() {
        tensorwire::Incoming::Message { payload, .. } => assert_eq!(payload, b"ready"),
        other => panic!("{other:?}"),
    }
    let chunk = vec![1u8; 8000];
    let mut sent = 0;
    let err = loop {
        match peer.ring_send(&[RingItem::bytes(sent, &chunk)], Duration::from_millis(200)) {
            Ok(()) => sent += 1,
            Err(e) => break e,
        }
        assert!(sent < 100, "a 64 KiB ring accepted {sent} x 8000 bytes unread");
    };
    assert!(matches!(err, Error::Timeout { .. }) && err.to_string().contains("space in the ring"), "{err}");
    assert!(sent >= 6, "ring of 64 KiB held only {sent} messages of 8000 bytes");
    // Receiving on an empty ring times out too (the child never sends).
    let start = Instant::now();
    let err = peer.ring_recv_with(false, wait(150)).unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(5));
    kill9(&mut child);
    // Blocked on a full ring when the consumer dies: PeerGone, not a hang.
    let start = Instant::now();
    let err = peer.ring_send(&[RingItem::bytes(0, &chunk)], Duration::from_secs(30)).unwrap_err();
    assert!(err.is_peer_gone(), "{err}");
    assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
}

#[test]
fn producer_dying_mid_stream_is_peer_gone_after_the_data() {
    let (mut child, peer) = spawn_child("send_then_die", cfg());
    match peer.recv(T).unwrap() {
        tensorwire::Incoming::Message { payload, .. } => assert_eq!(payload, b"sent"),
        other => panic!("{other:?}"),
    }
    kill9(&mut child);
    // What was published before the death is still delivered, then PeerGone.
    assert_eq!(peer.ring_recv(T).unwrap().into_vec(), b"one");
    assert_eq!(peer.ring_recv(T).unwrap().into_vec(), b"two");
    let start = Instant::now();
    let err = peer.ring_recv(Duration::from_secs(30)).unwrap_err();
    assert!(err.is_peer_gone(), "{err}");
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn recv_into_reuses_the_buffer_for_small_and_chunked_messages() {
    let (a, b) = tensorwire::Peer::pair(PeerConfig { ring_bytes: 4096, ..PeerConfig::default() }).unwrap();
    let mut buf = Vec::with_capacity(100_000);
    let cap_ptr = buf.as_ptr();
    std::thread::scope(|s| {
        s.spawn(|| {
            for i in 0..4u64 {
                let data = vec![i as u8; if i % 2 == 0 { 50 } else { 30_000 }];
                a.ring_send(&[RingItem::bytes(i, &data)], T).unwrap();
            }
        });
        for i in 0..4u64 {
            let (tag, desc) = b.ring_recv_into(&mut buf, wait(5000)).unwrap();
            assert_eq!((tag, desc.is_none()), (i, true));
            assert_eq!(buf, vec![i as u8; if i % 2 == 0 { 50 } else { 30_000 }]);
        }
    });
    assert_eq!(buf.as_ptr(), cap_ptr, "the caller's allocation should be reused");
}

#[test]
fn no_ring_is_a_clear_error() {
    let (a, b) = tensorwire::Peer::pair(PeerConfig { ring_bytes: 0, ..PeerConfig::default() }).unwrap();
    let e = a.ring_send(&[RingItem::bytes(0, b"x")], T).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("no ring to send through"), "{e}");
    let e = b.ring_recv(T).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("no ring to receive from"), "{e}");
    let e = tensorwire::Peer::pair(PeerConfig { ring_bytes: 5000, ..PeerConfig::default() }).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("power of two"), "{e}");
}

#[test]
fn large_messages_go_in_chunks_and_ones_that_fit_a_record_stay_whole() {
    // 8 MiB ring: a record holds up to 4 MiB. A 3 MiB message fits one record (and so can
    // be borrowed); a 9 MiB one goes in 1 MiB chunks through a ring smaller than itself,
    // copy-in overlapping copy-out, and arrives whole, in order, into a reused buffer.
    let (a, b) = tensorwire::Peer::pair(PeerConfig { ring_bytes: 8 << 20, ..PeerConfig::default() }).unwrap();
    let fits: Vec<u8> = (0..3usize << 20).map(|k| (k * 7) as u8).collect();
    let huge: Vec<u8> = (0..(9usize << 20) + 13).map(|k| (k ^ (k >> 9)) as u8).collect();
    std::thread::scope(|s| {
        s.spawn(|| {
            a.ring_send(&[RingItem::bytes(1, &fits)], T).unwrap();
            for tag in 2..5 {
                a.ring_send(&[RingItem::bytes(tag, &huge)], T).unwrap();
            }
        });
        let m = b.ring_recv_with(true, wait(10_000)).unwrap();
        assert!(m.is_borrowed(), "a message that fits one record is borrowed in place");
        assert_eq!((m.tag, m.into_vec()), (1, fits.clone()));
        let mut buf = Vec::new();
        for tag in 2..5 {
            let (t, desc) = b.ring_recv_into(&mut buf, wait(10_000)).unwrap();
            assert_eq!((t, desc.is_none(), buf.len()), (tag, true, huge.len()));
            assert!(buf == huge, "message {tag} corrupted");
        }
    });
}
