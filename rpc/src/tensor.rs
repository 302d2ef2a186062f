//! Tensors in RPC values.
//!
//! A [`Tensor`] is one of
//! - `Shared`: a tensorwire [`SharedTensor`] (memfd segment) of ours, ready to send;
//! - `Imported`: a tensor the peer exported to us natively ([`ImportedTensor`]: leased;
//!   released on drop);
//! - `File`: a PyTorch `file_system` shared-memory file ([`FsTensor`]);
//! - `Cuda`: device memory of ours, ready to send natively ([`CudaTensor`]);
//! - `CudaImported`: a CUDA tensor the peer exported to us natively
//!   ([`CudaImportedTensor`]: leased; released on drop). See [`crate::cuda_tensor`].
//!
//! Private copies (`to_vec`, `to_f64_vec`, `storage_copy`, `TensorValue`s) of a tensor a
//! peer sent are limited to `RpcConfig::max_tensor_copy` bytes each (the limit travels
//! with the tensor; see [`Tensor::max_copy`]): a view names its element count, and a
//! stride-0 view of a 4-byte storage can name 2^28 elements.
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
use crate::limits::{check_tensor_copy, try_with_capacity, try_zeroed};
use std::sync::Arc;
use tensorwire::{DType, Imported, Layout, SharedTensor};

pub use crate::cuda_tensor::{CudaImportedTensor, CudaTensor};
pub use crate::fs_tensor::{FS_DATA_OFFSET, FsTensor};

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
    Imported(Arc<ImportedTensor>),
    File(Arc<FsTensor>),
    Cuda(Arc<CudaTensor>),
    CudaImported(Arc<CudaImportedTensor>),
}

/// A tensor the peer exported to us natively, with the copy limit of the connection it
/// arrived on (`RpcConfig::max_tensor_copy`). Derefs to the transport's [`Imported`].
pub struct ImportedTensor {
    imported: Imported,
    max_copy: usize,
}

impl ImportedTensor {
    pub fn new(imported: Imported, max_copy: usize) -> ImportedTensor {
        ImportedTensor { imported, max_copy }
    }
    /// Largest private copy of this tensor allowed, in bytes.
    pub fn max_copy(&self) -> usize {
        self.max_copy
    }
    /// The transport's import (e.g. to release it explicitly).
    pub fn into_inner(self) -> Imported {
        self.imported
    }
}

impl std::ops::Deref for ImportedTensor {
    type Target = Imported;
    fn deref(&self) -> &Imported {
        &self.imported
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            Tensor::Shared(_) => "Shared",
            Tensor::Imported(_) => "Imported",
            Tensor::File(_) => "File",
            Tensor::Cuda(_) => "Cuda",
            Tensor::CudaImported(_) => "CudaImported",
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
            Tensor::File(t) => t.layout(),
            Tensor::Cuda(t) => t.layout(),
            Tensor::CudaImported(t) => t.layout(),
        }
    }

    /// Largest private copy of this tensor allowed, in bytes: `RpcConfig::max_tensor_copy`
    /// of the connection a peer's tensor arrived on; unlimited for tensors made here.
    pub fn max_copy(&self) -> usize {
        match self {
            Tensor::Shared(_) | Tensor::Cuda(_) => usize::MAX,
            Tensor::Imported(t) => t.max_copy(),
            Tensor::File(t) => t.max_copy(),
            Tensor::CudaImported(t) => t.max_copy(),
        }
    }

    /// The CUDA device the tensor lives on; `None` for CPU tensors.
    pub fn cuda_device(&self) -> Option<i32> {
        match self {
            Tensor::Cuda(t) => Some(t.device()),
            Tensor::CudaImported(t) => Some(t.device()),
            _ => None,
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
        let layout = self.layout();
        let nbytes = match self {
            Tensor::Shared(t) => t.storage_nbytes(),
            Tensor::Imported(t) => t.storage_nbytes(),
            Tensor::File(t) => t.storage_size(),
            Tensor::Cuda(_) | Tensor::CudaImported(_) => return Err(crate::cuda_tensor::no_host_copy(&layout, "a host copy of the storage")),
        };
        let what = || format!("a copy of the storage of a {layout:?} tensor");
        let n = check_tensor_copy(what, nbytes as u64, self.max_copy())?;
        let mut v = try_zeroed(n, what)?;
        match self {
            Tensor::Shared(t) => t.read_storage(0, &mut v)?,
            Tensor::Imported(t) => t.read_storage(0, &mut v)?,
            Tensor::File(t) => v.copy_from_slice(t.storage()),
            Tensor::Cuda(_) | Tensor::CudaImported(_) => return Err(crate::cuda_tensor::no_host_copy(&layout, "a host copy of the storage")),
        }
        Ok((v, layout))
    }

    /// The view's elements packed row-major (a private copy).
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let layout = self.layout();
        if self.cuda_device().is_some() {
            return Err(crate::cuda_tensor::no_host_copy(&layout, "a packed host copy"));
        }
        check_tensor_copy(|| format!("a packed copy of a {layout:?} tensor"), layout.packed_bytes(), self.max_copy())?;
        match self {
            Tensor::Shared(t) => Ok(t.to_vec()?),
            Tensor::Imported(t) => Ok(t.to_vec()?),
            Tensor::File(t) => {
                let mut v = Vec::new();
                // SAFETY: the mapping holds `storage_size` bytes after the header, and
                // `open`/`create` checked the layout's extent fits in them.
                unsafe { layout.gather(t.data_ptr(), &mut v) }?;
                Ok(v)
            }
            Tensor::Cuda(_) | Tensor::CudaImported(_) => Err(crate::cuda_tensor::no_host_copy(&layout, "a packed host copy")),
        }
    }

    /// Elements converted to f64 (numeric dtypes commonly used; others are an error).
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        let layout = self.layout();
        let dt = layout.dtype;
        if !matches!(
            dt,
            DType::Float32
                | DType::Float64
                | DType::Int8
                | DType::UInt8
                | DType::Int16
                | DType::Int32
                | DType::Int64
                | DType::UInt16
                | DType::UInt32
                | DType::UInt64
                | DType::Bool
        ) {
            return Err(RpcError::InvalidArgument(format!("no f64 conversion for dtype {}", dt.name())));
        }
        // Checked before the packed copy: the f64s are the larger of the two.
        let what = || format!("the f64 elements of a {layout:?} tensor");
        let n = check_tensor_copy(what, layout.numel().saturating_mul(8), self.max_copy())? / 8;
        let raw = self.to_vec()?;
        let mut out: Vec<f64> = try_with_capacity(n, what)?;
        macro_rules! conv {
            ($t:ty) => {
                out.extend(raw.chunks_exact(std::mem::size_of::<$t>()).map(|c| <$t>::from_ne_bytes(c.try_into().unwrap()) as f64))
            };
        }
        match dt {
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
            _ => out.extend(raw.iter().map(|&b| f64::from(u8::from(b != 0)))),
        }
        Ok(out)
    }

    /// Same underlying object (not value equality).
    pub fn same_as(&self, other: &Tensor) -> bool {
        match (self, other) {
            (Tensor::Shared(a), Tensor::Shared(b)) => {
                Arc::ptr_eq(a.segment(), b.segment()) && a.layout() == b.layout() && a.storage_offset_bytes() == b.storage_offset_bytes()
            }
            (Tensor::Imported(a), Tensor::Imported(b)) => Arc::ptr_eq(a, b),
            (Tensor::File(a), Tensor::File(b)) => Arc::ptr_eq(a, b),
            (Tensor::Cuda(a), Tensor::Cuda(b)) => Arc::ptr_eq(a, b),
            (Tensor::CudaImported(a), Tensor::CudaImported(b)) => Arc::ptr_eq(a, b),
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

pub(crate) fn int_field(m: &Map, k: &str) -> Result<i64> {
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

pub(crate) fn layout_fields(out: &mut Map, l: &Layout) {
    out.insert("dtype".into(), Value::Str(format!("torch.{}", l.dtype.name())));
    out.insert("tensor_size".into(), Value::Array(l.sizes().iter().map(|&s| Value::Int(s)).collect()));
    out.insert("tensor_stride".into(), Value::Array(l.strides().iter().map(|&s| Value::Int(s)).collect()));
    out.insert("tensor_offset".into(), Value::Int(l.storage_offset));
}

/// A tensor as pyisolate's `TensorValue` (data inline as nested lists; used over TCP,
/// where no memory can be shared). Numeric and bool dtypes only.
pub fn to_tensor_value(t: &Tensor) -> Result<Value> {
    let l = t.layout();
    // An f64 and a `Value` per element.
    let per_elem = (8 + std::mem::size_of::<Value>()) as u64;
    check_tensor_copy(|| format!("a TensorValue of a {l:?} tensor"), l.numel().saturating_mul(per_elem), t.max_copy())?;
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
/// `cuda_device`: `Some(n)` for a CUDA tensor (`"device": "cuda:n"`); CPU tensors carry
/// no `device` field (as they always have).
pub fn native_ref(tag: u64, layout: &Layout, cuda_device: Option<i32>) -> Value {
    let mut m = Map::new();
    m.insert("__type__".into(), "TensorwireTensor".into());
    m.insert("tag".into(), Value::from(tag));
    if let Some(d) = cuda_device {
        m.insert("device".into(), Value::Str(crate::cuda_tensor::device_name(d)));
    }
    layout_fields(&mut m, layout);
    Value::Object(m)
}

