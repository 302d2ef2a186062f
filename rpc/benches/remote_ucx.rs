//! A CPU tensor returned by an RPC over loopback TCP: as a remote (UCX) tensor the client
//! reads with one get, against the inline `TensorValue` copy a peer without remote tensors
//! gets — the same server process, the same run, sizes alternating between the two paths.
//! The server hands out a tensor it already holds (a memfd segment registered in place);
//! the client's time includes decoding, allocating and filling its own tensor, and sending
//! the release.
//!
//!     UCX_TLS=tcp cargo bench -p tensorwire-rpc --features ucx --bench remote_ucx [-- REPS]
//!
//! The inline form costs one JSON value per element, so it is measured up to 1 MiB only
//! (64 MiB of uint8 would be a ~2.5 GB value tree, over `RpcConfig::max_tensor_copy`), and
//! with `RpcConfig::max_values` raised: by default 1 MiB of uint8 is already refused.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tensorwire_rpc::*;

const SIZES: [usize; 4] = [4 << 10, 1 << 20, 64 << 20, 256 << 20];
const INLINE_MAX: usize = 1 << 20;

fn serve() -> ! {
    let held: Arc<HashMap<usize, Tensor>> = Arc::new(
        SIZES
            .iter()
            .map(|&n| {
                let data: Vec<u8> = (0..n).map(|i| i as u8).collect();
                (n, Tensor::from_bytes(tensorwire::DType::UInt8, &[n as i64], &data).unwrap())
            })
            .collect(),
    );
    let reg = Registry::new();
    reg.register(
        "t",
        Service::new("T").method("get", move |_, a| {
            let n = a.req(0, "n")?.as_i64().unwrap_or(0) as usize;
            held.get(&n).cloned().map(Value::from).ok_or_else(|| RpcError::InvalidArgument(format!("no tensor of {n} bytes")))
        }),
    )
    .unwrap();
    let cfg = RpcConfig { remote_tensors: true, max_frame: 256 << 20, ..RpcConfig::default() };
    let server = Server::bind("tcp://127.0.0.1:0", reg, cfg).unwrap();
    println!("@{}", server.local_addr());
    std::thread::spawn(move || server.serve_forever());
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    std::process::exit(0)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    if std::env::var("TW_BENCH_ROLE").as_deref() == Ok("server") {
        serve();
    }
    let reps: usize = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(5);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env("TW_BENCH_ROLE", "server")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.starts_with('@') {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the server ended");
    }
    let addr = line.trim()[1..].to_string();
    // The inline form needs more JSON values than the default cap (1,048,576) from 1 MiB
    // of uint8 on: raised here so that it can be measured at all.
    let cfg = |remote| RpcConfig { remote_tensors: remote, max_frame: 256 << 20, max_values: 1 << 26, ..RpcConfig::default() };
    let remote = Endpoint::connect(&addr, Registry::new(), cfg(true)).unwrap();
    assert!(remote.negotiate_native(Duration::from_secs(10)).unwrap(), "the server agreed to remote tensors");
    let inline = Endpoint::connect(&addr, Registry::new(), cfg(false)).unwrap();
    println!("UCX_TLS={}; median of {reps} calls each, alternating", std::env::var("UCX_TLS").unwrap_or_else(|_| "(unset)".into()));
    println!("| size | remote (UCX get) ms | GB/s | inline TensorValue ms | GB/s |");
    println!("|---|---|---|---|---|");
    for n in SIZES {
        let (mut r, mut i) = (Vec::new(), Vec::new());
        // One warm-up each (endpoint creation, first registration of the storage).
        for ep in [&remote, &inline] {
            if ep.remote_enabled() || n <= INLINE_MAX {
                let _ = ep.call("t", "get", vec![Value::Int(n as i64)]).unwrap();
            }
        }
        for _ in 0..reps {
            let s = Instant::now();
            let v = remote.call("t", "get", vec![Value::Int(n as i64)]).unwrap();
            r.push(s.elapsed().as_secs_f64());
            assert_eq!(v.as_tensor().unwrap().layout().numel() as usize, n);
            if n <= INLINE_MAX {
                let s = Instant::now();
                let v = inline.call("t", "get", vec![Value::Int(n as i64)]).unwrap();
                i.push(s.elapsed().as_secs_f64());
                assert_eq!(v.as_tensor().unwrap().layout().numel() as usize, n);
            }
        }
        let gbps = |t: f64| n as f64 / t / 1e9;
        let rm = median(&mut r);
        let inl = if i.is_empty() {
            "— | —".to_string()
        } else {
            let im = median(&mut i);
            format!("{:.2} | {:.3}", im * 1e3, gbps(im))
        };
        let size = if n >= 1 << 20 { format!("{} MiB", n >> 20) } else { format!("{} KiB", n >> 10) };
        println!("| {size} | {:.2} | {:.3} | {inl} |", rm * 1e3, gbps(rm));
    }
    drop(child.stdin.take());
    let _ = child.wait();
}
