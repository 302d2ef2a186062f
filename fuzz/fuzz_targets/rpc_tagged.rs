//! The RPC tagged-value decoder (rpc/src/tagged.rs): pyisolate's bytes, exception, enum,
//! remote-object, callable, object and tensor tags.
//!
//! Values come two ways: the fuzzer's bytes parsed as JSON, and a tagged dict built from
//! a template the first byte picks with every field value fuzzed (so the tag checks are
//! reached without the fuzzer having to spell `"__pyisolate_bytes__"`). Checked:
//! `classify` never panics; what it recognizes, the matching builder rebuilds into a
//! value that classifies back to the same thing (bytes survive base64 both ways);
//! `as_bytes`/`as_callback_id` agree with `classify`; `check_tree` fails exactly when
//! some value inside fails `classify`, and otherwise counts the tagged values in it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tensorwire_rpc::json::{self, Value};
use tensorwire_rpc::{base64, tagged, tagged::Tagged};

const TAGS: [&str; 8] = [
    tagged::BYTES_TAG,
    tagged::EXCEPTION_TAG,
    tagged::ENUM_TAG,
    tagged::CALLABLE_TAG,
    tagged::OBJECT_TAG,
    "__type__",
    "__type__",
    "__type__",
];
const TYPES: [&str; 3] = ["RemoteObjectHandle", "TensorRef", "TensorValue"];
const FIELDS: [&str; 10] =
    ["data", "type", "module", "message", "name", "value", "object_id", "type_name", "callback_id", "args"];

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else { return };
    if let Ok(v) = json::parse(rest, 64) {
        check(&v);
    }
    // A template: one tag (its value fuzzed, or the type name for `__type__`), then
    // fields from the list, each a value parsed from a piece of the input or a string.
    let tag = TAGS[usize::from(sel) % TAGS.len()];
    let mut m = json::Map::new();
    let mut pieces = rest.split(|&b| b == 0);
    let tag_value = if tag == "__type__" {
        Value::from(TYPES[usize::from(sel >> 3) % TYPES.len()])
    } else {
        piece_value(pieces.next().unwrap_or(b"true"))
    };
    m.insert(tag.to_owned(), tag_value);
    for (i, p) in pieces.enumerate().take(FIELDS.len()) {
        let field = FIELDS[(usize::from(sel >> 5) + i * 3) % FIELDS.len()];
        m.insert(field.to_owned(), piece_value(p));
    }
    let v = Value::Object(m);
    check(&v);
    check(&Value::Array(vec![Value::Null, v.clone(), Value::object([("k", v)])]));
});

/// A piece of the input as a value: JSON if it parses, else the text as a string.
fn piece_value(p: &[u8]) -> Value {
    json::parse(p, 16).unwrap_or_else(|_| Value::Str(String::from_utf8_lossy(p).into_owned()))
}

fn check(v: &Value) {
    let c = tagged::classify(v);
    match &c {
        Ok(Some(t)) => {
            assert!(matches!(v, Value::Object(_)), "only dicts are tagged");
            rebuilds(t);
        }
        Ok(None) => {}
        Err(e) => assert!(!e.to_string().is_empty()),
    }
    match tagged::as_bytes(v) {
        Ok(b) => assert!(matches!(&c, Ok(Some(Tagged::Bytes(x))) if *x == b)),
        Err(_) => assert!(!matches!(&c, Ok(Some(Tagged::Bytes(_))))),
    }
    match tagged::as_callback_id(v) {
        Ok(id) => assert!(matches!(&c, Ok(Some(Tagged::Callable { callback_id: Some(x), .. })) if *x == id)),
        Err(_) => assert!(!matches!(&c, Ok(Some(Tagged::Callable { callback_id: Some(_), .. })))),
    }
    // check_tree against a walk of our own.
    let (mut tagged_n, mut bad) = (0usize, false);
    let mut stack = vec![v];
    while let Some(x) = stack.pop() {
        match tagged::classify(x) {
            Ok(Some(_)) => tagged_n += 1,
            Ok(None) => {}
            Err(_) => bad = true,
        }
        match x {
            Value::Array(a) => stack.extend(a),
            Value::Object(m) => stack.extend(m.values()),
            _ => {}
        }
    }
    match tagged::check_tree(v) {
        Ok(n) => {
            assert!(!bad, "check_tree passed a tree with a bad tag");
            assert_eq!(n, tagged_n, "check_tree's count");
        }
        Err(_) => assert!(bad, "check_tree failed a tree whose tags all classify"),
    }
}

/// The builder for what `classify` found gives a value that classifies the same.
fn rebuilds(t: &Tagged<'_>) {
    let again = match t {
        Tagged::Bytes(b) => {
            assert_eq!(base64::decode(&base64::encode(b)).expect("our base64 decodes"), *b);
            tagged::bytes(b)
        }
        Tagged::Exception { type_name, module, message } => tagged::exception(type_name, module, message),
        // NaN != NaN: a value holding one cannot compare equal to itself.
        Tagged::Enum { value, .. } if value.to_json().map_or(true, |t| t.contains("NaN")) => return,
        Tagged::Enum { type_name, module, name, value } => {
            tagged::enum_member(type_name, module, name, (*value).clone())
        }
        Tagged::RemoteObject { object_id, type_name } => tagged::remote_handle(object_id, type_name),
        Tagged::Callable { callback_id: Some(id), name } => tagged::callable(id, name),
        _ => return,
    };
    let back = tagged::classify(&again).expect("a built tag classifies");
    assert_eq!(back.as_ref(), Some(t), "builder and classify disagree");
    // And through the wire: written, parsed back, still the same tag.
    let text = again.to_json().expect("a built tag serializes");
    let parsed = json::parse(text.as_bytes(), 64).expect("our output parses");
    assert_eq!(tagged::classify(&parsed).expect("reparsed tag classifies").as_ref(), Some(t));
}
