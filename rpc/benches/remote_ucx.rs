//! A CPU tensor returned by an RPC: every way it can reach the caller, in one run and one
//! table, at 4 KiB, 1 MiB, 64 MiB and 1 GiB.
//!
//!     cargo bench -p tensorwire-rpc --features ucx --bench remote_ucx [-- REPS]
//!
//! Over loopback TCP (one server and one client process, both `UCX_TLS=tcp`):
//! - *UCX*: the server's tensor as a remote tensor (`RpcConfig::remote_tensors`): the
//!   client asks the server's exporter for it and receives its bytes into a memfd segment
//!   of its own (from the connection's pool, `RpcConfig::remote_pool_bytes`, raised here to
//!   2 GiB so that 1 GiB is kept too: the tensor of the previous rep is dropped before the
//!   next), then releases it;
//! - *inline*: the same call on a connection without remote tensors, the tensor copied
//!   into the JSON as a `TensorValue` (what TCP peers got before remote tensors);
//! - *socket copy*: the same bytes written raw on a plain `TcpStream` and read into a
//!   buffer allocated once — the floor for moving them over loopback TCP;
//! - *call, no tensor*: a call on the remote-tensor connection that returns an integer —
//!   the floor for any call (the 4 KiB row only).
//!
//! Over shared memory (another server/client pair, both `UCX_TLS=sm,self`):
//! - *UCX*: as above, UCX over its shared-memory transports;
//! - *memfd*: the same call over a Unix socket with native tensors — the server's memfd
//!   segment passed by fd and mapped by the client. This is the real alternative: it is
//!   what tensorwire-rpc does for a co-located peer today (the engine follows the
//!   connection's kind, DESIGN "Remote peers"). It maps instead of copying, so its time is
//!   the lease and the mapping, not the bytes; the other columns include a full copy.
//!
//! Every time is the client's whole call (request, decode, the transfer, allocating and
//! filling its tensor, the release where there is one). The server hands out tensors it
//! already holds. Reps per size: 200, 50, 8, 3 by default (`REPS` sets all four); one
//! warm-up each. A cell that cannot be measured says why.

use std::collections::HashMap;
use std::io::{BufRead, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tensorwire_rpc::*;
use tensorwire_test_support::{Lines, RoleCommand, role, say};

const SIZES: [usize; 4] = [4 << 10, 1 << 20, 64 << 20, 1 << 30];
const DEFAULT_REPS: [usize; 4] = [200, 50, 8, 3];
/// The inline form is one JSON value per element: from 64 MiB of uint8 on, the frame
/// (~4 bytes per element) and the value tree (~32 bytes per element) are past any sane
/// `max_frame` / `max_values`, so it is measured up to 1 MiB only (and with `max_values`
/// raised: by default 1 MiB of uint8 is already refused).
const INLINE_MAX: usize = 1 << 20;
const COLUMNS: [&str; 6] =
    ["tcp: UCX", "tcp: inline TensorValue", "tcp: socket copy", "tcp: call, no tensor", "sm: UCX", "sm: memfd (Unix socket)"];

fn size_name(n: usize) -> String {
    match n {
        n if n >= 1 << 30 => format!("{} GiB", n >> 30),
        n if n >= 1 << 20 => format!("{} MiB", n >> 20),
        n => format!("{} KiB", n >> 10),
    }
}

fn data(n: usize) -> Vec<u8> {
    (0..n).map(|i| i as u8).collect()
}

/// The server: the tensors over RPC on TCP and on a Unix socket, the raw bytes on a plain
/// TCP listener. Prints `@tcp_addr unix_path raw_port`, serves until stdin closes.
fn serve() -> ! {
    let raw: Arc<HashMap<usize, Vec<u8>>> = Arc::new(SIZES.iter().map(|&n| (n, data(n))).collect());
    let held: Arc<HashMap<usize, Tensor>> = Arc::new(
        raw.iter().map(|(&n, d)| (n, Tensor::from_bytes(tensorwire::DType::UInt8, &[n as i64], d).unwrap())).collect(),
    );
    let registry = || {
        let held = held.clone();
        let reg = Registry::new();
        reg.register(
            "t",
            Service::new("T")
                .method("get", move |_, a| {
                    let n = a.req(0, "n")?.as_i64().unwrap_or(0) as usize;
                    held.get(&n).cloned().map(Value::from).ok_or_else(|| RpcError::InvalidArgument(format!("no tensor of {n} bytes")))
                })
                .method("ping", |_, _| Ok(Value::Int(1))),
        )
        .unwrap();
        reg
    };
    let cfg = RpcConfig { remote_tensors: true, max_frame: 256 << 20, ..RpcConfig::default() };
    let tcp = Server::bind("tcp://127.0.0.1:0", registry(), cfg.clone()).unwrap();
    let path = std::env::temp_dir().join(format!("tw-bench-remote-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let unix = Server::bind(path.to_str().unwrap(), registry(), cfg).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    say(&format!("{} {} {}", tcp.local_addr(), path.display(), listener.local_addr().unwrap().port()));
    std::thread::spawn(move || tcp.serve_forever());
    std::thread::spawn(move || unix.serve_forever());
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let (Ok(mut s), raw) = (s, raw.clone()) else { continue };
            std::thread::spawn(move || {
                let _ = s.set_nodelay(true);
                let mut idx = [0u8; 1];
                while s.read_exact(&mut idx).is_ok() {
                    if s.write_all(&raw[&SIZES[idx[0] as usize]]).is_err() {
                        return;
                    }
                }
            });
        }
    });
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    let _ = std::fs::remove_file(&path);
    std::process::exit(0)
}

/// `p50 / p90 ms (GB/s at p50)` of the call times in seconds.
fn cell(mut t: Vec<f64>, n: usize) -> String {
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let at = |q: f64| t[((q * t.len() as f64).ceil() as usize).clamp(1, t.len()) - 1];
    let (p50, p90) = (at(0.5), at(0.9));
    format!("{:.3} / {:.3} ms ({:.2} GB/s)", p50 * 1e3, p90 * 1e3, n as f64 / p50 / 1e9)
}

/// As [`cell`] without a rate.
fn cell_time(t: Vec<f64>) -> String {
    let c = cell(t, 1);
    c[..c.find(" (").unwrap_or(c.len())].to_string()
}

/// As [`cell`] for a path that maps the sender's memory instead of copying it: a rate
/// would be meaningless.
fn cell_mapped(t: Vec<f64>) -> String {
    format!("{} (mapped, no copy)", cell_time(t))
}

/// Times `reps` calls of `f` after one warm-up.
fn time(reps: usize, mut f: impl FnMut()) -> Vec<f64> {
    f();
    (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect()
}

fn rpc_get(ep: &Endpoint, n: usize) {
    let v = ep.call("t", "get", vec![Value::Int(n as i64)]).unwrap();
    assert_eq!(v.as_tensor().unwrap().layout().numel() as usize, n);
}

/// The client for one `group` ("tcp" or "sm"): prints `#<size index> <column> <cell>`.
fn client(group: &str, server: &str, reps: [usize; 4]) {
    let mut it = server.split(' ');
    let (tcp, unix, raw_port) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
    // `max_tensor_copy` raised so the client may allocate a 1 GiB tensor; `max_values`
    // raised so that 1 MiB inline can be measured at all.
    let cfg = |remote| RpcConfig {
        remote_tensors: remote,
        max_frame: 256 << 20,
        max_values: 1 << 26,
        max_tensor_copy: 1 << 31,
        max_remote_message_bytes: 2 << 30,
        max_remote_connection_bytes: 4 << 30,
        remote_pool_bytes: 2 << 30,
        ..RpcConfig::default()
    };
    let remote = Endpoint::connect(tcp, Registry::new(), cfg(true)).unwrap();
    assert!(remote.negotiate_native(Duration::from_secs(10)).unwrap() && remote.remote_enabled(), "the server agreed to remote tensors");
    let out = |i: usize, col: usize, text: String| println!("#{i} {col} {text}");
    if group == "tcp" {
        let inline = Endpoint::connect(tcp, Registry::new(), cfg(false)).unwrap();
        let mut sock = TcpStream::connect(("127.0.0.1", raw_port.parse::<u16>().unwrap())).unwrap();
        sock.set_nodelay(true).unwrap();
        for (i, &n) in SIZES.iter().enumerate() {
            out(i, 0, cell(time(reps[i], || rpc_get(&remote, n)), n));
            if n <= INLINE_MAX {
                out(i, 1, cell(time(reps[i], || rpc_get(&inline, n)), n));
            } else {
                out(i, 1, format!("not run: {} M JSON values, a ~{:.1} GB frame and ~{:.0} GB decoded (over max_frame, max_values)", n >> 20, n as f64 * 4.0 / 1e9, n as f64 * 32.0 / 1e9));
            }
            let mut buf = vec![0u8; n];
            let t = time(reps[i], || {
                sock.write_all(&[i as u8]).unwrap();
                sock.read_exact(&mut buf).unwrap();
            });
            assert!(buf.iter().enumerate().all(|(j, &b)| b == j as u8), "socket copy bytes");
            out(i, 2, cell(t, n));
            if i == 0 {
                out(i, 3, cell_time(time(reps[i], || assert_eq!(remote.call("t", "ping", vec![]).unwrap(), Value::Int(1)))));
            }
        }
    } else {
        let memfd = Endpoint::connect(unix, Registry::new(), cfg(false)).unwrap();
        assert!(memfd.negotiate_native(Duration::from_secs(10)).unwrap(), "native tensors on the Unix socket");
        for (i, &n) in SIZES.iter().enumerate() {
            out(i, 4, cell(time(reps[i], || rpc_get(&remote, n)), n));
            out(i, 5, cell_mapped(time(reps[i], || rpc_get(&memfd, n))));
        }
    }
}

/// This bench binary as a child playing `role`, its stdin and stdout piped.
fn spawn(role: &str, tls: &str, extra: &[(&str, &str)], args: &[String]) -> Lines {
    let child = RoleCommand::new(role)
        .args(args)
        .env("UCX_TLS", tls)
        .envs(extra.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn();
    Lines::new(child)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a.parse::<usize>().is_ok()).collect();
    let reps = args.first().and_then(|a| a.parse().ok()).map_or(DEFAULT_REPS, |r: usize| [r.max(1); 4]);
    match role().as_deref() {
        Some("server") => serve(),
        Some(group) => {
            let server = std::env::var("TW_BENCH_SERVER").unwrap();
            client(group, &server, reps);
            return;
        }
        None => {}
    }
    let load = || std::fs::read_to_string("/proc/loadavg").unwrap_or_default().split(' ').take(3).collect::<Vec<_>>().join(" ");
    let load_before = load();
    let mut cells: Vec<Vec<String>> = vec![vec!["—".to_string(); COLUMNS.len()]; SIZES.len()];
    let started = Instant::now();
    for (group, tls) in [("tcp", "tcp"), ("sm", "sm,self")] {
        let mut server = spawn("server", tls, &[], &[]);
        let addr = server.recv().expect("the server ended");
        let mut client = spawn(group, tls, &[("TW_BENCH_SERVER", &addr)], &args);
        client.close();
        for l in (&mut client.rx).lines() {
            let l = l.unwrap();
            let Some(rest) = l.strip_prefix('#') else { continue };
            let mut f = rest.splitn(3, ' ');
            let (i, c, text) = (f.next().unwrap(), f.next().unwrap(), f.next().unwrap());
            cells[i.parse::<usize>().unwrap()][c.parse::<usize>().unwrap()] = text.to_string();
        }
        assert!(client.child.wait().unwrap().success(), "the {group} client failed");
        server.close();
        let _ = server.child.wait();
    }
    println!(
        "p50 / p90 of each call's time (GB/s at p50); reps {reps:?}; {:.0} s in all; load average {load_before} → {}",
        started.elapsed().as_secs_f64(),
        load()
    );
    println!("| size | {} |", COLUMNS.join(" | "));
    println!("|---|{}", "---|".repeat(COLUMNS.len()));
    for (i, &n) in SIZES.iter().enumerate() {
        println!("| {} | {} |", size_name(n), cells[i].join(" | "));
    }
}
