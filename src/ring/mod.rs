//! Bounce-buffer rings on CPU: one per direction per connection, registered once (a
//! sealed memfd exchanged at setup) and reused for every message.
//!
//! The producer copies a tensor view (strided views packed contiguous on the way in) or
//! bytes into the ring and publishes; the consumer copies it out (clone-on-receive) or
//! borrows it in place until it drops the borrow. Waiting is spin-then-futex on doorbells
//! in the control block, every wait bounded.
//!
//! **Large tensors go through in chunks.** A record holds at most half the data area; a
//! message larger than that is split into consecutive records (FIRST … LAST) of at most
//! 1 MiB of data each (so that copy-in and copy-out overlap), which the consumer
//! reassembles into an owned buffer. Such a message can only be received as a
//! copy; borrowing works for messages that fit one record. (For zero-copy of large
//! tensors, export them under a lease instead: `Peer::export`.)
//!
//! Segment layout: a 64-byte header (magic, version, capacity, stamp salt), then the data
//! doorbell (the producer's cache line) and `tail` with the space doorbell (the
//! consumer's), then the data area at offset 4096, whose records each carry the stamp
//! that publishes them (`spsc` has the record format and the protocol). The whole
//! segment is faulted in when the ring is created (and when a peer's ring of up to 64 MiB
//! is opened): it is registered once and reused, so page faults belong to setup, not to
//! the first lap of messages.

mod broken;
pub mod spsc;

// `broken` (why a ring call failed) goes with the protocol. The mapped ring, one job a
// file: `shared` (the segment: its layout, creating ours, validating the peer's),
// `sender` and `receiver` (the two halves), `message` (what a receive returns), `waiter`
// (spin, then sleep with liveness checks, until the caller's deadline). Compiled out
// under loom (loom atomics are not plain memory); `spsc`, the protocol, is what the loom
// models check.
// (No C ABI lives here, so cbindgen need not follow these `mod` items into the macro.)
cfg_not_loom! {
    mod message;
    mod receiver;
    mod sender;
    mod shared;

    pub use message::RingMessage;
    pub use receiver::RingReceiver;
    pub use sender::{RingItem, RingSender};
    pub use shared::{RingShared, DATA_OFFSET, MAX_RING_BYTES, MIN_RING_BYTES};
}
