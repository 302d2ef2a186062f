//! The consumer's side of cross-process stream order: the producer's signal words opened
//! here ([`RemoteWords`]), and the claim an import holds on the signal its message named
//! ([`OrderClaim`]), waited for as the connection's [`CudaWait`] says.

use super::super::driver::ensure_context;
use super::super::event::StreamMark;
use super::super::types::CudaStream;
use super::host_wait::host_wait;
use super::liveness::PeerWatch;
use super::remote_events::{EventClaim, RemoteEvents};
use super::watchdog::{watch, Forced, Outcome, Pending};
use super::words::SignalWords;
use super::{CudaWait, Signal};
use crate::error::{Error, Result};
use crate::wait::Wait;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// What a host wait for a signal word waits for (its `Timeout` names it).
const WORD_WAIT: &str = "the producer's CUDA work (its signal word)";

/// The producer's signal words as this side holds them.
pub struct RemoteWords {
    device: i32,
    words: Arc<SignalWords>,
    timeout: Wait,
    peer: Arc<PeerWatch>,
    /// Cleared when a stream wait on the words failed (the driver cannot): later waits
    /// are made on the host.
    stream_waits: AtomicBool,
}

impl RemoteWords {
    /// Map the producer's words (`lanes` of them, from its announcement) and, where this
    /// side's streams are to wait on them (`CudaWait::Stream`), register them with CUDA
    /// on `device`; where that fails, waits are made on the host.
    pub fn open(device: i32, fd: OwnedFd, lanes: u32, policy: CudaWait, timeout: Wait, peer: Arc<PeerWatch>) -> Result<RemoteWords> {
        let mut words = SignalWords::open(fd, lanes)?;
        let on_stream = policy == CudaWait::Stream && words.register(device).is_ok();
        Ok(RemoteWords { device, words: Arc::new(words), timeout, peer, stream_waits: AtomicBool::new(on_stream) })
    }

    /// Whether this side's streams wait on the words (else its threads do).
    pub fn waits_on_streams(&self) -> bool {
        // Relaxed: a hint; a wait made on the host instead is as correct.
        self.stream_waits.load(Ordering::Relaxed)
    }
}

/// The signals this side can claim: the producer's words and/or its event pool.
#[derive(Clone, Default)]
pub struct RemoteSignals {
    pub words: Option<Arc<RemoteWords>>,
    pub events: Option<Arc<RemoteEvents>>,
}

impl RemoteSignals {
    /// Claim what a descriptor names (checked against what the producer announced).
    pub fn claim(&self, s: Signal) -> Result<OrderClaim> {
        match s {
            Signal::Word { lane, value } => {
                let words = self.words.clone().ok_or_else(|| {
                    Error::Protocol("a CUDA tensor names a signal word before the producer announced its words".into())
                })?;
                if lane >= words.words.lanes() {
                    return Err(Error::InvalidDescriptor(format!(
                        "CUDA signal lane {lane} out of range ({} lanes)",
                        words.words.lanes()
                    )));
                }
                Ok(OrderClaim::Word(WordClaim { words, lane, value, state: parking_lot::Mutex::new(WordState::Open) }))
            }
            Signal::Event { slot, seq } => {
                let events = self.events.clone().ok_or_else(|| {
                    Error::Protocol("a CUDA tensor arrived before the producer's IPC events".into())
                })?;
                events.claim(slot, seq).map(OrderClaim::Event)
            }
        }
    }
}

enum WordState {
    Open,
    /// The word was seen on the host: the producer's work is complete.
    Complete,
    /// A stream waits on the word; the watchdog ends that wait if it must.
    OnStream(Arc<Outcome>),
}

/// An import's claim on a word signal.
pub struct WordClaim {
    words: Arc<RemoteWords>,
    lane: u32,
    value: u32,
    state: parking_lot::Mutex<WordState>,
}

impl WordClaim {
    fn wait_on(&self, stream: CudaStream) -> Result<()> {
        let mut st = self.state.lock();
        if matches!(*st, WordState::Complete) {
            return Ok(());
        }
        let rw = &self.words;
        // The producer's work is often done by the time its message is read: then
        // nothing is enqueued and no thread waits.
        if rw.words.reached(self.lane, self.value)? {
            *st = WordState::Complete;
            return Ok(());
        }
        if rw.waits_on_streams() {
            match self.enqueue(stream, &st) {
                Ok(outcome) => {
                    *st = WordState::OnStream(outcome);
                    return Ok(());
                }
                Err(Error::Cuda { code, .. }) if code == crate::cuda::CudaCode::NOT_SUPPORTED => {
                    // Relaxed: a hint (see `waits_on_streams`).
                    rw.stream_waits.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        let peer = &rw.peer;
        host_wait(|| rw.words.reached(self.lane, self.value), &mut rw.timeout.deadline(), &|| peer.gone(), WORD_WAIT)?;
        *st = WordState::Complete;
        Ok(())
    }

    /// Make `stream` wait for the word, watched by the watchdog.
    fn enqueue(&self, stream: CudaStream, st: &WordState) -> Result<Arc<Outcome>> {
        let rw = &self.words;
        let _ctx = ensure_context(rw.device)?;
        rw.words.stream_wait(self.lane, self.value, stream)?;
        let outcome = match st {
            WordState::OnStream(o) => o.clone(),
            _ => Arc::new(Outcome::default()),
        };
        let deadline = match rw.timeout {
            Wait::Forever => None,
            Wait::Never => Some((Instant::now(), std::time::Duration::ZERO)),
            Wait::For(d) => Instant::now().checked_add(d).map(|end| (end, d)),
            Wait::Until(t) => Some((t, t.saturating_duration_since(Instant::now()))),
        };
        // If no mark can be recorded, the wait cannot be watched for its end: end it now
        // rather than leave a stream that may wait for good.
        let mark = StreamMark::record(rw.device, stream).inspect_err(|_| {
            let _ = rw.words.force(self.lane, self.value);
        })?;
        watch(Pending { words: rw.words.clone(), lane: self.lane, value: self.value, deadline, peer: rw.peer.clone(), mark, outcome: outcome.clone() });
        Ok(outcome)
    }

    fn forced(&self) -> Option<Forced> {
        match &*self.state.lock() {
            WordState::OnStream(o) => o.forced(),
            _ => None,
        }
    }
}

/// An import's claim on the signal its message named.
pub enum OrderClaim {
    Word(WordClaim),
    Event(EventClaim),
}

impl OrderClaim {
    /// Order `stream`'s later work after the producer's work for this import, as the
    /// connection's policy says (see [`CudaWait`]).
    pub fn wait_on(&self, stream: CudaStream) -> Result<()> {
        match self {
            OrderClaim::Word(w) => w.wait_on(stream),
            OrderClaim::Event(e) => e.wait_on(stream),
        }
    }

    /// `Err` once a stream's wait for the producer was ended by this side (the producer
    /// died, or its signal did not come within `cuda_wait_timeout`): the import's contents
    /// are undefined. `Ok` while the wait is pending or after it ended normally.
    pub fn status(&self) -> Result<()> {
        match self {
            OrderClaim::Word(w) => w.forced().map_or(Ok(()), |f| Err(f.error())),
            OrderClaim::Event(_) => Ok(()),
        }
    }
}
