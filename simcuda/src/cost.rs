//! The measured costs simcuda can add, so that a test or a bench without a GPU sees what
//! the hardware charges (all 0 by default: tests run at full speed). Measured on an H200,
//! driver 580, no MPS (`docs/DESIGN.md`, "CUDA events and stream order"):
//!
//! | setting | what it models | measured |
//! | --- | --- | --- |
//! | `SIMCUDA_XPROC_WAIT_US` | a stream wait on another process's IPC event: the GPU switches time slices between the two contexts | ~280 µs per round trip without MPS |
//! | `SIMCUDA_MPS=1` | MPS: the contexts share the GPU, no time-slice switch (the penalty above is not paid) | 28 µs round trip |
//! | `SIMCUDA_VALUE_WAIT_US` | a stream wait on a word (`cuStreamWaitValue32`), over a host wait | ~9 µs |

use std::sync::OnceLock;
use std::time::Duration;

fn micros(var: &str) -> Duration {
    Duration::from_micros(std::env::var(var).ok().and_then(|v| v.parse().ok()).unwrap_or(0))
}

/// True if `SIMCUDA_MPS=1`.
pub fn mps() -> bool {
    static M: OnceLock<bool> = OnceLock::new();
    *M.get_or_init(|| std::env::var("SIMCUDA_MPS").as_deref() == Ok("1"))
}

/// What a cross-process event stream wait adds once its record completed.
pub fn xproc_event_wait() -> Duration {
    static D: OnceLock<Duration> = OnceLock::new();
    if mps() {
        return Duration::ZERO;
    }
    *D.get_or_init(|| micros("SIMCUDA_XPROC_WAIT_US"))
}

/// What a stream wait on a word adds once its condition holds.
pub fn value_wait() -> Duration {
    static D: OnceLock<Duration> = OnceLock::new();
    *D.get_or_init(|| micros("SIMCUDA_VALUE_WAIT_US"))
}
