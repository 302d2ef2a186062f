//! Supervised workers: what starting one costs cold, unsandboxed and sandboxed (its own
//! namespaces under a keeper, landlock, seccomp: what containment adds to a start), what
//! a warm one from a `WorkerPool` costs to hand out, and a call's round trip through a
//! `Worker` against the same call on a bare `Endpoint` over a socketpair to a child (the
//! supervisor's own overhead), and through a sandboxed worker, all in one run.
//!
//!     cargo bench -p tensorwire-rpc --bench worker [-- CALLS [STARTS]]
//!
//! CALLS: calls per side (default 20000); STARTS: cold starts and warm hand-outs (default
//! 30). The worker is this bench binary run again as the child role `worker`
//! (`tensorwire_test_support::RoleCommand`).

use std::time::{Duration, Instant};
use tensorwire_rpc::worker;
use tensorwire_rpc::*;
use tensorwire_test_support::{ROLE_ENV, RoleCommand, role};

fn serve_if_worker() {
    if role().as_deref() != Some("worker") {
        return;
    }
    let reg = Registry::new();
    reg.register(
        "calc",
        Service::new("Calc").method_inline("add", |_, a| Ok(Value::Int(a.req(0, "a")?.as_i64().unwrap_or(0) + a.req(1, "b")?.as_i64().unwrap_or(0)))),
    )
    .unwrap();
    let r = worker::serve(reg, RpcConfig::default());
    std::process::exit(if r.is_ok() { 0 } else { 70 });
}

fn spec() -> WorkerSpec {
    WorkerSpec::new(RoleCommand::program()).env(ROLE_ENV, "worker").native_tensors(false)
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn row(what: &str, v: &mut [f64], unit: &str) -> f64 {
    let (p50, p90) = (pct(v, 0.5), pct(v, 0.9));
    println!("{what:<44} {p50:>10.1} {p90:>10.1} {unit}");
    p50
}

fn calls(n: usize, call: impl Fn() -> Result<Value>) -> Vec<f64> {
    for _ in 0..n / 10 {
        call().unwrap();
    }
    (0..n)
        .map(|_| {
            let t = Instant::now();
            assert_eq!(call().unwrap(), Value::Int(3));
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect()
}

fn main() {
    serve_if_worker();
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let n = args.first().copied().unwrap_or(20_000);
    let starts = args.get(1).copied().unwrap_or(30);
    println!("{:<44} {:>10} {:>10}", "", "p50", "p90");

    let cold_start = |spec: &WorkerSpec| -> Vec<f64> {
        (0..starts)
            .map(|_| {
                let t = Instant::now();
                let w = spec.spawn().unwrap();
                let d = t.elapsed().as_secs_f64() * 1e3;
                drop(w);
                d
            })
            .collect()
    };
    let sandboxed = spec().sandbox(Sandbox::default());
    let mut cold = cold_start(&spec());
    let mut cold_boxed = cold_start(&sandboxed);
    let cold50 = row("cold start (spawn + handshake)", &mut cold, "ms");
    let boxed50 = row("cold start, sandboxed", &mut cold_boxed, "ms");

    let pool = WorkerPool::new(spec(), 2).unwrap();
    let mut warm: Vec<f64> = (0..starts)
        .map(|_| {
            assert!(pool.wait_idle(2, Duration::from_secs(30)));
            let t = Instant::now();
            let w = pool.get().unwrap();
            let d = t.elapsed().as_secs_f64() * 1e6;
            drop(w);
            d
        })
        .collect();
    let warm50 = row("warm worker handed out by a pool", &mut warm, "µs");

    let w = spec().spawn().unwrap();
    let mut through_worker = calls(n, || w.call("calc", "add", vec![1.into(), 2.into()]));
    let ep = w.endpoint().unwrap();
    let mut bare = calls(n, || ep.call("calc", "add", vec![1.into(), 2.into()]));
    let wb = sandboxed.spawn().unwrap();
    let mut through_sandboxed = calls(n, || wb.call("calc", "add", vec![1.into(), 2.into()]));
    let worker50 = row("add(1, 2) through Worker::call", &mut through_worker, "µs");
    let bare50 = row("add(1, 2) on the same connection's Endpoint", &mut bare, "µs");
    let sandboxed50 = row("add(1, 2) through a sandboxed Worker::call", &mut through_sandboxed, "µs");
    println!();
    println!("sandboxed - unsandboxed cold start: {:+.2} ms (p50)", boxed50 - cold50);
    println!("sandboxed / unsandboxed Worker::call: {:.2} (p50)", sandboxed50 / worker50);
    println!("warm hand-out / cold start: {:.5} (p50)", warm50 / 1e3 / cold50);
    println!("Worker::call / Endpoint::call: {:.2} (p50)", worker50 / bare50);
}
