//! CUresult codes simcuda returns, their names and descriptions, and the guard every
//! exported call runs in (initialisation check, fault injection, no unwinding into C).


/// `CUresult` (a C enum: an `int` in the ABI).
pub type CuResult = i32;
/// What a simulated call returns internally: `Err` carries the CUresult.
pub type R<T = ()> = Result<T, CuResult>;

pub const SUCCESS: CuResult = 0;
pub const INVALID_VALUE: CuResult = 1;
pub const OUT_OF_MEMORY: CuResult = 2;
pub const NOT_INITIALIZED: CuResult = 3;
pub const NO_DEVICE: CuResult = 100;
pub const INVALID_DEVICE: CuResult = 101;
pub const INVALID_CONTEXT: CuResult = 201;
pub const MAP_FAILED: CuResult = 205;
pub const INVALID_HANDLE: CuResult = 400;
pub const NOT_FOUND: CuResult = 500;
pub const NOT_READY: CuResult = 600;
pub const ILLEGAL_ADDRESS: CuResult = 700;
pub const TOO_MANY_PEERS: CuResult = 711;
pub const HOST_MEMORY_ALREADY_REGISTERED: CuResult = 712;
pub const HOST_MEMORY_NOT_REGISTERED: CuResult = 713;
pub const NOT_PERMITTED: CuResult = 800;
pub const NOT_SUPPORTED: CuResult = 801;
pub const UNKNOWN: CuResult = 999;

/// (code, name, description) of every code simcuda returns or lets a fault inject.
pub const CODES: &[(CuResult, &str, &str)] = &[
    (SUCCESS, "CUDA_SUCCESS\0", "no error\0"),
    (INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE\0", "invalid argument\0"),
    (OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY\0", "out of memory\0"),
    (NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED\0", "initialization error\0"),
    (NO_DEVICE, "CUDA_ERROR_NO_DEVICE\0", "no CUDA-capable device is detected\0"),
    (INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE\0", "invalid device ordinal\0"),
    (INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT\0", "invalid device context\0"),
    (MAP_FAILED, "CUDA_ERROR_MAP_FAILED\0", "mapping of buffer object failed\0"),
    (INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE\0", "invalid resource handle\0"),
    (NOT_FOUND, "CUDA_ERROR_NOT_FOUND\0", "named symbol not found\0"),
    (NOT_READY, "CUDA_ERROR_NOT_READY\0", "device not ready\0"),
    (ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS\0", "an illegal memory access was encountered\0"),
    (TOO_MANY_PEERS, "CUDA_ERROR_TOO_MANY_PEERS\0", "peer mapping resources exhausted\0"),
    (
        HOST_MEMORY_ALREADY_REGISTERED,
        "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED\0",
        "part or all of the requested memory range is already mapped\0",
    ),
    (HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED\0", "pointer does not correspond to a registered memory region\0"),
    (NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED\0", "operation not permitted\0"),
    (NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED\0", "operation not supported\0"),
    (UNKNOWN, "CUDA_ERROR_UNKNOWN\0", "unknown error\0"),
];

/// The code named `name` (with or without the `CUDA_ERROR_` prefix).
pub fn code_of(name: &str) -> Option<CuResult> {
    CODES.iter().find(|(_, n, _)| {
        let n = n.trim_end_matches('\0');
        n == name || n.strip_prefix("CUDA_ERROR_") == Some(name)
    }).map(|c| c.0)
}

/// Write `v` through an out-pointer the caller passed (null is CUDA_ERROR_INVALID_VALUE).
pub fn out<T>(p: *mut T, v: T) -> R {
    if p.is_null() {
        return Err(INVALID_VALUE);
    }
    // SAFETY: the C caller passed a non-null out-pointer to a `T`, as the API requires.
    unsafe { p.write(v) };
    Ok(())
}
