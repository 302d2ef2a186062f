//! GPU bounce ring: one device arena per direction per connection, registered once, that
//! any CUDA tensor is copied through — no handle is opened per message.
//!
//! The producer allocates the arena (`slots` × `slot_bytes`, `cuMemAlloc`, one legacy IPC
//! handle), the ring's signal words (`words`: a written and a read word per slot, in a
//! memfd both sides register with CUDA), `slots` interprocess "written" events for a
//! consumer that cannot use the words, a small control segment and a CPU ring for
//! descriptors, and sends them once at connection setup. The consumer opens the arena once
//! and registers the words — or, under `CudaWait::Event` or where that fails, opens the
//! events and publishes its own "read" events — and says which in the control segment.
//!
//! A send of `n` bytes goes through `⌈n / slot_bytes⌉` chunks (at least one). Chunk `seq`
//! takes slot `seq % slots`, as its use `u = seq / slots + 1`:
//!
//! ```text
//! producer (its stream)                          consumer (its stream)
//!   wait credit: seq − freed < slots   (CPU)
//!   stream waits read[slot] ≥ u − 1  (if reused)
//!   cuMemcpyDtoDAsync  src → slot
//!   stream writes written[slot] = u
//!   push record (seq, offset, len[, desc])  ──►  pop record, validate
//!                                                stream waits written[slot] ≥ u
//!                                                cuMemcpyDtoDAsync  slot → dst
//!                                                stream writes read[slot] = u
//!                                     ◄──  freed = seq + 1  (credits::free)
//! ```
//!
//! Neither thread blocks on the GPU under the default policy: each wait is checked on the
//! host first and otherwise made by the stream, watched (`words`). Under `CudaWait::Host`
//! the waiting thread polls the word instead. With events the same steps record and wait
//! for events; an event is re-recorded only after the other side has enqueued its wait on
//! the previous record (`written[slot]` again only after the consumer freed the slot, which
//! it does after enqueueing its wait; `read[slot]` again only after the producer published
//! the slot's next use), so `cuStreamWaitEvent`, which captures an event's most recent
//! record when it is called, always captures the intended one — and those waits are made
//! on the host unless the policy is `Event`.
//!
//! The consumer receives in two steps, so the caller can allocate the destination once it
//! knows the shape: [`CudaRingReceiver::begin`] waits for a message's first record and
//! returns its tag and descriptor; [`CudaRingReceiver::finish`] copies every chunk into the
//! caller's device memory on the caller's stream (clone-on-receive) and frees the slots;
//! [`CudaRingReceiver::discard`] frees them without copying.
//!
//! The ring carries contiguous bytes: a strided view is packed on the device first (the
//! torch extension calls `.contiguous()` on the current stream).
//!
//! Hostile peers: the consumer copies each record to private memory (the descriptor ring
//! does) and checks magic, sequence, slot bounds, offsets, the descriptor and the total
//! against its limits; the producer checks `freed` (credits) and the consumer's mode word,
//! and leaves the consumer's event handles to the driver. A peer's words can only spoil
//! the data of its own messages, or stall a wait, which the watchdog ends (the ring then
//! breaks). Any violation breaks the ring with an error naming it.

mod config;
mod control;
mod receiver;
mod sender;
mod words;

pub use config::{CudaRingConfig, RingSetup, MAX_SLOTS, MAX_SLOT_BYTES, MIN_SLOT_BYTES};
pub use receiver::CudaRingReceiver;
pub use sender::CudaRingSender;

/// Shapes the tests of the ring's parts share.
#[cfg(test)]
mod test_support {
    use super::*;
    use crate::desc::{DType, Layout, StorageKind, StorageRef, TensorDesc};
    use bytemuck::Zeroable;
    use super::control::{Chunk, FLAG_FIRST, FLAG_LAST};

    pub(super) fn cfg() -> CudaRingConfig {
        CudaRingConfig { device: 0, slots: 4, slot_bytes: 4096 }
    }

    pub(super) fn first(total: u64, len: u64) -> (Chunk, TensorDesc) {
        let l = Layout::contiguous(DType::UInt8, &[total as i64]).unwrap();
        let d = TensorDesc::new_cuda(&l, 0, StorageKind::RingSlot, StorageRef { nbytes: total, ..Zeroable::zeroed() });
        let flags = FLAG_FIRST | if len == total { FLAG_LAST } else { 0 };
        (Chunk { flags, seq: 0, offset: 0, len, total }, d)
    }
}
