//! Round-trip latency between two processes over a `Peer`, with where each side ran: the
//! measurement behind the adaptive spin (`src/spin_policy.rs`).
//!
//!   cargo run --release --example pingpong -- [tw|ring] [--iters N] [--warm-ms MS]
//!       [--recv-spin-us US] [--ring-spin POLLS] [--reap-ms MS]
//!       [--pin-parent CPU] [--pin-child CPU] [--setsid]
//!
//! `tw` (the default) is the torch bench's round trip: the parent exports a 1 KiB shared
//! tensor, the child imports it, drops it (a release) and exports a one-element tensor
//! back, which the parent imports and drops. `ring` is `ring_send` of 64 bytes and the same
//! back. Unset settings keep `PeerConfig`'s defaults. Run under `taskset -c 0` to put both
//! processes on one core, or unpinned to let the scheduler place them.
//!
//! Each round trip records the parent's CPU after its receive and the CPU the child sent
//! its reply from (carried in the reply's tag); the report splits the round trips by
//! "same CPU" (the two processes shared a core for that exchange) or not. Each side also
//! prints its CPU time, sleeps and other context switches per round trip (`getrusage`).

use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};
use tensorwire::{DType, ExportOptions, Incoming, Layout, Peer, PeerConfig, RingItem, SharedTensor};

const ENV: &str = "TW_PINGPONG_CHILD";
const T: Duration = Duration::from_secs(30);
/// Tag that tells the child to stop.
const STOP: u64 = u64::MAX;
/// Tag of the warm-up round trips (the child starts counting at the first other tag).
const WARM: u64 = u64::MAX - 1;

/// This process's CPU time (µs), sleeps (voluntary switches) and other switches
/// (preemptions, and yields that let another task run).
fn usage() -> [f64; 3] {
    // SAFETY: a zeroed rusage is a valid out-parameter for getrusage.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid out-pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let us = |t: libc::timeval| t.tv_sec as f64 * 1e6 + t.tv_usec as f64;
    [us(ru.ru_utime) + us(ru.ru_stime), ru.ru_nvcsw as f64, ru.ru_nivcsw as f64]
}

/// Per-round-trip CPU µs, sleeps and switches of this process since `from`.
fn per_round(from: [f64; 3], n: usize) -> String {
    let now = usage();
    let d = |i: usize| (now[i] - from[i]) / n.max(1) as f64;
    format!("cpu {:.1} us, sleeps {:.2}, switches {:.2} per round trip", d(0), d(1), d(2))
}

struct Opts {
    mode: String,
    iters: usize,
    warm: Duration,
    cfg: PeerConfig,
    pin_parent: Option<usize>,
    pin_child: Option<usize>,
    /// Start the child in a session of its own (another autogroup: the scheduler then
    /// places the two processes in different groups, as for two unrelated programs).
    setsid: bool,
}

fn parse(args: &[String]) -> Opts {
    let mut o = Opts {
        mode: "tw".into(),
        iters: 2000,
        warm: Duration::from_millis(300),
        cfg: PeerConfig { ring_bytes: 64 << 10, ..PeerConfig::default() },
        pin_parent: None,
        pin_child: None,
        setsid: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{a} needs a value")).parse::<u64>().expect("a number");
        match a.as_str() {
            "tw" | "ring" => o.mode = a.clone(),
            "--iters" => o.iters = val() as usize,
            "--warm-ms" => o.warm = Duration::from_millis(val()),
            "--recv-spin-us" => o.cfg.recv_spin = Duration::from_micros(val()),
            "--ring-spin" => o.cfg.ring_spin = val() as u32,
            "--reap-ms" => o.cfg.reap_interval = Duration::from_millis(val()),
            "--pin-parent" => o.pin_parent = Some(val() as usize),
            "--pin-child" => o.pin_child = Some(val() as usize),
            "--setsid" => o.setsid = true,
            other => panic!("unknown argument {other}"),
        }
    }
    o
}

fn pin(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is valid; CPU_SET and sched_setaffinity only touch it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

fn cpu() -> u64 {
    // SAFETY: no arguments; returns the CPU this thread runs on (or -1).
    unsafe { libc::sched_getcpu() as u64 }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let o = parse(&args);
    if let Ok(fd) = std::env::var(ENV) {
        if let Some(c) = o.pin_child {
            pin(c);
        }
        if o.setsid {
            // SAFETY: no arguments; makes this process a session (and autogroup) leader.
            unsafe { libc::setsid() };
        }
        // SAFETY: the inherited fd number our parent passed.
        let fd = unsafe { OwnedFd::from_raw_fd(fd.parse().unwrap()) };
        return child(&o, Peer::from_fd(fd, o.cfg.clone()).unwrap());
    }
    if let Some(c) = o.pin_parent {
        pin(c);
    }
    let (mine, theirs) = tensorwire::os::seqpacket_pair().unwrap();
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    let fd = tensorwire::os::inherit_in_child(&mut cmd, theirs.as_fd());
    let mut child = cmd.args(&args).env(ENV, fd.to_string()).spawn().unwrap();
    drop(theirs);
    let peer = Peer::from_fd(mine, o.cfg.clone()).unwrap();
    let report = parent(&o, &peer);
    drop(peer);
    // The child prints its own lines before it exits: ours come after them.
    child.wait().unwrap();
    println!("{report}");
}

fn child(o: &Opts, peer: Peer) {
    let ack = SharedTensor::zeros(Layout::contiguous(DType::Float32, &[1]).unwrap()).unwrap();
    let mut buf = Vec::new();
    let (mut from, mut counted) = (None, 0usize);
    loop {
        let got = if o.mode == "tw" {
            peer.recv(T).map(|m| match m {
                Incoming::Tensor(t) => t.tag(),
                other => panic!("{other:?}"),
            })
        } else {
            peer.ring_recv_into(&mut buf, T).map(|r| r.0)
        };
        // The parent closes right after its stop: the stop may arrive as the end.
        let tag = match got {
            Err(e) if e.is_peer_gone() => return,
            r => r.unwrap(),
        };
        if tag == STOP {
            if let Some(f) = from {
                println!("  child: {}", per_round(f, counted));
            }
            return;
        }
        if tag != WARM {
            from.get_or_insert_with(usage);
            counted += 1;
        }
        if o.mode == "tw" {
            peer.export(&ack, ExportOptions { tag: cpu(), window: None }).unwrap();
        } else {
            peer.ring_send(&[RingItem::bytes(cpu(), &buf)], T).unwrap();
        }
    }
}

/// One round trip: (µs, the child's CPU, the parent's CPU after its receive).
fn round_trip(o: &Opts, peer: &Peer, t: &SharedTensor, msg: &[u8], buf: &mut Vec<u8>, tag: u64) -> (f64, u64, u64) {
    let t0 = Instant::now();
    let child_cpu = if o.mode == "tw" {
        peer.export(t, ExportOptions { tag, window: None }).unwrap();
        match peer.recv(T).unwrap() {
            Incoming::Tensor(a) => a.tag(),
            other => panic!("{other:?}"),
        }
    } else {
        peer.ring_send(&[RingItem::bytes(tag, msg)], T).unwrap();
        peer.ring_recv_into(buf, T).unwrap().0
    };
    (t0.elapsed().as_secs_f64() * 1e6, child_cpu, cpu())
}

fn parent(o: &Opts, peer: &Peer) -> String {
    let t = SharedTensor::zeros(Layout::contiguous(DType::UInt8, &[1024]).unwrap()).unwrap();
    let msg = [7u8; 64];
    let mut buf = Vec::new();
    let warm_end = Instant::now() + o.warm;
    while Instant::now() < warm_end {
        round_trip(o, peer, &t, &msg, &mut buf, WARM);
    }
    let from = usage();
    let samples: Vec<(f64, bool)> = (0..o.iters)
        .map(|i| {
            let (us, c, p) = round_trip(o, peer, &t, &msg, &mut buf, i as u64);
            (us, c == p)
        })
        .collect();
    let mine = per_round(from, o.iters);
    if o.mode == "tw" {
        peer.export(&t, ExportOptions { tag: STOP, window: None }).unwrap();
    } else {
        peer.ring_send(&[RingItem::bytes(STOP, b"")], T).unwrap();
    }
    let pick = |same: Option<bool>| {
        let mut v: Vec<f64> = samples.iter().filter(|s| same.is_none_or(|x| s.1 == x)).map(|s| s.0).collect();
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v
    };
    let q = |v: &[f64], p: usize| if v.is_empty() { f64::NAN } else { v[(v.len() * p / 100).min(v.len() - 1)] };
    let (all, same, apart) = (pick(None), pick(Some(true)), pick(Some(false)));
    format!(
        "{} recv_spin={:?} ring_spin={} n={}: p10 {:.1} p50 {:.1} p90 {:.1} p99 {:.1} us | same cpu {}/{} p50 {:.1} | apart p50 {:.1}",
        o.mode,
        o.cfg.recv_spin,
        o.cfg.ring_spin,
        all.len(),
        q(&all, 10),
        q(&all, 50),
        q(&all, 90),
        q(&all, 99),
        same.len(),
        all.len(),
        q(&same, 50),
        q(&apart, 50),
    ) + &format!("\n  parent: {mine}")
}
