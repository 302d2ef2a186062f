//! Without a CUDA driver, every CUDA entry point fails cleanly with `CudaUnavailable`
//! (never a panic or abort), and a CUDA descriptor from a peer gives its lease back.
//! With a driver present, these checks do not apply: the GPU script
//! (`scripts/gpu_test.sh`) covers that machine.

use bytemuck::Zeroable;
use std::time::Duration;
use tensorwire::lease::Exporter;
use tensorwire::peer::{KIND_CUDA_EVENTS, KIND_TABLE, KIND_TENSOR};
use tensorwire::{Connection, DType, Error, ExportOptions, Layout, Peer, PeerConfig, StorageKind, StorageRef, TensorDesc};

const T: Duration = Duration::from_secs(10);

fn no_driver() -> bool {
    if tensorwire::cuda::available() {
        eprintln!("a CUDA driver is present: run scripts/gpu_test.sh for the GPU tests");
        return false;
    }
    eprintln!("\n*** GPU tests SKIPPED: no CUDA driver on this machine; checking CudaUnavailable paths only ***\n");
    true
}

fn unavailable(e: Error) {
    assert!(matches!(e, Error::CudaUnavailable(_)) && e.to_string().contains("no NVIDIA driver"), "expected CudaUnavailable naming the missing driver, got {e}");
}

/// A victim `Peer` (default config) set up against a hand-driven attacker end: the
/// attacker sends its lease table (and, with `gpu_ring`, what `then` sends next).
fn victim_with(table: &Exporter, gpu_ring: bool, then: impl FnOnce(&Connection)) -> (Peer, Connection) {
    let (a, b) = Connection::pair().unwrap();
    let victim = std::thread::spawn(move || Peer::new(a, PeerConfig::default()));
    b.send(KIND_TABLE, &tensorwire::peer::setup_payload(16, 0, if gpu_ring { tensorwire::peer::SETUP_HAS_CUDA_RING } else { 0 }), &[table.table().fd()]).unwrap();
    then(&b);
    let _ = b.recv(T).unwrap();
    (victim.join().unwrap().expect("victim setup"), b)
}

#[test]
fn every_cuda_entry_point_is_cuda_unavailable() {
    if !no_driver() {
        return;
    }
    use tensorwire::cuda::order::{event_pool, remote_events, CudaWait, PeerWatch};
    use tensorwire::cuda::{ipc, ring, vmm, CudaStream, DevicePtr};
    let me = std::sync::Arc::new(PeerWatch::new(std::process::id() as i32));
    let wait = tensorwire::Wait::For(std::time::Duration::from_secs(5));
    unavailable(tensorwire::cuda::device_count().unwrap_err());
    unavailable(ipc::export_pointer(DevicePtr(0x7000_0000)).unwrap_err());
    unavailable(ipc::cache().open(0, [1; 64]).err().unwrap());
    unavailable(event_pool::EventPool::new(0).err().unwrap());
    // The producer's events cannot be opened here: an ack-only view, so imports that fail
    // still hand the producer's event slots back (else its pool would jam).
    let acks = tensorwire::Segment::create(4096).unwrap();
    let producer_view = tensorwire::Segment::from_fd(acks.fd().try_clone_to_owned().unwrap(), 16).unwrap();
    let events = std::sync::Arc::new(remote_events::RemoteEvents::open(0, &[[0; 64], [0; 64]], acks, CudaWait::Stream, wait, me.clone()).unwrap());
    let why = events.usable().unwrap_err();
    assert!(matches!(why, Error::CudaUnavailable(_)) && why.to_string().contains("no NVIDIA driver"), "{why}");
    let e = events.claim(2, 1).err().unwrap();
    assert!(matches!(e, Error::InvalidDescriptor(_)) && e.to_string().contains("slot 2 out of range (2 events)"), "{e}");
    let claim = events.claim(1, 7).unwrap();
    unavailable(claim.wait_on(CudaStream::LEGACY).unwrap_err());
    let ack = |slot: usize| {
        let mut w = [0u8; 8];
        producer_view.read_at(slot * 8, &mut w).unwrap();
        u64::from_le_bytes(w)
    };
    assert_eq!(ack(1), 0, "a wait that was not enqueued must not acknowledge");
    drop(claim);
    assert_eq!(ack(1), 7, "a claim dropped without a wait acknowledges its record");
    let e = remote_events::RemoteEvents::open(0, &[[0; 64]; 3], tensorwire::Segment::create(16).unwrap(), CudaWait::Stream, wait, me.clone()).err().unwrap();
    assert!(matches!(e, Error::Protocol(_)), "an ack table too small for the events is refused: {e}");
    unavailable(vmm::VmmAllocation::create(0, 1 << 20).err().unwrap());
    let seg = tensorwire::Segment::create(4096).unwrap();
    let fd = seg.fd().try_clone_to_owned().unwrap();
    unavailable(vmm::VmmAllocation::import_fd(&fd, 0, 4096).err().unwrap());
    unavailable(vmm::export_pointer(DevicePtr(0x7000_0000), 64).unwrap_err());
    unavailable(ring::CudaRingSender::create(ring::CudaRingConfig::default(), CudaWait::Stream, wait, me.clone()).err().unwrap());
    let with_ring = PeerConfig { cuda_ring: Some(ring::CudaRingConfig::default()), ..PeerConfig::default() };
    unavailable(Peer::pair(with_ring).unwrap_err());

    let (a, _b) = Peer::pair(PeerConfig::default()).unwrap();
    let l = Layout::contiguous(DType::Float32, &[16]).unwrap();
    let dropped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    struct Flag(std::sync::Arc<std::sync::atomic::AtomicBool>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
    let e = a.export_cuda(DevicePtr(0x7000_0000), 64, &l, CudaStream::LEGACY, Box::new(Flag(dropped.clone())), ExportOptions::default()).unwrap_err();
    unavailable(e);
    assert!(dropped.load(std::sync::atomic::Ordering::SeqCst), "the owner of a failed export must be dropped");
    assert_eq!(a.export_stats().live_leases, 0);

    // No GPU ring configured on either side: clear errors naming the setting.
    let e = a.cuda_ring_send(DevicePtr(0x7000_0000), &l, CudaStream::LEGACY, 1, T).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("cuda_ring"), "{e}");
    let e = a.cuda_ring_recv(T).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("offered no GPU ring"), "{e}");
}

/// A producer's event-pool announcement: device 0, `n` (made-up) event handles.
fn event_pool_message(n: u32) -> Vec<u8> {
    let mut ev = 0i32.to_le_bytes().to_vec();
    ev.extend_from_slice(&n.to_le_bytes());
    ev.extend_from_slice(&vec![7u8; 64 * n as usize]);
    ev
}

#[test]
fn cuda_messages_from_a_peer_are_cuda_unavailable_and_leases_come_back() {
    if !no_driver() {
        return;
    }
    let mut table = Exporter::new(16, u64::MAX).unwrap();
    let (victim, b) = victim_with(&table, false, |_| {});

    // The producer's event pool: the victim cannot open it without a driver.
    let acks = tensorwire::Segment::create(4096).unwrap();
    b.send(KIND_CUDA_EVENTS, &event_pool_message(2), &[acks.fd()]).unwrap();
    unavailable(victim.recv(T).unwrap_err());

    // A CUDA tensor under a live lease: refused, and the lease released.
    let seg = std::sync::Arc::new(tensorwire::Segment::create(64).unwrap());
    let (lease, _) = table.grant(Some(&seg), 64, Box::new(()), None).map_err(|(e, _)| e).unwrap();
    let l = Layout::contiguous(DType::Float16, &[32]).unwrap();
    let d = TensorDesc::new_cuda(&l, 0, StorageKind::CudaIpc, StorageRef {
        nbytes: 64,
        lease_slot: lease.slot,
        lease_gen: lease.generation,
        cuda_ipc_handle: [3; 64],
        ..Zeroable::zeroed()
    });
    let p = tensorwire::peer::tensor_payload(9, &d, tensorwire::peer::NO_FD_SLOT);
    b.send(KIND_TENSOR, &p, &[]).unwrap();
    let e = victim.recv(T).unwrap_err();
    // Without a driver the tensor is refused for that, whatever else is wrong with it.
    unavailable(e);
    let mut owners = tensorwire::lease::Reclaimed::default();
    table.reap(std::time::Instant::now(), &mut owners);
    assert_eq!(table.stats().released, 1, "the refused CUDA tensor's lease must be released");
    // Malformed event messages are protocol errors, not panics.
    b.send(KIND_CUDA_EVENTS, &[1, 2, 3], &[]).unwrap();
    assert!(matches!(victim.recv(T).unwrap_err(), Error::Protocol(_)));
    let mut bad = 0i32.to_le_bytes().to_vec();
    bad.extend_from_slice(&5000u32.to_le_bytes());
    b.send(KIND_CUDA_EVENTS, &bad, &[acks.fd()]).unwrap();
    {
        let e = victim.recv(T).unwrap_err();
        assert!(matches!(e, Error::Protocol(_)) && e.to_string().contains("announces 5000 events"), "{e}");
    }
}

/// A producer that offers a GPU ring to a consumer without CUDA: the connection still
/// comes up (CPU traffic works), the consumer refuses the ring in the shared control
/// block — so the producer's sends fail with a clear error instead of timing out — and
/// the consumer's GPU ring receives say why.
#[test]
fn a_gpu_ring_offered_to_a_machine_without_cuda_is_refused_cleanly() {
    if !no_driver() {
        return;
    }
    use tensorwire::cuda::ring::{CudaRingConfig, RingSetup};
    use tensorwire::peer::KIND_CUDA_RING;
    let table = Exporter::new(16, u64::MAX).unwrap();
    let cfg = CudaRingConfig { device: 0, slots: 2, slot_bytes: 4096 };
    let setup = RingSetup { cfg, arena: [9; 64], desc_ring_bytes: 65536, words: false, written: vec![[4; 64]; 2] };
    let ctrl = tensorwire::Segment::create(4096).unwrap();
    let descs = tensorwire::ring::RingShared::create(65536).unwrap();
    // A refused GPU ring must not fail the connection.
    let (victim, b) = victim_with(&table, true, |b| {
        b.send(KIND_CUDA_RING, &setup.encode(), &[ctrl.fd(), descs.segment().fd()]).unwrap();
    });

    let mut state = [0u8; 4];
    ctrl.read_at(128, &mut state).unwrap();
    assert_eq!(u32::from_le_bytes(state), 2, "the consumer must mark the ring refused in the control block");
    let e = victim.cuda_ring_recv(T).unwrap_err();
    assert!(matches!(e, Error::CudaUnavailable(_)) && e.to_string().contains("could not be opened here"), "{e}");
    b.send(tensorwire::peer::KIND_USER, b"still here", &[]).unwrap();
    match victim.recv(T).unwrap() {
        tensorwire::Incoming::Message { payload, .. } => assert_eq!(payload, b"still here"),
        other => panic!("expected the user message, got {other:?}"),
    }
}

/// CUDA VMM tensors (fd-shared allocations): refused with CudaUnavailable here and the
/// lease given back; a VMM descriptor without its fd, or an IPC one with an fd, is a
/// protocol error.
#[test]
fn vmm_tensors_from_a_peer_are_cuda_unavailable_and_leases_come_back() {
    if !no_driver() {
        return;
    }
    let mut table = Exporter::new(16, u64::MAX).unwrap();
    let (victim, b) = victim_with(&table, false, |_| {});
    let acks = tensorwire::Segment::create(4096).unwrap();
    let ev = event_pool_message(1);

    let seg = std::sync::Arc::new(tensorwire::Segment::create(64).unwrap());
    let l = Layout::contiguous(DType::Float16, &[32]).unwrap();
    let fake_fd = tensorwire::Segment::create(4096).unwrap();
    let mut released = 0;
    for (kind, with_fd, want) in [
        (StorageKind::CudaVmm, true, "unavailable"),
        (StorageKind::CudaVmm, false, "carried no fd"),
        (StorageKind::CudaIpc, true, "carried an fd"),
    ] {
        let (lease, _) = table.grant(Some(&seg), 64, Box::new(()), None).map_err(|(e, _)| e).unwrap();
        let d = TensorDesc::new_cuda(&l, 0, kind, StorageRef {
            segment_id: 2 << 20,
            nbytes: 64,
            lease_slot: lease.slot,
            lease_gen: lease.generation,
            ..Zeroable::zeroed()
        });
        let p = tensorwire::peer::tensor_payload(9, &d, tensorwire::peer::NO_FD_SLOT);
        let fds: Vec<_> = if with_fd { vec![fake_fd.fd()] } else { vec![] };
        b.send(KIND_TENSOR, &p, &fds).unwrap();
        let e = victim.recv(T).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(want) || msg.contains("before the producer's IPC events"), "{kind:?} fd={with_fd}: {e}");
        if want == "unavailable" {
            // Also once the (unopenable) events were announced.
            b.send(KIND_CUDA_EVENTS, &ev, &[acks.fd()]).unwrap();
            unavailable(victim.recv(T).unwrap_err());
            let mut owners = tensorwire::lease::Reclaimed::default();
            table.reap(std::time::Instant::now(), &mut owners);
            released += 1;
            assert_eq!(table.stats().released, released, "the refused VMM tensor's lease must be released");
        }
    }
}
