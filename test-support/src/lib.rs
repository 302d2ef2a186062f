//! What the tensorwire crates' tests and benches share, one file per job: re-running
//! this test (or bench) binary as a child role ([`role`](mod@role)), the line protocol
//! over a child's stdin/stdout ([`lines`](mod@lines)), bounded waits
//! ([`wait`](mod@wait)), deterministic test bytes ([`pattern`](mod@pattern)), a checksum
//! ([`fnv`](mod@fnv)) and hex text ([`hex`](mod@hex)).
//!
//! Crate-specific harnesses (a tensorwire `Peer` over an inherited socket, the RPC victim
//! server, network namespaces) live in each crate's `tests/`, built on these.

pub mod fnv;
pub mod hex;
pub mod lines;
pub mod pattern;
pub mod role;
pub mod wait;

pub use fnv::fnv1a;
pub use hex::{hex, unhex};
pub use lines::{Lines, hear, say};
pub use pattern::pattern;
pub use role::{ROLE_ENV, RoleCommand, role};
pub use wait::wait_until;
