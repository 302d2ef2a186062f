//! loom model of the ring's SPSC record protocol (`src/ring/spsc.rs`): records published
//! by their stamps over several laps, a wrap behind a PAD record, release, and sleeping
//! on both doorbells. The data area is loom `UnsafeCell`s, so loom also reports any read
//! of a record that is not ordered after its write (a torn or early read), besides lost
//! wake-ups (deadlock) and wrong contents; a stale stamp of an earlier lap taken for the
//! awaited one shows as wrong contents or a sequence error.
//!
//! Both sides wait as `src/waiting/waiter.rs` does with no spin budget (the path where a
//! wake-up can be lost), through the same `Doorbell::sleep_unless`: read the doorbell's
//! sequence, look (the consumer at the next record's stamp through a detached `Watch`, as
//! the receiver polls it without its lock; the producer at the consumer's tail), then
//! sleep on that sequence.
//!
//! Run: RUSTFLAGS="--cfg loom" cargo test --release -p tensorwire-loom --test loom_ring --target-dir target-loom
//!
//! Seen to fail when the protocol is weakened: the stamp's Release store (`put_header`)
//! made Relaxed, or the consumer's Acquire load of it (`stamped`) made Relaxed, each
//! reports a causality violation on the record's cells (the consumer reads bytes not
//! ordered after their write); `publish` not ringing, or `sleep_unless` looking before
//! it reads the sequence, deadlocks (a lost wake-up).
#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use tensorwire::doorbell::{Doorbell, DoorbellWords};
use tensorwire::ring::spsc::{Consumer, Ctrl, Producer, Region, FLAG_FIRST, FLAG_LAST};
use tensorwire::sync::{AtomicU32, AtomicU64};

/// Bytes of the modelled data area.
const CAP: usize = 256;
/// Any salt with its top bit set, as `RingShared::create` makes them.
const SALT: u64 = 0x8000_0000_5a17_0001;

struct Shared {
    tail: AtomicU64,
    data_bell: DoorbellWords,
    space_bell: DoorbellWords,
    /// The payload bytes: every access checked by loom.
    cells: Vec<UnsafeCell<u8>>,
    /// The stamp word of each 64-byte line (the same memory as the line's last 8 bytes
    /// in a mapped ring; separate here, as loom atomics cannot alias cells).
    stamps: Vec<AtomicU64>,
}

fn bell() -> DoorbellWords {
    DoorbellWords { seq: AtomicU32::new(0), waiters: AtomicU32::new(0) }
}

#[derive(Clone)]
struct Cells(Arc<Shared>);

impl Region for Cells {
    fn capacity(&self) -> u64 {
        self.0.cells.len() as u64
    }
    unsafe fn write_with(&self, at: u64, len: usize, fill: &mut dyn FnMut(&mut [u8])) {
        let mut buf = vec![0u8; len];
        fill(&mut buf);
        for (i, b) in buf.iter().enumerate() {
            // SAFETY: loom checks that no access to this cell races with this write.
            self.0.cells[at as usize + i].with_mut(|p| unsafe { *p = *b });
        }
    }
    unsafe fn read(&self, at: u64, dst: &mut [u8]) {
        for (i, d) in dst.iter_mut().enumerate() {
            // SAFETY: loom checks that this read is ordered after the cell's last write.
            *d = self.0.cells[at as usize + i].with(|p| unsafe { *p });
        }
    }
    unsafe fn stamp(&self, at: u64) -> &AtomicU64 {
        &self.0.stamps[at as usize / 64]
    }
}

fn ctrl(s: &Shared) -> Ctrl<'_> {
    Ctrl { tail: &s.tail, data_bell: Doorbell::new(&s.data_bell), space_bell: Doorbell::new(&s.space_bell), salt: SALT }
}

fn byte(msg: usize, k: usize) -> u8 {
    (msg * 31 + k) as u8 | 1
}

/// A producer thread sending one record per length (one publish each), and this thread
/// receiving them, both waiting as the ring halves do with no spin budget.
fn run(lens: &'static [u64]) {
    let shared = Arc::new(Shared {
        tail: AtomicU64::new(0),
        data_bell: bell(),
        space_bell: bell(),
        cells: (0..CAP).map(|_| UnsafeCell::new(0)).collect(),
        stamps: (0..CAP / 64).map(|_| AtomicU64::new(0)).collect(),
    });
    let s2 = shared.clone();
    let producer = loom::thread::spawn(move || {
        let mut p = Producer::new(ctrl(&s2), Cells(s2.clone()));
        for (m, &len) in lens.iter().enumerate() {
            let mut fill = |dst: &mut [u8]| {
                for (k, d) in dst.iter_mut().enumerate() {
                    *d = byte(m, k);
                }
            };
            // As `RingSender::push_all`: when full, ring for what is there, then wait
            // for the tail to move (sequence, look, sleep).
            while !p.try_push(FLAG_FIRST | FLAG_LAST, m as u64, len, &[], len, &mut fill).unwrap() {
                p.publish();
                ctrl(&s2).space_bell.sleep_unless(&|| p.tail_moved(), None);
            }
            p.publish();
        }
    });
    let mut c = Consumer::new(ctrl(&shared), Cells(shared.clone()));
    for (m, &len) in lens.iter().enumerate() {
        let rec = loop {
            if let Some(r) = c.try_pop().unwrap() {
                break r;
            }
            let watch = c.watch();
            ctrl(&shared).data_bell.sleep_unless(&|| watch.ready(), None);
        };
        assert_eq!((rec.header.tag, rec.header.data_len), (m as u64, len));
        let mut got = vec![0u8; len as usize];
        c.read_data(&rec, 0, &mut got);
        assert!(got.iter().enumerate().all(|(k, b)| *b == byte(m, k)), "message {m} torn: {got:?}");
        c.release_to(rec.end);
    }
    producer.join().unwrap();
}

fn check(bound: usize, f: fn()) {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(bound);
    }
    b.check(f);
}

/// Records of 64, 128 and 128 bytes in a 256-byte area: the third waits for space, then
/// wraps behind a PAD record.
#[test]
fn ring_publish_consume_wrap_and_wake() {
    check(2, || run(&[0, 64, 64]));
}

/// Three laps: 64 @0, 128 @64, PAD @192 and 128 @256, 128 @384, 64 @512. The consumer
/// waits at offset 0 while it still holds the stamp of lap 2 (position 256), at offset
/// 128 where lap 1 left data bytes, and the producer reuses every line the consumer read.
#[test]
fn ring_stamps_over_three_laps() {
    check(2, || run(&[0, 64, 64, 64, 0]));
}
