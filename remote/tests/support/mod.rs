//! Two-process plumbing for the UCX tests: the test binary re-runs itself as a child role
//! (selected by `TW_REMOTE_ROLE`), and the two sides talk over the child's stdin/stdout —
//! the "control connection" that carries blobs and releases.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

pub mod netns;

pub const ROLE: &str = "TW_REMOTE_ROLE";

/// The deterministic byte at `i` of a storage seeded with `seed`.
pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2654435761).wrapping_shr(13) as u8 ^ seed)
        .collect()
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

pub struct Peer {
    pub child: Child,
    pub tx: ChildStdin,
    pub rx: BufReader<ChildStdout>,
}

impl Peer {
    /// Re-runs this test binary's `test_name` as `role`, with `UCX_TLS=tls`.
    pub fn spawn(test_name: &str, role: &str, tls: &str) -> Peer {
        Peer::spawn_with(Command::new(std::env::current_exe().unwrap()), test_name, role, tls, &[])
    }

    /// As `spawn`, from a prepared command (e.g. `ip netns exec <ns> <this binary>`), with
    /// more environment.
    pub fn spawn_with(
        mut cmd: Command,
        test_name: &str,
        role: &str,
        tls: &str,
        env: &[(&str, &str)],
    ) -> Peer {
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .args(["--exact", test_name, "--nocapture", "--test-threads=1"])
            .env(ROLE, role)
            .env("UCX_TLS", tls)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let tx = child.stdin.take().unwrap();
        let rx = BufReader::new(child.stdout.take().unwrap());
        Peer { child, tx, rx }
    }

    pub fn send(&mut self, line: &str) {
        writeln!(self.tx, "{line}").unwrap();
        self.tx.flush().unwrap();
    }

    /// Next protocol line from the child (text before `@` is the harness's own output
    /// and skipped); `None` at EOF.
    pub fn recv(&mut self) -> Option<String> {
        loop {
            let mut s = String::new();
            if self.rx.read_line(&mut s).unwrap() == 0 {
                return None;
            }
            // libtest may print "test name ... " before the child's first line.
            if let Some(at) = s.find('@') {
                return Some(s.trim_end()[at + 1..].to_string());
            }
        }
    }

    pub fn kill(&mut self) {
        // std's `Child::kill` sends SIGKILL.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The child side of the control connection.
pub fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "@{line}").unwrap();
    out.flush().unwrap();
}

pub fn hear() -> Option<String> {
    let mut s = String::new();
    if std::io::stdin().read_line(&mut s).unwrap() == 0 {
        return None;
    }
    Some(s.trim_end().to_string())
}

/// Waits up to 10 s for the exporter's held exports to come down to `n` (a send completes
/// on the exporter's progress thread a moment after the importer has the bytes).
pub fn live_settles_to(exporter: &tensorwire_remote::ucx::Exporter, n: usize) -> usize {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let live = exporter.live_exports();
        if live <= n || std::time::Instant::now() > until {
            return live;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Waits until every thread of `pid` is stopped: `kill` returns before a group stop has
/// reached each thread.
pub fn wait_stopped(pid: u32) {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let stopped = || {
        std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().all(|t| {
            let stat = std::fs::read_to_string(t.unwrap().path().join("stat")).unwrap_or_default();
            stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('T'))
        })
    };
    while !stopped() {
        assert!(std::time::Instant::now() < until, "{pid} did not stop");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}
