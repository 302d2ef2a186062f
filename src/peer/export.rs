//! Exports: CPU views under leases (`send_leased`, the one path every CPU export takes)
//! and CUDA memory by IPC handle or VMM fd (`send_cuda_leased`, the one path every CUDA
//! export takes); user messages.

use crate::cuda::{CudaCode, CudaStream, DevicePtr};
use crate::desc::{Layout, StorageKind, StorageRef, TensorDesc};
use crate::error::{Error, Result};
use crate::lease::{LeaseId, Owner, Reclaimed};
use bytemuck::Zeroable;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use crate::payload::tensor_payload;
use crate::wire::messages::{KIND_CUDA_EVENTS, KIND_CUDA_SIGNALS, KIND_TENSOR, KIND_USER, NO_FD_SLOT};
use super::fd_slots::FdSlots;
use super::{ExportOptions, Peer, SharedTensor};
use crate::cuda::order::Signaller;
use crate::lease::Exporter;
use crate::segment::Segment;
use parking_lot::Mutex;

/// A CPU storage as a descriptor names it: the id this process shows it under on every
/// connection, what keeps it alive here, its fd, and the byte range of its file.
pub(crate) struct CpuStorage<'a> {
    pub id: u64,
    pub keeper: crate::lease::StorageKeeper,
    pub fd: BorrowedFd<'a>,
    pub base_offset: u64,
    pub nbytes: u64,
}

/// CUDA memory as a descriptor names it: its device, how the consumer opens it, the
/// allocation's size and the storage's byte range in it.
pub(super) struct CudaStorage<'a> {
    pub device: i32,
    pub handle: CudaHandle<'a>,
    pub alloc_size: u64,
    pub offset: u64,
    pub nbytes: u64,
}

/// How the consumer opens CUDA memory: the legacy IPC handle of its allocation (opened
/// through the consumer's handle cache), or the fd of its VMM allocation (sent with the
/// descriptor).
pub(super) enum CudaHandle<'a> {
    Ipc([u8; 64]),
    Vmm(BorrowedFd<'a>),
}

/// Legacy IPC for cudaMalloc memory, an fd for VMM memory (expandable segments), from the
/// driver's answer to "is this pointer legacy-IPC capable". A driver too old to know the
/// attribute answers CUDA_ERROR_INVALID_VALUE: legacy IPC then, as before the attribute
/// existed. Decided by the code, never by its name.
fn legacy_ipc(answer: Result<bool>) -> Result<bool> {
    match answer {
        Err(Error::Cuda { code: CudaCode::INVALID_VALUE, .. }) => Ok(true),
        r => r,
    }
}

/// cudaMalloc memory for a peer in another pid namespace (a sandboxed worker, or its
/// supervisor seen from inside), which cannot open a legacy IPC handle: a copy of the
/// `nbytes` at `dptr` in a VMM allocation made for it, enqueued on `stream` after the work
/// the export follows, and the fd to send it by. The consumer sees the copy: its writes do
/// not reach `dptr` (VMM memory with the POSIX-fd handle type, e.g. PyTorch's expandable
/// segments, is shared without one).
fn copy_for_another_pid_namespace(dptr: DevicePtr, nbytes: u64, stream: CudaStream) -> Result<(crate::cuda::vmm::VmmAllocation, std::os::fd::OwnedFd)> {
    let device = crate::cuda::driver::pointer_device(dptr)?;
    let copy = crate::cuda::vmm::VmmAllocation::create(device, nbytes)?;
    {
        let _ctx = crate::cuda::driver::ensure_context(device)?;
        crate::cuda::driver::memcpy_dtod_async(copy.ptr(), dptr, nbytes, stream)?;
    }
    let fd = copy.export_fd()?;
    Ok((copy, fd))
}

/// What this side exports to the peer: the lease table it grants from, what the peer
/// keeps in its fd slots, and how our CUDA exports signal it.
pub(super) struct Exports {
    pub(super) exporter: Mutex<Exporter>,
    /// The shared lease table (`exporter`'s), for the peer's releases and doorbells.
    pub(super) table: Arc<Segment>,
    /// Held across grant + send, so a segment's fd always precedes descriptors naming it;
    /// it guards what the peer keeps in its fd slots, changed only by the messages sent
    /// under it (tensors, FORGET).
    pub(super) send_lock: Mutex<FdSlots>,
    /// How our CUDA exports signal the peer (its words or an event pool, created and
    /// announced at the first export).
    pub(super) signaller: Mutex<Option<Signaller>>,
    /// The peer asked for IPC events rather than signal words (`SETUP_WANTS_EVENTS`).
    pub(super) peer_wants_events: bool,
}

impl Exports {
    pub(super) fn new(exporter: Exporter, table: Arc<Segment>, peer_wants_events: bool) -> Exports {
        Exports {
            exporter: Mutex::new(exporter),
            table,
            send_lock: Mutex::new(FdSlots::default()),
            signaller: Mutex::new(None),
            peer_wants_events,
        }
    }
}

impl Peer {
    /// Export `t` under a lease whose owner is `t`'s segment (kept alive until release).
    pub fn export(&self, t: &SharedTensor, opts: ExportOptions) -> Result<LeaseId> {
        self.export_with_owner(t, Box::new(t.segment.clone()), opts)
    }

    /// Export `t` under a lease holding `owner`, which is dropped exactly once: when the
    /// peer releases, when the window runs out, when the peer dies or this `Peer` is
    /// dropped — or at once if the export fails.
    pub fn export_with_owner(&self, t: &SharedTensor, owner: Owner, opts: ExportOptions) -> Result<LeaseId> {
        let keeper: crate::lease::StorageKeeper = Arc::downgrade(&t.segment) as _;
        let storage = CpuStorage {
            id: t.segment.id(),
            keeper,
            fd: t.segment.fd(),
            base_offset: t.offset as u64,
            nbytes: t.nbytes as u64,
        };
        self.send_leased(storage, &t.layout, owner, opts)
    }

    /// Grant a lease holding `owner` on `storage` and send its descriptor (`layout` over
    /// it), with the storage's fd where the consumer's fd slots do not hold it yet; on
    /// failure the lease is taken back and `owner` dropped.
    /// The one path every CPU export takes (own segments and forwarded imports alike).
    pub(crate) fn send_leased(&self, storage: CpuStorage<'_>, layout: &Layout, owner: Owner, opts: ExportOptions) -> Result<LeaseId> {
        // Only what is already known (asking the kernel would cost a `poll` on every
        // export's hot path): a peer that is gone but not yet known to be fails the send
        // below (its socket end closed), which takes the lease back.
        if self.inner.conn.known_gone() {
            drop(owner);
            return Err(Error::peer_gone(format!("process {} is gone; nothing can be exported to it", self.peer_pid())));
        }
        self.inner.reap_if_released();
        let window = opts.window.or(self.inner.cfg.default_window);
        let deadline = window.and_then(|w| std::time::Instant::now().checked_add(w)); // too long: no window
        let mut slots = self.inner.exports.send_lock.lock();
        let sid = storage.id;
        let granted = self.inner.exports.exporter.lock().grant_storage(
            Some(crate::lease::ShownStorage { segment_id: sid, base_offset: storage.base_offset, keeper: storage.keeper }),
            storage.nbytes,
            owner,
            deadline,
        );
        let (id, first) = granted.map_err(|(e, owner)| {
            drop(owner);
            e
        })?;
        let sref = StorageRef {
            segment_id: sid,
            base_offset: storage.base_offset,
            nbytes: storage.nbytes,
            lease_slot: id.slot,
            lease_gen: id.generation,
            ..Zeroable::zeroed()
        };
        let desc = TensorDesc::new(layout, StorageKind::Segment, sref);
        // The fd goes only when it goes into one of the consumer's fd slots; after that
        // the descriptor names the slot (`crate::wire::messages::SEGMENT_FD_SLOTS`). The consumer maps
        // from the slot's fd again whenever it evicted its mapping.
        // Relaxed: a hint the consumer sets (see `lease::lost_fd_slots`); it publishes no
        // data, and a bit seen late only costs the descriptor it was for.
        let lost = crate::lease::lost_fd_slots(&self.inner.exports.table);
        if lost.load(Ordering::Relaxed) != 0 {
            slots.lost(lost.swap(0, Ordering::Relaxed));
        }
        let choice = slots.choose(sid, first);
        let payload = tensor_payload(opts.tag, &desc, choice.slot);
        let fds = if choice.install { std::slice::from_ref(&storage.fd) } else { &[] };
        if let Err(e) = self.inner.conn.send(KIND_TENSOR, &payload, fds) {
            slots.unsent(choice);
            let mut dead = Reclaimed::default();
            {
                let mut ex = self.inner.exports.exporter.lock();
                ex.revoke(id, &mut dead);
                if first {
                    ex.unshare_segment(sid);
                }
            }
            drop(slots);
            dead.settle(&self.inner.exports.exporter);
            return Err(e);
        }
        self.inner.wake_idle_reaper();
        Ok(id)
    }

    /// Export `nbytes` of device memory at `dptr` (any pointer into a CUDA allocation),
    /// viewed as `layout`, under a lease holding `owner` (e.g. a c10 storage). The last
    /// write must have been enqueued on `stream`: an IPC event recorded there after it is
    /// what the consumer's stream will wait for. One device per connection.
    ///
    /// `cudaMalloc` memory goes by legacy IPC handle (opened once per process through the
    /// handle cache); VMM memory (`cuMemCreate` with the POSIX-fd handle type, e.g.
    /// PyTorch's expandable segments) by the fd of its physical allocation, passed with
    /// SCM_RIGHTS and mapped by the consumer for each import.
    pub fn export_cuda(
        &self,
        dptr: DevicePtr,
        nbytes: u64,
        layout: &Layout,
        stream: CudaStream,
        owner: Owner,
        opts: ExportOptions,
    ) -> Result<LeaseId> {
        use crate::cuda::{ipc, vmm};
        self.check_cuda_export(layout, nbytes)?;
        let legacy = legacy_ipc(crate::cuda::driver::is_legacy_ipc_capable(dptr))?;
        if legacy && !self.inner.conn.shares_pid_namespace() {
            let (copy, fd) = copy_for_another_pid_namespace(dptr, nbytes, stream)?;
            let storage = CudaStorage { device: copy.device(), handle: CudaHandle::Vmm(fd.as_fd()), alloc_size: copy.size(), offset: 0, nbytes };
            // The copy reads `owner`'s memory until the stream has run it: the lease holds both.
            return self.send_cuda_leased(storage, layout, stream, Box::new((owner, copy)), opts);
        }
        let vmm_export = if legacy { None } else { Some(vmm::export_pointer(dptr, nbytes)?) };
        let storage = match &vmm_export {
            None => {
                let e = ipc::export_pointer(dptr)?;
                CudaStorage { device: e.device, handle: CudaHandle::Ipc(e.handle), alloc_size: e.alloc_size, offset: e.offset, nbytes }
            }
            Some(v) => CudaStorage { device: v.device, handle: CudaHandle::Vmm(v.fd.as_fd()), alloc_size: v.alloc_size, offset: v.offset, nbytes },
        };
        self.send_cuda_leased(storage, layout, stream, owner, opts)
    }

    /// What every CUDA export checks before touching the driver: the peer is there, and
    /// the view fits the `nbytes` of storage it is sent over.
    pub(super) fn check_cuda_export(&self, layout: &Layout, nbytes: u64) -> Result<()> {
        if self.inner.conn.is_peer_gone() {
            return Err(Error::peer_gone(format!("process {} is gone; nothing can be exported to it", self.peer_pid())));
        }
        let need = layout.extent_bytes()?;
        if need > nbytes {
            return Err(Error::InvalidArgument(format!("view needs {need} bytes of storage, storage has {nbytes}")));
        }
        Ok(())
    }

    /// Grant a lease holding `owner` on CUDA `storage` and send its descriptor (`layout`
    /// over it), ordered after the work enqueued on `stream` by an event of this
    /// connection's pool (created, and announced to the peer, at the first CUDA export).
    /// On failure the event record is given back, the lease taken back and `owner`
    /// dropped (after our locks). The one path every CUDA export takes (own memory and
    /// forwarded imports alike).
    pub(super) fn send_cuda_leased(
        &self,
        storage: CudaStorage<'_>,
        layout: &Layout,
        stream: CudaStream,
        owner: Owner,
        opts: ExportOptions,
    ) -> Result<LeaseId> {
        use crate::cuda::ipc;
        let CudaStorage { device, handle, alloc_size, offset, nbytes } = storage;
        ipc::check_range(offset, nbytes, alloc_size).map_err(|_| {
            Error::InvalidArgument(format!("{nbytes} bytes at offset {offset} pass the end of a {alloc_size}-byte CUDA allocation"))
        })?;
        let device_index = u8::try_from(device).map_err(|_| Error::InvalidArgument(format!("device {device} out of range")))?;
        let _send = self.inner.exports.send_lock.lock();
        let mut signaller = self.inner.exports.signaller.lock();
        if signaller.is_none() {
            *signaller = Some(self.announce_signals(device, stream)?);
        }
        let sig = signaller.as_mut().expect("created above");
        if sig.device() != device {
            return Err(Error::InvalidArgument(format!(
                "this connection exports CUDA memory of device {}; device {device} needs its own connection",
                sig.device()
            )));
        }
        let signal = sig.signal(stream, self.inner.cfg.handshake_timeout)?;
        let window = opts.window.or(self.inner.cfg.default_window);
        let deadline = window.and_then(|w| std::time::Instant::now().checked_add(w)); // too long: no window
        let granted = self.inner.exports.exporter.lock().grant(None, nbytes, owner, deadline);
        let id = match granted {
            Ok((id, _)) => id,
            Err((e, owner)) => {
                // No message names the signal: give an event slot back.
                sig.cancel(signal);
                // Owners run arbitrary drop code (a C callback): never under our locks.
                drop(signaller);
                drop(_send);
                drop(owner);
                return Err(e);
            }
        };
        let (kind, segment_id, cuda_ipc_handle, fd) = match handle {
            CudaHandle::Ipc(h) => (StorageKind::CudaIpc, 0, h, None),
            // For VMM: the allocation's size (the fd does not carry it).
            CudaHandle::Vmm(fd) => (StorageKind::CudaVmm, alloc_size, [0; 64], Some(fd)),
        };
        let sref = StorageRef {
            segment_id,
            base_offset: offset,
            nbytes,
            lease_slot: id.slot,
            lease_gen: id.generation,
            cuda_ipc_handle,
            ..Zeroable::zeroed()
        };
        let mut desc = TensorDesc::new_cuda(layout, device_index, kind, sref);
        desc.set_signal(signal);
        let payload = tensor_payload(opts.tag, &desc, NO_FD_SLOT);
        if let Err(e) = self.inner.conn.send(KIND_TENSOR, &payload, fd.as_slice()) {
            sig.cancel(signal);
            let mut dead = Reclaimed::default();
            self.inner.exports.exporter.lock().revoke(id, &mut dead);
            drop(signaller);
            drop(_send);
            dead.settle(&self.inner.exports.exporter);
            return Err(e);
        }
        self.inner.wake_idle_reaper();
        Ok(id)
    }

    /// This connection's CUDA signalling, created and announced to the peer at its first
    /// CUDA export (under the send lock): signal words written by our streams, unless the
    /// peer asked for IPC events or the words cannot be used here (no host registration,
    /// no stream memory operations), then the event pool.
    fn announce_signals(&self, device: i32, stream: CudaStream) -> Result<crate::cuda::order::Signaller> {
        use crate::cuda::order::{event_pool::EventPool, Signaller, WordLanes};
        if !self.inner.exports.peer_wants_events {
            match WordLanes::new(device, stream) {
                Ok(lanes) => {
                    let mut payload = device.to_le_bytes().to_vec();
                    payload.extend_from_slice(&lanes.words().lanes().to_le_bytes());
                    self.inner.conn.send(KIND_CUDA_SIGNALS, &payload, &[lanes.words().fd()])?;
                    return Ok(Signaller::Words(lanes));
                }
                // The events would be refused on the other side of a pid namespace.
                Err(why) if !self.inner.conn.shares_pid_namespace() => {
                    return Err(Error::CudaUnavailable(format!(
                        "process {} runs in another pid namespace (a sandboxed worker, or its supervisor), where CUDA IPC \
                         events cannot be opened, and the signal words that order CUDA work across it cannot be used here \
                         (they need host registration and stream memory operations): {why}",
                        self.peer_pid()
                    )));
                }
                Err(_) => {}
            }
        }
        let p = EventPool::new(device)?;
        let mut payload = device.to_le_bytes().to_vec();
        payload.extend_from_slice(&(p.handles().len() as u32).to_le_bytes());
        for h in p.handles() {
            payload.extend_from_slice(h);
        }
        self.inner.conn.send(KIND_CUDA_EVENTS, &payload, &[p.acks().fd()])?;
        Ok(Signaller::Events(p))
    }

    /// Send a user message with up to 8 fds.
    pub fn send_message(&self, payload: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
        self.inner.conn.send(KIND_USER, payload, fds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cuda(code: CudaCode, name: &str) -> Result<bool> {
        Err(Error::Cuda { call: "cuPointerGetAttribute", code, name: name.into() })
    }

    #[test]
    fn an_old_drivers_invalid_value_means_legacy_ipc_by_its_code_not_its_name() {
        assert!(legacy_ipc(Ok(true)).unwrap());
        assert!(!legacy_ipc(Ok(false)).unwrap());
        assert!(legacy_ipc(cuda(CudaCode::INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE")).unwrap());
        assert!(legacy_ipc(cuda(CudaCode::INVALID_VALUE, "a name this driver made up")).unwrap());
        let e = legacy_ipc(cuda(CudaCode::NOT_SUPPORTED, "CUDA_ERROR_INVALID_VALUE")).unwrap_err();
        assert!(matches!(e, Error::Cuda { code: CudaCode::NOT_SUPPORTED, .. }), "{e}");
        assert!(matches!(legacy_ipc(Err(Error::CudaUnavailable("no driver".into()))), Err(Error::CudaUnavailable(_))));
    }
}
