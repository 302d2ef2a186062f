//! Standard base64 (RFC 4648, with padding), as Python's `base64.b64encode`/`b64decode`
//! use for `__pyisolate_bytes__` (and inline tensors' data). Decoding is strict: bad
//! characters, length or padding are errors.

use crate::error::{Result, RpcError};

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Each byte's sextet, or `BAD` (padding and every byte outside the alphabet).
const BAD: u8 = 0xff;
const SEXTETS: [u8; 256] = {
    let mut t = [BAD; 256];
    let mut i = 0;
    while i < 64 {
        t[ALPHABET[i] as usize] = i as u8;
        i += 1;
    }
    t
};

/// Standard base64 of `data`, appended to `out` (bytes, all ASCII).
pub fn encode_to(data: &[u8], out: &mut Vec<u8>) {
    let at = out.len();
    out.resize(at + data.len().div_ceil(3) * 4, b'=');
    let dst = &mut out[at..];
    let sym = |n: u64, shift: u32| ALPHABET[((n >> shift) & 63) as usize];
    // Six bytes (48 bits) at a time into eight symbols.
    let mut src = data.chunks_exact(6);
    let mut out8 = dst.chunks_exact_mut(8);
    for (c, o) in (&mut src).zip(&mut out8) {
        let n = u64::from_be_bytes([0, 0, c[0], c[1], c[2], c[3], c[4], c[5]]);
        let o: &mut [u8; 8] = o.try_into().expect("chunks of eight");
        *o = [sym(n, 42), sym(n, 36), sym(n, 30), sym(n, 24), sym(n, 18), sym(n, 12), sym(n, 6), sym(n, 0)];
    }
    let rest = src.remainder();
    let tail = &mut dst[data.len() / 6 * 8..];
    let mut three = rest.chunks_exact(3);
    for (c, o) in (&mut three).zip(tail.chunks_exact_mut(4)) {
        let n = u64::from(c[0]) << 16 | u64::from(c[1]) << 8 | u64::from(c[2]);
        o.copy_from_slice(&[sym(n, 18), sym(n, 12), sym(n, 6), sym(n, 0)]);
    }
    let last = three.remainder();
    if !last.is_empty() {
        let n = u64::from(last[0]) << 16 | u64::from(*last.get(1).unwrap_or(&0)) << 8;
        let end = dst.len() - 4;
        // One or two bytes: two or three symbols, the rest stays '=' padding.
        for k in 0..=last.len() {
            dst[end + k] = sym(n, 18 - 6 * k as u32);
        }
    }
}

pub fn encode(data: &[u8]) -> String {
    let mut out = Vec::new();
    encode_to(data, &mut out);
    String::from_utf8(out).expect("base64 is ASCII")
}

/// How many bytes the base64 text `s` decodes to, if its length and padding are right
/// (the characters are checked by the decode).
pub fn decoded_len(s: &str) -> Result<usize> {
    let b = s.as_bytes();
    if b.len() % 4 != 0 {
        return Err(RpcError::Decode(format!("base64 text of {} characters is not a multiple of 4", b.len())));
    }
    let pad = b.iter().rev().take_while(|&&c| c == b'=').count();
    if pad > 2 {
        return Err(RpcError::Decode("misplaced '=' padding in base64".into()));
    }
    Ok(b.len() / 4 * 3 - pad)
}

/// Decode `s` into `out`, which must be exactly [`decoded_len`] bytes long.
pub fn decode_into(s: &str, out: &mut [u8]) -> Result<()> {
    let n = decoded_len(s)?;
    if n != out.len() {
        return Err(RpcError::Decode(format!("base64 text decodes to {n} bytes, {} expected", out.len())));
    }
    let bad = |q: &[u8]| {
        let c = q.iter().copied().find(|&c| SEXTETS[c as usize] == BAD).unwrap_or(b'=');
        if c == b'=' {
            RpcError::Decode("misplaced '=' padding in base64".into())
        } else {
            RpcError::Decode(format!("invalid base64 character {:?}", c as char))
        }
    };
    let b = s.as_bytes();
    let whole = n / 3;
    // Eight characters at a time into six bytes, while both have that much left; the
    // rest (and the padded end) four at a time below.
    let eights = whole / 2;
    for (q, o) in b.chunks_exact(8).zip(out.chunks_exact_mut(6)).take(eights) {
        let q: &[u8; 8] = q.try_into().expect("chunks of eight");
        let x = q.map(|c| SEXTETS[c as usize]);
        // A sextet is below 64; `BAD` has the high bits set.
        if x.iter().fold(0, |a, &v| a | v) & 0xc0 != 0 {
            return Err(bad(q));
        }
        let v = x.iter().fold(0u64, |a, &v| a << 6 | u64::from(v));
        o.copy_from_slice(&v.to_be_bytes()[2..]);
    }
    let (b, out) = (&b[eights * 8..], &mut out[eights * 6..]);
    let whole = whole - eights * 2;
    for (q, o) in b.chunks_exact(4).zip(out.chunks_exact_mut(3)) {
        let (a, b1, c, d) = (SEXTETS[q[0] as usize], SEXTETS[q[1] as usize], SEXTETS[q[2] as usize], SEXTETS[q[3] as usize]);
        // A sextet is below 64; `BAD` has the high bits set.
        if (a | b1 | c | d) & 0xc0 != 0 {
            return Err(bad(q));
        }
        let v = (u32::from(a) << 18) | (u32::from(b1) << 12) | (u32::from(c) << 6) | u32::from(d);
        o.copy_from_slice(&[(v >> 16) as u8, (v >> 8) as u8, v as u8]);
    }
    let tail = out.len() - whole * 3;
    if tail > 0 {
        let q = &b[b.len() - 4..];
        let keep = tail + 1;
        let mut v = 0u32;
        for (k, &c) in q[..keep].iter().enumerate() {
            let x = SEXTETS[c as usize];
            if x == BAD {
                return Err(bad(&q[..keep]));
            }
            v |= u32::from(x) << (18 - 6 * k);
        }
        let bytes = [(v >> 16) as u8, (v >> 8) as u8];
        out[whole * 3..].copy_from_slice(&bytes[..tail]);
    }
    Ok(())
}

pub fn decode(s: &str) -> Result<Vec<u8>> {
    let mut out = vec![0; decoded_len(s)?];
    decode_into(s, &mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn roundtrip_and_strictness() {
        for (raw, enc) in [(&b""[..], ""), (b"f", "Zg=="), (b"fo", "Zm8="), (b"foo", "Zm9v"), (b"\x00\xff\x10", "AP8Q")] {
            assert_eq!(super::encode(raw), enc);
            assert_eq!(super::decode(enc).unwrap(), raw);
        }
        for bad in ["Zg=", "Z===", "Zg==Zg==", "Zm9*", "===="] {
            assert!(super::decode(bad).is_err(), "{bad}");
        }
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(super::decode(&super::encode(&all)).unwrap(), all);
        for n in 0..40 {
            let data: Vec<u8> = (0..n).map(|i| (i * 37 + 11) as u8).collect();
            let text = super::encode(&data);
            assert_eq!(super::decoded_len(&text).unwrap(), n);
            let mut out = vec![0; n];
            super::decode_into(&text, &mut out).unwrap();
            assert_eq!(out, data);
            // A buffer of another length is refused, not overrun or left short.
            assert!(super::decode_into(&text, &mut vec![0; n + 1]).is_err());
        }
        for bad in ["Zg=A", "Z=g=", "=Zg=", "Zg\u{0}=", "Zm9v\n"] {
            assert!(super::decode(bad).is_err(), "{bad:?}");
        }
    }
}
