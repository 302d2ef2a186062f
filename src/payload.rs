//! The peer protocol's payloads built and split: the tensor message (`KIND_TENSOR`) and
//! the setup message (`KIND_TABLE`). Their kinds, sizes and flags are in
//! `crate::wire::messages`.

use crate::desc::{TensorDesc, DESC_SIZE};
use crate::error::{Error, Result};
use crate::lease::LeaseId;
use crate::wire::messages::{SETUP_PAYLOAD, TENSOR_PAYLOAD};

/// The `KIND_TENSOR` payload (public for tools and tests that speak the wire protocol).
pub fn tensor_payload(tag: u64, desc: &TensorDesc, fd_slot: u32) -> [u8; TENSOR_PAYLOAD] {
    let mut p = [0u8; TENSOR_PAYLOAD];
    p[..8].copy_from_slice(&tag.to_le_bytes());
    p[8..8 + DESC_SIZE].copy_from_slice(desc.encode());
    p[8 + DESC_SIZE..TENSOR_PAYLOAD - 4].copy_from_slice(&fd_slot.to_le_bytes());
    p
}

/// A `KIND_TENSOR` payload's parts after its shape is checked: tag, the descriptor's
/// bytes (decoded and validated by the caller), fd slot.
pub(crate) fn split_tensor_payload(p: &[u8]) -> Result<(u64, &[u8], u32)> {
    if p.len() != TENSOR_PAYLOAD {
        return Err(Error::Protocol(format!("tensor message has {} bytes, expected {TENSOR_PAYLOAD}", p.len())));
    }
    let tail = &p[8 + DESC_SIZE..];
    if tail[4..] != [0; 4] {
        return Err(Error::Protocol("tensor message: the 4 bytes after its fd slot must be zero".into()));
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
    pub(crate) lease: LeaseId,
    pub(crate) fd_slot: u32,
}

/// [`Named`] of a `KIND_TENSOR` payload; `None` for a payload of another size, which is
/// not the protocol's layout and names nothing.
pub(crate) fn named_in_tensor_payload(p: &[u8]) -> Option<Named> {
    if p.len() != TENSOR_PAYLOAD {
        return None;
    }
    let u32_at = |at: usize| u32::from_le_bytes(p[at..at + 4].try_into().expect("4 bytes inside the payload"));
    let desc = 8;
    let slot = u32_at(desc + std::mem::offset_of!(TensorDesc, storage.lease_slot));
    let generation = u32_at(desc + std::mem::offset_of!(TensorDesc, storage.lease_gen));
    Some(Named {
        tag: u64::from_le_bytes(p[..8].try_into().expect("8 bytes inside the payload")),
        lease: LeaseId { slot, generation },
        fd_slot: u32_at(desc + DESC_SIZE),
    })
}

/// The `KIND_TABLE` payload: lease table capacity, ring data bytes (0: no ring), flags
/// (`SETUP_*`). Public for tools and tests that speak the wire protocol.
pub fn setup_payload(table_capacity: u32, ring_bytes: u64, flags: u32) -> Vec<u8> {
    let mut p = Vec::with_capacity(SETUP_PAYLOAD);
    p.extend_from_slice(&table_capacity.to_le_bytes());
    p.extend_from_slice(&ring_bytes.to_le_bytes());
    p.extend_from_slice(&flags.to_le_bytes());
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desc::{DType, Layout, StorageKind, StorageRef};
    use bytemuck::Zeroable;

    #[test]
    fn the_lease_and_slot_are_read_from_the_raw_payload() {
        let l = Layout::contiguous(DType::Float32, &[4]).unwrap();
        let mut d = TensorDesc::new(&l, StorageKind::Segment, StorageRef { lease_slot: 7, lease_gen: 0xdead_beef, ..Zeroable::zeroed() });
        d.dtype = 250; // invalid: the raw read does not care
        let p = tensor_payload(41, &d, 3);
        let lease = LeaseId { slot: 7, generation: 0xdead_beef };
        assert_eq!(named_in_tensor_payload(&p), Some(Named { tag: 41, lease, fd_slot: 3 }));
        assert_eq!(named_in_tensor_payload(&p[1..]), None);
    }
}
