//! pyisolate 0.10.2's tagged values (see `JSONSocketTransport._json_default` and
//! `_json_object_hook`): bytes, exceptions, enums, remote object handles, callables and
//! tensor references. Builders produce exactly the dicts pyisolate writes; [`classify`]
//! recognizes and validates them; [`check_tree`] validates every tag in a value.

use crate::base64;
use crate::error::{Result, RpcError};
use crate::value::{Map, Value};

pub const BYTES_TAG: &str = "__pyisolate_bytes__";
pub const EXCEPTION_TAG: &str = "__pyisolate_exception__";
pub const ENUM_TAG: &str = "__pyisolate_enum__";
pub const CALLABLE_TAG: &str = "__pyisolate_callable__";
pub const OBJECT_TAG: &str = "__pyisolate_object__";

/// `bytes` as pyisolate sends it: `{"__pyisolate_bytes__": true, "data": base64}`.
pub fn bytes(data: &[u8]) -> Value {
    Value::object([(BYTES_TAG, Value::Bool(true)), ("data", Value::Str(base64::encode(data)))])
}

/// An exception value (`{"__pyisolate_exception__": true, ...}`); pyisolate rebuilds it as
/// `RuntimeError("Remote {module}.{type}: {message}")`.
pub fn exception(type_name: &str, module: &str, message: &str) -> Value {
    Value::object([
        (EXCEPTION_TAG, Value::Bool(true)),
        ("type", type_name.into()),
        ("module", module.into()),
        ("args", Value::Array(vec![message.into()])),
        ("message", message.into()),
        ("traceback", "".into()),
    ])
}

/// An enum member.
pub fn enum_member(type_name: &str, module: &str, name: &str, value: Value) -> Value {
    Value::object([
        (ENUM_TAG, Value::Bool(true)),
        ("type", type_name.into()),
        ("module", module.into()),
        ("name", name.into()),
        ("value", value),
    ])
}

/// A `RemoteObjectHandle`.
pub fn remote_handle(object_id: &str, type_name: &str) -> Value {
    Value::object([("__type__", "RemoteObjectHandle".into()), ("object_id", object_id.into()), ("type_name", type_name.into())])
}

/// A callable the peer can invoke with `kind: "callback"` (pyisolate rebuilds it as a
/// `CallableProxy`). `signature` is empty: we take `*args, **kwargs`.
pub fn callable(callback_id: &str, name: &str) -> Value {
    Value::object([
        (CALLABLE_TAG, Value::Bool(true)),
        ("type", "function".into()),
        ("name", name.into()),
        ("signature", Value::Array(vec![])),
        ("callback_id", callback_id.into()),
    ])
}

/// What a tagged dict is.
#[derive(Debug, Clone, PartialEq)]
pub enum Tagged<'a> {
    Bytes(Vec<u8>),
    Exception { type_name: &'a str, module: &'a str, message: &'a str },
    Enum { type_name: &'a str, module: &'a str, name: &'a str, value: &'a Value },
    RemoteObject { object_id: &'a str, type_name: &'a str },
    /// `callback_id` is `None` when the sender had no RPC bound (not invocable).
    Callable { callback_id: Option<&'a str>, name: &'a str },
    /// A pyisolate `TensorRef` (CPU file_system or CUDA) not decoded into a tensor.
    TensorRef(&'a Map),
    /// A `TensorValue` (tensor data inline as nested lists).
    TensorValue(&'a Map),
    /// A generic `__pyisolate_object__` (class name + attribute dict).
    Object { type_name: &'a str, module: &'a str, data: &'a Value },
}

fn truthy(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) | Some(Value::Int(0)) => false,
        Some(Value::Str(s)) => !s.is_empty(),
        Some(_) => true,
    }
}

fn s<'a>(m: &'a Map, k: &str, tag: &str) -> Result<&'a str> {
    match m.get(k) {
        Some(Value::Str(s)) => Ok(s),
        Some(v) => Err(RpcError::Decode(format!("{tag} field {k:?} is a {}, expected str", v.type_name()))),
        None => Err(RpcError::Decode(format!("{tag} has no {k:?} field"))),
    }
}

fn s_or<'a>(m: &'a Map, k: &str, default: &'a str) -> &'a str {
    m.get(k).and_then(Value::as_str).unwrap_or(default)
}

/// Recognize a tagged dict. `Ok(None)` for plain values; `Err` for a tag with bad fields.
pub fn classify(v: &Value) -> Result<Option<Tagged<'_>>> {
    let Value::Object(m) = v else { return Ok(None) };
    // Same precedence as pyisolate's object hook.
    if truthy(m.get(EXCEPTION_TAG)) {
        return Ok(Some(Tagged::Exception {
            type_name: s_or(m, "type", "Exception"),
            module: s_or(m, "module", "builtins"),
            message: s_or(m, "message", ""),
        }));
    }
    if truthy(m.get(BYTES_TAG)) {
        return Ok(Some(Tagged::Bytes(base64::decode(s(m, "data", "bytes value")?)?)));
    }
    match m.get("__type__").and_then(Value::as_str) {
        Some("RemoteObjectHandle") => {
            return Ok(Some(Tagged::RemoteObject {
                object_id: s(m, "object_id", "RemoteObjectHandle")?,
                type_name: s(m, "type_name", "RemoteObjectHandle")?,
            }));
        }
        Some("TensorRef") => return Ok(Some(Tagged::TensorRef(m))),
        Some("TensorValue") => return Ok(Some(Tagged::TensorValue(m))),
        _ => {}
    }
    if truthy(m.get(ENUM_TAG)) {
        return Ok(Some(Tagged::Enum {
            type_name: s_or(m, "type", "Enum"),
            module: s_or(m, "module", "builtins"),
            name: s_or(m, "name", ""),
            value: m.get("value").unwrap_or(&Value::Null),
        }));
    }
    if truthy(m.get(OBJECT_TAG)) {
        return Ok(Some(Tagged::Object {
            type_name: s_or(m, "type", ""),
            module: s_or(m, "module", ""),
            data: m.get("data").unwrap_or(&Value::Null),
        }));
    }
    if truthy(m.get(CALLABLE_TAG)) {
        let callback_id = match m.get("callback_id") {
            None | Some(Value::Null) => None,
            Some(Value::Str(s)) => Some(s.as_str()),
            Some(v) => return Err(RpcError::Decode(format!("callable's callback_id is a {}, expected str", v.type_name()))),
        };
        return Ok(Some(Tagged::Callable { callback_id, name: s_or(m, "name", "<remote_callable>") }));
    }
    Ok(None)
}

/// The bytes of a `__pyisolate_bytes__` value.
pub fn as_bytes(v: &Value) -> Result<Vec<u8>> {
    match classify(v)? {
        Some(Tagged::Bytes(b)) => Ok(b),
        _ => Err(RpcError::Decode(format!("expected bytes, got {}", v.type_name()))),
    }
}

/// The callback id of a callable value.
pub fn as_callback_id(v: &Value) -> Result<&str> {
    match classify(v)? {
        Some(Tagged::Callable { callback_id: Some(id), .. }) => Ok(id),
        Some(Tagged::Callable { callback_id: None, name }) => {
            Err(RpcError::Decode(format!("callable {name:?} has no callback_id (the sender had no RPC bound)")))
        }
        _ => Err(RpcError::Decode(format!("expected a callable, got {}", v.type_name()))),
    }
}

/// Validate every tagged value inside `v` (recursively); returns how many were found.
pub fn check_tree(v: &Value) -> Result<usize> {
    let mut n = 0;
    let mut stack = vec![v];
    while let Some(v) = stack.pop() {
        if classify(v)?.is_some() {
            n += 1;
        }
        match v {
            Value::Array(a) => stack.extend(a.iter()),
            Value::Object(m) => stack.extend(m.values()),
            _ => {}
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builders_classify_back() {
        assert_eq!(as_bytes(&bytes(b"\x00hi\xff")).unwrap(), b"\x00hi\xff");
        assert_eq!(as_callback_id(&callable("abc", "f")).unwrap(), "abc");
        assert_eq!(
            classify(&remote_handle("o1", "Model")).unwrap(),
            Some(Tagged::RemoteObject { object_id: "o1", type_name: "Model" })
        );
        assert!(matches!(classify(&exception("ValueError", "builtins", "bad")).unwrap(), Some(Tagged::Exception { message: "bad", .. })));
        let e = enum_member("Color", "m", "RED", 1.into());
        assert!(matches!(classify(&e).unwrap(), Some(Tagged::Enum { name: "RED", .. })));
        assert_eq!(check_tree(&Value::Array(vec![bytes(b"a"), Value::object([("x", bytes(b"b"))])])).unwrap(), 3 - 1);
        assert!(classify(&Value::object([(BYTES_TAG, Value::Bool(true)), ("data", "!!".into())])).is_err());
        assert!(classify(&Value::object([(BYTES_TAG, Value::Bool(true))])).is_err());
    }
}
