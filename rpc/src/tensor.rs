//! Tensors in RPC values.
//!
//! A [`Tensor`] is one of
//! - `Shared`: a tensorwire [`SharedTensor`] (memfd segment) of ours, ready to send;
//! - `Imported`: a tensor the peer exported to us natively (leased; released on drop);
//! - `File`: a PyTorch `file_system` shared-memory file ([`FsTensor`]).
//!
//! On the wire a tensor is either a native descriptor (storage by fd over the transport,
//! under a lease; JSON carries `{"__type__": "TensorwireTensor", "tag": N, ...}`) or, for
//! peers that only speak pyisolate, a CPU `TensorRef` with strategy `file_system` /
//! `file_system_borrowed` naming a `/dev/shm` file laid out as PyTorch's
//! `RefcountedMapAllocator` does: an `int32` refcount at offset 0, data at offset 64.
//! Whoever brings the refcount to 0 unlinks the file — the same rule torch follows, so a
//! Python peer with plain torch and this crate can share files both ways.
//!
//! Trust: file_system mode names files in `/dev/shm`, like pyisolate. A peer could name a
//! file of ours it should not see (we refuse files not owned by our uid, non-regular files
//! and odd names) or truncate a shared file under our mapping (SIGBUS). Use native mode
//! (sealed memfds passed by fd) with peers you do not trust, and set
//! `RpcConfig::accept_fs_tensors = false`.

use crate::error::{Result, RpcError};
use crate::json::{Map, Value};
use std::ffi::CString;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use tensorwire::{DType, Imported, Layout, SharedTensor};

/// Offset of the data in a PyTorch file_system shm file (`map_alloc_alignment`).
pub const FS_DATA_OFFSET: usize = 64;

/// Which `TensorRef` strategy we emit for file_system tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FsStrategy {
    /// `file_system_borrowed` (pyisolate 0.10.2's default): no reference travels with the
    /// message; the sender keeps the file alive for `RpcConfig::fs_keep` and the receiver
    /// takes its own reference when it opens the file.
    #[default]
    Borrowed,
    /// `file_system` (torch.multiprocessing's `rebuild_storage_filename` protocol): one
    /// extra reference travels with the message and the receiver drops it after opening.
    /// If the receiver never opens the file, that reference (and the file) leaks.
    Transit,
}

/// A tensor value (boxed inside [`Value`], so its size does not matter there).
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
pub enum Tensor {
    Shared(SharedTensor),
    Imported(Arc<Imported>),
    File(Arc<FsTensor>),
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            Tensor::Shared(_) => "Shared",
            Tensor::Imported(_) => "Imported",
            Tensor::File(_) => "File",
        };
        write!(f, "Tensor::{kind}({:?})", self.layout())
    }
}

impl Tensor {
    /// A new tensor in a fresh memfd segment holding `data` (packed row-major).
    pub fn from_bytes(dtype: DType, sizes: &[i64], data: &[u8]) -> Result<Tensor> {
        let layout = Layout::contiguous(dtype, sizes)?;
        if layout.packed_bytes() != data.len() as u64 {
            return Err(RpcError::InvalidArgument(format!(
                "{} bytes of data for a {:?} tensor of {} bytes",
                data.len(),
                layout,
                layout.packed_bytes()
            )));
        }
        let t = SharedTensor::zeros(layout)?;
        t.write_storage(0, data)?;
        Ok(Tensor::Shared(t))
    }

    /// A float32 tensor.
    pub fn from_f32(sizes: &[i64], data: &[f32]) -> Result<Tensor> {
        let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_ne_bytes()).collect();
        Tensor::from_bytes(DType::Float32, sizes, &bytes)
    }

    pub fn layout(&self) -> Layout {
        match self {
            Tensor::Shared(t) => *t.layout(),
            Tensor::Imported(t) => t.layout(),
            Tensor::File(t) => t.layout,
        }
    }
    pub fn dtype(&self) -> DType {
        self.layout().dtype
    }
    pub fn shape(&self) -> Vec<i64> {
        self.layout().sizes().to_vec()
    }

    /// The storage bytes (a private copy) and the view's layout over them.
    pub fn storage_copy(&self) -> Result<(Vec<u8>, Layout)> {
        match self {
            Tensor::Shared(t) => {
                let mut v = vec![0u8; t.storage_nbytes()];
                t.read_storage(0, &mut v)?;
                Ok((v, *t.layout()))
            }
            Tensor::Imported(t) => {
                let mut v = vec![0u8; t.storage_nbytes()];
                t.read_storage(0, &mut v)?;
                Ok((v, t.layout()))
            }
            Tensor::File(t) => Ok((t.storage().to_vec(), t.layout)),
        }
    }

    /// The view's elements packed row-major (a private copy).
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        match self {
            Tensor::Shared(t) => Ok(t.to_vec()?),
            Tensor::Imported(t) => Ok(t.to_vec()?),
            Tensor::File(t) => {
                let mut v = Vec::new();
                // SAFETY: the mapping holds `storage_size` bytes after the header, and
                // `open`/`create` checked the layout's extent fits in them.
                unsafe { t.layout.gather(t.data_ptr(), &mut v) }?;
                Ok(v)
            }
        }
    }

    /// Elements converted to f64 (numeric dtypes commonly used; others are an error).
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        let raw = self.to_vec()?;
        let dt = self.dtype();
        macro_rules! conv {
            ($t:ty) => {
                raw.chunks_exact(std::mem::size_of::<$t>()).map(|c| <$t>::from_ne_bytes(c.try_into().unwrap()) as f64).collect()
            };
        }
        Ok(match dt {
            DType::Float32 => conv!(f32),
            DType::Float64 => conv!(f64),
            DType::Int8 => conv!(i8),
            DType::UInt8 => conv!(u8),
            DType::Int16 => conv!(i16),
            DType::Int32 => conv!(i32),
            DType::Int64 => conv!(i64),
            DType::UInt16 => conv!(u16),
            DType::UInt32 => conv!(u32),
            DType::UInt64 => conv!(u64),
            DType::Bool => raw.iter().map(|&b| f64::from(u8::from(b != 0))).collect(),
            other => return Err(RpcError::InvalidArgument(format!("no f64 conversion for dtype {}", other.name()))),
        })
    }

    /// Same underlying object (not value equality).
    pub fn same_as(&self, other: &Tensor) -> bool {
        match (self, other) {
            (Tensor::Shared(a), Tensor::Shared(b)) => {
                Arc::ptr_eq(a.segment(), b.segment()) && a.layout() == b.layout() && a.storage_offset_bytes() == b.storage_offset_bytes()
            }
            (Tensor::Imported(a), Tensor::Imported(b)) => Arc::ptr_eq(a, b),
            (Tensor::File(a), Tensor::File(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// As a file_system tensor: `File` as is, anything else copied into a new file.
    pub fn to_fs(&self) -> Result<Arc<FsTensor>> {
        if let Tensor::File(f) = self {
            return Ok(f.clone());
        }
        let (storage, layout) = self.storage_copy()?;
        Ok(Arc::new(FsTensor::create(layout, &storage)?))
    }
}

/// `torch.float32` → `DType::Float32`.
pub fn dtype_from_torch(s: &str) -> Result<DType> {
    let name = s.strip_prefix("torch.").unwrap_or(s);
    let alias = match name {
        "float" => "float32",
        "double" => "float64",
        "half" => "float16",
        "int" => "int32",
        "long" => "int64",
        "short" => "int16",
        n => n,
    };
    DType::ALL
        .iter()
        .copied()
        .find(|d| d.name() == alias)
        .ok_or_else(|| RpcError::Decode(format!("unknown or unsupported tensor dtype {s:?}")))
}

fn int_list(m: &Map, k: &str) -> Result<Vec<i64>> {
    match m.get(k) {
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_i64().ok_or_else(|| RpcError::Decode(format!("TensorRef field {k:?} holds a non-integer"))))
            .collect(),
        _ => Err(RpcError::Decode(format!("TensorRef has no integer list {k:?}"))),
    }
}

fn int_field(m: &Map, k: &str) -> Result<i64> {
    m.get(k).and_then(Value::as_i64).ok_or_else(|| RpcError::Decode(format!("TensorRef has no integer field {k:?}")))
}

/// Layout from a TensorRef/TensorwireTensor dict (`dtype`, `tensor_size`, `tensor_stride`,
/// `tensor_offset`), validated.
pub fn layout_from_ref(m: &Map) -> Result<Layout> {
    let dtype = dtype_from_torch(m.get("dtype").and_then(Value::as_str).unwrap_or(""))?;
    let sizes = int_list(m, "tensor_size")?;
    let strides = int_list(m, "tensor_stride")?;
    let offset = int_field(m, "tensor_offset")?;
    Layout::strided(dtype, &sizes, &strides, offset).map_err(|e| RpcError::Decode(format!("bad tensor geometry: {e}")))
}

fn layout_fields(out: &mut Map, l: &Layout) {
    out.insert("dtype".into(), Value::Str(format!("torch.{}", l.dtype.name())));
    out.insert("tensor_size".into(), Value::Array(l.sizes().iter().map(|&s| Value::Int(s)).collect()));
    out.insert("tensor_stride".into(), Value::Array(l.strides().iter().map(|&s| Value::Int(s)).collect()));
    out.insert("tensor_offset".into(), Value::Int(l.storage_offset));
}

/// A PyTorch file_system shared-memory tensor: `/dev/shm/<key>`, refcount at offset 0,
/// storage at offset 64. Holding one holds one reference; dropping it drops that
/// reference and unlinks the file if it was the last.
pub struct FsTensor {
    key: String,
    map: *mut u8,
    map_len: usize,
    storage_size: usize,
    layout: Layout,
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
        tensorwire::sys::getrandom(&mut rnd)?;
        let key = format!(
            "/tensorwire_{}_{:016x}_{}",
            std::process::id(),
            u64::from_ne_bytes(rnd),
            FS_COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let fd = shm_open(&key, libc::O_RDWR | libc::O_CREAT | libc::O_EXCL)?;
        let map_len = FS_DATA_OFFSET + storage.len().max(1);
        let r = (|| {
            tensorwire::sys::ftruncate(std::os::fd::AsFd::as_fd(&fd), map_len as u64)?;
            map_shared(&fd, map_len)
        })();
        let map = match r {
            Ok(m) => m,
            Err(e) => {
                shm_unlink(&key);
                return Err(e);
            }
        };
        let t = FsTensor { key, map, map_len, storage_size: storage.len(), layout, requires_grad: false };
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
        let st = tensorwire::sys::fstat(std::os::fd::AsFd::as_fd(&fd))?;
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
        let t = FsTensor { key: key.to_owned(), map, map_len, storage_size, layout, requires_grad: false };
        t.refcount().fetch_add(1, Ordering::SeqCst);
        Ok(t)
    }

    /// Decode a CPU `TensorRef` dict (strategy `file_system` or `file_system_borrowed`).
    pub fn from_tensor_ref(m: &Map) -> Result<FsTensor> {
        match m.get("device").and_then(Value::as_str) {
            Some("cpu") => {}
            Some(d) => return Err(RpcError::Decode(format!("TensorRef on device {d:?}: only CPU TensorRefs can be opened here"))),
            None => return Err(RpcError::Decode("TensorRef has no \"device\"".into())),
        }
        let strategy = m.get("strategy").and_then(Value::as_str).unwrap_or("");
        let transit = match strategy {
            "file_system" => true,
            "file_system_borrowed" => false,
            s => return Err(RpcError::Decode(format!("unsupported CPU TensorRef strategy {s:?}"))),
        };
        let key = m.get("storage_key").and_then(Value::as_str).ok_or_else(|| RpcError::Decode("TensorRef has no storage_key".into()))?;
        let size = int_field(m, "storage_size")?;
        let size = u64::try_from(size).map_err(|_| RpcError::Decode(format!("negative storage_size {size}")))?;
        let layout = layout_from_ref(m)?;
        let mut t = FsTensor::open(key, size, layout)?;
        t.requires_grad = m.get("requires_grad").and_then(Value::as_bool).unwrap_or(false);
        if transit {
            // The sender counted one reference for the message; it is ours to drop (as
            // torch's rebuild_storage_filename does with _shared_decref). We hold our own
            // reference from `open`, so this cannot reach zero unless the peer lied.
            if t.refcount().fetch_sub(1, Ordering::SeqCst) <= 1 {
                t.refcount().fetch_add(1, Ordering::SeqCst);
            }
        }
        Ok(t)
    }

    /// The `TensorRef` dict naming this file. With `Transit`, one reference is added for
    /// the receiver to drop.
    pub fn to_tensor_ref(&self, strategy: FsStrategy) -> Value {
        let mut m = Map::new();
        m.insert("__type__".into(), "TensorRef".into());
        m.insert("device".into(), "cpu".into());
        let s = match strategy {
            FsStrategy::Borrowed => "file_system_borrowed",
            FsStrategy::Transit => {
                self.refcount().fetch_add(1, Ordering::SeqCst);
                "file_system"
            }
        };
        m.insert("strategy".into(), s.into());
        m.insert("manager_path".into(), "".into());
        m.insert("storage_key".into(), self.key.clone().into());
        m.insert("storage_size".into(), Value::from(self.storage_size as u64));
        layout_fields(&mut m, &self.layout);
        m.insert("requires_grad".into(), Value::Bool(self.requires_grad));
        Value::Object(m)
    }

    pub fn key(&self) -> &str {
        &self.key
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

/// A tensor as pyisolate's `TensorValue` (data inline as nested lists; used over TCP,
/// where no memory can be shared). Numeric and bool dtypes only.
pub fn to_tensor_value(t: &Tensor) -> Result<Value> {
    let l = t.layout();
    let flat = t.to_f64_vec()?;
    let dt = l.dtype;
    let leaf = |x: f64| match dt {
        tensorwire::DType::Float32 | tensorwire::DType::Float64 => Value::Float(x),
        tensorwire::DType::Bool => Value::Bool(x != 0.0),
        _ => Value::Int(x as i64),
    };
    fn nest(sizes: &[i64], flat: &[f64], leaf: &dyn Fn(f64) -> Value) -> Value {
        match sizes.split_first() {
            None => leaf(flat[0]),
            Some((&n, rest)) => {
                let step: usize = rest.iter().map(|&s| s as usize).product();
                Value::Array((0..n as usize).map(|i| nest(rest, &flat[i * step..(i + 1) * step], leaf)).collect())
            }
        }
    }
    let data = if flat.is_empty() && !l.sizes().is_empty() { Value::Array(vec![]) } else { nest(l.sizes(), &flat, &leaf) };
    let mut m = Map::new();
    m.insert("__type__".into(), "TensorValue".into());
    m.insert("dtype".into(), Value::Str(format!("torch.{}", dt.name())));
    m.insert("tensor_size".into(), Value::Array(l.sizes().iter().map(|&s| Value::Int(s)).collect()));
    m.insert("requires_grad".into(), Value::Bool(false));
    m.insert("data".into(), data);
    Ok(Value::Object(m))
}

/// Decode a `TensorValue` (nested lists) into a new tensor.
pub fn from_tensor_value(m: &Map) -> Result<Tensor> {
    let dtype = dtype_from_torch(m.get("dtype").and_then(Value::as_str).unwrap_or(""))?;
    let sizes = int_list(m, "tensor_size")?;
    let layout = Layout::contiguous(dtype, &sizes).map_err(|e| RpcError::Decode(e.to_string()))?;
    let numel = layout.numel();
    let mut flat: Vec<f64> = Vec::new();
    let mut stack = vec![m.get("data").ok_or_else(|| RpcError::Decode("TensorValue has no data".into()))?];
    while let Some(v) = stack.pop() {
        match v {
            Value::Array(a) => stack.extend(a.iter().rev()),
            Value::Bool(b) => flat.push(f64::from(u8::from(*b))),
            other => flat.push(other.as_f64().ok_or_else(|| RpcError::Decode(format!("TensorValue data holds a {}", other.type_name())))?),
        }
        if flat.len() as u64 > numel {
            break;
        }
    }
    if flat.len() as u64 != numel {
        return Err(RpcError::Decode(format!("TensorValue has {} elements, its size {sizes:?} needs {numel}", flat.len())));
    }
    let mut bytes = Vec::with_capacity(flat.len() * dtype.size());
    for x in flat {
        match dtype {
            DType::Float32 => bytes.extend((x as f32).to_ne_bytes()),
            DType::Float64 => bytes.extend(x.to_ne_bytes()),
            DType::Int64 => bytes.extend((x as i64).to_ne_bytes()),
            DType::Int32 => bytes.extend((x as i32).to_ne_bytes()),
            DType::Int16 => bytes.extend((x as i16).to_ne_bytes()),
            DType::Int8 => bytes.extend((x as i8).to_ne_bytes()),
            DType::UInt8 | DType::Bool => bytes.push(x as u8),
            other => return Err(RpcError::Decode(format!("TensorValue of dtype {} is not supported", other.name()))),
        }
    }
    Tensor::from_bytes(dtype, &sizes, &bytes)
}

/// The JSON for a natively sent tensor (the descriptor travels over the transport).
pub fn native_ref(tag: u64, layout: &Layout) -> Value {
    let mut m = Map::new();
    m.insert("__type__".into(), "TensorwireTensor".into());
    m.insert("tag".into(), Value::from(tag));
    layout_fields(&mut m, layout);
    Value::Object(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fs_roundtrip_and_refcount() {
        let l = Layout::contiguous(DType::Float32, &[2, 2]).unwrap();
        let data: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0].iter().flat_map(|x| x.to_ne_bytes()).collect();
        let a = FsTensor::create(l, &data).unwrap();
        assert_eq!(a.refcount_now(), 1);
        let r = a.to_tensor_ref(FsStrategy::Borrowed);
        let b = FsTensor::from_tensor_ref(r.as_object().unwrap()).unwrap();
        assert_eq!(a.refcount_now(), 2);
        assert_eq!(Tensor::File(Arc::new(b)).to_f64_vec().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
        assert_eq!(a.refcount_now(), 1);
        let r = a.to_tensor_ref(FsStrategy::Transit);
        assert_eq!(a.refcount_now(), 2);
        let c = FsTensor::from_tensor_ref(r.as_object().unwrap()).unwrap();
        assert_eq!(a.refcount_now(), 2);
        let key = a.key().to_owned();
        drop(a);
        assert!(std::path::Path::new(&format!("/dev/shm{key}")).exists());
        drop(c);
        assert!(!std::path::Path::new(&format!("/dev/shm{key}")).exists(), "last reference unlinks");
    }

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
        assert!(dtype_from_torch("torch.float32").is_ok() && dtype_from_torch("torch.nope").is_err());
    }
}
