//! A hostile peer against the consumer's resources: files far larger than what they are
//! offered for, views that would map a whole sparse terabyte, more bytes than the quota,
//! and control messages that are just over a limit. Each attack goes through the raw
//! protocol against a victim that uses only the public `Peer` API, and each must end in a
//! clear, named error (or in bounded use of memory and address space), never in the
//! victim holding what the peer chose.

use bytemuck::Zeroable;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tensorwire::lease::{Exporter, LeaseId};
use tensorwire::peer::{KIND_FORGET, KIND_TABLE, KIND_TENSOR, SEGMENT_FD_SLOTS};
use tensorwire::ring::{RingShared, DATA_OFFSET};
use tensorwire::{
    Connection, DType, Error, Incoming, Layout, Peer, PeerConfig, Segment, StorageKind, StorageRef, TensorDesc,
};

const T: Duration = Duration::from_secs(10);
const GIB: u64 = 1 << 30;

/// The tests of this file run one at a time: some count this process's open fds, which
/// the others' sockets and memfds would disturb.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A sparse, sealed memfd of `len` bytes (no page is touched).
fn sparse(len: u64) -> OwnedFd {
    let fd = tensorwire::os::memfd_create("hostile-sparse").unwrap();
    tensorwire::os::ftruncate(fd.as_fd(), len).unwrap();
    tensorwire::os::add_seals(fd.as_fd(), libc::F_SEAL_SHRINK | libc::F_SEAL_GROW).unwrap();
    fd
}

fn status_kib(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with(field)).unwrap_or_else(|| panic!("{field} in /proc/self/status"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

struct Attacker {
    conn: Connection,
    table: Exporter,
    _victim_table: OwnedFd,
}

impl Attacker {
    fn live_lease(&mut self) -> LeaseId {
        let seg = Arc::new(Segment::create(64).unwrap());
        self.table.grant(Some(&seg), 64, Box::new(()), None).map_err(|(e, _)| e).unwrap().0
    }

    /// A descriptor of `nbytes` (viewed as u8[nbytes]) at `offset` of segment `sid`,
    /// under a live lease.
    fn desc(&mut self, sid: u64, offset: u64, nbytes: u64) -> TensorDesc {
        let lease = self.live_lease();
        let layout = Layout::contiguous(DType::UInt8, &[nbytes as i64]).unwrap();
        TensorDesc::new(&layout, StorageKind::Segment, StorageRef {
            segment_id: sid,
            base_offset: offset,
            nbytes,
            lease_slot: lease.slot,
            lease_gen: lease.generation,
            ..Zeroable::zeroed()
        })
    }

    /// A tensor message; the fd slot is the segment id modulo the slot count.
    fn send_tensor(&self, desc: &TensorDesc, fd: Option<&OwnedFd>) {
        let slot = (desc.storage.segment_id % u64::from(SEGMENT_FD_SLOTS)) as u32;
        let p = tensorwire::peer::tensor_payload(7, desc, slot);
        let fds: Vec<_> = fd.iter().map(|f| f.as_fd()).collect();
        self.conn.send(KIND_TENSOR, &p, &fds).unwrap();
    }
}

/// A victim set up with `cfg` and an attacker whose lease table has `capacity` slots and
/// who offers the ring `ring` (claimed size, fd) at setup.
fn setup_with(cfg: PeerConfig, capacity: u32, ring: Option<(u64, OwnedFd)>) -> (tensorwire::Result<Peer>, Attacker) {
    let (a, b) = Connection::pair().unwrap();
    let victim = std::thread::spawn(move || Peer::new(a, cfg));
    let table = Exporter::new(capacity, u64::MAX).unwrap();
    let ring_bytes = ring.as_ref().map_or(0, |r| r.0);
    let mut fds = vec![table.table().fd()];
    if let Some((_, fd)) = &ring {
        fds.push(fd.as_fd());
    }
    b.send(KIND_TABLE, &tensorwire::peer::setup_payload(capacity, ring_bytes, 0), &fds).unwrap();
    let m = b.recv(T).unwrap();
    assert_eq!(m.kind, KIND_TABLE);
    let victim = victim.join().unwrap();
    (victim, Attacker { conn: b, table, _victim_table: m.fds.into_iter().next().unwrap() })
}

fn no_ring() -> PeerConfig {
    PeerConfig { ring_bytes: 0, ..PeerConfig::default() }
}

#[test]
fn a_small_ring_inside_a_huge_sparse_file_is_refused_without_touching_it() {
    let _serial = serial();
    // A real ring's header, copied to the front of a 3 GiB sparse file: the header claims
    // 4 KiB, the file is 3 GiB. Faulting in the whole file would cost the victim 3 GiB.
    let real = RingShared::create(4096).unwrap();
    let mut header = vec![0u8; DATA_OFFSET];
    real.segment().read_at(0, &mut header).unwrap();
    let fd = sparse(3 * GIB);
    let big = Segment::from_fd(fd.try_clone().unwrap(), 0).unwrap();
    big.write_at(0, &header).unwrap();
    drop(big);

    let rss_before = status_kib("RssShmem:");
    let t0 = Instant::now();
    let (victim, _at) = setup_with(no_ring(), 16, Some((4096, fd)));
    let err = victim.expect_err("a 4 KiB ring in a 3 GiB file must be refused");
    let msg = err.to_string();
    assert!(matches!(err, Error::InvalidSegment(_)), "{msg}");
    assert!(msg.contains("must be exactly") && msg.contains("3221225472"), "{msg}");
    assert!(t0.elapsed() < Duration::from_secs(2), "refusal took {:?}", t0.elapsed());
    let grown = status_kib("RssShmem:").saturating_sub(rss_before);
    assert!(grown < 64 * 1024, "victim's shared-memory RSS grew by {grown} KiB during the handshake");
}

#[test]
fn small_views_of_terabyte_sparse_files_map_only_the_view() {
    let _serial = serial();
    let (victim, mut at) = setup_with(no_ring(), 512, None);
    let victim = victim.unwrap();
    let vm_before = status_kib("VmSize:");
    // 300 distinct 1 TiB files: mapping each whole would need 300 TiB of address space,
    // more than a process has (128 TiB).
    let mut held = Vec::new();
    for i in 0..300u64 {
        let d = at.desc(1000 + i, (1 << 40) - 8192, 4096);
        at.send_tensor(&d, Some(&sparse(1 << 40)));
        match victim.recv(T).unwrap() {
            Incoming::Tensor(t) => held.push(t),
            other => panic!("expected a tensor, got {other:?}"),
        }
    }
    let grown_mib = status_kib("VmSize:").saturating_sub(vm_before) / 1024;
    assert!(grown_mib < 256, "300 imports of 4 KiB views grew the victim's address space by {grown_mib} MiB");
    // The views really alias the files: a write through the import is read back.
    held[5].write_storage(0, b"seen").unwrap();
    let mut b = [0u8; 4];
    held[5].read_storage(0, &mut b).unwrap();
    assert_eq!(&b, b"seen");
}

#[test]
fn mapped_bytes_beyond_the_quota_are_refused_and_released_views_are_evicted() {
    let _serial = serial();
    let cfg = PeerConfig { max_import_mapped_bytes: 1 << 20, ..no_ring() };
    let (victim, mut at) = setup_with(cfg, 256, None);
    let victim = victim.unwrap();

    // One view larger than the whole quota: named error, and its lease handed back.
    let d = at.desc(1, 0, 2 << 20);
    at.send_tensor(&d, Some(&sparse(2 << 20)));
    let err = victim.recv(T).unwrap_err();
    assert!(matches!(err, Error::QuotaExceeded(_)), "{err}");
    assert!(matches!(err, Error::QuotaExceeded(_)) && err.to_string().contains("max_import_mapped_bytes"), "{err}");
    tensorwire_wait(
        || {
            let mut dead = tensorwire::lease::Reclaimed::default();
            at.table.reap(Instant::now(), &mut dead);
            at.table.stats().released == 1
        },
        "the refused import's lease to come back",
    );

    // A producer that never says FORGET: 64 distinct 256 KiB segments, each imported and
    // released. Four fit the quota at once; the rest evict the least recently used.
    for i in 0..64u64 {
        let d = at.desc(100 + i, 0, 256 << 10);
        at.send_tensor(&d, Some(&sparse(256 << 10)));
        let t = victim.recv_tensor(T).unwrap_or_else(|e| panic!("import {i}: {e}"));
        t.release().unwrap();
        assert!(victim.imported_segments() <= 4, "{} segments kept mapped", victim.imported_segments());
    }
    // Live views cannot be evicted: the fifth live 256 KiB view is over the quota.
    let mut live = Vec::new();
    for i in 0..4u64 {
        let d = at.desc(200 + i, 0, 256 << 10);
        at.send_tensor(&d, Some(&sparse(256 << 10)));
        live.push(victim.recv_tensor(T).unwrap());
    }
    let d = at.desc(300, 0, 256 << 10);
    at.send_tensor(&d, Some(&sparse(256 << 10)));
    let err = victim.recv(T).unwrap_err();
    assert!(matches!(err, Error::QuotaExceeded(_)), "{err}");
    drop(live);
    // Released again: the connection carries the next tensor.
    let d = at.desc(301, 0, 256 << 10);
    at.send_tensor(&d, Some(&sparse(256 << 10)));
    victim.recv_tensor(T).unwrap().release().unwrap();
}

#[test]
fn an_evicted_segment_is_mapped_again_when_its_fd_comes_again() {
    let _serial = serial();
    let cfg = PeerConfig { max_import_segments: 2, ..no_ring() };
    let (victim, mut at) = setup_with(cfg, 64, None);
    let victim = victim.unwrap();
    let segs: Vec<Segment> = (0..3).map(|_| Segment::create(4096).unwrap()).collect();
    for (i, s) in segs.iter().enumerate() {
        s.write_at(0, &[i as u8 + 1]).unwrap();
    }
    // 0, 1, 2 (evicts 0), then 0 again with its fd: mapped anew, same bytes.
    for &i in &[0usize, 1, 2, 0, 1] {
        let d = at.desc(10 + i as u64, 0, 64);
        at.send_tensor(&d, Some(&segs[i].fd().try_clone_to_owned().unwrap()));
        let t = victim.recv_tensor(T).unwrap();
        let mut b = [0u8; 1];
        t.read_storage(0, &mut b).unwrap();
        assert_eq!(b[0], i as u8 + 1, "segment {i}");
        t.release().unwrap();
        assert!(victim.imported_segments() <= 2);
    }
    // Mapped now: 10 and 11 (12 was evicted by the second 10, the least recently used).
    // Without an fd, a mapped segment is used as it is, and an evicted one is mapped again
    // from the fd its slot kept: the same bytes, no fd sent.
    let fds_before = open_fds();
    for (sid, want) in [(11u64, 2u8), (12, 3)] {
        let d = at.desc(sid, 0, 64);
        at.send_tensor(&d, None);
        let t = victim.recv_tensor(T).unwrap();
        let mut b = [0u8; 1];
        t.read_storage(0, &mut b).unwrap();
        assert_eq!(b[0], want, "segment {sid} without its fd");
        t.release().unwrap();
        assert!(victim.imported_segments() <= 2);
    }
    assert_eq!(open_fds(), fds_before, "a slot's fd was duplicated or closed");
    // A slot no fd was put in is a clear error, not a wrong mapping.
    let d = at.desc(13, 0, 64);
    at.send_tensor(&d, None);
    let err = victim.recv(T).unwrap_err();
    assert!(matches!(err, Error::InvalidDescriptor(_)) && err.to_string().contains("names segment 13 in fd slot 13, which holds no fd"), "{err}");
}

fn tensorwire_wait(mut cond: impl FnMut() -> bool, what: &str) {
    let end = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Send `bytes` as one raw SEQPACKET datagram carrying `fds`, bypassing every check of
/// the sending side.
fn raw_send(sock: std::os::fd::BorrowedFd<'_>, bytes: &[u8], fds: &[OwnedFd]) {
    let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut _, iov_len: bytes.len() };
    let mut cbuf = vec![0u64; 64];
    // SAFETY: zeroed msghdr is a valid value; the fields are filled below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        let n = (fds.len() * 4) as u32;
        // SAFETY: CMSG_SPACE/CMSG_LEN are size computations; `cbuf` (512 bytes, 8-aligned)
        // holds one header plus up to 100 fds, and `msg_controllen` bounds the walk.
        unsafe {
            msg.msg_control = cbuf.as_mut_ptr().cast();
            msg.msg_controllen = libc::CMSG_SPACE(n) as _;
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(n) as _;
            let data = libc::CMSG_DATA(c).cast::<i32>();
            for (i, fd) in fds.iter().enumerate() {
                data.add(i).write_unaligned(fd.as_raw_fd());
            }
        }
    }
    // SAFETY: `msg` points at `iov` and `cbuf`, both alive across the call.
    let r = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    assert!(r >= 0, "sendmsg: {}", std::io::Error::last_os_error());
}

fn framed(kind: u32, payload_len: usize) -> Vec<u8> {
    let mut m = u32::from_le_bytes(*b"TWM1").to_le_bytes().to_vec();
    m.extend_from_slice(&kind.to_le_bytes());
    m.resize(8 + payload_len, 0);
    m
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[test]
fn control_messages_just_over_a_limit_are_refused_and_the_connection_goes_on() {
    let _serial = serial();
    let (victim, at) = setup_with(no_ring(), 16, None);
    let victim = victim.unwrap();
    let limit = victim.config().max_message;

    // One byte over the payload limit.
    raw_send(at.conn.socket(), &framed(4, limit + 1), &[]);
    let err = victim.recv(T).unwrap_err();
    assert!(matches!(err, Error::Protocol(_)), "{err}");
    assert!(matches!(err, Error::Protocol(_)) && err.to_string().contains(&format!("{}-byte limit", limit)), "{err}");

    // Nine fds where at most eight are allowed: refused, and every one of them closed.
    let before = open_fds();
    let nine: Vec<OwnedFd> = (0..9).map(|_| tensorwire::os::memfd_create("nine").unwrap()).collect();
    raw_send(at.conn.socket(), &framed(4, 1), &nine);
    drop(nine);
    let err = victim.recv(T).unwrap_err();
    assert!(matches!(err, Error::Protocol(_)), "{err}");
    assert!(matches!(err, Error::Protocol(_)) && err.to_string().contains("more than 8 fds"), "{err}");
    assert_eq!(open_fds(), before, "the fds of a refused message must be closed");

    // A zero-length datagram from a live peer is its error, not its death.
    raw_send(at.conn.socket(), &[], &[]);
    let err = victim.recv(T).unwrap_err();
    assert!(matches!(err, Error::Protocol(_)), "a zero-length message was reported as {err}");
    assert!(!victim.is_peer_gone());

    // The connection still carries a user message.
    at.conn.send(tensorwire::peer::KIND_USER, b"still here", &[]).unwrap();
    match victim.recv(T).unwrap() {
        Incoming::Message { payload, .. } => assert_eq!(payload, b"still here"),
        other => panic!("expected the user message, got {other:?}"),
    }
}

#[test]
fn a_flood_of_internal_messages_cannot_stretch_a_receive_past_its_timeout() {
    let _serial = serial();
    let (victim, at) = setup_with(no_ring(), 16, None);
    let victim = victim.unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s = stop.clone();
    let flood = std::thread::spawn(move || {
        let end = Instant::now() + Duration::from_secs(4);
        while !s.load(std::sync::atomic::Ordering::Relaxed) && Instant::now() < end {
            let _ = at.conn.send(KIND_FORGET, &12345u64.to_le_bytes(), &[]);
        }
        at
    });
    std::thread::sleep(Duration::from_millis(50));
    let t0 = Instant::now();
    let err = victim.recv(Duration::from_secs(1)).unwrap_err();
    let took = t0.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    // The flooder may be blocked in a full socket: closing the victim ends its send.
    drop(victim);
    let _at = flood.join().unwrap();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(matches!(err, Error::Timeout { .. }) && err.to_string().contains("timed out after 1s"), "the error must name the requested timeout: {err}");
    assert!(took < Duration::from_millis(1500), "recv(1 s) returned after {took:?}");
}

/// Lower this process's soft fd limit to `n` (if it is higher) for the rest of the run, as
/// on a desktop where 1,024 is the common default.
fn lower_fd_limit(n: u64) {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `r` is a valid, writable rlimit.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) }, 0);
    if r.rlim_cur > n {
        r.rlim_cur = n;
        // SAFETY: `r` is a valid rlimit; lowering the soft limit needs no privilege.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) }, 0);
    }
}

#[test]
fn a_producer_that_never_forgets_cannot_fill_the_fd_table() {
    let _serial = serial();
    lower_fd_limit(1024);
    let (victim, mut at) = setup_with(no_ring(), 4096, None);
    let victim = victim.unwrap();
    let before = open_fds();
    // Three times the fd limit of distinct segments, each sent with its fd and never
    // forgotten: the victim keeps at most max_import_segments mappings and the fds of
    // its SEGMENT_FD_SLOTS slots.
    for i in 0..3072u64 {
        let seg = Segment::create(4096).unwrap();
        seg.write_at(0, &i.to_le_bytes()).unwrap();
        let d = at.desc(5000 + i, 0, 4096);
        at.send_tensor(&d, Some(&seg.fd().try_clone_to_owned().unwrap()));
        let t = victim.recv_tensor(T).unwrap_or_else(|e| panic!("segment {i}: {e}"));
        let mut b = [0u8; 8];
        t.read_storage(0, &mut b).unwrap();
        assert_eq!(u64::from_le_bytes(b), i);
        t.release().unwrap();
    }
    let kept = SEGMENT_FD_SLOTS as usize;
    assert!(open_fds() <= before + kept + 2, "victim's fds grew from {before} to {}", open_fds());
    assert!(victim.imported_segments() <= victim.config().max_import_segments);
    // A second, honest peer is served as usual.
    let (a, b) = Peer::pair(no_ring()).unwrap();
    let t = tensorwire::SharedTensor::zeros(Layout::contiguous(DType::Float32, &[256]).unwrap()).unwrap();
    a.export(&t, tensorwire::ExportOptions::default()).unwrap();
    b.recv_tensor(T).unwrap().release().unwrap();
}

/// A mapping covers whole pages, but the file may end inside its last page: touching the
/// bytes past the end raises SIGBUS. A later descriptor naming them (with or without its
/// fd) must be refused, not served from the cached mapping.
#[test]
fn a_cached_mapping_never_serves_bytes_past_the_end_of_the_file() {
    let _serial = serial();
    let (victim, mut at) = setup_with(no_ring(), 16, None);
    let victim = victim.unwrap();
    let fd = sparse(100);
    let d = at.desc(77, 0, 100);
    at.send_tensor(&d, Some(&fd));
    victim.recv_tensor(T).unwrap().release().unwrap();
    for with_fd in [false, true] {
        let d = at.desc(77, 200, 100);
        at.send_tensor(&d, with_fd.then_some(&fd));
        match victim.recv(T) {
            Ok(Incoming::Tensor(t)) => {
                let mut b = [0u8; 1];
                let _ = t.read_storage(0, &mut b); // SIGBUS here before the fix
                panic!("a view past the end of a 100-byte file was served (fd sent: {with_fd})");
            }
            Ok(other) => panic!("expected an error, got {other:?}"),
            Err(e) => assert!(matches!(e, Error::InvalidDescriptor(_)) && e.to_string().contains("segment too small"), "fd sent: {with_fd}: {e}"),
        }
    }
}
