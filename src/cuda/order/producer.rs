//! The producer's side of cross-process stream order: after the work a message depends on
//! is enqueued on its stream, it signals — a sequence word written by the stream
//! ([`WordLanes`], the default) or an IPC event recorded there (`event_pool`, for a
//! consumer that asks for events or where words cannot be used) — and the message names
//! the signal ([`Signal`]).

use super::super::driver::ensure_context;
use super::super::event::StreamMark;
use super::super::types::CudaStream;
use super::event_pool::EventPool;
use super::watchdog::linger;
use super::words::SignalWords;
use crate::error::Result;
use crate::wait::Wait;

/// Lanes per connection and direction: one per stream the producer exports from; more
/// streams than this take over the least recently used lane.
pub const LANES: u32 = 64;

pub use crate::desc::Signal;

struct Lane {
    stream: Option<CudaStream>,
    /// The last value written on this lane (0: none yet; words start at 0).
    value: u32,
    used: u64,
    /// Re-recorded after each write: reached once the lane's last write ran.
    mark: Option<StreamMark>,
}

/// Sequence words the producer's streams write, one lane per stream: writes to one lane
/// land in the order of that stream, so a lane's word only moves forward. A lane taken
/// over by another stream first makes the new stream wait for the old one's last write
/// (its private mark, in this process: no cross-process wait), so the order holds across
/// the change. (A stream handle destroyed with work pending and handed out again by the
/// driver counts as the same stream: destroy streams only once their work ran, as the
/// driver's own documentation of `cuStreamDestroy` advises for reused handles.)
pub struct WordLanes {
    device: i32,
    words: Option<SignalWords>,
    lanes: Vec<Lane>,
    clock: u64,
}

impl WordLanes {
    /// Create and register the words on `device`, and check that `stream` can write them
    /// (a write of 0, the value the words start at, changes nothing): an error means this
    /// driver or device cannot, and the caller uses events.
    pub fn new(device: i32, stream: CudaStream) -> Result<WordLanes> {
        let _ctx = ensure_context(device)?;
        let mut words = SignalWords::create(LANES)?;
        words.register(device)?;
        words.stream_write(0, 0, stream)?;
        let lanes = (0..LANES).map(|_| Lane { stream: None, value: 0, used: 0, mark: None }).collect();
        Ok(WordLanes { device, words: Some(words), lanes, clock: 0 })
    }

    pub fn words(&self) -> &SignalWords {
        self.words.as_ref().expect("present until drop")
    }

    /// Write the next value of `stream`'s lane on `stream`, after its work.
    pub fn signal(&mut self, stream: CudaStream) -> Result<(u32, u32)> {
        let _ctx = ensure_context(self.device)?;
        let i = match self.lanes.iter().position(|l| l.stream == Some(stream)) {
            Some(i) => i,
            None => {
                let i = self.lanes.iter().position(|l| l.stream.is_none()).unwrap_or_else(|| {
                    (0..self.lanes.len()).min_by_key(|&i| self.lanes[i].used).expect("LANES > 0")
                });
                if let Some(mark) = &self.lanes[i].mark {
                    // The old stream's last write lands before anything the new one writes.
                    mark.order(stream)?;
                }
                self.lanes[i].stream = Some(stream);
                i
            }
        };
        let value = self.lanes[i].value.wrapping_add(1);
        self.words.as_ref().expect("present until drop").stream_write(i as u32, value, stream)?;
        let lane = &mut self.lanes[i];
        lane.value = value;
        self.clock += 1;
        lane.used = self.clock;
        // The mark orders a later takeover of the lane and keeps the words registered
        // until the write ran (drop); a mark that cannot be recorded leaves the lane to
        // this stream for good (no takeover can be ordered after it).
        let recorded = match &lane.mark {
            Some(m) => m.record_again(stream),
            None => StreamMark::record(self.device, stream).map(|m| lane.mark = Some(m)),
        };
        if recorded.is_err() {
            lane.mark = None;
            lane.used = u64::MAX;
        }
        Ok((i as u32, value))
    }
}

impl Drop for WordLanes {
    fn drop(&mut self) {
        // Writes may still be queued on the streams: the words stay registered until each
        // lane's last write ran.
        let marks = self.lanes.iter_mut().filter_map(|l| l.mark.take()).collect();
        if let Some(words) = self.words.take() {
            linger(marks, Box::new(words));
        }
    }
}

/// The producer's signalling for one connection: words, or the event pool.
pub enum Signaller {
    Words(WordLanes),
    Events(EventPool),
}

impl Signaller {
    pub fn device(&self) -> i32 {
        match self {
            Signaller::Words(w) => w.device,
            Signaller::Events(p) => p.device(),
        }
    }

    /// Signal the work enqueued on `stream` so far. An event slot may have to be waited
    /// for (as `wait` says) until the consumer acknowledged its previous record.
    pub fn signal(&mut self, stream: CudaStream, wait: impl Into<Wait>) -> Result<Signal> {
        match self {
            Signaller::Words(w) => w.signal(stream).map(|(lane, value)| Signal::Word { lane, value }),
            Signaller::Events(p) => p.record(stream, wait).map(|(slot, seq)| Signal::Event { slot, seq }),
        }
    }

    /// The message naming `s` was never sent: give an event slot back (a word nobody
    /// waits for needs nothing).
    pub fn cancel(&mut self, s: Signal) {
        if let (Signaller::Events(p), Signal::Event { slot, seq }) = (self, s) {
            p.cancel(slot, seq);
        }
    }
}
