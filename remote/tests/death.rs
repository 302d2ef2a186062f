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
    let Some(role) = role() else {
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
                buf = importer
                    .import(&blob, buf, Duration::from_secs(30))
                    .unwrap();
            }
        }
        // Import once, check the bytes, report.
        "importer_once" => {
            let importer = Importer::new().unwrap();
            let line = hear().unwrap();
            let (seed, h) = line.split_once(' ').unwrap();
            let blob = ExportBlob::decode(&unhex(h)).unwrap();
            let buf = importer
                .import(&blob, vec![0u8; blob.length() as usize], Duration::from_secs(10))
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
            let scope = exporter.scope().unwrap();
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
    let scope = exporter.scope().unwrap();
    let blob = scope.export(pattern(1, BIG)).unwrap();
    let mut peer = spawn_peer("child_roles", "importer_loop", tls);
    peer.send(&hex(&blob.encode()));
    assert_eq!(peer.recv().as_deref(), Some("started"));
    std::thread::sleep(Duration::from_millis(100));
    peer.kill(); // SIGKILL, mid-transfer of a 256 MiB export.
    // The control connection's end drops the scope: the export goes once UCX has failed
    // the send to the dead importer.
    drop(scope);
    assert_eq!(
        live_settles_to(&exporter, 0),
        0,
        "{tls}: export left after importer death"
    );
    // The exporter still serves a new importer.
    let scope = exporter.scope().unwrap();
    let blob = scope.export(pattern(2, 1 << 20)).unwrap();
    let mut peer = spawn_peer("child_roles", "importer_once", tls);
    peer.send(&format!("2 {}", hex(&blob.encode())));
    assert_eq!(
        peer.recv().as_deref(),
        Some("ok"),
        "{tls}: exporter unusable after a peer died"
    );
    drop(peer.tx);
    peer.child.wait().unwrap();
    drop(scope);
    assert_eq!(live_settles_to(&exporter, 0), 0);
    let now = settles_to(baseline);
    assert!(
        now <= baseline,
        "{tls}: exporter holds {now} sockets/segments, {baseline} before the peers"
    );
}

fn exporter_killed(tls: &'static str, timeout: Duration) {
    let importer = Importer::with_options(&[("TLS", tls)]).unwrap();
    let baseline = transport_fds();
    let mut peer = spawn_peer("child_roles", "exporter", tls);
    let blob = ExportBlob::decode(&unhex(&peer.recv().unwrap())).unwrap();
    let pid = peer.child.id() as i32;
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        // SAFETY: signalling our own child by pid; it has not been reaped yet (we wait below).
        unsafe { libc::kill(pid, libc::SIGKILL) };
    });
    let started = Instant::now();
    let result = importer.import(&blob, vec![0u8; BIG], timeout).map(|_| ());
    killer.join().unwrap();
    peer.kill();
    assert!(
        matches!(
            result,
            Err(ImportError::PeerLost(_) | ImportError::Transfer(_) | ImportError::Timeout)
        ),
        "{tls}: {result:?} after {:?}",
        started.elapsed()
    );
    assert_eq!(
        importer.endpoints(),
        0,
        "{tls}: endpoint to a dead exporter kept"
    );
    let now = settles_to(baseline);
    assert!(
        now <= baseline,
        "{tls}: importer holds {now} sockets/segments, {baseline} before"
    );
    eprintln!(
        "{tls}: exporter death -> {result:?} in {:?}",
        started.elapsed()
    );
}

#[test]
fn either_side_killed_mid_transfer() {
    if role().is_some() {
        return;
    }
    importer_killed("tcp");
    exporter_killed("tcp", Duration::from_secs(10));
    // Not run: either death over `sm,self` (UCX over shared memory is out of scope: its
    // transports have no peer failure handler, so a transfer to or from a dead peer never
    // completes; co-located peers use memfd).
}
