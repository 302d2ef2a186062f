//! Deadlines from caller-given timeouts, which may be as large as `Duration::MAX`
//! ("forever"): `Instant + Duration` panics on overflow, so every deadline is made here.

use std::time::{Duration, Instant};

/// Far enough to be "never" (about 136 years), small enough for any `Instant`.
const FAR: Duration = Duration::from_secs(1 << 32);

/// The instant `timeout` from now, or about 136 years from now for larger timeouts.
pub fn after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout).unwrap_or_else(|| now + FAR)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_timeouts_do_not_overflow() {
        let t = Instant::now();
        assert!(after(Duration::MAX) > t + Duration::from_secs(1 << 30));
        assert!(after(Duration::MAX / 4) > t);
        let d = after(Duration::from_millis(5));
        assert!(d >= t + Duration::from_millis(5) && d < t + Duration::from_secs(5));
    }
}
