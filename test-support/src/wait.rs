//! A bounded wait for something another process or thread does.

use std::time::{Duration, Instant};

/// Poll `cond` every 2 ms (sleeping in between: the process it waits for may need this
/// CPU) until it holds; fail the test after `within`, naming `what`.
pub fn wait_until(what: &str, within: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out after {within:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}
