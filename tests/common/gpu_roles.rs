//! The child-process roles and shared steps of the CUDA test binaries
//! (`tests/cuda_sim.rs`, `tests/cuda_sim_ring.rs`): an importer that reads, flips a byte
//! and releases after its stream; a GPU-ring receiver (optionally slow, busy or dying); a
//! producer that dies mid-ring-message; a producer whose driver fails on purpose.

#![allow(dead_code)]

use super::gpu::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tensorwire::cuda::driver::DeviceBuffer;
use tensorwire::cuda::CudaStream;
use tensorwire::{DType, ExportOptions, Incoming, Layout, Peer};

pub const QUERY: u64 = u64::MAX;
pub const DONE: u64 = u64::MAX - 1;
pub const HOLD: u64 = u64::MAX - 2;
pub const DROP_HELD: u64 = u64::MAX - 3;
pub const RING: u64 = u64::MAX - 4;
pub const READY: u64 = u64::MAX - 5;
pub const KEEP_WARM: u64 = u64::MAX - 6;
pub const RING_DIE: u64 = u64::MAX - 7;
/// `[RING_STREAM, n, every]`: take `n` ring messages, discarding each whose tag is a
/// multiple of `every`, copying out the rest; then report `[kept, discarded, hash]`.
pub const RING_STREAM: u64 = u64::MAX - 8;

/// Body of each CUDA test binary's ignored `child_entry` test: play the role this process
/// was spawned with (if it was).
pub fn child_main() {
    let Some((role, peer)) = child_peer() else { return };
    match role.as_str() {
        "import" => child_import(&peer),
        "ring_recv" => child_ring_recv(&peer),
        "ring_produce_die" => child_ring_produce_die(&peer),
        "fault_export" => child_fault_export(&peer),
        other => panic!("unknown role {other}"),
    }
}

/// Import CUDA tensors: wait on our stream, read the storage, flip the view's first byte
/// (zero-copy proof), release after the stream, reply what was read.
pub fn child_import(peer: &Peer) {
    let cs = Stream::new();
    let mut hold = false;
    let mut held = Vec::new();
    loop {
        match peer.recv(T) {
            Ok(Incoming::CudaTensor(t)) => {
                t.wait_on(cs.0).unwrap();
                let n = t.storage_nbytes() as usize;
                let bytes = dtoh_on(t.storage_ptr(), n, cs.0);
                let l = t.layout();
                let rel = (t.data_ptr() - t.storage_ptr()) as usize;
                if l.numel() > 0 {
                    htod_async(t.data_ptr(), &[!bytes[rel]], cs.0);
                }
                let mut reply = vec![t.tag(), fnv1a(&bytes), l.dtype as u64, l.sizes().len() as u64];
                reply.extend(l.sizes().iter().map(|&s| s as u64));
                reply.extend(l.strides().iter().map(|&s| s as u64));
                reply.push(l.storage_offset as u64);
                if hold {
                    held.push(t);
                } else {
                    t.release_after(cs.0).unwrap();
                }
                peer.send_message(&words(&reply), &[]).unwrap();
            }
            Ok(Incoming::Message { payload, .. }) => match unwords(&payload)[0] {
                QUERY => {
                    // Flush deferred releases: the stream's marks are reached, the reaper
                    // gives the leases back and closes unused handles.
                    sync(cs.0);
                    let cache = tensorwire::cuda::ipc::cache();
                    let deadline = Instant::now() + Duration::from_secs(10);
                    while cache.stats().1 > held.len() && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    let (open, in_use) = cache.stats();
                    let s = sim_stats().unwrap_or_default();
                    let sim = u64::from(sim_stats().is_some());
                    peer.send_message(
                        &words(&[cache.opens(), open as u64, in_use as u64, sim, s.ipc_open_handles, s.vmm_mappings, s.faults_injected]),
                        &[],
                    )
                    .unwrap();
                }
                HOLD => hold = true,
                KEEP_WARM => tensorwire::cuda::ipc::cache().set_keep_warm(unwords(&payload)[1] as usize),
                DROP_HELD => {
                    hold = false;
                    for t in held.drain(..) {
                        t.release_after(cs.0).unwrap();
                    }
                }
                _ => return,
            },
            Ok(other) => panic!("unexpected {other:?}"),
            Err(e) if e.is_peer_gone() => return,
            Err(e) => peer.send_message(format!("ERR:{e}").as_bytes(), &[]).unwrap(),
        }
    }
}

/// Receive GPU-ring messages on request: [RING, n, sleep ms, busy ops] → n messages, each
/// copied out on our stream and answered with [tag, fnv, bytes, dtype]. Before each, sleep
/// (a slow consumer) and queue `busy` memsets on the stream (a busy GPU stream: the
/// copies out of the ring run well after the slots were freed on the CPU side).
pub fn child_ring_recv(peer: &Peer) {
    let cs = Stream::new();
    let scratch = DeviceBuffer::alloc(0, 4096).unwrap();
    loop {
        let w = unwords(&recv_msg(peer));
        if w[0] == RING_DIE {
            // Take the first part of a message, then die without copying it out.
            let _ = peer.cuda_ring_recv(T).unwrap();
            std::process::exit(0);
        }
        if w[0] == RING_STREAM {
            ring_stream(peer, &cs, w[1], w[2]);
            continue;
        }
        if w[0] != RING {
            return;
        }
        let (sleep_ms, busy) = (w.get(2).copied().unwrap_or(0), w.get(3).copied().unwrap_or(0));
        for _ in 0..w[1] {
            std::thread::sleep(Duration::from_millis(sleep_ms));
            let (tag, desc) = peer.cuda_ring_recv(T).unwrap();
            for _ in 0..busy {
                memset_async(scratch.ptr(), 0, 4096, cs.0);
            }
            let n = desc.storage.nbytes;
            let dst = DeviceBuffer::alloc(0, n.max(1)).unwrap();
            peer.cuda_ring_recv_finish(dst.ptr(), n.max(1), cs.0, T).unwrap();
            let bytes = dtoh_on(dst.ptr(), n as usize, cs.0);
            peer.send_message(&words(&[tag, fnv1a(&bytes), n, desc.layout().dtype as u64]), &[]).unwrap();
        }
    }
}

/// Take `n` ring messages without a reply per message: every `every`-th tag is discarded
/// (never copied out), the others copied out and folded into one hash in arrival order.
fn ring_stream(peer: &Peer, cs: &Stream, n: u64, every: u64) {
    let dst = DeviceBuffer::alloc(0, 64 << 10).unwrap();
    let (mut kept, mut discarded, mut hash) = (0u64, 0u64, 0u64);
    for _ in 0..n {
        let (tag, desc) = peer.cuda_ring_recv(T).unwrap();
        if tag % every == 0 {
            peer.cuda_ring_discard(T).unwrap();
            discarded += 1;
            continue;
        }
        let len = desc.storage.nbytes;
        peer.cuda_ring_recv_finish(dst.ptr(), 64 << 10, cs.0, T).unwrap();
        let bytes = dtoh_on(dst.ptr(), len as usize, cs.0);
        hash = hash.rotate_left(5) ^ fnv1a(&bytes) ^ tag;
        kept += 1;
    }
    peer.send_message(&words(&[kept, discarded, hash]), &[]).unwrap();
}

/// Offer a 2-slot ring, say READY, then send an 8-chunk message (blocks after two chunks
/// until the consumer frees slots) and wait to be killed.
pub fn child_ring_produce_die(peer: &Peer) {
    let slot = 64 << 10;
    let buf = DeviceBuffer::alloc(0, 8 * slot).unwrap();
    htod(buf.ptr(), &pattern(9, 8 * slot as usize));
    peer.send_message(&words(&[READY]), &[]).unwrap();
    let l = Layout::contiguous(DType::UInt8, &[8 * slot as i64]).unwrap();
    let _ = peer.cuda_ring_send(buf.ptr(), &l, CudaStream::LEGACY, 1, T);
    std::thread::sleep(Duration::from_secs(60));
}

/// A producer whose driver fails on purpose (SIMCUDA_FAIL="cuEventRecord:2,
/// cuMemcpyDtoDAsync_v2:2"): export 1 works, export 2 fails at its event record, then ring
/// send 1 works, ring send 2 fails at its copy, ring send 3 works, then 40 more exports
/// (the event pool wraps: a failed export must have given its slot back). Reports
/// [export error named, ring error named, owners dropped, live leases, faults injected].
pub fn child_fault_export(peer: &Peer) {
    let dropped = Arc::new(AtomicUsize::new(0));
    let buf = DeviceBuffer::alloc(0, 8192).unwrap();
    let l = Layout::contiguous(DType::UInt8, &[4096]).unwrap();
    let export = |tag: u64| {
        htod(buf.ptr(), &pattern(tag as u8, 4096));
        peer.export_cuda(buf.ptr(), 4096, &l, CudaStream::LEGACY, owner(&dropped), ExportOptions { tag, window: None })
    };
    let wait_lease = || {
        let deadline = Instant::now() + Duration::from_secs(20);
        while peer.reap_now().live_leases > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    export(1).unwrap();
    wait_lease();
    let e = export(2).unwrap_err().to_string();
    let export_named = (e.contains("cuEventRecord") || e.contains("cuStreamWriteValue32")) && e.contains("CUDA_ERROR_UNKNOWN");
    let failed_owner_dropped = dropped.load(Ordering::SeqCst) == 2;
    peer.send_message(&words(&[RING, 2]), &[]).unwrap();
    let rl = Layout::contiguous(DType::UInt8, &[8192]).unwrap();
    htod(buf.ptr(), &pattern(51, 8192));
    peer.cuda_ring_send(buf.ptr(), &rl, CudaStream::LEGACY, 51, T).unwrap();
    let e = peer.cuda_ring_send(buf.ptr(), &rl, CudaStream::LEGACY, 52, T).unwrap_err().to_string();
    let ring_named = e.contains("cuMemcpyDtoDAsync") && e.contains("CUDA_ERROR_UNKNOWN");
    htod(buf.ptr(), &pattern(53, 8192));
    peer.cuda_ring_send(buf.ptr(), &rl, CudaStream::LEGACY, 53, T).unwrap();
    for tag in 100..140 {
        export(tag).unwrap();
        wait_lease();
    }
    wait_lease();
    let s = sim_stats().unwrap_or_default();
    let report = [
        u64::from(export_named && failed_owner_dropped),
        u64::from(ring_named),
        dropped.load(Ordering::SeqCst) as u64,
        peer.reap_now().live_leases,
        s.faults_injected,
    ];
    peer.send_message(&words(&[READY]), &[]).unwrap();
    peer.send_message(&words(&report), &[]).unwrap();
    let _ = peer.recv(T);
}

pub struct Flag(pub Arc<AtomicUsize>);
impl Drop for Flag {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

pub fn owner(c: &Arc<AtomicUsize>) -> Box<Flag> {
    Box::new(Flag(c.clone()))
}

pub fn query(peer: &Peer) -> Vec<u64> {
    peer.send_message(&words(&[QUERY]), &[]).unwrap();
    unwords(&recv_msg(peer))
}

pub fn finish(mut child: std::process::Child, peer: Peer) {
    peer.send_message(&words(&[DONE]), &[]).unwrap();
    let st = child.wait().unwrap();
    assert!(st.success(), "child failed: {st:?}");
}

pub fn leases_back(peer: &Peer) {
    wait_until("the consumer's leases to come back", Duration::from_secs(20), || peer.reap_now().live_leases == 0);
}

