//! CUDA transport: the values it passes around (`types`: device pointers, streams, result
//! codes), the driver through cudarc with dynamic loading (`driver`), IPC memory
//! export/import through a per-process handle cache (`ipc`), pooled IPC events for
//! cross-process stream ordering (`event`), the GPU bounce ring (`ring`), and VMM allocations shared by fd (`vmm`).
//! Without a driver every entry point returns `Error::CudaUnavailable`.
//!
//! See `cuda_gotchas.md` beside this file for what the driver API makes easy to get
//! wrong.

pub mod driver;
pub mod event;
pub mod ipc;
pub mod ring;
pub mod types;
pub mod vmm;

pub use driver::{available, device_count};
pub use types::{CudaCode, CudaStream, DevicePtr};
