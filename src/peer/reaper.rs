//! The reaper: passes that drop owners of released, expired or orphaned leases, the
//! background thread that runs them, and the process-wide list of CUDA mappings that
//! linger until the GPU work reading them completes.

use crate::doorbell::Doorbell;
use crate::lease::Reclaimed;
use parking_lot::Mutex;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use crate::wire::messages::KIND_FORGET;
use super::Inner;
use std::sync::atomic::{AtomicBool, AtomicU32};

/// The reaper's wake-ups and passes.
#[derive(Default)]
pub(super) struct ReaperState {
    /// Wakes the reaper early (shutdown, an export while it idles); private to this process.
    pub(super) wake: parking_lot::Condvar,
    pub(super) lock: Mutex<()>,
    /// Release-doorbell sequence at the last reap.
    pub(super) seq: AtomicU32,
    /// Serialises reap passes, owner drops included, so `reap_now` returns only once
    /// every release it can see is settled. Re-entrant: a release callback may call back
    /// into this peer on the same thread.
    pub(super) reap_lock: parking_lot::ReentrantMutex<()>,
    /// The reaper is in its long idle sleep (no live lease for a while); an export wakes it.
    pub(super) idle: AtomicBool,
}

/// How often the reaper looks for a dead peer when no lease is live.
const IDLE_TICK: Duration = Duration::from_millis(50);

impl Inner {
    fn release_doorbell(&self) -> Doorbell<'_> {
        crate::lease::release_doorbell(&self.exports.table)
    }

    /// One reaper pass; returns (next deadline, peer gone, live leases). `look` asks the
    /// kernel whether the peer is gone (a `poll`); without it only what is already known
    /// counts (the export path's pass, which must not cost a system call per send).
    pub(super) fn reap_once(&self, look: bool) -> (Option<Instant>, bool, u64) {
        let _pass = self.reaper.reap_lock.lock();
        let mut dead = Reclaimed::default();
        let gone = if look { self.conn.is_peer_gone() } else { self.conn.known_gone() };
        // Relaxed: only a hint of whether anything was released since the last pass; the
        // slot words themselves carry the Acquire/Release pairing.
        self.reaper.seq.store(self.release_doorbell().current(), Ordering::Relaxed);
        let closing = gone || self.stop.load(Ordering::Acquire);
        // Reclaiming everything waits for an export that is sending (it holds `send_lock`
        // from grant to send): if its send fails, that export takes its own lease back
        // (revoked: its descriptor never went out), rather than this pass counting it as
        // reclaimed from a peer that never saw it. Same lock order as the export path.
        let sending = closing.then(|| self.exports.send_lock.lock());
        let (next, forget, live) = {
            let mut ex = self.exports.exporter.lock();
            if closing {
                ex.reclaim_all(&mut dead);
                (None, Vec::new(), 0)
            } else {
                let next = ex.reap(Instant::now(), &mut dead);
                (next, ex.forgettable_segments(), ex.stats().live_leases)
            }
        };
        drop(sending);
        // Owners run arbitrary drop code (a C callback): never under our locks.
        dead.settle(&self.exports.exporter);
        for id in forget {
            let mut slots = self.exports.send_lock.lock();
            // The consumer empties the slot holding it as it forgets; were this send to
            // fail, the connection is over and the slots with it.
            slots.forget(id);
            let _ = self.conn.send(KIND_FORGET, &id.to_le_bytes(), &[]);
        }
        let waiting = self.release_finished_imports(gone || self.stop.load(Ordering::Acquire));
        (next, gone, live + waiting)
    }

    /// Release deferred CUDA imports whose stream work completed; with `all` (the peer is
    /// gone or we are closing) release the rest's leases too, but keep their mappings
    /// until their work completes ([`linger`]). Returns how many still wait.
    pub(super) fn release_finished_imports(&self, all: bool) -> u64 {
        collect_lingering();
        let (finished, unfinished): (Vec<_>, Vec<_>) = {
            let mut d = self.imports.deferred.lock();
            if d.is_empty() {
                return 0;
            }
            // A mark that cannot be queried (device error) releases too: holding the
            // lease forever would only leak the producer's memory.
            let (done, wait): (Vec<_>, Vec<_>) = d.drain(..).partition(|(m, _)| m.done().unwrap_or(true));
            if all {
                (done, wait)
            } else {
                *d = wait;
                (done, Vec::new())
            }
        };
        let waiting = self.imports.deferred.lock().len() as u64;
        drop(finished);
        for (mark, imp) in unfinished {
            imp.linger(mark);
        }
        waiting
    }

    /// Reap if the consumer released anything since the last pass (cheap check).
    pub(super) fn reap_if_released(&self) {
        if self.release_doorbell().current() != self.reaper.seq.load(Ordering::Relaxed) {
            // Only if no pass is running: the export path never waits on one.
            if let Some(_pass) = self.reaper.reap_lock.try_lock() {
                self.reap_once(false);
            }
        }
    }
}

pub(super) fn reaper(inner: Arc<Inner>) {
    // Ticks in a row without a live lease; after QUIET_TICKS the reaper sleeps long.
    const QUIET_TICKS: u32 = 50;
    let mut quiet = 0u32;
    loop {
        if inner.stop.load(Ordering::Acquire) {
            return;
        }
        let (next, gone, live) = inner.reap_once(true);
        // A gone peer's reaper stays while CUDA mappings linger (its pass collects them).
        if gone && LINGERING.lock().is_empty() {
            return;
        }
        quiet = if live > 0 { 0 } else { quiet.saturating_add(1) };
        let mut g = inner.reaper.lock.lock();
        if inner.stop.load(Ordering::Acquire) {
            return;
        }
        if quiet >= QUIET_TICKS {
            // Idle: announce it, then re-check under the lock an export takes to wake us
            // (SeqCst store, then the exporter's lock: an export either sees the flag and
            // notifies — we hold `reaper_lock` until we wait — or granted before our check).
            inner.reaper.idle.store(true, Ordering::SeqCst);
            if inner.exports.exporter.lock().stats().live_leases == 0 {
                inner.reaper.wake.wait_for(&mut g, IDLE_TICK);
            }
            inner.reaper.idle.store(false, Ordering::SeqCst);
            if inner.exports.exporter.lock().stats().live_leases > 0 {
                quiet = 0;
            }
        } else {
            let tick = next.map_or(inner.cfg.reap_interval, |d| d.saturating_duration_since(Instant::now()).min(inner.cfg.reap_interval));
            inner.reaper.wake.wait_for(&mut g, tick);
        }
    }
}

impl Inner {
    /// After a grant: wake the reaper if it is in its long idle sleep.
    pub(super) fn wake_idle_reaper(&self) {
        // SeqCst: pairs with the reaper's SeqCst store of the flag before its re-check.
        if self.reaper.idle.load(Ordering::SeqCst) {
            let _g = self.reaper.lock.lock();
            self.reaper.wake.notify_all();
        }
    }
}

/// What must outlive GPU work that may still use it — mappings of released CUDA imports
/// whose readers had not finished when their connection closed, forwarded imports whose
/// relay-side work had not finished when the forward's lease ended, shared imports
/// released after a stream — each with the mark that work ends at. Dropped by
/// [`collect_lingering`] once its mark is reached (at every reaper pass of any connection
/// of this process).
static LINGERING: Mutex<Vec<(crate::cuda::event::StreamMark, Box<dyn Send>)>> = Mutex::new(Vec::new());

/// Keep `what` (a CUDA mapping, or an import holding one) until `mark` is reached: GPU
/// work enqueued before the mark may still use the memory, and an unmapping under it
/// faults (which poisons this process's context). At once if the mark is reached (or can
/// no longer be queried) already.
pub(super) fn hold_until(mark: crate::cuda::event::StreamMark, what: Box<dyn Send>) {
    if mark.done().unwrap_or(true) {
        drop(what);
        return;
    }
    LINGERING.lock().push((mark, what));
}

/// Drop what lingers whose marks were reached (or can no longer be queried).
/// True when none lingers any more.
pub(super) fn collect_lingering() -> bool {
    let done: Vec<_> = {
        let mut l = LINGERING.lock();
        if l.is_empty() {
            return true;
        }
        let (done, wait): (Vec<_>, Vec<_>) = l.drain(..).partition(|(m, _)| m.done().unwrap_or(true));
        *l = wait;
        done
    };
    // Dropped outside the lock (driver calls, lease releases).
    drop(done);
    LINGERING.lock().is_empty()
}
