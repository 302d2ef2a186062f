//! PyTorch `file_system` shared-memory tensors: `/dev/shm/<key>` files laid out as
//! PyTorch's `RefcountedMapAllocator` does (an `int32` refcount at offset 0, data at
//! offset 64), created for peers that only speak pyisolate and opened when such a peer
//! names one. The `TensorRef` dicts that name them are in [`crate::tensor`] (see there on
//! trust).
//!
//! A file this process created ([`FsTensor::create`]) is ours: mapped shared and
//! writable, it takes part in the shared refcount, and the last reference unlinks it —
//! torch's rule, so a peer that sends it back (or keeps it) shares it both ways. Any other
//! file a peer names is the peer's (or another program's): it must be a direct child of
//! [`SHM_DIR`], is opened `O_NOFOLLOW` read-only and mapped private and read-only, its
//! refcount is left alone, and it is never written, truncated or unlinked here. Which
//! files are ours is tracked by key and inode, not guessed from the name.

use crate::error::{Result, RpcError};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use tensorwire::Layout;

/// Offset of the data in a PyTorch file_system shm file (`map_alloc_alignment`).
pub const FS_DATA_OFFSET: usize = 64;

/// The directory PyTorch's (and so pyisolate's) file_system tensors live in. A key
/// `/name` names `SHM_DIR/name`; nothing below or beside it is ever opened.
pub const SHM_DIR: &str = "/dev/shm";

/// A PyTorch file_system shared-memory tensor: `/dev/shm/<key>`, refcount at offset 0,
/// storage at offset 64. One this process created holds one reference, and dropping the
/// last unlinks the file; one a peer named holds a private read-only mapping and nothing
/// else (see the module's text).
pub struct FsTensor {
    key: String,
    map: *mut u8,
    map_len: usize,
    storage_size: usize,
    layout: Layout,
    /// Largest private copy of this tensor's data allowed (`RpcConfig::max_tensor_copy`
    /// for a file a peer named; unlimited for our own).
    max_copy: usize,
    /// This process created the file (and it is still the file of that name): the
    /// mapping is shared and writable and this value holds a reference.
    own: Option<FileId>,
    pub requires_grad: bool,
}

// SAFETY: the mapping is plain shared memory owned by this value; all access goes through
// raw pointers with no thread affinity, and the refcount is updated atomically.
unsafe impl Send for FsTensor {}
// SAFETY: as above; &FsTensor only reads the mapping or does atomic refcount ops.
unsafe impl Sync for FsTensor {}

impl std::fmt::Debug for FsTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let whose = if self.own.is_some() { "ours" } else { "peer's, read-only" };
        write!(f, "FsTensor({}, {} bytes, {:?}, {whose})", self.key, self.storage_size, self.layout)
    }
}

static FS_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Which file a name meant when we created it: a peer that unlinks ours and puts its own
/// file under the same name does not make that file ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
}

impl FileId {
    fn of(st: &libc::stat) -> FileId {
        FileId { dev: st.st_dev, ino: st.st_ino }
    }
}

/// A file this process created, while any `FsTensor` of this process holds it.
struct Created {
    id: FileId,
    holders: usize,
}

/// The files this process created and still holds, by key: only these are written,
/// counted and unlinked here.
static CREATED: Mutex<BTreeMap<String, Created>> = Mutex::new(BTreeMap::new());

/// A key a peer may name: `/` then one plain file name (letters, digits, `_`, `-`, `.`;
/// no `..`), so that it can only mean a direct child of [`SHM_DIR`].
fn valid_key(key: &str) -> bool {
    let Some(rest) = key.strip_prefix('/') else { return false };
    !rest.is_empty()
        && rest.len() <= 200
        && rest.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-' || c == b'.')
        && rest != "."
        && !rest.contains("..")
}

/// At most `n` characters of a peer's string, for an error message.
pub(crate) fn clip(s: &str, n: usize) -> String {
    match s.char_indices().nth(n) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_owned(),
    }
}

/// [`SHM_DIR`], opened once (`O_PATH`: only to name files relative to it).
fn shm_dir() -> Result<BorrowedFd<'static>> {
    static DIR: OnceLock<OwnedFd> = OnceLock::new();
    if DIR.get().is_none() {
        let c = CString::new(SHM_DIR).expect("no NUL in SHM_DIR");
        // SAFETY: `c` is a valid NUL-terminated path; plain syscall wrapper.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(RpcError::io(&format!("opening {SHM_DIR} (file_system tensors live there)"), std::io::Error::last_os_error()));
        }
        // SAFETY: fresh fd from the kernel, owned by nobody else. A racing thread's
        // `set` wins and this one is closed.
        let _ = DIR.set(unsafe { OwnedFd::from_raw_fd(fd) });
    }
    Ok(DIR.get().expect("set above").as_fd())
}

/// The file name of a key checked by [`valid_key`] (or made by `create`).
fn name_of(key: &str) -> std::io::Result<CString> {
    CString::new(key.trim_start_matches('/')).map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "shm key contains NUL"))
}

/// Open `SHM_DIR/<key>` without following a symlink and without blocking (a FIFO put
/// there would otherwise block the open until someone writes it).
fn open_in_shm(key: &str, flags: libc::c_int) -> std::io::Result<OwnedFd> {
    let dir = shm_dir().map_err(|e| std::io::Error::other(e.to_string()))?;
    let c = name_of(key)?;
    // SAFETY: `dir` is an open directory fd and `c` a valid NUL-terminated name.
    let fd = unsafe {
        libc::openat(dir.as_raw_fd(), c.as_ptr(), flags | libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_NOCTTY | libc::O_NONBLOCK, 0o600)
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fresh fd from the kernel, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Unlink `SHM_DIR/<key>` if the name still means the file we created (`id`). A file a
/// peer put under the name since is left alone; one already gone (a torch peer dropped
/// the last reference) is fine.
fn unlink_ours(key: &str, id: FileId) {
    let (Ok(dir), Ok(c)) = (shm_dir(), name_of(key)) else { return };
    // SAFETY: zeroed `stat` is a valid bit pattern; fstatat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `dir` is an open directory fd, `c` a valid name, `st` a valid out-pointer.
    if unsafe { libc::fstatat(dir.as_raw_fd(), c.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) } != 0 || FileId::of(&st) != id {
        return;
    }
    // SAFETY: as above; removes only the name, which was just seen to be our file.
    unsafe { libc::unlinkat(dir.as_raw_fd(), c.as_ptr(), 0) };
}

fn map(fd: &OwnedFd, len: usize, own: bool) -> Result<*mut u8> {
    // Ours: shared and writable (the refcount and data are shared with the peer). A
    // peer's: private and read-only, so nothing this process does reaches the file.
    let (prot, flags) = if own { (libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED) } else { (libc::PROT_READ, libc::MAP_PRIVATE) };
    // SAFETY: mapping `len` bytes of an open file we checked is at least that long;
    // failure is reported as MAP_FAILED.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd.as_raw_fd(), 0) };
    if p == libc::MAP_FAILED {
        return Err(RpcError::io("mmap (file_system tensor)", std::io::Error::last_os_error()));
    }
    Ok(p.cast())
}

impl FsTensor {
    fn refcount(&self) -> &AtomicI32 {
        // SAFETY: the mapping is page-aligned and at least 64 bytes; offset 0 holds the
        // int32 refcount of PyTorch's RefcountedMapAllocator, which all processes update
        // atomically. It lives as long as `self` (unmapped in Drop). Only our own files'
        // mappings are written through it (a peer's is read-only).
        unsafe { &*self.map.cast::<AtomicI32>() }
    }

    /// A new file holding `storage` (the view `layout` over it), refcount 1 (ours).
    pub fn create(layout: Layout, storage: &[u8]) -> Result<FsTensor> {
        let need = layout.extent_bytes()?;
        if need > storage.len() as u64 {
            return Err(RpcError::InvalidArgument(format!("view needs {need} bytes, storage has {}", storage.len())));
        }
        let mut rnd = [0u8; 8];
        tensorwire::os::getrandom(&mut rnd)?;
        let key = format!(
            "/tensorwire_{}_{:016x}_{}",
            std::process::id(),
            u64::from_ne_bytes(rnd),
            FS_COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        // O_EXCL: a name someone else took (or a symlink put there) is an error, never
        // opened.
        let fd = open_in_shm(&key, libc::O_RDWR | libc::O_CREAT | libc::O_EXCL).map_err(|e| RpcError::io(&format!("creating {SHM_DIR}{key}"), e))?;
        let map_len = FS_DATA_OFFSET + storage.len().max(1);
        let r = (|| {
            let id = FileId::of(&tensorwire::os::fstat(fd.as_fd())?);
            tensorwire::os::ftruncate(fd.as_fd(), map_len as u64)?;
            Ok((id, map(&fd, map_len, true)?))
        })();
        let (id, map) = match r {
            Ok(m) => m,
            Err(e) => {
                if let Ok(st) = tensorwire::os::fstat(fd.as_fd()) {
                    unlink_ours(&key, FileId::of(&st));
                }
                return Err(e);
            }
        };
        CREATED.lock().insert(key.clone(), Created { id, holders: 1 });
        let t = FsTensor { key, map, map_len, storage_size: storage.len(), layout, max_copy: usize::MAX, own: Some(id), requires_grad: false };
        // Ordering: the refcount and data are published to other processes by the RPC
        // message that names the file (a socket write, a full barrier), not by this store.
        t.refcount().store(1, Ordering::SeqCst);
        // SAFETY: the mapping has FS_DATA_OFFSET + storage.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(storage.as_ptr(), t.map.add(FS_DATA_OFFSET), storage.len()) };
        Ok(t)
    }

    /// Open a file a peer named. The name must be a plain `/name` (a direct child of
    /// [`SHM_DIR`]); the file must be a regular file (not a symlink) owned by our uid and
    /// large enough, and the view must fit in `storage_size`. A file this process created
    /// and still holds is shared again (one more reference); any other is mapped private
    /// and read-only and never written or unlinked.
    pub fn open(key: &str, storage_size: u64, layout: Layout) -> Result<FsTensor> {
        if !valid_key(key) {
            return Err(RpcError::Decode(format!(
                "shared-memory key {:?} is not a plain /name (one file directly in {SHM_DIR}; no '..', no second '/')",
                clip(key, 80)
            )));
        }
        let storage_size = usize::try_from(storage_size)
            .ok()
            .filter(|s| *s <= isize::MAX as usize - FS_DATA_OFFSET)
            .ok_or_else(|| RpcError::Decode(format!("storage_size {storage_size} is too large")))?;
        let need = layout.extent_bytes().map_err(|e| RpcError::Decode(e.to_string()))?;
        if need > storage_size as u64 {
            return Err(RpcError::Decode(format!(
                "tensor view needs {need} bytes of storage, TensorRef says the storage has {storage_size}"
            )));
        }
        let fd = open_in_shm(key, libc::O_RDONLY).map_err(|e| match e.raw_os_error() {
            // The peer's doing, not this process's trouble: refused as a bad value.
            Some(libc::ELOOP) => RpcError::Decode(format!("{SHM_DIR}{key} is a symbolic link; only a plain file directly in {SHM_DIR} is opened")),
            Some(libc::ENOENT) => RpcError::Decode(format!("{SHM_DIR}{key}, which the peer named, does not exist")),
            _ => RpcError::io(&format!("opening {SHM_DIR}{key}"), e),
        })?;
        let st = tensorwire::os::fstat(fd.as_fd())?;
        // SAFETY: plain syscall.
        let uid = unsafe { libc::geteuid() };
        if st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_uid != uid {
            return Err(RpcError::Decode(format!("{SHM_DIR}{key} is not a regular file owned by uid {uid}")));
        }
        let map_len = FS_DATA_OFFSET + storage_size.max(1);
        if (st.st_size as u64) < (FS_DATA_OFFSET + storage_size) as u64 {
            return Err(RpcError::Decode(format!(
                "{SHM_DIR}{key} has {} bytes, a {storage_size}-byte storage needs {}",
                st.st_size,
                FS_DATA_OFFSET + storage_size
            )));
        }
        let map_len = map_len.min(st.st_size as usize);
        let id = FileId::of(&st);
        let mut created = CREATED.lock();
        match created.get_mut(key) {
            Some(c) if c.id == id => {
                // Ours, sent back: share it again (writable, so reopened read-write, and
                // checked to be the same file still).
                let rw = open_in_shm(key, libc::O_RDWR).map_err(|e| RpcError::io(&format!("opening {SHM_DIR}{key}"), e))?;
                if FileId::of(&tensorwire::os::fstat(rw.as_fd())?) != id {
                    return Err(RpcError::Decode(format!("{SHM_DIR}{key} was replaced while it was being opened")));
                }
                let map = map(&rw, map_len, true)?;
                c.holders += 1;
                drop(created);
                let t = FsTensor { key: key.to_owned(), map, map_len, storage_size, layout, max_copy: usize::MAX, own: Some(id), requires_grad: false };
                t.refcount().fetch_add(1, Ordering::SeqCst);
                Ok(t)
            }
            _ => {
                drop(created);
                let map = map(&fd, map_len, false)?;
                Ok(FsTensor { key: key.to_owned(), map, map_len, storage_size, layout, max_copy: usize::MAX, own: None, requires_grad: false })
            }
        }
    }

    /// One more reference, for a `file_system` `TensorRef` in transit: its receiver
    /// drops it after opening the file. Only our own files are counted (a peer's is never
    /// written); see [`FsTensor::to_tensor_ref`].
    pub(crate) fn add_transit_ref(&self) -> bool {
        if self.own.is_none() {
            return false;
        }
        self.refcount().fetch_add(1, Ordering::SeqCst);
        true
    }

    /// Drop the reference a received `file_system` `TensorRef` carried (as torch's
    /// `rebuild_storage_filename` does with `_shared_decref`) — for a file of ours only.
    /// We hold our own reference from `open`, so this cannot reach zero unless the peer
    /// lied; then it is put back. A peer's file is not written: the reference its
    /// `TensorRef` carried stays counted in the file (its creator's to account for).
    pub(crate) fn drop_transit_ref(&self) {
        if self.own.is_none() {
            return;
        }
        if self.refcount().fetch_sub(1, Ordering::SeqCst) <= 1 {
            self.refcount().fetch_add(1, Ordering::SeqCst);
        }
    }

    pub fn key(&self) -> &str {
        &self.key
    }
    /// Whether this process created the file (and so shares, counts and may unlink it);
    /// `false`: a peer's file, mapped private and read-only here.
    pub fn is_own(&self) -> bool {
        self.own.is_some()
    }
    /// Limit private copies of this tensor (`to_vec`, `to_f64_vec`, storage copies) to
    /// `bytes` (the endpoint sets `RpcConfig::max_tensor_copy` on files a peer names).
    pub fn with_max_copy(mut self, bytes: usize) -> FsTensor {
        self.max_copy = bytes;
        self
    }
    pub fn max_copy(&self) -> usize {
        self.max_copy
    }
    pub fn layout(&self) -> Layout {
        self.layout
    }
    pub fn storage_size(&self) -> usize {
        self.storage_size
    }
    /// Current value of the shared refcount (diagnostics, tests; for a peer's file, the
    /// value it had when it was mapped or since, as the private mapping shows it).
    pub fn refcount_now(&self) -> i32 {
        self.refcount().load(Ordering::SeqCst)
    }
    /// Start of the storage. Writable only for our own files ([`FsTensor::is_own`]): a
    /// peer's is mapped read-only, and a write through this pointer faults.
    pub fn data_ptr(&self) -> *mut u8 {
        // SAFETY: the mapping is at least FS_DATA_OFFSET + 1 bytes long.
        unsafe { self.map.add(FS_DATA_OFFSET) }
    }
    /// The storage bytes. Another process may write them concurrently.
    pub fn storage(&self) -> &[u8] {
        // SAFETY: the mapping holds storage_size bytes after the header (checked at
        // create/open) and stays mapped while `self` lives.
        unsafe { std::slice::from_raw_parts(self.data_ptr(), self.storage_size) }
    }
    /// Write into the storage at byte `at` — of our own file only; a peer's file is
    /// never written here.
    pub fn write_storage(&self, at: usize, data: &[u8]) -> Result<()> {
        if self.own.is_none() {
            return Err(RpcError::InvalidArgument(format!(
                "{SHM_DIR}{} is a peer's file, mapped read-only here: write into a tensor of your own (a copy) instead",
                self.key
            )));
        }
        if at.checked_add(data.len()).is_none_or(|e| e > self.storage_size) {
            return Err(RpcError::InvalidArgument(format!("{} bytes at {at} pass the end of a {}-byte storage", data.len(), self.storage_size)));
        }
        // SAFETY: bounds checked above; our own file's mapping is shared and writable.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.data_ptr().add(at), data.len()) };
        Ok(())
    }
}

impl Drop for FsTensor {
    fn drop(&mut self) {
        if let Some(id) = self.own {
            // Under the lock: an `open` of the same key must not take a reference between
            // the last one going and the unlink.
            let mut created = CREATED.lock();
            if self.refcount().fetch_sub(1, Ordering::SeqCst) == 1 {
                unlink_ours(&self.key, id);
            }
            if let Some(c) = created.get_mut(&self.key) {
                c.holders -= 1;
                if c.holders == 0 {
                    created.remove(&self.key);
                }
            }
        }
        // SAFETY: unmapping exactly the region mapped in create/open; nothing borrows it
        // past `self`.
        unsafe { libc::munmap(self.map.cast(), self.map_len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tensorwire::DType;

    #[test]
    fn fs_open_rejects_bad_refs() {
        let l = Layout::contiguous(DType::Float32, &[4]).unwrap();
        assert!(FsTensor::open("/../etc/passwd", 16, l).is_err());
        assert!(FsTensor::open("noslash", 16, l).is_err());
        assert!(FsTensor::open("/tensorwire_does_not_exist_x", 16, l).is_err());
        let a = FsTensor::create(l, &[0u8; 16]).unwrap();
        let e = FsTensor::open(a.key(), 1 << 20, l).unwrap_err().to_string();
        assert!(e.contains("needs"), "{e}");
        let big = Layout::contiguous(DType::Float32, &[8]).unwrap();
        assert!(FsTensor::open(a.key(), 16, big).is_err(), "view larger than storage");
    }
}
