//! `Peer`: one end of a tensorwire connection. Exports tensor views under leases,
//! imports the peer's, and carries small user messages with fds.

use crate::connection::{Connection, Listener};
use crate::desc::{Layout, StorageKind, StorageRef, TensorDesc, DESC_SIZE};
use crate::doorbell::Doorbell;
use crate::error::{Error, Result};
use crate::lease::{Exporter, ImportTable, LeaseId, LeaseStats, Owner, Reclaimed};
use crate::ring::{RingItem, RingMessage, RingReceiver, RingSender, RingShared, Wait};
use crate::segment::Segment;
use bytemuck::Zeroable;
use parking_lot::Mutex;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Wire message kinds of the peer protocol (after the connection's hello).
/// Setup: the lease table this side grants from (4-byte capacity, 1 fd).
pub const KIND_TABLE: u32 = 1;
/// A leased tensor: 8-byte tag + `TensorDesc`, plus the segment's fd (CPU: every time;
/// the consumer maps only the range named and may have evicted an earlier mapping).
pub const KIND_TENSOR: u32 = 2;
/// The producer dropped a segment the consumer holds no lease on (8-byte id).
pub const KIND_FORGET: u32 = 3;
/// A user message.
pub const KIND_USER: u32 = 4;
/// The producer's CUDA IPC event pool (once, before its first CUDA export): device (i32),
/// count (u32), count x 64-byte event handles; 1 fd: the ack table.
pub const KIND_CUDA_EVENTS: u32 = 5;
/// Setup, right after `KIND_TABLE` when its flags say so: this side's GPU bounce ring
/// (`cuda::ring::RingSetup`); 2 fds: control segment, descriptor ring.
pub const KIND_CUDA_RING: u32 = 6;
/// `KIND_TABLE` flag: a `KIND_CUDA_RING` message follows.
const SETUP_HAS_CUDA_RING: u32 = 1;

/// The `KIND_TABLE` payload: lease table capacity, ring data bytes (0: no ring), flags
/// (a GPU ring setup follows). Public for tools and tests that speak the wire protocol.
pub fn setup_payload(table_capacity: u32, ring_bytes: u64, cuda_ring: bool) -> Vec<u8> {
    let mut p = table_capacity.to_le_bytes().to_vec();
    p.extend_from_slice(&ring_bytes.to_le_bytes());
    p.extend_from_slice(&(if cuda_ring { SETUP_HAS_CUDA_RING } else { 0 }).to_le_bytes());
    p
}

/// How often the reaper looks for a dead peer when no lease is live.
const IDLE_TICK: Duration = Duration::from_millis(50);

/// Limits and defaults for one connection.
#[derive(Debug, Clone)]
pub struct PeerConfig {
    /// Leases the peer may hold at once (size of the lease table we give it).
    pub max_leases: u32,
    /// Bytes of storage the peer may hold under lease at once.
    pub max_lease_bytes: u64,
    /// Window applied to exports that name none (`None`: hold until release/death).
    pub default_window: Option<Duration>,
    /// Largest control message accepted or sent.
    pub max_message: usize,
    /// Most distinct segments of the peer's kept mapped here at once (held by imports or
    /// cached for the next descriptor naming them). Cached ones that no import holds are
    /// evicted, least recently used first, before a new one is refused.
    pub max_import_segments: usize,
    /// Most bytes of the peer's segments mapped here at once (address space, not memory:
    /// only the range each descriptor names is mapped). Cached mappings no import holds are
    /// evicted first; beyond that an import is refused with `QuotaExceeded`. Default: the
    /// machine's RAM plus swap, more than any honest peer can fill with shared memory.
    pub max_import_mapped_bytes: u64,
    /// Largest lease table accepted from the peer.
    pub max_peer_table_capacity: u32,
    /// How long connection setup may wait for the peer.
    pub handshake_timeout: Duration,
    /// How long a send (an export, a user message) may wait for room in the peer's
    /// socket buffer; a peer that stops reading then gets `Timeout`, and the export's
    /// lease is taken back.
    pub send_timeout: Duration,
    /// Data area of the ring this side sends through (a power of two ≥ 4 KiB; 0: none).
    pub ring_bytes: usize,
    /// Largest ring accepted from the peer.
    pub max_peer_ring_bytes: usize,
    /// Largest message reassembled from ring chunks (bounds what a peer can make us
    /// allocate).
    pub max_ring_message: u64,
    /// Polls before a ring wait sleeps in the futex.
    pub ring_spin: u32,
    /// While leases are live, how often the reaper looks for releases. A consumer's
    /// release is a compare-and-swap in shared memory that wakes no one (a wake-up per
    /// release would cost a context switch on the producer); owners are dropped within
    /// this interval, at the producer's next export, or at once with `reap_now`.
    pub reap_interval: Duration,
    /// How long a receive polls the socket before sleeping (0: sleep at once). A reply
    /// within it avoids a wake-up, which on some machines costs tens of µs.
    pub recv_spin: Duration,
    /// A GPU bounce ring for this side's CUDA sends (`None`: none). Creating the peer
    /// then needs a CUDA driver; the other side opens the ring at setup.
    pub cuda_ring: Option<crate::cuda::ring::CudaRingConfig>,
}

impl Default for PeerConfig {
    fn default() -> Self {
        PeerConfig {
            max_leases: 4096,
            max_lease_bytes: u64::MAX,
            default_window: None,
            max_message: crate::connection::DEFAULT_MAX_MESSAGE,
            max_import_segments: 1024,
            max_import_mapped_bytes: crate::sys::memory_and_swap_bytes(),
            max_peer_table_capacity: 1 << 20,
            handshake_timeout: Duration::from_secs(10),
            send_timeout: crate::connection::DEFAULT_SEND_TIMEOUT,
            ring_bytes: 4 << 20,
            max_peer_ring_bytes: 1 << 30,
            max_ring_message: 1 << 30,
            ring_spin: 2000,
            reap_interval: Duration::from_millis(1),
            recv_spin: Duration::from_micros(50),
            cuda_ring: None,
        }
    }
}

/// Per-export options.
#[derive(Debug, Clone, Copy, Default)]
pub struct ExportOptions {
    /// Opaque number delivered with the tensor (match requests to replies).
    pub tag: u64,
    /// Keeper window: the most time the peer may hold the lease.
    pub window: Option<Duration>,
}

/// A tensor view over a region of a shared segment, ready to export.
#[derive(Clone, Debug)]
pub struct SharedTensor {
    segment: Arc<Segment>,
    offset: usize,
    nbytes: usize,
    layout: Layout,
}

impl SharedTensor {
    /// `layout` over the `nbytes` of `segment` starting at byte `offset`.
    pub fn new(segment: Arc<Segment>, offset: usize, nbytes: usize, layout: Layout) -> Result<SharedTensor> {
        if offset.checked_add(nbytes).is_none_or(|e| e > segment.len()) {
            return Err(Error::InvalidArgument(format!(
                "storage of {nbytes} bytes at offset {offset} passes the end of a {}-byte segment",
                segment.len()
            )));
        }
        let need = layout.extent_bytes()?;
        if need > nbytes as u64 {
            return Err(Error::InvalidArgument(format!("view needs {need} bytes of storage, storage has {nbytes}")));
        }
        Ok(SharedTensor { segment, offset, nbytes, layout })
    }

    /// A zeroed tensor with a storage of its own (a fresh segment just large enough).
    pub fn zeros(layout: Layout) -> Result<SharedTensor> {
        let n = layout.extent_bytes()? as usize;
        SharedTensor::new(Arc::new(Segment::create(n.max(1))?), 0, n, layout)
    }

    /// Another view of the same storage.
    pub fn view(&self, layout: Layout) -> Result<SharedTensor> {
        SharedTensor::new(self.segment.clone(), self.offset, self.nbytes, layout)
    }

    pub fn segment(&self) -> &Arc<Segment> {
        &self.segment
    }
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    pub fn storage_offset_bytes(&self) -> usize {
        self.offset
    }
    pub fn storage_nbytes(&self) -> usize {
        self.nbytes
    }
    /// Start of the storage (shared memory: the peer may write it).
    pub fn storage_ptr(&self) -> *mut u8 {
        // SAFETY: offset ≤ segment length, checked in `new`.
        unsafe { self.segment.as_ptr().add(self.offset) }
    }
    /// Copy `data` into the storage at byte `at`.
    pub fn write_storage(&self, at: usize, data: &[u8]) -> Result<()> {
        check_in(at, data.len(), self.nbytes)?;
        self.segment.write_at(self.offset + at, data)
    }
    /// Copy from the storage at byte `at`.
    pub fn read_storage(&self, at: usize, out: &mut [u8]) -> Result<()> {
        check_in(at, out.len(), self.nbytes)?;
        self.segment.read_at(self.offset + at, out)
    }
    /// The view's elements, packed row-major, copied to private memory (an error if the
    /// packed copy cannot be allocated, e.g. a huge stride-0 broadcast).
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = Vec::new();
        // SAFETY: `new` checked extent_bytes ≤ nbytes and the storage lies in the mapping.
        unsafe { self.layout.gather(self.storage_ptr(), &mut v) }?;
        Ok(v)
    }
}

fn check_in(at: usize, len: usize, size: usize) -> Result<()> {
    if at.checked_add(len).is_none_or(|e| e > size) {
        return Err(Error::InvalidArgument(format!("{len} bytes at {at} pass the end of a {size}-byte storage")));
    }
    Ok(())
}

/// A CPU storage as a descriptor names it: the id this process shows it under on every
/// connection, what keeps it alive here, its fd, and the byte range of its file.
pub(crate) struct CpuStorage<'a> {
    pub id: u64,
    pub keeper: crate::lease::StorageKeeper,
    pub fd: BorrowedFd<'a>,
    pub base_offset: u64,
    pub nbytes: u64,
}

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

struct Inner {
    conn: Connection,
    cfg: PeerConfig,
    exporter: Mutex<Exporter>,
    export_table: Arc<Segment>,
    /// Held across grant + send, so a segment's fd always precedes descriptors naming it.
    send_lock: Mutex<()>,
    import: ImportTable,
    /// Our mappings of the peer's segments (windows), bounded per connection.
    import_segments: Mutex<crate::import_cache::ImportCache>,
    /// Set once by `Peer::drop` (Release); the reaper and imports read it (Acquire) so
    /// they see the shutdown and stop using the connection. Nothing else is published
    /// through it.
    stop: AtomicBool,
    /// Wakes the reaper early (shutdown); private to this process.
    reaper_wake: parking_lot::Condvar,
    reaper_lock: Mutex<()>,
    /// Release-doorbell sequence at the last reap.
    reaped_seq: std::sync::atomic::AtomicU32,
    /// Serialises reap passes, owner drops included, so `reap_now` returns only once
    /// every release it can see is settled. Re-entrant: a release callback may call back
    /// into this peer on the same thread.
    reap_lock: parking_lot::ReentrantMutex<()>,
    /// The reaper is in its long idle sleep (no live lease for a while); an export wakes it.
    reaper_idle: AtomicBool,
    ring_tx: Option<Mutex<RingSender>>,
    ring_rx: Option<RingReceiver>,
    /// Our IPC event pool for CUDA exports (created at the first one).
    cuda_tx: Mutex<Option<crate::cuda::event::EventPool>>,
    /// The peer's event pool, opened when it sends it.
    cuda_rx: Mutex<Option<Arc<crate::cuda::event::RemoteEvents>>>,
    /// CUDA imports released "after the stream's work": released by the reaper once
    /// their mark completes (`CudaImported::release_after`).
    deferred: Mutex<Vec<(crate::cuda::event::StreamMark, CudaImported)>>,
    /// Our GPU bounce ring (sending side), if configured.
    cuda_ring_tx: Option<Mutex<crate::cuda::ring::CudaRingSender>>,
    /// The peer's GPU bounce ring, if it offered one: opened, or why it could not be.
    cuda_ring_rx: Option<std::result::Result<crate::cuda::ring::CudaRingReceiver, String>>,
}

impl Inner {
    fn release_doorbell(&self) -> Doorbell<'_> {
        crate::lease::release_doorbell(&self.export_table)
    }

    /// One reaper pass; returns (next deadline, peer gone, live leases).
    fn reap_once(&self) -> (Option<Instant>, bool, u64) {
        let _pass = self.reap_lock.lock();
        let mut dead = Reclaimed::default();
        let gone = self.conn.is_peer_gone();
        // Relaxed: only a hint of whether anything was released since the last pass; the
        // slot words themselves carry the Acquire/Release pairing.
        self.reaped_seq.store(self.release_doorbell().current(), Ordering::Relaxed);
        let (next, forget, live) = {
            let mut ex = self.exporter.lock();
            if gone || self.stop.load(Ordering::Acquire) {
                ex.reclaim_all(&mut dead);
                (None, Vec::new(), 0)
            } else {
                let next = ex.reap(Instant::now(), &mut dead);
                (next, ex.forgettable_segments(), ex.stats().live_leases)
            }
        };
        // Owners run arbitrary drop code (a C callback): never under our locks.
        dead.settle(&self.exporter);
        for id in forget {
            let _g = self.send_lock.lock();
            let _ = self.conn.send(KIND_FORGET, &id.to_le_bytes(), &[]);
        }
        let waiting = self.release_finished_imports(gone || self.stop.load(Ordering::Acquire));
        (next, gone, live + waiting)
    }

    /// Release deferred CUDA imports whose stream work completed; with `all` (the peer is
    /// gone or we are closing) release the rest's leases too, but keep their mappings
    /// until their work completes ([`linger`]). Returns how many still wait.
    fn release_finished_imports(&self, all: bool) -> u64 {
        collect_lingering();
        let (finished, unfinished): (Vec<_>, Vec<_>) = {
            let mut d = self.deferred.lock();
            if d.is_empty() {
                return 0;
            }
            // A mark that cannot be queried (device error) releases too: holding the
            // lease forever would only leak the producer's memory.
            let (done, wait): (Vec<_>, Vec<_>) = d.drain(..).partition(|(m, _)| m.done().unwrap_or(true));
            if all {
                (done, wait)
            } else {
                *d = wait;
                (done, Vec::new())
            }
        };
        let waiting = self.deferred.lock().len() as u64;
        drop(finished);
        for (mark, imp) in unfinished {
            imp.linger(mark);
        }
        waiting
    }

    /// Reap if the consumer released anything since the last pass (cheap check).
    fn reap_if_released(&self) {
        if self.release_doorbell().current() != self.reaped_seq.load(Ordering::Relaxed) {
            // Only if no pass is running: the export path never waits on one.
            if let Some(_pass) = self.reap_lock.try_lock() {
                self.reap_once();
            }
        }
    }
}

fn reaper(inner: Arc<Inner>) {
    // Ticks in a row without a live lease; after QUIET_TICKS the reaper sleeps long.
    const QUIET_TICKS: u32 = 50;
    let mut quiet = 0u32;
    loop {
        if inner.stop.load(Ordering::Acquire) {
            return;
        }
        let (next, gone, live) = inner.reap_once();
        // A gone peer's reaper stays while CUDA mappings linger (its pass collects them).
        if gone && LINGERING.lock().is_empty() {
            return;
        }
        quiet = if live > 0 { 0 } else { quiet.saturating_add(1) };
        let mut g = inner.reaper_lock.lock();
        if inner.stop.load(Ordering::Acquire) {
            return;
        }
        if quiet >= QUIET_TICKS {
            // Idle: announce it, then re-check under the lock an export takes to wake us
            // (SeqCst store, then the exporter's lock: an export either sees the flag and
            // notifies — we hold `reaper_lock` until we wait — or granted before our check).
            inner.reaper_idle.store(true, Ordering::SeqCst);
            if inner.exporter.lock().stats().live_leases == 0 {
                inner.reaper_wake.wait_for(&mut g, IDLE_TICK);
            }
            inner.reaper_idle.store(false, Ordering::SeqCst);
            if inner.exporter.lock().stats().live_leases > 0 {
                quiet = 0;
            }
        } else {
            let tick = next.map_or(inner.cfg.reap_interval, |d| d.saturating_duration_since(Instant::now()).min(inner.cfg.reap_interval));
            inner.reaper_wake.wait_for(&mut g, tick);
        }
    }
}

impl Inner {
    /// After a grant: wake the reaper if it is in its long idle sleep.
    fn wake_idle_reaper(&self) {
        // SeqCst: pairs with the reaper's SeqCst store of the flag before its re-check.
        if self.reaper_idle.load(Ordering::SeqCst) {
            let _g = self.reaper_lock.lock();
            self.reaper_wake.notify_all();
        }
    }
}

/// One end of a connection. `Send + Sync`: export from any thread; one thread at a time
/// receives.
pub struct Peer {
    inner: Arc<Inner>,
    reaper: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer").field("peer_pid", &self.peer_pid()).finish()
    }
}

impl Peer {
    /// Set up leases over a handshaken connection. Both ends call this.
    pub fn new(mut conn: Connection, cfg: PeerConfig) -> Result<Peer> {
        conn.set_recv_spin(cfg.recv_spin);
        conn.set_send_timeout(cfg.send_timeout);
        let exporter = Exporter::new(cfg.max_leases, cfg.max_lease_bytes)?;
        let export_table = exporter.table().clone();
        let tx_ring = if cfg.ring_bytes > 0 { Some(RingShared::create(cfg.ring_bytes)?) } else { None };
        let cuda_tx = cfg.cuda_ring.map(crate::cuda::ring::CudaRingSender::create).transpose()?;
        let setup = setup_payload(exporter.capacity(), cfg.ring_bytes as u64, cuda_tx.is_some());
        let mut fds = vec![export_table.fd()];
        if let Some(r) = &tx_ring {
            fds.push(r.segment().fd());
        }
        conn.send(KIND_TABLE, &setup, &fds)?;
        if let Some(tx) = &cuda_tx {
            let (payload, fds) = tx.setup();
            conn.send(KIND_CUDA_RING, &payload, &fds)?;
        }
        let msg = conn.recv(Some(cfg.handshake_timeout))?;
        if msg.kind != KIND_TABLE || msg.payload.len() != 16 || msg.fds.is_empty() || msg.fds.len() > 2 {
            return Err(Error::Protocol(format!(
                "expected the peer's setup (kind {KIND_TABLE}, 16 bytes, lease table fd + optional ring fd), got kind {} with {} bytes and {} fds",
                msg.kind,
                msg.payload.len(),
                msg.fds.len()
            )));
        }
        let cap = u32::from_le_bytes(msg.payload[..4].try_into().unwrap());
        let ring_bytes = u64::from_le_bytes(msg.payload[4..12].try_into().unwrap());
        let flags = u32::from_le_bytes(msg.payload[12..16].try_into().unwrap());
        if flags & !SETUP_HAS_CUDA_RING != 0 {
            return Err(Error::Protocol(format!("unknown setup flags {flags:#x}")));
        }
        let mut fds = msg.fds.into_iter();
        let import = ImportTable::open(fds.next().expect("checked"), cap, cfg.max_peer_table_capacity)?;
        let rx_ring = match (ring_bytes, fds.next()) {
            (0, None) => None,
            (n, Some(fd)) if n > 0 => Some(RingShared::open(fd, n, cfg.max_peer_ring_bytes)?),
            (n, fd) => {
                return Err(Error::Protocol(format!(
                    "peer announced a {n}-byte ring but sent {} ring fd",
                    if fd.is_some() { "a" } else { "no" }
                )));
            }
        };
        let cuda_rx = if flags & SETUP_HAS_CUDA_RING != 0 { Some(Self::open_cuda_ring(&conn, &cfg)?) } else { None };
        let max_ring_message = cfg.max_ring_message;
        let inner = Arc::new(Inner {
            conn,
            cfg,
            exporter: Mutex::new(exporter),
            export_table,
            send_lock: Mutex::new(()),
            import,
            import_segments: Mutex::new(Default::default()),
            stop: AtomicBool::new(false),
            reaper_wake: parking_lot::Condvar::new(),
            reaper_lock: Mutex::new(()),
            reaped_seq: std::sync::atomic::AtomicU32::new(0),
            reap_lock: parking_lot::ReentrantMutex::new(()),
            reaper_idle: AtomicBool::new(false),
            ring_tx: tx_ring.map(|r| Mutex::new(RingSender::new(r))),
            ring_rx: rx_ring.map(|r| RingReceiver::new(r, max_ring_message)),
            cuda_tx: Mutex::new(None),
            cuda_rx: Mutex::new(None),
            deferred: Mutex::new(Vec::new()),
            cuda_ring_tx: cuda_tx.map(Mutex::new),
            cuda_ring_rx: cuda_rx,
        });
        let r = inner.clone();
        let reaper = std::thread::Builder::new()
            .name("tensorwire-reaper".into())
            .spawn(move || reaper(r))
            .map_err(|e| Error::io("spawning the lease reaper thread", e))?;
        Ok(Peer { inner, reaper: Some(reaper) })
    }

    /// Receive the peer's GPU ring setup and open it. A malformed setup fails the
    /// connection; a ring this side cannot open (no CUDA here) is refused in its control
    /// segment, so the producer's sends fail with a clear error, and remembered for ours.
    fn open_cuda_ring(conn: &Connection, cfg: &PeerConfig) -> Result<std::result::Result<crate::cuda::ring::CudaRingReceiver, String>> {
        use crate::cuda::ring::{CudaRingReceiver, RingSetup};
        let msg = conn.recv(Some(cfg.handshake_timeout))?;
        if msg.kind != KIND_CUDA_RING || msg.fds.len() != 2 {
            return Err(Error::Protocol(format!(
                "expected the peer's GPU ring setup (kind {KIND_CUDA_RING}, 2 fds), got kind {} with {} fds",
                msg.kind,
                msg.fds.len()
            )));
        }
        let setup = RingSetup::decode(&msg.payload)?;
        let mut fds = msg.fds.into_iter();
        let ctrl = CudaRingReceiver::map_control(&setup, fds.next().expect("checked"))?;
        let desc_ring = fds.next().expect("checked");
        match CudaRingReceiver::open(setup, ctrl.clone(), desc_ring, cfg.max_peer_ring_bytes, cfg.max_ring_message) {
            Ok(rx) => Ok(Ok(rx)),
            Err(e) => {
                CudaRingReceiver::refuse(&ctrl);
                Ok(Err(e.to_string()))
            }
        }
    }

    /// A GPU ring asked for: its shape must be valid and a driver present — checked before
    /// the handshake, so the caller learns at once instead of the peer timing out.
    fn check_cuda_ring(cfg: &PeerConfig) -> Result<()> {
        match &cfg.cuda_ring {
            Some(r) => {
                r.check()?;
                crate::cuda::driver::init()
            }
            None => Ok(()),
        }
    }

    /// A connected pair in this process (tests, in-process use).
    pub fn pair(cfg: PeerConfig) -> Result<(Peer, Peer)> {
        Self::check_cuda_ring(&cfg)?;
        let (a, b) = Connection::pair()?;
        let c2 = cfg.clone();
        let t = std::thread::spawn(move || Peer::new(b, c2));
        let a = Peer::new(a, cfg)?;
        let b = t.join().map_err(|_| Error::Protocol("setup thread panicked".into()))??;
        Ok((a, b))
    }

    /// From an inherited (or otherwise obtained) SEQPACKET socket fd.
    pub fn from_fd(fd: OwnedFd, cfg: PeerConfig) -> Result<Peer> {
        Self::check_cuda_ring(&cfg)?;
        let conn = Connection::establish_with(fd, cfg.handshake_timeout, cfg.max_message)?;
        Peer::new(conn, cfg)
    }

    /// Connect to a [`Listener`] at `path`.
    pub fn connect(path: impl AsRef<Path>, cfg: PeerConfig) -> Result<Peer> {
        let fd = crate::sys::seqpacket_connect(path.as_ref())?;
        Peer::from_fd(fd, cfg)
    }

    /// Accept one connection from `listener`.
    pub fn accept(listener: &Listener, cfg: PeerConfig) -> Result<Peer> {
        Self::check_cuda_ring(&cfg)?;
        let conn = listener.accept(cfg.handshake_timeout)?;
        Peer::new(conn, cfg)
    }

    /// The limits this side was set up with.
    pub fn config(&self) -> &PeerConfig {
        &self.inner.cfg
    }

    /// The peer's pid (kernel-verified at the handshake).
    pub fn peer_pid(&self) -> i32 {
        self.inner.conn.peer_pid()
    }

    pub fn is_peer_gone(&self) -> bool {
        self.inner.conn.is_peer_gone()
    }

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
    /// it) with the storage's fd; on failure the lease is taken back and `owner` dropped.
    /// The one path every CPU export takes (own segments and forwarded imports alike).
    pub(crate) fn send_leased(&self, storage: CpuStorage<'_>, layout: &Layout, owner: Owner, opts: ExportOptions) -> Result<LeaseId> {
        if self.inner.conn.is_peer_gone() {
            drop(owner);
            return Err(Error::peer_gone(format!("process {} is gone; nothing can be exported to it", self.peer_pid())));
        }
        self.inner.reap_if_released();
        let window = opts.window.or(self.inner.cfg.default_window);
        let deadline = window.map(crate::deadline::after);
        let _send = self.inner.send_lock.lock();
        let sid = storage.id;
        let granted = self.inner.exporter.lock().grant_storage(Some((sid, storage.keeper)), storage.nbytes, owner, deadline);
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
        let mut payload = [0u8; 8 + DESC_SIZE];
        payload[..8].copy_from_slice(&opts.tag.to_le_bytes());
        payload[8..].copy_from_slice(desc.encode());
        // The fd goes with every descriptor, not only the first naming the segment: the
        // consumer may have evicted its mapping (it bounds what it keeps mapped) and then
        // maps it again from this fd; when it still has it, it only compares identities.
        if let Err(e) = self.inner.conn.send(KIND_TENSOR, &payload, std::slice::from_ref(&storage.fd)) {
            let mut dead = Reclaimed::default();
            {
                let mut ex = self.inner.exporter.lock();
                ex.revoke(id, &mut dead);
                if first {
                    ex.unshare_segment(sid);
                }
            }
            drop(_send);
            dead.settle(&self.inner.exporter);
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
        dptr: u64,
        nbytes: u64,
        layout: &Layout,
        stream: usize,
        owner: Owner,
        opts: ExportOptions,
    ) -> Result<LeaseId> {
        use crate::cuda::{event::EventPool, ipc};
        if self.inner.conn.is_peer_gone() {
            return Err(Error::peer_gone(format!("process {} is gone; nothing can be exported to it", self.peer_pid())));
        }
        let need = layout.extent_bytes()?;
        if need > nbytes {
            return Err(Error::InvalidArgument(format!("view needs {need} bytes of storage, storage has {nbytes}")));
        }
        // Legacy IPC for cudaMalloc memory; an fd for VMM memory (expandable segments).
        // A driver too old to know the attribute answers CUDA_ERROR_INVALID_VALUE: legacy
        // IPC then, as before the attribute existed.
        let legacy = match crate::cuda::driver::is_legacy_ipc_capable(dptr) {
            Err(Error::Cuda { name, .. }) if name == "CUDA_ERROR_INVALID_VALUE" => true,
            r => r?,
        };
        let (exp, vmm_fd) = if legacy {
            (ipc::export_pointer(dptr)?, None)
        } else {
            let v = crate::cuda::vmm::export_pointer(dptr, nbytes)?;
            (ipc::IpcExport { device: v.device, handle: [0; 64], alloc_size: v.alloc_size, offset: v.offset }, Some(v.fd))
        };
        ipc::check_range(exp.offset, nbytes, exp.alloc_size).map_err(|_| {
            Error::InvalidArgument(format!(
                "{nbytes} bytes at offset {} pass the end of a {}-byte CUDA allocation",
                exp.offset, exp.alloc_size
            ))
        })?;
        let device = u8::try_from(exp.device).map_err(|_| Error::InvalidArgument(format!("device {} out of range", exp.device)))?;
        let _send = self.inner.send_lock.lock();
        let mut pool_guard = self.inner.cuda_tx.lock();
        if pool_guard.is_none() {
            let p = EventPool::new(exp.device)?;
            let mut payload = exp.device.to_le_bytes().to_vec();
            payload.extend_from_slice(&(p.handles().len() as u32).to_le_bytes());
            for h in p.handles() {
                payload.extend_from_slice(h);
            }
            self.inner.conn.send(KIND_CUDA_EVENTS, &payload, &[p.acks().fd()])?;
            *pool_guard = Some(p);
        }
        let pool = pool_guard.as_mut().expect("created above");
        if pool.device() != exp.device {
            return Err(Error::InvalidArgument(format!(
                "this connection exports CUDA memory of device {}; device {} needs its own connection",
                pool.device(),
                exp.device
            )));
        }
        let (slot, seq) = pool.record(stream, self.inner.cfg.handshake_timeout)?;
        let window = opts.window.or(self.inner.cfg.default_window);
        let deadline = window.map(crate::deadline::after);
        let granted = self.inner.exporter.lock().grant(None, nbytes, owner, deadline);
        let id = match granted {
            Ok((id, _)) => id,
            Err((e, owner)) => {
                // No message names the record: give its event slot back.
                pool.cancel(slot, seq);
                // Owners run arbitrary drop code (a C callback): never under our locks.
                drop(pool_guard);
                drop(_send);
                drop(owner);
                return Err(e);
            }
        };
        let storage = StorageRef {
            // For VMM: the allocation's size (the fd does not carry it).
            segment_id: if vmm_fd.is_some() { exp.alloc_size } else { 0 },
            base_offset: exp.offset,
            nbytes,
            lease_slot: id.slot,
            lease_gen: id.generation,
            cuda_ipc_handle: exp.handle,
            event_slot: slot,
            event_seq: seq,
            ..Zeroable::zeroed()
        };
        let kind = if vmm_fd.is_some() { StorageKind::CudaVmm } else { StorageKind::CudaIpc };
        let desc = TensorDesc::new_cuda(layout, device, kind, storage);
        let mut payload = [0u8; 8 + DESC_SIZE];
        payload[..8].copy_from_slice(&opts.tag.to_le_bytes());
        payload[8..].copy_from_slice(desc.encode());
        let fds: Vec<BorrowedFd<'_>> = vmm_fd.iter().map(|f| f.as_fd()).collect();
        if let Err(e) = self.inner.conn.send(KIND_TENSOR, &payload, &fds) {
            pool.cancel(slot, seq);
            let mut dead = Reclaimed::default();
            self.inner.exporter.lock().revoke(id, &mut dead);
            drop(pool_guard);
            drop(_send);
            dead.settle(&self.inner.exporter);
            return Err(e);
        }
        self.inner.wake_idle_reaper();
        Ok(id)
    }

    /// Send a user message with up to 8 fds.
    pub fn send_message(&self, payload: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
        self.inner.conn.send(KIND_USER, payload, fds)
    }

    /// Receive the next tensor or user message (`timeout` per call; `None` waits until
    /// something arrives or the peer dies).
    pub fn recv(&self, timeout: Option<Duration>) -> Result<Incoming> {
        let deadline = timeout.map(crate::deadline::after);
        let timed_out = || Error::Timeout { what: "a tensor or message from the peer", after: timeout.unwrap_or_default() };
        let mut first = true;
        loop {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            // The deadline holds across internal messages (FORGET, CUDA events): a peer
            // that keeps sending them must not stretch one receive past its timeout. The
            // first pass always looks, so a zero timeout still takes what is there.
            if !first && left.is_some_and(|l| l.is_zero()) {
                return Err(timed_out());
            }
            first = false;
            let msg = match self.inner.conn.recv_lossy(left) {
                Err(Error::Timeout { .. }) => return Err(timed_out()),
                r => r?,
            };
            if msg.fds_lost {
                return Err(self.drop_lost(msg));
            }
            match msg.kind {
                KIND_TENSOR => return self.import(msg),
                KIND_CUDA_EVENTS => self.open_cuda_events(msg)?,
                KIND_USER => return Ok(Incoming::Message { payload: msg.payload, fds: msg.fds }),
                KIND_FORGET => {
                    let id: [u8; 8] = msg.payload.as_slice().try_into().map_err(|_| {
                        Error::Protocol(format!("forget message of {} bytes, expected 8", msg.payload.len()))
                    })?;
                    self.inner.import_segments.lock().forget(u64::from_le_bytes(id));
                }
                k => return Err(Error::Protocol(format!("unknown message kind {k}"))),
            }
        }
    }

    /// A message arrived without the fds it carried (we are at our open-file limit): give
    /// back the lease a tensor message stood for, so the producer's memory is not held
    /// for a tensor nobody will see, and report the limit.
    fn drop_lost(&self, msg: crate::connection::Message) -> Error {
        if msg.kind == KIND_TENSOR && msg.payload.len() == 8 + DESC_SIZE {
            if let Ok(desc) = TensorDesc::decode(&msg.payload[8..]) {
                let _ = self.inner.import.release(LeaseId { slot: desc.storage.lease_slot, generation: desc.storage.lease_gen });
            }
        }
        crate::connection::fds_lost_error()
    }

    /// Receive, expecting a tensor.
    pub fn recv_tensor(&self, timeout: Option<Duration>) -> Result<Imported> {
        match self.recv(timeout)? {
            Incoming::Tensor(t) => Ok(t),
            other => Err(Error::Protocol(format!("expected a tensor, got {other:?}"))),
        }
    }

    /// The lease a received descriptor names must be live. If it is not because the
    /// producer has gone (closing ends every lease it granted, also those still in
    /// flight), say that: `PeerGone`, not a stale lease.
    fn check_live(&self, lease: LeaseId) -> Result<()> {
        self.inner.import.check_live(lease).map_err(|e| {
            if self.inner.conn.is_peer_gone() {
                Error::peer_gone(format!(
                    "process {} closed the connection; the lease of this tensor ended with it",
                    self.peer_pid()
                ))
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
        let ev = crate::cuda::event::RemoteEvents::open(device, &handles, acks)?;
        // Kept even when the events cannot be opened here: its ack table still hands the
        // producer's event slots back as our imports fail, so its exports do not jam.
        let unusable = ev.usable().err().map(|why| format!("the producer's IPC events could not be opened here: {why}"));
        *self.inner.cuda_rx.lock() = Some(Arc::new(ev));
        match unusable {
            Some(m) => Err(Error::CudaUnavailable(m)),
            None => Ok(()),
        }
    }

    /// Check the message's shape, copy and validate its descriptor once, then take the
    /// path its storage kind names.
    fn import(&self, mut msg: crate::connection::Message) -> Result<Incoming> {
        if msg.payload.len() != 8 + DESC_SIZE || msg.fds.len() > 1 {
            return Err(Error::Protocol(format!(
                "tensor message has {} bytes and {} fds, expected {} bytes and at most 1 fd",
                msg.payload.len(),
                msg.fds.len(),
                8 + DESC_SIZE
            )));
        }
        let tag = u64::from_le_bytes(msg.payload[..8].try_into().unwrap());
        let desc = TensorDesc::decode(&msg.payload[8..])?;
        let fd = msg.fds.pop();
        match desc.kind() {
            Some(StorageKind::Segment) => self.import_cpu(tag, desc, fd).map(Incoming::Tensor),
            Some(StorageKind::CudaIpc) if fd.is_none() => self.import_cuda(tag, desc, None).map(Incoming::CudaTensor),
            Some(StorageKind::CudaIpc) => Err(Error::Protocol("a CUDA IPC tensor message carried an fd".into())),
            Some(StorageKind::CudaVmm) if fd.is_some() => self.import_cuda(tag, desc, fd).map(Incoming::CudaTensor),
            Some(StorageKind::CudaVmm) => Err(Error::Protocol("a CUDA VMM tensor message carried no fd".into())),
            k => Err(Error::InvalidDescriptor(format!("storage kind {k:?} cannot arrive as a leased tensor"))),
        }
    }

    fn import_cuda(&self, tag: u64, desc: TensorDesc, vmm_fd: Option<OwnedFd>) -> Result<CudaImported> {
        let lease = LeaseId { slot: desc.storage.lease_slot, generation: desc.storage.lease_gen };
        // Claim the producer's event record first: whatever fails below, the claim's drop
        // acknowledges the record, so the producer's event slot is not left waiting.
        let claim = self.inner.cuda_rx.lock().clone()
            .ok_or_else(|| Error::Protocol("a CUDA tensor arrived before the producer's IPC events".into()))
            .and_then(|events| events.claim(desc.storage.event_slot, desc.storage.event_seq));
        self.check_live(lease)?;
        let opened = (|| {
            let claim = claim?;
            let device = i32::from(desc.device_index);
            let mapping = match vmm_fd {
                // Mapped per message (a VMM fd has no cheap identity to cache by).
                Some(fd) => CudaMemory::Vmm(crate::cuda::vmm::VmmAllocation::import_fd(&fd, device, desc.storage.segment_id)?),
                None => CudaMemory::Ipc(crate::cuda::ipc::cache().open(device, desc.storage.cuda_ipc_handle)?),
            };
            crate::cuda::ipc::check_range(desc.storage.base_offset, desc.storage.nbytes, mapping.size())?;
            Ok((mapping, claim))
        })();
        match opened {
            Ok((mapping, claim)) => {
                let held = HeldLease { inner: self.inner.clone(), lease, released: false };
                Ok(CudaImported { held, mapping, claim, desc, tag })
            }
            Err(e) => {
                let _ = self.inner.import.release(lease);
                Err(e)
            }
        }
    }

    fn import_cpu(&self, tag: u64, desc: TensorDesc, fd: Option<OwnedFd>) -> Result<Imported> {
        let lease = LeaseId { slot: desc.storage.lease_slot, generation: desc.storage.lease_gen };
        self.check_live(lease)?;
        // From here the lease is live: give it back on any failure so the producer's
        // owner is not held for nothing.
        let resolved = self.resolve_segment(&desc, fd);
        match resolved {
            Ok(r) => Ok(Imported {
                held: HeldLease { inner: self.inner.clone(), lease, released: false },
                window: r.window,
                fd: r.fd,
                desc,
                tag,
            }),
            Err(e) => {
                let _ = self.inner.import.release(lease);
                Err(e)
            }
        }
    }

    fn resolve_segment(&self, desc: &TensorDesc, fd: Option<OwnedFd>) -> Result<crate::import_cache::Resolved> {
        let limits = crate::import_cache::Limits {
            max_segments: self.inner.cfg.max_import_segments,
            max_bytes: self.inner.cfg.max_import_mapped_bytes,
        };
        self.inner.import_segments.lock().resolve(desc, fd, limits)
    }

    /// Counters of what this side exported to the peer.
    pub fn export_stats(&self) -> LeaseStats {
        self.inner.exporter.lock().stats()
    }

    /// Run one reaper pass now (releases, windows, peer death) instead of waiting for the
    /// background reaper.
    pub fn reap_now(&self) -> LeaseStats {
        self.inner.reap_once();
        self.export_stats()
    }

    fn ring_wait(&self, timeout: Option<Duration>, spin: Option<u32>) -> Wait {
        Wait { spin: spin.unwrap_or(self.inner.cfg.ring_spin), timeout: timeout.unwrap_or(Duration::MAX / 4) }
    }

    fn no_ring(side: &str) -> Error {
        Error::InvalidArgument(format!("this connection has no ring to {side} (PeerConfig::ring_bytes was 0)"))
    }

    /// Copy `items` (bytes or tensor views, packed contiguous) through this side's ring:
    /// one publish and one wake-up for the batch. Waits for space at most `timeout`.
    pub fn ring_send(&self, items: &[RingItem<'_>], timeout: Option<Duration>) -> Result<()> {
        self.ring_send_with(items, self.ring_wait(timeout, None))
    }

    /// `ring_send` with an explicit spin budget.
    pub fn ring_send_with(&self, items: &[RingItem<'_>], wait: Wait) -> Result<()> {
        let tx = self.inner.ring_tx.as_ref().ok_or_else(|| Self::no_ring("send through"))?;
        let conn = &self.inner.conn;
        tx.lock().send_many(items, wait, &|| conn.is_peer_gone())
    }

    /// Receive the next ring message as a private copy.
    pub fn ring_recv(&self, timeout: Option<Duration>) -> Result<RingMessage> {
        self.ring_recv_with(false, self.ring_wait(timeout, None))
    }

    /// Receive the next ring message; with `borrow`, a message that fits one record stays
    /// in the ring until the returned message is dropped (zero copies on receive).
    pub fn ring_recv_with(&self, borrow: bool, wait: Wait) -> Result<RingMessage> {
        let rx = self.inner.ring_rx.as_ref().ok_or_else(|| Self::no_ring("receive from"))?;
        let conn = &self.inner.conn;
        rx.recv(borrow, wait, &|| conn.is_peer_gone())
    }

    /// Receive the next ring message into `buf`, reusing its capacity (no allocation in
    /// steady state, also for messages larger than the ring). Returns tag and descriptor.
    pub fn ring_recv_into(&self, buf: &mut Vec<u8>, wait: Wait) -> Result<(u64, Option<TensorDesc>)> {
        let rx = self.inner.ring_rx.as_ref().ok_or_else(|| Self::no_ring("receive from"))?;
        let conn = &self.inner.conn;
        rx.recv_into(buf, wait, &|| conn.is_peer_gone())
    }

    /// Receive up to `max` ring messages: waits for the first, takes the rest that are
    /// already there.
    pub fn ring_recv_many(&self, max: usize, borrow: bool, wait: Wait) -> Result<Vec<RingMessage>> {
        let rx = self.inner.ring_rx.as_ref().ok_or_else(|| Self::no_ring("receive from"))?;
        let conn = &self.inner.conn;
        rx.recv_many(max.max(1), borrow, wait, &|| conn.is_peer_gone())
    }

    fn cuda_ring_rx(&self) -> Result<&crate::cuda::ring::CudaRingReceiver> {
        match &self.inner.cuda_ring_rx {
            Some(Ok(rx)) => Ok(rx),
            Some(Err(m)) => Err(Error::CudaUnavailable(format!("the peer's GPU ring could not be opened here: {m}"))),
            None => Err(Error::InvalidArgument(
                "the peer offered no GPU ring (its PeerConfig::cuda_ring was None)".into(),
            )),
        }
    }

    /// Copy a CUDA tensor through this side's GPU bounce ring: `layout` (contiguous)
    /// describes `layout.packed_bytes()` bytes at device address `src`; the copies are
    /// enqueued on `stream` after the work already there (no synchronize). Waits for free
    /// slots at most `timeout`.
    pub fn cuda_ring_send(&self, src: u64, layout: &Layout, stream: usize, tag: u64, timeout: Option<Duration>) -> Result<()> {
        let tx = self.inner.cuda_ring_tx.as_ref().ok_or_else(|| {
            Error::InvalidArgument("this connection has no GPU ring to send through (PeerConfig::cuda_ring was None)".into())
        })?;
        let conn = &self.inner.conn;
        tx.lock().send(src, layout, stream, tag, self.ring_wait(timeout, None), &|| conn.is_peer_gone())
    }

    /// Wait for the next message in the peer's GPU ring: its tag and descriptor (a
    /// contiguous layout on the ring's device). Then `cuda_ring_recv_finish` (copy it
    /// out) or `cuda_ring_discard`. Calling again first returns the same message.
    pub fn cuda_ring_recv(&self, timeout: Option<Duration>) -> Result<(u64, TensorDesc)> {
        let conn = &self.inner.conn;
        self.cuda_ring_rx()?.begin(self.ring_wait(timeout, None), &|| conn.is_peer_gone())
    }

    /// Copy the message `cuda_ring_recv` returned into `capacity` bytes of device memory
    /// at `dst`, on `stream` (ordered after the producer's writes; no synchronize), and
    /// free its slots. Waits for its later chunks at most `timeout`.
    pub fn cuda_ring_recv_finish(&self, dst: u64, capacity: u64, stream: usize, timeout: Option<Duration>) -> Result<()> {
        let conn = &self.inner.conn;
        self.cuda_ring_rx()?.finish(dst, capacity, stream, self.ring_wait(timeout, None), &|| conn.is_peer_gone())
    }

    /// Drop the message `cuda_ring_recv` returned without copying it.
    pub fn cuda_ring_discard(&self, timeout: Option<Duration>) -> Result<()> {
        let conn = &self.inner.conn;
        self.cuda_ring_rx()?.discard(self.ring_wait(timeout, None), &|| conn.is_peer_gone())
    }

    /// Number of the peer's segments mapped here.
    pub fn imported_segments(&self) -> usize {
        self.inner.import_segments.lock().len()
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Some(tx) = &self.inner.cuda_ring_tx {
            // The peer may still be copying out of our arena: let it finish (bounded).
            let conn = &self.inner.conn;
            tx.lock().drain(Duration::from_secs(1), &|| conn.is_peer_gone());
        }
        self.inner.stop.store(true, Ordering::Release);
        {
            let _g = self.inner.reaper_lock.lock();
            self.inner.reaper_wake.notify_all();
        }
        if let Some(t) = self.reaper.take() {
            let _ = t.join();
        }
        // The connection ends with this handle: the peer sees EOF now even while our
        // imports (which keep `inner` alive) are still held.
        // SAFETY: shutdown on our own open socket; it does not close the fd.
        unsafe { libc::shutdown(std::os::fd::AsRawFd::as_raw_fd(&self.inner.conn.socket()), libc::SHUT_RDWR) };
        self.inner.reap_once();
        self.inner.import_segments.lock().clear();
        // Deferred CUDA imports hold `inner` (a cycle): release them with the connection
        // (`stop` is set, so `release_after` defers nothing more); mappings whose readers
        // are still running linger until they finish — waited for here, bounded, since
        // this connection's reaper no longer collects them.
        self.inner.release_finished_imports(true);
        let deadline = Instant::now() + Duration::from_secs(1);
        while !collect_lingering() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// A tensor imported from the peer: a view over the peer's shared memory, valid until
/// released (or dropped, which releases). Sent on to another peer as the same memory
/// with [`Peer::export_imported`] (in an `Arc`: the forward's lease shares it).
pub struct Imported {
    held: HeldLease,
    window: Arc<crate::import_cache::Window>,
    /// The window's fd (shared by its imports), to forward this import as the same
    /// memory; `None` only if the descriptor came without one and no live import kept it.
    fd: Option<Arc<crate::import_cache::ImportFd>>,
    desc: TensorDesc,
    tag: u64,
}

/// The consumer's side of one lease: released once, explicitly or on drop.
struct HeldLease {
    inner: Arc<Inner>,
    lease: LeaseId,
    released: bool,
}

impl HeldLease {
    fn release(&mut self) -> Result<()> {
        self.released = true;
        if self.inner.stop.load(Ordering::Acquire) || self.inner.conn.is_peer_gone() {
            return Err(Error::peer_gone("the connection ended before the lease was released"));
        }
        self.inner.import.release(self.lease)
    }
}

impl Drop for HeldLease {
    fn drop(&mut self) {
        if !self.released {
            let _ = self.release();
        }
    }
}

impl Imported {
    /// The validated descriptor.
    pub fn desc(&self) -> &TensorDesc {
        &self.desc
    }
    pub fn layout(&self) -> Layout {
        self.desc.layout()
    }
    pub fn tag(&self) -> u64 {
        self.tag
    }
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
        let l = self.layout();
        // Clamped: for an empty view the offset is not bounded by the extent.
        let off = (l.storage_offset as u64).saturating_mul(l.dtype.size() as u64).min(self.desc.storage.nbytes);
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

    /// The fd of the window this import maps (for forwarding it).
    pub(crate) fn forward_fd(&self) -> Option<&Arc<crate::import_cache::ImportFd>> {
        self.fd.as_ref()
    }
}

/// A CUDA tensor imported from the peer: its allocation opened through the process's
/// handle cache, valid until released (or dropped, which releases). Before touching it on
/// a stream, call [`CudaImported::wait_on`] with that stream.
pub struct CudaImported {
    held: HeldLease,
    mapping: CudaMemory,
    claim: crate::cuda::event::EventClaim,
    desc: TensorDesc,
    tag: u64,
}

/// The memory behind a CUDA import: an IPC handle opened through the process's cache, or
/// a VMM allocation mapped from the producer's fd.
enum CudaMemory {
    Ipc(crate::cuda::ipc::IpcMapping),
    Vmm(crate::cuda::vmm::VmmAllocation),
}

impl CudaMemory {
    fn base(&self) -> u64 {
        match self {
            CudaMemory::Ipc(m) => m.base(),
            CudaMemory::Vmm(a) => a.ptr(),
        }
    }
    fn size(&self) -> u64 {
        match self {
            CudaMemory::Ipc(m) => m.size(),
            CudaMemory::Vmm(a) => a.size(),
        }
    }
    fn device(&self) -> i32 {
        match self {
            CudaMemory::Ipc(m) => m.device(),
            CudaMemory::Vmm(a) => a.device(),
        }
    }
}

impl CudaImported {
    pub fn desc(&self) -> &TensorDesc {
        &self.desc
    }
    pub fn layout(&self) -> Layout {
        self.desc.layout()
    }
    pub fn tag(&self) -> u64 {
        self.tag
    }
    pub fn device(&self) -> i32 {
        self.mapping.device()
    }
    /// Device address of the storage's first byte in this process.
    pub fn storage_ptr(&self) -> u64 {
        self.mapping.base() + self.desc.storage.base_offset
    }
    /// Device address of element 0 of the view.
    pub fn data_ptr(&self) -> u64 {
        let l = self.layout();
        self.storage_ptr() + (l.storage_offset as u64 * l.dtype.size() as u64).min(self.desc.storage.nbytes)
    }
    pub fn storage_nbytes(&self) -> u64 {
        self.desc.storage.nbytes
    }
    /// Make `stream` wait for the producer's last write (its IPC event): stream order,
    /// never a device-wide synchronize. Call before the first use on `stream`. The first
    /// call waits on the producer's event and hands its slot back; a later call (another
    /// stream) waits on a private event recorded on the first stream after its wait.
    pub fn wait_on(&self, stream: usize) -> Result<()> {
        self.claim.wait_on(stream)
    }
    /// Give the lease back once everything enqueued on `stream` so far has completed —
    /// without blocking: a mark is recorded on the stream and the connection's reaper
    /// releases the lease (and closes the mapping if unused) when the mark is reached.
    pub fn release_after(self, stream: usize) -> Result<()> {
        let mark = crate::cuda::event::StreamMark::record(self.device(), stream)?;
        let inner = self.held.inner.clone();
        let mut deferred = inner.deferred.lock();
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

    /// Give the lease back (after the work reading it has been enqueued and, if the
    /// producer may reuse the memory at once, completed).
    pub fn release(mut self) -> Result<()> {
        self.held.release()
    }

    /// Release the lease now but keep the mapping until `mark` is reached: GPU work still
    /// reading it must not find it unmapped (a fault there poisons this process's context).
    fn linger(self, mark: crate::cuda::event::StreamMark) {
        let CudaImported { held, mapping, claim, .. } = self;
        drop(claim);
        drop(held);
        LINGERING.lock().push((mark, mapping));
    }
}

/// Mappings of released CUDA imports whose readers on the GPU had not finished when their
/// connection closed: unmapped by [`collect_lingering`] once their marks are reached (at
/// every reaper pass of any connection of this process).
static LINGERING: Mutex<Vec<(crate::cuda::event::StreamMark, CudaMemory)>> = Mutex::new(Vec::new());

/// Unmap lingering mappings whose marks were reached (or can no longer be queried).
/// True when none lingers any more.
fn collect_lingering() -> bool {
    let done: Vec<_> = {
        let mut l = LINGERING.lock();
        if l.is_empty() {
            return true;
        }
        let (done, wait): (Vec<_>, Vec<_>) = l.drain(..).partition(|(m, _)| m.done().unwrap_or(true));
        *l = wait;
        done
    };
    // Unmapped outside the lock (driver calls).
    drop(done);
    LINGERING.lock().is_empty()
}
