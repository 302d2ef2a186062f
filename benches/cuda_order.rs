//! The CUDA round trip under each wait policy (`PeerConfig::cuda_wait`), on simcuda with
//! the hardware's measured costs switched on, so the effect of the policy shows without a
//! GPU:
//!
//! ```sh
//! simcuda/run.sh cargo bench --bench cuda_order            # or on a GPU machine, unchanged
//! ```
//!
//! One iteration: the producer (this process) writes a byte of a device buffer on its
//! stream and exports the buffer (handle cached after the first); the consumer (this
//! binary re-executed, `TW_BENCH_CHILD=<fd>`) imports it, orders its stream after the
//! producer's work as its policy says, synchronizes that stream (as a user reading the
//! tensor would), releases after its stream and answers with a user message. A socket
//! round trip of the same two messages without CUDA is the floor, measured in the same
//! run.
//!
//! On simcuda the bench sets, unless already set: `SIMCUDA_MAX_DELAY_US=0` (no random
//! stream delays), `SIMCUDA_XPROC_WAIT_US=280` (a stream wait on another process's event
//! pays a GPU time-slice switch, measured on an H200 without MPS) and
//! `SIMCUDA_VALUE_WAIT_US=9` (a stream wait on a word, over a host wait). The verdict: the
//! default policy stays clear of the modelled penalty (its p50 within half of it of the
//! `host` row, which never waits on the GPU for the other process) while `event` pays it.
//! simcuda's own costs (a worker thread per stream, polls every 10–20 µs) make every row
//! slower than hardware; compare rows, not absolute numbers.

use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::process::Command;
use std::time::{Duration, Instant};
use tensorwire::cuda::driver::{call, ensure_context, DeviceBuffer};
use tensorwire::cuda::{CudaStream, CudaWait};
use tensorwire::{DType, ExportOptions, Incoming, Layout, Peer, PeerConfig};

const CHILD_ENV: &str = "TW_BENCH_CHILD";
const POLICY_ENV: &str = "TW_BENCH_POLICY";
const ITERS: usize = 400;
const WARMUP: usize = 20;
const T: Duration = Duration::from_secs(30);
const BYTES: u64 = 4096;

fn stream() -> CudaStream {
    let _c = ensure_context(0).unwrap();
    let mut s: cudarc::driver::sys::CUstream = std::ptr::null_mut();
    // SAFETY: valid out-pointer; a context of device 0 is current.
    call("cuStreamCreate", || unsafe { cudarc::driver::sys::cuStreamCreate(&mut s, 0) }).unwrap();
    CudaStream(s as usize)
}

fn sync(s: CudaStream) {
    let _c = ensure_context(0).unwrap();
    // SAFETY: a live stream of the current context.
    call("cuStreamSynchronize", || unsafe { cudarc::driver::sys::cuStreamSynchronize(s.0 as cudarc::driver::sys::CUstream) }).unwrap();
}

fn memset(d: tensorwire::cuda::DevicePtr, v: u8, s: CudaStream) {
    let _c = ensure_context(0).unwrap();
    // SAFETY: `d` is a live allocation of at least one byte; ordered on `s`.
    call("cuMemsetD8Async", || unsafe { cudarc::driver::sys::cuMemsetD8Async(d.get(), v, 1, s.0 as cudarc::driver::sys::CUstream) })
        .unwrap();
}

fn main() {
    if let Ok(fd) = std::env::var(CHILD_ENV) {
        consumer(fd.parse().expect("TW_BENCH_CHILD must be an fd number"));
        return;
    }
    // Cargo passes `--bench`; nothing else is taken.
    for (k, v) in [("SIMCUDA_MAX_DELAY_US", "0"), ("SIMCUDA_XPROC_WAIT_US", "280"), ("SIMCUDA_VALUE_WAIT_US", "9")] {
        if std::env::var_os(k).is_none() {
            // SAFETY: single-threaded here (before any CUDA call, thread or child).
            unsafe { std::env::set_var(k, v) };
        }
    }
    if !tensorwire::cuda::available() || tensorwire::cuda::device_count().unwrap_or(0) == 0 {
        println!("SKIPPED cuda_order: no CUDA driver (run under simcuda/run.sh, or on a GPU machine)");
        return;
    }
    let floor = run(None);
    println!("{:<28} p50 {:>8.1} µs   p90 {:>8.1} µs", "floor (socket round trip)", floor.0, floor.1);
    let mut p50 = Vec::new();
    for w in CudaWait::ALL {
        let (a, b) = run(Some(w));
        println!("{:<28} p50 {:>8.1} µs   p90 {:>8.1} µs", format!("cuda_wait = {w}"), a, b);
        p50.push((w, a));
    }
    let get = |w| p50.iter().find(|(x, _)| *x == w).map(|(_, v)| *v).unwrap();
    let penalty = std::env::var("SIMCUDA_XPROC_WAIT_US").ok().and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // `host` never waits on the GPU for the other process: what stays above it is what a
    // policy pays for waiting on the GPU.
    let (host, stream, event) = (get(CudaWait::Host), get(CudaWait::Stream), get(CudaWait::Event));
    let clear = stream - host < penalty / 2.0;
    let pays = event - host >= penalty / 2.0;
    println!(
        "verdict: stream (default) {} the modelled {penalty:.0} µs cross-process event wait ({:+.1} µs over host); event {} it ({:+.1} µs over host); event / stream = {:.1}x",
        if clear { "stays clear of" } else { "PAYS" },
        stream - host,
        if pays { "pays" } else { "does NOT pay" },
        event - host,
        event / stream,
    );
}

/// (p50, p90) in µs of a round trip with `policy` (`None`: messages only).
fn run(policy: Option<CudaWait>) -> (f64, f64) {
    let (mine, theirs) = tensorwire::os::seqpacket_pair().unwrap();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    let fd = tensorwire::os::inherit_in_child(&mut cmd, theirs.as_fd());
    cmd.env(CHILD_ENV, fd.to_string()).env(POLICY_ENV, policy.map_or("none", CudaWait::name));
    let mut child = cmd.spawn().unwrap();
    drop(theirs);
    let cfg = PeerConfig { cuda_wait: policy.unwrap_or_default(), ..PeerConfig::default() };
    let peer = Peer::from_fd(mine, cfg).unwrap();
    let s = stream();
    let buf = DeviceBuffer::alloc(0, BYTES).unwrap();
    let l = Layout::contiguous(DType::UInt8, &[BYTES as i64]).unwrap();
    let mut times = Vec::with_capacity(ITERS);
    for i in 0..WARMUP + ITERS {
        let t = Instant::now();
        if policy.is_some() {
            memset(buf.ptr(), i as u8, s);
            peer.export_cuda(buf.ptr(), BYTES, &l, s, Box::new(()), ExportOptions { tag: i as u64, window: None }).unwrap();
        } else {
            peer.send_message(&(i as u64).to_le_bytes(), &[]).unwrap();
        }
        match peer.recv(T).unwrap() {
            Incoming::Message { .. } => {}
            other => panic!("expected the consumer's answer, got {other:?}"),
        }
        if i >= WARMUP {
            times.push(t.elapsed());
        }
        peer.reap_now();
    }
    peer.send_message(b"quit", &[]).unwrap();
    child.wait().unwrap();
    times.sort();
    let us = |q: f64| times[((times.len() as f64 - 1.0) * q) as usize].as_secs_f64() * 1e6;
    (us(0.5), us(0.9))
}

fn consumer(fd: i32) {
    // SAFETY: the parent handed us this inherited fd; nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let policy = std::env::var(POLICY_ENV).unwrap();
    let cuda_wait = policy.parse().unwrap_or_default();
    let peer = Peer::from_fd(fd, PeerConfig { cuda_wait, ..PeerConfig::default() }).unwrap();
    let s = if policy == "none" { CudaStream::LEGACY } else { stream() };
    loop {
        match peer.recv(T).unwrap() {
            Incoming::CudaTensor(t) => {
                t.wait_on(s).unwrap();
                sync(s);
                t.status().unwrap();
                let tag = t.tag();
                t.release_after(s).unwrap();
                peer.send_message(&tag.to_le_bytes(), &[]).unwrap();
            }
            Incoming::Message { payload, .. } if payload == b"quit" => return,
            Incoming::Message { payload, .. } => peer.send_message(&payload, &[]).unwrap(),
            other => panic!("unexpected {other:?}"),
        }
    }
}
