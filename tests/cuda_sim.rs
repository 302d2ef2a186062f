//! tensorwire's CUDA IPC paths (export/import, the handle cache, pooled IPC events, VMM by
//! fd) driven through the driver API in two processes: the data is filled with
//! host-to-device copies and checked with device-to-host copies. The GPU ring's tests are
//! in `cuda_sim_ring.rs`; the child roles in `common/gpu_roles.rs`.
//!
//! Runs on simcuda (`simcuda/run.sh cargo test --test cuda_sim`: a strict simulated
//! driver whose streams run after random delays, so a missing wait shows up as wrong
//! data) and unchanged on a real GPU. Counter checks of the simulated driver
//! (`simcuda_stats`) run only where it is loaded; without any driver every test says
//! SKIPPED loudly.

mod common;

use common::gpu::*;
use common::gpu_roles::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tensorwire::cuda::driver::DeviceBuffer;
use tensorwire::cuda::CudaStream;
use tensorwire::cuda::ring::CudaRingConfig;
use tensorwire::cuda::vmm::VmmAllocation;
use tensorwire::{DType, ExportOptions, Incoming, Layout, Peer, PeerConfig};

#[test]
#[ignore = "entry point of the child processes"]
fn child_entry() {
    child_main();
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
    assert_eq!(s.version, SIM_STATS_VERSION);
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
            let data = pattern(tag as u8, nbytes);
            htod(ptr, &data);
            tag += 1;
            peer.export_cuda(ptr, nbytes as u64, &l, CudaStream::LEGACY, owner(&dropped), ExportOptions { tag, window: None }).unwrap();
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
    htod(buf.ptr(), &pattern(1, 4096));
    let l = Layout::contiguous(DType::UInt8, &[1024]).unwrap();
    let send = |tag: u64, at: u64| {
        peer.export_cuda(buf.ptr() + at, 1024, &l, CudaStream::LEGACY, Box::new(()), ExportOptions { tag, window: None }).unwrap();
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
        let data = pattern(i, n);
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
        let data = pattern(i as u8 + 40, nbytes);
        htod(ptr, &data);
        for l in views(dt) {
            peer.export_cuda(ptr, nbytes as u64, &l, CudaStream::LEGACY, Box::new(()), ExportOptions::default()).unwrap();
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
        htod(b.ptr(), &pattern(i as u8, 4096));
        peer.export_cuda(b.ptr(), 4096, &l, CudaStream::LEGACY, owner(&dropped), ExportOptions { tag: i as u64, window: None }).unwrap();
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
    htod(buf.ptr(), &pattern(5, 4096));
    let l = Layout::contiguous(DType::UInt8, &[4096]).unwrap();
    let export = |tag| peer.export_cuda(buf.ptr(), 4096, &l, CudaStream::LEGACY, owner(&dropped), ExportOptions { tag, window: None }).unwrap();
    export(1);
    let r = recv_msg(&peer);
    let s = String::from_utf8_lossy(&r);
    assert!(s.starts_with("ERR:") && s.contains("cuIpcOpenMemHandle") && s.contains("CUDA_ERROR_MAP_FAILED"), "{s}");
    leases_back(&peer);
    assert_eq!(dropped.load(Ordering::SeqCst), 1, "the failed import's lease came back");
    export(2);
    assert_eq!(unwords(&recv_msg(&peer))[1], fnv1a(&pattern(5, 4096)), "the next import works");
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
        let data = pattern(i, n);
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
    let data = pattern(77, 48 << 10);
    htod(src.ptr(), &data);
    let sender = std::thread::spawn({
        let src = src.ptr();
        move || {
            a.cuda_ring_send(src, &rl, CudaStream::LEGACY, 5, T).unwrap();
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
