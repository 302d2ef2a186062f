//! `build_info()`: what this build of the binding is, for `tensorwire.build_info()`.

use pyo3::prelude::*;
use pyo3::types::PyDict;

/// The torch versions the wheel supports: `>= MIN, < BELOW` (pyproject's `Requires-Dist`
/// says the same; `python/tests/test_native.py` checks the two agree).
pub const TORCH_MIN: &str = "2.11";
pub const TORCH_BELOW: &str = "2.16";
/// The torch versions the test command runs the suite against.
pub const TORCH_TESTED: [&str; 2] = ["2.11.0", "2.15.0"];

/// `{"version", "cuda_built", "ucx_built", "torch_min", "torch_below", "torch_tested"}`.
/// `ucx_built`: whether the binding has remote tensors (the `ucx` feature; not in the
/// wheel). CUDA support is
/// always built in: the crate loads the driver at run time (cudarc `dynamic-loading`), so
/// whether CUDA *works* is `cuda_available()`, not a build option.
#[pyfunction]
pub fn build_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("version", env!("CARGO_PKG_VERSION"))?;
    d.set_item("cuda_built", true)?;
    d.set_item("ucx_built", cfg!(feature = "ucx"))?;
    d.set_item("torch_min", TORCH_MIN)?;
    d.set_item("torch_below", TORCH_BELOW)?;
    d.set_item("torch_tested", TORCH_TESTED.to_vec())?;
    Ok(d)
}
