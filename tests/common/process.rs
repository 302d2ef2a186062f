//! The child-process harness of every cross-process test: the test binary re-executes
//! itself (`tensorwire_test_support::RoleCommand`), running only its ignored `child_entry`
//! test, with a role, an inherited socket, optionally a GPU ring to offer, and extra
//! environment; plus the small helpers both sides of such tests share (word messages,
//! SIGKILL; checksums and bounded waits come from the shared crate).

use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tensorwire::cuda::ring::CudaRingConfig;
use tensorwire::{Incoming, Peer, PeerConfig};
use tensorwire_test_support::RoleCommand;
pub use tensorwire_test_support::{fnv1a, role, wait_until};

/// How long a test waits for anything a live peer does.
pub const T: Duration = Duration::from_secs(30);
pub const FD_ENV: &str = "TW_TEST_FD";
const RING_ENV: &str = "TW_TEST_RING";
const FDS_ENV: &str = "TW_TEST_FDS";

/// Spawn this test binary as a child playing `role` (its `child_entry` test), with `env`
/// added; `ring` is the GPU ring the child offers (it sends through it). Returns the child
/// and our peer, whose config is `cfg`.
pub fn spawn(role: &str, env: &[(&str, &str)], ring: Option<CudaRingConfig>, cfg: PeerConfig) -> (Child, Peer) {
    let (mut cmd, mine, theirs) = child_command(role);
    if let Some(r) = ring {
        cmd.env(RING_ENV, format!("{}:{}", r.slots, r.slot_bytes));
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd.spawn().unwrap();
    drop(theirs);
    let peer = Peer::from_fd(mine, cfg).unwrap();
    assert_eq!(peer.peer_pid() as u32, child.id(), "kernel-verified peer pid must be the child's");
    (child, peer)
}

/// [`spawn`] with no extra environment and no GPU ring.
pub fn spawn_child(role: &str, cfg: PeerConfig) -> (Child, Peer) {
    spawn(role, &[], None, cfg)
}

/// In a child: its role and peer (with the GPU ring its parent asked it to offer).
pub fn child_peer() -> Option<(String, Peer)> {
    let ring = std::env::var(RING_ENV).ok().map(|v| {
        let (s, b) = v.split_once(':').unwrap();
        CudaRingConfig { device: 0, slots: s.parse().unwrap(), slot_bytes: b.parse().unwrap() }
    });
    child_peer_with(PeerConfig { cuda_ring: ring, ..PeerConfig::default() })
}

/// In a child: its role and its peer, set up with `cfg`.
pub fn child_peer_with(cfg: PeerConfig) -> Option<(String, Peer)> {
    let (role, fd) = child_socket()?;
    Some((role, Peer::from_fd(fd, cfg).unwrap()))
}

/// In a child: its role and the raw socket its parent handed it (for children that speak
/// the protocol by hand, or set up their peer themselves).
pub fn child_socket() -> Option<(String, OwnedFd)> {
    let role = role()?;
    let fd: i32 = std::env::var(FD_ENV).ok()?.parse().ok()?;
    // SAFETY: the parent handed us this inherited fd number; nothing else owns it.
    Some((role, unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// Spawn this test binary as a child playing `role`, and return our end of its socket as
/// it is (the child may not be a `Peer`: it may speak the protocol by hand).
pub fn spawn_raw(role: &str) -> (Child, OwnedFd) {
    let (mut cmd, mine, theirs) = child_command(role);
    let child = cmd.spawn().unwrap();
    drop(theirs);
    (child, mine)
}

/// This test binary, to run only its `child_entry` test as `role`, with the child's end of
/// a new socket inherited; returns the command and both ends (close the child's once it
/// is spawned).
fn child_command(role: &str) -> (Command, OwnedFd, OwnedFd) {
    let (mine, theirs) = tensorwire::os::seqpacket_pair().unwrap();
    let mut cmd = child_role(role).command();
    let fd = tensorwire::os::inherit_in_child(&mut cmd, theirs.as_fd());
    cmd.env(FD_ENV, fd.to_string());
    (cmd, mine, theirs)
}

/// This test binary as a child running only its `child_entry` test as `role`.
fn child_role(role: &str) -> RoleCommand {
    RoleCommand::new(role).test("child_entry").stdout(Stdio::null())
}

pub fn words(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|w| w.to_le_bytes()).collect()
}

pub fn unwords(p: &[u8]) -> Vec<u64> {
    p.chunks(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect()
}

/// The next user message from the peer, as bytes.
pub fn recv_msg(peer: &Peer) -> Vec<u8> {
    match peer.recv(T).unwrap() {
        Incoming::Message { payload, .. } => payload,
        other => panic!("expected a message, got {other:?}"),
    }
}

/// The next user message from the peer, as 64-bit words.
pub fn recv_words(peer: &Peer) -> Vec<u64> {
    unwords(&recv_msg(peer))
}

pub fn kill9(child: &mut Child) {
    // SAFETY: plain kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    child.wait().unwrap();
}

/// Spawn this test binary as a child playing `role` with several sockets (`fds`,
/// inherited; the child takes them with [`child_peers`]), for tests of three processes.
pub fn spawn_with_fds(role: &str, fds: &[BorrowedFd<'_>]) -> Child {
    let mut cmd = child_role(role).command();
    let nums: Vec<String> = fds.iter().map(|fd| tensorwire::os::inherit_in_child(&mut cmd, *fd).to_string()).collect();
    cmd.env(FDS_ENV, nums.join(",")).spawn().unwrap()
}

/// In a child spawned by [`spawn_with_fds`]: its role and a peer over each of its sockets,
/// in order.
pub fn child_peers() -> Option<(String, Vec<Peer>)> {
    let fds = std::env::var(FDS_ENV).ok()?;
    let role = role()?;
    let peers = fds
        .split(',')
        // SAFETY: the parent handed us these inherited fd numbers; nothing else owns them.
        .map(|n| unsafe { OwnedFd::from_raw_fd(n.parse().unwrap()) })
        .map(|fd| Peer::from_fd(fd, PeerConfig::default()).unwrap())
        .collect();
    Some((role, peers))
}

/// Three processes: this one (the host) and two children, "relay" and "last", each
/// connected to the host (commands, reports) and to each other (the forward).
pub struct Chain {
    pub relay: Child,
    pub last: Child,
    pub to_relay: Peer,
    pub to_last: Peer,
}

/// Host ↔ relay, host ↔ last, relay ↔ last; each child gets [host, the other child].
pub fn chain() -> Chain {
    let (h_r, r_h) = tensorwire::os::seqpacket_pair().unwrap();
    let (h_l, l_h) = tensorwire::os::seqpacket_pair().unwrap();
    let (r_l, l_r) = tensorwire::os::seqpacket_pair().unwrap();
    let relay = spawn_with_fds("relay", &[r_h.as_fd(), r_l.as_fd()]);
    let last = spawn_with_fds("last", &[l_h.as_fd(), l_r.as_fd()]);
    drop((r_h, r_l, l_h, l_r));
    let to_relay = Peer::from_fd(h_r, PeerConfig::default()).unwrap();
    let to_last = Peer::from_fd(h_l, PeerConfig::default()).unwrap();
    Chain { relay, last, to_relay, to_last }
}

/// Run the tests of one binary that call this one at a time (they compare counters of
/// this whole process: open fds, driver objects); a test that panicked leaves the lock
/// usable.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}
