//! The lease table segment (`crate::lease::table`): its header and the slot words after
//! it (`crate::lease::slot`).

/// A table's magic (`b"TWLEASE1"`), at offset 0; the version (u32) at 8, the capacity
/// (u32) at 12.
pub const TABLE_MAGIC: u64 = u64::from_le_bytes(*b"TWLEASE1");
/// Version of the table layout (checked when the peer's table is opened).
pub const TABLE_VERSION: u32 = 2;
/// Offset of the capacity in the header.
pub const CAPACITY_AT: usize = 12;
/// Offset of the producer's line (`lease::MessageLine`: its message doorbell and CPU
/// hint); the consumer's release doorbell and lost-fd-slot bits share the first line.
pub const MESSAGE_LINE_OFFSET: usize = 64;
/// Bytes before the first slot word.
pub const TABLE_HEADER_BYTES: usize = 128;
/// Bytes of one slot word (`generation << 32 | state`).
pub const SLOT_BYTES: usize = 8;

/// Slot states (the low 32 bits of a slot word).
pub const FREE: u32 = 0;
pub const LIVE: u32 = 1;
pub const RELEASED: u32 = 2;
pub const EXPIRED: u32 = 3;
