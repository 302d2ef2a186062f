//! A message taken from a ring: its bytes copied out, or still in the ring (borrowed)
//! until it is dropped.

use crate::desc::TensorDesc;
use std::sync::Arc;

/// Where a borrowed message's bytes go back to (the receiver's state), in ring order.
pub(super) trait Release: Send + Sync {
    /// The record ending at ring position `end` is done with.
    fn release(&self, end: u64);
}

/// Keeps a borrowed region unreleased; dropping it releases in ring order.
pub(super) struct BorrowToken {
    pub(super) to: Option<Arc<dyn Release>>,
    pub(super) end: u64,
}

impl Drop for BorrowToken {
    fn drop(&mut self) {
        if let Some(r) = self.to.take() {
            r.release(self.end);
        }
    }
}

/// How a received message's bytes are held.
pub(super) enum Data {
    Owned(Vec<u8>),
    Borrowed { ptr: *const u8, len: usize, _token: BorrowToken },
}

// SAFETY: a borrowed message points into the ring mapping, which its token keeps alive;
// the bytes are only read through explicit copies or by the holder.
unsafe impl Send for Data {}

/// One received message.
pub struct RingMessage {
    pub tag: u64,
    /// For tensors: the (contiguous) layout, storage kind `RingSlot`, nbytes = data length.
    pub desc: Option<TensorDesc>,
    pub(super) data: Data,
}

impl std::fmt::Debug for RingMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingMessage")
            .field("tag", &self.tag)
            .field("tensor", &self.desc.map(|d| d.layout()))
            .field("len", &self.len())
            .field("borrowed", &self.is_borrowed())
            .finish()
    }
}

impl RingMessage {
    pub fn len(&self) -> usize {
        match &self.data {
            Data::Owned(v) => v.len(),
            Data::Borrowed { len, .. } => *len,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// True if the bytes are still in the ring (released when this is dropped).
    pub fn is_borrowed(&self) -> bool {
        matches!(self.data, Data::Borrowed { .. })
    }
    /// Address of the bytes (in the ring for a borrowed message; the producer side may
    /// be hostile and scribble them, so copy before trusting).
    pub fn as_ptr(&self) -> *const u8 {
        match &self.data {
            Data::Owned(v) => v.as_ptr(),
            Data::Borrowed { ptr, .. } => *ptr,
        }
    }
    /// The bytes, copied to (or already in) private memory.
    pub fn into_vec(self) -> Vec<u8> {
        match self.data {
            Data::Owned(v) => v,
            Data::Borrowed { ptr, len, .. } => {
                let mut v = vec![0u8; len];
                // SAFETY: the token (dropped after this copy) keeps [ptr, ptr+len) in the
                // ring unreleased and mapped.
                unsafe { std::ptr::copy_nonoverlapping(ptr, v.as_mut_ptr(), len) };
                v
            }
        }
    }
    /// The bytes of an owned message.
    pub fn owned(&self) -> Option<&[u8]> {
        match &self.data {
            Data::Owned(v) => Some(v),
            Data::Borrowed { .. } => None,
        }
    }
}
