//! Standard base64 (RFC 4648, with padding), as Python's `base64.b64encode`/`b64decode`
//! use for `__pyisolate_bytes__`. Decoding is strict: bad characters or length are errors.

use crate::error::{Result, RpcError};

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

pub fn encode(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for k in 0..4 {
            if k <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * k)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn sextet(c: u8) -> Option<u32> {
    Some(match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => return None,
    } as u32)
}

/// Append `data`'s base64 to `out` (the same text as [`encode`]), three bytes at a time.
pub fn encode_into(out: &mut Vec<u8>, data: &[u8]) {
    let chunks = data.chunks_exact(3);
    let rest = chunks.remainder();
    let start = out.len();
    out.resize(start + data.len() / 3 * 4, 0);
    for (c, o) in chunks.zip(out[start..].chunks_exact_mut(4)) {
        let n = (u32::from(c[0]) << 16) | (u32::from(c[1]) << 8) | u32::from(c[2]);
        o[0] = ALPHABET[(n >> 18) as usize & 63];
        o[1] = ALPHABET[(n >> 12) as usize & 63];
        o[2] = ALPHABET[(n >> 6) as usize & 63];
        o[3] = ALPHABET[n as usize & 63];
    }
    out.extend_from_slice(encode(rest).as_bytes());
}

/// Each base64 character's value; 0xff for a byte that is not one.
const SEXTETS: [u8; 256] = {
    let mut t = [0xffu8; 256];
    let mut i = 0;
    while i < 64 {
        t[ALPHABET[i] as usize] = i as u8;
        i += 1;
    }
    t
};

/// Decode `s` into `out`, which must be exactly the decoded length (as strict as
/// [`decode`]: bad characters, padding or length are errors).
pub fn decode_exact(s: &[u8], out: &mut [u8]) -> Result<()> {
    if s.len() % 4 != 0 {
        return Err(RpcError::Decode(format!("base64 text of {} characters is not a multiple of 4", s.len())));
    }
    let pad = s.iter().rev().take_while(|&&c| c == b'=').count();
    let want = (s.len() / 4 * 3).saturating_sub(pad);
    if pad > 2 || want != out.len() {
        return Err(RpcError::Decode(format!("base64 text of {} characters does not hold {} bytes", s.len(), out.len())));
    }
    let full = if pad > 0 { s.len() - 4 } else { s.len() };
    let bad = |c: u8| RpcError::Decode(format!("invalid base64 character {:?}", c as char));
    for (q, o) in s[..full].chunks_exact(4).zip(out.chunks_exact_mut(3)) {
        let v = [SEXTETS[q[0] as usize], SEXTETS[q[1] as usize], SEXTETS[q[2] as usize], SEXTETS[q[3] as usize]];
        if (v[0] | v[1] | v[2] | v[3]) & 0x80 != 0 {
            let i = v.iter().position(|&x| x == 0xff).unwrap_or(0);
            return Err(bad(q[i]));
        }
        let n = (u32::from(v[0]) << 18) | (u32::from(v[1]) << 12) | (u32::from(v[2]) << 6) | u32::from(v[3]);
        o[0] = (n >> 16) as u8;
        o[1] = (n >> 8) as u8;
        o[2] = n as u8;
    }
    if pad > 0 {
        let tail = decode(std::str::from_utf8(&s[full..]).map_err(|_| RpcError::Decode("invalid base64 padding".into()))?)?;
        out[full / 4 * 3..].copy_from_slice(&tail);
    }
    Ok(())
}

pub fn decode(s: &str) -> Result<Vec<u8>> {
    let b = s.as_bytes();
    if b.len() % 4 != 0 {
        return Err(RpcError::Decode(format!("base64 text of {} characters is not a multiple of 4", b.len())));
    }
    let mut out = Vec::with_capacity(b.len() / 4 * 3);
    let last = b.len() / 4;
    for (i, q) in b.chunks(4).enumerate() {
        let pad = q.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && i + 1 != last) {
            return Err(RpcError::Decode("misplaced '=' padding in base64".into()));
        }
        let mut n = 0u32;
        for &c in &q[..4 - pad] {
            n = (n << 6) | sextet(c).ok_or_else(|| RpcError::Decode(format!("invalid base64 character {:?}", c as char)))?;
        }
        n <<= 6 * pad as u32;
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..3 - pad]);
    }
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
        // The fast forms: the same text, the same strictness.
        for n in 0..40 {
            let raw: Vec<u8> = (0..n).map(|i| (i * 37 + 11) as u8).collect();
            let mut fast = Vec::new();
            super::encode_into(&mut fast, &raw);
            assert_eq!(fast, super::encode(&raw).as_bytes());
            let mut back = vec![0; n];
            super::decode_exact(&fast, &mut back).unwrap();
            assert_eq!(back, raw);
            assert!(super::decode_exact(&fast, &mut vec![0; n + 1]).is_err(), "a wrong length");
        }
        for bad in ["Zg=", "Z===", "Zg==Zg==", "Zm9*", "===="] {
            assert!(super::decode_exact(bad.as_bytes(), &mut [0; 1]).is_err(), "{bad}");
            assert!(super::decode_exact(bad.as_bytes(), &mut [0; 3]).is_err(), "{bad}");
        }
    }
}
