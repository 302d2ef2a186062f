//! The connection's framing (`crate::connection`): the hello both ends send first and the
//! header of every message after it, on a SOCK_SEQPACKET socket.

/// Magic of every message header (`b"TWM1"` little-endian); a header is the magic (u32)
/// then the kind (u32).
pub const MSG_MAGIC: u32 = u32::from_le_bytes(*b"TWM1");
/// Bytes of a message header.
pub const MSG_HEADER: usize = 8;
/// Kind of the hello (the first message each way).
pub const KIND_HELLO: u32 = 0;
/// Magic at the start of a hello's body (`b"TWHELLO1"`), followed by [`PROTOCOL_VERSION`].
pub const HELLO_MAGIC: u64 = u64::from_le_bytes(*b"TWHELLO1");
/// Wire protocol version exchanged in the hello: the version of everything in `wire`
/// that travels on a connection or in the segments it sets up.
pub const PROTOCOL_VERSION: u32 = 4;
