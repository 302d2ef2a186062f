//! Forwarding: a tensor received from one peer, sent on to another as the same memory
//! (host → relay → last), never copied. CPU imports first; CUDA imports below
//! ([`Peer::export_cuda_imported`]).
//!
//! The forward is an ordinary leased export whose storage is the import's: the relay
//! sends the upstream producer's memfd (the fd the import keeps, `ImportFd`) with a
//! descriptor naming the same file range, under a lease on the downstream connection
//! whose owner holds the upstream import. So:
//!
//! - the first producer's memory stays leased exactly as long as anyone downstream
//!   (or the relay itself) uses it: the upstream lease is released when the last of the
//!   relay's own handles and its forwards' leases ends;
//! - the downstream consumer releasing, its window running out, or it dying ends the
//!   forward's lease; the relay's reaper then drops the owner, and the upstream lease
//!   goes back to the host if nothing else in the relay holds the import;
//! - the relay dying ends the host's lease to it (the host reclaims it as for any dead
//!   peer). A downstream consumer that still maps the range keeps reading and writing
//!   valid memory: a memfd's pages live while any process maps them — the host's lease
//!   bookkeeping is over, the pages go when the last mapping does.
//!
//! On the downstream connection the storage goes under an id this process allocates
//! (`ImportFd::forward_id`, from the segment id counter), never the upstream's id, which
//! could collide with our own segments' ids; when the relay's last import of that window
//! is gone and no forward lease names it, the downstream consumer is told to forget it,
//! as for a dropped segment.

use crate::cuda::event::StreamMark;
use crate::cuda::CudaStream;
use crate::desc::Layout;
use crate::error::{Error, Result};
use crate::lease::{LeaseId, StorageKeeper};
use super::reaper::hold_until;
use super::{CpuStorage, CudaImported, ExportOptions, Imported, Peer};
use std::sync::Arc;

impl Peer {
    /// Send `imp` (received on any connection, this one included) on to this peer as the
    /// same memory, viewed as `view` (a layout over the import's storage; `None`: the
    /// import's own view). The lease granted here holds `imp`: the upstream lease is
    /// released only when this one ends (release, window, death of this peer, or this
    /// `Peer` dropped) and every other holder of `imp` has let go.
    pub fn export_imported(&self, imp: Arc<Imported>, view: Option<Layout>, opts: ExportOptions) -> Result<LeaseId> {
        self.export_imported_with(imp, view, Box::new(()), opts)
    }

    /// `export_imported`, with `extra` held by the lease too (dropped once, after the
    /// lease ends — or at once if the export fails): e.g. a C release callback.
    pub fn export_imported_with(
        &self,
        imp: Arc<Imported>,
        view: Option<Layout>,
        extra: crate::Owner,
        opts: ExportOptions,
    ) -> Result<LeaseId> {
        let layout = match view {
            Some(l) => l,
            None => imp.layout(),
        };
        let nbytes = imp.desc().storage.nbytes;
        let need = layout.extent_bytes()?;
        if need > nbytes {
            return Err(Error::InvalidArgument(format!(
                "view needs {need} bytes of storage, the imported storage has {nbytes}"
            )));
        }
        let fd = imp.forward_fd().clone();
        let keeper: StorageKeeper = Arc::downgrade(&fd) as _;
        let storage = CpuStorage {
            id: fd.forward_id(),
            keeper,
            fd: fd.fd(),
            base_offset: imp.desc().storage.base_offset,
            nbytes,
        };
        // The owner holds the import (its upstream lease, mapping and fd); the fd is kept
        // alive by the import for as long as the lease needs it.
        let owner: crate::Owner = Box::new((imp, extra));
        self.send_leased(storage, &layout, owner, opts)
    }
}

// CUDA imports. The relay sends on what it received — the legacy IPC handle's bytes (same
// allocation offset and size), or the producer's VMM fd, which the import keeps for this —
// and never opens or exports the memory through the driver again. Stream order: the
// relay's `stream` first waits for the producer's event (through the import's claim: the
// producer's event on the first stream that waits, a private mark after that wait on any
// later one), then an event of this connection's pool is recorded there, as for any CUDA
// export; the downstream consumer waits for that one. So it sees the producer's writes
// and whatever the relay enqueued on `stream` before the forward.
//
// Lifetimes: the forward's lease holds the import (an `Arc`), so the upstream lease goes
// back when that lease has ended and every other holder (the relay's own handle, other
// forwards) has let go. When the forward's lease ends before the relay's work enqueued on
// `stream` before the forward has run (a consumer that releases without waiting, or dies),
// the import is kept until a mark recorded after that work is reached: the mapping is never
// closed under GPU work of this process. Work the relay enqueues later is its own handle's
// business: `release_shared_after(stream)` (or `release_after` once nothing else holds it).

/// A forward's hold on its import: dropped when the forward's lease ends; the import then
/// goes once `mark` (recorded on the relay's stream right after the forward) is reached.
struct ForwardHold {
    imp: Option<Arc<CudaImported>>,
    mark: Option<StreamMark>,
}

impl Drop for ForwardHold {
    fn drop(&mut self) {
        if let (Some(imp), Some(mark)) = (self.imp.take(), self.mark.take()) {
            hold_until(mark, Box::new(imp));
        }
    }
}

impl Peer {
    /// Send `imp` (a CUDA tensor received on any connection, this one included) on to
    /// this peer as the same device memory, viewed as `view` (a layout over the import's
    /// storage; `None`: the import's own view), ordered after the work enqueued on
    /// `stream` (of the import's device): `stream` first waits for the producer's writes
    /// (it need not have waited before; a stream that did waits again, harmlessly). Relay
    /// writes must be enqueued on `stream` (or ordered before it) to be seen downstream.
    /// The lease granted here holds `imp`: the upstream lease is released only when this
    /// one ends and every other holder of `imp` has let go. One device per connection, as
    /// for [`Peer::export_cuda`].
    pub fn export_cuda_imported(
        &self,
        imp: Arc<CudaImported>,
        view: Option<Layout>,
        stream: CudaStream,
        opts: ExportOptions,
    ) -> Result<LeaseId> {
        self.export_cuda_imported_with(imp, view, stream, Box::new(()), opts)
    }

    /// `export_cuda_imported`, with `extra` held by the lease too (dropped once, after the
    /// lease ends — or at once if the export fails): e.g. a C release callback.
    pub fn export_cuda_imported_with(
        &self,
        imp: Arc<CudaImported>,
        view: Option<Layout>,
        stream: CudaStream,
        extra: crate::Owner,
        opts: ExportOptions,
    ) -> Result<LeaseId> {
        let layout = view.unwrap_or_else(|| imp.layout());
        self.check_cuda_export(&layout, imp.storage_nbytes())?;
        imp.wait_on(stream)?;
        let mark = StreamMark::record(imp.device(), stream)?;
        let hold = ForwardHold { imp: Some(imp.clone()), mark: Some(mark) };
        // The hold goes first: the import is let go (or kept until its mark) before the
        // caller's `extra` learns that the lease ended.
        let owner: crate::Owner = Box::new((hold, extra));
        self.send_cuda_leased(imp.forward_storage(), &layout, stream, owner, opts)
    }
}
