//! The wrapper of every exported call: initialisation check, injected faults, and no
//! unwinding into the caller's C frames. Above `result` (the codes) and `context`.

use crate::result::*;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Run one exported call: the driver must be initialised (unless `needs_init` is false),
/// an injected fault answers first, and a panic becomes CUDA_ERROR_UNKNOWN (never unwinds
/// into the caller's C frames).
pub fn guard(name: &'static str, needs_init: bool, f: impl FnOnce() -> R) -> CuResult {
    crate::stats::called(name);
    if needs_init && !crate::context::initialised() {
        return NOT_INITIALIZED;
    }
    if let Some(code) = crate::faults::hit(name) {
        return code;
    }
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => {
            eprintln!("simcuda: {name} panicked (a bug in simcuda); returning CUDA_ERROR_UNKNOWN");
            UNKNOWN
        }
    }
}
