//! The fixed-size tensor descriptor (`crate::desc::TensorDesc`): its size, magic, version
//! and flag bits.

/// Most dimensions a descriptor can describe.
pub const MAX_NDIM: usize = 16;
/// A descriptor's magic (`b"TWD1"` little-endian).
pub const DESC_MAGIC: u32 = u32::from_le_bytes(*b"TWD1");
/// Wire version of the descriptor.
pub const DESC_VERSION: u16 = 1;
/// Bytes of an encoded descriptor (`desc` asserts `TensorDesc` has exactly this size).
pub const DESC_SIZE: usize = 400;
/// Descriptor `flags` bit: a CUDA descriptor's `event_slot`/`event_seq` name a signal
/// word lane and value (`cuda::order::words`), not an IPC event record.
pub const FLAG_SIGNAL_WORD: u8 = 1;
