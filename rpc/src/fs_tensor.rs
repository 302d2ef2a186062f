//! PyTorch `file_system` shared-memory tensors: `/dev/shm/<key>` files laid out as
//! PyTorch's `RefcountedMapAllocator` does (an `int32` refcount at offset 0, data at
//! offset 64), created for peers that only speak pyisolate and opened when such a peer
//! names one. The `TensorRef` dicts that name them are in [`crate::tensor`] (see there on
//! trust).

use crate::error::{Result, RpcError};
use std::ffi::CString;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use tensorwire::Layout;

/// Offset of the data in a PyTorch file_system shm file (`map_alloc_alignment`).
pub const FS_DATA_OFFSET: usize = 64;

/// A PyTorch file_system shared-memory tensor: `/dev/shm/<key>`, refcount at offset 0,
/// storage at offset 64. Holding one holds one reference; dropping it drops that
/// reference and unlinks the file if it was the last.
pub struct FsTensor {
    key: String,
    map: *mut u8,
    map_len: usize,
    storage_size: usize,
    layout: Layout,
    /// Largest private copy of this tensor's data allowed (`RpcConfig::max_tensor_copy`
    /// for a file a peer named; unlimited for our own).
    max_copy: usize,
    pub requires_grad: bool,
}

// SAFETY: the mapping is plain shared memory owned by this value; all access goes through
// raw pointers with no thread affinity, and the refcount is updated atomically.
unsafe impl Send for FsTensor {}
// SAFETY: as above; &FsTensor only reads the mapping or does atomic refcount ops.
unsafe impl Sync for FsTensor {}

impl std::fmt::Debug for FsTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FsTensor({}, {} bytes, {:?})", self.key, self.storage_size, self.layout)
    }
}

static FS_COUNTER: AtomicU64 = AtomicU64::new(0);

fn valid_key(key: &str) -> bool {
    let Some(rest) = key.strip_prefix('/') else { return false };
    !rest.is_empty() && rest.len() <= 200 && rest.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-' || c == b'.') && rest != "." && rest != ".."
}

fn shm_open(key: &str, flags: libc::c_int) -> Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let c = CString::new(key).map_err(|_| RpcError::InvalidArgument("shm key contains NUL".into()))?;
    // SAFETY: `c` is a valid NUL-terminated name; plain syscall wrapper.
    let fd = unsafe { libc::shm_open(c.as_ptr(), flags | libc::O_CLOEXEC | libc::O_NOFOLLOW, 0o600) };
    if fd < 0 {
        return Err(RpcError::io(&format!("shm_open({key})"), std::io::Error::last_os_error()));
    }
    // SAFETY: fresh fd from the kernel, owned by nobody else.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

fn shm_unlink(key: &str) {
    if let Ok(c) = CString::new(key) {
        // SAFETY: valid NUL-terminated name. ENOENT (someone, e.g. torch_shm_manager,
        // already unlinked it) is fine.
        unsafe { libc::shm_unlink(c.as_ptr()) };
    }
}

fn map_shared(fd: &std::os::fd::OwnedFd, len: usize) -> Result<*mut u8> {
    use std::os::fd::AsRawFd;
    // SAFETY: mapping `len` bytes of an open file we checked is at least that long;
    // failure is reported as MAP_FAILED.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
    if p == libc::MAP_FAILED {
        return Err(RpcError::io("mmap (file_system tensor)", std::io::Error::last_os_error()));
    }
    Ok(p.cast())
}

impl FsTensor {
    fn refcount(&self) -> &AtomicI32 {
        // SAFETY: the mapping is page-aligned and at least 64 bytes; offset 0 holds the
        // int32 refcount of PyTorch's RefcountedMapAllocator, which all processes update
        // atomically. It lives as long as `self` (unmapped in Drop).
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
        let fd = shm_open(&key, libc::O_RDWR | libc::O_CREAT | libc::O_EXCL)?;
        let map_len = FS_DATA_OFFSET + storage.len().max(1);
        let r = (|| {
            tensorwire::os::ftruncate(std::os::fd::AsFd::as_fd(&fd), map_len as u64)?;
            map_shared(&fd, map_len)
        })();
        let map = match r {
            Ok(m) => m,
            Err(e) => {
                shm_unlink(&key);
                return Err(e);
            }
        };
        let t = FsTensor { key, map, map_len, storage_size: storage.len(), layout, max_copy: usize::MAX, requires_grad: false };
        // Ordering: the refcount and data are published to other processes by the RPC
        // message that names the file (a socket write, a full barrier), not by this store.
        t.refcount().store(1, Ordering::SeqCst);
        // SAFETY: the mapping has FS_DATA_OFFSET + storage.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(storage.as_ptr(), t.map.add(FS_DATA_OFFSET), storage.len()) };
        Ok(t)
    }

    /// Open a file a peer named: takes one reference. The name, owner, type and size are
    /// checked and the view must fit in `storage_size`.
    pub fn open(key: &str, storage_size: u64, layout: Layout) -> Result<FsTensor> {
        if !valid_key(key) {
            return Err(RpcError::Decode(format!("shared-memory key {key:?} is not a plain /name")));
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
        let fd = shm_open(key, libc::O_RDWR)?;
        let st = tensorwire::os::fstat(std::os::fd::AsFd::as_fd(&fd))?;
        // SAFETY: plain syscall.
        let uid = unsafe { libc::geteuid() };
        if st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_uid != uid {
            return Err(RpcError::Decode(format!("/dev/shm{key} is not a regular file owned by uid {uid}")));
        }
        let map_len = FS_DATA_OFFSET + storage_size.max(1);
        if (st.st_size as u64) < (FS_DATA_OFFSET + storage_size) as u64 {
            return Err(RpcError::Decode(format!(
                "/dev/shm{key} has {} bytes, a {storage_size}-byte storage needs {}",
                st.st_size,
                FS_DATA_OFFSET + storage_size
            )));
        }
        let map_len = map_len.min(st.st_size as usize);
        let map = map_shared(&fd, map_len)?;
        let t = FsTensor { key: key.to_owned(), map, map_len, storage_size, layout, max_copy: usize::MAX, requires_grad: false };
        t.refcount().fetch_add(1, Ordering::SeqCst);
        Ok(t)
    }

    /// One more reference, for a `file_system` `TensorRef` in transit: its receiver
    /// drops it after opening the file.
    pub(crate) fn add_transit_ref(&self) {
        self.refcount().fetch_add(1, Ordering::SeqCst);
    }

    /// Drop the reference a received `file_system` `TensorRef` carried (as torch's
    /// `rebuild_storage_filename` does with `_shared_decref`). We hold our own reference
    /// from `open`, so this cannot reach zero unless the peer lied; then it is put back.
    pub(crate) fn drop_transit_ref(&self) {
        if self.refcount().fetch_sub(1, Ordering::SeqCst) <= 1 {
            self.refcount().fetch_add(1, Ordering::SeqCst);
        }
    }

    pub fn key(&self) -> &str {
        &self.key
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
    /// Current value of the shared refcount (diagnostics, tests).
    pub fn refcount_now(&self) -> i32 {
        self.refcount().load(Ordering::SeqCst)
    }
    /// Start of the storage.
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
    /// Write into the storage at byte `at`.
    pub fn write_storage(&self, at: usize, data: &[u8]) -> Result<()> {
        if at.checked_add(data.len()).is_none_or(|e| e > self.storage_size) {
            return Err(RpcError::InvalidArgument(format!("{} bytes at {at} pass the end of a {}-byte storage", data.len(), self.storage_size)));
        }
        // SAFETY: bounds checked above; the mapping is writable.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.data_ptr().add(at), data.len()) };
        Ok(())
    }
}

impl Drop for FsTensor {
    fn drop(&mut self) {
        if self.refcount().fetch_sub(1, Ordering::SeqCst) == 1 {
            shm_unlink(&self.key);
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
