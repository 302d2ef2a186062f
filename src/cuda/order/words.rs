//! `SignalWords`: 32-bit sequence words in a sealed memfd that both processes map and
//! register with CUDA, so one process's stream writes a word (`cuStreamWriteValue32`) and
//! the other's stream waits for it (`cuStreamWaitValue32`) — or its host polls it.
//!
//! One word per *lane*, each on its own 64-byte line. A lane's word only moves forward in
//! cyclic order (the producer's writes to one lane land in stream order, see
//! `producer::WordLanes`), so "reached `v`" means `(int32_t)(word - v) >= 0` — the
//! driver's own GEQ, which ignores wraparound.
//!
//! The words are shared memory the peer can write at any time. A producer that writes a
//! value early only breaks the order of its own data; one that never writes is why a
//! waiting consumer can end its wait itself ([`SignalWords::force`]): a host store of the
//! awaited value releases its stream's pending wait.

use super::super::driver::{ensure_context, host_register, host_unregister, stream_wait_value32, stream_write_value32};
use super::super::types::{CudaStream, DevicePtr};
use crate::error::{Error, Result};
use crate::segment::Segment;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::AtomicU32;

pub use crate::wire::signal_words::{LANE_STRIDE, MAX_LANES};

pub use crate::signal_word::reached;

/// The words of one connection and direction, mapped here, and registered with CUDA
/// where this side's stream writes or waits on them.
pub struct SignalWords {
    seg: Segment,
    lanes: u32,
    /// Device and device address of byte 0, once registered.
    registered: Option<(i32, DevicePtr)>,
}

impl SignalWords {
    fn bytes(lanes: u32) -> usize {
        lanes as usize * LANE_STRIDE
    }

    /// New zeroed words (the producer's side).
    pub fn create(lanes: u32) -> Result<SignalWords> {
        if lanes == 0 || lanes > MAX_LANES {
            return Err(Error::InvalidArgument(format!("{lanes} signal lanes (1..={MAX_LANES})")));
        }
        Ok(SignalWords { seg: Segment::create(Self::bytes(lanes))?, lanes, registered: None })
    }

    /// Map the peer's words (exactly `lanes` words' size, up to page rounding).
    pub fn open(fd: OwnedFd, lanes: u32) -> Result<SignalWords> {
        if lanes == 0 || lanes > MAX_LANES {
            return Err(Error::Protocol(format!("the peer announced {lanes} CUDA signal lanes (1..={MAX_LANES})")));
        }
        let seg = Segment::from_fd_exact(fd, Self::bytes(lanes), "the CUDA signal words")?;
        Ok(SignalWords { seg, lanes, registered: None })
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.seg.fd()
    }
    pub fn lanes(&self) -> u32 {
        self.lanes
    }
    pub fn is_registered(&self) -> bool {
        self.registered.is_some()
    }

    /// Register the mapping with CUDA on `device` (page-locked, mapped for the device), so
    /// streams of that device can write and wait on the words.
    pub fn register(&mut self, device: i32) -> Result<()> {
        if self.registered.is_some() {
            return Ok(());
        }
        let _ctx = ensure_context(device)?;
        // SAFETY: the mapping lives as long as `self`, and `Drop` unregisters it before
        // the segment unmaps; GPU work using the device address is kept from outliving
        // `self` by its owners (`watchdog`).
        let d = unsafe { host_register(self.seg.as_ptr(), self.seg.len()) }?;
        self.registered = Some((device, d));
        Ok(())
    }

    fn check(&self, lane: u32) -> Result<()> {
        if lane >= self.lanes {
            return Err(Error::InvalidDescriptor(format!("CUDA signal lane {lane} out of range ({} lanes)", self.lanes)));
        }
        Ok(())
    }

    fn word(&self, lane: u32) -> &AtomicU32 {
        assert!(lane < self.lanes, "lane checked by the caller");
        // SAFETY: lane * LANE_STRIDE + 4 ≤ len (lane < lanes, len ≥ lanes * LANE_STRIDE),
        // 4-aligned in a page-aligned mapping; the words are only accessed atomically (the
        // GPU's accesses are whole aligned 32-bit words too).
        unsafe { &*self.seg.as_ptr().add(lane as usize * LANE_STRIDE).cast::<AtomicU32>() }
    }

    /// The lane's word now.
    pub fn load(&self, lane: u32) -> Result<u32> {
        self.check(lane)?;
        Ok(crate::signal_word::load(self.word(lane)))
    }

    /// Has lane `lane` reached `value`?
    pub fn reached(&self, lane: u32, value: u32) -> Result<bool> {
        Ok(reached(self.load(lane)?, value))
    }

    /// Raise lane `lane` to `value` from the host unless it has reached it: ends a pending
    /// stream wait for `value` on it (or any smaller value). Returns whether it wrote.
    pub fn force(&self, lane: u32, value: u32) -> Result<bool> {
        self.check(lane)?;
        Ok(crate::signal_word::raise(self.word(lane), value))
    }

    fn device_word(&self, lane: u32, what: &str) -> Result<(i32, DevicePtr)> {
        self.check(lane)?;
        let (device, base) = self.registered.ok_or_else(|| {
            Error::InvalidArgument(format!("the CUDA signal words are not registered with CUDA here: cannot {what} on a stream"))
        })?;
        Ok((device, base + lane as u64 * LANE_STRIDE as u64))
    }

    /// Enqueue on `stream` (of the registration's device) the store of `value` to lane
    /// `lane`, after the stream's work.
    pub fn stream_write(&self, lane: u32, value: u32, stream: CudaStream) -> Result<()> {
        let (device, word) = self.device_word(lane, "write")?;
        let _ctx = ensure_context(device)?;
        stream_write_value32(stream, word, value)
    }

    /// Make `stream`'s (of the registration's device) later work wait until lane `lane`
    /// reached `value`.
    pub fn stream_wait(&self, lane: u32, value: u32, stream: CudaStream) -> Result<()> {
        let (device, word) = self.device_word(lane, "wait")?;
        let _ctx = ensure_context(device)?;
        stream_wait_value32(stream, word, value)
    }
}

impl Drop for SignalWords {
    fn drop(&mut self) {
        if let Some((device, _)) = self.registered {
            let _ctx = ensure_context(device);
            // SAFETY: registered by `register`; the owners keep GPU work that uses the
            // device address from outliving this value (`watchdog`).
            let _ = unsafe { host_unregister(self.seg.as_ptr()) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn force_raises_but_never_lowers_and_lanes_are_checked() {
        let w = SignalWords::create(4).unwrap();
        assert!(w.force(1, 7).unwrap());
        assert_eq!(w.load(1).unwrap(), 7);
        assert!(!w.force(1, 3).unwrap(), "already past");
        assert_eq!(w.load(1).unwrap(), 7);
        assert_eq!(w.load(0).unwrap(), 0, "lanes are apart");
        assert!(matches!(w.load(4), Err(Error::InvalidDescriptor(_))));
        let e = w.stream_wait(0, 1, CudaStream::LEGACY).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("not registered"), "{e}");
        // The peer's side maps the same words.
        let fd = w.fd().try_clone_to_owned().unwrap();
        let peer = SignalWords::open(fd, 4).unwrap();
        assert_eq!(peer.load(1).unwrap(), 7);
        assert!(matches!(SignalWords::open(w.fd().try_clone_to_owned().unwrap(), 0), Err(Error::Protocol(_))));
    }
}
