//! The CUDA boundary of the CPU binding: what `Peer.recv` does with a CUDA import. This
//! placeholder refuses it (the import is dropped, so its lease goes back); the CUDA module
//! of `tensorwire._native` replaces this file with the real one.

use crate::errors::refused;
use pyo3::prelude::*;
use tensorwire::CudaImported;

/// An object the Python side finishes with the current stream (`_cuda_ops.finish_recv`);
/// here always `Refused`.
pub fn pending(py: Python<'_>, imp: CudaImported, tag: u64) -> PyResult<Py<PyAny>> {
    let _ = (imp, tag);
    Err(refused(py, "tensorwire: CUDA tensors need the CUDA module of tensorwire._native".to_string()))
}
