//! Binary values (export blobs, keys) as text on a line protocol.

/// Lower-case hex, two digits a byte.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of [`hex`] text; panics (naming the text) on anything else, as a test should
/// when its own peer wrote garbage.
pub fn unhex(s: &str) -> Vec<u8> {
    assert!(s.len() % 2 == 0, "odd-length hex text {s:?}");
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap_or_else(|e| panic!("bad hex {s:?} at {}: {e}", 2 * i)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(hex(&[0x00, 0x0f, 0xa5, 0xff]), "000fa5ff");
        assert_eq!(unhex(&hex(&all)), all);
    }

    #[test]
    #[should_panic(expected = "odd-length")]
    fn odd_length_is_refused() {
        unhex("abc");
    }
}
