//! Child processes for the cross-process tests: the test binary re-executes itself,
//! running only the ignored `child_entry` test, with a role and an inherited socket.

#![allow(dead_code)]

pub mod gpu;
pub mod gpu_roles;

use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tensorwire::{DType, ExportOptions, Incoming, Layout, Peer, PeerConfig, SharedTensor};

pub const QUERY: u64 = u64::MAX;
pub const DONE: u64 = u64::MAX - 1;

pub const ROLE_ENV: &str = "TW_TEST_ROLE";
pub const FD_ENV: &str = "TW_TEST_FD";
pub const T: Duration = Duration::from_secs(30);

/// Spawn this test binary as a child playing `role`; returns it and our connected peer.
pub fn spawn_child(role: &str, cfg: PeerConfig) -> (Child, Peer) {
    let (mine, theirs) = tensorwire::sys::seqpacket_pair().unwrap();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    let fd = tensorwire::sys::inherit_in_child(&mut cmd, theirs.as_fd());
    let child = cmd
        .args(["child_entry", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, role)
        .env(FD_ENV, fd.to_string())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    drop(theirs);
    let peer = Peer::from_fd(mine, cfg).unwrap();
    assert_eq!(peer.peer_pid() as u32, child.id(), "kernel-verified peer pid must be the child's");
    (child, peer)
}

/// In the child: the role and the peer, if this process is a child.
pub fn child_peer() -> Option<(String, Peer)> {
    let role = std::env::var(ROLE_ENV).ok()?;
    let fd: i32 = std::env::var(FD_ENV).ok()?.parse().ok()?;
    // SAFETY: the parent handed us this inherited fd number; nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    Some((role, Peer::from_fd(fd, PeerConfig::default()).unwrap()))
}

pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x1000_0000_01b3))
}

pub fn words(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|w| w.to_le_bytes()).collect()
}

pub fn recv_words(peer: &Peer) -> Vec<u64> {
    match peer.recv(T).unwrap() {
        Incoming::Message { payload, .. } => payload.chunks(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect(),
        other => panic!("expected a message, got {other:?}"),
    }
}

pub fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

pub fn kill9(child: &mut Child) {
    // SAFETY: plain kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    child.wait().unwrap();
}

pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Mappings of memfd segments in this process.
pub fn memfd_maps() -> usize {
    std::fs::read_to_string("/proc/self/maps").unwrap().lines().filter(|l| l.contains("/memfd:")).count()
}

/// Body of every test binary's ignored `child_entry` test: if this process was spawned
/// by `spawn_child`, play the role it was given.
pub fn child_main() {
    let Some((role, peer)) = child_peer() else { return };
    match role.as_str() {
        // Import, checksum, flip the first byte of the view, release, report.
        "verify" => loop {
            match peer.recv(T).unwrap() {
                Incoming::Tensor(t) => {
                    let sum = fnv1a(&t.to_vec().unwrap());
                    let l = t.layout();
                    let at = l.storage_offset as usize * l.dtype.size();
                    if l.numel() > 0 {
                        let mut b = [0u8];
                        t.read_storage(at, &mut b).unwrap();
                        t.write_storage(at, &[!b[0]]).unwrap();
                    }
                    let tag = t.tag();
                    t.release().unwrap();
                    peer.send_message(&words(&[tag, sum]), &[]).unwrap();
                }
                Incoming::Message { payload, .. } if payload == words(&[QUERY]) => {
                    peer.send_message(&words(&[peer.imported_segments() as u64]), &[]).unwrap();
                }
                Incoming::Message { .. } => return,
                Incoming::CudaTensor(t) => panic!("unexpected CUDA tensor {:?}", t.layout()),
            }
        },
        // Import and keep everything until told to report, then wait to be killed.
        "hold" => {
            let mut held = Vec::new();
            loop {
                match peer.recv(T).unwrap() {
                    Incoming::Tensor(t) => held.push(t),
                    Incoming::Message { .. } => {
                        peer.send_message(&words(&[held.len() as u64]), &[]).unwrap();
                        break;
                    }
                    Incoming::CudaTensor(t) => panic!("unexpected CUDA tensor {:?}", t.layout()),
                }
            }
            let _ = peer.recv(tensorwire::Wait::Forever);
            std::process::exit(0);
        }
        // Export three patterned tensors, say so, then wait to be killed.
        "produce_and_die" => {
            let mut keep = Vec::new();
            for i in 0..3u8 {
                let t = SharedTensor::zeros(Layout::contiguous(DType::UInt8, &[4096]).unwrap()).unwrap();
                t.write_storage(0, &vec![i + 1; 4096]).unwrap();
                peer.export(&t, ExportOptions { tag: i as u64, window: None }).unwrap();
                keep.push(t);
            }
            peer.send_message(b"ready", &[]).unwrap();
            let _ = peer.recv(tensorwire::Wait::Forever);
            std::process::exit(0);
        }
        other => panic!("unknown child role {other}"),
    }
}

/// This thread's CPU time (user + system) so far.
pub fn thread_cpu() -> Duration {
    // SAFETY: getrusage writes one `rusage` into the zeroed value we own.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        assert_eq!(libc::getrusage(libc::RUSAGE_THREAD, &mut ru), 0);
        ru
    };
    let tv = |t: libc::timeval| Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// An owner that counts its drops and keeps a segment alive.
pub struct Counted(pub std::sync::Arc<std::sync::atomic::AtomicUsize>, pub std::sync::Arc<tensorwire::Segment>);
impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}
