//! The single-producer/single-consumer record protocol of a bounce-buffer ring.
//!
//! Written only against `crate::sync` and the [`Region`] trait, so `tests/loom_ring.rs`
//! model-checks this exact code with loom atomics and `UnsafeCell` bytes (which also
//! catches unsynchronised access to record payloads, not just to the control words).
//!
//! Layout of the data area (a power of two, `cap` bytes): variable-size records, each a
//! 64-byte header, then `meta` (≤ `MAX_META` bytes) and `data`, each padded to 64 bytes.
//! A record never wraps: when it does not fit before the end, the producer first writes a
//! PAD header that covers the rest of the area and starts again at 0.
//!
//! `head` (written by the producer) and `tail` (written by the consumer) are monotonic
//! byte counters; `pos & (cap - 1)` is the offset. The producer publishes with a Release
//! store of `head` after writing a record; the consumer Acquire-loads it, copies the
//! header to private memory, validates it, and only then touches meta or data. The
//! consumer releases with a Release store of `tail` once it is done with the bytes below
//! it; the producer Acquire-loads `tail` before reusing them. Either side treats the
//! other's counter as hostile: a value outside what the protocol allows marks the ring
//! broken (an error, never an out-of-bounds access or an endless loop).

use crate::doorbell::Doorbell;
use crate::sync::{AtomicU64, Ordering};

pub const RECORD_ALIGN: u64 = 64;
pub const HEADER_BYTES: u64 = 64;
/// Largest `meta` part of a record (a tensor descriptor fits).
pub const MAX_META: u32 = 1024;
pub const KIND_DATA: u32 = 1;
pub const KIND_PAD: u32 = 2;
/// First record of a message.
pub const FLAG_FIRST: u32 = 1;
/// Last record of a message.
pub const FLAG_LAST: u32 = 2;

/// `n` rounded up to the record alignment (None on overflow).
pub fn align(n: u64) -> Option<u64> {
    n.checked_add(RECORD_ALIGN - 1).map(|v| v & !(RECORD_ALIGN - 1))
}

/// A record header as copied to private memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecordHeader {
    pub kind: u32,
    pub flags: u32,
    /// Sequence number of DATA records (consecutive from 0).
    pub seq: u64,
    pub meta_len: u32,
    pub data_len: u64,
    /// Bytes of the whole message (in its FIRST record).
    pub total_len: u64,
    /// Caller's tag (in its FIRST record).
    pub tag: u64,
}

impl RecordHeader {
    pub fn encode(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        b[0..4].copy_from_slice(&self.kind.to_le_bytes());
        b[4..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..20].copy_from_slice(&self.meta_len.to_le_bytes());
        b[24..32].copy_from_slice(&self.data_len.to_le_bytes());
        b[32..40].copy_from_slice(&self.total_len.to_le_bytes());
        b[40..48].copy_from_slice(&self.tag.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; 64]) -> RecordHeader {
        let u32at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let u64at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        RecordHeader {
            kind: u32at(0),
            flags: u32at(4),
            seq: u64at(8),
            meta_len: u32at(16),
            data_len: u64at(24),
            total_len: u64at(32),
            tag: u64at(40),
        }
    }

    /// Bytes the whole record occupies (None on overflow).
    pub fn size(&self) -> Option<u64> {
        HEADER_BYTES.checked_add(align(u64::from(self.meta_len))?)?.checked_add(align(self.data_len)?)
    }
}

/// The data area. Implementations copy bytes in and out; the protocol guarantees a range
/// is never written while the other side may read it.
pub trait Region {
    /// Size of the data area: a power of two, at least 256.
    fn capacity(&self) -> u64;
    /// Fill `len` bytes at offset `at` by calling `fill` with a writable buffer.
    ///
    /// # Safety
    /// `at + len ≤ capacity()`, and the consumer must not be reading that range.
    unsafe fn write_with(&self, at: u64, len: usize, fill: &mut dyn FnMut(&mut [u8]));
    /// Copy `dst.len()` bytes from offset `at`.
    ///
    /// # Safety
    /// `at + dst.len() ≤ capacity()`, and the producer must not be writing that range.
    unsafe fn read(&self, at: u64, dst: &mut [u8]);
    /// Hint that `[at, at + len)` will be read soon (a cache prefetch; no effect on
    /// correctness). `at + len ≤ capacity()`.
    fn prefetch(&self, _at: u64, _len: u64) {}
    /// Hint that `[at, at + len)` will be written soon (a prefetch for ownership; no
    /// effect on correctness). `at + len ≤ capacity()`.
    fn prefetch_write(&self, _at: u64, _len: u64) {}

    /// Copy `len` bytes from offset `at` to raw (possibly uninitialised) memory.
    ///
    /// # Safety
    /// As for `read`, and `dst` must be valid for writes of `len` bytes.
    unsafe fn read_raw(&self, at: u64, dst: *mut u8, len: usize) {
        let mut tmp = vec![0u8; len];
        // SAFETY: forwarded from the caller.
        unsafe {
            self.read(at, &mut tmp);
            std::ptr::copy_nonoverlapping(tmp.as_ptr(), dst, len);
        }
    }
}

/// The shared control words of one ring.
#[derive(Clone, Copy)]
pub struct Ctrl<'a> {
    pub head: &'a AtomicU64,
    pub tail: &'a AtomicU64,
    /// Rung by the producer after publishing; the consumer sleeps on it.
    pub data_bell: Doorbell<'a>,
    /// Rung by the consumer after releasing; the producer sleeps on it when full.
    pub space_bell: Doorbell<'a>,
}

/// What the other side wrote that the protocol does not allow. Once seen, the ring is
/// unusable for good: every later call on that side fails with the same reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RingBroken {
    /// The consumer's `tail` moved backwards or past the producer's head.
    TailOutOfRange { tail: u64, seen: u64, head: u64 },
    /// The producer's `head` moved backwards, or more than a lap past what was released.
    HeadOutOfRange { head: u64, read: u64, limit: u64 },
    /// Fewer published bytes than a record header, or a record off its 64-byte boundary.
    NoRoomForHeader { avail: u64, offset: u64 },
    /// A PAD record covers bytes past the published head.
    PadPastHead { offset: u64 },
    /// A record's meta or data part is larger than a record may be.
    RecordOverLimits { offset: u64, meta_len: u32, data_len: u64 },
    /// A record runs past the end of the data area or the published head.
    RecordPastEnd { size: u64, offset: u64 },
    /// A record's sequence number is not the next one.
    Sequence { got: u64, due: u64 },
    /// A record carries flags the protocol does not define.
    UnknownFlags { flags: u32 },
    /// A record's kind is neither DATA nor PAD.
    UnknownKind { kind: u32, offset: u64 },
    /// A record's meta part is neither empty nor a tensor descriptor.
    MetaNotDescriptor { len: usize },
    /// A FIRST record arrived while a chunked message was still incomplete.
    MessageInsideChunked,
    /// A message's first chunk is larger than the message, or a single-record message's
    /// data is not the whole message.
    ChunkLargerThanMessage { chunk: u64, total: u64 },
    /// A continuation chunk arrived with no message started.
    ContinuationWithoutStart,
    /// A chunked message's chunks add up to more than its announced size.
    ChunksExceedTotal { total: u64 },
    /// A chunked message's LAST record came before all of its bytes.
    MessageCutShort { got: u64, total: u64 },
}

impl std::fmt::Display for RingBroken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            RingBroken::TailOutOfRange { tail, seen, head } => {
                write!(f, "consumer tail {tail} outside [{seen}, {head}] (it may only move forward, up to the head)")
            }
            RingBroken::HeadOutOfRange { head, read, limit } => write!(f, "producer head {head} outside [{read}, {limit}]"),
            RingBroken::NoRoomForHeader { avail, offset } => {
                write!(f, "{avail} published bytes at offset {offset} cannot hold a record header")
            }
            RingBroken::PadPastHead { offset } => write!(f, "pad record at offset {offset} runs past the published head"),
            RingBroken::RecordOverLimits { offset, meta_len, data_len } => {
                write!(f, "record at offset {offset} has meta {meta_len} and data {data_len} bytes: over the limits")
            }
            RingBroken::RecordPastEnd { size, offset } => {
                write!(f, "record of {size} bytes at offset {offset} passes the end of the area or the published head")
            }
            RingBroken::Sequence { got, due } => write!(f, "record sequence {got} where {due} was due"),
            RingBroken::UnknownFlags { flags } => write!(f, "record flags {flags:#x} unknown"),
            RingBroken::UnknownKind { kind, offset } => write!(f, "unknown record kind {kind} at offset {offset}"),
            RingBroken::MetaNotDescriptor { len } => write!(f, "meta of {len} bytes is not a descriptor"),
            RingBroken::MessageInsideChunked => write!(f, "a new message started inside a chunked one"),
            RingBroken::ChunkLargerThanMessage { chunk, total } => write!(f, "chunk of {chunk} bytes for a message of {total}"),
            RingBroken::ContinuationWithoutStart => write!(f, "a continuation chunk arrived with no message started"),
            RingBroken::ChunksExceedTotal { total } => write!(f, "chunks exceed the announced {total} bytes"),
            RingBroken::MessageCutShort { got, total } => write!(f, "message ended at {got} of {total} bytes"),
        }
    }
}

/// Why a ring operation failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RingError {
    /// The other side wrote something the protocol does not allow; the ring is unusable.
    Broken(RingBroken),
    /// A record of this size can never fit (larger than half the data area).
    TooLarge { size: u64, max: u64 },
}

impl std::fmt::Display for RingError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RingError::Broken(why) => write!(f, "ring broken: {why}"),
            RingError::TooLarge { size, max } => write!(f, "record of {size} bytes exceeds the ring's {max}-byte record limit"),
        }
    }
}

/// The data area's capacity, checked: a power of two, at least 256 bytes.
fn checked_capacity(region: &impl Region) -> u64 {
    let cap = region.capacity();
    assert!(cap.is_power_of_two() && cap >= 256, "ring capacity must be a power of two ≥ 256");
    cap
}

/// Whether a side found the ring broken, and why. Sticky: the first reason stays, and
/// every later call on that side fails with it.
#[derive(Clone, Copy, Default)]
struct Broken(Option<RingBroken>);

impl Broken {
    /// `Err` with the first reason once the ring is broken.
    fn check(self) -> Result<(), RingError> {
        match self.0 {
            Some(why) => Err(RingError::Broken(why)),
            None => Ok(()),
        }
    }

    /// Record `why` (unless a reason is recorded already) and return it as the error.
    fn mark(&mut self, why: RingBroken) -> RingError {
        self.0.get_or_insert(why);
        RingError::Broken(why)
    }
}

/// The producer's half. Private state only; the shared words are read as hostile.
pub struct Producer<'a, R: Region> {
    ctrl: Ctrl<'a>,
    region: R,
    cap: u64,
    head: u64,
    tail_seen: u64,
    seq: u64,
    unpublished: bool,
    broken: Broken,
}

impl<'a, R: Region> Producer<'a, R> {
    /// A producer over a fresh ring (head = tail = 0).
    pub fn new(ctrl: Ctrl<'a>, region: R) -> Self {
        let cap = checked_capacity(&region);
        Producer { ctrl, region, cap, head: 0, tail_seen: 0, seq: 0, unpublished: false, broken: Broken::default() }
    }

    /// Largest record (header + meta + data) the ring accepts: half the data area, so
    /// that a record always fits once the consumer has caught up, wrap or not.
    pub fn max_record(&self) -> u64 {
        self.cap / 2
    }

    /// Largest data part of one record when its meta part is `meta_len` bytes.
    pub fn max_data(&self, meta_len: u32) -> u64 {
        self.max_record() - HEADER_BYTES - align(u64::from(meta_len)).unwrap_or(u64::MAX / 2)
    }

    pub fn doorbells(&self) -> Ctrl<'a> {
        self.ctrl
    }

    /// Bytes free right now.
    fn free(&mut self) -> Result<u64, RingError> {
        self.broken.check()?;
        // Acquire: pairs with the consumer's Release store in `Consumer::release_to`, so
        // its reads of every byte below `tail` are done before we overwrite them.
        let tail = self.ctrl.tail.load(Ordering::Acquire);
        if tail < self.tail_seen || tail > self.head {
            return Err(self.broken.mark(RingBroken::TailOutOfRange { tail, seen: self.tail_seen, head: self.head }));
        }
        self.tail_seen = tail;
        Ok(self.cap - (self.head - tail))
    }

    /// Append one record if it fits now (not yet visible: call [`publish`](Self::publish)).
    /// `fill` writes the `data_len` data bytes in place. Returns false if the ring is too
    /// full at the moment.
    pub fn try_push(
        &mut self,
        flags: u32,
        tag: u64,
        total_len: u64,
        meta: &[u8],
        data_len: u64,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<bool, RingError> {
        let mut hdr = RecordHeader {
            kind: KIND_DATA,
            flags,
            seq: self.seq,
            meta_len: meta.len() as u32,
            data_len,
            total_len,
            tag,
        };
        if meta.len() > MAX_META as usize {
            return Err(RingError::TooLarge { size: meta.len() as u64, max: u64::from(MAX_META) });
        }
        let size = hdr.size().filter(|s| *s <= self.max_record()).ok_or(RingError::TooLarge {
            size: hdr.size().unwrap_or(u64::MAX),
            max: self.max_record(),
        })?;
        let idx = self.head & (self.cap - 1);
        let to_end = self.cap - idx;
        let wrap = to_end < size;
        let need = if wrap { to_end + size } else { size };
        self.broken.check()?;
        // Free space from the tail we last saw is a lower bound (the tail only moves
        // forward); re-read the consumer's cache line only when that is not enough.
        if need > self.cap - (self.head - self.tail_seen) && need > self.free()? {
            return Ok(false);
        }
        let mut at = idx;
        if wrap {
            let pad = RecordHeader { kind: KIND_PAD, total_len: to_end, ..Default::default() }.encode();
            // SAFETY: [idx, idx+64) is inside the area (idx is 64-aligned and < cap) and
            // free: the consumer released it (checked against `tail` above).
            unsafe { self.region.write_with(idx, 64, &mut |b| b.copy_from_slice(&pad)) };
            self.head += to_end;
            at = 0;
        }
        hdr.seq = self.seq;
        let h = hdr.encode();
        let meta_at = at + HEADER_BYTES;
        let data_at = meta_at + align(meta.len() as u64).expect("≤ MAX_META");
        // SAFETY: [at, at+size) lies inside the area (no wrap: at+size ≤ cap) and is free
        // (size, plus the pad if any, ≤ free space computed from the consumer's tail).
        unsafe {
            self.region.write_with(at, 64, &mut |b| b.copy_from_slice(&h));
            if !meta.is_empty() {
                self.region.write_with(meta_at, meta.len(), &mut |b| b.copy_from_slice(meta));
            }
            if data_len > 0 {
                self.region.write_with(data_at, data_len as usize, fill);
            }
        }
        self.head += size;
        self.seq += 1;
        self.unpublished = true;
        Ok(true)
    }

    /// Make every pushed record visible and wake the consumer if it sleeps.
    pub fn publish(&mut self) {
        if self.unpublished {
            // Release: pairs with the consumer's Acquire load in `try_pop`; the records
            // written above are visible to it once it sees this head.
            self.ctrl.head.store(self.head, Ordering::Release);
            self.ctrl.data_bell.ring();
            self.unpublished = false;
            // The next record goes at `head`: take ownership of its first lines now, off
            // the critical path (they were last read by the consumer, a lap ago), so the
            // next send's stores, and with them its head store, commit without waiting
            // for that transfer. Only where the space is known free (no bouncing of lines
            // the consumer still reads).
            let idx = self.head & (self.cap - 1);
            let len = (2 * RECORD_ALIGN).min(self.cap - idx);
            if self.cap - (self.head - self.tail_seen) >= len {
                self.region.prefetch_write(idx, len);
            }
        }
    }
}

/// A DATA record as the consumer sees it (header copied and validated).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub header: RecordHeader,
    /// The meta bytes, copied to private memory.
    pub meta: Vec<u8>,
    /// Ring offset of the data bytes.
    pub data_offset: u64,
    /// Ring position just past this record (release up to here when done).
    pub end: u64,
}

/// The consumer's half.
pub struct Consumer<'a, R: Region> {
    ctrl: Ctrl<'a>,
    region: R,
    cap: u64,
    read: u64,
    released: u64,
    seq: u64,
    broken: Broken,
}

impl<'a, R: Region> Consumer<'a, R> {
    pub fn new(ctrl: Ctrl<'a>, region: R) -> Self {
        let cap = checked_capacity(&region);
        Consumer { ctrl, region, cap, read: 0, released: 0, seq: 0, broken: Broken::default() }
    }

    pub fn doorbells(&self) -> Ctrl<'a> {
        self.ctrl
    }

    pub fn is_broken(&self) -> Option<RingBroken> {
        self.broken.0
    }

    /// Take the next DATA record if one is published (skipping PAD records).
    pub fn try_pop(&mut self) -> Result<Option<Record>, RingError> {
        self.broken.check()?;
        // Acquire: pairs with the producer's Release store in `publish`.
        let head = self.ctrl.head.load(Ordering::Acquire);
        if head < self.read || head - self.released > self.cap {
            return Err(self.broken.mark(RingBroken::HeadOutOfRange { head, read: self.read, limit: self.released + self.cap }));
        }
        if head != self.read {
            // The header and the first payload line are read one after the other below:
            // start both transfers now so their latencies overlap.
            let idx = self.read & (self.cap - 1);
            self.region.prefetch(idx, (2 * RECORD_ALIGN).min(self.cap - idx).min(head - self.read));
        }
        loop {
            if head == self.read {
                return Ok(None);
            }
            let avail = head - self.read;
            let idx = self.read & (self.cap - 1);
            let to_end = self.cap - idx;
            if avail < HEADER_BYTES || idx % RECORD_ALIGN != 0 {
                return Err(self.broken.mark(RingBroken::NoRoomForHeader { avail, offset: idx }));
            }
            let mut raw = [0u8; 64];
            // SAFETY: [idx, idx+64) is inside the area (idx < cap, 64-aligned, cap a
            // multiple of 64) and published (avail ≥ 64), so the producer is done with it.
            unsafe { self.region.read(idx, &mut raw) };
            let h = RecordHeader::decode(&raw);
            match h.kind {
                KIND_PAD => {
                    if to_end > avail {
                        return Err(self.broken.mark(RingBroken::PadPastHead { offset: idx }));
                    }
                    self.read += to_end;
                }
                KIND_DATA => {
                    let size = match h.size() {
                        Some(s) if h.meta_len <= MAX_META && s <= self.cap / 2 => s,
                        _ => {
                            return Err(self.broken.mark(RingBroken::RecordOverLimits {
                                offset: idx,
                                meta_len: h.meta_len,
                                data_len: h.data_len,
                            }));
                        }
                    };
                    if size > to_end || size > avail {
                        return Err(self.broken.mark(RingBroken::RecordPastEnd { size, offset: idx }));
                    }
                    if h.seq != self.seq {
                        return Err(self.broken.mark(RingBroken::Sequence { got: h.seq, due: self.seq }));
                    }
                    if h.flags & !(FLAG_FIRST | FLAG_LAST) != 0 {
                        return Err(self.broken.mark(RingBroken::UnknownFlags { flags: h.flags }));
                    }
                    let mut meta = vec![0u8; h.meta_len as usize];
                    // SAFETY: meta lies inside the record, which was checked to be inside the
                    // area and published.
                    unsafe { self.region.read(idx + HEADER_BYTES, &mut meta) };
                    let data_offset = idx + HEADER_BYTES + align(u64::from(h.meta_len)).expect("≤ MAX_META");
                    self.read += size;
                    self.seq += 1;
                    return Ok(Some(Record { header: h, meta, data_offset, end: self.read }));
                }
                kind => return Err(self.broken.mark(RingBroken::UnknownKind { kind, offset: idx })),
            }
        }
    }

    /// Copy `dst.len()` data bytes of `rec` starting `skip` bytes in.
    pub fn read_data(&self, rec: &Record, skip: u64, dst: &mut [u8]) {
        let len = dst.len() as u64;
        assert!(skip.checked_add(len).is_some_and(|e| e <= rec.header.data_len), "read past the record's data");
        // SAFETY: the record (and so its data) was validated to lie inside the area and to
        // be published, and it is not released yet, so the producer cannot overwrite it.
        unsafe { self.region.read(rec.data_offset + skip, dst) };
    }

    /// Append `rec`'s data to `out` (one copy, straight into `out`'s spare capacity).
    pub fn append_data(&self, rec: &Record, out: &mut Vec<u8>) -> Result<(), std::collections::TryReserveError> {
        let n = rec.header.data_len as usize;
        out.try_reserve(n)?;
        let old = out.len();
        // SAFETY: capacity ≥ old + n after the reserve; `read_raw` initialises exactly
        // those n bytes (from a validated, published, unreleased record) before set_len.
        unsafe {
            self.region.read_raw(rec.data_offset, out.as_mut_ptr().add(old), n);
            out.set_len(old + n);
        }
        Ok(())
    }

    /// Ring offset of `rec`'s data, for in-place borrowing.
    pub fn data_offset(&self, rec: &Record) -> u64 {
        rec.data_offset
    }

    /// Give the producer back everything below ring position `end` (≤ what was read).
    pub fn release_to(&mut self, end: u64) {
        assert!(end >= self.released && end <= self.read, "release out of order");
        if end == self.released {
            return;
        }
        self.released = end;
        // Release: pairs with the producer's Acquire load in `free`; our reads of the
        // released bytes happen-before it overwrites them.
        self.ctrl.tail.store(end, Ordering::Release);
        self.ctrl.space_bell.ring();
    }

    /// Position of the next record to read.
    pub fn read_position(&self) -> u64 {
        self.read
    }
}
