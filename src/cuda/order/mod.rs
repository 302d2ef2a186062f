//! Cross-process stream order: how a consumer's CUDA work comes after the producer's,
//! without a device-wide synchronize and — by default — without a GPU-side wait on
//! another process's IPC event, which costs a GPU time-slice switch without MPS.
//!
//! The producer signals after the work a message depends on (`producer`): by default its
//! stream writes a sequence word in a sealed memfd both processes register with CUDA
//! (`words`), one lane per producer stream; where the consumer asks for IPC events
//! (`CudaWait::Event`) or words cannot be used here, it records a pooled IPC event
//! (`event_pool`). The consumer claims the signal its message names (`consumer`,
//! `remote_events`) and waits for it as its [`CudaWait`] policy says: its stream waits on
//! the word (`Stream`), its thread waits on the host for the word or the event (`Host`, and
//! `Stream` where only events come), or its stream waits on the event (`Event`). A
//! GPU-side wait on a word is watched (`watchdog`): ended by this side when the producer
//! dies or its signal does not come in time, so no peer can hang our stream for good.
//!
//! Which file holds what: the policy (`policy`), the words (`words`), the producer's lanes
//! and signaller (`producer`), its event pool (`event_pool`), the consumer's claims
//! (`consumer`) and its side of the event pool (`remote_events`), host waits
//! (`host_wait`), the peer's liveness (`liveness`), the watchdog (`watchdog`).

mod consumer;
pub mod event_pool;
mod host_wait;
mod liveness;
mod policy;
mod producer;
pub mod remote_events;
pub mod watchdog;
pub mod words;

pub use consumer::{OrderClaim, RemoteSignals, RemoteWords};
pub(crate) use host_wait::host_wait;
pub use liveness::PeerWatch;
pub use policy::CudaWait;
pub use producer::{Signal, Signaller, WordLanes, LANES};
