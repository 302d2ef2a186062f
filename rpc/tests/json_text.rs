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
