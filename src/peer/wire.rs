//! Wire message kinds of the peer protocol and the setup payload.

/// Wire message kinds of the peer protocol (after the connection's hello).
/// Setup: the lease table this side grants from (4-byte capacity, 1 fd).
pub const KIND_TABLE: u32 = 1;
/// A leased tensor: 8-byte tag + `TensorDesc`, plus the segment's fd (CPU: every time;
/// the consumer maps only the range named and may have evicted an earlier mapping).
pub const KIND_TENSOR: u32 = 2;
/// The producer dropped a segment the consumer holds no lease on (8-byte id).
pub const KIND_FORGET: u32 = 3;
/// A user message.
pub const KIND_USER: u32 = 4;
/// The producer's CUDA IPC event pool (once, before its first CUDA export): device (i32),
/// count (u32), count x 64-byte event handles; 1 fd: the ack table.
pub const KIND_CUDA_EVENTS: u32 = 5;
/// Setup, right after `KIND_TABLE` when its flags say so: this side's GPU bounce ring
/// (`cuda::ring::RingSetup`); 2 fds: control segment, descriptor ring.
pub const KIND_CUDA_RING: u32 = 6;
/// `KIND_TABLE` flag: a `KIND_CUDA_RING` message follows.
pub(super) const SETUP_HAS_CUDA_RING: u32 = 1;

/// The `KIND_TABLE` payload: lease table capacity, ring data bytes (0: no ring), flags
/// (a GPU ring setup follows). Public for tools and tests that speak the wire protocol.
pub fn setup_payload(table_capacity: u32, ring_bytes: u64, cuda_ring: bool) -> Vec<u8> {
    let mut p = table_capacity.to_le_bytes().to_vec();
    p.extend_from_slice(&ring_bytes.to_le_bytes());
    p.extend_from_slice(&(if cuda_ring { SETUP_HAS_CUDA_RING } else { 0 }).to_le_bytes());
    p
}
