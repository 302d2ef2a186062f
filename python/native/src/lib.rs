//! `tensorwire._native`: the Python binding of the tensorwire crate (PyO3, abi3), built by
//! maturin into the package's one wheel. It links no libtorch: tensors reach torch by
//! DLPack (`dlpack`), and the package's Python code turns them into the views it needs.
//!
//! One file a job: `errors` (Rust errors as `tensorwire.errors` classes), `dlpack` (the
//! capsule), `storage` (shared segments and their registry), `connection` (CPU send/recv),
//! `build` (`build_info`), `rpc` (the RPC layer and its workers, `tensorwire.rpc`).
//! CUDA adds a module of its own and registers it in `_native` below.

mod build;
mod connection;
mod cuda;
mod dlpack;
mod errors;
mod rpc;
mod storage;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<connection::PyPeer>()?;
    m.add_function(wrap_pyfunction!(build::build_info, m)?)?;
    m.add_function(wrap_pyfunction!(storage::segment_storage, m)?)?;
    m.add_function(wrap_pyfunction!(storage::is_segment, m)?)?;
    m.add_function(wrap_pyfunction!(storage::live_segments, m)?)?;
    rpc::register(m)?;
    cuda::register(m)?;
    Ok(())
}
