//! loom model of the ring's SPSC record protocol (`src/ring/spsc.rs`): publish, consume,
//! wrap with a PAD record, release, and sleeping on both doorbells. The data area is loom
//! `UnsafeCell`s, so loom also reports any read of a record that is not ordered after its
//! write (a torn or early read), besides lost wake-ups (deadlock) and wrong contents.
//!
//! Run: RUSTFLAGS="--cfg loom" cargo test --release --test loom_ring --target-dir target-loom
#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use tensorwire::doorbell::{Doorbell, DoorbellWords};
use tensorwire::ring::spsc::{Consumer, Ctrl, Producer, Region, FLAG_FIRST, FLAG_LAST};
use tensorwire::sync::{AtomicU32, AtomicU64};

struct Shared {
    head: AtomicU64,
    tail: AtomicU64,
    data_bell: DoorbellWords,
    space_bell: DoorbellWords,
    cells: Vec<UnsafeCell<u8>>,
}

fn bell() -> DoorbellWords {
    DoorbellWords { seq: AtomicU32::new(0), waiters: AtomicU32::new(0) }
}

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
}

fn ctrl(s: &Shared) -> Ctrl<'_> {
    Ctrl { head: &s.head, tail: &s.tail, data_bell: Doorbell::new(&s.data_bell), space_bell: Doorbell::new(&s.space_bell) }
}

/// Message lengths: records of 64, 128 and 128 bytes in a 256-byte area, so the third
/// must wait for space and then wrap behind a PAD record.
const LENS: [u64; 3] = [0, 64, 64];

fn byte(msg: usize, k: usize) -> u8 {
    (msg * 31 + k) as u8 | 1
}

#[test]
fn ring_publish_consume_wrap_and_wake() {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(2);
    b.check(|| {
        let shared = Arc::new(Shared {
            head: AtomicU64::new(0),
            tail: AtomicU64::new(0),
            data_bell: bell(),
            space_bell: bell(),
            cells: (0..256).map(|_| UnsafeCell::new(0)).collect(),
        });
        let s2 = shared.clone();
        let producer = loom::thread::spawn(move || {
            let mut p = Producer::new(ctrl(&s2), Cells(s2.clone()));
            for (m, &len) in LENS.iter().enumerate() {
                let mut fill = |dst: &mut [u8]| {
                    for (k, d) in dst.iter_mut().enumerate() {
                        *d = byte(m, k);
                    }
                };
                // As `RingSender::send_many`: try first; only when short of space read the
                // space doorbell, try again, then wait for it to change.
                loop {
                    if p.try_push(FLAG_FIRST | FLAG_LAST, m as u64, len, &[], len, &mut fill).unwrap() {
                        break;
                    }
                    p.publish();
                    let seen = ctrl(&s2).space_bell.current();
                    if p.try_push(FLAG_FIRST | FLAG_LAST, m as u64, len, &[], len, &mut fill).unwrap() {
                        break;
                    }
                    ctrl(&s2).space_bell.wait(seen, 0, None);
                }
                p.publish();
            }
        });
        let mut c = Consumer::new(ctrl(&shared), Cells(shared.clone()));
        for (m, &len) in LENS.iter().enumerate() {
            let rec = loop {
                let seen = ctrl(&shared).data_bell.current();
                if let Some(r) = c.try_pop().unwrap() {
                    break r;
                }
                ctrl(&shared).data_bell.wait(seen, 0, None);
            };
            assert_eq!((rec.header.tag, rec.header.data_len), (m as u64, len));
            let mut got = vec![0u8; len as usize];
            c.read_data(&rec, 0, &mut got);
            assert!(got.iter().enumerate().all(|(k, b)| *b == byte(m, k)), "message {m} torn: {got:?}");
            c.release_to(rec.end);
        }
        producer.join().unwrap();
    });
}
