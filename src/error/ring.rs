//! Why a ring operation failed: the typed reasons a ring's other side broke its protocol
//! (`RingBroken`, sticky), and the errors of one call (`RingError`). Here, below the rings,
//! so that `Error` can carry them without importing the ring code.

/// What the other side wrote that the protocol does not allow. Once seen, the ring is
/// unusable for good: every later call on that side fails with the same reason.
///
/// A record's stamp that does not match is never one of these: the stamp word of a
/// position that is not published yet holds whatever an earlier lap left there (a record
/// of that lap, or bytes of a record's data), so a wrong value means "not yet", and the
/// consumer waits as for a producer that sends nothing (until its deadline).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RingBroken {
    /// The consumer's `tail` moved backwards or past the producer's head.
    TailOutOfRange { tail: u64, seen: u64, head: u64 },
    /// A PAD record covers bytes the consumer still holds (read but not yet released:
    /// the producer may not have written there).
    PadOverHeld { offset: u64 },
    /// A record's meta or data part is larger than a record may be.
    RecordOverLimits { offset: u64, meta_len: u32, data_len: u64 },
    /// A record runs past the end of the data area, or into bytes the consumer still holds.
    RecordPastEnd { size: u64, offset: u64 },
    /// A record's sequence number is not the next one.
    Sequence { got: u64, due: u64 },
    /// A record carries flags the protocol does not define.
    UnknownFlags { flags: u32 },
    /// A record's kind is neither DATA nor PAD.
    UnknownKind { kind: u32, offset: u64 },
    /// A record's meta part is neither empty nor a tensor descriptor.
    MetaNotDescriptor { len: usize },
    /// A FIRST record arrived while a chunked message was still incomplete.
    MessageInsideChunked,
    /// A message's first chunk is larger than the message, or a single-record message's
    /// data is not the whole message.
    ChunkLargerThanMessage { chunk: u64, total: u64 },
    /// A continuation chunk arrived with no message started.
    ContinuationWithoutStart,
    /// A chunked message's chunks add up to more than its announced size.
    ChunksExceedTotal { total: u64 },
    /// A chunked message's LAST record came before all of its bytes.
    MessageCutShort { got: u64, total: u64 },
}

impl std::fmt::Display for RingBroken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            RingBroken::TailOutOfRange { tail, seen, head } => {
                write!(f, "consumer tail {tail} outside [{seen}, {head}] (it may only move forward, up to the head)")
            }
            RingBroken::PadOverHeld { offset } => {
                write!(f, "pad record at offset {offset} covers bytes the consumer still holds")
            }
            RingBroken::RecordOverLimits { offset, meta_len, data_len } => {
                write!(f, "record at offset {offset} has meta {meta_len} and data {data_len} bytes: over the limits")
            }
            RingBroken::RecordPastEnd { size, offset } => write!(
                f,
                "record of {size} bytes at offset {offset} passes the end of the area or reaches bytes the consumer still holds"
            ),
            RingBroken::Sequence { got, due } => write!(f, "record sequence {got} where {due} was due"),
            RingBroken::UnknownFlags { flags } => write!(f, "record flags {flags:#x} unknown"),
            RingBroken::UnknownKind { kind, offset } => write!(f, "unknown record kind {kind} at offset {offset}"),
            RingBroken::MetaNotDescriptor { len } => write!(f, "meta of {len} bytes is not a descriptor"),
            RingBroken::MessageInsideChunked => write!(f, "a new message started inside a chunked one"),
            RingBroken::ChunkLargerThanMessage { chunk, total } => write!(f, "chunk of {chunk} bytes for a message of {total}"),
            RingBroken::ContinuationWithoutStart => write!(f, "a continuation chunk arrived with no message started"),
            RingBroken::ChunksExceedTotal { total } => write!(f, "chunks exceed the announced {total} bytes"),
            RingBroken::MessageCutShort { got, total } => write!(f, "message ended at {got} of {total} bytes"),
        }
    }
}

/// Why a ring operation failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RingError {
    /// The other side wrote something the protocol does not allow; the ring is unusable.
    Broken(RingBroken),
    /// A record of this size can never fit (larger than half the data area).
    TooLarge { size: u64, max: u64 },
}

impl std::fmt::Display for RingError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RingError::Broken(why) => write!(f, "ring broken: {why}"),
            RingError::TooLarge { size, max } => write!(f, "record of {size} bytes exceeds the ring's {max}-byte record limit"),
        }
    }
}
