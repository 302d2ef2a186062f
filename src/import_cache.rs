//! The consumer's mappings of the peer's segments.
//!
//! Each descriptor names a range of one of the peer's segments. Only that range is
//! mapped (a *window*): a peer that offers a terabyte-sized sparse file for a 4 KiB view
//! costs 4 KiB of address space, not a terabyte. Windows are cached per segment id for the
//! next descriptor naming the same range, and bounded per connection, in count and in
//! bytes: cached windows no import holds are evicted, least recently used first, before a
//! new import is refused — a producer that never says FORGET cannot pin our address space.
//!
//! The producer sends the segment's fd with every tensor (SCM_RIGHTS), so an evicted
//! window is simply mapped again; a cached window is reused when the fd names the same
//! file (device and inode: a file once validated stays a sealed memfd) and the window
//! covers the range. Received fds are closed once mapped: what this side holds for a peer
//! is mappings only, so the peer cannot fill our fd table however many segments it sends.
//!
//! The one exception is a window that live imports hold: its fd is kept ([`ImportFd`],
//! one per window, shared by every import of it) so the import can be forwarded to a
//! third process as the same memory (`Peer::export_imported`). The cache entry keeps
//! only a `Weak` to it: once the last import of a window is gone the fd is closed, and a
//! cached window no import holds costs no fd — so what a peer can make us keep open is
//! bounded by the imports the application itself chooses to hold.

use crate::desc::TensorDesc;
use crate::error::{Error, Result};
use crate::segment::check_memfd;
use memmap2::{MmapOptions, MmapRaw};
use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

/// A mapping of one range of a peer's memfd.
pub(crate) struct Window {
    map: MmapRaw,
    /// File offset of the mapping's first byte (page-aligned).
    start: u64,
    /// File offset just past the last byte the window may serve: the end of the mapping
    /// or of the file, whichever comes first (the mapping's last page may run past the
    /// file's end; a descriptor naming those bytes names storage the file does not have).
    end: u64,
    /// (st_dev, st_ino) of the file: the identity a later fd is compared with.
    ident: (u64, u64),
    /// The connection's count of mapped bytes; this window's share is given back on drop.
    mapped: Arc<AtomicU64>,
}

impl Window {
    fn len(&self) -> u64 {
        self.map.len() as u64
    }

    fn covers(&self, offset: u64, nbytes: u64) -> bool {
        offset >= self.start && offset.saturating_add(nbytes) <= self.end
    }

    /// Address of file offset `offset`, which lies in the window (or one past its end).
    pub(crate) fn ptr_at(&self, offset: u64) -> *mut u8 {
        debug_assert!(offset >= self.start && offset - self.start <= self.len());
        // SAFETY: callers pass offsets of a descriptor this window was checked to cover,
        // so the result is inside the mapping or one past its end.
        unsafe { self.map.as_mut_ptr().add((offset - self.start) as usize) }
    }

    fn check(&self, offset: u64, len: usize) -> Result<()> {
        if !self.covers(offset, len as u64) {
            return Err(Error::InvalidArgument(format!(
                "{len} bytes at offset {offset} lie outside the mapped range {}..{} of the segment",
                self.start,
                self.end
            )));
        }
        Ok(())
    }

    /// Copy `data` to file offset `offset`.
    pub(crate) fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        // SAFETY: the range was checked to lie inside the mapping, which lives as long as
        // `self`; `data` is private memory, so the two cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr_at(offset), data.len()) };
        Ok(())
    }

    /// Copy from file offset `offset` into private memory.
    pub(crate) fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len())?;
        // SAFETY: as in `write_at`, with source and destination swapped.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr_at(offset), out.as_mut_ptr(), out.len()) };
        Ok(())
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        // Relaxed: a plain counter of bytes; nothing is published through it.
        self.mapped.fetch_sub(self.len(), Ordering::Relaxed);
    }
}

/// How much of the peer's memory one connection may keep mapped.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub max_segments: usize,
    pub max_bytes: u64,
}

/// The fd of a window's file, kept while imports of that window live (to forward them),
/// and the id under which this process shows that storage to other peers.
pub(crate) struct ImportFd {
    fd: OwnedFd,
    /// Process-unique (never reused): a forward after the last import of a window died
    /// shows the storage under a new id, so a late FORGET of the old one cannot race it.
    forward_id: u64,
}

impl ImportFd {
    fn new(fd: OwnedFd) -> Arc<ImportFd> {
        Arc::new(ImportFd { fd, forward_id: crate::segment::next_segment_id() })
    }
    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
    pub(crate) fn forward_id(&self) -> u64 {
        self.forward_id
    }
}

struct Entry {
    window: Arc<Window>,
    /// The window's fd while some import holds it (see [`ImportFd`]).
    fd: Weak<ImportFd>,
    last_use: u64,
}

/// What an import holds of its storage: the mapping, and the fd when one is known.
pub(crate) struct Resolved {
    pub window: Arc<Window>,
    pub fd: Option<Arc<ImportFd>>,
}

/// The windows of one connection, by the peer's segment id.
#[derive(Default)]
pub(crate) struct ImportCache {
    entries: HashMap<u64, Entry>,
    clock: u64,
    /// Bytes of every window of this connection still mapped: cached, or held by imports
    /// after the cache replaced or dropped them.
    mapped: Arc<AtomicU64>,
}

impl ImportCache {
    /// Segments mapped (cached) now.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// The producer dropped segment `sid`: forget its window (imports keep theirs).
    pub(crate) fn forget(&mut self, sid: u64) {
        self.entries.remove(&sid);
    }

    pub(crate) fn clear(&mut self) {
        self.entries.clear();
    }

    /// The window for `desc`'s storage in segment `desc.storage.segment_id`, mapping it
    /// from `fd` when no cached window of the same file covers it; with the window's fd
    /// (the one imports of it already share, else `fd`), if any.
    pub(crate) fn resolve(&mut self, desc: &TensorDesc, fd: Option<OwnedFd>, limits: Limits) -> Result<Resolved> {
        let sid = desc.storage.segment_id;
        let (offset, nbytes) = (desc.storage.base_offset, desc.storage.nbytes);
        self.clock += 1;
        let clock = self.clock;
        let Some(fd) = fd else {
            let e = self.entries.get_mut(&sid).ok_or_else(|| {
                Error::InvalidDescriptor(format!(
                    "descriptor names segment {sid}, which is not mapped here (never received, forgotten or evicted) and came without its fd"
                ))
            })?;
            if !e.window.covers(offset, nbytes) {
                return Err(Error::InvalidDescriptor(format!(
                    "segment too small or not mapped: descriptor needs {nbytes} bytes at offset {offset} of segment {sid}, outside the range mapped here ({}..{}), and came without its fd",
                    e.window.start, e.window.end
                )));
            }
            e.last_use = clock;
            return Ok(Resolved { window: e.window.clone(), fd: e.fd.upgrade() });
        };
        let st = crate::sys::fstat(fd.as_fd())?;
        let ident = (st.st_dev, st.st_ino);
        if let Some(e) = self.entries.get_mut(&sid) {
            if e.window.ident == ident && e.window.covers(offset, nbytes) {
                e.last_use = clock;
                // The same file: the fd imports of this window share, or this one (the
                // received duplicate is closed when dropped here).
                let shared = match e.fd.upgrade() {
                    Some(f) => f,
                    None => {
                        let f = ImportFd::new(fd);
                        e.fd = Arc::downgrade(&f);
                        f
                    }
                };
                return Ok(Resolved { window: e.window.clone(), fd: Some(shared) });
            }
        }
        let file_len = check_memfd(fd.as_fd())?;
        if file_len == 0 {
            return Err(Error::InvalidSegment("segment too small: the memfd is empty".into()));
        }
        desc.check_fits(file_len)?;
        // Page-aligned window over the storage; an empty storage maps one page at most.
        let page = crate::sys::page_size();
        let start = (offset.min(file_len - 1) / page) * page;
        let end = offset.saturating_add(nbytes).max(start + 1).min(file_len);
        let len = (end - start).div_ceil(page) * page;
        self.make_room(sid, len, limits)?;
        let len_usize = usize::try_from(len)
            .map_err(|_| Error::InvalidSegment(format!("a range of {len} bytes cannot be mapped here")))?;
        let map = MmapOptions::new()
            .offset(start)
            .len(len_usize)
            .map_raw(fd.as_raw_fd())
            .map_err(|e| Error::io("mmap (the peer's segment)", e))?;
        // Relaxed: a plain counter (see `Window::drop`).
        self.mapped.fetch_add(len, Ordering::Relaxed);
        let window = Arc::new(Window { map, start, end: (start + len).min(file_len), ident, mapped: self.mapped.clone() });
        let fd = ImportFd::new(fd);
        self.entries.insert(sid, Entry { window: window.clone(), fd: Arc::downgrade(&fd), last_use: clock });
        Ok(Resolved { window, fd: Some(fd) })
    }

    /// Evict cached windows no import holds, least recently used first, until one more
    /// window of `len` bytes for segment `sid` fits both limits.
    fn make_room(&mut self, sid: u64, len: u64, limits: Limits) -> Result<()> {
        // The window this one replaces goes first if no import holds it.
        if self.entries.get(&sid).is_some_and(|e| Arc::strong_count(&e.window) == 1) {
            self.entries.remove(&sid);
        }
        loop {
            let count = self.entries.len() + usize::from(!self.entries.contains_key(&sid));
            // Relaxed: a plain counter (see `Window::drop`).
            let mapped = self.mapped.load(Ordering::Relaxed);
            let bytes_over = mapped.saturating_add(len) > limits.max_bytes;
            if count <= limits.max_segments && !bytes_over {
                return Ok(());
            }
            // Arc::strong_count == 1: only this cache holds the window (imports hold
            // clones, and clones are only made under the cache's lock).
            let victim = self
                .entries
                .iter()
                .filter(|(_, e)| Arc::strong_count(&e.window) == 1)
                .min_by_key(|(_, e)| e.last_use)
                .map(|(&k, _)| k);
            match victim {
                Some(k) => {
                    self.entries.remove(&k);
                }
                None if bytes_over => {
                    return Err(Error::QuotaExceeded(format!(
                        "mapping {len} more bytes of the peer's segments would exceed PeerConfig::max_import_mapped_bytes = {} ({mapped} bytes are mapped, all held by live imports)",
                        limits.max_bytes
                    )));
                }
                None => {
                    return Err(Error::QuotaExceeded(format!(
                        "peer has {} segments mapped here, all held by live imports; the limit is {} (PeerConfig::max_import_segments)",
                        self.entries.len(),
                        limits.max_segments
                    )));
                }
            }
        }
    }
}
