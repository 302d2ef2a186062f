//! One direction's GPU bounce ring (`crate::cuda::ring`): the setup message, the control
//! segment both processes write, and the chunk records of its descriptor ring. Its signal
//! words (the setup's third fd) are `2 × slots` lanes in the layout of
//! [`super::signal_words`]: lane `slot` is the slot's *written* word (raised by the
//! producer's stream), lane `slots + slot` its *read* word (raised by the consumer's).

/// Most slots per ring.
pub const MAX_SLOTS: u32 = 1024;
/// Smallest and largest slot.
pub const MIN_SLOT_BYTES: u64 = 4096;
pub const MAX_SLOT_BYTES: u64 = 1 << 32;

/// Bytes of the setup message before its `slots` 64-byte event handles: device (i32),
/// slots (u32), slot bytes (u64), descriptor ring bytes (u64), arena IPC handle (64),
/// flags (u32).
pub const SETUP_FIXED: usize = 4 + 4 + 8 + 8 + 64 + 4;
/// Setup flag: the producer offers the ring's signal words (a third fd).
pub const SETUP_WORDS: u32 = 1;

/// Control segment layout (created by the producer, written by both; each word on its
/// own cache line): the consumer's `freed` count and its doorbell, the consumer's state,
/// how it orders its copies (`MODE_*`), then its `slots` 64-byte read-event handles.
pub const FREED_AT: usize = 0;
pub const BELL_AT: usize = 64;
pub const STATE_AT: usize = 128;
pub const MODE_AT: usize = 192;
pub const HANDLES_AT: usize = 256;
/// The consumer's choice, written before it says READY: the ring's signal words, or IPC
/// events.
pub const MODE_WORDS: u32 = 1;
pub const MODE_EVENTS: u32 = 2;
/// Consumer states: 0 not yet opened; opened, read events published; could not open;
/// broken (it found a bad record or lost a message part-way and frees nothing more);
/// closed (about to destroy its read events: the producer must not touch them again).
pub const STATE_READY: u32 = 1;
pub const STATE_REFUSED: u32 = 2;
pub const STATE_BROKEN: u32 = 3;
pub const STATE_CLOSED: u32 = 4;

/// Chunk records: a 64-byte header (magic u32 `b"TWGR"`, flags u32, seq u64, offset u64,
/// len u64, total u64, zeros), plus the message's descriptor in the first chunk.
pub const REC_MAGIC: u32 = u32::from_le_bytes(*b"TWGR");
pub const REC_HEADER: usize = 64;
pub const FLAG_FIRST: u32 = 1;
pub const FLAG_LAST: u32 = 2;
