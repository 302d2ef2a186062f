//! Small owned tensors inside the frame (`TensorwireInline`), with the server in a child
//! process (see `support`): negotiated in `native_hello` and only there; between two
//! tensorwire endpoints an owned tensor within the limit comes back owned (it travelled
//! inline: no export), a larger one as an import (an export); a peer that offered nothing
//! (an older tensorwire, `inline_tensors: 0`) and a peer that never negotiated (pyisolate's
//! wire) never see the form; a forged or inconsistent inline tensor is a named error and
//! the connection goes on.

mod support;
#[path = "support/packed.rs"]
mod packed;

use packed::{bytes, echo_one, every_dtype_echoes_owned, kinds_in_one_message, negotiated_client, packed, raw_hello, unnegotiated_server};
use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;
use support::{Victim, VictimSpec, call_frame, frame, read_frame, run_victim, victim_role};
use tensorwire::DType;
use tensorwire_rpc::config::DEFAULT_INLINE_TENSORS;
use tensorwire_rpc::tensor::pool;
use tensorwire_rpc::{Endpoint, Registry, RpcConfig, Tensor, Wait};

/// A client that offers no attached tensors (`attached_tensors.rs` tests those), so that
/// its owned tensors go inline.
fn client(v: &Victim, cfg: RpcConfig) -> Endpoint {
    negotiated_client(v, RpcConfig { attached_tensors: 0, ..cfg })
}

#[test]
fn owned_tensors_of_every_dtype_go_inline_and_large_ones_as_exports() {
    if victim_role().is_some() {
        run_victim(|_| {});
    }
    let v = Victim::spawn("owned_tensors_of_every_dtype_go_inline_and_large_ones_as_exports", &VictimSpec::default());
    let ep = client(&v, RpcConfig::default());
    every_dtype_echoes_owned(&ep, "inline");
    // At the limit: inline; one byte past it: an export, which comes back as an import.
    let at = Tensor::owned(DType::UInt8, &[DEFAULT_INLINE_TENSORS as i64], &bytes(DEFAULT_INLINE_TENSORS, 1)).unwrap();
    let back = echo_one(&ep, at.clone());
    assert!(matches!(back, Tensor::Owned(_)), "{back:?}");
    assert_eq!(packed(&back), packed(&at));
    let over = Tensor::owned(DType::UInt8, &[DEFAULT_INLINE_TENSORS as i64 + 1], &bytes(DEFAULT_INLINE_TENSORS + 1, 2)).unwrap();
    let back = echo_one(&ep, over.clone());
    assert!(matches!(back, Tensor::Imported(_)), "{back:?}");
    assert_eq!(packed(&back), packed(&over));
    // A tensor in a segment keeps its path whatever its size.
    let shared = Tensor::from_f32(&[2], &[1.0, 2.0]).unwrap();
    assert!(matches!(echo_one(&ep, shared), Tensor::Imported(_)));
}

#[test]
fn a_peer_that_offers_no_inline_tensors_gets_exports() {
    if victim_role().is_some() {
        run_victim(|_| {});
    }
    let v = Victim::spawn("a_peer_that_offers_no_inline_tensors_gets_exports", &VictimSpec::default());
    // An older tensorwire peer: a hello without the offer.
    let ep = client(&v, RpcConfig { inline_tensors: 0, ..RpcConfig::default() });
    let t = Tensor::owned(DType::Float32, &[4], &bytes(16, 3)).unwrap();
    let back = echo_one(&ep, t.clone());
    assert!(matches!(back, Tensor::Imported(_)), "{back:?}");
    assert_eq!(packed(&back), packed(&t));
    // On the wire: the old answer to a hello without the offer, the new one to a hello
    // with it.
    for (kwargs, want) in [("{}", r#""result": true"#), (r#"{"inline_tensors": 1024}"#, r#""result": {"native": true, "inline_tensors": "#)] {
        let (_raw, resp, _peer) = raw_hello(&v, kwargs);
        assert!(resp.contains(want), "hello with kwargs {kwargs}: {resp}");
    }
}

/// A peer that takes no attachments gets an owned tensor past the inline limit (the
/// binding's ordinary tensors up to 16 KiB) in a recycled segment of the process's pool,
/// not a fresh segment per call, and its bytes arrive as they were.
#[test]
fn owned_tensors_past_the_inline_limit_go_in_recycled_segments() {
    if victim_role().is_some() {
        run_victim(|_| {});
    }
    let v = Victim::spawn("owned_tensors_past_the_inline_limit_go_in_recycled_segments", &VictimSpec::default());
    let ep = client(&v, RpcConfig::default());
    let sizes = [DEFAULT_INLINE_TENSORS + 1, 6000, 16 << 10];
    let rounds = 40;
    let before = pool::stats();
    for round in 0..rounds {
        for (k, n) in sizes.into_iter().enumerate() {
            let t = Tensor::owned(DType::UInt8, &[n as i64], &bytes(n, (round * 3 + k) as u8)).unwrap();
            let back = echo_one(&ep, t.clone());
            assert!(matches!(back, Tensor::Imported(_)), "{n} bytes came back as {back:?}, not an export");
            assert_eq!(packed(&back), packed(&t), "{n} bytes, round {round}");
        }
    }
    let after = pool::stats();
    let calls = (rounds * sizes.len()) as u64;
    // Each class may fill while releases are in flight; every other call reuses a segment.
    // (Other tests of this binary share the counters, and only add to them.)
    let fresh_bound = (sizes.len() * pool::MAX_PER_CLASS) as u64;
    assert!(
        after.reused - before.reused >= calls - fresh_bound,
        "{calls} calls reused only {} pooled segments (before {before:?}, after {after:?})",
        after.reused - before.reused
    );
}

/// A raw peer (pyisolate's wire: no `native_hello`) calls a service that answers an owned
/// tensor: it gets pyisolate's `TensorRef`, and an inline tensor it sends is refused.
#[test]
fn a_peer_that_never_negotiated_gets_the_old_form() {
    let (ep, mut raw) = unnegotiated_server();
    let call = |raw: &mut UnixStream, id: i64, method: &str, args: &str| {
        raw.write_all(&call_frame(id, method, args)).unwrap();
        String::from_utf8(read_frame(raw).unwrap()).unwrap()
    };
    let resp = call(&mut raw, 1, "make", "[]");
    assert!(resp.contains(r#""__type__": "TensorRef""#) && !resp.contains("TensorwireInline"), "{resp}");
    let forged = r#"[{"__type__": "TensorwireInline", "dtype": "torch.uint8", "tensor_size": [3], "data": "AAEC"}]"#;
    let resp = call(&mut raw, 2, "echo", forged);
    assert!(resp.contains("never negotiated inline tensors"), "{resp}");
    drop(ep);
}

/// A peer that negotiated inline tensors and then sends forged ones: each a named refusal
/// in the call's error, and the server answers the next call.
#[test]
fn forged_inline_tensors_are_named_errors() {
    if victim_role().is_some() {
        run_victim(|_| {});
    }
    let v = Victim::spawn("forged_inline_tensors_are_named_errors", &VictimSpec::default());
    let (mut raw, resp, peer) = raw_hello(&v, r#"{"inline_tensors": 65536}"#);
    assert!(resp.contains(r#""native": true"#) && peer.is_some(), "{resp}");
    let inline = |dtype: &str, sizes: &str, data: &str| {
        format!(r#"{{"__type__": "TensorwireInline", "dtype": "{dtype}", "tensor_size": {sizes}, "data": {data}}}"#)
    };
    let cases = [
        (inline("torch.uint8", "[4]", r#""AAEC""#), "4 bytes its dtype and sizes name"),
        (inline("torch.uint8", "[2]", r#""AAEC""#), "2 bytes its dtype and sizes name"),
        (inline("torch.float33", "[1]", r#""AAAAAA==""#), "unknown dtype"),
        (inline("torch.float32", "[1048576, 1048576]", r#""""#), "over this connection's inline limit"),
        (inline("torch.float32", "[4611686018427387904, 4]", r#""""#), "overflows a byte count"),
        (inline("torch.float32", "[-1]", r#""""#), "negative size -1"),
        (inline("torch.float32", "[1.5]", r#""""#), "a float among the sizes"),
        (inline("torch.uint8", "[3]", r#""AA*C""#), "bad base64 data"),
        (inline("torch.uint8", "[3]", "12"), "no base64 string"),
    ];
    for (i, (value, want)) in cases.iter().enumerate() {
        raw.write_all(&call_frame(i as i64 + 10, "echo", &format!("[{value}]"))).unwrap();
        let resp = String::from_utf8(read_frame(&mut raw).unwrap()).unwrap();
        assert!(resp.contains("inline tensor refused") && resp.contains(want), "{value}: {resp}");
    }
    raw.write_all(&call_frame(99, "ping", "[]")).unwrap();
    let resp = String::from_utf8(read_frame(&mut raw).unwrap()).unwrap();
    assert!(resp.contains("pong"), "{resp}");
    // A well-formed one comes back inline, bit-exact.
    raw.write_all(&call_frame(100, "echo", &format!("[{}]", inline("torch.uint8", "[3]", r#""AAEC""#)))).unwrap();
    let resp = String::from_utf8(read_frame(&mut raw).unwrap()).unwrap();
    assert!(resp.contains(r#""data": "AAEC""#), "{resp}");
}

/// Inline tensors take at most half a frame of one message: past that, the rest of its
/// tensors go as exports, so many small tensors never push a value over the frame cap.
#[test]
fn inline_tensors_take_at_most_half_a_frame_of_a_message() {
    let cfg = RpcConfig { max_frame: 64 << 10, inline_tensors: 64 << 10, attached_tensors: 0, ..RpcConfig::default() };
    // 4 KiB each: 5,464 characters of base64; five fit in 32 KiB, the sixth would not.
    let want: Vec<&str> = (0..20).map(|i| if i < 5 { "owned" } else { "export" }).collect();
    assert_eq!(kinds_in_one_message(cfg, 20), want);
}

/// The number after `"call_id": ` in a frame's JSON.
fn call_id_of(text: &str) -> i64 {
    let at = text.find(r#""call_id": "#).expect("a call id") + r#""call_id": "#.len();
    text[at..].chars().take_while(char::is_ascii_digit).collect::<String>().parse().unwrap()
}

/// A peer that has answered our offer may send an inline tensor at once: our reader can
/// read that frame before the thread that negotiates has read the answer (here the two
/// frames arrive in one write), and takes it all the same — we accept inline tensors from
/// the moment we offer them, not from the moment we read the answer.
#[test]
fn an_inline_tensor_sent_right_after_the_answer_is_taken() {
    let data = bytes(64, 9);
    let b64 = {
        let Tensor::Owned(o) = Tensor::owned(DType::UInt8, &[64], &data).unwrap() else { unreachable!() };
        tensorwire_rpc::tensor::inline_value(&o).to_json().unwrap()
    };
    for round in 0..20 {
        let (ours, mut raw) = UnixStream::pair().unwrap();
        raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let cfg = RpcConfig { default_timeout: Wait::For(Duration::from_secs(10)), attached_tensors: 0, ..RpcConfig::default() };
        let ep = Endpoint::from_fd(ours.into(), Registry::new(), cfg).unwrap();
        // A call in flight before the negotiation: its answer will hold the inline tensor.
        let pending = ep.start_call("calc", "get", vec![], Default::default(), Default::default()).unwrap();
        let call_id = call_id_of(&String::from_utf8(read_frame(&mut raw).unwrap()).unwrap());
        std::thread::scope(|s| {
            let negotiation = s.spawn(|| ep.negotiate_native(Duration::from_secs(10)));
            // The hello, with the transport socket it carries.
            let mut buf = vec![0u8; 64 << 10];
            let got = tensorwire::os::recv_msg(raw.as_fd(), &mut buf).unwrap().expect("the hello");
            let hello = String::from_utf8_lossy(&buf[4..got.len]).into_owned();
            assert!(hello.contains("native_hello") && hello.contains("inline_tensors"), "{hello}");
            let theirs = got.fds.into_iter().next().expect("the hello's socket");
            // The answer and the inline tensor in one write.
            let answer = format!(
                r#"{{"kind": "response", "call_id": {}, "result": {{"native": true, "inline_tensors": {DEFAULT_INLINE_TENSORS}}}, "error": null}}"#,
                call_id_of(&hello)
            );
            let reply = format!(r#"{{"kind": "response", "call_id": {call_id}, "result": {b64}, "error": null}}"#);
            let mut both = frame(answer.as_bytes());
            both.extend_from_slice(&frame(reply.as_bytes()));
            raw.write_all(&both).unwrap();
            let pcfg = tensorwire::PeerConfig { handshake_timeout: Duration::from_secs(5).into(), ..Default::default() };
            let _peer = tensorwire::Peer::from_fd(theirs, pcfg).unwrap();
            assert!(negotiation.join().unwrap().unwrap(), "round {round}: the negotiation failed");
        });
        let got = pending.wait().unwrap_or_else(|e| panic!("round {round}: the inline tensor was refused: {e}"));
        let t = got.as_tensor().unwrap_or_else(|| panic!("round {round}: {got:?}"));
        assert_eq!(packed(t), data, "round {round}");
    }
}
