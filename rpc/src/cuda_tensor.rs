//! CUDA tensors in RPC values (native mode only).
//!
//! Sending: a [`CudaTensor`] names device memory of ours — a device pointer, the bytes of
//! storage behind it, the view's layout, the device, the stream its last write was
//! enqueued on, and an owner that keeps the allocation alive. Each time it is sent the
//! transport exports it ([`tensorwire::Peer::export_cuda`]: an IPC handle, or a VMM fd,
//! plus an IPC event recorded on `stream`) under a lease holding a clone of the owner, so
//! the memory lives until the receiver gives every lease back and the caller drops its
//! own `CudaTensor` — whichever comes last.
//!
//! Receiving: a [`crate::tensor::CudaImportedTensor`] is the peer's allocation opened in
//! this process.
//! Before touching it on a stream, call `wait_on(stream)` (stream order with the peer's
//! last write, never a device-wide synchronize); the lease is given back when the value
//! is dropped (for a handler: when it returns and its arguments go), or explicitly with
//! `into_inner().release_after(stream)` once GPU work reading it is enqueued.
//!
//! There is no host copy here (`to_vec` and friends refuse CUDA tensors): the bytes are
//! device memory, read with the driver on a stream after `wait_on`. A CUDA tensor cannot
//! travel over a connection without native tensors (a pyisolate `TensorRef` for CUDA
//! needs torch's CUDA runtime on both ends): sending one there is
//! [`RpcError::CudaNotNative`].

use crate::error::{Result, RpcError};
use std::sync::Arc;
use tensorwire::Layout;
use tensorwire::cuda::{CudaStream, DevicePtr};

/// Device memory of ours, ready to send natively (see the module docs).
pub struct CudaTensor {
    dptr: u64,
    nbytes: u64,
    layout: Layout,
    device: i32,
    stream: usize,
    owner: Arc<dyn Send + Sync>,
}

impl CudaTensor {
    /// `nbytes` of device memory at `dptr` (any pointer into a CUDA allocation of
    /// `device`), viewed as `layout` (its offset and strides count from `dptr`), whose
    /// last write was enqueued on `stream` (`0`: the legacy stream). `owner` keeps the
    /// allocation alive: it is dropped when this value and every lease of every send of
    /// it are gone.
    ///
    /// Checks with the driver that `dptr` belongs to `device` (`CudaUnavailable` without
    /// a driver) and that the view fits in `nbytes`.
    pub fn new(dptr: u64, nbytes: u64, layout: Layout, device: i32, stream: usize, owner: impl Send + Sync + 'static) -> Result<CudaTensor> {
        let need = layout.extent_bytes()?;
        if need > nbytes {
            return Err(RpcError::InvalidArgument(format!(
                "a {layout:?} CUDA view needs {need} bytes of storage, {nbytes} were given"
            )));
        }
        let actual = tensorwire::cuda::driver::pointer_device(DevicePtr(dptr))?;
        if actual != device {
            return Err(RpcError::InvalidArgument(format!(
                "device pointer {dptr:#x} belongs to device {actual}, not to device {device} as given"
            )));
        }
        Ok(CudaTensor { dptr, nbytes, layout, device, stream, owner: Arc::new(owner) })
    }
    pub fn layout(&self) -> Layout {
        self.layout
    }
    pub fn device(&self) -> i32 {
        self.device
    }
    pub fn storage_ptr(&self) -> u64 {
        self.dptr
    }
    pub fn storage_nbytes(&self) -> u64 {
        self.nbytes
    }
    pub fn stream(&self) -> usize {
        self.stream
    }

    /// Export through `peer` under a new lease holding a clone of the owner.
    pub(crate) fn export(&self, peer: &tensorwire::Peer, tag: u64) -> Result<()> {
        let owner: tensorwire::Owner = Box::new(self.owner.clone());
        let (dptr, stream) = (DevicePtr(self.dptr), CudaStream(self.stream));
        peer.export_cuda(dptr, self.nbytes, &self.layout, stream, owner, tensorwire::ExportOptions { tag, window: None })?;
        Ok(())
    }
}

/// `"cuda:N"` as torch writes a device.
pub(crate) fn device_name(device: i32) -> String {
    format!("cuda:{device}")
}

/// The message for host copies of a CUDA tensor, which this crate does not make.
pub(crate) fn no_host_copy(layout: &Layout, what: &str) -> RpcError {
    RpcError::InvalidArgument(format!(
        "{what} of a {layout:?} CUDA tensor: its bytes are device memory; read them with the driver on a stream after wait_on (storage_ptr/data_ptr)"
    ))
}
