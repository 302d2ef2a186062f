//! `tensorwire._native`: the Python binding of the tensorwire crate (PyO3, abi3), built by
//! maturin into the package's one wheel. It links no libtorch: tensors reach torch by
//! DLPack (`dlpack`), and the package's Python code turns them into the views it needs.
//!
//! One file a job: `errors` (Rust errors as `tensorwire.errors` classes), `dlpack` (the
//! capsule), `storage` (shared segments, trusted-fd segments, received imports and their
//! registries), `pool` (recycled segments for ordinary tensors sent by copy), `config` (the
//! connection options as a `PeerConfig`), `peer` (`Peer`'s state), `connection` (`Peer`'s
//! methods: opening, CPU send/recv, stats), `listener` (`Listener`), `ring` (the CPU ring), `cuda`
//! (the CUDA boundary `recv` hands CUDA imports to), `build` (`build_info`), `rpc` (the RPC
//! layer and its workers, `tensorwire.rpc`). The package's `torch.ops.tensorwire.*` are
//! Python ops over these (`python/tensorwire/_ops.py`).

mod build;
mod config;
mod connection;
mod cuda;
mod dlpack;
mod errors;
mod listener;
mod peer;
mod pool;
mod ring;
mod rpc;
mod storage;
mod view;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<peer::PyPeer>()?;
    m.add_class::<listener::PyListener>()?;
    m.add_function(wrap_pyfunction!(config::check_connection_options, m)?)?;
    m.add_function(wrap_pyfunction!(config::connection_options, m)?)?;
    m.add_function(wrap_pyfunction!(errors::result_codes, m)?)?;
    m.add_function(wrap_pyfunction!(errors::library_error, m)?)?;
    m.add_function(wrap_pyfunction!(connection::dtypes, m)?)?;
    m.add_function(wrap_pyfunction!(connection::empty_layout, m)?)?;
    m.add_function(wrap_pyfunction!(ring::ring_send, m)?)?;
    m.add_function(wrap_pyfunction!(ring::ring_recv, m)?)?;
    m.add_function(wrap_pyfunction!(build::build_info, m)?)?;
    m.add_function(wrap_pyfunction!(storage::segment_storage, m)?)?;
    m.add_function(wrap_pyfunction!(storage::is_segment, m)?)?;
    m.add_function(wrap_pyfunction!(storage::live_segments, m)?)?;
    m.add_function(wrap_pyfunction!(storage::trusted_fd_storage, m)?)?;
    m.add_function(wrap_pyfunction!(storage::storage_kind, m)?)?;
    m.add_function(wrap_pyfunction!(storage::segment_fd, m)?)?;
    m.add_function(wrap_pyfunction!(pool::pool_stats, m)?)?;
    m.add_function(wrap_pyfunction!(pool::pool_busy, m)?)?;
    rpc::register(m)?;
    cuda::register(m)?;
    Ok(())
}
