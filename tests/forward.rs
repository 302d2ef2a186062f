//! Forwarding a received CPU tensor without a copy: host → relay → last, three real
//! processes (this test binary re-executed), plus an in-process chain.
//!
//! What is checked, precisely:
//! - a write by the last process is seen by the host, and the other way round (one
//!   memory, no copy at either hop);
//! - the host's lease to the relay lives exactly as long as the last holds the forward:
//!   released when the last releases (then the relay tells the last to forget the
//!   storage, since it no longer holds it either);
//! - the relay SIGKILLed while the last holds the forward: the host's lease to the relay
//!   ends (reclaimed, owner dropped once). The last keeps a valid mapping of the memory it
//!   still maps — memfd pages live while any process maps them — and it still aliases the
//!   host's segment while the host keeps it; that is expected, not a leak: it ends with
//!   the last's mapping;
//! - the last SIGKILLed: the relay's lease on its forward is reclaimed and the relay's
//!   upstream import goes back to the host (released, not reclaimed: the relay lives).

mod common;

use common::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tensorwire::{DType, Error, ExportOptions, Incoming, Layout, Peer, PeerConfig, SharedTensor};

// Commands to the last (first word of a message); replies are words too.
const TAKE: u64 = 1;
const READ: u64 = 2;
const RELEASE: u64 = 3;
const SEGS: u64 = 4;
/// The byte the last writes at element 0 of the view it receives.
const MARK: u8 = 0xAB;

/// Entry point of the child processes (run by `chain`, never on its own).
#[test]
#[ignore = "child-process entry point; the other tests run it in a subprocess"]
fn child_entry() {
    let Some((role, peers)) = child_peers() else { return };
    let [host, link]: [Peer; 2] = peers.try_into().unwrap_or_else(|_| panic!("two sockets"));
    match role.as_str() {
        "relay" => relay(host, link),
        "last" => last(host, link),
        other => panic!("unknown role {other}"),
    }
}

/// Forward every tensor from the host to the last (an odd tag: without the view's first
/// row), reporting [tag, forwarded]; answer QUERY with the forward leases' stats.
fn relay(up: Peer, down: Peer) {
    loop {
        match up.recv(tensorwire::Wait::Forever).unwrap() {
            Incoming::Tensor(t) => {
                let tag = t.tag();
                let view = (tag % 2 == 1).then(|| {
                    let l = t.layout();
                    l.slice(0, 1, l.sizes()[0], 1).unwrap()
                });
                // The relay keeps no handle: only the forward's lease holds the import.
                let r = down.export_imported(Arc::new(t), view, ExportOptions { tag, window: None });
                up.send_message(&words(&[tag, r.is_ok() as u64]), &[]).unwrap();
            }
            Incoming::Message { payload, .. } if payload == words(&[QUERY]) => {
                let s = down.reap_now();
                up.send_message(&words(&[s.live_leases, s.released, s.reclaimed]), &[]).unwrap();
            }
            Incoming::Message { .. } => std::process::exit(0),
            Incoming::CudaTensor(_) => panic!("unexpected CUDA tensor"),
        }
    }
}

/// Obey the host's commands; the tensor comes from the relay.
fn last(host: Peer, up: Peer) {
    let mut held: Option<tensorwire::Imported> = None;
    loop {
        let cmd = recv_words(&host);
        let reply = match cmd[0] {
            TAKE => {
                let t = up.recv_tensor(T).unwrap();
                let l = t.layout();
                t.write_storage(l.storage_offset as usize * l.dtype.size(), &[MARK]).unwrap();
                let r = vec![t.tag(), l.storage_offset as u64, l.numel()];
                held = Some(t);
                r
            }
            READ => {
                let mut b = [0u8; 8];
                held.as_ref().unwrap().read_storage(0, &mut b).unwrap();
                vec![u64::from_le_bytes(b)]
            }
            RELEASE => match held.take().unwrap().release() {
                Ok(()) => vec![0],
                Err(e) if e.is_peer_gone() => vec![1],
                Err(_) => vec![2],
            },
            SEGS => {
                // Take what the relay sent meanwhile (its FORGET) without waiting long.
                let _ = up.recv(Duration::from_millis(20));
                vec![up.imported_segments() as u64]
            }
            _ => std::process::exit(0),
        };
        host.send_message(&words(&reply), &[]).unwrap();
    }
}

impl Chain {
    fn last(&self, cmd: u64) -> Vec<u64> {
        self.to_last.send_message(&words(&[cmd]), &[]).unwrap();
        recv_words(&self.to_last)
    }
    fn relay_stats(&self) -> Vec<u64> {
        self.to_relay.send_message(&words(&[QUERY]), &[]).unwrap();
        recv_words(&self.to_relay)
    }
    /// Export `t` to the relay under a counted owner and have the last take the forward.
    fn send(&self, t: &SharedTensor, tag: u64, drops: &Arc<AtomicUsize>) -> Vec<u64> {
        let owner = Box::new(Counted(drops.clone(), t.segment().clone()));
        self.to_relay.export_with_owner(t, owner, ExportOptions { tag, window: None }).unwrap();
        assert_eq!(recv_words(&self.to_relay), vec![tag, 1], "the relay could not forward");
        self.last(TAKE)
    }
}

fn matrix() -> SharedTensor {
    let t = SharedTensor::zeros(Layout::contiguous(DType::Int32, &[8, 16]).unwrap()).unwrap();
    t.write_storage(0, &[7u8; 512]).unwrap();
    t
}

fn read_u64(t: &SharedTensor, at: usize) -> u64 {
    let mut b = [0u8; 8];
    t.read_storage(at, &mut b).unwrap();
    u64::from_le_bytes(b)
}

#[test]
fn three_processes_share_one_memory_and_the_lease_chain_ends_with_the_last_release() {
    let _one = serial();
    let mut c = chain();
    let t = matrix();
    let drops = Arc::new(AtomicUsize::new(0));
    // Odd tag: the relay forwards the view without its first row (16 int32 = 64 bytes).
    assert_eq!(c.send(&t, 1, &drops), vec![1, 16, 7 * 16]);
    let mut b = [0u8];
    t.read_storage(64, &mut b).unwrap();
    assert_eq!(b[0], MARK, "the last's write is not visible to the host (copied on some hop)");
    t.write_storage(0, &0x0123_4567_89ab_cdefu64.to_le_bytes()).unwrap();
    assert_eq!(c.last(READ), vec![0x0123_4567_89ab_cdef], "the host's write is not visible to the last");

    // The host's lease lives while the last holds the forward.
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(c.to_relay.reap_now().live_leases, 1, "the host's lease ended while the last still holds the forward");
    assert_eq!(drops.load(Ordering::SeqCst), 0);
    assert_eq!(c.relay_stats(), vec![1, 0, 0]);

    assert_eq!(c.last(RELEASE), vec![0]);
    wait_until("the host's lease released through the relay", T, || c.to_relay.reap_now().live_leases == 0);
    assert_eq!(drops.load(Ordering::SeqCst), 1);
    let s = c.to_relay.export_stats();
    assert_eq!((s.granted, s.released, s.reclaimed), (1, 1, 0));
    assert_eq!(c.relay_stats(), vec![0, 1, 0]);
    // The relay holds no import of that storage now, but its fd slot keeps the host's
    // segment's fd (the host may send the segment again), so the last keeps it too.
    assert_eq!(c.last(SEGS), vec![1]);

    // A forwarded view that does not fit the storage is refused in the relay (tested
    // in-process below); here: forwarding again works after the first chain ended.
    assert_eq!(c.send(&t, 2, &drops), vec![2, 0, 8 * 16]);
    assert_eq!(c.last(RELEASE), vec![0]);
    wait_until("the second lease released", T, || c.to_relay.reap_now().live_leases == 0);
    assert_eq!(drops.load(Ordering::SeqCst), 2);

    // The host drops its segment: it tells the relay to forget it, the relay's slot lets
    // the fd go, and the last is told to forget the forwarded storage.
    drop(t);
    wait_until("the last to forget the forwarded storage", T, || {
        c.to_relay.reap_now();
        c.last(SEGS) == vec![0]
    });

    c.to_last.send_message(&words(&[DONE]), &[]).unwrap();
    c.to_relay.send_message(&words(&[DONE]), &[]).unwrap();
    assert!(c.last.wait().unwrap().success());
    assert!(c.relay.wait().unwrap().success());
}

#[test]
fn relay_sigkilled_ends_the_hosts_lease_and_the_last_keeps_its_mapping() {
    let _one = serial();
    let mut c = chain();
    let t = matrix();
    let drops = Arc::new(AtomicUsize::new(0));
    assert_eq!(c.send(&t, 0, &drops), vec![0, 0, 8 * 16]);
    kill9(&mut c.relay);
    wait_until("the host to reclaim the dead relay's lease", T, || c.to_relay.reap_now().live_leases == 0);
    assert_eq!(drops.load(Ordering::SeqCst), 1, "the host's owner must be dropped exactly once");
    let s = c.to_relay.export_stats();
    assert_eq!((s.granted, s.released, s.reclaimed), (1, 0, 1));

    // The last still maps the same pages: the host's later write is visible there, and
    // stays readable after the host has dropped its segment (memfd pages live while
    // mapped; they go with the last's mapping).
    t.write_storage(8, &0x5555_aaaa_5555_aaaau64.to_le_bytes()).unwrap();
    assert_eq!(read_u64(&t, 0) & 0xff, u64::from(MARK));
    let first = read_u64(&t, 0);
    assert_eq!(c.last(READ), vec![first]);
    drop(t);
    assert_eq!(c.last(READ), vec![first], "the last's mapping changed after the host dropped its segment");
    // Its lease ended with the relay: releasing it says so.
    assert_eq!(c.last(RELEASE), vec![1]);
    c.to_last.send_message(&words(&[DONE]), &[]).unwrap();
    assert!(c.last.wait().unwrap().success());
}

#[test]
fn last_sigkilled_ends_the_forward_and_releases_the_relays_import() {
    let _one = serial();
    let mut c = chain();
    let t = matrix();
    let drops = Arc::new(AtomicUsize::new(0));
    c.send(&t, 0, &drops);
    assert_eq!(c.relay_stats(), vec![1, 0, 0]);
    kill9(&mut c.last);
    wait_until("the relay to release its import back to the host", T, || c.to_relay.reap_now().live_leases == 0);
    assert_eq!(drops.load(Ordering::SeqCst), 1);
    let s = c.to_relay.export_stats();
    assert_eq!((s.released, s.reclaimed), (1, 0), "the relay is alive: it released, nothing was reclaimed");
    assert_eq!(c.relay_stats(), vec![0, 0, 1], "the relay's forward lease must be reclaimed from the dead last");
    c.to_relay.send_message(&words(&[DONE]), &[]).unwrap();
    assert!(c.relay.wait().unwrap().success());
}

#[test]
fn in_process_forward_checks_the_view_and_holds_the_upstream_lease() {
    let _one = serial();
    let (host, relay_up) = Peer::pair(PeerConfig::default()).unwrap();
    let (relay_down, last) = Peer::pair(PeerConfig::default()).unwrap();
    let t = matrix();
    host.export(&t, ExportOptions { tag: 5, window: None }).unwrap();
    let imp = Arc::new(relay_up.recv_tensor(T).unwrap());

    // A view needing more than the storage is refused; nothing is leased for it.
    let too_big = Layout::contiguous(DType::Int32, &[8, 17]).unwrap();
    let err = relay_down.export_imported(imp.clone(), Some(too_big), ExportOptions::default()).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(ref m) if m.contains("view needs")), "{err}");
    assert_eq!(relay_down.export_stats().live_leases, 0);

    let col = Layout::contiguous(DType::Int32, &[8, 16]).unwrap().slice(1, 3, 4, 1).unwrap();
    relay_down.export_imported(imp.clone(), Some(col), ExportOptions { tag: 6, window: None }).unwrap();
    // Back to the producer on the connection it came from: the same memory too.
    relay_up.export_imported(imp.clone(), None, ExportOptions { tag: 7, window: None }).unwrap();
    drop(imp);
    let got = last.recv_tensor(T).unwrap();
    assert_eq!((got.tag(), got.layout().storage_offset, got.layout().numel()), (6, 3, 8));
    got.write_storage(12, &[MARK]).unwrap();
    let mut b = [0u8];
    t.read_storage(12, &mut b).unwrap();
    assert_eq!(b[0], MARK);
    let back = host.recv_tensor(T).unwrap();
    // What came back names the producer's own file and range: the producer can tell its
    // own memory returned, as the last can tell it is not its own.
    let own = t.segment().file_ident().unwrap();
    assert_eq!(back.file_range(), (own, t.storage_offset_bytes() as u64));
    assert_eq!(got.file_range().0, own);
    assert_ne!(matrix().segment().file_ident().unwrap(), own);
    back.write_storage(13, &[MARK]).unwrap();
    t.read_storage(13, &mut b).unwrap();
    assert_eq!(b[0], MARK);

    // Both forwards hold the host's lease; it ends when the last of them does.
    got.release().unwrap();
    std::thread::sleep(Duration::from_millis(20));
    relay_down.reap_now();
    assert_eq!(host.reap_now().live_leases, 1, "one forward still holds the import");
    back.release().unwrap();
    wait_until("the host's lease", T, || {
        relay_up.reap_now();
        host.reap_now().live_leases == 0
    });
}

/// A raw producer (just enough protocol for a `Peer` to set up), to send descriptors with
/// and without their fd.
fn raw_producer() -> (Peer, tensorwire::Connection, tensorwire::lease::Exporter) {
    let (a, b) = tensorwire::Connection::pair().unwrap();
    let victim = std::thread::spawn(move || Peer::new(a, PeerConfig::default()));
    let table = tensorwire::lease::Exporter::new(16, u64::MAX).unwrap();
    b.send(tensorwire::peer::KIND_TABLE, &tensorwire::peer::setup_payload(16, 0, 0), &[table.table().fd()])
        .unwrap();
    assert_eq!(b.recv(T).unwrap().kind, tensorwire::peer::KIND_TABLE);
    (victim.join().unwrap().unwrap(), b, table)
}

fn send_raw(conn: &tensorwire::Connection, table: &mut tensorwire::lease::Exporter, seg: &Arc<tensorwire::Segment>, with_fd: bool) {
    use bytemuck::Zeroable;
    let lease = table.grant(Some(seg), 256, Box::new(()), None).map_err(|(e, _)| e).unwrap().0;
    let desc = tensorwire::TensorDesc::new(
        &Layout::contiguous(DType::UInt8, &[256]).unwrap(),
        tensorwire::StorageKind::Segment,
        tensorwire::StorageRef {
            segment_id: 77,
            nbytes: 256,
            lease_slot: lease.slot,
            lease_gen: lease.generation,
            ..Zeroable::zeroed()
        },
    );
    // Fd slot 0: filled by a message with the fd, named by one without.
    let p = tensorwire::peer::tensor_payload(9, &desc, 0);
    let fds: Vec<_> = if with_fd { vec![seg.fd()] } else { Vec::new() };
    conn.send(tensorwire::peer::KIND_TENSOR, &p, &fds).unwrap();
}

#[test]
fn imports_share_their_slots_fd_and_fdless_ones_forward_as_the_same_memory() {
    let _one = serial();
    let (victim, conn, mut table) = raw_producer();
    let (down, other) = Peer::pair(PeerConfig::default()).unwrap();
    let seg = Arc::new(tensorwire::Segment::create(4096).unwrap());
    let base = open_fds();

    // The fd goes into a slot once; imports of the window share it, the second came
    // without one.
    send_raw(&conn, &mut table, &seg, true);
    let a = Arc::new(victim.recv_tensor(T).unwrap());
    assert_eq!(open_fds(), base + 1, "the slot keeps the segment's fd");
    send_raw(&conn, &mut table, &seg, false);
    let b = Arc::new(victim.recv_tensor(T).unwrap());
    assert_eq!(open_fds(), base + 1, "imports of one window share the slot's fd");
    down.export_imported(b.clone(), None, ExportOptions::default()).unwrap();
    let got = other.recv_tensor(T).unwrap();
    got.write_storage(0, &[MARK]).unwrap();
    let mut byte = [0u8];
    seg.read_at(0, &mut byte).unwrap();
    assert_eq!(byte[0], MARK);
    got.release().unwrap();
    down.reap_now();
    drop((a, b));
    // Two slots hold it: the victim's, and `other`'s for the forward (both in this process).
    assert_eq!(open_fds(), base + 2, "the slots keep their fds after the last import");

    // Told to forget the segment, the victim's slot lets its fd go; the forward's storage
    // is then gone from the relay, which tells `other` to forget it too.
    conn.send(tensorwire::peer::KIND_FORGET, &77u64.to_le_bytes(), &[]).unwrap();
    send_raw(&conn, &mut table, &seg, false);
    let err = victim.recv(T).unwrap_err();
    assert!(matches!(err, Error::InvalidDescriptor(_)) && err.to_string().contains("which holds no fd"), "{err}");
    wait_until("the forwarded storage forgotten downstream", T, || {
        down.reap_now();
        let _ = other.recv(tensorwire::Wait::Never);
        open_fds() == base
    });
}
