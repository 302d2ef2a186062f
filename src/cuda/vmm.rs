//! VMM allocations shared by fd: memory from `cuMemCreate` with the POSIX-fd handle
//! type, exported with `cuMemExportToShareableHandle`, passed by SCM_RIGHTS, imported with
//! `cuMemImportFromShareableHandle` + reserve + map + set access. This is the path for
//! allocators that legacy IPC cannot share (PyTorch's expandable segments).

use super::driver::{call, ensure_context};
use super::types::DevicePtr;
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

fn prop(device: i32) -> sys::CUmemAllocationProp {
    // SAFETY: an all-zero CUmemAllocationProp is valid (no flags, null metadata).
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    p.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.__bindgen_anon_1.id = device;
    p
}

/// What a producer sends for a pointer into VMM memory: the fd of the physical
/// allocation that backs it (with SCM_RIGHTS), its size and the pointer's offset in it.
#[derive(Debug)]
pub struct VmmExport {
    pub device: i32,
    pub fd: OwnedFd,
    pub alloc_size: u64,
    pub offset: u64,
}

/// Export the VMM allocation that backs `nbytes` at `dptr` (memory from `cuMemCreate`
/// with the POSIX-fd handle type, mapped in this process — PyTorch's expandable segments
/// with IPC enabled). A range that crosses into another physical allocation (an
/// expandable segment maps many side by side) cannot be shared as one: an error says so.
pub fn export_pointer(dptr: DevicePtr, nbytes: u64) -> Result<VmmExport> {
    let device = super::driver::pointer_device(dptr)?;
    let _ctx = ensure_context(device)?;
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: valid out-pointers. For VMM memory the driver reports the physical
    // allocation mapped at `dptr`, not the whole reserved range.
    call("cuMemGetAddressRange", || unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, dptr.get()) })?;
    let offset = dptr.get() - base;
    if offset.checked_add(nbytes).is_none_or(|end| end > size as u64) {
        return Err(Error::InvalidArgument(format!(
            "{nbytes} bytes at offset {offset} cross the end of the {size}-byte VMM allocation that backs them \
             (an expandable segment maps many allocations side by side): send it through the GPU ring instead"
        )));
    }
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: valid out-pointer; `base` is mapped (it came from the driver).
    call("cuMemRetainAllocationHandle", || unsafe { sys::cuMemRetainAllocationHandle(&mut handle, base as *mut std::ffi::c_void) })?;
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: for the POSIX-fd handle type the driver writes an int to the pointer.
    let exported = call("cuMemExportToShareableHandle", || unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fd as *mut std::ffi::c_int).cast(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    });
    // SAFETY: drops the reference cuMemRetainAllocationHandle took (the mapping keeps
    // the allocation alive).
    let _ = call("cuMemRelease", || unsafe { sys::cuMemRelease(handle) });
    exported.map_err(|e| match e {
        Error::Cuda { name, .. } => Error::InvalidArgument(format!(
            "this VMM memory cannot be shared by fd ({name}): it was created without the POSIX-fd handle type"
        )),
        other => other,
    })?;
    // SAFETY: a fresh fd from the driver, owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok(VmmExport { device, fd, alloc_size: size as u64, offset })
}

/// A mapped VMM allocation (created here or imported from a peer's fd).
pub struct VmmAllocation {
    device: i32,
    handle: sys::CUmemGenericAllocationHandle,
    ptr: u64,
    size: u64,
}

impl VmmAllocation {
    /// Allocate at least `size` bytes on `device` (rounded up to the granularity).
    pub fn create(device: i32, size: u64) -> Result<VmmAllocation> {
        let _ctx = ensure_context(device)?;
        let p = prop(device);
        let mut gran: usize = 0;
        // SAFETY: valid out-pointer and property struct.
        call("cuMemGetAllocationGranularity", || unsafe {
            sys::cuMemGetAllocationGranularity(&mut gran, &p, sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        })?;
        let gran = gran.max(1) as u64;
        let size = size.max(1).div_ceil(gran) * gran;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out-pointer and property struct.
        call("cuMemCreate", || unsafe { sys::cuMemCreate(&mut handle, size as usize, &p, 0) })?;
        Self::map(device, handle, size)
    }

    fn map(device: i32, handle: sys::CUmemGenericAllocationHandle, size: u64) -> Result<VmmAllocation> {
        let release = |e: Error| {
            // SAFETY: releasing the handle we own on a failure path.
            let _ = call("cuMemRelease", || unsafe { sys::cuMemRelease(handle) });
            e
        };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; reserve a fresh range of `size` bytes.
        call("cuMemAddressReserve", || unsafe { sys::cuMemAddressReserve(&mut ptr, size as usize, 0, 0, 0) }).map_err(release)?;
        let unreserve = |e: Error| {
            // SAFETY: freeing the range reserved above.
            let _ = call("cuMemAddressFree", || unsafe { sys::cuMemAddressFree(ptr, size as usize) });
            release(e)
        };
        // SAFETY: map the whole allocation at the start of our reserved range.
        call("cuMemMap", || unsafe { sys::cuMemMap(ptr, size as usize, 0, handle, 0) }).map_err(unreserve)?;
        let access = sys::CUmemAccessDesc {
            location: prop(device).location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the range is mapped; one valid access descriptor.
        if let Err(e) = call("cuMemSetAccess", || unsafe { sys::cuMemSetAccess(ptr, size as usize, &access, 1) }) {
            // SAFETY: undo the mapping made above.
            let _ = call("cuMemUnmap", || unsafe { sys::cuMemUnmap(ptr, size as usize) });
            return Err(unreserve(e));
        }
        Ok(VmmAllocation { device, handle, ptr, size })
    }

    /// An fd the peer can import (send it with SCM_RIGHTS, with `size()` and `device()`).
    pub fn export_fd(&self) -> Result<OwnedFd> {
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: for the POSIX-fd handle type the driver writes an int to the pointer.
        call("cuMemExportToShareableHandle", || unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast(),
                self.handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        // SAFETY: a fresh fd from the driver, owned by nobody else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Import a peer's allocation of `size` bytes on `device` from its fd.
    pub fn import_fd(fd: &OwnedFd, device: i32, size: u64) -> Result<VmmAllocation> {
        if size == 0 || size > 1 << 44 {
            return Err(Error::InvalidDescriptor(format!("VMM allocation of {size} bytes")));
        }
        let _ctx = ensure_context(device)?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: for the POSIX-fd type the OS handle is the fd value itself, passed as a
        // pointer-sized integer; the driver dups what it needs.
        call("cuMemImportFromShareableHandle", || unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        Self::map(device, handle, size)
    }

    pub fn ptr(&self) -> DevicePtr {
        DevicePtr(self.ptr)
    }
    pub fn size(&self) -> u64 {
        self.size
    }
    pub fn device(&self) -> i32 {
        self.device
    }
}

impl Drop for VmmAllocation {
    fn drop(&mut self) {
        let _ctx = super::driver::ensure_context(self.device);
        // SAFETY: undo map, reserve and create, once each, in reverse order.
        let _ = call("cuMemUnmap", || unsafe { sys::cuMemUnmap(self.ptr, self.size as usize) });
        // SAFETY: as above.
        let _ = call("cuMemAddressFree", || unsafe { sys::cuMemAddressFree(self.ptr, self.size as usize) });
        // SAFETY: as above.
        let _ = call("cuMemRelease", || unsafe { sys::cuMemRelease(self.handle) });
    }
}
