//! The tokens of Python's JSON — whitespace, strings, numbers — read from text.
//!
//! Two readers take the same language: the tree parser here and the Python binding's
//! reader, which builds Python objects straight from a value's text. Both step over
//! tokens with these functions, so what is accepted, what a string decodes to and each
//! error's wording are written once. Each function reads at `*i` and leaves `*i` after
//! what it read, or at the byte that made it fail (the caller names that byte in its
//! error).

use super::{MAX_INT_DIGITS, plain_run};
use std::borrow::Cow;

/// What a token was wrong with, in words; the caller adds where.
pub type LexError = &'static str;

/// The error of an integer with more digits than Python converts.
pub const INT_TOO_LONG: LexError = "integer longer than 4300 digits";

/// Step over JSON whitespace.
#[inline]
pub fn ws(b: &[u8], i: &mut usize) {
    while matches!(b.get(*i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        *i += 1;
    }
}

/// Step over `lit` if the text at `*i` starts with it.
#[inline]
pub fn eat(b: &[u8], i: &mut usize, lit: &[u8]) -> bool {
    // The punctuation between values, one byte compared as a byte rather than by a call
    // to compare slices (most of the calls; `lit` is a constant where this is inlined).
    if let [c] = lit {
        let hit = b.get(*i) == Some(c);
        *i += usize::from(hit);
        return hit;
    }
    if b.get(*i..).is_some_and(|rest| rest.starts_with(lit)) {
        *i += lit.len();
        true
    } else {
        false
    }
}

/// A string's text, its escapes decoded; `*i` is at its opening quote. Borrowed from
/// `text` when it has no escape. A lone surrogate, which a Rust string cannot hold,
/// becomes U+FFFD (as `json.loads` would keep it, then fail to encode it).
#[inline]
pub fn string<'a>(text: &'a str, i: &mut usize) -> Result<Cow<'a, str>, LexError> {
    let b = text.as_bytes();
    *i += 1; // opening quote
    let mut out = String::new();
    loop {
        let start = *i;
        *i = plain_run(b, *i, false);
        let Some(&c) = b.get(*i) else { return Err("unterminated string") };
        // Both ends are next to ASCII bytes (the quote or escape before, the byte that
        // stopped the run after), so they are char boundaries of valid text.
        let part = text.get(start..*i).ok_or("a string that splits a character")?;
        *i += 1;
        match c {
            b'"' if out.is_empty() => return Ok(Cow::Borrowed(part)),
            b'"' => {
                out.push_str(part);
                return Ok(Cow::Owned(out));
            }
            b'\\' => {
                out.push_str(part);
                out.push(escape(b, i)?);
            }
            _ => return Err("control character in string"),
        }
    }
}

/// Check the string at `*i` (its opening quote) as [`string`] does, without decoding it;
/// `true` when it has an escape.
#[inline]
pub fn skim_string(b: &[u8], i: &mut usize) -> Result<bool, LexError> {
    *i += 1; // opening quote
    let mut escaped = false;
    loop {
        *i = plain_run(b, *i, false);
        let Some(&c) = b.get(*i) else { return Err("unterminated string") };
        *i += 1;
        match c {
            b'"' => return Ok(escaped),
            b'\\' => {
                escaped = true;
                escape(b, i)?;
            }
            _ => return Err("control character in string"),
        }
    }
}

/// The char of the escape after a backslash (`*i` just past it).
fn escape(b: &[u8], i: &mut usize) -> Result<char, LexError> {
    let Some(&e) = b.get(*i) else { return Err("unterminated escape") };
    *i += 1;
    Ok(match e {
        b'"' => '"',
        b'\\' => '\\',
        b'/' => '/',
        b'b' => '\u{8}',
        b'f' => '\u{c}',
        b'n' => '\n',
        b'r' => '\r',
        b't' => '\t',
        b'u' => {
            let u = hex4(b, i)?;
            // A high surrogate and a low one after it make one char; anything else
            // around a surrogate leaves it alone, as U+FFFD.
            let ch = if (0xD800..0xDC00).contains(&u) && b.get(*i..).is_some_and(|r| r.starts_with(b"\\u")) {
                let save = *i;
                *i += 2;
                let lo = hex4(b, i)?;
                if (0xDC00..0xE000).contains(&lo) {
                    char::from_u32(0x10000 + ((u - 0xD800) << 10) + (lo - 0xDC00))
                } else {
                    *i = save;
                    None
                }
            } else {
                char::from_u32(u)
            };
            ch.unwrap_or('\u{FFFD}')
        }
        _ => return Err("invalid escape"),
    })
}

fn hex4(b: &[u8], i: &mut usize) -> Result<u32, LexError> {
    let h = b.get(*i..*i + 4).ok_or("truncated \\u escape")?;
    let mut v = 0u32;
    for &c in h {
        v = v * 16 + (c as char).to_digit(16).ok_or("bad hex digit in \\u escape")?;
    }
    *i += 4;
    Ok(v)
}

#[inline]
fn digits(b: &[u8], i: &mut usize) -> usize {
    let s = *i;
    while b.get(*i).is_some_and(u8::is_ascii_digit) {
        *i += 1;
    }
    *i - s
}

/// A number, as `json.loads` reads it.
#[derive(Debug, PartialEq)]
pub enum Number<'a> {
    Int(i64),
    /// An integer beyond `i64`: its digits (at most [`MAX_INT_DIGITS`]), sign included.
    BigInt(&'a str),
    Float(f64),
}

/// The number at `*i`: an int when it has no fraction or exponent, else a float.
#[inline]
pub fn number<'a>(text: &'a str, i: &mut usize) -> Result<Number<'a>, LexError> {
    let start = *i;
    let float = number_text(text.as_bytes(), i)?;
    // Only ASCII digits, signs, '.' and 'e' were stepped over.
    let t = text.get(start..*i).ok_or("a number that splits a character")?;
    if float {
        return t.parse().map(Number::Float).map_err(|_| "bad float");
    }
    match t.parse::<i64>() {
        Ok(v) => Ok(Number::Int(v)),
        Err(_) if t.trim_start_matches('-').len() > MAX_INT_DIGITS => Err(INT_TOO_LONG),
        Err(_) => Ok(Number::BigInt(t)),
    }
}

/// Check the number at `*i` as [`number`] does, without converting it.
#[inline]
pub fn skim_number(b: &[u8], i: &mut usize) -> Result<(), LexError> {
    let start = *i;
    let float = number_text(b, i)?;
    let digits = *i - start - usize::from(b[start] == b'-');
    if !float && digits > MAX_INT_DIGITS {
        return Err(INT_TOO_LONG);
    }
    Ok(())
}

/// Step over a number's text; whether it is a float (has a fraction or exponent).
#[inline]
fn number_text(b: &[u8], i: &mut usize) -> Result<bool, LexError> {
    if b.get(*i) == Some(&b'-') {
        *i += 1;
    }
    match b.get(*i) {
        Some(b'0') => *i += 1,
        Some(b'1'..=b'9') => {
            digits(b, i);
        }
        _ => return Err("expected digits"),
    }
    let mut float = false;
    if b.get(*i) == Some(&b'.') && b.get(*i + 1).is_some_and(u8::is_ascii_digit) {
        *i += 1;
        digits(b, i);
        float = true;
    }
    if matches!(b.get(*i), Some(b'e' | b'E')) {
        let save = *i;
        *i += 1;
        if matches!(b.get(*i), Some(b'+' | b'-')) {
            *i += 1;
        }
        if digits(b, i) == 0 {
            *i = save; // Python stops the number here; the next token will fail
        } else {
            float = true;
        }
    }
    Ok(float)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_long_integer_error_names_the_limit() {
        assert_eq!(INT_TOO_LONG, format!("integer longer than {MAX_INT_DIGITS} digits"));
    }

    #[test]
    fn strings_borrow_unless_escaped_and_pair_surrogates() {
        let mut i = 0;
        assert!(matches!(string(r#""plain" x"#, &mut i), Ok(Cow::Borrowed("plain"))));
        assert_eq!(i, 7);
        let mut i = 0;
        assert_eq!(string(r#""a\n\ud83d\ude00\ud800z""#, &mut i).unwrap(), "a\n😀\u{FFFD}z");
        for (bad, what) in [(r#""abc"#, "unterminated string"), (r#""a\"#, "unterminated escape"), (r#""\x""#, "invalid escape"), (r#""\u12""#, "truncated \\u escape"), (r#""\u12g4""#, "bad hex digit in \\u escape"), ("\"a\u{1}\"", "control character in string")] {
            let mut i = 0;
            assert_eq!(string(bad, &mut i), Err(what), "{bad}");
            let mut i = 0;
            assert_eq!(skim_string(bad.as_bytes(), &mut i), Err(what), "{bad}");
        }
    }

    #[test]
    fn numbers_read_as_json_loads_reads_them() {
        let read = |t: &str| {
            let mut i = 0;
            number(t, &mut i).map(|n| (format!("{n:?}"), i))
        };
        assert_eq!(read("-12,"), Ok(("Int(-12)".into(), 3)));
        assert_eq!(read("1.5e3]"), Ok(("Float(1500.0)".into(), 5)));
        assert_eq!(read("1e"), Ok(("Int(1)".into(), 1)));
        assert_eq!(read("1."), Ok(("Int(1)".into(), 1)));
        assert_eq!(read("99999999999999999999"), Ok(("BigInt(\"99999999999999999999\")".into(), 20)));
        assert_eq!(read("-"), Err("expected digits"));
        let long = "9".repeat(MAX_INT_DIGITS + 1);
        assert_eq!(read(&long), Err(INT_TOO_LONG));
        let mut i = 0;
        assert_eq!(skim_number(long.as_bytes(), &mut i), Err(INT_TOO_LONG));
    }
}
