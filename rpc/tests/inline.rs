//! Small tensors inside the frame (`Tensor::Packed`, `TensorwireInline`): sent so to a
//! peer that said at native negotiation that it reads them, as segments otherwise; what
//! arrives inline is checked (dtype, shape against the bytes, the copy limit).

use std::time::{Duration, Instant};
use tensorwire_rpc::*;

fn packed(n: usize) -> Tensor {
    let p = PackedTensor::new(tensorwire::DType::Float32, &[n as i64], |out| {
        for (i, b) in out.iter_mut().enumerate() {
            *b = (i * 7 + 3) as u8;
        }
        Ok(())
    })
    .unwrap();
    Tensor::Packed(std::sync::Arc::new(p))
}

fn server() -> Registry {
    let reg = Registry::new();
    reg.register(
        "s",
        Service::new("S")
            .method("kind", |_, a| Ok(format!("{:?}", a.req(0, "t")?.as_tensor().map(|t| format!("{t:?}"))).into()))
            .method("echo", |_, mut a| Ok(a.args.swap_remove(0)))
            .method("raw", |_, mut a| Ok(a.args.swap_remove(0))),
    )
    .unwrap();
    reg
}

fn native_pair(cfg: RpcConfig) -> (Endpoint, Endpoint) {
    let (a, b) = Endpoint::pair(Registry::new(), server(), cfg).unwrap();
    assert!(a.negotiate_native(Duration::from_secs(10)).unwrap());
    let by = Instant::now() + Duration::from_secs(10);
    while !b.native_enabled() {
        assert!(Instant::now() < by, "the responder never set up native tensors");
        std::thread::sleep(Duration::from_millis(5));
    }
    (a, b)
}

#[test]
fn a_packed_tensor_travels_inline_both_ways_and_arrives_packed() {
    let (a, _b) = native_pair(RpcConfig::default());
    let t = packed(1024);
    let kind = a.call("s", "kind", vec![Value::from(t.clone())]).unwrap();
    assert!(kind.as_str().unwrap().contains("Packed"), "{kind:?}");
    let back = a.call("s", "echo", vec![Value::from(t.clone())]).unwrap();
    let back = back.as_tensor().unwrap();
    assert!(matches!(back, Tensor::Packed(_)), "{back:?}");
    assert_eq!(back.to_vec().unwrap(), t.to_vec().unwrap());
    assert_eq!(back.layout(), t.layout());
}

#[test]
fn without_native_tensors_a_packed_tensor_goes_as_before() {
    // No negotiation on this connection: the file_system path, which the receiver here
    // refuses (not a trusted pyisolate peer) — so the inline form was not used.
    let (a, _b) = Endpoint::pair(Registry::new(), server(), RpcConfig::default()).unwrap();
    let e = a.call("s", "kind", vec![Value::from(packed(16))]).unwrap_err().to_string();
    assert!(e.contains("file-system tensor"), "{e}");
}

#[test]
fn bad_inline_tensors_are_refused_with_what_was_wrong() {
    let (a, _b) = native_pair(RpcConfig { max_tensor_copy: 1 << 12, ..RpcConfig::default() });
    let inline = |dtype: &str, size: Vec<Value>, data: &str| {
        Value::object([
            ("__type__", Value::from("TensorwireInline")),
            ("dtype", dtype.into()),
            ("tensor_size", Value::Array(size)),
            ("data", data.into()),
        ])
    };
    for (v, says) in [
        (inline("torch.float32", vec![2.into()], "AAAA"), "does not hold 8 bytes"),
        (inline("torch.uint8", vec![3.into()], "AA*A"), "invalid base64 character"),
        (inline("torch.nope", vec![1.into()], "AAAAAA=="), "dtype"),
        (inline("torch.uint8", vec![(-1).into()], ""), "TensorwireInline"),
        (inline("torch.uint8", vec![(1 << 13).into()], ""), "max_tensor_copy"),
        (Value::object([("__type__", Value::from("TensorwireInline")), ("dtype", "torch.uint8".into()), ("tensor_size", Value::Array(vec![]))]), "no base64"),
    ] {
        let e = a.call("s", "raw", vec![v]).unwrap_err().to_string();
        assert!(e.contains(says), "{e:?} lacks {says:?}");
    }
    // The connection still works.
    let back = a.call("s", "echo", vec![Value::from(packed(4))]).unwrap();
    assert_eq!(back.as_tensor().unwrap().to_vec().unwrap(), packed(4).to_vec().unwrap());
}
