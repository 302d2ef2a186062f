//! When the machine says no: each test runs in a child process of its own (this binary
//! re-executed) with a resource limit set by `setrlimit` — address space, open files,
//! file size — or under a storm of signals, a full socket buffer. Each must end in the
//! documented error (`Error::Resource` naming the call, `Timeout`), leave no half-made
//! lease or mapping behind, and leave the connection usable; never a panic, abort or hang.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tensorwire::{DType, Error, ExportOptions, Layout, Peer, PeerConfig, RingItem, SharedTensor};

const T: Duration = Duration::from_secs(10);

/// Run `body` in a fresh child process (this test binary, only this test), so the limit
/// it sets cannot disturb other tests. The parent waits at most 60 s.
fn in_child(name: &str, body: impl FnOnce()) {
    if tensorwire_test_support::role().as_deref() == Some(name) {
        body();
        return;
    }
    let mut child = tensorwire_test_support::RoleCommand::new(name)
        .test(name)
        // The child's own "test result" line would be counted as another test run.
        .stdout(std::process::Stdio::null())
        .spawn();
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            assert!(st.success(), "child for {name} failed: {st}");
            return;
        }
        if Instant::now() > end {
            let _ = child.kill();
            panic!("child for {name} hung for 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn set_soft_limit(res: libc::__rlimit_resource_t, value: u64) {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `r` is a valid, writable rlimit.
    assert_eq!(unsafe { libc::getrlimit(res, &mut r) }, 0);
    r.rlim_cur = value.min(r.rlim_max);
    // SAFETY: `r` is a valid rlimit; a soft limit up to the hard one needs no privilege.
    assert_eq!(unsafe { libc::setrlimit(res, &r) }, 0, "setrlimit: {}", std::io::Error::last_os_error());
}

fn vm_size_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = s.lines().find(|l| l.starts_with("VmSize:")).unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

fn no_ring() -> PeerConfig {
    PeerConfig { ring_bytes: 0, ..PeerConfig::default() }
}

fn f32s(n: i64) -> Layout {
    Layout::contiguous(DType::Float32, &[n]).unwrap()
}

fn assert_resource(e: &Error, errno: i32) {
    assert!(matches!(e, Error::Resource { errno: got, .. } if *got == errno), "expected Resource(errno {errno}), got {e:?}: {e}");
}

/// The consumer's map of a 2 GiB segment fails under an address-space limit: a named
/// error, the lease handed back, nothing mapped, and the next tensor goes through.
#[test]
fn address_space_limit_fails_an_import_cleanly() {
    in_child("address_space_limit_fails_an_import_cleanly", || {
        let (a, b) = Peer::pair(no_ring()).unwrap();
        let big = SharedTensor::zeros(f32s(512 << 20)).unwrap(); // 2 GiB (sparse), mapped by the producer
        // 512 MiB of headroom: enough for what the run itself reserves (a thread's first
        // malloc can reserve a 64 MiB glibc arena), far too little for a second 2 GiB map.
        set_soft_limit(libc::RLIMIT_AS, vm_size_bytes() + (512 << 20));
        a.export(&big, ExportOptions::default()).unwrap();
        let e = b.recv(T).unwrap_err();
        assert_resource(&e, libc::ENOMEM);
        assert!(matches!(e, Error::Resource { .. }) && e.to_string().contains("mmap") && e.to_string().contains("address space"), "{e}");
        assert_eq!(b.imported_segments(), 0, "a failed map must leave nothing cached");
        wait_for(|| a.reap_now().live_leases == 0, "the failed import's lease to come back");
        // Small tensors still fit under the limit.
        let small = SharedTensor::zeros(f32s(1024)).unwrap();
        small.write_storage(0, &7f32.to_le_bytes()).unwrap();
        a.export(&small, ExportOptions::default()).unwrap();
        let t = b.recv_tensor(T).unwrap();
        assert_eq!(t.to_vec().unwrap()[..4], 7f32.to_le_bytes());
        t.release().unwrap();
        // And a segment the producer cannot map is its own named error.
        let e = SharedTensor::zeros(f32s(512 << 20)).unwrap_err();
        assert_resource(&e, libc::ENOMEM);
    });
}

/// With the fd table full, the fd a tensor carries cannot be received (the kernel drops
/// it) and no memfd can be made: named errors, the lease handed back; once an fd is free
/// the same connection carries tensors again.
#[test]
fn fd_limit_fails_receives_and_creates_cleanly() {
    in_child("fd_limit_fails_receives_and_creates_cleanly", || {
        let (a, b) = Peer::pair(no_ring()).unwrap();
        let t = SharedTensor::zeros(f32s(1024)).unwrap();
        let spare = SharedTensor::zeros(f32s(16)).unwrap();
        let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
        set_soft_limit(libc::RLIMIT_NOFILE, open + 16);
        let mut filler: Vec<OwnedFd> = Vec::new();
        loop {
            match tensorwire::os::memfd_create("filler") {
                Ok(fd) => filler.push(fd),
                Err(e) => {
                    assert_resource(&e, libc::EMFILE);
                    break;
                }
            }
        }
        let e = Peer::pair(no_ring()).unwrap_err();
        assert!(matches!(e, Error::Resource { .. }), "a new connection at the fd limit: {e:?}");
        a.export(&t, ExportOptions { tag: 1, window: None }).unwrap();
        let e = b.recv(T).unwrap_err();
        assert_resource(&e, libc::EMFILE);
        wait_for(|| a.reap_now().live_leases == 0, "the lost tensor's lease to come back");
        drop(filler.pop());
        a.export(&spare, ExportOptions { tag: 2, window: None }).unwrap();
        let got = b.recv_tensor(T).unwrap();
        assert_eq!(got.tag(), 2);
        got.release().unwrap();
    });
}

/// A memfd larger than RLIMIT_FSIZE cannot be sized: EFBIG (SIGXFSZ ignored, as a
/// process that sets the limit does), a named error, no segment.
#[test]
fn file_size_limit_fails_a_segment_cleanly() {
    in_child("file_size_limit_fails_a_segment_cleanly", || {
        // SAFETY: setting a signal's disposition to SIG_IGN has no preconditions.
        unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
        set_soft_limit(libc::RLIMIT_FSIZE, 1 << 20);
        let e = SharedTensor::zeros(f32s(1 << 20)).unwrap_err();
        assert_resource(&e, libc::EFBIG);
        assert!(matches!(e, Error::Resource { .. }) && e.to_string().contains("ulimit -f"), "{e}");
        SharedTensor::zeros(f32s(1024)).unwrap();
    });
}

/// A consumer that stops reading fills the socket buffer: the producer's export waits
/// at most `send_timeout`, then fails with `Timeout` and takes that lease back; the
/// exports that went out are all received once the consumer reads again.
#[test]
fn a_full_socket_buffer_times_out_the_send_and_takes_the_lease_back() {
    in_child("a_full_socket_buffer_times_out_the_send_and_takes_the_lease_back", full_socket_buffer);
}

fn full_socket_buffer() {
    let cfg = PeerConfig { send_timeout: Duration::from_millis(200).into(), ..no_ring() };
    let (a, b) = Peer::pair(cfg).unwrap();
    let t = SharedTensor::zeros(f32s(16)).unwrap();
    let mut sent = 0u64;
    let t0 = Instant::now();
    let err = loop {
        match a.export(&t, ExportOptions { tag: sent, window: None }) {
            Ok(_) => sent += 1,
            Err(e) => break e,
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "the socket buffer never filled");
    };
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(matches!(err, Error::Timeout { .. }) && err.to_string().contains("not reading"), "{err}");
    assert_eq!(a.reap_now().live_leases, sent, "the timed-out export's lease must be taken back");
    for i in 0..sent {
        let got = b.recv_tensor(T).unwrap();
        assert_eq!(got.tag(), i);
        got.release().unwrap();
    }
    wait_for(|| a.reap_now().live_leases == 0, "every lease to come back");
}

fn wait_for(mut cond: impl FnMut() -> bool, what: &str) {
    let end = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

static SIGNALS: AtomicU64 = AtomicU64::new(0);

extern "C" fn count_signal(_: libc::c_int) {
    SIGNALS.fetch_add(1, Ordering::Relaxed);
}

/// Install a handler for SIGUSR1 and SIGALRM without SA_RESTART (every blocking system
/// call they interrupt fails with EINTR), then signal thread `tid` every 100 µs until
/// `stop` is set.
fn signal_storm(tid: libc::pid_t, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    for sig in [libc::SIGUSR1, libc::SIGALRM] {
        // SAFETY: a zeroed sigaction is valid; the handler is an extern "C" fn that only
        // touches an atomic (async-signal-safe); sa_flags has no SA_RESTART on purpose.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = count_signal as *const () as usize;
            sa.sa_flags = 0;
            libc::sigemptyset(&mut sa.sa_mask);
            assert_eq!(libc::sigaction(sig, &sa, std::ptr::null_mut()), 0);
        }
    }
    std::thread::spawn(move || {
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() };
        let mut n = 0u32;
        while !stop.load(Ordering::Relaxed) {
            let sig = if n % 2 == 0 { libc::SIGUSR1 } else { libc::SIGALRM };
            // SAFETY: tgkill with our own pid and a tid of this process.
            unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, sig) };
            n += 1;
            std::thread::sleep(Duration::from_micros(100));
        }
    })
}

/// Every blocking call under a signal storm completes, or times out after (not before)
/// its timeout: no EINTR leaks out as an error or as an early timeout.
#[test]
fn blocking_calls_survive_a_signal_storm() {
    in_child("blocking_calls_survive_a_signal_storm", || {
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        let stop = Arc::new(AtomicBool::new(false));
        let storm = signal_storm(tid, stop.clone());
        std::thread::sleep(Duration::from_millis(20));

        // Handshake (hello, setup) with the storm on this thread.
        let (a, b) = Peer::pair(PeerConfig::default()).unwrap();
        let a = Arc::new(a);

        // A receive with nothing to receive lasts its whole timeout.
        let t0 = Instant::now();
        let e = b.recv(Duration::from_millis(300)).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(t0.elapsed() >= Duration::from_millis(300), "recv(300 ms) gave up after {:?}", t0.elapsed());

        // A receive that sleeps (poll) and one that sleeps in the futex (ring) both wake
        // for what comes 150 ms later.
        let t = SharedTensor::zeros(f32s(64)).unwrap();
        let (a2, t2) = (a.clone(), t.clone());
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(150));
            a2.export(&t2, ExportOptions { tag: 9, window: None }).unwrap();
            std::thread::sleep(Duration::from_millis(150));
            a2.ring_send(&[RingItem::bytes(3, b"after the storm")], T).unwrap();
        });
        let got = b.recv_tensor(T).unwrap();
        assert_eq!(got.tag(), 9);
        got.release().unwrap();
        let msg = b.ring_recv(T).unwrap();
        assert_eq!(msg.tag, 3);
        sender.join().unwrap();

        // A ring wait with nothing coming also lasts its whole timeout.
        let t0 = Instant::now();
        let e = b.ring_recv(Duration::from_millis(300)).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(t0.elapsed() >= Duration::from_millis(300), "ring_recv(300 ms) gave up after {:?}", t0.elapsed());

        // Many round trips.
        for i in 0..200 {
            a.export(&t, ExportOptions { tag: i, window: None }).unwrap();
            b.recv_tensor(T).unwrap().release().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        storm.join().unwrap();
        assert!(SIGNALS.load(Ordering::Relaxed) > 100, "the storm delivered only {} signals", SIGNALS.load(Ordering::Relaxed));
    });
}
