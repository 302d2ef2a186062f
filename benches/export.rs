//! Zero-copy export + import + release of an already-shared tensor, between two processes,
//! at 4 KiB, 1 MiB, 64 MiB and 1 GiB. Target (DESIGN.md): flat in size, 1 GiB within 2×
//! of 4 KiB.
//!
//! The bench binary re-executes itself as the consumer (`TW_BENCH_CHILD=<fd>` names the
//! inherited end of a SEQPACKET socketpair). The consumer loops: receive a tensor (the
//! import: decode and validate the descriptor, check the lease is live, find the
//! already-mapped segment), read one byte of it (its last, so the whole mapping must be
//! addressable), release the lease, and send a tiny ack carrying the tensor's tag.
//!
//! Each tensor's segment is created and filled once, and shared once: its first export
//! carries the fd and the consumer maps it; every later export of it sends only a
//! descriptor. That is the "already shared" case the target is about.
//!
//! What one measured iteration is — a full lease cycle, as seen by the producer:
//!   1. `export`: grant a lease, send the descriptor;
//!   2. the consumer imports, reads, releases (a CAS on the shared lease word plus a
//!      doorbell ring), then sends its ack;
//!   3. the producer receives the ack and *sees the release*: the consumer's release
//!      happened before it sent the ack, so after the ack one reaper pass (`reap_now`,
//!      the same pass the background reaper thread runs when the doorbell wakes it; if
//!      that thread got there first, the pass finds nothing left) must have dropped the
//!      lease's owner. The iteration asserts `live_leases` is back to its baseline, so a
//!      lease that were still held would fail the bench rather than flatter it.
//!
//! So the time is a round trip (two socket messages) plus the lease bookkeeping on both
//! sides; none of it should depend on the tensor's size.
//!
//! After the criterion groups, a separate loop times single iterations of every size,
//! interleaved round-robin (so drift hits all sizes alike), and prints medians and the
//! `1GiB/4KiB` ratio from that same run.

use criterion::{BenchmarkId, Criterion};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::process::{Child, Command};
use std::time::{Duration, Instant};
use tensorwire::{DType, ExportOptions, Incoming, Layout, Peer, PeerConfig, SharedTensor};

const CHILD_ENV: &str = "TW_BENCH_CHILD";
const SIZES: [(usize, &str); 4] = [
    (4 << 10, "4KiB"),
    (1 << 20, "1MiB"),
    (64 << 20, "64MiB"),
    (1 << 30, "1GiB"),
];
const ACK_TIMEOUT: Duration = Duration::from_secs(30);
const QUIT: &[u8] = b"quit";

/// Byte stored at index `i` of every tensor (so the consumer can check what it read).
fn pattern(i: usize) -> u8 {
    (i % 251) as u8
}

fn main() {
    if let Ok(fd) = std::env::var(CHILD_ENV) {
        consumer(fd.parse().expect("TW_BENCH_CHILD must be an fd number"));
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    let has = |f: &str| args.iter().any(|a| a == f);
    // Same rule as criterion: only `--bench` without `--test` benchmarks; `cargo test
    // --benches` runs each routine once. `--list` runs nothing.
    let benchmarking = has("--bench") && !has("--test");
    let listing = has("--list");

    // Set up (spawn the consumer, fill 1 GiB, share, warm up) before criterion starts
    // timing anything, except when only listing the benchmarks.
    let mut fixture: Option<Fixture> = (!listing).then(Fixture::new);
    let mut c = Criterion::default().configure_from_args();
    {
        let mut g = c.benchmark_group("export_import_release");
        for (i, &(_, name)) in SIZES.iter().enumerate() {
            g.bench_function(BenchmarkId::from_parameter(name), |b| {
                let f = fixture.get_or_insert_with(Fixture::new);
                b.iter_custom(|iters| {
                    let start = Instant::now();
                    for _ in 0..iters {
                        f.cycle(i);
                    }
                    start.elapsed()
                });
            });
        }
        g.finish();
    }
    c.final_summary();

    if listing {
        return;
    }
    let f = fixture.get_or_insert_with(Fixture::new);
    let rounds = if benchmarking { 2000 } else { 20 };
    let medians = f.interleaved_medians(rounds);
    println!(
        "export+import+release, two processes, median of {rounds} interleaved single iterations:"
    );
    for (&(_, name), m) in SIZES.iter().zip(&medians) {
        println!("  {name:>6}: {:8.2} µs", m.as_secs_f64() * 1e6);
    }
    let ratio = medians[SIZES.len() - 1].as_secs_f64() / medians[0].as_secs_f64();
    println!("1GiB/4KiB = {ratio:.3} (target <= 2)");
    fixture.take().expect("set above").shutdown();
}

/// The producer side: the consumer process, the connection, one shared tensor per size.
struct Fixture {
    child: Child,
    peer: Peer,
    tensors: Vec<SharedTensor>,
    baseline_leases: u64,
    next_tag: u64,
}

impl Fixture {
    fn new() -> Fixture {
        let (ours, theirs) = tensorwire::os::seqpacket_pair().expect("socketpair");
        tensorwire::os::set_cloexec(theirs.as_fd(), false)
            .expect("clear FD_CLOEXEC on the child's end");
        let exe = std::env::current_exe().expect("current_exe");
        let child = Command::new(exe)
            .env(CHILD_ENV, theirs.as_raw_fd().to_string())
            .stdin(std::process::Stdio::null())
            .spawn()
            .expect("spawn the consumer process");
        drop(theirs);
        let peer = Peer::from_fd(ours, PeerConfig::default()).expect("connect to the consumer");

        let mut tensors = Vec::new();
        for &(size, _) in &SIZES {
            let t = SharedTensor::zeros(Layout::contiguous(DType::UInt8, &[size as i64]).unwrap())
                .expect("segment");
            // Really write the data, once: the pages exist and hold the pattern.
            let mut chunk = vec![0u8; size.min(1 << 20)];
            for at in (0..size).step_by(chunk.len()) {
                for (k, b) in chunk.iter_mut().enumerate() {
                    *b = pattern(at + k);
                }
                t.write_storage(at, &chunk).expect("fill");
            }
            tensors.push(t);
        }
        let baseline_leases = peer.export_stats().live_leases;
        let mut f = Fixture {
            child,
            peer,
            tensors,
            baseline_leases,
            next_tag: 1,
        };
        // Share every segment (the first export of each carries its fd) and warm up.
        for _ in 0..50 {
            for i in 0..SIZES.len() {
                f.cycle(i);
            }
        }
        f
    }

    /// One measured iteration; see the module docs.
    #[inline]
    fn cycle(&mut self, i: usize) {
        let tag = self.next_tag;
        self.next_tag += 1;
        self.peer
            .export(&self.tensors[i], ExportOptions { tag, window: None })
            .expect("export");
        match self
            .peer
            .recv(Some(ACK_TIMEOUT))
            .expect("waiting for the consumer's ack")
        {
            Incoming::Message { payload, .. } => {
                assert_eq!(payload, tag.to_le_bytes(), "ack for the wrong export");
            }
            other => panic!("expected an ack, got {other:?}"),
        }
        let stats = self.peer.reap_now();
        assert_eq!(
            stats.live_leases, self.baseline_leases,
            "released lease still live after the ack"
        );
    }

    /// Median single-iteration time per size, sizes interleaved round-robin.
    fn interleaved_medians(&mut self, rounds: usize) -> Vec<Duration> {
        let mut samples = vec![Vec::with_capacity(rounds); SIZES.len()];
        for _ in 0..rounds {
            for (i, s) in samples.iter_mut().enumerate() {
                let t0 = Instant::now();
                self.cycle(i);
                s.push(t0.elapsed());
            }
        }
        samples
            .into_iter()
            .map(|mut s| {
                s.sort_unstable();
                s[s.len() / 2]
            })
            .collect()
    }

    fn shutdown(mut self) {
        self.peer.send_message(QUIT, &[]).expect("send quit");
        let status = self.child.wait().expect("wait for the consumer");
        assert!(status.success(), "consumer exited with {status}");
    }
}

/// The consumer process: import, read one byte, release, ack; until told to quit.
fn consumer(fd: i32) {
    // SAFETY: the parent passed us this fd number for the socket end it left open across
    // exec (FD_CLOEXEC cleared) and nothing else in this process owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let peer = Peer::from_fd(fd, PeerConfig::default()).expect("consumer: connect");
    loop {
        match peer.recv(tensorwire::Wait::Forever) {
            Ok(Incoming::Tensor(t)) => {
                let n = t.storage_nbytes();
                let mut byte = [0u8; 1];
                t.read_storage(n - 1, &mut byte).expect("consumer: read");
                assert_eq!(byte[0], pattern(n - 1), "consumer read the wrong data");
                let tag = t.tag();
                t.release().expect("consumer: release");
                peer.send_message(&tag.to_le_bytes(), &[])
                    .expect("consumer: ack");
            }
            Ok(Incoming::Message { payload, .. }) if payload == QUIT => return,
            Ok(other) => panic!("consumer: unexpected {other:?}"),
            Err(e) if e.is_peer_gone() => return,
            Err(e) => panic!("consumer: {e}"),
        }
    }
}
