//! The switches that turn capabilities off (so tensorwire's fallbacks can be tested) and the
//! measured cost model (off by default), read once per process from the environment:
//!
//! - `SIMCUDA_MPS=1`: the device reports `CU_DEVICE_ATTRIBUTE_MPS_ENABLED` and
//!   cross-process event stream waits cost nothing extra (as under MPS on hardware).
//! - `SIMCUDA_XPROC_WAIT_US=N` (default 0): a `cuStreamWaitEvent` on a record made by
//!   another process sleeps N µs on the stream once the event completed (without MPS; an
//!   H200 measured ~280 µs per round trip: a GPU time-slice switch).
//! - `SIMCUDA_CTX_SWITCH_US=N` (default 0): a copy or memset that runs while the device's
//!   last engine work was another process's sleeps N µs first (without MPS; an H200
//!   measured ~140 µs a switch: `timeslice.rs`).
//! - `SIMCUDA_VALUE_WAIT_US=N` (default 0): a stream value wait sleeps N µs on the stream
//!   once its condition holds (an H200 measured ~9 µs more than a host wait).
//! - `SIMCUDA_NO_MEMOPS=1`: no stream memory operations (attributes 122/123 are
//!   0, `cuStreamWaitValue*`/`cuStreamWriteValue*` return CUDA_ERROR_NOT_SUPPORTED).
//! - `SIMCUDA_NO_HOST_REGISTER=1`: no host registration (attribute 99 is 0,
//!   `cuMemHostRegister` returns CUDA_ERROR_NOT_SUPPORTED).
//! - `SIMCUDA_EXIT_DRAIN_MS=N` (default 10000): how long a normal exit waits for queued
//!   stream work (`stream::drain_at_exit`).
//!
//! A malformed value is reported on stderr and the default used.

use std::sync::OnceLock;
use std::time::Duration;

pub struct Settings {
    pub mps: bool,
    pub xproc_wait: Duration,
    pub ctx_switch: Duration,
    pub value_wait: Duration,
    pub memops: bool,
    pub host_register: bool,
    pub exit_drain: Duration,
}

fn number(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Err(_) => default,
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            eprintln!("simcuda: ignoring {name}={v:?} (want a whole number); using {default}");
            default
        }),
    }
}

fn switch(name: &str) -> bool {
    match std::env::var(name).as_deref() {
        Err(_) | Ok("" | "0") => false,
        Ok("1") => true,
        Ok(v) => {
            eprintln!("simcuda: ignoring {name}={v:?} (want 0 or 1); off");
            false
        }
    }
}

pub fn get() -> &'static Settings {
    static S: OnceLock<Settings> = OnceLock::new();
    S.get_or_init(|| Settings {
        mps: switch("SIMCUDA_MPS"),
        xproc_wait: Duration::from_micros(number("SIMCUDA_XPROC_WAIT_US", 0)),
        ctx_switch: Duration::from_micros(number("SIMCUDA_CTX_SWITCH_US", 0)),
        value_wait: Duration::from_micros(number("SIMCUDA_VALUE_WAIT_US", 0)),
        memops: !switch("SIMCUDA_NO_MEMOPS"),
        host_register: !switch("SIMCUDA_NO_HOST_REGISTER"),
        exit_drain: Duration::from_millis(number("SIMCUDA_EXIT_DRAIN_MS", 10_000)),
    })
}
