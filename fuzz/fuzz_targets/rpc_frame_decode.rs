//! tensorwire-rpc frame decoder + message decoder on arbitrary bytes, fed in arbitrary
//! chunks: never panics, never buffers more than it was given, never returns a frame over
//! the cap.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tensorwire_rpc::frame::FrameDecoder;
use tensorwire_rpc::message::Message;

const CAP: usize = 4096;

fuzz_target!(|data: &[u8]| {
    if data.is_empty() {
        return;
    }
    let step = (data[0] as usize % 61) + 1;
    let mut d = FrameDecoder::new(CAP);
    let mut fed = 0usize;
    for chunk in data[1..].chunks(step) {
        if d.push(chunk).is_err() {
            return; // out of memory: the endpoint closes this peer
        }
        fed += chunk.len();
        loop {
            match d.next_frame() {
                Ok(Some(f)) => {
                    assert!(f.len() <= CAP);
                    let _ = Message::decode(f, 64);
                }
                Ok(None) => break,
                Err(_) => return, // poisoned for this peer; the endpoint closes
            }
        }
        assert!(d.buffered() <= fed);
    }
});
