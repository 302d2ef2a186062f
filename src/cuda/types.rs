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

/// A CUDA driver result code (`CUresult`'s number), with named constants for the codes
/// tensorwire acts on; `Error::Cuda` carries it with the driver's name for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CudaCode(pub u32);

impl CudaCode {
    pub const INVALID_VALUE: CudaCode = CudaCode::of(sys::CUresult::CUDA_ERROR_INVALID_VALUE);
    pub const NOT_INITIALIZED: CudaCode = CudaCode::of(sys::CUresult::CUDA_ERROR_NOT_INITIALIZED);
    pub const OUT_OF_MEMORY: CudaCode = CudaCode::of(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    pub const NO_DEVICE: CudaCode = CudaCode::of(sys::CUresult::CUDA_ERROR_NO_DEVICE);
    pub const INVALID_DEVICE: CudaCode = CudaCode::of(sys::CUresult::CUDA_ERROR_INVALID_DEVICE);
    pub const INVALID_CONTEXT: CudaCode = CudaCode::of(sys::CUresult::CUDA_ERROR_INVALID_CONTEXT);
    pub const MAP_FAILED: CudaCode = CudaCode::of(sys::CUresult::CUDA_ERROR_MAP_FAILED);
    pub const INVALID_HANDLE: CudaCode = CudaCode::of(sys::CUresult::CUDA_ERROR_INVALID_HANDLE);
    pub const NOT_FOUND: CudaCode = CudaCode::of(sys::CUresult::CUDA_ERROR_NOT_FOUND);
    pub const NOT_READY: CudaCode = CudaCode::of(sys::CUresult::CUDA_ERROR_NOT_READY);
    pub const NOT_SUPPORTED: CudaCode = CudaCode::of(sys::CUresult::CUDA_ERROR_NOT_SUPPORTED);
    pub const UNKNOWN: CudaCode = CudaCode::of(sys::CUresult::CUDA_ERROR_UNKNOWN);

    const fn of(r: sys::CUresult) -> CudaCode {
        CudaCode(r as u32)
    }
}

impl From<sys::CUresult> for CudaCode {
    fn from(r: sys::CUresult) -> CudaCode {
        CudaCode::of(r)
    }
}

/// The number, as the driver's documentation lists it.
impl fmt::Display for CudaCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}
