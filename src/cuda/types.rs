//! The CUDA values tensorwire's API passes around, each its own type rather than a bare
//! integer: device addresses ([`DevicePtr`]), streams ([`CudaStream`]) and the driver's
//! result codes ([`CudaCode`]). The first two are `#[repr(transparent)]`: the C ABI passes
//! them as the integers they wrap (`uint64_t`, `size_t`).

use cudarc::driver::sys;
use std::fmt;

/// A device address (`CUdeviceptr`) in this process.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The address as the driver takes it.
    pub const fn get(self) -> u64 {
        self.0
    }
}

/// The address `bytes` further on.
impl std::ops::Add<u64> for DevicePtr {
    type Output = DevicePtr;
    fn add(self, bytes: u64) -> DevicePtr {
        DevicePtr(self.0 + bytes)
    }
}

/// Bytes from `base` to this address.
impl std::ops::Sub for DevicePtr {
    type Output = u64;
    fn sub(self, base: DevicePtr) -> u64 {
        self.0 - base.0
    }
}

impl fmt::Display for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// A CUDA stream (`CUstream`) of the caller's context; [`CudaStream::LEGACY`] (0) is the
/// legacy default stream.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CudaStream(pub usize);

impl CudaStream {
    /// The legacy default stream (`CU_STREAM_LEGACY` behaviour of stream 0).
    pub const LEGACY: CudaStream = CudaStream(0);

    /// The handle as the driver takes it.
    pub(crate) fn raw(self) -> sys::CUstream {
        self.0 as sys::CUstream
    }
}

pub use crate::error::cuda_code::CudaCode;

