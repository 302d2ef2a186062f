//! Moving a receiving thread off the CPU the peer last sent from, and telling the peer
//! where we send from, through the two message lines of a `Peer`'s lease tables.

use crate::lease::MessageLine;
use crate::segment::SharedRef;
use crate::sys;
use parking_lot::Mutex;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// The two message lines of a `Peer`'s lease tables. After each message it sends, a side
/// stores its CPU in `ours` and rings its doorbell; a receive that finds no message waits
/// on `theirs` (polls it, then sleeps on it), not in poll(2) on the socket
/// (`lease::MessageLine` says why). The peer may ring too often or never, and
/// write any CPU: a ring only makes a receive look at the socket again (and after
/// `doorbell::FALSE_RINGS` rings that brought nothing the receive sleeps in `poll(2)`
/// on the socket instead), a receive also looks between sleep slices (an unrung message
/// costs latency, not a hang), and a CPU costs at most one move per [`MOVE_AT_MOST_EVERY`].
pub(crate) struct MessageBells {
    pub(crate) ours: SharedRef<MessageLine>,
    pub(crate) theirs: SharedRef<MessageLine>,
}

/// Fewest time between two moves of a receiving thread off a CPU it shares with the peer.
/// Short enough that a pair put back together (a burst of other work on the second core)
/// is split again within a few hundred round trips (`docs/DESIGN.md`, "Two processes on
/// one core", has what a longer limit did). Long enough that a peer lying about its CPU
/// costs a move (two `sched_setaffinity` calls and a migration) per 2 ms at most.
pub(crate) const MOVE_AT_MOST_EVERY: Duration = Duration::from_millis(2);

/// A connection's record of its moves: when a receive last tried to move off the peer's
/// CPU (rate limit for a lying peer), and whether that found this thread allowed on one
/// CPU only.
#[derive(Default)]
pub(crate) struct CpuMoves {
    last_move: Mutex<Option<(Instant, bool)>>,
}

impl CpuMoves {
    /// Before waiting: if the peer last sent from the CPU we run on, move to another one.
    /// Returns true when the two share it for good: this thread may run on this CPU only
    /// (`taskset -c N`). The wait must then not spin or yield, only sleep, which hands the
    /// core to the peer at once.
    ///
    /// Two processes that hand messages back and forth on one core stay there: the
    /// scheduler puts a woken process next to the one that woke it, and two processes
    /// that never sleep (they poll, or yield to each other) are only split by the load
    /// balancer, which leaves tasks that ran within the last half millisecond where they
    /// are (`docs/measurements.md`, "Two processes on one core", has the measurements).
    ///
    /// So a wait that could move but may not yet (the rate limit) keeps its spin policy:
    /// sleeping at once there would hold the two together, each wake-up placing the woken
    /// side next to its waker.
    /// Whether a receive has tried to move this connection's receiving thread yet.
    #[cfg(test)]
    pub(crate) fn tried(&self) -> bool {
        self.last_move.lock().is_some()
    }

    pub(crate) fn move_off_peer_cpu(&self, bells: &MessageBells) -> bool {
        let line = bells.theirs.get();
        // Relaxed: a hint (see `MessageLine::sender_cpu`); copied before it is compared.
        let theirs = line.sender_cpu.load(Ordering::Relaxed);
        if theirs == 0 || theirs != sys::current_cpu().wrapping_add(1) {
            return false;
        }
        let mut last = self.last_move.lock();
        let now = Instant::now();
        if let Some((at, only_here)) = *last {
            if now.saturating_duration_since(at) < MOVE_AT_MOST_EVERY {
                return only_here;
            }
        }
        let moved = sys::move_off_this_cpu();
        *last = Some((now, moved == sys::CpuMove::OnlyHere));
        if moved == sys::CpuMove::Moved {
            // Say where we are now, so that the peer does not take our last send's CPU
            // for ours and move there after us. Relaxed: the same hint as at a send,
            // paired with nothing.
            bells.ours.get().sender_cpu.store(sys::current_cpu().wrapping_add(1), Ordering::Relaxed);
        }
        moved == sys::CpuMove::OnlyHere
    }
}

/// After a send: store the CPU we sent from in our message line if it changed, so that
/// the peer's waits know where we run (without writing the line each time).
pub(crate) fn note_send_cpu(bells: &MessageBells) {
    let line = bells.ours.get();
    let cpu = sys::current_cpu().wrapping_add(1);
    // Relaxed: a hint read on its own (see `MessageLine::sender_cpu`).
    if line.sender_cpu.load(Ordering::Relaxed) != cpu {
        line.sender_cpu.store(cpu, Ordering::Relaxed);
    }
}
