//! The CUDA parts of the C ABI (`tw_peer_export_cuda`, `tw_imported_cuda_wait`,
//! `tw_imported_release_after`, `tw_peer_cuda_ring_*`, `tw_cuda_ipc_cache_stats`) called as
//! C would call them, over two peers of one process connected by `tw_socketpair`: the data
//! arrives, stream order holds, the release callback runs once, the ring carries a
//! many-chunk message. Runs on simcuda and unchanged on a GPU; SKIPPED without a driver.
//! (ffi/tests/c/cuda.c does the same from C across a fork, under valgrind on simcuda.)

/// The core crate's test helpers (the driver calls, streams, simcuda's counters).
#[path = "../../tests/common/mod.rs"]
mod common;

use common::gpu::*;
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use tensorwire::cuda::driver::DeviceBuffer;
use tensorwire::cuda::DevicePtr;
use tensorwire_ffi::*;

static RELEASED: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C" fn on_release(_ctx: *mut c_void) {
    RELEASED.fetch_add(1, Ordering::SeqCst);
}

fn layout_u8(n: i64) -> tw_layout_t {
    let mut l = tw_layout_t { dtype: 0, ndim: 1, reserved: [0; 6], storage_offset: 0, sizes: [0; 16], strides: [0; 16] };
    l.sizes[0] = n;
    l.strides[0] = 1;
    l
}

struct P(*mut tw_peer_t);
// SAFETY: a tw_peer_t is usable from any thread (the C ABI documents peers as thread-safe
// handles; the Rust Peer inside is Send + Sync).
unsafe impl Send for P {}

#[test]
fn the_c_abi_moves_cuda_tensors_and_ring_messages() {
    if !gpu("the_c_abi_moves_cuda_tensors_and_ring_messages") {
        return;
    }
    let (mut fa, mut fb) = (-1, -1);
    // SAFETY: every call below gets live handles and writable out-pointers, as C would.
    unsafe {
        assert_eq!(tw_socketpair(&mut fa, &mut fb), tw_result_e::TW_OK);
        let mut cfg = std::mem::zeroed::<tw_peer_config_t>();
        assert_eq!(tw_peer_config_default(&mut cfg), tw_result_e::TW_OK);
        let mut ring_cfg = cfg;
        ring_cfg.cuda_ring_device = 0;
        ring_cfg.cuda_ring_slots = 2;
        ring_cfg.cuda_ring_slot_bytes = 16 << 10;
        // The consumer side (b) offers the GPU ring back to a.
        let other = std::thread::spawn(move || {
            let mut pb = std::ptr::null_mut();
            assert_eq!(tw_peer_from_fd(fb, &ring_cfg, &mut pb), tw_result_e::TW_OK);
            P(pb)
        });
        let mut pa = std::ptr::null_mut();
        assert_eq!(tw_peer_from_fd(fa, &cfg, &mut pa), tw_result_e::TW_OK);
        let pb = other.join().unwrap().0;

        // a exports a CUDA tensor written on its stream right before; b waits, reads,
        // writes back, releases after its stream.
        let (ps, cs) = (Stream::new(), Stream::new());
        let n = 8192usize;
        let buf = DeviceBuffer::alloc(0, n as u64).unwrap();
        let l = layout_u8(n as i64);
        for i in 0..4u8 {
            let data = pattern(i, n);
            htod_async(buf.ptr(), &data, ps.0);
            let r = tw_peer_export_cuda(pa, buf.ptr().get(), n as u64, &l, ps.0.0, i.into(), 0, Some(on_release), std::ptr::null_mut(), std::ptr::null_mut());
            assert_eq!(r, tw_result_e::TW_OK);
            let (mut imp, mut msg) = (std::ptr::null_mut(), std::ptr::null_mut());
            assert_eq!(tw_peer_recv(pb, 10_000, &mut imp, &mut msg), tw_result_e::TW_OK);
            assert!(msg.is_null() && !imp.is_null());
            assert_eq!((tw_imported_device(imp), tw_imported_tag(imp), tw_imported_storage_len(imp)), (0, u64::from(i), n));
            assert_eq!(tw_imported_cuda_wait(imp, cs.0.0), tw_result_e::TW_OK);
            let dptr = DevicePtr(tw_imported_storage(imp) as u64);
            assert_eq!(fnv1a(&dtoh_on(dptr, n, cs.0)), fnv1a(&data), "round {i}");
            htod_async(dptr, &[!data[0]], cs.0);
            assert_eq!(tw_imported_release_after(imp, cs.0.0), tw_result_e::TW_OK);
            let mut st = std::mem::zeroed::<tw_lease_stats_t>();
            wait_until("the lease to come back", std::time::Duration::from_secs(10), || {
                tw_peer_reap(pa, &mut st) == tw_result_e::TW_OK && st.live_leases == 0
            });
            assert_eq!(dtoh_on(buf.ptr(), 1, ps.0)[0], !data[0], "round {i}: the consumer's write landed before the lease came back");
        }
        assert_eq!(RELEASED.load(Ordering::SeqCst), 4, "each release callback ran once");
        let (mut opens, mut open) = (0, 0);
        tw_cuda_ipc_cache_stats(&mut opens, &mut open);
        // One process: nothing is opened through the driver; the one cache entry is the GPU
        // ring's arena (this process's own allocation, held for the connection).
        assert_eq!((opens, open), (0, 1), "driver opens, cache entries");

        // b sends through its GPU ring: 5 chunks through 2 slots.
        let m = 5 * (16 << 10);
        let src = DeviceBuffer::alloc(0, m as u64).unwrap();
        let data = pattern(33, m);
        htod(src.ptr(), &data);
        let rl = layout_u8(m as i64);
        let sender = std::thread::spawn({
            let (pb, src) = (P(pb), src.ptr().get());
            move || {
                let pb = pb;
                assert_eq!(tw_peer_cuda_ring_send(pb.0, src, &rl, 0, 7, 10_000), tw_result_e::TW_OK);
                pb
            }
        });
        let (mut tag, mut dev, mut nbytes) = (0, -1, 0);
        let mut got = std::mem::zeroed::<tw_layout_t>();
        assert_eq!(tw_peer_cuda_ring_recv(pa, 10_000, &mut tag, &mut got, &mut dev, &mut nbytes), tw_result_e::TW_OK);
        assert_eq!((tag, dev, nbytes, got.sizes[0]), (7, 0, m as u64, m as i64));
        let dst = DeviceBuffer::alloc(0, m as u64).unwrap();
        assert_eq!(tw_peer_cuda_ring_recv_finish(pa, dst.ptr().get(), m as u64, cs.0.0, 10_000), tw_result_e::TW_OK);
        assert_eq!(fnv1a(&dtoh_on(dst.ptr(), m, cs.0)), fnv1a(&data));
        let pb = sender.join().unwrap().0;
        tw_peer_free(pb);
        tw_peer_free(pa);
    }
}
