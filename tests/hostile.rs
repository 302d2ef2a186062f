//! A hostile peer: a raw `Connection` that speaks just enough of the protocol to get a
//! `Peer` set up, then sends crafted descriptors, fds and messages. Every case must be a
//! clear error naming the problem — no panic, no hang — and the connection must still
//! carry a valid tensor afterwards.

mod common;

use bytemuck::Zeroable;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tensorwire::lease::{Exporter, LeaseId, TABLE_HEADER_BYTES};
use tensorwire::peer::{KIND_TABLE, KIND_TENSOR};
use tensorwire::{
    Connection, DType, Error, ErrorKind, ExportOptions, Layout, Peer, PeerConfig, Segment, SharedTensor, StorageKind,
    StorageRef, TensorDesc,
};

const T: Duration = Duration::from_secs(10);

struct Attacker {
    conn: Connection,
    table: Exporter,
    victim_table: OwnedFd,
}

/// A victim `Peer` and an attacker speaking raw messages on the other end.
fn setup() -> (Peer, Attacker) {
    let (a, b) = Connection::pair().unwrap();
    let victim = std::thread::spawn(move || Peer::new(a, PeerConfig::default()));
    let table = Exporter::new(32, u64::MAX).unwrap();
    b.send(KIND_TABLE, &setup_msg(32, 0), &[table.table().fd()]).unwrap();
    let m = b.recv(T).unwrap();
    assert_eq!(m.kind, KIND_TABLE);
    let victim = victim.join().unwrap().unwrap();
    (victim, Attacker { conn: b, table, victim_table: m.fds.into_iter().next().unwrap() })
}

/// The setup payload: lease-table capacity, then the ring size (0: no ring).
fn setup_msg(capacity: u32, ring_bytes: u64) -> Vec<u8> {
    tensorwire::peer::setup_payload(capacity, ring_bytes, 0)
}

fn sealed(len: usize, seals: i32) -> OwnedFd {
    let fd = tensorwire::os::memfd_create("hostile").unwrap();
    tensorwire::os::ftruncate(fd.as_fd(), len as u64).unwrap();
    if seals != 0 {
        tensorwire::os::add_seals(fd.as_fd(), seals).unwrap();
    }
    fd
}

impl Attacker {
    /// A lease that is really live in the attacker's table, so the victim gets past the
    /// lease check and reaches the check under test.
    fn live_lease(&mut self) -> LeaseId {
        let seg = Arc::new(Segment::create(64).unwrap());
        self.table.grant(Some(&seg), 64, Box::new(()), None).map_err(|(e, _)| e).unwrap().0
    }

    fn desc(&mut self, layout: Layout, segment_id: u64, nbytes: u64) -> TensorDesc {
        let lease = self.live_lease();
        TensorDesc::new(&layout, StorageKind::Segment, StorageRef {
            segment_id,
            nbytes,
            lease_slot: lease.slot,
            lease_gen: lease.generation,
            ..Zeroable::zeroed()
        })
    }

    /// A tensor message naming fd slot 0.
    fn send_raw(&self, tag: u64, desc_bytes: &[u8], fd: Option<&OwnedFd>) {
        self.send_in(tag, desc_bytes, fd, 0, 0);
    }

    /// A tensor message: tag, descriptor bytes, fd slot, then `trailer` where the
    /// protocol wants 0.
    fn send_in(&self, tag: u64, desc_bytes: &[u8], fd: Option<&OwnedFd>, slot: u32, trailer: u32) {
        let mut p = tag.to_le_bytes().to_vec();
        p.extend_from_slice(desc_bytes);
        p.extend_from_slice(&slot.to_le_bytes());
        p.extend_from_slice(&trailer.to_le_bytes());
        let fds: Vec<_> = fd.iter().map(|f| f.as_fd()).collect();
        self.conn.send(KIND_TENSOR, &p, &fds).unwrap();
    }
}

fn expect_err(victim: &Peer, kind: ErrorKind, needle: &str) -> Error {
    let err = match victim.recv(T) {
        Ok(x) => panic!("expected an error containing {needle:?}, got {x:?}"),
        Err(e) => e,
    };
    assert!(err.kind() == kind && err.to_string().contains(needle), "expected {kind:?} with {needle:?}, got {:?}: {err}", err.kind());
    assert!(!matches!(err, Error::Timeout { .. }), "{err}");
    err
}

fn f32s(n: i64) -> Layout {
    Layout::contiguous(DType::Float32, &[n]).unwrap()
}

#[test]
fn hostile_producer_gets_clear_errors_and_the_connection_survives() {
    let (victim, mut at) = setup();

    // Segments that must not be mapped.
    let d = at.desc(f32s(16), 100, 64);
    at.send_raw(1, d.encode(), Some(&sealed(4096, 0)));
    expect_err(&victim, ErrorKind::InvalidSegment, "not sealed against resizing (missing F_SEAL_SHRINK and F_SEAL_GROW)");

    let d = at.desc(f32s(16), 101, 64);
    at.send_raw(2, d.encode(), Some(&sealed(4096, libc::F_SEAL_GROW)));
    expect_err(&victim, ErrorKind::InvalidSegment, "missing F_SEAL_SHRINK");

    let d = at.desc(f32s(1024), 102, 4096);
    at.send_raw(3, d.encode(), Some(&sealed(1024, libc::F_SEAL_GROW | libc::F_SEAL_SHRINK)));
    expect_err(&victim, ErrorKind::InvalidDescriptor, "segment too small: descriptor needs 4096 bytes at offset 0, segment has 1024");

    let path = std::env::temp_dir().join(format!("tw-hostile-{}", std::process::id()));
    std::fs::write(&path, vec![0u8; 4096]).unwrap();
    let file: OwnedFd = std::fs::File::open(&path).unwrap().into();
    std::fs::remove_file(&path).unwrap();
    let d = at.desc(f32s(16), 103, 64);
    at.send_raw(4, d.encode(), Some(&file));
    expect_err(&victim, ErrorKind::InvalidSegment, "not a memfd");

    let named = Segment::create_named(4096).unwrap();
    let d = at.desc(f32s(16), 104, 64);
    at.send_raw(5, d.encode(), Some(&named.fd().try_clone_to_owned().unwrap()));
    expect_err(&victim, ErrorKind::InvalidSegment, "not a memfd");

    // A real, sealed segment, but a descriptor whose extent passes its end.
    let good = Segment::create(4096).unwrap();
    let good_fd = || good.fd().try_clone_to_owned().unwrap();
    let mut d = at.desc(f32s(16), 200, 64);
    d.storage.base_offset = 4090;
    at.send_raw(6, d.encode(), Some(&good_fd()));
    expect_err(&victim, ErrorKind::InvalidDescriptor, "segment too small: descriptor needs 64 bytes at offset 4090, segment has 4096");

    // Descriptor-level garbage.
    let mut d = at.desc(f32s(16), 200, 64);
    d.sizes[0] = i64::MAX;
    d.strides[0] = 2;
    at.send_raw(7, d.encode(), None);
    expect_err(&victim, ErrorKind::InvalidDescriptor, "overflow 64 bits when packed");
    let mut d = at.desc(f32s(16), 200, 64);
    d.dtype = 99;
    at.send_raw(8, d.encode(), None);
    expect_err(&victim, ErrorKind::InvalidDescriptor, "unknown dtype code 99");
    let mut d = at.desc(f32s(16), 200, 64);
    d.strides[0] = -1;
    at.send_raw(9, d.encode(), None);
    expect_err(&victim, ErrorKind::InvalidDescriptor, "stride -1 of dim 0 is negative");
    let mut rnd = vec![0u8; tensorwire::DESC_SIZE];
    tensorwire::os::getrandom(&mut rnd).unwrap();
    at.send_raw(10, &rnd, None);
    expect_err(&victim, ErrorKind::InvalidDescriptor, "invalid tensor descriptor");
    at.send_raw(11, &rnd[..17], None);
    expect_err(&victim, ErrorKind::Protocol, "tensor message has 33 bytes, expected 416");

    // Leases the victim was never granted.
    let mut d = at.desc(f32s(16), 200, 64);
    d.storage.lease_slot = 999;
    at.send_raw(12, d.encode(), None);
    expect_err(&victim, ErrorKind::StaleLease, "lease slot 999 out of range (the peer's table has 32 slots)");
    let mut d = at.desc(f32s(16), 200, 64);
    d.storage.lease_gen += 7;
    at.send_raw(13, d.encode(), None);
    expect_err(&victim, ErrorKind::StaleLease, "not 8");
    // A segment id no fd ever came with.
    let d = at.desc(f32s(16), 777, 64);
    at.send_raw(14, d.encode(), None);
    expect_err(&victim, ErrorKind::InvalidDescriptor, "names segment 777 in fd slot 0, which holds no fd");
    // Fd slots: one past the last, with and without an fd; a slot that holds another
    // segment's fd; a trailer that is not zero.
    let d = at.desc(f32s(16), 200, 64);
    at.send_in(16, d.encode(), Some(&good_fd()), tensorwire::peer::SEGMENT_FD_SLOTS, 0);
    expect_err(&victim, ErrorKind::Protocol, "names fd slot 16; a connection has 16");
    let d = at.desc(f32s(16), 200, 64);
    at.send_in(17, d.encode(), None, u32::MAX, 0);
    expect_err(&victim, ErrorKind::Protocol, &format!("names fd slot {}", u32::MAX));
    let d = at.desc(f32s(16), 200, 64);
    at.send_in(18, d.encode(), Some(&good_fd()), 3, 0);
    victim.recv_tensor(T).unwrap().release().unwrap();
    let d = at.desc(f32s(16), 201, 64);
    at.send_in(19, d.encode(), None, 3, 0);
    expect_err(&victim, ErrorKind::InvalidDescriptor, "names segment 201 in fd slot 3, which holds the fd of segment 200");
    let d = at.desc(f32s(16), 200, 64);
    at.send_in(20, d.encode(), None, 3, 1);
    expect_err(&victim, ErrorKind::Protocol, "the 4 bytes after its fd slot must be zero");
    // Unknown message kind and a runt message.
    at.conn.send(99, b"??", &[]).unwrap();
    expect_err(&victim, ErrorKind::Protocol, "unknown message kind 99");

    // The victim gave back every live lease it refused after the lease check.
    let mut owners = tensorwire::lease::Reclaimed::default();
    at.table.reap(std::time::Instant::now(), &mut owners);
    assert!(at.table.stats().released >= 10, "{:?}", at.table.stats());

    // Still healthy: a valid tensor on a sealed segment goes through.
    let d = at.desc(f32s(16), 300, 64);
    let seg = Segment::create(64).unwrap();
    seg.write_at(0, &[9u8; 64]).unwrap();
    at.send_raw(15, d.encode(), Some(&seg.fd().try_clone_to_owned().unwrap()));
    let t = victim.recv_tensor(T).unwrap();
    assert_eq!((t.tag(), t.to_vec().unwrap()), (15, vec![9u8; 64]));
    t.release().unwrap();
}

/// A slot's fd is used only with a window of its own file: a producer that sent one
/// segment id with two different files (slots 1 and 2) gets each file's bytes through
/// each slot, never the other's window.
#[test]
fn a_slot_maps_its_own_file_not_a_cached_window_of_another() {
    let (victim, mut at) = setup();
    let files: Vec<Segment> = (0..2u8).map(|i| {
        let s = Segment::create(64).unwrap();
        s.write_at(0, &[10 + i; 64]).unwrap();
        s
    }).collect();
    for (slot, f) in [(1u32, &files[0]), (2, &files[1])] {
        let d = at.desc(f32s(16), 500, 64);
        at.send_in(1, d.encode(), Some(&f.fd().try_clone_to_owned().unwrap()), slot, 0);
        victim.recv_tensor(T).unwrap().release().unwrap();
    }
    // The cached window of segment 500 is file 1's now; slot 1 holds file 0.
    for (slot, want) in [(1u32, 10u8), (2, 11), (1, 10)] {
        let d = at.desc(f32s(16), 500, 64);
        at.send_in(2, d.encode(), None, slot, 0);
        let t = victim.recv_tensor(T).unwrap();
        assert_eq!(t.to_vec().unwrap()[0], want, "through slot {slot}");
        t.release().unwrap();
    }
}

/// The producer's side of the fd slots: a segment's fd goes with its first descriptor
/// only; later ones name its slot. Pushed out of its slot by SEGMENT_FD_SLOTS other
/// segments, its fd goes again.
#[test]
fn a_segments_fd_travels_once_until_other_segments_take_its_slot() {
    let (victim, at) = setup();
    let layout = Layout::contiguous(DType::UInt8, &[256]).unwrap();
    let hot = SharedTensor::zeros(layout).unwrap();
    let sent = |t: &SharedTensor, tag: u64| {
        victim.export(t, ExportOptions { tag, window: None }).unwrap();
        let m = at.conn.recv(T).unwrap();
        assert_eq!(m.kind, KIND_TENSOR);
        let p = &m.payload;
        assert_eq!(u64::from_le_bytes(p[..8].try_into().unwrap()), tag);
        let slot = u32::from_le_bytes(p[p.len() - 8..p.len() - 4].try_into().unwrap());
        (m.fds.len(), slot)
    };
    let (fds, slot) = sent(&hot, 0);
    assert_eq!(fds, 1, "the first descriptor of a segment carries its fd");
    for tag in 1..4 {
        assert_eq!(sent(&hot, tag), (0, slot), "export {tag} of the same segment");
    }
    let others: Vec<SharedTensor> = (0..tensorwire::peer::SEGMENT_FD_SLOTS).map(|_| SharedTensor::zeros(layout).unwrap()).collect();
    for (i, o) in others.iter().enumerate() {
        assert_eq!(sent(o, 100 + i as u64).0, 1, "another segment's first descriptor");
    }
    assert_eq!(sent(&hot, 4).0, 1, "pushed out of its slot, the segment's fd must travel again");
    assert_eq!(sent(&hot, 5).0, 0);
}

#[test]
fn hostile_consumer_scribbling_the_lease_table_cannot_break_the_producer() {
    let (victim, at) = setup();
    let table = Segment::from_fd(at.victim_table.try_clone().unwrap(), TABLE_HEADER_BYTES).unwrap();
    let dropped = Arc::new(AtomicUsize::new(0));
    struct Count(Arc<AtomicUsize>);
    impl Drop for Count {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let t = SharedTensor::zeros(Layout::contiguous(DType::UInt8, &[256]).unwrap()).unwrap();
    for i in 0..20 {
        victim.export_with_owner(&t, Box::new(Count(dropped.clone())), ExportOptions { tag: i, window: None }).unwrap();
    }
    // Scribble every word of the table, header and doorbell included, many times.
    let words = table.len() / 8;
    let mut rnd = vec![0u8; table.len()];
    for round in 0..50 {
        tensorwire::os::getrandom(&mut rnd).unwrap();
        for w in 0..words {
            let v = u64::from_le_bytes(rnd[w * 8..w * 8 + 8].try_into().unwrap());
            // SAFETY: w*8 < table.len(); the word is 8-aligned in a page-aligned mapping.
            let word = unsafe { &*table.as_ptr().add(w * 8).cast::<AtomicU64>() };
            word.store(if round % 2 == 0 { v } else { v & 0xffff_ffff_0000_0003 }, Ordering::Relaxed);
        }
        victim.reap_now();
    }
    let s = victim.export_stats();
    assert!(s.live_leases <= 20);
    assert_eq!(s.live_leases as usize + dropped.load(Ordering::SeqCst), 20, "an owner was lost or dropped twice");
    // The consumer disconnects: everything still held comes back exactly once.
    drop(at);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while dropped.load(Ordering::SeqCst) < 20 {
        assert!(std::time::Instant::now() < deadline, "owners not reclaimed after the consumer left");
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(victim);
    assert_eq!(dropped.load(Ordering::SeqCst), 20);
}

#[test]
fn hostile_table_at_setup_is_refused() {
    for (cap, fd_seals, kind, needle) in [
        (0u32, true, ErrorKind::Protocol, "capacity 0 outside"),
        (u32::MAX, true, ErrorKind::Protocol, "outside 1..="),
        (16, false, ErrorKind::InvalidSegment, "not sealed"),
    ] {
        let (a, b) = Connection::pair().unwrap();
        let victim = std::thread::spawn(move || Peer::new(a, PeerConfig::default()));
        let fd = sealed(4096, if fd_seals { libc::F_SEAL_GROW | libc::F_SEAL_SHRINK } else { 0 });
        b.send(KIND_TABLE, &setup_msg(cap, 0), &[fd.as_fd()]).unwrap();
        let err = victim.join().unwrap().unwrap_err();
        assert!(err.kind() == kind && err.to_string().contains(needle), "expected {kind:?} with {needle:?}, got {:?}: {err}", err.kind());
    }
    // A sealed memfd of the right size whose header is not a lease table.
    let (a, b) = Connection::pair().unwrap();
    let victim = std::thread::spawn(move || Peer::new(a, PeerConfig::default()));
    let fd = sealed(4096, libc::F_SEAL_GROW | libc::F_SEAL_SHRINK);
    b.send(KIND_TABLE, &setup_msg(16, 0), &[fd.as_fd()]).unwrap();
    let err = victim.join().unwrap().unwrap_err();
    assert!(matches!(err, Error::Protocol(_)) && err.to_string().contains("lease table header invalid"), "{err}");
    // A ring announced without its fd, and a ring fd that is not a ring.
    let good_table = Exporter::new(16, u64::MAX).unwrap();
    for (ring_bytes, ring_fd, kind, needle) in [
        (1u64 << 16, None, ErrorKind::Protocol, "announced a 65536-byte ring but sent no ring fd"),
        (1000, Some(sealed(8192, libc::F_SEAL_GROW | libc::F_SEAL_SHRINK)), ErrorKind::Protocol, "not a power of two"),
        (4096, Some(sealed(8192, libc::F_SEAL_GROW | libc::F_SEAL_SHRINK)), ErrorKind::Protocol, "ring header invalid"),
        (1 << 16, Some(sealed(8192, libc::F_SEAL_GROW | libc::F_SEAL_SHRINK)), ErrorKind::InvalidSegment, "segment too small"),
    ] {
        let (a, b) = Connection::pair().unwrap();
        let victim = std::thread::spawn(move || Peer::new(a, PeerConfig::default()));
        let mut fds = vec![good_table.table().fd()];
        if let Some(f) = &ring_fd {
            fds.push(f.as_fd());
        }
        b.send(KIND_TABLE, &setup_msg(16, ring_bytes), &fds).unwrap();
        let err = victim.join().unwrap().unwrap_err();
        assert!(err.kind() == kind && err.to_string().contains(needle), "expected {kind:?} with {needle:?}, got {:?}: {err}", err.kind());
    }
}

/// Malformed GPU ring setups fail the connection with a protocol error naming what was
/// wrong (checked before any CUDA call, so this runs with or without a GPU).
#[test]
fn hostile_gpu_ring_setup_is_refused() {
    use tensorwire::cuda::ring::{CudaRingConfig, RingSetup};
    use tensorwire::peer::{KIND_CUDA_RING, KIND_USER};
    let good = RingSetup {
        cfg: CudaRingConfig { device: 0, slots: 2, slot_bytes: 4096 },
        arena: [1; 64],
        desc_ring_bytes: 65536,
        words: false,
        written: vec![[2; 64]; 2],
    };
    let offers_words = RingSetup { words: true, ..good.clone() }.encode();
    let mut zero_slots = good.encode();
    zero_slots[4..8].copy_from_slice(&0u32.to_le_bytes());
    let short = good.encode()[..100].to_vec();
    let table = Exporter::new(16, u64::MAX).unwrap();
    let ctrl = sealed(4096, libc::F_SEAL_GROW | libc::F_SEAL_SHRINK);
    let small_ctrl = sealed(64, libc::F_SEAL_GROW | libc::F_SEAL_SHRINK);
    let descs = tensorwire::ring::RingShared::create(65536).unwrap();
    use ErrorKind::{InvalidSegment, Protocol};
    // Message kind, payload, fds, the error's kind, what its message names.
    type Case<'a> = (u32, Vec<u8>, Vec<std::os::fd::BorrowedFd<'a>>, ErrorKind, &'static str);
    let cases: Vec<Case<'_>> = vec![
        (KIND_CUDA_RING, zero_slots, vec![ctrl.as_fd(), descs.segment().fd()], Protocol, "GPU ring of 0 slots"),
        (KIND_CUDA_RING, short, vec![ctrl.as_fd(), descs.segment().fd()], Protocol, "100 bytes for 2 slots"),
        (KIND_CUDA_RING, good.encode(), vec![ctrl.as_fd()], Protocol, "2 or 3 fds"),
        (KIND_CUDA_RING, offers_words, vec![ctrl.as_fd(), descs.segment().fd()], Protocol, "offers signal words and needs 3 fds, came with 2"),
        (KIND_CUDA_RING, good.encode(), vec![ctrl.as_fd(), descs.segment().fd(), ctrl.as_fd()], Protocol, "does not offer signal words and needs 2 fds, came with 3"),
        (KIND_USER, b"hello".to_vec(), vec![], Protocol, "expected the peer's GPU ring setup"),
        (KIND_CUDA_RING, good.encode(), vec![small_ctrl.as_fd(), descs.segment().fd()], InvalidSegment, "segment too small"),
    ];
    for (msg_kind, payload, fds, kind, needle) in cases {
        let (a, b) = Connection::pair().unwrap();
        let victim = std::thread::spawn(move || Peer::new(a, PeerConfig::default()));
        b.send(KIND_TABLE, &tensorwire::peer::setup_payload(16, 0, tensorwire::peer::SETUP_HAS_CUDA_RING), &[table.table().fd()]).unwrap();
        b.send(msg_kind, &payload, &fds).unwrap();
        let err = victim.join().unwrap().unwrap_err();
        assert!(err.kind() == kind && err.to_string().contains(needle), "expected {kind:?} with {needle:?}, got {:?}: {err}", err.kind());
    }
    // Unknown setup flags.
    let (a, b) = Connection::pair().unwrap();
    let victim = std::thread::spawn(move || Peer::new(a, PeerConfig::default()));
    let mut p = tensorwire::peer::setup_payload(16, 0, 0);
    p[12] = 0x80;
    b.send(KIND_TABLE, &p, &[table.table().fd()]).unwrap();
    let err = victim.join().unwrap().unwrap_err();
    assert!(matches!(err, Error::Protocol(_)) && err.to_string().contains("unknown setup flags 0x80"), "{err}");
}

#[test]
fn segment_from_fd_refuses_bad_fds_directly() {
    let e = Segment::from_fd(sealed(100, libc::F_SEAL_GROW | libc::F_SEAL_SHRINK), 4096).unwrap_err();
    assert!(matches!(e, Error::InvalidSegment(_)) && e.to_string().contains("segment too small: 4096 bytes needed, memfd has 100"), "{e}");
    let e = Segment::from_fd(sealed(4096, libc::F_SEAL_SHRINK), 1).unwrap_err();
    assert!(matches!(e, Error::InvalidSegment(_)) && e.to_string().contains("missing F_SEAL_GROW"), "{e}");
    let (s1, _s2) = tensorwire::os::seqpacket_pair().unwrap();
    let e = Segment::from_fd(s1, 1).unwrap_err();
    assert!(matches!(e, Error::InvalidSegment(_)) && e.to_string().contains("not a memfd"), "{e}");
}

/// A peer that rings our message doorbell with nothing sent, writes any CPU into its
/// message line, or sends without ringing, costs latency only: a ring just makes a receive
/// look at the socket again, and a receive also looks between its sleep slices.
#[test]
fn a_peer_that_rings_for_nothing_or_never_rings_is_still_heard() {
    use tensorwire::lease::{MessageLine, MESSAGE_LINE_OFFSET};
    let (victim, at) = setup();
    let table = at.table.table().clone();
    // SAFETY: the attacker's own table, mapped for the test's whole length; the line lies
    // inside its header and is atomics only.
    let line = move || unsafe { &*table.as_ptr().add(MESSAGE_LINE_OFFSET).cast::<MessageLine>() };
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let noise = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut i = 0u32;
            while !stop.load(Ordering::Relaxed) {
                line().bell.seq.fetch_add(1, Ordering::SeqCst);
                line().sender_cpu.store(i % 3, Ordering::Relaxed);
                tensorwire::sync::futex::wake_all(&line().bell.seq);
                i = i.wrapping_add(1);
                std::thread::sleep(Duration::from_micros(50));
            }
        })
    };
    match victim.recv(Duration::from_millis(200)) {
        Err(Error::Timeout { .. }) => {}
        other => panic!("rings with nothing sent must end in the receive's timeout, got {other:?}"),
    }
    stop.store(true, Ordering::Relaxed);
    noise.join().unwrap();
    // A message sent without a ring, while the victim sleeps on the doorbell.
    let sender = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        at.conn.send(tensorwire::peer::KIND_USER, b"unrung", &[]).unwrap();
        at
    });
    match victim.recv(T) {
        Ok(tensorwire::Incoming::Message { payload, .. }) => assert_eq!(payload, b"unrung"),
        other => panic!("an unrung message must still arrive, got {other:?}"),
    }
    drop(sender.join().unwrap());
}

/// What a peer that moves its message doorbell without sending does to it.
#[derive(Debug, Clone, Copy)]
enum BellGame {
    /// Bumps the sequence as fast as it can, waking sleepers each time.
    Spam,
    /// Moves the sequence backwards, waking sleepers each time.
    Backwards,
    /// Stores random sequences and random sender CPUs (ours among them), waking sleepers.
    RandomWithCpu,
}

/// Play `game` on the attacker's message line until `stop`.
fn play(game: BellGame, table: Arc<Segment>, stop: Arc<std::sync::atomic::AtomicBool>) -> std::thread::JoinHandle<u64> {
    use tensorwire::lease::{MessageLine, MESSAGE_LINE_OFFSET};
    std::thread::spawn(move || {
        // SAFETY: the attacker's own table, kept alive by the Arc for the thread's life;
        // the line lies inside its header and is atomics only.
        let line = unsafe { &*table.as_ptr().add(MESSAGE_LINE_OFFSET).cast::<MessageLine>() };
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get() as u32);
        let mut rnd = [0u8; 8];
        let mut moves = 0u64;
        while !stop.load(Ordering::Relaxed) {
            match game {
                BellGame::Spam => {
                    line.bell.seq.fetch_add(1, Ordering::SeqCst);
                }
                BellGame::Backwards => {
                    line.bell.seq.fetch_sub(1, Ordering::SeqCst);
                }
                BellGame::RandomWithCpu => {
                    tensorwire::os::getrandom(&mut rnd).unwrap();
                    line.bell.seq.store(u32::from_le_bytes(rnd[..4].try_into().unwrap()), Ordering::SeqCst);
                    let c = u32::from_le_bytes(rnd[4..].try_into().unwrap());
                    // Mostly a CPU this machine has (the receiver's own among them), else any word.
                    line.sender_cpu.store(if c % 4 == 0 { c } else { c % (cpus + 1) }, Ordering::Relaxed);
                }
            }
            tensorwire::sync::futex::wake_all(&line.bell.seq);
            moves += 1;
        }
        moves
    })
}

/// A peer that moves its message doorbell without sending anything — as fast as it can,
/// backwards, or to random values with random CPUs — costs a receiver in `recv(1 s)` a
/// small part of one core, not a whole one, and the receive still ends at its deadline.
/// (Before the spin was per wait and the doorbell's false rings were counted, each such
/// receive spun a core for its whole wait and overran it by as long as the game went on.)
/// Bounds, generous against a loaded 2-CPU machine: CPU under 25% of the wall time, the
/// timeout kept within 10% + 100 ms of scheduling slack. A message sent during a game
/// still arrives at once (the fallback wait polls the socket).
#[test]
fn doorbell_games_do_not_burn_the_receivers_cpu_or_stretch_its_wait() {
    const WAIT: Duration = Duration::from_secs(1);
    for game in [BellGame::Spam, BellGame::Backwards, BellGame::RandomWithCpu] {
        let (victim, at) = setup();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let noise = play(game, at.table.table().clone(), stop.clone());
        let mut worst = (Duration::ZERO, Duration::ZERO);
        for _ in 0..2 {
            let (cpu0, t0) = (common::thread_cpu(), std::time::Instant::now());
            let r = victim.recv(WAIT);
            let (wall, cpu) = (t0.elapsed(), common::thread_cpu() - cpu0);
            assert!(matches!(r, Err(Error::Timeout { .. })), "{game:?}: a receive with nothing sent must time out, got {r:?}");
            eprintln!("{game:?}: recv(1 s) took {wall:?} wall, {cpu:?} CPU");
            assert!(cpu * 4 < wall, "{game:?}: the receive used {cpu:?} of CPU in {wall:?} (bound: 25%)");
            assert!(wall < WAIT + WAIT / 10 + Duration::from_millis(100), "{game:?}: recv(1 s) took {wall:?}");
            worst = worst.max((wall, cpu));
        }
        // A real message during the game is taken at once.
        at.conn.send(tensorwire::peer::KIND_USER, b"real", &[]).unwrap();
        let t0 = std::time::Instant::now();
        match victim.recv(WAIT) {
            Ok(tensorwire::Incoming::Message { payload, .. }) => assert_eq!(payload, b"real"),
            other => panic!("{game:?}: a message sent during the game must arrive, got {other:?}"),
        }
        assert!(t0.elapsed() < Duration::from_millis(200), "{game:?}: the message took {:?}", t0.elapsed());
        stop.store(true, Ordering::Relaxed);
        let moves = noise.join().unwrap();
        assert!(moves > 1000, "{game:?}: the game moved the doorbell only {moves} times");
    }
}

impl Attacker {
    /// After the victim refused a message: whether a reaper pass of ours sees exactly one
    /// more lease released by it.
    fn one_given_back(&mut self) -> bool {
        let before = self.table.stats().released;
        let mut owners = tensorwire::lease::Reclaimed::default();
        self.table.reap(std::time::Instant::now(), &mut owners);
        self.table.stats().released == before + 1
    }
}

/// Every refusal of a tensor message whose lease reference can be read gives that lease
/// back — also the refusals that come before the descriptor is decoded or before any
/// import path: a non-zero trailer word, two fds, a descriptor that does not decode (its
/// lease read from the raw bytes), a storage kind that cannot arrive — and those after
/// the lease check (a segment too small). A refused message that names a live lease with
/// another generation releases nothing: the lease an import holds stays live.
#[test]
fn every_refused_tensor_message_gives_its_lease_back() {
    let (victim, mut at) = setup();
    let good = Segment::create(4096).unwrap();
    let good_fd = || good.fd().try_clone_to_owned().unwrap();

    let d = at.desc(f32s(16), 200, 64);
    at.send_in(1, d.encode(), Some(&good_fd()), 0, 7);
    expect_err(&victim, ErrorKind::Protocol, "the 4 bytes after its fd slot must be zero");
    assert!(at.one_given_back(), "a non-zero trailer word kept its lease");
    assert_eq!(victim.refused_tag(), Some(1), "the refused message's tag");
    at.conn.send(99, b"??", &[]).unwrap();
    expect_err(&victim, ErrorKind::Protocol, "unknown message kind 99");
    assert_eq!(victim.refused_tag(), None, "no tensor message was refused");
    let d = at.desc(f32s(16), 200, 64);
    at.send_in(2, d.encode(), None, 0, 7);
    expect_err(&victim, ErrorKind::Protocol, "the 4 bytes after its fd slot must be zero");
    assert!(at.one_given_back());
    at.conn.send(tensorwire::peer::KIND_USER, b"not a tensor", &[]).unwrap();
    let e = victim.recv_tensor(T).err().expect("a user message is not a tensor");
    assert!(matches!(e, Error::Protocol(_)) && e.to_string().contains("expected a tensor"), "{e}");
    assert_eq!(victim.refused_tag(), None, "recv_tensor refused a user message, not a tensor message");

    let d = at.desc(f32s(16), 200, 64);
    let p = tensorwire::peer::tensor_payload(2, &d, 0);
    let (f1, f2) = (good_fd(), good_fd());
    at.conn.send(KIND_TENSOR, &p, &[f1.as_fd(), f2.as_fd()]).unwrap();
    expect_err(&victim, ErrorKind::Protocol, "tensor message has 2 fds, expected at most 1");
    assert!(at.one_given_back(), "a message with two fds kept its lease");

    for (edit, needle) in [
        (Box::new(|d: &mut TensorDesc| d.dtype = 99) as Box<dyn Fn(&mut TensorDesc)>, "unknown dtype code 99"),
        (Box::new(|d: &mut TensorDesc| d.magic = 0), "bad magic"),
        (Box::new(|d: &mut TensorDesc| d.storage.base_offset = u64::MAX), "overflows 64 bits"),
        (Box::new(|d: &mut TensorDesc| d.storage_kind = StorageKind::RingSlot as u8), "cannot arrive as a leased tensor"),
    ] {
        let mut d = at.desc(f32s(16), 200, 64);
        edit(&mut d);
        at.send_raw(3, d.encode(), None);
        expect_err(&victim, ErrorKind::InvalidDescriptor, needle);
        assert!(at.one_given_back(), "a descriptor refused with {needle:?} kept its lease");
    }

    // After the lease check: the segment is too small for the descriptor.
    let d = at.desc(f32s(1024), 201, 4096);
    at.send_raw(4, d.encode(), Some(&sealed(1024, libc::F_SEAL_GROW | libc::F_SEAL_SHRINK)));
    expect_err(&victim, ErrorKind::InvalidDescriptor, "segment too small");
    assert!(at.one_given_back(), "an import refused after the lease check kept its lease");

    // A forged reference: the slot of a lease an import holds, another generation. The
    // table's generation check refuses that release, so the import's lease stays live.
    let d = at.desc(f32s(16), 200, 64);
    at.send_raw(5, d.encode(), Some(&good_fd()));
    let held = victim.recv_tensor(T).unwrap();
    for generation in [held.lease().generation.wrapping_add(1), held.lease().generation.wrapping_sub(1)] {
        let mut forged = d;
        forged.storage.lease_gen = generation;
        forged.dtype = 99;
        at.send_raw(6, forged.encode(), None);
        expect_err(&victim, ErrorKind::InvalidDescriptor, "unknown dtype code 99");
    }
    assert!(!at.one_given_back(), "a forged generation released the lease an import holds");
    held.release().unwrap();
    assert!(at.one_given_back());
    assert_eq!(at.table.stats().granted, at.table.stats().released, "{:?}", at.table.stats());
}

/// A hello whose protocol version is not ours — 0, 1, ours + 1, u32::MAX — is refused at
/// once with both versions named, by a `Peer` being set up (not after its handshake
/// timeout, which an accepted hello would run into here: the raw end sends nothing more).
#[test]
fn a_hello_of_another_protocol_version_is_refused_at_once() {
    use tensorwire::wire::connection::PROTOCOL_VERSION;
    for version in [0, 1, PROTOCOL_VERSION + 1, u32::MAX] {
        let (ours, raw) = tensorwire::os::seqpacket_pair().unwrap();
        let mut hello = b"TWM1".to_vec();
        hello.extend_from_slice(&0u32.to_le_bytes());
        hello.extend_from_slice(b"TWHELLO1");
        hello.extend_from_slice(&version.to_le_bytes());
        hello.extend_from_slice(&65536u32.to_le_bytes());
        tensorwire::os::send_msg(raw.as_fd(), &hello, &[], true, T).unwrap();
        let t = std::time::Instant::now();
        let cfg = PeerConfig { handshake_timeout: Duration::from_secs(5).into(), ..PeerConfig::default() };
        let e = Peer::from_fd(ours, cfg).unwrap_err();
        let want = format!("peer speaks protocol {version}, this build speaks {PROTOCOL_VERSION}");
        assert!(matches!(&e, Error::Protocol(m) if *m == want), "version {version}: expected {want:?}, got {e:?}");
        assert!(t.elapsed() < Duration::from_secs(1), "version {version}: refused only after {:?}", t.elapsed());
        drop(raw);
    }
}
