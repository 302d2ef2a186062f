//! The ring segment: its fixed layout (a wire format both processes map), creating one,
//! validating the peer's, and the raw views of its control words and data area that the
//! sender and receiver build on.

use super::spsc::{Ctrl, Region, STAMP_AT};
use crate::doorbell::{Doorbell, DoorbellWords};
use crate::error::{Error, Result};
use crate::segment::Segment;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use crate::wire::ring::{CAPACITY_AT, DATA_BELL_AT, RING_MAGIC, RING_VERSION, SALT_AT, SALT_TOP_BIT, SPACE_BELL_AT, TAIL_AT, VERSION_AT};

// The producer writes one cache line (the data doorbell it rings), the consumer another
// (tail + the space doorbell it rings). A waiting consumer polls neither: it polls the
// stamp of the record it waits for (`spsc`), and reads the data doorbell only before it
// sleeps; the producer reads the consumer's line only when short of space
// (`wire::ring` has the offsets).
pub use crate::wire::ring::{DATA_OFFSET, MAX_RING_BYTES, MIN_RING_BYTES};

/// The data area of a mapped ring segment (a raw view; copies of it are views of the same
/// mapping, which the `RingShared` of whoever holds one keeps alive).
#[derive(Clone)]
pub(super) struct MmapRegion {
    pub(super) base: *mut u8,
    cap: u64,
}

// SAFETY: the region is a raw view of a shared mapping that the owning `RingShared` keeps
// alive; moving it between threads is fine (all access is by explicit copies).
unsafe impl Send for MmapRegion {}

impl Region for MmapRegion {
    fn capacity(&self) -> u64 {
        self.cap
    }
    unsafe fn write_with(&self, at: u64, len: usize, fill: &mut dyn FnMut(&mut [u8])) {
        // SAFETY: the caller guarantees [at, at+len) is inside the data area and that the
        // consumer does not read it now; the mapping outlives `self`.
        fill(unsafe { std::slice::from_raw_parts_mut(self.base.add(at as usize), len) })
    }
    unsafe fn read(&self, at: u64, dst: &mut [u8]) {
        // SAFETY: the caller guarantees the range is inside the data area and published.
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(at as usize), dst.as_mut_ptr(), dst.len()) }
    }
    unsafe fn stamp(&self, at: u64) -> &AtomicU64 {
        // SAFETY: the caller guarantees `at` is a multiple of 64 below the capacity, so the
        // word at `at + STAMP_AT` is 8-aligned (the area starts page-aligned) and inside the
        // mapping, which outlives `self`; while the line is a header it is only accessed
        // atomically (the protocol's reads and writes of header fields end before it).
        unsafe { &*self.base.add((at + STAMP_AT) as usize).cast::<AtomicU64>() }
    }
    fn prefetch(&self, at: u64, len: u64) {
        #[cfg(target_arch = "x86_64")]
        {
            let mut off = at & !63;
            while off < at + len {
                // SAFETY: a prefetch never faults or changes memory; the address is inside
                // the mapped data area anyway (at + len ≤ capacity).
                unsafe {
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(self.base.add(off as usize).cast())
                };
                off += 64;
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (at, len);
    }
    fn prefetch_write(&self, at: u64, len: u64) {
        #[cfg(target_arch = "x86_64")]
        {
            let mut off = at & !63;
            while off < at + len {
                // SAFETY: PREFETCHW never faults or changes memory (it executes as a NOP
                // on CPUs without it); the address is inside the mapped data area anyway.
                unsafe {
                    std::arch::asm!("prefetchw [{p}]", p = in(reg) self.base.add(off as usize), options(nostack, preserves_flags, readonly))
                };
                off += 64;
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (at, len);
    }
    unsafe fn read_raw(&self, at: u64, dst: *mut u8, len: usize) {
        // SAFETY: as for `read`; the caller guarantees `dst` is writable for `len` bytes.
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(at as usize), dst, len) }
    }
}

/// Largest peer ring whose pages are mapped in advance when opened.
const POPULATE_PEER_MAX: u64 = 64 << 20;

/// Fault in a whole ring segment now (`MADV_POPULATE_WRITE` / `_READ`, Linux 5.14+). Only
/// an optimisation: on an older kernel, or on failure, pages fault in on first use.
fn populate(seg: &Segment, advice: libc::c_int) {
    // SAFETY: the range is exactly the live mapping of `seg`; populating it only faults
    // pages in (no change to contents or protections).
    unsafe { libc::madvise(seg.as_ptr().cast(), seg.len(), advice) };
}

/// A ring segment, mapped, with its capacity validated.
pub struct RingShared {
    seg: Arc<Segment>,
    cap: u64,
    /// The stamp salt from the header, copied to private memory.
    salt: u64,
}

impl RingShared {
    /// Create a ring with a data area of `bytes` (a power of two, 4 KiB ..= 16 GiB).
    pub fn create(bytes: usize) -> Result<RingShared> {
        if !bytes.is_power_of_two() || !(MIN_RING_BYTES..=MAX_RING_BYTES).contains(&bytes) {
            return Err(Error::InvalidArgument(format!(
                "ring size {bytes} must be a power of two in {MIN_RING_BYTES}..={MAX_RING_BYTES}"
            )));
        }
        let seg = Segment::create(DATA_OFFSET + bytes)?;
        // Random, so that no sender of data can forge a stamp (`spsc` module docs); the top
        // bit set, so that no position a ring reaches has a stamp of zero.
        let mut salt = [0u8; 8];
        crate::sys::getrandom(&mut salt)?;
        let salt = u64::from_le_bytes(salt) | SALT_TOP_BIT;
        let mut hdr = [0u8; 32];
        hdr[0..8].copy_from_slice(&RING_MAGIC.to_le_bytes());
        hdr[VERSION_AT..VERSION_AT + 4].copy_from_slice(&RING_VERSION.to_le_bytes());
        hdr[CAPACITY_AT..CAPACITY_AT + 8].copy_from_slice(&(bytes as u64).to_le_bytes());
        hdr[SALT_AT..SALT_AT + 8].copy_from_slice(&salt.to_le_bytes());
        seg.write_at(0, &hdr)?;
        // The ring is registered once and reused for every message: allocate and map all
        // of it now rather than in page faults during the first lap of messages.
        populate(&seg, libc::MADV_POPULATE_WRITE);
        Ok(RingShared { seg: Arc::new(seg), cap: bytes as u64, salt })
    }

    /// Validate a ring segment from the peer. `claimed` is the size its setup message
    /// announced; the header must agree and the segment must hold the whole area.
    pub fn open(fd: std::os::fd::OwnedFd, claimed: u64, max_bytes: usize) -> Result<RingShared> {
        if !claimed.is_power_of_two() || claimed < MIN_RING_BYTES as u64 || claimed > max_bytes as u64 {
            return Err(Error::Protocol(format!(
                "peer's ring of {claimed} bytes is not a power of two in {MIN_RING_BYTES}..={max_bytes}"
            )));
        }
        let seg = Segment::from_fd_exact(fd, DATA_OFFSET + claimed as usize, "the peer's ring segment")?;
        seg.check_header("ring", (RING_MAGIC, RING_VERSION), CAPACITY_AT..CAPACITY_AT + 8, claimed)?;
        let mut salt = [0u8; 8];
        seg.read_at(SALT_AT, &mut salt)?;
        let salt = u64::from_le_bytes(salt);
        if salt & SALT_TOP_BIT == 0 {
            return Err(Error::Protocol(format!("peer's ring stamp salt {salt:#x} lacks its top bit")));
        }
        // Map the pages the producer allocated (read faults only; bounded, since the size
        // is the peer's choice: beyond it pages are mapped on first use as before).
        if claimed <= POPULATE_PEER_MAX {
            populate(&seg, libc::MADV_POPULATE_READ);
        }
        Ok(RingShared { seg: Arc::new(seg), cap: claimed, salt })
    }

    pub fn segment(&self) -> &Arc<Segment> {
        &self.seg
    }
    pub fn capacity(&self) -> u64 {
        self.cap
    }
    /// The stamp salt (`spsc::stamp`): what a test playing a hostile producer needs.
    pub fn salt(&self) -> u64 {
        self.salt
    }

    /// The control words and the data area. `'static` because the segment is kept
    /// alive by the `Arc` that every user of these also holds (see `RingSender`).
    pub(super) fn parts(&self) -> (Ctrl<'static>, MmapRegion) {
        let base = self.seg.as_ptr();
        // SAFETY: every offset is inside the first 4096 bytes of a mapping of at least
        // DATA_OFFSET + cap bytes (checked at create/open), 8-aligned, and these words are
        // only ever accessed atomically. The 'static lifetime is sound because each
        // holder of the returned references also holds `self.seg` (declared after the
        // user of the references, so it is dropped later).
        unsafe {
            let word = |off: usize| &*base.add(off).cast::<AtomicU64>();
            let bell = |off: usize| Doorbell::new(&*base.add(off).cast::<DoorbellWords>());
            let ctrl = Ctrl {
                tail: word(TAIL_AT),
                data_bell: bell(DATA_BELL_AT),
                space_bell: bell(SPACE_BELL_AT),
                salt: self.salt,
            };
            (ctrl, MmapRegion { base: base.add(DATA_OFFSET), cap: self.cap })
        }
    }
}
