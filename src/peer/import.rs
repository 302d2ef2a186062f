//! Receiving: the message loop (`recv`), descriptor checks and the CPU and CUDA import
//! paths; `Imported`.

use crate::desc::{Layout, StorageKind, TensorDesc};
use crate::error::{Error, Result};
use crate::lease::LeaseId;
use crate::segment::Segment;
use crate::shared_tensor::check_in;
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use crate::wait::Wait;
use super::cuda_import::{CudaImported, CudaMemory};
use super::held_lease::{import_accessors, HeldLease};
use crate::payload::{named_in_tensor_payload, split_tensor_payload};
use crate::wire::messages::{KIND_CUDA_EVENTS, KIND_CUDA_SIGNALS, KIND_FORGET, KIND_TENSOR, KIND_USER, NO_FD_SLOT};
use super::Peer;
use crate::cuda::event::StreamMark;
use crate::cuda::order::RemoteSignals;
use crate::import_cache::ImportCache;
use crate::lease::ImportTable;
use parking_lot::Mutex;

/// What `recv` returns.
#[allow(clippy::large_enum_variant)] // one per message; boxing would only add an allocation
pub enum Incoming {
    /// A tensor the peer exported to us.
    Tensor(Imported),
    /// A user message (`Peer::send_message`).
    Message { payload: Vec<u8>, fds: Vec<OwnedFd> },
    /// A CUDA tensor the peer exported to us.
    CudaTensor(CudaImported),
}

impl std::fmt::Debug for Incoming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Incoming::Tensor(t) => write!(f, "Tensor({:?}, tag {})", t.layout(), t.tag()),
            Incoming::Message { payload, fds } => write!(f, "Message({} bytes, {} fds)", payload.len(), fds.len()),
            Incoming::CudaTensor(t) => write!(f, "CudaTensor({:?}, tag {})", t.desc.layout(), t.tag),
        }
    }
}

/// What this side imports from the peer: its lease table, our windows of its segments,
/// its CUDA signals, the CUDA imports released after a stream's work, and the last
/// refusal.
pub(super) struct Imports {
    pub(super) table: ImportTable,
    /// Our mappings of the peer's segments (windows), bounded per connection.
    pub(super) cache: Mutex<ImportCache>,
    /// The peer's signals (its words and/or its event pool), opened as it announces them.
    pub(super) signals: Mutex<RemoteSignals>,
    /// CUDA imports released "after the stream's work": released by the reaper once
    /// their mark completes (`CudaImported::release_after`).
    pub(super) deferred: Mutex<Vec<(StreamMark, CudaImported)>>,
    /// The tag of the tensor message whose refusal the last receive returned
    /// (`Peer::refused_tag`); written only when a receive fails.
    pub(super) refused_tag: Mutex<Option<u64>>,
}

impl Imports {
    pub(super) fn new(table: ImportTable) -> Imports {
        Imports {
            table,
            cache: Mutex::new(ImportCache::default()),
            signals: Mutex::new(RemoteSignals::default()),
            deferred: Mutex::new(Vec::new()),
            refused_tag: Mutex::new(None),
        }
    }
}

impl Peer {
    /// Receive the next tensor or user message, waiting as `wait` says (`Wait::Forever`:
    /// until something arrives or the peer dies).
    pub fn recv(&self, wait: impl Into<Wait>) -> Result<Incoming> {
        let mut refused = None;
        let r = self.recv_noting(wait, &mut refused);
        if r.is_err() {
            *self.inner.imports.refused_tag.lock() = refused;
        }
        r
    }

    /// The tag of the tensor message whose refusal the last [`Self::recv`] (or
    /// [`Self::recv_tensor`]) returned as its error — when that message had a tag to read
    /// (a payload of the protocol's size); `None` when the last error was something else.
    /// Meaningful right after a receive that failed, on the receiving thread. For a
    /// caller that matches tensors to tags (the RPC layer), so that what waits for that
    /// tag can fail at once with the refusal. The tag is the peer's word, as any tag is.
    pub fn refused_tag(&self) -> Option<u64> {
        *self.inner.imports.refused_tag.lock()
    }

    /// `recv`, noting in `refused` the tag of a tensor message it refused.
    fn recv_noting(&self, wait: impl Into<Wait>, refused: &mut Option<u64>) -> Result<Incoming> {
        const WHAT: &str = "a tensor or message from the peer";
        let mut deadline = wait.into().deadline();
        let mut first = true;
        loop {
            // The deadline holds across internal messages (FORGET, CUDA events): a peer
            // that keeps sending them must not stretch one receive past its timeout. The
            // first pass always looks, so not waiting still takes what is there.
            if !first && deadline.expired() {
                return Err(deadline.timed_out(WHAT));
            }
            first = false;
            let msg = match self.inner.conn.recv_lossy_until(&mut deadline) {
                Err(Error::Timeout { .. }) => return Err(deadline.timed_out(WHAT)),
                r => r?,
            };
            match msg.kind {
                KIND_TENSOR => return self.import(msg, refused),
                // Its fds were dropped for our open-file limit: it cannot be used.
                _ if msg.fds_lost => return Err(crate::connection::fds_lost_error()),
                KIND_CUDA_EVENTS => self.open_cuda_events(msg)?,
                KIND_CUDA_SIGNALS => self.open_cuda_signals(msg)?,
                KIND_USER => return Ok(Incoming::Message { payload: msg.payload, fds: msg.fds }),
                KIND_FORGET => {
                    let id: [u8; 8] = msg.payload.as_slice().try_into().map_err(|_| {
                        Error::Protocol(format!("forget message of {} bytes, expected 8", msg.payload.len()))
                    })?;
                    self.inner.imports.cache.lock().forget(u64::from_le_bytes(id));
                }
                k => return Err(Error::Protocol(format!("unknown message kind {k}"))),
            }
        }
    }

    /// Receive, expecting a tensor.
    pub fn recv_tensor(&self, wait: impl Into<Wait>) -> Result<Imported> {
        match self.recv(wait)? {
            Incoming::Tensor(t) => Ok(t),
            other => {
                // This error refuses no tensor message (`refused_tag` says so).
                *self.inner.imports.refused_tag.lock() = None;
                Err(Error::Protocol(format!("expected a tensor, got {other:?}")))
            }
        }
    }

    /// The lease a received descriptor names must be live. If it is not because the
    /// producer has gone (closing ends every lease it granted, also those still in
    /// flight), say that: `PeerGone`, not a stale lease.
    fn check_live(&self, lease: LeaseId) -> Result<()> {
        self.inner.imports.table.check_live(lease).map_err(|e| {
            if self.inner.conn.is_peer_gone() {
                let end = self.inner.conn.peer_end("closed the connection");
                Error::peer_gone(format!("{end}; the lease of this tensor ended with it"))
            } else {
                e
            }
        })
    }

    fn open_cuda_events(&self, mut msg: crate::connection::Message) -> Result<()> {
        let p = &msg.payload;
        if p.len() < 8 || msg.fds.len() != 1 {
            return Err(Error::Protocol(format!("CUDA event message of {} bytes and {} fds", p.len(), msg.fds.len())));
        }
        let device = i32::from_le_bytes(p[0..4].try_into().unwrap());
        let n = u32::from_le_bytes(p[4..8].try_into().unwrap()) as usize;
        if n == 0 || n > 1024 || p.len() != 8 + 64 * n {
            return Err(Error::Protocol(format!("CUDA event message announces {n} events in {} bytes", p.len())));
        }
        let handles: Vec<[u8; 64]> = p[8..].chunks(64).map(|c| c.try_into().unwrap()).collect();
        let acks = Segment::from_fd_exact(msg.fds.pop().expect("checked"), n * 8, "the CUDA event ack table")?;
        let cfg = &self.inner.cfg;
        let ev = crate::cuda::order::remote_events::RemoteEvents::open(
            device,
            &handles,
            acks,
            cfg.cuda_wait,
            cfg.cuda_wait_timeout,
            self.inner.peer_watch.clone(),
        )?;
        // Kept even when the events cannot be opened here: its ack table still hands the
        // producer's event slots back as our imports fail, so its exports do not jam.
        let unusable = ev.usable().err().map(|why| format!("the producer's IPC events could not be opened here: {why}"));
        self.inner.imports.signals.lock().events = Some(Arc::new(ev));
        match unusable {
            Some(m) => Err(Error::CudaUnavailable(m)),
            None => Ok(()),
        }
    }

    /// The producer's signal words (`KIND_CUDA_SIGNALS`): mapped here, and registered with
    /// CUDA where our streams wait on them.
    fn open_cuda_signals(&self, mut msg: crate::connection::Message) -> Result<()> {
        let p = &msg.payload;
        if p.len() != 8 || msg.fds.len() != 1 {
            return Err(Error::Protocol(format!("CUDA signal message of {} bytes and {} fds, expected 8 and 1", p.len(), msg.fds.len())));
        }
        let device = i32::from_le_bytes(p[0..4].try_into().expect("4 bytes"));
        let lanes = u32::from_le_bytes(p[4..8].try_into().expect("4 bytes"));
        let cfg = &self.inner.cfg;
        let words = crate::cuda::order::RemoteWords::open(
            device,
            msg.fds.pop().expect("checked"),
            lanes,
            cfg.cuda_wait,
            cfg.cuda_wait_timeout,
            self.inner.peer_watch.clone(),
        )?;
        self.inner.imports.signals.lock().words = Some(Arc::new(words));
        Ok(())
    }

    /// A tensor message: imported, or refused with its lease given back.
    ///
    /// The one rule for refusals, here and nowhere else: once the message's lease
    /// reference can be read — a payload of the protocol's size, read raw, before any
    /// check — every refusal of the message releases that lease, whatever refused it (the
    /// payload's shape, its fds, a descriptor that does not decode, a storage kind that
    /// cannot arrive, the import itself, our open-file limit), so the producer's memory is
    /// not held for a tensor nobody will see. What stops a forged or stale reference from
    /// releasing another lease is the table's generation check: a release takes only a
    /// slot that is live with exactly that generation, so a refused message can release
    /// no later grant of its slot and nothing of another connection's table. It can
    /// release a lease of the same producer that one of our imports holds, if it names it
    /// exactly; the producer hurts only itself by that (its owner goes early; it could
    /// end any of its leases by writing its own table anyway), and our import's own
    /// release then says `StaleLease`.
    /// The refused message's tag goes to `refused` (for [`Self::refused_tag`]).
    fn import(&self, msg: crate::connection::Message, refused: &mut Option<u64>) -> Result<Incoming> {
        let named = named_in_tensor_payload(&msg.payload);
        let r = self.import_checked(msg, named.map(|n| n.fd_slot));
        if r.is_err() {
            if let Some(n) = named {
                // Refused by the table unless that generation of that slot is live (an
                // import path that gave it back already, a lease that was never live).
                let _ = self.inner.imports.table.release(n.lease);
                *refused = Some(n.tag);
            }
        }
        r
    }

    /// Check the message's shape, copy and validate its descriptor once, then take the
    /// path its storage kind names. Every error is a refusal [`Self::import`] gives the
    /// lease back for.
    fn import_checked(&self, mut msg: crate::connection::Message, raw_slot: Option<u32>) -> Result<Incoming> {
        if msg.fds_lost {
            // The fd it would have put in that slot was dropped: ask for it again.
            if let Some(slot) = raw_slot {
                self.report_lost_slot(slot);
            }
            return Err(crate::connection::fds_lost_error());
        }
        if msg.fds.len() > 1 {
            return Err(Error::Protocol(format!("tensor message has {} fds, expected at most 1", msg.fds.len())));
        }
        let (tag, raw, slot) = split_tensor_payload(&msg.payload)?;
        let desc = TensorDesc::decode(raw)?;
        let fd = msg.fds.pop();
        let cuda = matches!(desc.kind(), Some(StorageKind::CudaIpc | StorageKind::CudaVmm));
        if cuda && slot != NO_FD_SLOT {
            return Err(Error::Protocol(format!("a CUDA tensor message names fd slot {slot}; CUDA storage has none")));
        }
        match desc.kind() {
            Some(StorageKind::Segment) => self.import_cpu(tag, desc, fd, slot).map(Incoming::Tensor),
            Some(StorageKind::CudaIpc) if fd.is_none() => self.import_cuda(tag, desc, None).map(Incoming::CudaTensor),
            Some(StorageKind::CudaIpc) => Err(Error::Protocol("a CUDA IPC tensor message carried an fd".into())),
            Some(StorageKind::CudaVmm) if fd.is_some() => self.import_cuda(tag, desc, fd).map(Incoming::CudaTensor),
            Some(StorageKind::CudaVmm) => Err(Error::Protocol("a CUDA VMM tensor message carried no fd".into())),
            k => Err(Error::InvalidDescriptor(format!("storage kind {k:?} cannot arrive as a leased tensor"))),
        }
    }

    fn import_cuda(&self, tag: u64, desc: TensorDesc, vmm_fd: Option<OwnedFd>) -> Result<CudaImported> {
        let lease = LeaseId { slot: desc.storage.lease_slot, generation: desc.storage.lease_gen };
        // Claim the producer's signal first: whatever fails below, the claim's drop
        // acknowledges an event record, so the producer's event slot is not left waiting.
        let claim = self.inner.imports.signals.lock().claim(desc.signal());
        self.check_live(lease)?;
        // Any failure from here is a refusal `import` gives the lease back for.
        let (mapping, claim) = (|| -> Result<_> {
            let claim = claim?;
            let device = i32::from(desc.device_index);
            let mapping = match &vmm_fd {
                // Mapped per message (a VMM fd has no cheap identity to cache by).
                Some(fd) => CudaMemory::Vmm(crate::cuda::vmm::VmmAllocation::import_fd(fd, device, desc.storage.segment_id)?),
                None => CudaMemory::Ipc(crate::cuda::ipc::cache().open(device, desc.storage.cuda_ipc_handle)?),
            };
            crate::cuda::ipc::check_range(desc.storage.base_offset, desc.storage.nbytes, mapping.size())?;
            Ok((mapping, claim))
        })()?;
        let held = HeldLease { inner: self.inner.clone(), lease, released: false };
        // A VMM import keeps the producer's fd: forwarding sends it on as it came.
        Ok(CudaImported { held, mapping, vmm_fd, claim, desc, tag })
    }

    /// A CPU import; on failure its caller ([`Self::import`]) gives the lease back.
    fn import_cpu(&self, tag: u64, desc: TensorDesc, fd: Option<OwnedFd>, fd_slot: u32) -> Result<Imported> {
        let lease = LeaseId { slot: desc.storage.lease_slot, generation: desc.storage.lease_gen };
        self.check_live(lease)?;
        let r = self.resolve_segment(&desc, fd, fd_slot)?;
        Ok(Imported { held: HeldLease { inner: self.inner.clone(), lease, released: false }, window: r.window, fd: r.fd, desc, tag })
    }

    fn resolve_segment(&self, desc: &TensorDesc, fd: Option<OwnedFd>, fd_slot: u32) -> Result<crate::import_cache::Resolved> {
        let limits = crate::import_cache::Limits {
            max_segments: self.inner.cfg.max_import_segments,
            max_bytes: self.inner.cfg.max_import_mapped_bytes,
        };
        let fd_less = fd.is_none();
        let r = self.inner.imports.cache.lock().resolve(desc, fd, fd_slot, limits);
        if fd_less && matches!(r, Err(Error::InvalidDescriptor(_))) {
            // The slot lacks that segment's fd (an empty slot, or another segment's):
            // ask for it again with the next export. Any other refusal of an fd-less
            // descriptor reports it too, which costs one fd sent again, nothing more.
            self.report_lost_slot(fd_slot);
        }
        r
    }

    /// Tell the producer that fd slot `slot` lacks its fd (`lease::lost_fd_slots`).
    fn report_lost_slot(&self, slot: u32) {
        if slot < super::SEGMENT_FD_SLOTS {
            // Relaxed: a hint, paired with nothing (see the producer's read in `export`).
            crate::lease::lost_fd_slots(self.inner.imports.table.segment()).fetch_or(1 << slot, Ordering::Relaxed);
        }
    }
}

/// A tensor imported from the peer: a view over the peer's shared memory, valid until
/// released (or dropped, which releases). Sent on to another peer as the same memory
/// with [`Peer::export_imported`] (in an `Arc`: the forward's lease shares it).
pub struct Imported {
    held: HeldLease,
    window: Arc<crate::import_cache::Window>,
    /// The fd of the window's file (shared with its fd slot and its other imports), to
    /// forward this import as the same memory.
    fd: Arc<crate::import_cache::ImportFd>,
    desc: TensorDesc,
    tag: u64,
}


impl Imported {
    import_accessors!();
    pub fn lease(&self) -> LeaseId {
        self.held.lease
    }
    pub fn storage_nbytes(&self) -> usize {
        self.desc.storage.nbytes as usize
    }
    /// Start of the storage in this process (valid until release; the peer may write it).
    pub fn storage_ptr(&self) -> *mut u8 {
        // The window was mapped (or checked) to cover base_offset..base_offset + nbytes.
        self.window.ptr_at(self.desc.storage.base_offset)
    }
    /// Address of element 0 of the view.
    pub fn data_ptr(&self) -> *mut u8 {
        let off = self.desc.data_offset();
        // SAFETY: off ≤ nbytes, and the storage's nbytes lie inside the mapping (checked
        // at import), so the result is within (or one past) the storage.
        unsafe { self.storage_ptr().add(off as usize) }
    }
    /// The view's elements packed row-major, copied to private memory. The peer chose
    /// the shape: a stride-0 view may name more elements than can be allocated, which is
    /// an error here, never an abort.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = Vec::new();
        // SAFETY: the extent was validated ≤ nbytes, and the storage lies in the mapping.
        unsafe { self.layout().gather(self.storage_ptr(), &mut v) }?;
        Ok(v)
    }
    pub fn read_storage(&self, at: usize, out: &mut [u8]) -> Result<()> {
        check_in(at, out.len(), self.storage_nbytes())?;
        self.window.read_at(self.desc.storage.base_offset + at as u64, out)
    }
    pub fn write_storage(&self, at: usize, data: &[u8]) -> Result<()> {
        check_in(at, data.len(), self.storage_nbytes())?;
        self.window.write_at(self.desc.storage.base_offset + at as u64, data)
    }

    /// Give the lease back. `Err(PeerGone)` if the producer is gone (nothing is left to
    /// release then); `Err(StaleLease)` if its window ran out first.
    pub fn release(mut self) -> Result<()> {
        self.held.release()
    }

    /// The file this import maps, as `(st_dev, st_ino)` read when its fd arrived, and the
    /// storage's byte offset in it: a process can tell that a tensor it received is a
    /// range of a segment of its own ([`Segment::file_ident`]), sent back to it.
    pub fn file_range(&self) -> ((u64, u64), u64) {
        (self.fd.ident(), self.desc.storage.base_offset)
    }

    /// The fd of the window this import maps (for forwarding it).
    pub(crate) fn forward_fd(&self) -> &Arc<crate::import_cache::ImportFd> {
        &self.fd
    }
}
