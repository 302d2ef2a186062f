//! Shared CPU memory segments.
//!
//! The default backing is an anonymous `memfd` sealed against shrink and grow, so a peer
//! holding the fd can never truncate it under our mapping (which would SIGBUS us). It is
//! shared by passing the fd (SCM_RIGHTS); there is no name anyone could guess. A received
//! fd is mapped only after it proves to be such a memfd and at least the size it is
//! claimed to be.
//!
//! The optional named backing (POSIX shm, `/dev/shm/tensorwire-<128 random bits>`) is for
//! peers that can take only a name. Named objects cannot be sealed, so a peer that opens
//! one could truncate it: use it only with peers you trust not to, and unlink early (the
//! creator unlinks on drop, or at once with [`Segment::unlink`] once the peer has opened).

use crate::error::{Error, Result};
use crate::sys;
use memmap2::{MmapOptions, MmapRaw};
use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Seals every memfd segment carries: no shrink (SIGBUS), no grow, no further seals.
pub const REQUIRED_SEALS: i32 = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

static NEXT_SEGMENT_ID: AtomicU64 = AtomicU64::new(1);

/// A fresh process-unique segment id (from the same counter as `Segment::id`), for
/// storage this process shows a peer that is not a `Segment` of its own (a forwarded
/// import), so that ids never collide on a connection.
pub(crate) fn next_segment_id() -> u64 {
    // Relaxed: only uniqueness matters; nothing is published through the counter.
    NEXT_SEGMENT_ID.fetch_add(1, Ordering::Relaxed)
}

/// How a segment is backed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backing {
    /// Sealed anonymous memfd, shared by fd.
    Memfd,
    /// Named POSIX shm object; `owner` is true for the creator, who unlinks it.
    Named { name: String, owner: bool },
}

/// A mapped shared-memory region.
///
/// Memory in a segment is shared with another process that may write it at any time, so
/// this type hands out raw pointers and bounds-checked copies, never `&[u8]` into the
/// mapping (a Rust reference would promise the bytes do not change).
pub struct Segment {
    id: u64,
    fd: OwnedFd,
    map: MmapRaw,
    backing: parking_lot::Mutex<Backing>,
    /// Set once [`Segment::fd`] has handed the fd out (to pass it to a peer, or anyone).
    fd_handed_out: AtomicBool,
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment").field("id", &self.id).field("len", &self.len()).field("fd", &self.fd.as_raw_fd()).finish()
    }
}

fn map_shared(fd: BorrowedFd<'_>, len: usize) -> Result<MmapRaw> {
    MmapOptions::new().len(len).map_raw(fd.as_raw_fd()).map_err(|e| Error::io("mmap (segment)", e))
}

/// Check that `fd` is a memfd sealed against shrink and grow (and not write-sealed);
/// returns its size. Nothing is mapped.
pub(crate) fn check_memfd(fd: BorrowedFd<'_>) -> Result<u64> {
    let st = sys::fstat(fd)?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(Error::InvalidSegment(format!(
            "fd is not a memfd (file type {:o}, expected a regular memfd file)",
            st.st_mode & libc::S_IFMT
        )));
    }
    let target = sys::fd_target(fd)?;
    if !target.starts_with("/memfd:") {
        return Err(Error::InvalidSegment(format!("fd is not a memfd: it refers to {target:?}")));
    }
    let seals = sys::get_seals(fd)
        .ok_or_else(|| Error::InvalidSegment("memfd does not support sealing (created without MFD_ALLOW_SEALING)".into()))?;
    if seals & REQUIRED_SEALS != REQUIRED_SEALS {
        let mut missing = Vec::new();
        if seals & libc::F_SEAL_SHRINK == 0 {
            missing.push("F_SEAL_SHRINK");
        }
        if seals & libc::F_SEAL_GROW == 0 {
            missing.push("F_SEAL_GROW");
        }
        return Err(Error::InvalidSegment(format!(
            "memfd is not sealed against resizing (missing {}): a peer could truncate it under our mapping",
            missing.join(" and ")
        )));
    }
    if seals & (libc::F_SEAL_WRITE | libc::F_SEAL_FUTURE_WRITE) != 0 {
        return Err(Error::InvalidSegment("memfd is write-sealed; tensorwire maps segments read-write".into()));
    }
    Ok(u64::try_from(st.st_size).unwrap_or(0))
}

impl Segment {
    /// Create a zero-filled segment of `len` bytes backed by a sealed memfd.
    pub fn create(len: usize) -> Result<Segment> {
        if len == 0 {
            return Err(Error::InvalidArgument("segment length must be > 0".into()));
        }
        let fd = sys::memfd_create("tensorwire")?;
        sys::ftruncate(fd.as_fd(), len as u64)?;
        sys::add_seals(fd.as_fd(), REQUIRED_SEALS | libc::F_SEAL_SEAL)?;
        let map = map_shared(fd.as_fd(), len)?;
        Ok(Segment { id: NEXT_SEGMENT_ID.fetch_add(1, Ordering::Relaxed), fd, map, backing: Backing::Memfd.into(), fd_handed_out: AtomicBool::new(false) })
    }

    /// Map a memfd received from a peer, after checking that it is a memfd, sealed
    /// against shrink and grow, and at least `min_len` bytes. The whole file is mapped:
    /// use it only where the caller chose the file's size or trusts it ([`Segment::from_fd_exact`]
    /// for control structures of a known size; imports map only the range they need).
    pub fn from_fd(fd: OwnedFd, min_len: usize) -> Result<Segment> {
        let size = check_memfd(fd.as_fd())?;
        if size < min_len as u64 || size == 0 {
            return Err(Error::InvalidSegment(format!(
                "segment too small: {min_len} bytes needed, memfd has {size}"
            )));
        }
        let len = usize::try_from(size).map_err(|_| Error::InvalidSegment(format!("segment of {size} bytes cannot be mapped")))?;
        let map = map_shared(fd.as_fd(), len)?;
        Ok(Segment { id: NEXT_SEGMENT_ID.fetch_add(1, Ordering::Relaxed), fd, map, backing: Backing::Memfd.into(), fd_handed_out: AtomicBool::new(false) })
    }

    /// Map a peer's memfd that holds a structure of `len` bytes (a ring, a lease table:
    /// the size follows from what the peer announced), allowing page rounding. A larger
    /// file is refused before anything is mapped: mapping or faulting in the peer's whole
    /// file would let it choose what the setup costs our address space and memory.
    pub fn from_fd_exact(fd: OwnedFd, len: usize, what: &str) -> Result<Segment> {
        let size = check_memfd(fd.as_fd())?;
        let page = sys::page_size();
        let max = (len as u64).div_ceil(page).max(1) * page;
        if size < len as u64 {
            return Err(Error::InvalidSegment(format!("segment too small: {what} needs {len} bytes, its memfd has {size}")));
        }
        if size > max {
            return Err(Error::InvalidSegment(format!(
                "{what} must be exactly {len} bytes (up to {max} with page rounding) for what the peer announced, its memfd has {size}"
            )));
        }
        Segment::from_fd(fd, len)
    }

    /// Check the header that a structure the peer announced (a ring, a lease table) opens
    /// with, read to private memory: magic (u64 at 0) and version (u32 at 8) as this build
    /// writes them, and the capacity field at `cap_at` (little-endian, 4 or 8 bytes) equal
    /// to what the peer's setup message `claimed`. The error names `what` and every field.
    pub(crate) fn check_header(
        &self,
        what: &str,
        (want_magic, want_version): (u64, u32),
        cap_at: std::ops::Range<usize>,
        claimed: u64,
    ) -> Result<()> {
        let mut hdr = vec![0u8; cap_at.end.max(12)];
        self.read_at(0, &mut hdr)?;
        let le = |r: std::ops::Range<usize>| hdr[r].iter().rev().fold(0u64, |v, &b| v << 8 | u64::from(b));
        let (magic, version, cap) = (le(0..8), le(8..12), le(cap_at));
        if magic != want_magic || version != u64::from(want_version) || cap != claimed {
            return Err(Error::Protocol(format!(
                "{what} header invalid (magic {magic:#x}, version {version}, capacity {cap}, claimed {claimed})"
            )));
        }
        Ok(())
    }

    /// Map an fd from a peer you trust not to truncate it: any regular shared-memory file
    /// of at least `min_len` bytes, sealed or not (e.g. a storage PyTorch shared with
    /// its `file_descriptor` strategy, which is an unsealed shm file). A peer that shrinks
    /// such a file makes this process take SIGBUS on access: never use this for fds from
    /// an untrusted peer — [`Segment::from_fd`] is the checked path.
    pub fn from_trusted_fd(fd: OwnedFd, min_len: usize) -> Result<Segment> {
        let st = sys::fstat(fd.as_fd())?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(Error::InvalidSegment(format!(
                "fd is not a regular shared-memory file (file type {:o})",
                st.st_mode & libc::S_IFMT
            )));
        }
        let size = u64::try_from(st.st_size).unwrap_or(0);
        if size < min_len as u64 || size == 0 {
            return Err(Error::InvalidSegment(format!("segment too small: {min_len} bytes needed, file has {size}")));
        }
        let len = usize::try_from(size).map_err(|_| Error::InvalidSegment(format!("file of {size} bytes cannot be mapped")))?;
        let map = map_shared(fd.as_fd(), len)?;
        Ok(Segment { id: NEXT_SEGMENT_ID.fetch_add(1, Ordering::Relaxed), fd, map, backing: Backing::Memfd.into(), fd_handed_out: AtomicBool::new(false) })
    }

    /// Create a named POSIX shm segment with an unguessable name (128 random bits). The
    /// creator unlinks it on drop; call [`Segment::unlink`] sooner once the peer has it.
    pub fn create_named(len: usize) -> Result<Segment> {
        if len == 0 {
            return Err(Error::InvalidArgument("segment length must be > 0".into()));
        }
        let mut rnd = [0u8; 16];
        sys::getrandom(&mut rnd)?;
        let name = format!("/tensorwire-{}", rnd.iter().map(|b| format!("{b:02x}")).collect::<String>());
        let c = CString::new(name.clone()).expect("generated name has no NUL");
        // SAFETY: `c` is a valid C string; O_EXCL makes this fail rather than open a file
        // someone else created under the same name.
        let raw = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC, 0o600) };
        if raw < 0 {
            return Err(Error::last_os("shm_open (create)"));
        }
        // SAFETY: fresh fd from the kernel.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let cleanup = |e: Error| {
            // SAFETY: `c` is valid; unlinking our own just-created name.
            unsafe { libc::shm_unlink(c.as_ptr()) };
            e
        };
        sys::ftruncate(fd.as_fd(), len as u64).map_err(cleanup)?;
        let map = map_shared(fd.as_fd(), len).map_err(cleanup)?;
        Ok(Segment {
            id: NEXT_SEGMENT_ID.fetch_add(1, Ordering::Relaxed),
            fd,
            map,
            backing: Backing::Named { name, owner: true }.into(),
            fd_handed_out: AtomicBool::new(false),
        })
    }

    /// Open a named segment created by a peer; it must be at least `min_len` bytes.
    pub fn open_named(name: &str, min_len: usize) -> Result<Segment> {
        if !name.starts_with('/') || name[1..].contains('/') || name.len() > 255 {
            return Err(Error::InvalidArgument(format!("shm name {name:?} must be '/' followed by a name without '/'")));
        }
        let c = CString::new(name).map_err(|_| Error::InvalidArgument("shm name contains NUL".into()))?;
        // SAFETY: `c` is a valid C string.
        let raw = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC, 0) };
        if raw < 0 {
            return Err(Error::last_os("shm_open (open by name)"));
        }
        // SAFETY: fresh fd from the kernel.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let st = sys::fstat(fd.as_fd())?;
        let size = u64::try_from(st.st_size).unwrap_or(0);
        if size < min_len as u64 || size == 0 {
            return Err(Error::InvalidSegment(format!("segment too small: {min_len} bytes needed, {name} has {size}")));
        }
        let map = map_shared(fd.as_fd(), size as usize)?;
        Ok(Segment {
            id: NEXT_SEGMENT_ID.fetch_add(1, Ordering::Relaxed),
            fd,
            map,
            backing: Backing::Named { name: name.to_owned(), owner: false }.into(),
            fd_handed_out: AtomicBool::new(false),
        })
    }

    /// Remove a named segment's name now (mappings and fds stay valid). No-op for memfd
    /// segments and for segments this process did not create.
    pub fn unlink(&self) -> Result<()> {
        let mut b = self.backing.lock();
        if let Backing::Named { name, owner: true } = &*b {
            let c = CString::new(name.as_str()).expect("stored name has no NUL");
            // SAFETY: `c` is a valid C string.
            if unsafe { libc::shm_unlink(c.as_ptr()) } < 0 {
                return Err(Error::last_os("shm_unlink"));
            }
            *b = Backing::Named { name: name.clone(), owner: false };
        }
        Ok(())
    }

    /// Process-unique id of this mapping (used to name it on a connection).
    /// The file's identity, `(st_dev, st_ino)` (one `fstat`): what a peer's import of it
    /// reports ([`crate::Imported::file_range`]).
    pub fn file_ident(&self) -> Result<(u64, u64)> {
        let st = sys::fstat(self.fd.as_fd())?;
        Ok((st.st_dev, st.st_ino))
    }
    pub fn id(&self) -> u64 {
        self.id
    }
    pub fn len(&self) -> usize {
        self.map.len()
    }
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }
    /// The fd to pass to a peer. Marks the segment as [`Segment::fd_handed_out`].
    pub fn fd(&self) -> BorrowedFd<'_> {
        // Relaxed: a reader that must see it (a recycler deciding whether to write the
        // segment again) first takes the segment back from its last holder, which orders
        // it (the holder's `Arc` drop releases, the recycler acquires).
        self.fd_handed_out.store(true, Ordering::Relaxed);
        self.fd.as_fd()
    }
    /// Whether [`Segment::fd`] was ever called: the fd may have gone to another process,
    /// which may keep the memory mapped after it gave the segment back. A recycler writes
    /// other data into a segment only where this is false.
    pub fn fd_handed_out(&self) -> bool {
        // Relaxed: see `fd`.
        self.fd_handed_out.load(Ordering::Relaxed)
    }
    pub fn backing(&self) -> Backing {
        self.backing.lock().clone()
    }
    /// Base address of the mapping. Valid for `len()` bytes while `self` lives; another
    /// process may write it concurrently.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(Error::InvalidArgument(format!(
                "range of {len} bytes at offset {offset} passes the end of a {}-byte segment",
                self.len()
            ))),
        }
    }

    /// Copy `data` into the segment at `offset`.
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check_range(offset, data.len())?;
        // SAFETY: the range was checked to lie inside the mapping, which lives as long as
        // `self`; `data` is private memory and cannot overlap a fresh mmap.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.as_ptr().add(offset), data.len()) };
        Ok(())
    }

    /// Copy `out.len()` bytes from the segment at `offset` into private memory.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check_range(offset, out.len())?;
        // SAFETY: as in `write_at`, with source and destination swapped.
        unsafe { std::ptr::copy_nonoverlapping(self.as_ptr().add(offset), out.as_mut_ptr(), out.len()) };
        Ok(())
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if let Backing::Named { name, owner: true } = &*self.backing.lock() {
            if let Ok(c) = CString::new(name.as_str()) {
                // SAFETY: `c` is a valid C string; failure (already unlinked) is harmless.
                unsafe { libc::shm_unlink(c.as_ptr()) };
            }
        }
    }
}

/// A `T` at a fixed offset of a shared segment, with the segment kept mapped for as long
/// as this handle lives (for holders that outlive any one borrow of the segment, e.g. a
/// `Connection` holding the message doorbells of two lease tables).
pub(crate) struct SharedRef<T> {
    seg: std::sync::Arc<Segment>,
    offset: usize,
    _t: std::marker::PhantomData<fn() -> T>,
}

impl<T> SharedRef<T> {
    /// The `T` at `offset` of `seg`. Panics unless it lies inside the segment, aligned.
    ///
    /// # Safety
    /// `T` must be made of atomics only (every bit pattern valid, every access atomic), as
    /// a peer may write those bytes at any time.
    pub(crate) unsafe fn new(seg: std::sync::Arc<Segment>, offset: usize) -> SharedRef<T> {
        assert!(
            offset % std::mem::align_of::<T>() == 0 && offset + std::mem::size_of::<T>() <= seg.len(),
            "shared word outside its segment or misaligned"
        );
        SharedRef { seg, offset, _t: std::marker::PhantomData }
    }

    pub(crate) fn get(&self) -> &T {
        // SAFETY: inside the live mapping and aligned (checked in `new`; the mapping is
        // page-aligned and the `Arc` keeps it mapped while the borrow lasts); `T` is
        // atomics only (the contract of `new`).
        unsafe { &*self.seg.as_ptr().add(self.offset).cast::<T>() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_is_sealed_and_roundtrips_through_from_fd() {
        let s = Segment::create(4096).unwrap();
        s.write_at(10, b"hello").unwrap();
        let dup = s.fd().try_clone_to_owned().unwrap();
        let t = Segment::from_fd(dup, 4096).unwrap();
        let mut buf = [0u8; 5];
        t.read_at(10, &mut buf).unwrap();
        assert_eq!(&buf, b"hello");
        let seals = sys::get_seals(s.fd()).unwrap();
        assert_eq!(seals & REQUIRED_SEALS, REQUIRED_SEALS);
        // The seal really holds: the kernel refuses to shrink.
        assert!(sys::ftruncate(s.fd(), 0).is_err());
    }

    #[test]
    fn fd_handed_out_is_set_by_fd_and_stays() {
        let s = Segment::create(4096).unwrap();
        s.write_at(0, b"x").unwrap();
        let _ = s.file_ident().unwrap();
        assert!(!s.fd_handed_out(), "writing and fstat hand nothing out");
        let _ = s.fd();
        assert!(s.fd_handed_out());
        assert!(s.fd_handed_out(), "once handed out, always");
    }

    #[test]
    fn check_header_refuses_each_field_by_name() {
        let s = Segment::create(4096).unwrap();
        s.write_at(0, &7u64.to_le_bytes()).unwrap();
        s.write_at(8, &2u32.to_le_bytes()).unwrap();
        s.write_at(12, &9u32.to_le_bytes()).unwrap();
        s.write_at(16, &(1u64 << 40).to_le_bytes()).unwrap();
        // A u32 capacity at 12 and a u64 one at 16, as the lease table and the ring have.
        s.check_header("table", (7, 2), 12..16, 9).unwrap();
        s.check_header("ring", (7, 2), 16..24, 1 << 40).unwrap();
        for (magic_version, claimed, needle) in [
            ((8, 2), 9, "table header invalid (magic 0x7, version 2, capacity 9, claimed 9)"),
            ((7, 1), 9, "version 2"),
            ((7, 2), 10, "capacity 9, claimed 10"),
        ] {
            let err = s.check_header("table", magic_version, 12..16, claimed).unwrap_err();
            assert!(matches!(err, Error::Protocol(_)) && err.to_string().contains(needle), "{err}");
        }
    }

    #[test]
    fn trusted_fd_maps_unsealed_shm_but_still_checks_size_and_type() {
        let fd = sys::memfd_create("unsealed").unwrap();
        sys::ftruncate(fd.as_fd(), 4096).unwrap();
        let dup = fd.try_clone().unwrap();
        assert!(Segment::from_fd(fd.try_clone().unwrap(), 1).is_err());
        let s = Segment::from_trusted_fd(dup, 4096).unwrap();
        assert_eq!(s.len(), 4096);
        {
        let e = Segment::from_trusted_fd(fd, 8192).unwrap_err();
        assert!(matches!(e, Error::InvalidSegment(_)) && e.to_string().contains("too small"), "{e}");
    }
        let (a, _b) = sys::seqpacket_pair().unwrap();
        {
        let e = Segment::from_trusted_fd(a, 1).unwrap_err();
        assert!(matches!(e, Error::InvalidSegment(_)) && e.to_string().contains("not a regular"), "{e}");
    }
    }

    #[test]
    fn out_of_range_copies_are_refused() {
        let s = Segment::create(64).unwrap();
        assert!(s.write_at(60, &[0; 8]).is_err());
        assert!(s.read_at(usize::MAX, &mut [0; 1]).is_err());
    }

    #[test]
    fn named_segment_is_shared_and_unlinked_by_creator() {
        let s = Segment::create_named(8192).unwrap();
        let Backing::Named { name, .. } = s.backing() else { panic!("not named") };
        assert_eq!(name.len(), "/tensorwire-".len() + 32);
        let t = Segment::open_named(&name, 8192).unwrap();
        s.write_at(0, &[7; 4]).unwrap();
        let mut b = [0; 4];
        t.read_at(0, &mut b).unwrap();
        assert_eq!(b, [7; 4]);
        {
        let e = Segment::open_named(&name, 1 << 20).unwrap_err();
        assert!(matches!(e, Error::InvalidSegment(_)) && e.to_string().contains("too small"), "{e}");
    }
        drop(s);
        assert!(Segment::open_named(&name, 1).is_err(), "creator must unlink on drop");
    }
}
