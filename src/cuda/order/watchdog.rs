//! The watchdog of GPU-side waits on the peer's signal words, and what must outlive GPU
//! work that uses registered words.
//!
//! A consumer's stream that waits for a word (`cuStreamWaitValue32`) waits for as long as
//! the word stays short of the value: a producer that died before its stream wrote it, or
//! that never writes, would hang that stream — and every later piece of work on it — for
//! good. So each such wait is handed to the watchdog with the peer to watch, its deadline
//! and a private mark recorded on the stream right after it. One process-wide thread looks
//! every millisecond while any wait is pending: a wait whose word arrived is forgotten once
//! the stream passed its mark; one whose peer died, or whose deadline passed, is ended by
//! a host store of the value (`SignalWords::force`) and its [`Outcome`] says why, for the
//! import to report. The words stay registered (and mapped) while any wait or write of
//! ours on them may still run: pending entries and [`linger`]ed holders keep them.

use super::super::event::StreamMark;
use super::liveness::PeerWatch;
use super::words::SignalWords;
use crate::error::Error;
use parking_lot::{Condvar, Mutex};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// How often the watchdog looks while anything is pending.
const TICK: Duration = Duration::from_millis(1);
/// How often it asks whether a pending wait's peer died (a `poll` each).
const LIVENESS_EVERY: Duration = Duration::from_millis(5);

/// Why a GPU-side wait was ended by this side rather than by the producer's signal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forced {
    /// The producer (`pid`) died before its stream wrote the word.
    PeerGone { pid: i32 },
    /// The word had not arrived after `after` (`PeerConfig::cuda_wait_timeout`).
    Timeout { after: Duration },
}

impl Forced {
    /// The error an import reports once its wait was forced.
    pub fn error(self) -> Error {
        match self {
            Forced::PeerGone { pid } => Error::peer_gone(format!(
                "process {pid} died before its CUDA work for this tensor completed; this side ended its stream's wait, \
                 and the tensor's contents are undefined"
            )),
            Forced::Timeout { after } => Error::Timeout {
                what: "the producer's CUDA work for this tensor (its stream's wait was ended by this side; the contents are undefined)",
                after,
            },
        }
    }
}

/// Whether a watched wait ended normally; shared by the watchdog and the claim.
#[derive(Debug, Default)]
pub struct Outcome(Mutex<Option<Forced>>);

impl Outcome {
    pub fn forced(&self) -> Option<Forced> {
        *self.0.lock()
    }
}

/// One pending GPU-side wait.
pub struct Pending {
    pub words: Arc<SignalWords>,
    pub lane: u32,
    pub value: u32,
    /// `None`: only the peer's death ends it.
    pub deadline: Option<(Instant, Duration)>,
    pub peer: Arc<PeerWatch>,
    /// Recorded on the waiting stream right after the wait: reached once the stream
    /// passed it (then nothing of ours uses the words for this wait any more).
    pub mark: StreamMark,
    pub outcome: Arc<Outcome>,
}

struct Watched {
    p: Pending,
    forced: bool,
    next_look: Instant,
}

/// Something kept alive until every one of its marks is reached.
struct Lingering {
    marks: Vec<StreamMark>,
    _holder: Box<dyn Send>,
}

#[derive(Default)]
struct State {
    pending: Vec<Watched>,
    lingering: Vec<Lingering>,
}

struct Watchdog {
    state: Mutex<State>,
    wake: Condvar,
}

fn watchdog() -> &'static Watchdog {
    static W: OnceLock<Watchdog> = OnceLock::new();
    static STARTED: std::sync::Once = std::sync::Once::new();
    let w = W.get_or_init(|| Watchdog { state: Mutex::new(State::default()), wake: Condvar::new() });
    STARTED.call_once(|| {
        // Without the thread, a wait whose peer dies would never be ended: say so loudly
        // rather than fail the import that asked (a thread always starts in practice).
        if let Err(e) = std::thread::Builder::new().name("tensorwire-cuda-watchdog".into()).spawn(run) {
            eprintln!("tensorwire: cannot start the CUDA wait watchdog ({e}); GPU-side waits will not be ended on the peer's death");
        }
    });
    w
}

/// Watch a GPU-side wait until its stream passed it.
pub fn watch(p: Pending) {
    let w = watchdog();
    w.state.lock().pending.push(Watched { p, forced: false, next_look: Instant::now() });
    w.wake.notify_one();
}

/// Keep `holder` (registered words, or what owns them) until every mark is reached.
/// Marks that cannot be queried any more (a device error) count as reached.
pub fn linger(marks: Vec<StreamMark>, holder: Box<dyn Send>) {
    if marks.iter().all(|m| m.done().unwrap_or(true)) {
        drop(holder);
        return;
    }
    let w = watchdog();
    w.state.lock().lingering.push(Lingering { marks, _holder: holder });
    w.wake.notify_one();
}

/// How many waits are pending and holders lingering (tests).
pub fn counts() -> (usize, usize) {
    let s = watchdog().state.lock();
    (s.pending.len(), s.lingering.len())
}

fn run() {
    let w = watchdog();
    loop {
        {
            let mut s = w.state.lock();
            while s.pending.is_empty() && s.lingering.is_empty() {
                w.wake.wait(&mut s);
            }
        }
        pass(w);
        std::thread::sleep(TICK);
    }
}

/// One look at everything pending; what is finished is dropped outside the lock (its
/// drop makes driver calls).
fn pass(w: &Watchdog) {
    let (mut pending, mut lingering) = {
        let mut s = w.state.lock();
        (std::mem::take(&mut s.pending), std::mem::take(&mut s.lingering))
    };
    let now = Instant::now();
    pending.retain_mut(|e| {
        if e.p.mark.done().unwrap_or(true) {
            return false;
        }
        if !e.forced && !e.p.words.reached(e.p.lane, e.p.value).unwrap_or(true) {
            let timed_out = e.p.deadline.filter(|(end, _)| now >= *end).map(|(_, after)| Forced::Timeout { after });
            let died = (now >= e.next_look).then(|| {
                e.next_look = now + LIVENESS_EVERY;
                e.p.peer.gone()
            });
            let why = timed_out.or((died == Some(true)).then_some(Forced::PeerGone { pid: e.p.peer.pid() }));
            if let Some(why) = why {
                *e.p.outcome.0.lock() = Some(why);
                e.forced = true;
            }
        }
        if e.forced {
            // Every look until the stream passed the wait: a live peer may lower the word
            // again before the stream saw our store.
            let _ = e.p.words.force(e.p.lane, e.p.value);
        }
        true
    });
    lingering.retain(|l| !l.marks.iter().all(|m| m.done().unwrap_or(true)));
    let mut s = w.state.lock();
    s.pending.append(&mut pending);
    s.lingering.append(&mut lingering);
}
