//! UCX import vs a plain socket copy of the same bytes, two processes over loopback.
//!
//! `cargo bench -p tensorwire-remote --features ucx --bench ucx` — for each of
//! `UCX_TLS=tcp` and `UCX_TLS=sm,self`, a child process exports 4 KiB, 1 MiB and 64 MiB
//! and also serves the same bytes over a loopback TCP socket; the parent times
//! `Importer::import` and a socket read of each size into a buffer it allocated once.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tensorwire_remote::ExportBlob;
use tensorwire_remote::ucx::{Exporter, Importer};

const SIZES: [usize; 3] = [4 << 10, 1 << 20, 64 << 20];

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

fn serve() {
    let exporter = Exporter::new().unwrap();
    let scope = exporter.scope().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", listener.local_addr().unwrap().port()).unwrap();
    let data: Vec<Vec<u8>> = SIZES
        .iter()
        .map(|&n| (0..n).map(|i| i as u8).collect())
        .collect();
    for d in &data {
        writeln!(out, "{}", hex(&scope.export(d.clone()).unwrap().encode())).unwrap();
    }
    out.flush().unwrap();
    let (mut s, _) = listener.accept().unwrap();
    s.set_nodelay(true).unwrap();
    let mut idx = [0u8; 1];
    while s.read_exact(&mut idx).is_ok() {
        s.write_all(&data[idx[0] as usize]).unwrap();
    }
}

fn iterations(size: usize) -> usize {
    ((512 << 20) / size).clamp(5, 2000)
}

fn main() {
    if std::env::var("TW_REMOTE_BENCH_ROLE").is_ok() {
        serve();
        return;
    }
    println!("| transport | size | UCX import GB/s (µs) | socket copy GB/s (µs) |");
    println!("|---|---|---|---|");
    for tls in ["tcp", "sm,self"] {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .env("TW_REMOTE_BENCH_ROLE", "1")
            .env("UCX_TLS", tls)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut rx = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        rx.read_line(&mut line).unwrap();
        let port: u16 = line.trim().parse().unwrap();
        let blobs: Vec<ExportBlob> = SIZES
            .iter()
            .map(|_| {
                let mut l = String::new();
                rx.read_line(&mut l).unwrap();
                ExportBlob::decode(&unhex(l.trim())).unwrap()
            })
            .collect();
        let importer = Importer::with_options(&[("TLS", tls)]).unwrap();
        let mut sock = TcpStream::connect(("127.0.0.1", port)).unwrap();
        sock.set_nodelay(true).unwrap();
        for (i, (&size, blob)) in SIZES.iter().zip(&blobs).enumerate() {
            let mut buf = vec![0u8; size];
            let n = iterations(size);
            buf = importer
                .import(blob, buf, Duration::from_secs(60))
                .unwrap(); // warm-up
            assert!(buf.iter().enumerate().all(|(j, &b)| b == j as u8));
            let t = Instant::now();
            for _ in 0..n {
                buf = importer
                    .import(blob, buf, Duration::from_secs(60))
                    .unwrap();
            }
            let ucx = t.elapsed() / n as u32;
            sock.write_all(&[i as u8]).unwrap();
            sock.read_exact(&mut buf).unwrap();
            let t = Instant::now();
            for _ in 0..n {
                sock.write_all(&[i as u8]).unwrap();
                sock.read_exact(&mut buf).unwrap();
            }
            let copy = t.elapsed() / n as u32;
            let gbs = |d: Duration| size as f64 / d.as_secs_f64() / 1e9;
            println!(
                "| {tls} | {} KiB | {:.2} ({:.0}) | {:.2} ({:.0}) |",
                size >> 10,
                gbs(ucx),
                ucx.as_secs_f64() * 1e6,
                gbs(copy),
                copy.as_secs_f64() * 1e6
            );
        }
        drop(sock);
        let _ = child.kill();
        let _ = child.wait();
    }
}
