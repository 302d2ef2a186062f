//! An event's state: how many times it was recorded, the highest record whose preceding
//! work completed, and who recorded last (`events` says how they are used). Below the
//! streams, whose wait ops hold it, and the events, which create it.

use crate::memory::Backing;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

pub(crate) const W_ID: usize = 0;
pub(crate) const W_RECORDED: usize = 1;
pub(crate) const W_COMPLETED: usize = 2;
/// The pid of the process that made the most recent record.
pub(crate) const W_RECORDER: usize = 3;
pub(crate) const WORDS: usize = 4;

pub(crate) enum Mem {
    Local(Box<[AtomicU64; WORDS]>),
    /// Interprocess: the first 32 bytes of a memfd page.
    Shared(Backing),
}

pub struct EventState {
    pub(crate) mem: Mem,
}

impl EventState {
    pub(crate) fn words(&self) -> &[AtomicU64; WORDS] {
        match &self.mem {
            Mem::Local(b) => b,
            // SAFETY: the backing is at least a page, page-aligned, mapped while `self`
            // lives; its words are only accessed atomically (here and in other processes).
            Mem::Shared(b) => unsafe { &*b.at(0).cast::<[AtomicU64; WORDS]>() },
        }
    }

    pub fn id(&self) -> u64 {
        // Relaxed: written once before the handle was made.
        self.words()[W_ID].load(Ordering::Relaxed)
    }

    pub(crate) fn recorded(&self) -> u64 {
        // Acquire: pairs with the AcqRel fetch_add in `record` (this or another process).
        self.words()[W_RECORDED].load(Ordering::Acquire)
    }

    pub(crate) fn completed(&self) -> u64 {
        // Acquire: pairs with the Release fetch_max in the recording stream's op: the work
        // before the record (its copies) happens-before whoever sees it complete.
        self.words()[W_COMPLETED].load(Ordering::Acquire)
    }

    /// The process that made the most recent record (read after `recorded`: the pid of
    /// that record's maker or of a later one's).
    pub(crate) fn recorder(&self) -> u32 {
        // Relaxed: stored before the AcqRel fetch_add in `record`, which the Acquire load in
        // `recorded` (called first) pairs with.
        self.words()[W_RECORDER].load(Ordering::Relaxed) as u32
    }

    /// True if record `target` is not complete and can never complete: the process that
    /// made the most recent record is gone (a stream waiting on it waits forever, as on
    /// hardware; a normal exit does not wait for it).
    pub fn orphaned(&self, target: u64) -> bool {
        self.completed() < target && !crate::process::alive(self.recorder())
    }

    /// Block (the calling stream worker or host thread) until record `target` completed.
    pub fn wait_completed(&self, target: u64) {
        while self.completed() < target {
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    pub fn backing(&self) -> Option<&Backing> {
        match &self.mem {
            Mem::Shared(b) => Some(b),
            Mem::Local(_) => None,
        }
    }
}
