//! CUDA tensors over RPC in native mode, between two processes: a client here and a
//! server in a child process (this test binary re-run as `child_entry`), each allocating
//! device memory through the driver API. Runs on simcuda (`simcuda/run.sh cargo test -p
//! tensorwire-rpc --test cuda_sim`) and, unchanged, on a GPU; without a driver the GPU
//! tests print a SKIPPED line and the no-driver test checks the named error instead.
//!
//! The server reads what the client sent only after `wait_on` (the client's last writes
//! are asynchronous copies still queued on its stream when the call goes out), answers
//! with a tensor whose writes are likewise still queued, and the client reads that after
//! its own `wait_on`; with simcuda's random stream delays a missing wait reads stale
//! bytes.

use cudarc::driver::sys;
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tensorwire::cuda::CudaStream;
use tensorwire::cuda::driver::{DeviceBuffer, call, ensure_context};
use tensorwire::{DType, Layout};
use tensorwire_rpc::*;
use tensorwire_test_support::{RoleCommand, pattern, role, wait_until};

const FD_ENV: &str = "TW_RPC_CUDA_FD";
/// No server child outlives this, whatever the parent does.
const CHILD_DEADLINE: Duration = Duration::from_secs(120);

// ---- the driver, directly (as a user's own CUDA code would) ----

/// True if a CUDA driver with a device is loaded; otherwise says loudly that `test` was
/// skipped. Under `simcuda/run.sh` (TW_EXPECT_SIMCUDA=1) a missing driver is a failure.
fn gpu(test: &str) -> bool {
    if tensorwire::cuda::available() && tensorwire::cuda::device_count().unwrap_or(0) > 0 {
        return true;
    }
    assert!(std::env::var_os("TW_EXPECT_SIMCUDA").is_none(), "{test}: simcuda/run.sh ran this, but no CUDA driver loaded");
    skipped(&format!("SKIPPED {test}: no CUDA driver loaded (run under simcuda/run.sh, or on a GPU machine)"));
    false
}

/// Straight to stderr, past libtest's capture (which only takes `eprintln!`), so a skip
/// shows in every run.
fn skipped(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// A stream of device 0, never destroyed: exports record events on it after the handler
/// that made them has returned (when the response is encoded).
fn new_stream() -> usize {
    let _c = ensure_context(0).unwrap();
    let mut s: sys::CUstream = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    call("cuStreamCreate", || unsafe { sys::cuStreamCreate(&mut s, 0) }).unwrap();
    s as usize
}

/// Queue a copy of `bytes` to `dptr` on `stream` (pageable memory: staged before the call
/// returns, so `bytes` may go; the copy itself lands later).
fn htod_async(dptr: u64, bytes: &[u8], stream: usize) {
    let _c = ensure_context(0).unwrap();
    // SAFETY: `bytes` is readable for its length; dptr is a live allocation of ours with
    // room for it.
    call("cuMemcpyHtoDAsync", || unsafe { sys::cuMemcpyHtoDAsync_v2(dptr, bytes.as_ptr().cast(), bytes.len(), stream as sys::CUstream) })
        .unwrap();
}

/// Queue `bytes` to `dptr` on `stream` as 16 copies: each waits its own random delay on
/// simcuda, so the last lands well after the call that sends the tensor has gone out —
/// a reader that skips `wait_on` sees stale bytes.
fn htod_queued(dptr: u64, bytes: &[u8], stream: usize) {
    let chunk = bytes.len().div_ceil(16).max(1);
    for (i, c) in bytes.chunks(chunk).enumerate() {
        htod_async(dptr + (i * chunk) as u64, c, stream);
    }
}

/// Read `n` bytes at `dptr`, ordered on `stream`, then synchronize that stream.
fn dtoh_on(dptr: u64, n: usize, stream: usize) -> Vec<u8> {
    let _c = ensure_context(0).unwrap();
    let mut v = vec![0u8; n];
    // SAFETY: `v` has room for n bytes; dptr names n readable device bytes (an import's
    // storage); the stream is synchronized before `v` is used.
    call("cuMemcpyDtoHAsync", || unsafe { sys::cuMemcpyDtoHAsync_v2(v.as_mut_ptr().cast(), dptr, n, stream as sys::CUstream) }).unwrap();
    // SAFETY: a live stream of the current context.
    call("cuStreamSynchronize", || unsafe { sys::cuStreamSynchronize(stream as sys::CUstream) }).unwrap();
    v
}

fn first_difference(got: &[u8], want: &[u8]) -> Option<usize> {
    (got.len() != want.len()).then_some(got.len().min(want.len())).or_else(|| got.iter().zip(want).position(|(a, b)| a != b))
}

/// A device allocation that counts itself in `alive` until dropped (the tensor's owner).
struct Counted {
    _buf: DeviceBuffer,
    alive: Arc<AtomicUsize>,
}

impl Counted {
    fn alloc(n: u64, alive: &Arc<AtomicUsize>) -> Counted {
        alive.fetch_add(1, Ordering::SeqCst);
        Counted { _buf: DeviceBuffer::alloc(0, n).unwrap(), alive: alive.clone() }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.alive.fetch_sub(1, Ordering::SeqCst);
    }
}

// ---- the server (child process) ----

fn server_registry() -> Registry {
    static STREAM: OnceLock<usize> = OnceLock::new();
    static ANSWERS: OnceLock<Arc<AtomicUsize>> = OnceLock::new();
    static HELD: Mutex<Vec<Value>> = Mutex::new(Vec::new());
    let stream = || *STREAM.get_or_init(new_stream);
    let answers = || ANSWERS.get_or_init(Default::default).clone();
    let imported = |a: &Args| match a.req(0, "t")?.as_tensor() {
        Some(Tensor::CudaImported(t)) => Ok(t.clone()),
        other => Err(RpcError::InvalidArgument(format!("expected a CUDA tensor, got {other:?}"))),
    };
    let svc = Service::new("Gpu")
        // check(t, seed): the storage must hold pattern(seed); answers [u, sizes, strides,
        // offset] where u is a CUDA tensor of the same layout holding pattern(seed + 1).
        .method("check", move |_, a| {
            let t = imported(&a)?;
            let seed = a.req(1, "seed")?.as_i64().unwrap_or(0) as u8;
            let s = stream();
            t.wait_on(CudaStream(s))?;
            let n = t.storage_nbytes() as usize;
            let got = dtoh_on(t.storage_ptr().get(), n, s);
            if let Some(i) = first_difference(&got, &pattern(seed, n)) {
                return Err(RpcError::Remote(format!("server read other bytes than the client wrote, first at byte {i}")));
            }
            let l = t.layout();
            let owner = Counted::alloc(n as u64, &answers());
            let ptr = owner._buf.ptr();
            htod_queued(ptr.get(), &pattern(seed.wrapping_add(1), n), s);
            let u = CudaTensor::new(ptr.get(), n as u64, l, 0, s, owner)?;
            let ints = |v: &[i64]| Value::Array(v.iter().map(|&x| Value::Int(x)).collect());
            Ok(Value::Array(vec![Tensor::Cuda(Arc::new(u)).into(), ints(l.sizes()), ints(l.strides()), Value::Int(l.storage_offset)]))
        })
        // hold(t): keep the argument past the call (its lease stays out).
        .method("hold", move |_, a| {
            imported(&a)?;
            HELD.lock().unwrap().push(a.req(0, "t")?.clone());
            Ok(Value::Null)
        })
        .method("drop_held", |_, _| {
            let n = std::mem::take(&mut *HELD.lock().unwrap()).len();
            Ok(Value::Int(n as i64))
        })
        .method("answers_alive", move |_, _| Ok(Value::Int(answers().load(Ordering::SeqCst) as i64)));
    let reg = Registry::new();
    reg.register("gpu", svc).unwrap();
    reg
}

/// The child's entry: serve the parent until it closes the connection.
#[test]
#[ignore = "entry point of the server child process"]
fn child_entry() {
    let Ok(fd) = std::env::var(FD_ENV) else { return };
    assert_eq!(role().as_deref(), Some("server"));
    std::thread::spawn(|| {
        std::thread::sleep(CHILD_DEADLINE);
        std::process::exit(3);
    });
    // SAFETY: the parent handed us this inherited fd number; nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd.parse().unwrap()) };
    let ep = Endpoint::from_fd(fd, server_registry(), RpcConfig::default()).unwrap();
    ep.wait_closed();
}

struct Server {
    child: Child,
    ep: Endpoint,
}

impl Server {
    fn spawn() -> Server {
        let (mine, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut cmd = RoleCommand::new("server").test("child_entry").stdout(Stdio::null()).command();
        let fd = tensorwire::os::inherit_in_child(&mut cmd, std::os::fd::AsFd::as_fd(&theirs));
        cmd.env(FD_ENV, fd.to_string());
        let child = cmd.spawn().unwrap();
        drop(theirs);
        let ep = Endpoint::from_fd(mine.into(), Registry::new(), RpcConfig::default()).unwrap();
        assert!(ep.negotiate_native(Duration::from_secs(10)).unwrap(), "the server refused native tensors");
        Server { child, ep }
    }
    fn int(&self, method: &str) -> i64 {
        self.ep.call("gpu", method, vec![]).unwrap().as_i64().unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.ep.close(Duration::from_secs(5));
        let _ = self.child.wait();
    }
}

// ---- the tests ----

/// A CUDA argument the server checks, a CUDA answer the client checks (a transposed view
/// both ways, each write still queued on its stream when it is sent), and every lease
/// given back afterwards: the client's owner once the handler returned and the client
/// dropped its own value, the server's once the client dropped the answer.
#[test]
fn cuda_call_both_ways_then_leases_back() {
    if !gpu("cuda_call_both_ways_then_leases_back") {
        return;
    }
    let srv = Server::spawn();
    let s = new_stream();
    let alive = Arc::new(AtomicUsize::new(0));
    let view = Layout::contiguous(DType::Float32, &[32, 16]).unwrap().transpose(0, 1).unwrap();
    let n = 32 * 16 * 4;
    for round in 0..4u8 {
        let seed = 10 * round + 1;
        let owner = Counted::alloc(n, &alive);
        let ptr = owner._buf.ptr();
        htod_queued(ptr.get(), &pattern(seed, n as usize), s);
        let t = CudaTensor::new(ptr.get(), n, view, 0, s, owner).unwrap();
        let r = srv.ep.call("gpu", "check", vec![Tensor::Cuda(Arc::new(t)).into(), Value::Int(seed.into())]).unwrap();
        // The handler has returned and our value is gone: the lease comes back.
        wait_until("the client's lease back after the call", Duration::from_secs(10), || alive.load(Ordering::SeqCst) == 0);

        let Value::Array(r) = r else { panic!("check answered {r:?}") };
        let ints = |v: &Value| v.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect::<Vec<_>>();
        assert_eq!((ints(&r[1]), ints(&r[2]), r[3].as_i64()), (view.sizes().to_vec(), view.strides().to_vec(), Some(0)), "the layout the server saw");
        let Some(Tensor::CudaImported(u)) = r[0].as_tensor() else { panic!("the answer is not a CUDA tensor: {:?}", r[0]) };
        assert_eq!(u.layout(), view);
        assert_eq!(u.device(), 0);
        u.wait_on(CudaStream(s)).unwrap();
        let got = dtoh_on(u.storage_ptr().get(), u.storage_nbytes() as usize, s);
        assert_eq!(first_difference(&got, &pattern(seed + 1, n as usize)), None, "round {round}: the client read other bytes than the server wrote");
        assert_eq!(srv.int("answers_alive"), 1, "the server's answer must stay alive while the client holds it");
        drop(r);
        wait_until("the server's lease back after the client dropped the answer", Duration::from_secs(10), || srv.int("answers_alive") == 0);
    }
}

/// A handler that keeps its CUDA argument keeps the lease out after the call returns; the
/// lease comes back when it drops the value.
#[test]
fn cuda_lease_held_until_the_handler_drops_it() {
    if !gpu("cuda_lease_held_until_the_handler_drops_it") {
        return;
    }
    let srv = Server::spawn();
    let s = new_stream();
    let alive = Arc::new(AtomicUsize::new(0));
    let owner = Counted::alloc(4096, &alive);
    let ptr = owner._buf.ptr();
    let t = CudaTensor::new(ptr.get(), 4096, Layout::contiguous(DType::UInt8, &[4096]).unwrap(), 0, s, owner).unwrap();
    assert_eq!(srv.ep.call("gpu", "hold", vec![Tensor::Cuda(Arc::new(t)).into()]).unwrap(), Value::Null);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(alive.load(Ordering::SeqCst), 1, "the lease came back while the server still holds the tensor");
    assert_eq!(srv.int("drop_held"), 1);
    wait_until("the lease back after the server dropped the tensor", Duration::from_secs(10), || alive.load(Ordering::SeqCst) == 0);
}

/// Named errors on the sending side: a view larger than its storage, and a CUDA tensor
/// on a connection without native tensors.
#[test]
fn cuda_send_errors_are_named() {
    if !gpu("cuda_send_errors_are_named") {
        return;
    }
    let buf = DeviceBuffer::alloc(0, 256).unwrap();
    let l = Layout::contiguous(DType::Float32, &[128]).unwrap();
    match CudaTensor::new(buf.ptr().get(), 256, l, 0, 0, ()) {
        Err(RpcError::InvalidArgument(m)) => assert!(m.contains("needs 512 bytes"), "{m}"),
        other => panic!("a 512-byte view of 256 bytes gave {:?}", other.map(|_| ())),
    }
    let reg = Registry::new();
    reg.register("echo", Service::new("Echo").method("id", |_, a| Ok(a.req(0, "x")?.clone()))).unwrap();
    let (_server, client) = Endpoint::pair(reg, Registry::new(), RpcConfig::default()).unwrap();
    let t = CudaTensor::new(buf.ptr().get(), 256, Layout::contiguous(DType::Float32, &[64]).unwrap(), 0, 0, ()).unwrap();
    match client.call("echo", "id", vec![Tensor::Cuda(Arc::new(t)).into()]) {
        Err(RpcError::CudaNotNative(m)) => assert!(m.contains("negotiate_native"), "{m}"),
        other => panic!("a CUDA tensor without native mode gave {other:?}"),
    }
}

/// Without a driver, making a CUDA tensor is `CudaUnavailable` (runs in the plain test
/// run, where no driver is loaded).
#[test]
fn cuda_unavailable_without_a_driver() {
    if tensorwire::cuda::available() {
        skipped("SKIPPED cuda_unavailable_without_a_driver: a CUDA driver is loaded (this case runs without one)");
        return;
    }
    let l = Layout::contiguous(DType::UInt8, &[16]).unwrap();
    match CudaTensor::new(0x1000, 16, l, 0, 0, ()) {
        Err(e @ RpcError::CudaUnavailable(_)) => assert!(e.to_string().starts_with("CUDA unavailable"), "{e}"),
        other => panic!("without a driver CudaTensor::new gave {:?}", other.map(|_| ())),
    }
}

// ---- a sandboxed worker (its own pid namespace) ----

/// The sandboxed worker's entry: serve the same methods as the server child, inside the
/// sandbox its supervisor asked for.
#[test]
#[ignore = "entry point of the sandboxed worker process"]
fn sandboxed_worker_entry() {
    if role().as_deref() != Some("sandboxed") {
        return;
    }
    let r = tensorwire_rpc::worker::serve(server_registry(), RpcConfig::default());
    std::process::exit(if r.is_ok() { 0 } else { 70 });
}

/// A sandboxed GPU worker (pid 1 of its own pid namespace, landlocked, seccomp) receives a
/// CUDA tensor of cudaMalloc memory, checks its bytes, and answers with a CUDA tensor of
/// its own, which the host checks. Neither side can open the other's legacy IPC handles
/// across the namespace boundary (simcuda refuses them, as the driver does): both
/// directions travel by VMM fd.
#[test]
fn cuda_through_a_sandboxed_worker() {
    if !gpu("cuda_through_a_sandboxed_worker") {
        return;
    }
    let child = RoleCommand::new("sandboxed").test("sandboxed_worker_entry").quiet();
    let mut spec = child
        .vars()
        .into_iter()
        .fold(WorkerSpec::new(RoleCommand::program()).args(child.argv()), |s, (k, v)| s.env(k, v))
        .native_tensors(true)
        .handshake_timeout(Duration::from_secs(30))
        .call_timeout(Duration::from_secs(30))
        .sandbox(tensorwire_rpc::worker::Sandbox { gpu: true, ..Default::default() });
    // The simulated driver's settings (seed, delays, features) are the host's.
    for (k, v) in std::env::vars().filter(|(k, _)| k.starts_with("SIMCUDA_")) {
        spec = spec.env(k, v);
    }
    let w = match spec.spawn() {
        Err(RpcError::Unsupported(why)) => return skipped(&format!("SKIPPED cuda_through_a_sandboxed_worker: {why}")),
        r => r.unwrap(),
    };
    assert_eq!(w.call("gpu", "answers_alive", vec![]).unwrap(), Value::Int(0));
    let s = new_stream();
    let alive = Arc::new(AtomicUsize::new(0));
    let view = Layout::contiguous(DType::Float32, &[24, 8]).unwrap().transpose(0, 1).unwrap();
    let n = 24 * 8 * 4;
    for round in 0..3u8 {
        let seed = 7 * round + 3;
        let owner = Counted::alloc(n, &alive);
        let ptr = owner._buf.ptr();
        htod_queued(ptr.get(), &pattern(seed, n as usize), s);
        let t = CudaTensor::new(ptr.get(), n, view, 0, s, owner).unwrap();
        let r = w.call("gpu", "check", vec![Tensor::Cuda(Arc::new(t)).into(), Value::Int(seed.into())]);
        if std::env::var_os("SIMCUDA_NO_HOST_REGISTER").is_some() {
            // No signal words here, and IPC events do not cross the namespace: refused
            // before anything is sent, saying why.
            match r {
                Err(RpcError::Transport { message: m, .. }) | Err(RpcError::CudaUnavailable(m)) => assert!(m.contains("another pid namespace"), "{m}"),
                other => panic!("a CUDA tensor to a sandboxed worker without signal words gave {other:?}"),
            }
            wait_until("the host's lease back after the refusal", Duration::from_secs(10), || alive.load(Ordering::SeqCst) == 0);
            return;
        }
        let r = r.unwrap();
        wait_until("the host's lease back after the call", Duration::from_secs(10), || alive.load(Ordering::SeqCst) == 0);
        let Value::Array(r) = r else { panic!("check answered {r:?}") };
        let Some(Tensor::CudaImported(u)) = r[0].as_tensor() else { panic!("the answer is not a CUDA tensor: {:?}", r[0]) };
        assert_eq!(u.layout(), view);
        u.wait_on(CudaStream(s)).unwrap();
        let got = dtoh_on(u.storage_ptr().get(), u.storage_nbytes() as usize, s);
        assert_eq!(first_difference(&got, &pattern(seed + 1, n as usize)), None, "round {round}: the host read other bytes than the worker wrote");
        drop(r);
        wait_until("the worker's lease back after the host dropped the answer", Duration::from_secs(10), || {
            w.call("gpu", "answers_alive", vec![]).unwrap() == Value::Int(0)
        });
    }
}
