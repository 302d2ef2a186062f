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
/// export id to release (or the error). "announcing_importer" also says "start" just
/// before each import, so the exporter can act while the get is in flight.
#[test]
fn child_roles() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    match role.as_str() {
        "importer" | "announcing_importer" => {
            let importer = Importer::new().unwrap();
            while let Some(line) = hear() {
                let (seed, blob_hex) = line.split_once(' ').unwrap();
                let blob = ExportBlob::decode(&unhex(blob_hex)).unwrap();
                let mut buf = vec![0u8; blob.length() as usize];
                // The announced imports are the large ones.
                let mut wait = Duration::from_secs(5);
                if role == "announcing_importer" {
                    say("start");
                    wait = Duration::from_secs(30);
                }
                match importer.import(&blob, &mut buf, wait) {
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
        assert_eq!(
            reply,
            format!("release {}", blob.export_id()),
            "{tls} {size}"
        );
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

/// Hostile blobs: every header field and the packed key are checked when decoding, and a
/// forged worker address or key that passes the structural checks is a named import error
/// (or, for a key UCX's tcp emulation ignores, a correct read) — never a crash.
#[test]
fn hostile_blobs_are_named_errors() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    use tensorwire_remote::{BlobError, ImportError};
    let exporter = Exporter::with_options(&[("TLS", "tcp")]).unwrap();
    let importer = Importer::with_options(&[("TLS", "tcp")]).unwrap();
    let scope = exporter.scope();
    let blob = scope.export(pattern(5, 4096)).unwrap();
    let bytes = blob.encode();
    let t = Duration::from_secs(2);

    // Truncated, wrong version, absurd length: decode errors.
    assert!(matches!(
        ExportBlob::decode(&bytes[..bytes.len() - 1]),
        Err(BlobError::Truncated { .. })
    ));
    let mut v2 = bytes.clone();
    v2[4] = 2;
    assert_eq!(
        ExportBlob::decode(&v2),
        Err(BlobError::UnsupportedVersion(2))
    );
    let mut huge = bytes.clone();
    huge[24..32].copy_from_slice(&(1u64 << 50).to_le_bytes());
    assert_eq!(
        ExportBlob::decode(&huge),
        Err(BlobError::BadLength(1 << 50))
    );

    // A buffer of the wrong length is refused before anything is sent.
    let mut small = vec![0u8; 100];
    assert!(matches!(
        importer.import(&blob, &mut small, t),
        Err(ImportError::LengthMismatch { .. })
    ));

    // Forged worker addresses (same length, random bytes; and cut short): named errors.
    let w = blob.worker_address().len();
    let mut seed = 0x9e3779b97f4a7c15u64;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed as u8
    };
    for cut in [w, w / 2, 1] {
        let mut forged = bytes.clone();
        forged[32..34].copy_from_slice(&(cut as u16).to_le_bytes());
        let tail = forged.split_off(36 + w);
        forged.truncate(36 + cut);
        for b in &mut forged[36..] {
            *b = rnd();
        }
        forged.extend_from_slice(&tail);
        // An unknown address version is refused by decode (UCX would abort on it).
        forged[36] = (forged[36] & 0xf0) | 0x0d;
        assert!(matches!(
            ExportBlob::decode(&forged),
            Err(BlobError::BadWorkerAddress(_))
        ));
        // Keep UCX's two header bytes, forge the rest.
        let k = 2.min(cut);
        forged[36..36 + k].copy_from_slice(&blob.worker_address()[..k]);
        let Ok(fb) = ExportBlob::decode(&forged) else {
            continue;
        };
        let mut buf = vec![0u8; 4096];
        let r = importer.import(&fb, &mut buf, t);
        assert!(r.is_err(), "forged address of {cut} bytes imported: {r:?}");
    }

    // Forged key bytes that keep the key's structure: UCX either refuses them or (tcp
    // emulates the get in software and does not consult the key) reads the export.
    let rk_off = 36 + w;
    for _ in 0..32 {
        let mut forged = bytes.clone();
        // The domain map's low 16 bits and any per-domain bytes (tcp's key is the 9-byte
        // header alone).
        forged[rk_off] = rnd();
        forged[rk_off + 1] = rnd();
        for b in &mut forged[rk_off + 9..] {
            *b = rnd();
        }
        let Ok(fb) = ExportBlob::decode(&forged) else {
            continue;
        };
        let mut buf = vec![0u8; 4096];
        match importer.import(&fb, &mut buf, t) {
            Ok(()) => assert_eq!(buf, pattern(5, 4096)),
            Err(e) => assert!(
                matches!(
                    e,
                    ImportError::Rkey(_) | ImportError::Transfer(_) | ImportError::PeerLost(_)
                ),
                "{e:?}"
            ),
        }
    }
    // The genuine blob still works after all that.
    let mut buf = vec![0u8; 4096];
    importer.import(&blob, &mut buf, t).unwrap();
    assert_eq!(buf, pattern(5, 4096));
}

/// Storage that overwrites itself when dropped, and is then leaked (still mapped): a get
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

/// A release that comes while the importer's get is still being served (over tcp the
/// exporter sends the reply in fragments, read from the storage as they go) must not let
/// the storage go until the reply is out: the importer reads the bytes it was exported.
#[test]
fn release_during_a_get_keeps_the_storage_until_the_reply_is_out() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    const N: usize = 128 << 20;
    let exporter = Exporter::with_options(&[("TLS", "tcp")]).unwrap();
    let scope = exporter.scope();
    let mut peer = Peer::spawn("child_roles", "announcing_importer", "tcp");
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
    assert_eq!(exporter.live_exports(), 0, "the registration goes once the reply is out");
    drop(peer.tx);
    assert!(peer.child.wait().unwrap().success());
}
