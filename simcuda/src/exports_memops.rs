//! Exported driver entry points, part 3: stream memory operations (`memops`) and host
//! memory registration (`host_register`). Named by their ABI symbols: cudarc 0.19 loads the
//! `_v2` names (`cuStreamWaitValue32_v2`, `cuMemHostRegister_v2`, …); the older stream
//! memory operation names are exported too (the same operations; they also take
//! `CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER`). Each runs in `guard`.

use crate::host_register;
use crate::memops::{self, Api, Width};
use crate::guard::guard;
use crate::result::*;
use std::ffi::c_void;

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWaitValue32_v2(s: usize, addr: u64, value: u32, flags: u32) -> CuResult {
    guard("cuStreamWaitValue32_v2", true, || memops::wait(s, addr, value.into(), flags, Width::W32))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWaitValue64_v2(s: usize, addr: u64, value: u64, flags: u32) -> CuResult {
    guard("cuStreamWaitValue64_v2", true, || memops::wait(s, addr, value, flags, Width::W64))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWriteValue32_v2(s: usize, addr: u64, value: u32, flags: u32) -> CuResult {
    guard("cuStreamWriteValue32_v2", true, || memops::write(s, addr, value.into(), flags, Width::W32, Api::V2))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWriteValue64_v2(s: usize, addr: u64, value: u64, flags: u32) -> CuResult {
    guard("cuStreamWriteValue64_v2", true, || memops::write(s, addr, value, flags, Width::W64, Api::V2))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWaitValue32(s: usize, addr: u64, value: u32, flags: u32) -> CuResult {
    guard("cuStreamWaitValue32", true, || memops::wait(s, addr, value.into(), flags, Width::W32))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWaitValue64(s: usize, addr: u64, value: u64, flags: u32) -> CuResult {
    guard("cuStreamWaitValue64", true, || memops::wait(s, addr, value, flags, Width::W64))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWriteValue32(s: usize, addr: u64, value: u32, flags: u32) -> CuResult {
    guard("cuStreamWriteValue32", true, || memops::write(s, addr, value.into(), flags, Width::W32, Api::V1))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWriteValue64(s: usize, addr: u64, value: u64, flags: u32) -> CuResult {
    guard("cuStreamWriteValue64", true, || memops::write(s, addr, value, flags, Width::W64, Api::V1))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemHostRegister_v2(p: *mut c_void, bytesize: usize, flags: u32) -> CuResult {
    guard("cuMemHostRegister_v2", true, || host_register::register(p as u64, bytesize as u64, flags))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemHostUnregister(p: *mut c_void) -> CuResult {
    guard("cuMemHostUnregister", true, || host_register::unregister(p as u64))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(pdptr: *mut u64, p: *mut c_void, flags: u32) -> CuResult {
    guard("cuMemHostGetDevicePointer_v2", true, || {
        if pdptr.is_null() {
            return Err(INVALID_VALUE);
        }
        out(pdptr, host_register::device_pointer(p as u64, flags)?)
    })
}
