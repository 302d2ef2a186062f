//! SIGKILL of either side mid-transfer leaves nothing registered or leaked on the side that
//! survives. One test function runs the cases in sequence, so the descriptor counts are not
//! disturbed by other tests' threads.
#![cfg(feature = "ucx")]

mod support;

use std::time::{Duration, Instant};

use support::*;
use tensorwire_remote::ucx::{Exporter, Importer};
use tensorwire_remote::{ExportBlob, ImportError};

const BIG: usize = 256 << 20;

#[test]
fn child_roles() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    match role.as_str() {
        // Import the blob on stdin over and over, never releasing, until killed.
        "importer_loop" => {
            let importer = Importer::new().unwrap();
            let blob = ExportBlob::decode(&unhex(&hear().unwrap())).unwrap();
            let mut buf = vec![0u8; blob.length() as usize];
            say("started");
            loop {
                importer
                    .import(&blob, &mut buf, Duration::from_secs(30))
                    .unwrap();
            }
        }
        // Import once, check the bytes, report.
        "importer_once" => {
            let importer = Importer::new().unwrap();
            let line = hear().unwrap();
            let (seed, h) = line.split_once(' ').unwrap();
            let blob = ExportBlob::decode(&unhex(h)).unwrap();
            let mut buf = vec![0u8; blob.length() as usize];
            importer
                .import(&blob, &mut buf, Duration::from_secs(10))
                .unwrap();
            say(if buf == pattern(seed.parse().unwrap(), buf.len()) {
                "ok"
            } else {
                "bad"
            });
        }
        // Export a big storage, hand out the blob, serve until killed.
        "exporter" => {
            let exporter = Exporter::new().unwrap();
            let scope = exporter.scope();
            let blob = scope.export(pattern(3, BIG)).unwrap();
            say(&hex(&blob.encode()));
            while hear().is_some() {}
            std::thread::sleep(Duration::from_secs(3600));
        }
        other => panic!("unknown role {other}"),
    }
    std::process::exit(0);
}

/// Descriptors a transfer can leave behind: sockets (tcp) and shared-memory segments. The
/// test's own pipes and UCX's one-per-worker timers are not counted.
fn transport_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| {
            let l = l.to_string_lossy();
            l.starts_with("socket:") || l.contains("shm") || l.contains("memfd")
        })
        .count()
}

/// Waits up to 5 s for the transport descriptor count to come back to `baseline`.
fn settles_to(baseline: usize) -> usize {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let n = transport_fds();
        if n <= baseline || Instant::now() > until {
            return n;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn importer_killed(tls: &str) {
    let exporter = Exporter::with_options(&[("TLS", tls)]).unwrap();
    let baseline = transport_fds();
    let scope = exporter.scope();
    let blob = scope.export(pattern(1, BIG)).unwrap();
    let mut peer = Peer::spawn("child_roles", "importer_loop", tls);
    peer.send(&hex(&blob.encode()));
    assert_eq!(peer.recv().as_deref(), Some("started"));
    std::thread::sleep(Duration::from_millis(100));
    peer.kill(); // SIGKILL, mid-transfer of a 256 MiB get.
    // The control connection's end drops the scope: the registration goes once the
    // worker's flush behind it completes. Over tcp that is at once (the socket resets).
    // Over shared memory the flush waits on a reply queued to the dead importer until the
    // exporter's keepalive fails it, which took over 10 s in 4 of 16 runs (once over 45 s): a known gap
    // (DESIGN, "Remote peers"), reported here rather than asserted; the storage is still
    // held, never freed under a queued reply.
    drop(scope);
    let until = Instant::now() + Duration::from_secs(10);
    while exporter.live_exports() != 0 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    let held = exporter.live_exports();
    if tls == "tcp" {
        assert_eq!(held, 0, "{tls}: registration left after importer death");
    } else if held != 0 {
        eprintln!("{tls}: known gap: {held} registration still held 10 s after the importer died");
    }
    // The exporter still serves a new importer.
    let scope = exporter.scope();
    let blob = scope.export(pattern(2, 1 << 20)).unwrap();
    let mut peer = Peer::spawn("child_roles", "importer_once", tls);
    peer.send(&format!("2 {}", hex(&blob.encode())));
    assert_eq!(
        peer.recv().as_deref(),
        Some("ok"),
        "{tls}: exporter unusable after a peer died"
    );
    drop(peer.tx);
    peer.child.wait().unwrap();
    drop(scope);
    if held != 0 {
        // The worker-wide flush behind this release also waits on the dead importer's
        // queued reply, and its endpoint (and segment) is still there: same known gap.
        return;
    }
    assert_eq!(exporter.live_exports(), 0, "{tls}: the second export kept");
    let now = settles_to(baseline);
    assert!(
        now <= baseline,
        "{tls}: exporter holds {now} sockets/segments, {baseline} before the peers"
    );
}

/// What the importer's side must look like after a failed import: no endpoint to the
/// exporter and no socket or segment left beyond `baseline`.
fn nothing_left(importer: &Importer, baseline: usize, tls: &str) {
    assert_eq!(
        importer.endpoints(),
        0,
        "{tls}: endpoint to a failed exporter kept"
    );
    let now = settles_to(baseline);
    assert!(
        now <= baseline,
        "{tls}: importer holds {now} sockets/segments, {baseline} before"
    );
}

/// SIGKILL of the exporter 30 ms into a 256 MiB get: the import ends with a named error in
/// bounded time, never a hang, and leaves nothing behind. Over tcp it is `PeerLost` at once
/// (the socket resets). Over shared memory it is `PeerLost` within about a second (UCX's
/// keepalive, 1 s on the importer, finds the pid gone) — in 15 of 16 runs; once the
/// keepalive did not fire and the import ran into its deadline (`Timeout`, 15 s here),
/// which is still bounded and named (DESIGN, "Remote peers").
fn exporter_killed(tls: &'static str) {
    let timeout = Duration::from_secs(15);
    let importer = Importer::with_options(&[("TLS", tls)]).unwrap();
    let baseline = transport_fds();
    let mut peer = Peer::spawn("child_roles", "exporter", tls);
    let blob = ExportBlob::decode(&unhex(&peer.recv().unwrap())).unwrap();
    // The killer also reaps the exporter, as its parent would on another machine: a zombie
    // keeps its pid and start time, which is what UCX's shared-memory check looks at.
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        peer.kill();
    });
    let mut buf = vec![0u8; BIG];
    let started = Instant::now();
    let result = importer.import(&blob, &mut buf, timeout);
    let took = started.elapsed();
    killer.join().unwrap();
    eprintln!("{tls}: exporter death -> {result:?} in {took:?}");
    match (tls, &result) {
        ("tcp", Err(ImportError::PeerLost(_))) => assert!(took < Duration::from_secs(5)),
        (_, Err(ImportError::PeerLost(_))) => assert!(took < timeout, "{tls}: took {took:?}"),
        (_, Err(ImportError::Timeout)) if tls != "tcp" => {
            assert!(took < timeout + Duration::from_secs(3), "{tls}: took {took:?}")
        }
        _ => panic!("{tls}: {result:?} after {took:?}"),
    }
    nothing_left(&importer, baseline, tls);
}

/// An exporter that is alive but never answers (SIGSTOPped before the get): the import
/// ends at its deadline with `Timeout`, the get cancelled and the endpoint closed.
fn exporter_stopped(tls: &'static str) {
    let timeout = Duration::from_secs(2);
    let before = transport_fds();
    let importer = Importer::with_options(&[("TLS", tls)]).unwrap();
    let mut peer = Peer::spawn("child_roles", "exporter", tls);
    let blob = ExportBlob::decode(&unhex(&peer.recv().unwrap())).unwrap();
    let pid = peer.child.id() as i32;
    // SAFETY: signalling our own child by pid; it is not reaped until `peer.kill()` below.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let mut buf = vec![0u8; BIG];
    let started = Instant::now();
    let result = importer.import(&blob, &mut buf, timeout);
    let took = started.elapsed();
    eprintln!("{tls}: exporter stopped -> {result:?} in {took:?}");
    assert!(
        matches!(result, Err(ImportError::Timeout)),
        "{tls}: {result:?} after {took:?}"
    );
    assert!(
        took >= timeout && took < timeout + Duration::from_secs(3),
        "{tls}: took {took:?} for a {timeout:?} deadline"
    );
    assert_eq!(importer.endpoints(), 0, "{tls}: endpoint to a stopped exporter kept");
    // The connection the stopped exporter opened towards us (tcp: its direction) is its to
    // close; UCX notices the close when our worker is next progressed, which an idle
    // importer is not. So: the exporter dies, the importer goes, and nothing is left.
    peer.kill();
    drop(importer);
    let now = settles_to(before);
    assert!(
        now <= before,
        "{tls}: {now} sockets/segments after the importer went, {before} before it"
    );
}

#[test]
fn either_side_killed_mid_transfer() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    importer_killed("tcp");
    importer_killed("sm,self");
    exporter_killed("tcp");
    exporter_killed("sm,self");
    exporter_stopped("tcp");
    exporter_stopped("sm,self");
}
