//! The CPU ring segment (`crate::ring`): its header, the two control lines, the data area
//! and the records in it (`crate::ring::spsc`).

/// A ring segment's magic (`b"TWRING01"`), at offset 0; version (u32) at 8, capacity
/// (u64) at 16, stamp salt (u64) at [`SALT_AT`].
pub const RING_MAGIC: u64 = u64::from_le_bytes(*b"TWRING01");
/// Version 2: records are published by their own stamps (no shared head counter).
pub const RING_VERSION: u32 = 2;
pub const VERSION_AT: usize = 8;
pub const CAPACITY_AT: usize = 16;
pub const SALT_AT: usize = 24;
/// The producer writes one cache line (the data doorbell it rings), the consumer another
/// (tail + the space doorbell it rings). These are offsets in a format both processes
/// map, so the separation is spelled out in bytes (`CachePadded`'s alignment is the
/// compiler's per-target choice, no layout to share with another build).
pub const DATA_BELL_AT: usize = 64;
pub const TAIL_AT: usize = 128;
pub const SPACE_BELL_AT: usize = 136;
/// The bit every stamp salt has set.
pub const SALT_TOP_BIT: u64 = 1 << 63;
/// Offset of the data area in the ring segment.
pub const DATA_OFFSET: usize = 4096;
/// Smallest and largest data area.
pub const MIN_RING_BYTES: usize = 4096;
pub const MAX_RING_BYTES: usize = 1 << 34;

/// Records: each starts on this alignment with a header line.
pub const RECORD_ALIGN: u64 = 64;
/// Bytes of a record's header line.
pub const HEADER_BYTES: u64 = 64;
/// Bytes of a header line that hold its fields (copied to private memory as one).
pub const FIELDS_BYTES: usize = 56;
/// Offset of the stamp word in a header line.
pub const STAMP_AT: u64 = 56;
/// Largest `meta` part of a record (a tensor descriptor fits).
pub const MAX_META: u32 = 1024;
/// Record kinds.
pub const KIND_DATA: u32 = 1;
pub const KIND_PAD: u32 = 2;
/// First record of a message.
pub const FLAG_FIRST: u32 = 1;
/// Last record of a message.
pub const FLAG_LAST: u32 = 2;
