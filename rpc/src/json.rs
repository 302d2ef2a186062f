//! JSON as Python's `json` module writes and reads it.
//!
//! serde_json refuses the bare `NaN`, `Infinity` and `-Infinity` tokens that
//! `json.dumps` emits for non-finite floats, cannot hold a NaN in its `Value`, and turns
//! integers beyond 64 bits into floats. pyisolate peers produce all of these, so the RPC
//! layer has its own small parser and writer over its own [`Value`]:
//!
//! - reads: everything `json.loads` accepts in strict mode (`NaN`/`Infinity`/`-Infinity`,
//!   `\uXXXX` escapes incl. surrogate pairs; a lone surrogate, which Rust strings cannot
//!   hold, becomes U+FFFD), integers of any length up to Python's 4300-digit limit
//!   (beyond `i64`: [`Value::BigInt`] keeps the digits), nesting up to a depth limit
//!   (no stack overflow from `[[[[...`), UTF-8 validated up front;
//! - writes: what `json.loads` reads back to the same Python value: floats always with a
//!   `.` or exponent (so `1.0` stays a float), non-finite floats as the bare tokens, raw
//!   UTF-8 strings with control characters escaped.
//!
//! Conversions to and from `serde_json::Value` (and so any serde type) are provided; those
//! map a NaN or infinity to `null` because serde_json cannot represent them.

use crate::error::{Result, RpcError};
use crate::tensor::Tensor;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// A JSON object (keys sorted; Python dicts do not depend on key order for equality).
pub type Map = BTreeMap<String, Value>;

/// Nesting depth accepted by default (Python's own recursion limit is about 1000).
pub const DEFAULT_MAX_DEPTH: usize = 256;
/// Python 3.11 refuses to convert integers longer than this many digits.
pub const MAX_INT_DIGITS: usize = 4300;
/// JSON values decoded from one frame by default (see `RpcConfig::max_values`).
pub const DEFAULT_MAX_VALUES: usize = 1 << 20;

mod parser;
pub use parser::{Limits, parse, parse_limited};

/// A value on the wire: JSON plus non-finite floats, big integers, and tensors (which are
/// carried out of band and appear in the JSON as a tagged object).
#[derive(Clone, Debug, Default)]
pub enum Value {
    #[default]
    Null,
    Bool(bool),
    Int(i64),
    /// An integer outside `i64`, as its decimal digits (optional leading `-`).
    BigInt(String),
    Float(f64),
    Str(String),
    Array(Vec<Value>),
    Object(Map),
    /// A tensor: encoded per connection as a native descriptor or a file_system
    /// `TensorRef` (see [`crate::tensor`]).
    Tensor(Box<Tensor>),
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
            _ => false,
        }
    }
}

impl Value {
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }
    /// A number as f64 (ints convert).
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Int(i) => Some(*i as f64),
            Value::Float(f) => Some(*f),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&Vec<Value>> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
    pub fn as_object(&self) -> Option<&Map> {
        match self {
            Value::Object(m) => Some(m),
            _ => None,
        }
    }
    pub fn as_tensor(&self) -> Option<&Tensor> {
        match self {
            Value::Tensor(t) => Some(t),
            _ => None,
        }
    }
    pub fn is_null(&self) -> bool {
        matches!(self, Value::Null)
    }
    /// `self[key]` for objects.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.as_object().and_then(|m| m.get(key))
    }
    /// The Python type name of this value (for error messages).
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::Null => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) | Value::BigInt(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Array(_) => "list",
            Value::Object(_) => "dict",
            Value::Tensor(_) => "Tensor",
        }
    }
    /// Build an object from pairs.
    pub fn object<K: Into<String>>(pairs: impl IntoIterator<Item = (K, Value)>) -> Value {
        Value::Object(pairs.into_iter().map(|(k, v)| (k.into(), v)).collect())
    }

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

    /// From any serde-serializable value (via serde_json: non-finite floats become null).
    pub fn from_serde<T: serde::Serialize + ?Sized>(v: &T) -> Result<Value> {
        let j = serde_json::to_value(v).map_err(|e| RpcError::InvalidArgument(format!("cannot serialize: {e}")))?;
        Ok(Value::from(j))
    }

    /// Into any serde-deserializable type (via serde_json).
    pub fn to_serde<T: serde::de::DeserializeOwned>(&self) -> Result<T> {
        let j = serde_json::Value::try_from(self)?;
        serde_json::from_value(j).map_err(|e| RpcError::Decode(format!("cannot convert the value: {e}")))
    }
}

macro_rules! from_int {
    ($($t:ty),*) => {$(
        impl From<$t> for Value {
            fn from(v: $t) -> Value { Value::Int(v as i64) }
        }
    )*};
}
from_int!(i8, i16, i32, i64, u8, u16, u32);

impl From<u64> for Value {
    fn from(v: u64) -> Value {
        i64::try_from(v).map(Value::Int).unwrap_or_else(|_| Value::BigInt(v.to_string()))
    }
}
impl From<f64> for Value {
    fn from(v: f64) -> Value {
        Value::Float(v)
    }
}
impl From<f32> for Value {
    fn from(v: f32) -> Value {
        Value::Float(v as f64)
    }
}
impl From<bool> for Value {
    fn from(v: bool) -> Value {
        Value::Bool(v)
    }
}
impl From<&str> for Value {
    fn from(v: &str) -> Value {
        Value::Str(v.to_owned())
    }
}
impl From<String> for Value {
    fn from(v: String) -> Value {
        Value::Str(v)
    }
}
impl From<Vec<Value>> for Value {
    fn from(v: Vec<Value>) -> Value {
        Value::Array(v)
    }
}
impl From<Map> for Value {
    fn from(v: Map) -> Value {
        Value::Object(v)
    }
}
impl From<Tensor> for Value {
    fn from(v: Tensor) -> Value {
        Value::Tensor(Box::new(v))
    }
}
impl<T: Into<Value>> From<Option<T>> for Value {
    fn from(v: Option<T>) -> Value {
        v.map_or(Value::Null, Into::into)
    }
}

impl From<serde_json::Value> for Value {
    fn from(j: serde_json::Value) -> Value {
        match j {
            serde_json::Value::Null => Value::Null,
            serde_json::Value::Bool(b) => Value::Bool(b),
            serde_json::Value::Number(n) => {
                if let Some(i) = n.as_i64() {
                    Value::Int(i)
                } else if let Some(u) = n.as_u64() {
                    Value::from(u)
                } else {
                    Value::Float(n.as_f64().unwrap_or(f64::NAN))
                }
            }
            serde_json::Value::String(s) => Value::Str(s),
            serde_json::Value::Array(a) => Value::Array(a.into_iter().map(Value::from).collect()),
            serde_json::Value::Object(o) => Value::Object(o.into_iter().map(|(k, v)| (k, Value::from(v))).collect()),
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
        })
    }
}

// ---------------------------------------------------------------------------------------
// Writer
// ---------------------------------------------------------------------------------------

/// Append `v` as JSON; `tensor` turns each tensor into the value to write in its place.
pub fn write_value(out: &mut Vec<u8>, v: &Value, tensor: &mut dyn FnMut(&Tensor) -> Result<Value>) -> Result<()> {
    match v {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Int(i) => {
            let mut s = String::new();
            let _ = write!(s, "{i}");
            out.extend_from_slice(s.as_bytes());
        }
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
    }
    Ok(())
}

/// A float as Python's `json.dumps` writes it.
pub fn write_float(out: &mut Vec<u8>, f: f64) {
    if f.is_nan() {
        out.extend_from_slice(b"NaN");
    } else if f.is_infinite() {
        out.extend_from_slice(if f > 0.0 { b"Infinity" } else { b"-Infinity" });
    } else {
        // Debug is the shortest round-trip form and always has '.' or 'e' ("1.0", "1e100").
        let mut s = String::new();
        let _ = write!(s, "{f:?}");
        out.extend_from_slice(s.as_bytes());
    }
}

/// A JSON string literal: UTF-8 copied, quotes/backslashes/control characters escaped.
pub fn write_str(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    let b = s.as_bytes();
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
            let mut u = String::new();
            let _ = write!(u, "\\u{c:04x}");
            out.extend_from_slice(u.as_bytes());
        } else {
            out.extend_from_slice(esc);
        }
        start = i + 1;
    }
    out.extend_from_slice(&b[start..]);
    out.push(b'"');
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
    fn escapes_and_surrogates() {
        let v = Value::parse(br#""a\u00e9\ud83d\ude00\n\"\\\/\ud800x""#).unwrap();
        assert_eq!(v.as_str().unwrap(), "a\u{e9}\u{1F600}\n\"\\/\u{FFFD}x");
        assert_eq!(v.to_json().unwrap(), "\"a\u{e9}\u{1F600}\\n\\\"\\\\/\u{FFFD}x\"");
        assert_eq!(Value::from("\u{1}\u{7f}").to_json().unwrap(), "\"\\u0001\\u007f\"");
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
            a: i32,
            b: Vec<String>,
        }
        let p = P { a: 3, b: vec!["x".into()] };
        let v = Value::from_serde(&p).unwrap();
        assert_eq!(v.to_json().unwrap(), r#"{"a": 3, "b": ["x"]}"#);
        assert_eq!(v.to_serde::<P>().unwrap(), p);
    }
}
