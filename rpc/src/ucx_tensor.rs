//! Remote tensors on the wire (feature `ucx`): the `TensorwireRemote` value a CPU tensor
//! becomes on a TCP connection whose peer announced UCX.
//!
//! ```json
//! {"__type__": "TensorwireRemote", "engine": "ucx",
//!  "worker_address": "<base64>", "key": "<base64 of 16 bytes>",
//!  "length": 4096, "export_id": 7,
//!  "dtype": "torch.float32", "tensor_size": [32, 32], "tensor_stride": [32, 1],
//!  "tensor_offset": 0}
//! ```
//!
//! `worker_address`, `key`, `export_id` and `length` are what the receiver needs to ask the
//! exporter for the storage (the fields of a `tensorwire-remote` [`ExportBlob`]): it
//! connects to the worker address and asks for export `export_id` under `key` (the random
//! key of the sender's scope for this connection), and the exporter sends exactly that
//! export's `length` bytes. `export_id` is also what goes back in
//! `__tensorwire__.remote_release` once the receiver has read it; the layout fields are
//! those of every other tensor form and describe the view over the storage. No field names
//! an address in the exporter.
//!
//! `parse` (crate-private) validates everything a peer could forge before anything is
//! allocated or connected to: each field's presence and type, the engine, the export
//! blob's own checks (lengths, the UCX address version: see
//! `tensorwire_remote::ExportBlob::decode`), and that the view fits in `length` bytes.
//! Every rejection is an [`RpcError::Decode`] naming the field.

use crate::base64;
use crate::error::{Result, RpcError};
use crate::value::{Map, Value};
use tensorwire::Layout;
use tensorwire_remote::{Engine, ExportBlob};

/// The `__type__` of a remote tensor value.
pub const REMOTE_TENSOR_TYPE: &str = "TensorwireRemote";
/// The one engine name this version speaks.
pub const ENGINE_UCX: &str = "ucx";

/// The value naming `blob`'s export viewed as `layout`.
pub(crate) fn to_value(blob: &ExportBlob, layout: &Layout) -> Result<Value> {
    // JSON integers here are i64: a length or an id above i64::MAX is not something this
    // process can have exported.
    let int = |what: &str, v: u64| {
        i64::try_from(v)
            .map(Value::Int)
            .map_err(|_| RpcError::RemoteTransfer(format!("the export's {what} {v:#x} does not fit a JSON integer")))
    };
    let mut m = Map::new();
    m.insert("__type__".into(), REMOTE_TENSOR_TYPE.into());
    m.insert("engine".into(), ENGINE_UCX.into());
    m.insert("worker_address".into(), Value::Str(base64::encode(blob.worker_address())));
    m.insert("key".into(), Value::Str(base64::encode(blob.key())));
    m.insert("length".into(), int("length", blob.length())?);
    m.insert("export_id".into(), int("export id", blob.export_id())?);
    crate::tensor::layout_fields(&mut m, layout);
    Ok(Value::Object(m))
}

/// The `length` alone, for the message budget (`None` if the field is missing or not a
/// non-negative integer: `parse` names that).
pub(crate) fn length(m: &Map) -> Option<u64> {
    unsigned(m, "length").ok()
}

/// A validated remote tensor value.
#[derive(Debug)]
pub(crate) struct RemoteRef {
    pub(crate) blob: ExportBlob,
    pub(crate) layout: Layout,
}

fn field<'a>(m: &'a Map, k: &str) -> Result<&'a Value> {
    m.get(k).ok_or_else(|| RpcError::Decode(format!("{REMOTE_TENSOR_TYPE} has no {k:?} field")))
}

fn unsigned(m: &Map, k: &str) -> Result<u64> {
    match field(m, k)? {
        Value::Int(i) => u64::try_from(*i).map_err(|_| RpcError::Decode(format!("{REMOTE_TENSOR_TYPE} field {k:?} is negative ({i})"))),
        v => Err(RpcError::Decode(format!("{REMOTE_TENSOR_TYPE} field {k:?} is a {}, expected an integer", v.type_name()))),
    }
}

fn bytes(m: &Map, k: &str, max: usize) -> Result<Vec<u8>> {
    let s = match field(m, k)? {
        Value::Str(s) => s,
        v => return Err(RpcError::Decode(format!("{REMOTE_TENSOR_TYPE} field {k:?} is a {}, expected base64 text", v.type_name()))),
    };
    // Bounded before decoding: base64 is 4 characters per 3 bytes.
    if s.len() > max.div_ceil(3) * 4 {
        return Err(RpcError::Decode(format!("{REMOTE_TENSOR_TYPE} field {k:?} is {} characters, more than {max} bytes can take", s.len())));
    }
    base64::decode(s).map_err(|e| RpcError::Decode(format!("{REMOTE_TENSOR_TYPE} field {k:?}: {e}")))
}

/// The export id alone, read first so that a value rejected later can still be released
/// (`None` if the field is missing or not a non-negative integer).
pub(crate) fn export_id(m: &Map) -> Option<u64> {
    unsigned(m, "export_id").ok()
}

/// Validate a remote tensor value (see the module docs).
pub(crate) fn parse(m: &Map) -> Result<RemoteRef> {
    match field(m, "engine")? {
        Value::Str(s) if s == ENGINE_UCX => {}
        Value::Str(s) => {
            return Err(RpcError::Decode(format!("{REMOTE_TENSOR_TYPE} names engine {s:?}; this build speaks only {ENGINE_UCX:?}")));
        }
        v => return Err(RpcError::Decode(format!("{REMOTE_TENSOR_TYPE} field \"engine\" is a {}, expected a string", v.type_name()))),
    }
    let export_id = unsigned(m, "export_id")?;
    let length = unsigned(m, "length")?;
    let worker_address = bytes(m, "worker_address", tensorwire_remote::MAX_WORKER_ADDRESS_LEN)?;
    let key = bytes(m, "key", tensorwire_remote::KEY_LEN)?;
    let blob = ExportBlob::from_parts(Engine::Ucx, export_id, length, &key, &worker_address)
        .map_err(|e| RpcError::Decode(format!("{REMOTE_TENSOR_TYPE} export {export_id} is malformed: {e}")))?;
    let layout = crate::tensor::layout_from_ref(m)?;
    let need = layout
        .extent_bytes()
        .map_err(|e| RpcError::Decode(format!("{REMOTE_TENSOR_TYPE} export {export_id}: bad tensor geometry: {e}")))?;
    if need > length {
        return Err(RpcError::Decode(format!(
            "{REMOTE_TENSOR_TYPE} export {export_id}: a {layout:?} view needs {need} bytes of storage, \"length\" is {length}"
        )));
    }
    Ok(RemoteRef { blob, layout })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tensorwire::DType;

    fn good() -> Map {
        let blob = ExportBlob::from_parts(Engine::Ucx, 7, 64, &[0x33; 16], &[0x10; 90]).unwrap();
        let l = Layout::contiguous(DType::Float32, &[4, 4]).unwrap();
        match to_value(&blob, &l).unwrap() {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    fn with(k: &str, v: Option<Value>) -> Map {
        let mut m = good();
        match v {
            Some(v) => m.insert(k.into(), v),
            None => m.shift_remove(k),
        };
        m
    }

    fn decode_err(m: &Map) -> String {
        match parse(m) {
            Err(RpcError::Decode(s)) => s,
            other => panic!("expected a Decode error, got {other:?}"),
        }
    }

    #[test]
    fn round_trip() {
        let r = parse(&good()).unwrap();
        assert_eq!((r.blob.export_id(), r.blob.length(), *r.blob.key()), (7, 64, [0x33; 16]));
        assert_eq!(r.layout, Layout::contiguous(DType::Float32, &[4, 4]).unwrap());
        assert_eq!(export_id(&good()), Some(7));
    }

    #[test]
    fn every_field_is_checked_and_named() {
        for k in ["engine", "export_id", "length", "worker_address", "key", "dtype", "tensor_size"] {
            let e = match parse(&with(k, None)) {
                Err(RpcError::Decode(s)) => s,
                other => panic!("{k} missing gave {other:?}"),
            };
            assert!(e.contains(k), "{k}: {e}");
        }
        assert!(decode_err(&with("engine", Some("nixl".into()))).contains("nixl"));
        assert!(decode_err(&with("length", Some(Value::Int(-1)))).contains("negative"));
        assert!(decode_err(&with("export_id", Some("0x10".into()))).contains("export_id"));
        assert!(decode_err(&with("length", Some(Value::Int(0)))).contains("BadLength"));
        assert!(decode_err(&with("length", Some(Value::Int(1 << 50)))).contains("BadLength"));
        assert!(decode_err(&with("key", Some("!!!!".into()))).contains("key"));
        assert!(decode_err(&with("key", Some(Value::Str(base64::encode(&[0xff; 12]))))).contains("BadKey(12)"));
        assert!(decode_err(&with("key", Some(Value::Str("A".repeat(10_000))))).contains("key"));
        assert!(decode_err(&with("worker_address", Some(Value::Str(base64::encode(&[0x0f; 90]))))).contains("BadWorkerAddress"));
        assert!(decode_err(&with("worker_address", Some(Value::Str(String::new())))).contains("BadWorkerAddress"));
        // A view larger than the storage.
        assert!(decode_err(&with("tensor_size", Some(Value::Array(vec![Value::Int(5), Value::Int(4)])))).contains("needs 80 bytes"));
        assert!(decode_err(&with("tensor_offset", Some(Value::Int(1)))).contains("needs 68 bytes"));
    }
}
