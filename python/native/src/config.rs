//! The connection options of the opening ops (`from_fd`, `connect`, `accept`) as one
//! `PeerConfig`: the ten keyword-only ints of `TW_CONNECTION_OPTIONS` (cpp/src/common.h),
//! checked and mapped exactly as `cpp/src/connection.cpp`'s `peer_config` does through the
//! C ABI's `tw_peer_config_t` (src/ffi/config.rs): 0 keeps the library's default,
//! `cuda_ring_device` -1 is no GPU ring, and a bad value is refused under its own name with
//! the extension's message (a plain `tensorwire.Error`, no code, as a `TORCH_CHECK` reads
//! after `translate`).

use crate::errors::{IntoPy, raise};
use pyo3::prelude::*;
use std::time::Duration;
use tensorwire::cuda::CudaWait;
use tensorwire::cuda::ring::CudaRingConfig;
use tensorwire::{PeerConfig, Wait};

/// How many options there are (the length of the list Python passes, schema order).
pub const OPTION_COUNT: usize = 10;

/// The C convention of a wait in ms: < 0 no limit, 0 do not wait, n > 0 at most n ms.
pub fn wait_ms(ms: i64) -> Wait {
    match ms {
        ..0 => Wait::Forever,
        0 => Wait::Never,
        ms => Wait::For(Duration::from_millis(ms.unsigned_abs())),
    }
}

fn check(py: Python<'_>, ok: bool, message: String) -> PyResult<()> {
    if ok { Ok(()) } else { Err(raise(py, "Error", None, message)) }
}

/// `options` in schema order: max_leases, max_lease_bytes, window_ms, handshake_timeout_ms,
/// ring_bytes, cuda_ring_device, cuda_ring_slot_bytes, cuda_ring_slots, cuda_wait,
/// cuda_wait_timeout_ms (`None`: every option at its default).
pub fn peer_config(py: Python<'_>, options: Option<Vec<i64>>) -> PyResult<PeerConfig> {
    let o = options.unwrap_or_else(|| vec![0, 0, 0, 0, 0, -1, 0, 0, 0, 0]);
    let Ok::<[i64; OPTION_COUNT], _>(
        [max_leases, max_lease_bytes, window_ms, handshake_timeout_ms, ring_bytes, cuda_ring_device, cuda_ring_slot_bytes,
         cuda_ring_slots, cuda_wait, cuda_wait_timeout_ms],
    ) = o.clone().try_into()
    else {
        return Err(crate::errors::refused(py, format!("tensorwire: {} connection options, expected {OPTION_COUNT}", o.len())));
    };
    let u32_max = i64::from(u32::MAX);
    check(py, (0..=u32_max).contains(&max_leases), format!("tensorwire: max_leases must be in [0, 2^32), got {max_leases}"))?;
    check(py, max_lease_bytes >= 0, format!("tensorwire: max_lease_bytes must be >= 0, got {max_lease_bytes}"))?;
    check(py, window_ms >= 0, format!("tensorwire: window_ms must be >= 0, got {window_ms}"))?;
    check(
        py,
        handshake_timeout_ms >= -1,
        format!("tensorwire: handshake_timeout_ms must be -1 (no limit), 0 (the default) or > 0, got {handshake_timeout_ms}"),
    )?;
    check(py, ring_bytes >= 0, format!("tensorwire: ring_bytes must be >= 0 (0: the default), got {ring_bytes}"))?;
    check(
        py,
        (-1..=255).contains(&cuda_ring_device),
        format!("tensorwire: cuda_ring_device must be -1 (no GPU ring) or a device index, got {cuda_ring_device}"),
    )?;
    check(
        py,
        cuda_ring_slot_bytes >= 0,
        format!("tensorwire: cuda_ring_slot_bytes must be >= 0 (0: the default), got {cuda_ring_slot_bytes}"),
    )?;
    check(
        py,
        (0..=u32_max).contains(&cuda_ring_slots),
        format!("tensorwire: cuda_ring_slots must be in [0, 2^32) (0: the default), got {cuda_ring_slots}"),
    )?;
    check(
        py,
        (0..=2).contains(&cuda_wait),
        format!("tensorwire: cuda_wait must be 0 (stream), 1 (host) or 2 (event), got {cuda_wait}"),
    )?;
    check(
        py,
        cuda_wait_timeout_ms >= -1,
        format!("tensorwire: cuda_wait_timeout_ms must be -1 (no limit), 0 (the default) or > 0, got {cuda_wait_timeout_ms}"),
    )?;
    // In range from here on: the conversions below cannot fail.
    let as_u32 = |v: i64| u32::try_from(v).unwrap_or(u32::MAX);
    let as_u64 = |v: i64| v.unsigned_abs();
    let mut c = PeerConfig::default();
    if max_leases != 0 {
        c.max_leases = as_u32(max_leases);
    }
    if max_lease_bytes != 0 {
        c.max_lease_bytes = as_u64(max_lease_bytes);
    }
    if window_ms != 0 {
        c.default_window = Some(Duration::from_millis(as_u64(window_ms)));
    }
    if handshake_timeout_ms != 0 {
        c.handshake_timeout = wait_ms(handshake_timeout_ms);
    }
    if ring_bytes != 0 {
        c.ring_bytes = usize::try_from(ring_bytes).unwrap_or(usize::MAX);
    }
    if cuda_ring_device >= 0 {
        let d = CudaRingConfig::default();
        c.cuda_ring = Some(CudaRingConfig {
            device: i32::try_from(cuda_ring_device).unwrap_or(-1),
            slots: if cuda_ring_slots != 0 { as_u32(cuda_ring_slots) } else { d.slots },
            slot_bytes: if cuda_ring_slot_bytes != 0 { as_u64(cuda_ring_slot_bytes) } else { d.slot_bytes },
        });
    }
    // As the extension: the option always sets the policy (0 is `stream`).
    c.cuda_wait = CudaWait::from_code(as_u32(cuda_wait)).py_err(py)?;
    if cuda_wait_timeout_ms != 0 {
        c.cuda_wait_timeout = wait_ms(cuda_wait_timeout_ms);
    }
    Ok(c)
}

/// Check `options` (schema order) as the opening ops do, opening nothing: `accept` checks
/// them before it looks at its listener handle, as the extension does.
#[pyfunction]
pub fn check_connection_options(py: Python<'_>, options: Vec<i64>) -> PyResult<()> {
    peer_config(py, Some(options)).map(drop)
}
