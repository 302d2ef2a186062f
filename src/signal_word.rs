//! The host's side of a CUDA signal word (`cuda::order::words`): a 32-bit sequence that
//! the producer's stream writes in order, the consumer reads, and the consumer raises
//! itself to end a wait the producer never ends. Kept apart from the CUDA code so that
//! `loom/tests/loom.rs` checks these very functions (the device's accesses are whole aligned
//! 32-bit loads and stores, modelled there by a thread).

use crate::sync::{AtomicU32, Ordering};

/// True if `word` is at or past `value` in cyclic order: the driver's
/// `CU_STREAM_WAIT_VALUE_GEQ`, `(int32_t)(word - value) >= 0`, which ignores wraparound.
pub fn reached(word: u32, value: u32) -> bool {
    (word.wrapping_sub(value) as i32) >= 0
}

/// The word now.
pub fn load(w: &AtomicU32) -> u32 {
    // Acquire: pairs with the producer's release of the value (its stream's write, which
    // has a memory barrier before it): its work before the write is visible once the
    // value is seen.
    w.load(Ordering::Acquire)
}

/// Raise the word to `value` unless it has reached it; true if this call wrote. A
/// compare-and-swap, so a value the producer stored between our load and our store is
/// never lowered (a lowered word would hold back later waits on it).
pub fn raise(w: &AtomicU32, value: u32) -> bool {
    // Acquire loads: as in `load`. AcqRel on success: the store publishes nothing (the
    // wait it ends reads nothing we wrote); the read half pairs as `load` does.
    let mut cur = w.load(Ordering::Acquire);
    loop {
        if reached(cur, value) {
            return false;
        }
        match w.compare_exchange_weak(cur, value, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return true,
            Err(now) => cur = now,
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn reached_is_the_drivers_cyclic_geq_and_raise_never_lowers() {
        assert!(reached(5, 5) && reached(6, 5) && !reached(4, 5));
        assert!(reached(5, 0xFFFF_FFF0), "wrapped past");
        assert!(!reached(0xFFFF_FFF0, 5));
        let w = AtomicU32::new(3);
        assert!(raise(&w, 7));
        assert_eq!(load(&w), 7);
        assert!(!raise(&w, 6));
        assert_eq!(load(&w), 7);
    }
}
