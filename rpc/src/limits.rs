//! Checked, fallible allocation for sizes a peer chose. A peer's tensor view can name far
//! more elements than its storage holds (stride 0), and a frame's text can expand into a
//! much larger tree, so every buffer sized from what a peer sent is first checked against
//! a configured limit (an error naming the `RpcConfig` field) and then allocated with
//! `try_reserve` (an error, not an abort, when memory or address space runs out).

use crate::error::{Result, RpcError};

/// `need` bytes for `what`, if within `cap` (`RpcConfig::max_tensor_copy`).
pub(crate) fn check_tensor_copy(what: impl FnOnce() -> String, need: u64, cap: usize) -> Result<usize> {
    match usize::try_from(need) {
        Ok(n) if n <= cap => Ok(n),
        _ => Err(RpcError::TensorCopyLimit { what: what(), need, cap }),
    }
}

/// An empty vector with room for `n` elements, or an error naming `what`.
pub(crate) fn try_with_capacity<T>(n: usize, what: impl FnOnce() -> String) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| RpcError::OutOfMemory { what: what(), bytes: (n as u64).saturating_mul(std::mem::size_of::<T>() as u64) })?;
    Ok(v)
}

/// `n` zero bytes, or an error naming `what`.
pub(crate) fn try_zeroed(n: usize, what: impl FnOnce() -> String) -> Result<Vec<u8>> {
    let mut v = try_with_capacity(n, what)?;
    v.resize(n, 0);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn over_the_cap_names_the_field_and_huge_allocations_fail_cleanly() {
        let e = check_tensor_copy(|| "a copy".into(), 1 << 40, 1 << 20).unwrap_err().to_string();
        assert!(e.contains("max_tensor_copy") && e.contains("1099511627776"), "{e}");
        assert_eq!(check_tensor_copy(|| unreachable!(), 10, 10).unwrap(), 10);
        let e = try_with_capacity::<u64>(usize::MAX / 8, || "a huge buffer".into()).unwrap_err().to_string();
        assert!(e.contains("out of memory") && e.contains("a huge buffer"), "{e}");
    }
}
