//! The JSON parser behind [`crate::json::parse`]: Python's `json.loads` grammar (see the
//! parent module), bounded. A frame's text is at most `RpcConfig::max_frame` bytes, but
//! the tree built from it costs ~32 bytes per value however short the value's text is, so
//! the parser counts values against [`Limits::max_values`] and nesting against
//! [`Limits::max_depth`] as it goes, and stops with [`RpcError::DecodeLimit`] at the first
//! value over either — before allocating for it.

use super::{DEFAULT_MAX_DEPTH, DEFAULT_MAX_VALUES, MAX_INT_DIGITS, Map, Value};
use crate::error::{Result, RpcError};

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
    if let Err(e) = std::str::from_utf8(bytes) {
        return Err(RpcError::Decode(format!("frame is not valid UTF-8 (at byte {})", e.valid_up_to())));
    }
    let mut p = Parser { b: bytes, i: 0, depth: 0, values: 0, limits, entries: Vec::new(), items: Vec::new() };
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
    b: &'a [u8],
    i: usize,
    depth: usize,
    /// Values (and keys) parsed so far.
    values: usize,
    limits: Limits,
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
        while let Some(c) = self.b.get(self.i) {
            if matches!(c, b' ' | b'\t' | b'\n' | b'\r') {
                self.i += 1;
            } else {
                break;
            }
        }
    }
    fn eat(&mut self, lit: &[u8]) -> bool {
        if self.b[self.i..].starts_with(lit) {
            self.i += lit.len();
            true
        } else {
            false
        }
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
            b'{' => self.object(),
            b'[' => self.array(),
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
    fn array(&mut self) -> Result<Value> {
        let first = self.items.len();
        let parsed = self.items(b"]", "expected ',' or ']'", |p| {
            let v = p.value()?;
            p.items.push(v);
            Ok(())
        });
        let items = self.items.drain(first..);
        parsed?;
        Ok(Value::Array(items.collect()))
    }
    fn object(&mut self) -> Result<Value> {
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
            let v = p.value()?;
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
    fn hex4(&mut self) -> Result<u32> {
        let h = self.b.get(self.i..self.i + 4).ok_or_else(|| self.err("truncated \\u escape"))?;
        let mut v = 0u32;
        for &c in h {
            let d = (c as char).to_digit(16).ok_or_else(|| self.err("bad hex digit in \\u escape"))?;
            v = v * 16 + d;
        }
        self.i += 4;
        Ok(v)
    }
    /// The text from `start` to the current position (see the SAFETY note for why both
    /// are char boundaries).
    fn text_from(&self, start: usize) -> &str {
        let bytes = &self.b[start..self.i];
        debug_assert!(std::str::from_utf8(bytes).is_ok());
        // SAFETY: `parse_limited` checked that all of `self.b` is UTF-8, and both ends of
        // this range are char boundaries, so the slice is UTF-8. Every ASCII byte has a
        // boundary before and after it. A range starts just after an ASCII byte (an
        // opening quote, an escape sequence's last byte) or at one (a number's '-' or
        // first digit); it ends just before one (a string's text stops at '"', '\\' or
        // a control character), just after one (a number's last digit), or where it
        // started.
        unsafe { std::str::from_utf8_unchecked(bytes) }
    }
    fn string(&mut self) -> Result<String> {
        self.i += 1; // opening quote
        let mut out = String::new();
        loop {
            let start = self.i;
            while let Some(&c) = self.b.get(self.i) {
                if c == b'"' || c == b'\\' || c < 0x20 {
                    break;
                }
                self.i += 1;
            }
            let Some(&c) = self.b.get(self.i) else { return Err(self.err("unterminated string")) };
            if c == b'"' && out.is_empty() {
                // No escape: the common case, one allocation of the exact size.
                let s = self.text_from(start).to_owned();
                self.i += 1;
                return Ok(s);
            }
            out.push_str(self.text_from(start));
            self.i += 1;
            match c {
                b'"' => return Ok(out),
                b'\\' => {
                    let Some(&e) = self.b.get(self.i) else { return Err(self.err("unterminated escape")) };
                    self.i += 1;
                    match e {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => {
                            let u = self.hex4()?;
                            let ch = if (0xD800..0xDC00).contains(&u) {
                                // High surrogate: a low one must follow to make a char.
                                if self.b[self.i..].starts_with(b"\\u") {
                                    let save = self.i;
                                    self.i += 2;
                                    let lo = self.hex4()?;
                                    if (0xDC00..0xE000).contains(&lo) {
                                        char::from_u32(0x10000 + ((u - 0xD800) << 10) + (lo - 0xDC00))
                                    } else {
                                        self.i = save;
                                        None
                                    }
                                } else {
                                    None
                                }
                            } else {
                                char::from_u32(u)
                            };
                            out.push(ch.unwrap_or('\u{FFFD}'));
                        }
                        _ => return Err(self.err("invalid escape")),
                    }
                }
                _ => return Err(self.err("control character in string")),
            }
        }
    }
    fn digits(&mut self) -> usize {
        let s = self.i;
        while self.b.get(self.i).is_some_and(u8::is_ascii_digit) {
            self.i += 1;
        }
        self.i - s
    }
    fn number(&mut self) -> Result<Value> {
        let start = self.i;
        if self.b[self.i] == b'-' {
            self.i += 1;
        }
        match self.b.get(self.i) {
            Some(b'0') => self.i += 1,
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return Err(self.err("expected digits")),
        }
        let mut float = false;
        if self.b.get(self.i) == Some(&b'.') && self.b.get(self.i + 1).is_some_and(u8::is_ascii_digit) {
            self.i += 1;
            self.digits();
            float = true;
        }
        if matches!(self.b.get(self.i), Some(b'e' | b'E')) {
            let save = self.i;
            self.i += 1;
            if matches!(self.b.get(self.i), Some(b'+' | b'-')) {
                self.i += 1;
            }
            if self.digits() == 0 {
                self.i = save; // Python stops the number here; the next token will fail
            } else {
                float = true;
            }
        }
        // Only ASCII digits, signs, '.' and 'e' were consumed.
        let text = self.text_from(start);
        if float {
            return text.parse::<f64>().map(Value::Float).map_err(|_| self.err("bad float"));
        }
        match text.parse::<i64>() {
            Ok(i) => Ok(Value::Int(i)),
            Err(_) => {
                if text.trim_start_matches('-').len() > MAX_INT_DIGITS {
                    return Err(self.err(&format!("integer longer than {MAX_INT_DIGITS} digits")));
                }
                Ok(Value::BigInt(text.to_owned()))
            }
        }
    }
}
