//! tensorwire-rpc value decoder: Python-compatible JSON parse, tagged-form validation
//! (bytes/base64, exceptions, enums, handles, callables, TensorRef geometry), and
//! write-then-reparse stability, and the value-count budget (a limited parse that
//! succeeds gives the same value). Never panics.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tensorwire_rpc::json::{self, Value};
use tensorwire_rpc::{tagged, tensor};

fuzz_target!(|data: &[u8]| {
    let Ok(v) = json::parse(data, 64) else { return };
    // A value-count budget only ever refuses: where it accepts, the value is the same.
    if let Ok(small) = json::parse_limited(data, json::Limits { max_depth: 64, max_values: 64 }) {
        assert_eq!(small.to_json().ok(), v.to_json().ok(), "a limited parse gives the same value");
    }
    let _ = tagged::check_tree(&v);
    if let Value::Object(m) = &v {
        let _ = tensor::layout_from_ref(m);
    }
    let _ = tensorwire_rpc::message::Message::from_value(v.clone());
    // What we write, Python (and we) read back to an equal value (NaN aside).
    let text = v.to_json().expect("a parsed value always serializes");
    let again = json::parse(text.as_bytes(), 64).expect("our own output parses");
    let text2 = again.to_json().unwrap();
    assert_eq!(text, text2, "serialization is stable");
});
