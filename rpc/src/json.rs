//! JSON as Python's `json` module writes and reads it.
//!
//! serde_json refuses the bare `NaN`, `Infinity` and `-Infinity` tokens that
//! `json.dumps` emits for non-finite floats, cannot hold a NaN in its `Value`, and turns
//! integers beyond 64 bits into floats. pyisolate peers produce all of these, so the RPC
//! layer has its own small parser and writer over its own [`Value`]:
//!
//! - reads: everything `json.loads` accepts in strict mode (`NaN`/`Infinity`/`-Infinity`,
//!   `\u` escapes of four hex digits, surrogate pairs included; a lone surrogate, which
//!   Rust strings cannot hold, becomes U+FFFD), integers of any length up to Python's 4300-digit limit
//!   (beyond `i64`: [`Value::BigInt`] keeps the digits), nesting up to a depth limit
//!   (no stack overflow from `[[[[...`), UTF-8 validated up front;
//! - writes: what `json.loads` reads back to the same Python value: floats always with a
//!   `.` or exponent (so `1.0` stays a float), non-finite floats as the bare tokens, raw
//!   UTF-8 strings with control characters escaped.
//!
//! The value type itself is [`crate::value`] (re-exported here as `json::Value`/`json::Map`).

use crate::error::{Result, RpcError};
pub use crate::value::{JsonText, Map, Value};
use crate::value::TensorEncoder;
use std::io::Write as _;

/// Nesting depth accepted by default (Python's own recursion limit is about 1000).
pub const DEFAULT_MAX_DEPTH: usize = 256;
/// Python 3.11 refuses to convert integers longer than this many digits.
pub const MAX_INT_DIGITS: usize = 4300;
/// JSON values decoded from one frame by default (see `RpcConfig::max_values`).
pub const DEFAULT_MAX_VALUES: usize = 1 << 20;

pub mod lex;
mod parser;
pub use parser::{Limits, parse, parse_limited, parse_message_text};

impl Value {
    /// Parse Python-compatible JSON text (see the module docs) within the default
    /// [`Limits`].
    pub fn parse(bytes: &[u8]) -> Result<Value> {
        parse_limited(bytes, Limits::default())
    }

    /// Serialize; tensors are an error here (the endpoint encodes them per connection).
    pub fn to_json(&self) -> Result<String> {
        let mut out = Vec::new();
        write_value(&mut out, self, &mut |_| {
            Err(RpcError::InvalidArgument("a tensor can only be sent through an endpoint".into()))
        })?;
        // SAFETY-free: the writer only emits UTF-8 (ASCII syntax + escaped or copied UTF-8 strings).
        String::from_utf8(out).map_err(|e| RpcError::Protocol(format!("writer produced invalid UTF-8: {e}")))
    }
}

// ---------------------------------------------------------------------------------------
// Writer
// ---------------------------------------------------------------------------------------

/// Append `v` as JSON; `tensor` turns each tensor into the value to write in its place.
pub fn write_value(out: &mut Vec<u8>, v: &Value, tensor: &mut TensorEncoder<'_>) -> Result<()> {
    match v {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Int(i) => write_int(out, *i),
        Value::BigInt(s) => {
            let digits = s.strip_prefix('-').unwrap_or(s);
            if digits.is_empty() || !digits.bytes().all(|c| c.is_ascii_digit()) {
                return Err(RpcError::InvalidArgument(format!("BigInt {s:?} is not an integer")));
            }
            out.extend_from_slice(s.as_bytes());
        }
        Value::Float(f) => write_float(out, *f),
        Value::Str(s) => write_str(out, s),
        Value::Array(a) => {
            out.push(b'[');
            for (n, x) in a.iter().enumerate() {
                if n > 0 {
                    out.extend_from_slice(b", ");
                }
                write_value(out, x, tensor)?;
            }
            out.push(b']');
        }
        Value::Object(m) => {
            out.push(b'{');
            for (n, (k, x)) in m.iter().enumerate() {
                if n > 0 {
                    out.extend_from_slice(b", ");
                }
                write_str(out, k);
                out.extend_from_slice(b": ");
                write_value(out, x, tensor)?;
            }
            out.push(b'}');
        }
        Value::Tensor(t) => {
            let repl = tensor(t)?;
            if matches!(repl, Value::Tensor(_)) {
                return Err(RpcError::InvalidArgument("tensor encoder returned a tensor".into()));
            }
            write_value(out, &repl, tensor)?;
        }
        Value::Json(j) => {
            let text = j.text().as_bytes();
            let mut at = 0;
            for (off, t) in j.tensors() {
                out.extend_from_slice(&text[at..*off]);
                let repl = tensor(t)?;
                if matches!(repl, Value::Tensor(_)) {
                    return Err(RpcError::InvalidArgument("tensor encoder returned a tensor".into()));
                }
                write_value(out, &repl, tensor)?;
                at = *off;
            }
            out.extend_from_slice(&text[at..]);
        }
    }
    Ok(())
}

/// An integer as Python's `json.dumps` writes it.
pub fn write_int(out: &mut Vec<u8>, i: i64) {
    out.extend_from_slice(itoa::Buffer::new().format(i).as_bytes());
}

/// A float as Python's `json.dumps` writes it.
pub fn write_float(out: &mut Vec<u8>, f: f64) {
    if f.is_nan() {
        out.extend_from_slice(b"NaN");
    } else if f.is_infinite() {
        out.extend_from_slice(if f > 0.0 { b"Infinity" } else { b"-Infinity" });
    } else if f != 0.0 && f.abs() < 1e15 && f.fract() == 0.0 {
        // A whole number: the same text as Debug's ("3.0"), without the formatting
        // machinery.
        write_int(out, f as i64);
        out.extend_from_slice(b".0");
    } else if (1e-4..1e16).contains(&f.abs()) {
        // The shortest digits that read back to `f`, laid out as `repr` (and Debug) lay
        // out this range: decimal, with a '.' ("0.0001", "1.5"). Where two shortest
        // forms are equally near, `repr` takes the nearer to `f`, as zmij does.
        out.extend_from_slice(zmij::Buffer::new().format_finite(f).as_bytes());
    } else {
        // Outside that range zmij's layout ("1e+16", "0.00001") is neither `repr`'s nor
        // Debug's ("1e16", "1e-5"); Debug is the shortest round-trip form there and always has
        // '.' or 'e' ("1e100"). Written straight into `out`: writing to a Vec cannot fail.
        let _ = write!(out, "{f:?}");
    }
}

/// Bytes from `i` on in `b` that a string copies as they are: the index of the first
/// byte at or after `i` that is a `"`, a `\\`, a control character (below 0x20) or, with
/// `del`, 0x7f — or `b.len()`. Eight bytes at a time.
#[inline]
pub fn plain_run(b: &[u8], mut i: usize, del: bool) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let zero_in = |x: u64| x.wrapping_sub(ONES) & !x & HIGH;
    while let Some(chunk) = b.get(i..i + 8) {
        let x = u64::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3], chunk[4], chunk[5], chunk[6], chunk[7]]);
        // A byte below 0x20: (x - 0x20 per byte) borrows into its high bit, unless the byte
        // had its own high bit set (UTF-8's multi-byte sequences).
        let special = (x.wrapping_sub(0x20 * ONES) & !x & HIGH)
            | zero_in(x ^ (b'"' as u64 * ONES))
            | zero_in(x ^ (b'\\' as u64 * ONES))
            | if del { zero_in(x ^ (0x7f * ONES)) } else { 0 };
        if special != 0 {
            break;
        }
        i += 8;
    }
    while let Some(&c) = b.get(i) {
        if c == b'"' || c == b'\\' || c < 0x20 || (del && c == 0x7f) {
            break;
        }
        i += 1;
    }
    i
}

/// A JSON string literal: UTF-8 copied, quotes/backslashes/control characters escaped.
pub fn write_str(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    let b = s.as_bytes();
    let run = plain_run(b, 0, true);
    if run == b.len() {
        out.extend_from_slice(b);
        out.push(b'"');
        return;
    }
    let mut start = 0;
    for (i, &c) in b.iter().enumerate() {
        let esc: &[u8] = match c {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0..=0x1f | 0x7f => b"",
            _ => continue,
        };
        out.extend_from_slice(&b[start..i]);
        if esc.is_empty() {
            let _ = write!(out, "\\u{c:04x}");
        } else {
            out.extend_from_slice(esc);
        }
        start = i + 1;
    }
    out.extend_from_slice(&b[start..]);
    out.push(b'"');
}


// What needs the parser: a value's tree, its comparison and its serde form (a
// `Value::Json` holds text; the value module itself parses nothing).

impl Value {
    /// The tree of a [`Value::Json`] (parsed within `limits`); any other value as it is.
    /// Text written with tensors has no tree form here (the tensors' encodings are
    /// chosen per connection): an error.
    pub fn into_tree(self, limits: Limits) -> Result<Value> {
        match self {
            Value::Json(j) if j.tensors().is_empty() => parse_limited(j.text().as_bytes(), limits),
            Value::Json(_) => Err(RpcError::InvalidArgument("a value written as JSON text with tensors in it has no tree form".into())),
            v => Ok(v),
        }
    }
}

impl PartialEq for Value {
    fn eq(&self, other: &Value) -> bool {
        use Value::*;
        match (self, other) {
            (Null, Null) => true,
            (Bool(a), Bool(b)) => a == b,
            (Int(a), Int(b)) => a == b,
            (BigInt(a), BigInt(b)) => a == b,
            // Python: 1 == 1.0
            (Float(a), Float(b)) => a == b,
            (Int(a), Float(b)) | (Float(b), Int(a)) => (*a as f64) == *b && (*b as i64) == *a,
            (Str(a), Str(b)) => a == b,
            (Array(a), Array(b)) => a == b,
            (Object(a), Object(b)) => a == b,
            (Tensor(a), Tensor(b)) => a.same_as(b),
            (Json(_), _) | (_, Json(_)) => match (self.clone().into_tree(Limits::default()), other.clone().into_tree(Limits::default())) {
                (Ok(a), Ok(b)) => a == b,
                _ => false,
            },
            _ => false,
        }
    }
}

impl TryFrom<&Value> for serde_json::Value {
    type Error = RpcError;
    fn try_from(v: &Value) -> Result<serde_json::Value> {
        Ok(match v {
            Value::Null => serde_json::Value::Null,
            Value::Bool(b) => serde_json::Value::Bool(*b),
            Value::Int(i) => serde_json::Value::from(*i),
            Value::BigInt(s) => match s.parse::<u64>() {
                Ok(u) => serde_json::Value::from(u),
                Err(_) => {
                    return Err(RpcError::Decode(format!("integer {s} does not fit 64 bits")));
                }
            },
            Value::Float(f) => serde_json::Number::from_f64(*f).map_or(serde_json::Value::Null, serde_json::Value::Number),
            Value::Str(s) => serde_json::Value::String(s.clone()),
            Value::Array(a) => serde_json::Value::Array(a.iter().map(serde_json::Value::try_from).collect::<Result<_>>()?),
            Value::Object(m) => serde_json::Value::Object(
                m.iter().map(|(k, v)| Ok((k.clone(), serde_json::Value::try_from(v)?))).collect::<Result<_>>()?,
            ),
            Value::Tensor(_) => return Err(RpcError::Decode("a tensor has no plain-JSON form".into())),
            Value::Json(_) => return serde_json::Value::try_from(&v.clone().into_tree(Limits::default())?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rt(s: &str) -> String {
        Value::parse(s.as_bytes()).unwrap().to_json().unwrap()
    }

    #[test]
    fn python_tokens_both_ways() {
        let v = Value::parse(b"[NaN, Infinity, -Infinity, 1.5, -0.0, 1e400]").unwrap();
        let a = v.as_array().unwrap();
        assert!(a[0].as_f64().unwrap().is_nan());
        assert_eq!(a[1].as_f64(), Some(f64::INFINITY));
        assert_eq!(a[2].as_f64(), Some(f64::NEG_INFINITY));
        assert_eq!(a[5].as_f64(), Some(f64::INFINITY));
        assert_eq!(v.to_json().unwrap(), "[NaN, Infinity, -Infinity, 1.5, -0.0, Infinity]");
        assert_eq!(rt("1.0"), "1.0");
        assert_eq!(rt("1E2"), "100.0");
        assert_eq!(rt("2"), "2");
    }

    #[test]
    fn floats_read_back_exactly_in_the_shortest_form() {
        // Whole numbers, the edges of the decimal range and any other float: the text
        // reads back to the same bits, has a '.' or an exponent (so it stays a float),
        // is never longer than Debug's shortest form, is Debug's text outside the
        // decimal range, and inside it is decimal as `repr` writes it.
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let check = |f: f64| {
            let mut out = Vec::new();
            write_float(&mut out, f);
            let text = String::from_utf8(out).unwrap();
            let debug = format!("{f:?}");
            assert_eq!(text.parse::<f64>().unwrap().to_bits(), f.to_bits(), "{text} for {debug}");
            assert!(text.contains('.') || text.contains('e'), "{text}");
            assert!(text.len() <= debug.len(), "{text} longer than {debug}");
            if f == 0.0 || !(1e-4..1e16).contains(&f.abs()) {
                assert_eq!(text, debug);
            } else {
                assert!(!text.contains('e'), "{text}");
            }
        };
        for f in [0.0, -0.0, 1.0, 0.5, 1e-4, 9.999999999999999e-5, 1e15, 999999999999999.0, 999999999999999.9, 1e16, 9999999999999998.0, 0.1, 1.0 / 3.0, 123456.789, 4503599627370497.0, 1e308, 5e-324, f64::MAX, f64::MIN_POSITIVE] {
            check(f);
            check(-f);
        }
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let f = f64::from_bits(x);
            if f.is_finite() {
                check(f);
            }
            // And numbers in the decimal range with few or many digits.
            let m = (x >> 11) as f64 / (1u64 << 53) as f64;
            let e = (x % 20) as i32 - 5;
            check(m * 10f64.powi(e));
            check((m * 1e6).round() / 1e3);
            check((m * 10f64.powi(e + 5)).round());
        }
        // Two shortest forms equally short: the nearer one, as `repr` has it (Debug
        // writes ...749.3 here).
        let mut out = Vec::new();
        write_float(&mut out, 947482943091749.2);
        assert_eq!(out, b"947482943091749.2");
        let mut out = Vec::new();
        write_float(&mut out, 0.0001);
        assert_eq!(out, b"0.0001");
    }

    #[test]
    fn objects_keep_insertion_order_and_the_last_duplicate() {
        // As json.loads: keys in the order written; a repeated key's last value, in the
        // place of its first occurrence.
        assert_eq!(rt(r#"{"b": 1, "a": {"z": 2, "y": 3}, "c": 4}"#), r#"{"b": 1, "a": {"z": 2, "y": 3}, "c": 4}"#);
        assert_eq!(rt(r#"{"x": 1, "a": 2, "x": 3}"#), r#"{"x": 3, "a": 2}"#);
        let mut m = Map::new();
        m.insert("2".into(), Value::Int(2));
        m.insert("10".into(), Value::Int(10));
        assert_eq!(Value::Object(m).to_json().unwrap(), r#"{"2": 2, "10": 10}"#);
    }

    #[test]
    fn escapes_and_surrogates() {
        let v = Value::parse(br#""a\u00e9\ud83d\ude00\n\"\\\/\ud800x""#).unwrap();
        assert_eq!(v.as_str().unwrap(), "a\u{e9}\u{1F600}\n\"\\/\u{FFFD}x");
        assert_eq!(v.to_json().unwrap(), "\"a\u{e9}\u{1F600}\\n\\\"\\\\/\u{FFFD}x\"");
        assert_eq!(Value::from("\u{1}\u{7f}").to_json().unwrap(), "\"\\u0001\\u007f\"");
    }

    #[test]
    fn plain_runs_stop_at_every_special_byte() {
        // Each special byte at each position of a 20-byte run, with multi-byte UTF-8 around.
        for special in [b'"', b'\\', 0x00, 0x1f, 0x7f] {
            for at in 0..20 {
                let mut b: Vec<u8> = "aé😀 bcdefghijklmnop".bytes().take(20).collect();
                b[at] = special;
                let want = b.iter().position(|&c| c == b'"' || c == b'\\' || c < 0x20 || c == 0x7f).unwrap();
                assert_eq!(plain_run(&b, 0, true), want, "{special:#x} at {at}");
                let want = b.iter().position(|&c| c == b'"' || c == b'\\' || c < 0x20).unwrap_or(b.len());
                assert_eq!(plain_run(&b, 0, false), want, "{special:#x} at {at}, no del");
            }
        }
        let b = "plain text, é and 😀, then more plain text".as_bytes();
        assert_eq!(plain_run(b, 3, true), b.len());
    }

    #[test]
    fn big_ints_and_limits() {
        assert_eq!(rt("123456789012345678901234567890"), "123456789012345678901234567890");
        assert_eq!(Value::parse(b"-9223372036854775808").unwrap(), Value::Int(i64::MIN));
        let long = "9".repeat(MAX_INT_DIGITS + 1);
        assert!(Value::parse(long.as_bytes()).is_err());
        let deep = "[".repeat(DEFAULT_MAX_DEPTH + 1) + &"]".repeat(DEFAULT_MAX_DEPTH + 1);
        let e = Value::parse(deep.as_bytes()).unwrap_err().to_string();
        assert!(e.contains("nesting deeper"), "{e}");
        let ok = "[".repeat(DEFAULT_MAX_DEPTH) + &"]".repeat(DEFAULT_MAX_DEPTH);
        assert!(Value::parse(ok.as_bytes()).is_ok());
    }

    #[test]
    fn rejects_malformed() {
        for bad in [
            &b""[..],
            b"[1,]",
            b"{\"a\" 1}",
            b"\"abc",
            b"\"a\x01\"",
            b"01",
            b"[1] x",
            b"nul",
            b"-",
            b"\"\\x\"",
            b"\"\\u12\"",
            b"\xff\xfe",
            b"{1: 2}",
            b"1.",
            b".5",
        ] {
            assert!(Value::parse(bad).is_err(), "{:?} should fail", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn serde_bridge() {
        #[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
        struct P {
            b: Vec<String>,
            a: i32,
        }
        let p = P { b: vec!["x".into()], a: 3 };
        let v = Value::from_serde(&p).unwrap();
        // In the fields' order, as a Python peer's dict would list them.
        assert_eq!(v.to_json().unwrap(), r#"{"b": ["x"], "a": 3}"#);
        assert_eq!(v.to_serde::<P>().unwrap(), p);
    }
}
