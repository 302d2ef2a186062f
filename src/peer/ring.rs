//! Pass-throughs to the connection's CPU rings and GPU bounce rings.

use crate::cuda::{CudaStream, DevicePtr};
use crate::desc::{Layout, TensorDesc};
use crate::error::{Error, Result};
use crate::ring::{RingItem, RingMessage};
use crate::wait::Wait;
use super::{Peer, PeerCudaRing};

// Every wait here spins `PeerConfig::ring_spin` polls before it sleeps (none for
// `Wait::Never`).
impl Peer {
    fn no_ring(side: &str) -> Error {
        Error::InvalidArgument(format!("this connection has no ring to {side} (PeerConfig::ring_bytes was 0)"))
    }

    /// Copy `items` (bytes or tensor views, packed contiguous) through this side's ring:
    /// one publish and one wake-up for the batch. Waits for space as `wait` says.
    pub fn ring_send(&self, items: &[RingItem<'_>], wait: impl Into<Wait>) -> Result<()> {
        let tx = self.inner.ring_tx.as_ref().ok_or_else(|| Self::no_ring("send through"))?;
        let conn = &self.inner.conn;
        tx.lock().send_many(items, wait, self.inner.cfg.ring_spin, &|| conn.is_peer_gone())
    }

    /// Receive the next ring message as a private copy.
    pub fn ring_recv(&self, wait: impl Into<Wait>) -> Result<RingMessage> {
        self.ring_recv_with(false, wait)
    }

    /// Receive the next ring message; with `borrow`, a message that fits one record stays
    /// in the ring until the returned message is dropped (zero copies on receive).
    pub fn ring_recv_with(&self, borrow: bool, wait: impl Into<Wait>) -> Result<RingMessage> {
        let rx = self.inner.ring_rx.as_ref().ok_or_else(|| Self::no_ring("receive from"))?;
        let conn = &self.inner.conn;
        rx.recv(borrow, wait, self.inner.cfg.ring_spin, &|| conn.is_peer_gone())
    }

    /// Receive the next ring message into `buf`, reusing its capacity (no allocation in
    /// steady state, also for messages larger than the ring). Returns tag and descriptor.
    pub fn ring_recv_into(&self, buf: &mut Vec<u8>, wait: impl Into<Wait>) -> Result<(u64, Option<TensorDesc>)> {
        let rx = self.inner.ring_rx.as_ref().ok_or_else(|| Self::no_ring("receive from"))?;
        let conn = &self.inner.conn;
        rx.recv_into(buf, wait, self.inner.cfg.ring_spin, &|| conn.is_peer_gone())
    }

    /// Receive up to `max` ring messages: waits for the first, takes the rest that are
    /// already there.
    pub fn ring_recv_many(&self, max: usize, borrow: bool, wait: impl Into<Wait>) -> Result<Vec<RingMessage>> {
        let rx = self.inner.ring_rx.as_ref().ok_or_else(|| Self::no_ring("receive from"))?;
        let conn = &self.inner.conn;
        rx.recv_many(max.max(1), borrow, wait, self.inner.cfg.ring_spin, &|| conn.is_peer_gone())
    }

    fn cuda_ring_rx(&self) -> Result<&crate::cuda::ring::CudaRingReceiver> {
        match &self.inner.cuda_ring_rx {
            Some(PeerCudaRing::Open(rx)) => Ok(rx),
            Some(PeerCudaRing::Refused(why)) => Err(Error::CudaUnavailable(format!("the peer's GPU ring could not be opened here: {why}"))),
            None => Err(Error::InvalidArgument(
                "the peer offered no GPU ring (its PeerConfig::cuda_ring was None)".into(),
            )),
        }
    }

    /// Copy a CUDA tensor through this side's GPU bounce ring: `layout` (contiguous)
    /// describes `layout.packed_bytes()` bytes at device address `src`; the copies are
    /// enqueued on `stream` after the work already there (no synchronize). Waits for free
    /// slots as `wait` says.
    pub fn cuda_ring_send(&self, src: DevicePtr, layout: &Layout, stream: CudaStream, tag: u64, wait: impl Into<Wait>) -> Result<()> {
        let tx = self.inner.cuda_ring_tx.as_ref().ok_or_else(|| {
            Error::InvalidArgument("this connection has no GPU ring to send through (PeerConfig::cuda_ring was None)".into())
        })?;
        let conn = &self.inner.conn;
        tx.lock().send(src, layout, stream, tag, wait.into(), self.inner.cfg.ring_spin, &|| conn.is_peer_gone())
    }

    /// Wait for the next message in the peer's GPU ring: its tag and descriptor (a
    /// contiguous layout on the ring's device). Then `cuda_ring_recv_finish` (copy it
    /// out) or `cuda_ring_discard`. Calling again first returns the same message.
    pub fn cuda_ring_recv(&self, wait: impl Into<Wait>) -> Result<(u64, TensorDesc)> {
        let conn = &self.inner.conn;
        self.cuda_ring_rx()?.begin(wait.into(), self.inner.cfg.ring_spin, &|| conn.is_peer_gone())
    }

    /// Copy the message `cuda_ring_recv` returned into `capacity` bytes of device memory
    /// at `dst`, on `stream` (ordered after the producer's writes; no synchronize), and
    /// free its slots. Waits for its later chunks as `wait` says.
    pub fn cuda_ring_recv_finish(&self, dst: DevicePtr, capacity: u64, stream: CudaStream, wait: impl Into<Wait>) -> Result<()> {
        let conn = &self.inner.conn;
        self.cuda_ring_rx()?.finish(dst, capacity, stream, wait.into(), self.inner.cfg.ring_spin, &|| conn.is_peer_gone())
    }

    /// Drop the message `cuda_ring_recv` returned without copying it.
    pub fn cuda_ring_discard(&self, wait: impl Into<Wait>) -> Result<()> {
        let conn = &self.inner.conn;
        self.cuda_ring_rx()?.discard(wait.into(), self.inner.cfg.ring_spin, &|| conn.is_peer_gone())
    }
}
