//! The producer's IPC event pool: cross-process stream order through interprocess events,
//! for consumers that ask for them (`CudaWait::Event`) or where the signal words cannot be
//! used.
//!
//! Per connection the producer creates a pool of events with
//! `CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING` once and exports their handles once.
//! For each send it records the next slot on its stream after the last write and sends
//! (slot, sequence); the consumer waits for the record (`order::remote_events`) and then
//! acknowledges the sequence in a shared ack table. A slot is recorded again only once the
//! consumer has acknowledged its previous sequence: `cuStreamWaitEvent` captures the
//! event's state when it is called, so after the acknowledgement a new record cannot
//! change what the consumer's stream waits for.
//!
//! Every record is acknowledged exactly once, or given back: an import that fails, or is
//! dropped without a wait, acknowledges its record (the claim's drop); an export whose
//! message never went out cancels its record ([`EventPool::cancel`]). Otherwise one lost
//! acknowledgement would stall every export once the pool wrapped around to its slot.
//!
//! The ack table is a sealed memfd the producer creates; a hostile consumer writing it can
//! only break its own ordering (the producer treats any value as "maybe done" and never
//! reads anything else from it).

use super::super::driver::ensure_context;
use super::super::event::IpcEventSet;
use super::super::types::CudaStream;
use crate::error::Result;
use crate::segment::Segment;
use crate::wait::Wait;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Events per connection.
pub const POOL_SIZE: usize = 32;

/// Slot `slot`'s word of an ack table.
pub(super) fn ack_word(seg: &Segment, slot: usize) -> &AtomicU64 {
    assert!((slot + 1) * 8 <= seg.len());
    // SAFETY: slot*8+8 ≤ len (checked), 8-aligned in a page-aligned mapping; the words are
    // only accessed atomically.
    unsafe { &*seg.as_ptr().add(slot * 8).cast::<AtomicU64>() }
}

/// The producer's bookkeeping of its pool, apart from the driver (so it is tested without a
/// GPU): the sequence each slot was last issued with, the next slot, and the consumer's
/// ack table. A slot may be recorded again once the consumer acknowledged its last issue.
struct Ledger {
    acks: Arc<Segment>,
    issued: Vec<u64>,
    next: usize,
    seq: u64,
}

impl Ledger {
    fn new(acks: Arc<Segment>, slots: usize) -> Ledger {
        Ledger { acks, issued: vec![0; slots], next: 0, seq: 0 }
    }

    /// Is the next slot free (its last issue acknowledged)?
    fn next_free(&self) -> bool {
        // Acquire: pairs with the consumer's Release store in `RemoteEvents::ack`: its
        // stream wait on the slot's last record was enqueued before it acknowledged.
        ack_word(&self.acks, self.next).load(Ordering::Acquire) >= self.issued[self.next]
    }

    /// Wait (as `wait` says) until the next slot is free; returns it.
    fn reserve(&self, wait: impl Into<Wait>) -> Result<usize> {
        let mut deadline = wait.into().deadline();
        while !self.next_free() {
            if deadline.expired() {
                return Err(deadline.timed_out("the consumer to finish with an IPC event slot"));
            }
            std::thread::sleep(Duration::from_micros(20));
        }
        Ok(self.next)
    }

    /// The reserved slot was recorded: issue it under the next sequence number.
    fn issue(&mut self, slot: usize) -> u64 {
        self.seq += 1;
        self.issued[slot] = self.seq;
        self.next = (slot + 1) % self.issued.len();
        self.seq
    }

    /// The record issued as (`slot`, `seq`) will never reach the consumer (the export
    /// failed before its message went out): nobody will wait on it or acknowledge it, so
    /// the slot is free again at once (its previous issue was acknowledged before it was
    /// reserved).
    fn cancel(&mut self, slot: usize, seq: u64) {
        if self.issued.get(slot) == Some(&seq) {
            self.issued[slot] = 0;
        }
    }
}

/// The producer's pool.
pub struct EventPool {
    device: i32,
    events: IpcEventSet,
    ledger: Ledger,
}

impl EventPool {
    /// Create and export `POOL_SIZE` interprocess events on `device`.
    pub fn new(device: i32) -> Result<EventPool> {
        let _ctx = ensure_context(device)?;
        let acks = Arc::new(Segment::create(POOL_SIZE * 8)?);
        let events = IpcEventSet::create(POOL_SIZE)?;
        Ok(EventPool { device, events, ledger: Ledger::new(acks, POOL_SIZE) })
    }

    pub fn device(&self) -> i32 {
        self.device
    }
    /// Handles to send to the consumer (once per connection).
    pub fn handles(&self) -> &[[u8; 64]] {
        self.events.handles()
    }
    /// The ack table to send with them.
    pub fn acks(&self) -> &Arc<Segment> {
        &self.ledger.acks
    }

    /// Record the next slot on `stream` (waiting as `wait` says for the consumer to
    /// acknowledge that slot's previous use). Returns (slot, sequence). If the record
    /// never reaches the consumer, the caller must [`cancel`](EventPool::cancel) it.
    pub fn record(&mut self, stream: CudaStream, wait: impl Into<Wait>) -> Result<(u32, u64)> {
        let slot = self.ledger.reserve(wait)?;
        let _ctx = ensure_context(self.device)?;
        self.events.record(slot, stream)?;
        Ok((slot as u32, self.ledger.issue(slot)))
    }

    /// Give back a record whose message was never sent (a refused lease, a failed send):
    /// otherwise its slot would wait for an acknowledgement that never comes, and every
    /// export would time out once the pool wrapped around to it.
    pub fn cancel(&mut self, slot: u32, seq: u64) {
        self.ledger.cancel(slot as usize, seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    fn ack(acks: &Segment, slot: usize, seq: u64) {
        ack_word(acks, slot).store(seq, Ordering::Release);
    }

    #[test]
    fn a_slot_waits_for_its_acknowledgement_and_a_cancelled_issue_frees_it() {
        let acks = Arc::new(Segment::create(2 * 8).unwrap());
        let mut l = Ledger::new(acks.clone(), 2);
        let short = Duration::from_millis(5);
        let s0 = l.reserve(short).unwrap();
        assert_eq!((s0, l.issue(s0)), (0, 1));
        let s1 = l.reserve(short).unwrap();
        assert_eq!((s1, l.issue(s1)), (1, 2));
        // Slot 0 again: its issue 1 is not acknowledged yet.
        let e = l.reserve(short).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        ack(&acks, 0, 1);
        assert_eq!(l.reserve(short).unwrap(), 0);
        assert_eq!(l.issue(0), 3);
        // Issue 3's message never went out: cancelling it frees slot 0 without an ack...
        ack(&acks, 1, 2);
        assert_eq!(l.reserve(short).unwrap(), 1);
        assert_eq!(l.issue(1), 4);
        l.cancel(0, 3);
        assert_eq!(l.reserve(short).unwrap(), 0, "a cancelled issue must not jam its slot");
        // ...but a cancel naming an older issue of the slot changes nothing.
        assert_eq!(l.issue(0), 5);
        l.cancel(0, 3);
        ack(&acks, 1, 4);
        assert_eq!(l.reserve(short).unwrap(), 1);
        assert_eq!(l.issue(1), 6);
        assert!(matches!(l.reserve(short), Err(Error::Timeout { .. })), "slot 0's issue 5 is still unacknowledged");
        // Not waiting fails at once; a timeout too long for the clock is not zero.
        let t = std::time::Instant::now();
        assert!(matches!(l.reserve(Wait::Never), Err(Error::Timeout { .. })));
        assert!(t.elapsed() < Duration::from_secs(1));
        ack(&acks, 0, 5);
        assert_eq!(l.reserve(Duration::MAX).unwrap(), 0);
    }
}
