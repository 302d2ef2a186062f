//! A hostile ring producer (and consumer): raw writes to the ring segment's counters and
//! record headers. The victim reports a clear error naming the violation, never reads
//! outside the mapping, never panics, and never waits past its timeout.

mod common;

use common::*;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tensorwire::lease::Exporter;
use tensorwire::peer::KIND_TABLE;
use tensorwire::ring::spsc::{stamp, RecordHeader, RingBroken, FLAG_FIRST, FLAG_LAST, KIND_DATA, KIND_PAD, STAMP_AT};
use tensorwire::ring::{RingShared, DATA_OFFSET};
use tensorwire::{Connection, Error, Peer, PeerConfig, RingItem, Segment, Wait};

const CAP: u64 = 4096;
/// Offsets in the ring segment (`src/ring/shared.rs`): the stamp salt in the header, the
/// data doorbell's sequence word, the consumer's tail.
const OFF_SALT: usize = 24;
const OFF_DATA_BELL: usize = 64;
const OFF_TAIL: usize = 128;

struct Attacker {
    _conn: Connection,
    _table: Exporter,
    ring: Arc<Segment>,
    salt: u64,
    victim_ring: Option<Arc<Segment>>,
}

impl Attacker {
    fn word(seg: &Segment, off: usize) -> &AtomicU64 {
        // SAFETY: off is 8-aligned and inside a live mapping of the ring segment.
        unsafe { &*seg.as_ptr().add(off).cast::<AtomicU64>() }
    }
    /// Write `h`'s fields as the record at ring position `pos`, then its stamp: what an
    /// honest producer does, with whatever fields the test chooses.
    fn publish(&self, pos: u64, h: RecordHeader) {
        self.record(pos % CAP, h);
        self.set_stamp(pos % CAP, stamp(self.salt, pos));
    }
    /// The header fields alone, at an offset.
    fn record(&self, at: u64, h: RecordHeader) {
        self.ring.write_at(DATA_OFFSET + at as usize, &h.encode()).unwrap();
    }
    /// The stamp word of the header line at offset `at`.
    fn set_stamp(&self, at: u64, v: u64) {
        Self::word(&self.ring, DATA_OFFSET + (at + STAMP_AT) as usize).store(v, Ordering::Release);
        self.ring_bell();
    }
    /// Bump the data doorbell, so a sleeping victim looks again.
    fn ring_bell(&self) {
        // SAFETY: the data doorbell's sequence word: 4-aligned, in the header page.
        unsafe { &*self.ring.as_ptr().add(OFF_DATA_BELL).cast::<std::sync::atomic::AtomicU32>() }.fetch_add(1, Ordering::SeqCst);
    }
    fn data(k: u32, seq: u64, len: u64) -> RecordHeader {
        RecordHeader { kind: k, flags: FLAG_FIRST | FLAG_LAST, seq, data_len: len, total_len: len, ..Default::default() }
    }
}

/// Victim peer with a ring from the attacker (and one to it); the attacker's ring may be
/// doctored before the victim sees it.
fn setup_with(victim_cfg: PeerConfig, doctor: impl FnOnce(&Segment)) -> (Result<Peer, Error>, Attacker) {
    let (a, b) = Connection::pair().unwrap();
    let table = Exporter::new(16, u64::MAX).unwrap();
    let ring = RingShared::create(CAP as usize).unwrap();
    doctor(ring.segment());
    let victim = std::thread::spawn(move || Peer::new(a, victim_cfg));
    let setup = tensorwire::peer::setup_payload(16, CAP, 0);
    b.send(KIND_TABLE, &setup, &[table.table().fd(), ring.segment().fd()]).unwrap();
    let victim_ring = b.recv(T).ok().and_then(|m| m.fds.into_iter().nth(1)).map(|fd| Arc::new(Segment::from_fd(fd, DATA_OFFSET).unwrap()));
    let victim = victim.join().unwrap();
    (victim, Attacker { _conn: b, _table: table, ring: ring.segment().clone(), salt: ring.salt(), victim_ring })
}

fn setup(victim_cfg: PeerConfig) -> (Peer, Attacker) {
    let (victim, at) = setup_with(victim_cfg, |_| {});
    (victim.unwrap(), at)
}

fn w(ms: u64) -> Wait {
    Wait::For(Duration::from_millis(ms))
}

fn expect_broken(victim: &Peer, needle: &str, why: RingBroken) {
    let start = Instant::now();
    let err = victim.ring_recv_with(false, w(500)).unwrap_err();
    assert!(matches!(err, Error::RingBroken(_)) && err.to_string().contains(needle), "expected {needle:?} in {err}");
    assert!(matches!(err, Error::RingBroken(w) if w == why), "expected {why:?}, got {err:?}");
    assert!(start.elapsed() < Duration::from_secs(3));
    // Broken for good: the next call fails at once with the same reason.
    let start = Instant::now();
    let again = victim.ring_recv_with(false, w(10_000)).unwrap_err();
    assert!(matches!(again, Error::RingBroken(_)) && again.to_string().contains("ring broken"), "{again}");
    assert!(matches!(again, Error::RingBroken(w) if w == why), "expected {why:?} again, got {again:?}");
    assert!(start.elapsed() < Duration::from_secs(1), "a broken ring must fail fast");
}

/// Nothing is taken: the receive times out.
fn expect_nothing(victim: &Peer, what: &str) {
    match victim.ring_recv_with(false, w(100)) {
        Err(Error::Timeout { .. }) => {}
        other => panic!("{what}: expected nothing to be taken, got {other:?}"),
    }
}

#[test]
fn adversarial_producer_cases_each_name_the_violation() {
    // Every record here carries the right stamp: the header is what lies.
    type Case = (&'static str, RingBroken, Box<dyn Fn(&Attacker)>);
    let cases: Vec<Case> = vec![
        ("unknown record kind 77", RingBroken::UnknownKind { kind: 77, offset: 0 }, Box::new(|a| a.publish(0, Attacker::data(77, 0, 8)))),
        ("over the limits", RingBroken::RecordOverLimits { offset: 0, meta_len: 0, data_len: u64::MAX - 10 }, Box::new(|a| {
            a.publish(0, Attacker::data(KIND_DATA, 0, u64::MAX - 10))
        })),
        ("over the limits", RingBroken::RecordOverLimits { offset: 0, meta_len: 1088, data_len: 0 }, Box::new(|a| {
            let mut h = Attacker::data(KIND_DATA, 0, 0);
            h.meta_len = 1088;
            a.publish(0, h)
        })),
        ("record sequence 5 where 0 was due", RingBroken::Sequence { got: 5, due: 0 }, Box::new(|a| a.publish(0, Attacker::data(KIND_DATA, 5, 8)))),
        ("flags 0x10 unknown", RingBroken::UnknownFlags { flags: 0x10 }, Box::new(|a| {
            let mut h = Attacker::data(KIND_DATA, 0, 8);
            h.flags = 0x10;
            a.publish(0, h);
        })),
        ("continuation chunk arrived with no message started", RingBroken::ContinuationWithoutStart, Box::new(|a| {
            let mut h = Attacker::data(KIND_DATA, 0, 8);
            h.flags = FLAG_LAST;
            a.publish(0, h);
        })),
        ("chunk of 64 bytes for a message of 8", RingBroken::ChunkLargerThanMessage { chunk: 64, total: 8 }, Box::new(|a| {
            let mut h = Attacker::data(KIND_DATA, 0, 64);
            h.total_len = 8;
            a.publish(0, h);
        })),
        ("chunks exceed the announced 100 bytes", RingBroken::ChunksExceedTotal { total: 100 }, Box::new(|a| {
            let mut h = Attacker::data(KIND_DATA, 0, 64);
            h.flags = FLAG_FIRST;
            h.total_len = 100;
            a.publish(0, h);
            let mut h2 = Attacker::data(KIND_DATA, 1, 64);
            h2.flags = FLAG_LAST;
            h2.total_len = 0;
            a.publish(128, h2);
        })),
        ("meta of 3 bytes is not a descriptor", RingBroken::MetaNotDescriptor { len: 3 }, Box::new(|a| {
            let mut h = Attacker::data(KIND_DATA, 0, 8);
            h.meta_len = 3;
            a.publish(0, h);
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
    at.publish(0, h);
    let err = victim.ring_recv_with(false, w(500)).unwrap_err();
    assert!(matches!(err, Error::QuotaExceeded(_)) && err.to_string().contains("exceeds the 1000-byte limit"), "{err}");
}

#[test]
fn records_past_the_end_or_over_held_bytes_are_refused() {
    // Two honest records (2048 + 1024 bytes) bring the read position to offset 3072; a
    // record of 1088 bytes there would run past the end of the area.
    let (victim, at) = setup(PeerConfig::default());
    at.publish(0, Attacker::data(KIND_DATA, 0, 2048 - 64));
    at.publish(2048, Attacker::data(KIND_DATA, 1, 1024 - 64));
    at.publish(3072, Attacker::data(KIND_DATA, 2, 1000));
    assert_eq!(victim.ring_recv_with(false, w(500)).unwrap().len(), 2048 - 64);
    assert_eq!(victim.ring_recv_with(false, w(500)).unwrap().len(), 1024 - 64);
    expect_broken(&victim, "passes the end of the area", RingBroken::RecordPastEnd { size: 1088, offset: 3072 });

    // The victim holds (borrows) the record at 0; a PAD at 128 covers the rest of the lap,
    // and a PAD at 4096 (offset 0 again, written once the victim has the record there)
    // would cover the bytes it holds.
    let (victim, at) = setup(PeerConfig::default());
    at.publish(0, Attacker::data(KIND_DATA, 0, 8));
    at.publish(128, RecordHeader { kind: KIND_PAD, ..Default::default() });
    let held = victim.ring_recv_with(true, w(500)).unwrap();
    assert!(held.is_borrowed());
    at.publish(CAP, RecordHeader { kind: KIND_PAD, ..Default::default() });
    expect_broken(&victim, "pad record at offset 0 covers bytes the consumer still holds", RingBroken::PadOverHeld { offset: 0 });
    drop(held);

    // The same with a DATA record at 4096 whose 128 bytes reach the held ones.
    let (victim, at) = setup(PeerConfig::default());
    at.publish(0, Attacker::data(KIND_DATA, 0, 8));
    at.publish(128, RecordHeader { kind: KIND_PAD, ..Default::default() });
    let held = victim.ring_recv_with(true, w(500)).unwrap();
    at.publish(CAP, Attacker::data(KIND_DATA, 1, 8));
    expect_broken(&victim, "reaches bytes the consumer still holds", RingBroken::RecordPastEnd { size: 128, offset: 0 });
    drop(held);
}

#[test]
fn stamps_that_do_not_match_are_never_taken() {
    // A well-formed record whose stamp names another position (the next record's, or
    // this offset's next lap) is not published: the victim waits, then takes it once the
    // stamp is right.
    for wrong in [64, CAP, 3 * CAP] {
        let (victim, at) = setup(PeerConfig::default());
        at.record(0, Attacker::data(KIND_DATA, 0, 5));
        at.ring.write_at(DATA_OFFSET + 64, b"hello").unwrap();
        at.set_stamp(0, stamp(at.salt, wrong));
        expect_nothing(&victim, &format!("a stamp for position {wrong} at position 0"));
        at.set_stamp(0, stamp(at.salt, 0));
        assert_eq!(victim.ring_recv_with(false, w(500)).unwrap().into_vec(), b"hello");
    }
    // A stale record: after a lap (a record, then a PAD to the end), offset 0 still holds
    // the first record, stamp and all (sequence 0, as due when it was written). It is not
    // taken again; the record of the new lap is.
    let (victim, at) = setup(PeerConfig::default());
    at.ring.write_at(DATA_OFFSET + 64, b"first").unwrap();
    at.publish(0, Attacker::data(KIND_DATA, 0, 5));
    at.publish(128, RecordHeader { kind: KIND_PAD, ..Default::default() });
    assert_eq!(victim.ring_recv_with(false, w(500)).unwrap().into_vec(), b"first");
    expect_nothing(&victim, "the stamp of the last lap");
    at.ring.write_at(DATA_OFFSET + 64, b"again").unwrap();
    at.publish(CAP, Attacker::data(KIND_DATA, 1, 5));
    assert_eq!(victim.ring_recv_with(false, w(500)).unwrap().into_vec(), b"again");
    // A stamp of zero on a fresh (zeroed) ring matches no position.
    let (victim, at) = setup(PeerConfig::default());
    at.record(0, Attacker::data(KIND_DATA, 0, 0));
    at.set_stamp(0, 0);
    expect_nothing(&victim, "a zero stamp");
}

#[test]
fn a_ring_whose_salt_lacks_its_top_bit_is_refused() {
    let (victim, _at) = setup_with(PeerConfig::default(), |seg| seg.write_at(OFF_SALT, &5u64.to_le_bytes()).unwrap());
    let err = victim.expect_err("a salt of 5 must be refused");
    assert!(matches!(err, Error::Protocol(_)) && err.to_string().contains("stamp salt 0x5 lacks its top bit"), "{err}");
}

#[test]
fn hostile_consumer_scribbling_tail_breaks_the_sender_cleanly() {
    let (victim, at) = setup(PeerConfig { ring_bytes: 4096, ..PeerConfig::default() });
    let theirs = at.victim_ring.as_ref().expect("victim sends a ring");
    victim.ring_send(&[RingItem::bytes(1, b"hello")], T).unwrap();
    Attacker::word(theirs, OFF_TAIL).store(1 << 50, Ordering::Release); // tail past head
    // The producer trusts the tail it last saw while that leaves room; the scribbled one
    // is read (and refused) as soon as the ring needs the consumer's space.
    let blob = vec![0u8; 1000];
    let err = (2..20u64)
        .find_map(|i| victim.ring_send(&[RingItem::bytes(i, &blob)], Duration::from_millis(200)).err())
        .expect("a 4 KiB ring cannot take 18 KB without reading the tail");
    assert!(matches!(err, Error::RingBroken(_)) && err.to_string().contains("consumer tail 1125899906842624 outside [0, "), "{err}");
    let Error::RingBroken(why @ RingBroken::TailOutOfRange { tail: 1125899906842624, .. }) = err else {
        panic!("expected a scribbled tail, got {err:?}")
    };
    let err = victim.ring_send(&[RingItem::bytes(3, b"x")], T).unwrap_err();
    assert!(matches!(err, Error::RingBroken(_)) && err.to_string().contains("ring broken"), "{err}");
    assert!(matches!(err, Error::RingBroken(w) if w == why), "the same reason again, got {err:?}");
}

#[test]
#[ignore = "child-process entry point; random_scribbling_never_crashes_or_hangs runs it"]
fn child_entry() {
    let Some((role, fd)) = child_socket() else { return };
    assert_eq!(role, "scribbler");
    let conn = Connection::establish(fd, Duration::from_secs(10)).unwrap();
    let table = Exporter::new(16, u64::MAX).unwrap();
    let ring = RingShared::create(CAP as usize).unwrap();
    let setup = tensorwire::peer::setup_payload(16, CAP, 0);
    conn.send(KIND_TABLE, &setup, &[table.table().fd(), ring.segment().fd()]).unwrap();
    let _ = conn.recv(T).unwrap();
    let seg = ring.segment();
    let mut rnd = vec![0u8; 4096 + 64];
    let start = Instant::now();
    let mut round = 0u64;
    while start.elapsed() < Duration::from_millis(1500) {
        tensorwire::os::getrandom(&mut rnd).unwrap();
        let r = |i: usize| u64::from_le_bytes(rnd[i * 8..i * 8 + 8].try_into().unwrap());
        // Plausible-looking records with the stamp of their offset in this lap or the next
        // (every 8th at offset 0, where a fresh victim reads first) half the time, raw noise
        // (stamp words included) the other half.
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
            let at = if round % 8 == 0 { 0 } else { r(7) % 64 * 64 };
            seg.write_at(DATA_OFFSET + at as usize, &h.encode()).unwrap();
            let pos = at + r(8) % 2 * CAP;
            Attacker::word(seg, DATA_OFFSET + (at + STAMP_AT) as usize).store(stamp(ring.salt(), pos), Ordering::Release);
        } else {
            seg.write_at(DATA_OFFSET, &rnd[..4096]).unwrap();
        }
        // Ring the data doorbell so the victim wakes (bump its sequence word).
        // SAFETY: the data doorbell's sequence word: 4-aligned, in the header page.
        unsafe { &*seg.as_ptr().add(OFF_DATA_BELL).cast::<std::sync::atomic::AtomicU32>() }.fetch_add(1, Ordering::SeqCst);
        // A plausible record where a fresh victim reads first stays for 2 ms: a receiver
        // whose doorbell keeps moving for nothing looks in 1 ms slices (`FALSE_RINGS`), and
        // must get to see it.
        let held = round % 8 == 0;
        round += 1;
        std::thread::sleep(if held { Duration::from_millis(2) } else { Duration::from_micros(200) });
    }
    let _ = conn.send(9, b"done", &[]);
}

/// Held by the tests that load the CPU (a doorbell spammed from a spinning thread) or
/// need it (a scribbled record is valid for about a quarter of a millisecond at a time):
/// run in parallel on two cores, the first starves the second's victim of its looks.
static CPU_HEAVY: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn random_scribbling_never_crashes_or_hangs() {
    let _one_at_a_time = CPU_HEAVY.lock().unwrap_or_else(|e| e.into_inner());
    // The child is a raw-protocol process, not a Peer.
    let (mut child, mine) = spawn_raw("scribbler");
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

/// A producer that moves the ring's data doorbell without publishing anything (as fast
/// as it can, waking sleepers each time) costs a receiver in `ring_recv(1 s)` a small part
/// of a core, and the receive ends at its deadline; a record published during the game
/// is still taken within milliseconds. Bounds as in `tests/hostile.rs`'s message-line
/// games: CPU under 25% of the wall time, the timeout kept within 10% + 100 ms.
#[test]
fn a_data_doorbell_that_moves_for_nothing_costs_little_cpu_and_no_deadline() {
    let _one_at_a_time = CPU_HEAVY.lock().unwrap_or_else(|e| e.into_inner());
    let (victim, at) = setup(PeerConfig::default());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let ring = at.ring.clone();
    let noise = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            // SAFETY: the data doorbell's sequence word: 4-aligned, in the header page of
            // a mapping the Arc keeps alive.
            let seq = unsafe { &*ring.as_ptr().add(OFF_DATA_BELL).cast::<std::sync::atomic::AtomicU32>() };
            let mut moves = 0u64;
            while !stop.load(Ordering::Relaxed) {
                seq.fetch_add(1, Ordering::SeqCst);
                tensorwire::sync::futex::wake_all(seq);
                moves += 1;
            }
            moves
        })
    };
    const WAIT: Duration = Duration::from_secs(1);
    for _ in 0..2 {
        let (cpu0, t0) = (thread_cpu(), Instant::now());
        let r = victim.ring_recv_with(false, WAIT);
        let (wall, cpu) = (t0.elapsed(), thread_cpu() - cpu0);
        assert!(matches!(r, Err(Error::Timeout { .. })), "nothing was published, got {r:?}");
        eprintln!("ring_recv(1 s) under doorbell spam: {wall:?} wall, {cpu:?} CPU");
        assert!(cpu * 4 < wall, "the receive used {cpu:?} of CPU in {wall:?} (bound: 25%)");
        assert!(wall < WAIT + WAIT / 10 + Duration::from_millis(100), "ring_recv(1 s) took {wall:?}");
    }
    std::thread::scope(|s| {
        let victim = &victim;
        let got = s.spawn(move || (victim.ring_recv_with(false, WAIT).map(|m| m.into_vec()), Instant::now()));
        std::thread::sleep(Duration::from_millis(100));
        at.ring.write_at(DATA_OFFSET + 64, b"real").unwrap();
        at.publish(0, Attacker::data(KIND_DATA, 0, 4));
        let sent = Instant::now();
        let (got, at_) = got.join().unwrap();
        assert_eq!(got.unwrap(), b"real");
        let late = at_.saturating_duration_since(sent);
        assert!(late < Duration::from_millis(100), "a record published during the game took {late:?} to be taken");
    });
    stop.store(true, Ordering::Relaxed);
    assert!(noise.join().unwrap() > 1000, "the game must have moved the doorbell");
}
