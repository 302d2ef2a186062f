//! The producer's record of which segment fd the consumer keeps in each of its fd slots
//! (`crate::wire::messages::SEGMENT_FD_SLOTS` says why the slots exist). Held under `Inner::send_lock`,
//! the lock every tensor send and FORGET takes, so the record changes in the same order
//! as the messages that change the consumer's slots.

use crate::wire::messages::SEGMENT_FD_SLOTS;

/// Which slot a segment's descriptor names, and whether its fd must go with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SlotChoice {
    pub slot: u32,
    /// The fd goes with this message and replaces what the slot held.
    pub install: bool,
}

/// Sends of a segment that name its slot before its fd goes again. The consumer cannot
/// say that it lacks a slot's fd: an install whose fd the kernel dropped (the consumer
/// at its open-file limit) leaves the slot empty there, and each descriptor naming it is
/// refused (its lease given back). Sending the fd again every this many sends heals that
/// within as many messages, at 1/64 of an fd's cost per send.
pub(crate) const REINSTALL_EVERY: u32 = 64;

/// What the consumer keeps in one slot, as far as this side knows.
#[derive(Clone, Copy)]
struct Slot {
    /// The segment whose fd is there.
    sid: u64,
    /// When a send last named it (for replacing the least recently used).
    used: u64,
    /// Sends naming it since its fd last went.
    since_install: u32,
}

/// Slot `i` of the consumer holds `slots[i]`.
pub(crate) struct FdSlots {
    slots: Vec<Option<Slot>>,
    clock: u64,
}

impl Default for FdSlots {
    fn default() -> Self {
        FdSlots { slots: vec![None; SEGMENT_FD_SLOTS as usize], clock: 0 }
    }
}

impl FdSlots {
    /// The slot for a descriptor of segment `sid`. `shown_anew`: the lease table counts
    /// this as the segment's first showing on this connection (never shown, or dropped
    /// and not yet forgotten): its fd goes again even where a slot still names the id.
    pub(crate) fn choose(&mut self, sid: u64, shown_anew: bool) -> SlotChoice {
        self.clock += 1;
        let clock = self.clock;
        if let Some(i) = self.slots.iter().position(|s| s.is_some_and(|s| s.sid == sid)) {
            let s = self.slots[i].as_mut().expect("found above");
            s.used = clock;
            s.since_install += 1;
            let install = shown_anew || s.since_install >= REINSTALL_EVERY;
            if install {
                s.since_install = 0;
            }
            return SlotChoice { slot: i as u32, install };
        }
        // An empty slot, else the least recently named one.
        let i = self
            .slots
            .iter()
            .enumerate()
            .min_by_key(|(_, s)| s.map_or(0, |s| s.used))
            .map(|(i, _)| i)
            .expect("SEGMENT_FD_SLOTS > 0");
        self.slots[i] = Some(Slot { sid, used: clock, since_install: 0 });
        SlotChoice { slot: i as u32, install: true }
    }

    /// The message that `choice` was for did not go out: the consumer's slot is as it
    /// was, which this record no longer knows, so it holds nothing we rely on.
    pub(crate) fn unsent(&mut self, choice: SlotChoice) {
        if choice.install {
            self.slots[choice.slot as usize] = None;
        }
    }

    /// The consumer reported these slots (bit i: slot i) as lacking their fd: whatever
    /// segment a later descriptor names, its fd goes with it.
    pub(crate) fn lost(&mut self, mask: u32) {
        for (i, s) in self.slots.iter_mut().enumerate() {
            if mask & (1 << i) != 0 {
                *s = None;
            }
        }
    }

    /// The consumer is told to forget `sid` (it empties the slot too).
    pub(crate) fn forget(&mut self, sid: u64) {
        for s in &mut self.slots {
            if s.is_some_and(|s| s.sid == sid) {
                *s = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_segment_installs_once_then_names_its_slot_and_the_least_recent_is_replaced() {
        let mut s = FdSlots::default();
        let n = SEGMENT_FD_SLOTS as u64;
        for sid in 0..n {
            assert_eq!(s.choose(sid, true), SlotChoice { slot: sid as u32, install: true });
        }
        for sid in 0..n {
            assert_eq!(s.choose(sid, false), SlotChoice { slot: sid as u32, install: false }, "segment {sid} again");
        }
        // Segment 0 is the least recently named: a new one takes its slot.
        s.choose(3, false);
        assert_eq!(s.choose(100, true), SlotChoice { slot: 0, install: true });
        assert_eq!(s.choose(0, false), SlotChoice { slot: 1, install: true }, "0 lost its slot; 1 is now the oldest");
        // Shown anew: the fd goes again, into the slot that names it.
        assert_eq!(s.choose(3, true), SlotChoice { slot: 3, install: true });
    }

    #[test]
    fn a_slots_fd_goes_again_every_reinstall_every_sends() {
        let mut s = FdSlots::default();
        assert!(s.choose(5, true).install);
        for k in 1..REINSTALL_EVERY {
            assert!(!s.choose(5, false).install, "send {k} since the install");
        }
        assert!(s.choose(5, false).install, "send {REINSTALL_EVERY} since the install must carry the fd again");
        assert!(!s.choose(5, false).install, "and the one after it not");
    }

    #[test]
    fn a_slot_the_consumer_lost_gets_its_fd_again() {
        let mut s = FdSlots::default();
        let a = s.choose(1, true);
        let b = s.choose(2, true);
        s.lost(1 << a.slot);
        assert!(s.choose(1, false).install, "a lost slot's segment must send its fd again");
        assert_eq!(s.choose(2, false), SlotChoice { slot: b.slot, install: false }, "other slots are as they were");
    }

    #[test]
    fn an_unsent_install_and_a_forget_leave_nothing_to_rely_on() {
        let mut s = FdSlots::default();
        let c = s.choose(7, true);
        s.unsent(c);
        assert!(s.choose(7, false).install, "an unsent install must be sent again");
        s.forget(7);
        assert!(s.choose(7, false).install, "a forgotten segment's fd must travel again");
        let c = s.choose(7, false);
        s.unsent(c);
        assert!(!s.choose(7, false).install, "an unsent reuse changes no slot");
    }
}
