//! What a hostile importer can make an exporter do with a forged blob, and what a stalled
//! exporter can do to other imports: named errors, nothing read outside an export, nothing
//! crashes, no other import delayed.
#![cfg(feature = "ucx")]

mod support;

use std::time::{Duration, Instant};

use support::*;
use tensorwire_remote::ucx::{Exporter, Importer};
use tensorwire_remote::{BlobError, ExportBlob, ImportError};

#[test]
fn child_roles() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    match role.as_str() {
        // Export 1 MiB, hand out the blob, serve until stdin closes.
        "exporter" => {
            let exporter = Exporter::new().unwrap();
            let scope = exporter.scope().unwrap();
            let blob = scope.export(pattern(4, 1 << 20)).unwrap();
            say(&hex(&blob.encode()));
            while hear().is_some() {}
        }
        other => panic!("unknown role {other}"),
    }
    std::process::exit(0);
}

/// `blob` with the 8 bytes at `offset` replaced (16: length, 8: export id).
fn forge_u64(blob: &ExportBlob, offset: usize, v: u64) -> ExportBlob {
    let mut b = blob.encode();
    b[offset..offset + 8].copy_from_slice(&v.to_le_bytes());
    ExportBlob::decode(&b).unwrap()
}

/// `blob` carrying `key` instead of its own.
fn with_key(blob: &ExportBlob, key: &[u8]) -> ExportBlob {
    let mut b = blob.encode();
    b[24..40].copy_from_slice(key);
    ExportBlob::decode(&b).unwrap()
}

fn import(importer: &Importer, blob: &ExportBlob) -> Result<Vec<u8>, ImportError> {
    importer.import(blob, vec![0u8; blob.length() as usize], Duration::from_secs(5))
}

/// Forged ids, replays after release, another connection's ids and keys, forged lengths:
/// each is a named error from the exporter, which serves the genuine blob afterwards.
#[test]
fn forged_requests_are_named_errors() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let exporter = Exporter::with_options(&[("TLS", "tcp")]).unwrap();
    let importer = Importer::with_options(&[("TLS", "tcp")]).unwrap();
    let (a, b) = (exporter.scope().unwrap(), exporter.scope().unwrap());
    let blob = a.export(pattern(5, 64 << 10)).unwrap();
    let other = b.export(pattern(6, 64 << 10)).unwrap();
    assert_eq!(import(&importer, &blob).unwrap(), pattern(5, 64 << 10));

    // An id never handed out.
    let forged = forge_u64(&blob, 8, blob.export_id() + 1000);
    assert_eq!(
        import(&importer, &forged).map(|v| v.len()),
        Err(ImportError::UnknownExport(blob.export_id() + 1000))
    );
    // Another connection's export id under our key, and our id under a guessed key.
    let stolen = forge_u64(&blob, 8, other.export_id());
    assert_eq!(
        import(&importer, &stolen).map(|v| v.len()),
        Err(ImportError::UnknownExport(other.export_id()))
    );
    assert_eq!(
        import(&importer, &with_key(&other, &[0u8; 16])).map(|v| v.len()),
        Err(ImportError::UnknownExport(other.export_id()))
    );
    // The other connection's genuine blob still works (for its own holder).
    assert_eq!(import(&importer, &other).unwrap(), pattern(6, 64 << 10));
    // A length the export does not have, larger and smaller: nothing is sent.
    for len in [(64 << 10) + 1, 1 << 30, 100] {
        assert_eq!(
            import(&importer, &forge_u64(&blob, 16, len)).map(|v| v.len()),
            Err(ImportError::ExporterLengthMismatch {
                export: 64 << 10,
                requested: len
            }),
            "{len}"
        );
    }
    // Replayed after its release (the SIGSEGV of the one-sided get): a named error.
    a.release(blob.export_id()).unwrap();
    assert_eq!(
        import(&importer, &blob).map(|v| v.len()),
        Err(ImportError::UnknownExport(blob.export_id()))
    );
    // A destination of the wrong length is refused before anything is sent.
    assert!(matches!(
        importer.import(&other, vec![0u8; 100], Duration::from_secs(1)),
        Err(ImportError::LengthMismatch { .. })
    ));
    // The exporter is alive and serves on.
    let again = a.export(pattern(7, 4096)).unwrap();
    assert_eq!(import(&importer, &again).unwrap(), pattern(7, 4096));
    assert_eq!(importer.parked(), 0);
}

/// Forged worker addresses: an address version UCX would abort on is refused by decode;
/// random bytes behind a valid version are a named error, never a crash.
#[test]
fn forged_worker_addresses() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let exporter = Exporter::with_options(&[("TLS", "tcp")]).unwrap();
    let importer = Importer::with_options(&[("TLS", "tcp")]).unwrap();
    let scope = exporter.scope().unwrap();
    let blob = scope.export(pattern(5, 4096)).unwrap();
    let bytes = blob.encode();
    let w = blob.worker_address().len();
    let mut seed = 0x9e3779b97f4a7c15u64;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed as u8
    };
    for cut in [w, w / 2, 1] {
        let mut forged = bytes[..42].to_vec();
        forged[40..42].copy_from_slice(&(cut as u16).to_le_bytes());
        forged.extend((0..cut).map(|_| rnd()));
        forged[42] = (forged[42] & 0xf0) | 0x0d;
        assert!(matches!(
            ExportBlob::decode(&forged),
            Err(BlobError::BadWorkerAddress(_))
        ));
        let k = 2.min(cut);
        forged[42..42 + k].copy_from_slice(&blob.worker_address()[..k]);
        let Ok(fb) = ExportBlob::decode(&forged) else {
            continue;
        };
        let r = importer.import(&fb, vec![0u8; 4096], Duration::from_secs(2));
        assert!(r.is_err(), "forged address of {cut} bytes imported");
    }
    assert_eq!(
        importer
            .import(&blob, vec![0u8; 4096], Duration::from_secs(5))
            .unwrap(),
        pattern(5, 4096)
    );
}

/// An exporter that stops answering (SIGSTOP) holds only the imports from it, each to its
/// own deadline: an import from a healthy exporter on another importer, at the same time,
/// completes at its own pace.
#[test]
fn a_stalled_exporter_delays_no_other_import() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let mut stalled = Peer::spawn("child_roles", "exporter", "tcp");
    let stalled_blob = ExportBlob::decode(&unhex(&stalled.recv().unwrap())).unwrap();
    let healthy = Exporter::with_options(&[("TLS", "tcp")]).unwrap();
    let scope = healthy.scope().unwrap();
    let blob = scope.export(pattern(8, 1 << 20)).unwrap();
    // One importer per connection, as the RPC layer has.
    let slow = Importer::with_options(&[("TLS", "tcp")]).unwrap();
    let fast = Importer::with_options(&[("TLS", "tcp")]).unwrap();
    // Connect both first, so the stop catches an established connection.
    assert_eq!(import(&slow, &stalled_blob).unwrap(), pattern(4, 1 << 20));
    assert_eq!(import(&fast, &blob).unwrap(), pattern(8, 1 << 20));

    // SAFETY: stopping our own child by pid; it is reaped below.
    unsafe { libc::kill(stalled.child.id() as i32, libc::SIGSTOP) };
    wait_stopped(stalled.child.id());
    std::thread::scope(|s| {
        let t = s.spawn(|| {
            let started = Instant::now();
            let r = slow.import(&stalled_blob, vec![0u8; 1 << 20], Duration::from_secs(3));
            (r.map(|_| ()), started.elapsed())
        });
        std::thread::sleep(Duration::from_millis(200));
        let started = Instant::now();
        for _ in 0..5 {
            assert_eq!(import(&fast, &blob).unwrap(), pattern(8, 1 << 20));
        }
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(2),
            "5 imports from a healthy exporter took {took:?} beside a stalled one"
        );
        let (r, slow_took) = t.join().unwrap();
        assert_eq!(r, Err(ImportError::Timeout));
        assert!(slow_took < Duration::from_secs(5), "the stalled import took {slow_took:?}");
    });
    // SAFETY: as above.
    unsafe { libc::kill(stalled.child.id() as i32, libc::SIGCONT) };
    stalled.kill();
    assert_eq!(slow.parked(), 0);
}
