//! Sequences of ring operations — push, publish, pop, release — and a hostile peer's
//! writes (scribbled bytes, headers with any fields and any stamp, a scribbled tail),
//! against a `VecDeque` model.
//!
//! While nothing was corrupted, the consumer must deliver exactly the pushed messages (a
//! record is visible once pushed: its stamp publishes it) in order, with their meta and
//! data, say `ready` exactly when one is waiting, and never fail; over many laps, so a
//! stale stamp taken for a new one shows as a wrong message. After a corruption (a
//! hostile peer), anything but a panic, an endless loop or an out-of-bounds access (ASan)
//! is allowed: errors, or garbage that passed validation.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use tensorwire::doorbell::{Doorbell, DoorbellWords};
use tensorwire::ring::spsc::{stamp, Consumer, Ctrl, Producer, RecordHeader, Region, FLAG_FIRST, FLAG_LAST, STAMP_AT};

const CAP: usize = 1024;
const SALT: u64 = 0x8000_0000_0000_0000 | 0x1234_5678_9abc_def0;

/// The data area, aligned as a mapped ring's (its stamp words are 8-aligned atomics).
#[repr(C, align(64))]
struct Area(UnsafeCell<[u8; CAP]>);

#[derive(Clone)]
struct Heap(*const Area);

impl Heap {
    fn base(&self) -> *mut u8 {
        // SAFETY: the area outlives every `Heap` (both live for one fuzz input).
        unsafe { (*self.0).0.get().cast() }
    }
}

impl Region for Heap {
    fn capacity(&self) -> u64 {
        CAP as u64
    }
    unsafe fn write_with(&self, at: u64, len: usize, fill: &mut dyn FnMut(&mut [u8])) {
        // SAFETY: single-threaded; the slice indexing below is bounds-checked (ASan checks
        // the rest).
        let area = unsafe { &mut *(*self.0).0.get() };
        fill(&mut area[at as usize..at as usize + len]);
    }
    unsafe fn read(&self, at: u64, dst: &mut [u8]) {
        // SAFETY: as above.
        let area = unsafe { &*(*self.0).0.get() };
        dst.copy_from_slice(&area[at as usize..at as usize + dst.len()]);
    }
    unsafe fn stamp(&self, at: u64) -> &AtomicU64 {
        assert!(at % 64 == 0 && at < CAP as u64, "stamp of offset {at}");
        // SAFETY: 8-aligned (the area is 64-aligned) and inside the area (checked above).
        unsafe { &*self.base().add((at + STAMP_AT) as usize).cast::<AtomicU64>() }
    }
}

fn content(tag: u64, len: usize) -> Vec<u8> {
    (0..len).map(|k| (tag as u8).wrapping_mul(29).wrapping_add(k as u8)).collect()
}

/// A message the model expects: tag, data length, meta byte and length.
type Sent = (u64, usize, u8, usize);

fuzz_target!(|ops: &[u8]| {
    let tail = AtomicU64::new(0);
    let bell = || DoorbellWords { seq: AtomicU32::new(0), waiters: AtomicU32::new(0) };
    let (data_bell, space_bell) = (bell(), bell());
    let area = Box::new(Area(UnsafeCell::new([0u8; CAP])));
    let ctrl = Ctrl { tail: &tail, data_bell: Doorbell::new(&data_bell), space_bell: Doorbell::new(&space_bell), salt: SALT };
    let mut p = Producer::new(ctrl, Heap(&*area));
    let mut c = Consumer::new(ctrl, Heap(&*area));
    let raw = Heap(&*area);
    let mut sent: VecDeque<Sent> = VecDeque::new();
    let mut delivered = 0u64;
    let mut corrupted = false;
    let mut next_tag = 0u64;
    let mut it = ops.chunks(3);
    while let Some(op) = it.next() {
        let (a, b) = (op.get(1).copied().unwrap_or(0), op.get(2).copied().unwrap_or(0));
        match op[0] % 10 {
            0 | 1 => {
                let len = (usize::from(a) << 1 | usize::from(b & 1)) % 600;
                let tag = next_tag;
                let data = content(tag, len);
                let mut fill = |d: &mut [u8]| d.copy_from_slice(&data);
                let meta = vec![b; usize::from(b % 5) * 9];
                match p.try_push(FLAG_FIRST | FLAG_LAST, tag, len as u64, &meta, len as u64, &mut fill) {
                    Ok(true) => {
                        sent.push_back((tag, len, b, meta.len()));
                        next_tag += 1;
                    }
                    Ok(false) => {}
                    Err(e) => assert!(corrupted || e.to_string().contains("exceeds"), "{e}"),
                }
            }
            2 => p.publish(),
            3 | 4 => match c.try_pop() {
                Ok(Some(rec)) => {
                    let mut got = vec![0u8; rec.header.data_len as usize];
                    c.read_data(&rec, 0, &mut got);
                    let mut meta = vec![0u8; rec.header.meta_len as usize];
                    c.read_meta(&rec, &mut meta);
                    if !corrupted {
                        let (tag, len, mb, ml) = sent.pop_front().expect("popped a message never pushed");
                        assert_eq!((rec.header.tag, got.len()), (tag, len));
                        assert_eq!(got, content(tag, len));
                        assert_eq!(meta, vec![mb; ml]);
                    }
                    delivered += 1;
                    if a % 2 == 0 {
                        c.release_to(rec.end);
                    }
                }
                Ok(None) => assert!(corrupted || sent.is_empty(), "pushed messages not delivered"),
                Err(e) => assert!(corrupted, "error without corruption: {e}"),
            },
            5 => c.release_to(c.read_position()),
            6 => {
                // A byte of the area: data, a header field or a stamp word.
                corrupted = true;
                // SAFETY: single-threaded; the index is in range.
                unsafe { *raw.base().add((usize::from(a) << 2 | usize::from(b)) % CAP) = b ^ 0x5a };
            }
            7 => {
                // A hostile producer's record at the consumer's read offset: any fields
                // (half the time the sequence number due), and the stamp of the read
                // position, of its next or last lap, or any value.
                corrupted = true;
                let pos = c.read_position();
                let at = pos % CAP as u64;
                let h = RecordHeader {
                    kind: u32::from(a % 4),
                    flags: u32::from(b % 5),
                    seq: delivered + u64::from(a / 4 % 2),
                    meta_len: u32::from(b) * 9 % 1100,
                    data_len: u64::from(a) * 13 % 1200,
                    total_len: if b % 3 == 0 { u64::from(a) * 13 % 1200 } else { u64::from(a) << (b % 64) },
                    tag: u64::from(a),
                };
                let fields = h.encode();
                // SAFETY: single-threaded; `at + 56 ≤ CAP`.
                unsafe { raw.write_with(at, fields.len(), &mut |d| d.copy_from_slice(&fields)) };
                let s = match b % 4 {
                    0 => stamp(SALT, pos),
                    1 => stamp(SALT, pos + CAP as u64),
                    2 => stamp(SALT, pos.wrapping_sub(CAP as u64)),
                    _ => u64::from(a) << 32 | u64::from(b),
                };
                // SAFETY: `at` is a 64-aligned offset below CAP.
                unsafe { raw.stamp(at) }.store(s, Ordering::Release);
            }
            8 => {
                // A hostile consumer's tail.
                corrupted = true;
                tail.store(u64::from(a) << (b % 64) | u64::from(b), Ordering::Relaxed);
            }
            _ => {
                // `ready` says what a pop would find.
                if !corrupted {
                    assert_eq!(c.ready(), !sent.is_empty(), "ready disagrees with the messages pushed");
                    assert_eq!(c.watch().ready(), !sent.is_empty(), "a watch disagrees with the messages pushed");
                }
            }
        }
    }
});
