//! The export blob: what an importer needs to ask for one export.
//!
//! Version 2, little-endian, 42-byte header then the worker address:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `TWXB` |
//! | 4 | 2 | version (2) |
//! | 6 | 1 | engine (1 = UCX) |
//! | 7 | 1 | flags (0; no bit defined) |
//! | 8 | 8 | export id (the exporter's name for the export) |
//! | 16 | 8 | length in bytes (1 ..= [`MAX_EXPORT_LEN`]) |
//! | 24 | 16 | the key of the exporter's scope the export lives in |
//! | 40 | 2 | worker address length *w* (1 ..= [`MAX_WORKER_ADDRESS_LEN`]) |
//! | 42 | *w* | the exporter's worker address |
//!
//! The blob must end exactly there. It names no address in the exporter: the importer asks
//! for the export by id and key, and the exporter sends that export's bytes (two-sided).
//! The key is random per scope (one scope per importer connection) and travels only on
//! that connection, so an importer cannot name another connection's exports.
//! [`ExportBlob::decode`] copies the bytes it is given first, then validates the copy, so
//! a peer that still holds the source cannot change a field between check and use.

use crate::error::BlobError;

/// Blob format version written and accepted by this build.
pub const BLOB_VERSION: u16 = 2;
/// Largest storage a blob may describe (1 TiB): a guard against absurd lengths, far above
/// any tensor a host can hold.
pub const MAX_EXPORT_LEN: u64 = 1 << 40;
/// Largest worker address accepted (UCX's are 77–180 bytes over tcp/sm here).
pub const MAX_WORKER_ADDRESS_LEN: usize = 1024;
/// Length of a scope key.
pub const KEY_LEN: usize = 16;

const MAGIC: [u8; 4] = *b"TWXB";
const HEADER_LEN: usize = 42;

/// The bulk-transfer engine a blob was made by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// UCX (an active-message request answered by an active-message send of the export).
    Ucx,
}

impl Engine {
    fn to_byte(self) -> u8 {
        match self {
            Engine::Ucx => 1,
        }
    }

    fn from_byte(b: u8) -> Result<Self, BlobError> {
        match b {
            1 => Ok(Engine::Ucx),
            other => Err(BlobError::UnknownEngine(other)),
        }
    }
}

/// A validated export blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportBlob {
    engine: Engine,
    export_id: u64,
    length: u64,
    key: [u8; KEY_LEN],
    worker_address: Vec<u8>,
}

impl ExportBlob {
    /// Builds a blob from an engine's fields, checking them as `decode` would.
    pub(crate) fn new(
        engine: Engine,
        export_id: u64,
        length: u64,
        key: [u8; KEY_LEN],
        worker_address: Vec<u8>,
    ) -> Result<Self, BlobError> {
        let blob = ExportBlob {
            engine,
            export_id,
            length,
            key,
            worker_address,
        };
        blob.validate()?;
        Ok(blob)
    }

    /// A blob from fields that travelled separately (e.g. as the fields of an RPC value),
    /// checked exactly as [`ExportBlob::decode`] checks an encoded one. Each variable field
    /// is bounds-checked before it is copied.
    pub fn from_parts(
        engine: Engine,
        export_id: u64,
        length: u64,
        key: &[u8],
        worker_address: &[u8],
    ) -> Result<Self, BlobError> {
        let w = worker_address.len();
        if w == 0 || w > MAX_WORKER_ADDRESS_LEN {
            return Err(BlobError::BadWorkerAddress(w));
        }
        let key: [u8; KEY_LEN] = key.try_into().map_err(|_| BlobError::BadKey(key.len()))?;
        ExportBlob::new(engine, export_id, length, key, worker_address.to_vec())
    }

    /// The engine that made the export.
    pub fn engine(&self) -> Engine {
        self.engine
    }
    /// The exporter's id for this export: what the importer asks for and releases.
    pub fn export_id(&self) -> u64 {
        self.export_id
    }
    /// Length of the storage in bytes.
    pub fn length(&self) -> u64 {
        self.length
    }
    /// The key of the exporter's scope the export lives in.
    pub fn key(&self) -> &[u8; KEY_LEN] {
        &self.key
    }
    /// The exporter's worker address (engine-specific bytes).
    pub fn worker_address(&self) -> &[u8] {
        &self.worker_address
    }

    /// Serialises the blob (see the module documentation for the layout).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + self.worker_address.len());
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&BLOB_VERSION.to_le_bytes());
        out.push(self.engine.to_byte());
        out.push(0);
        out.extend_from_slice(&self.export_id.to_le_bytes());
        out.extend_from_slice(&self.length.to_le_bytes());
        out.extend_from_slice(&self.key);
        // Fits: `validate` bounds it far below u16::MAX.
        out.extend_from_slice(&(self.worker_address.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.worker_address);
        out
    }

    /// Copies `bytes`, then parses and validates the copy. Every rejection is a named
    /// [`BlobError`].
    pub fn decode(bytes: &[u8]) -> Result<Self, BlobError> {
        let copy = bytes.to_vec();
        let b = copy.as_slice();
        if b.len() < HEADER_LEN {
            return Err(BlobError::Truncated {
                needed: HEADER_LEN,
                got: b.len(),
            });
        }
        if b[0..4] != MAGIC {
            return Err(BlobError::BadMagic);
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != BLOB_VERSION {
            return Err(BlobError::UnsupportedVersion(version));
        }
        let engine = Engine::from_byte(b[6])?;
        if b[7] != 0 {
            return Err(BlobError::UnknownFlags(b[7]));
        }
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(a)
        };
        let export_id = u64_at(8);
        let length = u64_at(16);
        let mut key = [0u8; KEY_LEN];
        key.copy_from_slice(&b[24..40]);
        let w = u16::from_le_bytes([b[40], b[41]]) as usize;
        let needed = HEADER_LEN + w;
        if b.len() < needed {
            return Err(BlobError::Truncated {
                needed,
                got: b.len(),
            });
        }
        if b.len() > needed {
            return Err(BlobError::TrailingBytes {
                extra: b.len() - needed,
            });
        }
        ExportBlob::new(engine, export_id, length, key, b[HEADER_LEN..needed].to_vec())
    }

    fn validate(&self) -> Result<(), BlobError> {
        if self.length == 0 || self.length > MAX_EXPORT_LEN {
            return Err(BlobError::BadLength(self.length));
        }
        let w = self.worker_address.len();
        if w == 0 || w > MAX_WORKER_ADDRESS_LEN {
            return Err(BlobError::BadWorkerAddress(w));
        }
        match self.engine {
            Engine::Ucx => {
                // UCX aborts (`ucs_assertv_always`) on an address whose low nibble is not a
                // version it knows: `UCP_OBJECT_VERSION_V1` (0, the default) or `_V2` (1).
                if self.worker_address[0] & 0x0f > 1 {
                    return Err(BlobError::BadWorkerAddress(w));
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ExportBlob {
        ExportBlob::new(Engine::Ucx, 7, 4096, [0x5a; KEY_LEN], vec![0x11; 100]).unwrap()
    }

    #[test]
    fn round_trip() {
        let b = sample();
        assert_eq!(ExportBlob::decode(&b.encode()).unwrap(), b);
    }

    #[test]
    fn from_parts_checks_as_decode_does() {
        let b = sample();
        let parts =
            |wa: &[u8], key: &[u8], len: u64| ExportBlob::from_parts(Engine::Ucx, 7, len, key, wa);
        assert_eq!(parts(b.worker_address(), b.key(), 4096), Ok(b.clone()));
        assert_eq!(parts(&[], b.key(), 4096), Err(BlobError::BadWorkerAddress(0)));
        assert_eq!(
            parts(&[0x11; 2000], b.key(), 4096),
            Err(BlobError::BadWorkerAddress(2000))
        );
        assert_eq!(
            parts(&[0x1f; 100], b.key(), 4096),
            Err(BlobError::BadWorkerAddress(100))
        );
        assert_eq!(parts(b.worker_address(), &[0; 15], 4096), Err(BlobError::BadKey(15)));
        assert_eq!(parts(b.worker_address(), &[0; 300], 4096), Err(BlobError::BadKey(300)));
        assert_eq!(parts(b.worker_address(), b.key(), 0), Err(BlobError::BadLength(0)));
        assert_eq!(
            parts(b.worker_address(), b.key(), MAX_EXPORT_LEN + 1),
            Err(BlobError::BadLength(MAX_EXPORT_LEN + 1))
        );
    }

    #[test]
    fn every_truncation_is_named() {
        let bytes = sample().encode();
        for n in 0..bytes.len() {
            assert!(
                matches!(
                    ExportBlob::decode(&bytes[..n]),
                    Err(BlobError::Truncated { .. })
                ),
                "prefix {n}"
            );
        }
    }

    #[test]
    fn header_fields_are_checked() {
        let good = sample().encode();
        let with = |o: usize, v: &[u8]| {
            let mut b = good.clone();
            b[o..o + v.len()].copy_from_slice(v);
            ExportBlob::decode(&b)
        };
        assert_eq!(with(0, b"XXXX"), Err(BlobError::BadMagic));
        assert_eq!(
            with(4, &1u16.to_le_bytes()),
            Err(BlobError::UnsupportedVersion(1))
        );
        assert_eq!(with(6, &[9]), Err(BlobError::UnknownEngine(9)));
        assert_eq!(with(7, &[1]), Err(BlobError::UnknownFlags(1)));
        assert_eq!(with(16, &0u64.to_le_bytes()), Err(BlobError::BadLength(0)));
        assert_eq!(
            with(16, &u64::MAX.to_le_bytes()),
            Err(BlobError::BadLength(u64::MAX))
        );
        let mut long = good.clone();
        long.push(0);
        assert_eq!(
            ExportBlob::decode(&long),
            Err(BlobError::TrailingBytes { extra: 1 })
        );
    }
}
