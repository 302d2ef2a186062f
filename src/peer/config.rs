//! Per-connection limits and defaults (`PeerConfig`) and per-export options.

use crate::wait::Wait;
use std::time::Duration;

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
    /// How long connection setup may wait for the peer (each step: its hello, its setup
    /// messages), and a CUDA export for a free event slot.
    pub handshake_timeout: Wait,
    /// How long a send (an export, a user message) may wait for room in the peer's
    /// socket buffer; a peer that stops reading then gets `Timeout`, and the export's
    /// lease is taken back.
    pub send_timeout: Wait,
    /// Data area of the ring this side sends through (a power of two ≥ 4 KiB; 0: none).
    pub ring_bytes: usize,
    /// Largest ring accepted from the peer.
    pub max_peer_ring_bytes: usize,
    /// Largest message reassembled from ring chunks (bounds what a peer can make us
    /// allocate).
    pub max_ring_message: u64,
    /// Most polls before a ring wait sleeps in the futex. A cap: while the other process
    /// seems to share our core, where the spin would only keep it from ringing, a wait
    /// spins less or not at all (see `spin_policy`). 0: sleep at once.
    pub ring_spin: u32,
    /// While leases are live, how often the reaper looks for releases. A consumer's
    /// release is a compare-and-swap in shared memory that wakes no one (a wake-up per
    /// release would cost a context switch on the producer); owners are dropped within
    /// this interval, at the producer's next export, or at once with `reap_now`.
    pub reap_interval: Duration,
    /// Most time a receive polls the socket before sleeping (0: sleep at once). A reply
    /// within it avoids a wake-up, which on some machines costs tens of µs. A cap: while
    /// the peer seems to share our core, a receive spins less or not at all (see
    /// `spin_policy`).
    pub recv_spin: Duration,
    /// A GPU bounce ring for this side's CUDA sends (`None`: none). Creating the peer
    /// then needs a CUDA driver; the other side opens the ring at setup.
    pub cuda_ring: Option<crate::cuda::ring::CudaRingConfig>,
    /// How this side waits for the peer's CUDA work before using what it sent (imports,
    /// GPU ring slots), and how the peer's streams wait for ours (the GPU ring's slot
    /// reuse). Default `Stream`: the GPU waits on a shared sequence word, the CPU returns
    /// at once; see [`CudaWait`](crate::cuda::CudaWait) for what each costs and blocks.
    pub cuda_wait: crate::cuda::CudaWait,
    /// The longest a wait for the peer's CUDA work may take: a host wait fails with
    /// `Timeout` then; a stream's wait is ended by this side and the import reports it
    /// (`CudaImported::status`). The peer's death ends either at once.
    pub cuda_wait_timeout: Wait,
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
            handshake_timeout: Wait::For(Duration::from_secs(10)),
            send_timeout: crate::connection::DEFAULT_SEND_TIMEOUT,
            ring_bytes: 4 << 20,
            max_peer_ring_bytes: 1 << 30,
            max_ring_message: 1 << 30,
            ring_spin: 2000,
            reap_interval: Duration::from_millis(1),
            recv_spin: Duration::from_micros(50),
            cuda_ring: None,
            cuda_wait: default_cuda_wait(),
            cuda_wait_timeout: Wait::For(Duration::from_secs(30)),
        }
    }
}

/// `CudaWait::Stream`, or what `TENSORWIRE_CUDA_WAIT` names (`stream`, `host`, `event`):
/// a machine's operator (an MPS setup) or a test run can choose the policy for every
/// connection that does not set its own. An unknown name is reported once on stderr and
/// ignored.
fn default_cuda_wait() -> crate::cuda::CudaWait {
    static FROM_ENV: std::sync::OnceLock<crate::cuda::CudaWait> = std::sync::OnceLock::new();
    *FROM_ENV.get_or_init(|| match std::env::var("TENSORWIRE_CUDA_WAIT") {
        Ok(v) => v.parse().unwrap_or_else(|e| {
            eprintln!("tensorwire: TENSORWIRE_CUDA_WAIT ignored: {e}");
            crate::cuda::CudaWait::default()
        }),
        Err(_) => crate::cuda::CudaWait::default(),
    })
}

/// Per-export options.
#[derive(Debug, Clone, Copy, Default)]
pub struct ExportOptions {
    /// Opaque number delivered with the tensor (match requests to replies).
    pub tag: u64,
    /// Keeper window: the most time the peer may hold the lease.
    pub window: Option<Duration>,
}
