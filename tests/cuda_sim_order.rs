//! Cross-process CUDA order under each wait policy (`PeerConfig::cuda_wait`): what the
//! consumer waits on, what that costs the GPU (simcuda counts cross-process event stream
//! waits, the wait that costs a time-slice switch on hardware without MPS), and what
//! happens when the producer's signal never comes (a dead producer, one that never
//! writes its word): a named error, never a stream that waits for good.
//!
//! Runs on simcuda (`simcuda/run.sh cargo test --test cuda_sim_order`) and unchanged on a
//! real GPU; the counter checks need simcuda and say SKIPPED elsewhere.

mod common;

use bytemuck::Zeroable;
use common::gpu::*;
use std::time::{Duration, Instant};
use tensorwire::cuda::driver::{ensure_context, DeviceBuffer};
use tensorwire::cuda::order::words::SignalWords;
use tensorwire::cuda::order::Signal;
use tensorwire::cuda::ring::CudaRingConfig;
use tensorwire::cuda::{CudaStream, CudaWait};
use tensorwire::lease::Exporter;
use tensorwire::peer::{KIND_CUDA_SIGNALS, KIND_TABLE, KIND_TENSOR};
use tensorwire::{Connection, DType, Error, ExportOptions, Incoming, Layout, Peer, PeerConfig, StorageKind, StorageRef, TensorDesc};

const N: usize = 4;
const BYTES: usize = 4096;

#[test]
#[ignore = "entry point of the child processes"]
fn child_entry() {
    let Some((role, peer)) = child_peer() else { return };
    match role.as_str() {
        "produce" => child_produce(&peer),
        "stuck" => child_stuck(&peer),
        "import_report" => child_import_report(&peer),
        other => panic!("unknown role {other}"),
    }
}

fn cfg(wait: CudaWait) -> PeerConfig {
    PeerConfig { cuda_wait: wait, ..PeerConfig::default() }
}

/// Child: export `N` patterned tensors, each written on its own stream right before the
/// export, then one message through its GPU ring; stay until told to go.
fn child_produce(peer: &Peer) {
    let s = Stream::new();
    let bufs: Vec<_> = (0..N).map(|_| DeviceBuffer::alloc(0, BYTES as u64).unwrap()).collect();
    let l = Layout::contiguous(DType::UInt8, &[BYTES as i64]).unwrap();
    for (i, b) in bufs.iter().enumerate() {
        htod_async(b.ptr(), &pattern(i as u8, BYTES), s.0);
        peer.export_cuda(b.ptr(), BYTES as u64, &l, s.0, Box::new(()), ExportOptions { tag: i as u64, window: None }).unwrap();
    }
    let r = DeviceBuffer::alloc(0, BYTES as u64).unwrap();
    htod_async(r.ptr(), &pattern(99, BYTES), s.0);
    peer.cuda_ring_send(r.ptr(), &l, s.0, 99, T).unwrap();
    let _ = recv_msg(peer);
    sync(s.0);
}

/// Child: export a tensor on a stream that is stuck behind a wait nobody ends, so the
/// signal for it is never written; then wait to be killed.
fn child_stuck(peer: &Peer) {
    let s = Stream::new();
    let mut never = SignalWords::create(1).unwrap();
    never.register(0).unwrap();
    never.stream_wait(0, 1, s.0).unwrap();
    let b = DeviceBuffer::alloc(0, BYTES as u64).unwrap();
    let l = Layout::contiguous(DType::UInt8, &[BYTES as i64]).unwrap();
    peer.export_cuda(b.ptr(), BYTES as u64, &l, s.0, Box::new(()), ExportOptions::default()).unwrap();
    peer.send_message(b"sent", &[]).unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

/// Child: import one tensor, read it on its own stream, report `[fnv1a, cross-process
/// event stream waits of this process]`.
fn child_import_report(peer: &Peer) {
    let imp = match peer.recv(T).unwrap() {
        Incoming::CudaTensor(t) => t,
        other => panic!("expected a CUDA tensor, got {other:?}"),
    };
    let s = Stream::new();
    imp.wait_on(s.0).unwrap();
    let bytes = dtoh_on(imp.data_ptr(), BYTES, s.0);
    imp.status().unwrap();
    let xproc = sim_stats().map_or(u64::MAX, |st| st.xproc_event_waits);
    peer.send_message(&words(&[fnv1a(&bytes), xproc]), &[]).unwrap();
    imp.release_after(s.0).unwrap();
    let _ = recv_msg(peer);
}

/// Can this process register signal words with CUDA (else producers fall back to events
/// and the word tests have nothing to check)? Says SKIPPED when not.
fn words_here(test: &str) -> bool {
    let ok = SignalWords::create(1).and_then(|mut w| w.register(0)).is_ok();
    if !ok {
        eprintln!("SKIPPED {test}: this driver cannot register host memory (signal words unused)");
    }
    ok
}

fn xproc() -> Option<u64> {
    sim_stats().map(|s| s.xproc_event_waits)
}

/// Import what the "produce" child sends (and forward the first tensor to an
/// "import_report" child): every byte as written, under `wait`; returns how many
/// cross-process event stream waits this process and the forward's last made.
fn round(wait: CudaWait) -> (Option<u64>, u64) {
    let ring = CudaRingConfig { device: 0, slots: 4, slot_bytes: BYTES as u64 };
    let env = [("TENSORWIRE_CUDA_WAIT", wait.name())];
    let before = xproc();
    let (mut producer, peer) = spawn("produce", &env, Some(ring), cfg(wait));
    let (mut last, down) = spawn("import_report", &env, None, cfg(wait));
    let s = Stream::new();
    let mut forwarded = false;
    for i in 0..N {
        let imp = match peer.recv(T).unwrap() {
            Incoming::CudaTensor(t) => std::sync::Arc::new(t),
            other => panic!("expected a CUDA tensor, got {other:?}"),
        };
        assert_eq!(imp.tag(), i as u64);
        imp.wait_on(s.0).unwrap();
        assert_eq!(dtoh_on(imp.data_ptr(), BYTES, s.0), pattern(i as u8, BYTES), "{wait}: tensor {i}");
        imp.status().unwrap();
        if !forwarded {
            down.export_cuda_imported(imp.clone(), None, s.0, ExportOptions::default()).unwrap();
            forwarded = true;
        }
    }
    let (tag, _) = peer.cuda_ring_recv(T).unwrap();
    assert_eq!(tag, 99);
    let out = DeviceBuffer::alloc(0, BYTES as u64).unwrap();
    peer.cuda_ring_recv_finish(out.ptr(), BYTES as u64, s.0, T).unwrap();
    assert_eq!(dtoh_on(out.ptr(), BYTES, s.0), pattern(99, BYTES), "{wait}: the ring message");
    let report = unwords(&recv_msg(&down));
    assert_eq!(report[0], fnv1a(&pattern(0, BYTES)), "{wait}: the forward's bytes at the last");
    let ours = before.zip(xproc()).map(|(a, b)| b - a);
    peer.send_message(b"go", &[]).unwrap();
    down.send_message(b"go", &[]).unwrap();
    producer.wait().unwrap();
    last.wait().unwrap();
    (ours, report[1])
}

#[test]
fn under_stream_and_host_no_cross_process_event_stream_wait_happens_and_under_event_they_do() {
    if !gpu("under_stream_and_host_no_cross_process_event_stream_wait_happens_and_under_event_they_do") {
        return;
    }
    for wait in CudaWait::ALL {
        let (ours, last) = round(wait);
        let Some(ours) = ours else {
            eprintln!("SKIPPED the counts of {wait}: needs simcuda's counters");
            continue;
        };
        if wait == CudaWait::Event {
            // N imports, the ring's chunk: each a GPU-side wait on the producer's event;
            // the forward's last waits on the relay's.
            assert!(ours > N as u64, "event: {ours} cross-process event stream waits here");
            assert!(last >= 1, "event: the last made {last}");
        } else {
            assert_eq!((ours, last), (0, 0), "{wait}: an import, a ring message and a forward wait on no IPC event on the GPU");
        }
    }
}

/// A raw producer in this process (so it can be made to misbehave) and a victim.
fn victim(table: &Exporter, cfg: PeerConfig) -> (Peer, Connection) {
    let (a, b) = Connection::pair().unwrap();
    let victim = std::thread::spawn(move || Peer::new(a, cfg));
    b.send(KIND_TABLE, &tensorwire::peer::setup_payload(16, 0, 0), &[table.table().fd()]).unwrap();
    let _ = b.recv(T).unwrap();
    (victim.join().unwrap().expect("victim setup"), b)
}

/// Send a tensor of `buf` that names `signal`, under a fresh lease.
fn send_signalled(table: &mut Exporter, b: &Connection, buf: &DeviceBuffer, signal: Signal) {
    let handle = tensorwire::cuda::ipc::export_pointer(buf.ptr()).unwrap().handle;
    let (lease, _) = table.grant(None, 64, Box::new(()), None).map_err(|(e, _)| e).unwrap();
    let s = StorageRef { nbytes: 64, lease_slot: lease.slot, lease_gen: lease.generation, cuda_ipc_handle: handle, ..Zeroable::zeroed() };
    let mut d = TensorDesc::new_cuda(&Layout::contiguous(DType::UInt8, &[64]).unwrap(), 0, StorageKind::CudaIpc, s);
    d.set_signal(signal);
    b.send(KIND_TENSOR, &tensorwire::peer::tensor_payload(1, &d, tensorwire::peer::NO_FD_SLOT), &[]).unwrap();
}

fn announce(b: &Connection, words: &SignalWords) {
    let mut m = 0i32.to_le_bytes().to_vec();
    m.extend_from_slice(&words.lanes().to_le_bytes());
    b.send(KIND_CUDA_SIGNALS, &m, &[words.fd()]).unwrap();
}

fn cuda_tensor(p: &Peer) -> tensorwire::CudaImported {
    match p.recv(T).unwrap() {
        Incoming::CudaTensor(t) => t,
        other => panic!("expected a CUDA tensor, got {other:?}"),
    }
}

fn stream_idle(s: CudaStream) -> bool {
    let _c = ensure_context(0).unwrap();
    // SAFETY: a live stream of the current context.
    let r = unsafe { cudarc::driver::sys::cuStreamQuery(raw(s)) };
    r == cudarc::driver::sys::CUresult::CUDA_SUCCESS
}

#[test]
fn a_producer_that_never_writes_its_word_ends_in_a_named_error_and_a_stream_that_runs_again() {
    if !gpu("a_producer_that_never_writes_its_word_ends_in_a_named_error_and_a_stream_that_runs_again") || !words_here("a_producer_that_never_writes_its_word_ends_in_a_named_error_and_a_stream_that_runs_again") {
        return;
    }
    let timeout = Duration::from_millis(300);
    let mut table = Exporter::new(16, u64::MAX).unwrap();
    let words = SignalWords::create(4).unwrap();
    let buf = DeviceBuffer::alloc(0, 4096).unwrap();

    // Stream: the call returns at once, the stream waits, and this side ends the wait at
    // its deadline; the import then says so.
    let (v, b) = victim(&table, PeerConfig { cuda_wait: CudaWait::Stream, cuda_wait_timeout: timeout.into(), ..PeerConfig::default() });
    announce(&b, &words);
    send_signalled(&mut table, &b, &buf, Signal::Word { lane: 0, value: 5 });
    let imp = cuda_tensor(&v);
    let s = Stream::new();
    let t = Instant::now();
    imp.wait_on(s.0).unwrap();
    assert!(t.elapsed() < timeout / 2, "a stream-policy wait_on returned after {:?}", t.elapsed());
    imp.status().unwrap();
    memset_async(buf.ptr(), 7, 64, s.0);
    std::thread::sleep(Duration::from_millis(50));
    assert!(!stream_idle(s.0), "the stream must wait for the word");
    sync(s.0);
    let waited = t.elapsed();
    assert!(waited >= timeout && waited < timeout + Duration::from_secs(5), "the stream ran again after {waited:?}");
    let e = imp.status().unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }) && e.to_string().contains("contents are undefined"), "{e}");
    assert_eq!(words.load(0).unwrap(), 5, "this side raised the word itself");

    // A word that arrives in time: nothing to report.
    send_signalled(&mut table, &b, &buf, Signal::Word { lane: 1, value: 3 });
    let ok = cuda_tensor(&v);
    ok.wait_on(s.0).unwrap();
    words.force(1, 3).unwrap();
    sync(s.0);
    ok.status().unwrap();
    drop((imp, ok, v));

    // Host: the call waits, and fails at the deadline naming the word.
    let (v, b) = victim(&table, PeerConfig { cuda_wait: CudaWait::Host, cuda_wait_timeout: timeout.into(), ..PeerConfig::default() });
    announce(&b, &words);
    send_signalled(&mut table, &b, &buf, Signal::Word { lane: 2, value: 9 });
    let imp = cuda_tensor(&v);
    let t = Instant::now();
    let e = imp.wait_on(s.0).unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }) && e.to_string().contains("signal word"), "{e}");
    assert!(t.elapsed() >= timeout, "{:?}", t.elapsed());
    // A lane past the announced ones is refused (and its lease given back).
    send_signalled(&mut table, &b, &buf, Signal::Word { lane: 4, value: 1 });
    let e = v.recv(T).unwrap_err();
    assert!(matches!(&e, Error::InvalidDescriptor(m) if m.contains("lane 4 out of range")), "{e}");
}

#[test]
fn a_producer_killed_before_its_signal_leaves_a_named_error_and_a_stream_that_runs_again() {
    if !gpu("a_producer_killed_before_its_signal_leaves_a_named_error_and_a_stream_that_runs_again") || !words_here("a_producer_killed_before_its_signal_leaves_a_named_error_and_a_stream_that_runs_again") {
        return;
    }
    for wait in [CudaWait::Stream, CudaWait::Host] {
        let (mut child, peer) = spawn("stuck", &[], None, PeerConfig { cuda_wait: wait, ..PeerConfig::default() });
        let imp = cuda_tensor(&peer);
        assert_eq!(recv_msg(&peer), b"sent");
        let s = Stream::new();
        let pid = child.id() as i32;
        let killer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            // SAFETY: kill(2) of our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        });
        let t = Instant::now();
        let waited = imp.wait_on(s.0);
        killer.join().unwrap();
        child.wait().unwrap();
        match wait {
            CudaWait::Host => {
                let e = waited.unwrap_err();
                assert!(e.is_peer_gone(), "host: {e}");
            }
            _ => {
                waited.unwrap();
                sync(s.0);
                let e = imp.status().unwrap_err();
                assert!(e.is_peer_gone() && e.to_string().contains(&pid.to_string()), "stream: {e}");
            }
        }
        assert!(t.elapsed() < Duration::from_secs(10), "{wait}: ended after {:?}", t.elapsed());
    }
}

/// A GPU ring on a pair in this process, under `wait`, with a stream of the producer's
/// held back by a gate word this test raises: what the producer's stream does before its
/// send is not done until then.
struct GatedRing {
    producer: Peer,
    consumer: Peer,
    gate: SignalWords,
    ps: Stream,
    cs: Stream,
}

const RING_BYTES: usize = 4 * 4096;

impl GatedRing {
    fn new(wait: CudaWait, timeout: Duration) -> GatedRing {
        let ring = CudaRingConfig { device: 0, slots: 2, slot_bytes: 4096 };
        let cfg = PeerConfig { cuda_ring: Some(ring), cuda_wait: wait, cuda_wait_timeout: timeout.into(), ..PeerConfig::default() };
        let (producer, consumer) = Peer::pair(cfg).unwrap();
        let mut gate = SignalWords::create(1).unwrap();
        gate.register(0).unwrap();
        let (ps, cs) = (Stream::new(), Stream::new());
        gate.stream_wait(0, 1, ps.0).unwrap();
        GatedRing { producer, consumer, gate, ps, cs }
    }

    /// Write `seed`'s pattern behind the gate and send it: 4 chunks through 2 slots (two
    /// reuses). The consumer receives on another thread; returns the destination and how
    /// long the send and the receive took.
    fn send_and_receive(&self, seed: u8) -> (DeviceBuffer, Duration, Result<(), Error>) {
        let src = DeviceBuffer::alloc(0, RING_BYTES as u64).unwrap();
        let dst = DeviceBuffer::alloc(0, RING_BYTES as u64).unwrap();
        htod_async(src.ptr(), &pattern(seed, RING_BYTES), self.ps.0);
        let l = Layout::contiguous(DType::UInt8, &[RING_BYTES as i64]).unwrap();
        let (consumer, cs, out) = (&self.consumer, self.cs.0, dst.ptr());
        let t = Instant::now();
        let received = std::thread::scope(|s| {
            let rx = s.spawn(move || {
                let (tag, _) = consumer.cuda_ring_recv(T)?;
                assert_eq!(tag, seed as u64);
                consumer.cuda_ring_recv_finish(out, RING_BYTES as u64, cs, T)
            });
            self.producer.cuda_ring_send(src.ptr(), &l, self.ps.0, seed as u64, T).unwrap();
            rx.join().unwrap()
        });
        let took = t.elapsed();
        // The source may go: the copies out of it are ordered before later work on `ps`.
        sync_later(src, self.ps.0);
        (dst, took, received)
    }
}

/// Keep `buf` until `stream` has run what was queued so far (a test helper: a thread).
fn sync_later(buf: DeviceBuffer, stream: CudaStream) {
    let _ = std::thread::spawn(move || {
        sync(stream);
        drop(buf);
    });
}

#[test]
fn under_stream_a_gpu_ring_message_blocks_no_thread_on_gpu_work_and_arrives_in_order() {
    if !gpu("under_stream_a_gpu_ring_message_blocks_no_thread_on_gpu_work_and_arrives_in_order")
        || !words_here("under_stream_a_gpu_ring_message_blocks_no_thread_on_gpu_work_and_arrives_in_order")
    {
        return;
    }
    let r = GatedRing::new(CudaWait::Stream, Duration::from_secs(30));
    assert!(r.consumer.cuda_ring_uses_words().unwrap(), "under stream the ring goes by its signal words");
    let (dst, took, received) = r.send_and_receive(3);
    received.unwrap();
    // Both calls returned with the producer's stream still held at the gate: the copy-in
    // of each reused slot waits on the GPU for the consumer's copy out, the copies out on
    // the GPU for the copies in.
    assert!(took < Duration::from_secs(5), "the send and receive took {took:?}");
    std::thread::sleep(Duration::from_millis(20));
    assert!(!stream_idle(r.ps.0) && !stream_idle(r.cs.0), "both streams wait behind the gate");
    r.gate.force(0, 1).unwrap();
    assert_eq!(dtoh_on(dst.ptr(), RING_BYTES, r.cs.0), pattern(3, RING_BYTES), "the bytes written behind the gate");
    // And the next message, with nothing held back, through the same (reused) slots.
    let (dst, _, received) = r.send_and_receive(4);
    received.unwrap();
    assert_eq!(dtoh_on(dst.ptr(), RING_BYTES, r.cs.0), pattern(4, RING_BYTES));
}

#[test]
fn a_gpu_ring_copy_that_never_comes_ends_the_consumers_wait_and_breaks_the_ring_by_name() {
    if !gpu("a_gpu_ring_copy_that_never_comes_ends_the_consumers_wait_and_breaks_the_ring_by_name")
        || !words_here("a_gpu_ring_copy_that_never_comes_ends_the_consumers_wait_and_breaks_the_ring_by_name")
    {
        return;
    }
    let timeout = Duration::from_millis(300);
    let r = GatedRing::new(CudaWait::Stream, timeout);
    // The gate stays shut past the consumer's `cuda_wait_timeout`: the producer's copies
    // (and its written words) never come in time.
    let (_dst, _, received) = r.send_and_receive(5);
    received.unwrap();
    let t = Instant::now();
    sync(r.cs.0);
    let waited = t.elapsed();
    assert!(waited < timeout + Duration::from_secs(5), "the consumer's stream ran again after {waited:?}");
    let e = r.consumer.cuda_ring_recv(Duration::from_millis(10)).unwrap_err();
    assert!(matches!(e, Error::Protocol(_)) && e.to_string().contains("ended by this side"), "{e}");
    let e = r.consumer.cuda_ring_recv(Duration::from_millis(10)).unwrap_err();
    assert!(matches!(e, Error::Protocol(_)) && e.to_string().contains("broken"), "stays broken: {e}");
    r.gate.force(0, 1).unwrap();
    sync(r.ps.0);
}
