//! A connection's CUDA signal words (`crate::cuda::order::words`): a sealed memfd of
//! 32-bit words, one per lane.

/// Bytes between two lanes' words (a cache line each).
pub const LANE_STRIDE: usize = 64;
/// Most lanes a peer may announce.
pub const MAX_LANES: u32 = 2048;
