//! What travels on a connection between two peers (after the socket's hello,
//! `connection`): the message kinds, the tensor message and the setup payload. Below
//! `peer` and `import_cache`, which both read it.

/// Wire message kinds of the peer protocol (after the connection's hello).
/// Setup: the lease table this side grants from (4-byte capacity, 1 fd).
pub const KIND_TABLE: u32 = 1;
/// A leased tensor: [`tensor_payload`] (tag, `TensorDesc`, fd slot), plus the storage's
/// fd when the message installs it (CPU: the first time a segment goes into a slot; CUDA
/// VMM: every time).
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
/// The producer's CUDA signal words (once, before its first CUDA export that names them,
/// instead of `KIND_CUDA_EVENTS` unless the consumer asked for events): device (i32),
/// lanes (u32); 1 fd: the words (`cuda::order::words`).
pub const KIND_CUDA_SIGNALS: u32 = 7;
/// Bytes of a `KIND_TENSOR` payload: tag (u64), descriptor, fd slot (u32), zero (u32).
pub const TENSOR_PAYLOAD: usize = 8 + crate::desc::DESC_SIZE + 8;

/// How many segment fds a consumer keeps per connection on the producer's behalf (its
/// *fd slots*). A CPU tensor message names a slot: with an fd attached it installs that
/// fd there (closing what the slot held), without one it uses the fd already there,
/// which must be of the segment the descriptor names. The producer chooses the slots
/// (least recently used is replaced), so a segment exported again and again travels
/// with its fd once, not with every descriptor: passing an fd costs both sides system
/// calls (SCM_RIGHTS, then `fstat` and `close` on receipt), about 2.5 µs of a 20 µs
/// torch round trip each way here. The consumer's mappings stay bounded on its own
/// terms (`PeerConfig::max_import_*`): an evicted window is mapped again from the slot's
/// fd. So a peer can make us hold at most this many of its fds.
pub const SEGMENT_FD_SLOTS: u32 = 16;

/// The fd slot of a tensor message that names none (CUDA storage).
pub const NO_FD_SLOT: u32 = u32::MAX;

/// The `KIND_TENSOR` payload (public for tools and tests that speak the wire protocol).
pub fn tensor_payload(tag: u64, desc: &crate::desc::TensorDesc, fd_slot: u32) -> [u8; TENSOR_PAYLOAD] {
    let mut p = [0u8; TENSOR_PAYLOAD];
    p[..8].copy_from_slice(&tag.to_le_bytes());
    p[8..8 + crate::desc::DESC_SIZE].copy_from_slice(desc.encode());
    p[8 + crate::desc::DESC_SIZE..TENSOR_PAYLOAD - 4].copy_from_slice(&fd_slot.to_le_bytes());
    p
}

/// A `KIND_TENSOR` payload's parts after its shape is checked: tag, the descriptor's
/// bytes (decoded and validated by the caller), fd slot.
pub(crate) fn split_tensor_payload(p: &[u8]) -> crate::error::Result<(u64, &[u8], u32)> {
    use crate::desc::DESC_SIZE;
    if p.len() != TENSOR_PAYLOAD {
        return Err(crate::error::Error::Protocol(format!("tensor message has {} bytes, expected {TENSOR_PAYLOAD}", p.len())));
    }
    let tail = &p[8 + DESC_SIZE..];
    if tail[4..] != [0; 4] {
        return Err(crate::error::Error::Protocol("tensor message: the 4 bytes after its fd slot must be zero".into()));
    }
    let tag = u64::from_le_bytes(p[..8].try_into().expect("8 bytes"));
    let slot = u32::from_le_bytes(tail[..4].try_into().expect("4 bytes"));
    Ok((tag, &p[8..8 + DESC_SIZE], slot))
}

/// What a `KIND_TENSOR` payload of the protocol's size names, read from its raw bytes
/// before (and whatever) any check of them: for giving its lease back when the message is
/// refused, asking for a lost slot's fd again, and saying which tag was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Named {
    pub(crate) tag: u64,
    /// The lease its descriptor's storage reference names (`TensorDesc` is a fixed
    /// `#[repr(C)]` Pod struct, so the offsets of `storage.lease_slot` and
    /// `storage.lease_gen` are known).
    pub(crate) lease: crate::lease::LeaseId,
    pub(crate) fd_slot: u32,
}

/// [`Named`] of a `KIND_TENSOR` payload; `None` for a payload of another size, which is
/// not the protocol's layout and names nothing.
pub(crate) fn named_in_tensor_payload(p: &[u8]) -> Option<Named> {
    use crate::desc::{TensorDesc, DESC_SIZE};
    if p.len() != TENSOR_PAYLOAD {
        return None;
    }
    let u32_at = |at: usize| u32::from_le_bytes(p[at..at + 4].try_into().expect("4 bytes inside the payload"));
    let desc = 8;
    let slot = u32_at(desc + std::mem::offset_of!(TensorDesc, storage.lease_slot));
    let generation = u32_at(desc + std::mem::offset_of!(TensorDesc, storage.lease_gen));
    Some(Named {
        tag: u64::from_le_bytes(p[..8].try_into().expect("8 bytes inside the payload")),
        lease: crate::lease::LeaseId { slot, generation },
        fd_slot: u32_at(desc + DESC_SIZE),
    })
}

/// `KIND_TABLE` flag: a `KIND_CUDA_RING` message follows.
pub const SETUP_HAS_CUDA_RING: u32 = 1;
/// `KIND_TABLE` flag: this side waits on IPC events (`CudaWait::Event`): the producer
/// records them for its CUDA exports rather than writing signal words.
pub const SETUP_WANTS_EVENTS: u32 = 2;
/// Every `KIND_TABLE` flag this build knows.
pub(crate) const SETUP_FLAGS: u32 = SETUP_HAS_CUDA_RING | SETUP_WANTS_EVENTS;

/// The `KIND_TABLE` payload: lease table capacity, ring data bytes (0: no ring), flags
/// (`SETUP_*`). Public for tools and tests that speak the wire protocol.
pub fn setup_payload(table_capacity: u32, ring_bytes: u64, flags: u32) -> Vec<u8> {
    let mut p = table_capacity.to_le_bytes().to_vec();
    p.extend_from_slice(&ring_bytes.to_le_bytes());
    p.extend_from_slice(&flags.to_le_bytes());
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desc::{DType, Layout, StorageKind, StorageRef, TensorDesc};
    use bytemuck::Zeroable;

    #[test]
    fn the_lease_and_slot_are_read_from_the_raw_payload() {
        let l = Layout::contiguous(DType::Float32, &[4]).unwrap();
        let mut d = TensorDesc::new(&l, StorageKind::Segment, StorageRef { lease_slot: 7, lease_gen: 0xdead_beef, ..Zeroable::zeroed() });
        d.dtype = 250; // invalid: the raw read does not care
        let p = tensor_payload(41, &d, 3);
        let lease = crate::lease::LeaseId { slot: 7, generation: 0xdead_beef };
        assert_eq!(named_in_tensor_payload(&p), Some(Named { tag: 41, lease, fd_slot: 3 }));
        assert_eq!(named_in_tensor_payload(&p[1..]), None);
    }
}
