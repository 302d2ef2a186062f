//! Differential: the RPC JSON codec (rpc/src/json.rs) against serde_json, on the inputs
//! both accept.
//!
//! The RPC parser accepts more than serde_json (Python's `NaN`/`Infinity`, integers
//! beyond 64 bits, lone surrogates as U+FFFD, deeper nesting), so only inputs both parse
//! are compared. On those: the same value — same types (an integer stays an integer, a
//! float a float, bit for bit), same strings, same keys in the same order (insertion
//! order, as Python's `json.loads`: serde_json's `preserve_order`; a duplicate's last
//! value wins, in its first place, in both); except that an integer outside 64 bits is
//! a `BigInt` here and an f64 there (then the f64 must be the digits' nearest float),
//! and `-0` is the integer 0 here (as in Python) and the float -0.0 there. And the same re-encoding: each codec reads
//! what the other writes back to the same value, and our writer is stable
//! (write → parse → write gives the same text).
#![no_main]

use libfuzzer_sys::fuzz_target;
use serde_json::Value as J;
use tensorwire_rpc::json::{self, Value};

fuzz_target!(|data: &[u8]| {
    let Ok(ours) = json::parse(data, 64) else { return };
    let Ok(theirs) = serde_json::from_slice::<J>(data) else { return };
    same(&ours, &theirs, "$");

    // Our writer's text, read by serde_json: the same value again.
    let text = ours.to_json().expect("a parsed value serializes");
    let theirs2: J = serde_json::from_str(&text).unwrap_or_else(|e| panic!("serde_json cannot read our output {text:?}: {e}"));
    same(&ours, &theirs2, "$ (our text, their parser)");
    // serde_json's text, read by us: the same value again.
    let their_text = serde_json::to_string(&theirs).expect("serde_json writes its own value");
    let ours2 = json::parse(their_text.as_bytes(), 64).unwrap_or_else(|e| panic!("we cannot read serde_json's output {their_text:?}: {e}"));
    same(&ours2, &theirs, "$ (their text, our parser)");
    // Stable: what we write, we read back and write identically.
    let again = json::parse(text.as_bytes(), 64).expect("our output parses").to_json().unwrap();
    assert_eq!(text, again, "write -> parse -> write changed the text");
});

/// Strict equality: same types, floats bit for bit.
fn same(a: &Value, b: &J, at: &str) {
    match (a, b) {
        (Value::Null, J::Null) => {}
        (Value::Bool(x), J::Bool(y)) => assert_eq!(x, y, "{at}"),
        // `-0`: Python (and we) read the integer 0; serde_json reads the float -0.0.
        (Value::Int(0), J::Number(n)) if n.as_f64().is_some_and(|f| f == 0.0 && f.is_sign_negative()) && n.is_f64() => {}
        (Value::Int(x), J::Number(n)) => {
            assert_eq!(Some(*x), n.as_i64(), "{at}: integer {x} vs {n}");
        }
        (Value::BigInt(s), J::Number(n)) => {
            if let Some(u) = n.as_u64() {
                // 2^63 ..= 2^64-1: a u64 there.
                assert_eq!(s.parse::<u64>().ok(), Some(u), "{at}: big integer {s} vs {n}");
            } else {
                // Beyond 64 bits serde_json makes it a float: the digits' nearest.
                let f = n.as_f64().expect("a non-integer number is a float");
                assert!(n.is_f64(), "{at}: {s} vs {n}");
                assert_eq!(s.parse::<f64>().ok().map(f64::to_bits), Some(f.to_bits()), "{at}: big integer {s} vs float {f}");
            }
        }
        (Value::Float(x), J::Number(n)) => {
            assert!(n.is_f64(), "{at}: float {x} vs integer {n}");
            assert_eq!(x.to_bits(), n.as_f64().unwrap().to_bits(), "{at}: float {x:?} vs {n}");
        }
        (Value::Str(x), J::String(y)) => assert_eq!(x, y, "{at}"),
        (Value::Array(x), J::Array(y)) => {
            assert_eq!(x.len(), y.len(), "{at}: array lengths");
            for (i, (p, q)) in x.iter().zip(y).enumerate() {
                same(p, q, &format!("{at}[{i}]"));
            }
        }
        (Value::Object(x), J::Object(y)) => {
            assert_eq!(x.len(), y.len(), "{at}: key counts");
            for ((k, p), (l, q)) in x.iter().zip(y) {
                assert_eq!(k, l, "{at}: keys");
                same(p, q, &format!("{at}.{k}"));
            }
        }
        _ => panic!("{at}: {a:?} vs {b:?}"),
    }
}
