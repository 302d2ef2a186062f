//! Stream memory operations: `cuStreamWaitValue32/64` and `cuStreamWriteValue32/64`.
//!
//! Both are stream ops: a write stores after the stream's earlier work (Release); a wait
//! polls the word until its condition holds (Acquire), so a write by another stream,
//! another process mapping the same pages, or a plain host store releases it. Conditions
//! as documented: GEQ `(int32_t)(*addr - value) >= 0` (cyclic, wraparound ignored; int64
//! for the 64-bit call), EQ, AND `(*addr & value) != 0`, NOR `~(*addr | value) != 0`;
//! `FLUSH` may be or-ed in. The address is a device address simcuda knows (device memory,
//! opened IPC memory, a VMM mapping, registered host memory's device pointer), aligned
//! to the word's size.

use crate::memory;
use crate::result::*;
use crate::stream::{self, Op};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

const GEQ: u32 = 0;
const EQ: u32 = 1;
const AND: u32 = 2;
const NOR: u32 = 3;
const FLUSH: u32 = 1 << 30;
const NO_MEMORY_BARRIER: u32 = 1;

/// `SIMCUDA_NO_MEMOPS=1`: the device has no stream memory operations.
pub fn supported() -> bool {
    std::env::var("SIMCUDA_NO_MEMOPS").as_deref() != Ok("1")
}

fn holds(cond: u32, word: u64, value: u64, wide: bool) -> bool {
    match cond {
        GEQ if wide => (word.wrapping_sub(value) as i64) >= 0,
        GEQ => ((word as u32).wrapping_sub(value as u32) as i32) >= 0,
        EQ => word == value,
        AND => word & value != 0,
        _ => !(word | value) & if wide { u64::MAX } else { u64::from(u32::MAX) } != 0,
    }
}

/// The word at `addr`: inside one accessible region, aligned.
fn word(addr: u64, wide: bool) -> R<memory::Span> {
    let n = if wide { 8 } else { 4 };
    if !supported() {
        return Err(NOT_SUPPORTED);
    }
    if addr % n != 0 {
        return Err(INVALID_VALUE);
    }
    memory::span(addr, n)
}

fn load(w: &memory::Span, wide: bool) -> u64 {
    let p = w.backing.at(w.off);
    // SAFETY: `word` checked the span lies in its backing, aligned to its size; the word
    // is only accessed atomically (here, by host code, by other processes).
    // Acquire: pairs with the Release store of whoever wrote the value (a stream write,
    // a host store), so the work before it is visible to the waiting stream's later work.
    unsafe {
        if wide { (*p.cast::<AtomicU64>()).load(Ordering::Acquire) } else { u64::from((*p.cast::<AtomicU32>()).load(Ordering::Acquire)) }
    }
}

/// `cuStreamWaitValue32/64`.
pub fn wait(stream_h: usize, addr: u64, value: u64, flags: u32, wide: bool) -> R {
    let cond = flags & !FLUSH;
    if cond > NOR {
        return Err(INVALID_VALUE);
    }
    let w = word(addr, wide)?;
    let s = stream::resolve(stream_h)?;
    crate::stats::value_wait();
    let extra = crate::cost::value_wait();
    stream::enqueue(
        &s,
        Op::Run(Box::new(move || {
            while !holds(cond, load(&w, wide), value, wide) {
                std::thread::sleep(Duration::from_micros(10));
            }
            if !extra.is_zero() {
                std::thread::sleep(extra);
            }
        })),
    );
    Ok(())
}

/// `cuStreamWriteValue32/64`.
pub fn write(stream_h: usize, addr: u64, value: u64, flags: u32, wide: bool) -> R {
    if flags & !NO_MEMORY_BARRIER != 0 {
        return Err(INVALID_VALUE);
    }
    let w = word(addr, wide)?;
    let s = stream::resolve(stream_h)?;
    crate::stats::value_write();
    stream::enqueue(
        &s,
        Op::Run(Box::new(move || {
            let p = w.backing.at(w.off);
            // SAFETY: as in `load`. Release: the stream's earlier ops ran before this one on
            // this worker; whoever sees the value sees their effects.
            unsafe {
                if wide {
                    (*p.cast::<AtomicU64>()).store(value, Ordering::Release)
                } else {
                    (*p.cast::<AtomicU32>()).store(value as u32, Ordering::Release)
                }
            }
        })),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conditions_are_the_documented_ones() {
        assert!(holds(GEQ, 5, 0xFFFF_FFF0, false), "32-bit GEQ is cyclic");
        assert!(!holds(GEQ, 0xFFFF_FFF0, 5, false));
        assert!(holds(GEQ, 7, 7, true) && !holds(GEQ, 6, 7, true));
        assert!(holds(EQ, 3, 3, false) && !holds(EQ, 3, 4, false));
        assert!(holds(AND, 6, 2, false) && !holds(AND, 4, 2, false));
        assert!(holds(NOR, 0, 0, false) && !holds(NOR, 0xFFFF_FFFF, 0, false));
    }
}
