//! A hostile ring producer (and consumer): raw writes to the ring segment's counters and
//! record headers. The victim reports a clear error naming the violation, never reads
//! outside the mapping, never panics, and never waits past its timeout.

mod common;

use common::*;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tensorwire::lease::Exporter;
use tensorwire::peer::KIND_TABLE;
use tensorwire::ring::spsc::{RecordHeader, RingBroken, FLAG_FIRST, FLAG_LAST, KIND_DATA, KIND_PAD};
use tensorwire::ring::{RingShared, DATA_OFFSET};
use tensorwire::{Connection, Error, Peer, PeerConfig, RingItem, Segment, Wait};

const CAP: u64 = 4096;

struct Attacker {
    _conn: Connection,
    _table: Exporter,
    ring: Arc<Segment>,
    victim_ring: Option<Arc<Segment>>,
}

impl Attacker {
    fn word(seg: &Segment, off: usize) -> &AtomicU64 {
        // SAFETY: off is 8-aligned and inside the ring header page of a live mapping.
        unsafe { &*seg.as_ptr().add(off).cast::<AtomicU64>() }
    }
    fn set_head(&self, v: u64) {
        Self::word(&self.ring, 64).store(v, Ordering::Release);
    }
    fn record(&self, at: u64, h: RecordHeader) {
        self.ring.write_at(DATA_OFFSET + at as usize, &h.encode()).unwrap();
    }
    fn data(k: u32, seq: u64, len: u64) -> RecordHeader {
        RecordHeader { kind: k, flags: FLAG_FIRST | FLAG_LAST, seq, data_len: len, total_len: len, ..Default::default() }
    }
}

/// Victim peer with a ring from the attacker (and one to it).
fn setup(victim_cfg: PeerConfig) -> (Peer, Attacker) {
    let (a, b) = Connection::pair().unwrap();
    let victim = std::thread::spawn(move || Peer::new(a, victim_cfg));
    let table = Exporter::new(16, u64::MAX).unwrap();
    let ring = RingShared::create(CAP as usize).unwrap();
    let setup = tensorwire::peer::setup_payload(16, CAP, false);
    b.send(KIND_TABLE, &setup, &[table.table().fd(), ring.segment().fd()]).unwrap();
    let m = b.recv(T).unwrap();
    let victim_ring = m.fds.into_iter().nth(1).map(|fd| Arc::new(Segment::from_fd(fd, DATA_OFFSET).unwrap()));
    let victim = victim.join().unwrap().unwrap();
    (victim, Attacker { _conn: b, _table: table, ring: ring.segment().clone(), victim_ring })
}

fn w(ms: u64) -> Wait {
    Wait::For(Duration::from_millis(ms))
}

fn expect_broken(victim: &Peer, needle: &str, why: RingBroken) {
    let start = Instant::now();
    let err = victim.ring_recv_with(false, w(500)).unwrap_err();
    assert!(err.to_string().contains(needle), "expected {needle:?} in {err}");
    assert!(matches!(err, Error::RingBroken(w) if w == why), "expected {why:?}, got {err:?}");
    assert!(start.elapsed() < Duration::from_secs(3));
    // Broken for good: the next call fails at once with the same reason.
    let start = Instant::now();
    let again = victim.ring_recv_with(false, w(10_000)).unwrap_err();
    assert!(again.to_string().contains("ring broken"), "{again}");
    assert!(matches!(again, Error::RingBroken(w) if w == why), "expected {why:?} again, got {again:?}");
    assert!(start.elapsed() < Duration::from_secs(1), "a broken ring must fail fast");
}

#[test]
fn adversarial_producer_cases_each_name_the_violation() {
    type Case = (&'static str, RingBroken, Box<dyn Fn(&Attacker)>);
    let cases: Vec<Case> = vec![
        ("outside [0, 4096]", RingBroken::HeadOutOfRange { head: CAP + 64, read: 0, limit: CAP }, Box::new(|a| a.set_head(CAP + 64))),
        ("outside [0, 4096]", RingBroken::HeadOutOfRange { head: u64::MAX, read: 0, limit: CAP }, Box::new(|a| a.set_head(u64::MAX))),
        ("cannot hold a record header", RingBroken::NoRoomForHeader { avail: 32, offset: 0 }, Box::new(|a| a.set_head(32))),
        ("unknown record kind 77", RingBroken::UnknownKind { kind: 77, offset: 0 }, Box::new(|a| {
            a.record(0, Attacker::data(77, 0, 8));
            a.set_head(128);
        })),
        ("over the limits", RingBroken::RecordOverLimits { offset: 0, meta_len: 0, data_len: u64::MAX - 10 }, Box::new(|a| {
            a.record(0, Attacker::data(KIND_DATA, 0, u64::MAX - 10));
            a.set_head(128);
        })),
        ("passes the end of the area or the published head", RingBroken::RecordPastEnd { size: 64 + 1024, offset: 0 }, Box::new(|a| {
            a.record(0, Attacker::data(KIND_DATA, 0, 1000));
            a.set_head(128);
        })),
        ("record sequence 5 where 0 was due", RingBroken::Sequence { got: 5, due: 0 }, Box::new(|a| {
            a.record(0, Attacker::data(KIND_DATA, 5, 8));
            a.set_head(128);
        })),
        ("pad record at offset 0 runs past the published head", RingBroken::PadPastHead { offset: 0 }, Box::new(|a| {
            a.record(0, Attacker::data(KIND_PAD, 0, 0));
            a.set_head(64);
        })),
        ("flags 0x10 unknown", RingBroken::UnknownFlags { flags: 0x10 }, Box::new(|a| {
            let mut h = Attacker::data(KIND_DATA, 0, 8);
            h.flags = 0x10;
            a.record(0, h);
            a.set_head(128);
        })),
        ("continuation chunk arrived with no message started", RingBroken::ContinuationWithoutStart, Box::new(|a| {
            let mut h = Attacker::data(KIND_DATA, 0, 8);
            h.flags = FLAG_LAST;
            a.record(0, h);
            a.set_head(128);
        })),
        ("chunk of 64 bytes for a message of 8", RingBroken::ChunkLargerThanMessage { chunk: 64, total: 8 }, Box::new(|a| {
            let mut h = Attacker::data(KIND_DATA, 0, 64);
            h.total_len = 8;
            a.record(0, h);
            a.set_head(128);
        })),
        ("chunks exceed the announced 100 bytes", RingBroken::ChunksExceedTotal { total: 100 }, Box::new(|a| {
            let mut h = Attacker::data(KIND_DATA, 0, 64);
            h.flags = FLAG_FIRST;
            h.total_len = 100;
            a.record(0, h);
            let mut h2 = Attacker::data(KIND_DATA, 1, 64);
            h2.flags = FLAG_LAST;
            h2.total_len = 0;
            a.record(128, h2);
            a.set_head(256);
        })),
        ("meta of 3 bytes is not a descriptor", RingBroken::MetaNotDescriptor { len: 3 }, Box::new(|a| {
            let mut h = Attacker::data(KIND_DATA, 0, 8);
            h.meta_len = 3;
            a.record(0, h);
            a.set_head(192);
        })),
    ];
    for (needle, why, attack) in cases {
        let (victim, at) = setup(PeerConfig::default());
        attack(&at);
        expect_broken(&victim, needle, why);
    }
    // A message bigger than the victim allows to be reassembled.
    let (victim, at) = setup(PeerConfig { max_ring_message: 1000, ..PeerConfig::default() });
    let mut h = Attacker::data(KIND_DATA, 0, 64);
    h.flags = FLAG_FIRST;
    h.total_len = 1 << 40;
    at.record(0, h);
    at.set_head(128);
    let err = victim.ring_recv_with(false, w(500)).unwrap_err();
    assert!(matches!(err, Error::QuotaExceeded(_)) && err.to_string().contains("exceeds the 1000-byte limit"), "{err}");
}

#[test]
fn hostile_consumer_scribbling_tail_breaks_the_sender_cleanly() {
    let (victim, at) = setup(PeerConfig { ring_bytes: 4096, ..PeerConfig::default() });
    let theirs = at.victim_ring.as_ref().expect("victim sends a ring");
    victim.ring_send(&[RingItem::bytes(1, b"hello")], T).unwrap();
    Attacker::word(theirs, 128).store(1 << 50, Ordering::Release); // tail past head
    // The producer trusts the tail it last saw while that leaves room; the scribbled one
    // is read (and refused) as soon as the ring needs the consumer's space.
    let blob = vec![0u8; 1000];
    let err = (2..20u64)
        .find_map(|i| victim.ring_send(&[RingItem::bytes(i, &blob)], Duration::from_millis(200)).err())
        .expect("a 4 KiB ring cannot take 18 KB without reading the tail");
    assert!(err.to_string().contains("consumer tail 1125899906842624 outside [0, "), "{err}");
    let Error::RingBroken(why @ RingBroken::TailOutOfRange { tail: 1125899906842624, .. }) = err else {
        panic!("expected a scribbled tail, got {err:?}")
    };
    let err = victim.ring_send(&[RingItem::bytes(3, b"x")], T).unwrap_err();
    assert!(err.to_string().contains("ring broken"), "{err}");
    assert!(matches!(err, Error::RingBroken(w) if w == why), "the same reason again, got {err:?}");
}

#[test]
#[ignore = "child-process entry point; random_scribbling_never_crashes_or_hangs runs it"]
fn child_entry() {
    let Ok(role) = std::env::var(ROLE_ENV) else { return };
    assert_eq!(role, "scribbler");
    let fd: i32 = std::env::var(FD_ENV).unwrap().parse().unwrap();
    // SAFETY: the inherited fd number the parent gave us.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let conn = Connection::establish(fd, Duration::from_secs(10)).unwrap();
    let table = Exporter::new(16, u64::MAX).unwrap();
    let ring = RingShared::create(CAP as usize).unwrap();
    let setup = tensorwire::peer::setup_payload(16, CAP, false);
    conn.send(KIND_TABLE, &setup, &[table.table().fd(), ring.segment().fd()]).unwrap();
    let _ = conn.recv(T).unwrap();
    let seg = ring.segment();
    let mut rnd = vec![0u8; 4096 + 64];
    let start = Instant::now();
    let mut round = 0u64;
    while start.elapsed() < Duration::from_millis(1500) {
        tensorwire::sys::getrandom(&mut rnd).unwrap();
        let r = |i: usize| u64::from_le_bytes(rnd[i * 8..i * 8 + 8].try_into().unwrap());
        // Plausible-looking records half the time, raw noise the other half.
        if round % 2 == 0 {
            let h = RecordHeader {
                kind: (r(0) % 3) as u32,
                flags: (r(1) % 4) as u32,
                seq: r(2) % 4,
                meta_len: (r(3) % 500) as u32,
                data_len: r(4) % 3000,
                total_len: r(5) % 5000,
                tag: r(6),
            };
            seg.write_at(DATA_OFFSET + (r(7) % 64 * 64) as usize, &h.encode()).unwrap();
        } else {
            seg.write_at(DATA_OFFSET, &rnd[..4096]).unwrap();
        }
        let head = match round % 4 {
            0 => r(8) % (2 * CAP),
            1 => r(8),
            _ => (r(8) % 64) * 64,
        };
        Attacker::word(seg, 64).store(head, Ordering::Release);
        // Ring the data doorbell so the victim wakes (bump its sequence word).
        // SAFETY: offset 72 is the data doorbell's sequence word, 4-aligned, in the page.
        unsafe { &*seg.as_ptr().add(72).cast::<std::sync::atomic::AtomicU32>() }.fetch_add(1, Ordering::SeqCst);
        round += 1;
        std::thread::sleep(Duration::from_micros(200));
    }
    let _ = conn.send(9, b"done", &[]);
}

#[test]
fn random_scribbling_never_crashes_or_hangs() {
    // The child is a raw-protocol process, not a Peer: spawn it by hand.
    let (mine, theirs) = tensorwire::sys::seqpacket_pair().unwrap();
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    let fd = tensorwire::sys::inherit_in_child(&mut cmd, theirs.as_fd());
    let mut child = cmd
        .args(["child_entry", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, "scribbler")
        .env(FD_ENV, fd.to_string())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    drop(theirs);
    // Fresh victims until the child is done: each gets scribbled into brokenness.
    let victim = Peer::from_fd(mine, PeerConfig::default()).unwrap();
    let (mut ok, mut errs) = (0, 0);
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(1300) {
        let t0 = Instant::now();
        match victim.ring_recv_with(false, w(20)) {
            Ok(m) => {
                ok += 1;
                let _ = m.into_vec();
            }
            Err(Error::Timeout { .. }) => {}
            Err(e) => {
                errs += 1;
                assert!(!e.is_peer_gone(), "{e}");
            }
        }
        assert!(t0.elapsed() < Duration::from_millis(500), "a 20 ms wait took {:?}", t0.elapsed());
    }
    assert!(errs > 0, "scribbling went unnoticed ({ok} messages accepted)");
    child.wait().unwrap();
}
