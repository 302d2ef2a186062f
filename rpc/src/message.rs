//! The three pyisolate messages (`call`, `callback`, `response`) and the `null` close
//! frame, decoded from and encoded to the wire exactly as DESIGN.md and pyisolate 0.10.2
//! (`rpc_serialization.RPCRequest` / `RPCCallback` / `RPCResponse`) define them.

use crate::error::{Result, RpcError};
use crate::json;
use crate::value::{Map, TensorEncoder, Value};

/// One decoded frame.
#[allow(clippy::large_enum_variant)] // one per frame, moved rarely
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    Call { object_id: String, call_id: i64, parent_call_id: Option<i64>, method: String, args: Vec<Value>, kwargs: Map },
    Callback { callback_id: String, call_id: i64, parent_call_id: Option<i64>, args: Vec<Value>, kwargs: Map },
    /// `error` is `None` on success. (pyisolate treats a falsy `error` as success.)
    Response { call_id: i64, result: Value, error: Option<String> },
    /// The `null` frame: the peer is closing.
    Close,
}

fn take_str(m: &mut Map, k: &str, kind: &str) -> Result<String> {
    match m.swap_remove(k) {
        Some(Value::Str(s)) => Ok(s),
        Some(v) => Err(RpcError::Protocol(format!("{kind} message field {k:?} is a {}, expected str", v.type_name()))),
        None => Err(RpcError::Protocol(format!("{kind} message has no {k:?} field"))),
    }
}

fn take_id(m: &mut Map, k: &str, kind: &str) -> Result<i64> {
    match m.swap_remove(k) {
        Some(Value::Int(i)) => Ok(i),
        Some(v) => Err(RpcError::Protocol(format!("{kind} message field {k:?} is a {}, expected int", v.type_name()))),
        None => Err(RpcError::Protocol(format!("{kind} message has no {k:?} field"))),
    }
}

fn take_parent(m: &mut Map, kind: &str) -> Result<Option<i64>> {
    match m.swap_remove("parent_call_id") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Int(i)) => Ok(Some(i)),
        Some(v) => Err(RpcError::Protocol(format!("{kind} message field \"parent_call_id\" is a {}, expected int or None", v.type_name()))),
    }
}

fn take_args(m: &mut Map, kind: &str) -> Result<(Vec<Value>, Map)> {
    let args = match m.swap_remove("args") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(RpcError::Protocol(format!("{kind} message field \"args\" is a {}, expected list", v.type_name()))),
    };
    let kwargs = match m.swap_remove("kwargs") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(o)) => o,
        Some(v) => return Err(RpcError::Protocol(format!("{kind} message field \"kwargs\" is a {}, expected dict", v.type_name()))),
    };
    Ok((args, kwargs))
}

impl Message {
    /// Parse one frame's payload (the default value count).
    pub fn decode(payload: &[u8], max_depth: usize) -> Result<Message> {
        Message::decode_limited(payload, json::Limits { max_depth, ..json::Limits::default() })
    }

    /// Parse one frame's payload within `limits`; going over one is
    /// [`RpcError::DecodeLimit`], any other bad JSON [`RpcError::Protocol`].
    pub fn decode_limited(payload: &[u8], limits: json::Limits) -> Result<Message> {
        let v = json::parse_limited(payload, limits).map_err(|e| match e {
            RpcError::DecodeLimit { .. } => e,
            e => RpcError::Protocol(e.to_string()),
        })?;
        Message::from_value(v)
    }

    /// As [`decode_limited`](Self::decode_limited), with the values the message carries
    /// (result, args, kwargs values) as [`Value::Json`] text where they hold no tagged
    /// object (see [`json::parse_message_text`]).
    pub fn decode_text(payload: &[u8], limits: json::Limits) -> Result<Message> {
        let v = json::parse_message_text(payload, limits).map_err(|e| match e {
            RpcError::DecodeLimit { .. } => e,
            e => RpcError::Protocol(e.to_string()),
        })?;
        Message::from_value(v)
    }

    /// Interpret a parsed frame.
    pub fn from_value(v: Value) -> Result<Message> {
        let mut m = match v {
            Value::Null => return Ok(Message::Close),
            Value::Object(m) => m,
            other => {
                return Err(RpcError::Protocol(format!("frame holds a JSON {}, expected an object or null", other.type_name())));
            }
        };
        let kind = take_str(&mut m, "kind", "RPC")?;
        match kind.as_str() {
            "call" => {
                let object_id = take_str(&mut m, "object_id", "call")?;
                let call_id = take_id(&mut m, "call_id", "call")?;
                let parent_call_id = take_parent(&mut m, "call")?;
                let method = take_str(&mut m, "method", "call")?;
                let (args, kwargs) = take_args(&mut m, "call")?;
                Ok(Message::Call { object_id, call_id, parent_call_id, method, args, kwargs })
            }
            "callback" => {
                let callback_id = take_str(&mut m, "callback_id", "callback")?;
                let call_id = take_id(&mut m, "call_id", "callback")?;
                let parent_call_id = take_parent(&mut m, "callback")?;
                let (args, kwargs) = take_args(&mut m, "callback")?;
                Ok(Message::Callback { callback_id, call_id, parent_call_id, args, kwargs })
            }
            "response" => {
                let call_id = take_id(&mut m, "call_id", "response")?;
                let result = m.swap_remove("result").unwrap_or(Value::Null);
                let error = match m.swap_remove("error") {
                    None | Some(Value::Null) | Some(Value::Bool(false)) => None,
                    Some(Value::Str(s)) if s.is_empty() => None,
                    Some(Value::Str(s)) => Some(s),
                    Some(other) => Some(other.to_json().unwrap_or_else(|_| "remote error".into())),
                };
                Ok(Message::Response { call_id, result, error })
            }
            other => Err(RpcError::Protocol(format!(
                "unknown message kind {other:?} (expected \"call\", \"callback\" or \"response\")"
            ))),
        }
    }

    /// The bytes of the text this message's values already hold as JSON text
    /// ([`Value::Json`]): what encoding it will at least copy, so that the buffer can be
    /// sized once.
    pub fn text_len(&self) -> usize {
        let text = |v: &Value| match v {
            Value::Json(j) => j.text().len(),
            _ => 0,
        };
        match self {
            Message::Call { args, kwargs, .. } | Message::Callback { args, kwargs, .. } => {
                args.iter().chain(kwargs.values()).map(text).sum()
            }
            Message::Response { result, .. } => text(result),
            Message::Close => 0,
        }
    }

    /// Encode the JSON payload (no frame header) into `out`.
    pub fn encode(&self, out: &mut Vec<u8>, tensor: &mut TensorEncoder<'_>) -> Result<()> {
        let parent = |out: &mut Vec<u8>, p: &Option<i64>| match p {
            Some(p) => out.extend_from_slice(p.to_string().as_bytes()),
            None => out.extend_from_slice(b"null"),
        };
        match self {
            Message::Close => out.extend_from_slice(b"null"),
            Message::Call { object_id, call_id, parent_call_id, method, args, kwargs } => {
                out.extend_from_slice(b"{\"kind\": \"call\", \"object_id\": ");
                json::write_str(out, object_id);
                out.extend_from_slice(format!(", \"call_id\": {call_id}, \"parent_call_id\": ").as_bytes());
                parent(out, parent_call_id);
                out.extend_from_slice(b", \"method\": ");
                json::write_str(out, method);
                encode_args(out, args, kwargs, tensor)?;
            }
            Message::Callback { callback_id, call_id, parent_call_id, args, kwargs } => {
                out.extend_from_slice(b"{\"kind\": \"callback\", \"callback_id\": ");
                json::write_str(out, callback_id);
                out.extend_from_slice(format!(", \"call_id\": {call_id}, \"parent_call_id\": ").as_bytes());
                parent(out, parent_call_id);
                encode_args(out, args, kwargs, tensor)?;
            }
            Message::Response { call_id, result, error } => {
                out.extend_from_slice(format!("{{\"kind\": \"response\", \"call_id\": {call_id}, \"result\": ").as_bytes());
                json::write_value(out, result, tensor)?;
                out.extend_from_slice(b", \"error\": ");
                match error {
                    Some(e) => json::write_str(out, e),
                    None => out.extend_from_slice(b"null"),
                }
                out.push(b'}');
            }
        }
        Ok(())
    }

    /// The `call_id` of a call, callback or response.
    pub fn call_id(&self) -> Option<i64> {
        match self {
            Message::Call { call_id, .. } | Message::Callback { call_id, .. } | Message::Response { call_id, .. } => Some(*call_id),
            Message::Close => None,
        }
    }
}

/// The `call_id` of a connection notice: a response to no request, carrying the reason
/// the sender is about to close the connection (a refused connection, a frame over a
/// decode limit). Our endpoints fail every pending call with that reason; a pyisolate
/// peer sees a response to an unknown id, then the close.
pub const NOTICE_CALL_ID: i64 = -1;

/// A connection notice's payload (see [`NOTICE_CALL_ID`]).
pub fn connection_notice(reason: &str) -> Vec<u8> {
    let mut out = Vec::new();
    let m = Message::Response { call_id: NOTICE_CALL_ID, result: Value::Null, error: Some(reason.to_owned()) };
    // A response with a string error and no tensors always encodes.
    let _ = m.encode(&mut out, &mut |_| Err(RpcError::InvalidArgument("no tensors in a notice".into())));
    out
}

fn encode_args(out: &mut Vec<u8>, args: &[Value], kwargs: &Map, tensor: &mut TensorEncoder<'_>) -> Result<()> {
    out.extend_from_slice(b", \"args\": [");
    for (i, a) in args.iter().enumerate() {
        if i > 0 {
            out.extend_from_slice(b", ");
        }
        json::write_value(out, a, tensor)?;
    }
    out.extend_from_slice(b"], \"kwargs\": {");
    for (i, (k, v)) in kwargs.iter().enumerate() {
        if i > 0 {
            out.extend_from_slice(b", ");
        }
        json::write_str(out, k);
        out.extend_from_slice(b": ");
        json::write_value(out, v, tensor)?;
    }
    out.extend_from_slice(b"}}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enc(m: &Message) -> Vec<u8> {
        let mut v = Vec::new();
        m.encode(&mut v, &mut |_| unreachable!()).unwrap();
        v
    }

    #[test]
    fn roundtrip_every_kind() {
        let mut kw = Map::new();
        kw.insert("k".into(), Value::Float(f64::INFINITY));
        let msgs = [
            Message::Call { object_id: "o".into(), call_id: 3, parent_call_id: Some(1), method: "m".into(), args: vec![1.into(), "x".into()], kwargs: kw.clone() },
            Message::Callback { callback_id: "cb".into(), call_id: 0, parent_call_id: None, args: vec![], kwargs: Map::new() },
            Message::Response { call_id: 9, result: Value::Array(vec![Value::Null]), error: None },
            Message::Response { call_id: 9, result: Value::Null, error: Some("boom".into()) },
            Message::Close,
        ];
        for m in msgs {
            assert_eq!(Message::decode(&enc(&m), 64).unwrap(), m);
        }
    }

    #[test]
    fn text_len_counts_every_value_held_as_text() {
        let text = |t: &str| Value::Json(Box::new(crate::value::JsonText::new(t.into(), Vec::new()).unwrap()));
        let mut kw = Map::new();
        kw.insert("k".into(), text("[1, 2]"));
        kw.insert("tree".into(), Value::Array(vec![Value::Int(1)]));
        let call = Message::Call { object_id: "o".into(), call_id: 3, parent_call_id: None, method: "m".into(), args: vec![text("{\"a\": 1}"), "x".into()], kwargs: kw.clone() };
        assert_eq!(call.text_len(), 8 + 6);
        let cb = Message::Callback { callback_id: "cb".into(), call_id: 0, parent_call_id: None, args: vec![text("null")], kwargs: kw };
        assert_eq!(cb.text_len(), 4 + 6);
        assert_eq!(Message::Response { call_id: 9, result: text("[true]"), error: None }.text_len(), 6);
        assert_eq!(Message::Response { call_id: 9, result: Value::Null, error: None }.text_len(), 0);
        // What encoding copies at least: the message is longer than its texts.
        assert!(enc(&call).len() > call.text_len());
    }

    #[test]
    fn clear_errors_for_bad_messages() {
        for (bad, want) in [
            (&b"[1]"[..], "expected an object"),
            (b"{\"kind\": \"nope\", \"call_id\": 1}", "unknown message kind"),
            (b"{\"call_id\": 1}", "no \"kind\""),
            (b"{\"kind\": \"call\", \"object_id\": \"o\", \"call_id\": \"1\", \"method\": \"m\"}", "expected int"),
            (b"{\"kind\": \"response\"}", "no \"call_id\""),
            (b"{\"kind\": \"call\", \"object_id\": \"o\", \"call_id\": 1, \"method\": \"m\", \"args\": 5}", "expected list"),
            (b"\xff", "UTF-8"),
        ] {
            let e = Message::decode(bad, 64).unwrap_err().to_string();
            assert!(e.contains(want), "{e:?} lacks {want:?}");
        }
    }
}
