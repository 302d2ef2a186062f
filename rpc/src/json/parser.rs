//! The JSON parser behind [`crate::json::parse`]: Python's `json.loads` grammar (see the
//! parent module), bounded. A frame's text is at most `RpcConfig::max_frame` bytes, but
//! the tree built from it costs ~32 bytes per value however short the value's text is, so
//! the parser counts values against [`Limits::max_values`] and nesting against
//! [`Limits::max_depth`] as it goes, and stops with [`RpcError::DecodeLimit`] at the first
//! value over either — before allocating for it.

use super::lex::{self, Number};
use super::{DEFAULT_MAX_DEPTH, DEFAULT_MAX_VALUES, JsonText, Map, Value};
use crate::error::{Result, RpcError};
use std::borrow::Cow;

/// What one parse may build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Deepest nesting of lists and dicts (`RpcConfig::max_depth`).
    pub max_depth: usize,
    /// Most values, dict keys included (`RpcConfig::max_values`).
    pub max_values: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_depth: DEFAULT_MAX_DEPTH, max_values: DEFAULT_MAX_VALUES }
    }
}

/// Parse `bytes` (must be UTF-8) with at most `max_depth` nested arrays/objects and the
/// default value count.
pub fn parse(bytes: &[u8], max_depth: usize) -> Result<Value> {
    parse_limited(bytes, Limits { max_depth, ..Limits::default() })
}

/// Parse `bytes` (must be UTF-8) within `limits`.
pub fn parse_limited(bytes: &[u8], limits: Limits) -> Result<Value> {
    parse_with(bytes, limits, false)
}

/// Parse a message's payload as [`parse_limited`] does — the same checks, limits and
/// errors — except that the values a message carries (its `"result"`, each of its
/// `"args"` and each value of its `"kwargs"`) come out as [`Value::Json`] text, no tree
/// built, when they hold no object with a `"__type__"` key (a tagged value: a tensor, a
/// pyisolate form; a key written with an escape counts as one). Those are parsed into
/// the tree as before, for the endpoint to read their tensors.
pub fn parse_message_text(bytes: &[u8], limits: Limits) -> Result<Value> {
    parse_with(bytes, limits, true)
}

fn parse_with(bytes: &[u8], limits: Limits, text_fields: bool) -> Result<Value> {
    let text = match std::str::from_utf8(bytes) {
        Ok(text) => text,
        Err(e) => return Err(RpcError::Decode(format!("frame is not valid UTF-8 (at byte {})", e.valid_up_to()))),
    };
    let mut p = Parser { text, b: bytes, i: 0, depth: 0, values: 0, limits, text_fields, entries: Vec::new(), items: Vec::new() };
    p.ws();
    let v = p.value()?;
    p.ws();
    if p.i != p.b.len() {
        return Err(p.err("extra data after the JSON value"));
    }
    Ok(v)
}

/// `used` within `max`, else the limit error naming `field` (an `RpcConfig` field).
fn within(used: usize, max: usize, field: &'static str, what: impl FnOnce() -> String) -> Result<()> {
    if used > max {
        return Err(RpcError::DecodeLimit { what: what(), field });
    }
    Ok(())
}

struct Parser<'a> {
    text: &'a str,
    /// `text`'s bytes.
    b: &'a [u8],
    i: usize,
    depth: usize,
    /// Values (and keys) parsed so far.
    values: usize,
    limits: Limits,
    /// Keep the message's values as text (see [`parse_message_text`]).
    text_fields: bool,
    /// The entries of the objects being parsed, innermost last: an object's map is built
    /// once its entries are known, at its final size (growing a hash map entry by entry
    /// costs more than the entries' own parse).
    entries: Vec<(String, Value)>,
    /// The same for the items of the lists being parsed: each list is allocated once, at
    /// its final length.
    items: Vec<Value>,
}

impl Parser<'_> {
    fn err(&self, what: &str) -> RpcError {
        RpcError::Decode(format!("invalid JSON at byte {}: {what}", self.i))
    }
    fn ws(&mut self) {
        lex::ws(self.b, &mut self.i);
    }
    fn eat(&mut self, lit: &[u8]) -> bool {
        lex::eat(self.b, &mut self.i, lit)
    }
    /// Count one more value (or key) against the budget.
    fn count(&mut self) -> Result<()> {
        self.values += 1;
        within(self.values, self.limits.max_values, "max_values", || format!("frame holds more than {} JSON values (at byte {})", self.limits.max_values, self.i))
    }
    fn value(&mut self) -> Result<Value> {
        let Some(&c) = self.b.get(self.i) else { return Err(self.err("unexpected end of input")) };
        self.count()?;
        match c {
            b'{' => self.object(false),
            b'[' => self.array(false),
            b'"' => Ok(Value::Str(self.string()?)),
            b'n' if self.eat(b"null") => Ok(Value::Null),
            b't' if self.eat(b"true") => Ok(Value::Bool(true)),
            b'f' if self.eat(b"false") => Ok(Value::Bool(false)),
            b'N' if self.eat(b"NaN") => Ok(Value::Float(f64::NAN)),
            b'I' if self.eat(b"Infinity") => Ok(Value::Float(f64::INFINITY)),
            b'-' if self.eat(b"-Infinity") => Ok(Value::Float(f64::NEG_INFINITY)),
            b'-' | b'0'..=b'9' => self.number(),
            _ => Err(self.err("expected a value")),
        }
    }
    fn enter(&mut self) -> Result<()> {
        self.depth += 1;
        within(self.depth, self.limits.max_depth, "max_depth", || format!("JSON nesting deeper than {} levels (at byte {})", self.limits.max_depth, self.i))
    }
    /// The items of a list or dict, whose opening bracket is at `self.i`: `item` parses
    /// one (whitespace around it is skipped here); items are separated by `,` and end at
    /// `close` (`expected` names both for the error).
    fn items(&mut self, close: &[u8], expected: &str, mut item: impl FnMut(&mut Self) -> Result<()>) -> Result<()> {
        self.enter()?;
        self.i += 1;
        self.ws();
        if !self.eat(close) {
            loop {
                self.ws();
                item(self)?;
                self.ws();
                if self.eat(b",") {
                    continue;
                }
                if self.eat(close) {
                    break;
                }
                return Err(self.err(expected));
            }
        }
        self.depth -= 1;
        Ok(())
    }
    /// A list; `text`: each item as [`Parser::text_value`] reads it.
    fn array(&mut self, text: bool) -> Result<Value> {
        let first = self.items.len();
        let parsed = self.items(b"]", "expected ',' or ']'", |p| {
            let v = if text { p.text_value()? } else { p.value()? };
            p.items.push(v);
            Ok(())
        });
        let items = self.items.drain(first..);
        parsed?;
        Ok(Value::Array(items.collect()))
    }
    /// A dict; `text`: each value as [`Parser::text_value`] reads it.
    fn object(&mut self, text: bool) -> Result<Value> {
        let first = self.entries.len();
        let parsed = self.items(b"}", "expected ',' or '}'", |p| {
            if p.b.get(p.i) != Some(&b'"') {
                return Err(p.err("expected a string key"));
            }
            p.count()?;
            let k = p.string()?;
            p.ws();
            if !p.eat(b":") {
                return Err(p.err("expected ':'"));
            }
            p.ws();
            let v = if text {
                p.text_value()?
            } else if p.text_fields && p.depth == 1 {
                // A field of the message itself.
                match (k.as_str(), p.b.get(p.i)) {
                    ("result", _) => p.text_value()?,
                    ("args", Some(b'[')) => {
                        p.count()?;
                        p.array(true)?
                    }
                    ("kwargs", Some(b'{')) => {
                        p.count()?;
                        p.object(true)?
                    }
                    _ => p.value()?,
                }
            } else {
                p.value()?
            };
            p.entries.push((k, v));
            Ok(())
        });
        let entries = self.entries.drain(first..);
        parsed?;
        let mut out = Map::with_capacity(entries.len());
        for (k, v) in entries {
            out.insert(k, v); // duplicate keys: the last value wins, in the first one's place, as in Python
        }
        Ok(Value::Object(out))
    }
    /// The value here as [`Value::Json`] when it holds no tagged object, checked as
    /// [`Parser::value`] checks it; else its tree.
    fn text_value(&mut self) -> Result<Value> {
        let (start, values, depth) = (self.i, self.values, self.depth);
        if self.skim()? {
            return Ok(Value::Json(Box::new(JsonText::received(self.text_from(start)?.to_owned()))));
        }
        self.i = start;
        self.values = values;
        self.depth = depth;
        self.value()
    }
    /// Check the value here as [`Parser::value`] does (grammar, limits, the same errors)
    /// without building it; `true` when it holds no object with a `"__type__"` key (nor
    /// a key with an escape, which could spell one).
    fn skim(&mut self) -> Result<bool> {
        let Some(&c) = self.b.get(self.i) else { return Err(self.err("unexpected end of input")) };
        if c != b'{' && c != b'[' {
            return self.skim_scalar().map(|()| true);
        }
        self.count()?;
        let mut plain = true;
        if c == b'{' {
            self.items(b"}", "expected ',' or '}'", |p| {
                if p.b.get(p.i) != Some(&b'"') {
                    return Err(p.err("expected a string key"));
                }
                p.count()?;
                let key = p.i;
                if p.skim_string()? || &p.b[key..p.i] == b"\"__type__\"" {
                    plain = false;
                }
                p.ws();
                if !p.eat(b":") {
                    return Err(p.err("expected ':'"));
                }
                p.ws();
                plain &= p.skim_item()?;
                Ok(())
            })?;
        } else {
            self.items(b"]", "expected ',' or ']'", |p| {
                plain &= p.skim_item()?;
                Ok(())
            })?;
        }
        Ok(plain)
    }
    /// [`Parser::skim`] of an item: a scalar checked here, without a call per leaf.
    #[inline(always)]
    fn skim_item(&mut self) -> Result<bool> {
        match self.b.get(self.i) {
            Some(b'{' | b'[') => self.skim(),
            _ => self.skim_scalar().map(|()| true),
        }
    }
    /// [`Parser::skim`] of anything but a list or dict (the same checks and errors).
    #[inline(always)]
    fn skim_scalar(&mut self) -> Result<()> {
        let Some(&c) = self.b.get(self.i) else { return Err(self.err("unexpected end of input")) };
        self.count()?;
        match c {
            b'"' => self.skim_string().map(|_| ()),
            b'n' if self.eat(b"null") => Ok(()),
            b't' if self.eat(b"true") => Ok(()),
            b'f' if self.eat(b"false") => Ok(()),
            b'N' if self.eat(b"NaN") => Ok(()),
            b'I' if self.eat(b"Infinity") => Ok(()),
            b'-' if self.eat(b"-Infinity") => Ok(()),
            b'-' | b'0'..=b'9' => self.skim_number(),
            _ => Err(self.err("expected a value")),
        }
    }
    /// Check the string here as [`Parser::string`] does, without building it; `true`
    /// when it has an escape.
    fn skim_string(&mut self) -> Result<bool> {
        lex::skim_string(self.b, &mut self.i).map_err(|what| self.err(what))
    }
    /// The text from `start` to the current position: both are next to ASCII bytes (a
    /// value starts at one and ends after one), so char boundaries of the checked text.
    fn text_from(&self, start: usize) -> Result<&str> {
        self.text.get(start..self.i).ok_or_else(|| self.err("a value that splits a character"))
    }
    fn string(&mut self) -> Result<String> {
        lex::string(self.text, &mut self.i).map(Cow::into_owned).map_err(|what| self.err(what))
    }
    /// Check the number here as [`Parser::number`] does, without converting it.
    fn skim_number(&mut self) -> Result<()> {
        lex::skim_number(self.b, &mut self.i).map_err(|what| self.err(what))
    }
    fn number(&mut self) -> Result<Value> {
        Ok(match lex::number(self.text, &mut self.i).map_err(|what| self.err(what))? {
            Number::Int(i) => Value::Int(i),
            Number::BigInt(digits) => Value::BigInt(digits.to_owned()),
            Number::Float(f) => Value::Float(f),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::json::MAX_INT_DIGITS;

    fn text(v: &Value) -> Option<&str> {
        match v {
            Value::Json(j) => Some(j.text()),
            _ => None,
        }
    }

    #[test]
    fn message_values_stay_text_unless_tagged() {
        let msg = br#"{"kind": "call", "object_id": "o", "call_id": 1, "method": "m", "args": [[1, 2.5, "x"], {"__type__": "TensorRef", "a": 1}, {"k": {"\u005f_type__": 1}}, null], "kwargs": {"p": {"a": [Infinity]}, "q": {"b": {"__type__": "X"}}}, "parent_call_id": null}"#;
        let v = parse_message_text(msg, Limits::default()).unwrap();
        let args = v.get("args").and_then(Value::as_array).unwrap();
        assert_eq!(text(&args[0]), Some("[1, 2.5, \"x\"]"));
        assert!(matches!(&args[1], Value::Object(m) if m.get("__type__").and_then(Value::as_str) == Some("TensorRef")), "a tagged value is a tree");
        assert!(matches!(&args[2], Value::Object(_)), "a key spelt with an escape is a tree: {:?}", args[2]);
        assert_eq!(text(&args[3]), Some("null"));
        let kwargs = v.get("kwargs").and_then(Value::as_object).unwrap();
        assert_eq!(text(&kwargs["p"]), Some("{\"a\": [Infinity]}"));
        assert!(matches!(&kwargs["q"], Value::Object(_)));
        // The envelope's own fields are never text; the same value as the tree parse.
        assert_eq!(v.get("object_id").and_then(Value::as_str), Some("o"));
        assert_eq!(v, parse_limited(msg, Limits::default()).unwrap());
        let r = parse_message_text(br#"{"kind": "response", "call_id": 3, "result": {"a": [1, {"b": -0.0}]}, "error": null}"#, Limits::default()).unwrap();
        assert_eq!(text(r.get("result").unwrap()), Some(r#"{"a": [1, {"b": -0.0}]}"#));
        // Nested deeper, a "result" key is only data.
        let n = parse_message_text(br#"{"kind": "response", "call_id": 3, "result": null, "error": {"result": [1]}}"#, Limits::default()).unwrap();
        assert!(matches!(n.get("error").and_then(|e| e.get("result")), Some(Value::Array(_))));
    }

    #[test]
    fn text_values_are_checked_as_the_tree_parse_checks_them() {
        let wrap = |inner: &str| format!(r#"{{"kind": "response", "call_id": 1, "result": {inner}, "error": null}}"#);
        for bad in ["[1,]", "{\"a\" 1}", "\"abc", "\"a\u{1}\"", "01", "[1] x", "nul", "-", "\"\\x\"", "\"\\u12\"", "{1: 2}", "1.", ".5", "[", "{\"a\": }"] {
            let frame = wrap(bad);
            let tree = parse_limited(frame.as_bytes(), Limits::default()).unwrap_err().to_string();
            let text = parse_message_text(frame.as_bytes(), Limits::default()).unwrap_err().to_string();
            assert_eq!(text, tree, "{bad:?}");
        }
        let long = "9".repeat(MAX_INT_DIGITS + 1);
        let e = parse_message_text(wrap(&format!("[{long}]")).as_bytes(), Limits::default()).unwrap_err().to_string();
        assert!(e.contains("integer longer than"), "{e}");
        assert!(parse_message_text(wrap(&format!("[{long}.5]")).as_bytes(), Limits::default()).is_ok(), "a long float is a float");
        // The limits count the text's values and depth as the tree's.
        let limits = Limits { max_depth: 4, max_values: 12 };
        let deep = wrap("[[[[1]]]]");
        let e = parse_message_text(deep.as_bytes(), limits).unwrap_err();
        assert!(matches!(&e, RpcError::DecodeLimit { field: "max_depth", .. }), "{e}");
        assert_eq!(e.to_string(), parse_limited(deep.as_bytes(), limits).unwrap_err().to_string());
        let many = wrap("[1, 2, 3, 4, 5, 6]");
        let e = parse_message_text(many.as_bytes(), limits).unwrap_err();
        assert!(matches!(&e, RpcError::DecodeLimit { field: "max_values", .. }), "{e}");
        assert!(parse_message_text(wrap("[[[1]]]").as_bytes(), limits).is_ok());
    }

    #[test]
    fn text_parses_into_the_same_tree() {
        let frame = r#"{"kind": "response", "call_id": 1, "result": {"a": [1, 2.5, "\u00e9\ud83d\ude00", 123456789012345678901234567890, Infinity, {"x": null, "x": true}]}, "error": null}"#;
        let v = parse_message_text(frame.as_bytes(), Limits::default()).unwrap();
        let t = v.get("result").cloned().unwrap();
        assert!(matches!(t, Value::Json(_)));
        let tree = t.into_tree(Limits::default()).unwrap();
        assert_eq!(Some(&tree), parse_limited(frame.as_bytes(), Limits::default()).unwrap().get("result"));
        assert_eq!(tree.get("a").and_then(Value::as_array).map(Vec::len), Some(6));
    }

    /// `v` with each text in it parsed into its tree.
    fn untext(v: Value) -> Value {
        match v {
            Value::Json(_) => v.into_tree(Limits::default()).unwrap(),
            Value::Array(a) => Value::Array(a.into_iter().map(untext).collect()),
            Value::Object(m) => Value::Object(m.into_iter().map(|(k, v)| (k, untext(v))).collect()),
            v => v,
        }
    }

    fn next_of(x: &mut u64, n: u64) -> u64 {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        *x % n
    }

    /// A random well-formed value of at most `depth` levels: lists and dicts (empty ones
    /// too), keys and strings holding brackets, commas, colons, escapes and `__type__`,
    /// numbers and literals, with whitespace between tokens.
    fn random_value(x: &mut u64, depth: usize, out: &mut String) {
        const STRINGS: [&str; 9] = ["\"a\"", "\"[,]:{}\"", "\"\"", "\"__type__\"", "\"x\\\"y\"", "\"\\u00e9\"", "\"é😀\"", "\"__type__ \"", "\"k\""];
        const SCALARS: [&str; 9] = ["0", "-1.5e3", "123456789012345678901234567890", "true", "false", "null", "NaN", "-Infinity", "2.5"];
        let ws = |out: &mut String, r: u64| out.push_str(["", " ", "\n\t", ""][r as usize % 4]);
        match if depth == 0 { 2 + next_of(x, 2) } else { next_of(x, 4) } {
            0 => {
                out.push('[');
                for n in 0..next_of(x, 4) {
                    if n > 0 {
                        out.push(',');
                    }
                    ws(out, next_of(x, 4));
                    random_value(x, depth - 1, out);
                }
                ws(out, next_of(x, 4));
                out.push(']');
            }
            1 => {
                out.push('{');
                for n in 0..next_of(x, 4) {
                    if n > 0 {
                        out.push(',');
                    }
                    ws(out, next_of(x, 4));
                    out.push_str(STRINGS[next_of(x, STRINGS.len() as u64) as usize]);
                    ws(out, next_of(x, 4));
                    out.push(':');
                    ws(out, next_of(x, 4));
                    random_value(x, depth - 1, out);
                }
                ws(out, next_of(x, 4));
                out.push('}');
            }
            2 => out.push_str(STRINGS[next_of(x, STRINGS.len() as u64) as usize]),
            _ => out.push_str(SCALARS[next_of(x, SCALARS.len() as u64) as usize]),
        }
    }

    #[test]
    fn text_values_count_and_fail_as_the_tree_parse_does() {
        // Random values in every place a message carries one, whole and cut short,
        // against limits around what they hold: the same success or error (word for
        // word) as the tree parse, and the same tree.
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..3000 {
            let mut v = String::new();
            let d = (x % 5) as usize;
            random_value(&mut x, d, &mut v);
            let mut at = next_of(&mut x, v.len() as u64 + 1) as usize;
            while !v.is_char_boundary(at) {
                at -= 1;
            }
            let cut = v[..at].to_owned();
            let frames = [
                format!(r#"{{"kind": "response", "call_id": 1, "result": {v}, "error": null}}"#),
                format!(r#"{{"kind": "call", "object_id": "o", "call_id": 2, "method": "m", "args": [1, {v}], "kwargs": {{"k": {v}}}}}"#),
                format!(r#"{{"kind": "response", "call_id": 1, "result": {cut}, "error": null}}"#),
            ];
            for frame in &frames {
                let (mut values, mut depth) = (1, 1);
                for max_depth in 1..=8 {
                    depth = max_depth;
                    if parse_limited(frame.as_bytes(), Limits { max_depth, max_values: usize::MAX }).is_ok() {
                        break;
                    }
                }
                for max_values in 1..=400 {
                    values = max_values;
                    if parse_limited(frame.as_bytes(), Limits { max_depth: 64, max_values }).is_ok() {
                        break;
                    }
                }
                for limits in [
                    Limits::default(),
                    Limits { max_depth: depth, max_values: values },
                    Limits { max_depth: depth - 1, max_values: values },
                    Limits { max_depth: depth, max_values: values - 1 },
                ] {
                    let tree = parse_limited(frame.as_bytes(), limits);
                    let text = parse_message_text(frame.as_bytes(), limits);
                    match (&tree, &text) {
                        // Compared as written out: NaN is not equal to itself.
                        (Ok(t), Ok(x)) => assert_eq!(untext(x.clone()).to_json().unwrap(), t.to_json().unwrap(), "{frame}"),
                        (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string(), "{frame} {limits:?}"),
                        _ => panic!("{frame} {limits:?}: tree {tree:?}, text {text:?}"),
                    }
                }
            }
        }
    }
}
