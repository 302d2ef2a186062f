//! A side's sticky record of the ring being broken (the reasons: `error::ring`).

use crate::error::ring::{RingBroken, RingError};

/// Whether a side found the ring broken, and why. Sticky: the first reason stays, and
/// every later call on that side fails with it.
#[derive(Clone, Copy, Default)]
pub(super) struct Broken(pub(super) Option<RingBroken>);

impl Broken {
    /// `Err` with the first reason once the ring is broken.
    pub(super) fn check(self) -> Result<(), RingError> {
        match self.0 {
            Some(why) => Err(RingError::Broken(why)),
            None => Ok(()),
        }
    }

    /// Record `why` (unless a reason is recorded already) and return it as the error.
    pub(super) fn mark(&mut self, why: RingBroken) -> RingError {
        self.0.get_or_insert(why);
        RingError::Broken(why)
    }
}
