//! CUDA transport: the values it passes around (`types`: device pointers, streams, result
//! codes), the driver through cudarc with dynamic loading (`driver`), IPC memory
//! export/import through a per-process handle cache (`ipc`), the driver's event objects
//! (`event`), cross-process stream order (`order`: the wait policies, signal words, the
//! event pool), the GPU bounce ring (`ring`), and VMM allocations shared by fd (`vmm`).
//! Without a driver every entry point returns `Error::CudaUnavailable`.
//!
//! See `cuda_gotchas.md` beside this file for what the driver API makes easy to get
//! wrong.

pub mod driver;
pub mod event;
pub mod ipc;
pub mod order;
pub mod ring;
pub mod types;
pub mod vmm;

pub use driver::{available, device_count};
pub use order::CudaWait;
pub use types::{CudaCode, CudaStream, DevicePtr};
