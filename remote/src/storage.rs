//! What an exporter can export (a byte range kept alive by its owner) and what an import
//! writes into.

/// A contiguous byte range whose owner keeps it alive and in place.
///
/// The exporter holds the value (and so the memory) from the export until it is
/// released or its scope is dropped and no send still reads it; only then is it dropped.
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

/// A contiguous writable byte range an import fills, owned by the import until it returns.
///
/// The importer takes the value, hands the range to the engine, and gives the value back
/// when the bytes are in. If the transfer cannot be stopped at once (a timeout or a lost
/// peer with a receive in flight), the importer keeps the value until the engine is done
/// with the range, so nothing is ever written into memory that was given back or freed.
///
/// # Safety
/// For as long as the value lives, `as_mut_ptr()..as_mut_ptr() + len()` must be writable
/// memory of this process that does not move, is not freed, and is not read or written by
/// anyone else while the importer holds the value; both methods must return the same
/// values on every call.
pub unsafe trait Destination: Send + 'static {
    /// Start of the range.
    fn as_mut_ptr(&mut self) -> *mut u8;
    /// Length of the range in bytes.
    fn len(&self) -> usize;
    /// Whether the range is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// SAFETY: a `Vec<u8>`'s heap buffer stays in place while the vector lives unmodified; the
// importer owns the vector while it writes into it.
unsafe impl Destination for Vec<u8> {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_slice().as_mut_ptr()
    }
    fn len(&self) -> usize {
        self.as_slice().len()
    }
}

// SAFETY: as for `Vec<u8>`.
unsafe impl Destination for Box<[u8]> {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        (**self).as_mut_ptr()
    }
    fn len(&self) -> usize {
        (**self).len()
    }
}
