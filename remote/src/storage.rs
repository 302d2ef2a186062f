//! What an exporter can register: a byte range kept alive by its owner.

/// A contiguous byte range whose owner keeps it alive and in place.
///
/// The exporter holds the value (and so the memory) from registration until the export is
/// released or its scope is dropped; only then is the value dropped.
///
/// # Safety
/// For as long as the value lives, `as_ptr()..as_ptr() + len()` must be readable memory of
/// this process that does not move and is not freed; both methods must return the same
/// values on every call. Remote peers read it concurrently with the owner's threads, so the
/// owner must not rely on exclusive access to it either.
pub unsafe trait Storage: Send + 'static {
    /// Start of the range.
    fn as_ptr(&self) -> *const u8;
    /// Length of the range in bytes.
    fn len(&self) -> usize;
    /// Whether the range is empty (empty ranges cannot be exported).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// SAFETY: a `Vec<u8>`'s heap buffer does not move or get freed while the vector is alive and
// unmodified; the exporter owns the vector and never touches it until it drops it.
unsafe impl Storage for Vec<u8> {
    fn as_ptr(&self) -> *const u8 {
        self.as_slice().as_ptr()
    }
    fn len(&self) -> usize {
        self.as_slice().len()
    }
}

// SAFETY: as for `Vec<u8>`: a boxed slice's buffer is stable for the box's lifetime.
unsafe impl Storage for Box<[u8]> {
    fn as_ptr(&self) -> *const u8 {
        (**self).as_ptr()
    }
    fn len(&self) -> usize {
        (**self).len()
    }
}
