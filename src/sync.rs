//! Synchronization shim: std atomics normally, loom's under `--cfg loom`.
//!
//! The shared-memory protocols (`lease::slot`, `doorbell`) are written against this module
//! only, so `loom/tests/loom.rs` model-checks the very code that runs in production. Code that
//! casts mmap'd bytes to atomics is compiled out under loom (loom atomics are not plain
//! memory); it uses `std::sync::atomic` directly and calls the same protocol functions.

#[cfg(loom)]
pub use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
pub use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Hint inside a bounded spin loop.
#[inline]
pub fn spin_hint() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::hint::spin_loop();
}

/// `futex(2)` on a 32-bit word, non-private (the word lives in memory shared between
/// processes). Under loom a single mutex + condvar models the kernel's hash-bucket lock:
/// the value check and the sleep are atomic with respect to a wake, and spurious wake-ups
/// are allowed, exactly as the real futex.
pub mod futex {
    use super::AtomicU32;
    use std::time::Duration;

    /// Sleep while `*word == expected`, at most `timeout`. Returns on wake, on a value
    /// mismatch, on timeout, or spuriously; callers re-check their condition.
    #[cfg(not(loom))]
    pub fn wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
        let ts = timeout.map(|t| libc::timespec {
            tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t,
            tv_nsec: t.subsec_nanos() as libc::c_long,
        });
        let ts_ptr = ts.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: `word` is a live reference to an aligned 32-bit atomic for the duration
        // of the call; FUTEX_WAIT only reads it. `ts_ptr` is null or points to `ts`, which
        // outlives the call. Errors (EAGAIN on mismatch, ETIMEDOUT, EINTR) all mean
        // "return and let the caller re-check", so the result is deliberately ignored.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAIT,
                expected,
                ts_ptr,
                std::ptr::null::<u32>(),
                0u32,
            );
        }
    }

    /// Wake every waiter sleeping on `word`.
    #[cfg(not(loom))]
    pub fn wake_all(word: &AtomicU32) {
        // SAFETY: `word` is a live, aligned 32-bit atomic; FUTEX_WAKE does not access the
        // memory, it only uses the address as a key.
        unsafe {
            libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX, 0usize, 0usize, 0u32);
        }
    }

    #[cfg(loom)]
    loom::lazy_static! {
        static ref BUCKET: (loom::sync::Mutex<()>, loom::sync::Condvar) =
            (loom::sync::Mutex::new(()), loom::sync::Condvar::new());
    }

    /// Loom model of FUTEX_WAIT (timeouts are not modelled: a lost wake-up deadlocks,
    /// which loom reports).
    #[cfg(loom)]
    pub fn wait(word: &AtomicU32, expected: u32, _timeout: Option<Duration>) {
        use super::Ordering;
        let guard = BUCKET.0.lock().unwrap();
        if word.load(Ordering::SeqCst) == expected {
            drop(BUCKET.1.wait(guard).unwrap());
        }
    }

    /// Loom model of FUTEX_WAKE.
    #[cfg(loom)]
    pub fn wake_all(_word: &AtomicU32) {
        let _guard = BUCKET.0.lock().unwrap();
        BUCKET.1.notify_all();
    }
}
