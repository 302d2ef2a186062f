//! Doorbells on words inside a segment, for C code that builds its own shared-memory
//! protocol next to tensorwire's.

use super::{arg, get, guard, tw_result_e, wait_ms};
use super::segment::tw_segment_t;
use tensorwire::doorbell::{Doorbell, DoorbellWords};
use tensorwire::error::Error;

fn words(seg: &tw_segment_t, offset: usize) -> Result<&DoorbellWords, Error> {
    let size = std::mem::size_of::<DoorbellWords>();
    if offset % 4 != 0 || offset.checked_add(size).is_none_or(|e| e > seg.inner.len()) {
        return Err(Error::InvalidArgument(format!(
            "doorbell at offset {offset} must be 4-aligned with {size} bytes inside the {}-byte segment",
            seg.inner.len()
        )));
    }
    // SAFETY: offset is 4-aligned and offset+8 ≤ len (checked), inside a live mapping
    // owned by `seg`; DoorbellWords is two AtomicU32 and is only accessed atomically.
    Ok(unsafe { &*seg.inner.as_ptr().add(offset).cast::<DoorbellWords>() })
}

/// Current sequence of the doorbell at `offset` in `seg` (8 bytes, 4-aligned).
///
/// # Safety
/// `seg` must be a live handle; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_doorbell_current(seg: *const tw_segment_t, offset: usize, out: *mut u32) -> tw_result_e {
    // SAFETY: forwarded from this function's contract.
    unsafe { get("tw_doorbell_current", (seg, "seg"), out, |s| Ok(Doorbell::new(words(s, offset)?).current())) }
}

/// Ring the doorbell: bump its sequence and wake sleepers (FUTEX_WAKE only if any).
///
/// # Safety
/// `seg` must be a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_doorbell_ring(seg: *const tw_segment_t, offset: usize) -> tw_result_e {
    guard("tw_doorbell_ring", || {
        // SAFETY: live handle per the contract; NULL refused.
        Doorbell::new(words(unsafe { arg(seg, "seg")? }, offset)?).ring();
        Ok(())
    })
}

/// Wait until the sequence differs from `seen`: spin `spin` times, then sleep in
/// FUTEX_WAIT, as `timeout_ms` says (0: spin not at all). `TW_ERR_TIMEOUT` if it did not
/// change in time.
///
/// # Safety
/// `seg` must be a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_doorbell_wait(
    seg: *const tw_segment_t,
    offset: usize,
    seen: u32,
    spin: u32,
    timeout_ms: i64,
) -> tw_result_e {
    guard("tw_doorbell_wait", || {
        // SAFETY: live handle per the contract; NULL refused.
        let d = Doorbell::new(words(unsafe { arg(seg, "seg")? }, offset)?);
        let wait = wait_ms(timeout_ms);
        if d.wait(seen, spin, wait) {
            Ok(())
        } else {
            Err(tensorwire::ffi_support::timed_out(wait, "the doorbell").into())
        }
    })
}
