//! A hostile producer's CUDA messages against a victim with a working driver (simcuda, or a
//! real GPU): forged IPC event and memory handles, offsets past the allocation, event slots
//! out of range. Each is a clear error from `recv`, never a panic or a mapping of the wrong
//! memory, and the lease named by the descriptor is released. Without a driver: SKIPPED
//! (tests/cuda_unavailable.rs covers that case).

mod common;

use bytemuck::Zeroable;
use common::gpu::gpu;
use std::time::Duration;
use tensorwire::cuda::driver::DeviceBuffer;
use tensorwire::lease::Exporter;
use tensorwire::peer::{KIND_CUDA_EVENTS, KIND_TABLE, KIND_TENSOR};
use tensorwire::{Connection, DType, Error, ErrorKind, Layout, Peer, PeerConfig, StorageKind, StorageRef, TensorDesc};

const T: Duration = Duration::from_secs(10);

fn victim(table: &Exporter) -> (Peer, Connection) {
    let (a, b) = Connection::pair().unwrap();
    let victim = std::thread::spawn(move || Peer::new(a, PeerConfig::default()));
    b.send(KIND_TABLE, &tensorwire::peer::setup_payload(16, 0, 0), &[table.table().fd()]).unwrap();
    let _ = b.recv(T).unwrap();
    (victim.join().unwrap().expect("victim setup"), b)
}

fn events_message(handles: &[[u8; 64]]) -> Vec<u8> {
    let mut m = 0i32.to_le_bytes().to_vec();
    m.extend_from_slice(&(handles.len() as u32).to_le_bytes());
    for h in handles {
        m.extend_from_slice(h);
    }
    m
}

/// Send a CUDA IPC tensor descriptor under a fresh lease; the victim's error, and whether
/// the lease was released.
fn send_tensor(table: &mut Exporter, victim: &Peer, b: &Connection, edit: impl FnOnce(&mut StorageRef)) -> (Error, bool) {
    let seg = std::sync::Arc::new(tensorwire::Segment::create(64).unwrap());
    let (lease, _) = table.grant(Some(&seg), 64, Box::new(()), None).map_err(|(e, _)| e).unwrap();
    let l = Layout::contiguous(DType::Float32, &[16]).unwrap();
    let mut s = StorageRef { nbytes: 64, lease_slot: lease.slot, lease_gen: lease.generation, event_seq: 1, ..Zeroable::zeroed() };
    edit(&mut s);
    let d = TensorDesc::new_cuda(&l, 0, StorageKind::CudaIpc, s);
    let p = tensorwire::peer::tensor_payload(1, &d, tensorwire::peer::NO_FD_SLOT);
    b.send(KIND_TENSOR, &p, &[]).unwrap();
    let e = victim.recv(T).unwrap_err();
    let released_before = table.stats().released;
    let mut owners = tensorwire::lease::Reclaimed::default();
    table.reap(std::time::Instant::now(), &mut owners);
    (e, table.stats().released == released_before + 1)
}

#[test]
fn forged_cuda_messages_are_errors_and_give_their_leases_back() {
    if !gpu("forged_cuda_messages_are_errors_and_give_their_leases_back") {
        return;
    }
    let mut table = Exporter::new(16, u64::MAX).unwrap();
    let (v, b) = victim(&table);
    // Forged event handles: the driver refuses them; the victim says so and keeps an
    // ack-only view (imports still fail cleanly and acknowledge).
    let acks = tensorwire::Segment::create(4096).unwrap();
    b.send(KIND_CUDA_EVENTS, &events_message(&[[7; 64], [8; 64]]), &[acks.fd()]).unwrap();
    let e = v.recv(T).unwrap_err();
    assert!(matches!(e, Error::CudaUnavailable(_)) && e.to_string().contains("cuIpcOpenEventHandle"), "{e}");
    let (e, released) = send_tensor(&mut table, &v, &b, |s| s.cuda_ipc_handle = [3; 64]);
    assert!(released, "lease of a refused import released ({e})");

    // Real events (this process's own pool), then forged and out-of-range descriptors.
    let pool = tensorwire::cuda::order::event_pool::EventPool::new(0).unwrap();
    let acks = tensorwire::Segment::create(pool.handles().len() * 8).unwrap();
    b.send(KIND_CUDA_EVENTS, &events_message(pool.handles()), &[acks.fd()]).unwrap();
    let buf = DeviceBuffer::alloc(0, 4096).unwrap();
    let real = tensorwire::cuda::ipc::export_pointer(buf.ptr()).unwrap().handle;

    let (e, released) = send_tensor(&mut table, &v, &b, |s| s.cuda_ipc_handle = [3; 64]);
    assert!(matches!(&e, Error::Cuda { call: "cuIpcOpenMemHandle", .. }), "forged memory handle: {e}");
    assert!(released, "lease released after a forged handle");

    let (e, released) = send_tensor(&mut table, &v, &b, |s| {
        s.cuda_ipc_handle = real;
        s.base_offset = 4096 - 32;
    });
    assert!(matches!(&e, Error::InvalidDescriptor(m) if m.contains("allocation too small")), "past the end: {e}");
    assert!(released, "lease released after a range past the allocation");

    let (e, released) = send_tensor(&mut table, &v, &b, |s| {
        s.cuda_ipc_handle = real;
        s.event_slot = 999;
    });
    assert!(matches!(&e, Error::InvalidDescriptor(m) if m.contains("slot 999")), "event slot out of range: {e}");
    assert!(released, "lease released after a bad event slot");

    assert_eq!(tensorwire::cuda::ipc::cache().stats(), (0, 0), "nothing left open by refused imports");
    drop(v);
}

/// A CUDA tensor message refused before any import path — its descriptor does not decode
/// (an offset whose end overflows), an IPC message that carried an fd, a VMM message
/// without one, a CUDA descriptor naming an fd slot — is a named error, and the lease it
/// names is given back (read from the raw descriptor when it does not decode).
#[test]
fn cuda_messages_refused_before_the_import_give_their_leases_back() {
    if !gpu("cuda_messages_refused_before_the_import_give_their_leases_back") {
        return;
    }
    let mut table = Exporter::new(16, u64::MAX).unwrap();
    let (v, b) = victim(&table);
    let pool = tensorwire::cuda::order::event_pool::EventPool::new(0).unwrap();
    let acks = tensorwire::Segment::create(pool.handles().len() * 8).unwrap();
    b.send(KIND_CUDA_EVENTS, &events_message(pool.handles()), &[acks.fd()]).unwrap();
    let buf = DeviceBuffer::alloc(0, 4096).unwrap();
    let real = tensorwire::cuda::ipc::export_pointer(buf.ptr()).unwrap().handle;
    let some_fd = tensorwire::Segment::create(64).unwrap();
    type Edit = fn(&mut StorageRef);
    use tensorwire::ErrorKind::{InvalidDescriptor, Protocol};
    let cases: [(&str, StorageKind, u32, bool, Edit, ErrorKind, &str); 4] = [
        ("an offset whose end overflows", StorageKind::CudaIpc, tensorwire::peer::NO_FD_SLOT, false, |s| s.base_offset = u64::MAX - 8, InvalidDescriptor, "overflows 64 bits"),
        ("an IPC message with an fd", StorageKind::CudaIpc, tensorwire::peer::NO_FD_SLOT, true, |_| {}, Protocol, "a CUDA IPC tensor message carried an fd"),
        ("a VMM message without an fd", StorageKind::CudaVmm, tensorwire::peer::NO_FD_SLOT, false, |s| s.segment_id = 4096, Protocol, "a CUDA VMM tensor message carried no fd"),
        ("a CUDA descriptor naming fd slot 0", StorageKind::CudaIpc, 0, false, |_| {}, Protocol, "a CUDA tensor message names fd slot 0"),
    ];
    for (what, kind, slot, with_fd, edit, err_kind, needle) in cases {
        let seg = std::sync::Arc::new(tensorwire::Segment::create(64).unwrap());
        let (lease, _) = table.grant(Some(&seg), 64, Box::new(()), None).map_err(|(e, _)| e).unwrap();
        let l = Layout::contiguous(DType::Float32, &[16]).unwrap();
        let mut s = StorageRef {
            nbytes: 64,
            lease_slot: lease.slot,
            lease_gen: lease.generation,
            cuda_ipc_handle: real,
            event_seq: 1,
            ..Zeroable::zeroed()
        };
        edit(&mut s);
        let d = TensorDesc::new_cuda(&l, 0, kind, s);
        let p = tensorwire::peer::tensor_payload(1, &d, slot);
        let fds = if with_fd { vec![some_fd.fd()] } else { vec![] };
        b.send(KIND_TENSOR, &p, &fds).unwrap();
        let e = v.recv(T).unwrap_err();
        assert!(e.kind() == err_kind && e.to_string().contains(needle), "{what}: expected {err_kind:?} with {needle:?}, got {:?}: {e}", e.kind());
        let released_before = table.stats().released;
        let mut owners = tensorwire::lease::Reclaimed::default();
        table.reap(std::time::Instant::now(), &mut owners);
        assert_eq!(table.stats().released, released_before + 1, "{what}: the refused message kept its lease");
    }
    assert_eq!(tensorwire::cuda::ipc::cache().stats(), (0, 0), "nothing left open by refused imports");
    drop(v);
}
