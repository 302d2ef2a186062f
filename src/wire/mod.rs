//! Every constant and header offset of tensorwire's wire formats, named for what it
//! holds: what the two processes of a connection must agree on byte for byte. A change
//! here is a protocol change (bump the version the format carries).
//!
//! The bottom layer: it imports nothing from the crate, so every module that reads or
//! writes a format (the connection, the lease table, the rings, the descriptor, the CUDA
//! ordering) takes its numbers from here and no two places can disagree. The codecs that
//! use them stay with their formats (`payload` for the peer messages, `ring::shared` for
//! the ring segment, ...).

pub mod connection;
pub mod cuda_ring;
pub mod descriptor;
pub mod lease_table;
pub mod messages;
pub mod ring;
pub mod signal_words;
