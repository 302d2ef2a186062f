//! Small-call round trip: tensorwire-rpc client <-> tensorwire-rpc server (two processes,
//! Unix socket) against pyisolate's own AsyncRPC client <-> server (two processes,
//! JSONSocketTransport), measured in the same run. Prints p50 / mean round trip, calls/s
//! and the ratio (target: tensorwire-rpc ≥ 20× lower).
//!
//!     cargo bench -p tensorwire-rpc --bench rpc --target-dir target-rpc [-- N]
//!
//! Python: $TW_PYTHON or <repo>/.venv/bin/python (scripts/setup-venv.sh); without it the
//! pyisolate half is skipped, loudly.

use std::process::Command;
use std::time::{Duration, Instant};
use tensorwire_rpc::*;

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

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() - 1) as f64 * p) as usize]
}

fn main() {
    if let Ok(p) = std::env::var("TW_RPC_BENCH_SERVE") {
        serve(&p);
    }
    let n: usize = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(20_000);
    let path = std::env::temp_dir().join(format!("tw-rpc-bench-{}.sock", std::process::id())).display().to_string();
    let _ = std::fs::remove_file(&path);
    let mut child = Command::new(std::env::current_exe().unwrap()).env("TW_RPC_BENCH_SERVE", &path).spawn().unwrap();
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
    let args = || vec![Value::Int(1), Value::Int(2)];
    for _ in 0..2000 {
        assert_eq!(ep.call("calc", "add", args()).unwrap(), Value::Int(3));
    }
    let mut lat = Vec::with_capacity(n);
    let t0 = Instant::now();
    for _ in 0..n {
        let s = Instant::now();
        let r = ep.call("calc", "add", args()).unwrap();
        lat.push(s.elapsed().as_secs_f64() * 1e6);
        debug_assert_eq!(r, Value::Int(3));
    }
    let total = t0.elapsed().as_secs_f64();
    let rs_p50 = percentile(&mut lat, 0.5);
    let rs_p99 = percentile(&mut lat, 0.99);
    let rs_mean = total / n as f64 * 1e6;
    // Throughput with 4 callers sharing the connection (calls outstanding at once).
    let t0 = Instant::now();
    let per = n / 4;
    std::thread::scope(|s| {
        for _ in 0..4 {
            let ep = ep.clone();
            s.spawn(move || {
                for _ in 0..per {
                    ep.call("calc", "add", args()).unwrap();
                }
            });
        }
    });
    let conc_cps = (per * 4) as f64 / t0.elapsed().as_secs_f64();
    ep.close(Duration::from_secs(1));
    let _ = child.wait();
    let _ = std::fs::remove_file(&path);

    println!("RPC small-call round trip, add(1, 2), two processes over a Unix socket");
    println!("{:<44} {:>10} {:>10} {:>10} {:>12}", "", "p50 µs", "p99 µs", "mean µs", "calls/s");
    println!("{:<44} {:>10.1} {:>10.1} {:>10.1} {:>12.0}", "tensorwire-rpc (1 caller)", rs_p50, rs_p99, rs_mean, 1e6 / rs_mean);
    println!("{:<44} {:>10} {:>10} {:>10} {:>12.0}", "tensorwire-rpc (4 callers, one connection)", "", "", "", conc_cps);

    let py = std::env::var("TW_PYTHON").ok().map(std::path::PathBuf::from).unwrap_or_else(|| {
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python")
    });
    if !py.exists() {
        println!("SKIPPED pyisolate baseline: no Python venv at {} (run scripts/setup-venv.sh)", py.display());
        return;
    }
    let script = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/pyisolate_rtt.py");
    let out = Command::new(&py).arg(script).arg((n / 10).max(500).to_string()).output().unwrap();
    assert!(out.status.success(), "pyisolate bench failed: {}", String::from_utf8_lossy(&out.stderr));
    let line = String::from_utf8_lossy(&out.stdout);
    let v = Value::parse(line.trim().as_bytes()).unwrap();
    let f = |k: &str| v.get(k).and_then(Value::as_f64).unwrap();
    let (py_p50, py_mean, py_cps) = (f("p50_us"), f("mean_us"), f("calls_per_s"));
    println!("{:<44} {:>10.1} {:>10} {:>10.1} {:>12.0}", "pyisolate 0.10.2 AsyncRPC (JSONSocketTransport)", py_p50, "", py_mean, py_cps);
    let ratio_p50 = py_p50 / rs_p50;
    let ratio_mean = py_mean / rs_mean;
    println!("ratio pyisolate / tensorwire-rpc: p50 {ratio_p50:.1}x, mean {ratio_mean:.1}x (target >= 20x): {}", if ratio_p50 >= 20.0 { "MET" } else { "NOT MET" });
}
