//! Two-process plumbing for the UCX tests: the test binary re-runs itself as a child role
//! (`tensorwire_test_support::RoleCommand`), and the two sides talk over the child's
//! stdin/stdout — the "control connection" that carries blobs and releases
//! (`tensorwire_test_support::lines`).

#![allow(dead_code, unused_imports)]

use std::process::{Command, Stdio};
pub use tensorwire_test_support::{hear, hex, pattern, role, say, unhex};
use tensorwire_test_support::{Lines, RoleCommand, wait_until};

pub mod netns;

/// The parent's end of a child role's control connection.
pub type Peer = Lines;

/// Re-runs this test binary's `test_name` as `role`, with `UCX_TLS=tls`.
pub fn spawn_peer(test_name: &str, role: &str, tls: &str) -> Peer {
    spawn_peer_with(Command::new(RoleCommand::program()), test_name, role, tls, &[])
}

/// As `spawn_peer`, from a prepared command (e.g. `ip netns exec <ns> <this binary>`), with
/// more environment.
pub fn spawn_peer_with(mut cmd: Command, test_name: &str, role: &str, tls: &str, env: &[(&str, &str)]) -> Peer {
    RoleCommand::new(role)
        .test(test_name)
        .envs(env.iter().copied())
        .env("UCX_TLS", tls)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .apply(&mut cmd);
    Lines::new(cmd.spawn().unwrap())
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
    wait_until(&format!("every thread of {pid} to stop"), std::time::Duration::from_secs(5), || {
        std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().all(|t| {
            let stat = std::fs::read_to_string(t.unwrap().path().join("stat")).unwrap_or_default();
            stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('T'))
        })
    });
}
