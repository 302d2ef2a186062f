//! Tensors in RPC values, and what they look like on the wire.
//!
//! A [`Tensor`] (defined in [`crate::tensor_handle`], below the value type) is one of
//! - `Shared`: a tensorwire [`SharedTensor`] (memfd segment) of ours, ready to send;
//! - `Imported`: a tensor the peer exported to us natively ([`ImportedTensor`]: leased;
//!   released on drop);
//! - `File`: a PyTorch `file_system` shared-memory file ([`FsTensor`]);
//! - `Cuda`: device memory of ours, ready to send natively ([`CudaTensor`]);
//! - `CudaImported`: a CUDA tensor the peer exported to us natively
//!   ([`CudaImportedTensor`]: leased; released on drop). See [`crate::cuda_tensor`].
//!
//! On the wire a tensor is either a native descriptor (storage by fd over the transport,
//! under a lease; JSON carries `{"__type__": "TensorwireTensor", "tag": N, ...}`) or, for
//! peers that only speak pyisolate, a CPU `TensorRef` with strategy `file_system` /
//! `file_system_borrowed` naming a `/dev/shm` file laid out as PyTorch's
//! `RefcountedMapAllocator` does: an `int32` refcount at offset 0, data at offset 64.
//! Whoever brings the refcount of a file this process created to 0 unlinks it — the same
//! rule torch follows, so a Python peer with plain torch and this crate can share our files
//! both ways; a peer's file is only read here. Over TCP a tensor
//! is copied into the JSON as a `TensorValue` (nested lists), within
//! `RpcConfig::max_tensor_copy`.
//!
//! Trust: file_system mode names files in `/dev/shm`, like pyisolate, so a received
//! `TensorRef` is refused unless the endpoint asked for them
//! (`RpcConfig::accept_fs_tensors`, off by default; on only for a trusted pyisolate peer).
//! When on, the name must be one file directly in `/dev/shm` (no `..`, no second `/`, no
//! symlink), a regular file owned by our uid; a file this process did not create is opened
//! read-only and mapped private and read-only, and never written, truncated or unlinked
//! here (its refcount included: see [`crate::fs_tensor`]). A peer that truncates its file
//! under our mapping can still make a read of it fault (SIGBUS): use native mode (sealed
//! memfds passed by fd) with peers you do not trust.

use crate::cuda_tensor::device_name;
use crate::error::{Result, RpcError};
use crate::limits::check_tensor_copy;
use crate::value::{Map, Value};
use tensorwire::{DType, Layout};
#[cfg(doc)]
use tensorwire::SharedTensor;

pub use crate::cuda_tensor::CudaTensor;
pub use crate::fs_tensor::{FS_DATA_OFFSET, FsTensor};
pub use crate::tensor_handle::{CudaImportedTensor, FromPeer, ImportedTensor, Tensor};

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
        m.insert("device".into(), Value::Str(device_name(d)));
    }
    layout_fields(&mut m, layout);
    Value::Object(m)
}

/// The device a `TensorwireTensor`'s JSON names: `None` for CPU (no `device` field, as
/// CPU tensors have always been sent, or `"cpu"`), `Some(n)` for `"cuda:N"`.
pub(crate) fn device_from_ref(m: &Map) -> Result<Option<i32>> {
    match m.get("device") {
        None => Ok(None),
        Some(Value::Str(s)) if s == "cpu" => Ok(None),
        Some(Value::Str(s)) => s
            .strip_prefix("cuda:")
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|n| n.parse::<u8>().ok())
            .map(|n| Some(i32::from(n)))
            .ok_or_else(|| RpcError::Decode(format!("TensorwireTensor names device {s:?}; expected \"cpu\" or \"cuda:N\""))),
        Some(other) => Err(RpcError::Decode(format!("TensorwireTensor's device is a {}, not a string", other.type_name()))),
    }
}

/// The `TensorRef` dicts naming file_system tensors.
impl FsTensor {
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
            // The sender counted one reference for the message; it is ours to drop.
            t.drop_transit_ref();
        }
        Ok(t)
    }

    /// The `TensorRef` dict naming this file. With `Transit`, one reference is added for
    /// the receiver to drop — to a file of ours; a peer's file (never written here) goes
    /// as `file_system_borrowed` whatever `strategy` says.
    pub fn to_tensor_ref(&self, strategy: FsStrategy) -> Value {
        let mut m = Map::new();
        m.insert("__type__".into(), "TensorRef".into());
        m.insert("device".into(), "cpu".into());
        let s = match strategy {
            FsStrategy::Borrowed => "file_system_borrowed",
            FsStrategy::Transit if self.add_transit_ref() => "file_system",
            FsStrategy::Transit => "file_system_borrowed",
        };
        m.insert("strategy".into(), s.into());
        m.insert("manager_path".into(), "".into());
        m.insert("storage_key".into(), self.key().into());
        m.insert("storage_size".into(), Value::from(self.storage_size() as u64));
        layout_fields(&mut m, &self.layout());
        m.insert("requires_grad".into(), Value::Bool(self.requires_grad));
        Value::Object(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

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
    fn torch_dtype_names() {
        assert_eq!(dtype_from_torch("torch.float32").unwrap(), DType::Float32);
        assert_eq!(dtype_from_torch("torch.long").unwrap(), DType::Int64);
        assert!(dtype_from_torch("torch.nope").is_err());
    }

    fn with_device(v: Option<Value>) -> Map {
        let mut m = Map::new();
        if let Some(v) = v {
            m.insert("device".into(), v);
        }
        m
    }

    #[test]
    fn device_field_parses_cpu_and_cuda() {
        assert_eq!(device_from_ref(&with_device(None)).unwrap(), None);
        assert_eq!(device_from_ref(&with_device(Some(Value::Str("cpu".into())))).unwrap(), None);
        assert_eq!(device_from_ref(&with_device(Some(Value::Str(device_name(3))))).unwrap(), Some(3));
    }

    #[test]
    fn bad_device_fields_are_decode_errors() {
        for bad in ["cuda:", "cuda:-1", "cuda:+1", "cuda: 1", "cuda:256", "cuda:0x1", "gpu:0", "CUDA:0", ""] {
            match device_from_ref(&with_device(Some(Value::Str(bad.into())))) {
                Err(RpcError::Decode(m)) => assert!(m.contains("cuda:N"), "{bad:?}: {m}"),
                other => panic!("device {bad:?} gave {other:?}"),
            }
        }
        assert!(matches!(device_from_ref(&with_device(Some(Value::Int(0)))), Err(RpcError::Decode(_))));
    }
}
