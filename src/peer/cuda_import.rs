//! CUDA imports: the memory behind them (IPC mapping or VMM allocation) and their
//! stream-ordered release.

use crate::cuda::{CudaStream, DevicePtr};
use crate::desc::{Layout, TensorDesc};
use crate::error::Result;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use super::export::{CudaHandle, CudaStorage};
use super::held_lease::{import_accessors, HeldLease};
use super::reaper::hold_until;

/// A CUDA tensor imported from the peer: its allocation opened through the process's
/// handle cache, valid until released (or dropped, which releases). Before touching it on
/// a stream, call [`CudaImported::wait_on`] with that stream. Sent on to another peer as
/// the same memory with [`Peer::export_cuda_imported`](super::Peer::export_cuda_imported)
/// (in an `Arc`: the forward's lease shares it).
///
/// Fields drop in order: the mapping is closed before the lease goes back, so the
/// producer never frees memory this process still has open.
pub struct CudaImported {
    pub(super) mapping: CudaMemory,
    /// The producer's fd of a VMM allocation, kept to forward it as the same memory (the
    /// relay never exports it again through the driver); `None` for legacy IPC, whose
    /// handle bytes are in the descriptor.
    pub(super) vmm_fd: Option<OwnedFd>,
    pub(super) claim: crate::cuda::order::OrderClaim,
    pub(super) held: HeldLease,
    pub(super) desc: TensorDesc,
    pub(super) tag: u64,
}

/// The memory behind a CUDA import: an IPC handle opened through the process's cache, or
/// a VMM allocation mapped from the producer's fd.
pub(super) enum CudaMemory {
    Ipc(crate::cuda::ipc::IpcMapping),
    Vmm(crate::cuda::vmm::VmmAllocation),
}

impl CudaMemory {
    pub(super) fn base(&self) -> DevicePtr {
        match self {
            CudaMemory::Ipc(m) => m.base(),
            CudaMemory::Vmm(a) => a.ptr(),
        }
    }
    pub(super) fn size(&self) -> u64 {
        match self {
            CudaMemory::Ipc(m) => m.size(),
            CudaMemory::Vmm(a) => a.size(),
        }
    }
    pub(super) fn device(&self) -> i32 {
        match self {
            CudaMemory::Ipc(m) => m.device(),
            CudaMemory::Vmm(a) => a.device(),
        }
    }
}

impl CudaImported {
    import_accessors!();
    pub fn device(&self) -> i32 {
        self.mapping.device()
    }
    /// Device address of the storage's first byte in this process.
    pub fn storage_ptr(&self) -> DevicePtr {
        self.mapping.base() + self.desc.storage.base_offset
    }
    /// Device address of element 0 of the view.
    pub fn data_ptr(&self) -> DevicePtr {
        self.storage_ptr() + self.desc.data_offset()
    }
    pub fn storage_nbytes(&self) -> u64 {
        self.desc.storage.nbytes
    }
    /// Order `stream`'s later work after the producer's writes, as the connection's
    /// [`CudaWait`](crate::cuda::CudaWait) says: by default the stream waits on the
    /// producer's signal word and this call returns at once (nothing is enqueued when the
    /// producer's work is already complete); `Host` waits here; `Event` makes the stream
    /// wait on the producer's IPC event. Never a device-wide synchronize. Call before the
    /// first use on `stream` (and once for each further stream).
    pub fn wait_on(&self, stream: CudaStream) -> Result<()> {
        self.claim.wait_on(stream)
    }
    /// `Err` once this side had to end a stream's wait for the producer (the producer
    /// died, or its signal did not come within `PeerConfig::cuda_wait_timeout`): the
    /// contents are then undefined. `Ok` while the wait is pending or after it ended as
    /// it should.
    pub fn status(&self) -> Result<()> {
        self.claim.status()
    }
    /// Give the lease back once everything enqueued on `stream` so far has completed —
    /// without blocking: a mark is recorded on the stream and the connection's reaper
    /// releases the lease (and closes the mapping if unused) when the mark is reached.
    pub fn release_after(self, stream: CudaStream) -> Result<()> {
        let mark = crate::cuda::event::StreamMark::record(self.device(), stream)?;
        let inner = self.held.inner.clone();
        let mut deferred = inner.imports.deferred.lock();
        // Checked under the lock `Peer::drop`'s last pass takes: after that pass nobody
        // would release a deferred import (and it would keep `inner` alive for good).
        // Acquire: pairs with the Release store of `stop` in `Peer::drop`.
        if inner.stop.load(Ordering::Acquire) || inner.conn.is_peer_gone() {
            drop(deferred);
            self.linger(mark);
            return Ok(());
        }
        deferred.push((mark, self));
        drop(deferred);
        inner.wake_idle_reaper();
        Ok(())
    }

    /// `release_after` for an import shared with the leases of its forwards (an `Arc`):
    /// this holder lets go once the work enqueued on `stream` so far has completed,
    /// without blocking; the lease goes back when the last holder has let go. Alone (no
    /// forward holds it any more): exactly `release_after`.
    pub fn release_shared_after(self: Arc<Self>, stream: CudaStream) -> Result<()> {
        match Arc::try_unwrap(self) {
            Ok(only) => only.release_after(stream),
            Err(shared) => {
                let mark = crate::cuda::event::StreamMark::record(shared.device(), stream)?;
                hold_until(mark, Box::new(shared));
                Ok(())
            }
        }
    }

    /// Give the lease back (after the work reading it has been enqueued and, if the
    /// producer may reuse the memory at once, completed).
    pub fn release(mut self) -> Result<()> {
        self.held.release()
    }

    /// This import as a descriptor names it, to send on as the same memory: the legacy IPC
    /// handle as it came, or the producer's VMM fd this import kept; the allocation's size
    /// here and the storage's range in it. Nothing is exported through the driver again.
    pub(super) fn forward_storage(&self) -> CudaStorage<'_> {
        let handle = match &self.vmm_fd {
            Some(fd) => CudaHandle::Vmm(fd.as_fd()),
            None => CudaHandle::Ipc(self.desc.storage.cuda_ipc_handle),
        };
        CudaStorage {
            device: self.device(),
            handle,
            alloc_size: self.mapping.size(),
            offset: self.desc.storage.base_offset,
            nbytes: self.desc.storage.nbytes,
        }
    }

    /// Release the lease now but keep the mapping until `mark` is reached: GPU work still
    /// reading it must not find it unmapped (a fault there poisons this process's context).
    pub(super) fn linger(self, mark: crate::cuda::event::StreamMark) {
        let CudaImported { held, mapping, claim, vmm_fd, .. } = self;
        drop((claim, vmm_fd));
        drop(held);
        hold_until(mark, Box::new(mapping));
    }
}
