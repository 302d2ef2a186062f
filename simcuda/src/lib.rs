//! simcuda: a simulated CUDA driver, stricter than the real one, loaded as `libcuda.so.1`
//! so that tensorwire's CUDA code runs in every test run on machines without a GPU.
//!
//! Device memory lives in memfds: the device address range is reserved `PROT_NONE` in the
//! process (a host dereference of a device pointer faults, as on hardware) and simcuda
//! moves bytes through a private alias mapping of the same pages. Streams run their work
//! on worker threads after seeded random delays, so a missing wait shows up as wrong data.
//! See README.md beside this crate for each call's semantics and where they come from.

mod context;
mod cost;
mod events;
mod exports_ctx;
mod exports_mem;
mod faults;
mod host_register;
mod ipc;
mod memory;
mod memops;
mod result;
mod stats;
mod stream;
mod vmm;

pub use stats::SimcudaStats;
