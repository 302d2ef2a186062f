//! Two processes over loopback: bytes checked on the importer, releases free registrations.
//! Each case runs once with `UCX_TLS=tcp` and once with `UCX_TLS=sm,self`.
#![cfg(feature = "ucx")]

mod support;

use std::time::Duration;

use support::*;
use tensorwire_remote::ExportBlob;
use tensorwire_remote::ucx::{Exporter, Importer};

const SIZES: [usize; 3] = [4 << 10, 1 << 20, 64 << 20];

/// Child role "importer": for every blob line, import, check the bytes, reply with the
/// export id to release (or the error).
#[test]
fn child_roles() {
    let Ok(role) = std::env::var(ROLE) else { return };
    match role.as_str() {
        "importer" => {
            let importer = Importer::new().unwrap();
            while let Some(line) = hear() {
                let (seed, blob_hex) = line.split_once(' ').unwrap();
                let blob = ExportBlob::decode(&unhex(blob_hex)).unwrap();
                let mut buf = vec![0u8; blob.length() as usize];
                match importer.import(&blob, &mut buf, Duration::from_secs(5)) {
                    Ok(()) if buf == pattern(seed.parse().unwrap(), buf.len()) => {
                        say(&format!("release {}", blob.export_id()))
                    }
                    Ok(()) => say("error bytes differ"),
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
    let scope = exporter.scope();
    let mut peer = Peer::spawn("child_roles", "importer", tls);
    for (i, &size) in SIZES.iter().enumerate() {
        let seed = i as u8 + 1;
        let blob = scope.export(pattern(seed, size)).unwrap();
        assert_eq!(exporter.live_exports(), 1);
        peer.send(&format!("{seed} {}", hex(&blob.encode())));
        let reply = peer.recv().expect("importer died");
        assert_eq!(reply, format!("release {}", blob.export_id()), "{tls} {size}");
        scope.release(blob.export_id()).unwrap();
        assert_eq!(exporter.live_exports(), 0, "release frees the registration");
        // A second release of the same id is a named error.
        assert!(scope.release(blob.export_id()).is_err());
    }
    // Exports not released before the connection ends are dropped with its scope.
    let blob = scope.export(pattern(9, 4096)).unwrap();
    peer.send(&format!("9 {}", hex(&blob.encode())));
    assert!(peer.recv().unwrap().starts_with("release"));
    drop(peer.tx);
    assert!(peer.child.wait().unwrap().success());
    assert_eq!(exporter.live_exports(), 1);
    drop(scope);
    assert_eq!(exporter.live_exports(), 0);
}

#[test]
fn round_trip_tcp() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    round_trip("tcp");
}

#[test]
fn round_trip_shared_memory() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    round_trip("sm,self");
}

/// A release names its scope: one connection cannot release another's export.
#[test]
fn release_is_scoped() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let exporter = Exporter::with_options(&[("TLS", "tcp")]).unwrap();
    let (a, b) = (exporter.scope(), exporter.scope());
    let blob = a.export(vec![1u8; 64]).unwrap();
    assert!(b.release(blob.export_id()).is_err());
    assert_eq!(a.live(), 1);
    a.release(blob.export_id()).unwrap();
    assert_eq!(exporter.live_exports(), 0);
}
