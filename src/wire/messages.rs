//! What travels on a connection between two peers after the hello: the message kinds,
//! the tensor message's size and fd slots, and the setup message's flags. The payloads
//! are built and split in `crate::payload`.

use super::descriptor::DESC_SIZE;

/// Setup: the lease table this side grants from (capacity u32, ring bytes u64, flags u32
/// `SETUP_*`; 1 fd).
pub const KIND_TABLE: u32 = 1;
/// A leased tensor: tag (u64), descriptor, fd slot (u32), zero (u32); plus the storage's
/// fd when the message installs it (CPU: the first time a segment goes into a slot; CUDA
/// VMM: every time).
pub const KIND_TENSOR: u32 = 2;
/// The producer dropped a segment the consumer holds no lease on (8-byte id).
pub const KIND_FORGET: u32 = 3;
/// A user message.
pub const KIND_USER: u32 = 4;
/// The producer's CUDA IPC event pool (once, before its first CUDA export): device (i32),
/// count (u32), count x 64-byte event handles; 1 fd: the ack table.
pub const KIND_CUDA_EVENTS: u32 = 5;
/// Setup, right after `KIND_TABLE` when its flags say so: this side's GPU bounce ring
/// (`cuda::ring::RingSetup`, layout in [`super::cuda_ring`]); 2 or 3 fds: control
/// segment, descriptor ring, and the ring's signal words where offered.
pub const KIND_CUDA_RING: u32 = 6;
/// The producer's CUDA signal words (once, before its first CUDA export that names them,
/// instead of `KIND_CUDA_EVENTS` unless the consumer asked for events): device (i32),
/// lanes (u32); 1 fd: the words ([`super::signal_words`]).
pub const KIND_CUDA_SIGNALS: u32 = 7;

/// Bytes of a `KIND_TENSOR` payload: tag (u64), descriptor, fd slot (u32), zero (u32).
pub const TENSOR_PAYLOAD: usize = 8 + DESC_SIZE + 8;
/// Bytes of a `KIND_TABLE` payload.
pub const SETUP_PAYLOAD: usize = 4 + 8 + 4;

/// How many segment fds a consumer keeps per connection on the producer's behalf (its
/// *fd slots*). A CPU tensor message names a slot: with an fd attached it installs that
/// fd there (closing what the slot held), without one it uses the fd already there,
/// which must be of the segment the descriptor names. The producer chooses the slots
/// (least recently used is replaced), so a segment exported again and again travels
/// with its fd once, not with every descriptor (passing an fd costs both sides system
/// calls: SCM_RIGHTS, then `fstat` and `close` on receipt). The consumer's mappings stay
/// bounded on its own terms (`PeerConfig::max_import_*`): an evicted window is mapped
/// again from the slot's fd. So a peer can make us hold at most this many of its fds.
pub const SEGMENT_FD_SLOTS: u32 = 16;
/// The fd slot of a tensor message that names none (CUDA storage).
pub const NO_FD_SLOT: u32 = u32::MAX;

/// `KIND_TABLE` flag: a `KIND_CUDA_RING` message follows.
pub const SETUP_HAS_CUDA_RING: u32 = 1;
/// `KIND_TABLE` flag: this side waits on IPC events (`CudaWait::Event`): the producer
/// records them for its CUDA exports rather than writing signal words.
pub const SETUP_WANTS_EVENTS: u32 = 2;
/// Every `KIND_TABLE` flag this build knows.
pub const SETUP_FLAGS: u32 = SETUP_HAS_CUDA_RING | SETUP_WANTS_EVENTS;
