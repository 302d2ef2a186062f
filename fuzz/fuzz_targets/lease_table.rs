//! Lease tables read from shared memory (src/lease): the consumer's `ImportTable` over a
//! segment whose header and slot words the fuzzer writes, and the producer's `Exporter`
//! over the same words while the "consumer" scribbles on them.
//!
//! 1. `ImportTable::open` on a memfd of fuzzed size whose header the fuzzer writes (magic,
//!    version, capacity, claimed capacity): accepted only when all agree and the size fits.
//! 2. A real table (an `Exporter`'s) opened by an `ImportTable`; then a script of grants,
//!    consumer checks and releases, raw word writes (a hostile consumer), reaps and
//!    expiries, against a model of each slot: `check_live`/`release` succeed exactly when
//!    the slot word is `generation << 32 | LIVE` for the lease named, a release leaves
//!    `RELEASED` there, slots out of range are refused, and every owner the exporter
//!    holds is dropped exactly once — by reap, expiry or `reclaim_all` — with the stats
//!    adding up.
#![no_main]

#[path = "../common/input.rs"]
mod input;

use input::{Input, dup, memfd};
use libfuzzer_sys::fuzz_target;
use std::cell::Cell;
use parking_lot::Mutex;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tensorwire::lease::slot::{self, LIVE};
use tensorwire::lease::{Exporter, ImportTable, LeaseId, Reclaimed, TABLE_HEADER_BYTES, TABLE_VERSION};

const TABLE_MAGIC: [u8; 8] = *b"TWLEASE1";

/// Counts its drops: an owner dropped twice (or never) shows in the count.
struct Owner(Arc<AtomicUsize>);
impl Drop for Owner {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    let mode = inp.u8();
    if mode & 1 == 0 {
        open_hostile(&mut inp, mode);
    } else {
        script(&mut inp);
    }
});

/// `ImportTable::open` on a header and size the fuzzer chose.
fn open_hostile(inp: &mut Input<'_>, mode: u8) {
    let claimed = if mode & 2 == 0 { u32::from(inp.u8()) } else { inp.u32() };
    let header_cap = if mode & 4 == 0 { claimed } else { inp.u32() };
    let max_capacity = 1 + u32::from(inp.u16());
    let mut hdr = [0u8; 16];
    if mode & 8 == 0 {
        hdr[0..8].copy_from_slice(&TABLE_MAGIC);
        hdr[8..12].copy_from_slice(&TABLE_VERSION.to_le_bytes());
    } else {
        hdr[0..12].copy_from_slice(&{
            let mut b = [0u8; 12];
            let s = inp.bytes(12);
            b[..s.len()].copy_from_slice(s);
            b
        });
    }
    hdr[12..16].copy_from_slice(&header_cap.to_le_bytes());
    let exact = TABLE_HEADER_BYTES + 8 * claimed as usize;
    let len = match inp.u8() % 5 {
        0 | 1 => exact,
        2 => exact.saturating_sub(1 + usize::from(inp.u8())),
        3 => exact + 1 + usize::from(inp.u16()),
        _ => usize::from(inp.u16()),
    };
    if len > 1 << 20 {
        return; // a huge claim with an exact-size file: not worth the memory per run
    }
    let fd = memfd(len, &hdr, mode & 16 != 0);
    let page = 4096usize;
    let good = claimed >= 1
        && claimed <= max_capacity
        && len >= exact
        && len <= exact.div_ceil(page) * page
        && mode & 16 == 0
        && hdr[0..8] == TABLE_MAGIC
        && hdr[8..12] == TABLE_VERSION.to_le_bytes()
        && header_cap == claimed;
    match ImportTable::open(fd, claimed, max_capacity) {
        Ok(t) => {
            assert!(good, "accepted a bad table: claimed {claimed}, header {hdr:02x?}, {len} bytes, max {max_capacity}, mode {mode:#x}");
            assert_eq!(t.capacity(), claimed);
            // A slot past the end is refused, not read.
            assert!(t.check_live(LeaseId { slot: claimed, generation: 1 }).is_err());
            assert!(t.release(LeaseId { slot: u32::MAX, generation: 1 }).is_err());
            // Every slot in range is readable (zeroed: no lease is live).
            for s in [0, claimed / 2, claimed - 1] {
                assert!(t.check_live(LeaseId { slot: s, generation: 0 }).is_err());
            }
        }
        Err(e) => {
            assert!(!good, "refused a good table (claimed {claimed}, {len} bytes): {e}");
            assert!(!e.to_string().is_empty());
        }
    }
}

/// A producer and a consumer over one real table, the consumer partly hostile.
fn script(inp: &mut Input<'_>) {
    let cap = 1 + u32::from(inp.u8() % 16);
    let ex = Mutex::new(Exporter::new(cap, 1 << 20).expect("exporter"));
    let table = ex.lock().table().clone();
    let import = ImportTable::open(dup(table.fd()), cap, 64).expect("a real table opens");
    let word = |s: u32| -> &AtomicU64 {
        // SAFETY: s < cap, so the word lies in the mapping (header + cap * 8 bytes),
        // 8-aligned; the library accesses these words only atomically too.
        unsafe { &*table.as_ptr().add(TABLE_HEADER_BYTES + 8 * s as usize).cast::<AtomicU64>() }
    };
    let drops = Arc::new(AtomicUsize::new(0));
    let mut granted: Vec<LeaseId> = Vec::new();
    let mut total = 0usize;
    let clock = Rc::new(Cell::new(Instant::now()));
    let mut out = Reclaimed::default();
    let mut steps = 0;
    while !inp.is_empty() && steps < 256 {
        steps += 1;
        let op = inp.u8();
        // A lease: one granted (maybe stale now), or made up.
        let pick = |inp: &mut Input<'_>, granted: &[LeaseId]| -> LeaseId {
            let k = inp.u8();
            if k & 1 == 0 && !granted.is_empty() {
                granted[usize::from(k >> 1) % granted.len()]
            } else {
                LeaseId { slot: u32::from(inp.u8()) % (cap + 2), generation: u32::from(inp.u8() % 4) }
            }
        };
        match op % 7 {
            0 | 1 => {
                let window = if op & 0x10 != 0 { Some(clock.get() + Duration::from_millis(u64::from(inp.u8()))) } else { None };
                let before = ex.lock().stats().live_leases;
                let r = ex.lock().grant(None, 1 + u64::from(inp.u8()), Box::new(Owner(drops.clone())), window);
                match r {
                    Ok((id, first)) => {
                        assert!(!first, "no segment, never a first share");
                        assert!(id.slot < cap && id.generation != 0);
                        assert_eq!(word(id.slot).load(Ordering::Relaxed), slot::pack(id.generation, LIVE));
                        assert!(import.check_live(id).is_ok(), "a fresh grant is live to the consumer");
                        granted.push(id);
                        total += 1;
                    }
                    Err((e, owner)) => {
                        assert!(before >= u64::from(cap) || !e.to_string().is_empty());
                        drop(owner); // handed back to the caller: counts as dropped once
                        total += 1;
                    }
                }
            }
            2 => {
                let id = pick(inp, &granted);
                let before = (id.slot < cap).then(|| word(id.slot).load(Ordering::Relaxed));
                let live = before == Some(slot::pack(id.generation, LIVE));
                assert_eq!(import.check_live(id).is_ok(), live, "check_live of {id:?} over {before:x?}");
            }
            3 => {
                let id = pick(inp, &granted);
                let before = (id.slot < cap).then(|| word(id.slot).load(Ordering::Relaxed));
                let live = before == Some(slot::pack(id.generation, LIVE));
                let r = import.release(id);
                assert_eq!(r.is_ok(), live, "release of {id:?} over {before:x?}: {r:?}");
                if live {
                    assert_eq!(word(id.slot).load(Ordering::Relaxed), slot::pack(id.generation, slot::RELEASED));
                    assert!(import.release(id).is_err(), "a second release of {id:?} took");
                } else if let Some(b) = before {
                    assert_eq!(word(id.slot).load(Ordering::Relaxed), b, "a refused release changed the word");
                }
            }
            4 => {
                // The hostile consumer writes any word into a slot.
                let s = u32::from(inp.u8()) % cap;
                let v = match inp.u8() % 3 {
                    0 => inp.u64(),
                    1 => slot::pack(u32::from(inp.u8() % 4), u32::from(inp.u8() % 5)),
                    _ => slot::pack(granted.last().map_or(1, |l| l.generation), u32::from(inp.u8() % 5)),
                };
                word(s).store(v, Ordering::Relaxed);
            }
            5 => {
                // Time passes; the reaper runs.
                clock.set(clock.get() + Duration::from_millis(u64::from(inp.u8())));
                ex.lock().reap(clock.get(), &mut out);
                std::mem::take(&mut out).settle(&ex);
            }
            _ => {
                let live = ex.lock().stats().live_leases;
                assert!(live <= u64::from(cap));
                assert_eq!(drops.load(Ordering::Relaxed) as u64 + live, total as u64, "every owner is held or dropped once");
            }
        }
    }
    ex.lock().reclaim_all(&mut out);
    std::mem::take(&mut out).settle(&ex);
    assert_eq!(drops.load(Ordering::Relaxed), total, "each owner dropped exactly once");
    assert_eq!(ex.lock().stats().live_leases, 0, "reclaim_all leaves no live lease");
}
