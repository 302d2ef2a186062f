//! What a process that holds an engine hands down to the processes it spawns: none of the
//! engine's file descriptors (UCX's sockets, epoll sets, pipes, timers, shared-memory
//! files), even from a plain `Command` that closes nothing — otherwise a child could speak
//! on the engine's connections or accept on its listeners.
#![cfg(feature = "ucx")]

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use support::*;
use tensorwire_remote::ucx::{Exporter, Importer};

#[test]
fn child_roles() {
    let Some(role) = role() else {
        return;
    };
    match role.as_str() {
        // Say each open fd of this process ("<fd> <target>"), then "end".
        "fds" => {
            for (fd, target) in open_fds() {
                say(&format!("{fd} {target}"));
            }
            say("end");
        }
        other => panic!("unknown role {other}"),
    }
    std::process::exit(0);
}

/// This process's open fds and what each refers to (`socket:[inode]`,
/// `anon_inode:[eventpoll]`, a path, ...), but the one listing them.
fn open_fds() -> BTreeSet<(u32, String)> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| {
            let e = e.ok()?;
            let fd = e.file_name().to_str()?.parse().ok()?;
            let target = std::fs::read_link(e.path()).ok()?.to_string_lossy().into_owned();
            Some((fd, target))
        })
        .filter(|(_, target)| !target.starts_with("/proc/"))
        .collect()
}

/// An exporter and an importer in this process, with an import done over tcp and another
/// with every transport UCX builds (shared memory among them), then a child spawned by a
/// plain `Command`: the child holds none of the fds the engines opened. Only those are
/// judged (matched by number and target, which an inherited fd keeps): the child's stdio
/// and whatever the test runner handed this process are not the engines'. This test is
/// alone in its binary, so nothing but the engines opens fds between the two listings.
#[test]
fn spawned_children_inherit_no_engine_fds() {
    if role().is_some() {
        return;
    }
    let before = open_fds();
    let mut engines = Vec::new();
    for options in [&[("TLS", "tcp")][..], &[]] {
        let exporter = Exporter::with_options(options).unwrap();
        let importer = Importer::with_options(options).unwrap();
        let scope = exporter.scope().unwrap();
        let blob = scope.export(pattern(3, 1 << 20)).unwrap();
        let got = importer.import(&blob, vec![0u8; 1 << 20], Duration::from_secs(10)).unwrap();
        assert_eq!(got, pattern(3, 1 << 20));
        engines.push((exporter, importer, scope));
    }
    let engine_fds: BTreeSet<(u32, String)> = open_fds().difference(&before).cloned().collect();
    // The test means something only where the engines hold what a child could misuse.
    for kind in ["socket:[", "anon_inode:[eventpoll]"] {
        assert!(
            engine_fds.iter().any(|(_, t)| t.starts_with(kind)),
            "the engines hold no {kind} fd, so this test checks nothing: {engine_fds:?}"
        );
    }

    let mut child = spawn_peer("child_roles", "fds", "tcp");
    let mut child_fds = BTreeSet::new();
    loop {
        let line = child.recv().expect("the child died before listing its fds");
        if line == "end" {
            break;
        }
        let (fd, target) = line.split_once(' ').unwrap();
        child_fds.insert((fd.parse::<u32>().unwrap(), target.to_string()));
    }
    child.close();
    assert!(child.child.wait().unwrap().success());

    let inherited: Vec<&(u32, String)> = child_fds.intersection(&engine_fds).collect();
    assert!(
        inherited.is_empty(),
        "a child spawned by a plain Command holds {} of the engines' {} fds (not \
         close-on-exec): {inherited:?}",
        inherited.len(),
        engine_fds.len()
    );
    drop(engines);
}
