//! Small-call round trip: tensorwire-rpc client <-> tensorwire-rpc server (two processes,
//! Unix socket) against pyisolate's own AsyncRPC client <-> server (two processes,
//! JSONSocketTransport), measured in the same run. The two sides alternate over a few
//! rounds (so that a burst of load from elsewhere on the machine hits both), every sample
//! is kept, and p50 / p90 / mean come from the same code for both. Prints the ratio on p50
//! and on mean, and whether each meets the target (tensorwire-rpc ≥ 20× lower).
//!
//!     cargo bench -p tensorwire-rpc --bench rpc --target-dir target-rpc [-- N [ROUNDS]]
//!
//! N: tensorwire-rpc calls in all (default 30000; pyisolate makes N/10); ROUNDS: default 3.
//! Python: $TW_PYTHON or <repo>/.venv/bin/python (scripts/setup-venv.sh); without it the
//! pyisolate half is skipped, loudly.

use std::process::Command;
use std::time::{Duration, Instant};
use tensorwire_rpc::*;
use tensorwire_test_support::{RoleCommand, role};

const TARGET: f64 = 20.0;

fn serve(path: &str) -> ! {
    let reg = Registry::new();
    reg.register(
        "calc",
        Service::new("Calc").method_inline("add", |_, a| Ok(Value::Int(a.req(0, "a")?.as_i64().unwrap_or(0) + a.req(1, "b")?.as_i64().unwrap_or(0)))),
    )
    .unwrap();
    let server = Server::bind(path, reg, RpcConfig::default()).unwrap();
    let ep = server.accept().unwrap();
    ep.wait_closed();
    std::process::exit(0)
}

struct Summary {
    p50: f64,
    p90: f64,
    p99: f64,
    mean: f64,
}

fn summarize(v: &mut [f64]) -> Summary {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let at = |p: f64| v[((v.len() - 1) as f64 * p) as usize];
    Summary { p50: at(0.5), p90: at(0.9), p99: at(0.99), mean: v.iter().sum::<f64>() / v.len() as f64 }
}

fn rust_round(ep: &Endpoint, n: usize, lat: &mut Vec<f64>) {
    let args = || vec![Value::Int(1), Value::Int(2)];
    for _ in 0..n {
        let s = Instant::now();
        let r = ep.call("calc", "add", args()).unwrap();
        lat.push(s.elapsed().as_secs_f64() * 1e6);
        debug_assert_eq!(r, Value::Int(3));
    }
}

fn py_round(py: &std::path::Path, n: usize, lat: &mut Vec<f64>) {
    let script = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/pyisolate_rtt.py");
    let out = Command::new(py).arg(script).arg(n.to_string()).output().unwrap();
    assert!(out.status.success(), "pyisolate bench failed: {}", String::from_utf8_lossy(&out.stderr));
    let line = String::from_utf8_lossy(&out.stdout);
    let v = Value::parse(line.trim().as_bytes()).unwrap();
    let samples = v.get("lat_us").and_then(Value::as_array).expect("lat_us in the pyisolate bench output");
    lat.extend(samples.iter().map(|x| x.as_f64().unwrap()));
}

fn main() {
    if role().as_deref() == Some("server") {
        serve(&std::env::var("TW_RPC_BENCH_SOCKET").expect("the server's socket path"));
    }
    let mut nums = std::env::args().skip(1).filter_map(|a| a.parse::<usize>().ok());
    let n = nums.next().unwrap_or(30_000);
    let rounds = nums.next().unwrap_or(3).max(1);
    let path = std::env::temp_dir().join(format!("tw-rpc-bench-{}.sock", std::process::id())).display().to_string();
    let _ = std::fs::remove_file(&path);
    let mut child = RoleCommand::new("server").env("TW_RPC_BENCH_SOCKET", &path).spawn();
    let deadline = Instant::now() + Duration::from_secs(10);
    let ep = loop {
        let spin = std::env::var("TW_RPC_SPIN_US").ok().and_then(|s| s.parse().ok()).map(Duration::from_micros);
        let cfg = RpcConfig { spin: spin.unwrap_or(RpcConfig::default().spin), ..RpcConfig::default() };
        match Endpoint::connect(&path, Registry::new(), cfg) {
            Ok(e) => break e,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("cannot connect to the bench server: {e}"),
        }
    };
    let py = std::env::var("TW_PYTHON").ok().map(std::path::PathBuf::from).unwrap_or_else(|| {
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python")
    });
    let have_py = py.exists();

    let mut warm = Vec::new();
    rust_round(&ep, 2000, &mut warm);
    let (mut rs_lat, mut py_lat) = (Vec::with_capacity(n), Vec::new());
    for _ in 0..rounds {
        rust_round(&ep, n / rounds, &mut rs_lat);
        if have_py {
            py_round(&py, (n / 10 / rounds).max(300), &mut py_lat);
        }
    }
    // Throughput with 4 callers sharing the connection (calls outstanding at once).
    let t0 = Instant::now();
    let per = n / 8;
    std::thread::scope(|s| {
        for _ in 0..4 {
            let ep = ep.clone();
            s.spawn(move || {
                for _ in 0..per {
                    ep.call("calc", "add", vec![Value::Int(1), Value::Int(2)]).unwrap();
                }
            });
        }
    });
    let conc_cps = (per * 4) as f64 / t0.elapsed().as_secs_f64();
    ep.close(Duration::from_secs(1));
    let _ = child.wait();
    let _ = std::fs::remove_file(&path);

    let rs = summarize(&mut rs_lat);
    println!("RPC small-call round trip, add(1, 2), two processes over a Unix socket ({rounds} alternating rounds)");
    println!("{:<48} {:>8} {:>8} {:>8} {:>8} {:>10} {:>8}", "", "p50 µs", "p90 µs", "p99 µs", "mean µs", "calls/s", "samples");
    let row = |name: &str, s: &Summary, k: usize| {
        println!("{:<48} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>10.0} {:>8}", name, s.p50, s.p90, s.p99, s.mean, 1e6 / s.mean, k);
    };
    row("tensorwire-rpc (1 caller)", &rs, rs_lat.len());
    println!("{:<48} {:>8} {:>8} {:>8} {:>8} {:>10.0}", "tensorwire-rpc (4 callers, one connection)", "", "", "", "", conc_cps);
    if !have_py {
        println!("SKIPPED pyisolate baseline: no Python venv at {} (run scripts/setup-venv.sh)", py.display());
        return;
    }
    let pys = summarize(&mut py_lat);
    row("pyisolate 0.10.2 AsyncRPC (JSONSocketTransport)", &pys, py_lat.len());
    let verdict = |r: f64| if r >= TARGET { "MET" } else { "NOT MET" };
    let (r50, r90, rmean) = (pys.p50 / rs.p50, pys.p90 / rs.p90, pys.mean / rs.mean);
    println!("ratio pyisolate / tensorwire-rpc: p50 {r50:.1}x, p90 {r90:.1}x, mean {rmean:.1}x");
    println!("target >= {TARGET}x lower round trip: on p50 {}, on mean {}", verdict(r50), verdict(rmean));
}
