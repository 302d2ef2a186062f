//! Loom models of tensorwire's shared-memory protocols live in `tests/` of this crate
//! (`tests/loom.rs`, `tests/loom_ring.rs`), run against the production code through the
//! `tensorwire::sync` shim:
//!
//! ```text
//! RUSTFLAGS="--cfg loom" cargo test --release -p tensorwire-loom --target-dir target-loom
//! ```
//!
//! The crate has no code of its own: it exists so that the loom build compiles
//! tensorwire and loom only, not tensorwire's dev-dependencies.
