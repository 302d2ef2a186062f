//! Small owned tensors as binary attachments of their frame (`TensorwireAttached`), with
//! the server in a child process (see `support`): negotiated in `native_hello` and only
//! there; between two tensorwire endpoints an owned tensor within the limit comes back
//! owned (it travelled in the frame: no export), a larger one as an import; a peer that
//! offered none and a peer that never negotiated (pyisolate's wire) never receive a frame
//! with attachments; a forged attachment is a named error — of the call where the frame
//! can still be read, of the connection where its table cannot.

mod support;
#[path = "support/packed.rs"]
mod packed;

use packed::{bytes, echo_one, every_dtype_echoes_owned, kinds_in_one_message, negotiated_client, packed, raw_hello, unnegotiated_server};
use std::io::Write;
use support::{Victim, VictimSpec, call_text, frame, read_frame, run_victim, victim_role};
use tensorwire::DType;
use tensorwire_rpc::config::DEFAULT_ATTACHED_TENSORS;
use tensorwire_rpc::tensor::ATTACHED_FRAME_MARK;
use tensorwire_rpc::{Endpoint, RpcConfig, Tensor, Value};

/// A client that offers attachments and no inline tensors, so that an owned tensor that
/// comes back owned travelled as an attachment.
fn client(v: &Victim, cfg: RpcConfig) -> Endpoint {
    negotiated_client(v, RpcConfig { inline_tensors: 0, ..cfg })
}

/// A frame payload: `json`, then `atts` and the trailer that says where they are.
fn attached(json: &str, atts: &[&[u8]]) -> Vec<u8> {
    let mut f = json.as_bytes().to_vec();
    for a in atts {
        f.extend_from_slice(a);
    }
    for a in atts {
        f.extend_from_slice(&(a.len() as u32).to_be_bytes());
    }
    f.extend_from_slice(&(atts.len() as u32).to_be_bytes());
    f.extend_from_slice(&(json.len() as u32).to_be_bytes());
    f.push(ATTACHED_FRAME_MARK);
    f
}

/// The JSON text and attachments of a received payload (`None` for JSON alone).
fn split(payload: &[u8]) -> Option<(String, Vec<Vec<u8>>)> {
    if payload.last() != Some(&ATTACHED_FRAME_MARK) {
        return None;
    }
    let word = |at: usize| u32::from_be_bytes(payload[at..at + 4].try_into().unwrap()) as usize;
    let n = payload.len();
    let (json_len, count) = (word(n - 5), word(n - 9));
    let table = n - 9 - 4 * count;
    let mut at = json_len;
    let atts = (0..count)
        .map(|i| {
            let len = word(table + 4 * i);
            at += len;
            payload[at - len..at].to_vec()
        })
        .collect();
    Some((String::from_utf8(payload[..json_len].to_vec()).unwrap(), atts))
}

#[test]
fn owned_tensors_of_every_dtype_go_attached_and_large_ones_as_exports() {
    if victim_role().is_some() {
        run_victim(|_| {});
    }
    let v = Victim::spawn("owned_tensors_of_every_dtype_go_attached_and_large_ones_as_exports", &VictimSpec::default());
    let ep = client(&v, RpcConfig::default());
    every_dtype_echoes_owned(&ep, "attached");
    // Several in one value, each its own attachment, in order.
    let many: Vec<Value> = (0..5).map(|i| Value::from(Tensor::owned(DType::UInt8, &[100 + i], &bytes(100 + i as usize, i as u8)).unwrap())).collect();
    let r = ep.call("calc", "echo", many.clone()).unwrap();
    for (got, want) in r.as_array().unwrap().iter().zip(&many) {
        assert_eq!(packed(got.as_tensor().unwrap()), packed(want.as_tensor().unwrap()));
    }
    // At the limit: attached; one byte past it: an export, which comes back as an import.
    let at = Tensor::owned(DType::UInt8, &[DEFAULT_ATTACHED_TENSORS as i64], &bytes(DEFAULT_ATTACHED_TENSORS, 1)).unwrap();
    let back = echo_one(&ep, at.clone());
    assert!(matches!(back, Tensor::Owned(_)), "{back:?}");
    assert_eq!(packed(&back), packed(&at));
    let over = Tensor::owned(DType::UInt8, &[DEFAULT_ATTACHED_TENSORS as i64 + 1], &bytes(DEFAULT_ATTACHED_TENSORS + 1, 2)).unwrap();
    let back = echo_one(&ep, over.clone());
    assert!(matches!(back, Tensor::Imported(_)), "{back:?}");
    assert_eq!(packed(&back), packed(&over));
}

#[test]
fn a_peer_that_offers_no_attachments_never_gets_one() {
    if victim_role().is_some() {
        run_victim(|_| {});
    }
    let v = Victim::spawn("a_peer_that_offers_no_attachments_never_gets_one", &VictimSpec::default());
    // A tensorwire peer that offers neither form: exports, whatever the size (an empty
    // tensor too, which no limit of 0 lets through).
    let ep = client(&v, RpcConfig { attached_tensors: 0, ..RpcConfig::default() });
    for sizes in [&[4][..], &[0]] {
        let t = Tensor::owned(DType::Float32, sizes, &bytes(4 * sizes[0] as usize, 3)).unwrap();
        let back = echo_one(&ep, t.clone());
        assert!(matches!(back, Tensor::Imported(_)), "{back:?}");
        assert_eq!(packed(&back), packed(&t));
    }
    // On the wire: no offer, no field in the answer; a raw peer that offered inline
    // tensors only gets its tensor back in a frame of JSON alone, one that offered
    // attachments gets it attached.
    let inline = r#"[{"__type__": "TensorwireInline", "dtype": "torch.uint8", "tensor_size": [3], "data": "AQID"}]"#;
    let named = r#"[{"__type__": "TensorwireAttached", "dtype": "torch.uint8", "tensor_size": [3], "nbytes": 3, "attachment": 0}]"#;
    for (kwargs, answer, other, request) in [
        (r#"{"inline_tensors": 1024}"#, r#""inline_tensors": "#, "attached_tensors", frame(call_text(2, "echo", inline).as_bytes())),
        (r#"{"attached_tensors": 4096}"#, r#""attached_tensors": "#, "inline_tensors", frame(&attached(&call_text(2, "echo", named), &[&[1, 2, 3]]))),
    ] {
        let (mut raw, resp, _peer) = raw_hello(&v, kwargs);
        assert!(resp.contains(answer) && !resp.contains(other), "hello with kwargs {kwargs}: {resp}");
        raw.write_all(&request).unwrap();
        let reply = read_frame(&mut raw).unwrap();
        match split(&reply) {
            Some((json, atts)) => {
                assert_eq!(other, "inline_tensors", "attachments only where offered: {json}");
                assert_eq!(atts, vec![vec![1, 2, 3]], "the attachment is the tensor's bytes");
                assert!(json.contains(r#""attachment": 0"#), "{json}");
            }
            None => {
                let text = String::from_utf8(reply).unwrap();
                assert_eq!(other, "attached_tensors", "a frame of JSON alone where attachments were offered: {text}");
                assert!(text.contains(r#""data": "AQID""#), "{text}");
            }
        }
    }
}

/// A raw peer (pyisolate's wire: no `native_hello`) calls a service that answers an owned
/// tensor: it gets pyisolate's `TensorRef` in a frame of JSON alone; an attached tensor it
/// names is refused, and a frame with attachments ends the connection, named.
#[test]
fn a_peer_that_never_negotiated_gets_the_old_form() {
    let (ep, mut raw) = unnegotiated_server();
    raw.write_all(&frame(call_text(1, "make", "[]").as_bytes())).unwrap();
    let reply = read_frame(&mut raw).unwrap();
    assert!(split(&reply).is_none(), "JSON alone");
    let resp = String::from_utf8(reply).unwrap();
    assert!(resp.contains(r#""__type__": "TensorRef""#) && !resp.contains("TensorwireAttached"), "{resp}");
    let named = r#"[{"__type__": "TensorwireAttached", "dtype": "torch.uint8", "tensor_size": [3], "nbytes": 3, "attachment": 0}]"#;
    raw.write_all(&frame(call_text(2, "echo", named).as_bytes())).unwrap();
    let resp = String::from_utf8(read_frame(&mut raw).unwrap()).unwrap();
    assert!(resp.contains("attached tensor refused") && resp.contains("never negotiated"), "{resp}");
    raw.write_all(&frame(&attached(&call_text(3, "echo", named), &[&[1, 2, 3]]))).unwrap();
    let resp = String::from_utf8(read_frame(&mut raw).unwrap()).unwrap();
    assert!(resp.contains(r#""call_id": -1"#), "a connection notice, not an answer: {resp}");
    assert!(resp.contains("attached tensor refused") && resp.contains("never negotiated"), "{resp}");
    assert!(read_frame(&mut raw).is_err(), "the connection is closed after the notice");
    drop(ep);
}

/// A peer that negotiated attachments and then sends forged ones: each a named refusal in
/// the call's error, the connection going on; an unreadable table: a named notice, and
/// the connection ends.
#[test]
fn forged_attachments_are_named_errors() {
    if victim_role().is_some() {
        run_victim(|_| {});
    }
    let v = Victim::spawn("forged_attachments_are_named_errors", &VictimSpec::default());
    let (mut raw, resp, _peer) = raw_hello(&v, r#"{"attached_tensors": 65536}"#);
    assert!(resp.contains(r#""attached_tensors": "#), "{resp}");
    let att = |dtype: &str, sizes: &str, nbytes: &str, index: &str| {
        format!(r#"{{"__type__": "TensorwireAttached", "dtype": "{dtype}", "tensor_size": {sizes}, "nbytes": {nbytes}, "attachment": {index}}}"#)
    };
    let three: &[u8] = &[1, 2, 3];
    let cases: Vec<(String, Vec<&[u8]>, &str)> = vec![
        (format!("[{}]", att("torch.uint8", "[3]", "3", "1")), vec![three], "attachment 1 named, the frame carries 1"),
        (format!("[{}]", att("torch.uint8", "[3]", "3", "0")), vec![], "attachment 0 named, the frame carries 0"),
        (format!("[{}]", att("torch.uint8", "[4]", "4", "0")), vec![three], "the attachment's length is 3, its dtype and sizes name 4 bytes"),
        (format!("[{}]", att("torch.uint8", "[3]", "4", "0")), vec![three], "nbytes is 4, its dtype and sizes name 3 bytes"),
        (format!("[{}]", att("torch.float33", "[3]", "3", "0")), vec![three], "unknown dtype"),
        (format!("[{}]", att("torch.float32", "[1048576]", "4194304", "0")), vec![three], "over this connection's attachment limit"),
        (format!("[{}]", att("torch.float32", "[-1]", "0", "0")), vec![three], "negative size -1"),
        (format!("[{0}, {0}]", att("torch.uint8", "[3]", "3", "0")), vec![three], "attachment 0 is named by two values"),
        (format!("[{}]", att("torch.uint8", "[3]", "3", "0")), vec![three, three], "1 of the frame's 2 attachments named by no value"),
    ];
    for (i, (args, atts, want)) in cases.iter().enumerate() {
        raw.write_all(&frame(&attached(&call_text(i as i64 + 10, "echo", args), atts))).unwrap();
        let resp = String::from_utf8(read_frame(&mut raw).unwrap()).unwrap();
        assert!(resp.contains("attached tensor refused") && resp.contains(want), "{args}: {resp}");
    }
    // A well-formed one comes back attached, bit-exact, and the connection goes on.
    let ok = format!("[{}]", att("torch.uint8", "[3]", "3", "0"));
    raw.write_all(&frame(&attached(&call_text(100, "echo", &ok), &[three]))).unwrap();
    let (json, atts) = split(&read_frame(&mut raw).unwrap()).expect("the reply carries the attachment");
    assert!(json.contains(r#""attachment": 0"#) && json.contains(r#""error": null"#), "{json}");
    assert_eq!(atts, vec![three.to_vec()]);
    // Tables that do not describe their frame: the connection ends, the reason named.
    for (forge, want) in [
        (Box::new(|f: &mut Vec<u8>| *f = vec![ATTACHED_FRAME_MARK]) as Box<dyn Fn(&mut Vec<u8>)>, "shorter than a trailer"),
        (Box::new(|f: &mut Vec<u8>| f.insert(0, b' ')), "its attachment table adds up to"),
        (Box::new(|f: &mut Vec<u8>| {
            let n = f.len();
            f[n - 9..n - 5].copy_from_slice(&100_000u32.to_be_bytes());
        }), "100000 attachments, at most 65536 a frame"),
    ] {
        let (mut raw, _, _peer) = raw_hello(&v, r#"{"attached_tensors": 65536}"#);
        let mut f = attached(&call_text(5, "echo", &ok), &[three]);
        forge(&mut f);
        raw.write_all(&frame(&f)).unwrap();
        let resp = String::from_utf8(read_frame(&mut raw).unwrap()).unwrap();
        assert!(resp.contains(r#""call_id": -1"#), "a connection notice, not an answer: {resp}");
        assert!(resp.contains("attached tensor refused") && resp.contains(want), "{want}: {resp}");
        assert!(read_frame(&mut raw).is_err(), "the connection is closed after the notice");
    }
    let ping = call_text(99, "ping", "[]");
    raw.write_all(&frame(ping.as_bytes())).unwrap();
    let resp = String::from_utf8(read_frame(&mut raw).unwrap()).unwrap();
    assert!(resp.contains("pong"), "{resp}");
}

/// Attachments take at most half a frame of one message, as inline tensors do: past that,
/// the rest of its tensors go as exports.
#[test]
fn attachments_take_at_most_half_a_frame_of_a_message() {
    let cfg = RpcConfig { max_frame: 64 << 10, inline_tensors: 0, ..RpcConfig::default() };
    // 4 KiB each: eight fit in 32 KiB, the ninth would not.
    let want: Vec<&str> = (0..20).map(|i| if i < 8 { "owned" } else { "export" }).collect();
    assert_eq!(kinds_in_one_message(cfg, 20), want);
}
