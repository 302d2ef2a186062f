//! Peer setup and the messages after it, driven through a real SEQPACKET socketpair
//! whose other end is the fuzzer (src/peer.rs: `Peer::new`'s setup parsing, the GPU ring
//! setup `open_cuda_ring` → `RingSetup::decode`, `open_cuda_events`' payload checks, and
//! tensor / forget / user messages).
//!
//! The raw end sends a valid hello, then a `KIND_TABLE` setup (fields and fds fuzzed: a
//! real lease table from an `Exporter`, a memfd of fuzzed size and content, a real ring,
//! or nothing), optionally a `KIND_CUDA_RING` setup, then up to 6 later messages, then
//! shuts down its write side. `Peer::from_fd` must accept a setup only if its shape is
//! right, and every `recv` after it must return what was sent or an error — and reach
//! `PeerGone` (the shutdown) within one call per message: no hang, no swallowed EOF.
#![no_main]

#[path = "../common/input.rs"]
mod input;

use input::{Input, dup, framed, hello, memfd, send_raw, shutdown_write};
use libfuzzer_sys::fuzz_target;
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};
use tensorwire::lease::{Exporter, Reclaimed};
use tensorwire::peer::{KIND_CUDA_EVENTS, KIND_CUDA_RING, KIND_FORGET, KIND_TABLE, KIND_TENSOR, KIND_USER};
use tensorwire::ring::RingShared;
use tensorwire::{DESC_SIZE, Incoming, Peer, PeerConfig, TensorDesc};

fn cfg() -> PeerConfig {
    PeerConfig {
        max_leases: 8,
        max_message: 16 << 10,
        max_import_segments: 4,
        max_import_mapped_bytes: 1 << 20,
        max_peer_table_capacity: 64,
        handshake_timeout: Duration::from_secs(5).into(),
        send_timeout: Duration::from_millis(200).into(),
        ring_bytes: 0,
        max_peer_ring_bytes: 1 << 16,
        max_ring_message: 1 << 16,
        recv_spin: Duration::ZERO,
        ..PeerConfig::default()
    }
}

/// An fd the fuzzer picked for a setup slot.
fn pick_fd(inp: &mut Input<'_>, sel: u8, real: Option<&OwnedFd>, wanted_len: usize) -> Option<OwnedFd> {
    match sel % 4 {
        0 => None,
        1 => real.map(|f| dup(f.as_fd())),
        2 => {
            // Fuzzed size near what was wanted, fuzzed content.
            let len = match inp.u8() % 4 {
                0 => wanted_len,
                1 => wanted_len.saturating_sub(1),
                2 => wanted_len + 4096,
                _ => usize::from(inp.u16()),
            };
            let n = usize::from(inp.u8());
            let fill = inp.bytes(n).to_vec();
            Some(memfd(len, &fill, inp.u8() & 1 == 1))
        }
        _ => Some(memfd(usize::from(inp.u16() % 8192), &[], false)),
    }
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    let flags = inp.u8();
    let (ours, raw) = tensorwire::os::seqpacket_pair().expect("socketpair");
    // The hello with SCM_CREDENTIALS, as a real peer sends it (conn_hello fuzzes hellos).
    let h = hello(tensorwire::wire::connection::PROTOCOL_VERSION, 16 << 10);
    if tensorwire::os::send_msg(raw.as_fd(), &h, &[], true, Some(Duration::from_millis(100))).is_err() {
        return;
    }

    // The raw side's own lease table, and a ring, as a real peer would have them.
    let table_cap = 1 + u32::from(inp.u8() % 16);
    let mut exporter = Exporter::new(table_cap, u64::MAX).expect("exporter");
    let table_fd = dup(exporter.table().fd());
    let ring_bytes = 4096usize << (inp.u8() % 3);
    let ring = RingShared::create(ring_bytes).expect("ring");
    let ring_fd = dup(ring.segment().fd());

    // KIND_TABLE: capacity, ring bytes, setup flags.
    let payload = if flags & 1 == 0 {
        let cap = if flags & 2 == 0 { table_cap } else { inp.u32() };
        let rb = match inp.u8() % 4 {
            0 => 0,
            1 => ring_bytes as u64,
            _ => inp.u64(),
        };
        let mut p = tensorwire::peer::setup_payload(cap, rb, if flags & 4 != 0 { tensorwire::peer::SETUP_HAS_CUDA_RING } else { 0 });
        if flags & 8 != 0 {
            p[12..16].copy_from_slice(&inp.u32().to_le_bytes());
        }
        p
    } else {
        let n = usize::from(inp.u8() % 32);
        inp.bytes(n).to_vec()
    };
    let sel = inp.u8();
    let mut fds: Vec<OwnedFd> = Vec::new();
    fds.extend(pick_fd(&mut inp, sel, Some(&table_fd), 64 + 8 * table_cap as usize));
    fds.extend(pick_fd(&mut inp, sel >> 2, Some(&ring_fd), 4096 + ring_bytes));
    if sel & 0x80 != 0 {
        fds.push(memfd(4096, &[], false));
    }
    let borrowed: Vec<_> = fds.iter().map(AsFd::as_fd).collect();
    let setup_kind = if flags & 0x10 == 0 { KIND_TABLE } else { inp.u32() };
    if !send_raw(raw.as_fd(), &framed(setup_kind, &payload), &borrowed) {
        return;
    }

    if flags & 0x20 != 0 {
        // A GPU ring setup: device, slots, slot bytes, descriptor ring bytes, arena handle,
        // one 64-byte handle per slot — shaped right or not — and its 2 fds.
        let p = if inp.u8() & 1 == 0 {
            let slots = match inp.u8() % 4 {
                0 => 0,
                3 => inp.u32(),
                n => u32::from(n),
            };
            let mut p = inp.u32().to_le_bytes().to_vec();
            p.extend_from_slice(&slots.to_le_bytes());
            let slot_bytes = if inp.u8() & 1 == 0 { 4096u64 << (inp.u8() % 4) } else { inp.u64() };
            p.extend_from_slice(&slot_bytes.to_le_bytes());
            p.extend_from_slice(&inp.u64().to_le_bytes());
            p.extend_from_slice(&[7u8; 64]);
            let n = if inp.u8() & 1 == 0 { 64 * slots.min(8) as usize } else { usize::from(inp.u8()) };
            p.resize(p.len() + n, 0x5a);
            p
        } else {
            let n = usize::from(inp.u16() % 1024);
            inp.bytes(n).to_vec()
        };
        let nfds = inp.u8() % 4;
        let fds: Vec<OwnedFd> = (0..nfds).map(|_| memfd(4096 << (inp.u8() % 5), &[], false)).collect();
        let borrowed: Vec<_> = fds.iter().map(AsFd::as_fd).collect();
        if !send_raw(raw.as_fd(), &framed(KIND_CUDA_RING, &p), &borrowed) {
            return;
        }
    }

    // Later messages.
    let count = inp.u8() % 7;
    let mut users: Vec<Vec<u8>> = Vec::new();
    let mut granted = 0u64;
    for _ in 0..count {
        let what = inp.u8();
        let (kind, payload, fds): (u32, Vec<u8>, Vec<OwnedFd>) = match what % 6 {
            0 | 1 => {
                // A tensor: fuzzed descriptor, made plausible on request, naming a lease
                // this side really granted, with a segment fd.
                let tag = inp.u64();
                let mut d: TensorDesc = bytemuck::pod_read_unaligned(&{
                    let mut b = [0u8; DESC_SIZE];
                    let src = inp.bytes(DESC_SIZE);
                    b[..src.len()].copy_from_slice(src);
                    b
                });
                let seg_len = 1 + usize::from(inp.u16() % 16384);
                if what & 0x10 != 0 {
                    d.magic = tensorwire::desc::DESC_MAGIC;
                    d.version = tensorwire::desc::DESC_VERSION;
                    d.dtype = 0;
                    d.ndim = 1;
                    d.device_type = 0;
                    d.device_index = 0;
                    d.storage_kind = 1;
                    d.flags = 0;
                    d.reserved0 = 0;
                    d.storage.reserved0 = 0;
                    d.sizes = [0; 16];
                    d.strides = [0; 16];
                    d.sizes[0] = i64::from(inp.u16() % 4096);
                    d.strides[0] = 1;
                    d.storage_offset = i64::from(inp.u8());
                    d.storage.base_offset = u64::from(inp.u16());
                    d.storage.nbytes = u64::from(inp.u16());
                }
                if what & 0x20 != 0 {
                    match exporter.grant(None, 1, Box::new(()), None) {
                        Ok((id, _)) => {
                            granted += 1;
                            d.storage.lease_slot = id.slot;
                            d.storage.lease_gen = id.generation;
                        }
                        Err(_) => {}
                    }
                }
                let mut p = tag.to_le_bytes().to_vec();
                p.extend_from_slice(d.encode());
                // The fd slot: mostly a real one (0..SEGMENT_FD_SLOTS), sometimes any
                // word; the trailer zero unless the input says otherwise.
                let slot = if what & 0x08 == 0 { u32::from(inp.u8()) % tensorwire::peer::SEGMENT_FD_SLOTS } else { inp.u32() };
                p.extend_from_slice(&slot.to_le_bytes());
                p.extend_from_slice(&(if what & 0x04 == 0 { 0 } else { inp.u32() }).to_le_bytes());
                if what & 0x40 != 0 {
                    p.truncate(usize::from(inp.u16()) % (p.len() + 1));
                }
                let fds = if what & 0x80 == 0 { vec![memfd(seg_len, b"tensor", inp.u8() & 1 == 1)] } else { Vec::new() };
                (KIND_TENSOR, p, fds)
            }
            2 => {
                // CUDA IPC events: device, count, count x 64-byte handles; 1 fd (acks).
                let n = if what & 0x10 == 0 { u32::from(inp.u8() % 4) } else { inp.u32() };
                let mut p = inp.u32().to_le_bytes().to_vec();
                p.extend_from_slice(&n.to_le_bytes());
                let body = if what & 0x20 == 0 { 64 * n.min(8) as usize } else { usize::from(inp.u16() % 1024) };
                p.resize(8 + body, 0x11);
                let ack_len = if what & 0x40 == 0 { 8 * n.min(8) as usize } else { usize::from(inp.u16()) };
                let fds = if what & 0x80 == 0 { vec![memfd(ack_len, &[], false)] } else { Vec::new() };
                (KIND_CUDA_EVENTS, p, fds)
            }
            3 => {
                let n = if what & 0x10 == 0 { 8 } else { usize::from(inp.u8() % 16) };
                (KIND_FORGET, inp.bytes(n).to_vec(), Vec::new())
            }
            4 => {
                let n = usize::from(inp.u16() % 512);
                let p = inp.bytes(n).to_vec();
                users.push(p.clone());
                (KIND_USER, p, Vec::new())
            }
            _ => {
                let kind = inp.u32();
                let n = usize::from(inp.u8());
                let p = inp.bytes(n).to_vec();
                if kind == KIND_USER {
                    users.push(p.clone());
                }
                (kind, p, Vec::new())
            }
        };
        let borrowed: Vec<_> = fds.iter().map(AsFd::as_fd).collect();
        if !send_raw(raw.as_fd(), &framed(kind, &payload), &borrowed) {
            break;
        }
    }
    shutdown_write(raw.as_fd());

    let setup_shape_ok = setup_kind == KIND_TABLE && payload.len() == 16 && (1..=2).contains(&fds.len());
    let peer = match Peer::from_fd(ours, cfg()) {
        Ok(p) => {
            assert!(setup_shape_ok, "accepted a setup of kind {setup_kind}, {} bytes, {} fds", payload.len(), fds.len());
            p
        }
        Err(e) => {
            assert!(!e.to_string().is_empty());
            return;
        }
    };

    // One result per message that returns one (the later messages, and a GPU ring setup
    // the table setup did not announce), then PeerGone.
    let mut users = users.into_iter();
    let mut gone = false;
    for _ in 0..count + 2 {
        match peer.recv(Some(Duration::from_secs(5))) {
            Ok(Incoming::Tensor(t)) => {
                // Every byte the validated view names is readable.
                let v = t.to_vec().expect("an imported tensor reads back");
                assert_eq!(v.len() as u64, t.layout().packed_bytes());
                // Released, or refused because the connection has ended (the raw end
                // shut down) — never another error.
                if let Err(e) = t.release() {
                    assert!(e.is_peer_gone(), "release of a fresh import: {e}");
                }
            }
            Ok(Incoming::CudaTensor(_)) => panic!("a CUDA tensor imported without a driver"),
            Ok(Incoming::Message { payload, .. }) => {
                assert_eq!(Some(payload), users.next(), "user messages arrive intact, in order");
            }
            Err(e) if e.is_peer_gone() => {
                gone = true;
                break;
            }
            Err(e) => assert!(!e.to_string().is_empty()),
        }
    }
    assert!(gone, "the shutdown was not seen after {count} messages (+ 1 GPU ring setup)");
    drop(peer);

    // The raw side reaps whatever the consumer released: never more than it granted.
    let mut out = Reclaimed::default();
    exporter.reap(Instant::now(), &mut out);
    let released = exporter.stats().released;
    assert!(released <= granted, "{released} leases reaped, {granted} granted");
});
