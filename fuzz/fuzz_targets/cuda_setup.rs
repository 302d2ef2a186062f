//! The CUDA setup messages a peer sends (src/cuda): the GPU ring setup
//! (`cuda::ring::RingSetup::decode`) and the IPC event pool's bounds
//! (`cuda::order::remote_events::RemoteEvents::open`, which `Peer::open_cuda_events` feeds after its own
//! payload checks; those run through a socket in the `peer_setup` target).
//!
//! A decoded ring setup must describe a valid ring (`CudaRingConfig::check`), carry one
//! handle per slot, and encode back to exactly the bytes it came from. The event pool
//! must refuse counts outside 1..=1024 and ack tables too small for the count, and,
//! without a driver, say the events are unusable rather than fail or panic.
#![no_main]

#[path = "../common/input.rs"]
mod input;

use input::{Input, memfd};
use libfuzzer_sys::fuzz_target;
use tensorwire::Segment;
use std::sync::Arc;
use tensorwire::cuda::CudaWait;
use tensorwire::cuda::order::PeerWatch;
use tensorwire::cuda::order::remote_events::RemoteEvents;
use tensorwire::cuda::ring::{MAX_SLOTS, MIN_SLOT_BYTES, RingSetup};

/// Bytes of a setup before the per-slot handles: device, slots, slot bytes, descriptor
/// ring bytes, arena handle.
const SETUP_FIXED: usize = 4 + 4 + 8 + 8 + 64;

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else { return };
    if sel & 1 == 0 {
        ring_setup(rest);
        // With the slot count made to match the length, decoding gets past the shape
        // check to the configuration checks.
        if rest.len() >= SETUP_FIXED {
            let mut p = rest.to_vec();
            let slots = ((p.len() - SETUP_FIXED) / 64) as u32;
            p.truncate(SETUP_FIXED + 64 * slots as usize);
            p[4..8].copy_from_slice(&slots.to_le_bytes());
            ring_setup(&p);
        }
    } else {
        events(&mut Input::new(rest), sel);
    }
});

fn ring_setup(p: &[u8]) {
    match RingSetup::decode(p) {
        Ok(s) => {
            s.cfg.check().expect("a decoded setup has a valid configuration");
            assert!(s.cfg.slots >= 1 && s.cfg.slots <= MAX_SLOTS);
            assert!(s.cfg.slot_bytes >= MIN_SLOT_BYTES);
            assert_eq!(s.written.len(), s.cfg.slots as usize, "one handle per slot");
            assert_eq!(s.encode(), p, "decode -> encode gives the bytes back");
            let again = RingSetup::decode(&s.encode()).expect("our own encoding decodes");
            assert_eq!(again.encode(), p);
        }
        Err(e) => {
            let m = e.to_string();
            assert!(m.contains("GPU ring setup"), "error names what was wrong: {m}");
        }
    }
}

fn events(inp: &mut Input<'_>, sel: u8) {
    let n = if sel & 2 == 0 { usize::from(inp.u8() % 8) } else { usize::from(inp.u16() % 1100) };
    let ack_len = match inp.u8() % 3 {
        0 => 8 * n.max(1),
        1 => (8 * n).saturating_sub(1 + usize::from(inp.u8() % 8)).max(1),
        _ => 1 + usize::from(inp.u16()),
    };
    let handles: Vec<[u8; 64]> = (0..n).map(|i| [i as u8; 64]).collect();
    let acks = Segment::from_fd(memfd(ack_len, &[], false), 1).expect("a sealed memfd maps");
    let device = inp.u32() as i32;
    let good = (1..=1024).contains(&n) && acks.len() >= 8 * n;
    let me = Arc::new(PeerWatch::new(std::process::id() as i32));
    let wait = tensorwire::Wait::For(std::time::Duration::from_secs(1));
    match RemoteEvents::open(device, &handles, acks, CudaWait::Stream, wait, me) {
        Ok(ev) => {
            assert!(good, "accepted {n} events with a {ack_len}-byte ack table");
            // No driver in the fuzzer: usable() explains, nothing panics.
            if let Err(why) = ev.usable() {
                assert!(!why.to_string().is_empty());
            }
        }
        Err(e) => assert!(!good, "refused {n} events with a {ack_len}-byte ack table: {e}"),
    }
}
