//! DLPack by hand (the `DLManagedTensor` ABI of dlpack.h, which every torch since 1.10
//! reads through `torch.from_dlpack(capsule)`): a 1-D uint8 tensor over memory, or a typed
//! strided view of it, whose Rust owner is dropped by the managed tensor's deleter, inside
//! a `PyCapsule` named `"dltensor"`. Torch renames a capsule it consumed to
//! `"used_dltensor"` and calls the deleter itself when its last view dies; the capsule's
//! destructor frees the tensor only while the capsule is still named `"dltensor"` (never
//! consumed).
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
/// `DLDataTypeCode`s.
const DL_INT: u8 = 0;
const DL_UINT: u8 = 1;
const DL_FLOAT: u8 = 2;
const DL_BFLOAT: u8 = 4;
const DL_COMPLEX: u8 = 5;
const DL_BOOL: u8 = 6;

/// The DLPack type of `dtype`, for the dtypes every supported torch reads from DLPack
/// (those of DLPack 0.6, which torch 2.0 already spoke); `None` for the rest (unsigned
/// integers wider than 8 bits, float8, complex32), which go as bytes and a torch view.
pub fn dl_dtype(dtype: tensorwire::DType) -> Option<DLDataType> {
    use tensorwire::DType as D;
    let (code, bits) = match dtype {
        D::UInt8 => (DL_UINT, 8),
        D::Int8 => (DL_INT, 8),
        D::Int16 => (DL_INT, 16),
        D::Int32 => (DL_INT, 32),
        D::Int64 => (DL_INT, 64),
        D::Float16 => (DL_FLOAT, 16),
        D::Float32 => (DL_FLOAT, 32),
        D::Float64 => (DL_FLOAT, 64),
        D::BFloat16 => (DL_BFLOAT, 16),
        D::Complex64 => (DL_COMPLEX, 64),
        D::Complex128 => (DL_COMPLEX, 128),
        D::Bool => (DL_BOOL, 8),
        _ => return None,
    };
    Some(DLDataType { code, bits, lanes: 1 })
}

const CAPSULE_NAME: &CStr = c"dltensor";

#[repr(C)]
pub struct DLDevice {
    pub device_type: i32,
    pub device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
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
    // Heap buffers: `managed` points into them, and they do not move with the holder.
    shape: Vec<i64>,
    strides: Vec<i64>,
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
    let uint8 = DLDataType { code: DL_UINT, bits: 8, lanes: 1 };
    // SAFETY: one byte per element over `nbytes` bytes at `data`: the caller's range.
    unsafe { view_capsule(py, data, uint8, vec![len], vec![1], device, owner) }
}

/// A `"dltensor"` capsule for a typed strided view whose element 0 is at `data` (torch
/// reads it as that view in one step: no `view`/`as_strided` after). `owner` as for
/// [`capsule`].
///
/// # Safety
/// Every element the view names (`shape`, non-negative `strides` in elements of `dtype`)
/// lies in memory that `owner` keeps alive.
pub unsafe fn view_capsule(
    py: Python<'_>,
    data: *mut u8,
    dtype: DLDataType,
    mut shape: Vec<i64>,
    mut strides: Vec<i64>,
    device: (i32, i32),
    owner: Box<dyn Send>,
) -> PyResult<Py<PyAny>> {
    let ndim = i32::try_from(shape.len()).map_err(|_| crate::errors::refused(py, format!("{} dimensions do not fit DLPack", shape.len())))?;
    let (shape_ptr, strides_ptr) = (shape.as_mut_ptr(), strides.as_mut_ptr());
    let holder = Box::into_raw(Box::new(Holder {
        managed: DLManagedTensor {
            dl_tensor: DLTensor {
                data: data.cast(),
                device: DLDevice { device_type: device.0, device_id: device.1 },
                ndim,
                dtype,
                shape: shape_ptr,
                strides: strides_ptr,
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_holder),
        },
        // Moving a Vec moves its pointer, not its buffer: `shape_ptr` stays valid.
        shape,
        strides,
        owner: Some(owner),
    }));
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
