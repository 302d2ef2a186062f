//! `tensorwire demo`: spawn a child process of this binary, share tensors of several
//! sizes and layouts both ways, verify them on the other side, prove zero-copy by
//! mutation, release, and print a table. Exits non-zero if anything failed.

use crossbeam_utils::Backoff;
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tensorwire::{DType, ExportOptions, Incoming, Layout, Peer, PeerConfig, SharedTensor};

const USAGE: &str = "usage: tensorwire demo [--max-size BYTES]\n\
    Spawns a child process, shares tensors (4 KiB .. 64 MiB by default; contiguous,\n\
    transposed, sliced, expanded) both ways, verifies them, and prints a table.";

const MSG_IMPORTED: u64 = 1;
const MSG_GO_RELEASE: u64 = 2;
const MSG_RELEASING: u64 = 3;
const MSG_DONE: u64 = 4;
const TIMEOUT: Duration = Duration::from_secs(30);

type Fail = Box<dyn std::error::Error>;

fn now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid out-pointer; CLOCK_MONOTONIC is system-wide, so stamps from
    // the two processes are comparable.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x1000_0000_01b3))
}

fn words(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn recv_words(peer: &Peer) -> Result<Vec<u64>, Fail> {
    match peer.recv(TIMEOUT)? {
        Incoming::Message { payload, .. } if payload.len() % 8 == 0 && !payload.is_empty() => {
            Ok(payload.chunks(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect())
        }
        other => Err(format!("expected a demo control message, got {other:?}").into()),
    }
}

/// One demo case: a view over a storage of about `bytes` bytes.
struct Case {
    name: &'static str,
    layout: Layout,
    storage_bytes: usize,
}

fn cases(max: usize) -> Result<Vec<Case>, Fail> {
    let mut out = Vec::new();
    for bytes in [4usize << 10, 1 << 20, 64 << 20] {
        if bytes > max {
            continue;
        }
        let f32n = (bytes / 4) as i64;
        out.push(Case { name: "contiguous", layout: Layout::contiguous(DType::Float32, &[f32n])?, storage_bytes: bytes });
        let rows = (bytes / 8 / 64) as i64;
        out.push(Case {
            name: "transposed",
            layout: Layout::contiguous(DType::Float64, &[rows, 64])?.transpose(0, 1)?,
            storage_bytes: bytes,
        });
        let n16 = (bytes / 2) as i64;
        out.push(Case {
            name: "sliced ::3",
            layout: Layout::contiguous(DType::BFloat16, &[n16])?.slice(0, 1, n16, 3)?,
            storage_bytes: bytes,
        });
        let k = (bytes / 8) as i64;
        out.push(Case {
            name: "expanded x4",
            layout: Layout::contiguous(DType::Int64, &[1, k])?.expand(0, 4)?,
            storage_bytes: bytes,
        });
    }
    Ok(out)
}

/// Owner that records when the producer let go of the memory.
struct Flag(Arc<AtomicBool>, #[allow(dead_code)] Arc<tensorwire::Segment>);
impl Drop for Flag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

struct Row {
    direction: &'static str,
    /// "lease" (zero-copy export) or "ring" (copied through the bounce buffer).
    path: &'static str,
    case: String,
    /// export+import (lease) or copy-in+copy-out (ring), producer call to consumer done.
    transfer_us: f64,
    /// consumer release to producer owner dropped (lease only).
    release_us: Option<f64>,
    ok: bool,
}

fn fill(t: &SharedTensor, seed: u64) -> Result<(), Fail> {
    let n = t.storage_nbytes();
    let mut chunk = vec![0u8; (1 << 20).min(n)];
    let mut x = seed | 1;
    let mut at = 0;
    while at < n {
        let len = chunk.len().min(n - at);
        for b in chunk[..len].iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        t.write_storage(at, &chunk[..len])?;
        at += len;
    }
    Ok(())
}

fn produce(peer: &Peer, direction: &'static str, max: usize) -> Result<Vec<Row>, Fail> {
    let mut rows = Vec::new();
    for (i, case) in cases(max)?.into_iter().enumerate() {
        let tag = i as u64;
        let t = SharedTensor::zeros(Layout::contiguous(DType::UInt8, &[case.storage_bytes as i64])?)?.view(case.layout)?;
        fill(&t, 0x9e37_79b9_7f4a_7c15 ^ tag)?;
        let expect = fnv1a(&t.to_vec()?);
        let first_at = case.layout.storage_offset as usize * case.layout.dtype.size();
        let mut first = [0u8];
        t.read_storage(first_at, &mut first)?;

        let dropped = Arc::new(AtomicBool::new(false));
        let owner = Box::new(Flag(dropped.clone(), t.segment().clone()));
        let t0 = now_ns();
        peer.export_with_owner(&t, owner, ExportOptions { tag, window: None })?;
        let m = recv_words(peer)?;
        if m.len() != 4 || m[0] != MSG_IMPORTED || m[1] != tag {
            return Err(format!("case {tag}: unexpected reply {m:?}").into());
        }
        let (t1, got) = (m[2], m[3]);
        let checksum_ok = got == expect;
        if !checksum_ok {
            eprintln!("{direction} {}: checksum mismatch: producer {expect:#x}, consumer {got:#x}", case.name);
        }
        // Zero-copy: the consumer flipped the view's first byte in its own mapping; the
        // producer must see the flip in its memory.
        let mut now_first = [0u8];
        t.read_storage(first_at, &mut now_first)?;
        let zero_copy_ok = now_first[0] == !first[0];
        if !zero_copy_ok {
            eprintln!("{direction} {}: consumer's write not visible to the producer", case.name);
        }
        if dropped.load(Ordering::Acquire) {
            return Err(format!("case {tag}: owner dropped before the consumer released").into());
        }
        drop(t);
        peer.send_message(&words(&[MSG_GO_RELEASE, tag]), &[])?;
        let m = recv_words(peer)?;
        if m.len() != 3 || m[0] != MSG_RELEASING || m[1] != tag {
            return Err(format!("case {tag}: unexpected reply {m:?}").into());
        }
        let t2 = m[2];
        // The reaper thread drops the owner: spin briefly, then yield to it (on a busy
        // machine it may need this very CPU) rather than burn the CPU for up to 10 s.
        let deadline = Instant::now() + Duration::from_secs(10);
        let backoff = Backoff::new();
        while !dropped.load(Ordering::Acquire) {
            if Instant::now() > deadline {
                return Err(format!("case {tag}: owner not dropped 10 s after the consumer released").into());
            }
            backoff.snooze();
        }
        let t3 = now_ns();
        let ok = checksum_ok && zero_copy_ok;
        rows.push(Row {
            direction,
            path: "lease",
            case: format!("{:<11} {:>8} {:?}", case.name, case.layout.dtype.name(), case.layout.sizes()),
            transfer_us: t1.saturating_sub(t0) as f64 / 1e3,
            release_us: Some(t3.saturating_sub(t2) as f64 / 1e3),
            ok,
        });
    }
    peer.send_message(&words(&[MSG_DONE]), &[])?;
    Ok(rows)
}

const MSG_RING_GOT: u64 = 5;
const RING_DONE_TAG: u64 = u64::MAX;

fn sizes_hash(l: &Layout) -> u64 {
    fnv1a(&words(&l.sizes().iter().map(|&s| s as u64).collect::<Vec<_>>()))
}

/// The same cases copied through the ring (views packed on the way in; the 64 MiB ones
/// are larger than the ring and go through in chunks).
fn ring_produce(peer: &Peer, direction: &'static str, max: usize) -> Result<Vec<Row>, Fail> {
    let mut rows = Vec::new();
    let mut all = vec![Case { name: "contiguous", layout: Layout::contiguous(DType::UInt8, &[64])?, storage_bytes: 64 }];
    all.extend(cases(max)?);
    for (i, case) in all.into_iter().enumerate() {
        let tag = i as u64;
        let t = SharedTensor::zeros(Layout::contiguous(DType::UInt8, &[case.storage_bytes as i64])?)?.view(case.layout)?;
        fill(&t, 0x51ed_270b_2f3e_a9c1 ^ tag)?;
        let expect = fnv1a(&t.to_vec()?);
        let t0 = now_ns();
        peer.ring_send(&[tensorwire::RingItem::shared(tag, &t)], TIMEOUT)?;
        let m = recv_words(peer)?;
        if m.len() != 5 || m[0] != MSG_RING_GOT || m[1] != tag {
            return Err(format!("ring case {tag}: unexpected reply {m:?}").into());
        }
        let ok = m[3] == expect && m[4] == sizes_hash(&case.layout);
        if !ok {
            eprintln!("{direction} ring {}: checksum or shape mismatch", case.name);
        }
        rows.push(Row {
            direction,
            path: "ring",
            case: format!("{:<11} {:>8} {:?}", case.name, case.layout.dtype.name(), case.layout.sizes()),
            transfer_us: m[2].saturating_sub(t0) as f64 / 1e3,
            release_us: None,
            ok,
        });
    }
    peer.ring_send(&[tensorwire::RingItem::bytes(RING_DONE_TAG, b"")], TIMEOUT)?;
    Ok(rows)
}

fn ring_consume(peer: &Peer) -> Result<(), Fail> {
    let mut buf = Vec::new();
    loop {
        let (tag, desc) = peer.ring_recv_into(&mut buf, TIMEOUT)?;
        if tag == RING_DONE_TAG {
            return Ok(());
        }
        let t1 = now_ns();
        let desc = desc.ok_or("a ring tensor arrived without its descriptor")?;
        let shape = sizes_hash(&desc.layout());
        peer.send_message(&words(&[MSG_RING_GOT, tag, t1, fnv1a(&buf), shape]), &[])?;
    }
}

fn consume(peer: &Peer) -> Result<(), Fail> {
    loop {
        let imported = match peer.recv(TIMEOUT)? {
            Incoming::Tensor(t) => t,
            Incoming::Message { payload, .. } if payload == words(&[MSG_DONE]) => return Ok(()),
            other => return Err(format!("consumer: unexpected {other:?}").into()),
        };
        let t1 = now_ns();
        let sum = fnv1a(&imported.to_vec()?);
        let l = imported.layout();
        let at = l.storage_offset as usize * l.dtype.size();
        let mut b = [0u8];
        imported.read_storage(at, &mut b)?;
        imported.write_storage(at, &[!b[0]])?;
        peer.send_message(&words(&[MSG_IMPORTED, imported.tag(), t1, sum]), &[])?;
        let m = recv_words(peer)?;
        if m != [MSG_GO_RELEASE, imported.tag()] {
            return Err(format!("consumer: unexpected {m:?}").into());
        }
        let t2 = now_ns();
        let tag = imported.tag();
        imported.release()?;
        peer.send_message(&words(&[MSG_RELEASING, tag, t2]), &[])?;
    }
}

pub fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("demo") => parent(&args[1..]),
        Some("demo-child") => child(&args[1..]),
        Some("-h" | "--help") | None => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Some(other) => Err(format!("unknown command {other:?}\n{USAGE}").into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tensorwire: {e}");
            ExitCode::FAILURE
        }
    }
}

fn parse_max(args: &[String]) -> Result<usize, Fail> {
    match args {
        [] => Ok(64 << 20),
        [flag, v] if flag == "--max-size" => Ok(v.parse()?),
        _ => Err(USAGE.into()),
    }
}

fn parent(args: &[String]) -> Result<(), Fail> {
    let max = parse_max(args)?;
    let (mine, theirs) = tensorwire::os::seqpacket_pair()?;
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    let fd = tensorwire::os::inherit_in_child(&mut cmd, std::os::fd::AsFd::as_fd(&theirs));
    let mut child = cmd.args(["demo-child", "--fd", &fd.to_string(), "--max-size", &max.to_string()]).spawn()?;
    drop(theirs);
    let run = || -> Result<Vec<Row>, Fail> {
        let peer = Peer::from_fd(mine, PeerConfig::default())?;
        println!("tensorwire demo: parent pid {} <-> child pid {}", std::process::id(), peer.peer_pid());
        let mut rows = produce(&peer, "parent->child", max)?;
        consume(&peer)?;
        rows.extend(ring_produce(&peer, "parent->child", max)?);
        ring_consume(&peer)?;
        // The child reports its rows (it produced second) as text lines.
        match peer.recv(TIMEOUT)? {
            Incoming::Message { payload, .. } => {
                for line in String::from_utf8(payload)?.lines() {
                    let f: Vec<&str> = line.split('\t').collect();
                    if f.len() != 5 {
                        return Err(format!("bad row from child: {line:?}").into());
                    }
                    rows.push(Row {
                        direction: "child->parent",
                        path: if f[0] == "ring" { "ring" } else { "lease" },
                        case: f[1].to_string(),
                        transfer_us: f[2].parse()?,
                        release_us: f[3].parse().ok(),
                        ok: f[4] == "ok",
                    });
                }
            }
            other => return Err(format!("expected the child's rows, got {other:?}").into()),
        }
        let stats = peer.reap_now();
        if stats.live_leases != 0 {
            return Err(format!("{} leases still live at the end", stats.live_leases).into());
        }
        Ok(rows)
    };
    let rows = run();
    let status = child.wait()?;
    let rows = rows?;
    if !status.success() {
        return Err(format!("child exited with {status}").into());
    }
    println!("\n{:<14} {:<6} {:<42} {:>13} {:>12}  verified", "direction", "path", "view (dtype, shape)", "transfer", "release");
    let mut all_ok = true;
    for r in &rows {
        all_ok &= r.ok;
        println!(
            "{:<14} {:<6} {:<42} {:>10.1} µs {:>12}  {}",
            r.direction,
            r.path,
            r.case,
            r.transfer_us,
            r.release_us.map_or("-".to_string(), |u| format!("{u:.1} µs")),
            match (r.ok, r.path) {
                (false, _) => "FAILED",
                (true, "lease") => "checksum + zero-copy ok",
                (true, _) => "checksum + shape ok",
            }
        );
    }
    println!("\ntransfer: lease = export until the consumer has imported (zero-copy, any size);");
    println!("          ring  = copy in + copy out through the {} KiB bounce buffer (views packed).", PeerConfig::default().ring_bytes >> 10);
    println!("release:  consumer's release until the producer's owner is dropped (a release wakes no");
    println!("          one; the producer collects within PeerConfig::reap_interval = {:?}).", PeerConfig::default().reap_interval);
    if !all_ok {
        return Err("some transfers failed verification".into());
    }
    println!("\nall {} transfers verified in the other process", rows.len());
    Ok(())
}

fn child(args: &[String]) -> Result<(), Fail> {
    let (fd, rest) = match args {
        [flag, fd, rest @ ..] if flag == "--fd" => (fd.parse::<i32>()?, rest),
        _ => return Err("demo-child needs --fd N".into()),
    };
    let max = parse_max(rest)?;
    // SAFETY: the parent passed us this inherited fd number and nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let peer = Peer::from_fd(fd, PeerConfig::default())?;
    consume(&peer)?;
    let mut rows = produce(&peer, "child->parent", max)?;
    ring_consume(&peer)?;
    rows.extend(ring_produce(&peer, "child->parent", max)?);
    let text: String = rows
        .iter()
        .map(|r| {
            let rel = r.release_us.map_or("-".to_string(), |u| u.to_string());
            format!("{}\t{}\t{}\t{}\t{}\n", r.path, r.case, r.transfer_us, rel, if r.ok { "ok" } else { "bad" })
        })
        .collect();
    peer.send_message(text.as_bytes(), &[])?;
    // Wait for the parent to finish with us before tearing the connection down.
    let _ = peer.recv(TIMEOUT);
    Ok(())
}
