//! The ring's shape (`CudaRingConfig`, its limits) and the setup message that carries
//! it (`RingSetup`).

use crate::error::{Error, Result};

pub use crate::wire::cuda_ring::{MAX_SLOTS, MAX_SLOT_BYTES, MIN_SLOT_BYTES};
use crate::wire::cuda_ring::{SETUP_FIXED, SETUP_WORDS};

/// Shape of one direction's GPU ring (`PeerConfig::cuda_ring`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaRingConfig {
    /// Device the arena lives on; tensors sent through the ring must be on it.
    pub device: i32,
    /// Slots in the arena (more slots: more chunks in flight).
    pub slots: u32,
    /// Bytes per slot (a message larger than a slot goes through in chunks).
    pub slot_bytes: u64,
}

impl Default for CudaRingConfig {
    fn default() -> Self {
        CudaRingConfig { device: 0, slots: 8, slot_bytes: 4 << 20 }
    }
}

impl CudaRingConfig {
    /// Check the shape (`InvalidArgument` naming the bad field).
    pub fn check(&self) -> Result<()> {
        if self.device < 0 || self.device > 255 {
            return Err(Error::InvalidArgument(format!("GPU ring device {} out of range 0..=255", self.device)));
        }
        if self.slots == 0 || self.slots > MAX_SLOTS {
            return Err(Error::InvalidArgument(format!("GPU ring of {} slots (1..={MAX_SLOTS})", self.slots)));
        }
        if !(MIN_SLOT_BYTES..=MAX_SLOT_BYTES).contains(&self.slot_bytes) || self.slot_bytes % 256 != 0 {
            return Err(Error::InvalidArgument(format!(
                "GPU ring slot of {} bytes (a multiple of 256 in {MIN_SLOT_BYTES}..={MAX_SLOT_BYTES})",
                self.slot_bytes
            )));
        }
        Ok(())
    }

    pub(super) fn arena_bytes(&self) -> u64 {
        self.slots as u64 * self.slot_bytes
    }
}

/// What the producer sends once at setup, with two fds (control segment, descriptor ring)
/// and, where it offers them, a third: the ring's signal words (`words`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingSetup {
    pub cfg: CudaRingConfig,
    /// IPC handle of the arena allocation.
    pub arena: [u8; 64],
    /// Data bytes of the descriptor ring.
    pub desc_ring_bytes: u64,
    /// The producer offers the ring's signal words (their memfd is the third fd).
    pub words: bool,
    /// Handles of the producer's `slots` "written" events (used where words are not).
    pub written: Vec<[u8; 64]>,
}


impl RingSetup {
    pub fn encode(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(SETUP_FIXED + 64 * self.written.len());
        p.extend_from_slice(&self.cfg.device.to_le_bytes());
        p.extend_from_slice(&self.cfg.slots.to_le_bytes());
        p.extend_from_slice(&self.cfg.slot_bytes.to_le_bytes());
        p.extend_from_slice(&self.desc_ring_bytes.to_le_bytes());
        p.extend_from_slice(&self.arena);
        p.extend_from_slice(&if self.words { SETUP_WORDS } else { 0 }.to_le_bytes());
        for h in &self.written {
            p.extend_from_slice(h);
        }
        p
    }

    /// The fds its message must come with: control segment, descriptor ring, and the
    /// signal words where offered.
    pub fn check_fds(&self, fds: usize) -> Result<()> {
        let want = if self.words { 3 } else { 2 };
        if fds != want {
            return Err(Error::Protocol(format!(
                "GPU ring setup {} signal words and needs {want} fds, came with {fds}",
                if self.words { "offers" } else { "does not offer" }
            )));
        }
        Ok(())
    }

    /// Parse and check a peer's setup payload.
    pub fn decode(p: &[u8]) -> Result<RingSetup> {
        let bad = |m: String| Error::Protocol(format!("GPU ring setup: {m}"));
        if p.len() < SETUP_FIXED {
            return Err(bad(format!("{} bytes, expected at least {SETUP_FIXED}", p.len())));
        }
        let u32_at = |o: usize| u32::from_le_bytes(p[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(p[o..o + 8].try_into().expect("8 bytes"));
        let cfg = CudaRingConfig { device: u32_at(0) as i32, slots: u32_at(4), slot_bytes: u64_at(8) };
        cfg.check().map_err(|e| bad(e.to_string()))?;
        let desc_ring_bytes = u64_at(16);
        let want = SETUP_FIXED + 64 * cfg.slots as usize;
        if p.len() != want {
            return Err(bad(format!("{} bytes for {} slots, expected {want}", p.len(), cfg.slots)));
        }
        let arena = p[24..88].try_into().expect("64 bytes");
        let flags = u32_at(88);
        if flags & !SETUP_WORDS != 0 {
            return Err(bad(format!("unknown flags {flags:#x}")));
        }
        let written = p[SETUP_FIXED..].chunks_exact(64).map(|c| c.try_into().expect("64 bytes")).collect();
        Ok(RingSetup { cfg, arena, desc_ring_bytes, words: flags & SETUP_WORDS != 0, written })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::ring::test_support::*;

    #[test]
    fn setup_round_trips_and_rejects_bad_shapes() {
        let s = RingSetup { cfg: cfg(), arena: [7; 64], desc_ring_bytes: 65536, words: true, written: vec![[1; 64]; 4] };
        assert_eq!(RingSetup::decode(&s.encode()).unwrap(), s);
        let no_words = RingSetup { words: false, ..s.clone() };
        assert_eq!(RingSetup::decode(&no_words.encode()).unwrap(), no_words);
        let p = s.encode();
        let err = |p: &[u8]| RingSetup::decode(p).unwrap_err().to_string();
        let mut q = p.clone();
        q[88] = 3;
        assert!(err(&q).contains("unknown flags 0x3"));
        assert!(err(&p[..10]).contains("expected at least"));
        assert!(err(&p[..p.len() - 1]).contains("for 4 slots"));
        let mut q = p.clone();
        q[4..8].copy_from_slice(&0u32.to_le_bytes());
        assert!(err(&q).contains("0 slots"));
        let mut q = p.clone();
        q[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(err(&q).contains("slots"));
        let mut q = p.clone();
        q[8..16].copy_from_slice(&4097u64.to_le_bytes());
        assert!(err(&q).contains("slot of 4097 bytes"));
        let mut q = p;
        q[0..4].copy_from_slice(&(-1i32).to_le_bytes());
        assert!(err(&q).contains("device -1"));
    }

    #[test]
    fn config_limits() {
        assert!(cfg().check().is_ok());
        assert!(CudaRingConfig::default().check().is_ok());
        for bad in [
            CudaRingConfig { slots: 0, ..cfg() },
            CudaRingConfig { slots: MAX_SLOTS + 1, ..cfg() },
            CudaRingConfig { slot_bytes: 1000, ..cfg() },
            CudaRingConfig { slot_bytes: 4096 + 1, ..cfg() },
            CudaRingConfig { device: -1, ..cfg() },
        ] {
            assert!(matches!(bad.check(), Err(Error::InvalidArgument(_))), "{bad:?}");
        }
    }
}
