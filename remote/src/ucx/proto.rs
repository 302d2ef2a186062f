//! The two active messages of a transfer, as fixed-size little-endian headers.
//!
//! - [`AM_REQUEST`], importer → exporter, no payload, sent with `UCP_AM_SEND_FLAG_REPLY` so
//!   the exporter can answer on the same connection: magic `TWRQ`, version (1), reserved
//!   (0), token (the importer's name for this request), export id, length the importer
//!   expects, the scope key from the blob.
//! - [`AM_REPLY`], exporter → importer: magic `TWRP`, status ([`Status`]), token, length;
//!   the payload is the export's bytes when the status is `Ok`, nothing otherwise.
//!
//! Both sides parse a header only from exactly its length and drop anything else.

use crate::blob::KEY_LEN;

/// Active-message id of a request (on the exporter's worker).
pub(crate) const AM_REQUEST: u32 = 0x7701;
/// Active-message id of a reply (on the importer's worker).
pub(crate) const AM_REPLY: u32 = 0x7702;

pub(crate) const REQUEST_LEN: usize = 48;
pub(crate) const REPLY_LEN: usize = 24;
const REQUEST_MAGIC: [u8; 4] = *b"TWRQ";
const REPLY_MAGIC: [u8; 4] = *b"TWRP";
const VERSION: u16 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Request {
    pub(crate) token: u64,
    pub(crate) export_id: u64,
    pub(crate) length: u64,
    pub(crate) key: [u8; KEY_LEN],
}

/// What the exporter answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    /// The payload is the export.
    Ok,
    /// No live export with this id under this key.
    UnknownExport,
    /// The export's length is not the requested one (the reply's length field is the
    /// export's).
    LengthMismatch,
    /// The exporter could not start the send.
    SendFailed,
}

impl Status {
    fn to_u32(self) -> u32 {
        match self {
            Status::Ok => 0,
            Status::UnknownExport => 1,
            Status::LengthMismatch => 2,
            Status::SendFailed => 3,
        }
    }
    fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            0 => Status::Ok,
            1 => Status::UnknownExport,
            2 => Status::LengthMismatch,
            3 => Status::SendFailed,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reply {
    pub(crate) status: Status,
    pub(crate) token: u64,
    pub(crate) length: u64,
}

fn u64_at(b: &[u8], o: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[o..o + 8]);
    u64::from_le_bytes(a)
}

impl Request {
    pub(crate) fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[0..4].copy_from_slice(&REQUEST_MAGIC);
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[8..16].copy_from_slice(&self.token.to_le_bytes());
        b[16..24].copy_from_slice(&self.export_id.to_le_bytes());
        b[24..32].copy_from_slice(&self.length.to_le_bytes());
        b[32..48].copy_from_slice(&self.key);
        b
    }

    pub(crate) fn parse(b: &[u8]) -> Option<Self> {
        if b.len() != REQUEST_LEN
            || b[0..4] != REQUEST_MAGIC
            || b[4..6] != VERSION.to_le_bytes()
            || b[6..8] != [0, 0]
        {
            return None;
        }
        let mut key = [0u8; KEY_LEN];
        key.copy_from_slice(&b[32..48]);
        Some(Request {
            token: u64_at(b, 8),
            export_id: u64_at(b, 16),
            length: u64_at(b, 24),
            key,
        })
    }
}

impl Reply {
    pub(crate) fn encode(&self) -> [u8; REPLY_LEN] {
        let mut b = [0u8; REPLY_LEN];
        b[0..4].copy_from_slice(&REPLY_MAGIC);
        b[4..8].copy_from_slice(&self.status.to_u32().to_le_bytes());
        b[8..16].copy_from_slice(&self.token.to_le_bytes());
        b[16..24].copy_from_slice(&self.length.to_le_bytes());
        b
    }

    pub(crate) fn parse(b: &[u8]) -> Option<Self> {
        if b.len() != REPLY_LEN || b[0..4] != REPLY_MAGIC {
            return None;
        }
        let status = Status::from_u32(u32::from_le_bytes([b[4], b[5], b[6], b[7]]))?;
        Some(Reply {
            status,
            token: u64_at(b, 8),
            length: u64_at(b, 16),
        })
    }
}

/// `len` bytes at `ptr` as a slice, or an empty one for a null or empty header (UCX's
/// header pointer is undefined when its length is 0).
///
/// # Safety
/// A non-null `ptr` with `len > 0` must be readable for `len` bytes for the returned
/// lifetime.
pub(crate) unsafe fn header<'a>(ptr: *const std::ffi::c_void, len: usize) -> &'a [u8] {
    if ptr.is_null() || len == 0 {
        return &[];
    }
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(ptr as *const u8, len) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects() {
        let r = Request { token: 5, export_id: 9, length: 4096, key: [3; KEY_LEN] };
        let e = r.encode();
        assert_eq!(Request::parse(&e), Some(r));
        assert_eq!(Request::parse(&e[..47]), None);
        let mut bad = e;
        bad[0] = b'X';
        assert_eq!(Request::parse(&bad), None);
        let mut bad = e;
        bad[4] = 2;
        assert_eq!(Request::parse(&bad), None);
        let p = Reply { status: Status::UnknownExport, token: 5, length: 0 };
        assert_eq!(Reply::parse(&p.encode()), Some(p));
        let mut bad = p.encode();
        bad[4] = 99;
        assert_eq!(Reply::parse(&bad), None);
        assert_eq!(Reply::parse(&[]), None);
    }
}
