//! Sequences of ring operations — push, publish, pop, release — and corruptions of the
//! shared words and records, against a `VecDeque` model.
//!
//! While nothing was corrupted, the consumer must deliver exactly the published messages
//! in order and never fail. After a corruption (a hostile peer), anything but a panic or
//! an out-of-bounds access (ASan) is allowed: errors, or garbage that passed validation.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use tensorwire::doorbell::{Doorbell, DoorbellWords};
use tensorwire::ring::spsc::{Consumer, Ctrl, Producer, Region, FLAG_FIRST, FLAG_LAST};

const CAP: usize = 1024;

struct Heap(*const UnsafeCell<[u8; CAP]>);

impl Region for Heap {
    fn capacity(&self) -> u64 {
        CAP as u64
    }
    unsafe fn write_with(&self, at: u64, len: usize, fill: &mut dyn FnMut(&mut [u8])) {
        // SAFETY: the protocol keeps [at, at+len) inside the area (ASan checks it).
        let area = unsafe { &mut *(*self.0).get() };
        fill(&mut area[at as usize..at as usize + len]);
    }
    unsafe fn read(&self, at: u64, dst: &mut [u8]) {
        // SAFETY: as above.
        let area = unsafe { &*(*self.0).get() };
        dst.copy_from_slice(&area[at as usize..at as usize + dst.len()]);
    }
}

fn content(tag: u64, len: usize) -> Vec<u8> {
    (0..len).map(|k| (tag as u8).wrapping_mul(29).wrapping_add(k as u8)).collect()
}

fuzz_target!(|ops: &[u8]| {
    let head = AtomicU64::new(0);
    let tail = AtomicU64::new(0);
    let bell = || DoorbellWords { seq: AtomicU32::new(0), waiters: AtomicU32::new(0) };
    let (data_bell, space_bell) = (bell(), bell());
    let area = Box::new(UnsafeCell::new([0u8; CAP]));
    let ctrl = Ctrl { head: &head, tail: &tail, data_bell: Doorbell::new(&data_bell), space_bell: Doorbell::new(&space_bell) };
    let mut p = Producer::new(ctrl, Heap(&*area));
    let mut c = Consumer::new(ctrl, Heap(&*area));
    let mut pushed: VecDeque<(u64, usize)> = VecDeque::new();
    let mut published: VecDeque<(u64, usize)> = VecDeque::new();
    let mut corrupted = false;
    let mut next_tag = 0u64;
    let mut it = ops.chunks(3);
    while let Some(op) = it.next() {
        let (a, b) = (op.get(1).copied().unwrap_or(0), op.get(2).copied().unwrap_or(0));
        match op[0] % 8 {
            0 | 1 => {
                let len = (usize::from(a) << 1 | usize::from(b & 1)) % 600;
                let tag = next_tag;
                let data = content(tag, len);
                let mut fill = |d: &mut [u8]| d.copy_from_slice(&data);
                let meta = vec![b; usize::from(b % 5) * 9];
                match p.try_push(FLAG_FIRST | FLAG_LAST, tag, len as u64, &meta, len as u64, &mut fill) {
                    Ok(true) => {
                        pushed.push_back((tag, len));
                        next_tag += 1;
                    }
                    Ok(false) => {}
                    Err(e) => assert!(corrupted || e.to_string().contains("exceeds"), "{e}"),
                }
            }
            2 => {
                p.publish();
                published.extend(pushed.drain(..));
            }
            3 | 4 => match c.try_pop() {
                Ok(Some(rec)) => {
                    let mut got = vec![0u8; rec.header.data_len as usize];
                    c.read_data(&rec, 0, &mut got);
                    if !corrupted {
                        let (tag, len) = published.pop_front().expect("popped a message never published");
                        assert_eq!((rec.header.tag, got.len()), (tag, len));
                        assert_eq!(got, content(tag, len));
                    }
                    if a % 2 == 0 {
                        c.release_to(rec.end);
                    }
                }
                Ok(None) => assert!(corrupted || published.is_empty(), "published messages not delivered"),
                Err(e) => assert!(corrupted, "error without corruption: {e}"),
            },
            5 => c.release_to(c.read_position()),
            6 => {
                // Corrupt a byte of the area.
                corrupted = true;
                // SAFETY: single-threaded; index is in range.
                unsafe { (*area.get())[(usize::from(a) << 2 | usize::from(b)) % CAP] = b ^ 0x5a };
            }
            _ => {
                corrupted = true;
                let v = u64::from(a) << (b % 64) | u64::from(b);
                if b % 2 == 0 { head.store(v, Ordering::Relaxed) } else { tail.store(v, Ordering::Relaxed) }
            }
        }
    }
});
