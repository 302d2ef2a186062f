//! The CUDA driver's result codes as `Error::Cuda` carries them. Here, below the CUDA
//! code, so that `Error` can name them without importing it.

use cudarc::driver::sys;
use std::fmt;

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
