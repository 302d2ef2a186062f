//! The [`Tensor`] an RPC value holds: which memory it names — a memfd segment of ours,
//! a tensor the peer exported to us natively, a PyTorch `file_system` file, device memory
//! of ours or the peer's, bytes in our heap — its layout, and private copies of it within
//! the copy limit.
//!
//! Private copies (`to_vec`, `to_f64_vec`, `storage_copy`) of a tensor a peer sent are
//! limited to `RpcConfig::max_tensor_copy` bytes each (the limit travels with the tensor;
//! see [`Tensor::max_copy`]): a view names its element count, and a stride-0 view of a
//! 4-byte storage can name 2^28 elements.
//!
//! What a tensor looks like on the wire is in [`crate::tensor`], which builds on the value
//! type; this module sits below it, so that [`crate::value::Value`] can hold a tensor.

use crate::cuda_tensor::{CudaTensor, no_host_copy};
use crate::error::{Result, RpcError};
use crate::fs_tensor::FsTensor;
use crate::limits::{check_tensor_copy, try_with_capacity, try_zeroed};
use std::sync::Arc;
use tensorwire::{CudaImported, DType, Imported, Layout, SharedTensor};

/// A tensor value (boxed inside [`crate::value::Value`], so its size does not matter there).
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
pub enum Tensor {
    Shared(SharedTensor),
    Imported(Arc<ImportedTensor>),
    /// Another view (layout) over the storage of a tensor the peer exported to us: sent
    /// on, it travels as the same memory (forwarded), like `Imported`. Made here only
    /// ([`Tensor::imported_view`]), never decoded from the wire.
    ImportedView(Arc<ImportedTensor>, Layout),
    File(Arc<FsTensor>),
    Cuda(Arc<CudaTensor>),
    CudaImported(Arc<CudaImportedTensor>),
    /// Packed bytes in this process's heap, shared with nothing: an ordinary small tensor
    /// to send (on a connection that negotiated inline tensors it travels inside the
    /// frame, see [`crate::tensor`]; elsewhere it is copied into a segment or file as any
    /// other private tensor), or one that arrived that way.
    Owned(Arc<OwnedTensor>),
}

/// A contiguous CPU tensor in a heap buffer of its own: no segment, no lease. The buffer
/// is 8-byte aligned (a whole number of `u64` words), enough for every dtype's elements.
#[derive(Clone)]
pub struct OwnedTensor {
    words: Vec<u64>,
    layout: Layout,
    max_copy: usize,
}

impl OwnedTensor {
    /// A zero-filled contiguous tensor of `dtype` and `sizes`; `max_copy` is the copy limit
    /// that travels with it ([`Tensor::max_copy`]). The allocation is fallible (an error,
    /// not an abort); the caller bounds the size first.
    pub fn zeroed(dtype: DType, sizes: &[i64], max_copy: usize) -> Result<OwnedTensor> {
        let layout = Layout::contiguous(dtype, sizes)?;
        let n = usize::try_from(layout.packed_bytes())
            .map_err(|_| RpcError::InvalidArgument(format!("a {layout:?} tensor is too large for this machine")))?;
        let mut words: Vec<u64> = try_with_capacity(n.div_ceil(8), || format!("an owned {layout:?} tensor"))?;
        words.resize(n.div_ceil(8), 0);
        Ok(OwnedTensor { words, layout, max_copy })
    }
    /// The packed elements.
    pub fn bytes(&self) -> &[u8] {
        let n = self.layout.packed_bytes() as usize;
        // SAFETY: `words` holds `ceil(n / 8)` initialized words, so at least `n` bytes, and
        // any byte pattern is a valid `u8`.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), n) }
    }
    /// The packed elements, to fill.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.layout.packed_bytes() as usize;
        // SAFETY: as in `bytes`; `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), n) }
    }
    /// The contiguous layout of the elements (offset 0).
    pub fn layout(&self) -> Layout {
        self.layout
    }
    /// Largest private copy of this tensor allowed, in bytes.
    pub fn max_copy(&self) -> usize {
        self.max_copy
    }
}

/// A tensor the peer exported to us natively — `T` is the transport's import, CPU
/// ([`Imported`]) or CUDA ([`CudaImported`]) — with the copy limit of the connection it
/// arrived on (`RpcConfig::max_tensor_copy`). Derefs to `T`; the lease goes back when it
/// drops.
pub struct FromPeer<T> {
    imported: T,
    max_copy: usize,
}

/// A CPU tensor the peer exported to us natively; derefs to the transport's [`Imported`]
/// (shared: a forward of it on any connection holds it too).
pub type ImportedTensor = FromPeer<Arc<Imported>>;

/// A CUDA tensor the peer exported to us natively; derefs to the transport's
/// [`CudaImported`] (`wait_on`, `data_ptr`, `storage_ptr`, `storage_nbytes`, `device`).
/// See [`crate::cuda_tensor`].
pub type CudaImportedTensor = FromPeer<CudaImported>;

impl<T> FromPeer<T> {
    pub fn new(imported: impl Into<T>, max_copy: usize) -> FromPeer<T> {
        FromPeer { imported: imported.into(), max_copy }
    }
    /// Largest private copy of this tensor allowed, in bytes.
    pub fn max_copy(&self) -> usize {
        self.max_copy
    }
    /// The transport's import, borrowed (a CPU one is an `Arc`: clone it to forward it).
    pub fn inner(&self) -> &T {
        &self.imported
    }
    /// The transport's import (e.g. to release it explicitly, or `release_after(stream)`
    /// for a CUDA one).
    pub fn into_inner(self) -> T {
        self.imported
    }
}

impl<T> std::ops::Deref for FromPeer<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.imported
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            Tensor::Shared(_) => "Shared",
            Tensor::Imported(_) => "Imported",
            Tensor::ImportedView(..) => "ImportedView",
            Tensor::File(_) => "File",
            Tensor::Cuda(_) => "Cuda",
            Tensor::CudaImported(_) => "CudaImported",
            Tensor::Owned(_) => "Owned",
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

    /// A new tensor in a heap buffer of its own holding `data` (packed row-major): sent on
    /// a connection that negotiated inline tensors and small enough, it travels inside the
    /// frame (see [`crate::tensor`]); anywhere else it is copied once into a segment or
    /// file when sent.
    pub fn owned(dtype: DType, sizes: &[i64], data: &[u8]) -> Result<Tensor> {
        let mut t = OwnedTensor::zeroed(dtype, sizes, usize::MAX)?;
        if t.bytes().len() != data.len() {
            return Err(RpcError::InvalidArgument(format!(
                "{} bytes of data for a {:?} tensor of {} bytes",
                data.len(),
                t.layout(),
                t.bytes().len()
            )));
        }
        t.bytes_mut().copy_from_slice(data);
        Ok(Tensor::Owned(Arc::new(t)))
    }

    /// `layout` over the storage of `imp` (any dtype, sizes, strides and offset whose
    /// extent lies inside the import's storage): sent on, it is forwarded as the same
    /// memory.
    pub fn imported_view(imp: Arc<ImportedTensor>, layout: Layout) -> Result<Tensor> {
        let need = layout.extent_bytes()?;
        if need > imp.storage_nbytes() as u64 {
            return Err(RpcError::InvalidArgument(format!(
                "a view {layout:?} needs {need} bytes of storage, the imported storage has {}",
                imp.storage_nbytes()
            )));
        }
        Ok(Tensor::ImportedView(imp, layout))
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
            Tensor::ImportedView(_, l) => *l,
            Tensor::File(t) => t.layout(),
            Tensor::Cuda(t) => t.layout(),
            Tensor::CudaImported(t) => t.layout(),
            Tensor::Owned(t) => t.layout(),
        }
    }

    /// Largest private copy of this tensor allowed, in bytes: `RpcConfig::max_tensor_copy`
    /// of the connection a peer's tensor arrived on; unlimited for tensors made here.
    pub fn max_copy(&self) -> usize {
        match self {
            Tensor::Shared(_) | Tensor::Cuda(_) => usize::MAX,
            Tensor::Imported(t) | Tensor::ImportedView(t, _) => t.max_copy(),
            Tensor::File(t) => t.max_copy(),
            Tensor::CudaImported(t) => t.max_copy(),
            Tensor::Owned(t) => t.max_copy(),
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
            Tensor::Imported(t) | Tensor::ImportedView(t, _) => t.storage_nbytes(),
            Tensor::File(t) => t.storage_size(),
            Tensor::Owned(t) => t.bytes().len(),
            Tensor::Cuda(_) | Tensor::CudaImported(_) => return Err(no_host_copy(&layout, "a host copy of the storage")),
        };
        let what = || format!("a copy of the storage of a {layout:?} tensor");
        let n = check_tensor_copy(what, nbytes as u64, self.max_copy())?;
        let mut v = try_zeroed(n, what)?;
        match self {
            Tensor::Shared(t) => t.read_storage(0, &mut v)?,
            Tensor::Imported(t) | Tensor::ImportedView(t, _) => t.read_storage(0, &mut v)?,
            Tensor::File(t) => v.copy_from_slice(t.storage()),
            Tensor::Owned(t) => v.copy_from_slice(t.bytes()),
            Tensor::Cuda(_) | Tensor::CudaImported(_) => return Err(no_host_copy(&layout, "a host copy of the storage")),
        }
        Ok((v, layout))
    }

    /// The view's elements packed row-major (a private copy).
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let layout = self.layout();
        if self.cuda_device().is_some() {
            return Err(no_host_copy(&layout, "a packed host copy"));
        }
        check_tensor_copy(|| format!("a packed copy of a {layout:?} tensor"), layout.packed_bytes(), self.max_copy())?;
        match self {
            Tensor::Shared(t) => Ok(t.to_vec()?),
            Tensor::Imported(t) => Ok(t.to_vec()?),
            Tensor::Owned(t) => {
                let mut v = try_with_capacity(t.bytes().len(), || format!("a packed copy of a {layout:?} tensor"))?;
                v.extend_from_slice(t.bytes());
                Ok(v)
            }
            Tensor::ImportedView(t, l) => {
                let mut v = Vec::new();
                // SAFETY: `imported_view` checked the view's extent against the storage's
                // bytes, which the import keeps mapped.
                unsafe { l.gather(t.storage_ptr(), &mut v) }?;
                Ok(v)
            }
            Tensor::File(t) => {
                let mut v = Vec::new();
                // SAFETY: the mapping holds `storage_size` bytes after the header, and
                // `open`/`create` checked the layout's extent fits in them.
                unsafe { layout.gather(t.data_ptr(), &mut v) }?;
                Ok(v)
            }
            Tensor::Cuda(_) | Tensor::CudaImported(_) => Err(no_host_copy(&layout, "a packed host copy")),
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
            (Tensor::ImportedView(a, la), Tensor::ImportedView(b, lb)) => Arc::ptr_eq(a, b) && la == lb,
            (Tensor::File(a), Tensor::File(b)) => Arc::ptr_eq(a, b),
            (Tensor::Cuda(a), Tensor::Cuda(b)) => Arc::ptr_eq(a, b),
            (Tensor::CudaImported(a), Tensor::CudaImported(b)) => Arc::ptr_eq(a, b),
            (Tensor::Owned(a), Tensor::Owned(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// As a file_system tensor: a `File` of ours as is, anything else (a peer's file
    /// included: it is never handed on) copied into a new file.
    pub fn to_fs(&self) -> Result<Arc<FsTensor>> {
        if let Tensor::File(f) = self {
            if f.is_own() {
                return Ok(f.clone());
            }
        }
        let (storage, layout) = self.storage_copy()?;
        Ok(Arc::new(FsTensor::create(layout, &storage)?))
    }
}
