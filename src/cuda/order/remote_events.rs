//! The consumer's side of the producer's IPC event pool: claims on its records, waited
//! for as the connection's [`CudaWait`] says — on the host (`Stream`, `Host`: no
//! time-slice switch) or by the stream (`Event`: `cuStreamWaitEvent`) — and acknowledged
//! exactly once.

use super::super::driver::ensure_context;
use super::super::event::{IpcEventSet, StreamMark};
use super::super::types::CudaStream;
use super::event_pool::ack_word;
use super::host_wait::host_wait;
use super::liveness::PeerWatch;
use super::CudaWait;
use crate::error::{Error, Result};
use crate::segment::Segment;
use crate::wait::Wait;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// What a host wait for an event record waits for (its `Timeout` names it).
const EVENT_WAIT: &str = "the producer's CUDA work (its IPC event)";

/// The consumer's view of the producer's pool.
pub struct RemoteEvents {
    device: i32,
    /// How many events the producer announced (the ack table holds as many words).
    count: usize,
    /// The opened events, or why they could not be opened here (reported at every wait):
    /// the table still takes acknowledgements then, so the producer's slots do not jam.
    events: Result<IpcEventSet>,
    acks: Segment,
    /// How this side waits for a record, and for how long at most on the host.
    policy: CudaWait,
    timeout: Wait,
    peer: Arc<PeerWatch>,
}

impl RemoteEvents {
    /// Open the producer's event handles (once per connection) and its ack table. A
    /// malformed announcement is an error; events this process cannot open (no usable
    /// CUDA here) give an ack-only view: claims work and acknowledge, waits fail saying why.
    pub fn open(
        device: i32,
        handles: &[[u8; 64]],
        acks: Segment,
        policy: CudaWait,
        timeout: Wait,
        peer: Arc<PeerWatch>,
    ) -> Result<RemoteEvents> {
        if handles.is_empty() || handles.len() > 1024 || acks.len() < handles.len() * 8 {
            return Err(Error::Protocol(format!(
                "{} IPC events with a {}-byte ack table",
                handles.len(),
                acks.len()
            )));
        }
        let events = ensure_context(device).and_then(|_ctx| IpcEventSet::open(handles));
        Ok(RemoteEvents { device, count: handles.len(), events, acks, policy, timeout, peer })
    }

    /// Could the events be opened here? (`Err`: why not.)
    pub fn usable(&self) -> std::result::Result<(), &Error> {
        self.events.as_ref().map(|_| ())
    }

    /// Claim the producer's record `seq` in `slot` (named by a descriptor): it is waited on
    /// at most once and acknowledged exactly once, also when it is never waited on.
    pub fn claim(self: &Arc<Self>, slot: u32, seq: u64) -> Result<EventClaim> {
        if slot as usize >= self.count {
            return Err(Error::InvalidDescriptor(format!("IPC event slot {slot} out of range ({} events)", self.count)));
        }
        Ok(EventClaim { events: self.clone(), slot, seq, state: parking_lot::Mutex::new(ClaimState::Open) })
    }

    /// Order `stream` after the record in `slot` (checked by `claim`): the stream waits
    /// for it (`Event`), or this thread does (`Stream`, `Host`), in which case the record
    /// is complete on return and nothing is enqueued. True if the stream waits.
    fn wait(&self, slot: u32, stream: CudaStream) -> Result<bool> {
        let events = self.events.as_ref().map_err(|why| {
            Error::CudaUnavailable(format!("the producer's IPC events could not be opened here: {why}"))
        })?;
        let _ctx = ensure_context(self.device)?;
        if self.policy == CudaWait::Event {
            events.wait(stream, slot as usize)?;
            return Ok(true);
        }
        let peer = &self.peer;
        host_wait(|| events.query(slot as usize), &mut self.timeout.deadline(), &|| peer.gone(), EVENT_WAIT)?;
        Ok(false)
    }

    /// Tell the producer we will never wait on record `seq` of `slot` again (`slot` checked
    /// by `claim`).
    fn ack(&self, slot: u32, seq: u64) {
        // Release: pairs with the producer's Acquire load in `Ledger::next_free`; a stream
        // wait on the record, if any, was enqueued before, so a later record of the slot
        // cannot change what that wait captured.
        ack_word(&self.acks, slot as usize).store(seq, Ordering::Release);
    }
}

enum ClaimState {
    /// Not waited on yet (or every wait so far failed to enqueue).
    Open,
    /// Waited on and acknowledged; the mark recorded on the first stream right after its
    /// wait orders any further stream (None if that mark could not be recorded).
    Waited(Option<StreamMark>),
    /// Waited for on the host: the producer's work is complete, any stream may go.
    Complete,
}

/// The consumer's claim on one record of the producer's pool (one import). The first
/// [`wait_on`](EventClaim::wait_on) makes a stream wait for the producer's record and then
/// acknowledges it; after that the producer may record the slot again, so a second stream
/// waits on a private mark recorded on the first one instead. Dropped without a wait, the
/// claim acknowledges the record, so the producer's slot never jams.
pub struct EventClaim {
    events: Arc<RemoteEvents>,
    slot: u32,
    seq: u64,
    state: parking_lot::Mutex<ClaimState>,
}

impl EventClaim {
    /// Make `stream` wait for the producer's write (a stream wait, never a device-wide
    /// synchronize).
    pub fn wait_on(&self, stream: CudaStream) -> Result<()> {
        let mut st = self.state.lock();
        match &*st {
            ClaimState::Complete => Ok(()),
            ClaimState::Waited(Some(mark)) => mark.order(stream),
            ClaimState::Waited(None) => Err(Error::InvalidArgument(
                "this CUDA import ordered its first stream, but the event that would order a second one could not be \
                 recorded: use the first stream"
                    .into(),
            )),
            ClaimState::Open => {
                // A wait that could not be enqueued (or ran out on the host) changes
                // nothing: the claim stays open (a later call may succeed; the drop
                // acknowledges).
                let on_stream = self.events.wait(self.slot, stream)?;
                // The wait is enqueued or over: this claim never waits on the record again.
                self.events.ack(self.slot, self.seq);
                *st = if on_stream {
                    ClaimState::Waited(StreamMark::record(self.events.device, stream).ok())
                } else {
                    ClaimState::Complete
                };
                Ok(())
            }
        }
    }
}

impl Drop for EventClaim {
    fn drop(&mut self) {
        if matches!(*self.state.get_mut(), ClaimState::Open) {
            self.events.ack(self.slot, self.seq);
        }
    }
}

