//! tensorwire's CUDA code (IPC export/import, the handle cache, pooled IPC events, the GPU
//! ring, VMM by fd) driven through the driver API in two processes: the data is filled
//! with host-to-device copies and checked with device-to-host copies.
//!
//! Runs on simcuda (`simcuda/run.sh cargo test --test cuda_sim`: a strict simulated
//! driver whose streams run after random delays, so a missing wait shows up as wrong
//! data) and unchanged on a real GPU. Counter checks of the simulated driver
//! (`simcuda_stats`) run only where it is loaded; without any driver every test says
//! SKIPPED loudly.

mod common;

use common::gpu::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tensorwire::cuda::driver::DeviceBuffer;
use tensorwire::cuda::ring::CudaRingConfig;
use tensorwire::cuda::vmm::VmmAllocation;
use tensorwire::{DType, Error, ExportOptions, Incoming, Layout, Peer, PeerConfig};

const QUERY: u64 = u64::MAX;
const DONE: u64 = u64::MAX - 1;
const HOLD: u64 = u64::MAX - 2;
const DROP_HELD: u64 = u64::MAX - 3;
const RING: u64 = u64::MAX - 4;
const READY: u64 = u64::MAX - 5;
const KEEP_WARM: u64 = u64::MAX - 6;
const RING_DIE: u64 = u64::MAX - 7;

#[test]
#[ignore = "entry point of the child processes"]
fn child_entry() {
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
fn child_import(peer: &Peer) {
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
fn child_ring_recv(peer: &Peer) {
    let cs = Stream::new();
    let scratch = DeviceBuffer::alloc(0, 4096).unwrap();
    loop {
        let w = unwords(&recv_msg(peer));
        if w[0] == RING_DIE {
            // Take the first part of a message, then die without copying it out.
            let _ = peer.cuda_ring_recv(T).unwrap();
            std::process::exit(0);
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

/// Offer a 2-slot ring, say READY, then send an 8-chunk message (blocks after two chunks
/// until the consumer frees slots) and wait to be killed.
fn child_ring_produce_die(peer: &Peer) {
    let slot = 64 << 10;
    let buf = DeviceBuffer::alloc(0, 8 * slot).unwrap();
    htod(buf.ptr(), &pattern(8 * slot as usize, 9));
    peer.send_message(&words(&[READY]), &[]).unwrap();
    let l = Layout::contiguous(DType::UInt8, &[8 * slot as i64]).unwrap();
    let _ = peer.cuda_ring_send(buf.ptr(), &l, 0, 1, T);
    std::thread::sleep(Duration::from_secs(60));
}

/// A producer whose driver fails on purpose (SIMCUDA_FAIL="cuEventRecord:2,
/// cuMemcpyDtoDAsync_v2:2"): export 1 works, export 2 fails at its event record, then ring
/// send 1 works, ring send 2 fails at its copy, ring send 3 works, then 40 more exports
/// (the event pool wraps: a failed export must have given its slot back). Reports
/// [export error named, ring error named, owners dropped, live leases, faults injected].
fn child_fault_export(peer: &Peer) {
    let dropped = Arc::new(AtomicUsize::new(0));
    let buf = DeviceBuffer::alloc(0, 8192).unwrap();
    let l = Layout::contiguous(DType::UInt8, &[4096]).unwrap();
    let export = |tag: u64| {
        htod(buf.ptr(), &pattern(4096, tag as u8));
        peer.export_cuda(buf.ptr(), 4096, &l, 0, owner(&dropped), ExportOptions { tag, window: None })
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
    let export_named = e.contains("cuEventRecord") && e.contains("CUDA_ERROR_UNKNOWN");
    let failed_owner_dropped = dropped.load(Ordering::SeqCst) == 2;
    peer.send_message(&words(&[RING, 2]), &[]).unwrap();
    let rl = Layout::contiguous(DType::UInt8, &[8192]).unwrap();
    htod(buf.ptr(), &pattern(8192, 51));
    peer.cuda_ring_send(buf.ptr(), &rl, 0, 51, T).unwrap();
    let e = peer.cuda_ring_send(buf.ptr(), &rl, 0, 52, T).unwrap_err().to_string();
    let ring_named = e.contains("cuMemcpyDtoDAsync") && e.contains("CUDA_ERROR_UNKNOWN");
    htod(buf.ptr(), &pattern(8192, 53));
    peer.cuda_ring_send(buf.ptr(), &rl, 0, 53, T).unwrap();
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

struct Flag(Arc<AtomicUsize>);
impl Drop for Flag {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn owner(c: &Arc<AtomicUsize>) -> Box<Flag> {
    Box::new(Flag(c.clone()))
}

fn query(peer: &Peer) -> Vec<u64> {
    peer.send_message(&words(&[QUERY]), &[]).unwrap();
    unwords(&recv_msg(peer))
}

fn finish(mut child: std::process::Child, peer: Peer) {
    peer.send_message(&words(&[DONE]), &[]).unwrap();
    let st = child.wait().unwrap();
    assert!(st.success(), "child failed: {st:?}");
}

fn leases_back(peer: &Peer) {
    wait_until("the consumer's leases to come back", Duration::from_secs(20), || peer.reap_now().live_leases == 0);
}

/// Views of a 64-element storage: contiguous, transposed, strided with an offset, a
/// scalar, an empty one.
fn views(dt: DType) -> Vec<Layout> {
    vec![
        Layout::contiguous(dt, &[4, 6]).unwrap(),
        Layout::strided(dt, &[6, 4], &[1, 6], 0).unwrap(),
        Layout::strided(dt, &[3, 4], &[8, 2], 5).unwrap(),
        Layout::strided(dt, &[], &[], 7).unwrap(),
        Layout::contiguous(dt, &[0, 3]).unwrap(),
    ]
}

/// `simcuda/run.sh` sets TW_EXPECT_SIMCUDA=1: then the driver must be simcuda (a suite
/// that silently skipped, or ran on some other libcuda, must not pass).
#[test]
fn simcuda_is_loaded_when_expected() {
    if std::env::var("TW_EXPECT_SIMCUDA").as_deref() != Ok("1") {
        eprintln!("SKIPPED simcuda_is_loaded_when_expected: not run by simcuda/run.sh");
        return;
    }
    assert!(tensorwire::cuda::available(), "simcuda/run.sh ran the suite but no CUDA driver loaded");
    let s = sim_stats().expect("the loaded libcuda is not simcuda (no simcuda_stats)");
    assert_eq!(s.version, 1);
}

#[test]
fn ipc_export_of_every_dtype_and_view_arrives_exactly_and_is_zero_copy() {
    if !gpu("ipc_export_of_every_dtype_and_view_arrives_exactly_and_is_zero_copy") {
        return;
    }
    let (child, peer) = spawn("import", &[], None, PeerConfig::default());
    let dropped = Arc::new(AtomicUsize::new(0));
    let mut tag = 0;
    for dt in DType::ALL {
        let es = dt.size();
        let nbytes = 64 * es;
        let buf = DeviceBuffer::alloc(0, nbytes as u64 + 512).unwrap();
        for (vi, l) in views(dt).into_iter().enumerate() {
            // The view's storage starts 256 bytes into the allocation: the export sends
            // the handle of the base and the offset.
            let ptr = buf.ptr() + 256;
            let data = pattern(nbytes, tag as u8);
            htod(ptr, &data);
            tag += 1;
            peer.export_cuda(ptr, nbytes as u64, &l, 0, owner(&dropped), ExportOptions { tag, window: None }).unwrap();
            let r = unwords(&recv_msg(&peer));
            let nd = l.sizes().len();
            assert_eq!(r[0], tag);
            assert_eq!(r[1], fnv1a(&data), "{dt:?} view {vi}: the consumer read other bytes than the producer wrote");
            assert_eq!(r[2], dt as u64);
            assert_eq!(&r[4..4 + nd], l.sizes().iter().map(|&s| s as u64).collect::<Vec<_>>().as_slice(), "{dt:?} view {vi} sizes");
            assert_eq!(&r[4 + nd..4 + 2 * nd], l.strides().iter().map(|&s| s as u64).collect::<Vec<_>>().as_slice(), "strides");
            assert_eq!(r[4 + 2 * nd], l.storage_offset as u64, "storage offset");
            leases_back(&peer);
            if l.numel() > 0 {
                let at = l.storage_offset as usize * es;
                let now = dtoh(ptr, nbytes);
                assert_eq!(now[at], !data[at], "{dt:?} view {vi}: the consumer's write is not in the producer's memory (not zero-copy)");
            }
        }
    }
    assert_eq!(dropped.load(Ordering::SeqCst), tag as usize, "every owner released once");
    let q = query(&peer);
    assert_eq!(q[1], 0, "no IPC handle stays open in the consumer once its imports are released");
    if q[3] == 1 {
        assert_eq!(q[4], 0, "simcuda: the consumer has no IPC mapping left");
    }
    finish(child, peer);
}

#[test]
fn handle_cache_opens_each_handle_once_while_used_and_closes_it_when_unused() {
    if !gpu("handle_cache_opens_each_handle_once_while_used_and_closes_it_when_unused") {
        return;
    }
    let (child, peer) = spawn("import", &[], None, PeerConfig::default());
    let buf = DeviceBuffer::alloc(0, 4096).unwrap();
    htod(buf.ptr(), &pattern(4096, 1));
    let l = Layout::contiguous(DType::UInt8, &[1024]).unwrap();
    let send = |tag: u64, at: u64| {
        peer.export_cuda(buf.ptr() + at, 1024, &l, 0, Box::new(()), ExportOptions { tag, window: None }).unwrap();
        assert_eq!(unwords(&recv_msg(&peer))[0], tag);
    };
    // keep_warm 0: one open per message, none left open.
    for i in 0..5 {
        send(i, 0);
        leases_back(&peer);
        let q = query(&peer);
        assert_eq!((q[0], q[1]), (i + 1, 0), "message {i}: opens so far, handles open");
    }
    // keep_warm 16: the handle stays open between messages, one open for many.
    peer.send_message(&words(&[KEEP_WARM, 16]), &[]).unwrap();
    let before = query(&peer)[0];
    for i in 0..5 {
        send(20 + i, 0);
        leases_back(&peer);
    }
    let q = query(&peer);
    assert_eq!((q[0], q[1], q[2]), (before + 1, 1, 0), "keep_warm 16: one open, left open, unused");
    peer.send_message(&words(&[KEEP_WARM, 0]), &[]).unwrap();
    assert_eq!(query(&peer)[1], 0, "keep_warm back to 0 closes it");
    // While an import lives, more messages of the same allocation (other offsets) reuse it.
    peer.send_message(&words(&[HOLD]), &[]).unwrap();
    send(10, 0);
    peer.send_message(&words(&[DROP_HELD]), &[]).unwrap();
    let before = query(&peer)[0];
    peer.send_message(&words(&[HOLD]), &[]).unwrap();
    send(11, 0);
    send(12, 1024);
    send(13, 2048);
    let q = query(&peer);
    assert_eq!(q[0], before + 1, "three imports of one allocation open its handle once");
    assert_eq!((q[1], q[2]), (1, 1), "one handle open, in use");
    if q[3] == 1 {
        assert_eq!(q[4], 1, "simcuda: one IPC mapping in the consumer");
    }
    peer.send_message(&words(&[DROP_HELD]), &[]).unwrap();
    leases_back(&peer);
    let q = query(&peer);
    assert_eq!(q[1], 0, "closed once unused");
    if q[3] == 1 {
        assert_eq!(q[4], 0, "simcuda: no IPC mapping left in the consumer");
    }
    finish(child, peer);
}

/// A producer write queued on a stream right before `export_cuda` (no synchronize) is what
/// the consumer reads; the consumer's write before `release_after` is in memory before the
/// producer sees the lease back and reuses the buffer.
#[test]
fn stream_order_holds_across_processes_under_random_delays() {
    if !gpu("stream_order_holds_across_processes_under_random_delays") {
        return;
    }
    let (child, peer) = spawn("import", &[], None, PeerConfig::default());
    let n = 64 << 10;
    let buf = DeviceBuffer::alloc(0, n as u64).unwrap();
    let ps = Stream::new();
    let l = Layout::contiguous(DType::UInt8, &[n as i64]).unwrap();
    for i in 0..24u8 {
        let data = pattern(n, i);
        htod_async(buf.ptr(), &data, ps.0);
        peer.export_cuda(buf.ptr(), n as u64, &l, ps.0, Box::new(()), ExportOptions { tag: i.into(), window: None }).unwrap();
        let r = unwords(&recv_msg(&peer));
        assert_eq!(r[1], fnv1a(&data), "round {i}: the consumer read before the producer's queued write landed");
        leases_back(&peer);
        // Reuse on the producer's stream: must see the consumer's write.
        let now = dtoh_on(buf.ptr(), 1, ps.0);
        assert_eq!(now[0], !data[0], "round {i}: the lease came back before the consumer's write landed");
    }
    finish(child, peer);
}

#[test]
fn vmm_memory_is_exported_by_fd_zero_copy_and_opens_no_ipc_handle() {
    if !gpu("vmm_memory_is_exported_by_fd_zero_copy_and_opens_no_ipc_handle") {
        return;
    }
    let (child, peer) = spawn("import", &[], None, PeerConfig::default());
    let a = VmmAllocation::create(0, 1 << 20).unwrap();
    assert!(!tensorwire::cuda::driver::is_legacy_ipc_capable(a.ptr()).unwrap(), "VMM memory is not legacy-IPC capable");
    for (i, dt) in [DType::Float32, DType::Int64, DType::BFloat16].into_iter().enumerate() {
        let es = dt.size();
        let nbytes = 64 * es;
        let ptr = a.ptr() + 4096 * i as u64;
        let data = pattern(nbytes, i as u8 + 40);
        htod(ptr, &data);
        for l in views(dt) {
            peer.export_cuda(ptr, nbytes as u64, &l, 0, Box::new(()), ExportOptions::default()).unwrap();
            let r = unwords(&recv_msg(&peer));
            assert_eq!(r[1], fnv1a(&data), "{dt:?}: the consumer read other bytes than the producer wrote");
            leases_back(&peer);
            let now = dtoh(ptr, nbytes);
            if l.numel() > 0 {
                let at = l.storage_offset as usize * es;
                assert_ne!(now[at], data[at], "{dt:?}: the consumer's write is not in the producer's VMM memory");
            }
            htod(ptr, &data);
        }
    }
    let q = query(&peer);
    assert_eq!(q[0], 0, "VMM imports open no legacy IPC handle");
    if q[3] == 1 {
        assert_eq!(q[5], 0, "simcuda: the consumer unmapped every VMM import");
    }
    finish(child, peer);
}

#[test]
fn gpu_ring_carries_dtypes_many_chunks_and_many_messages_in_order() {
    if !gpu("gpu_ring_carries_dtypes_many_chunks_and_many_messages_in_order") {
        return;
    }
    let ring = CudaRingConfig { device: 0, slots: 4, slot_bytes: 64 << 10 };
    let (child, peer) = spawn("ring_recv", &[], None, PeerConfig { cuda_ring: Some(ring), ..PeerConfig::default() });
    let ps = Stream::new();
    let mut cases: Vec<(Layout, usize)> = DType::ALL.iter().map(|&dt| (Layout::contiguous(dt, &[5, 7]).unwrap(), 35 * dt.size())).collect();
    // 3 MiB: 48 chunks through 4 slots (each slot reused 12 times).
    cases.push((Layout::contiguous(DType::Float32, &[3 << 18]).unwrap(), 3 << 20));
    cases.push((Layout::contiguous(DType::UInt8, &[0]).unwrap(), 0));
    for _ in 0..40 {
        cases.push((Layout::contiguous(DType::Int32, &[1000]).unwrap(), 4000));
    }
    peer.send_message(&words(&[RING, cases.len() as u64]), &[]).unwrap();
    let src = DeviceBuffer::alloc(0, 3 << 20).unwrap();
    for (i, (l, n)) in cases.iter().enumerate() {
        let data = pattern(*n, i as u8);
        // Queued right before the send, no synchronize: the ring's copy must wait for it.
        htod_async(src.ptr(), &data, ps.0);
        peer.cuda_ring_send(src.ptr(), l, ps.0, i as u64, T).unwrap();
        // Reuse of the source right after the send, on the same stream: fine (stream order).
        let r = unwords(&recv_msg(&peer));
        assert_eq!((r[0], r[2], r[3]), (i as u64, *n as u64, l.dtype as u64), "message {i}");
        assert_eq!(r[1], fnv1a(&data), "message {i} ({n} bytes): other bytes arrived than were sent");
    }
    peer.send_message(&words(&[DONE]), &[]).unwrap();
    let mut child = child;
    assert!(child.wait().unwrap().success());
}

#[test]
fn gpu_ring_backpressure_and_timeouts() {
    if !gpu("gpu_ring_backpressure_and_timeouts") {
        return;
    }
    let ring = CudaRingConfig { device: 0, slots: 2, slot_bytes: 64 << 10 };
    let (child, peer) = spawn("ring_recv", &[], None, PeerConfig { cuda_ring: Some(ring), ..PeerConfig::default() });
    let src = DeviceBuffer::alloc(0, 64 << 10).unwrap();
    let l = Layout::contiguous(DType::UInt8, &[64 << 10]).unwrap();
    htod(src.ptr(), &pattern(64 << 10, 3));
    // Nobody receives: two messages fill the slots, the third times out before its first
    // chunk and leaves the ring usable.
    peer.cuda_ring_send(src.ptr(), &l, 0, 0, T).unwrap();
    peer.cuda_ring_send(src.ptr(), &l, 0, 1, T).unwrap();
    let t0 = Instant::now();
    let e = peer.cuda_ring_send(src.ptr(), &l, 0, 2, Some(Duration::from_millis(200))).unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    // A slow consumer: the sender waits for slots (backpressure), everything arrives.
    peer.send_message(&words(&[RING, 8, 20, 0]), &[]).unwrap();
    for i in 0..2u64 {
        assert_eq!(unwords(&recv_msg(&peer))[0], i);
    }
    for i in 2..8u64 {
        peer.cuda_ring_send(src.ptr(), &l, 0, i, T).unwrap();
    }
    for i in 2..8u64 {
        let r = unwords(&recv_msg(&peer));
        assert_eq!((r[0], r[1]), (i, fnv1a(&pattern(64 << 10, 3))));
    }
    peer.send_message(&words(&[DONE]), &[]).unwrap();
    let mut child = child;
    assert!(child.wait().unwrap().success());
}

/// The consumer's copies out of the ring run late (its stream is busy) while the producer
/// already refills the slots the consumer freed: every message still arrives intact, because
/// the producer's copy into a reused slot waits for the consumer's read event.
#[test]
fn gpu_ring_slot_reuse_waits_for_the_consumers_copy_out() {
    if !gpu("gpu_ring_slot_reuse_waits_for_the_consumers_copy_out") {
        return;
    }
    let slot = 16u64 << 10;
    let ring = CudaRingConfig { device: 0, slots: 2, slot_bytes: slot };
    let (child, peer) = spawn("ring_recv", &[], None, PeerConfig { cuda_ring: Some(ring), ..PeerConfig::default() });
    let n = 8 * slot as usize;
    let msgs = 6u64;
    peer.send_message(&words(&[RING, msgs, 0, 30]), &[]).unwrap();
    let ps = Stream::new();
    let srcs: Vec<DeviceBuffer> = (0..msgs).map(|_| DeviceBuffer::alloc(0, n as u64).unwrap()).collect();
    let l = Layout::contiguous(DType::UInt8, &[n as i64]).unwrap();
    for (i, src) in srcs.iter().enumerate() {
        htod(src.ptr(), &pattern(n, 100 + i as u8));
    }
    // All messages back to back, no reply awaited in between.
    for (i, src) in srcs.iter().enumerate() {
        peer.cuda_ring_send(src.ptr(), &l, ps.0, i as u64, T).unwrap();
    }
    for i in 0..msgs {
        let r = unwords(&recv_msg(&peer));
        assert_eq!(r[0], i);
        assert_eq!(r[1], fnv1a(&pattern(n, 100 + i as u8)), "message {i}: a slot was overwritten before the consumer copied it out");
    }
    peer.send_message(&words(&[DONE]), &[]).unwrap();
    let mut child = child;
    assert!(child.wait().unwrap().success());
}

#[test]
fn producer_killed_mid_ring_message_gives_the_consumer_peer_gone_in_bounded_time() {
    if !gpu("producer_killed_mid_ring_message_gives_the_consumer_peer_gone_in_bounded_time") {
        return;
    }
    let ring = CudaRingConfig { device: 0, slots: 2, slot_bytes: 64 << 10 };
    let (mut child, peer) = spawn("ring_produce_die", &[], Some(ring), PeerConfig::default());
    assert_eq!(unwords(&recv_msg(&peer))[0], READY);
    let (_, desc) = peer.cuda_ring_recv(T).unwrap();
    assert_eq!(desc.storage.nbytes, 8 * (64 << 10));
    kill9(&mut child);
    let dst = DeviceBuffer::alloc(0, 8 * (64 << 10)).unwrap();
    let t0 = Instant::now();
    let e = peer.cuda_ring_recv_finish(dst.ptr(), 8 * (64 << 10), 0, T).unwrap_err();
    assert!(e.is_peer_gone(), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5), "PeerGone took {:?}", t0.elapsed());
}

#[test]
fn importer_sigkilled_gives_leases_back() {
    if !gpu("importer_sigkilled_gives_leases_back") {
        return;
    }
    let (mut child, peer) = spawn("import", &[], None, PeerConfig::default());
    let dropped = Arc::new(AtomicUsize::new(0));
    let bufs: Vec<DeviceBuffer> = (0..3).map(|_| DeviceBuffer::alloc(0, 4096).unwrap()).collect();
    peer.send_message(&words(&[HOLD]), &[]).unwrap();
    let l = Layout::contiguous(DType::UInt8, &[4096]).unwrap();
    for (i, b) in bufs.iter().enumerate() {
        htod(b.ptr(), &pattern(4096, i as u8));
        peer.export_cuda(b.ptr(), 4096, &l, 0, owner(&dropped), ExportOptions { tag: i as u64, window: None }).unwrap();
        recv_msg(&peer);
    }
    assert_eq!(peer.reap_now().live_leases, 3);
    kill9(&mut child);
    wait_until("leases of a killed consumer to be reclaimed", Duration::from_secs(10), || peer.reap_now().live_leases == 0);
    assert_eq!(dropped.load(Ordering::SeqCst), 3);
    let before = sim_stats();
    drop(bufs);
    if let (Some(b), Some(a)) = (before, sim_stats()) {
        assert_eq!(a.free_while_imported, b.free_while_imported, "a dead importer's handles do not count as open");
    }
}

/// Injected driver failures in the consumer: the import fails with an error naming the
/// call, the lease comes back, and the next import works; the consumer keeps nothing open.
#[test]
fn injected_driver_failures_are_named_errors_and_leave_nothing_behind() {
    if !gpu("injected_driver_failures_are_named_errors_and_leave_nothing_behind") {
        return;
    }
    if sim_stats().is_none() {
        eprintln!("SKIPPED injected_driver_failures_are_named_errors_and_leave_nothing_behind: needs simcuda (fault injection)");
        return;
    }
    let env = [("SIMCUDA_FAIL", "cuIpcOpenMemHandle_v2:1=CUDA_ERROR_MAP_FAILED")];
    let (child, peer) = spawn("import", &env, None, PeerConfig::default());
    let dropped = Arc::new(AtomicUsize::new(0));
    let buf = DeviceBuffer::alloc(0, 4096).unwrap();
    htod(buf.ptr(), &pattern(4096, 5));
    let l = Layout::contiguous(DType::UInt8, &[4096]).unwrap();
    let export = |tag| peer.export_cuda(buf.ptr(), 4096, &l, 0, owner(&dropped), ExportOptions { tag, window: None }).unwrap();
    export(1);
    let r = recv_msg(&peer);
    let s = String::from_utf8_lossy(&r);
    assert!(s.starts_with("ERR:") && s.contains("cuIpcOpenMemHandle") && s.contains("CUDA_ERROR_MAP_FAILED"), "{s}");
    leases_back(&peer);
    assert_eq!(dropped.load(Ordering::SeqCst), 1, "the failed import's lease came back");
    export(2);
    assert_eq!(unwords(&recv_msg(&peer))[1], fnv1a(&pattern(4096, 5)), "the next import works");
    leases_back(&peer);
    let q = query(&peer);
    assert_eq!((q[1], q[4]), (0, 0), "the consumer has no handle open");
    assert_eq!(q[6], 1, "simcuda injected one failure so far");
    finish(child, peer);
    assert_eq!(dropped.load(Ordering::SeqCst), 2);
}

/// Both ends in one process: the driver refuses to open an IPC handle (memory or event) in
/// the process that exported it, so the import uses the allocation and the events
/// themselves — still under the lease and the event order.
#[test]
fn both_ends_in_one_process_import_without_opening_handles() {
    if !gpu("both_ends_in_one_process_import_without_opening_handles") {
        return;
    }
    let ring = CudaRingConfig { device: 0, slots: 2, slot_bytes: 16 << 10 };
    let (a, b) = Peer::pair(PeerConfig { cuda_ring: Some(ring), ..PeerConfig::default() }).unwrap();
    let n = 32 << 10;
    let buf = DeviceBuffer::alloc(0, n as u64 + 4096).unwrap();
    let (ps, cs) = (Stream::new(), Stream::new());
    let l = Layout::contiguous(DType::Int32, &[(n / 4) as i64]).unwrap();
    let dropped = Arc::new(AtomicUsize::new(0));
    let opens = tensorwire::cuda::ipc::cache().opens();
    for i in 0..6u8 {
        let data = pattern(n, i);
        htod_async(buf.ptr() + 4096, &data, ps.0);
        a.export_cuda(buf.ptr() + 4096, n as u64, &l, ps.0, owner(&dropped), ExportOptions { tag: i.into(), window: None }).unwrap();
        let t = match b.recv(T).unwrap() {
            Incoming::CudaTensor(t) => t,
            other => panic!("expected a CUDA tensor, got {other:?}"),
        };
        assert_eq!(t.storage_ptr(), buf.ptr() + 4096, "the import is the exporter's own pointer");
        t.wait_on(cs.0).unwrap();
        assert_eq!(fnv1a(&dtoh_on(t.storage_ptr(), n, cs.0)), fnv1a(&data), "round {i}: read before the queued write landed");
        htod_async(t.data_ptr(), &[!data[0]], cs.0);
        t.release_after(cs.0).unwrap();
        leases_back(&a);
        assert_eq!(dtoh_on(buf.ptr() + 4096, 1, ps.0)[0], !data[0], "round {i}: lease back before the consumer's write landed");
    }
    assert_eq!(dropped.load(Ordering::SeqCst), 6);
    assert_eq!(tensorwire::cuda::ipc::cache().opens(), opens, "no cuIpcOpenMemHandle for this process's own memory");
    // The GPU ring too: its arena and events are this process's own.
    let src = DeviceBuffer::alloc(0, 48 << 10).unwrap();
    let rl = Layout::contiguous(DType::UInt8, &[48 << 10]).unwrap();
    let data = pattern(48 << 10, 77);
    htod(src.ptr(), &data);
    let sender = std::thread::spawn({
        let src = src.ptr();
        move || {
            a.cuda_ring_send(src, &rl, 0, 5, T).unwrap();
            a
        }
    });
    let (tag, desc) = b.cuda_ring_recv(T).unwrap();
    assert_eq!((tag, desc.storage.nbytes), (5, 48 << 10));
    let dst = DeviceBuffer::alloc(0, 48 << 10).unwrap();
    b.cuda_ring_recv_finish(dst.ptr(), 48 << 10, cs.0, T).unwrap();
    assert_eq!(fnv1a(&dtoh_on(dst.ptr(), 48 << 10, cs.0)), fnv1a(&data));
    let _a = sender.join().unwrap();
}

/// Driver failures in the producer (an event record for an export, a copy into the GPU
/// ring): each is a tensorwire error naming the call, the failed export's owner is dropped
/// and its event slot given back (40 exports after it wrap the pool), the ring stays usable
/// after a failure before its first chunk, and the consumer sees only intact data.
#[test]
fn injected_producer_failures_are_named_and_leave_the_connection_usable() {
    if !gpu("injected_producer_failures_are_named_and_leave_the_connection_usable") {
        return;
    }
    if sim_stats().is_none() {
        eprintln!("SKIPPED injected_producer_failures_are_named_and_leave_the_connection_usable: needs simcuda (fault injection)");
        return;
    }
    let ring = CudaRingConfig { device: 0, slots: 2, slot_bytes: 16 << 10 };
    let env = [("SIMCUDA_FAIL", "cuEventRecord:2,cuMemcpyDtoDAsync_v2:2")];
    let (mut child, peer) = spawn("fault_export", &env, Some(ring), PeerConfig::default());
    let cs = Stream::new();
    let mut tensors = Vec::new();
    let mut ring_msgs = Vec::new();
    loop {
        match peer.recv(T).unwrap() {
            Incoming::CudaTensor(t) => {
                t.wait_on(cs.0).unwrap();
                let got = dtoh_on(t.storage_ptr(), 4096, cs.0);
                assert_eq!(fnv1a(&got), fnv1a(&pattern(4096, t.tag() as u8)), "export {}", t.tag());
                tensors.push(t.tag());
                t.release_after(cs.0).unwrap();
            }
            Incoming::Message { payload, .. } => match unwords(&payload)[..] {
                [RING, n] => {
                    for _ in 0..n {
                        let (tag, desc) = peer.cuda_ring_recv(T).unwrap();
                        let dst = DeviceBuffer::alloc(0, desc.storage.nbytes).unwrap();
                        peer.cuda_ring_recv_finish(dst.ptr(), desc.storage.nbytes, cs.0, T).unwrap();
                        assert_eq!(fnv1a(&dtoh_on(dst.ptr(), 8192, cs.0)), fnv1a(&pattern(8192, tag as u8)), "ring message {tag}");
                        ring_msgs.push(tag);
                    }
                }
                [READY] => break,
                ref other => panic!("unexpected message {other:?}"),
            },
            Incoming::Tensor(t) => panic!("unexpected CPU tensor {:?}", t.layout()),
        }
    }
    let r = unwords(&recv_msg(&peer));
    assert_eq!(r[0], 1, "the failed export is an error naming cuEventRecord and its owner was dropped");
    assert_eq!(r[1], 1, "the failed ring send is an error naming cuMemcpyDtoDAsync");
    assert_eq!((r[2], r[3]), (42, 0), "every owner dropped once, no lease left");
    assert_eq!(r[4], 2, "two injected failures");
    let mut want = vec![1u64];
    want.extend(100..140);
    assert_eq!(tensors, want, "the failed export sent nothing; the 40 after it (the pool wrapped) arrived");
    assert_eq!(ring_msgs, [51, 53], "the ring works after the failed send");
    kill9(&mut child);
}

/// A consumer that dies part-way through a message: the producer's send, waiting for slots,
/// fails with PeerGone in bounded time instead of waiting for ever.
#[test]
fn gpu_ring_consumer_that_dies_mid_message_gives_the_producer_peer_gone() {
    if !gpu("gpu_ring_consumer_that_dies_mid_message_gives_the_producer_peer_gone") {
        return;
    }
    let ring = CudaRingConfig { device: 0, slots: 2, slot_bytes: 16 << 10 };
    let (mut child, peer) = spawn("ring_recv", &[], None, PeerConfig { cuda_ring: Some(ring), ..PeerConfig::default() });
    let src = DeviceBuffer::alloc(0, 8 * (16 << 10)).unwrap();
    htod(src.ptr(), &pattern(8 * (16 << 10), 1));
    let l = Layout::contiguous(DType::UInt8, &[8 * (16 << 10)]).unwrap();
    peer.send_message(&words(&[RING_DIE]), &[]).unwrap();
    let t0 = Instant::now();
    let e = peer.cuda_ring_send(src.ptr(), &l, 0, 1, T).unwrap_err();
    assert!(e.is_peer_gone(), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(10), "took {:?}", t0.elapsed());
    assert!(child.wait().unwrap().success());
    let e = peer.cuda_ring_send(src.ptr(), &l, 0, 2, T).unwrap_err();
    assert!(e.is_peer_gone() || matches!(e, Error::Protocol(_)), "a later send fails at once: {e}");
}
