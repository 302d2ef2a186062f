//! The lease-slot word: the only thing a consumer can touch of a lease.
//!
//! Each slot of a per-peer lease table is one 64-bit word `generation << 32 | state`,
//! written by both processes. The producer (who owns the memory) grants, reaps, expires
//! and reclaims; the consumer only releases. Every transition but the producer's grant
//! and reclaim is a compare-exchange on the whole word, so a stale generation can never
//! release a newer lease, and a release racing an expiry resolves to exactly one winner.
//! The owner itself lives in producer-private memory and is dropped by whoever removes
//! it from that private table, once. Modelled in `loom/tests/loom.rs`.
//!
//! A hostile consumer can write any value here. The producer never acts on a word it does
//! not recognise (it simply keeps the owner until expiry or peer death), and never reads
//! anything else from it.

use crate::sync::{AtomicU64, Ordering};

pub use crate::wire::lease_table::{EXPIRED, FREE, LIVE, RELEASED};

#[inline]
pub fn pack(generation: u32, state: u32) -> u64 {
    (u64::from(generation) << 32) | u64::from(state)
}

#[inline]
pub fn unpack(word: u64) -> (u32, u32) {
    ((word >> 32) as u32, word as u32)
}

/// The next generation after `generation` (never 0, so a zeroed table names no lease).
#[inline]
pub fn next_gen(generation: u32) -> u32 {
    match generation.wrapping_add(1) {
        0 => 1,
        g => g,
    }
}

/// Why a consumer's release did not take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseRefused {
    /// The producer's window ran out first; it already took the memory back.
    Expired,
    /// This lease was already released.
    AlreadyReleased,
    /// The slot holds another generation (or garbage): the handle is stale.
    Stale { found_gen: u32, found_state: u32 },
}

/// Producer: publish lease `generation` in a slot its private table says is free.
pub fn grant(word: &AtomicU64, generation: u32) {
    // Release: the granted state is published before the descriptor naming it is sent;
    // pairs with the consumer's Acquire in `is_live`/`release`.
    word.store(pack(generation, LIVE), Ordering::Release);
}

/// Consumer: is `generation` the live lease of this slot?
pub fn is_live(word: &AtomicU64, generation: u32) -> Result<(), ReleaseRefused> {
    // Acquire: pairs with `grant`'s Release.
    classify(word.load(Ordering::Acquire), generation).map(|_| ())
}

fn classify(cur: u64, generation: u32) -> Result<(), ReleaseRefused> {
    match unpack(cur) {
        (g, LIVE) if g == generation => Ok(()),
        (g, EXPIRED) if g == generation => Err(ReleaseRefused::Expired),
        (g, RELEASED) | (g, FREE) if g == generation => Err(ReleaseRefused::AlreadyReleased),
        (found_gen, found_state) => Err(ReleaseRefused::Stale { found_gen, found_state }),
    }
}

/// Consumer: give lease `generation` back. The caller then rings the table's doorbell.
pub fn release(word: &AtomicU64, generation: u32) -> Result<(), ReleaseRefused> {
    // AcqRel on success: Release so every access the consumer made to the leased memory
    // happens-before the producer's Acquire in `reap` (only then may the producer reuse
    // it). Acquire on failure: to classify the current state.
    match word.compare_exchange(pack(generation, LIVE), pack(generation, RELEASED), Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => Ok(()),
        Err(cur) => classify(cur, generation).and(Err(ReleaseRefused::Stale { found_gen: unpack(cur).0, found_state: unpack(cur).1 })),
    }
}

/// Producer: if the consumer released `generation`, mark the slot free and return true.
pub fn reap(word: &AtomicU64, generation: u32) -> bool {
    // Acquire on success: pairs with the consumer's Release in `release`, so the
    // consumer's last reads of the memory happen-before the owner is dropped.
    word.compare_exchange(pack(generation, RELEASED), pack(generation, FREE), Ordering::Acquire, Ordering::Relaxed).is_ok()
}

/// What `expire` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expiry {
    /// The lease was live; it is now marked expired (a later release is refused).
    Expired,
    /// The consumer had released it already; the slot is free.
    WasReleased,
    /// The word held something the producer never wrote: the consumer scribbled it.
    Scribbled,
}

/// Producer: the window of lease `generation` ran out. The owner is dropped whatever this
/// returns; the word only tells the consumer why its release will be refused.
pub fn expire(word: &AtomicU64, generation: u32) -> Expiry {
    // AcqRel/Acquire: as in `release`/`reap`, for whichever side wins.
    match word.compare_exchange(pack(generation, LIVE), pack(generation, EXPIRED), Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => Expiry::Expired,
        Err(_) if reap(word, generation) => Expiry::WasReleased,
        Err(_) => Expiry::Scribbled,
    }
}

/// Producer: the consumer is gone; take the slot back unconditionally.
pub fn reclaim(word: &AtomicU64, generation: u32) {
    // Relaxed: nobody is left on the other side to synchronise with.
    word.store(pack(generation, FREE), Ordering::Relaxed);
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn transitions() {
        let w = AtomicU64::new(0);
        grant(&w, 1);
        assert_eq!(is_live(&w, 1), Ok(()));
        assert!(matches!(release(&w, 2), Err(ReleaseRefused::Stale { found_gen: 1, .. })));
        assert_eq!(release(&w, 1), Ok(()));
        assert_eq!(release(&w, 1), Err(ReleaseRefused::AlreadyReleased));
        assert!(reap(&w, 1));
        assert!(!reap(&w, 1));
        grant(&w, 2);
        assert_eq!(expire(&w, 2), Expiry::Expired);
        assert_eq!(release(&w, 2), Err(ReleaseRefused::Expired));
        grant(&w, 3);
        w.store(0xdead_beef, Ordering::Relaxed);
        assert_eq!(expire(&w, 3), Expiry::Scribbled);
    }
}
