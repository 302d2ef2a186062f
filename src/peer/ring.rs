//! Pass-throughs to the connection's CPU rings and GPU bounce rings.

use crate::cuda::{CudaStream, DevicePtr};
use crate::desc::{Layout, TensorDesc};
use crate::error::{Error, Result};
use crate::ring::{RingItem, RingMessage};
use crate::wait::Wait;
use super::Peer;
use crate::cuda::ring::{CudaRingReceiver, CudaRingSender};
use crate::ring::{RingReceiver, RingSender};
use parking_lot::Mutex;

/// The connection's rings: our CPU ring and GPU bounce ring (sending), the peer's
/// (receiving); each only if configured or offered.
pub(super) struct Rings {
    pub(super) tx: Option<Mutex<RingSender>>,
    pub(super) rx: Option<RingReceiver>,
    pub(super) cuda_tx: Option<Mutex<CudaRingSender>>,
    pub(super) cuda_rx: Option<PeerCudaRing>,
}

/// The peer's GPU bounce ring as this side holds it.
#[allow(clippy::large_enum_variant)] // one per connection, held for its life: boxing would only add an allocation
pub(super) enum PeerCudaRing {
    /// Opened: its messages can be received.
    Open(CudaRingReceiver),
    /// Refused here (no usable CUDA, or the ring could not be mapped): why, reported at
    /// every receive.
    Refused(Error),
}

// Every wait here spins `PeerConfig::ring_spin` polls before it sleeps (none for
// `Wait::Never`, and none while the peer runs on our CPU and we cannot move off it:
// `Connection::shares_core_with_peer`). A send notes its CPU for the peer's waits.
impl Peer {
    /// The spin for a wait on a ring now: none while the peer shares our core. A
    /// configured spin of 0 has nothing to save: no look at the peer's CPU then (the
    /// look, where the peer last ran on our CPU, takes a lock and the clock).
    fn ring_spin(&self) -> u32 {
        let spin = self.inner.cfg.ring_spin;
        if spin == 0 || self.inner.conn.shares_core_with_peer() { 0 } else { spin }
    }

    fn no_ring(side: &str) -> Error {
        Error::InvalidArgument(format!("this connection has no ring to {side} (PeerConfig::ring_bytes was 0)"))
    }

    /// Copy `items` (bytes or tensor views, packed contiguous) through this side's ring:
    /// one publish and one wake-up for the batch. Waits for space as `wait` says.
    pub fn ring_send(&self, items: &[RingItem<'_>], wait: impl Into<Wait>) -> Result<()> {
        let tx = self.inner.rings.tx.as_ref().ok_or_else(|| Self::no_ring("send through"))?;
        let conn = &self.inner.conn;
        let sent = tx.lock().send_many(items, wait, self.ring_spin(), &|| conn.is_peer_gone());
        conn.note_send_cpu();
        sent
    }

    /// Receive the next ring message as a private copy.
    pub fn ring_recv(&self, wait: impl Into<Wait>) -> Result<RingMessage> {
        self.ring_recv_with(false, wait)
    }

    /// Receive the next ring message; with `borrow`, a message that fits one record stays
    /// in the ring until the returned message is dropped (zero copies on receive).
    pub fn ring_recv_with(&self, borrow: bool, wait: impl Into<Wait>) -> Result<RingMessage> {
        let rx = self.inner.rings.rx.as_ref().ok_or_else(|| Self::no_ring("receive from"))?;
        let conn = &self.inner.conn;
        rx.recv(borrow, wait, self.ring_spin(), &|| conn.is_peer_gone())
    }

    /// Receive the next ring message into `buf`, reusing its capacity (no allocation in
    /// steady state, also for messages larger than the ring). Returns tag and descriptor.
    pub fn ring_recv_into(&self, buf: &mut Vec<u8>, wait: impl Into<Wait>) -> Result<(u64, Option<TensorDesc>)> {
        let rx = self.inner.rings.rx.as_ref().ok_or_else(|| Self::no_ring("receive from"))?;
        let conn = &self.inner.conn;
        rx.recv_into(buf, wait, self.ring_spin(), &|| conn.is_peer_gone())
    }

    /// Receive up to `max` ring messages: waits for the first, takes the rest that are
    /// already there.
    pub fn ring_recv_many(&self, max: usize, borrow: bool, wait: impl Into<Wait>) -> Result<Vec<RingMessage>> {
        let rx = self.inner.rings.rx.as_ref().ok_or_else(|| Self::no_ring("receive from"))?;
        let conn = &self.inner.conn;
        rx.recv_many(max.max(1), borrow, wait, self.ring_spin(), &|| conn.is_peer_gone())
    }

    fn cuda_ring_rx(&self) -> Result<&crate::cuda::ring::CudaRingReceiver> {
        match &self.inner.rings.cuda_rx {
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
        let tx = self.inner.rings.cuda_tx.as_ref().ok_or_else(|| {
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

    /// How this side orders its copies out of the peer's GPU ring after the peer's copies
    /// in: by the ring's signal words (`true`: both sides registered them and neither
    /// asked for `CudaWait::Event`) or by IPC events.
    pub fn cuda_ring_uses_words(&self) -> Result<bool> {
        Ok(self.cuda_ring_rx()?.uses_words())
    }

    /// Drop the message `cuda_ring_recv` returned without copying it.
    pub fn cuda_ring_discard(&self, wait: impl Into<Wait>) -> Result<()> {
        let conn = &self.inner.conn;
        self.cuda_ring_rx()?.discard(wait.into(), self.inner.cfg.ring_spin, &|| conn.is_peer_gone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peer::PeerConfig;
    use crate::ring::RingItem;
    use std::time::Duration;

    /// Pin the calling thread to `cpus`.
    fn pin(cpus: &[usize]) {
        // SAFETY: zeroed is the empty set; CPU_SET writes bits below CPU_SETSIZE (CPUs the
        // kernel named); sched_setaffinity reads a set of the size passed; 0: this thread.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            cpus.iter().for_each(|&c| libc::CPU_SET(c, &mut set));
            assert_eq!(libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set), 0, "pinning to {cpus:?}");
        }
    }

    fn cpu() -> usize {
        crate::sys::current_cpu() as usize
    }

    /// The CPUs the calling thread may run on.
    fn allowed() -> Vec<usize> {
        // SAFETY: zeroed is the empty set; the call fills a set of the size passed; 0: this
        // thread; CPU_ISSET reads bits below CPU_SETSIZE.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            assert_eq!(libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set), 0);
            (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect()
        }
    }

    /// A ring wait spins only while the peer may run elsewhere: with both sides allowed
    /// one CPU only (`taskset -c N`) it sleeps at once; with the peer's last send from
    /// another CPU it spins as configured. The peer's CPU comes from its message line,
    /// written by its ring sends as by its control messages.
    #[test]
    fn ring_waits_do_not_spin_when_both_sides_may_run_on_one_cpu_only() {
        let cfg = PeerConfig { ring_bytes: 64 << 10, ring_spin: 1234, ..PeerConfig::default() };
        let (a, b) = Peer::pair(cfg).unwrap();
        std::thread::spawn(move || {
            let here = cpu();
            pin(&[here]);
            let b = std::thread::spawn(move || {
                pin(&[here]);
                b.ring_send(&[RingItem::bytes(7, b"x")], Wait::For(Duration::from_secs(5))).unwrap();
                b
            })
            .join()
            .unwrap();
            assert_eq!(a.ring_spin(), 0, "both sides on CPU {here} only, and the wait would still spin");
            assert_eq!(a.ring_recv(Wait::For(Duration::from_secs(5))).unwrap().tag, 7);
            // The peer's last send from another CPU (as if it had moved): spin again.
            b.inner.conn.our_sender_cpu().store(here as u32 + 2, std::sync::atomic::Ordering::Relaxed);
            assert_eq!(a.ring_spin(), 1234, "the peer runs elsewhere, and the wait does not spin");
        })
        .join()
        .unwrap();
    }

    /// A layer with a channel of its own to the peer (the RPC's frames) uses the same
    /// CPU words as the transport's sends and waits: its note is what the other side reads
    /// as the peer's CPU, and a wait beside the noted CPU moves off it — or, allowed that
    /// CPU only, says so (the wait must then sleep, not spin).
    #[test]
    fn another_channel_notes_its_cpu_and_waits_move_off_the_peers() {
        let allowed = allowed();
        let (a, b) = Peer::pair(PeerConfig::default()).unwrap();
        std::thread::spawn(move || {
            let here = cpu();
            pin(&[here]);
            b.note_send_cpu();
            assert_eq!(a.peer_cpu(), Some(here as u32));
            assert!(a.move_off_peer_cpu(), "allowed CPU {here} only, beside the peer, and the wait would spin");
            assert_eq!(cpu(), here);
        })
        .join()
        .unwrap();
        if allowed.len() < 2 {
            eprintln!("one CPU allowed: the move itself is not checked");
            return;
        }
        let (a, b) = Peer::pair(PeerConfig::default()).unwrap();
        std::thread::spawn(move || {
            let here = cpu();
            pin(&[here]);
            b.note_send_cpu();
            pin(&allowed);
            assert!(!a.move_off_peer_cpu(), "allowed {allowed:?}, and the wait was told not to spin");
            assert_ne!(cpu(), here, "the wait stayed on the peer's CPU");
            // It says where it runs now, so that the peer does not follow it there.
            assert_eq!(b.peer_cpu(), Some(cpu() as u32));
        })
        .join()
        .unwrap();
    }

    /// A receive that finds its message waiting takes it without moving off the CPU the
    /// peer sent from: the move (two `sched_setaffinity` calls and a migration) is for a
    /// receive about to wait, and a thread that reads its peer's message after a
    /// notification by another channel (the RPC layer's frames) would pay it every time.
    #[test]
    fn a_receive_that_finds_its_message_waiting_does_not_move() {
        let (a, b) = Peer::pair(PeerConfig::default()).unwrap();
        std::thread::spawn(move || {
            let here = cpu();
            // One CPU: the peer's word below then names this thread's CPU for certain.
            pin(&[here]);
            b.send_message(b"x", &[]).unwrap();
            // The peer's last send from the CPU this thread runs on.
            b.inner.conn.our_sender_cpu().store(here as u32 + 1, std::sync::atomic::Ordering::Relaxed);
            assert!(matches!(a.recv(Wait::For(Duration::from_secs(5))).unwrap(), crate::Incoming::Message { .. }));
            assert!(!a.inner.conn.tried_a_move(), "a receive whose message was waiting moved off the peer's CPU");
            // Nothing waiting, and a receive that may not wait: no move either.
            b.inner.conn.our_sender_cpu().store(here as u32 + 1, std::sync::atomic::Ordering::Relaxed);
            assert!(a.recv(Wait::Never).is_err());
            assert!(!a.inner.conn.tried_a_move(), "a receive that may not wait moved off the peer's CPU");
            // Nothing waiting: the receive looks for a move before it waits.
            b.inner.conn.our_sender_cpu().store(here as u32 + 1, std::sync::atomic::Ordering::Relaxed);
            assert!(a.recv(Wait::For(Duration::from_millis(20))).is_err());
            assert!(a.inner.conn.tried_a_move(), "a receive that waited never looked for a move");
        })
        .join()
        .unwrap();
    }
}
