//! `Peer`: one end of a tensorwire connection. Exports tensor views under leases,
//! imports the peer's, and carries small user messages with fds.
//!
//! This file holds the `Peer` handle, its shared state (`Inner`: the connection and one
//! part per concern), setup (handshake) and teardown; the rest is one job per file, each
//! concern's state with its code: `config` (limits, export options), `export` (`Exports`;
//! CPU and CUDA exports), `fd_slots` (what the peer keeps in each fd slot), `import`
//! (`Imports`; receive and the import paths), `held_lease` (the consumer's side of a
//! lease), `cuda_import` (CUDA imports and their memory), `reaper` (`ReaperState`; lease
//! reaping and lingering CUDA mappings), `ring` (`Rings`; ring pass-throughs) and
//! `forward` (sending an import on as the same memory). What travels on the wire is
//! `crate::wire::messages` (built and split in `crate::payload`); `SharedTensor` lives in `crate::shared_tensor`.

use crate::connection::{Connection, Listener};
use crate::waiting::cpu::MessageBells;
use crate::segment::SharedRef;
use crate::error::{Error, Result};
use crate::lease::{Exporter, ImportTable, LeaseStats, MESSAGE_LINE_OFFSET};
use crate::ring::{RingReceiver, RingSender, RingShared};
use crate::wait::Wait;
use parking_lot::Mutex;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

mod config;
mod cuda_import;
mod export;
mod fd_slots;
mod forward;
mod held_lease;
mod import;
pub mod options;
mod reaper;
mod ring;

pub use crate::shared_tensor::SharedTensor;
pub use config::{ExportOptions, PeerConfig};
pub use cuda_import::CudaImported;
pub(crate) use export::CpuStorage;
pub use import::{Imported, Incoming};
pub use crate::payload::{setup_payload, tensor_payload};
pub use crate::wire::messages::{
    KIND_CUDA_EVENTS, KIND_CUDA_RING, KIND_CUDA_SIGNALS, KIND_FORGET, KIND_TABLE, KIND_TENSOR, KIND_USER, NO_FD_SLOT,
    SEGMENT_FD_SLOTS, SETUP_HAS_CUDA_RING, SETUP_WANTS_EVENTS, TENSOR_PAYLOAD,
};
use reaper::collect_lingering;
use crate::wire::messages::SETUP_FLAGS;

/// State shared by a `Peer`, its reaper thread and its imports (which outlive the handle):
/// the connection, and one part per concern, each in its own file.
struct Inner {
    conn: Connection,
    cfg: PeerConfig,
    /// Set once by `Peer::drop` (Release); the reaper and imports read it (Acquire) so
    /// they see the shutdown and stop using the connection. Nothing else is published
    /// through it.
    stop: AtomicBool,
    /// The peer process, for waits on its CUDA work that must end when it dies (they may
    /// outlive this connection: a stream's wait is watched process-wide).
    peer_watch: Arc<crate::cuda::order::PeerWatch>,
    /// What we export to the peer (`export.rs`).
    exports: export::Exports,
    /// What we import from the peer (`import.rs`).
    imports: import::Imports,
    /// The reaper thread's wake-ups and passes (`reaper.rs`).
    reaper: reaper::ReaperState,
    /// The CPU rings and GPU bounce rings (`ring.rs`).
    rings: ring::Rings,
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
    pub fn new(mut conn: Connection, mut cfg: PeerConfig) -> Result<Peer> {
        if !conn.shares_pid_namespace() && cfg.cuda_wait == crate::cuda::CudaWait::Event {
            // IPC events do not cross a pid namespace (a sandboxed worker's): the stream
            // waits on the producer's words instead, which are shared by fd.
            cfg.cuda_wait = crate::cuda::CudaWait::Stream;
        }
        conn.set_recv_spin(cfg.recv_spin);
        conn.set_send_timeout(cfg.send_timeout);
        let exporter = Exporter::new(cfg.max_leases, cfg.max_lease_bytes)?;
        let export_table = exporter.table().clone();
        let tx_ring = if cfg.ring_bytes > 0 { Some(RingShared::create(cfg.ring_bytes)?) } else { None };
        let peer_watch = Arc::new(crate::cuda::order::PeerWatch::new(conn.peer_pid()));
        let cuda_tx = cfg
            .cuda_ring
            .map(|r| crate::cuda::ring::CudaRingSender::create(r, cfg.cuda_wait, cfg.cuda_wait_timeout, peer_watch.clone()))
            .transpose()?;
        let flags = if cuda_tx.is_some() { SETUP_HAS_CUDA_RING } else { 0 }
            | if cfg.cuda_wait == crate::cuda::CudaWait::Event { SETUP_WANTS_EVENTS } else { 0 };
        let setup = setup_payload(exporter.capacity(), cfg.ring_bytes as u64, flags);
        let mut fds = vec![export_table.fd()];
        if let Some(r) = &tx_ring {
            fds.push(r.segment().fd());
        }
        conn.send(KIND_TABLE, &setup, &fds)?;
        if let Some(tx) = &cuda_tx {
            let (payload, fds) = tx.setup();
            conn.send(KIND_CUDA_RING, &payload, &fds)?;
        }
        let msg = conn.recv(cfg.handshake_timeout)?;
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
        if flags & !SETUP_FLAGS != 0 {
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
        let cuda_rx = if flags & SETUP_HAS_CUDA_RING != 0 { Some(Self::open_cuda_ring(&conn, &cfg, &peer_watch)?) } else { None };
        // From here on a receive sleeps on the message doorbell in the peer's table, and
        // each send rings ours (`waiting::cpu::MessageBells` says why not the socket).
        // SAFETY: a `MessageLine` is atomics only; the offset is the table layout's.
        conn.set_message_bells(unsafe {
            MessageBells {
                ours: SharedRef::new(export_table.clone(), MESSAGE_LINE_OFFSET),
                theirs: SharedRef::new(import.segment().clone(), MESSAGE_LINE_OFFSET),
            }
        });
        let max_ring_message = cfg.max_ring_message;
        let inner = Arc::new(Inner {
            conn,
            cfg,
            stop: AtomicBool::new(false),
            peer_watch,
            exports: export::Exports::new(exporter, export_table, flags & SETUP_WANTS_EVENTS != 0),
            imports: import::Imports::new(import),
            reaper: reaper::ReaperState::default(),
            rings: ring::Rings {
                tx: tx_ring.map(|r| Mutex::new(RingSender::new(r))),
                rx: rx_ring.map(|r| RingReceiver::new(r, max_ring_message)),
                cuda_tx: cuda_tx.map(Mutex::new),
                cuda_rx,
            },
        });
        let r = inner.clone();
        let reaper = std::thread::Builder::new()
            .name("tensorwire-reaper".into())
            .spawn(move || reaper::reaper(r))
            .map_err(|e| Error::io("spawning the lease reaper thread", e))?;
        Ok(Peer { inner, reaper: Some(reaper) })
    }

    /// Receive the peer's GPU ring setup and open it. A malformed setup fails the
    /// connection; a ring this side cannot open (no CUDA here) is refused in its control
    /// segment, so the producer's sends fail with a clear error, and remembered for ours.
    fn open_cuda_ring(conn: &Connection, cfg: &PeerConfig, peer: &Arc<crate::cuda::order::PeerWatch>) -> Result<ring::PeerCudaRing> {
        use crate::cuda::ring::{CudaRingReceiver, RingSetup};
        let msg = conn.recv(cfg.handshake_timeout)?;
        if msg.kind != KIND_CUDA_RING || !(2..=3).contains(&msg.fds.len()) {
            return Err(Error::Protocol(format!(
                "expected the peer's GPU ring setup (kind {KIND_CUDA_RING}, 2 or 3 fds), got kind {} with {} fds",
                msg.kind,
                msg.fds.len()
            )));
        }
        let setup = RingSetup::decode(&msg.payload)?;
        setup.check_fds(msg.fds.len())?;
        let mut fds = msg.fds.into_iter();
        let ctrl = CudaRingReceiver::map_control(&setup, fds.next().expect("checked"))?;
        let desc_ring = fds.next().expect("checked");
        let words = fds.next();
        let opened = CudaRingReceiver::open(
            setup,
            ctrl.clone(),
            desc_ring,
            words,
            cfg.max_peer_ring_bytes,
            cfg.max_ring_message,
            cfg.cuda_wait,
            cfg.cuda_wait_timeout,
            peer.clone(),
        );
        match opened {
            Ok(rx) => Ok(ring::PeerCudaRing::Open(rx)),
            Err(e) => {
                CudaRingReceiver::refuse(&ctrl);
                Ok(ring::PeerCudaRing::Refused(e))
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

    /// Accept one connection from `listener`, waiting for it as `wait` says (its setup
    /// then waits at most `cfg.handshake_timeout` per step).
    pub fn accept(listener: &Listener, wait: impl Into<Wait>, cfg: PeerConfig) -> Result<Peer> {
        Self::check_cuda_ring(&cfg)?;
        let conn = listener.accept(wait, cfg.handshake_timeout)?;
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

    /// Counters of what this side exported to the peer.
    pub fn export_stats(&self) -> LeaseStats {
        self.inner.exports.exporter.lock().stats()
    }

    /// Run one reaper pass now (releases, windows, peer death) instead of waiting for the
    /// background reaper.
    pub fn reap_now(&self) -> LeaseStats {
        self.inner.reap_once(true);
        self.export_stats()
    }

    /// Number of the peer's segments mapped here.
    pub fn imported_segments(&self) -> usize {
        self.inner.imports.cache.lock().len()
    }

    /// For a layer that also talks to the peer on a channel of its own (an RPC socket):
    /// after it writes there, store the CPU this thread runs on where the peer's waits
    /// look, as each of the transport's own sends does. Cheap: one `sched_getcpu` (vDSO)
    /// and, only when the CPU changed, one store.
    pub fn note_send_cpu(&self) {
        self.inner.conn.note_send_cpu();
    }

    /// For the same layer, before it waits for the peer on its own channel: if the peer
    /// last sent (or noted, [`Peer::note_send_cpu`]) from the CPU this thread runs on,
    /// move this thread to another CPU it may run on, at most once per 2 ms (its affinity
    /// stays as it was). Returns true when the two share this CPU for good (this thread
    /// may run on it only): the wait should then sleep at once, not spin or yield.
    ///
    /// Why: two processes handing messages back and forth on one core stay there (the
    /// scheduler places a woken thread next to its waker), and each hand-off then costs a
    /// context switch instead of a spin on each side (`docs/DESIGN.md`, "Two processes
    /// on one core").
    pub fn move_off_peer_cpu(&self) -> bool {
        self.inner.conn.shares_core_with_peer()
    }

    /// The CPU the peer last sent from (or noted), as it said: a hint (it may have moved
    /// since, or lie). `None` before its first send and where its kernel could not say.
    pub fn peer_cpu(&self) -> Option<u32> {
        self.inner.conn.peer_sender_cpu()
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Some(tx) = &self.inner.rings.cuda_tx {
            // The peer may still be copying out of our arena: let it finish (bounded).
            let conn = &self.inner.conn;
            tx.lock().drain(Duration::from_secs(1), &|| conn.is_peer_gone());
        }
        self.inner.stop.store(true, Ordering::Release);
        {
            let _g = self.inner.reaper.lock.lock();
            self.inner.reaper.wake.notify_all();
        }
        if let Some(t) = self.reaper.take() {
            let _ = t.join();
        }
        // The connection ends with this handle: the peer sees EOF now even while our
        // imports (which keep `inner` alive) are still held.
        // SAFETY: shutdown on our own open socket; it does not close the fd.
        unsafe { libc::shutdown(std::os::fd::AsRawFd::as_raw_fd(&self.inner.conn.socket()), libc::SHUT_RDWR) };
        self.inner.reap_once(true);
        self.inner.imports.cache.lock().clear();
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
