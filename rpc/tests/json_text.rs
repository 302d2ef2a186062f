//! `RpcConfig::json_text`: received values without tagged objects reach the consumers that
//! read text as `Value::Json` (a service built with `Service::json_text`,
//! `PendingCall::wait_slice`), and every other consumer as the tree, as before.

use std::time::Duration;
use tensorwire_rpc::*;

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Json(_) => "text",
        _ => "tree",
    }
}

fn services() -> Registry {
    let reg = Registry::new();
    let kinds = |_: &CallCtx, a: Args| {
        let mut out: Vec<Value> = a.args.iter().map(|v| kind(v).into()).collect();
        out.extend(a.kwargs.values().map(|v| kind(v).into()));
        Ok(Value::Array(out))
    };
    reg.register("text", Service::new("Text").json_text().method("kinds", kinds).method("echo", |_, mut a| Ok(a.args.swap_remove(0))))
        .unwrap();
    reg.register("tree", Service::new("Tree").method("kinds", kinds).method("echo", |_, mut a| Ok(a.args.swap_remove(0)))).unwrap();
    reg
}

fn pair(json_text: bool) -> (Endpoint, Endpoint) {
    let cfg = RpcConfig { json_text, ..RpcConfig::default() };
    Endpoint::pair(Registry::new(), services(), cfg).unwrap()
}

fn value() -> Value {
    Value::object([("a", Value::Array(vec![1.into(), 2.5.into(), "é".into()])), ("b", Value::Null)])
}

#[test]
fn services_that_read_text_get_text_and_the_others_the_tree() {
    let (a, _b) = pair(true);
    let tagged = Value::object([("__type__", "SomethingTagged".into()), ("x", 1.into())]);
    let mut kw = Map::new();
    kw.insert("k".into(), value());
    let got = a.call_with("text", "kinds", vec![value(), tagged.clone(), 3.into()], kw.clone(), CallOptions::default()).unwrap();
    assert_eq!(got, Value::Array(vec!["text".into(), "tree".into(), "text".into(), "text".into()]));
    let got = a.call_with("tree", "kinds", vec![value(), tagged, 3.into()], kw, CallOptions::default()).unwrap();
    assert_eq!(got, Value::Array(vec!["tree".into(); 4]));
    // Off (the default): the tree everywhere.
    let (c, _d) = pair(false);
    let got = c.call_with("text", "kinds", vec![value()], Map::new(), CallOptions::default()).unwrap();
    assert_eq!(got, Value::Array(vec!["tree".into()]));
}

#[test]
fn waits_give_the_tree_except_wait_slice() {
    let (a, _b) = pair(true);
    // A text argument echoed: written back as its text, read as the same value.
    let r = a.call_with("text", "echo", vec![value()], Map::new(), CallOptions::default()).unwrap();
    assert_eq!(kind(&r), "tree");
    assert_eq!(r, value());
    let p = a.start_call("text", "echo", vec![value()], Map::new(), CallOptions::default()).unwrap();
    let r = loop {
        if let Some(r) = p.wait_slice(Duration::from_millis(100)) {
            break r.unwrap();
        }
    };
    assert_eq!(kind(&r), "text");
    let Value::Json(j) = &r else { unreachable!() };
    assert_eq!(j.text(), r#"{"a": [1, 2.5, "é"], "b": null}"#);
    assert_eq!(r.into_tree(json::Limits::default()).unwrap(), value());
}

#[test]
fn text_written_with_tensors_encodes_them_in_place() {
    let t = Tensor::from_f32(&[2], &[1.0, 2.0]).unwrap();
    let text = JsonText::new("[1, , 2]".into(), vec![(4, t)]).unwrap();
    let mut out = Vec::new();
    json::write_value(&mut out, &Value::Json(Box::new(text)), &mut |t| Ok(Value::Int(t.layout().numel() as i64))).unwrap();
    assert_eq!(out, b"[1, 2, 2]");
    // Offsets out of order or inside a character are refused.
    let t = || Tensor::from_f32(&[1], &[1.0]).unwrap();
    assert!(JsonText::new("[, ]".into(), vec![(3, t()), (1, t())]).is_err());
    assert!(JsonText::new("\"é\"".into(), vec![(2, t())]).is_err());
    // Text with tensors has no tree form here.
    let text = JsonText::new("[]".into(), vec![(1, t())]).unwrap();
    assert!(Value::Json(Box::new(text)).into_tree(json::Limits::default()).is_err());
}

/// A received value that is not JSON ends the connection with the parser's error, as a
/// bad frame does, on an endpoint that hands values on as text too: no service, nor
/// `wait_slice`, is given text that was not checked, byte for byte.
#[test]
fn a_malformed_value_ends_the_connection() {
    use std::io::Write;
    use std::os::unix::net::UnixStream;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;

    fn closed_with(ep: &Endpoint) -> String {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !ep.is_closed() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        ep.close_reason().expect("the connection should be closed").to_string()
    }
    fn frame(payload: &str) -> Vec<u8> {
        let mut v = (payload.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(payload.as_bytes());
        v
    }
    // Each fault in a value that would otherwise stay text, last in the value (every
    // byte before it is fine); the error names the byte where the fault is.
    let faults = [
        ("[1, 2,]", "expected a value"),
        ("{\"a\": [1, {\"b\": tru}]}", "expected a value"),
        ("[1, 2.]", "expected ',' or ']'"),
        ("[1, -]", "expected digits"),
        ("[\"a\tb\"]", "control character in string"),
        ("[\"\\q\"]", "invalid escape"),
        ("{\"a\" 1}", "expected ':'"),
        ("{\"a\": 1,}", "expected a string key"),
        ("[1, 1e5, 1.5, 0.1Infinity]", "expected ',' or ']'"),
    ];
    for (bad, says) in faults {
        // A call whose argument is `bad`, to a service that reads text.
        let (a, mut raw) = UnixStream::pair().unwrap();
        let called = Arc::new(AtomicBool::new(false));
        let seen = called.clone();
        let reg = Registry::new();
        // Relaxed: read after the connection has closed, which the reader thread does
        // after any handler it ran inline.
        reg.register("text", Service::new("Text").json_text().method_inline("m", move |_, _| Ok(Value::Bool(seen.swap(true, Ordering::Relaxed)))))
            .unwrap();
        let ep = Endpoint::new(Stream::Unix(a), reg, RpcConfig { json_text: true, ..RpcConfig::default() }).unwrap();
        let call = format!("{{\"kind\": \"call\", \"object_id\": \"text\", \"call_id\": 0, \"parent_call_id\": null, \"method\": \"m\", \"args\": [{bad}], \"kwargs\": {{}}}}");
        raw.write_all(&frame(&call)).unwrap();
        let why = closed_with(&ep);
        let want = json::parse(call.as_bytes(), 64).unwrap_err().to_string();
        assert!(want.contains(says), "{bad}: the parser says {want:?}");
        assert!(why.contains(&want), "{bad}: {why:?} should say {want:?}");
        assert!(!called.load(Ordering::Relaxed), "{bad}: the service was called");

        // A response whose result is `bad`.
        let (a, mut raw) = UnixStream::pair().unwrap();
        let ep = Endpoint::new(Stream::Unix(a), Registry::new(), RpcConfig { json_text: true, ..RpcConfig::default() }).unwrap();
        let p = ep.start_call("x", "y", vec![], Map::new(), CallOptions::default()).unwrap();
        let response = format!("{{\"kind\": \"response\", \"call_id\": 0, \"result\": {bad}, \"error\": null}}");
        raw.write_all(&frame(&response)).unwrap();
        let got = loop {
            if let Some(r) = p.wait_slice(Duration::from_millis(100)) {
                break r;
            }
        };
        let want = json::parse(response.as_bytes(), 64).unwrap_err().to_string();
        assert!(got.is_err(), "{bad}: the result was handed on: {got:?}");
        assert!(closed_with(&ep).contains(&want), "{bad}: should say {want:?}");
    }
}
