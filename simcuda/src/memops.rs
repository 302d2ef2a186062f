//! Stream memory operations: `cuStreamWaitValue32/64` and `cuStreamWriteValue32/64`
//! (`_v2` and the older names).
//!
//! Both are stream ops (legacy-stream ordering and seeded delays as for every op). A write
//! stores the word after the stream's earlier work (a Release store: what the stream did
//! before is visible to whoever sees the value). A wait polls the word (Acquire loads,
//! short sleeps) until its condition holds, so a write by another stream, another process
//! or a plain host store to registered memory releases it. The address must be a device
//! address simcuda knows (`cuMemAlloc`, opened IPC memory, an accessible VMM mapping, the
//! device pointer of registered host memory), aligned to the word, the word inside one
//! allocation: else CUDA_ERROR_INVALID_VALUE.

use crate::memory::{self, Span};
use crate::result::*;
use crate::stream::{self, Op};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

pub const WAIT_GEQ: u32 = 0;
pub const WAIT_EQ: u32 = 1;
pub const WAIT_AND: u32 = 2;
pub const WAIT_NOR: u32 = 3;
pub const WAIT_FLUSH: u32 = 1 << 30;
pub const WRITE_DEFAULT: u32 = 0;
pub const WRITE_NO_MEMORY_BARRIER: u32 = 1;

/// How long a waiting stream sleeps between two looks at the word.
const POLL: Duration = Duration::from_micros(10);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Width {
    W32,
    W64,
}

impl Width {
    fn bytes(self) -> u64 {
        match self {
            Width::W32 => 4,
            Width::W64 => 8,
        }
    }
}

/// Which entry point was called: the `_v2` calls do not take
/// `CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER` (documented: "This flag is not supported in
/// the v2 API"); the older names do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    V1,
    V2,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cond {
    Geq,
    Eq,
    And,
    Nor,
}

/// The condition in wait `flags`. `CU_STREAM_WAIT_VALUE_FLUSH` is documented as supported
/// on selected platforms only (`CAN_FLUSH_REMOTE_WRITES`); x86 drivers have refused it
/// since CUDA 9.2, so simcuda (an x86 H200) reports the attribute 0 and refuses the flag with
/// CUDA_ERROR_NOT_SUPPORTED (the strict choice; the code a real driver returns is calibrated).
fn condition(flags: u32) -> R<Cond> {
    let cond = match flags & !WAIT_FLUSH {
        WAIT_GEQ => Cond::Geq,
        WAIT_EQ => Cond::Eq,
        WAIT_AND => Cond::And,
        WAIT_NOR => Cond::Nor,
        _ => return Err(INVALID_VALUE),
    };
    if flags & WAIT_FLUSH != 0 {
        return Err(NOT_SUPPORTED);
    }
    Ok(cond)
}

/// The documented conditions: GEQ is the cyclic `(int32_t)(*addr - value) >= 0` (int64 for
/// the 64-bit call), which ignores wraparound; AND is `(*addr & value) != 0`; NOR is
/// `~(*addr | value) != 0`.
fn holds(cond: Cond, width: Width, cur: u64, value: u64) -> bool {
    let (cur, value, mask) = match width {
        Width::W32 => (cur & 0xffff_ffff, value & 0xffff_ffff, 0xffff_ffffu64),
        Width::W64 => (cur, value, u64::MAX),
    };
    match cond {
        Cond::Geq => match width {
            Width::W32 => (cur.wrapping_sub(value) as u32 as i32) >= 0,
            Width::W64 => (cur.wrapping_sub(value) as i64) >= 0,
        },
        Cond::Eq => cur == value,
        Cond::And => cur & value != 0,
        Cond::Nor => !(cur | value) & mask != 0,
    }
}

/// The word at device address `addr`: a known address, aligned, inside one allocation.
fn word(addr: u64, width: Width, write: bool) -> R<Span> {
    if addr % width.bytes() != 0 {
        return Err(INVALID_VALUE);
    }
    if write { memory::span_for_write(addr, width.bytes()) } else { memory::span(addr, width.bytes()) }
}

fn load(w: &Span, width: Width) -> u64 {
    let p = w.backing.at(w.off);
    match width {
        // SAFETY: the span is an aligned word inside its backing's pages (checked by `word`;
        // a memfd alias the span's Arc keeps mapped, or registered host pages the caller
        // keeps mapped); every access to it by simcuda is atomic. Acquire: pairs with the
        // Release store of the write op (this or another process) or a host store.
        Width::W32 => u64::from(unsafe { AtomicU32::from_ptr(p.cast()) }.load(Ordering::Acquire)),
        // SAFETY: as above.
        Width::W64 => unsafe { AtomicU64::from_ptr(p.cast()) }.load(Ordering::Acquire),
    }
}

fn store(w: &Span, width: Width, v: u64) {
    let p = w.backing.at(w.off);
    match width {
        // SAFETY: as in `load`. Release: the stream's earlier ops ran before this one on
        // this worker; pairs with the Acquire load of a wait (any process) or the host.
        Width::W32 => unsafe { AtomicU32::from_ptr(p.cast()) }.store(v as u32, Ordering::Release),
        // SAFETY: as above.
        Width::W64 => unsafe { AtomicU64::from_ptr(p.cast()) }.store(v, Ordering::Release),
    }
}

fn supported() -> R {
    if crate::settings::get().memops { Ok(()) } else { Err(NOT_SUPPORTED) }
}

/// `cuStreamWaitValue32/64`: enqueue a wait until the condition in `flags` holds for the
/// word at `addr` (other flag values: CUDA_ERROR_INVALID_VALUE; FLUSH: see `condition`).
pub fn wait(stream_h: usize, addr: u64, value: u64, flags: u32, width: Width) -> R {
    supported()?;
    let s = stream::resolve(stream_h)?;
    let cond = condition(flags)?;
    let w = word(addr, width, false)?;
    let extra = crate::settings::get().value_wait;
    crate::stats::count(&crate::stats::VALUE_WAITS);
    stream::enqueue(
        &s,
        Op::Run(Box::new(move || {
            while !holds(cond, width, load(&w, width), value) {
                std::thread::sleep(POLL);
            }
            if !extra.is_zero() {
                std::thread::sleep(extra);
            }
        })),
    );
    Ok(())
}

/// `cuStreamWriteValue32/64`: enqueue a store of `value` to the word at `addr`. Flags:
/// DEFAULT, or NO_MEMORY_BARRIER with the older API only (else CUDA_ERROR_INVALID_VALUE;
/// simcuda's store always orders after the stream's earlier work, which the flag allows).
/// Host memory registered read-only is CUDA_ERROR_INVALID_VALUE (strict: the device must
/// not write it).
pub fn write(stream_h: usize, addr: u64, value: u64, flags: u32, width: Width, api: Api) -> R {
    supported()?;
    let s = stream::resolve(stream_h)?;
    let ok = flags == WRITE_DEFAULT || (flags == WRITE_NO_MEMORY_BARRIER && api == Api::V1);
    if !ok {
        return Err(INVALID_VALUE);
    }
    let w = word(addr, width, true)?;
    crate::stats::count(&crate::stats::VALUE_WRITES);
    stream::enqueue(&s, Op::Run(Box::new(move || store(&w, width, value))));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conditions_follow_the_documented_formulas() {
        // GEQ is cyclic: 5 is "after" 0xFFFF_FFF0 (the difference 0x15 is positive).
        assert!(holds(Cond::Geq, Width::W32, 5, 0xFFFF_FFF0));
        assert!(!holds(Cond::Geq, Width::W32, 0xFFFF_FFF0, 5));
        assert!(holds(Cond::Geq, Width::W32, 7, 7));
        assert!(!holds(Cond::Geq, Width::W32, 6, 7));
        assert!(holds(Cond::Geq, Width::W64, 5, u64::MAX - 15));
        assert!(!holds(Cond::Geq, Width::W64, 1 << 32, (1 << 32) + 1));
        // 32-bit: only the low word counts.
        assert!(holds(Cond::Eq, Width::W32, 0x1_0000_0007, 7));
        assert!(holds(Cond::And, Width::W32, 0b0110, 0b0100));
        assert!(!holds(Cond::And, Width::W32, 0b0110, 0b1001));
        assert!(holds(Cond::Nor, Width::W32, 0b0001, 0b0010));
        assert!(!holds(Cond::Nor, Width::W32, 0xFFFF_0000, 0x0000_FFFF));
        assert!(!holds(Cond::Nor, Width::W64, u64::MAX, 0));
        assert!(holds(Cond::Nor, Width::W64, 0xFFFF_FFFF, 0));
        assert_eq!(condition(WAIT_NOR), Ok(Cond::Nor));
        assert_eq!(condition(WAIT_EQ | WAIT_FLUSH), Err(NOT_SUPPORTED));
        assert_eq!(condition(5 | WAIT_FLUSH), Err(INVALID_VALUE));
        assert_eq!(condition(4), Err(INVALID_VALUE));
        assert_eq!(condition(1 << 29), Err(INVALID_VALUE));
    }
}
