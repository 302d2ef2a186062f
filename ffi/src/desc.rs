//! Layouts (views) and descriptors in C. Plain value types: no thread-safety concerns.

use super::{arg, get, guard, need, put, quiet, tw_result_e};
use tensorwire::desc::{DType, Layout, TensorDesc, DESC_SIZE, MAX_NDIM};
use tensorwire::error::Error;

/// Most dimensions of a view.
pub const TW_MAX_NDIM: usize = 16;
const _: () = assert!(TW_MAX_NDIM == MAX_NDIM);

// Spelled out for cbindgen, which cannot expand the table in `desc/dtype.rs`;
// `ffi/tests/c_header.rs` checks that the two name the same dtypes with the same numbers.
/// Element types for `tw_layout_t.dtype`, numbered exactly like `c10::ScalarType`.
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum tw_dtype_e {
    TW_DTYPE_UINT8 = 0,
    TW_DTYPE_INT8 = 1,
    TW_DTYPE_INT16 = 2,
    TW_DTYPE_INT32 = 3,
    TW_DTYPE_INT64 = 4,
    TW_DTYPE_FLOAT16 = 5,
    TW_DTYPE_FLOAT32 = 6,
    TW_DTYPE_FLOAT64 = 7,
    TW_DTYPE_COMPLEX32 = 8,
    TW_DTYPE_COMPLEX64 = 9,
    TW_DTYPE_COMPLEX128 = 10,
    TW_DTYPE_BOOL = 11,
    TW_DTYPE_BFLOAT16 = 15,
    TW_DTYPE_FLOAT8_E5M2 = 23,
    TW_DTYPE_FLOAT8_E4M3FN = 24,
    TW_DTYPE_FLOAT8_E5M2FNUZ = 25,
    TW_DTYPE_FLOAT8_E4M3FNUZ = 26,
    TW_DTYPE_UINT16 = 27,
    TW_DTYPE_UINT32 = 28,
    TW_DTYPE_UINT64 = 29,
    TW_DTYPE_FLOAT8_E8M0FNU = 44,
}

/// Shape, strides (elements) and storage offset (elements) of a view. `dtype` is the
/// `c10::ScalarType` number. Entries past `ndim` are ignored.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tw_layout_t {
    pub dtype: u8,
    pub ndim: u8,
    pub reserved: [u8; 6],
    pub storage_offset: i64,
    pub sizes: [i64; 16],
    pub strides: [i64; 16],
}

impl tw_layout_t {
    pub(crate) fn to_layout(self) -> Result<Layout, Error> {
        let dtype = DType::from_code(self.dtype)
            .ok_or_else(|| Error::InvalidArgument(format!("unknown dtype code {}", self.dtype)))?;
        let nd = self.ndim as usize;
        if nd > MAX_NDIM {
            return Err(Error::InvalidArgument(format!("ndim {nd} exceeds the limit of {MAX_NDIM}")));
        }
        Layout::strided(dtype, &self.sizes[..nd], &self.strides[..nd], self.storage_offset)
    }

    pub(crate) fn from_layout(l: &Layout) -> tw_layout_t {
        let mut out = tw_layout_t {
            dtype: l.dtype as u8,
            ndim: l.ndim() as u8,
            reserved: [0; 6],
            storage_offset: l.storage_offset,
            sizes: [0; 16],
            strides: [0; 16],
        };
        out.sizes[..l.ndim()].copy_from_slice(l.sizes());
        out.strides[..l.ndim()].copy_from_slice(l.strides());
        out
    }
}

/// Bytes per element of `dtype` (a `c10::ScalarType` number); 0 if unsupported.
#[unsafe(no_mangle)]
pub extern "C" fn tw_dtype_size(dtype: u8) -> usize {
    quiet(0, || DType::from_code(dtype).map_or(0, DType::size))
}

/// Size in bytes of an encoded descriptor.
#[unsafe(no_mangle)]
pub extern "C" fn tw_desc_size() -> usize {
    DESC_SIZE
}

/// A contiguous row-major layout of `ndim` sizes.
///
/// # Safety
/// `sizes` must be readable for `ndim` values (may be NULL when `ndim` is 0); `out`
/// must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_layout_contiguous(dtype: u8, sizes: *const i64, ndim: usize, out: *mut tw_layout_t) -> tw_result_e {
    guard("tw_layout_contiguous", || {
        need(out, "out")?;
        let sizes = if ndim == 0 {
            &[][..]
        } else {
            need(sizes, "sizes")?;
            if ndim > MAX_NDIM {
                return Err(Error::InvalidArgument(format!("ndim {ndim} exceeds the limit of {MAX_NDIM}")).into());
            }
            // SAFETY: non-null, readable for ndim ≤ 16 values per the contract.
            unsafe { std::slice::from_raw_parts(sizes, ndim) }
        };
        let dt = DType::from_code(dtype).ok_or_else(|| Error::InvalidArgument(format!("unknown dtype code {dtype}")))?;
        let l = Layout::contiguous(dt, sizes)?;
        // SAFETY: checked non-null.
        unsafe { put(out, tw_layout_t::from_layout(&l), "out") }
    })
}

/// Bytes of storage the view needs (checked: overflow, negative values, unknown dtype).
///
/// # Safety
/// `layout` must be readable, `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_layout_extent_bytes(layout: *const tw_layout_t, out: *mut u64) -> tw_result_e {
    // SAFETY: forwarded from this function's contract.
    unsafe { get("tw_layout_extent_bytes", (layout, "layout"), out, |l| Ok(l.to_layout()?.extent_bytes()?)) }
}

/// Copy `len` untrusted bytes into `out` and validate them as a descriptor: version,
/// dtype, device, storage kind, ndim, padding, signs, overflow, extent inside storage.
///
/// # Safety
/// `bytes` must be readable for `len` bytes; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_desc_decode(bytes: *const u8, len: usize, out: *mut TensorDesc) -> tw_result_e {
    guard("tw_desc_decode", || {
        need(out, "out")?;
        need(bytes, "bytes")?;
        // SAFETY: non-null and readable for `len` bytes per the contract.
        let b = unsafe { std::slice::from_raw_parts(bytes, len) };
        let d = TensorDesc::decode(b)?;
        // SAFETY: checked non-null.
        unsafe { put(out, d, "out") }
    })
}

/// Validate `desc` and write its `tw_desc_size()` wire bytes to `out`.
///
/// # Safety
/// `desc` readable; `out` writable for `out_len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_desc_encode(desc: *const TensorDesc, out: *mut u8, out_len: usize) -> tw_result_e {
    guard("tw_desc_encode", || {
        // SAFETY: readable per the contract; NULL refused.
        let d = unsafe { arg(desc, "desc")? };
        need(out, "out")?;
        d.validate()?;
        if out_len < DESC_SIZE {
            return Err(Error::InvalidArgument(format!("output of {out_len} bytes; a descriptor needs {DESC_SIZE}")).into());
        }
        // SAFETY: out is writable for out_len ≥ DESC_SIZE bytes.
        unsafe { std::ptr::copy_nonoverlapping(d.encode().as_ptr(), out, DESC_SIZE) };
        Ok(())
    })
}

/// The view part of a (validated) descriptor.
///
/// # Safety
/// `desc` readable; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_desc_layout(desc: *const TensorDesc, out: *mut tw_layout_t) -> tw_result_e {
    let read = |d: &TensorDesc| {
        d.validate()?;
        Ok(tw_layout_t::from_layout(&d.layout()))
    };
    // SAFETY: forwarded from this function's contract.
    unsafe { get("tw_desc_layout", (desc, "desc"), out, read) }
}
