//! Owned tensors as binary attachments of their frame: the `TensorwireAttached` value
//! that names one ([`attached_value`]), the trailer that says where each lies
//! ([`append_attachments`]: their lengths, their count, the JSON text's length and
//! [`ATTACHED_FRAME_MARK`]), and the checks on a received frame ([`Attachments`]), each
//! refusal named ([`AttachmentRefusal`]). The dtype and sizes are checked as an inline
//! tensor's are (`packed_geometry` in the parent).

use super::{Geometry, OwnedTensor, Tensor, packed_geometry, packed_head, packed_text};
use crate::error::{Result, RpcError};
use crate::limits::check_tensor_copy;
use crate::value::{Map, Value};

/// The `__type__` of a tensor whose bytes travel as an attachment of its frame (see
/// [`attached_value`]).
pub const ATTACHED_TENSOR_TYPE: &str = "TensorwireAttached";

/// The last byte of a frame that carries attachments. A JSON text never ends with a NUL
/// byte, so a frame of JSON alone (every frame of a peer that did not negotiate
/// attachments) is never read as one.
pub const ATTACHED_FRAME_MARK: u8 = 0;

/// Most attachments one frame carries (more tensors in one message go as exports).
pub const MAX_ATTACHMENTS: usize = 1 << 16;

/// Bytes after the attachments in a frame that carries `n`: a 4-byte length each, the
/// count, the JSON text's length, the mark.
fn trailer_len(n: usize) -> usize {
    4 * n + 9
}

/// Why a frame's attachments, or a `TensorwireAttached` value naming one, were refused
/// (each a [`RpcError`] whose text starts with this one's: an unreadable table, the
/// second and third, a [`RpcError::Protocol`] that ends the connection, as does a frame
/// with attachments where we offered none; the others a [`RpcError::Decode`] that answers
/// the call naming it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttachmentRefusal {
    /// A frame with attachments, or a value naming one, on a connection where we offered
    /// none.
    NotNegotiated,
    /// The frame is too short for its trailer, or its count is over [`MAX_ATTACHMENTS`].
    BadTrailer(String),
    /// The JSON length and the attachments' lengths do not add up to the frame's length.
    LengthsDisagree { frame: usize, table: u64 },
    /// The dtype or the sizes.
    Geometry(Geometry),
    /// The packed bytes the sizes name are over the connection's attachment limit.
    TooLarge { bytes: u64, limit: usize },
    /// `attachment` is missing, not an integer, or names no attachment of the frame.
    BadIndex { index: String, count: usize },
    /// `nbytes`, or the attachment's length, is not the byte count the dtype and sizes
    /// name.
    LengthMismatch { what: &'static str, len: String, bytes: u64 },
    /// A second value names an attachment another already took.
    Reused { index: usize },
    /// Attachments of the frame that no value named.
    Unused { unused: usize, count: usize },
}

impl std::fmt::Display for AttachmentRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "attached tensor refused: ")?;
        match self {
            AttachmentRefusal::NotNegotiated => {
                write!(f, "a frame with attachments on a connection that never negotiated them (native_hello's attached_tensors)")
            }
            AttachmentRefusal::BadTrailer(why) => write!(f, "the frame's attachment table is unreadable: {why}"),
            AttachmentRefusal::LengthsDisagree { frame, table } => {
                write!(f, "the frame is {frame} bytes, its attachment table adds up to {table}")
            }
            AttachmentRefusal::Geometry(g) => g.fmt(f),
            AttachmentRefusal::TooLarge { bytes, limit } => {
                write!(f, "{bytes} bytes, over this connection's attachment limit of {limit} (RpcConfig::attached_tensors)")
            }
            AttachmentRefusal::BadIndex { index, count } => {
                write!(f, "attachment {index} named, the frame carries {count}")
            }
            AttachmentRefusal::LengthMismatch { what, len, bytes } => {
                write!(f, "{what} is {len}, its dtype and sizes name {bytes} bytes")
            }
            AttachmentRefusal::Reused { index } => write!(f, "attachment {index} is named by two values"),
            AttachmentRefusal::Unused { unused, count } => write!(f, "{unused} of the frame's {count} attachments named by no value"),
        }
    }
}

impl From<AttachmentRefusal> for RpcError {
    fn from(r: AttachmentRefusal) -> RpcError {
        match r {
            AttachmentRefusal::BadTrailer(_) | AttachmentRefusal::LengthsDisagree { .. } => RpcError::Protocol(r.to_string()),
            r => RpcError::Decode(r.to_string()),
        }
    }
}

/// An owned tensor as the JSON that names its bytes, attachment `index` of the frame:
/// `{"__type__": "TensorwireAttached", "dtype": "torch.float32", "tensor_size": [..],
/// "nbytes": N, "attachment": i}` — contiguous, so no strides or offset. The caller appends
/// the bytes to the frame ([`append_attachments`]). Sent only on connections where both
/// sides negotiated attachments.
pub fn attached_value(t: &OwnedTensor, index: usize) -> Value {
    let mut text = Vec::with_capacity(128);
    packed_head(&mut text, ATTACHED_TENSOR_TYPE, &t.layout());
    text.extend_from_slice(br#", "nbytes": "#);
    crate::json::write_int(&mut text, t.bytes().len() as i64);
    text.extend_from_slice(br#", "attachment": "#);
    crate::json::write_int(&mut text, index as i64);
    text.push(b'}');
    packed_text(text)
}

/// Append `tensors`' bytes after the JSON text in `frame` (`json_len` bytes so far), then
/// the trailer that says where they are: each one's length, their count, the JSON's
/// length (4 bytes big-endian each) and [`ATTACHED_FRAME_MARK`].
pub fn append_attachments(frame: &mut Vec<u8>, tensors: &[std::sync::Arc<OwnedTensor>]) -> Result<()> {
    let json_len = frame.len();
    let total = tensors.iter().map(|t| t.bytes().len()).sum::<usize>() + trailer_len(tensors.len());
    let u32_of = |n: usize, what: &str| {
        u32::try_from(n).map_err(|_| RpcError::InvalidArgument(format!("{what} of {n} bytes does not fit a frame")))
    };
    if tensors.len() > MAX_ATTACHMENTS {
        return Err(RpcError::InvalidArgument(format!("{} attachments, at most {MAX_ATTACHMENTS} a frame", tensors.len())));
    }
    frame.try_reserve(total).map_err(|_| RpcError::OutOfMemory { what: "a frame's attachments".into(), bytes: total as u64 })?;
    for t in tensors {
        frame.extend_from_slice(t.bytes());
    }
    for t in tensors {
        frame.extend_from_slice(&u32_of(t.bytes().len(), "an attachment")?.to_be_bytes());
    }
    frame.extend_from_slice(&u32_of(tensors.len(), "a count")?.to_be_bytes());
    frame.extend_from_slice(&u32_of(json_len, "a JSON text")?.to_be_bytes());
    frame.push(ATTACHED_FRAME_MARK);
    Ok(())
}

/// The attachments of one received frame, and which of them values have taken: the frame
/// itself (private memory, copied from the socket), the JSON text's length and where each
/// attachment lies in it.
#[derive(Debug, Default)]
pub struct Attachments {
    frame: Vec<u8>,
    json_len: usize,
    spans: Vec<std::ops::Range<usize>>,
    taken: Vec<bool>,
}

impl Attachments {
    /// A frame of JSON alone: no attachments.
    pub fn none() -> Attachments {
        Attachments::default()
    }

    /// Whether `frame` (a received payload) ends with [`ATTACHED_FRAME_MARK`].
    pub fn marked(frame: &[u8]) -> bool {
        frame.last() == Some(&ATTACHED_FRAME_MARK)
    }

    /// Read a marked frame's trailer: every length checked against the frame's before any
    /// is used (their sum with the JSON's and the trailer's must be the frame's length).
    pub fn split(frame: Vec<u8>) -> std::result::Result<Attachments, AttachmentRefusal> {
        let len = frame.len();
        let word = |at: usize| u32::from_be_bytes([frame[at], frame[at + 1], frame[at + 2], frame[at + 3]]) as usize;
        if len < trailer_len(0) {
            return Err(AttachmentRefusal::BadTrailer(format!("{len} bytes, shorter than a trailer")));
        }
        let (json_len, count) = (word(len - 5), word(len - 9));
        if count > MAX_ATTACHMENTS {
            return Err(AttachmentRefusal::BadTrailer(format!("{count} attachments, at most {MAX_ATTACHMENTS} a frame")));
        }
        if trailer_len(count) > len {
            return Err(AttachmentRefusal::BadTrailer(format!("{count} attachments' lengths do not fit in {len} bytes")));
        }
        let table = len - trailer_len(count);
        let lens: Vec<usize> = (0..count).map(|i| word(table + 4 * i)).collect();
        let sum = lens.iter().map(|&n| n as u64).sum::<u64>() + json_len as u64 + trailer_len(count) as u64;
        if sum != len as u64 {
            return Err(AttachmentRefusal::LengthsDisagree { frame: len, table: sum });
        }
        let mut at = json_len;
        let spans = lens
            .iter()
            .map(|&n| {
                at += n;
                at - n..at
            })
            .collect();
        Ok(Attachments { frame, json_len, spans, taken: vec![false; count] })
    }

    /// The frame's JSON text.
    pub fn json(&self) -> &[u8] {
        &self.frame[..self.json_len]
    }

    /// How many attachments the frame carries.
    pub fn count(&self) -> usize {
        self.spans.len()
    }

    /// The tensor a received `TensorwireAttached` object names, copied out of the frame
    /// into a buffer of its own, after checking everything the peer said: the dtype, the
    /// sizes (integers, none negative, their byte count without overflow and within
    /// `limit`, the connection's attachment limit, 0 for none, and `max_copy`), `nbytes`,
    /// and that the attachment exists, is that long and no other value took it.
    pub fn take(&mut self, m: &Map, limit: usize, max_copy: usize) -> Result<Tensor> {
        if limit == 0 {
            return Err(AttachmentRefusal::NotNegotiated.into());
        }
        let (dtype, sizes, bytes) = packed_geometry(m).map_err(AttachmentRefusal::Geometry)?;
        if bytes > limit as u64 {
            return Err(AttachmentRefusal::TooLarge { bytes, limit }.into());
        }
        let said = match m.get("nbytes") {
            Some(v) => v.as_i64().filter(|&n| n >= 0).map(|n| n as u64),
            None => None,
        };
        if said != Some(bytes) {
            let len = m.get("nbytes").map_or("missing".into(), |v| v.to_json().unwrap_or_else(|_| v.type_name().into()));
            return Err(AttachmentRefusal::LengthMismatch { what: "nbytes", len: crate::fs_tensor::clip(&len, 40), bytes }.into());
        }
        let count = self.count();
        let index = match m.get("attachment").and_then(Value::as_i64) {
            Some(i) if i >= 0 && (i as u64) < count as u64 => i as usize,
            _ => {
                let index = m.get("attachment").map_or("(none)".into(), |v| v.to_json().unwrap_or_else(|_| v.type_name().into()));
                return Err(AttachmentRefusal::BadIndex { index: crate::fs_tensor::clip(&index, 40), count }.into());
            }
        };
        let span = self.spans[index].clone();
        if span.len() as u64 != bytes {
            return Err(AttachmentRefusal::LengthMismatch { what: "the attachment's length", len: span.len().to_string(), bytes }.into());
        }
        if std::mem::replace(&mut self.taken[index], true) {
            return Err(AttachmentRefusal::Reused { index }.into());
        }
        check_tensor_copy(|| format!("an attached {} tensor of sizes {sizes:?}", dtype.name()), bytes, max_copy)?;
        let mut t = OwnedTensor::zeroed(dtype, &sizes, max_copy).map_err(|e| match e {
            e @ RpcError::OutOfMemory { .. } => e,
            other => AttachmentRefusal::Geometry(Geometry::BadSizes(other.to_string())).into(),
        })?;
        t.bytes_mut().copy_from_slice(&self.frame[span]);
        Ok(Tensor::Owned(std::sync::Arc::new(t)))
    }

    /// After every value of the frame is decoded: each attachment was taken.
    pub fn check_all_taken(&self) -> Result<()> {
        match self.taken.iter().filter(|&&t| !t).count() {
            0 => Ok(()),
            unused => Err(AttachmentRefusal::Unused { unused, count: self.count() }.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use tensorwire::DType;

    fn owned(dtype: DType, sizes: &[i64], seed: u8) -> std::sync::Arc<OwnedTensor> {
        let n = sizes.iter().product::<i64>() as usize * dtype.size();
        let data: Vec<u8> = (0..n).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed)).collect();
        let Tensor::Owned(o) = Tensor::owned(dtype, sizes, &data).unwrap() else { unreachable!() };
        o
    }

    /// A frame of `values` (each a JSON object text) with `tensors` attached.
    fn attached_frame(tensors: &[Arc<OwnedTensor>]) -> (Vec<Map>, Attachments) {
        let mut frame = b"[".to_vec();
        let mut maps = Vec::new();
        for (i, t) in tensors.iter().enumerate() {
            let Value::Json(j) = attached_value(t, i) else { panic!("an attached tensor is written as text") };
            if i > 0 {
                frame.extend_from_slice(b", ");
            }
            frame.extend_from_slice(j.text().as_bytes());
            maps.push(crate::json::parse(j.text().as_bytes(), 8).unwrap().as_object().unwrap().clone());
        }
        frame.push(b']');
        append_attachments(&mut frame, tensors).unwrap();
        assert!(Attachments::marked(&frame));
        let att = Attachments::split(frame).unwrap();
        assert!(crate::json::parse(att.json(), 8).is_ok(), "the JSON text is the frame's first part");
        (maps, att)
    }

    #[test]
    fn attached_tensors_round_trip_every_dtype_bit_exact() {
        let mut tensors = Vec::new();
        for (k, dtype) in DType::ALL.into_iter().enumerate() {
            for sizes in [&[][..], &[0], &[1], &[2], &[5, 3], &[3, 0, 2]] {
                tensors.push(owned(dtype, sizes, k as u8));
            }
        }
        let (maps, mut att) = attached_frame(&tensors);
        assert_eq!(att.count(), tensors.len());
        for (m, t) in maps.iter().zip(&tensors) {
            let back = att.take(m, 1 << 20, 1 << 20).unwrap();
            let Tensor::Owned(b) = &back else { panic!("{back:?}") };
            assert_eq!(b.layout(), t.layout());
            assert_eq!(b.bytes(), t.bytes(), "{:?}", t.layout());
            assert_eq!(b.bytes().as_ptr() as usize % 8, 0, "8-byte aligned for every dtype");
        }
        att.check_all_taken().unwrap();
        // A frame of JSON alone is never read as one with attachments.
        assert!(!Attachments::marked(b"null") && !Attachments::marked(b"{\"a\": 1} ") && !Attachments::marked(b""));
    }

    fn attach_refusal(r: Result<Tensor>) -> String {
        match r {
            Err(RpcError::Decode(why)) => why,
            other => panic!("expected a decode refusal, got {other:?}"),
        }
    }

    /// Each inconsistency a peer can put in a frame's attachments is its own named refusal.
    #[test]
    fn forged_attachments_are_each_a_named_refusal() {
        let two = [owned(DType::Float32, &[2, 3], 1), owned(DType::UInt8, &[5], 2)];
        let (maps, _) = attached_frame(&two);
        let good = || maps[0].clone();
        let with = |k: &str, v: Value| {
            let mut m = good();
            m.insert(k.into(), v);
            m
        };
        let ints = |v: &[i64]| Value::Array(v.iter().map(|&x| Value::Int(x)).collect());
        // Descriptor-level: each against a fresh frame of the two tensors.
        let cases: Vec<(Map, usize, AttachmentRefusal)> = vec![
            (good(), 0, AttachmentRefusal::NotNegotiated),
            (with("dtype", "torch.float33".into()), 1024, AttachmentRefusal::Geometry(Geometry::UnknownDtype("\"torch.float33\"".into()))),
            (with("dtype", Value::Int(6)), 1024, AttachmentRefusal::Geometry(Geometry::UnknownDtype("(a int)".into()))),
            (with("tensor_size", ints(&[-1, 3])), 1024, AttachmentRefusal::Geometry(Geometry::BadSizes("negative size -1".into()))),
            (with("tensor_size", "2".into()), 1024, AttachmentRefusal::Geometry(Geometry::BadSizes("not a list".into()))),
            (with("tensor_size", ints(&[1; 30])), 1024, AttachmentRefusal::Geometry(Geometry::BadSizes(format!("30 dimensions, at most {}", tensorwire::MAX_NDIM)))),
            (with("tensor_size", ints(&[i64::MAX, 2])), 1024, AttachmentRefusal::Geometry(Geometry::SizeOverflow(format!("{:?}", [i64::MAX, 2])))),
            (good(), 23, AttachmentRefusal::TooLarge { bytes: 24, limit: 23 }),
            (with("nbytes", Value::Int(25)), 1024, AttachmentRefusal::LengthMismatch { what: "nbytes", len: "25".into(), bytes: 24 }),
            (with("tensor_size", ints(&[2, 2])), 1024, AttachmentRefusal::LengthMismatch { what: "nbytes", len: "24".into(), bytes: 16 }),
            (
                Map::from_iter(good().into_iter().filter(|(k, _)| k != "nbytes")),
                1024,
                AttachmentRefusal::LengthMismatch { what: "nbytes", len: "missing".into(), bytes: 24 },
            ),
            (with("attachment", Value::Int(2)), 1024, AttachmentRefusal::BadIndex { index: "2".into(), count: 2 }),
            (with("attachment", Value::Int(-1)), 1024, AttachmentRefusal::BadIndex { index: "-1".into(), count: 2 }),
            (with("attachment", "0".into()), 1024, AttachmentRefusal::BadIndex { index: "\"0\"".into(), count: 2 }),
            (
                Map::from_iter(good().into_iter().filter(|(k, _)| k != "attachment")),
                1024,
                AttachmentRefusal::BadIndex { index: "(none)".into(), count: 2 },
            ),
            // Attachment 1 holds 5 bytes; the value names 24.
            (with("attachment", Value::Int(1)), 1024, AttachmentRefusal::LengthMismatch { what: "the attachment's length", len: "5".into(), bytes: 24 }),
        ];
        for (m, limit, want) in cases {
            let (_, mut att) = attached_frame(&two);
            assert_eq!(attach_refusal(att.take(&m, limit, usize::MAX)), want.to_string(), "{m:?}");
        }
        // One attachment named by two values.
        let (maps, mut att) = attached_frame(&two);
        att.take(&maps[0], 1024, usize::MAX).unwrap();
        assert_eq!(attach_refusal(att.take(&maps[0], 1024, usize::MAX)), AttachmentRefusal::Reused { index: 0 }.to_string());
        // One named by none.
        match att.check_all_taken() {
            Err(RpcError::Decode(why)) => assert_eq!(why, AttachmentRefusal::Unused { unused: 1, count: 2 }.to_string()),
            other => panic!("{other:?}"),
        }
        // The copy limit holds too, as for any private copy of a peer's tensor.
        let (maps, mut att) = attached_frame(&two);
        assert!(matches!(att.take(&maps[0], 1024, 16), Err(RpcError::TensorCopyLimit { need: 24, cap: 16, .. })));
    }

    /// A trailer that does not describe its frame is refused before any length in it is
    /// used: the frame cannot be read, so each is a protocol error.
    #[test]
    fn forged_attachment_tables_are_each_a_named_refusal() {
        let (_, att) = attached_frame(&[owned(DType::UInt8, &[5], 2)]);
        let frame = att.frame.clone();
        let n = frame.len();
        let set = |at: usize, v: u32| {
            let mut f = frame.clone();
            f[at..at + 4].copy_from_slice(&v.to_be_bytes());
            f
        };
        let cases: Vec<(Vec<u8>, AttachmentRefusal)> = vec![
            (vec![0; 8], AttachmentRefusal::BadTrailer("8 bytes, shorter than a trailer".into())),
            (set(n - 9, MAX_ATTACHMENTS as u32 + 1), AttachmentRefusal::BadTrailer(format!("{} attachments, at most {MAX_ATTACHMENTS} a frame", MAX_ATTACHMENTS + 1))),
            (set(n - 9, 1000), AttachmentRefusal::BadTrailer(format!("1000 attachments' lengths do not fit in {n} bytes"))),
            // The JSON said one byte longer, the attachment one byte longer, or none at all.
            (set(n - 5, (n - 13 - 5 + 1) as u32), AttachmentRefusal::LengthsDisagree { frame: n, table: n as u64 + 1 }),
            (set(n - 13, 6), AttachmentRefusal::LengthsDisagree { frame: n, table: n as u64 + 1 }),
            (set(n - 13, u32::MAX), AttachmentRefusal::LengthsDisagree { frame: n, table: n as u64 + u64::from(u32::MAX) - 5 }),
            (set(n - 9, 0), AttachmentRefusal::LengthsDisagree { frame: n, table: (n - 13 - 5 + 9) as u64 }),
        ];
        for (f, want) in cases {
            let got = Attachments::split(f).unwrap_err();
            assert_eq!(got, want);
            assert!(matches!(RpcError::from(got), RpcError::Protocol(_)), "a frame that cannot be read ends the connection");
        }
    }
}
