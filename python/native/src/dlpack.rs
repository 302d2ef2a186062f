//! DLPack by hand (the `DLManagedTensor` ABI of dlpack.h, which every torch since 1.10
//! reads through `torch.from_dlpack(capsule)`): a 1-D uint8 tensor over memory whose Rust
//! owner is dropped by the managed tensor's deleter, inside a `PyCapsule` named
//! `"dltensor"`. Torch renames a capsule it consumed to `"used_dltensor"` and calls the
//! deleter itself when its last view dies; the capsule's destructor frees the tensor only
//! while the capsule is still named `"dltensor"` (never consumed).
//!
//! No crate: the structs are five `#[repr(C)]` definitions and the capsule is three
//! functions of CPython's limited API, and the dlpack crates on crates.io target other
//! PyO3 versions or wrap more than this needs.

use pyo3::ffi;
use pyo3::prelude::*;
use std::ffi::{CStr, c_void};

/// `DLDeviceType::kDLCPU`.
pub const DL_CPU: i32 = 1;
/// `DLDeviceType::kDLCUDA`: device memory, with the device index as `device_id`.
pub const DL_CUDA: i32 = 2;
/// `DLDataTypeCode::kDLUInt`.
const DL_UINT: u8 = 1;

const CAPSULE_NAME: &CStr = c"dltensor";

#[repr(C)]
pub struct DLDevice {
    pub device_type: i32,
    pub device_id: i32,
}

#[repr(C)]
pub struct DLDataType {
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

#[repr(C)]
pub struct DLTensor {
    pub data: *mut c_void,
    pub device: DLDevice,
    pub ndim: i32,
    pub dtype: DLDataType,
    pub shape: *mut i64,
    pub strides: *mut i64,
    pub byte_offset: u64,
}

#[repr(C)]
pub struct DLManagedTensor {
    pub dl_tensor: DLTensor,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// The managed tensor and what keeps its memory alive, in one allocation: `managed` is the
/// first field of a `#[repr(C)]` struct, so a pointer to it is a pointer to the holder.
#[repr(C)]
struct Holder {
    managed: DLManagedTensor,
    shape: [i64; 1],
    strides: [i64; 1],
    owner: Option<Box<dyn Send>>,
}

unsafe extern "C" fn delete_holder(m: *mut DLManagedTensor) {
    if m.is_null() {
        return;
    }
    // Torch may call this on any thread, with or without the GIL; dropping the owner
    // touches no Python object. A panic must not unwind into torch's C++ frames.
    let r = std::panic::catch_unwind(|| {
        // SAFETY: `m` is the `managed` field (offset 0) of a `Holder` made by
        // `Box::into_raw` in `capsule`, and DLPack calls the deleter exactly once.
        drop(unsafe { Box::from_raw(m.cast::<Holder>()) });
    });
    if r.is_err() {
        std::process::abort();
    }
}

unsafe extern "C" fn capsule_destructor(cap: *mut ffi::PyObject) {
    // SAFETY: called by CPython with the GIL held on a live capsule. `PyCapsule_IsValid`
    // is false (and sets no error) once torch renamed it "used_dltensor".
    unsafe {
        if ffi::PyCapsule_IsValid(cap, CAPSULE_NAME.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(cap, CAPSULE_NAME.as_ptr()).cast::<DLManagedTensor>();
            if let Some(d) = (*m).deleter {
                d(m);
            }
        }
    }
}

/// A `"dltensor"` capsule for `nbytes` bytes at `data` on `device` (`(DL_CPU, 0)` or
/// `(DL_CUDA, index)`), as a 1-D uint8 tensor; `owner` keeps the memory alive and is
/// dropped when torch's last view of it dies (or with the capsule, if never consumed).
pub fn capsule(py: Python<'_>, data: *mut u8, nbytes: usize, device: (i32, i32), owner: Box<dyn Send>) -> PyResult<Py<PyAny>> {
    let len = i64::try_from(nbytes).map_err(|_| crate::errors::refused(py, format!("{nbytes} bytes do not fit a tensor")))?;
    let holder = Box::into_raw(Box::new(Holder {
        managed: DLManagedTensor {
            dl_tensor: DLTensor {
                data: data.cast(),
                device: DLDevice { device_type: device.0, device_id: device.1 },
                ndim: 1,
                dtype: DLDataType { code: DL_UINT, bits: 8, lanes: 1 },
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_holder),
        },
        shape: [len],
        strides: [1],
        owner: Some(owner),
    }));
    // SAFETY: `holder` is a fresh, exclusively owned allocation; the shape and strides
    // pointers point into it and live as long as it does.
    unsafe {
        (*holder).managed.dl_tensor.shape = (*holder).shape.as_mut_ptr();
        (*holder).managed.dl_tensor.strides = (*holder).strides.as_mut_ptr();
    }
    // SAFETY: the GIL is held (`py`); on failure the capsule was not made, so the holder
    // is still ours to free through its own deleter.
    unsafe {
        let cap = ffi::PyCapsule_New(holder.cast(), CAPSULE_NAME.as_ptr(), Some(capsule_destructor));
        if cap.is_null() {
            delete_holder(holder.cast());
            return Err(PyErr::fetch(py));
        }
        Ok(Py::from_owned_ptr(py, cap))
    }
}
