//! Hostile peers against a server's resources, each through the public API and the raw
//! protocol, with the victim in a child process (see `support`) so its fds, threads and
//! peak RSS can be watched and limits (setrlimit) put on it alone:
//!
//! - an idle-connection flood under a 1,024-fd limit must not stop the accept loop; over
//!   the connection cap a new connection is refused with a message naming the cap; a
//!   connection costs one fd (these hold idle connections, so their victims turn off
//!   `first_message_timeout`, which otherwise frees a silent connection's slot: see
//!   `hostile.rs`);
//! - `native_hello` is accepted once per connection;
//! - a tiny file tensor viewed as a huge broadcast (stride 0) cannot make the server
//!   allocate by its element count (under a 3 GiB address-space limit it used to abort);
//! - a 60 MB JSON array costs a bounded multiple of its size to decode.

mod support;

use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};
use support::*;
use tensorwire_rpc::*;

/// A non-blocking connect: a full backlog is `WouldBlock`, not a hang.
fn connect_nonblocking(addr: &str) -> std::io::Result<UnixStream> {
    // SAFETY: plain syscall; the fd is owned below.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh fd from the kernel, owned by nobody else.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_un is plain data; all-zero is a valid value.
    let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in sa.sun_path.iter_mut().zip(addr.as_bytes()) {
        *d = *s as libc::c_char;
    }
    let len = (std::mem::size_of::<libc::sa_family_t>() + addr.len() + 1) as libc::socklen_t;
    // SAFETY: `sa` is a valid sockaddr_un of `len` bytes (path NUL-terminated: zeroed).
    let rc = unsafe { libc::connect(owned.as_raw_fd(), (&sa as *const libc::sockaddr_un).cast(), len) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(UnixStream::from(owned))
}

/// What a flooding connection has seen so far.
#[derive(Debug, Clone, PartialEq)]
enum Seen {
    /// Nothing yet, still open.
    Idle,
    /// The server wrote this and hung up.
    Refused(String),
}

fn probe(s: &mut UnixStream, got: &mut Vec<u8>) -> Option<Seen> {
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Some(Seen::Refused(String::from_utf8_lossy(got).into_owned())),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return if got.is_empty() { Some(Seen::Idle) } else { None },
            Err(e) => return Some(Seen::Refused(format!("{}: {e}", String::from_utf8_lossy(got)))),
        }
    }
}

/// Open `n` idle connections (retrying while the backlog is full), stopping early if the
/// server goes away; then wait until the server has dealt with all of them.
fn flood(v: &mut Victim, n: usize) -> (Vec<UnixStream>, Vec<Seen>) {
    let mut socks = Vec::with_capacity(n);
    let deadline = Instant::now() + Duration::from_secs(30);
    while socks.len() < n && Instant::now() < deadline {
        match connect_nonblocking(&v.addr) {
            Ok(s) => socks.push(s),
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => std::thread::sleep(Duration::from_millis(1)),
            Err(e) => {
                eprintln!("flood: connect #{} failed: {e}", socks.len());
                break;
            }
        }
    }
    // Let the accept loop catch up: wait until the picture stops changing (for long
    // enough that a server starved of CPU on a loaded machine is not taken for done).
    let mut got: Vec<Vec<u8>> = vec![Vec::new(); socks.len()];
    let mut seen = vec![Seen::Idle; socks.len()];
    let mut last_change = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(40);
    while last_change.elapsed() < Duration::from_secs(2) && Instant::now() < deadline {
        for (i, s) in socks.iter_mut().enumerate() {
            if seen[i] == Seen::Idle || got[i].is_empty() {
                if let Some(now) = probe(s, &mut got[i]) {
                    if now != seen[i] {
                        seen[i] = now;
                        last_change = Instant::now();
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    (socks, seen)
}

/// A fresh well-behaved client is served (retrying a few seconds while closed
/// connections are noticed).
fn assert_serves_again(v: &mut Victim) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match v.call("ping", vec![]) {
            Ok(r) => {
                assert_eq!(r, Value::from("pong"));
                return;
            }
            Err(e) if Instant::now() < deadline && v.alive() => {
                eprintln!("ping not served yet: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!("a fresh client is not served: {e}; {}", v.report()),
        }
    }
}

/// The two flood tests run one at a time (each holds its whole flood open).
static FLOOD_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// How many connections to flood with and the victim's fd limit: 1,500 against 1,024
/// fds where this process may open enough; scaled down (flood ≥ 4/3 × the victim's
/// limit) where its hard limit is lower, e.g. 1,024 on some desktops.
fn flood_plan() -> (usize, u64) {
    let own = raise_own_nofile(4096) as usize;
    let flood = 1500.min(own.saturating_sub(200));
    let nofile = 1024.min(flood * 3 / 4) as u64;
    assert!(nofile > 2 * RpcConfig::default().max_connections as u64, "this test needs ~1,100 fds of its own; the limit is {own}");
    (flood, nofile)
}

#[test]
fn idle_connection_flood_under_1024_fds_is_capped_and_survived() {
    if victim_role().is_some() {
        run_victim(|cfg| cfg.first_message_timeout = None); // counts idle connections: they stay
    }
    let _one_at_a_time = FLOOD_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let (n, nofile) = flood_plan();
    let mut v = Victim::spawn("idle_connection_flood_under_1024_fds_is_capped_and_survived", &VictimSpec { nofile: Some(nofile), ..Default::default() });
    let (socks, seen) = flood(&mut v, n);
    assert!(v.alive(), "the server died under {} idle connections: {}", socks.len(), v.report());
    assert_eq!(socks.len(), n, "every connect reached the server: {}", v.report());
    let cap = RpcConfig::default().max_connections;
    let idle = seen.iter().filter(|s| **s == Seen::Idle).count();
    let refused: Vec<&String> = seen.iter().filter_map(|s| if let Seen::Refused(m) = s { Some(m) } else { None }).collect();
    eprintln!("flood of {n} under {nofile} fds: {idle} served (idle), {} refused; first refusal: {:?}", refused.len(), refused.first());
    assert_eq!(idle, cap, "the first {cap} connections are served, no more: {}", v.report());
    assert_eq!(refused.len(), n - cap, "every connection over the cap is refused, none left waiting");
    assert!(refused.iter().all(|m| m.contains("max_connections")), "refusals must name the cap: {:?}", refused.first());
    drop(socks);
    assert_serves_again(&mut v);
    assert!(!v.stderr().contains("panicked"), "{}", v.stderr());
}

#[test]
fn accept_out_of_fds_is_logged_and_survived() {
    if victim_role().is_some() {
        // A cap the fd limit cannot reach: accept itself runs out of fds.
        run_victim(|cfg| {
            cfg.max_connections = 100_000;
            cfg.first_message_timeout = None; // the idle flood keeps the fds taken
        });
    }
    let _one_at_a_time = FLOOD_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let (n, nofile) = flood_plan();
    let mut v = Victim::spawn("accept_out_of_fds_is_logged_and_survived", &VictimSpec { nofile: Some(nofile), ..Default::default() });
    let (socks, seen) = flood(&mut v, n);
    assert!(v.alive(), "the server died out of fds: {}", v.report());
    let idle = seen.iter().filter(|s| **s == Seen::Idle).count();
    let refused: Vec<&String> = seen.iter().filter_map(|s| if let Seen::Refused(m) = s { Some(m) } else { None }).collect();
    eprintln!("flood of {n} under {nofile} fds, no effective cap: {idle} served (idle), {} refused; first refusal: {:?}", refused.len(), refused.first());
    assert!(idle < nofile as usize && idle + 100 > nofile as usize, "about as many served as fds allow: {idle}");
    assert!(refused.len() + idle == socks.len(), "none left waiting");
    assert!(refused.iter().all(|m| m.contains("out of file descriptors")), "{:?}", refused.first());
    let log = v.stderr();
    assert!(log.contains("accept failed") && log.contains("Too many open files"), "the failure is logged: {log}");
    assert!(log.lines().count() < 100, "the log is rate-limited: {} lines", log.lines().count());
    drop(socks);
    assert_serves_again(&mut v);
}

#[test]
fn a_connection_costs_one_fd() {
    if victim_role().is_some() {
        run_victim(|cfg| cfg.first_message_timeout = None); // measures idle connections
    }
    let v = Victim::spawn("a_connection_costs_one_fd", &VictimSpec::default());
    let (fds0, threads0) = (v.settle(Duration::from_secs(5), Victim::fds), v.threads());
    let n = 100;
    let socks: Vec<UnixStream> = (0..n).map(|_| v.raw()).collect();
    let fds1 = v.settle(Duration::from_secs(10), |v| v.fds());
    let threads1 = v.threads();
    let per_conn = (fds1 - fds0) as f64 / n as f64;
    eprintln!("{n} idle connections: {per_conn:.2} fds and {:.2} threads per connection", (threads1 - threads0) as f64 / n as f64);
    assert!(fds1 - fds0 <= n + 5, "{per_conn:.2} fds per connection (one socket needs one)");
    drop(socks);
}

fn hello_frame(call_id: i64) -> Vec<u8> {
    frame(
        format!(r#"{{"kind": "call", "object_id": "__tensorwire__", "call_id": {call_id}, "parent_call_id": null, "method": "native_hello", "args": [1], "kwargs": {{}}}}"#)
            .as_bytes(),
    )
}

#[test]
fn native_hello_is_accepted_once_per_connection() {
    if victim_role().is_some() {
        run_victim(|_| {});
    }
    let v = Victim::spawn("native_hello_is_accepted_once_per_connection", &VictimSpec::default());
    let mut raw = v.raw();
    let (fds0, threads0) = (v.settle(Duration::from_secs(5), Victim::fds), v.threads());
    let rss0 = v.status_kb("VmRSS");
    let hellos = 40;
    let mut accepted = 0;
    let mut refused = Vec::new();
    let mut attackers = Vec::new();
    for i in 0..hellos {
        let (mine, theirs) = tensorwire::os::seqpacket_pair().unwrap();
        tensorwire::os::send_msg(raw.as_fd(), &hello_frame(i), &[theirs.as_fd()], false, None).unwrap();
        drop(theirs);
        let resp = String::from_utf8(read_frame(&mut raw).expect("a response to native_hello")).unwrap();
        if resp.contains("\"result\": true") {
            accepted += 1;
        } else {
            refused.push(resp);
        }
        // Answer the setup as a real peer would (the costly case for the server).
        let cfg = tensorwire::PeerConfig { handshake_timeout: Duration::from_secs(3).into(), ..Default::default() };
        attackers.push(std::thread::spawn(move || tensorwire::Peer::from_fd(mine, cfg).ok()));
    }
    let peers: Vec<_> = attackers.into_iter().map(|t| t.join().unwrap()).collect();
    let live = peers.iter().filter(|p| p.is_some()).count();
    let fds1 = v.settle(Duration::from_secs(5), Victim::fds);
    let threads1 = v.settle(Duration::from_secs(5), Victim::threads);
    let rss1 = v.status_kb("VmRSS");
    eprintln!(
        "{hellos} native_hellos: {accepted} accepted, {} refused, {live} transport peers set up; server grew by {} fds, {} threads, {} KiB RSS",
        refused.len(),
        fds1 as i64 - fds0 as i64,
        threads1 as i64 - threads0 as i64,
        rss1 as i64 - rss0 as i64
    );
    assert_eq!(accepted, 1, "one native negotiation per connection");
    assert!(refused.iter().all(|r| r.contains("native_hello") && r.contains("already")), "clear refusal: {:?}", refused.first());
    assert_eq!(live, 1, "only the accepted hello becomes a transport peer");
    assert!(threads1 <= threads0 + 4, "threads {threads0} -> {threads1}");
    assert!(fds1 <= fds0 + 12, "fds {fds0} -> {fds1}");
    // The connection still works.
    raw.write_all(&call_frame(1000, "ping", "[]")).unwrap();
    assert!(String::from_utf8(read_frame(&mut raw).unwrap()).unwrap().contains("pong"));
}

/// A 68-byte PyTorch file_system shm file: refcount 1 at offset 0, one float32 at 64.
struct ShmFile(String);
impl ShmFile {
    fn new() -> ShmFile {
        let key = format!("/tw_hostile_{}_{}", std::process::id(), Instant::now().elapsed().as_nanos());
        let mut bytes = vec![0u8; 68];
        bytes[..4].copy_from_slice(&1i32.to_ne_bytes());
        bytes[64..].copy_from_slice(&1.5f32.to_ne_bytes());
        std::fs::write(format!("/dev/shm{key}"), &bytes).unwrap();
        ShmFile(key)
    }
}
impl Drop for ShmFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(format!("/dev/shm{}", self.0));
    }
}

#[test]
fn broadcast_view_of_a_tiny_file_cannot_size_allocations() {
    if victim_role().is_some() {
        // A peer trusted with file_system tensors, which still cannot size our copies.
        run_victim(|c| c.accept_fs_tensors = true);
    }
    // 3 GiB of address space: the 1 GiB packed copy fits, the 2 GiB f64 vector does not.
    let mut v = Victim::spawn(
        "broadcast_view_of_a_tiny_file_cannot_size_allocations",
        &VictimSpec { address_space: Some(3 << 30), ..Default::default() },
    );
    let f = ShmFile::new();
    let tref = format!(
        r#"{{"__type__": "TensorRef", "device": "cpu", "strategy": "file_system_borrowed", "manager_path": "", "storage_key": "{}", "storage_size": 4, "dtype": "torch.float32", "tensor_size": [268435456], "tensor_stride": [0], "tensor_offset": 0, "requires_grad": false}}"#,
        f.0
    );
    let mut raw = v.raw();
    raw.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    raw.write_all(&call_frame(0, "sum", &format!("[{tref}]"))).unwrap();
    let resp = read_frame(&mut raw).map(|b| String::from_utf8_lossy(&b).into_owned());
    let hwm = v.status_kb("VmHWM");
    eprintln!("float32[2^28] stride-0 view of a 4-byte file: response {resp:?}; server peak RSS {} MiB", hwm / 1024);
    let resp = resp.unwrap_or_else(|e| panic!("no response ({e}): {}", v.report()));
    assert!(resp.contains("max_tensor_copy"), "the error names the limit: {resp}");
    assert!(v.alive(), "{}", v.report());
    assert!(hwm < 512 * 1024, "peak RSS {hwm} kB");
    // A small view of the same file still works.
    let ok = tref.replace("[268435456]", "[3]");
    raw.write_all(&call_frame(1, "sum", &format!("[{ok}]"))).unwrap();
    let resp = String::from_utf8(read_frame(&mut raw).unwrap()).unwrap();
    assert!(resp.contains("\"result\": 4.5"), "{resp}");
}

#[test]
fn a_60_mb_json_array_costs_a_bounded_multiple_of_its_size() {
    if victim_role().is_some() {
        run_victim(|_| {});
    }
    let mut v = Victim::spawn("a_60_mb_json_array_costs_a_bounded_multiple_of_its_size", &VictimSpec::default());
    // As Python's json.dumps writes a list of zeros: "0, " per element.
    let n = 20_000_000;
    let mut arr = String::with_capacity(3 * n + 2);
    arr.push('[');
    for i in 0..n {
        arr.push_str(if i == 0 { "0" } else { ", 0" });
    }
    arr.push(']');
    let msg = call_frame(0, "echo", &format!("[{arr}]"));
    drop(arr);
    let size_mib = msg.len() as f64 / (1 << 20) as f64;
    let hwm0 = v.status_kb("VmHWM");
    let raw = v.raw();
    raw.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let writer = {
        let mut w = raw.try_clone().unwrap();
        std::thread::spawn(move || w.write_all(&msg))
    };
    // The answer: a response or an error notice, then maybe a hang-up.
    let mut reply = Vec::new();
    let _ = raw.take(4096).read_to_end(&mut reply);
    let _ = writer.join();
    let hwm1 = v.status_kb("VmHWM");
    let grew = (hwm1 - hwm0) as f64 / 1024.0;
    let head = String::from_utf8_lossy(&reply[..reply.len().min(400)]).into_owned();
    eprintln!("{size_mib:.1} MiB JSON array frame: server peak RSS grew {grew:.0} MiB ({:.1}x the frame); reply starts {head:?}", grew / size_mib);
    assert!(v.alive(), "{}", v.report());
    assert!(grew < 3.0 * size_mib, "decoding a {size_mib:.0} MiB frame cost {grew:.0} MiB");
    assert!(head.contains("max_values"), "a clear error naming the limit: {head}");
    assert_serves_again(&mut v);
}
