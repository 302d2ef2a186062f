//! `tw_segment_t`: a shared-memory segment. Immutable handle: safe to use from any
//! thread; the memory itself is shared with other processes and may change at any time.

use super::{arg, guard, need, put, quiet, tw_result_e};
use tensorwire::segment::Segment;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

/// Opaque segment handle.
pub struct tw_segment_t {
    pub(crate) inner: Arc<Segment>,
}

fn boxed(s: Segment) -> *mut tw_segment_t {
    Box::into_raw(Box::new(tw_segment_t { inner: Arc::new(s) }))
}

/// Create a zeroed segment of `len` bytes: a memfd sealed against shrink and grow.
///
/// # Safety
/// `out` must be valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_segment_new(len: usize, out: *mut *mut tw_segment_t) -> tw_result_e {
    guard("tw_segment_new", || {
        need(out, "out")?;
        let s = Segment::create(len)?;
        // SAFETY: `out` checked non-null; caller guarantees it is writable.
        unsafe { put(out, boxed(s), "out") }
    })
}

/// Map a memfd received from a peer after checking it is sealed against shrink and grow
/// and at least `min_len` bytes. Takes ownership of `fd` (closed on failure too).
///
/// # Safety
/// `fd` must be an open fd the caller owns; `out` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_segment_from_fd(fd: c_int, min_len: usize, out: *mut *mut tw_segment_t) -> tw_result_e {
    // SAFETY: forwarded from this function's contract.
    unsafe { map_fd("tw_segment_from_fd", fd, out, |owned| Segment::from_fd(owned, min_len)) }
}

/// Map an fd from a TRUSTED peer without requiring seals (e.g. a storage PyTorch shared
/// with its file_descriptor strategy). A peer that truncates the file makes this process
/// take SIGBUS: use `tw_segment_from_fd` for anything untrusted. Takes ownership of `fd`.
///
/// # Safety
/// `fd` must be an open fd the caller owns; `out` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_segment_from_trusted_fd(fd: c_int, min_len: usize, out: *mut *mut tw_segment_t) -> tw_result_e {
    // SAFETY: forwarded from this function's contract.
    unsafe { map_fd("tw_segment_from_trusted_fd", fd, out, |owned| Segment::from_trusted_fd(owned, min_len)) }
}

/// What both fd imports share: a negative `fd` refused, the fd owned from here (so
/// closed on every failure, `out` NULL included), mapped by `map`, the handle written out.
///
/// # Safety
/// `fd` an open fd the caller owns (or negative); `out` writable.
unsafe fn map_fd(
    name: &'static str,
    fd: c_int,
    out: *mut *mut tw_segment_t,
    map: impl FnOnce(OwnedFd) -> tensorwire::Result<Segment>,
) -> tw_result_e {
    guard(name, || {
        if fd < 0 {
            return Err(tensorwire::Error::InvalidArgument(format!("fd {fd} is not a valid descriptor")).into());
        }
        // SAFETY: the caller transfers ownership of the open fd to us.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        need(out, "out")?;
        let s = map(owned)?;
        // SAFETY: checked non-null above.
        unsafe { put(out, boxed(s), "out") }
    })
}

/// Create a named POSIX shm segment (unguessable name, unlinked when this handle is
/// freed). Only for peers that can take nothing but a name: named segments cannot be
/// sealed. The name is copied into `name_buf` (NUL-terminated; 64 bytes suffice).
///
/// # Safety
/// `name_buf` must be writable for `name_buf_len` bytes; `out` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_segment_new_named(
    len: usize,
    name_buf: *mut c_char,
    name_buf_len: usize,
    out: *mut *mut tw_segment_t,
) -> tw_result_e {
    guard("tw_segment_new_named", || {
        need(out, "out")?;
        need(name_buf, "name_buf")?;
        let s = Segment::create_named(len)?;
        let tensorwire::segment::Backing::Named { name, .. } = s.backing() else { unreachable!("created named") };
        if name.len() + 1 > name_buf_len {
            return Err(tensorwire::Error::InvalidArgument(format!(
                "name buffer of {name_buf_len} bytes; {} needed",
                name.len() + 1
            ))
            .into());
        }
        // SAFETY: name_buf is writable for name_buf_len ≥ name.len()+1 bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(name.as_ptr(), name_buf.cast::<u8>(), name.len());
            name_buf.add(name.len()).write(0);
        }
        // SAFETY: checked non-null above.
        unsafe { put(out, boxed(s), "out") }
    })
}

/// Open a named segment a peer created; it must be at least `min_len` bytes.
///
/// # Safety
/// `name` must be a NUL-terminated string; `out` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_segment_open_named(name: *const c_char, min_len: usize, out: *mut *mut tw_segment_t) -> tw_result_e {
    guard("tw_segment_open_named", || {
        need(out, "out")?;
        // SAFETY: caller passes a valid C string (NULL refused by `arg`).
        let name = unsafe { CStr::from_ptr(arg(name, "name")?) };
        let name = name.to_str().map_err(|_| tensorwire::Error::InvalidArgument("name is not UTF-8".into()))?;
        let s = Segment::open_named(name, min_len)?;
        // SAFETY: checked non-null above.
        unsafe { put(out, boxed(s), "out") }
    })
}

/// Free a segment handle. The mapping stays alive while leases or imports use it.
/// NULL is a no-op.
///
/// # Safety
/// `seg` must be NULL or a handle from a `tw_segment_*` constructor, not yet freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_segment_free(seg: *mut tw_segment_t) {
    // SAFETY: forwarded from this function's contract.
    unsafe { super::free_handle(seg) }
}

/// Base address of the mapping (NULL if `seg` is NULL).
///
/// # Safety
/// `seg` must be NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_segment_data(seg: *const tw_segment_t) -> *mut c_void {
    // SAFETY: NULL or live, per the contract.
    quiet(std::ptr::null_mut(), || unsafe { seg.as_ref() }.map_or(std::ptr::null_mut(), |s| s.inner.as_ptr().cast()))
}

/// Length of the mapping in bytes (0 if `seg` is NULL).
///
/// # Safety
/// `seg` must be NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_segment_len(seg: *const tw_segment_t) -> usize {
    // SAFETY: NULL or live, per the contract.
    quiet(0, || unsafe { seg.as_ref() }.map_or(0, |s| s.inner.len()))
}

/// The segment's fd (owned by the handle; dup it to keep it), or -1 if `seg` is NULL.
///
/// # Safety
/// `seg` must be NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_segment_fd(seg: *const tw_segment_t) -> c_int {
    // SAFETY: NULL or live, per the contract.
    quiet(-1, || unsafe { seg.as_ref() }.map_or(-1, |s| s.inner.fd().as_raw_fd()))
}
