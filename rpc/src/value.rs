//! The value an RPC carries: JSON as Python reads and writes it (with non-finite floats
//! and integers beyond 64 bits), plus tensors, which travel out of band and appear in the
//! JSON as tagged objects. The text codec is [`crate::json`]; tensors' wire forms are in
//! [`crate::tensor`]; both build on this type.
//!
//! Conversions to and from `serde_json::Value` (and so any serde type) are here too; those
//! map a NaN or infinity to `null` because serde_json cannot represent them.

use crate::error::{Result, RpcError};
use crate::tensor_handle::Tensor;

/// A JSON object, in insertion order: a Python dict sent keeps its key order, as
/// `json.loads` keeps it, and the text written is in that order too. Equality ignores
/// order, as a dict's does. Hashed with std's randomly keyed SipHash, so a peer cannot
/// choose colliding keys to make an object's decode quadratic.
pub type Map = indexmap::IndexMap<String, Value>;

/// Turns each tensor met while writing a value into the value written in its place (the
/// endpoint encodes tensors per connection: native descriptor, `TensorRef`, `TensorValue`).
pub type TensorEncoder<'a> = dyn FnMut(&Tensor) -> Result<Value> + 'a;

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
    /// A tensor: encoded per connection as a native descriptor, a file_system
    /// `TensorRef` or a `TensorValue` (see [`crate::tensor`]).
    Tensor(Box<Tensor>),
    /// A value held as its JSON text rather than as a tree (see [`JsonText`]).
    Json(Box<JsonText>),
}

/// One value as JSON text, with no tree built for it: what the Python binding sends
/// (written straight from Python objects, its tensors kept aside and encoded in place
/// when the text is written) and — on an endpoint with `RpcConfig::json_text` — what a
/// received value holding no tagged object (no `"__type__"` key) arrives as, validated
/// within the connection's decode limits. [`Value::into_tree`] parses it.
#[derive(Clone, Debug, Default)]
pub struct JsonText {
    text: String,
    tensors: Vec<(usize, Tensor)>,
}

impl JsonText {
    /// `text` is one JSON value as [`crate::json`] writes it, with each tensor's encoding
    /// to be written at its byte offset in `text`, where a value goes (offsets in
    /// ascending order, each at most `text.len()` and on a char boundary). The caller
    /// vouches for the text; it is written as it is.
    pub fn new(text: String, tensors: Vec<(usize, Tensor)>) -> Result<JsonText> {
        let mut last = 0;
        for (at, _) in &tensors {
            if *at < last || !text.is_char_boundary(*at) {
                return Err(RpcError::InvalidArgument(format!(
                    "a tensor's offset {at} in a {}-byte JSON text is out of order or inside a character",
                    text.len()
                )));
            }
            last = *at;
        }
        Ok(JsonText { text, tensors })
    }
    /// Received text, checked by the parser.
    pub(crate) fn received(text: String) -> JsonText {
        JsonText { text, tensors: Vec::new() }
    }
    /// The text (tensors not included).
    pub fn text(&self) -> &str {
        &self.text
    }
    /// The tensors with the offsets where their encodings go.
    pub fn tensors(&self) -> &[(usize, Tensor)] {
        &self.tensors
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
            Value::Json(j) => match j.text.trim_start().as_bytes().first() {
                Some(b'{') => "dict",
                Some(b'[') => "list",
                Some(b'"') => "str",
                Some(b'n') => "None",
                Some(b't' | b'f') => "bool",
                Some(_) if j.text.contains(['.', 'e', 'E', 'N', 'I']) => "float",
                _ => "int",
            },
        }
    }

    /// Build an object from pairs.
    pub fn object<K: Into<String>>(pairs: impl IntoIterator<Item = (K, Value)>) -> Value {
        Value::Object(pairs.into_iter().map(|(k, v)| (k.into(), v)).collect())
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

