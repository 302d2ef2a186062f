//! The ring's signal words: how each side orders its stream after the other's copies
//! without an IPC event, so neither side's thread nor its GPU waits on the other process
//! through the driver's events (a GPU-side wait on another process's event costs a GPU
//! time-slice switch without MPS; see `cuda::order`).
//!
//! One sealed memfd per ring, made by the producer and registered with CUDA by both
//! sides, holds `2 × slots` words (`SignalWords` lanes): lane `slot` is the slot's
//! *written* word, raised by the producer's stream after its copy into the slot; lane
//! `slots + slot` its *read* word, raised by the consumer's stream after its copy out.
//! Chunk `seq` is use `u = seq / slots + 1` of slot `seq % slots`: the consumer's copy out
//! waits for written ≥ u, and the producer's copy of the slot's next use waits for
//! read ≥ u (the use before it).
//!
//! A wait is checked on the host first (usually the word is there already: nothing is
//! enqueued). Otherwise, under `CudaWait::Stream` the waiting side's stream waits for the
//! word (`cuStreamWaitValue32`) and the watchdog ends that wait itself if the peer dies or
//! `cuda_wait_timeout` passes — the ring then breaks with the reason ([`Outcome`]) — and
//! under `CudaWait::Host` the waiting thread polls the word.
//!
//! The words are shared memory the peer may write at any time: a peer that raises its
//! word early only spoils its own data (the producer's bytes, or the consumer's copy);
//! one that never raises it, or lowers it again, is what the watchdog is for. A side never
//! orders its stream after its *own* earlier work through these words (the peer could
//! hold them back): that goes through private marks (`StreamMark`).

use crate::cuda::event::StreamMark;
use crate::cuda::order::host_wait;
use crate::cuda::order::watchdog::{linger, watch, Outcome, Pending};
use crate::cuda::order::words::SignalWords;
use crate::cuda::order::{CudaWait, PeerWatch};
use crate::cuda::types::CudaStream;
use crate::error::{Error, Result};
use crate::wait::{Deadline, Wait};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::Instant;

/// The slot's use that chunk `seq` is (1 for its first use): the value its words reach.
pub(super) fn use_of(seq: u64, slots: u32) -> u32 {
    (seq / slots as u64).wrapping_add(1) as u32
}

/// Which of a slot's two words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Word {
    /// Raised by the producer after its copy into the slot.
    Written,
    /// Raised by the consumer after its copy out of the slot.
    Read,
}

/// How this side waits on the peer's words, and what ends such a wait.
pub(super) struct Waits {
    /// `Stream` or `Host` (a ring under `Event` uses no words).
    pub(super) policy: CudaWait,
    /// How long a stream's wait may go before the watchdog ends it.
    pub(super) timeout: Wait,
    pub(super) peer: Arc<PeerWatch>,
    /// Set by the watchdog when it ended one of this side's stream waits: from then on
    /// the ring is broken (the data of that chunk is undefined).
    pub(super) outcome: Arc<Outcome>,
}

impl Waits {
    pub(super) fn new(policy: CudaWait, timeout: Wait, peer: Arc<PeerWatch>) -> Waits {
        Waits { policy, timeout, peer, outcome: Arc::new(Outcome::default()) }
    }

    /// `Err` (naming why) once the watchdog ended one of our waits.
    pub(super) fn check(&self) -> Result<()> {
        match self.outcome.forced() {
            Some(f) => Err(Error::Protocol(format!("GPU ring broken: a wait for the peer's copy was ended by this side: {}", f.error()))),
            None => Ok(()),
        }
    }
}

/// The ring's words as one side holds them, registered with CUDA on the ring's device.
pub(super) struct RingWords {
    words: Option<Arc<SignalWords>>,
    device: i32,
    slots: u32,
    /// Per slot: a private mark after this side's last copy through the slot and its word
    /// write (orders a later copy through the slot from another stream; keeps the words
    /// registered until that work ran).
    own: Vec<Option<StreamMark>>,
}

impl RingWords {
    fn lanes(slots: u32) -> u32 {
        2 * slots
    }

    /// The producer's words: created, registered, and checked writable by `stream` (a
    /// write of 0, the value they start at). An error means this driver cannot; the ring
    /// then goes by events.
    pub(super) fn create(device: i32, slots: u32) -> Result<RingWords> {
        let mut w = SignalWords::create(Self::lanes(slots))?;
        w.register(device)?;
        w.stream_write(0, 0, CudaStream::LEGACY)?;
        Ok(Self::from(w, device, slots))
    }

    /// The consumer's side: map the producer's words and register them.
    pub(super) fn open(fd: OwnedFd, device: i32, slots: u32) -> Result<RingWords> {
        let mut w = SignalWords::open(fd, Self::lanes(slots))?;
        w.register(device)?;
        Ok(Self::from(w, device, slots))
    }

    fn from(w: SignalWords, device: i32, slots: u32) -> RingWords {
        RingWords { words: Some(Arc::new(w)), device, slots, own: (0..slots).map(|_| None).collect() }
    }

    fn words(&self) -> &Arc<SignalWords> {
        self.words.as_ref().expect("present until drop")
    }

    pub(super) fn fd(&self) -> BorrowedFd<'_> {
        self.words().fd()
    }

    fn lane(&self, slot: usize, which: Word) -> u32 {
        match which {
            Word::Written => slot as u32,
            Word::Read => self.slots + slot as u32,
        }
    }

    /// Has `which` of `slot` reached `value` (read on the host)?
    pub(super) fn reached(&self, slot: usize, which: Word, value: u32) -> Result<bool> {
        self.words().reached(self.lane(slot, which), value)
    }

    /// Order `stream`'s later work after this side's own last copy through `slot`.
    pub(super) fn after_own(&self, slot: usize, stream: CudaStream) -> Result<()> {
        match &self.own[slot] {
            Some(m) => m.order(stream),
            None => Ok(()),
        }
    }

    /// After this side's copy through `slot` on `stream`: raise `which` to `value` there,
    /// and re-record the slot's private mark.
    pub(super) fn signal(&mut self, slot: usize, which: Word, value: u32, stream: CudaStream) -> Result<()> {
        let lane = self.lane(slot, which);
        self.words().stream_write(lane, value, stream)?;
        match &self.own[slot] {
            Some(m) => m.record_again(stream),
            None => StreamMark::record(self.device, stream).map(|m| self.own[slot] = Some(m)),
        }
    }

    /// Raise our own word from the host (a chunk dropped without a copy: nothing of ours
    /// goes through the slot).
    pub(super) fn raise(&self, slot: usize, which: Word, value: u32) -> Result<()> {
        self.words().force(self.lane(slot, which), value).map(|_| ())
    }

    /// Order `stream` after the peer's `which` word of `slot` reaching `value`, as
    /// `waits.policy` says. A host wait goes by `deadline` and `gone`; a stream wait is
    /// handed to the watchdog.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn wait(
        &self,
        slot: usize,
        which: Word,
        value: u32,
        stream: CudaStream,
        waits: &Waits,
        deadline: &mut Deadline,
        gone: &dyn Fn() -> bool,
        what: &'static str,
    ) -> Result<()> {
        let lane = self.lane(slot, which);
        let words = self.words();
        // Usually the peer's copy is done by the time its record (or credit) is read.
        if words.reached(lane, value)? {
            return Ok(());
        }
        if waits.policy != CudaWait::Stream {
            host_wait(|| words.reached(lane, value), deadline, gone, what)?;
            return Ok(());
        }
        words.stream_wait(lane, value, stream)?;
        // Without a mark the wait cannot be watched for its end: end it now rather than
        // leave a stream that may wait for good (the ring then breaks).
        let mark = match StreamMark::record(self.device, stream) {
            Ok(m) => m,
            Err(e) => {
                let _ = words.force(lane, value);
                return Err(e);
            }
        };
        let end = match waits.timeout {
            Wait::Forever => None,
            Wait::Never => Some((Instant::now(), std::time::Duration::ZERO)),
            Wait::For(d) => Instant::now().checked_add(d).map(|end| (end, d)),
            Wait::Until(t) => Some((t, t.saturating_duration_since(Instant::now()))),
        };
        watch(Pending {
            words: words.clone(),
            lane,
            value,
            deadline: end,
            peer: waits.peer.clone(),
            mark,
            outcome: waits.outcome.clone(),
        });
        Ok(())
    }

    /// Wait on the host (bounded by `until`) for this side's own copies through the ring
    /// to have run.
    pub(super) fn wait_own(&self, until: Instant) {
        for m in self.own.iter().flatten() {
            while matches!(m.done(), Ok(false)) && Instant::now() < until {
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
        }
    }
}

impl Drop for RingWords {
    fn drop(&mut self) {
        // Our writes (and waits, which the watchdog holds on its own) may still be queued:
        // the words stay registered until each slot's last one ran.
        let marks = self.own.iter_mut().filter_map(Option::take).collect();
        if let Some(w) = self.words.take() {
            linger(marks, Box::new(w));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uses_count_from_one_per_slot_and_wrap() {
        assert_eq!((use_of(0, 4), use_of(3, 4), use_of(4, 4), use_of(9, 4)), (1, 1, 2, 3));
        // The word is 32 bits: the use wraps, which the driver's cyclic GEQ allows.
        assert_eq!(use_of((u32::MAX as u64) * 4, 4), 0);
        assert!(crate::signal_word::reached(use_of((u32::MAX as u64 + 1) * 4, 4), use_of((u32::MAX as u64) * 4, 4)));
    }
}
