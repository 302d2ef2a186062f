//! simcuda: a simulated CUDA driver, stricter than the real one, loaded as `libcuda.so.1`
//! so that tensorwire's CUDA code runs in every test run on machines without a GPU.
//!
//! Device memory lives in memfds: the device address range is reserved `PROT_NONE` in the
//! process (a host dereference of a device pointer faults, as on hardware) and simcuda
//! moves bytes through a private alias mapping of the same pages. Streams run their work
//! on worker threads after seeded random delays, so a missing wait shows up as wrong data.
//! Stream memory operations wait on and write words of device memory or of registered
//! host memory, across processes too.
//! See README.md beside this crate for each call's semantics and where they come from.

mod allocation;
mod context;
mod event_state;
mod events;
mod exports_ctx;
mod exports_mem;
mod exports_memops;
mod exports_stats;
mod faults;
mod guard;
mod host_register;
mod ipc;
mod memops;
mod memory;
mod process;
mod result;
mod settings;
mod stats;
mod stats_layout;
mod stream;
mod timeslice;
mod vmm;

pub use exports_stats::SimcudaStats;
