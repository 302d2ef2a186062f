//! Exporter and importer on two "hosts": two network namespaces joined by a veth pair that
//! the test makes (its own addresses, shaped with netem delay and rate where the kernel
//! has netem, a tbf rate limit otherwise) and removes after. Bytes checked across the link,
//! forged and replayed requests, and SIGKILL of either side mid-transfer. Skipped, with the
//! reason, where the namespaces cannot be made (not root, no iproute2).
#![cfg(feature = "ucx")]

mod support;

use std::time::{Duration, Instant};

use support::netns::Pair;
use support::*;
use tensorwire_remote::ExportBlob;
use tensorwire_remote::ucx::{Exporter, Importer};

#[test]
fn child_roles() {
    let Some(role) = role() else {
        return;
    };
    match role.as_str() {
        // Commands on stdin: "export SEED LEN", "release ID", "live N" (waits for the held
        // exports to come down to N), "rescope" (the importer's connection ended).
        "exporter" => {
            let exporter = Exporter::new().unwrap();
            let mut scope = exporter.scope().unwrap();
            while let Some(line) = hear() {
                let w: Vec<&str> = line.split(' ').collect();
                match w[0] {
                    "export" => {
                        let blob = scope.export(pattern(w[1].parse().unwrap(), w[2].parse().unwrap())).unwrap();
                        say(&hex(&blob.encode()));
                    }
                    "release" => say(&format!("{:?}", scope.release(w[1].parse().unwrap()))),
                    "live" => say(&live_settles_to(&exporter, w[1].parse().unwrap()).to_string()),
                    "rescope" => {
                        scope = exporter.scope().unwrap();
                        say("ok");
                    }
                    other => panic!("unknown command {other}"),
                }
            }
        }
        // "import SEED HEX": import, check, say "ok", "bad" or the error; "announce" first
        // says "start"; "loop HEX" imports for ever; "stats" says endpoints and parked.
        "importer" => {
            let importer = Importer::new().unwrap();
            while let Some(line) = hear() {
                let w: Vec<&str> = line.split(' ').collect();
                match w[0] {
                    "import" | "announce" => {
                        let blob = ExportBlob::decode(&unhex(w[2])).unwrap();
                        if w[0] == "announce" {
                            say("start");
                        }
                        let t = Instant::now();
                        let r = importer.import(&blob, vec![0u8; blob.length() as usize], Duration::from_secs(30));
                        match r {
                            Ok(b) if b == pattern(w[1].parse().unwrap(), b.len()) => say("ok"),
                            Ok(_) => say("bad"),
                            Err(e) => say(&format!("error {e:?} after {} ms", t.elapsed().as_millis())),
                        }
                    }
                    "loop" => {
                        let blob = ExportBlob::decode(&unhex(w[1])).unwrap();
                        let mut buf = vec![0u8; blob.length() as usize];
                        say("started");
                        loop {
                            buf = importer.import(&blob, buf, Duration::from_secs(30)).unwrap();
                        }
                    }
                    "stats" => say(&format!("endpoints {} parked {}", importer.endpoints(), importer.parked())),
                    other => panic!("unknown command {other}"),
                }
            }
        }
        other => panic!("unknown role {other}"),
    }
    std::process::exit(0);
}

fn spawn(pair: &Pair, side: usize, role: &str) -> Peer {
    spawn_peer_with(
        pair.command(side, &tensorwire_test_support::RoleCommand::program()),
        "child_roles",
        role,
        "tcp",
        &[("UCX_NET_DEVICES", &pair.dev[side])],
    )
}

fn ask(p: &mut Peer, line: &str) -> String {
    p.send(line);
    p.recv().unwrap_or_else(|| panic!("peer ended on {line:?}"))
}

#[test]
fn across_a_veth_pair() {
    if role().is_some() {
        return;
    }
    let pair = match Pair::make("t", true) {
        Ok(p) => p,
        Err(why) => {
            eprintln!("SKIPPED across_a_veth_pair: cannot make two network namespaces here: {why}");
            return;
        }
    };
    eprintln!("namespaces {:?}, link shaped: {}", pair.ns, pair.shaping);
    let mut exp = spawn(&pair, 0, "exporter");
    let mut imp = spawn(&pair, 1, "importer");
    // The worker address the importer connects to is the exporter's veth address.
    for (seed, len) in [(1u8, 4096usize), (2, 1 << 20), (3, 16 << 20)] {
        let blob = ExportBlob::decode(&unhex(&ask(&mut exp, &format!("export {seed} {len}")))).unwrap();
        assert_eq!(ask(&mut imp, &format!("import {seed} {}", hex(&blob.encode()))), "ok", "{len} bytes");
        assert_eq!(ask(&mut exp, &format!("release {}", blob.export_id())), "Ok(())");
    }
    assert_eq!(ask(&mut exp, "live 0"), "0");

    // Forged id, then a replay after release: named errors across the link.
    let hexblob = ask(&mut exp, "export 4 4096");
    let blob = ExportBlob::decode(&unhex(&hexblob)).unwrap();
    let mut forged = blob.encode();
    forged[8..16].copy_from_slice(&(blob.export_id() + 1000).to_le_bytes());
    let r = ask(&mut imp, &format!("import 4 {}", hex(&forged)));
    assert!(r.starts_with(&format!("error UnknownExport({})", blob.export_id() + 1000)), "{r}");
    assert_eq!(ask(&mut exp, &format!("release {}", blob.export_id())), "Ok(())");
    let r = ask(&mut imp, &format!("import 4 {hexblob}"));
    assert!(r.starts_with(&format!("error UnknownExport({})", blob.export_id())), "{r}");

    // SIGKILL of the importer while it receives 64 MiB: its connection ends (the scope
    // goes), and nothing stays held on the exporter, which then serves a new importer.
    let big = ask(&mut exp, &format!("export 5 {}", 64 << 20));
    let mut doomed = spawn(&pair, 1, "importer");
    doomed.send(&format!("loop {big}"));
    assert_eq!(doomed.recv().as_deref(), Some("started"));
    std::thread::sleep(Duration::from_millis(200));
    doomed.kill();
    assert_eq!(ask(&mut exp, "rescope"), "ok");
    assert_eq!(ask(&mut exp, "live 0"), "0", "exports held after the importer died");
    let blob = ask(&mut exp, "export 6 1048576");
    assert_eq!(ask(&mut imp, &format!("import 6 {blob}")), "ok");

    // SIGKILL of the exporter mid-transfer: a named error on the importer, in bounded
    // time, its endpoint to the dead exporter closed, no destination left parked; the
    // importer serves on with the first exporter.
    let mut doomed = spawn(&pair, 0, "exporter");
    let big = ask(&mut doomed, &format!("export 7 {}", 64 << 20));
    imp.send(&format!("announce 7 {big}"));
    assert_eq!(imp.recv().as_deref(), Some("start"));
    std::thread::sleep(Duration::from_millis(150));
    doomed.kill();
    let r = imp.recv().unwrap();
    assert!(r.starts_with("error PeerLost") || r.starts_with("error Transfer"), "{r}");
    assert_eq!(ask(&mut imp, "stats"), "endpoints 1 parked 0", "only the live exporter's endpoint is left");
    let blob = ask(&mut exp, "export 8 1048576");
    assert_eq!(ask(&mut imp, &format!("import 8 {blob}")), "ok");
    eprintln!("exporter death seen by the importer as: {r}");
}
