//! Deterministic test bytes that differ from one seed to the next at every byte, so a
//! transfer that delivered the wrong buffer, or stale bytes, shows at the first byte.

/// `len` bytes seeded with `seed`: byte `i` is a hash of `i` xor `seed`.
pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(2654435761).wrapping_shr(13) as u8 ^ seed).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_differ_at_every_byte() {
        let (a, b) = (pattern(1, 4096), pattern(2, 4096));
        assert_eq!(a.len(), 4096);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        assert_eq!(a, pattern(1, 4096));
    }
}
