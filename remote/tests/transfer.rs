//! Two processes over loopback: bytes checked on the importer, releases free exports.
//! Each case runs once with `UCX_TLS=tcp` and once with `UCX_TLS=sm,self`.
#![cfg(feature = "ucx")]

mod support;

use std::time::Duration;

use support::*;
use tensorwire_remote::ExportBlob;
use tensorwire_remote::ucx::{Exporter, Importer};

const SIZES: [usize; 3] = [4 << 10, 1 << 20, 64 << 20];

/// Child role "importer": for every blob line, import, check the bytes, reply with the
/// export id to release (or the error). "announcing_importer" also says "start" just
/// before each import, so the exporter can act while the get is in flight.
#[test]
fn child_roles() {
    let Some(role) = role() else {
        return;
    };
    match role.as_str() {
        "importer" | "announcing_importer" => {
            let importer = Importer::new().unwrap();
            while let Some(line) = hear() {
                let (seed, blob_hex) = line.split_once(' ').unwrap();
                let blob = ExportBlob::decode(&unhex(blob_hex)).unwrap();
                let buf = vec![0u8; blob.length() as usize];
                // The announced imports are the large ones.
                let mut wait = Duration::from_secs(5);
                if role == "announcing_importer" {
                    say("start");
                    wait = Duration::from_secs(30);
                }
                match importer.import(&blob, buf, wait) {
                    Ok(buf) if buf == pattern(seed.parse().unwrap(), buf.len()) => {
                        say(&format!("release {}", blob.export_id()))
                    }
                    Ok(_) => say("error bytes differ"),
                    Err(e) => say(&format!("error {e}")),
                }
            }
        }
        other => panic!("unknown role {other}"),
    }
    std::process::exit(0);
}

fn round_trip(tls: &str) {
    let exporter = Exporter::with_options(&[("TLS", tls)]).unwrap();
    let scope = exporter.scope().unwrap();
    let mut peer = spawn_peer("child_roles", "importer", tls);
    for (i, &size) in SIZES.iter().enumerate() {
        let seed = i as u8 + 1;
        let blob = scope.export(pattern(seed, size)).unwrap();
        assert_eq!(live_settles_to(&exporter, 1), 1);
        peer.send(&format!("{seed} {}", hex(&blob.encode())));
        let reply = peer.recv().expect("importer died");
        assert_eq!(
            reply,
            format!("release {}", blob.export_id()),
            "{tls} {size}"
        );
        scope.release(blob.export_id()).unwrap();
        assert_eq!(live_settles_to(&exporter, 0), 0, "release frees the export");
        // A second release of the same id is a named error.
        assert!(scope.release(blob.export_id()).is_err());
    }
    // Exports not released before the connection ends are dropped with its scope.
    let blob = scope.export(pattern(9, 4096)).unwrap();
    peer.send(&format!("9 {}", hex(&blob.encode())));
    assert!(peer.recv().unwrap().starts_with("release"));
    drop(peer.tx);
    assert!(peer.child.wait().unwrap().success());
    assert_eq!(live_settles_to(&exporter, 1), 1);
    drop(scope);
    assert_eq!(live_settles_to(&exporter, 0), 0);
}

#[test]
fn round_trip_tcp() {
    if role().is_some() {
        return;
    }
    round_trip("tcp");
}

#[test]
fn round_trip_shared_memory() {
    if role().is_some() {
        return;
    }
    round_trip("sm,self");
}

/// A release names its scope: one connection cannot release another's export.
#[test]
fn release_is_scoped() {
    if role().is_some() {
        return;
    }
    let exporter = Exporter::with_options(&[("TLS", "tcp")]).unwrap();
    let (a, b) = (exporter.scope().unwrap(), exporter.scope().unwrap());
    let blob = a.export(vec![1u8; 64]).unwrap();
    assert!(b.release(blob.export_id()).is_err());
    assert_eq!(a.live(), 1);
    a.release(blob.export_id()).unwrap();
    assert_eq!(live_settles_to(&exporter, 0), 0);
}

/// Storage that overwrites itself when dropped, and is then leaked (still mapped): a send
/// that reads it after the drop sees the poison instead of faulting.
struct PoisonOnDrop(Vec<u8>);

// SAFETY: the vector's buffer is stable while the value lives; after the drop it is leaked,
// never freed.
unsafe impl tensorwire_remote::Storage for PoisonOnDrop {
    fn as_ptr(&self) -> *const u8 {
        self.0.as_ptr()
    }
    fn len(&self) -> usize {
        self.0.len()
    }
}

impl Drop for PoisonOnDrop {
    fn drop(&mut self) {
        self.0.fill(0x5a);
        std::mem::forget(std::mem::take(&mut self.0));
    }
}

/// A release that comes while the export is being sent (over tcp the exporter sends it in
/// fragments, read from the storage as they go) must not let the storage go until the send
/// is out: the importer reads the bytes it was exported.
#[test]
fn release_during_a_send_keeps_the_storage_until_it_is_out() {
    if role().is_some() {
        return;
    }
    const N: usize = 128 << 20;
    let exporter = Exporter::with_options(&[("TLS", "tcp")]).unwrap();
    let scope = exporter.scope().unwrap();
    let mut peer = spawn_peer("child_roles", "announcing_importer", "tcp");
    // A first small import: the importer's endpoint is up before the timed one.
    let warm = scope.export(pattern(1, 4096)).unwrap();
    peer.send(&format!("1 {}", hex(&warm.encode())));
    assert_eq!(peer.recv().as_deref(), Some("start"));
    assert_eq!(peer.recv().unwrap(), format!("release {}", warm.export_id()));
    scope.release(warm.export_id()).unwrap();

    let blob = scope.export(PoisonOnDrop(pattern(7, N))).unwrap();
    peer.send(&format!("7 {}", hex(&blob.encode())));
    assert_eq!(peer.recv().as_deref(), Some("start"));
    // 128 MiB take well over 50 ms over loopback tcp here: the release lands mid-reply.
    std::thread::sleep(Duration::from_millis(50));
    scope.release(blob.export_id()).unwrap();
    let reply = peer.recv().expect("importer died");
    assert_eq!(reply, format!("release {}", blob.export_id()), "the importer read what was exported");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while exporter.live_exports() > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(exporter.live_exports(), 0, "the export goes once the send is out");
    drop(peer.tx);
    assert!(peer.child.wait().unwrap().success());
}
