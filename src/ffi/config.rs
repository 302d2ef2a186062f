//! Connection limits in C: `tw_peer_config_t` and its defaults.

use super::{guard, ms_of_wait, put, tw_result_e, wait_ms};
use crate::peer::PeerConfig;
use std::time::Duration;

/// How a connection waits for the peer's CUDA work (`tw_peer_config_t::cuda_wait`); see
/// `docs/DESIGN.md`, "CUDA events and stream order", for what each costs and blocks.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum tw_cuda_wait_e {
    /// The GPU waits on the producer's signal word; the call returns at once (default).
    TW_CUDA_WAIT_STREAM = 0,
    /// The receiving thread waits until the producer's work completed.
    TW_CUDA_WAIT_HOST = 1,
    /// The stream waits on the producer's IPC event (`cuStreamWaitEvent`; slow without MPS).
    TW_CUDA_WAIT_EVENT = 2,
}

/// Limits for one connection (`tw_peer_config_default` fills the defaults).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tw_peer_config_t {
    /// Leases the peer may hold at once.
    pub max_leases: u32,
    /// Largest lease table accepted from the peer.
    pub max_peer_table_capacity: u32,
    /// Bytes the peer may hold under lease at once.
    pub max_lease_bytes: u64,
    /// Window for exports that name none, in ms (0: none).
    pub default_window_ms: u64,
    /// Largest control message.
    pub max_message: u64,
    /// Most peer segments mapped at once.
    pub max_import_segments: u64,
    /// How long (ms) each step of connection setup may wait for the peer (negative: no
    /// limit, 0: do not wait).
    pub handshake_timeout_ms: i64,
    /// Data area of the ring this side sends through (power of two ≥ 4096; 0: none).
    pub ring_bytes: u64,
    /// Largest ring accepted from the peer.
    pub max_peer_ring_bytes: u64,
    /// Largest message reassembled from ring chunks.
    pub max_ring_message: u64,
    /// Polls before a ring wait sleeps.
    pub ring_spin: u32,
    /// How this side waits for the peer's CUDA work (`tw_cuda_wait_e`: 0 stream, 1 host,
    /// 2 event); an unknown value fails the connection's creation with
    /// `TW_ERR_INVALID_ARGUMENT`.
    pub cuda_wait: u32,
    /// While leases are live, how often (µs) released leases are collected and their
    /// release callbacks run (also at each export and `tw_peer_reap`).
    pub reap_interval_us: u64,
    /// How long (µs) a receive polls before sleeping (0: sleep at once).
    pub recv_spin_us: u64,
    /// Device of this side's GPU bounce ring (-1: no GPU ring). With one, creating the
    /// peer needs a CUDA driver.
    pub cuda_ring_device: i32,
    /// Slots in the GPU ring's arena.
    pub cuda_ring_slots: u32,
    /// Bytes per GPU ring slot (a multiple of 256, at least 4096); larger tensors go
    /// through in chunks.
    pub cuda_ring_slot_bytes: u64,
    /// Most bytes of the peer's segments mapped here at once (only the ranges its
    /// descriptors name are mapped); over it an import fails with
    /// `TW_ERR_QUOTA_EXCEEDED`. Default: RAM plus swap.
    pub max_import_mapped_bytes: u64,
    /// How long (ms) a send may wait for room in the peer's socket buffer before it fails
    /// with `TW_ERR_TIMEOUT` (the export's lease is taken back); negative: no limit, 0: do
    /// not wait.
    pub send_timeout_ms: i64,
    /// The longest (ms) a wait for the peer's CUDA work may take (negative: no limit):
    /// a host wait then fails with `TW_ERR_TIMEOUT`; a stream's wait is ended by this
    /// side and `tw_imported_cuda_status` reports it. The peer's death ends either.
    pub cuda_wait_timeout_ms: i64,
}

impl TryFrom<&tw_peer_config_t> for PeerConfig {
    type Error = crate::Error;
    fn try_from(c: &tw_peer_config_t) -> crate::Result<Self> {
        Ok(PeerConfig {
            max_leases: c.max_leases,
            max_lease_bytes: c.max_lease_bytes,
            default_window: (c.default_window_ms > 0).then(|| Duration::from_millis(c.default_window_ms)),
            max_message: c.max_message as usize,
            max_import_segments: c.max_import_segments as usize,
            max_import_mapped_bytes: c.max_import_mapped_bytes,
            send_timeout: wait_ms(c.send_timeout_ms),
            max_peer_table_capacity: c.max_peer_table_capacity,
            handshake_timeout: wait_ms(c.handshake_timeout_ms),
            ring_bytes: c.ring_bytes as usize,
            max_peer_ring_bytes: c.max_peer_ring_bytes as usize,
            max_ring_message: c.max_ring_message,
            ring_spin: c.ring_spin,
            reap_interval: Duration::from_micros(c.reap_interval_us.max(1)),
            recv_spin: Duration::from_micros(c.recv_spin_us),
            cuda_ring: (c.cuda_ring_device >= 0).then_some(crate::cuda::ring::CudaRingConfig {
                device: c.cuda_ring_device,
                slots: c.cuda_ring_slots,
                slot_bytes: c.cuda_ring_slot_bytes,
            }),
            cuda_wait: crate::cuda::CudaWait::from_code(c.cuda_wait)?,
            cuda_wait_timeout: wait_ms(c.cuda_wait_timeout_ms),
        })
    }
}

/// Fill `out` with the default limits.
///
/// # Safety
/// `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_config_default(out: *mut tw_peer_config_t) -> tw_result_e {
    guard("tw_peer_config_default", || {
        let c = tw_peer_config_t::from_default();
        // SAFETY: writable per the contract; NULL refused.
        unsafe { put(out, c, "out") }
    })
}

impl tw_peer_config_t {
    fn from_default() -> tw_peer_config_t {
        let d = PeerConfig::default();
        tw_peer_config_t {
            max_leases: d.max_leases,
            max_peer_table_capacity: d.max_peer_table_capacity,
            max_lease_bytes: d.max_lease_bytes,
            default_window_ms: d.default_window.map_or(0, |w| w.as_millis() as u64),
            max_message: d.max_message as u64,
            max_import_segments: d.max_import_segments as u64,
            handshake_timeout_ms: ms_of_wait(d.handshake_timeout),
            ring_bytes: d.ring_bytes as u64,
            max_peer_ring_bytes: d.max_peer_ring_bytes as u64,
            max_ring_message: d.max_ring_message,
            ring_spin: d.ring_spin,
            cuda_wait: d.cuda_wait as u32,
            reap_interval_us: d.reap_interval.as_micros() as u64,
            recv_spin_us: d.recv_spin.as_micros() as u64,
            cuda_ring_device: -1,
            cuda_ring_slots: crate::cuda::ring::CudaRingConfig::default().slots,
            cuda_ring_slot_bytes: crate::cuda::ring::CudaRingConfig::default().slot_bytes,
            max_import_mapped_bytes: d.max_import_mapped_bytes,
            send_timeout_ms: ms_of_wait(d.send_timeout),
            cuda_wait_timeout_ms: ms_of_wait(d.cuda_wait_timeout),
        }
    }
}

/// # Safety
/// `cfg` NULL or readable.
pub(super) unsafe fn config(cfg: *const tw_peer_config_t) -> crate::Result<PeerConfig> {
    // SAFETY: NULL or readable per the callers' contracts.
    unsafe { cfg.as_ref() }.map_or_else(|| Ok(PeerConfig::default()), PeerConfig::try_from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::CudaWait;

    #[test]
    fn the_c_wait_policies_are_the_rust_ones() {
        for (c, rust) in [
            (tw_cuda_wait_e::TW_CUDA_WAIT_STREAM, CudaWait::Stream),
            (tw_cuda_wait_e::TW_CUDA_WAIT_HOST, CudaWait::Host),
            (tw_cuda_wait_e::TW_CUDA_WAIT_EVENT, CudaWait::Event),
        ] {
            assert_eq!(CudaWait::from_code(c as u32).unwrap(), rust);
        }
        let mut c = tw_peer_config_t::from_default();
        c.cuda_wait = 9;
        let e = PeerConfig::try_from(&c).unwrap_err();
        assert!(matches!(e, crate::error::Error::InvalidArgument(_)) && e.to_string().contains("policy 9 unknown"), "{e}");
    }
}
