//! What a CUDA descriptor names for the consumer to wait on before it uses the tensor (the
//! producer's side: `cuda::order::producer`; the consumer's: `cuda::order::consumer`).

/// What a message names for the consumer to wait on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// Lane `lane` of the producer's signal words reaches `value`.
    Word { lane: u32, value: u32 },
    /// Record `seq` of the producer's pooled IPC event `slot`.
    Event { slot: u32, seq: u64 },
}
