//! Ring latency and throughput between two processes, against baselines measured in the
//! same run between the same kind of process pair:
//!   - a Unix socket moving the same bytes (SOCK_STREAM socketpair, ping-pong);
//!   - the raw floors: a bare spin ping-pong and a bare futex ping-pong on one shared word;
//!   - for 4 KiB, a bare copy-through ping-pong: each side copies the 4 KiB into its own
//!     page of a shared segment, flips the shared word (Release); the other spins on it
//!     (Acquire), copies the page out, and replies the same way — no headers, no
//!     validation: the 64 cache lines a copy-out receive must pull from the other core,
//!     which the one-word spin floor does not move (the ring can beat it: its producer
//!     takes ownership of the next record's lines while it waits for the reply, where
//!     the bare copy-in into the page the other side just read pays for them in line);
//!   - iceoryx2 (crates.io, a bench-only dev-dependency): publish-subscribe ping-pong at
//!     64 B and 4 KiB, zero-copy loans, busy-waiting subscribers — the method of iceoryx2's
//!     own publish-subscribe benchmark, between the same two pinned processes, with the
//!     bytes copied into each loan and out of each sample as the ring copies them
//!     (`support/iceoryx2_pingpong.rs` says exactly what it mirrors and where it differs);
//!   - for throughput, a bare copy-through pipeline: two pinned threads copying the same
//!     bytes in and out of a shared buffer of the ring's size in 1 MiB slots with bare
//!     spinning counters (no headers, no validation, no futex) — what two cores do with
//!     those bytes at all; and, as information only, single-thread memcpy bandwidth (a
//!     1 MiB memcpy runs from L2, out of reach of anything that crosses cores).
//!
//! One-way latency = half a ping-pong round trip (the echo goes back through the other
//! direction's ring / socket / word / service). "Spinning" = both sides poll before sleeping
//! with a budget far longer than a round trip; "sleeping" = spin budget 0, straight to
//! FUTEX_WAIT. Messages are copied out on receive (`ring_recv_into`, buffer reused), as the
//! socket's bytes are copied out by `read` and iceoryx2's samples by `copy_from_slice`.
//! Parent and child are pinned to CPUs 0 and 1. Every latency row: the same warm-up, then
//! the same number of timed round trips per size.
//!
//! Targets (DESIGN.md), printed as verdict lines at the end of each half (printed, never
//! asserted: `cargo test --benches` runs a brief pass whose numbers mean nothing):
//!   - spinning one-way p50 ≤ 2x the spin floor at 64 B, ≤ 4x at 4 KiB, and at 4 KiB
//!     ≤ 1.5x the bare 4 KiB copy-through floor;
//!   - sleeping one-way p50 ≤ 1.5x the futex floor at 64 B;
//!   - spinning one-way p50 ≤ iceoryx2's at 64 B and 4 KiB;
//!   - throughput ≥ 90% of the bare two-core pipeline at every size.
//!
//!   cargo bench --bench ring            (full)      cargo bench --bench ring -- --quick
//!   cargo bench --bench ring -- [--quick] latency    (or throughput: that half only)
//!
//! The bench re-executes itself as the child (`TW_RING_BENCH=<mode>:<fd>`).

#[path = "support/iceoryx2_pingpong.rs"]
mod iceoryx2_pingpong;

use std::io::{Read, Write};
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};
use tensorwire::{Peer, PeerConfig, RingItem, Segment};

const ENV: &str = "TW_RING_BENCH";
const SPIN_FOREVER: u32 = 1 << 28;
/// Throughput runs wait like a bulk consumer would: a short spin, then sleep in the
/// futex — spinning forever on two cores would only steal time from the other side.
const BULK_SPIN: u32 = 2000;
const T: Duration = Duration::from_secs(60);
fn ring_bytes() -> usize {
    std::env::var("TW_RING_BYTES").ok().and_then(|v| v.parse().ok()).unwrap_or(16 << 20)
}

fn cfg(spin: u32) -> PeerConfig {
    PeerConfig { ring_bytes: ring_bytes(), ring_spin: spin, ..PeerConfig::default() }
}

/// Ring for latency runs: large enough that a message fits one record, small enough that
/// the records cycle through warm cache lines (as a latency-sensitive user would size it).
fn latency_cfg(spin: u32, size: usize) -> PeerConfig {
    PeerConfig { ring_bytes: (4 * size).next_power_of_two().max(64 << 10), ring_spin: spin, ..PeerConfig::default() }
}

/// Pin this process to `cpu` (when the machine has at least two), so every ping-pong —
/// baselines and ring alike — runs parent on CPU 0 and child on CPU 1 instead of starting
/// co-scheduled on one core (the scheduler places a woken child next to its waker).
fn pin(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is valid; CPU_SET and sched_setaffinity only touch it.
    unsafe {
        if libc::sysconf(libc::_SC_NPROCESSORS_ONLN) < 2 {
            return;
        }
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

fn main() {
    if let Ok(spec) = std::env::var(ENV) {
        pin(1);
        let (mode, fd) = spec.split_once(':').expect("mode:fd");
        // SAFETY: the inherited fd number our parent passed.
        child(mode, unsafe { OwnedFd::from_raw_fd(fd.parse().unwrap()) });
        return;
    }
    let quick = std::env::args().any(|a| a == "--quick");
    // `cargo bench` passes --bench; `cargo test --benches` runs us without it: be brief.
    let as_test = !std::env::args().any(|a| a == "--bench");
    let scale = if as_test { 0.01 } else if quick { 0.2 } else { 1.0 };
    let n = |full: usize| ((full as f64 * scale) as usize).max(20);
    pin(0);
    parent(n, as_test);
}

fn spawn(mode: &str) -> (std::process::Child, OwnedFd) {
    let (mine, theirs) = tensorwire::os::seqpacket_pair().unwrap();
    spawn_with(mode, mine, theirs)
}

fn spawn_with(mode: &str, mine: OwnedFd, theirs: OwnedFd) -> (std::process::Child, OwnedFd) {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    let fd = tensorwire::os::inherit_in_child(&mut cmd, theirs.as_fd());
    let child = cmd.env(ENV, format!("{mode}:{fd}")).spawn().unwrap();
    drop(theirs);
    (child, mine)
}

/// A shared 64-byte page for the bare ping-pongs: word 0 is the ball.
fn shared_word(seg: &Segment) -> &AtomicU32 {
    // SAFETY: offset 0 of a live, page-aligned mapping; accessed only atomically.
    unsafe { &*seg.as_ptr().cast::<AtomicU32>() }
}

fn child(mode: &str, fd: OwnedFd) {
    match mode {
        "spin" | "futex" => {
            // Receive the shared page, then bounce the ball: odd values are ours to answer.
            let c = tensorwire::Connection::establish(fd, T).unwrap();
            let mut m = c.recv(Some(T)).unwrap();
            let seg = Segment::from_fd(m.fds.pop().unwrap(), 64).unwrap();
            let w = shared_word(&seg);
            loop {
                let v = wait_for(w, |v| v % 2 == 1 || v == u32::MAX, mode == "spin");
                if v == u32::MAX {
                    return;
                }
                w.store(v + 1, Ordering::Release);
                if mode == "futex" {
                    tensorwire::sync::futex::wake_all(w);
                }
            }
        }
        "copy" => {
            // Receive the segment (the ball at 0, our page to read at 4096, the one to
            // write after it; the message size in the payload), then bounce the bytes.
            let c = tensorwire::Connection::establish(fd, T).unwrap();
            let mut m = c.recv(Some(T)).unwrap();
            let size = usize::from_le_bytes(m.payload[..8].try_into().unwrap());
            let seg = Segment::from_fd(m.fds.pop().unwrap(), 4096 + 2 * size).unwrap();
            let w = shared_word(&seg);
            let mut buf = vec![0u8; size];
            loop {
                let v = wait_for(w, |v| v % 2 == 1 || v == u32::MAX, true);
                if v == u32::MAX {
                    return;
                }
                seg.read_at(4096, &mut buf).unwrap();
                seg.write_at(4096 + size, &buf).unwrap();
                // Release: pairs with the parent's Acquire load of the ball; the page is
                // written before it.
                w.store(v + 1, Ordering::Release);
            }
        }
        "sock" => {
            let mut s = UnixStream::from(fd);
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let mut len = [0u8; 4];
                if s.read_exact(&mut len).is_err() {
                    return;
                }
                let n = u32::from_le_bytes(len) as usize;
                s.read_exact(&mut buf[..n]).unwrap();
                s.write_all(&len).unwrap();
                s.write_all(&buf[..n]).unwrap();
            }
        }
        "ring_spin" | "ring_sleep" => {
            let spin = if mode == "ring_spin" { SPIN_FOREVER } else { 0 };
            let size: usize = std::env::var("TW_RING_MSG").unwrap().parse().unwrap();
            let peer = Peer::from_fd(fd, latency_cfg(spin, size)).unwrap();
            let mut buf = Vec::new();
            loop {
                match peer.ring_recv_into(&mut buf, T) {
                    Ok((tag, _)) => peer.ring_send(&[RingItem::bytes(tag, &buf)], T).unwrap(),
                    Err(e) if e.is_peer_gone() => return,
                    Err(e) => panic!("{e}"),
                }
            }
        }
        "ring_sink" => {
            let peer = Peer::from_fd(fd, cfg(BULK_SPIN)).unwrap();
            let mut buf = Vec::new();
            loop {
                match peer.ring_recv_into(&mut buf, T) {
                    Ok((tag, _)) if tag == u64::MAX => peer.send_message(b"done", &[]).unwrap(),
                    Ok(_) => {}
                    Err(e) if e.is_peer_gone() => return,
                    Err(e) => panic!("{e}"),
                }
            }
        }
        iceoryx2_pingpong::MODE => iceoryx2_pingpong::echo(fd),
        other => panic!("unknown mode {other}"),
    }
}

fn wait_for(w: &AtomicU32, ready: impl Fn(u32) -> bool, spin: bool) -> u32 {
    loop {
        // Acquire: pairs with the other side's Release store of the ball.
        let v = w.load(Ordering::Acquire);
        if ready(v) {
            return v;
        }
        if spin {
            std::hint::spin_loop();
        } else {
            tensorwire::sync::futex::wait(w, v, Some(Duration::from_millis(100)));
        }
    }
}

struct Stats {
    p50: f64,
    p99: f64,
}

/// One-way latency (µs) from `iters` timed round trips after `warm` untimed ones.
fn one_way(iters: usize, mut round_trip: impl FnMut()) -> Stats {
    for _ in 0..iters / 10 + 10 {
        round_trip();
    }
    let mut v: Vec<f64> = (0..iters)
        .map(|_| {
            let t = Instant::now();
            round_trip();
            t.elapsed().as_secs_f64() * 1e6 / 2.0
        })
        .collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Stats { p50: v[v.len() / 2], p99: v[(v.len() * 99 / 100).min(v.len() - 1)] }
}

fn bare_pingpong(mode: &str, iters: usize) -> Stats {
    let (mut child, fd) = spawn(mode);
    let c = tensorwire::Connection::establish(fd, T).unwrap();
    let seg = Segment::create(4096).unwrap();
    c.send(1, b"page", &[seg.fd()]).unwrap();
    let w = shared_word(&seg);
    let spin = mode == "spin";
    let mut ball = 0u32;
    let s = one_way(iters, || {
        // Release: pairs with the child's Acquire load of the ball.
        w.store(ball + 1, Ordering::Release);
        if !spin {
            tensorwire::sync::futex::wake_all(w);
        }
        ball = wait_for(w, |v| v == ball + 2, spin);
    });
    w.store(u32::MAX, Ordering::Release);
    tensorwire::sync::futex::wake_all(w);
    child.wait().unwrap();
    s
}

/// One-way latency of the bare copy-through ping-pong (see the module docs): `size` bytes
/// each way through two pages of one shared segment, a shared word to hand over.
fn bare_copy_pingpong(size: usize, iters: usize) -> Stats {
    let (mut child, fd) = spawn("copy");
    let c = tensorwire::Connection::establish(fd, T).unwrap();
    let seg = Segment::create(4096 + 2 * size).unwrap();
    c.send(1, &size.to_le_bytes(), &[seg.fd()]).unwrap();
    let w = shared_word(&seg);
    let msg = vec![7u8; size];
    let mut back = vec![0u8; size];
    let mut ball = 0u32;
    let s = one_way(iters, || {
        seg.write_at(4096, &msg).unwrap();
        // Release: pairs with the child's Acquire load of the ball; the page is written
        // before it.
        w.store(ball + 1, Ordering::Release);
        ball = wait_for(w, |v| v == ball + 2, true);
        seg.read_at(4096 + size, &mut back).unwrap();
    });
    w.store(u32::MAX, Ordering::Release);
    child.wait().unwrap();
    s
}

fn socket_pingpong(size: usize, iters: usize) -> Stats {
    let (a, b) = UnixStream::pair().unwrap();
    let (mut child, _unused) = spawn_with("sock", OwnedFd::from(a.try_clone().unwrap()), OwnedFd::from(b));
    drop(_unused);
    let mut s = a;
    let msg = vec![7u8; size];
    let mut back = vec![0u8; size];
    let st = one_way(iters, || {
        s.write_all(&(size as u32).to_le_bytes()).unwrap();
        s.write_all(&msg).unwrap();
        let mut len = [0u8; 4];
        s.read_exact(&mut len).unwrap();
        s.read_exact(&mut back).unwrap();
    });
    drop(s);
    child.wait().unwrap();
    st
}

fn ring_pingpong(size: usize, iters: usize, spin: bool) -> Stats {
    // SAFETY: single-threaded at this point of the bench; the child reads it at start.
    unsafe { std::env::set_var("TW_RING_MSG", size.to_string()) };
    let (mut child, fd) = spawn(if spin { "ring_spin" } else { "ring_sleep" });
    let spin = if spin { SPIN_FOREVER } else { 0 };
    let peer = Peer::from_fd(fd, latency_cfg(spin, size)).unwrap();
    let msg = vec![7u8; size];
    let mut back = Vec::with_capacity(size);
    let w = T;
    let mut tag = 0u64;
    let st = one_way(iters, || {
        peer.ring_send(&[RingItem::bytes(tag, &msg)], w).unwrap();
        let (t, _) = peer.ring_recv_into(&mut back, w).unwrap();
        assert_eq!((t, back.len()), (tag, size));
        tag += 1;
    });
    drop(peer);
    child.wait().unwrap();
    st
}

/// µs for one 64-byte send + receive within one thread (no waiting, no cache misses).
fn same_thread_cost(iters: usize) -> f64 {
    let (a, b) = Peer::pair(latency_cfg(0, 64)).unwrap();
    let w = T;
    let msg = [7u8; 64];
    let mut buf = Vec::with_capacity(64);
    let mut run = |n: usize| {
        let t = Instant::now();
        for i in 0..n as u64 {
            a.ring_send(&[RingItem::bytes(i, &msg)], w).unwrap();
            b.ring_recv_into(&mut buf, w).unwrap();
        }
        t.elapsed().as_secs_f64() * 1e6 / n as f64
    };
    run(iters / 10 + 10);
    run(iters)
}

/// Bytes/s through the ring for `count` messages of `size` (after one warm-up message).
fn ring_throughput(size: usize, count: usize) -> f64 {
    let (mut child, fd) = spawn("ring_sink");
    let peer = Peer::from_fd(fd, cfg(BULK_SPIN)).unwrap();
    let data: Vec<u8> = (0..size).map(|k| k as u8).collect();
    let w = T;
    let round = |n: usize| {
        let t = Instant::now();
        for i in 0..n {
            peer.ring_send(&[RingItem::bytes(i as u64, &data)], w).unwrap();
        }
        peer.ring_send(&[RingItem::bytes(u64::MAX, b"")], w).unwrap();
        match peer.recv(T).unwrap() {
            tensorwire::Incoming::Message { payload, .. } => assert_eq!(payload, b"done"),
            other => panic!("{other:?}"),
        }
        t.elapsed()
    };
    round(2);
    let el = round(count);
    drop(peer);
    child.wait().unwrap();
    (size * count) as f64 / el.as_secs_f64()
}

fn memcpy_bw(size: usize, count: usize) -> f64 {
    let src: Vec<u8> = (0..size).map(|k| k as u8).collect();
    let mut dst = vec![0u8; size];
    dst.copy_from_slice(&src);
    let t = Instant::now();
    for _ in 0..count {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    }
    (size * count) as f64 / t.elapsed().as_secs_f64()
}

/// Bytes/s of the bare copy-through pipeline: the calling thread (pinned to CPU 0) copies
/// `count` messages of `size` into a `ring_bytes()` buffer in ≤ 1 MiB slots, a thread
/// pinned to CPU 1 copies each slot out into one reused destination.
fn bare_copy_through(size: usize, count: usize) -> f64 {
    use std::sync::atomic::AtomicU64;
    let slot = size.clamp(1, 1 << 20);
    let nslots = (ring_bytes() / slot).max(2);
    let buf = vec![1u8; nslots * slot]; // written, so faulted in (the ring is pre-faulted too)
    let base = buf.as_ptr() as usize;
    let chunks_per_msg = size.div_ceil(slot);
    let total = (count * chunks_per_msg) as u64;
    #[repr(align(128))]
    struct Line(AtomicU64);
    let (published, consumed) = (Line(AtomicU64::new(0)), Line(AtomicU64::new(0)));
    let (published, consumed) = (&published.0, &consumed.0);
    let src: Vec<u8> = (0..size).map(|k| k as u8).collect();
    let t = std::thread::scope(|sc| {
        sc.spawn(|| {
            pin(1);
            let mut dst = vec![1u8; size];
            for k in 0..total {
                // Acquire: pairs with the producer's Release store after filling slot k.
                while published.load(Ordering::Acquire) <= k {
                    std::hint::spin_loop();
                }
                let off = (k as usize % chunks_per_msg) * slot;
                let len = slot.min(size - off);
                // SAFETY: slot k % nslots lies inside `buf`, fully written before `published`
                // passed k, and not written again until `consumed` passes k.
                let from = unsafe { std::slice::from_raw_parts((base + (k as usize % nslots) * slot) as *const u8, len) };
                dst[off..off + len].copy_from_slice(from);
                // Release: pairs with the producer's Acquire load before reusing the slot.
                consumed.store(k + 1, Ordering::Release);
            }
            std::hint::black_box(&dst);
        });
        let t = Instant::now();
        for k in 0..total {
            // Acquire: pairs with the consumer's Release store after copying a slot out.
            while consumed.load(Ordering::Acquire) + (nslots as u64) <= k {
                std::hint::spin_loop();
            }
            let off = (k as usize % chunks_per_msg) * slot;
            let len = slot.min(size - off);
            // SAFETY: as above; the consumer is done with this slot's previous use.
            let to = unsafe { std::slice::from_raw_parts_mut((base + (k as usize % nslots) * slot) as *mut u8, len) };
            to.copy_from_slice(&src[off..off + len]);
            // Release: pairs with the consumer's Acquire load.
            published.store(k + 1, Ordering::Release);
        }
        while consumed.load(Ordering::Acquire) < total {
            std::hint::spin_loop();
        }
        t.elapsed()
    });
    drop(buf);
    (size * count) as f64 / t.as_secs_f64()
}

fn parent(n: impl Fn(usize) -> usize, as_test: bool) {
    if as_test {
        println!("(run as a test: a few dozen round trips per row, to check the bench works; its numbers mean nothing)");
    }
    // `-- latency` / `-- throughput`: run only that half (both by default).
    let only = |what: &str| {
        let other = if what == "latency" { "throughput" } else { "latency" };
        !std::env::args().any(|a| a == other)
    };
    if only("latency") {
        latency(&n);
    }
    if only("throughput") {
        throughput(&n, as_test);
    }
}

/// One target's verdict line: `what = measured (target <= / >= limit) met|MISSED`.
fn verdict(what: &str, measured: f64, unit: &str, at_most: bool, limit: f64) {
    let (op, met) = if at_most { ("<=", measured <= limit) } else { (">=", measured >= limit) };
    let m = if met { "met" } else { "MISSED" };
    println!("{what:<38} = {measured:.2}{unit} (target {op} {limit}{unit}) {m}");
}

fn latency(n: &impl Fn(usize) -> usize) {
    let spin = bare_pingpong("spin", n(200_000));
    let futex = bare_pingpong("futex", n(20_000));
    let copy4k = bare_copy_pingpong(4096, n(20_000));
    println!("ring latency, one-way (µs), two processes; baselines from this run");
    println!("{:<28} {:>9} {:>9}", "path", "p50", "p99");
    println!("{:<28} {:>9.3} {:>9.3}", "floor: spin ping-pong", spin.p50, spin.p99);
    println!("{:<28} {:>9.3} {:>9.3}", "floor: futex ping-pong", futex.p50, futex.p99);
    println!("{:<28} {:>9.3} {:>9.3}", "floor: 4 KiB copy ping-pong", copy4k.p50, copy4k.p99);
    // (label, ring spinning p50, ring sleeping p50, iceoryx2 p50) per size that has targets.
    let mut targeted = Vec::new();
    for (size, label, iters) in [(64usize, "64 B", 50_000), (4096, "4 KiB", 20_000), (1 << 20, "1 MiB", 1_000)] {
        let sock = socket_pingpong(size, n(iters));
        let rs = ring_pingpong(size, n(iters), true);
        let rz = ring_pingpong(size, n(iters), false);
        println!("{:<28} {:>9.3} {:>9.3}", format!("unix socket {label}"), sock.p50, sock.p99);
        if size <= 4096 {
            let iox = iceoryx2_pingpong::pingpong(size, n(iters));
            println!("{:<28} {:>9.3} {:>9.3}", format!("iceoryx2 {label}, busy-wait"), iox.p50, iox.p99);
            targeted.push((label, rs.p50, rz.p50, iox.p50));
        }
        println!("{:<28} {:>9.3} {:>9.3}", format!("ring {label}, spinning"), rs.p50, rs.p99);
        println!("{:<28} {:>9.3} {:>9.3}", format!("ring {label}, sleeping"), rz.p50, rz.p99);
    }
    println!("{:<28} {:>9.3}", "ring 64 B software cost*", same_thread_cost(n(200_000)));
    println!("  * send + receive in one thread: the ring's own instructions, no cross-core traffic");
    println!();
    for &(label, ring_spin, ring_sleep, iox) in &targeted {
        let floor_limit = if label == "64 B" { 2.0 } else { 4.0 };
        verdict(&format!("{label} spinning / spin floor"), ring_spin / spin.p50, "x", true, floor_limit);
        if label == "4 KiB" {
            verdict("4 KiB spinning / bare 4 KiB copy floor", ring_spin / copy4k.p50, "x", true, 1.5);
        }
        if label == "64 B" {
            verdict(&format!("{label} sleeping / futex floor"), ring_sleep / futex.p50, "x", true, 1.5);
        }
        verdict(&format!("{label} spinning / iceoryx2 (p50)"), ring_spin / iox, "x", true, 1.0);
    }
    println!();
}

fn throughput(n: &impl Fn(usize) -> usize, as_test: bool) {
    println!("ring throughput vs the bare two-core pipeline (same run), {} MiB ring", ring_bytes() >> 20);
    println!("(bare: two pinned threads copying the same bytes through a shared buffer, no protocol;");
    println!(" memcpy: one thread, source and destination cache-resident up to L2 — information only)");
    println!("{:<10} {:>12} {:>13} {:>10} {:>12} {:>12}", "size", "ring GB/s", "bare GB/s", "ring/bare", "memcpy GB/s", "ring/memcpy");
    let sizes: &[usize] = if as_test { &[1 << 20] } else { &[1 << 20, 4 << 20, 16 << 20, 64 << 20] };
    let mut lowest: Option<(f64, usize)> = None;
    for &size in sizes {
        let count = n((256 << 20) / size * 4).max(8);
        let mem = memcpy_bw(size, count);
        let ring = ring_throughput(size, count);
        let bare = bare_copy_through(size, count);
        println!(
            "{:<10} {:>12.2} {:>13.2} {:>9.0}% {:>12.2} {:>11.0}%",
            format!("{} MiB", size >> 20),
            ring / 1e9,
            bare / 1e9,
            100.0 * ring / bare,
            mem / 1e9,
            100.0 * ring / mem
        );
        if lowest.is_none_or(|(r, _)| ring / bare < r) {
            lowest = Some((ring / bare, size));
        }
    }
    println!();
    if let Some((ratio, size)) = lowest {
        verdict(&format!("ring / bare, lowest ({} MiB)", size >> 20), 100.0 * ratio, "%", false, 90.0);
    }
    println!();
}
