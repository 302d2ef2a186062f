//! The single-producer/single-consumer record protocol of a bounce-buffer ring.
//!
//! Written only against `crate::sync` and the [`Region`] trait, so `loom/tests/loom_ring.rs`
//! model-checks this exact code with loom atomics and `UnsafeCell` bytes (which also
//! catches unsynchronised access to record payloads, not just to the control words).
//!
//! Layout of the data area (a power of two, `cap` bytes): variable-size records, each a
//! 64-byte header line, then `meta` (≤ `MAX_META` bytes) and `data`, each padded to 64
//! bytes. A record never wraps: when it does not fit before the end, the producer first
//! writes a PAD record that covers the rest of the area and starts again at 0. The header
//! line holds the fields (kind u32 at 0, flags u32 at 4, seq u64 at 8, meta_len u32 at 16,
//! data_len u64 at 24, total_len u64 at 32, tag u64 at 40; the rest zero) in its first
//! [`FIELDS_BYTES`] bytes and the record's **stamp**, a u64, in its last 8 ([`STAMP_AT`]).
//!
//! **Publishing is per record.** Positions are monotonic byte counters (`pos & (cap - 1)`
//! is the offset). The producer writes a record's meta, data and header fields, then
//! Release-stores its stamp, [`stamp`]`(salt, pos)`. The consumer Acquire-loads the stamp
//! word at its read position and takes the record once it holds that value: it copies the
//! header fields to private memory, validates them, and only then touches meta or data.
//! So the consumer learns of a record from the line it must read anyway (the header's),
//! and a waiting consumer polls exactly that line, with the first data line beside it;
//! there is no shared head counter to read first and no doorbell on the fast path.
//!
//! Why `pos ^ salt` (the salt: a random u64 with its top bit set, fixed per ring in the
//! segment header): it differs for every position, so a record of an earlier lap at the
//! same offset never passes for the one awaited now; a zeroed area matches only the
//! position equal to the salt (≥ 2^63 bytes into the ring: never reached); and an offset
//! that held data bytes in an earlier lap (records differ in size, so an offset is a header
//! in one lap and data in another) matches only if those bytes equal the stamp, which the
//! sender of the data cannot arrange without the salt (a client feeding bytes to a process
//! that forwards them through a ring cannot forge a record). A stamp that does not match is
//! never an error: it is what an unpublished position holds.
//!
//! The consumer releases with a Release store of `tail` once it is done with the bytes
//! below it; the producer Acquire-loads `tail` before reusing them. Either side treats what
//! the other writes as hostile: a tail outside what the protocol allows, or a published
//! record whose header breaks a rule, marks the ring broken (an error, never an
//! out-of-bounds access or an endless loop).
//!
//! **Waking.** The producer rings the data doorbell once per batch ([`Producer::publish`],
//! after the batch's stamps); a consumer about to sleep reads the doorbell's sequence,
//! then checks the stamp ([`Consumer::ready`]), then sleeps on that sequence: a record
//! stamped after the check is rung after the read, so the sleep returns at once (the
//! doorbell's own waiter count makes the wake-up itself Dekker-safe; `crate::doorbell`).
//! The producer rings on every publish, not only when the consumer may be asleep: skipping
//! the ring safely would take a StoreLoad fence between the stamp store and a load of the
//! waiter count, which costs what the ring's one locked add costs, and the ring's line
//! stays in the producer's cache (the consumer reads it only before it sleeps).

pub use crate::error::ring::{RingBroken, RingError};
use super::broken::Broken;
use crate::doorbell::Doorbell;
use crate::sync::{AtomicU64, Ordering};

pub use crate::wire::ring::{FIELDS_BYTES, FLAG_FIRST, FLAG_LAST, HEADER_BYTES, KIND_DATA, KIND_PAD, MAX_META, RECORD_ALIGN, STAMP_AT};
/// Most bytes past its head the producer takes ownership of after publishing (see
/// [`Producer::publish`]): a 4 KiB message's record and more, never a large chunk's.
const PREFETCH_AHEAD: u64 = 8 << 10;

/// `n` rounded up to the record alignment (None on overflow).
pub fn align(n: u64) -> Option<u64> {
    n.checked_add(RECORD_ALIGN - 1).map(|v| v & !(RECORD_ALIGN - 1))
}

/// The stamp that publishes the record at ring position `pos` of a ring with `salt`.
pub fn stamp(salt: u64, pos: u64) -> u64 {
    pos ^ salt
}

/// A record header as copied to private memory (its fields; the stamp is separate).
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
    /// The fields as they lie in the header line (its first `FIELDS_BYTES` bytes).
    pub fn encode(&self) -> [u8; FIELDS_BYTES] {
        let mut b = [0u8; FIELDS_BYTES];
        b[0..4].copy_from_slice(&self.kind.to_le_bytes());
        b[4..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..20].copy_from_slice(&self.meta_len.to_le_bytes());
        b[24..32].copy_from_slice(&self.data_len.to_le_bytes());
        b[32..40].copy_from_slice(&self.total_len.to_le_bytes());
        b[40..48].copy_from_slice(&self.tag.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; FIELDS_BYTES]) -> RecordHeader {
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
    /// The stamp word of the header line at offset `at` (the u64 at `at + STAMP_AT`). While
    /// the line is a header, that word is only accessed atomically; `write_with` and
    /// `read` of header fields never cover it.
    ///
    /// # Safety
    /// `at` is a multiple of 64 below `capacity()`.
    unsafe fn stamp(&self, at: u64) -> &AtomicU64;
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

/// The shared control words of one ring, and its salt.
#[derive(Clone, Copy)]
pub struct Ctrl<'a> {
    /// Written by the consumer: every byte below it is released.
    pub tail: &'a AtomicU64,
    /// Rung by the producer after publishing; the consumer sleeps on it.
    pub data_bell: Doorbell<'a>,
    /// Rung by the consumer after releasing; the producer sleeps on it when full.
    pub space_bell: Doorbell<'a>,
    /// The ring's stamp salt (see the module docs), copied to private memory.
    pub salt: u64,
}

/// The data area's capacity, checked: a power of two, at least 256 bytes.
fn checked_capacity(region: &impl Region) -> u64 {
    let cap = region.capacity();
    assert!(cap.is_power_of_two() && cap >= 256, "ring capacity must be a power of two ≥ 256");
    cap
}

/// Whether the header line at `at` carries the stamp `expect`.
fn stamped(region: &impl Region, at: u64, expect: u64) -> bool {
    // SAFETY: callers pass a record offset: `pos & (cap - 1)` of a 64-aligned position.
    // Acquire: pairs with the producer's Release store in `Producer::put_header`; the
    // record's bytes are visible once its stamp is.
    unsafe { region.stamp(at) }.load(Ordering::Acquire) == expect
}

/// The producer's half. Private state only; the shared words are read as hostile.
pub struct Producer<'a, R: Region> {
    ctrl: Ctrl<'a>,
    region: R,
    cap: u64,
    head: u64,
    tail_seen: u64,
    seq: u64,
    /// Records stamped since the data doorbell last rang.
    unrung: bool,
    /// Bytes of the last record pushed (what the next one likely needs).
    last_size: u64,
    broken: Broken,
}

impl<'a, R: Region> Producer<'a, R> {
    /// A producer over a fresh ring (head = tail = 0).
    pub fn new(ctrl: Ctrl<'a>, region: R) -> Self {
        let cap = checked_capacity(&region);
        Producer { ctrl, region, cap, head: 0, tail_seen: 0, seq: 0, unrung: false, last_size: 0, broken: Broken::default() }
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

    /// Whether the consumer's tail moved since a push last found the ring too full (what
    /// a sender waiting for space polls; the next push validates it).
    pub fn tail_moved(&self) -> bool {
        // Acquire: pairs with the consumer's Release store in `Consumer::release_to` (a
        // hint only: `free` loads it again before any byte is reused).
        self.ctrl.tail.load(Ordering::Acquire) != self.tail_seen
    }

    /// Write `hdr`'s fields into the header line at `at`, then publish the record: the
    /// Release store of the stamp of position `pos`.
    ///
    /// # Safety
    /// `at` is a multiple of 64 below the capacity, the record at `at` lies in free space,
    /// and its meta and data are written.
    unsafe fn put_header(&self, at: u64, pos: u64, hdr: &RecordHeader) {
        let fields = hdr.encode();
        // SAFETY: forwarded from the caller; the fields end before the stamp word.
        unsafe {
            self.region.write_with(at, FIELDS_BYTES, &mut |b| b.copy_from_slice(&fields));
            // Release: pairs with the consumer's Acquire load in `stamped`: everything
            // written to the record above is visible to it once it sees this stamp.
            self.region.stamp(at).store(stamp(self.ctrl.salt, pos), Ordering::Release);
        }
    }

    /// Append one record if it fits now. `fill` writes the `data_len` data bytes in
    /// place. The record is visible to the consumer at once (its stamp); a sleeping
    /// consumer wakes at [`publish`](Self::publish). Returns false if the ring is too full
    /// at the moment.
    pub fn try_push(
        &mut self,
        flags: u32,
        tag: u64,
        total_len: u64,
        meta: &[u8],
        data_len: u64,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<bool, RingError> {
        if meta.len() > MAX_META as usize {
            return Err(RingError::TooLarge { size: meta.len() as u64, max: u64::from(MAX_META) });
        }
        let hdr = RecordHeader { kind: KIND_DATA, flags, seq: self.seq, meta_len: meta.len() as u32, data_len, total_len, tag };
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
            let pad = RecordHeader { kind: KIND_PAD, total_len: to_end, ..Default::default() };
            // SAFETY: idx is 64-aligned and < cap; the pad covers [idx, cap), free space
            // (checked against the consumer's tail above), and holds nothing but its header.
            unsafe { self.put_header(idx, self.head, &pad) };
            self.head += to_end;
            at = 0;
        }
        let meta_at = at + HEADER_BYTES;
        let data_at = meta_at + align(meta.len() as u64).expect("≤ MAX_META");
        // SAFETY: [at, at+size) lies inside the area (no wrap: at+size ≤ cap) and is free
        // (size, plus the pad if any, ≤ free space computed from the consumer's tail); the
        // header goes last, after the meta and data it publishes.
        unsafe {
            if !meta.is_empty() {
                self.region.write_with(meta_at, meta.len(), &mut |b| b.copy_from_slice(meta));
            }
            if data_len > 0 {
                self.region.write_with(data_at, data_len as usize, fill);
            }
            self.put_header(at, self.head, &hdr);
        }
        self.head += size;
        self.seq += 1;
        self.last_size = size;
        self.unrung = true;
        Ok(true)
    }

    /// Wake the consumer if it sleeps: ring the data doorbell, once for every record
    /// pushed since the last call (they are visible already).
    pub fn publish(&mut self) {
        if !self.unrung {
            return;
        }
        self.unrung = false;
        self.ctrl.data_bell.ring();
        // The next record goes at `head`: take ownership of as many lines as the last
        // record had (they were last read by the consumer, a lap ago) now, off the critical
        // path, so the next send's stores commit without waiting for those transfers. Only
        // where the space is known free (no bouncing of lines the consumer still reads).
        let idx = self.head & (self.cap - 1);
        let len = self.last_size.clamp(2 * RECORD_ALIGN, PREFETCH_AHEAD).min(self.cap - idx);
        if self.cap - (self.head - self.tail_seen) >= len {
            self.region.prefetch_write(idx, len);
        }
    }
}

/// A DATA record as the consumer sees it (header copied and validated).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    pub header: RecordHeader,
    /// Ring offset of the meta bytes (`header.meta_len` of them).
    pub meta_offset: u64,
    /// Ring offset of the data bytes.
    pub data_offset: u64,
    /// Ring position just past this record (release up to here when done).
    pub end: u64,
}

/// The stamp a consumer awaits, detached from the consumer: a spin can poll it without
/// access to the consumer's state (the receiver polls it without holding its lock).
pub struct Watch<R> {
    region: R,
    at: u64,
    expect: u64,
}

impl<R: Region> Watch<R> {
    /// Whether the awaited record is published (as [`Consumer::ready`] would say now).
    pub fn ready(&self) -> bool {
        // Keep the line after the header (a small record's data) in our cache while we
        // wait: the producer takes both lines over to write them, and we pull both back
        // together when the stamp turns, instead of the data line after the header line.
        let next = self.at + HEADER_BYTES;
        if next < self.region.capacity() {
            self.region.prefetch(next, HEADER_BYTES);
        }
        stamped(&self.region, self.at, self.expect)
    }
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

    /// Whether the record at the read position is published: what a consumer about to
    /// sleep checks after reading the data doorbell's sequence (see the module docs).
    pub fn ready(&self) -> bool {
        stamped(&self.region, self.read & (self.cap - 1), stamp(self.ctrl.salt, self.read))
    }

    /// The stamp [`ready`](Self::ready) awaits, to poll without this consumer.
    pub fn watch(&self) -> Watch<R>
    where
        R: Clone,
    {
        Watch { region: self.region.clone(), at: self.read & (self.cap - 1), expect: stamp(self.ctrl.salt, self.read) }
    }

    /// Take the next DATA record if one is published (skipping PAD records).
    // Inlined: its result, returned through memory, costs store-forwarding stalls.
    #[inline]
    pub fn try_pop(&mut self) -> Result<Option<Record>, RingError> {
        self.broken.check()?;
        // Ends in at most cap/64 rounds: each PAD moves `read` forward by ≥ 64 bytes, and
        // none may reach past `released + cap`.
        loop {
            let idx = self.read & (self.cap - 1);
            if !stamped(&self.region, idx, stamp(self.ctrl.salt, self.read)) {
                return Ok(None);
            }
            let to_end = self.cap - idx;
            if to_end > HEADER_BYTES {
                // The first line after the header (meta or data) is read next: start its
                // transfer now so that it overlaps the header's validation.
                self.region.prefetch(idx + HEADER_BYTES, HEADER_BYTES);
            }
            // Bytes from the read position that the producer may write: not those we still
            // hold (read, not yet released), a lap back. `read - released ≤ cap` always.
            let room = self.released + self.cap - self.read;
            let mut raw = [0u8; FIELDS_BYTES];
            // SAFETY: [idx, idx+56) is inside the area (idx < cap, 64-aligned, cap a
            // multiple of 64) and published (its stamp matched), so the producer is done
            // with it; it ends before the stamp word.
            unsafe { self.region.read(idx, &mut raw) };
            let h = RecordHeader::decode(&raw);
            match h.kind {
                KIND_PAD => {
                    if to_end > room {
                        return Err(self.broken.mark(RingBroken::PadOverHeld { offset: idx }));
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
                    if size > to_end || size > room {
                        return Err(self.broken.mark(RingBroken::RecordPastEnd { size, offset: idx }));
                    }
                    if h.seq != self.seq {
                        return Err(self.broken.mark(RingBroken::Sequence { got: h.seq, due: self.seq }));
                    }
                    if h.flags & !(FLAG_FIRST | FLAG_LAST) != 0 {
                        return Err(self.broken.mark(RingBroken::UnknownFlags { flags: h.flags }));
                    }
                    let meta_offset = idx + HEADER_BYTES;
                    let data_offset = meta_offset + align(u64::from(h.meta_len)).expect("≤ MAX_META");
                    self.read += size;
                    self.seq += 1;
                    return Ok(Some(Record { header: h, meta_offset, data_offset, end: self.read }));
                }
                kind => return Err(self.broken.mark(RingBroken::UnknownKind { kind, offset: idx })),
            }
        }
    }

    /// Copy `rec`'s meta bytes (all `header.meta_len` of them) to `dst`.
    pub fn read_meta(&self, rec: &Record, dst: &mut [u8]) {
        assert_eq!(dst.len() as u64, u64::from(rec.header.meta_len), "meta is read whole");
        // SAFETY: the meta part lies inside the record, which was validated to lie inside
        // the area and to be published, and is not released yet.
        unsafe { self.region.read(rec.meta_offset, dst) };
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
