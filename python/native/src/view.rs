//! What an op was handed as a tensor view (dtype by torch name, sizes, strides), checked as
//! the C++ extension's ops check it before tensorwire sees it. Below `connection`, `cuda`,
//! `ring` and `storage`, which all take views.

use crate::errors::{IntoPy, op_error, refused};
use pyo3::prelude::*;
use tensorwire::{DType, Layout, MAX_NDIM};

pub(crate) fn dtype_named(py: Python<'_>, name: &str) -> PyResult<DType> {
    DType::ALL
        .into_iter()
        .find(|d| d.name() == name)
        .ok_or_else(|| refused(py, format!("tensorwire: dtype torch.{name} is not supported")))
}

/// The view an op was handed (`sizes` and `strides` counts), checked as the op checks it
/// before tensorwire sees it (the C++ extension's `make_layout`): at most `MAX_NDIM`
/// dimensions, one stride per size; each refusal is the op's own ([`op_error`]).
pub(crate) fn check_view(py: Python<'_>, op: &str, sizes: usize, strides: usize) -> PyResult<()> {
    if sizes > MAX_NDIM {
        return Err(op_error(py, format!("tensorwire.{op}: {sizes} dimensions; tensorwire carries at most {MAX_NDIM}")));
    }
    if sizes != strides {
        return Err(op_error(py, format!("tensorwire.{op}: {sizes} sizes but {strides} strides")));
    }
    Ok(())
}

/// The view an op was handed (`dtype` by torch name, `sizes`, `strides`, `storage_offset`
/// in elements) as a layout: checked as [`check_view`] checks it, then by tensorwire, whose
/// refusal is named for `function` (the C call the C++ extension makes there).
pub(crate) fn view_layout(
    py: Python<'_>,
    op: &str,
    function: &str,
    dtype: &str,
    sizes: &[i64],
    strides: &[i64],
    storage_offset: i64,
) -> PyResult<Layout> {
    check_view(py, op, sizes.len(), strides.len())?;
    Layout::strided(dtype_named(py, dtype)?, sizes, strides, storage_offset).py_err_in(py, function)
}
