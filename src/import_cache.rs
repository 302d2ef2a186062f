//! The consumer's mappings of the peer's segments.
//!
//! Each descriptor names a range of one of the peer's segments. Only that range is
//! mapped (a *window*): a peer that offers a terabyte-sized sparse file for a 4 KiB view
//! costs 4 KiB of address space, not a terabyte. Windows are cached per segment id for the
//! next descriptor naming the same range, and bounded per connection, in count and in
//! bytes: cached windows no import holds are evicted, least recently used first, before a
//! new import is refused — a producer that never says FORGET cannot pin our address space.
//!
//! The producer sends a segment's fd once into one of this connection's *fd slots*
//! (`wire::SEGMENT_FD_SLOTS`, chosen by the producer); later descriptors of that segment
//! name the slot instead of carrying the fd again, and a window evicted here is simply
//! mapped again from the slot's fd. A slot's fd is checked once, when it arrives (a
//! sealed memfd; its device and inode are the identity later windows are compared
//! with); a window is used for a slot only when it maps the same file. So what this side
//! holds for a peer is its mappings, bounded as above, and at most `SEGMENT_FD_SLOTS`
//! fds, however many segments the peer sends.
//!
//! The fd of a window that live imports hold is kept too ([`ImportFd`], one per file,
//! shared by the slot and every import of it), so an import can be forwarded to a third
//! process as the same memory (`Peer::export_imported`) even after its slot was given to
//! another segment. The cache entry keeps only a `Weak` to it: once neither a slot nor an
//! import holds it, the fd is closed.

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
    /// (st_dev, st_ino) of the file, read when the fd arrived.
    ident: (u64, u64),
    /// The file's size, read when the fd arrived: fixed since (sealed against resizing).
    len: u64,
}

impl ImportFd {
    fn new(fd: OwnedFd, ident: (u64, u64), len: u64) -> Arc<ImportFd> {
        Arc::new(ImportFd { fd, forward_id: crate::segment::next_segment_id(), ident, len })
    }
    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
    pub(crate) fn forward_id(&self) -> u64 {
        self.forward_id
    }
    pub(crate) fn ident(&self) -> (u64, u64) {
        self.ident
    }
}

struct Entry {
    window: Arc<Window>,
    /// The window's fd while some import holds it (see [`ImportFd`]).
    fd: Weak<ImportFd>,
    last_use: u64,
}

/// What an import holds of its storage: the mapping, and the fd of its file.
pub(crate) struct Resolved {
    pub window: Arc<Window>,
    pub fd: Arc<ImportFd>,
}

/// The windows of one connection, by the peer's segment id, and its fd slots.
#[derive(Default)]
pub(crate) struct ImportCache {
    entries: HashMap<u64, Entry>,
    clock: u64,
    /// Bytes of every window of this connection still mapped: cached, or held by imports
    /// after the cache replaced or dropped them.
    mapped: Arc<AtomicU64>,
    /// The fd slots (`SEGMENT_FD_SLOTS`, allocated at the first install): the segment id
    /// the producer put in each, and its fd.
    slots: Vec<Option<(u64, Arc<ImportFd>)>>,
}

impl ImportCache {
    /// Segments mapped (cached) now.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// The producer dropped segment `sid`: forget its window and empty the slot that
    /// held its fd (imports keep theirs).
    pub(crate) fn forget(&mut self, sid: u64) {
        self.entries.remove(&sid);
        for s in &mut self.slots {
            if s.as_ref().is_some_and(|(id, _)| *id == sid) {
                *s = None;
            }
        }
    }

    pub(crate) fn clear(&mut self) {
        self.entries.clear();
        self.slots.clear();
    }

    /// The window for `desc`'s storage in segment `desc.storage.segment_id`, and the fd of
    /// its file. With `fd` (arrived with the message), that fd goes into fd slot
    /// `slot`, replacing what the slot held; without, the slot must hold the fd of that
    /// segment. The window is a cached one of the same file covering the range, or a new
    /// one mapped from the fd.
    pub(crate) fn resolve(&mut self, desc: &TensorDesc, fd: Option<OwnedFd>, slot: u32, limits: Limits) -> Result<Resolved> {
        use crate::wire::messages::SEGMENT_FD_SLOTS;
        let sid = desc.storage.segment_id;
        if slot >= SEGMENT_FD_SLOTS {
            return Err(Error::Protocol(format!(
                "tensor message names fd slot {slot}; a connection has {SEGMENT_FD_SLOTS} (0..{SEGMENT_FD_SLOTS})"
            )));
        }
        if self.slots.is_empty() {
            self.slots.resize(SEGMENT_FD_SLOTS as usize, None);
        }
        let k = slot as usize;
        self.clock += 1;
        let kept = match fd {
            Some(fd) => {
                // The slot holds nothing until the new fd is checked and mapped: a bad
                // one leaves it empty, so later descriptors naming it fail clearly.
                let old = self.slots[k].take();
                let st = crate::sys::fstat(fd.as_fd())?;
                let ident = (st.st_dev, st.st_ino);
                // The fd this slot or the window's imports already hold, if it is this
                // file (the producer sends it again now and then; the received duplicate
                // is closed when dropped here), else this one.
                let same = |f: &Arc<ImportFd>| f.ident == ident;
                let shared = old
                    .map(|(_, f)| f)
                    .filter(same)
                    .or_else(|| self.entries.get(&sid).and_then(|e| e.fd.upgrade()).filter(same));
                let kept = match shared {
                    Some(f) => f,
                    None => {
                        let len = check_memfd(fd.as_fd())?;
                        ImportFd::new(fd, ident, len)
                    }
                };
                let window = self.window_for(desc, &kept, limits)?;
                self.slots[k] = Some((sid, kept.clone()));
                return Ok(Resolved { window, fd: kept });
            }
            None => match &self.slots[k] {
                Some((id, f)) if *id == sid => f.clone(),
                Some((id, _)) => {
                    return Err(Error::InvalidDescriptor(format!(
                        "descriptor names segment {sid} in fd slot {slot}, which holds the fd of segment {id}, and came without its fd"
                    )));
                }
                None => {
                    return Err(Error::InvalidDescriptor(format!(
                        "descriptor names segment {sid} in fd slot {slot}, which holds no fd (never filled, or forgotten), and came without its fd"
                    )));
                }
            },
        };
        let window = self.window_for(desc, &kept, limits)?;
        Ok(Resolved { window, fd: kept })
    }

    /// A window of `fd`'s file covering `desc`'s storage: the cached one of its segment
    /// if it maps this file and covers the range (no system call), else a new one.
    fn window_for(&mut self, desc: &TensorDesc, fd: &Arc<ImportFd>, limits: Limits) -> Result<Arc<Window>> {
        let sid = desc.storage.segment_id;
        let (offset, nbytes) = (desc.storage.base_offset, desc.storage.nbytes);
        let clock = self.clock;
        if let Some(e) = self.entries.get_mut(&sid) {
            if e.window.ident == fd.ident && e.window.covers(offset, nbytes) {
                e.last_use = clock;
                if e.fd.strong_count() == 0 {
                    e.fd = Arc::downgrade(fd);
                }
                return Ok(e.window.clone());
            }
        }
        let file_len = fd.len;
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
            .map_raw(fd.fd().as_raw_fd())
            .map_err(|e| Error::io("mmap (the peer's segment)", e))?;
        // Relaxed: a plain counter (see `Window::drop`).
        self.mapped.fetch_add(len, Ordering::Relaxed);
        let window = Arc::new(Window { map, start, end: (start + len).min(file_len), ident: fd.ident, mapped: self.mapped.clone() });
        self.entries.insert(sid, Entry { window: window.clone(), fd: Arc::downgrade(fd), last_use: clock });
        Ok(window)
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
