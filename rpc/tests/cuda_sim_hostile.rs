//! Forged CUDA tensors against a native-mode server (a child process, `support`), on
//! simcuda (`simcuda/run.sh cargo test -p tensorwire-rpc --test cuda_sim_hostile`) or a
//! GPU. A raw client negotiates native tensors, sets the transport up by hand, and sends
//! `KIND_TENSOR` messages with crafted descriptors — zero and random IPC handles, an
//! event slot out of range, a range past the allocation, a VMM message without its fd —
//! each followed by a call naming its tag. Each call gets an error reply naming what the
//! transport refused (at once, not after the 10 s a claim waits for a tensor), every
//! lease comes back to the forger's table, its connection still answers, and a second
//! client's honest CUDA call succeeds. Without a driver: SKIPPED.

mod support;

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::*;
use tensorwire::cuda::driver::DeviceBuffer;
use tensorwire::lease::{Exporter, Reclaimed};
use tensorwire::peer::{setup_payload, tensor_payload, KIND_CUDA_EVENTS, KIND_TABLE, KIND_TENSOR, NO_FD_SLOT};
use tensorwire::{Connection, DType, Layout, StorageKind, StorageRef, TensorDesc};
use tensorwire_rpc::*;

const T: Duration = Duration::from_secs(10);

/// True if a CUDA driver with a device is loaded; otherwise says loudly that `test` was
/// skipped. Under `simcuda/run.sh` (TW_EXPECT_SIMCUDA=1) a missing driver is a failure.
fn gpu(test: &str) -> bool {
    if tensorwire::cuda::available() && tensorwire::cuda::device_count().unwrap_or(0) > 0 {
        return true;
    }
    assert!(std::env::var_os("TW_EXPECT_SIMCUDA").is_none(), "{test}: simcuda/run.sh ran this, but no CUDA driver loaded");
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: no CUDA driver loaded (run under simcuda/run.sh, or on a GPU machine)");
    false
}

/// A raw client: the RPC socket, and the transport it set up by hand after
/// `native_hello` (its own lease table; no ring).
struct Forger {
    raw: UnixStream,
    conn: Connection,
    table: Exporter,
    next_call: i64,
}

impl Forger {
    fn connect(v: &Victim) -> Forger {
        let mut raw = v.raw();
        let (mine, theirs) = tensorwire::os::seqpacket_pair().unwrap();
        let hello = frame(br#"{"kind": "call", "object_id": "__tensorwire__", "call_id": 1, "parent_call_id": null, "method": "native_hello", "args": [1], "kwargs": {}}"#);
        tensorwire::os::send_msg(raw.as_fd(), &hello, &[theirs.as_fd()], false, None).unwrap();
        drop(theirs);
        let resp = String::from_utf8(read_frame(&mut raw).unwrap()).unwrap();
        assert!(resp.contains("\"result\": true"), "native_hello refused: {resp}");
        let conn = Connection::establish(mine, T).unwrap();
        let table = Exporter::new(64, u64::MAX).unwrap();
        conn.send(KIND_TABLE, &setup_payload(64, 0, 0), &[table.table().fd()]).unwrap();
        assert_eq!(conn.recv(T).unwrap().kind, KIND_TABLE, "the server's setup");
        Forger { raw, conn, table, next_call: 100 }
    }

    /// A call of `method` whose only argument is the JSON `arg`: the response's text and
    /// how long it took.
    fn call(&mut self, method: &str, arg: &str) -> (String, Duration) {
        use std::io::Write;
        self.next_call += 1;
        let t = Instant::now();
        self.raw.write_all(&call_frame(self.next_call, method, &format!("[{arg}]"))).unwrap();
        let resp = String::from_utf8(read_frame(&mut self.raw).expect("a response")).unwrap();
        assert!(resp.contains(&format!("\"call_id\": {}", self.next_call)), "{resp}");
        (resp, t.elapsed())
    }

    /// Leases the server gave back since the last look (a reaper pass of ours).
    fn released(&mut self) -> u64 {
        let mut owners = Reclaimed::default();
        self.table.reap(Instant::now(), &mut owners);
        self.table.stats().released
    }
}

#[test]
fn forged_cuda_tensors_get_error_replies_and_leases_back_and_the_server_serves_on() {
    if victim_role().is_some() {
        run_victim(|_| {});
    }
    if !gpu("forged_cuda_tensors_get_error_replies_and_leases_back_and_the_server_serves_on") {
        return;
    }
    let v = Victim::spawn("forged_cuda_tensors_get_error_replies_and_leases_back_and_the_server_serves_on", &VictimSpec::default());
    let mut f = Forger::connect(&v);
    // Real IPC events (a pool of this process's), so that a descriptor's event claim
    // passes and the forged memory is what is refused.
    let pool = tensorwire::cuda::order::event_pool::EventPool::new(0).unwrap();
    let acks = tensorwire::Segment::create(pool.handles().len() * 8).unwrap();
    let mut events = 0i32.to_le_bytes().to_vec();
    events.extend_from_slice(&(pool.handles().len() as u32).to_le_bytes());
    for h in pool.handles() {
        events.extend_from_slice(h);
    }
    f.conn.send(KIND_CUDA_EVENTS, &events, &[acks.fd()]).unwrap();
    let buf = DeviceBuffer::alloc(0, 4096).unwrap();
    let real = tensorwire::cuda::ipc::export_pointer(buf.ptr()).unwrap().handle;
    let mut random = [0u8; 64];
    tensorwire::os::getrandom(&mut random).unwrap();

    let l = Layout::contiguous(DType::Float32, &[16]).unwrap();
    let json = |tag: u64| {
        format!(
            r#"{{"__type__": "TensorwireTensor", "tag": {tag}, "device": "cuda:0", "dtype": "torch.float32", "tensor_size": [16], "tensor_stride": [1], "tensor_offset": 0}}"#
        )
    };
    type Edit = Box<dyn Fn(&mut StorageRef)>;
    let cases: Vec<(&str, StorageKind, Edit, &str)> = vec![
        ("a zero IPC handle", StorageKind::CudaIpc, Box::new(|s| s.cuda_ipc_handle = [0; 64]), "cuIpcOpenMemHandle"),
        ("a random IPC handle", StorageKind::CudaIpc, Box::new(move |s| s.cuda_ipc_handle = random), "cuIpcOpenMemHandle"),
        ("an event slot out of range", StorageKind::CudaIpc, Box::new(move |s| s.event_slot = 999), "slot 999"),
        ("a range past the allocation", StorageKind::CudaIpc, Box::new(|s| s.base_offset = 4096 - 32), "allocation too small"),
        ("a VMM message without an fd", StorageKind::CudaVmm, Box::new(|s| s.segment_id = 4096), "carried no fd"),
    ];
    let released0 = f.released();
    for (i, (what, kind, edit, needle)) in cases.iter().enumerate() {
        let tag = 1000 + i as u64;
        let (lease, _) = f.table.grant(None, 64, Box::new(()), None).map_err(|(e, _)| e).unwrap();
        let mut s = StorageRef {
            segment_id: 0,
            base_offset: 0,
            nbytes: 64,
            lease_slot: lease.slot,
            lease_gen: lease.generation,
            cuda_ipc_handle: real,
            event_slot: 0,
            reserved0: 0,
            event_seq: 1,
            ring_seq: 0,
        };
        edit(&mut s);
        let d = TensorDesc::new_cuda(&l, 0, *kind, s);
        f.conn.send(KIND_TENSOR, &tensor_payload(tag, &d, NO_FD_SLOT), &[]).unwrap();
        let (resp, took) = f.call("cuda_nbytes", &json(tag));
        eprintln!("{what}: {resp} ({took:?})");
        assert!(!resp.contains("\"error\": null"), "{what}: the call succeeded: {resp}");
        assert!(resp.contains(needle), "{what}: expected {needle:?} in {resp}");
        assert!(took < Duration::from_secs(5), "{what}: the error reply took {took:?}");
    }
    let deadline = Instant::now() + T;
    while f.released() < released0 + cases.len() as u64 {
        assert!(Instant::now() < deadline, "leases not given back: {:?}", f.table.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(f.table.stats().granted, f.table.stats().released, "every lease back: {:?}", f.table.stats());
    // The forger's connection still serves.
    let (resp, _) = f.call("ping", "null");
    assert!(resp.contains("pong"), "{resp}");

    // Another client's honest CUDA call.
    let ep = Endpoint::connect(&v.addr, Registry::new(), RpcConfig::default()).unwrap();
    assert!(ep.negotiate_native(T).unwrap(), "the server refused native tensors to a second client");
    let mine = DeviceBuffer::alloc(0, 4096).unwrap();
    let t = CudaTensor::new(mine.ptr().get(), 4096, Layout::contiguous(DType::UInt8, &[4096]).unwrap(), 0, 0, ()).unwrap();
    let r = ep.call("calc", "cuda_nbytes", vec![Tensor::Cuda(Arc::new(t)).into()]).unwrap();
    assert_eq!(r.as_i64(), Some(4096));
    ep.close(Duration::from_secs(5));
    drop(mine);
}
