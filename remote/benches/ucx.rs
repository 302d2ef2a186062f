//! Two-sided UCX import vs a plain socket copy of the same bytes, two processes, same run.
//!
//! `cargo bench -p tensorwire-remote --features ucx --bench ucx` — over loopback TCP, and
//! (as root, where two network namespaces can be made) across a veth pair between two
//! namespaces, shaped with netem delay 1 ms and rate 1 Gbit/s (a tbf rate limit alone where
//! the kernel has no netem). A server process exports 4 KiB, 1 MiB and 64 MiB (and 1 GiB
//! with `TW_BENCH_1G=1`) and serves the same bytes on a TCP socket; a client process times
//! `Importer::import` into a buffer it allocated once and a socket read of the same size
//! into another, interleaved rep by rep. One table row per link and size: p50 per
//! transfer, GB/s at p50, and UCX / socket throughput. `TW_BENCH_LOOPBACK_ONLY=1` skips
//! the veth pair.

#[path = "../tests/support/netns.rs"]
mod netns;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tensorwire_remote::ExportBlob;
use tensorwire_remote::ucx::{Exporter, Importer};
use tensorwire_test_support::{Lines, RoleCommand, hear, hex, role, say, unhex};


fn sizes() -> Vec<usize> {
    let mut s = vec![4 << 10, 1 << 20, 64 << 20];
    if std::env::var("TW_BENCH_1G").as_deref() == Ok("1") {
        s.push(1 << 30);
    }
    s
}


/// Exports every size, serves the same bytes on a socket (one index byte in, that many
/// bytes out), until the client hangs up.
fn server() {
    let exporter = Exporter::new().unwrap();
    let scope = exporter.scope().unwrap();
    let listener = TcpListener::bind("0.0.0.0:0").unwrap();
    let data: Vec<Vec<u8>> = sizes()
        .iter()
        .map(|&n| (0..n).map(|i| i as u8).collect())
        .collect();
    say(&listener.local_addr().unwrap().port().to_string());
    for d in &data {
        say(&hex(&scope.export(d.clone()).unwrap().encode()));
    }
    let (mut s, _) = listener.accept().unwrap();
    s.set_nodelay(true).unwrap();
    let mut idx = [0u8; 1];
    while s.read_exact(&mut idx).is_ok() {
        s.write_all(&data[idx[0] as usize]).unwrap();
    }
}

fn p50(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Reads the port and blobs on stdin, times both ways for each size, prints rows.
fn client() {
    let link = std::env::var("TW_BENCH_LINK").unwrap();
    let host = std::env::var("TW_BENCH_HOST").unwrap();
    let budget: usize = std::env::var("TW_BENCH_BYTES").unwrap().parse().unwrap();
    let port: u16 = hear().unwrap().parse().unwrap();
    let blobs: Vec<ExportBlob> = sizes().iter().map(|_| ExportBlob::decode(&unhex(&hear().unwrap())).unwrap()).collect();
    let importer = Importer::new().unwrap();
    let mut sock = TcpStream::connect((host.as_str(), port)).unwrap();
    sock.set_nodelay(true).unwrap();
    for (i, (&size, blob)) in sizes().iter().zip(&blobs).enumerate() {
        let reps = (budget / size).clamp(3, 1000);
        let mut dst = vec![0u8; size];
        let mut buf = vec![0u8; size];
        // Warm-up, and the bytes checked once each way.
        dst = importer.import(blob, dst, Duration::from_secs(120)).unwrap();
        sock.write_all(&[i as u8]).unwrap();
        sock.read_exact(&mut buf).unwrap();
        assert!(dst.iter().enumerate().all(|(j, &b)| b == j as u8));
        assert!(buf.iter().enumerate().all(|(j, &b)| b == j as u8));
        let (mut ucx, mut copy) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            let t = Instant::now();
            dst = importer.import(blob, dst, Duration::from_secs(120)).unwrap();
            ucx.push(t.elapsed());
            let t = Instant::now();
            sock.write_all(&[i as u8]).unwrap();
            sock.read_exact(&mut buf).unwrap();
            copy.push(t.elapsed());
        }
        let (u, c) = (p50(ucx), p50(copy));
        let gbs = |d: Duration| size as f64 / d.as_secs_f64() / 1e9;
        let t = |d: Duration| {
            if d < Duration::from_millis(1) {
                format!("{:.0} µs", d.as_secs_f64() * 1e6)
            } else {
                format!("{:.1} ms", d.as_secs_f64() * 1e3)
            }
        };
        let size_s = if size >= 1 << 20 { format!("{} MiB", size >> 20) } else { format!("{} KiB", size >> 10) };
        println!(
            "| {link} | {size_s} | {reps} | {} ({:.2} GB/s) | {} ({:.2} GB/s) | {:.2}× |",
            t(u),
            gbs(u),
            t(c),
            gbs(c),
            c.as_secs_f64() / u.as_secs_f64()
        );
    }
}

/// Runs a server and a client (each optionally inside a namespace) and relays the server's
/// port and blobs to the client.
fn run(link: &str, pair: Option<&netns::Pair>, budget: usize) {
    let exe = RoleCommand::program();
    // This bench binary as `role` on `side` (in its namespace, if any).
    let spawn = |side: usize, role: RoleCommand| {
        let mut cmd = match pair {
            Some(p) => p.command(side, &exe),
            None => Command::new(&exe),
        };
        let dev = pair.map_or("lo".to_string(), |p| p.dev[side].clone());
        role.env("UCX_TLS", "tcp").env("UCX_NET_DEVICES", dev).apply(&mut cmd);
        cmd.spawn().unwrap()
    };
    let mut srv = Lines::new(spawn(0, RoleCommand::new("server").stdout(Stdio::piped())));
    let client = RoleCommand::new("client")
        .env("TW_BENCH_LINK", link)
        .env("TW_BENCH_HOST", pair.map_or("127.0.0.1", |p| p.ip[0]))
        .env("TW_BENCH_BYTES", budget.to_string())
        .stdin(Stdio::piped());
    let mut cli = spawn(1, client);
    let mut tx = cli.stdin.take().unwrap();
    for _ in 0..1 + sizes().len() {
        let l = srv.recv().expect("the server ended before its port and blobs");
        writeln!(tx, "{l}").unwrap();
    }
    drop(tx);
    assert!(cli.wait().unwrap().success(), "{link}: the client failed");
    srv.kill();
}

fn main() {
    match role().as_deref() {
        Some("server") => return server(),
        Some("client") => return client(),
        _ => {}
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average before: {}", load.split(' ').take(3).collect::<Vec<_>>().join(" "));
    println!("| link | size | reps | UCX import p50 | socket copy p50 | UCX / socket throughput |");
    println!("|---|---|---|---|---|---|");
    run("loopback", None, 2 << 30);
    if std::env::var("TW_BENCH_LOOPBACK_ONLY").as_deref() == Ok("1") {
        return;
    }
    match netns::Pair::make("b", true) {
        Ok(p) => run(&format!("veth ({})", p.shaping), Some(&p), 512 << 20),
        Err(why) => println!("| veth | - | - | not run: cannot make two network namespaces here: {why} | | |"),
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average after: {}", load.split(' ').take(3).collect::<Vec<_>>().join(" "));
}
