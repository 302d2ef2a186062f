//! Tensors in RPC values, and what they look like on the wire.
//!
//! A [`Tensor`] (defined in [`crate::tensor_handle`], below the value type) is one of
//! - `Shared`: a tensorwire [`SharedTensor`] (memfd segment) of ours, ready to send;
//! - `Imported`: a tensor the peer exported to us natively ([`ImportedTensor`]: leased;
//!   released on drop);
//! - `File`: a PyTorch `file_system` shared-memory file ([`FsTensor`]);
//! - `Cuda`: device memory of ours, ready to send natively ([`CudaTensor`]);
//! - `CudaImported`: a CUDA tensor the peer exported to us natively
//!   ([`CudaImportedTensor`]: leased; released on drop). See [`crate::cuda_tensor`];
//! - `Owned`: packed bytes in our heap ([`OwnedTensor`]): a small private tensor to send,
//!   or one that arrived inline.
//!
//! On the wire a tensor is either a native descriptor (storage by fd over the transport,
//! under a lease; JSON carries `{"__type__": "TensorwireTensor", "tag": N, ...}`), an
//! owned tensor's bytes inside the frame where both sides negotiated it ([`inline_value`],
//! [`from_inline`]: `{"__type__": "TensorwireInline", ...}` with base64 data), its bytes
//! as a binary attachment of the frame (`tensor/attached.rs`: [`attached_value`],
//! [`Attachments`]), or, for
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
pub use crate::tensor_handle::{CudaImportedTensor, FromPeer, ImportedTensor, OwnedTensor, Tensor};
pub use attached::{ATTACHED_FRAME_MARK, ATTACHED_TENSOR_TYPE, AttachmentRefusal, Attachments, MAX_ATTACHMENTS, append_attachments, attached_value};

mod attached;
pub mod pool;

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

/// The `__type__` of a tensor carried inside the frame (see [`inline_value`]).
pub const INLINE_TENSOR_TYPE: &str = "TensorwireInline";

/// Why a received `TensorwireInline` value was refused (each a [`RpcError::Decode`] whose
/// text starts with this one's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InlineRefusal {
    /// The dtype or the sizes.
    Geometry(Geometry),
    /// The packed bytes the sizes name are over the connection's inline limit.
    TooLarge { bytes: u64, limit: usize },
    /// `data` is missing or not a string.
    NoData,
    /// `data` does not decode to exactly the bytes the sizes name.
    LengthMismatch { text: usize, bytes: u64 },
    /// `data` is not strict standard base64.
    BadBase64(String),
}

impl std::fmt::Display for InlineRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "inline tensor refused: ")?;
        match self {
            InlineRefusal::Geometry(g) => g.fmt(f),
            InlineRefusal::TooLarge { bytes, limit } => {
                write!(f, "{bytes} bytes, over this connection's inline limit of {limit} (RpcConfig::inline_tensors, the smaller of the two sides')")
            }
            InlineRefusal::NoData => write!(f, "no base64 string \"data\""),
            InlineRefusal::LengthMismatch { text, bytes } => {
                write!(f, "{text} characters of base64 cannot hold exactly the {bytes} bytes its dtype and sizes name")
            }
            InlineRefusal::BadBase64(why) => write!(f, "bad base64 data: {why}"),
        }
    }
}

impl From<InlineRefusal> for RpcError {
    fn from(r: InlineRefusal) -> RpcError {
        RpcError::Decode(r.to_string())
    }
}

/// An owned tensor as the JSON that carries it inside the frame:
/// `{"__type__": "TensorwireInline", "dtype": "torch.float32", "tensor_size": [..],
/// "data": "<base64 of the packed elements>"}` — contiguous, so no strides or offset.
/// Sent only on connections where both sides negotiated inline tensors. Written as text
/// (a [`Value::Json`]), the base64 straight into it.
pub fn inline_value(t: &OwnedTensor) -> Value {
    let mut text = Vec::with_capacity(96 + t.bytes().len().div_ceil(3) * 4);
    packed_head(&mut text, INLINE_TENSOR_TYPE, &t.layout());
    text.extend_from_slice(br#", "data": ""#);
    crate::base64::encode_to(t.bytes(), &mut text);
    text.extend_from_slice(br#""}"#);
    packed_text(text)
}

/// The start of a packed tensor's JSON text, inline or attached: `{"__type__": "<type>",
/// "dtype": "torch.<name>", "tensor_size": [..]`, the caller writing the rest.
fn packed_head(text: &mut Vec<u8>, type_name: &str, l: &Layout) {
    text.extend_from_slice(br#"{"__type__": ""#);
    text.extend_from_slice(type_name.as_bytes());
    text.extend_from_slice(br#"", "dtype": "torch."#);
    text.extend_from_slice(l.dtype.name().as_bytes());
    text.extend_from_slice(br#"", "tensor_size": ["#);
    for (i, &n) in l.sizes().iter().enumerate() {
        if i > 0 {
            text.extend_from_slice(b", ");
        }
        crate::json::write_int(text, n);
    }
    text.push(b']');
}

/// A packed tensor's finished JSON text as the value that carries it: ASCII (fixed keys, a
/// dtype name, integers and base64), naming no tensors.
fn packed_text(text: Vec<u8>) -> Value {
    let text = String::from_utf8(text).expect("ASCII: fixed keys, a dtype name, integers and base64");
    Value::Json(Box::new(crate::value::JsonText::new(text, Vec::new()).expect("no tensors in the text")))
}

/// Decode a received `TensorwireInline` object into a tensor of our own heap (one decode,
/// straight into its buffer), after checking everything the peer said: the dtype, the
/// sizes (integers, none negative, their byte count without overflow and within `limit`,
/// the negotiated inline limit, and `max_copy`, `RpcConfig::max_tensor_copy`), and that the
/// base64 text holds exactly those bytes.
pub fn from_inline(m: &Map, limit: usize, max_copy: usize) -> Result<Tensor> {
    let (dtype, sizes, bytes) = packed_geometry(m).map_err(InlineRefusal::Geometry)?;
    if bytes > limit as u64 {
        return Err(InlineRefusal::TooLarge { bytes, limit }.into());
    }
    check_tensor_copy(|| format!("an inline {} tensor of sizes {sizes:?}", dtype.name()), bytes, max_copy)?;
    let Some(Value::Str(text)) = m.get("data") else {
        return Err(InlineRefusal::NoData.into());
    };
    // The length first (the padding says how many bytes the last four characters hold),
    // so a mismatch is named as one, whatever the characters.
    let decoded = crate::base64::decoded_len(text).ok();
    if text.len() != (bytes as usize).div_ceil(3) * 4 || decoded != Some(bytes as usize) {
        return Err(InlineRefusal::LengthMismatch { text: text.len(), bytes }.into());
    }
    let mut t = OwnedTensor::zeroed(dtype, &sizes, max_copy).map_err(|e| match e {
        e @ RpcError::OutOfMemory { .. } => e,
        other => InlineRefusal::Geometry(Geometry::BadSizes(other.to_string())).into(),
    })?;
    crate::base64::decode_into(text, t.bytes_mut()).map_err(|e| match e {
        RpcError::Decode(why) => InlineRefusal::BadBase64(why),
        other => InlineRefusal::BadBase64(other.to_string()),
    })?;
    Ok(Tensor::Owned(std::sync::Arc::new(t)))
}

/// What can be wrong with the dtype and sizes of a packed tensor in a frame, inline or
/// attached ([`InlineRefusal::Geometry`], [`AttachmentRefusal::Geometry`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Geometry {
    /// `dtype` is missing, not a string, or names no dtype this build knows.
    UnknownDtype(String),
    /// `tensor_size` is missing, holds a non-integer, a negative size, or too many
    /// dimensions.
    BadSizes(String),
    /// The sizes times the element size overflow.
    SizeOverflow(String),
}

impl std::fmt::Display for Geometry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Geometry::UnknownDtype(d) => write!(f, "unknown dtype {d}"),
            Geometry::BadSizes(why) => write!(f, "bad tensor_size: {why}"),
            Geometry::SizeOverflow(sizes) => write!(f, "tensor_size {sizes} overflows a byte count"),
        }
    }
}

/// The dtype, sizes and packed byte count of a `TensorwireInline` or `TensorwireAttached`
/// object (each kind checks the count against its own limit).
fn packed_geometry(m: &Map) -> std::result::Result<(DType, Vec<i64>, u64), Geometry> {
    let dtype = match m.get("dtype") {
        Some(Value::Str(s)) => dtype_from_torch(s).map_err(|_| Geometry::UnknownDtype(format!("{:?}", crate::fs_tensor::clip(s, 40))))?,
        Some(v) => return Err(Geometry::UnknownDtype(format!("(a {})", v.type_name()))),
        None => return Err(Geometry::UnknownDtype("(none given)".into())),
    };
    let sizes = match m.get("tensor_size") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| match x.as_i64() {
                Some(n) if n >= 0 => Ok(n),
                Some(n) => Err(Geometry::BadSizes(format!("negative size {n}"))),
                None => Err(Geometry::BadSizes(format!("a {} among the sizes", x.type_name()))),
            })
            .collect::<std::result::Result<Vec<i64>, _>>()?,
        _ => return Err(Geometry::BadSizes("not a list".into())),
    };
    if sizes.len() > tensorwire::MAX_NDIM {
        return Err(Geometry::BadSizes(format!("{} dimensions, at most {}", sizes.len(), tensorwire::MAX_NDIM)));
    }
    let bytes = sizes
        .iter()
        .try_fold(dtype.size() as u64, |acc, &n| acc.checked_mul(n as u64))
        .ok_or_else(|| Geometry::SizeOverflow(format!("{sizes:?}")))?;
    Ok((dtype, sizes, bytes))
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

    fn inline_map(v: &Value) -> Map {
        let Value::Json(j) = v else { panic!("an inline tensor is written as text, got {v:?}") };
        crate::json::parse(j.text().as_bytes(), 8).unwrap().as_object().unwrap().clone()
    }

    fn refusal(m: &Map, limit: usize) -> String {
        match from_inline(m, limit, usize::MAX) {
            Err(RpcError::Decode(why)) => why,
            other => panic!("expected a decode refusal, got {other:?}"),
        }
    }

    #[test]
    fn inline_tensors_round_trip_every_dtype_bit_exact() {
        for (k, dtype) in DType::ALL.into_iter().enumerate() {
            for sizes in [&[][..], &[0], &[1], &[2], &[5, 3], &[3, 0, 2]] {
                let n = sizes.iter().product::<i64>() as usize * dtype.size();
                let data: Vec<u8> = (0..n).map(|i| (i * 7 + k) as u8).collect();
                let t = Tensor::owned(dtype, sizes, &data).unwrap();
                let Tensor::Owned(o) = &t else { unreachable!() };
                let m = inline_map(&inline_value(o));
                let back = from_inline(&m, 1 << 20, 1 << 20).unwrap();
                assert!(matches!(back, Tensor::Owned(_)));
                assert_eq!(back.layout(), t.layout(), "{} {sizes:?}", dtype.name());
                assert_eq!(back.to_vec().unwrap(), data, "{} {sizes:?}", dtype.name());
                assert_eq!(back.max_copy(), 1 << 20, "the connection's copy limit travels with it");
            }
        }
    }

    /// Each inconsistency a peer can put in an inline tensor is its own named refusal.
    #[test]
    fn forged_inline_tensors_are_each_a_named_refusal() {
        let good = || {
            let Tensor::Owned(o) = Tensor::owned(DType::Float32, &[2, 3], &[7; 24]).unwrap() else { unreachable!() };
            inline_map(&inline_value(&o))
        };
        let with = |k: &str, v: Value| {
            let mut m = good();
            m.insert(k.into(), v);
            m
        };
        let ints = |v: &[i64]| Value::Array(v.iter().map(|&x| Value::Int(x)).collect());
        assert!(from_inline(&good(), 24, 24).is_ok());
        let cases: Vec<(Map, usize, InlineRefusal)> = vec![
            (with("dtype", "torch.float33".into()), 1024, InlineRefusal::Geometry(Geometry::UnknownDtype("\"torch.float33\"".into()))),
            (with("dtype", Value::Int(6)), 1024, InlineRefusal::Geometry(Geometry::UnknownDtype("(a int)".into()))),
            (with("tensor_size", ints(&[-1, 3])), 1024, InlineRefusal::Geometry(Geometry::BadSizes("negative size -1".into()))),
            (with("tensor_size", Value::Array(vec![Value::Float(2.0)])), 1024, InlineRefusal::Geometry(Geometry::BadSizes("a float among the sizes".into()))),
            (with("tensor_size", "2".into()), 1024, InlineRefusal::Geometry(Geometry::BadSizes("not a list".into()))),
            (with("tensor_size", ints(&[1; 30])), 1024, InlineRefusal::Geometry(Geometry::BadSizes(format!("30 dimensions, at most {}", tensorwire::MAX_NDIM)))),
            (with("tensor_size", ints(&[i64::MAX, 2])), 1024, InlineRefusal::Geometry(Geometry::SizeOverflow(format!("{:?}", [i64::MAX, 2])))),
            (with("tensor_size", ints(&[1 << 40])), 1024, InlineRefusal::TooLarge { bytes: 4 << 40, limit: 1024 }),
            (good(), 23, InlineRefusal::TooLarge { bytes: 24, limit: 23 }),
            (with("tensor_size", ints(&[2, 4])), 1024, InlineRefusal::LengthMismatch { text: 32, bytes: 32 }),
            (with("tensor_size", ints(&[2, 2])), 1024, InlineRefusal::LengthMismatch { text: 32, bytes: 16 }),
            // Four characters hold three bytes, not the two that the sizes name.
            (
                Map::from_iter([
                    ("__type__".into(), INLINE_TENSOR_TYPE.into()),
                    ("dtype".into(), "torch.uint8".into()),
                    ("tensor_size".into(), ints(&[2])),
                    ("data".into(), "AAEC".into()),
                ]),
                1024,
                InlineRefusal::LengthMismatch { text: 4, bytes: 2 },
            ),
            (with("data", Value::Null), 1024, InlineRefusal::NoData),
            (with("data", "BwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcH=".into()), 1024, InlineRefusal::LengthMismatch { text: 33, bytes: 24 }),
            (with("data", "BwcHBwcHBwcHBwcH*wcHBwcHBwcHBwcH".into()), 1024, InlineRefusal::BadBase64("invalid base64 character '*'".into())),
            (with("data", "BwcHBwcHBwcHBwcHBw==BwcHBwcHBwcH".into()), 1024, InlineRefusal::BadBase64("misplaced '=' padding in base64".into())),
        ];
        for (m, limit, want) in cases {
            assert_eq!(refusal(&m, limit), want.to_string(), "{m:?}");
        }
        // The copy limit holds too, as for any private copy of a peer's tensor.
        assert!(matches!(from_inline(&good(), 1024, 16), Err(RpcError::TensorCopyLimit { need: 24, cap: 16, .. })));
    }
}

