//! What the tests of owned tensors packed in the frame share (`inline_tensors.rs`,
//! `attached_tensors.rs`; both also use `support/mod.rs`, the victim in a child process):
//! a client that negotiated, tensors to send and how they came back, every dtype's echo, a raw peer's
//! `native_hello`, a server that never negotiates, and how a message's tensors went.

use crate::support::{Victim, frame, read_frame};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;
use tensorwire::DType;
use tensorwire_rpc::{Endpoint, Registry, RpcConfig, Service, Stream, Tensor, Value, Wait};

/// A client of the victim with `cfg` (and a 10 s timeout) that negotiated native tensors.
pub fn negotiated_client(v: &Victim, cfg: RpcConfig) -> Endpoint {
    let cfg = RpcConfig { default_timeout: Wait::For(Duration::from_secs(10)), ..cfg };
    let ep = Endpoint::connect(&v.addr, Registry::new(), cfg).unwrap();
    assert!(ep.negotiate_native(Duration::from_secs(10)).unwrap());
    ep
}

/// Bytes that differ from element to element and call to call.
pub fn bytes(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed)).collect()
}

/// A tensor's elements, packed.
pub fn packed(t: &Tensor) -> Vec<u8> {
    t.to_vec().unwrap()
}

/// `t` sent to the victim's `echo` and back.
pub fn echo_one(ep: &Endpoint, t: Tensor) -> Tensor {
    let r = ep.call("calc", "echo", vec![Value::from(t)]).unwrap();
    r.as_array().and_then(|a| a.first()).and_then(Value::as_tensor).cloned().expect("the echo holds the tensor")
}

/// An owned tensor of every dtype in five shapes (0-d, empty, 1-d, 2-d, empty 3-d), echoed through the victim:
/// each comes back owned (`how`: "attached" or "inline", what the message says it was
/// not), with its layout and bytes.
pub fn every_dtype_echoes_owned(ep: &Endpoint, how: &str) {
    let shapes: [&[i64]; 5] = [&[], &[0], &[7], &[3, 5], &[2, 0, 4]];
    for (k, dtype) in DType::ALL.into_iter().enumerate() {
        for sizes in shapes {
            let n = sizes.iter().product::<i64>() as usize * dtype.size();
            let t = Tensor::owned(dtype, sizes, &bytes(n, k as u8)).unwrap();
            let back = echo_one(ep, t.clone());
            assert!(matches!(back, Tensor::Owned(_)), "{} {sizes:?} came back as {back:?}, not {how}", dtype.name());
            assert_eq!(back.layout(), t.layout());
            assert_eq!(packed(&back), packed(&t), "{} {sizes:?}", dtype.name());
        }
    }
}

/// A raw connection to the victim that sent `native_hello` with `kwargs`, its answer, and
/// the transport peer set up on our side when the victim agreed.
pub fn raw_hello(v: &Victim, kwargs: &str) -> (UnixStream, String, Option<tensorwire::Peer>) {
    let mut raw = v.raw();
    let (mine, theirs) = tensorwire::os::seqpacket_pair().unwrap();
    let hello = format!(
        r#"{{"kind": "call", "object_id": "__tensorwire__", "call_id": 1, "parent_call_id": null, "method": "native_hello", "args": [1], "kwargs": {kwargs}}}"#
    );
    tensorwire::os::send_msg(raw.as_fd(), &frame(hello.as_bytes()), &[theirs.as_fd()], false, None).unwrap();
    drop(theirs);
    let resp = String::from_utf8(read_frame(&mut raw).unwrap()).unwrap();
    let cfg = tensorwire::PeerConfig { handshake_timeout: Duration::from_secs(5).into(), ..Default::default() };
    let peer = resp.contains(r#""native": true"#).then(|| std::thread::spawn(move || tensorwire::Peer::from_fd(mine, cfg).unwrap()).join().unwrap());
    (raw, resp, peer)
}

/// An endpoint with the default config serving `calc` (`make`: an owned float32 tensor of
/// 2; `echo`: its arguments) to a raw peer on the other end of a socket pair, which never
/// negotiates (pyisolate's wire).
pub fn unnegotiated_server() -> (Endpoint, UnixStream) {
    let reg = Registry::new();
    reg.register(
        "calc",
        Service::new("Calc")
            .method_inline("make", |_, _| Ok(Value::from(Tensor::owned(DType::Float32, &[2], &bytes(8, 5))?)))
            .method_inline("echo", |_, a| Ok(Value::Array(a.args))),
    )
    .unwrap();
    let (mine, theirs) = UnixStream::pair().unwrap();
    let ep = Endpoint::new(Stream::from_fd(theirs.into()), reg, RpcConfig::default()).unwrap();
    mine.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    (ep, mine)
}

/// How the 4 KiB owned tensors of one message of `n` travel between two endpoints of
/// `cfg` in this process that negotiated: `"owned"` for each that came in the frame (inline
/// or attached), `"export"` for each that came as an import.
pub fn kinds_in_one_message(cfg: RpcConfig, n: u8) -> Vec<String> {
    let reg = Registry::new();
    reg.register(
        "calc",
        Service::new("Calc").method("kinds", |_, a| {
            let kinds = a.args[0].as_array().unwrap().iter().map(|v| match v.as_tensor() {
                Some(Tensor::Owned(_)) => Value::from("owned"),
                Some(Tensor::Imported(_)) => Value::from("export"),
                other => Value::from(format!("{other:?}")),
            });
            Ok(Value::Array(kinds.collect()))
        }),
    )
    .unwrap();
    let cfg = RpcConfig { default_timeout: Wait::For(Duration::from_secs(10)), ..cfg };
    let (_s, c) = Endpoint::pair(reg, Registry::new(), cfg).unwrap();
    assert!(c.negotiate_native(Duration::from_secs(10)).unwrap());
    let many: Vec<Value> = (0..n).map(|i| Value::from(Tensor::owned(DType::UInt8, &[4096], &bytes(4096, i)).unwrap())).collect();
    let r = c.call("calc", "kinds", vec![Value::Array(many)]).unwrap();
    r.as_array().unwrap().iter().map(|k| k.as_str().unwrap().to_owned()).collect()
}
