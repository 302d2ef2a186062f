//! Tests of `cuda.rs` on simcuda (`simcuda/run.sh cargo test -p tensorwire-python cuda`):
//! both ends in one process, driving export, the pending import, its DLPack capsule and
//! deleter, forwards and the GPU ring through the binding's own functions.

use super::*;
use crate::dlpack::DLManagedTensor;
use cudarc::driver::sys;
use pyo3::ffi;
use std::sync::atomic::AtomicUsize;
use std::time::Instant;
use tensorwire::cuda::driver::{call, ensure_context, DeviceBuffer};
use tensorwire::cuda::ring::CudaRingConfig;
use tensorwire::{Incoming, PeerConfig};

const T: Duration = Duration::from_secs(10);

fn gpu(test: &str) -> bool {
    if tensorwire::cuda::available() && tensorwire::cuda::device_count().unwrap_or(0) > 0 {
        return true;
    }
    eprintln!("SKIPPED {test}: no CUDA driver loaded (run under simcuda/run.sh, or on a GPU machine)");
    false
}

fn htod(dptr: DevicePtr, bytes: &[u8]) {
    let _c = ensure_context(0).unwrap();
    // SAFETY: `bytes` is readable for its length; dptr is a live allocation of the
    // caller's with room for it.
    call("cuMemcpyHtoD", || unsafe { sys::cuMemcpyHtoD_v2(dptr.get(), bytes.as_ptr().cast(), bytes.len()) }).unwrap();
}

/// `n` bytes at `dptr`, read after the work queued on the legacy stream (which waits
/// for every blocking stream's earlier work).
fn dtoh(dptr: DevicePtr, n: usize) -> Vec<u8> {
    let _c = ensure_context(0).unwrap();
    let mut v = vec![0u8; n];
    // SAFETY: `v` has room for n bytes; dptr is live device memory of at least n.
    call("cuMemcpyDtoH", || unsafe { sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), dptr.get(), n) }).unwrap();
    v
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

struct Flag(Arc<AtomicUsize>);
impl Drop for Flag {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn until(what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + T;
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn recv_cuda(p: &Peer) -> CudaImported {
    match p.recv(T).unwrap() {
        Incoming::CudaTensor(t) => t,
        other => panic!("expected a CUDA tensor, got {other:?}"),
    }
}

/// The managed tensor inside a live (unconsumed) capsule.
fn managed(py: Python<'_>, cap: &Py<PyAny>) -> *mut DLManagedTensor {
    // SAFETY: the GIL is held; `cap` is a live capsule named "dltensor" made by dlpack.rs.
    let m = unsafe { ffi::PyCapsule_GetPointer(cap.as_ptr(), c"dltensor".as_ptr()) };
    assert!(!m.is_null(), "not a live dltensor capsule");
    let _ = py;
    m.cast()
}

/// export -> `pending` -> `capsule` (a kDLCUDA 1-D uint8 over the whole storage,
/// registered for forwarding) -> torch's deleter (simulated: renamed "used_dltensor",
/// then the deleter) -> out of the registry, lease released after the stream's work,
/// owner dropped; a second capsule is refused.
#[test]
fn export_pending_capsule_deleter_releases_the_lease() {
    if !gpu("export_pending_capsule_deleter_releases_the_lease") {
        return;
    }
    Python::initialize();
    let (a, b) = Peer::pair(PeerConfig::default()).unwrap();
    let buf = DeviceBuffer::alloc(0, 4096).unwrap();
    let data = pattern(4096, 3);
    htod(buf.ptr(), &data);
    let l = Layout::strided(DType::Float32, &[4, 8], &[16, 2], 3).unwrap();
    let dropped = Arc::new(AtomicUsize::new(0));
    let opts = ExportOptions { tag: 7, window: None };
    let fwd = export(&a, buf.ptr().get(), 4096, 0, &l, CudaStream::LEGACY, Box::new(Flag(dropped.clone())), opts).unwrap();
    assert!(!fwd, "own memory is exported, not forwarded");
    let imp = recv_cuda(&b);
    Python::attach(|py| {
        let p = pending(py, imp, 7).unwrap();
        let p = p.bind(py).cast::<CudaPending>().unwrap().get();
        assert_eq!((p.device(), p.tag(), p.nbytes()), (0, 7, 4096));
        assert_eq!(p.view(), ("float32", vec![4, 8], vec![16, 2], 3));
        let cap = p.capsule(py, 0).unwrap();
        assert!(p.capsule(py, 0).is_err(), "a second capsule of one import");
        let m = managed(py, &cap);
        // SAFETY: `m` is the live managed tensor of `cap` (checked above).
        let t = unsafe { &(*m).dl_tensor };
        assert_eq!((t.device.device_type, t.device.device_id, t.ndim), (dlpack::DL_CUDA, 0, 1));
        assert_eq!(t.data as u64, buf.ptr().get(), "the storage itself (same process: the exporter's pointer)");
        // SAFETY: shape and strides point at one i64 each inside the holder.
        assert_eq!(unsafe { (*t.shape, *t.strides) }, (4096, 1));
        assert_eq!(dtoh(DevicePtr(t.data as u64), 4096), data);
        assert!(import_at(buf.ptr().get(), 4096, 0).is_some(), "registered while torch holds it");
        assert!(import_at(buf.ptr().get(), 4097, 0).is_none() && import_at(buf.ptr().get(), 16, 1).is_none());
        assert_eq!(a.export_stats().live_leases, 1);
        // Torch consumed it: renamed, then its deleter when the last view dies.
        // SAFETY: the GIL is held; `cap` is live; the deleter is called once, as
        // torch does, and the destructor no longer calls it (the name changed).
        unsafe {
            assert_eq!(ffi::PyCapsule_SetName(cap.as_ptr(), c"used_dltensor".as_ptr()), 0);
            ((*m).deleter.unwrap())(m);
        }
        drop(cap);
    });
    assert!(import_at(buf.ptr().get(), 4096, 0).is_none(), "left the registry with the deleter");
    until("the lease to come back", || a.reap_now().live_leases == 0);
    until("the owner to drop", || dropped.load(Ordering::SeqCst) == 1);
}

/// A capsule torch never consumed: its destructor ends the hold and the lease; a
/// `CudaPending` dropped without a capsule gives the lease back at once.
#[test]
fn unconsumed_capsule_and_dropped_pending_release() {
    if !gpu("unconsumed_capsule_and_dropped_pending_release") {
        return;
    }
    Python::initialize();
    let (a, b) = Peer::pair(PeerConfig::default()).unwrap();
    let buf = DeviceBuffer::alloc(0, 1024).unwrap();
    let l = Layout::contiguous(DType::UInt8, &[1024]).unwrap();
    for _ in 0..2 {
        export(&a, buf.ptr().get(), 1024, 0, &l, CudaStream::LEGACY, Box::new(()), ExportOptions::default()).unwrap();
    }
    let (i1, i2) = (recv_cuda(&b), recv_cuda(&b));
    Python::attach(|py| {
        let p1 = pending(py, i1, 1).unwrap();
        let cap = p1.bind(py).cast::<CudaPending>().unwrap().get().capsule(py, 0).unwrap();
        let p2 = pending(py, i2, 2).unwrap();
        assert_eq!(a.reap_now().live_leases, 2);
        drop(p2);
        until("the pending's lease", || a.reap_now().live_leases == 1);
        assert!(import_at(buf.ptr().get(), 1024, 0).is_some());
        drop(cap);
        drop(p1);
    });
    assert!(import_at(buf.ptr().get(), 1024, 0).is_none());
    until("the capsule's lease", || a.reap_now().live_leases == 0);
}

/// A storage torch holds from a CUDA import goes on as the same memory (no IPC export,
/// no handle opened); the upstream lease lives until both the local hold and the
/// forward's lease ended.
#[test]
fn a_held_import_is_forwarded_as_the_same_memory() {
    if !gpu("a_held_import_is_forwarded_as_the_same_memory") {
        return;
    }
    Python::initialize();
    let (host, relay_in) = Peer::pair(PeerConfig::default()).unwrap();
    let (relay_out, last) = Peer::pair(PeerConfig::default()).unwrap();
    let buf = DeviceBuffer::alloc(0, 8192).unwrap();
    let data = pattern(8192, 9);
    htod(buf.ptr(), &data);
    let l = Layout::contiguous(DType::Int32, &[2048]).unwrap();
    export(&host, buf.ptr().get(), 8192, 0, &l, CudaStream::LEGACY, Box::new(()), ExportOptions::default()).unwrap();
    let imp = recv_cuda(&relay_in);
    let opens = tensorwire::cuda::ipc::cache().opens();
    Python::attach(|py| {
        let p = pending(py, imp, 0).unwrap();
        let cap = p.bind(py).cast::<CudaPending>().unwrap().get().capsule(py, 0).unwrap();
        // The relay sends rows 1.. of a [16, 128] view of the storage it holds.
        let v = Layout::strided(DType::Int32, &[15, 128], &[128, 1], 128).unwrap();
        let dropped = Arc::new(AtomicUsize::new(0));
        let fwd = export(&relay_out, buf.ptr().get(), 8192, 0, &v, CudaStream::LEGACY, Box::new(Flag(dropped.clone())), ExportOptions { tag: 4, window: None })
            .unwrap();
        assert!(fwd, "a held import is forwarded");
        // A range the import does not cover, or another device, is not the import.
        assert!(import_at(buf.ptr().get(), 8193, 0).is_none());
        let got = recv_cuda(&last);
        assert_eq!((got.storage_ptr(), got.storage_nbytes(), got.tag()), (buf.ptr(), 8192, 4));
        assert_eq!(got.layout(), v);
        assert_eq!(dtoh(got.data_ptr(), 4), data[512..516].to_vec());
        drop(cap); // torch's views of the relay's import die
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(host.reap_now().live_leases, 1, "the forward still holds the upstream lease");
        got.release_after(CudaStream::LEGACY).unwrap();
        until("the forward's lease", || relay_out.reap_now().live_leases == 0);
        until("the forward's owner", || dropped.load(Ordering::SeqCst) == 1);
        drop(p);
    });
    until("the upstream lease", || host.reap_now().live_leases == 0);
    assert_eq!(tensorwire::cuda::ipc::cache().opens(), opens, "no handle opened to forward");
}

/// Errors as the C++ ops raise them: `tensorwire.errors`' class and `.code` by kind, the
/// C ABI function named in the message (the package's `__init__` is bypassed: it
/// loads torch).
#[test]
fn errors_are_the_c_abis_with_the_function_named() {
    Python::initialize();
    Python::attach(|py| {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../tensorwire");
        let code = format!("import sys, types\nm = types.ModuleType('tensorwire')\nm.__path__ = [{dir:?}]\nsys.modules.setdefault('tensorwire', m)\n");
        py.run(&std::ffi::CString::new(code).unwrap(), None, None).unwrap();
        // `tensorwire.errors` builds its tables from the binding: this very module, made
        // here (a checkout need not have the built `_native.abi3.so` beside the package).
        let native = pyo3::wrap_pymodule!(crate::_native)(py);
        py.import("sys").unwrap().getattr("modules").unwrap().set_item("tensorwire._native", native).unwrap();
        let e = named(py, "tw_cuda_device_count", &Error::CudaUnavailable("no NVIDIA driver here".into()));
        let v = e.value(py);
        assert_eq!(v.get_type().name().unwrap().to_string(), "CudaUnavailable");
        assert_eq!(v.getattr("code").unwrap().extract::<String>().unwrap(), "TW_ERR_CUDA_UNAVAILABLE");
        assert_eq!(
            v.str().unwrap().to_string(),
            "tensorwire (TW_ERR_CUDA_UNAVAILABLE): tw_cuda_device_count: CUDA unavailable: no NVIDIA driver here"
        );
        let e = cuda_ipc_cache_keep_warm(py, -1).unwrap_err();
        let v = e.value(py);
        assert_eq!(v.get_type().name().unwrap().to_string(), "Refused");
        assert!(v.str().unwrap().to_string().contains("n must be >= 0, got -1"));
        assert!(v.is_instance_of::<pyo3::exceptions::PyRuntimeError>());
    });
}

fn py_peer(py: Python<'_>, peer: Peer) -> Py<PyPeer> {
    Py::new(py, PyPeer::new(peer)).unwrap()
}

/// The GPU ring through the Python functions: send, describe, finish into a buffer,
/// then a discarded message and a refused destination; timeouts in ms.
#[test]
fn gpu_ring_send_recv_finish_and_discard() {
    if !gpu("gpu_ring_send_recv_finish_and_discard") {
        return;
    }
    Python::initialize();
    let ring = CudaRingConfig { device: 0, slots: 2, slot_bytes: 16 << 10 };
    let (a, b) = Peer::pair(PeerConfig { cuda_ring: Some(ring), ..PeerConfig::default() }).unwrap();
    let n = 40 << 10; // three chunks
    let src = DeviceBuffer::alloc(0, n as u64).unwrap();
    let data = pattern(n, 5);
    htod(src.ptr(), &data);
    let dst = DeviceBuffer::alloc(0, n as u64).unwrap();
    Python::attach(|py| {
        let (a, b) = (py_peer(py, a), py_peer(py, b));
        // Nothing sent yet: 0 ms does not wait.
        let e = cuda_ring_recv(py, b.borrow(py), 0).unwrap_err();
        assert!(e.to_string().contains("tw_peer_cuda_ring_recv"), "{e}");
        let sizes = vec![(n / 8) as i64, 2];
        let sender = {
            let a = a.clone_ref(py);
            let ptr = src.ptr().get();
            let sizes = sizes.clone();
            std::thread::spawn(move || {
                Python::attach(|py| {
                    cuda_ring_send(py, a.borrow(py), ptr, 0, 0, "float32", sizes.clone(), vec![2, 1], 11, 10_000).unwrap();
                    cuda_ring_send(py, a.borrow(py), ptr, 0, 0, "float32", sizes, vec![2, 1], 12, 10_000).unwrap();
                })
            })
        };
        let (tag, dtype, got_sizes, device, nbytes) = cuda_ring_recv(py, b.borrow(py), 10_000).unwrap();
        assert_eq!((tag, dtype, got_sizes, device, nbytes), (11, "float32", sizes.clone(), 0, n as u64));
        // A host pointer or NULL is refused before any copy, and the message stays.
        let host = data.as_ptr() as u64;
        assert!(cuda_ring_recv_finish(py, b.borrow(py), host, n as u64, 0, 10_000).is_err());
        assert!(cuda_ring_recv_finish(py, b.borrow(py), 0, n as u64, 0, 10_000).is_err());
        cuda_ring_recv_finish(py, b.borrow(py), dst.ptr().get(), n as u64, 0, 10_000).unwrap();
        assert_eq!(dtoh(dst.ptr(), n), data);
        let (tag, ..) = cuda_ring_recv(py, b.borrow(py), 10_000).unwrap();
        assert_eq!(tag, 12);
        cuda_ring_discard(py, b.borrow(py), 10_000).unwrap();
        py.detach(|| sender.join().unwrap());
        // Not contiguous: refused by the ring's layout check.
        let e = cuda_ring_send(py, a.borrow(py), src.ptr().get(), 0, 0, "float32", vec![4, 2], vec![1, 4], 0, 0).unwrap_err();
        assert!(e.to_string().contains("tw_peer_cuda_ring_send"), "{e}");
        // A host pointer as the source: refused here, never copied from.
        assert!(cuda_ring_send(py, a.borrow(py), host, 0, 0, "uint8", vec![8], vec![1], 0, 0).is_err());
    });
}

/// A stream of device 0, never destroyed (exports record events on it when the value
/// is encoded, after the code that queued the work has moved on).
fn new_stream() -> usize {
    let _c = ensure_context(0).unwrap();
    let mut s: sys::CUstream = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    call("cuStreamCreate", || unsafe { sys::cuStreamCreate(&mut s, 0) }).unwrap();
    s as usize
}

/// Queue `bytes` to `dptr` on `stream` as 16 asynchronous copies (simcuda delays each
/// at random: a reader not ordered after them sees stale bytes).
fn htod_queued(dptr: DevicePtr, bytes: &[u8], stream: usize) {
    let _c = ensure_context(0).unwrap();
    let chunk = bytes.len().div_ceil(16).max(1);
    for (i, c) in bytes.chunks(chunk).enumerate() {
        let at = dptr.get() + (i * chunk) as u64;
        // SAFETY: `c` is readable for its length (pageable: staged before the call
        // returns); `at` lies in a live allocation with room for it.
        call("cuMemcpyHtoDAsync", || unsafe { sys::cuMemcpyHtoDAsync_v2(at, c.as_ptr().cast(), c.len(), stream as sys::CUstream) }).unwrap();
    }
}

/// `len` bytes at `data`, read on `stream` (no other order), then that stream synchronized.
fn read_on(data: u64, len: usize, stream: usize) -> Vec<u8> {
    let mut got = vec![0u8; len];
    let _c = ensure_context(0).unwrap();
    // SAFETY: `got` has room for `len` bytes; `data` names `len` live device bytes (an
    // import's storage, held by the caller); the stream is synchronized before use.
    call("cuMemcpyDtoHAsync", || unsafe { sys::cuMemcpyDtoHAsync_v2(got.as_mut_ptr().cast(), data, len, stream as sys::CUstream) }).unwrap();
    // SAFETY: a live stream of the current context.
    call("cuStreamSynchronize", || unsafe { sys::cuStreamSynchronize(stream as sys::CUstream) }).unwrap();
    got
}

/// What torch does with a capsule it took: renames it, and calls the deleter when its
/// last view dies. Returns the storage's device address and byte length first.
fn consume(py: Python<'_>, cap: Py<PyAny>) -> (u64, usize, impl FnOnce()) {
    let m = managed(py, &cap);
    // SAFETY: `m` is the live managed tensor of `cap`; shape points at one i64.
    let (data, len, dev) = unsafe {
        let t = &(*m).dl_tensor;
        (t.data as u64, *t.shape as usize, (t.device.device_type, t.device.device_id))
    };
    assert_eq!(dev, (dlpack::DL_CUDA, 0));
    // SAFETY: the GIL is held and `cap` is live; renamed, its destructor no longer
    // calls the deleter, which the returned closure calls once (as torch does).
    assert_eq!(unsafe { ffi::PyCapsule_SetName(cap.as_ptr(), c"used_dltensor".as_ptr()) }, 0);
    let m = m as usize;
    (data, len, move || {
        let m = m as *mut DLManagedTensor;
        // SAFETY: the managed tensor lives until its deleter runs, here, once.
        unsafe { ((*m).deleter.unwrap())(m) };
    })
}

/// `tensorwire.rpc`'s CUDA values without torch: a storage of ours (`rpc_tensor`, its
/// writes still queued on a stream) as a call's argument over a native RPC pair; the
/// handler hands it to "torch" (`rpc_import_capsule`: its stream ordered after the
/// producer, so the queued bytes are there, a strided view as sent) and answers with a
/// CUDA tensor of its own, which the caller takes the same way. Each owner drops once
/// the value is gone and "torch" let go (the deleter: lease released after the
/// receiver's stream). Over a connection without native tensors the same value is
/// `CudaNotNative` (`CudaUnavailable` in Python) before anything is exported.
#[test]
fn rpc_cuda_values_round_trip_ordered_and_released() {
    if !gpu("rpc_cuda_values_round_trip_ordered_and_released") {
        return;
    }
    Python::initialize();
    use tensorwire_rpc::{CallOptions, Endpoint, Registry, RpcConfig, RpcError, Service, Tensor as RpcTensor, Value};
    let n = 64 << 10;
    let (arg_buf, res_buf) = (Arc::new(DeviceBuffer::alloc(0, n as u64).unwrap()), Arc::new(DeviceBuffer::alloc(0, n as u64).unwrap()));
    let (arg_data, res_data) = (pattern(n, 21), pattern(n, 77));
    let stream = new_stream();
    let view = Layout::strided(DType::Float32, &[64, 100], &[200, 2], 5).unwrap();
    let (arg_dropped, res_dropped) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let reg = Registry::new();
    {
        let (arg_data, res_buf, res_data, res_dropped) = (arg_data.clone(), res_buf.clone(), res_data.clone(), res_dropped.clone());
        let service = Service::new("Gpu").method("take", move |_, mut args| {
            // A panic here would leave the call unanswered: failures are answers.
            let fail = |m: String| Err(RpcError::Remote(m));
            let Some(Value::Tensor(t)) = args.args.pop() else { return fail("expected a tensor argument".into()) };
            let RpcTensor::CudaImported(imp) = *t else { return fail(format!("expected a CUDA import, got {t:?}")) };
            if (imp.layout(), imp.device(), imp.storage_nbytes()) != (view, 0, n as u64) {
                return fail(format!("arrived as {:?} on {} ({} bytes)", imp.layout(), imp.device(), imp.storage_nbytes()));
            }
            // Not the legacy stream, which would wait for the producer's (blocking)
            // stream by itself: only `rpc_import_capsule`'s wait orders this one.
            let mine = new_stream();
            let got = Python::attach(|py| {
                let cap = rpc_import_capsule(py, imp, mine).map_err(|e| RpcError::Remote(e.to_string()))?;
                let (data, len, deleter) = consume(py, cap);
                let got = read_on(data, len, mine);
                deleter();
                Ok::<_, RpcError>(got)
            })?;
            if got != arg_data {
                return fail("the handler read the argument before the producer's queued writes landed".into());
            }
            // The answer: its writes queued on a stream, not yet landed.
            let s = new_stream();
            htod_queued(res_buf.ptr(), &res_data, s);
            let owner = (Flag(res_dropped.clone()), res_buf.clone());
            let l = Layout::contiguous(DType::Int64, &[(n / 8) as i64]).unwrap();
            Ok(Value::Tensor(Box::new(rpc_tensor(res_buf.ptr().get(), n as u64, 0, s, l, owner).map_err(|e| RpcError::Remote(e.to_string()))?)))
        });
        reg.register("gpu", service).unwrap();
    }
    let (a, _b) = Endpoint::pair(Registry::new(), reg, RpcConfig::default()).unwrap();
    assert!(a.negotiate_native(T).unwrap());
    htod_queued(arg_buf.ptr(), &arg_data, stream);
    let arg = rpc_tensor(arg_buf.ptr().get(), n as u64, 0, stream, view, (Flag(arg_dropped.clone()), arg_buf.clone())).unwrap();
    let opts = || CallOptions { timeout: Some(T.into()), parent_call_id: None };
    let out = a.call_with("gpu", "take", vec![Value::Tensor(Box::new(arg))], Default::default(), opts()).unwrap();
    let Value::Tensor(t) = out else { panic!("expected a tensor result, got {out:?}") };
    let RpcTensor::CudaImported(imp) = *t else { panic!("expected a CUDA import") };
    let stream2 = new_stream();
    Python::attach(|py| {
        let cap = rpc_import_capsule(py, imp, stream2).unwrap();
        assert!(import_at(res_buf.ptr().get(), n as u64, 0).is_some(), "registered while torch holds it");
        let (data, len, deleter) = consume(py, cap);
        let got = read_on(data, len, stream2);
        assert!(got == res_data, "the caller read the result before the handler's queued writes landed");
        deleter();
    });
    until("the argument's owner (lease released, value gone)", || arg_dropped.load(Ordering::SeqCst) == 1);
    until("the result's owner (lease released, value gone)", || res_dropped.load(Ordering::SeqCst) == 1);
    assert!(import_at(res_buf.ptr().get(), n as u64, 0).is_none(), "left the registry with the deleter");

    // No native tensors: refused before anything is exported; the owner goes at once.
    let (c, _d) = Endpoint::pair(Registry::new(), Registry::new(), RpcConfig::default()).unwrap();
    let dropped = Arc::new(AtomicUsize::new(0));
    let t = rpc_tensor(arg_buf.ptr().get(), n as u64, 0, stream, view, Flag(dropped.clone())).unwrap();
    let e = c.call_with("gpu", "take", vec![Value::Tensor(Box::new(t))], Default::default(), opts()).unwrap_err();
    assert!(matches!(e, RpcError::CudaNotNative(_)), "{e:?}");
    assert_eq!(dropped.load(Ordering::SeqCst), 1, "nothing holds the storage after the refusal");
    // A host pointer, an empty storage, a view past the storage: refused.
    let host = [0u8; 64];
    assert!(rpc_tensor(host.as_ptr() as u64, 64, 0, 0, Layout::contiguous(DType::UInt8, &[64]).unwrap(), ()).is_err());
    assert!(rpc_tensor(arg_buf.ptr().get(), 0, 0, 0, Layout::contiguous(DType::UInt8, &[0]).unwrap(), ()).is_err());
    assert!(rpc_tensor(arg_buf.ptr().get(), 64, 0, 0, Layout::contiguous(DType::UInt8, &[65]).unwrap(), ()).is_err());
}

/// `cuda_send`'s checks: a host pointer, the wrong device, a view past the storage.
#[test]
fn cuda_send_validates_pointers_and_layouts() {
    if !gpu("cuda_send_validates_pointers_and_layouts") {
        return;
    }
    Python::initialize();
    let (a, _b) = Peer::pair(PeerConfig::default()).unwrap();
    let buf = DeviceBuffer::alloc(0, 256).unwrap();
    let host = [0u8; 256];
    let a = Python::attach(|py| py_peer(py, a));
    let a2 = Python::attach(|py| a.clone_ref(py));
    Python::attach(|py| {
        let send = |ptr: u64, nbytes: u64, device: i32, sizes: Vec<i64>| {
            cuda_send(py, a.borrow(py), py.None(), ptr, nbytes, device, 0, "uint8", sizes, vec![1], 0, 0, 0)
        };
        assert!(send(host.as_ptr() as u64, 256, 0, vec![256]).is_err(), "host memory");
        assert!(send(0, 256, 0, vec![256]).is_err(), "NULL");
        assert!(send(buf.ptr().get(), 0, 0, vec![0]).is_err(), "empty storage");
        assert!(send(buf.ptr().get(), 256, 1, vec![256]).is_err(), "device 0 memory said to be on device 1");
        let e = send(buf.ptr().get(), 256, 0, vec![257]).unwrap_err();
        assert!(e.to_string().contains("tw_peer_export_cuda") && e.to_string().contains("257"), "{e}");
        // The view's own checks, with the op's messages (`view::check_view`).
        let e = send(buf.ptr().get(), 256, 0, vec![1; 17]).unwrap_err();
        assert!(e.to_string().contains("tensorwire.send: 17 dimensions; tensorwire carries at most 16"), "{e}");
        let e = send(buf.ptr().get(), 256, 0, vec![16, 16]).unwrap_err();
        assert!(e.to_string().contains("tensorwire.send: 2 sizes but 1 strides"), "{e}");
        assert!(!send(buf.ptr().get(), 256, 0, vec![256]).unwrap());
        assert_eq!(a.borrow(py).peer.reap_now().live_leases, 1);
        // `cuda_recv` hands it over as a `CudaPending`; dropped, the lease goes back.
        let b = py_peer(py, _b);
        let p = cuda_recv(py, b.borrow(py), 10_000).unwrap();
        let p = p.bind(py).cast::<CudaPending>().unwrap().get();
        assert_eq!((p.tag(), p.nbytes(), p.view()), (0, 256, ("uint8", vec![256], vec![1], 0)));
        let e = cuda_recv(py, b.borrow(py), 0).unwrap_err();
        assert!(e.to_string().contains("tw_peer_recv"), "{e}");
    });
    Python::attach(|py| until("the lease of the dropped pending", || a2.borrow(py).peer.reap_now().live_leases == 0));
}
